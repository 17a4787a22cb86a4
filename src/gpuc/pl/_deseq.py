"""Plots of :func:`gpuc.tl.deseq` output: volcano, MA and dispersion (plotDispEsts) plots."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from anndata import AnnData
from matplotlib.axes import Axes

from gpuc import _keys
from gpuc.get._deseq import _entry, deseq_results
from gpuc.pl._utils import finish, place_labels


def _results_for_plot(
    adata: AnnData, contrast: Any, key: str, group: Any, alpha: float | None, *, shrunk: bool
) -> tuple[Any, str, float]:
    """The results table, the fold-change column to draw (MLE or shrunken) and the significance level."""
    df = deseq_results(adata, contrast, key=key, group=group)
    alpha = float(adata.uns[key]["params"]["alpha"]) if alpha is None else alpha
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
    top = [i for i in order[:n_top] if np.isfinite(x[i]) and np.isfinite(y[i])]
    place_labels(ax, x[top], y[top], [names[i] for i in top])


def _title(adata: AnnData, key: str, contrast: Any, group: Any) -> str:
    name = (
        str(contrast) if contrast is not None else _keys.decode_name(next(iter(_entry(adata, key, group)["results"])))
    )
    return f"DESeq2 {name}" + (f" ({group})" if group is not None else "")


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
    save: str | None = None,
) -> Axes | None:
    """Volcano plot: log2 fold change against -log10 p-value; genes with padj < alpha coloured, top genes labelled.

    Parameters
    ----------
    adata
        AnnData after :func:`gpuc.tl.deseq`.
    contrast
        Which results (see :func:`gpuc.get.deseq_results`).
    key, group
        As in :func:`gpuc.get.deseq_results`.
    alpha
        Significance threshold on padj (default: the ``alpha`` used in the fit).
    lfc_threshold
        Also require an absolute log2 fold change above this to colour a gene; drawn as dashed lines.
    shrunk
        Plot the shrunken fold changes (needs ``lfc_shrink``).
    n_top
        Number of most significant genes to label (labels never overlap; one that finds no free place is left out).
    gene_symbols
        ``var`` column to label genes with; default: a symbol column of ``var`` if there is one (``gene_symbols``,
        ``symbol``, ``gene_name`` ...), else the gene names.
    ax
        Axes to draw into.
    show
        Show the figure (default: ``scanpy.settings.autoshow``, as in Scanpy) and return ``None``; ``False``
        returns it for further drawing.
    save
        Path to save the figure to (any format matplotlib writes, e.g. ``.png`` or ``.pdf``).

    Returns
    -------
    The Axes when ``show=False``.
    """
    df, col, alpha = _results_for_plot(adata, contrast, key, group, alpha, shrunk=shrunk)
    lfc = df[col].to_numpy()
    p = df["pvalue"].to_numpy()
    with np.errstate(divide="ignore"):
        nlp = -np.log10(np.clip(p, 1e-300, 1))
    sig = (df["padj"].to_numpy() < alpha) & (np.abs(lfc) > lfc_threshold)
    ok = np.isfinite(nlp) & np.isfinite(lfc)
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 4.5))
    ax.set_title(_title(adata, key, contrast, group), fontsize=9)
    ax.scatter(lfc[ok & ~sig], nlp[ok & ~sig], s=4, c="0.7", rasterized=True, label="n.s.")
    ax.scatter(lfc[ok & sig], nlp[ok & sig], s=5, c="tab:red", rasterized=True, label=f"padj < {alpha:g}")
    if lfc_threshold > 0:
        for v in (-lfc_threshold, lfc_threshold):
            ax.axvline(v, ls="--", c="0.4", lw=0.8)
    ax.set_xlabel("log2 fold change" + (" (shrunken)" if shrunk else ""))
    ax.set_ylabel("-log10 p-value")
    ax.legend(frameon=False, fontsize=8, markerscale=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    order = np.argsort(np.where(ok, p, np.inf))
    _label_top(ax, lfc, nlp, _gene_labels(adata, df.index, gene_symbols), order, n_top)
    return finish(ax, show, save=save)


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
    save: str | None = None,
) -> Axes | None:
    """MA plot (R ``plotMA``): log2 fold change against mean of normalised counts, padj < alpha in colour.

    Parameters
    ----------
    adata
        AnnData after :func:`gpuc.tl.deseq`.
    contrast, key, group
        As in :func:`gpuc.get.deseq_results`.
    alpha
        Threshold on padj (default: the fit's ``alpha``).
    shrunk
        Plot the shrunken fold changes.
    n_top
        Number of most significant genes to label (labels never overlap; one that finds no free place is left out).
    gene_symbols
        ``var`` column to label genes with; default: a symbol column of ``var`` if there is one (``gene_symbols``,
        ``symbol``, ``gene_name`` ...), else the gene names.
    ylim
        Symmetric y limit; points beyond are drawn as triangles at the edge.
    ax
        Axes to draw into; a new figure if None.
    show
        Show the figure (default: ``scanpy.settings.autoshow``, as in Scanpy) and return ``None``; ``False``
        returns it for further drawing.
    save
        Path to save the figure to (any format matplotlib writes, e.g. ``.png`` or ``.pdf``).

    Returns
    -------
    The Axes when ``show=False``.
    """
    df, col, alpha = _results_for_plot(adata, contrast, key, group, alpha, shrunk=shrunk)
    bm, lfc = df["baseMean"].to_numpy(), df[col].to_numpy()
    ok = (bm > 0) & np.isfinite(lfc)
    sig = df["padj"].to_numpy() < alpha
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 4))
    yl = ylim if ylim is not None else float(np.nanmax(np.abs(lfc[ok]))) * 1.05 if ok.any() else 1.0
    y = np.clip(lfc, -yl, yl)
    out = np.abs(lfc) > yl
    ax.set_title(_title(adata, key, contrast, group), fontsize=9)
    for mask, c, name in ((~sig, "0.6", "n.s."), (sig, "tab:blue", f"padj < {alpha:g}")):
        m = ok & mask
        ax.scatter(bm[m & ~out], y[m & ~out], s=4, c=c, rasterized=True, label=name)
        if (m & out).any():
            ax.scatter(bm[m & out], y[m & out], s=10, c=c, marker="^", rasterized=True, label=f"{name}, beyond ylim")
    ax.axhline(0, c="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("mean of normalised counts")
    ax.set_ylabel("log2 fold change" + (" (shrunken)" if shrunk else ""))
    ax.legend(frameon=False, fontsize=8, markerscale=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    order = np.argsort(np.where(ok, df["pvalue"].to_numpy(), np.inf))
    _label_top(ax, bm, y, _gene_labels(adata, df.index, gene_symbols), order, n_top)
    return finish(ax, show, save=save)


def dispersion(
    adata: AnnData,
    *,
    key: str = _keys.DESEQ,
    group: str | None = None,
    ax: Any = None,
    show: bool | None = None,
    save: str | None = None,
) -> Axes | None:
    """Dispersion estimates against the mean (R ``plotDispEsts``): genewise (black), trend (red), final (blue),
    dispersion outliers circled.

    Parameters
    ----------
    adata
        AnnData after :func:`gpuc.tl.deseq`.
    key, group
        As in :func:`gpuc.get.deseq_results`.
    ax
        Axes to draw into; a new figure if None.
    show
        Show the figure (default: ``scanpy.settings.autoshow``, as in Scanpy) and return ``None``; ``False``
        returns it for further drawing.
    save
        Path to save the figure to (any format matplotlib writes, e.g. ``.png`` or ``.pdf``).

    Returns
    -------
    The Axes when ``show=False``.
    """
    entry = _entry(adata, key, group)
    if "genes" in entry:
        g = entry["genes"]
        get = lambda f: g[f].to_numpy()  # noqa: E731
    else:
        get = lambda f: adata.var[_keys.deseq_var(key, f)].to_numpy()  # noqa: E731
    bm, gw, fit, final, out = (
        get("baseMean"),
        get("dispGeneEst"),
        get("dispFit"),
        get("dispersion"),
        get("dispOutlier").astype(bool),
    )
    ok = (bm > 0) & np.isfinite(gw)
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 4))
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
