"""Regularised log transformation (R DESeq2 ``rlog`` / ``rlogData``), batched over genes.

R fits, for each gene, a negative-binomial GLM with an intercept and one coefficient per sample, the sample
coefficients under a normal (ridge) prior of variance ``betaPriorVar`` and the intercept under a flat one
(lambda 1e-6), with the trend dispersion ``dispFit`` held fixed (``fitNbinomGLMs(betaTol=1e-4, useQR=TRUE)``, an IRLS
of at most 100 steps that stops when the deviance changes by less than 1e-4 relative). The rlog values are the fitted
log2 means without the size factor: intercept + sample coefficient.

The design is ``[1 | I]`` (n samples, n + 1 columns), so each gene's penalised normal equations have the arrowhead
form ``[[sum w + l0, w^T], [w, diag(w) + l]]``. Eliminating the sample coefficients gives the intercept in closed
form, ``b0 = sum(h z) / (l0 + sum h)`` with ``h = w l / (w + l)``, and then ``b_j = w_j (z_j - b0) / (w_j + l)``:
O(n) per gene and step instead of R's QR of an (2n + 1) x (n + 1) matrix, the same solution (R's QR of the
ridge-augmented system solves the same equations). Every step is a few elementwise array operations over
genes x samples in the backend's ``xp``, so the CPU and a GPU run the same code; each gene stops at the step where R
stops it (same start, same deviance test, same 0.5 floor on the mean), so the values agree with R to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuc._backend import Backend, get_backend
from gpuc.deseq._rlinalg import r_row_sums
from gpuc.deseq._shrink import weighted_upper_quantile_var

LN2 = float(np.log(2.0))
INTERCEPT_LAMBDA = 1e-6  # R's "wide" prior on the intercept (log2 scale)


@dataclass
class RlogFit:
    """The rlog of the genes given to :func:`rlog_genes` (genes x samples, host numpy)."""

    values: np.ndarray  # log2 rlog values, genes x samples
    intercept: np.ndarray  # log2 fitted intercept per gene (R's mcols(rld)$rlogIntercept)
    iterations: np.ndarray  # IRLS steps taken per gene (R's betaIter)
    converged: np.ndarray  # False where the gene hit max_iter or diverged (|beta| > 30), as R's betaConv


def rlog_prior_variance(norm: np.ndarray, base_mean: np.ndarray, disp_fit: np.ndarray) -> float:
    """R's ``betaPriorVar`` of ``rlogData``: the weighted upper-quantile match of the log fold changes of every
    sample over the gene mean, ``log2(q + 0.5) - log2(baseMean + 0.5)``, weighted by ``1 / (1/baseMean + dispFit)``.

    ``norm`` is genes x samples normalised counts of the genes with a non-zero count (host numpy).
    """
    lfc = np.log2(norm + 0.5) - np.log2(base_mean + 0.5)[:, None]
    with np.errstate(
        divide="ignore"
    ):  # a zero baseMean (all of a gene's counts replaced as outliers) weighs 0, as in R
        weights = 1.0 / (1.0 / base_mean + disp_fit)
    # R flattens the genes x samples matrix column by column and repeats the weights per sample
    return weighted_upper_quantile_var(lfc.T.ravel(), np.tile(weights, norm.shape[1]))


def rlog_genes(
    bk: Backend,
    y: Any,
    sf: Any,
    disp_fit: Any,
    beta_prior_var: float,
    *,
    tol: float = 1e-4,
    max_iter: int = 100,
    min_mu: float = 0.5,
    large: float = 30.0,
) -> RlogFit:
    """R's ``rlogData`` fit for genes x samples counts ``y`` of genes with a non-zero count.

    Parameters
    ----------
    bk
        Backend the arrays live on (or are moved to).
    y
        Genes x samples counts (float64), no all-zero gene.
    sf
        Size factors (n,).
    disp_fit
        Trend dispersion of each gene (R's ``mcols(dds)$dispFit``).
    beta_prior_var
        Prior variance of the sample coefficients (log2 scale), from :func:`rlog_prior_variance`.
    tol, max_iter, min_mu, large
        R's ``betaTol=1e-4``, ``maxit=100``, ``minmu=0.5`` and divergence bound (natural-log scale) of ``fitBeta``.

    Returns
    -------
    :class:`RlogFit` on the host.
    """
    xp = bk.xp
    y = bk.asarray(y, dtype=np.float64)
    sf = bk.asarray(sf, dtype=np.float64)
    alpha = bk.asarray(disp_fit, dtype=np.float64)
    g, n = y.shape
    lam = 1.0 / beta_prior_var / LN2**2  # R passes lambda / log(2)^2 to the natural-log IRLS
    lam0 = INTERCEPT_LAMBDA / LN2**2
    r = 1.0 / alpha[:, None]
    # the terms of the NB log-likelihood that do not depend on mu, once per gene (alpha is fixed): the deviance of a
    # step is then -2 (const + the mu terms), the value R's dnbinom_mu sums
    const = (bk.special.gammaln(y + r) - bk.special.gammaln(r) - bk.special.gammaln(y + 1.0)).sum(axis=1)
    # R's start for a rank-deficient design with an intercept: intercept log(baseMean), sample coefficients 0
    b0 = xp.log((y / sf[None, :]).mean(axis=1))
    b = xp.zeros((g, n))
    mu = xp.maximum(sf[None, :] * xp.exp(b0)[:, None], min_mu)
    dev_old = xp.zeros(g)
    iters = xp.zeros(g, dtype=np.int64)
    diverged = xp.zeros(g, dtype=bool)
    idx = xp.arange(g)  # the genes still iterating; each step works on them only
    for t in range(max_iter):
        iters[idx] += 1
        yi, mui, ai, ri = y[idx], mu[idx], alpha[idx][:, None], r[idx]
        w = mui / (1.0 + ai * mui)
        z = xp.log(mui / sf[None, :]) + (yi - mui) / mui
        h = w * lam / (w + lam)
        nb0 = (h * z).sum(axis=1) / (lam0 + h.sum(axis=1))
        nb = w * (z - nb0[:, None]) / (w + lam)
        b0[idx] = nb0
        b[idx] = nb
        # fitBeta stops a gene whose coefficients leave [-30, 30], keeping them, and counts it as not converged
        out = (xp.abs(nb) > large).any(axis=1) | (xp.abs(nb0) > large)
        mui = xp.maximum(sf[None, :] * xp.exp(nb0[:, None] + nb), min_mu)
        mu[idx] = mui
        amu = ai * mui
        l1p = xp.log1p(amu)
        ll = (-ri * l1p + xp.where(yi > 0, yi * (xp.log(amu) - l1p), 0.0)).sum(axis=1)
        dev = -2.0 * (const[idx] + ll)
        conv = xp.abs(dev - dev_old[idx]) / (xp.abs(dev) + 0.1)
        dev_old[idx] = dev
        diverged[idx] = out
        stop = out | (conv < tol) if t > 0 else out
        idx = idx[~stop]
        if idx.size == 0:  # the size of a device array: one synchronising read per step
            break
    iters[diverged] = max_iter
    iters[idx] = max_iter  # still iterating after max_iter steps: not converged, as R's betaIter == maxit
    values = (b0[:, None] + b) / LN2
    return RlogFit(
        values=np.asarray(bk.to_host(values)),
        intercept=np.asarray(bk.to_host(b0 / LN2)),
        iterations=np.asarray(bk.to_host(iters)),
        converged=np.asarray(bk.to_host(iters < max_iter)),
    )


def rlog_block(
    y: np.ndarray,
    disp_fit: np.ndarray,
    *,
    backend: Backend,
    size_factors: np.ndarray,
    beta_prior_var: float,
    n_jobs: int | None = None,
) -> RlogFit:
    """One gene block of :func:`regularized_log` (a unit of :func:`gpuc._dask.map_units`): :func:`rlog_genes` of the
    block's genes x samples counts (all with a non-zero count) and trend dispersions under the global size factors
    and prior variance. Each gene's fit is its own, so the values do not depend on the blocks.
    """
    from gpuc._utils import cpu_threads

    with cpu_threads(n_jobs):
        return rlog_genes(backend, y, size_factors, disp_fit, beta_prior_var)


@dataclass
class RlogResult:
    """What :func:`regularized_log` returns (host numpy / plain Python)."""

    values: np.ndarray  # samples x genes log2 values; 0 for genes with no count (R's buildMatrixWithZeroRows)
    intercept: np.ndarray  # per gene log2 intercept, -inf for genes with no count (R's rlogIntercept)
    converged: np.ndarray  # per gene, False where the IRLS hit 100 steps or diverged (nan-free; True for zero genes)
    beta_prior_var: float  # R's attr(rld, "betaPriorVar")
    size_factors: np.ndarray
    trend: Any  # the DispersionFunction used
    note: str | None  # a trend-fit fallback message, or None


def regularized_log(
    bk: Backend,
    counts: Any,
    *,
    size_factors: np.ndarray | None = None,
    trend: Any = None,
    fit_type: str = "parametric",
    base_mean: np.ndarray | None = None,
    disp_fit: np.ndarray | None = None,
    beta_prior_var: float | None = None,
    client: Any = None,
    block_genes: int | None = None,
    n_jobs: int | None = None,
) -> RlogResult:
    """R's ``rlog`` of samples x genes ``counts``.

    Blind (``trend=None``): median-of-ratios size factors (unless given) and a dispersion trend fitted with an
    intercept-only design, as R's ``rlog(blind=TRUE)``. Otherwise the given size factors and trend (of an earlier
    :func:`gpuc.tl.deseq` fit: R's ``rlog(dds, blind=FALSE)`` after ``DESeq``). ``base_mean`` and ``disp_fit`` (per
    gene, all genes) replace the mean of the normalised counts in the prior variance and the trend's value at it, as
    R reads ``mcols(dds)$baseMean`` and ``$dispFit`` when they are there: after ``DESeq`` they were computed from the
    counts with Cook's outliers replaced, for the refitted genes. The prior variance is estimated
    from all genes here (a global step); the per-gene fits then run at once, or in blocks of ``block_genes`` genes
    in this process or as Dask tasks on ``client`` (:func:`gpuc._dask.map_units`), with the same values.
    """
    from gpuc._dask import map_units
    from gpuc._utils import cpu_threads
    from gpuc.deseq._blocks import _gene_major, _label, gene_spans
    from gpuc.deseq._pipeline import compute_size_factors
    from gpuc.deseq._vst import vst_fit

    y_host = _gene_major(counts)  # genes x samples, host float64: the blocks are cut from it
    g_all, n = y_host.shape
    note = None
    with cpu_threads(n_jobs):
        y = bk.asarray(y_host)
        if size_factors is None:
            sf, _, note = compute_size_factors(bk, y, "ratio")
        else:
            sf = bk.asarray(np.asarray(size_factors, dtype=np.float64))
        if trend is None and disp_fit is None:
            trend, trend_note = vst_fit(bk, y, sf, np.ones((n, 1)), fit_type=fit_type)
            note = trend_note or note
        sf_host = np.asarray(bk.to_host(sf), dtype=np.float64)
    nonzero = np.flatnonzero(y_host.sum(axis=1) > 0)
    yz = y_host[nonzero]
    norm = yz / sf_host[None, :]
    if base_mean is None:  # R's rowMeans of the normalised counts (host values)
        base_mean = r_row_sums(get_backend("cpu"), norm, mean=True)
    else:
        base_mean = np.asarray(base_mean, dtype=np.float64)[nonzero]
    if disp_fit is None:
        disp_fit = np.asarray(trend(base_mean), dtype=np.float64)
    else:
        disp_fit = np.asarray(disp_fit, dtype=np.float64)[nonzero]
    if beta_prior_var is None:
        beta_prior_var = rlog_prior_variance(norm, base_mean, disp_fit)
    spans = gene_spans(nonzero.size, block_genes or max(nonzero.size, 1))
    units = [(_label(int(nonzero[lo]), int(nonzero[hi - 1]) + 1), (yz[lo:hi], disp_fit[lo:hi])) for lo, hi in spans]
    shared = {"backend": bk, "size_factors": sf_host, "beta_prior_var": float(beta_prior_var)}
    parts = map_units(rlog_block, units, client=client, shared=shared, n_jobs=n_jobs, what="rlog") if units else []
    values = np.zeros((g_all, n))
    intercept = np.full(g_all, -np.inf)
    converged = np.ones(g_all, dtype=bool)
    if parts:
        values[nonzero] = np.concatenate([p.values for p in parts])
        intercept[nonzero] = np.concatenate([p.intercept for p in parts])
        converged[nonzero] = np.concatenate([p.converged for p in parts])
    return RlogResult(
        values=values.T.copy(),
        intercept=intercept,
        converged=converged,
        beta_prior_var=float(beta_prior_var),
        size_factors=sf_host,
        trend=trend,
        note=note,
    )
