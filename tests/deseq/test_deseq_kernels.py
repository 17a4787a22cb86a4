"""The compiled CPU loops (numba) of the dispersion solver and the IRLS against the vectorised numpy form they
replace (which the GPU and numba-less CPUs run)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.special
import scipy.stats

from gpuc._backend import get_backend
from gpuc.deseq import _kernels
from gpuc.deseq._dispersion import _logpost
from gpuc.deseq._glm import outer_rows

pytest.importorskip("numba")


@pytest.mark.parametrize("derivs", [False, True])
@pytest.mark.parametrize("prior", [False, True])
def test_logpost_kernel_matches_numpy(disable_numba, derivs, prior):
    rng = np.random.default_rng(3)
    G, n = 400, 15
    x = np.column_stack([np.ones(n), np.repeat([0.0, 1.0], [7, 8]), rng.normal(size=n)])
    mu = np.exp(rng.normal(2, 2.5, (G, 1)) + rng.normal(0, 0.3, (G, n)))
    y = rng.negative_binomial(4, 4 / (4 + mu)).astype(float)
    y[:20] += 0.25  # non-integer counts take the general path
    la = rng.uniform(np.log(1e-4), np.log(20), G)
    pm = rng.normal(-2, 1, G) if prior else None
    bk = get_backend("cpu")
    xx = outer_rows(x)
    got = _logpost(bk, la, y, mu, xx, 3, cr=True, prior_mean=pm, prior_var=0.7, derivs=derivs)
    disable_numba()
    ref = _logpost(bk, la, y, mu, xx, 3, cr=True, prior_mean=pm, prior_var=0.7, derivs=derivs)
    for a, b in zip(got, ref, strict=True):
        if b is not None:
            # the numpy form's trigamma is a 2e-9 approximation and lgamma differences cancel at small alpha
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_const_kernel_matches_gammaln():
    rng = np.random.default_rng(4)
    y = np.concatenate([rng.poisson(3.0, (50, 9)), rng.poisson(500.0, (50, 9))]).astype(float)
    y[0, 0] = 2.5
    alpha = np.exp(rng.uniform(np.log(1e-3), np.log(10), 100))
    out = np.empty(100)
    _kernels.nb_const_kernel()(y, alpha, out)
    r = 1.0 / alpha[:, None]
    ref = (scipy.special.gammaln(y + r) - scipy.special.gammaln(r) - scipy.special.gammaln(y + 1.0)).sum(axis=1)
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-8)


@pytest.mark.parametrize("formula", ["~condition", "~batch + x + condition"])
def test_pipeline_compiled_equals_numpy(disable_numba, formula, sim_bulk):
    from gpuc.deseq import build_design, contrast_vector, results, run_deseq

    a = sim_bulk(n_per=12, n_genes=1500, seed=11)
    d = build_design(a.obs, formula)
    c = contrast_vector(d, ["condition", "B", "A"])[0]
    bk = get_backend("cpu")
    f1 = run_deseq(bk, a.X, d.matrix)
    r1, _ = results(f1, c)
    disable_numba()
    f2 = run_deseq(bk, a.X, d.matrix)
    r2, _ = results(f2, c)
    for k in ("dispGeneEst", "dispersion", "deviance"):
        np.testing.assert_allclose(f1.genes[k], f2.genes[k], rtol=1e-6, equal_nan=True)
    np.testing.assert_array_equal(f1.genes["betaIter"], f2.genes["betaIter"])
    for k in ("log2FoldChange", "lfcSE", "pvalue", "padj"):
        np.testing.assert_allclose(r1[k], r2[k], rtol=1e-6, atol=1e-12, equal_nan=True)


def test_independent_filtering_equals_per_threshold_bh():
    """The sort-once filtering gives, array for array, what scipy's BH adjustment of each threshold's genes gives."""
    from gpuc.deseq._stats import independent_filtering, p_adjust_bh

    rng = np.random.default_rng(3)
    g = 4000
    base_mean = np.where(rng.random(g) < 0.1, 0.0, rng.lognormal(3, 2, g))
    p = np.concatenate([rng.uniform(0, 1e-4, 400), rng.random(g - 400)])
    p[rng.choice(g, 300, replace=False)] = np.nan
    p[:50] = p[50]  # ties
    rng.shuffle(p)
    alpha = 0.1
    padj, info = independent_filtering(base_mean, p, alpha)
    for j, cut in enumerate(info["cutoffs"]):
        use = base_mean >= cut
        ref = np.full(g, np.nan)
        ok = use & ~np.isnan(p)
        ref[ok] = scipy.stats.false_discovery_control(p[ok], method="bh")
        np.testing.assert_array_equal(p_adjust_bh(np.where(use, p, np.nan)), ref)
        assert info["num_rejections"][j] == int(np.sum(ref[~np.isnan(ref)] < alpha))
        if cut == info["filter_threshold"]:
            np.testing.assert_array_equal(padj, ref)


@pytest.mark.parametrize("prior", [False, True])
def test_newton_kernel_equals_array_loop(monkeypatch, prior):
    """The compiled per-gene Newton loop takes the steps of the array code: same iterations and convergence, the same
    estimates up to the rounding of the p x p determinant and inverse (LU here, LAPACK there)."""
    from gpuc.deseq._dispersion import fit_log_alpha

    rng = np.random.default_rng(5)
    G, n = 600, 12
    x = np.column_stack([np.ones(n), np.repeat([0.0, 1.0], [6, 6]), rng.normal(size=n)])
    mu = np.exp(rng.normal(2, 2.5, (G, 1)) + rng.normal(0, 0.3, (G, n)))
    y = rng.negative_binomial(4, 4 / (4 + mu)).astype(float)
    y[:5] = 0.0
    y[5:10, 0] = 1.0  # a single count: flat starts at the minimum
    y[10:20] += 0.5  # non-integer counts
    mu = np.maximum(mu, 0.5)
    a0 = np.exp(rng.uniform(np.log(1e-6), np.log(5), G))
    bk = get_backend("cpu")
    kw = {"min_disp": 1e-8, "max_disp": 12.0, "r_flat_start": not prior}
    if prior:
        kw |= {"prior_mean": rng.normal(-2, 1, G), "prior_var": 0.6}
    got = fit_log_alpha(bk, y, mu, x, a0, **kw)
    monkeypatch.setattr(_kernels, "newton_kernel", lambda: None)
    ref = fit_log_alpha(bk, y, mu, x, a0, **kw)
    np.testing.assert_array_equal(got.converged, ref.converged)
    np.testing.assert_array_equal(got.iters, ref.iters)
    # near the minimum dispersion the log posterior is flat in log alpha: rounding moves the optimum there
    np.testing.assert_allclose(got.alpha, ref.alpha, rtol=1e-9, atol=1e-12)
    for a, b in zip(got.state, ref.state, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-7)  # log alpha there: 1e-7 is 1e-14 in alpha


@pytest.mark.parametrize("complete", [True, False])
def test_sample_medians_in_column_blocks_equal_nanmedian(complete):
    """The per-sample medians of the size factors, computed in column blocks on two threads, are numpy's nanmedian."""
    from gpuc._utils import cpu_threads
    from gpuc.deseq._size_factors import sample_medians
    from gpuc.deseq._threads import column_blocks

    rng = np.random.default_rng(7)
    ratio = rng.normal(size=(3000, 90))
    if not complete:
        ratio[rng.random(ratio.shape) < 0.2] = np.nan
        ratio[:, 3] = np.nan  # a sample without a usable gene
    bk = get_backend("cpu")
    assert len(column_blocks(bk, ratio.shape[1], ratio.shape[0])) > 1
    with np.errstate(all="ignore"), cpu_threads(2), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = sample_medians(bk, ratio, complete=complete)
        want = np.nanmedian(ratio, axis=0)
    np.testing.assert_array_equal(got, want)


def test_gene_moments_in_spans_equal_whole_matrix():
    """Normalised counts, baseMean and baseVar computed in parallel gene spans equal the whole-matrix numpy values."""
    from gpuc._utils import cpu_threads
    from gpuc.deseq._pipeline import gene_moments
    from gpuc.deseq._threads import stage_blocks

    rng = np.random.default_rng(8)
    y = rng.poisson(20.0, size=(6000, 40)).astype(np.float64)
    sf = rng.uniform(0.5, 2.0, 40)
    bk = get_backend("cpu")
    assert len(stage_blocks(bk, *y.shape)) > 1
    with cpu_threads(2):
        norm, mean, var = gene_moments(bk, y, sf)
    want = y / sf[None, :]
    np.testing.assert_array_equal(norm, want)
    np.testing.assert_array_equal(mean, want.mean(axis=1))
    np.testing.assert_array_equal(var, want.var(axis=1, ddof=1))
