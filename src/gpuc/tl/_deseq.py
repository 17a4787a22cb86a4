"""``gpuc.tl.deseq`` and ``gpuc.tl.pseudobulk``: AnnData adapters over the :mod:`gpuc.deseq` engine."""

from __future__ import annotations

import warnings
from typing import Any, Literal

import numpy as np
import pandas as pd
from anndata import AnnData

from gpuc import _keys
from gpuc import _log as logg
from gpuc._atomic import atomic_writes
from gpuc._backend import Device, get_backend
from gpuc._dask import is_dask_array, map_units, resolve_client, runs_on
from gpuc._docs import doc_params
from gpuc._errors import GpucWarning, interruptible
from gpuc._inputs import record as record_inputs
from gpuc._lazy import load
from gpuc._validate import (
    SeedLike,
    align_to_obs,
    check_adata,
    check_bool,
    check_choice,
    check_int,
    check_key,
    check_key_added,
    check_memory,
    check_number,
    check_printable_labels,
    get_matrix,
    group_labels,
    resolve_random_state,
)
from gpuc.deseq._analysis import Analysis, contrast_names, is_name_list, split_contrasts
from gpuc.deseq._run import (
    DeseqPlan,
    GroupResult,
    VstPlan,
    check_counts,
    check_deseq_memory,
    check_raw_counts,
    plan_deseq,
    profile_sums,
    run_deseq_plan,
    run_vst,
    vst_peak_bytes,
)
from gpuc.deseq._run import deseq_peak_bytes as deseq_peak_bytes  # the memory model, where tests look it up


# --------------------------------------------------------------------------------------------------------------------
# deseq
# --------------------------------------------------------------------------------------------------------------------
@doc_params()
def deseq(
    adata: AnnData,
    design: str | pd.DataFrame = "~condition",
    *,
    contrast: Any = None,
    layer: str | None = None,
    size_factors: Literal["ratio", "poscounts", "iterative"] | np.ndarray = "ratio",
    control_genes: Any = None,
    normalization_factors: str | None = None,
    fit_type: Literal["parametric", "local", "mean"] = "parametric",
    test: Literal["wald", "lrt"] = "wald",
    reduced: str | pd.DataFrame | None = None,
    alpha: float = 0.1,
    cooks_filter: bool = True,
    independent_filter: bool = True,
    refit_cooks: bool = True,
    lfc_shrink: Literal["normal", "apeglm"] | None = None,
    lfc_threshold: float = 0.0,
    alt_hypothesis: Literal["greaterAbs", "lessAbs", "greater", "less"] = "greaterAbs",
    min_replicates: int = 7,
    max_iter: int = 100,
    groupby: str | None = None,
    random_state: SeedLike = 0,
    device: Device | None = None,
    n_jobs: int | None = None,
    client: Any = None,
    key_added: str = _keys.DESEQ,
    copy: bool = False,
) -> AnnData | None:
    """DESeq2 differential expression, every gene fitted at once (R DESeq2 1.38 rules).

    Size factors, dispersions (genewise MLE with Cox-Reid adjustment, trend, empirical-Bayes shrinkage), the
    negative-binomial GLM, Cook's outlier handling and the Wald or likelihood-ratio test, on samples x genes raw
    counts, on the CPU or a GPU.

    Parameters
    ----------
    adata
        Samples x genes AnnData with raw integer counts in ``X`` or ``layers[layer]`` (dense or sparse). A dask
        array (a lazily read AnnData) is loaded into memory: DESeq2 needs every sample of a gene together.
    design
        Formula over ``adata.obs`` columns (``"~condition"``, ``"~batch + condition"``, ``"~a + b + a:b"``,
        continuous covariates, ``C(lane)`` for an integer-coded factor, backticks for names with spaces: ``"~`my column`"``)
        or a ready design DataFrame (numeric columns), matched to the samples by its index (labels missing from
        ``obs_names``, duplicated or foreign are an error). The reference level of a factor is the first category
        of a pandas Categorical, else the first in sorted order (by character code: uppercase first, as R in the C
        locale; a warning says so when R in a UTF-8 locale would pick another reference). A boolean column is a
        two-level factor with reference False, coded 0/1 as R codes a logical.
    contrast
        ``[factor, numerator, reference]`` (levels as they are in ``obs``: strings, integers of an integer-coded
        factor, True/False of a boolean column), a design column name, a numeric vector over design columns, a
        Series or dict of weights labelled by design column (matched by name), or several of these as a list or as
        ``{name: contrast}`` (the names become the results' names); all are computed from one fit. Two contrasts
        with the same name are an error. ``None``: the last design column (R's default). R's list form (one or two
        lists of design column names, numerator and denominator: ``[["group[T.B]", "group[T.B]:cond[T.trt]"]]``)
        is one contrast. Any other contrast can be asked after the fit, without refitting, with
        :func:`gpuc.get.deseq_results`.
    layer
        Layer with the counts; ``None`` uses ``X``.
    size_factors
        ``"ratio"`` (median of ratios; switches to ``"poscounts"`` with a warning when every gene has a zero),
        ``"poscounts"``, ``"iterative"`` (R's ``type="iterate"``: rounds of dispersion fits and optim's L-BFGS-B on a
        trimmed likelihood; raises, as R, when it does not converge), or given size factors: an array in the order of ``obs``, or a Series,
        dict or one-column DataFrame labelled by ``obs_names`` (matched by name). ``params`` stores given factors as
        that DataFrame, so a replay after the samples were reordered gives each sample its own factor.
    control_genes
        Genes the size factors are estimated from (R ``estimateSizeFactors(dds, controlGenes=)``, e.g. spike-ins or
        housekeeping genes): gene names of ``var_names``, integer positions or a boolean mask over the genes. Every
        gene is still fitted and tested. Only with ``size_factors="ratio"`` or ``"poscounts"``; ``None``: all genes.
    normalization_factors
        Layer of ``adata`` with one positive factor per sample and gene (R ``normalizationFactors(dds) <- nf``, e.g.
        tximport's average transcript lengths times library sizes): they replace the size factors in every step
        (mean of normalised counts, dispersions, the GLM offset, Cook's distances, outlier replacement), used as
        given (R's setter does not rescale them; R's ``estimateSizeFactors(normMatrix=)`` route would first divide
        by their per-gene geometric mean). ``obs[f"{key}_size_factors"]`` is then NaN. Not with given
        ``size_factors``, ``control_genes`` or ``lfc_shrink="apeglm"``, which refuse them.
    fit_type
        Dispersion trend: ``"parametric"`` (falls back to a local fit as R when it fails), ``"local"``, ``"mean"``.
    test
        ``"wald"`` or ``"lrt"`` (likelihood-ratio test against ``reduced``).
    reduced
        Reduced formula for ``test="lrt"``, e.g. ``"~batch"`` or ``"~1"``.
    alpha
        Target FDR of independent filtering (R ``results()``'s ``alpha``, 0.1; earlier gpuc versions used PyDESeq2's
        0.05).
    cooks_filter
        Set p-values of genes with a Cook's outlier to NaN.
    independent_filter
        Independent filtering on the mean of normalised counts before Benjamini-Hochberg.
    refit_cooks
        Replace outlier counts in samples whose design cell has at least ``min_replicates`` samples and refit.
    lfc_shrink
        Also report shrunken log2 fold changes: ``"normal"`` (R ``lfcShrink(type="normal")``) or ``"apeglm"``
        (Cauchy prior with adaptive scale, as apeglm). P-values are unchanged.
    lfc_threshold
        log2 fold-change threshold for the Wald test.
    alt_hypothesis
        ``"greaterAbs"`` (absolute log2 fold change > threshold; with a threshold, R's "greaterAbs2014" form used by DESeq2
        1.34-1.42), ``"lessAbs"``, ``"greater"``, ``"less"``.
    min_replicates
        Minimum samples per design cell for outlier replacement.
    max_iter
        Iteration limit of the IRLS fit of the negative-binomial GLM per gene (R's ``maxit``, 100). Genes that
        reach it, or whose coefficients run away, are refitted as R refits them: ``optim``'s L-BFGS-B on the log2
        coefficients within +-30, with its own limit of 100 iterations; genes that do not converge there either
        keep ``betaConv`` False and are reported by a warning, as R reports them.
    groupby
        Column of ``obs`` (e.g. a cell type of a pseudobulk AnnData): fit and test each group separately. Samples
        with a missing label (NaN/None) belong to no group and are left out, with a warning that counts them; two
        labels that print the same (``1`` and ``"1"``) are an error. Group names are stored as ``uns`` keys percent-encoded (``"T/NK"`` as ``"T%2FNK"``) so they survive
        ``write_h5ad``; each group's entry keeps its original name under ``"group"``, and
        :func:`gpuc.get.deseq_results` takes the original name.
    random_state
        Seed of R's simulation of the dispersion prior variance, used only when the design leaves 3 or fewer residual
        degrees of freedom (samples minus coefficients); other fits draw no random numbers. The simulation is seeded
        with ``random_state + 2`` (2 is the seed R DESeq2 sets there), so the default 0 gives R's value: R's random
        stream is replayed draw for draw.
    {device}
    {n_jobs}
    client
        Where the fits run: ``None`` follows :attr:`gpuc.settings.client` (default: in this process);
        ``"default"`` or a ``distributed.Client``: with ``groupby``, one Dask task per group (see
        :func:`gpuc._dask.map_units`); without it, the per-gene steps (genewise dispersions, then MAP dispersions,
        GLM, Cook's distances and outlier refits) as Dask tasks over blocks of genes (~256 MB of work each), the
        global steps (size factors, dispersion trend, prior variance, independent filtering, Benjamini-Hochberg) in
        this process between them. Groups and single-block fits are bit-identical to the in-process fit; across
        several gene blocks, integer and boolean fields, filtering and size factors are identical and float fields
        agree to 1e-12 relative (BLAS rounds the last gene of a block with another kernel).
    key_added
        Prefix of every key written. Entries under these names that an earlier :func:`deseq` did not write (the
        data, another package's output) are never replaced: the call is refused.
    {copy}

    Returns
    -------
    ``None`` or, with ``copy=True``, the modified copy. ``uns[key]["params"]`` holds the call in a form that
    ``deseq(adata, **params)`` replays (the contrast as given, several as ``{name: contrast}``; given size factors
    and design DataFrames as themselves; control genes as their names; an R list-form contrast as its name
    mapped to its weights by design column). Writes (``key`` = ``key_added``):

    ``adata.obs[f"{key}_size_factors"]``
        Size factors (for ``groupby``, each sample's factor within its group).
    ``adata.var[f"{key}_<field>"]``
        Per-gene fit: baseMean, baseVar, allZero, dispGeneEst, dispGeneConv, dispFit, dispMAP, dispMAPConv,
        dispOutlier, dispersion, betaConv, betaIter, deviance, maxCooks, replace, refitted (not with ``groupby``).
    ``adata.varm[f"{key}_coef"]``
        Genes x design columns MLE coefficients on the log2 scale (not with ``groupby``).
    ``adata.varm[f"{key}_coef_cov"]``
        Their covariance (log2 scale, flattened p x p per gene).
    ``adata.layers[f"{key}_cooks"]``
        Cook's distances (not with ``groupby``).
    ``adata.uns[key]``
        ``params``; ``design_columns``; ``trend`` (type and coefficients); ``prior_disp_var``;
        ``var_log_disp_ests``; ``size_factor_type``; ``cooks_cutoff``; ``contrasts`` (name -> vector);
        ``results`` (name -> DataFrame with baseMean, log2FoldChange, lfcSE, stat, pvalue, padj, and
        ``log2FoldChange_shrunk``/``lfcSE_shrunk`` with ``lfc_shrink``); ``filtering`` (name -> independent
        filtering threshold and theta); ``messages``. With ``groupby`` the fit and results sit under
        ``uns[key]["groups"][group]``. Contrast names in ``contrasts``/``results``/``filtering`` are
        percent-encoded the same way. ``inputs``: the number and a digest of the sample and gene names, by which the
        getters align a gene subset by name and refuse objects joined after the fit.

    With ``groupby``, each group's entry also holds what a contrast asked later needs: ``samples`` (its
    ``obs_names``), ``coef`` and ``coef_cov`` (as the ``varm`` entries above) and ``cooks`` (samples x genes).

    Every output of an earlier run under the same ``key_added`` is removed first, so nothing from that fit remains
    (e.g. the per-gene ``var`` columns after a rerun with ``groupby``).

    Warns
    -----
    ConvergenceWarning
        When the GLM of some genes stopped at ``max_iter`` (their ``betaConv`` is False; once per call, with counts).
    GpucWarning
        For R's fallbacks (a parametric trend that failed, poscounts size factors), skipped groups, samples left
        out for a missing group label, a reference level that depends on letter case, and input that looks like
        single cells (DESeq2 takes every row as a replicate: sum cells per sample with :func:`pseudobulk` first).

    Raises
    ------
    InsufficientMemoryError
        Before any fit, when the estimated peak memory exceeds the device's free memory.

    Notes
    -----
    The defaults are R DESeq2 1.38's ``DESeq()`` and ``results()`` defaults (``alpha=0.1``, ``lfcThreshold=0``,
    ``altHypothesis="greaterAbs"``, ``independentFiltering=TRUE``, ``cooksCutoff`` the 0.99 quantile of
    F(p, m - p), ``fitType="parametric"``, ``sfType="ratio"``, ``minReplicatesForReplace=7``, ``test="Wald"``).
    Where gpuc differs, and why (``docs/conventions.md``, "DESeq2 defaults"):

    - ``lfc_shrink=None``: R's ``results()`` does not shrink either; shrinking is R's separate ``lfcShrink()``,
      whose own default type is apeglm. gpuc adds shrunken columns only when asked.
    - Benjamini-Hochberg is the only p-value adjustment (R's ``pAdjustMethod="BH"`` default; no other method).
    - ``minmu=0.5`` and R's ridge are fixed; there is no ``betaPrior`` (R's default FALSE) and no ``useT``
      (default FALSE).
    - ``max_iter=100`` is R's ``maxit``; genes that do not converge are refitted by R's optim (L-BFGS-B) search.
    """
    # the call's arguments, in signature order, as uns[key]["params"] will store them once checked
    call = {k: v for k, v in locals().items() if k not in ("adata", "client", "key_added", "copy")}
    check_adata(adata)
    check_key_added(key_added)
    check_bool("copy", copy)
    _keys.check_not_foreign(adata, _keys.deseq_outputs(key_added), key_added, "gpuc.tl.deseq", _keys.DESEQ_MARKER)
    params = _checked_params(adata, call)  # every option checked; labelled inputs aligned to obs_names
    where = f"adata.layers[{layer!r}]" if layer is not None else "adata.X"
    counts = load(get_matrix(adata, layer=layer), where)  # a lazily read (dask) matrix: DESeq2 needs all samples
    check_counts(counts, where)
    group_of = None
    if groupby is not None:
        check_key(adata.obs, groupby, "adata.obs")
        # labels as given: 1 and "1" are refused, missing labels leave their samples out with a warning
        group_of = group_labels(adata.obs[groupby], f"adata.obs[{groupby!r}]", what="sample(s)")
    backend = get_backend(device, counts, tool="deseq", work=float(counts.shape[0]) * float(counts.shape[1]))
    dask_client = resolve_client(client)

    # ---- plan: every group's design, contrasts and counts checked, and the memory, before any fit
    options = {k: params[k] for k in _FIT_OPTIONS} | {"random_state": params["random_state"] + 2}
    if params["control_genes"] is not None:
        options["control_genes"] = np.flatnonzero(adata.var_names.isin(params["control_genes"]))
    plan = plan_deseq(
        adata.obs, counts, params["design"], contrast, reduced=params["reduced"], group_of=group_of,
        groupby=groupby, size_factors=params["size_factors"], options=options, where=where,
    )  # fmt: skip
    if params["normalization_factors"] is not None:
        plan.size_factors = _normalization_factors(adata, params["normalization_factors"])
    check_deseq_memory(backend, plan, adata.n_obs, adata.n_vars, client=dask_client, n_jobs=n_jobs)

    # ---- one engine call
    start = logg.info(
        f"DESeq2: {adata.n_obs} samples x {adata.n_vars} genes"
        + ("" if groupby is None else f", {len(plan.units)} groups of {groupby!r}")
        + f" ({runs_on(backend, dask_client)})"
    )
    with interruptible("deseq"):
        fitted = run_deseq_plan(
            backend, counts, plan, gene_names=adata.var_names, client=dask_client, n_jobs=n_jobs, run_units=map_units
        )
    logg.info("    finished", time=start)

    # ---- everything computed and validated: write
    adata = adata.copy() if copy else adata
    params["contrast"] = _replayable_contrast(contrast, plan.first)
    if not isinstance(params["size_factors"], str):  # stored with their labels, so a replay matches them by name
        params["size_factors"] = pd.DataFrame({"size_factors": params["size_factors"]}, index=adata.obs_names.copy())
    inputs = record_inputs(obs_names=adata.obs_names, var_names=adata.var_names)
    with atomic_writes(adata):  # all or nothing: the old outputs or the new ones
        _write_deseq(adata, fitted, plan, params, key_added, backend.name)
        adata.uns[key_added]["inputs"] = inputs  # readers align genes by name and recognise joined objects
    return adata if copy else None


# the options of every analysis, as the engine names them (gpuc.deseq._analysis.run_analysis)
_FIT_OPTIONS = (
    "fit_type", "refit_cooks", "min_replicates", "max_iter", "alpha", "cooks_filter", "independent_filter",
    "lfc_threshold", "alt_hypothesis", "lfc_shrink",
)  # fmt: skip


def _checked_params(adata: AnnData, call: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a :func:`deseq` call, each checked, as ``uns[key]["params"]`` stores them (the contrast is
    made replayable after planning): numbers as Python numbers, the seed resolved, a design or reduced DataFrame and
    given size factors aligned to ``obs_names`` by label.
    """
    p = dict(call)
    check_choice("test", p["test"], ("wald", "lrt"))
    check_choice("fit_type", p["fit_type"], ("parametric", "local", "mean"))
    check_choice("lfc_shrink", p["lfc_shrink"], (None, "normal", "apeglm"))
    check_choice("alt_hypothesis", p["alt_hypothesis"], ("greaterAbs", "lessAbs", "greater", "less"))
    if isinstance(p["size_factors"], str):
        check_choice("size_factors", p["size_factors"], ("ratio", "poscounts", "iterative"))
    else:
        p["size_factors"] = _given_size_factors(p["size_factors"], adata)
    if p["normalization_factors"] is not None:
        layer = p["normalization_factors"]
        if not isinstance(layer, str):
            msg = "normalization_factors must name a layer of adata (samples x genes factors, as the counts)."
            raise TypeError(msg)
        check_key(adata.layers, layer, "adata.layers")
        if not (isinstance(p["size_factors"], str) and p["size_factors"] == "ratio") or p["control_genes"] is not None:
            msg = (
                "normalization_factors replace the size factors (as R's normalizationFactors): do not pass "
                "size_factors or control_genes with them."
            )
            raise ValueError(msg)
        if p["lfc_shrink"] == "apeglm":
            msg = "lfc_shrink='apeglm' does not take normalization_factors yet; use lfc_shrink='normal'."
            raise ValueError(msg)
        if layer == p["layer"]:
            msg = f"normalization_factors={layer!r} is the counts layer; pass the layer of factors."
            raise ValueError(msg)
    if p["control_genes"] is not None:
        if not (isinstance(p["size_factors"], str) and p["size_factors"] in ("ratio", "poscounts")):
            msg = (
                "control_genes= chooses the genes the size factors are estimated from, so it needs "
                "size_factors='ratio' or 'poscounts' (R: estimateSizeFactors(controlGenes=) with type ratio or "
                "poscounts)."
            )
            raise ValueError(msg)
        p["control_genes"] = _control_gene_names(p["control_genes"], adata)
    for name in ("cooks_filter", "independent_filter", "refit_cooks"):
        p[name] = check_bool(name, p[name])
    p["alpha"] = check_number("alpha", p["alpha"], low=0, high=1, low_open=True, high_open=True)
    p["lfc_threshold"] = check_number("lfc_threshold", p["lfc_threshold"], low=0)
    # a design (or reduced) DataFrame is matched to the samples by its index, never by row order
    for name in ("design", "reduced"):
        if isinstance(p[name], pd.DataFrame):
            p[name] = align_to_obs(p[name], adata, name)
    p["min_replicates"] = check_int("min_replicates", p["min_replicates"], minimum=1)
    p["random_state"] = resolve_random_state(p["random_state"])
    p["max_iter"] = check_int("max_iter", p["max_iter"], minimum=1)
    test, reduced = p["test"], p["reduced"]
    if test == "lrt" and reduced is None:
        msg = "test='lrt' needs reduced= (e.g. reduced='~1' or '~batch')."
        raise ValueError(msg)
    if test == "wald" and reduced is not None:
        msg = "reduced= is only used with test='lrt'."
        raise ValueError(msg)
    if test == "lrt" and (p["lfc_threshold"] != 0 or p["alt_hypothesis"] != "greaterAbs"):
        msg = "lfc_threshold and alt_hypothesis apply to the Wald test only."
        raise ValueError(msg)
    p["alpha"], p["lfc_threshold"] = float(p["alpha"]), float(p["lfc_threshold"])
    return p


def _write_deseq(
    adata: AnnData, fitted: list[GroupResult], plan: DeseqPlan, params: dict, key: str, device: str
) -> None:
    """Write the results of :func:`deseq` (see its Returns section), after removing every earlier output under
    ``key``.
    """
    _keys.drop_outputs(adata, _keys.deseq_outputs(key))
    sf_col = np.full(adata.n_obs, np.nan)
    for r in fitted:
        if np.ndim(r.analysis.fit.size_factors) == 1:  # normalisation factors (genes x samples) leave NaN
            sf_col[r.mask] = r.analysis.fit.size_factors
    adata.obs[_keys.deseq_size_factors(key)] = sf_col
    uns: dict[str, Any] = {"params": params, "device": device}
    if not plan.grouped:
        res = fitted[0].analysis
        fit = res.fit
        for f in _keys.DESEQ_GENE_FIELDS:
            adata.var[_keys.deseq_var(key, f)] = fit.genes[f]
        adata.varm[_keys.deseq_coef(key)] = fit.beta / np.log(2)
        adata.varm[_keys.deseq_coef_cov(key)] = (fit.cov / np.log(2) ** 2).reshape(fit.cov.shape[0], -1)
        adata.layers[_keys.deseq_cooks(key)] = fit.cooks.T.copy()
        uns.update(_analysis_uns(res))
    else:
        uns["groups"] = {}
        for r in fitted:
            entry = _analysis_uns(r.analysis)
            genes = r.analysis.fit.genes
            entry["genes"] = pd.DataFrame({f: genes[f] for f in _keys.DESEQ_GENE_FIELDS}, index=adata.var_names)
            # what a new contrast needs (gpuc.get.deseq_results): the group's samples, coefficients, covariances and
            # Cook's distances, as the varm / layers entries of a fit without groupby
            fit = r.analysis.fit
            entry["samples"] = np.asarray(adata.obs_names[r.mask], dtype=str)
            entry["coef"] = fit.beta / np.log(2)
            entry["coef_cov"] = (fit.cov / np.log(2) ** 2).reshape(fit.cov.shape[0], -1)
            entry["cooks"] = fit.cooks.T.copy()
            entry["n_samples"] = int(r.mask.sum())
            entry["group"] = r.group
            uns["groups"][_keys.encode_name(r.group)] = entry
        if plan.skipped:
            uns["skipped_groups"] = {_keys.encode_name(g): why for g, why in plan.skipped.items()}
    adata.uns[key] = uns


def _normalization_factors(adata: AnnData, layer: str) -> np.ndarray:
    """The layer of normalisation factors as a dense samples x genes float64 array, checked: positive and finite."""
    nf = load(adata.layers[layer], f"adata.layers[{layer!r}]")
    nf = nf.toarray() if hasattr(nf, "toarray") else nf
    nf = np.asarray(nf.get() if hasattr(nf, "get") else nf, dtype=np.float64)
    if nf.shape != adata.shape or not np.all(np.isfinite(nf)) or np.any(nf <= 0):
        msg = f"adata.layers[{layer!r}] must hold positive finite normalisation factors, one per sample and gene."
        raise ValueError(msg)
    return nf


def _control_gene_names(genes: Any, adata: AnnData) -> np.ndarray:
    """``control_genes`` as the names of the chosen genes, in ``var`` order (how ``params`` stores them): from names,
    integer positions or a boolean mask over the genes.
    """
    arr = np.asarray(list(genes) if isinstance(genes, set | frozenset) else genes)
    if arr.ndim != 1 or arr.shape[0] == 0:
        msg = "control_genes must be a non-empty 1-D list of gene names, integer positions or a boolean mask over the genes."
        raise ValueError(msg)
    names = adata.var_names
    if arr.dtype == bool:
        if arr.shape[0] != adata.n_vars:
            msg = f"control_genes as a boolean mask must have one entry per gene ({adata.n_vars}), got {arr.shape[0]}."
            raise ValueError(msg)
        mask = arr
    elif arr.dtype.kind in "iu":
        if arr.min() < -adata.n_vars or arr.max() >= adata.n_vars:
            msg = f"control_genes positions must lie in [0, {adata.n_vars}); got {arr.min()}..{arr.max()}."
            raise ValueError(msg)
        mask = np.zeros(adata.n_vars, dtype=bool)
        mask[arr] = True
    else:
        labels = pd.Index(arr.astype(str))
        unknown = labels[~labels.isin(names)]
        if len(unknown):
            msg = f"control_genes: {len(unknown)} name(s) not in adata.var_names ({_show_names(unknown)})."
            raise ValueError(msg)
        mask = names.isin(labels)
    return np.asarray(names[mask], dtype=str)


def _stored_trend(adata: AnnData, key: str) -> dict:
    """``uns[key]["trend"]`` of a :func:`deseq` fit, after checking the entry and the trend's fields (a file edited
    by hand gives a message naming the field, not an internal error).
    """
    from gpuc.get._checks import tool_output

    entry = tool_output(adata, key, "deseq")
    trend = entry.get("trend")
    need = {
        "parametric": ("asymptDisp", "extraPois"), "mean": ("mean",), "local": ("grid_logmean", "grid_logdisp"),
    }  # fmt: skip
    kind = trend.get("type") if isinstance(trend, dict) else None
    missing = [f for f in need.get(kind, ()) if f not in trend] if kind in need else ["type"]
    if missing:
        msg = (
            f"adata.uns[{key!r}]['trend'] is not a dispersion trend gpuc.tl.deseq wrote (missing or altered: "
            f"{missing}); refit with gpuc.tl.deseq(adata, ..., key_added={key!r}) or use blind=True."
        )
        raise ValueError(msg)
    return trend


def _given_size_factors(size_factors: Any, adata: AnnData) -> np.ndarray:
    """Given size factors as one positive float per sample: a Series or dict matched by obs name, an array by
    position.
    """
    if isinstance(size_factors, pd.DataFrame) and size_factors.shape[1] == 1:
        size_factors = size_factors.iloc[:, 0]  # as params stores them: one column labelled by obs_names
    sf = align_to_obs(size_factors, adata, "size_factors")
    try:
        sfv = np.asarray(sf, dtype=np.float64)
    except (TypeError, ValueError):
        sfv = None
    if sfv is None or sfv.shape != (adata.n_obs,) or not np.all(np.isfinite(sfv)) or np.any(sfv <= 0):
        msg = (
            f"size_factors given as values must hold {adata.n_obs} positive finite numbers, one per sample (an array "
            "in the order of adata.obs, or a Series/dict labelled by adata.obs_names)."
        )
        raise ValueError(msg)
    return sfv


def _replayable_contrast(contrast: Any, plan: Any) -> Any:
    """``params["contrast"]``: a form :func:`deseq` accepts again and ``write_h5ad`` can store.

    One contrast is kept as given (a Series of weights as a dict, arrays as arrays); several become ``{name:
    contrast}`` under the names of their results, so a replay gives the same names even when the contrasts are of
    different kinds (which h5ad could not store as one list).
    """

    def one(c: Any) -> Any:
        if isinstance(c, pd.Series):
            return {str(k): float(v) for k, v in c.items()}
        if isinstance(c, dict):
            return {str(k): float(v) for k, v in c.items()}
        if isinstance(c, tuple | list) and len(c) == 3 and isinstance(c[0], str):
            return [v.item() if isinstance(v, np.generic) else v for v in c]
        if isinstance(c, np.ndarray | list | tuple):
            arr = np.asarray(c)
            return arr.astype(np.float64) if arr.dtype.kind in "iufb" else arr
        return c

    if plan is not None and is_name_list(plan.design, contrast):
        # R's list form: h5ad cannot store ragged lists of names, so the replay gets the same vector under its name
        c = plan.contrasts[0]
        return {c.name: {col: float(w) for col, w in zip(plan.design.columns, c.vector, strict=True)}}
    parts = split_contrasts(contrast)
    if len(parts) == 1 and contrast_names(contrast) is None:
        return one(parts[0])
    names = contrast_names(contrast) or ([c.name for c in plan.contrasts] if plan is not None else None)
    if names is None:
        names = [str(i) for i in range(len(parts))]
    return {name: one(c) for name, c in zip(names, parts, strict=True)}


def _analysis_uns(res: Analysis) -> dict:
    """The ``uns`` entry of one analysis; contrast names percent-encoded (see :func:`gpuc._keys.encode_name`)."""
    fit = res.fit
    return {
        "design_columns": list(res.plan.design.columns),
        "trend": fit.trend.to_dict(),
        "prior_disp_var": float(fit.prior_var),
        "prior_disp_var_method": fit.prior_var_method,
        "var_log_disp_ests": float(fit.var_log_disp),
        "size_factor_type": fit.size_factor_type,
        "cooks_cutoff": float(fit.cooks_cutoff),
        "contrasts": {_keys.encode_name(c.name): np.asarray(c.vector) for c in res.plan.contrasts},
        "results": {_keys.encode_name(name): t for name, t in res.tables.items()},
        "filtering": {_keys.encode_name(name): f for name, f in res.filtering.items()},
        "messages": list(fit.messages),
    } | ({"lrt_df": int(fit.lrt_df)} if fit.lrt_df is not None else {})


# --------------------------------------------------------------------------------------------------------------------
# pseudobulk
# --------------------------------------------------------------------------------------------------------------------
def pseudobulk(
    adata: AnnData,
    sample_key: str,
    *,
    groupby: str | None = None,
    layer: str | None = None,
    min_cells: int = 10,
    min_counts: float = 0,
) -> AnnData:
    """Sum raw counts of the cells of each sample (and group) into a samples x genes AnnData for :func:`deseq`.

    The sums are those of :func:`scanpy.get.aggregate` with ``func="sum"`` over ``[sample_key, groupby]``: a
    sparse indicator matrix times the counts. Cells whose sample or group is missing (NaN) belong to no profile:
    they are dropped, with a warning giving their number.

    Parameters
    ----------
    adata
        Cells x genes AnnData with raw counts. ``X`` or the layer may be a dask array (``anndata.experimental.read_lazy``
        or ``read_elem_lazy``): it is then checked and summed chunk by chunk in one pass, never loaded whole.
    sample_key
        ``obs`` column naming the biological sample (donor, replicate) of each cell.
    groupby
        Optional ``obs`` column (e.g. cell type): one pseudobulk profile per (sample, group).
    layer
        Layer with the raw counts (e.g. ``"counts"``); ``None`` uses ``X``.
    min_cells
        Drop (sample, group) profiles made of fewer cells, with a warning that counts and names them.
    min_counts
        Drop profiles whose total count (over all genes) is below this, likewise. Together with ``min_cells`` this is
        decoupler's ``pp.filter_samples(min_cells=, min_counts=)`` (whose defaults are 10 and 1000) applied here;
        the default 0 keeps every profile with enough cells.

    Returns
    -------
    A new AnnData (profiles x genes, named ``"<sample>_<group>"``; when labels contain "_" and that join would give
    two profiles one name, another separator that occurs in no label, with a warning) with summed counts in ``X``
    (int64) and

    - ``obs``: ``sample_key``, ``groupby``, every ``obs`` column that is constant within each sample (e.g.
      condition, donor covariates), ``n_cells`` (int) and the quality-control columns of decoupler's
      ``pp.pseudobulk``: ``psbulk_cells`` (cells summed, float as decoupler writes it) and ``psbulk_counts`` (total
      count of the profile over all genes);
    - ``layers["psbulk_props"]``: per profile and gene, the fraction of the profile's cells with a non-zero count
      (decoupler's ``psbulk_props``);
    - ``var``: copied; ``uns["pseudobulk"]``: ``params``, ``n_dropped`` (profiles under ``min_cells`` or
      ``min_counts``) and ``n_cells_missing`` (cells without a sample or group).

    These are the fields decoupler's ``pp.filter_samples``, ``pp.filter_by_prop`` and ``pl.filter_samples``,
    ``pl.filter_by_prop`` read, and ``X`` is what its ``pp.filter_by_expr`` (edgeR's ``filterByExpr`` rule) and
    ``pl.filter_by_expr`` read: the same numbers as decoupler's own pseudobulk of the same cells. ``adata`` is not
    modified.

    Examples
    --------
    Drop shallow profiles and lowly expressed genes before :func:`deseq`, as decoupler's pseudobulk tutorial does::

        import decoupler as dc

        pb = gpuc.tl.pseudobulk(adata, "donor", groupby="cell_type", layer="counts", min_cells=10, min_counts=1000)
        b = pb[pb.obs["cell_type"] == "B"].copy()
        dc.pp.filter_by_prop(b, min_prop=0.1, min_smpls=2)
        dc.pp.filter_by_expr(b, group="condition", min_count=10, min_total_count=15)
    """
    check_adata(adata)
    check_key(adata.obs, sample_key, "adata.obs")
    if groupby is not None:
        check_key(adata.obs, groupby, "adata.obs")
    check_int("min_cells", min_cells, minimum=1)
    check_number("min_counts", min_counts, low=0)
    x = get_matrix(adata, layer=layer)
    what = f"adata.layers[{layer!r}]" if layer else "adata.X"
    lazy = is_dask_array(x)  # lazily read counts are checked and summed chunk by chunk, in one pass over the data
    if not lazy:
        check_raw_counts(x, what)
    keys = [sample_key] if groupby is None else [sample_key, groupby]
    for k in keys:  # 1 and "1" (or NaN and "nan") would be summed into one profile: refused, naming them
        check_printable_labels(adata.obs[k], f"adata.obs[{k!r}]")
    present = adata.obs[keys].notna().all(axis=1).to_numpy()
    n_missing = int((~present).sum())
    if not present.any():
        if lazy:
            check_raw_counts(x, what)  # bad counts are reported first, as in memory
        msg = f"every cell has a missing {' or '.join(map(repr, keys))} in adata.obs; nothing to sum."
        raise ValueError(msg)
    cells = np.flatnonzero(present)
    sample = adata.obs[sample_key].astype(str).to_numpy()[cells]
    labels = sample if groupby is None else sample + "\x1f" + adata.obs[groupby].astype(str).to_numpy()[cells]
    codes, uniq = pd.factorize(labels, sort=True)
    # one engine call: a sparse indicator times the counts, where the counts are; a lazy matrix chunk by chunk,
    # checked in the same pass (never loaded whole)
    summed, expressing, flags = profile_sums(x, codes, cells, len(uniq))
    if lazy:
        check_raw_counts(x, what, flags)
    if n_missing:
        warnings.warn(
            f"{n_missing} cell(s) with a missing {' or '.join(map(repr, keys))} were left out of the pseudobulk.",
            GpucWarning,
            stacklevel=2,
        )
    n_cells = np.bincount(codes, minlength=len(uniq))
    obs = pd.DataFrame(index=pd.Index(_profile_names(uniq), name=None))
    first = cells[np.unique(codes, return_index=True)[1]]
    obs[sample_key] = adata.obs[sample_key].to_numpy()[first]
    if groupby is not None:
        obs[groupby] = adata.obs[groupby].to_numpy()[first]
    for col in adata.obs.columns:
        if col in keys:
            continue
        vals = adata.obs[col].iloc[cells]
        per = vals.groupby(sample, observed=True).nunique(dropna=False)
        if (per <= 1).all():
            obs[col] = vals.to_numpy()[np.unique(codes, return_index=True)[1]]
    for col in obs.columns:
        if isinstance(adata.obs[col].dtype, pd.CategoricalDtype):
            obs[col] = pd.Categorical(obs[col], categories=adata.obs[col].cat.categories)
    totals = summed.sum(axis=1)
    obs["n_cells"] = n_cells
    obs[_keys.PSBULK_CELLS] = n_cells.astype(np.float64)
    obs[_keys.PSBULK_COUNTS] = totals
    few_cells, few_counts = n_cells < min_cells, totals < min_counts
    keep = ~(few_cells | few_counts)
    if not keep.any():
        msg = (
            f"no (sample, group) profile has at least min_cells={min_cells} cells and a total count of at least "
            f"min_counts={min_counts}."
        )
        raise ValueError(msg)
    for under, what, arg in (
        (few_cells, f"fewer than min_cells={min_cells} cells", "min_cells"),
        (few_counts & ~few_cells, f"a total count below min_counts={min_counts}", "min_counts"),
    ):
        if under.any():
            warnings.warn(
                f"{int(under.sum())} of {keep.size} (sample, group) profiles have {what} and were dropped "
                f"({_show_names(obs.index[under])}); pass a smaller {arg} to keep them.",
                GpucWarning,
                stacklevel=2,
            )
    props = expressing[keep] / n_cells[keep, None]
    out = AnnData(
        X=np.rint(summed[keep]).astype(np.int64),
        obs=obs.loc[keep].copy(),
        var=adata.var.copy(),
        layers={_keys.PSBULK_PROPS: props},
    )
    for col in out.obs.columns:
        if isinstance(out.obs[col].dtype, pd.CategoricalDtype):
            out.obs[col] = out.obs[col].cat.remove_unused_categories()
    out.uns[_keys.PSEUDOBULK] = {
        "params": {
            "sample_key": sample_key,
            "groupby": groupby,
            "layer": layer,
            "min_cells": int(min_cells),
            "min_counts": float(min_counts),
        },
        "n_dropped": int((~keep).sum()),
        "n_cells_missing": n_missing,
    }
    return out


def _show_names(names: Any, n: int = 5) -> str:
    names = list(names)
    return ", ".join(map(repr, names[:n])) + (f" and {len(names) - n} more" if len(names) > n else "")


PROFILE_SEPARATORS = ("_", "|", ":", "+", "~", "#", "@")


def _profile_names(keys: Any) -> list[str]:
    """Names of the pseudobulk profiles from their (sample, group) keys: ``"<sample>_<group>"``, unique by
    construction.

    Joining with "_" is ambiguous when labels contain "_" (("a_b", "c") and ("a", "b_c") both give "a_b_c"); then
    the first separator of :data:`PROFILE_SEPARATORS` that occurs in no label is used, which makes the join
    one-to-one, with a warning saying which. The ``obs`` columns keep the sample and group of each profile.
    """
    parts = [str(u).split("\x1f") for u in keys]
    names = ["_".join(p) for p in parts]
    if len(parts[0]) == 1 or len(set(names)) == len(names):
        return names
    for sep in PROFILE_SEPARATORS[1:]:
        if not any(sep in x for p in parts for x in p):
            warnings.warn(
                f"joining sample and group with '_' would give the same name to different profiles (labels contain "
                f"'_'); the profiles are named '<sample>{sep}<group>' instead.",
                GpucWarning,
                stacklevel=3,
            )
            return [sep.join(p) for p in parts]
    return [repr(tuple(p)) for p in parts]  # every separator occurs in the labels: a tuple's repr is one-to-one


# ---- shared by the transforms (vst here, rlog and normalized_counts in tl/_transforms.py) ----------------------------
def _check_layer_kept(layer: str | None, key_added: str, tool: str, default: str) -> None:
    if layer is not None and key_added == layer:
        msg = (
            f"{tool}(layer={layer!r}, key_added={key_added!r}) would replace the counts it transforms; pass another "
            f"key_added (default {default!r}) to keep adata.layers[{layer!r}]."
        )
        raise ValueError(msg)


def _check_fit_options(adata: AnnData, key_added: str, fit_type: str, blind: bool, copy: bool) -> None:
    """The checks :func:`vst` and :func:`gpuc.tl.rlog` make first, in this order."""
    check_adata(adata)
    check_key_added(key_added)
    check_choice("fit_type", fit_type, ("parametric", "local", "mean"))
    check_bool("blind", blind)
    check_bool("copy", copy)


def _transform_counts(
    adata: AnnData,
    layer: str | None,
    key_added: str,
    tool: str,
    default: str,
    outputs: dict[str, list[str]],
    marker: str,
) -> Any:
    """The counts that ``gpuc.tl.<tool>`` transforms (``layer``; ``None``: ``X``), in memory and checked, after
    refusing a ``key_added`` that names them (:func:`_check_layer_kept`) or another tool's outputs (``outputs``).
    A lazily read (dask) matrix is loaded: DESeq2 needs every sample of a gene at once.
    """
    _check_layer_kept(layer, key_added, tool, default)
    _keys.check_not_foreign(adata, outputs, key_added, f"gpuc.tl.{tool}", marker)
    where = f"adata.layers[{layer!r}]" if layer else "adata.X"
    counts = load(get_matrix(adata, layer=layer), where)
    check_counts(counts, where)
    return counts


def _fitted(adata: AnnData, key: str) -> None:
    """Refuse ``blind=False`` without a single (not ``groupby``) :func:`gpuc.tl.deseq` run under ``key``."""
    check_key(adata.uns, key, "adata.uns", "Run gpuc.tl.deseq first, or use blind=True.")
    if "groups" in adata.uns[key]:
        msg = "blind=False is not available after a groupby DESeq2 run; subset one group first."
        raise ValueError(msg)
    check_key(adata.obs, _keys.deseq_size_factors(key), "adata.obs")


# --------------------------------------------------------------------------------------------------------------------
# vst
# --------------------------------------------------------------------------------------------------------------------
@doc_params()
def vst(
    adata: AnnData,
    *,
    layer: str | None = None,
    blind: bool = True,
    fit_type: Literal["parametric", "local", "mean"] = "parametric",
    key: str = _keys.DESEQ,
    device: Device | None = None,
    n_jobs: int | None = None,
    key_added: str = _keys.VST,
    copy: bool = False,
) -> AnnData | None:
    """Variance-stabilising transformation of counts (R ``varianceStabilizingTransformation``).

    Parameters
    ----------
    adata
        Samples x genes AnnData with raw counts. A dask array (a lazily read AnnData) is loaded into memory:
        DESeq2 needs every sample of a gene together.
    layer
        Layer with the counts; ``None`` uses ``X``.
    blind
        Fit the dispersion trend with an intercept-only design (R's default). ``blind=False`` reuses the size
        factors and trend of an earlier :func:`deseq` run stored under ``key``.
    fit_type
        Trend type for a blind fit.
    key
        ``key_added`` of the :func:`deseq` run used when ``blind=False``.
    {device}
    {n_jobs}
    key_added
        Name of the layer written. It may not name the counts read (``layer``) nor a layer that an earlier
        :func:`vst` under this key did not write (raw counts, another tool's output): that is refused.
    {copy}

    Returns
    -------
    ``None`` or the modified copy. Writes ``adata.layers[key_added]`` (log2-like values, samples x genes) and
    ``adata.uns[key_added]`` (``params``, ``device``, ``trend``); replaces both if they exist.

    Warns
    -----
    GpucWarning
        When the trend fit fell back to another type, as R does.

    Raises
    ------
    InsufficientMemoryError
        Before anything is computed, when the estimated peak memory exceeds the device's free memory.
    """
    _check_fit_options(adata, key_added, fit_type, blind, copy)
    counts = _transform_counts(adata, layer, key_added, "vst", "vst", _keys.vst_outputs(key_added), _keys.VST_MARKER)

    # ---- plan: a blind fit, or the size factors and trend of an earlier deseq run
    plan = VstPlan(fit_type=fit_type)
    if not blind:
        _fitted(adata, key)
        if adata.uns[key]["params"].get("normalization_factors") is not None:
            msg = "blind=False is not available after a DESeq2 run with normalization_factors."
            raise ValueError(msg)
        sf = adata.obs[_keys.deseq_size_factors(key)].to_numpy(dtype=np.float64)
        plan = VstPlan(fit_type=fit_type, size_factors=sf, trend=_stored_trend(adata, key))
    backend = get_backend(device, counts, tool="deseq", work=float(counts.shape[0]) * float(counts.shape[1]))
    check_memory(
        backend,
        vst_peak_bytes(adata.n_obs, adata.n_vars),
        f"the VST of {adata.n_obs} samples x {adata.n_vars} genes",
        "Drop genes with low counts first, or transform subsets of genes separately.",
    )

    # ---- one engine call
    with interruptible("vst"):
        out, trend, note = run_vst(backend, counts, plan, n_jobs=n_jobs)
    if note:
        warnings.warn(note, GpucWarning, stacklevel=2)

    # ---- write
    adata = adata.copy() if copy else adata
    params = {
        "layer": layer,
        "blind": bool(blind),
        "fit_type": fit_type,
        "key": key,
        "device": device,
        "n_jobs": n_jobs,
    }
    with atomic_writes(adata):  # all or nothing
        _keys.drop_outputs(adata, _keys.vst_outputs(key_added))
        adata.layers[key_added] = out
        adata.uns[key_added] = {"params": params, "device": backend.name, "trend": trend}
    return adata if copy else None
