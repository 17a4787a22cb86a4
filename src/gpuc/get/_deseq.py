"""``gpuc.get.deseq_results`` and ``gpuc.get.deseq_summary``: results of :func:`gpuc.tl.deseq`, for the contrasts
computed at fit time and for any other contrast of the same fit (R ``results()`` / ``lfcShrink()`` after ``DESeq()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import pandas as pd
from anndata import AnnData

from gpuc import _keys
from gpuc._validate import check_adata, check_bool, check_choice, check_number, get_matrix
from gpuc.get._checks import deseq_entry

ALT_HYPOTHESES = ("greaterAbs", "lessAbs", "greater", "less")
# the options of R's results() that deseq_results takes, with what an output of gpuc.tl.deseq older than them means
_OPTIONS = ("alpha", "lfc_threshold", "alt_hypothesis", "cooks_filter", "independent_filter", "lfc_shrink")
_OLD_DEFAULTS = {
    "alpha": 0.05,
    "lfc_threshold": 0.0,
    "alt_hypothesis": "greaterAbs",
    "cooks_filter": True,
    "independent_filter": True,
    "lfc_shrink": None,
}


def _stored_name(entry: Mapping, contrast: Any) -> str | None:
    """The stored (percent-encoded) results key of ``contrast`` when it is found by name (``None``: the first
    contrast; a results name; ``[factor, numerator, reference]`` by its results name), else None.
    """
    stored = list(entry["results"])
    names = [_keys.decode_name(n) for n in stored]
    if contrast is None:
        return stored[0]
    if isinstance(contrast, str) and contrast in names:
        return _keys.encode_name(contrast)
    if isinstance(contrast, list | tuple) and len(contrast) == 3 and all(isinstance(c, str) for c in contrast):
        name = f"{contrast[0]}_{contrast[1]}_vs_{contrast[2]}"
        if name in names:
            return _keys.encode_name(name)
    return None


def _fit_options(params: Mapping) -> dict[str, Any]:
    """The results options of the :func:`gpuc.tl.deseq` call (those an older version did not record: its defaults)."""
    return {k: params.get(k, _OLD_DEFAULTS[k]) for k in _OPTIONS}


def _checked_options(given: dict[str, Any], fit: dict[str, Any], test: str) -> dict[str, Any]:
    """``given`` options (None: the fit's), each checked as R's ``results()`` checks it."""
    o = {k: (fit[k] if v is None else v) for k, v in given.items()}
    if given["lfc_shrink"] is False:  # no shrunken columns, even where the fit added them
        o["lfc_shrink"] = None
    o["alpha"] = float(check_number("alpha", o["alpha"], low=0, high=1, low_open=True, high_open=True))
    o["lfc_threshold"] = float(check_number("lfc_threshold", o["lfc_threshold"], low=0))
    check_choice("alt_hypothesis", o["alt_hypothesis"], ALT_HYPOTHESES)
    check_bool("independent_filter", o["independent_filter"])
    check_choice("lfc_shrink", o["lfc_shrink"], (None, "normal", "apeglm"))
    cf = o["cooks_filter"]
    if not isinstance(cf, bool | np.bool_):
        cf = float(check_number("cooks_filter", cf, low=0))
    o["cooks_filter"] = cf if not isinstance(cf, np.bool_) else bool(cf)
    if o["alt_hypothesis"] == "lessAbs" and o["lfc_threshold"] == 0:
        msg = "alt_hypothesis='lessAbs' needs a positive lfc_threshold (as R's results())."
        raise ValueError(msg)
    if test == "lrt" and (o["lfc_threshold"] != 0 or o["alt_hypothesis"] != "greaterAbs"):
        msg = "lfc_threshold and alt_hypothesis apply to the Wald test only; this fit used test='lrt'."
        raise ValueError(msg)
    return o


def _with_attrs(table: pd.DataFrame, name: str, opts: dict[str, Any], filtering: Mapping, test: str) -> pd.DataFrame:
    """``table`` with R's ``metadata(res)`` as ``DataFrame.attrs`` (what :func:`deseq_summary` reads)."""
    ft = filtering.get("filter_threshold") if opts["independent_filter"] else None
    table.attrs = {
        "contrast": name,
        "test": test,
        "alpha": float(opts["alpha"]),
        "lfc_threshold": float(opts["lfc_threshold"]),
        "alt_hypothesis": opts["alt_hypothesis"],
        "filter_threshold": None if ft is None else float(np.asarray(ft)),
    }
    return table


def deseq_results(
    adata: AnnData,
    contrast: Any = None,
    *,
    key: str = _keys.DESEQ,
    group: str | None = None,
    alpha: float | None = None,
    lfc_threshold: float | None = None,
    alt_hypothesis: Literal["greaterAbs", "lessAbs", "greater", "less"] | None = None,
    cooks_filter: bool | float | None = None,
    independent_filter: bool | None = None,
    lfc_shrink: Literal["normal", "apeglm", False] | None = None,
    list_values: tuple[float, float] = (1.0, -1.0),
) -> pd.DataFrame:
    """DESeq2 results for one contrast as a DataFrame (genes x baseMean, log2FoldChange, lfcSE, stat, pvalue, padj):
    R ``results(dds, contrast=...)`` and ``lfcShrink(dds, contrast=...)`` on the fit :func:`gpuc.tl.deseq` stored.

    A contrast computed at fit time with the fit's options returns the stored table. Any other contrast, or other
    options, is computed from the stored fit without refitting: the Wald statistic of the contrast c is
    c'beta / sqrt(c' Sigma c) from the stored coefficients and covariances (R ``getContrast``), then R's rules in
    R's order: a zero fold change where the compared samples have no count, the log2 fold-change threshold and
    alternative hypothesis, the Cook's filter (with R's heuristic in a design of one two-level factor), genes whose
    replaced counts left no count, and independent filtering with Benjamini-Hochberg. After ``test="lrt"`` the
    statistic and p-value are the likelihood-ratio test's (as R), only the fold change follows the contrast.

    Parameters
    ----------
    adata
        AnnData on which :func:`gpuc.tl.deseq` ran. A new contrast also reads its counts (``X`` or the layer the
        fit read), ``obs`` (to rebuild the design) and the stored size factors, coefficients and Cook's distances:
        they must be those of the fit.
    contrast
        ``None`` (the first contrast computed), a results name (e.g. ``"condition_treated_vs_untreated"``) or any
        contrast :func:`gpuc.tl.deseq` accepts: ``[factor, numerator, reference]``, a design column name (R's
        ``name=``), a numeric vector over the design columns, a Series or dict of weights by design column, or R's
        list form: one or two lists of design column names, numerator and denominator (R
        ``contrast=list(c("a", "b"), "c")`` is ``[["a", "b"], ["c"]]``; columns as the design names them,
        ``"group[T.B]:cond[T.trt]"``, or as results name them, ``"group_B:cond_trt"``).
    key
        ``key_added`` used by :func:`gpuc.tl.deseq`.
    group
        The group, when :func:`gpuc.tl.deseq` ran with ``groupby``.
    alpha
        Target FDR of independent filtering (R's ``alpha``). ``None``, as every option below: the value the fit
        used (:func:`gpuc.tl.deseq`'s defaults are R's: 0.1 here).
    lfc_threshold
        log2 fold-change threshold of the Wald test (R's ``lfcThreshold``).
    alt_hypothesis
        ``"greaterAbs"``, ``"lessAbs"``, ``"greater"`` or ``"less"`` (R's ``altHypothesis``; "greaterAbs" with a
        threshold is R 1.38's form, see :func:`gpuc.tl.deseq`).
    cooks_filter
        R's ``cooksCutoff``: True (the default cut-off, the 0.99 quantile of F(p, m - p)), False (no filter), or a
        number (that cut-off on the stored maximum Cook's distances).
    independent_filter
        R's ``independentFiltering``.
    lfc_shrink
        ``"normal"`` (R ``lfcShrink(type="normal")``: a zero-centred normal prior on the coefficients of the
        expanded model matrix, fitted again with the stored dispersions, the MLE untouched; main-effect designs
        only, as R) or ``"apeglm"`` (one design coefficient). Adds ``log2FoldChange_shrunk`` and ``lfcSE_shrunk``.
        A contrast that is one design coefficient is shrunk as R's ``lfcShrink(coef=)``, any other as
        ``lfcShrink(contrast=)`` (R's two differ). ``False``: no shrunken columns, even when the fit shrank.
    list_values
        Weights of the numerator and denominator columns of a list contrast (R's ``listValues``).

    Returns
    -------
    A new DataFrame (genes in ``var`` order). ``DataFrame.attrs`` holds R's ``metadata(res)``: ``contrast`` (its
    name), ``test``, ``alpha``, ``lfc_threshold``, ``alt_hypothesis`` and ``filter_threshold`` (the mean count of
    independent filtering; None without it).

    Raises
    ------
    KeyError
        For a contrast name that was not computed and is no design column.
    ValueError
        For a contrast the design cannot form, options R refuses (``lessAbs`` without a threshold, a threshold
        after a likelihood-ratio test), and a new contrast of a fit whose stored arrays are missing or no longer
        match the AnnData (a ``groupby`` fit of gpuc before per-group coefficients were stored: rerun
        :func:`gpuc.tl.deseq`).
    """
    check_adata(adata)
    entry = deseq_entry(adata, key, group)
    uns = adata.uns[key]
    params = uns["params"]
    test = str(params.get("test", "wald"))
    fit_opts = _fit_options(params)
    given = {
        "alpha": alpha,
        "lfc_threshold": lfc_threshold,
        "alt_hypothesis": alt_hypothesis,
        "cooks_filter": cooks_filter,
        "independent_filter": independent_filter,
        "lfc_shrink": lfc_shrink,
    }
    opts = _checked_options(given, fit_opts, test)
    same = all(_same(opts[k], fit_opts[k]) for k in _OPTIONS)
    name = _stored_name(entry, contrast)
    if name is not None and same:
        return _stored_table(entry, name, opts, test)
    return _new_contrast(adata, key, entry, params, contrast, opts, test, list_values, same)


def _same(a: Any, b: Any) -> bool:
    """Two option values are the same (True is not 1: a boolean Cook's filter is not a cut-off of 1)."""
    if isinstance(a, bool | np.bool_) or isinstance(b, bool | np.bool_):
        return isinstance(a, bool | np.bool_) and isinstance(b, bool | np.bool_) and bool(a) == bool(b)
    if a is None or b is None or isinstance(a, str) or isinstance(b, str):
        return a == b
    return float(a) == float(b)


def _stored_table(entry: Mapping, name: str, opts: dict[str, Any], test: str) -> pd.DataFrame:
    filtering = entry.get("filtering", {}).get(name, {})
    return _with_attrs(entry["results"][name].copy(), _keys.decode_name(name), opts, filtering, test)


def _new_contrast(
    adata: AnnData,
    key: str,
    entry: Mapping,
    params: Mapping,
    contrast: Any,
    opts: dict[str, Any],
    test: str,
    list_values: tuple[float, float],
    same: bool,
) -> pd.DataFrame:
    """R ``results()`` (and ``lfcShrink``) of ``contrast`` from the stored fit (see :func:`deseq_results`)."""
    from gpuc._backend import get_backend
    from gpuc.deseq._analysis import AnalysisOptions, fit_from_stored, resolve_contrast, results_table
    from gpuc.deseq._design import build_design

    stored = _stored_arrays(adata, adata.uns[key], entry, key, params.get("normalization_factors"))
    obs = adata.obs.iloc[stored["rows"]]
    obs = obs.assign(
        **{
            c: obs[c].cat.remove_unused_categories()
            for c in obs.columns
            if isinstance(obs[c].dtype, pd.CategoricalDtype)
        }
    )
    design = params["design"]
    if isinstance(design, pd.DataFrame):
        design = design.loc[obs.index]
    dsg = build_design(obs, design)
    if list(dsg.columns) != [str(c) for c in entry["design_columns"]]:
        msg = (
            f"the design rebuilt from adata.obs has columns {dsg.columns}, but the fit's were "
            f"{list(entry['design_columns'])}: adata.obs changed since gpuc.tl.deseq. Rerun it to ask new contrasts."
        )
        raise ValueError(msg)
    if isinstance(contrast, str) and contrast not in dsg.columns and _column(dsg, contrast) is None:
        names = [_keys.decode_name(n) for n in entry["results"]]
        msg = f"no results named {contrast!r} and no design column of that name; results: {names}, columns: {dsg.columns}."
        raise KeyError(msg)
    if isinstance(contrast, str):
        contrast = dsg.columns[_column(dsg, contrast)]  # type: ignore[index]
    c = resolve_contrast(dsg, contrast, list_values=list_values)
    if same:  # the vector of a contrast computed at fit time: its stored table
        for sname, v in entry["contrasts"].items():
            v = np.asarray(v, dtype=np.float64)
            if v.shape == c.vector.shape and np.array_equal(v, c.vector):
                return _stored_table(entry, sname, opts, test)
    layer = params.get("layer")
    where = f"adata.layers[{layer!r}]" if layer is not None else "adata.X"
    counts = _host_rows(get_matrix(adata, layer=layer), stored["rows"], where)
    lrt_stat = None
    if test == "lrt":
        lrt_stat = next(iter(entry["results"].values()))["stat"].to_numpy(dtype=np.float64)
    fit = fit_from_stored(
        coef_log2=stored["coef"],
        cov_log2=stored["cov"],
        genes=stored["genes"],
        counts=np.asarray(counts, dtype=np.float64).T,
        size_factors=stored["size_factors"],
        design=dsg.matrix,
        cooks=stored["cooks"],
        cooks_cutoff=float(entry["cooks_cutoff"]),
        lrt_stat=lrt_stat,
        lrt_df=None if test != "lrt" else int(entry["lrt_df"]),
    )
    options = AnalysisOptions(**{k: opts[k] for k in _OPTIONS})
    table, filtering = results_table(
        get_backend("cpu"), fit, dsg, c, gene_names=adata.var_names, options=options, test=test
    )
    return _with_attrs(table, c.name, opts, filtering, test)


def _column(design: Any, name: str) -> int | None:
    from gpuc.deseq._analysis import _column_index

    return _column_index(design, name)


def _host_rows(x: Any, rows: np.ndarray, where: str) -> np.ndarray:
    """Rows ``rows`` of a samples x genes matrix as a dense float64 host array, wherever it is (numpy, scipy sparse,
    CuPy / cupyx on a GPU, a lazily read dask array).
    """
    from gpuc._backend import to_host
    from gpuc._lazy import load

    x = load(x, where)
    part = x[rows] if rows.shape[0] != x.shape[0] or not np.array_equal(rows, np.arange(x.shape[0])) else x
    part = to_host(part)
    part = part.toarray() if hasattr(part, "toarray") else part
    part = to_host(part)
    return np.asarray(part, dtype=np.float64)


_NEEDED = ("baseMean", "allZero", "maxCooks", "replace", "dispFit", "dispersion")


def _stored_arrays(adata: AnnData, uns: Mapping, entry: Mapping, key: str, nf_layer: str | None) -> dict[str, Any]:
    """The fit's arrays a new contrast needs, with the rows (samples) of ``adata`` it was fitted on; a clear error
    when they are missing or no longer match ``adata``. With normalisation factors (``nf_layer``) the size factors
    are that layer's genes x samples factors.
    """
    rerun = f"Rerun gpuc.tl.deseq(..., key_added={key!r}) to ask new contrasts."
    sf_col = _keys.deseq_size_factors(key)
    if nf_layer is not None and nf_layer not in adata.layers:
        msg = f"adata.layers[{nf_layer!r}] (the fit's normalisation factors) is missing. {rerun}"
        raise ValueError(msg)
    if sf_col not in adata.obs:
        msg = f"adata.obs[{sf_col!r}] (the fit's size factors) is missing. {rerun}"
        raise ValueError(msg)
    if "groups" in uns:
        if "coef" not in entry or "samples" not in entry:
            msg = (
                "this groupby fit was written by a gpuc version that did not store per-group coefficients, so only "
                f"the contrasts computed at fit time can be read. {rerun}"
            )
            raise ValueError(msg)
        rows = adata.obs_names.get_indexer(pd.Index(np.asarray(entry["samples"], dtype=str)))
        if (rows < 0).any():
            msg = f"samples of this group's fit are no longer in adata.obs_names. {rerun}"
            raise ValueError(msg)
        genes = entry["genes"]
        coef, cov, cooks = entry["coef"], entry["coef_cov"], entry["cooks"]
        gene_fields = {f: np.asarray(genes[f]) for f in _NEEDED}
    else:
        rows = np.arange(adata.n_obs)
        slots = {
            "varm": [_keys.deseq_coef(key), _keys.deseq_coef_cov(key)],
            "layers": [_keys.deseq_cooks(key)],
            "var": [_keys.deseq_var(key, f) for f in _NEEDED],
        }
        for slot, names in slots.items():
            for n in names:
                if n not in getattr(adata, slot):
                    msg = f"adata.{slot}[{n!r}] (part of the stored fit) is missing. {rerun}"
                    raise ValueError(msg)
        coef, cov = adata.varm[_keys.deseq_coef(key)], adata.varm[_keys.deseq_coef_cov(key)]
        cooks = adata.layers[_keys.deseq_cooks(key)]
        gene_fields = {f: adata.var[_keys.deseq_var(key, f)].to_numpy() for f in _NEEDED}
    coef = np.asarray(coef, dtype=np.float64)
    p = coef.shape[1]
    cov = np.asarray(cov, dtype=np.float64).reshape(coef.shape[0], p, p)
    cooks = np.asarray(cooks, dtype=np.float64)
    if nf_layer is None:
        sf = adata.obs[sf_col].to_numpy(dtype=np.float64)[rows]
    else:
        sf = _host_rows(adata.layers[nf_layer], rows, f"adata.layers[{nf_layer!r}]").T.copy()
    if coef.shape[0] != adata.n_vars or cooks.shape != (rows.shape[0], adata.n_vars) or not np.all(np.isfinite(sf)):
        msg = f"the stored fit does not match this AnnData's genes and samples. {rerun}"
        raise ValueError(msg)
    return {"rows": rows, "coef": coef, "cov": cov, "cooks": cooks.T, "genes": gene_fields, "size_factors": sf}


# --------------------------------------------------------------------------------------------------------------------
# summary
# --------------------------------------------------------------------------------------------------------------------
def _r_format2(x: float) -> str:
    """R ``format(x, digits=2)`` of a percentage: two significant digits, never scientific for 0-100."""
    if x == 0:
        return "0"
    if abs(x) >= 10:
        return str(round(x))
    return f"{x:.2g}"


def deseq_summary(
    adata: AnnData | pd.DataFrame,
    contrast: Any = None,
    *,
    key: str = _keys.DESEQ,
    group: str | None = None,
    alpha: float | None = None,
    show: bool = True,
    **results_options: Any,
) -> pd.Series:
    """R ``summary(res)``: how many genes are up, down, Cook's outliers and filtered for low counts.

    Parameters
    ----------
    adata
        AnnData on which :func:`gpuc.tl.deseq` ran (the table is :func:`deseq_results` of ``contrast``), or a
        table :func:`deseq_results` returned.
    contrast
        As :func:`deseq_results` (ignored for a table).
    key
        As :func:`deseq_results`.
    group
        As :func:`deseq_results`.
    alpha
        Adjusted p-value threshold of the counts (R ``summary(res, alpha=)``); ``None``: the alpha of the results
        (their independent filtering's), as R.
    show
        Print R's text.
    **results_options
        Passed to :func:`deseq_results` (``lfc_threshold``, ``alt_hypothesis``, ``cooks_filter`` ...).

    Returns
    -------
    A Series with R's numbers: ``n_nonzero`` (genes with a count: baseMean > 0), ``alpha``, ``lfc_threshold``,
    ``up`` and ``down`` (padj < alpha and log2FoldChange above the threshold / below minus it), ``outliers``
    (baseMean > 0 and no p-value: Cook's outliers), ``low_counts`` (a p-value but no adjusted one: filtered) and
    ``filter_threshold`` (the mean count below which genes were filtered, rounded as R prints it; 0 without
    independent filtering).
    """
    check_bool("show", show)
    if isinstance(adata, pd.DataFrame):
        if results_options:
            msg = f"options {sorted(results_options)} apply to an AnnData, not to a results table."
            raise TypeError(msg)
        res = adata
    else:
        res = deseq_results(adata, contrast, key=key, group=group, **results_options)
    missing = [c for c in ("baseMean", "log2FoldChange", "pvalue", "padj") if c not in res.columns]
    if missing:
        msg = f"the table lacks the columns {missing} of gpuc.get.deseq_results."
        raise ValueError(msg)
    meta = res.attrs
    a = (
        float(meta.get("alpha", 0.1))
        if alpha is None
        else float(check_number("alpha", alpha, low=0, high=1, low_open=True, high_open=True))
    )
    t = float(meta.get("lfc_threshold", 0.0) or 0.0)
    bm, lfc = res["baseMean"].to_numpy(), res["log2FoldChange"].to_numpy()
    pv, padj = res["pvalue"].to_numpy(), res["padj"].to_numpy()
    with np.errstate(invalid="ignore"):
        notallzero = int(np.sum(bm > 0))
        up = int(np.sum((padj < a) & (lfc > t)))
        down = int(np.sum((padj < a) & (lfc < -t)))
    filt = int(np.sum(~np.isnan(pv) & np.isnan(padj)))
    outlier = int(np.sum((bm > 0) & np.isnan(pv)))
    ft = meta.get("filter_threshold")
    ft = 0 if ft is None else round(float(ft))
    out = pd.Series(
        {
            "n_nonzero": notallzero,
            "alpha": a,
            "lfc_threshold": t,
            "up": up,
            "down": down,
            "outliers": outlier,
            "low_counts": filt,
            "filter_threshold": ft,
        },
        dtype=object,
        name=meta.get("contrast"),
    )
    if show:
        pct = lambda k: _r_format2(k / notallzero * 100) if notallzero else "NaN"  # noqa: E731
        pt = "0 (up)       " if t == 0 else f"{t:.2f} (up)    "
        mt = "0 (down)     " if t == 0 else f"{-t:.2f} (down) "
        print(
            f"\nout of {notallzero} with nonzero total read count\n"
            f"adjusted p-value < {a:g}\n"
            f"LFC > {pt}: {up}, {pct(up)}%\n"
            f"LFC < {mt}: {down}, {pct(down)}%\n"
            f"outliers [1]       : {outlier}, {pct(outlier)}%\n"
            f"low counts [2]     : {filt}, {pct(filt)}%\n"
            f"(mean count < {ft})\n"
            "[1] see 'cooks_filter' argument of gpuc.get.deseq_results\n"
            "[2] see 'independent_filter' argument of gpuc.get.deseq_results\n"
        )
    return out
