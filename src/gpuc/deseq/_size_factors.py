"""Size factors: median of ratios (R ``estimateSizeFactorsForMatrix``), poscounts, and R's iterative estimate."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuc._backend import Backend
from gpuc.deseq._rlinalg import r_mean, r_row_sums
from gpuc.deseq._threads import column_blocks, map_blocks, over_gene_spans


class NoCommonGenesError(ValueError):
    """Every gene has at least one zero count, so the median-of-ratios size factors are undefined."""


def sample_medians(bk: Backend, ratio: Any, *, complete: bool) -> Any:
    """Per sample (column) median of the log ratios ``ratio`` (usable genes x samples), NaN entries (zero counts)
    skipped.

    ``complete``: ``ratio`` holds no NaN (the ratio type's usable genes have no zero count), so the plain median is
    taken: the same values as the NaN-skipping one, without its per-column copies. On the CPU the samples run in
    column blocks in parallel (:func:`gpuc.deseq._threads.column_blocks`; each column's median is its own, so the
    split does not change a value).
    """
    xp = bk.xp
    median = xp.median if complete else xp.nanmedian
    blocks = column_blocks(bk, ratio.shape[1], ratio.shape[0])
    if blocks is None:
        return median(ratio, axis=0)
    return np.concatenate(map_blocks(blocks, lambda s: median(ratio[:, s], axis=0)))


def log_geo_means(bk: Backend, y: Any, kind: str) -> Any:
    """Per gene log geometric mean of gene-major counts as R forms it for ``type="ratio"`` (``rowMeans(log(y))``,
    -inf for a gene with a zero count) or ``"poscounts"`` (``log(exp(sum(log(y[y > 0])) / n))``, -inf for a gene of
    zeros).
    """
    xp = bk.xp
    if kind == "ratio":
        with np.errstate(divide="ignore"):
            return r_row_sums(bk, xp.log(y), mean=True)
    with np.errstate(divide="ignore"):
        logpos = xp.where(y > 0, xp.log(xp.maximum(y, 1.0)), 0.0)
    allzero = ~(y > 0).any(axis=1)
    return xp.where(allzero, -xp.inf, xp.log(xp.exp(r_row_sums(bk, logpos) / y.shape[1])))


def centred_on_geometric_mean(bk: Backend, sf: Any) -> Any:
    """``sf / exp(mean(log(sf)))`` as R rescales size factors made from given geometric means (``poscounts``)."""
    return sf / bk.xp.exp(r_mean(bk, bk.xp.log(sf)))


def _log_counts(bk: Backend, y: Any) -> tuple[Any, Any]:
    """``log(y)`` of gene-major counts and its per-gene mean as R's ``rowMeans`` forms it (:func:`r_row_sums`; the
    log geometric mean, -inf for a gene with a zero count). On the CPU the genes run in spans in parallel (each
    gene's values are its own).
    """
    xp = bk.xp
    logy, loggeo = xp.empty(y.shape), xp.empty(y.shape[0])

    def span(s: slice) -> None:
        with np.errstate(divide="ignore"):
            xp.log(y[s], out=logy[s])
        loggeo[s] = r_row_sums(bk, logy[s], mean=True)

    over_gene_spans(bk, y.shape[0], y.shape[1], span)
    return logy, loggeo


def _median_of_ratios(bk: Backend, y: Any, loggeo: Any) -> Any:
    """Per sample, exp(median over usable genes with a positive count of log(count) - log geometric mean)."""
    xp = bk.xp
    usable = xp.isfinite(loggeo)
    with np.errstate(divide="ignore"):
        logy = xp.log(y[usable])  # (G_used, n)
    ratio = logy - loggeo[usable][:, None]
    ratio = xp.where(y[usable] > 0, ratio, xp.nan)
    return xp.exp(sample_medians(bk, ratio, complete=False))


def size_factors_ratio(bk: Backend, y: Any, control: Any = None) -> Any:
    """Median-of-ratios size factors for gene-major counts ``y`` (genes x samples), not rescaled (as R).

    A gene is usable when its log geometric mean is finite, i.e. when it has no zero count, so its log ratios are
    all finite.
    """
    xp = bk.xp
    yc = y if control is None else y[control]
    logy, loggeo = _log_counts(bk, yc)
    usable = xp.isfinite(loggeo)
    if not bool(usable.any()):
        msg = "every gene has at least one zero count, so median-of-ratios size factors are undefined; use size_factors='poscounts'."
        raise NoCommonGenesError(msg)
    ratio = logy[usable] - loggeo[usable][:, None]
    return xp.exp(sample_medians(bk, ratio, complete=True))


def size_factors_poscounts(bk: Backend, y: Any, control: Any = None) -> Any:
    """R's ``type="poscounts"``: geometric means over positive counts divided by n, then geometric-mean-1 scaling."""
    yc = y if control is None else y[control]
    sf = _median_of_ratios(bk, yc, log_geo_means(bk, yc, "poscounts"))
    return centred_on_geometric_mean(bk, sf)


def size_factors_iterative(bk: Backend, y: Any, *, niter: int = 10, quant: float = 0.95, min_disp: float = 1e-8) -> Any:
    """R's ``estimateSizeFactorsIterate``: alternate an intercept-only dispersion fit and a trimmed NB likelihood.

    The log size factors (centred) are optimised by L-BFGS-B on the host over the summed NB log-likelihood of the
    genes below the ``quant`` quantile of per-gene negative log-likelihood; dispersions come from the batched
    genewise/MAP solvers with a mean trend.
    """
    import scipy.optimize

    from gpuc.deseq._dispersion import fit_dispersions_map_pipeline

    xp = bk.xp
    n = y.shape[1]
    sf = xp.ones(n)
    keep = (y > 0).any(axis=1)
    y = y[keep]
    x = xp.ones((n, 1))
    yh = np.asarray(bk.to_host(y))
    for it in range(niter):
        disp = fit_dispersions_map_pipeline(bk, y, sf, x, min_disp=min_disp)
        norm = y / sf[None, :]
        q = norm.mean(axis=1)
        qh, ah = np.asarray(bk.to_host(q)), np.asarray(bk.to_host(disp))
        r = 1.0 / ah

        def objective(logsf: np.ndarray, qh=qh, r=r) -> float:
            s = np.exp(logsf - logsf.mean())
            mu = qh[:, None] * s[None, :]
            from scipy.special import gammaln

            ll = (
                gammaln(yh + r[:, None])
                - gammaln(r[:, None])
                - gammaln(yh + 1)
                + r[:, None] * np.log(r[:, None] / (r[:, None] + mu))
                + yh * np.log(mu / (r[:, None] + mu))
            )
            nll = -ll.sum(axis=1)
            cut = np.quantile(nll, quant)
            return float(nll[nll < cut].sum())

        start = np.log(np.asarray(bk.to_host(sf)))
        res = scipy.optimize.minimize(objective, start, method="L-BFGS-B", bounds=[(-np.inf, np.inf)] * n)
        new = np.exp(res.x - res.x.mean())
        change = float(np.sum((np.log(new) - start) ** 2))
        sf = xp.asarray(new)
        if it > 1 and change < 1e-4:
            break
    return sf
