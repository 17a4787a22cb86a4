"""Compile report of the fused GPU kernels (issue 40): every kernel at every argument signature the engines launch
compiles for sm_80 and sm_90 without a GPU, with no spills and within gpuc._testing.kernel_report.BOUNDS (registers
and local memory per thread).

The whole report needs numba-cuda with the CUDA compiler wheels (libNVVM, nvJitLink), which the GPU extras bring:
run it in a venv with ``pip install -e '.[gpu-cu12,test]'`` (or ``gpu-cu13``), as ``.ci/compile_kernels`` does. In an
environment without them (CI's '.[test,doc,dask,lint]' venv: numba-cuda without NVRTC/libNVVM) it is skipped with
the reason. The bookkeeping tests below run everywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpuc._testing import kernel_report as kr


def test_every_fused_kernel_has_a_bound():
    kernels = kr.all_kernels()
    assert len(kernels) == 16, kernels
    assert sorted(kr.BOUNDS) == kernels


def test_check_bounds_reports_spills_registers_local_memory_and_missing_kernels():
    row = {"kernel": "gpuc.nmf._kernels_gpu.step", "signature": "s", "target": "sm_90"}
    ok = {**row, "registers": 40, "local_bytes": 0, "spill_stores": 0, "spill_loads": 0}
    assert kr.check_bounds({"rows": [ok]}) == []
    bad = [
        {**ok, "registers": 129},
        {**ok, "local_bytes": 8},
        {**ok, "spill_stores": 16},
        {**ok, "kernel": "gpuc.nmf._kernels_gpu.unknown"},
    ]
    problems = kr.check_bounds({"rows": bad, "missing": ["gpuc.nmf._kernels_gpu.restore"]})
    assert len(problems) == 5, problems
    for text in ("129 registers > 128", "8 bytes of local memory > 0", "spills 16 B", "no bound", "never launched"):
        assert any(text in p for p in problems), (text, problems)


def test_resources_are_read_from_the_assemblers_report():
    log = (
        "ptxas info    : Compiling entry function '_Z4step' for 'sm_90'\n"
        "ptxas         .     48 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 72 registers, used 0 barriers\n"
    )
    assert kr._PTXAS_REGS.search(log).group(1) == "72"
    assert kr._PTXAS_FRAME.search(log).groups() == ("48", "8", "4")


@pytest.mark.slow
def test_every_kernel_and_signature_compiles_for_sm80_and_sm90_within_bounds(tmp_path):
    """The report, in a fresh process with the CUDA simulator off (the test session runs with it on)."""
    out = tmp_path / "report.json"
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    cmd = [sys.executable, "-m", "gpuc._testing.kernel_report", "--out", str(out)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if run.returncode == 2:  # the toolchain is missing: not the kernels' fault
        pytest.skip(f"{run.stderr.strip()}; run in a venv with '.[gpu-cu12,test]' (.ci/compile_kernels)")
    assert out.exists(), run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {r["target"] for r in report["rows"]} == {"sm_80", "sm_90"}
    assert {r["kernel"] for r in report["rows"]} == set(kr.all_kernels())
    assert report["problems"] == [], "\n".join(report["problems"])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
