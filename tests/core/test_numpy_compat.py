"""gpuc._numpy_compat: numpy 2.5 removed ``np.row_stack``, which numba-cuda 0.30 names while its compiler loads, so
no kernel compiled (issue 40). The shim restores the name when numpy lacks it and numba-cuda is installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

from gpuc import _numpy_compat


@pytest.fixture
def numpy_without_row_stack(monkeypatch):
    """numpy as 2.5 ships it: no ``row_stack``."""
    monkeypatch.delattr(np, "row_stack", raising=False)


def test_the_shim_restores_row_stack_as_vstack_when_numba_cuda_is_installed(numpy_without_row_stack, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "numba_cuda" else None)
    assert not hasattr(np, "row_stack")
    assert _numpy_compat.restore_row_stack()
    assert _numpy_compat.row_stack_shimmed()
    assert np.__dict__["row_stack"] is not np.vstack  # numba-cuda's overload attaches to the shim, not to vstack
    a, b = np.arange(3.0), np.ones(3, dtype=np.float32)
    np.testing.assert_array_equal(np.__dict__["row_stack"]((a, b)), np.vstack((a, b)))
    assert np.__dict__["row_stack"]((a, b), dtype=np.float32).dtype == np.float32
    assert _numpy_compat.restore_row_stack()  # idempotent


def test_the_shim_leaves_numpy_alone_without_numba_cuda(numpy_without_row_stack, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert not _numpy_compat.restore_row_stack()
    assert not hasattr(np, "row_stack")


def test_a_numpy_that_has_row_stack_keeps_its_own(monkeypatch):
    own = object()
    monkeypatch.setattr(np, "row_stack", own, raising=False)
    assert not _numpy_compat.restore_row_stack()
    assert np.__dict__["row_stack"] is own


COMPILE_AFTER_NUMPY_25 = """
import json, numpy as np
if hasattr(np, "row_stack"):  # make this numpy look like 2.5 before anything imports numba-cuda's compiler
    del np.row_stack
import gpuc  # the shim comes with gpuc
from numba import cuda, types
from gpuc._numpy_compat import row_stack_shimmed

def kernel(x):
    x[0] = x[0] * 2.0 + 1.0

ptx, _ = cuda.compile_ptx(kernel, (types.float64[::1],), cc=(8, 0))
print(json.dumps({"shimmed": row_stack_shimmed(), "ptx": ".target sm_80" in ptx}))
"""


@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="numba-cuda is not installed")
def test_numba_cuda_compiles_after_import_gpuc_without_row_stack(compile_outside_simulator):
    """The failure of issue 40, end to end in a fresh process: numpy without ``row_stack``, ``import gpuc``, then
    ``cuda.compile_ptx``. Needs libNVVM (the GPU extras' CUDA wheels), not a GPU; skipped without it."""
    assert compile_outside_simulator(COMPILE_AFTER_NUMPY_25) == {"shimmed": True, "ptx": True}


def test_import_gpuc_does_not_touch_numpy_that_has_row_stack():
    code = (
        "import numpy as np; own = np.__dict__.get('row_stack'); import gpuc; "
        "print(own is None or np.__dict__.get('row_stack') is own)"  # numpy < 2.5: its own row_stack stays
    )
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "True"
