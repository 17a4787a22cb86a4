"""The DESeq2 pipeline on arrays: size factors -> dispersions -> GLM -> Cook's -> refit -> tests.

Everything per gene is batched; only scalars and 2-parameter trend fits go through the host. The outputs are host
numpy arrays so the adapter can write them to the AnnData directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuc._backend import Backend
from gpuc.deseq._cooks import cooks_cutoff, cooks_distance, replace_outliers, robust_disp
from gpuc.deseq._design import n_or_more_in_cell
from gpuc.deseq._dispersion import (
    DispersionFunction,
    dispersion_mu,
    fit_log_alpha,
    fit_trend,
    log_residual_variance,
    prior_variance,
    rough_moments_init,
)
from gpuc.deseq._glm import LN2, fit_nb_glm, gene_rows, per_gene
from gpuc.deseq._rlinalg import r_row_sums, r_row_vars
from gpuc.deseq._size_factors import size_factors_iterative, size_factors_poscounts, size_factors_ratio
from gpuc.deseq._stats import independent_filtering, lrt, p_adjust_bh, wald
from gpuc.deseq._threads import map_blocks, over_gene_spans, stage_blocks


@dataclass
class DeseqFit:
    """Everything the pipeline computed (host arrays; natural-log coefficients and covariances)."""

    size_factors: np.ndarray
    genes: dict[str, np.ndarray]
    beta: np.ndarray
    cov: np.ndarray
    mu: np.ndarray
    cooks: np.ndarray
    counts: np.ndarray  # original counts, genes x samples (host)
    design: np.ndarray
    trend: DispersionFunction
    var_log_disp: float
    prior_var: float
    prior_var_method: str
    cooks_cutoff: float
    size_factor_type: str
    lrt_stat: np.ndarray | None = None
    lrt_pvalue: np.ndarray | None = None
    lrt_df: int | None = None
    messages: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class DispersionPrior:
    """The global dispersion steps of :func:`dispersion_prior`: the trend, its values at the genes' means (genes with a
    count, in gene order), the variance of log dispersions around it, and the prior variance with its method
    (``"moments"`` or ``"simulation"``).
    """

    trend: DispersionFunction
    fitted: np.ndarray
    var_log_disp: float
    prior_var: float
    method: str


@dataclass(frozen=True)
class FitGlobals:
    """What every gene's fit after the dispersion prior (:func:`fit_genes`) shares besides its own data: the global
    results of :func:`dispersion_prior`, the dispersion bounds and the fit options (the same for every gene block).
    """

    trend: DispersionFunction
    prior_var: float
    var_log_disp: float
    refit_cooks: bool
    min_replicates: int
    max_iter: int
    reduced: np.ndarray | None
    min_mu: float
    min_disp: float
    max_disp: float
    xim: float | None = None  # with normalisation factors, R's mean(1 / colMeans(normalizationFactors))


POSCOUNTS_NOTE = "every gene has at least one zero count; using size_factors='poscounts' instead of 'ratio'."


def compute_size_factors(bk: Backend, y: Any, kind: str, *, control: Any = None) -> tuple[Any, str, str | None]:
    """Size factors of gene-major counts, switching ratio -> poscounts (with a message) when every gene has a zero."""
    if kind == "ratio":
        has_common = bool((y > 0).all(axis=1).any()) if control is None else bool((y[control] > 0).all(axis=1).any())
        if not has_common:
            return (
                size_factors_poscounts(bk, y, control),
                "poscounts",
                POSCOUNTS_NOTE,
            )
        return size_factors_ratio(bk, y, control), "ratio", None
    if kind == "poscounts":
        return size_factors_poscounts(bk, y, control), "poscounts", None
    if kind == "iterative":
        return size_factors_iterative(bk, y[(y > 0).any(axis=1)], estimate_dispersions), "iterative", None
    msg = f"size_factors={kind!r} is not valid."
    raise ValueError(msg)


def gene_moments(bk: Backend, y: Any, sf: Any) -> tuple[Any, Any, Any]:
    """The normalised counts ``y / sf`` of gene-major counts and their per-gene mean and variance (R's baseMean and
    baseVar). On the CPU the genes run in spans in parallel; each gene's values are its own, so they are the same.
    """
    xp = bk.xp
    norm, mean, var = xp.empty(y.shape), xp.empty(y.shape[0]), xp.empty(y.shape[0])

    def span(s: slice) -> None:
        xp.divide(y[s], per_gene(gene_rows(sf, s)), out=norm[s])
        mean[s] = r_row_sums(bk, norm[s], mean=True)  # R's rowMeans and matrixStats' rowVars
        var[s] = r_row_vars(xp, norm[s])

    over_gene_spans(bk, y.shape[0], y.shape[1], span)
    return norm, mean, var


def dispersion_start(
    bk: Backend, y: Any, sf: Any, x: Any, *, min_disp: float, max_disp: float, min_mu: float, xim: float | None = None
) -> tuple[Any, Any]:
    """The genewise fit's starting dispersions and its (floored) mu, per gene (``xim``: see
    :func:`gpuc.deseq._dispersion.rough_moments_init`).
    """
    a0 = rough_moments_init(bk, y, sf, x, min_disp=min_disp, max_disp=max_disp, xim=xim)
    return a0, dispersion_mu(bk, y, sf, x, a0, min_mu=min_mu)


def _fit_dispersions(
    bk: Backend, y: Any, sf: Any, x: Any, *, min_disp: float, max_disp: float, min_mu: float, xim: float | None = None
) -> tuple[Any, Any, Any, Any]:
    blocks = stage_blocks(bk, y.shape[0], y.shape[1])
    if blocks is not None:  # CPU: the whole stage per gene span, spans in parallel
        parts = map_blocks(
            blocks,
            lambda s: _fit_dispersions(
                bk, y[s], gene_rows(sf, s), x, min_disp=min_disp, max_disp=max_disp, min_mu=min_mu, xim=xim
            ),
        )
        cat = np.concatenate
        state = tuple(cat([q[3][i] for q in parts]) for i in range(4))
        return cat([q[0] for q in parts]), cat([q[1] for q in parts]), cat([q[2] for q in parts]), state
    a0, mu = dispersion_start(bk, y, sf, x, min_disp=min_disp, max_disp=max_disp, min_mu=min_mu, xim=xim)
    gw = fit_log_alpha(bk, y, mu, x, a0, min_disp=min_disp, max_disp=max_disp, r_flat_start=True)
    return gw.alpha, gw.converged, mu, gw.state


def map_dispersions(
    bk: Backend, y: Any, mu: Any, x: Any, gw: Any, fitted: Any, glob: FitGlobals
) -> tuple[Any, Any, Any, Any]:
    """MAP dispersions towards the trend values ``fitted`` (R's search from the gene-wise value, or from the trend
    value where the gene-wise one is more than 10 times below it), R's dispersion outliers (which keep their
    gene-wise value) and the final dispersions (``estimateDispersionsMAP``).
    """
    xp = bk.xp
    start = xp.where(gw > 0.1 * fitted, gw, fitted)
    mp = fit_log_alpha(
        bk,
        y,
        mu,
        x,
        start,
        min_disp=glob.min_disp,
        max_disp=glob.max_disp,
        prior_mean=xp.log(fitted),
        prior_var=glob.prior_var,
    )
    outlier = xp.log(gw) > xp.log(fitted) + 2.0 * math.sqrt(glob.var_log_disp)
    final = xp.clip(xp.where(outlier, gw, mp.alpha), glob.min_disp, glob.max_disp)
    return mp.alpha, mp.converged, outlier, final


def _fit_map(
    bk: Backend, y: Any, sf: Any, mu: Any, x: Any, gw: Any, fitted: Any, state: tuple | None, glob: FitGlobals
) -> tuple[Any, Any, Any, Any, Any]:
    """:func:`map_dispersions` and the NB GLM fitted with the final dispersions (``state`` is unused)."""
    dmap, map_conv, outlier, final = map_dispersions(bk, y, mu, x, gw, fitted, glob)
    # the likelihood-ratio test subtracts deviances: R's own there
    fit = fit_nb_glm(
        bk, y, sf, x, final, min_mu=glob.min_mu, maxit=glob.max_iter, exact_log_like=glob.reduced is not None
    )
    return dmap, map_conv, outlier, final, fit


def estimate_dispersions(
    bk: Backend, y: Any, sf: Any, x: np.ndarray, *, fit_type: str, min_disp: float = 1e-8, min_mu: float = 0.5
) -> tuple[Any, Any]:
    """R's ``estimateDispersions`` on gene-major counts ``y`` of genes with a count: gene-wise estimates, the trend
    of ``fit_type``, the prior and MAP. Returns the final dispersions and the means the gene-wise search used (R's
    ``assays(dds)[["mu"]]``).
    """
    n, p = x.shape
    max_disp = max(10.0, float(n))
    xd = bk.asarray(x)
    _, base_mean, _ = gene_moments(bk, y, sf)
    gw, _, mu, _ = _fit_dispersions(bk, y, sf, xd, min_disp=min_disp, max_disp=max_disp, min_mu=min_mu)
    prior = dispersion_prior(
        np.asarray(bk.to_host(base_mean)), np.asarray(bk.to_host(gw)), n, p, fit_type=fit_type, min_disp=min_disp,
        messages=[],
    )  # fmt: skip
    glob = FitGlobals(
        prior.trend, prior.prior_var, prior.var_log_disp, False, 7, 100, None, min_mu, min_disp, max_disp
    )  # fmt: skip
    final = map_dispersions(bk, y, mu, xd, gw, bk.asarray(prior.fitted), glob)[3]
    return final, mu


def run_deseq(
    bk: Backend,
    counts: Any,
    x: np.ndarray,
    *,
    size_factors: str | np.ndarray = "ratio",
    fit_type: str = "parametric",
    refit_cooks: bool = True,
    min_replicates: int = 7,
    min_mu: float = 0.5,
    min_disp: float = 1e-8,
    reduced: np.ndarray | None = None,
    control_genes: Any = None,
    max_iter: int = 100,
    random_state: int = 2,
) -> DeseqFit:
    """Run the DESeq2 fit on samples x genes ``counts`` with model matrix ``x`` (n x p).

    ``reduced`` (n x q model matrix) adds a likelihood-ratio test of the full against the reduced model, with the
    full model's dispersions, as R's ``nbinomLRT``. ``max_iter`` bounds the IRLS iterations of the final GLM fits
    (R's ``maxit``); genes that reach it keep ``betaConv`` False.

    The steps are :func:`compute_size_factors`, the genewise dispersions, :func:`dispersion_prior` (the global
    trend and prior), :func:`fit_genes` (every per-gene step after it) and :func:`gene_fields`;
    :func:`gpuc.deseq._blocks.run_analysis_blocked` runs the per-gene ones on gene blocks.
    """
    xp = bk.xp
    messages: list[str] = []
    x, n, p = check_design(x)
    reduced, lrt_df = check_reduced(reduced, p)
    y_all = bk.asarray(counts, dtype=np.float64)
    if bk.sparse.issparse(y_all):
        y_all = y_all.toarray()
    y_all = xp.ascontiguousarray(y_all.T)  # genes x samples
    G = y_all.shape[0]
    xd = bk.asarray(x)
    max_disp = max(10.0, float(n))

    # ---- size factors, or normalisation factors (samples x genes, as the counts): R's normalizationFactors, which
    # replace the size factors everywhere (one offset per gene and sample)
    nf_all = None
    if not isinstance(size_factors, str) and np.ndim(size_factors) == 2:
        nf_all = xp.ascontiguousarray(bk.asarray(np.asarray(size_factors, dtype=np.float64)).T)  # genes x samples
        if nf_all.shape != y_all.shape:
            msg = f"normalisation factors of shape {tuple(nf_all.shape[::-1])} do not match the counts {tuple(y_all.shape[::-1])}."
            raise ValueError(msg)
        sf, sf_type = nf_all, "normalization_factors"
    elif isinstance(size_factors, str):
        control = None if control_genes is None else bk.asarray(np.asarray(control_genes, dtype=np.int64))
        sf, sf_type, note = compute_size_factors(bk, y_all, size_factors, control=control)
        if note:
            messages.append(note)
    else:
        sf, sf_type = bk.asarray(np.asarray(size_factors, dtype=np.float64)), "given"

    nonzero = (y_all > 0).any(axis=1)
    nz_idx = xp.nonzero(nonzero)[0]
    y = y_all[nz_idx]
    sf_all = sf
    xim = None
    if nf_all is not None:
        sf = nf_all[nz_idx]
        xim = float((1.0 / sf.mean(axis=0)).mean())  # R: mean(1 / colMeans(normalizationFactors)), genes with a count
    norm, base_mean, base_var = gene_moments(bk, y, sf)

    # ---- dispersions
    gw, gw_conv, mu_disp, gw_state = _fit_dispersions(
        bk, y, sf, xd, min_disp=min_disp, max_disp=max_disp, min_mu=min_mu, xim=xim
    )
    prior = dispersion_prior(
        np.asarray(bk.to_host(base_mean)),
        np.asarray(bk.to_host(gw)),
        n,
        p,
        fit_type=fit_type,
        min_disp=min_disp,
        messages=messages,
        random_state=random_state,
    )

    # ---- MAP, GLM, Cook's, refit, LRT
    glob = FitGlobals(
        prior.trend, prior.prior_var, prior.var_log_disp, refit_cooks, min_replicates, max_iter, reduced, min_mu,
        min_disp, max_disp, xim,
    )  # fmt: skip
    parts = fit_genes(
        bk,
        y,
        sf,
        x,
        norm=norm,
        base_mean=base_mean,
        base_var=base_var,
        gw=gw,
        gw_conv=gw_conv,
        mu_disp=mu_disp,
        gw_state=gw_state,
        fitted=bk.asarray(prior.fitted),
        glob=glob,
    )
    return assemble_fit(
        gene_fields(bk, parts, nonzero, G),
        size_factors=np.asarray(bk.to_host(sf_all)),
        counts=np.asarray(bk.to_host(y_all)),
        design=x,
        prior=prior,
        size_factor_type=sf_type,
        lrt_df=lrt_df,
        messages=messages,
    )


def assemble_fit(
    fields: dict[str, Any],
    *,
    size_factors: np.ndarray,
    counts: np.ndarray,
    design: np.ndarray,
    prior: DispersionPrior,
    size_factor_type: str,
    lrt_df: int | None,
    messages: list[str],
) -> DeseqFit:
    """The :class:`DeseqFit` of a finished fit (the one place it is built, in process and from gene blocks).

    ``fields`` are the host arrays over all genes of :func:`gene_fields` (``genes``, ``beta``, ``cov``, ``mu``,
    ``cooks``, ``lrt_stat``, ``lrt_pvalue``); ``counts`` are the genes x samples counts fitted, ``prior`` the global
    dispersion steps (:func:`dispersion_prior`).
    """
    n, p = design.shape
    return DeseqFit(
        size_factors=size_factors,
        genes=fields["genes"],
        beta=fields["beta"],
        cov=fields["cov"],
        mu=fields["mu"],
        cooks=fields["cooks"],
        counts=counts,
        design=design,
        trend=prior.trend,
        var_log_disp=prior.var_log_disp,
        prior_var=prior.prior_var,
        prior_var_method=prior.method,
        cooks_cutoff=cooks_cutoff(n, p),
        size_factor_type=size_factor_type,
        lrt_stat=fields["lrt_stat"],
        lrt_pvalue=fields["lrt_pvalue"],
        lrt_df=lrt_df,
        messages=messages,
    )


def check_design(x: Any) -> tuple[np.ndarray, int, int]:
    """The model matrix as float64 and its samples and coefficients; raise without residual degrees of freedom."""
    x = np.asarray(x, dtype=np.float64)
    n, p = x.shape
    if n <= p:
        msg = f"no residual degrees of freedom: {n} samples and {p} model coefficients. Add replicates or simplify the design."
        raise ValueError(msg)
    return x, n, p


def check_reduced(reduced: np.ndarray | None, p: int) -> tuple[np.ndarray | None, int | None]:
    """The reduced model matrix as float64 and the likelihood-ratio test's degrees of freedom (None, None without)."""
    if reduced is None:
        return None, None
    reduced = np.asarray(reduced, dtype=np.float64)
    lrt_df = p - reduced.shape[1]
    if lrt_df <= 0:
        msg = f"the reduced design must have fewer coefficients than the full one ({reduced.shape[1]} vs {p})."
        raise ValueError(msg)
    return reduced, lrt_df


def dispersion_prior(
    means: np.ndarray,
    genewise: np.ndarray,
    n: int,
    p: int,
    *,
    fit_type: str,
    min_disp: float,
    messages: list[str],
    random_state: int = 2,
) -> DispersionPrior:
    """The global dispersion steps, on host vectors over the genes with a count (in gene order): the trend, its
    values at ``means``, the variance of log dispersions around it and the prior variance (with its method;
    ``random_state`` seeds its simulation, used with 3 or fewer residual degrees of freedom).

    Appends R's notes (trend fallback, simulated prior variance) to ``messages``.
    """
    trend, note = fit_trend(means, genewise, fit_type=fit_type, min_disp=min_disp)
    if note:
        messages.append(note)
    fitted = trend(means)
    var_log_disp, resid = log_residual_variance(genewise, fitted, min_disp=min_disp)
    prior_var, pv_method = prior_variance(resid, var_log_disp, n, p, seed=random_state)
    if pv_method == "simulation":
        messages.append(
            f"residual degrees of freedom n - p = {n - p} <= 3: the dispersion prior variance was matched by simulation (as R), giving {prior_var:.3g}."
        )
    return DispersionPrior(trend, fitted, var_log_disp, prior_var, pv_method)


def fit_genes(
    bk: Backend,
    y: Any,
    sf: Any,
    x: np.ndarray,
    *,
    norm: Any,
    base_mean: Any,
    base_var: Any,
    gw: Any,
    gw_conv: Any,
    mu_disp: Any,
    gw_state: tuple,
    fitted: Any,
    glob: FitGlobals,
) -> dict[str, Any]:
    """Every per-gene step after the dispersion prior, on gene-major counts ``y`` of genes with a count: MAP
    dispersions, the GLM, Cook's distances, outlier replacement and refit, and (with a ``reduced`` model matrix) the
    likelihood-ratio test (``glob.reduced``).

    A gene's results depend only on its own counts, genewise fit and trend value and on the global values passed in
    (size factors, design, ``glob``), so any split of the genes into blocks gives the same values.
    Returns the per-gene arrays (the LRT statistic and p-value on the host, None without a reduced model). On the CPU
    the genes run in spans (:func:`gpuc.deseq._threads.stage_blocks`), in parallel.
    """
    blocks = stage_blocks(bk, y.shape[0], y.shape[1])
    if blocks is not None:
        per_gene = {"norm": norm, "base_mean": base_mean, "base_var": base_var, "gw": gw, "gw_conv": gw_conv}
        per_gene |= {"mu_disp": mu_disp, "fitted": fitted}
        parts = map_blocks(
            blocks,
            lambda s: fit_genes(
                bk,
                y[s],
                gene_rows(sf, s),
                x,
                **{k: v[s] for k, v in per_gene.items()},
                gw_state=tuple(v[s] for v in gw_state),
                glob=glob,
            ),
        )
        return {k: None if parts[0][k] is None else np.concatenate([q[k] for q in parts]) for k in parts[0]}
    xp = bk.xp
    n, p = x.shape
    xd = bk.asarray(x)
    min_mu, max_iter, reduced = glob.min_mu, glob.max_iter, glob.reduced

    # ---- MAP dispersions and the GLM
    dmap, map_conv, outlier, disp, fit = _fit_map(bk, y, sf, mu_disp, xd, gw, fitted, gw_state, glob)
    beta, cov, mu, dev = fit.beta, fit.cov, fit.mu, fit.deviance
    beta_conv, beta_iter = fit.converged, fit.iters

    # ---- Cook's
    rob = robust_disp(bk, norm, x)
    cooks = cooks_distance(y, mu, fit.hat, rob, p)
    cutoff = cooks_cutoff(n, p)
    for_cooks = bk.asarray(n_or_more_in_cell(x, 3))
    max_cooks = (
        xp.where(for_cooks[None, :], cooks, -xp.inf).max(axis=1)
        if bool(for_cooks.any())
        else xp.full(y.shape[0], xp.nan)
    )
    max_cooks = xp.where(xp.isfinite(max_cooks), max_cooks, xp.nan)

    replace = xp.zeros(y.shape[0], dtype=bool)
    refitted = xp.zeros(y.shape[0], dtype=bool)
    replaceable = n_or_more_in_cell(x, glob.min_replicates)
    y_fit = y
    new_all_zero = xp.zeros(y.shape[0], dtype=bool)
    if glob.refit_cooks and replaceable.any():
        y_new, replace = replace_outliers(bk, y, sf, cooks, bk.asarray(replaceable), cutoff)
        if bool(replace.any()):
            y_fit = y_new
            new_all_zero = replace & ~(y_new > 0).any(axis=1)
            ridx = xp.nonzero(replace & ~new_all_zero)[0]
            norm_r, base_mean, base_var = gene_moments(bk, y_new, sf)
            if ridx.shape[0] > 0:
                yr = y_new[ridx]
                sfr = gene_rows(sf, ridx)
                gw_r, gwc_r, mu_r, gw_state_r = _fit_dispersions(
                    bk, yr, sfr, xd, min_disp=glob.min_disp, max_disp=glob.max_disp, min_mu=min_mu, xim=glob.xim
                )
                fitted_r = bk.asarray(glob.trend(np.asarray(bk.to_host(base_mean[ridx]))))
                dmap_r, mapc_r, out_r, disp_r, fit_r = _fit_map(bk, yr, sfr, mu_r, xd, gw_r, fitted_r, gw_state_r, glob)
                gw[ridx], gw_conv[ridx], fitted[ridx], dmap[ridx], map_conv[ridx], outlier[ridx], disp[ridx] = (
                    gw_r,
                    gwc_r,
                    fitted_r,
                    dmap_r,
                    mapc_r,
                    out_r,
                    disp_r,
                )
                beta[ridx], cov[ridx], mu[ridx], dev[ridx] = fit_r.beta, fit_r.cov, fit_r.mu, fit_r.deviance
                beta_conv[ridx], beta_iter[ridx] = fit_r.converged, fit_r.iters
                rob_r = robust_disp(bk, norm_r[ridx], x)
                cooks_r = cooks_distance(yr, fit_r.mu, fit_r.hat, rob_r, p)
                if bool(for_cooks.any()):
                    mc = xp.where(for_cooks[None, :], cooks_r, -xp.inf).max(axis=1)
                    max_cooks[ridx] = xp.where(xp.isfinite(mc), mc, xp.nan)
                refitted[ridx] = True
            if bool(new_all_zero.any()):
                zidx = xp.nonzero(new_all_zero)[0]
                beta[zidx] = 0.0
                cov[zidx] = 0.0
                base_mean[zidx] = 0.0
                base_var[zidx] = 0.0

    # ---- LRT
    st = pv = None
    if reduced is not None:
        fr = fit_nb_glm(bk, y_fit, sf, bk.asarray(reduced), disp, min_mu=min_mu, maxit=max_iter, exact_log_like=True)
        # R's statistic 2 (logLike_full - logLike_reduced), from the deviances (-2 logLike) of both fits
        st, pv = lrt(np.asarray(bk.to_host(fr.deviance)), np.asarray(bk.to_host(dev)), p - reduced.shape[1])
        nz_h = np.asarray(bk.to_host(new_all_zero))
        st[nz_h], pv[nz_h] = 0.0, 1.0
    return {
        "base_mean": base_mean,
        "base_var": base_var,
        "gw": gw,
        "gw_conv": gw_conv,
        "fitted": fitted,
        "dmap": dmap,
        "map_conv": map_conv,
        "outlier": outlier,
        "disp": disp,
        "beta_conv": beta_conv,
        "beta_iter": beta_iter,
        "dev": dev,
        "max_cooks": max_cooks,
        "replace": replace,
        "refitted": refitted,
        "new_all_zero": new_all_zero,
        "beta": beta,
        "cov": cov,
        "mu": mu,
        "cooks": cooks,
        "lrt_stat": st,
        "lrt_pvalue": pv,
    }


def gene_fields(bk: Backend, parts: dict[str, Any], nonzero: Any, G: int) -> dict[str, Any]:
    """The host arrays of :class:`DeseqFit` over all ``G`` genes from :func:`fit_genes`' arrays over the genes with a
    count (``nonzero``, a mask over the ``G`` genes): ``genes`` (the per-gene fields), ``beta``, ``cov``, ``mu``,
    ``cooks``, ``lrt_stat`` and ``lrt_pvalue``; genes without a count get R's fill values.
    """
    xp = bk.xp
    nz_idx = xp.nonzero(nonzero)[0]
    host = lambda a: np.asarray(bk.to_host(a))  # noqa: E731
    genes = {
        "baseMean": _scatter(bk, host(parts["base_mean"]), nz_idx, G, fill=0.0),
        "baseVar": _scatter(bk, host(parts["base_var"]), nz_idx, G, fill=0.0),
        "allZero": ~host(nonzero),
        "dispGeneEst": _scatter(bk, host(parts["gw"]), nz_idx, G),
        "dispGeneConv": _scatter(bk, host(parts["gw_conv"]), nz_idx, G, fill=False),
        "dispFit": _scatter(bk, host(parts["fitted"]), nz_idx, G),
        "dispMAP": _scatter(bk, host(parts["dmap"]), nz_idx, G),
        "dispMAPConv": _scatter(bk, host(parts["map_conv"]), nz_idx, G, fill=False),
        "dispOutlier": _scatter(bk, host(parts["outlier"]), nz_idx, G, fill=False),
        "dispersion": _scatter(bk, host(parts["disp"]), nz_idx, G),
        "betaConv": _scatter(bk, host(parts["beta_conv"]), nz_idx, G, fill=False),
        "betaIter": _scatter(bk, host(parts["beta_iter"]), nz_idx, G, fill=0),
        "deviance": _scatter(bk, host(parts["dev"]), nz_idx, G),
        "maxCooks": _scatter(bk, host(parts["max_cooks"]), nz_idx, G),
        "replace": _scatter(bk, host(parts["replace"]), nz_idx, G, fill=False),
        "refitted": _scatter(bk, host(parts["refitted"]), nz_idx, G, fill=False),
        "newAllZero": _scatter(bk, host(parts["new_all_zero"]), nz_idx, G, fill=False),
    }
    out: dict[str, Any] = {"genes": genes}
    for k in ("beta", "cov", "mu", "cooks"):
        out[k] = _scatter(bk, host(parts[k]), nz_idx, G)
    for k in ("lrt_stat", "lrt_pvalue"):
        out[k] = None if parts[k] is None else _scatter(bk, parts[k], nz_idx, G)
    return out


def _scatter(bk: Backend, values: np.ndarray, nz_idx: Any, G: int, fill: Any = np.nan) -> np.ndarray:
    idx = np.asarray(bk.to_host(nz_idx))
    values = np.asarray(values)
    dtype = values.dtype if values.dtype != bool or isinstance(fill, bool) else np.float64
    if values.dtype.kind in "iu" and not isinstance(fill, int):
        dtype = np.float64
    if idx.shape[0] == G:  # every gene has a count: nz_idx is 0..G-1
        return values.astype(dtype, copy=False)
    out = np.empty((G, *values.shape[1:]), dtype=dtype)
    missing = np.ones(G, dtype=bool)
    missing[idx] = False
    out[missing] = fill
    out[idx] = values
    return out


def cooks_outliers(fit: DeseqFit, *, two_group: bool = True) -> np.ndarray:
    """R's Cook's filter: maxCooks above the cut-off; in a design of one two-level factor (``two_group``: R's
    heuristic applies only there) not when >= 3 samples have counts above the flagged sample's.
    """
    mc = fit.genes["maxCooks"]
    with np.errstate(invalid="ignore"):
        out = mc > fit.cooks_cutoff
    idx = np.nonzero(out)[0]
    if idx.size and two_group:
        counts = fit.counts[idx]
        which = np.nanargmax(np.where(np.isnan(fit.cooks[idx]), -np.inf, fit.cooks[idx]), axis=1)
        ref = counts[np.arange(idx.size), which]
        dont = (counts > ref[:, None]).sum(axis=1) >= 3
        out[idx[dont]] = False
    return out


def results(
    fit: DeseqFit,
    contrast: np.ndarray,
    *,
    alpha: float = 0.1,
    cooks_filter: bool = True,
    independent_filter: bool = True,
    lfc_threshold: float = 0.0,
    alt_hypothesis: str = "greaterAbs",
    zero_groups: tuple[np.ndarray, np.ndarray] | None = None,
    test: str = "wald",
    two_group: bool = True,
) -> tuple[dict[str, np.ndarray], dict]:
    """Results columns for one contrast (R ``results()``), and filtering diagnostics.

    ``zero_groups`` (two sample masks) enables R's rule that genes with all-zero counts in both groups of a factor
    contrast get log2FoldChange 0 (and, for Wald, stat 0 and p-value 1). ``two_group``: the design is one two-level
    factor, where R's Cook's filter spares outliers with 3 or more higher counts (:func:`cooks_outliers`).
    """
    res = wald(fit.beta, fit.cov, contrast, lfc_threshold=lfc_threshold, alt=alt_hypothesis)
    if test == "lrt":
        res["stat"] = fit.lrt_stat.copy()
        res["pvalue"] = fit.lrt_pvalue.copy()
    nz = fit.genes["newAllZero"]
    if nz.any():
        res["log2FoldChange"][nz] = 0.0
        res["lfcSE"][nz] = 0.0
        if test == "wald":
            res["stat"][nz], res["pvalue"][nz] = 0.0, 1.0
    both = contrast_all_zero(fit, zero_groups)
    if both.any():
        res["log2FoldChange"][both] = 0.0
        if test == "wald":
            res["stat"][both], res["pvalue"][both] = 0.0, 1.0
    pv = res["pvalue"]
    pv[fit.genes["allZero"]] = np.nan
    info: dict = {}
    if cooks_filter:
        out = cooks_outliers(fit, two_group=two_group)
        pv[out] = np.nan
        info["n_cooks_outliers"] = int(out.sum())
    bm = fit.genes["baseMean"]
    if independent_filter:
        padj, finfo = independent_filtering(bm, pv, alpha)
        info.update({k: v for k, v in finfo.items()})
    else:
        padj = p_adjust_bh(pv)
    res["pvalue"] = pv
    res["padj"] = padj
    res["baseMean"] = bm
    return res, info


def contrast_all_zero(fit: DeseqFit, zero_groups: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
    """The genes with a count but none in the samples a contrast compares (R's ``contrastAllZero``), whose fold
    change R's ``cleanContrast`` sets to 0; none without ``zero_groups``.
    """
    if zero_groups is None:
        return np.zeros(fit.counts.shape[0], dtype=bool)
    a, b = zero_groups
    in_groups = a | b
    counts = fit.counts if in_groups.all() else fit.counts[:, in_groups]  # a two-level factor: every sample
    return ~(counts > 0).any(axis=1) & ~fit.genes["allZero"]


def lfc_log2(fit: DeseqFit) -> np.ndarray:
    """Coefficients on the log2 scale (as R reports them)."""
    return fit.beta / LN2
