"""The guard on gpuc's fused GPU kernels (gpuc._backend.fused_kernels_status): numba-cuda that imports but cannot
compile (numba-cuda 0.30 with numpy 2.5, where its compiler's import fails on ``np.row_stack``; or no libNVVM)
switches every engine to its CuPy array code, with one warning naming the versions and the fix. The failure is
simulated; the engines run on the stand-in device, where the kernels otherwise run under the CUDA simulator."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.sparse as sp

from gpuc import _backend
from gpuc._backend import FusedKernelsWarning, fused_kernels_status, fused_kernels_usable, get_backend
from gpuc._testing.standin import counting, simulator_status, standin_backend

CPU = get_backend("cpu")
ROW_STACK = "module 'numpy' has no attribute 'row_stack'"


@pytest.fixture(autouse=True)
def _fresh_probe():
    fused_kernels_status.cache_clear()
    yield
    fused_kernels_status.cache_clear()


@pytest.fixture
def broken_compiler(monkeypatch):
    """numba-cuda importable, its compiler failing as numba-cuda 0.30's does under numpy 2.5."""
    monkeypatch.setattr(
        _backend, "_probe_cuda_compiler", lambda: f"numba-cuda cannot compile a kernel (AttributeError: {ROW_STACK})"
    )
    fused_kernels_status.cache_clear()
    with pytest.warns(FusedKernelsWarning):
        assert not fused_kernels_usable()


@pytest.fixture
def fused_then_plain(request):
    """``fused, plain = fused_then_plain(fit)``: ``fit()`` (on the stand-in GPU) run with the fused kernels, checked to
    have launched them, then with the compiler broken, checked to have run the array code alone."""

    def run_both(fit):
        def run():
            with counting() as c:
                res = fit()
            return res, [name for name in c.by_name if name.startswith("kernel.")]

        fused, fused_kernels = run()
        assert fused_kernels  # the kernels ran
        request.getfixturevalue("broken_compiler")
        plain, plain_kernels = run()
        assert not plain_kernels  # the array code ran
        return fused, plain

    return run_both


def test_a_compiler_that_imports_but_cannot_compile_turns_the_kernels_off_with_one_warning(monkeypatch):
    """The probe itself, outside the simulator, with numba-cuda's compile failing as under numpy 2.5."""
    numba = pytest.importorskip("numba")
    from numba import cuda

    def compile_ptx(*args, **kwargs):
        raise AttributeError(ROW_STACK)

    monkeypatch.setattr(numba.config, "ENABLE_CUDASIM", 0)
    monkeypatch.setattr(cuda, "compile_ptx", compile_ptx, raising=False)
    monkeypatch.setattr(cuda, "compile_ptx_for_current_device", compile_ptx, raising=False)
    with pytest.warns(FusedKernelsWarning) as rec:
        ok, msg = fused_kernels_status()
    assert not ok
    assert len(rec) == 1
    text = str(rec[0].message)
    assert "row_stack" in text and "numba-cuda " in text and "numpy " in text  # the cause and the versions
    assert "pip install -U numba-cuda" in text and "numpy<2.5" in text  # what to install
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # probed once per process: no second probe, no second warning
        assert not fused_kernels_usable()
        assert fused_kernels_status() == (ok, msg)


def test_the_simulator_needs_no_compiler():
    if not simulator_status()[0]:
        pytest.skip(simulator_status()[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fused_kernels_usable()


needs_simulator = pytest.mark.skipif(not simulator_status()[0], reason=simulator_status()[1])


@pytest.mark.slow
@needs_simulator
@pytest.mark.filterwarnings("ignore::gpuc.metacells.MetacellConvergenceWarning")
def test_metacells_run_the_array_code_and_give_the_same_fit(fused_then_plain):
    import scanpy as sc

    from gpuc.metacells import build_kernel, compute_knn, fit, initial_archetypes

    x = np.ascontiguousarray(np.asarray(sc.datasets.pbmc68k_reduced().obsm["X_pca"])[:120], dtype=np.float64)
    knn = compute_knn(CPU, x, 10)
    mmat, _ = build_kernel(CPU, x, knn=knn)
    arche = np.asarray(initial_archetypes(CPU, sp.csr_matrix(mmat @ mmat.T), knn, 4, np.random.RandomState(0)))
    gpu = standin_backend()

    fused, plain = fused_then_plain(lambda: fit(gpu, gpu.asarray(mmat), arche, max_iter=2, min_iter=2, fw_iters=6))
    for name in ("A", "B"):
        np.testing.assert_array_equal(
            gpu.to_host(getattr(plain, name)).toarray(), gpu.to_host(getattr(fused, name)).toarray()
        )
    np.testing.assert_allclose(plain.rss, fused.rss, rtol=1e-12)


# The NMF and DESeq2 engines choose their kernels in gpuc.nmf._kernels_gpu.usable and gpuc.deseq._kernels.gpu_kernels,
# each asking gpuc._backend.fused_kernels_usable().
@needs_simulator
def test_nmf_runs_the_array_code_and_gives_the_same_factors(fused_then_plain):
    from gpuc._utils import derive_seed
    from gpuc.nmf._hals import Operator, fit_hals_groups

    rng = np.random.default_rng(0)
    v = sp.csr_matrix(rng.poisson(1.0, (40, 30)).astype(np.float64) + (rng.random((40, 30)) < 0.05))
    groups = [(k, [derive_seed(3, k, r) for r in range(2)]) for k in (2, 3)]
    gpu = standin_backend()

    fused, plain = fused_then_plain(
        lambda: fit_hals_groups(gpu, Operator.build(gpu, gpu.asarray(v), dtype=np.float64), groups, max_iter=20)
    )
    for rf, rp in zip(fused, plain, strict=True):
        np.testing.assert_allclose(rp.losses, rf.losses, rtol=1e-10)
        np.testing.assert_allclose(rp.usages.get(), rf.usages.get(), rtol=0, atol=1e-10 * np.abs(rf.usages.get()).max())


@needs_simulator
def test_deseq_runs_the_array_code_and_gives_the_same_fit(fused_then_plain):
    from gpuc.deseq._glm import fit_nb_glm

    rng = np.random.default_rng(7)
    n = 8
    x = np.column_stack([np.ones(n), np.repeat([0.0, 1.0], n // 2)])
    mu = np.exp(rng.normal(2, 1.5, (30, 1)) + rng.normal(0, 0.3, (30, n)))
    y = rng.negative_binomial(4, 4 / (4 + mu)).astype(float)
    sf = np.exp(rng.normal(0, 0.2, n))
    alpha = np.exp(rng.uniform(np.log(1e-3), np.log(2), y.shape[0]))
    gpu = standin_backend()

    fused, plain = fused_then_plain(
        lambda: fit_nb_glm(gpu, gpu.asarray(y), gpu.asarray(sf), gpu.asarray(x), gpu.asarray(alpha))
    )
    for f in ("beta", "deviance", "mu"):
        np.testing.assert_allclose(getattr(plain, f).get(), getattr(fused, f).get(), rtol=1e-6, atol=1e-9, err_msg=f)


def test_gpuc_info_says_whether_the_fused_kernels_are_on_and_require_fused_fails_when_off(broken_compiler, capsys):
    from gpuc.cli import info, main

    text = info()
    assert "fused GPU kernels: OFF" in text and "row_stack" in text and "numpy<2.5" in text
    assert main(["info", "--require-fused"]) == 3
    assert "fused GPU kernels are off" in capsys.readouterr().err


def test_gpuc_info_reports_the_fused_kernels_on(monkeypatch):
    from gpuc.cli import info, main

    monkeypatch.setattr(_backend, "_probe_cuda_compiler", lambda: None)
    fused_kernels_status.cache_clear()
    assert "fused GPU kernels: on (numba-cuda compiles kernels" in info()
    assert main(["info", "--require-fused"]) == 0
