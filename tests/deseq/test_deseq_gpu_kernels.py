"""The numba-cuda kernels of the DESeq2 solvers (gpuc.deseq._kernels_gpu) on the stand-in GPU, under numba-cuda's CUDA
simulator: the same answers as the CPU kernels, a launch budget per iteration that does not grow with the genes or the
samples, and GPU path = CPU path where the dispersion trend falls back to the local fit.

The simulator runs a Python thread per CUDA thread, so the sets are small (a few dozen genes).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from gpuc._backend import get_backend
from gpuc._testing.simulated import near_poisson_counts
from gpuc._testing.standin import counting, simulator_status, standin_backend
from gpuc.deseq import _kernels
from gpuc.deseq._dispersion import _fitdisp_grid, fit_log_alpha
from gpuc.deseq._glm import _fit_nb_glm, fit_nb_glm

pytestmark = pytest.mark.skipif(not simulator_status()[0], reason=simulator_status()[1])


@pytest.fixture
def sb():
    return standin_backend()


def _up(bk, d):
    return {k: bk.asarray(v) if isinstance(v, np.ndarray) else v for k, v in d.items()}


def _problem(G: int, n: int, seed: int) -> tuple[np.ndarray, ...]:
    """Integer NB counts of G genes with a 3-column design, their means (floored at 0.5) and size factors."""
    rng = np.random.default_rng(seed)
    x = np.column_stack([np.ones(n), np.repeat([0.0, 1.0], [n // 2, n - n // 2]), rng.normal(size=n)])
    mu = np.exp(rng.normal(2, 2.5, (G, 1)) + rng.normal(0, 0.3, (G, n)))
    y = rng.negative_binomial(4, 4 / (4 + mu)).astype(float)
    y[:2] = 0.0  # nothing to fit: flat at the minimum dispersion
    y[2:4, 0] = 1.0  # a single count
    y[4, :] = 200.0 + np.arange(n)  # counts above the recurrence tables (asymptotic series)
    sf = np.exp(rng.normal(0, 0.2, n))
    return x, np.maximum(mu, 0.5), y, sf


def test_kernel_module_imports_and_is_chosen_on_the_standin(sb):
    from gpuc.deseq import _kernels_gpu

    assert _kernels.gpu_kernels(sb, 3) is _kernels_gpu
    assert _kernels.gpu_kernels(sb, _kernels_gpu.MAXP + 1) is None  # wide designs: batched CuPy path
    assert _kernels.gpu_kernels(get_backend("cpu"), 3) is None
    for name in ("nb_const", "irls", "fit_disp", "fit_disp_grid"):
        assert hasattr(getattr(_kernels_gpu, name), "py_func") or callable(getattr(_kernels_gpu, name))


def test_kernel_module_imports_without_a_gpu_or_the_simulator():
    """A fresh process without a GPU and without the simulator imports the kernels (compiled lazily, on first launch)
    and the GPU path does not pick them for the stand-in there."""
    import os
    import subprocess
    import sys

    code = (
        "import gpuc.deseq._kernels_gpu as k; from gpuc.deseq._kernels import gpu_kernels; "
        "from gpuc._testing.standin import standin_backend; "
        "print(type(k.irls).__name__, gpu_kernels(standin_backend(), 3))"
    )
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["CUDADispatcher", "None"], out.stdout + out.stderr


@pytest.mark.parametrize("prior", [False, True])
def test_fitdisp_kernel_equals_cpu_kernel(sb, prior):
    """R's line search (fitDisp) and R's rules on the GPU kernel: the same proposals, estimates and log posteriors as
    the CPU kernel (one source, gpuc.deseq._fitdisp)."""
    x, mu, y, _ = _problem(40, 8, 5)
    rng = np.random.default_rng(1)
    a0 = np.exp(rng.uniform(np.log(1e-6), np.log(5), y.shape[0]))
    kw = {"min_disp": 1e-8, "max_disp": 12.0}
    if prior:
        kw |= {"prior_mean": rng.normal(-2, 1, y.shape[0]), "prior_var": 0.6}
    ref = fit_log_alpha(get_backend("cpu"), y, mu, x, a0, **kw)
    with counting() as c:
        got = fit_log_alpha(sb, sb.asarray(y), sb.asarray(mu), sb.asarray(x), sb.asarray(a0), **_up(sb, kw))
    assert c.by_name["kernel.fit_disp"] == 1, c.top()
    np.testing.assert_array_equal(got.iters.get(), ref.iters)
    np.testing.assert_array_equal(got.converged.get(), ref.converged)
    np.testing.assert_allclose(got.alpha.get(), ref.alpha, rtol=1e-12)
    for a, b in zip(got.state, ref.state, strict=True):
        np.testing.assert_allclose(a.get(), b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("prior", [False, True])
def test_grid_kernel_equals_cpu(sb, prior):
    x, mu, y, _ = _problem(24, 6, 6)
    pm = np.random.default_rng(2).normal(-2, 1, y.shape[0]) if prior else None
    args = (0.6 if prior else 1.0, prior, True, math.log(1e-8), math.log(10.0), 20)
    ref = _fitdisp_grid(get_backend("cpu"), y, mu, x, pm, *args)
    with counting() as c:
        got = _fitdisp_grid(
            sb, sb.asarray(y), sb.asarray(mu), sb.asarray(x), None if pm is None else sb.asarray(pm), *args
        )
    assert c.by_name["kernel.fit_disp_grid"] == 1, c.top()
    np.testing.assert_allclose(got.get(), ref, rtol=1e-12, atol=1e-12)


def test_irls_kernel_equals_cpu_kernel(sb):
    x, mu, y, sf = _problem(40, 8, 7)
    rng = np.random.default_rng(3)
    y = rng.negative_binomial(4, 4 / (4 + sf * mu)).astype(float)
    y[0] = 0.0
    y[0, -1] = 5.0  # all zero but one sample
    y[1, : y.shape[1] // 2] = 0.0  # all zero in one group: diverges, refitted by the fallback
    alpha = np.exp(rng.uniform(np.log(1e-3), np.log(2), y.shape[0]))
    ref = fit_nb_glm(get_backend("cpu"), y, sf, x, alpha)
    with counting() as c:
        got = fit_nb_glm(sb, sb.asarray(y), sb.asarray(sf), sb.asarray(x), sb.asarray(alpha))
    assert c.by_name["kernel.irls"] == 1 and c.by_name["kernel.nb_const"] == 1, c.top()
    for f in ("iters", "converged", "refit"):
        np.testing.assert_array_equal(getattr(got, f).get(), getattr(ref, f), err_msg=f)
    for f in ("beta", "deviance", "cov", "hat", "mu"):
        np.testing.assert_allclose(getattr(got, f).get(), getattr(ref, f), rtol=1e-10, atol=1e-12, err_msg=f)


def test_nb_const_kernel_equals_cpu_kernel(sb):
    from gpuc.deseq import _kernels_gpu

    rng = np.random.default_rng(4)
    y = np.concatenate([rng.poisson(3.0, (20, 9)), rng.poisson(500.0, (20, 9))]).astype(float)
    y[0, 0] = 2.5  # a non-integer count: lgamma itself
    alpha = np.exp(rng.uniform(np.log(1e-3), np.log(10), 40))
    ref = np.empty(40)
    _kernels.nb_const_kernel()(y, alpha, ref)
    got = sb.xp.empty(40)
    sb.launch(_kernels_gpu.nb_const, 1, 64, sb.asarray(np.ascontiguousarray(y.T)), sb.asarray(alpha), got)
    np.testing.assert_allclose(got.get(), ref, rtol=1e-12)


# ---- launch budgets ------------------------------------------------------------------------------------------------
IRLS_OPS_PER_ITER = 15
DISP_OPS_PER_ITER = 25


def _irls_counts(sb, G: int, n: int, maxit: int):
    x, mu, _, sf = _problem(G, n, 8)
    y = np.random.default_rng(9).negative_binomial(4, 4 / (4 + sf * mu)).astype(float)
    alpha = np.full(G, 0.1)
    args = (sb.asarray(y), sb.asarray(sf), sb.asarray(x), sb.asarray(alpha))
    with counting() as c:
        fit = _fit_nb_glm(sb, *args, maxit=maxit, use_fallback=False)
    return c, int(fit.iters.get().max())


def _disp_counts(sb, G: int, n: int, maxit: int):
    x, mu, y, _ = _problem(G, n, 10)
    a0 = np.full(G, 0.5)
    with counting() as c, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fit = fit_log_alpha(
            sb, sb.asarray(y), sb.asarray(mu), sb.asarray(x), sb.asarray(a0), min_disp=1e-8, max_disp=10.0,
            maxit=maxit,
        )  # fmt: skip
    return c, int(fit.iters.get().max())


@pytest.mark.parametrize(("G", "n"), [(12, 6), (30, 10)])
@pytest.mark.parametrize(
    ("counts", "short_maxit", "full_maxit", "ops_per_iter"),
    [(_irls_counts, 2, 25, IRLS_OPS_PER_ITER), (_disp_counts, 1, 50, DISP_OPS_PER_ITER)],
    ids=["irls", "dispersion"],
)
def test_launches_per_iteration_do_not_grow(sb, G, n, counts, short_maxit, full_maxit, ops_per_iter):
    short, it_short = counts(sb, G, n, short_maxit)
    full, it_full = counts(sb, G, n, full_maxit)
    assert it_full > it_short
    per_iter_ops = (full.ops - short.ops) / (it_full - it_short)
    per_iter_reads = (full.reads - short.reads) / (it_full - it_short)
    assert per_iter_ops <= ops_per_iter, full.top()
    assert per_iter_reads <= 1, full.top()
    # the whole fit is a fixed number of launches, whatever the genes, samples or iterations
    ref, _ = counts(sb, 12, 6, full_maxit)
    assert full.ops == ref.ops and full.reads == ref.reads, (full.top(), ref.top())


# ---- GPU path = CPU path where the trend falls back to the local fit ------------------------------------------------
def _near_poisson(G: int, seed: int, n: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Samples x genes Poisson counts (technical replicates: no overdispersion), two groups, 10% of genes changed;
    and the design (intercept, group)."""
    y, cond = near_poisson_counts(G, seed, n)
    return y, np.column_stack([np.ones(n), cond])


def test_local_trend_fit_gpu_path_equals_cpu_path(sb):
    """On near-Poisson counts the parametric trend fails and R's local fit takes over; its input, the gene-wise
    dispersions of at least 1e-7, includes genes in the flat region of the likelihood near the minimum dispersion,
    where the GPU path's former vectorised log posterior (lgamma(y + 1/alpha) - lgamma(1/alpha) cancelling at small
    alpha) stopped the Newton elsewhere than the CPU's kernel: dispFit differed by 6% on this set."""
    from gpuc.deseq import contrast_vector, results, run_deseq  # noqa: F401

    y, x = _near_poisson(100, 11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cpu = run_deseq(get_backend("cpu"), y, x)
        gpu = run_deseq(sb, sb.asarray(y), x)
    assert cpu.trend.kind == gpu.trend.kind == "local"
    assert any("local" in m for m in gpu.messages)
    for k in ("dispGeneEst", "dispFit", "dispMAP", "dispersion", "deviance"):
        np.testing.assert_allclose(gpu.genes[k], cpu.genes[k], rtol=1e-6, atol=0, equal_nan=True, err_msg=k)
    np.testing.assert_allclose(gpu.beta, cpu.beta, rtol=1e-6, atol=1e-9)
    c = np.array([0.0, 1.0])
    rc, _ = results(cpu, c)
    rg, _ = results(gpu, c)
    for k in ("log2FoldChange", "lfcSE", "pvalue", "padj"):
        np.testing.assert_allclose(rg[k], rc[k], rtol=1e-6, atol=1e-12, equal_nan=True, err_msg=k)


def test_local_trend_fit_batched_array_path_equals_cpu_path(sb, monkeypatch):
    """The same on the GPU path's batched array code (designs wider than the kernels take, or no numba-cuda), on a
    larger near-Poisson set (10 x 2000; dispFit differed by 24% before its log posterior followed the kernels')."""
    from gpuc.deseq import run_deseq

    monkeypatch.setattr(_kernels, "gpu_kernels", lambda *args: None)
    y, x = _near_poisson(2000, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cpu = run_deseq(get_backend("cpu"), y, x)
        with counting() as c:
            gpu = run_deseq(sb, sb.asarray(y), x)
    assert not any(k.startswith("kernel.") for k in c.by_name), c.top()
    assert cpu.trend.kind == gpu.trend.kind == "local"
    for k in ("dispFit", "dispMAP", "dispersion", "deviance"):
        np.testing.assert_allclose(gpu.genes[k], cpu.genes[k], rtol=1e-6, atol=0, equal_nan=True, err_msg=k)
    # gene-wise estimates where the likelihood is not flat near the minimum (there both stop at the optimiser's
    # tolerance, at different points, all below the local fit's 1e-7 threshold)
    ge_c, ge_g = cpu.genes["dispGeneEst"], gpu.genes["dispGeneEst"]
    flat = ge_c < 1e-6
    np.testing.assert_allclose(ge_g[~flat], ge_c[~flat], rtol=1e-6)
    assert np.array_equal(ge_g >= 1e-7, ge_c >= 1e-7)  # the same genes enter the local fit
    np.testing.assert_allclose(gpu.beta, cpu.beta, rtol=1e-6, atol=1e-9)


REFS = Path(__file__).resolve().parents[1] / "data" / "deseq" / "refs"
SHIPPED = {  # tests/data/deseq: counts file, metadata file, design
    "single_factor": ("synthetic/test_counts.csv.gz", "synthetic/test_metadata.csv.gz", "~condition"),
    "multi_factor": ("synthetic/test_counts.csv.gz", "synthetic/test_metadata.csv.gz", "~group + condition"),
    "continuous": (
        "continuous/test_counts.csv.gz",
        "continuous/test_metadata.csv.gz",
        "~group + condition + measurement",
    ),
    "wide": ("wide/test_counts.csv.gz", "wide/test_metadata.csv.gz", "~group + condition"),
    "large_counts": (
        "large_counts/test_counts_from_inline_test.csv.gz",
        "large_counts/test_metadata_from_inline_test.csv.gz",
        "~condition",
    ),
}


@pytest.mark.parametrize("case", list(SHIPPED))
def test_shipped_sets_gpu_path_equals_cpu_path(sb, case):
    """Every DESeq2 set shipped in tests/data/deseq through the kernels (stand-in, simulator) against the CPU path."""
    from gpuc.deseq import build_design, run_deseq

    counts, meta, formula = SHIPPED[case]
    c = pd.read_csv(REFS / counts, index_col=0)
    m = pd.read_csv(REFS / meta, index_col=0)
    if c.shape[0] != m.shape[0]:
        c = c.T  # genes x samples on disk
    x = build_design(m.loc[c.index], formula).matrix
    y = c.to_numpy().astype(np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cpu = run_deseq(get_backend("cpu"), y, x)
        with counting() as cnt:
            gpu = run_deseq(sb, sb.asarray(y), x)
    assert cnt.by_name["kernel.fit_disp"] >= 2 and cnt.by_name["kernel.irls"] >= 1, cnt.top()
    assert gpu.trend.kind == cpu.trend.kind
    for k in ("dispFit", "dispMAP", "dispersion", "deviance", "maxCooks"):
        np.testing.assert_allclose(gpu.genes[k], cpu.genes[k], rtol=1e-6, atol=0, equal_nan=True, err_msg=k)
    ge_c, ge_g = cpu.genes["dispGeneEst"], gpu.genes["dispGeneEst"]
    flat = ge_c < 1e-6
    np.testing.assert_allclose(ge_g[~flat], ge_c[~flat], rtol=1e-6)
    np.testing.assert_array_equal(gpu.genes["betaIter"], cpu.genes["betaIter"])
    np.testing.assert_allclose(gpu.beta, cpu.beta, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(gpu.cov, cpu.cov, rtol=1e-6, atol=1e-12)
