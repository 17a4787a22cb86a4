"""One large DESeq2 design fitted as gene blocks: the per-gene steps run per block (in this process or as Dask tasks),
the global steps run here between them, on per-gene vectors.

DESeq2 treats genes independently except for a few steps that pool them. :func:`run_analysis_blocked` runs those
pooled steps on the client and everything else on blocks of genes (:func:`gpuc._dask.map_units`):

1. size factors (here): the median of ratios needs, per sample, the median over all genes of log(count) - log
   geometric mean. A median has no small mergeable partial, so the ratios of the usable genes are formed block by
   block on the client, which holds the counts anyway (one genes x samples matrix of the usable genes, never the
   dozen temporaries of a fit), and their median is taken once. ``"iterative"`` alternates whole-data dispersion fits
   and a likelihood optimisation over all genes: it runs here in one piece (:func:`compute_size_factors`).
2. genewise dispersions (units): per block, baseMean and the genewise dispersion MLE with its Newton state.
3. dispersion trend, variance of log dispersions, prior variance (here), on the baseMean and genewise vectors.
4. MAP dispersions, NB GLM, Cook's distances, outlier replacement and refit, LRT (units, :func:`fit_genes`). The
   replacement decision of a gene uses only its own Cook's distances and the global cut-off, and the refit the
   trend and prior variance of step 3 (as R), so it stays inside the block.
5. Wald tests, Cook's filter, independent filtering and Benjamini-Hochberg over all genes (here, :func:`tabulate`),
   and lfcShrink when asked for.

Each unit calls the same functions as :func:`gpuc.deseq._pipeline.run_deseq` on its genes, and every per-gene
result depends only on the gene's counts and the global values, so the result is the same as one in-process fit.
Step 4 recomputes the dispersion mu of step 2 (deterministic, cheaper than shipping a genes x samples matrix back and
forth). On a cluster each unit's block of counts is scattered with it by :func:`gpuc._dask.map_units`, and scattered
again from here when its worker dies, so a killed worker costs a rerun of its units, not the call.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from gpuc._backend import Backend, is_sparse, to_host
from gpuc._dask import map_units, resolve_client
from gpuc._utils import threaded
from gpuc.deseq._analysis import Analysis, AnalysisOptions, AnalysisPlan, tabulate
from gpuc.deseq._glm import per_gene
from gpuc.deseq._pipeline import (
    POSCOUNTS_NOTE,
    FitGlobals,
    _fit_dispersions,
    assemble_fit,
    check_design,
    check_reduced,
    compute_size_factors,
    dispersion_prior,
    dispersion_start,
    fit_genes,
    gene_fields,
    gene_moments,
)
from gpuc.deseq._rlinalg import r_col_means, r_mean, r_row_sums
from gpuc.deseq._size_factors import NoCommonGenesError, centred_on_geometric_mean, log_geo_means, sample_medians

BLOCK_BYTES = 256 * 2**20
MIN_MU = 0.5
MIN_DISP = 1e-8


def default_block_genes(n_samples: int, block_bytes: float = BLOCK_BYTES) -> int:
    """Genes per block so that a block's working memory is about ``block_bytes``: ~14 float64 genes x samples arrays
    and ~100 float64 values per gene (the estimate of :func:`gpuc.deseq._run.deseq_peak_bytes`).
    """
    return max(1, int(block_bytes // ((14.0 * n_samples + 100.0) * 8.0)))


def gene_spans(n_genes: int, block_genes: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive blocks of ``block_genes`` genes (the last one may be shorter)."""
    return [(lo, min(lo + block_genes, n_genes)) for lo in range(0, n_genes, block_genes)]


def _label(lo: int, hi: int) -> str:
    return f"genes {lo}-{hi - 1}"


def _gene_major(counts: Any) -> np.ndarray:
    """Samples x genes counts (numpy, scipy/cupyx sparse or cupy) as a host, C-contiguous float64 genes x samples
    matrix (the values :func:`run_deseq` fits, converted exactly).
    """
    counts = to_host(counts)
    if is_sparse(counts):
        counts = counts.toarray()
    return np.ascontiguousarray(np.asarray(counts, dtype=np.float64).T)


# --------------------------------------------------------------------------------------------------------------------
# global step 1: size factors, block by block
# --------------------------------------------------------------------------------------------------------------------
def size_factors_blocked(
    bk: Backend, y_all: np.ndarray, kind: str, spans: list[tuple[int, int]]
) -> tuple[Any, str, str | None]:
    """:func:`gpuc.deseq._pipeline.compute_size_factors` of host gene-major counts, one gene block on the device at a
    time: the log geometric means per block, the log ratios of the usable genes gathered into one matrix, and the
    median per sample over all of them (the same values, so the same result).
    """
    xp = bk.xp
    if kind == "iterative":  # a global optimisation over all genes: not split
        return compute_size_factors(bk, bk.asarray(y_all), kind)
    if kind not in ("ratio", "poscounts"):
        msg = f"size_factors={kind!r} is not valid."
        raise ValueError(msg)
    blocks = lambda: ((lo, hi, bk.asarray(y_all[lo:hi])) for lo, hi in spans)  # noqa: E731
    note = None
    if kind == "ratio" and not any(bool((yb > 0).all(axis=1).any()) for _, _, yb in blocks()):
        kind, note = "poscounts", POSCOUNTS_NOTE
    loggeo = [log_geo_means(bk, yb, kind) for _, _, yb in blocks()]
    usable = [xp.isfinite(lg) for lg in loggeo]
    n_used = sum(int(u.sum()) for u in usable)
    if kind == "ratio" and n_used == 0:
        msg = "every gene has at least one zero count, so median-of-ratios size factors are undefined; use size_factors='poscounts'."
        raise NoCommonGenesError(msg)
    ratio = xp.empty((n_used, y_all.shape[1]))
    at = 0
    for (_, _, yb), lg, u in zip(blocks(), loggeo, usable, strict=True):
        yu = yb[u]
        with np.errstate(divide="ignore"):
            logy = xp.log(yu)
        ratio[at : at + yu.shape[0]] = xp.where(yu > 0, logy - lg[u][:, None], xp.nan)
        at += yu.shape[0]
    sf = xp.exp(sample_medians(bk, ratio, complete=kind == "ratio"))
    if kind == "poscounts":
        sf = centred_on_geometric_mean(bk, sf)
    return sf, kind, note


# --------------------------------------------------------------------------------------------------------------------
# the units (module level: Dask workers import them)
# --------------------------------------------------------------------------------------------------------------------
def _block_counts(bk: Backend, y: np.ndarray, lo: int) -> tuple[Any, Any, Any]:
    """The block's counts on the device, its mask of genes with a count and their counts; raises for negative or
    non-finite counts (checked here, where the block is, naming the genes by their index in the whole matrix).
    """
    bad = np.nonzero(~(np.isfinite(y) & (y >= 0)).all(axis=1))[0]
    if bad.size:
        msg = (
            f"{bad.size} gene(s) have negative or non-finite counts (genes {(bad[:10] + lo).tolist()}); DESeq2 needs "
            "raw non-negative integer counts."
        )
        raise ValueError(msg)
    xp = bk.xp
    y_all = bk.asarray(y)
    nonzero = (y_all > 0).any(axis=1)
    return y_all, nonzero, y_all[xp.nonzero(nonzero)[0]]


def _block_factors(bk: Backend, size_factors: Any, nf: np.ndarray | None, nonzero: Any) -> Any:
    """The size factors of a block's genes with a count: the per-sample ones, or the block's normalisation factors
    (genes x samples) of those genes.
    """
    if nf is None:
        return bk.asarray(size_factors)
    return bk.asarray(nf)[bk.xp.nonzero(nonzero)[0]]


def genewise_block(
    y: np.ndarray,
    lo: int,
    nf: np.ndarray | None = None,
    *,
    backend: Backend,
    size_factors: np.ndarray | None,
    design: np.ndarray,
    xim: float | None = None,
    n_jobs: int | None = None,
) -> dict[str, Any]:
    """Unit of step 2 on gene-major counts ``y`` of the genes ``lo..``: which genes have a count and, for those,
    baseMean, the genewise dispersion MLE, its convergence and the Newton state the MAP fit starts from. ``nf``: the
    block's normalisation factors (genes x samples), which replace ``size_factors``; ``xim`` then R's global
    ``mean(1 / colMeans(normalizationFactors))``.
    """
    bk = backend
    host = lambda a: np.asarray(bk.to_host(a))  # noqa: E731
    _, nonzero, yz = _block_counts(bk, y, lo)
    sf = _block_factors(bk, size_factors, nf, nonzero)
    base_mean = r_row_sums(bk, yz / per_gene(sf), mean=True)
    max_disp = max(10.0, float(design.shape[0]))
    gw, gw_conv, _, state = _fit_dispersions(
        bk, yz, sf, bk.asarray(design), min_disp=MIN_DISP, max_disp=max_disp, min_mu=MIN_MU, xim=xim
    )
    return {
        "nonzero": host(nonzero),
        "base_mean": host(base_mean),
        "gw": host(gw),
        "gw_conv": host(gw_conv),
        "state": tuple(host(s) for s in state),
    }


def fit_block(
    y: np.ndarray,
    lo: int,
    genewise: dict[str, Any],
    fitted: np.ndarray,
    nf: np.ndarray | None = None,
    *,
    backend: Backend,
    size_factors: np.ndarray | None,
    design: np.ndarray,
    globals_: FitGlobals,
    xim: float | None = None,
    n_jobs: int | None = None,
) -> dict[str, Any]:
    """Unit of step 4 on the same block: :func:`fit_genes` with the block's genewise results and trend values and
    the global trend and prior variance (``globals_``), returned as the block's rows of the :class:`DeseqFit` arrays
    (``nf``, ``xim``: as :func:`genewise_block`).
    """
    bk = backend
    _, nonzero, yz = _block_counts(bk, y, lo)
    sf = _block_factors(bk, size_factors, nf, nonzero)
    xd = bk.asarray(design)
    norm, base_mean, base_var = gene_moments(bk, yz, sf)
    g = globals_
    _, mu_disp = dispersion_start(bk, yz, sf, xd, min_disp=g.min_disp, max_disp=g.max_disp, min_mu=g.min_mu, xim=g.xim)
    parts = fit_genes(
        bk,
        yz,
        sf,
        design,
        norm=norm,
        base_mean=base_mean,
        base_var=base_var,
        gw=bk.xp.array(genewise["gw"]),  # copies: fit_genes updates the refitted genes in place
        gw_conv=bk.xp.array(genewise["gw_conv"]),
        mu_disp=mu_disp,
        gw_state=tuple(bk.asarray(s) for s in genewise["state"]),
        fitted=bk.xp.array(fitted),
        glob=g,
    )
    return gene_fields(bk, parts, nonzero, y.shape[0])


# --------------------------------------------------------------------------------------------------------------------
# the driver
# --------------------------------------------------------------------------------------------------------------------
@threaded
def run_analysis_blocked(
    backend: Backend,
    counts: Any,
    plan: AnalysisPlan,
    *,
    client: Any = None,
    block_genes: int | None = None,
    gene_names: pd.Index,
    n_jobs: int | None = None,
    **options: Any,
) -> Analysis:
    """:func:`gpuc.deseq._analysis.run_analysis` with the per-gene steps on blocks of ``block_genes`` genes.

    The blocks run one after the other in this process, or as Dask tasks on ``client``; the global steps (size
    factors, dispersion trend, prior variance, independent filtering, Benjamini-Hochberg) run here between them (see
    the module docstring). The :class:`Analysis` is the same as :func:`run_analysis` gives for the same arguments.

    Parameters
    ----------
    backend
        Where each block is fitted (a :class:`~gpuc._backend.Backend`; it travels to the workers by device name).
    counts
        Samples x genes raw counts (numpy, scipy/cupyx sparse or cupy; gathered on the host as float64).
    plan
        The design, contrasts and reduced design (:func:`gpuc.deseq._analysis.plan_analysis`).
    client
        A ``distributed.Client``, ``"default"`` or ``None`` (:attr:`gpuc.settings.client`, by default in this
        process), as :func:`gpuc._dask.resolve_client`.
    block_genes
        Genes per block; ``None`` sizes a block's working memory to about 256 MB (:func:`default_block_genes`).
    gene_names
        As :func:`run_analysis`.
    n_jobs
        CPU threads of each block (inside a worker at most the worker's threads) and of the steps here.
    options
        Those of :class:`gpuc.deseq._analysis.AnalysisOptions`, as :func:`run_analysis`. ``size_factors="iterative"``
        and ``lfc_shrink`` run in this process on all genes.

    Returns
    -------
    The :class:`Analysis`: the :class:`DeseqFit` over all genes, a results table and filtering summary per contrast.

    Raises
    ------
    ValueError
        For a block with negative or non-finite counts (in this process), and as :func:`run_analysis`.
    TypeError
        For an unknown option, before any fit.
    gpuc._dask.DaskTaskError
        When a block fails on the cluster; the message names its genes (``"genes 100-199"``).
    """
    bk = backend
    opts = AnalysisOptions(**options)
    size_factors = opts.size_factors
    dask_client = resolve_client(client)
    x, n, p = check_design(plan.design.matrix)
    reduced, lrt_df = check_reduced(None if plan.reduced is None else plan.reduced.matrix, p)
    y_all = _gene_major(counts)
    G = y_all.shape[0]
    if block_genes is None:
        block_genes = default_block_genes(n)
    if int(block_genes) < 1:
        msg = f"block_genes must be a positive number of genes, got {block_genes!r}."
        raise ValueError(msg)
    spans = gene_spans(G, int(block_genes))
    labels = [_label(lo, hi) for lo, hi in spans]
    messages: list[str] = []

    # ---- 1. size factors (here), or normalisation factors (samples x genes, R's normalizationFactors): their
    # genes x samples blocks travel with the counts' blocks
    nf_all, xim = None, None
    if not isinstance(size_factors, str) and np.ndim(size_factors) == 2:
        nf_all = np.ascontiguousarray(np.asarray(size_factors, dtype=np.float64).T)
        if nf_all.shape != y_all.shape:
            msg = f"normalisation factors of shape {nf_all.shape[::-1]} do not match the counts {y_all.shape[::-1]}."
            raise ValueError(msg)
        nz = (y_all > 0).any(axis=1)
        xim = r_mean(bk, 1.0 / r_col_means(bk, nf_all[nz]))  # R: mean(1 / colMeans(NF)), genes with a count
        sf, sf_type = None, "normalization_factors"
    elif isinstance(size_factors, str):
        control = opts.control_genes
        if control is None:
            sf, sf_type, note = size_factors_blocked(bk, y_all, size_factors, spans)
        else:  # the size factors of the control genes only (R's controlGenes), in blocks of them
            y_c = y_all[np.asarray(control)]
            sf, sf_type, note = size_factors_blocked(bk, y_c, size_factors, gene_spans(y_c.shape[0], int(block_genes)))
        if note:
            messages.append(note)
        sf = np.asarray(bk.to_host(sf))
    else:
        sf, sf_type = np.asarray(size_factors, dtype=np.float64), "given"

    # on a cluster map_units scatters each block's counts to a worker with its unit (again from here if that worker
    # dies); the design and size factors go to every worker once
    data = [y_all[lo:hi] for lo, hi in spans]
    nfs = [() if nf_all is None else (nf_all[lo:hi],) for lo, hi in spans]
    shared = {"backend": bk, "size_factors": sf, "design": x, "xim": xim}
    run = {"client": dask_client, "n_jobs": n_jobs, "what": "deseq", "scatter_args": True}

    # ---- 2. genewise dispersions (units)
    units = [(lab, (d, lo, *f)) for lab, d, (lo, _), f in zip(labels, data, spans, nfs, strict=True)]
    gws = map_units(genewise_block, units, shared=shared, **run)

    # ---- 3. trend and prior (here), on the genes with a count in gene order
    prior = dispersion_prior(
        np.concatenate([g["base_mean"] for g in gws]),
        np.concatenate([g["gw"] for g in gws]),
        n,
        p,
        fit_type=opts.fit_type,
        min_disp=MIN_DISP,
        messages=messages,
        random_state=opts.random_state,
    )
    edges = np.cumsum([0] + [g["gw"].shape[0] for g in gws])

    # ---- 4. MAP, GLM, Cook's, refit, LRT (units)
    globals_ = FitGlobals(
        prior.trend, prior.prior_var, prior.var_log_disp, opts.refit_cooks, opts.min_replicates, opts.max_iter, reduced,
        MIN_MU, MIN_DISP, max(10.0, float(n)), xim,
    )  # fmt: skip
    units = [
        (lab, (d, lo, {k: g[k] for k in ("gw", "gw_conv", "state")}, prior.fitted[edges[i] : edges[i + 1]], *nfs[i]))
        for i, (lab, d, (lo, _), g) in enumerate(zip(labels, data, spans, gws, strict=True))
    ]
    parts = map_units(fit_block, units, shared={**shared, "globals_": globals_}, **run)
    cat = lambda key: None if parts[0][key] is None else np.concatenate([q[key] for q in parts])  # noqa: E731
    fields = {k: cat(k) for k in ("beta", "cov", "mu", "cooks", "lrt_stat", "lrt_pvalue")}
    fields["genes"] = {k: np.concatenate([q["genes"][k] for q in parts]) for k in parts[0]["genes"]}
    fit = assemble_fit(
        fields,
        size_factors=sf if nf_all is None else nf_all,
        counts=y_all,
        design=x,
        prior=prior,
        size_factor_type=sf_type,
        lrt_df=lrt_df,
        messages=messages,
    )

    # ---- 5. tests, filtering, BH (here)
    return tabulate(bk, fit, plan, gene_names=gene_names, options=opts)
