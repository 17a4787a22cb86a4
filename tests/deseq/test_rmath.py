"""gpuc's arithmetic against R's own values, bit for bit (references: tests/data/deseq/rmath/make_reference.R, R 4.2.2
with DESeq2 1.38.3 and the reference BLAS).

R DESeq2's gene-wise dispersion search accepts or rejects a step, and stops, on the last bits of its log posterior,
and steps by its derivative; its linear-model means and size factors feed both. These tests pin each piece to R's
exact doubles: R's ``lgammafn`` and ``digamma``, ``linearModelMuNormalized`` (LINPACK QR, reference BLAS), the
median-of-ratios size factors (``rowMeans`` in extended precision), ``fitDisp``'s log posterior and derivative, the
starting values of the search (``rowVars``, the moments estimate), the parametric trend (``glm.fit``) and the prior
variance, and the dispersions that follow from them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from gpuc._backend import get_backend

pytest.importorskip("numba")

DATA = Path(__file__).resolve().parents[1] / "data" / "deseq" / "rmath"
DESIGNS = {"1": 1, "condition": 2, "type_condition": 3}


def _hex(col: pd.Series) -> np.ndarray:
    return np.array([float.fromhex(v) for v in col])


def _design(name: str) -> np.ndarray:
    """R's pasilla model matrices (samples untreated1-4, treated1-3; type single-read for samples 1, 2 and 5)."""
    one = np.ones(7)
    treated = np.array([0, 0, 0, 0, 1, 1, 1.0])
    single = np.array([1, 1, 0, 0, 1, 0, 0.0])
    return {"1": one[:, None], "condition": np.c_[one, treated], "type_condition": np.c_[one, single, treated]}[name]


def _table(kind: str, name: str) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    t = pd.read_csv(DATA / f"{kind}_{name}.csv")
    y = t[[f"y{j}" for j in range(1, 8)]].to_numpy(float)
    mu = np.column_stack([_hex(t[f"mu{j}"]) for j in range(1, 8)])
    return t, y, mu


def test_lgamma_and_digamma_are_r_bit_for_bit():
    from gpuc.deseq import _fitdisp as F
    from gpuc.deseq._dispersion import _psi, _r_lgamma

    t = pd.read_csv(DATA / "special.csv")
    x, lg, dg = _hex(t.x), _hex(t.lgamma), _hex(t.digamma)
    np.testing.assert_array_equal([F.r_lgamma(v) for v in x], lg)
    np.testing.assert_array_equal([F.r_digamma(v) for v in x], dg)
    bk = get_backend("cpu")
    # the array code takes NumPy's logarithm, which may round differently from the C library's
    np.testing.assert_allclose(_r_lgamma(bk, x), lg, rtol=4e-16, atol=1e-300)
    np.testing.assert_allclose(_psi(np, x), dg, rtol=4e-16, atol=4e-16)


@pytest.mark.parametrize("name", list(DESIGNS))
def test_linear_model_means_are_r_bit_for_bit(name):
    from gpuc.deseq._rlinalg import linear_model_fit

    t, y, mu_r = _table("lm", name)
    sf = _hex(t.loc[0, [f"sf{j}" for j in range(1, 8)]])
    mu = linear_model_fit(get_backend("cpu"), y / sf, _design(name)) * sf
    np.testing.assert_array_equal(mu, mu_r)


def test_size_factors_are_r_bit_for_bit():
    """Median of ratios over the bundled pasilla counts (R's log geometric means are extended-precision row means)."""
    import gpuc
    from gpuc.deseq._size_factors import size_factors_ratio

    a = gpuc.datasets.pasilla()
    y = np.asarray(a.X.toarray() if hasattr(a.X, "toarray") else a.X, dtype=float).T
    t = pd.read_csv(DATA / "lm_condition.csv", nrows=1)
    sf_r = _hex(t[[f"sf{j}" for j in range(1, 8)]].iloc[0])
    order = [list(a.obs_names).index(s) for s in ["untreated1", "untreated2", "untreated3", "untreated4",
                                                    "treated1", "treated2", "treated3"]]  # fmt: skip
    np.testing.assert_array_equal(size_factors_ratio(get_backend("cpu"), y[:, order]), sf_r)


def _compiled_posterior():
    """The log posterior and its derivative compiled by numba, as the CPU kernels call them (LLVM must not rewrite
    R's ``pow(x, -1)`` into ``1 / x``)."""
    from numba import njit

    from gpuc.deseq import _fitdisp as F

    @njit
    def lp_dlp(la, y, mu, x, p, pm, pv, use_prior, b, db, inv, cache, out):
        n = y.shape[0]
        out[0] = F.log_posterior(la, y, mu, 0, 1, n, x, p, pm, pv, use_prior, True, b, cache)
        out[1] = F.dlog_posterior(la, y, mu, 0, 1, n, x, p, pm, pv, use_prior, True, b, db, inv, cache, True)

    return lp_dlp


def _posterior_and_derivative(t, y, mu, x, compiled, *, prior: bool):
    """gpuc's log posterior and derivative at R's points (prior mean la - 0.5 and variance 0.7, or no prior), as
    Python (the GPU kernels' simulator) or compiled for the CPU through the gene's table."""
    from gpuc.deseq import _fitdisp as F

    la = _hex(t.la)
    p = x.shape[1]
    b, db, inv = np.empty(p * p), np.empty(p * p), np.empty(F.inverse_scratch(p))
    cache = np.empty(F.cache_size(7)) if compiled else np.empty(0)
    lp, dlp = np.empty(len(t)), np.empty(len(t))
    kernel = _compiled_posterior() if compiled else None
    out = np.empty(2)
    for i in range(len(t)):
        pm = la[i] - 0.5 if prior else 0.0
        pv = 0.7 if prior else 1.0
        if compiled:
            F.gene_cache(y[i], mu[i], 0, 1, 7, cache)
            kernel(la[i], y[i], mu[i], x.reshape(-1), p, pm, pv, prior, b, db, inv, cache, out)
            lp[i], dlp[i] = out
            continue
        args = (y[i], mu[i], 0, 1, 7, x.reshape(-1), p, pm, pv, prior, True)
        lp[i] = F.log_posterior(la[i], *args, b, cache)
        dlp[i] = F.dlog_posterior(la[i], *args, b, db, inv, cache, False)
    return lp, dlp


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "numba"])
@pytest.mark.parametrize("name", list(DESIGNS))
def test_log_posterior_and_derivative_are_r_bit_for_bit(name, compiled):
    """fitDisp's log posterior (with the prior and the Cox-Reid term) and its derivative equal R's to the bit for
    every design, as Python (the GPU kernels' simulator) and compiled for the CPU (three coefficients: Armadillo's
    LAPACK inverse, dgetrf + dgetri, in reference order)."""
    t, y, mu = _table("lp", name)
    lp, dlp = _posterior_and_derivative(t, y, mu, _design(name), compiled, prior=True)
    np.testing.assert_array_equal(lp, _hex(t.lp))
    np.testing.assert_array_equal(dlp, _hex(t.dlp))


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "numba"])
def test_derivative_where_r_divides_is_r_bit_for_bit(compiled):
    """R writes the Cox-Reid weights as pow(pow(mu, -1) + alpha, -1), which its compiler turns into divisions,
    while the count terms keep the C library's pow(., -1): 139 pasilla ~type + condition genes at R's means, among
    them the 19 of 12,359 whose derivative tells the two apart."""
    t, y, mu = _table("dlp", "type_condition")
    lp, dlp = _posterior_and_derivative(t, y, mu, _design("type_condition"), compiled, prior=False)
    np.testing.assert_array_equal(lp, _hex(t.lp))
    np.testing.assert_array_equal(dlp, _hex(t.dlp))


def test_irls_and_its_start_are_r_bit_for_bit():
    """fitNbinomGLMs' start (R's qr(), qr.Q, qr.R, dgemm and dgesv) and fitBeta's IRLS (Armadillo's qr_econ by
    LAPACK dgeqr2/dorg2r, dgemv, the triangular solve, exp; its stopping rule) give R's coefficients, iteration
    counts and means bit for bit on 150 pasilla ~type + condition genes at random dispersions."""
    from gpuc.deseq._glm import fit_nb_glm, init_beta

    t = pd.read_csv(DATA / "fitbeta_type_condition.csv")
    y = t[[f"y{j}" for j in range(1, 8)]].to_numpy(float)
    sf = _hex(t.loc[0, [f"sf{j}" for j in range(1, 8)]])
    alpha = _hex(t.alpha)
    x = _design("type_condition")
    bk = get_backend("cpu")
    np.testing.assert_array_equal(init_beta(bk, y, sf, x), np.column_stack([_hex(t[f"b0_{k}"]) for k in (1, 2, 3)]))
    fit = fit_nb_glm(bk, y, sf, x, alpha)
    np.testing.assert_array_equal(fit.beta, np.column_stack([_hex(t[f"beta_{k}"]) for k in (1, 2, 3)]))
    np.testing.assert_array_equal(fit.iters, t.iter.to_numpy())
    np.testing.assert_array_equal(fit.mu, np.column_stack([_hex(t[f"mu{j}"]) for j in range(1, 8)]))


def test_trigamma_is_r_bit_for_bit():
    """R's trigamma (dpsifn), which the dispersion prior variance subtracts: the direct sum for small arguments,
    the shifted asymptotic series otherwise."""
    from gpuc.deseq._dispersion import r_trigamma

    t = pd.read_csv(DATA / "trigamma.csv")
    np.testing.assert_array_equal([r_trigamma(v) for v in _hex(t.x)], _hex(t.trigamma))


def test_dispersion_start_and_genewise_estimates_are_r_bit_for_bit():
    """The CD14 pseudobulk (24 samples, ~group): baseMean (R's rowMeans), baseVar (matrixStats' rowVars), the
    rough / moments starting value of the search, and R's dispGeneEst itself. The moments estimate cancels for
    nearly Poisson genes, so the start's last bits decide whether R's first step is accepted (dispGeneIter 1, then
    the grid) or rejected: the estimates of such genes differ by orders of magnitude when the start is not R's."""
    import anndata as ad

    import gpuc
    from gpuc.deseq._dispersion import rough_moments_init
    from gpuc.deseq._pipeline import gene_moments
    from gpuc.deseq._size_factors import size_factors_ratio

    prefit = DATA.parent / "prefit"
    cts = pd.read_csv(prefit / "pbmc_cd14_counts.csv.gz", index_col=0)
    md = pd.read_csv(prefit / "pbmc_cd14_metadata.csv", index_col=0).loc[cts.columns]
    t = pd.read_csv(DATA / "start_pbmc_cd14.csv.gz", index_col=0)
    y = cts.loc[t.index].to_numpy(np.float64)
    bk = get_backend("cpu")
    sf = size_factors_ratio(bk, cts.to_numpy(np.float64))
    _, base_mean, base_var = gene_moments(bk, y, sf)
    np.testing.assert_array_equal(base_mean, _hex(t.baseMean))
    np.testing.assert_array_equal(base_var, _hex(t.baseVar))
    x = np.c_[np.ones(len(md)), (md["group"] == "stim").to_numpy(float)]
    a0 = rough_moments_init(bk, y, sf, x, min_disp=1e-8, max_disp=24.0)
    np.testing.assert_array_equal(a0, _hex(t.alpha_init))

    a = ad.AnnData(cts.T.to_numpy(np.int64), obs=md, var=pd.DataFrame(index=cts.index))
    a.obs["group"] = pd.Categorical(a.obs["group"], ["ctrl", "stim"])
    # no outlier replacement (24 samples): R's reference is estimateDispersionsGeneEst on the original counts
    gpuc.tl.deseq(a, "~group", contrast=["group", "stim", "ctrl"], device="cpu", min_replicates=25)
    got = a.var.loc[t.index, "deseq_dispGeneEst"].to_numpy()
    want = _hex(t.dispGeneEst)
    off = np.abs(got - want) > 1e-6 * want
    assert off.sum() == 0, off.sum()
    assert (got == want).mean() > 0.999  # measured: all but 10 of 11,955 to the bit


def test_parametric_trend_and_prior_variance_are_r_bit_for_bit():
    """pasilla ~condition: R's parametricDispersionFit (glm.fit with LINPACK's dqrls, R's sum) and dispPriorVar (R's
    mad) to the bit, and R's gene-wise, trend, MAP and final dispersions of the 300 reference genes to the bit too."""
    import gpuc

    t = pd.read_csv(DATA / "trend_pasilla_condition.csv", index_col=0)
    a = gpuc.datasets.pasilla()
    gpuc.tl.deseq(a, "~condition", contrast=["condition", "treated", "untreated"], device="cpu")
    tr = a.uns["deseq"]["trend"]
    assert float(tr["asymptDisp"]) == float.fromhex(t.loc["asymptDisp", "dispersion"])
    assert float(tr["extraPois"]) == float.fromhex(t.loc["extraPois", "dispersion"])
    assert float(a.uns["deseq"]["prior_disp_var"]) == float.fromhex(t.loc["dispPriorVar", "dispersion"])
    genes = t.index[3:]
    for col in ("dispGeneEst", "dispFit", "dispMAP", "dispersion"):
        np.testing.assert_array_equal(a.var.loc[genes, f"deseq_{col}"].to_numpy(), _hex(t.loc[genes, col]), col)
