"""Variance-stabilising transformation (R ``varianceStabilizingTransformation``), batched over genes."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuc._backend import Backend
from gpuc._utils import threaded
from gpuc.deseq._dispersion import DispersionFunction, dispersion_mu, fit_log_alpha, fit_trend, rough_moments_init
from gpuc.deseq._rlinalg import r_row_sums


def vst_fit(
    bk: Backend, y: Any, sf: Any, x: np.ndarray, *, fit_type: str = "parametric", min_disp: float = 1e-8
) -> tuple[DispersionFunction, str | None]:
    """Genewise dispersions (design ``x``; intercept-only for blind) and the dispersion trend, as R's VST does."""
    xp = bk.xp
    n = y.shape[1]
    max_disp = max(10.0, float(n))
    nz = (y > 0).any(axis=1)
    yn = y[xp.nonzero(nz)[0]]
    xd = bk.asarray(x)
    a0 = rough_moments_init(bk, yn, sf, xd, min_disp=min_disp, max_disp=max_disp)
    mu = dispersion_mu(bk, yn, sf, xd, a0)
    gw = fit_log_alpha(bk, yn, mu, xd, a0, min_disp=min_disp, max_disp=max_disp, r_flat_start=True).alpha
    means = np.asarray(bk.to_host(r_row_sums(bk, yn / sf[None, :], mean=True)))
    return fit_trend(means, np.asarray(bk.to_host(gw)), fit_type=fit_type, min_disp=min_disp)


def vst_transform(bk: Backend, y: Any, sf: Any, trend: DispersionFunction) -> Any:
    """Apply the closed-form VST for a parametric or mean trend, or R's numerical integral for a local trend."""
    xp = bk.xp
    q = y / sf[None, :]
    if trend.kind == "parametric":
        a0, a1 = trend.coefs  # type: ignore[misc]
        return xp.log((1 + a1 + 2 * a0 * q + 2 * xp.sqrt(a0 * q * (1 + a1 + a0 * q))) / (4 * a0)) / np.log(2)
    if trend.kind == "mean":
        a = float(trend.mean)  # type: ignore[arg-type]
        return (2 * xp.arcsinh(xp.sqrt(a * q)) - np.log(a) - np.log(4)) / np.log(2)
    from scipy.interpolate import CubicSpline

    qh = np.asarray(bk.to_host(q))
    sfh = np.asarray(bk.to_host(sf))
    xg = np.sinh(np.linspace(0, np.arcsinh(qh.max()), 1000))[1:]
    xim = np.mean(1 / sfh)
    var = trend(xg) * xg**2 + xim * xg
    integ = 1 / np.sqrt(var)
    knots = np.arcsinh((xg[1:] + xg[:-1]) / 2)
    cum = np.cumsum((xg[1:] - xg[:-1]) * (integ[1:] + integ[:-1]) / 2)
    spl = CubicSpline(knots, cum, extrapolate=True)
    rm = qh.mean(axis=1)
    h1, h2 = np.quantile(rm, 0.95), np.quantile(rm, 0.999)
    eta = (np.log2(h2) - np.log2(h1)) / (spl(np.arcsinh(h2)) - spl(np.arcsinh(h1)))
    xi = np.log2(h1) - eta * spl(np.arcsinh(h1))
    return bk.asarray(eta * spl(np.arcsinh(qh)) + xi)


@threaded
def variance_stabilize(
    bk: Backend,
    counts: Any,
    *,
    size_factors: np.ndarray | None = None,
    trend: DispersionFunction | None = None,
    fit_type: str = "parametric",
    n_jobs: int | None = None,
) -> tuple[np.ndarray, DispersionFunction, str | None]:
    """R's ``varianceStabilizingTransformation`` of samples x genes ``counts``.

    Blind (``trend=None``): median-of-ratios size factors and a dispersion trend fitted with an intercept-only
    design. Otherwise the given size factors and trend of an earlier fit are used. Returns the transformed values
    (samples x genes, host numpy), the trend and a note when the trend fit fell back to another type. ``n_jobs``: CPU
    threads (:func:`gpuc._utils.cpu_threads`).
    """
    from gpuc.deseq._pipeline import compute_size_factors

    y = bk.asarray(counts, dtype=np.float64)
    if bk.sparse.issparse(y):
        y = y.toarray()
    y = bk.xp.ascontiguousarray(y.T)  # genes x samples
    note = None
    if trend is None:
        sf, _, _ = compute_size_factors(bk, y, "ratio")
        trend, note = vst_fit(bk, y, sf, np.ones((y.shape[1], 1)), fit_type=fit_type)
    else:
        sf = bk.asarray(np.asarray(size_factors, dtype=np.float64))
    out = np.asarray(bk.to_host(vst_transform(bk, y, sf, trend))).T.copy()
    return out, trend, note


def sample_pca(values: np.ndarray, ntop: int = 500) -> tuple[np.ndarray, np.ndarray]:
    """R DESeq2's ``plotPCA`` computation on samples x genes transformed values (vst or rlog): the ``ntop`` genes of
    largest variance (R's ``rowVars``, n - 1 denominator; ties in R's ``order``), centred but not scaled
    (``prcomp``); returns the sample scores (samples x components) and each component's fraction of the variance
    (R's ``percentVar``, over all components). Signs of components are arbitrary, as in ``prcomp``.
    """
    values = np.asarray(values, dtype=np.float64)
    var = values.var(axis=0, ddof=1)
    top = np.argsort(-var, kind="stable")[: min(ntop, var.size)]
    x = values[:, top] - values[:, top].mean(axis=0)
    u, s, _ = np.linalg.svd(x, full_matrices=False)
    return u * s, s**2 / np.sum(s**2)
