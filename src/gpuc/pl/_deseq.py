"""Plots of :func:`gpuc.tl.deseq` output (volcano, MA and dispersion plots) and of the transformed counts (R's plotPCA
and plotCounts).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from anndata import AnnData
from matplotlib.axes import Axes

from gpuc import _keys
from gpuc.get._checks import deseq_entry
from gpuc.get._deseq import deseq_results
from gpuc.pl._utils import category_colors, check_number, finish, place_labels, plot_function, single_ax


def _results_for_plot(
    adata: AnnData, contrast: Any, key: str, group: Any, alpha: float | None, *, shrunk: bool
) -> tuple[Any, str, float]:
    """The results table, the fold-change column to draw (MLE or shrunken) and the significance level."""
    df = deseq_results(adata, contrast, key=key, group=group)
    alpha = float(adata.uns[key]["params"]["alpha"]) if alpha is None else check_number("alpha", alpha, low=0, high=1)
    col = "log2FoldChange_shrunk" if shrunk else "log2FoldChange"
    if col not in df:
        msg = f"{col!r} not in the results; run gpuc.tl.deseq with lfc_shrink=."
        raise KeyError(msg)
    return df, col, alpha


SYMBOL_COLUMNS = ("gene_symbols", "gene_symbol", "symbol", "symbols", "gene_name", "gene_names")


def _gene_labels(adata: AnnData, index: Any, gene_symbols: str | None) -> np.ndarray:
    """Labels of the genes ``index``: ``var[gene_symbols]``, else the first symbol column found in ``var``
    (:data:`SYMBOL_COLUMNS`), else the gene names.
    """
    if gene_symbols is not None:
        if gene_symbols not in adata.var:
            msg = f"gene_symbols={gene_symbols!r} is not a column of adata.var."
            raise KeyError(msg)
        col = gene_symbols
    else:
        col = next((c for c in SYMBOL_COLUMNS if c in adata.var), None)
    if col is None:
        return np.asarray(index).astype(str)
    sym = adata.var[col].reindex(index)
    return np.where(sym.isna(), np.asarray(index).astype(str), sym.astype(str))


def _label_top(ax: Any, x: np.ndarray, y: np.ndarray, names: Any, order: np.ndarray, n_top: int) -> None:
    """Label the first ``n_top`` genes of ``order`` (the significant genes, most significant first)."""
    top = [i for i in order[:n_top] if np.isfinite(x[i]) and np.isfinite(y[i])]
    place_labels(ax, x[top], y[top], [names[i] for i in top])


def _significant_order(p: np.ndarray, drawn: np.ndarray, sig: np.ndarray) -> np.ndarray:
    """Indices of the drawn significant genes, smallest p-value first.

    Only these are labelled, so that nothing is labelled when no gene is significant.
    """
    keep = np.flatnonzero(drawn & sig)
    return keep[np.argsort(p[keep], kind="stable")]


def _title(adata: AnnData, key: str, contrast: Any, group: Any) -> str:
    name = (
        str(contrast)
        if contrast is not None
        else _keys.decode_name(next(iter(deseq_entry(adata, key, group)["results"])))
    )
    return f"DESeq2 {name}" + (f" ({group})" if group is not None else "")


@plot_function
def volcano(
    adata: AnnData,
    contrast: Any = None,
    *,
    key: str = _keys.DESEQ,
    group: str | None = None,
    alpha: float | None = None,
    lfc_threshold: float = 0.0,
    shrunk: bool = False,
    n_top: int = 10,
    gene_symbols: str | None = None,
    ax: Any = None,
    show: bool | None = None,
    save: str | bool | None = None,
) -> Axes | None:
    """Volcano plot: log2 fold change against -log10 p-value; genes with padj < alpha coloured, top genes labelled.

    P-values that underflow to 0 (R and gpuc report them as 0 below about 1e-300) have no finite -log10: they are
    drawn at the top of the axis (just above the largest finite value) as upward triangles, named in the legend, so
    that they are neither lost nor mistaken for measured values. Only significant genes are labelled: when no gene
    passes ``padj < alpha`` (and ``lfc_threshold``), nothing is labelled and the legend says so.

    Parameters
    ----------
    {deseq_results}
    alpha
        Significance threshold on padj (default: the ``alpha`` used in the fit).
    lfc_threshold
        Also require an absolute log2 fold change above this to colour a gene; drawn as dashed lines.
    shrunk
        Plot the shrunken fold changes (needs ``lfc_shrink``).
    {label_genes}
    {ax_show_save}

    {returns_axes}
    """
    lfc_threshold = check_number("lfc_threshold", lfc_threshold, low=0)
    n_top = _check_n_top(n_top)
    df, col, alpha = _results_for_plot(adata, contrast, key, group, alpha, shrunk=shrunk)
    names = _gene_labels(adata, df.index, gene_symbols)
    ax = single_ax(ax, "the volcano plot", (5, 4.5))
    lfc = df[col].to_numpy()
    p = df["pvalue"].to_numpy(dtype=float)
    capped = p <= 0  # underflowed to 0: -log10 is infinite
    with np.errstate(divide="ignore"):
        nlp = -np.log10(p)
    finite = np.isfinite(nlp) & ~capped
    top = float(nlp[finite].max()) if finite.any() else 1.0
    cap = top * 1.08 if top > 0 else 1.0
    nlp = np.where(capped, cap, nlp)
    sig = (df["padj"].to_numpy() < alpha) & (np.abs(lfc) > lfc_threshold)
    ok = np.isfinite(nlp) & np.isfinite(lfc)
    ax.set_title(_title(adata, key, contrast, group), fontsize=9)
    for mask, c, name in ((~sig, "0.7", "n.s."), (sig, "tab:red", f"padj < {alpha:g}")):
        m = ok & mask & ~capped
        if m.any():
            ax.scatter(lfc[m], nlp[m], s=4, c=c, rasterized=True, label=name)
        m = ok & mask & capped
        if m.any():
            ax.scatter(lfc[m], nlp[m], s=18, c=c, marker="^", label=f"{name}, p = 0 (drawn at the top)", zorder=3)
    if not sig.any():
        ax.plot([], [], ls="none", label=f"no gene with padj < {alpha:g}")
    if lfc_threshold > 0:
        for v in (-lfc_threshold, lfc_threshold):
            ax.axvline(v, ls="--", c="0.4", lw=0.8)
    if capped.any():
        ax.axhline(cap, ls=":", c="0.5", lw=0.6)
        ax.set_ylim(top=cap * 1.04)
    ax.set_xlabel("log2 fold change" + (" (shrunken)" if shrunk else ""))
    ax.set_ylabel("-log10 p-value")
    ax.legend(frameon=False, fontsize=8, markerscale=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _label_top(ax, lfc, nlp, names, _significant_order(p, ok, sig), n_top)
    return finish(ax, show, save=save)


def _check_n_top(n_top: Any) -> int:
    from gpuc._validate import check_int

    return check_int("n_top", n_top, minimum=0)


@plot_function
def ma(
    adata: AnnData,
    contrast: Any = None,
    *,
    key: str = _keys.DESEQ,
    group: str | None = None,
    alpha: float | None = None,
    shrunk: bool = False,
    n_top: int = 10,
    ylim: float | None = None,
    gene_symbols: str | None = None,
    ax: Any = None,
    show: bool | None = None,
    save: str | bool | None = None,
) -> Axes | None:
    """MA plot (R ``plotMA``): log2 fold change against mean of normalised counts, padj < alpha in colour.

    Only significant genes are labelled; when none is, nothing is labelled and the legend says so.

    Parameters
    ----------
    {deseq_results}
    alpha
        Threshold on padj (default: the fit's ``alpha``).
    shrunk
        Plot the shrunken fold changes.
    ylim
        Symmetric y limit; points beyond are drawn as triangles at the edge.
    {label_genes}
    {ax_show_save}

    {returns_axes}
    """
    n_top = _check_n_top(n_top)
    if ylim is not None:
        ylim = check_number("ylim", ylim, low=0, strict=True)
    df, col, alpha = _results_for_plot(adata, contrast, key, group, alpha, shrunk=shrunk)
    names = _gene_labels(adata, df.index, gene_symbols)
    ax = single_ax(ax, "the MA plot", (5, 4))
    bm, lfc = df["baseMean"].to_numpy(), df[col].to_numpy()
    ok = (bm > 0) & np.isfinite(lfc)
    sig = df["padj"].to_numpy() < alpha
    yl = ylim if ylim is not None else float(np.nanmax(np.abs(lfc[ok]))) * 1.05 if ok.any() else 1.0
    y = np.clip(lfc, -yl, yl)
    out = np.abs(lfc) > yl
    ax.set_title(_title(adata, key, contrast, group), fontsize=9)
    for mask, c, name in ((~sig, "0.6", "n.s."), (sig, "tab:blue", f"padj < {alpha:g}")):
        m = ok & mask
        ax.scatter(bm[m & ~out], y[m & ~out], s=4, c=c, rasterized=True, label=name)
        if (m & out).any():
            ax.scatter(bm[m & out], y[m & out], s=10, c=c, marker="^", rasterized=True, label=f"{name}, beyond ylim")
    if not (ok & sig).any():
        ax.plot([], [], ls="none", label=f"no gene with padj < {alpha:g}")
    ax.axhline(0, c="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("mean of normalised counts")
    ax.set_ylabel("log2 fold change" + (" (shrunken)" if shrunk else ""))
    ax.legend(frameon=False, fontsize=8, markerscale=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _label_top(ax, bm, y, names, _significant_order(df["pvalue"].to_numpy(dtype=float), ok, sig), n_top)
    return finish(ax, show, save=save)


@plot_function
def dispersion(
    adata: AnnData,
    *,
    key: str = _keys.DESEQ,
    group: str | None = None,
    ax: Any = None,
    show: bool | None = None,
    save: str | bool | None = None,
) -> Axes | None:
    """Dispersion estimates against the mean (R ``plotDispEsts``): genewise (black), trend (red), final (blue),
    dispersion outliers circled.

    Parameters
    ----------
    {deseq_run}
    {ax_show_save}

    {returns_axes}
    """
    entry = deseq_entry(adata, key, group)
    if "genes" in entry:
        g = entry["genes"]
        get = lambda f: g[f].to_numpy()  # noqa: E731
    else:
        missing = [f for f in ("baseMean", "dispGeneEst") if _keys.deseq_var(key, f) not in adata.var]
        if missing:
            msg = (
                f"adata.var has no {_keys.deseq_var(key, missing[0])!r} column: the per-gene fit of "
                f"gpuc.tl.deseq(..., key_added={key!r}) was removed. Rerun gpuc.tl.deseq."
            )
            raise KeyError(msg)
        get = lambda f: adata.var[_keys.deseq_var(key, f)].to_numpy()  # noqa: E731
    ax = single_ax(ax, "the dispersion plot", (5, 4))
    bm, gw, fit, final, out = (
        get("baseMean"),
        get("dispGeneEst"),
        get("dispFit"),
        get("dispersion"),
        get("dispOutlier").astype(bool),
    )
    ok = (bm > 0) & np.isfinite(gw)
    ax.scatter(bm[ok], gw[ok], s=3, c="k", rasterized=True, label="gene-est")
    ax.scatter(bm[ok], final[ok], s=3, c="dodgerblue", rasterized=True, label="final")
    ax.scatter(
        bm[ok & out], final[ok & out], s=14, facecolors="none", edgecolors="dodgerblue", lw=0.8, label="outliers"
    )
    order = np.argsort(bm[ok])
    ax.plot(bm[ok][order], fit[ok][order], c="red", lw=1.5, label="fitted")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("mean of normalised counts")
    ax.set_ylabel("dispersion")
    ax.legend(frameon=False, fontsize=8, markerscale=2)
    return finish(ax, show, save=save)


def _obs_groups(adata: AnnData, color: Any) -> tuple[list[str], Any]:
    """``obs`` columns named by ``color`` (one or several, checked) and the group of each sample: the column's values,
    or the values of several joined with ":" (R's ``intgroup``), as a Categorical.
    """
    import pandas as pd

    cols = [color] if isinstance(color, str) else list(color)
    missing = [c for c in cols if c not in adata.obs.columns]
    if not cols or missing:
        msg = f"color must name adata.obs columns; {missing or cols!r} not found (columns: {list(adata.obs.columns)})."
        raise KeyError(msg)
    if len(cols) == 1:
        g = adata.obs[cols[0]]
        return cols, g.astype("category") if not isinstance(g.dtype, pd.CategoricalDtype) else g
    joined = adata.obs[cols].astype(str).agg(":".join, axis=1)
    return cols, pd.Categorical(joined)


def _draw_groups(ax: Any, adata: AnnData, key: str, x: np.ndarray, y: np.ndarray, groups: Any, s: float) -> None:
    import pandas as pd

    cats = list(pd.Categorical(groups).categories)
    colors = category_colors(adata, key, cats)
    codes = pd.Categorical(groups, categories=cats).codes
    for i, (cat, col) in enumerate(zip(cats, colors, strict=True)):
        sel = codes == i
        if sel.any():
            ax.scatter(x[sel], y[sel], s=s, color=col, label=str(cat), edgecolors="none")


@plot_function
def pca(
    adata: AnnData,
    color: str | list[str] = "condition",
    *,
    key: str = _keys.RLOG,
    ntop: int = 500,
    components: tuple[int, int] = (1, 2),
    ax: Any = None,
    show: bool | None = None,
    save: str | bool | None = None,
) -> Axes | None:
    """Samples on principal components of transformed counts, coloured by design variables (R ``plotPCA``).

    The ``ntop`` genes of largest variance in ``layers[key]`` (:func:`gpuc.tl.rlog` or :func:`gpuc.tl.vst`
    output), centred, not scaled; the axes say each component's share of the variance, as R's
    ``plotPCA(returnData=TRUE)`` computes it (sample scores equal R's up to each component's sign).

    Parameters
    ----------
    adata
        Samples x genes AnnData with the transformed values in ``layers[key]``.
    color
        ``obs`` column(s) to colour by (R's ``intgroup``); several are joined with ":".
    key
        ``key_added`` of the :func:`gpuc.tl.rlog` or :func:`gpuc.tl.vst` run: the layer with the transformed values
        (``"rlog"`` or ``"vst"`` by default).
    ntop
        Number of most variable genes used.
    components
        The two components drawn (1-based).
    {ax_show_save}

    {returns_axes}
    """
    from gpuc.deseq._vst import sample_pca

    if key not in adata.layers:
        msg = f"adata.layers has no {key!r}; run gpuc.tl.rlog or gpuc.tl.vst first (or pass key=)."
        raise KeyError(msg)
    ntop = _check_positive_int("ntop", ntop)
    comps = tuple(components)
    if len(comps) != 2 or not all(isinstance(c, int | np.integer) and 1 <= c <= adata.n_obs for c in comps):
        msg = (
            f"components must be two integers between 1 and the number of samples ({adata.n_obs}), got {components!r}."
        )
        raise ValueError(msg)
    cols, groups = _obs_groups(adata, color)
    scores, frac = sample_pca(np.asarray(adata.layers[key]), ntop)
    if max(comps) > scores.shape[1]:
        msg = f"only {scores.shape[1]} components exist for {adata.n_obs} samples; components={components!r}."
        raise ValueError(msg)
    ax = single_ax(ax, "the PCA plot", (4.8, 4))
    i, j = comps[0] - 1, comps[1] - 1
    _draw_groups(ax, adata, cols[0], scores[:, i], scores[:, j], groups, s=40)
    ax.set_xlabel(f"PC{comps[0]}: {round(100 * frac[i])}% variance")
    ax.set_ylabel(f"PC{comps[1]}: {round(100 * frac[j])}% variance")
    ax.set_aspect("equal", adjustable="datalim")  # R's coord_fixed: distances read alike on both axes
    ax.legend(title=":".join(cols), frameon=False, fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.set_title(f"{key}, top {min(ntop, adata.n_vars)} genes")
    return finish(ax, show, save=save)


def _check_positive_int(name: str, value: Any) -> int:
    from gpuc._validate import check_int

    return check_int(name, value, minimum=1)


@plot_function
def counts(
    adata: AnnData,
    gene: str,
    groupby: str | list[str] = "condition",
    *,
    layer: str | None = None,
    key: str = _keys.DESEQ,
    normalized: bool = True,
    log: bool = True,
    pc: float | None = None,
    gene_symbols: str | None = None,
    ax: Any = None,
    show: bool | None = None,
    save: str | bool | None = None,
) -> Axes | None:
    """Counts of one gene per sample, by group (R ``plotCounts``).

    Normalised counts (divided by the size factors of the :func:`gpuc.tl.deseq` run under ``key``, or by
    median-of-ratios size factors computed here when there is none, as R's ``plotCounts`` estimates them) plus a
    pseudocount, on a log axis, one column of points per group with a little horizontal jitter (fixed, so the figure
    is reproducible). The values drawn are R's ``plotCounts(returnData=TRUE)$count``.

    Parameters
    ----------
    adata
        Samples x genes AnnData with raw counts.
    gene
        Gene name (``var_names``), or a value of ``var[gene_symbols]``.
    groupby
        ``obs`` column(s) (R's ``intgroup``); several are joined with ":".
    layer
        Layer with the raw counts; ``None`` uses ``X``.
    key
        ``key_added`` of the :func:`gpuc.tl.deseq` run whose size factors are used.
    normalized
        Divide by the size factors (R's default); ``False`` draws raw counts.
    log
        Log-scale y axis (R's ``transform=TRUE``).
    pc
        Pseudocount added; ``None``: 0.5 on a log axis, else 0 (R's default).
    gene_symbols
        ``var`` column to look ``gene`` up in.
    {ax_show_save}

    {returns_axes}
    """
    from gpuc._lazy import load
    from gpuc._validate import get_matrix
    from gpuc.deseq._blocks import _gene_major

    names = adata.var_names if gene_symbols is None else adata.var[gene_symbols].astype(str)
    hits = np.flatnonzero(np.asarray(names == gene))
    if hits.size != 1:
        where = "adata.var_names" if gene_symbols is None else f"adata.var[{gene_symbols!r}]"
        msg = f"gene {gene!r} {'is not in' if hits.size == 0 else 'occurs more than once in'} {where}."
        raise KeyError(msg)
    pc = (0.5 if log else 0.0) if pc is None else check_number("pc", pc, low=0)
    cols, groups = _obs_groups(adata, groupby)
    y = _gene_major(load(get_matrix(adata, layer=layer), "counts"))
    values = y[hits[0]]
    if normalized:
        sf_col = _keys.deseq_size_factors(key)
        if sf_col in adata.obs.columns:
            sf = adata.obs[sf_col].to_numpy(dtype=np.float64)
        else:
            from gpuc._backend import get_backend
            from gpuc.deseq._pipeline import compute_size_factors

            sf = np.asarray(compute_size_factors(get_backend("cpu"), y, "ratio")[0], dtype=np.float64)
        values = values / sf
    values = values + pc
    import pandas as pd

    codes = pd.Categorical(groups).codes.astype(float)
    jitter = np.random.default_rng(0).uniform(-0.05, 0.05, codes.size)  # R: runif(-0.05, 0.05)
    ax = single_ax(ax, "the counts plot", (4, 3.6))
    _draw_groups(ax, adata, cols[0], codes + jitter, values, groups, s=30)
    cats = list(pd.Categorical(groups).categories)
    ax.set_xticks(range(len(cats)), [str(c) for c in cats])
    ax.set_xlim(-0.5, len(cats) - 0.5)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel(":".join(cols))
    ax.set_ylabel(("normalized count" if normalized else "count") + (f" + {pc:g}" if pc else ""))
    ax.set_title(str(gene))
    return finish(ax, show, save=save)
