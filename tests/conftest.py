"""Shared test configuration: the ``gpu`` mark skips without a usable CUDA device; ``shared_data`` locates ../shared;
``unchanged`` and ``same`` are the one deep AnnData comparison every test uses (test modules import nothing from each
other: shared helpers are fixtures here or in a folder's conftest.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def _cuda_device_present() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


# Without a GPU, gpuc's custom kernels (numba-cuda) run on the stand-in device under numba-cuda's CUDA simulator. The
# switch is read when numba is first imported (importing gpuc may import it), so it is set before gpuc is imported.
if not _cuda_device_present():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    # a pytest plugin may have imported numba already (fast_array_utils' does, with anndata >= 0.13 on Python 3.12):
    # numba then reads the switch again; numba.cuda, which chooses the simulator when imported, comes later
    if "numba" in sys.modules:
        sys.modules["numba"].config.reload_config()

from gpuc._backend import gpu_status  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEST_DATA = ROOT / "tests" / "data"
SHARED_DATA = ROOT.parent / "shared" / "data"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ok, reason = gpu_status()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"no usable GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def test_data() -> Path:
    """Folder of the small fixtures shipped with the tests."""
    return TEST_DATA


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` next to the checkout; tests using it skip when it is absent (e.g. a bare clone)."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _quiet_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuc._settings import settings

    monkeypatch.setattr(settings, "progress", False)


# ---- one deep AnnData comparison for every test: "unchanged on error" and "survives write_h5ad" ---------------------
def assert_same(got: object, want: object, path: str = "adata") -> None:
    """Recursive equality of AnnData contents: frames, dense/sparse arrays, mappings, sequences and scalars.

    A sequence read back from h5ad may come back as an array, so sequences are compared as arrays; NaN equals NaN.
    """
    import numpy as np
    import pandas as pd
    import scipy.sparse as sp
    from anndata import AnnData

    if isinstance(want, AnnData):
        assert isinstance(got, AnnData), f"{path}: {type(got).__name__} is not an AnnData"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        for slot in ("X", "obs", "var", "layers", "obsm", "varm", "obsp", "varp", "uns"):
            assert_same(getattr(got, slot), getattr(want, slot), f"{path}.{slot}")
        return
    if isinstance(want, pd.DataFrame):
        pd.testing.assert_frame_equal(got, want, obj=path)
        return
    if hasattr(want, "keys") and not isinstance(want, pd.Series):
        assert set(got.keys()) == set(want.keys()), f"{path}: keys {sorted(got.keys())} != {sorted(want.keys())}"
        for k in want.keys():
            assert_same(got[k], want[k], f"{path}[{k!r}]")
        return
    if sp.issparse(want):
        assert sp.issparse(got), f"{path}: not sparse"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        g, w = sp.csr_matrix(got, copy=True), sp.csr_matrix(want, copy=True)  # canonical form; NaN equals NaN
        for m in (g, w):
            m.sum_duplicates()
            m.eliminate_zeros()
        np.testing.assert_array_equal(g.indptr, w.indptr, err_msg=f"{path}: sparse pattern differs")
        np.testing.assert_array_equal(g.indices, w.indices, err_msg=f"{path}: sparse pattern differs")
        np.testing.assert_array_equal(g.data, w.data, err_msg=f"{path}: sparse values differ")
        return
    if want is None:
        assert got is None, f"{path}: {got!r} is not None"
        return
    if isinstance(want, str | bytes):
        assert got == want, f"{path}: {got!r} != {want!r}"
        return
    if isinstance(want, pd.Series | pd.Index):
        want, got = np.asarray(want), np.asarray(got)
    w, g = np.asarray(want), np.asarray(got)
    assert g.shape == w.shape, f"{path}: shape {g.shape} != {w.shape}"
    if w.dtype.kind in "fc":
        np.testing.assert_array_equal(g, w, err_msg=path)
    else:
        assert (g == w).all(), f"{path}: {got!r} != {want!r}"


@pytest.fixture
def unchanged():
    """Context manager: ``with unchanged(adata), pytest.raises(...):`` asserts the call left ``adata`` as it was."""
    from contextlib import contextmanager

    @contextmanager
    def check(adata):
        before = adata.copy()
        yield
        assert_same(adata, before)
        for slot in ("layers", "obsm", "varm", "obsp", "varp", "uns"):  # nothing re-inserted in another order either
            got, want = list(getattr(adata, slot).keys()), list(getattr(before, slot).keys())
            assert got == want, f"adata.{slot}: key order {got} != {want}"

    return check


@pytest.fixture
def same():
    """:func:`assert_same` as a fixture, for tests that compare AnnData contents (e.g. after a round trip)."""
    return assert_same


@pytest.fixture
def disable_numba(monkeypatch):
    """Call it to run the rest of the test on the engines' array code instead of the numba CPU kernels
    (``gpuc.settings.numba = False``, the one switch, restored after the test).
    """
    from gpuc._settings import settings

    return lambda: monkeypatch.setattr(settings, "numba", False)


# ---- the stand-in GPU: CPU CI runs the GPU code path on device arrays that refuse implicit host conversion ---------
@pytest.fixture
def standin_gpu():
    """Within the test, ``device="gpu"`` (and device-resident input) resolve to :mod:`gpuc._testing.standin`.

    Yields the stand-in :class:`gpuc._backend.Backend`; upload with ``standin_gpu.asarray(x)``.
    """
    from gpuc._testing.standin import use_standin

    with use_standin() as bk:
        yield bk


@pytest.fixture
def on_device(standin_gpu):
    """``on_device(adata)``: a copy of ``adata`` with ``X``, layers and ``obsm`` arrays on the stand-in GPU, as
    ``rapids_singlecell.get.anndata_to_GPU`` would leave them (needs AnnData to accept the stand-in: no CuPy)."""
    from gpuc._testing.standin import ANNDATA_ACCEPTS

    if not ANNDATA_ACCEPTS:
        pytest.skip("CuPy is installed: AnnData accepts only real CuPy arrays (the GPU tests cover this)")

    def move(adata, *, layers=True, obsm=True):
        out = adata.copy()
        if out.X is not None:
            out.X = standin_gpu.asarray(out.X)
        if layers:
            for k in list(out.layers):
                out.layers[k] = standin_gpu.asarray(out.layers[k])
        if obsm:
            for k in list(out.obsm):
                if not hasattr(out.obsm[k], "columns"):
                    out.obsm[k] = standin_gpu.asarray(out.obsm[k])
        return out

    return move


def _planted_programs(n_cells: int, n_genes: int, k: int = 3, seed: int = 0):
    """Poisson counts (sparse float32) from ``k`` planted programmes, every gene flagged highly variable."""
    import anndata as ad
    import numpy as np
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    spectra = np.full((k, n_genes), 0.05)
    for j, block in enumerate(np.array_split(np.arange(n_genes), k)):
        spectra[j, block] = rng.uniform(2, 6, block.size)
    usage = rng.dirichlet(np.full(k, 0.3), n_cells) * rng.uniform(20, 40, (n_cells, 1))
    a = ad.AnnData(sp.csr_matrix(rng.poisson(usage @ spectra).astype(np.float32)))
    a.var_names = [f"g{j}" for j in range(n_genes)]
    a.var["highly_variable"] = True
    return a


@pytest.fixture
def planted_programs():
    """``planted_programs(n_cells, n_genes, k=3, seed=0)``: small counts with planted NMF programmes."""
    return _planted_programs


@pytest.fixture
def wide_design():
    """``wide_design(n, levels, n_genes, seed=0)``: n samples of negative binomial counts in ``levels`` groups
    (``obs["f"]``), so that ``"~f"`` is a design of ``levels`` columns (intercept + levels - 1)."""
    import anndata as ad
    import numpy as np
    import pandas as pd

    def make(n: int, levels: int, n_genes: int, seed: int = 0) -> ad.AnnData:
        rng = np.random.default_rng(seed)
        mean = 2 ** rng.normal(5, 2, n_genes)
        counts = rng.negative_binomial(5, 5 / (5 + mean[None, :] * np.ones((n, 1)))).astype(np.int64)
        counts[:, 0] += 1
        a = ad.AnnData(counts)
        a.obs["f"] = pd.Categorical([f"l{x:02d}" for x in np.arange(n) % levels])
        return a

    return make


@pytest.fixture
def traced_peak():
    """``traced_peak(fn, *args, **kwargs)``: the tracemalloc peak of the call above what was allocated before it
    (its warnings ignored)."""
    import tracemalloc
    import warnings

    def peak(fn, *args, **kwargs) -> int:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                fn(*args, **kwargs)
                return tracemalloc.get_traced_memory()[1] - base
            finally:
                tracemalloc.stop()

    return peak


# ---- a terminal that records what the progress bars draw --------------------------------------------------------------
@pytest.fixture
def tty_stderr(monkeypatch: pytest.MonkeyPatch):
    """Call it in the test (pytest sets its own stderr again between a fixture and the test): bars switched on,
    Scanpy's default verbosity, and ``sys.stderr`` a terminal (``isatty()`` is true) that records what is written;
    the call returns that terminal, an :class:`io.StringIO` with a ``lines()`` method."""
    import io

    import scanpy as sc

    from gpuc._settings import settings

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

        def lines(self) -> list[str]:
            """The non-blank lines written, each state of a bar (redrawn after ``\\r``) a line of its own."""
            return [line for line in self.getvalue().replace("\r", "\n").split("\n") if line.strip()]

    def patch() -> Terminal:
        out = Terminal()
        monkeypatch.setattr(sys, "stderr", out)
        return out

    monkeypatch.setattr(settings, "progress", True)
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    verbosity = sc.settings.verbosity
    sc.settings.verbosity = 1  # Scanpy's default (warning)
    try:
        yield patch
    finally:
        sc.settings.verbosity = verbosity


# ---- numba-cuda outside the simulator -------------------------------------------------------------------------------
@pytest.fixture
def compile_outside_simulator():
    """``compile_outside_simulator(script)``: run the Python ``script`` in a fresh process with the CUDA simulator off
    (e.g. to compile kernels to PTX) and return the JSON its last line prints. Skips the test where the CUDA compiler
    cannot run; fails it, with the script's stderr, where the script fails otherwise."""
    import json
    import subprocess

    # no CUDA compiler libraries: the toolchain's, not the kernels'. (numba-cuda 0.30's failure under numpy 2.5,
    # "module 'numpy' has no attribute 'row_stack'", is not skipped: gpuc._numpy_compat fixes it, and a test fails if
    # it comes back.)
    missing = ("DynamicLibNotFoundError", "NvvmSupportError", "libnvvm", "libNVVM", "nvrtc", "CudaSupportError")

    def run(script: str):
        env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0 and any(m in out.stderr for m in missing):
            pytest.skip(f"the CUDA compiler cannot run here: {out.stderr.strip().splitlines()[-1]}")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    return run


# ---- a real dask.distributed cluster ----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def local_cluster():
    """``with local_cluster(n_workers) as client:`` a dask.distributed LocalCluster of worker processes with one thread
    each (as CI runs them) and a client that is not made the default, both closed on leaving; keyword arguments go
    to ``LocalCluster``. Skips without distributed."""
    from contextlib import contextmanager

    distributed = pytest.importorskip("distributed")

    @contextmanager
    def start(n_workers: int = 1, **kwargs):
        opts = {"threads_per_worker": 1, "processes": True, "dashboard_address": ":0", **kwargs}
        with (
            distributed.LocalCluster(n_workers=n_workers, **opts) as cluster,
            distributed.Client(cluster, set_as_default=False) as client,
        ):
            yield client

    return start


@pytest.fixture
def kill_busy_worker():
    """``with kill_busy_worker(client, settle=0.3):`` SIGKILL the first worker process of ``client`` seen running a
    task (``settle`` seconds later, to let the task get going; polled every ``poll`` seconds, for at most a minute)
    while the block runs; on leaving, fail the test if no worker was killed (the failure was not exercised)."""
    import signal
    import threading
    import time
    from contextlib import contextmanager

    @contextmanager
    def kill(client, *, settle: float = 0.0, poll: float = 0.05):
        pids = client.run(os.getpid)
        killed = []
        done = threading.Event()

        def kill_when_busy():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not killed and not done.is_set():
                busy = [w for w, tasks in client.processing().items() if tasks]
                if busy:
                    time.sleep(settle)
                    os.kill(pids[busy[0]], signal.SIGKILL)
                    killed.append(busy[0])
                time.sleep(poll)

        killer = threading.Thread(target=kill_when_busy)
        killer.start()
        try:
            yield
        finally:
            done.set()
            killer.join()
        assert killed, "no worker was killed: the test did not exercise the failure"

    return kill
