"""Size factors: median of ratios (R ``estimateSizeFactorsForMatrix``), poscounts, and R's iterative estimate."""

from __future__ import annotations

from collections.abc import Callable
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


def size_factors_iterative(
    bk: Backend,
    y: Any,
    estimate_dispersions: Callable[..., tuple[Any, Any]],
    *,
    niter: int = 10,
    quantile: float = 0.05,
) -> Any:
    """R's ``estimateSizeFactorsIterate`` on gene-major counts ``y`` of the genes with a count.

    Each round fits the dispersions of the intercept-only model with a mean trend (R's
    ``estimateDispersions(fitType = "mean")``), then maximises over the log size factors p, with
    sf = exp(p - mean(p)), the summed log-likelihood of the genes above the ``quantile`` of per-gene log-likelihoods
    (means: the dispersion means over the old size factors, times sf) by ``optim``'s L-BFGS-B, as R does, in R's
    arithmetic (:mod:`gpuc.deseq._optim`); it stops once the squared change of log sf is below 1e-4 from the second
    round on. Raises, as R, when a round's search or the rounds do not converge. ``estimate_dispersions(bk, y, sf,
    x, fit_type=)`` is the pipeline's (:func:`gpuc.deseq._pipeline.estimate_dispersions`): final dispersions and the
    gene-wise means.
    """
    from gpuc._backend import get_backend
    from gpuc.deseq._optim import lbfgsb, log_density_matrix
    from gpuc.deseq._rlinalg import r_quantile, r_sum

    host = get_backend("cpu")

    n = y.shape[1]
    x = np.ones((n, 1))
    counts = np.ascontiguousarray(bk.to_host(y), dtype=np.float64)
    sf = np.ones(n)
    for i in range(1, niter + 1):
        disp, mu = estimate_dispersions(bk, y, bk.asarray(sf), x, fit_type="mean")
        q = np.asarray(bk.to_host(mu), dtype=np.float64) / sf[None, :]
        alpha = np.ascontiguousarray(bk.to_host(disp), dtype=np.float64)
        terms = np.empty(counts.shape)

        def negative_trimmed_log_likelihood(p: np.ndarray, q=q, alpha=alpha, terms=terms) -> float:
            # optim(fnscale = -1) minimises -fn
            s = np.exp(p - r_mean(host, p))
            log_density_matrix(counts, q * s[None, :], alpha, terms)
            gene_ll = r_row_sums(host, terms)
            return -r_sum(gene_ll[gene_ll > r_quantile(gene_ll, quantile)])

        old = sf
        res = lbfgsb(negative_trimmed_log_likelihood, np.log(old), np.full(n, -np.inf), np.full(n, np.inf))
        if res.convergence != 0:
            msg = "iterative size factor normalization did not converge within an iteration (as R's estimateSizeFactorsIterate)."
            raise RuntimeError(msg)
        sf = np.exp(res.par - r_mean(host, res.par))
        if i > 1 and r_sum((np.log(old) - np.log(sf)) ** 2) < 1e-4:
            break
        if i == niter:
            raise RuntimeError(
                "iterative size factor normalization did not converge (as R's estimateSizeFactorsIterate)."
            )
    return bk.asarray(sf)
