"""Plots of consensus NMF results: k sweep, density histogram, clustergram, programme top genes, usages on an embedding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from anndata import AnnData

from gpuc import _keys
from gpuc._validate import check_adata, check_int, check_key
from gpuc.get._checks import tool_output
from gpuc.get._nmf import nmf_top_genes, program_names
from gpuc.pl._utils import check_cmap, check_ncols, check_number, finish, panels, plot_function, single_ax

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


@plot_function
def nmf_k_sweep(
    adata: AnnData,
    *,
    key: str = _keys.NMF_K_SWEEP,
    mark_k: int | None = None,
    ax: Sequence[Axes] | None = None,
    show: bool | None = None,
    save: str | bool | None = None,
) -> Figure | None:
    """Stability and relative reconstruction error against k, from :func:`gpuc.tl.nmf_k_sweep`.

    A stable k at which the error is still falling is the one to take; the k the sweep points to under the rule of
    :func:`gpuc.get.nmf_suggest_k` is marked (dashed line on both panels, ringed on the stability panel). ks whose
    consensus failed (too few components passed the density filter) are marked with a red cross on the stability
    panel; when every k failed, nothing is marked and the title says so. The legends sit below the panels, clear
    of the curves and of the marked k.

    Parameters
    ----------
    adata
        AnnData after :func:`gpuc.tl.nmf_k_sweep`.
    key
        Its ``key_added``.
    mark_k
        The k to mark; ``None`` marks the sweep's suggestion (:func:`gpuc.get.nmf_suggest_k` with its default
        options; pass ``mark_k=gpuc.get.nmf_suggest_k(adata, tol=...)`` for others).
    ax
        Two Axes (stability, error); a new figure when ``None``.
    {show_save}

    {returns_figure}
    """
    from matplotlib.ticker import MaxNLocator

    u = tool_output(adata, key, "nmf_k_sweep")
    fig, axes = panels(ax, 2, "stability, error", (4.25, 3.9))
    t = u["table"]
    k = t["k"].to_numpy()
    failed = t["consensus_failed"].to_numpy(dtype=bool)
    stab = t["stability"].to_numpy(dtype=float)
    if mark_k is None:
        from gpuc.get._nmf import nmf_suggest_k

        # every consensus failed: no suggestion (the stored suggested_k is then None)
        mark_k = nmf_suggest_k(adata, key=key) if np.isfinite(stab).any() else None
        what = "suggested"
    else:
        mark_k = check_int("mark_k", mark_k, minimum=1)
        what = "chosen"
    a0, a1 = axes
    a0.plot(k[~failed], stab[~failed], "o-", color="C0", label="stability")
    if failed.any():
        lo = np.nanmin(stab) if np.isfinite(stab).any() else 0.0
        a0.plot(k[failed], np.full(failed.sum(), lo), "x", color="red", ms=9, mew=2, label="consensus failed")
    a0.set(xlabel="k", ylabel="stability (mean silhouette)", title="stability")
    a1.plot(k, t["median_error"], "o-", color="C1", label="median over runs")
    a1.plot(k, t["best_error"], "--", color="C1", alpha=0.6, label="best run")
    a1.set(xlabel="k", ylabel="||V - WH||² / ||V||²", title="relative error")
    if mark_k is not None:
        hit = k == mark_k
        if hit.any() and np.isfinite(stab[hit]).all():
            a0.plot(k[hit], stab[hit], "o", ms=13, mfc="none", mec="black", mew=1.5, zorder=3)
        for a in axes:
            a.axvline(mark_k, color="0.3", ls="--", lw=1, zorder=0, label=f"{what} k = {mark_k}")
    for a in axes:
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        a.grid(alpha=0.3)
        # below the x label, outside the data area: a legend there never covers a curve or the marked k
        a.legend(frameon=False, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    title = (
        f"{what} k = {mark_k}: a stable k at which adding a programme still lowers the error"
        if mark_k is not None
        else "no k suggested: the consensus failed for every k (raise density_threshold)"
    )
    fig.suptitle(title, fontsize=9, y=1.0)
    return finish(fig, show, save=save, layout=ax is None)


@plot_function
def nmf_density(
    adata: AnnData,
    *,
    key: str = _keys.NMF,
    threshold: float | None = None,
    bins: int = 50,
    ax: Axes | None = None,
    show: bool | None = None,
    save: str | bool | None = None,
) -> Axes | None:
    """Histogram of the pooled components' local densities with the density threshold and the number dropped.

    The x axis spans the densities. Restarts that agree give tiny densities (1e-5 to 1e-3 on unit-norm spectra),
    far below the default threshold of 0.5: drawn to the threshold, the bars would be squeezed into an invisible
    sliver at 0. A threshold outside the densities' range is therefore not drawn to scale but marked by an arrow at
    the edge of the axis on its side, labelled with its value.

    Parameters
    ----------
    {consensus_run}
    threshold
        Threshold to draw and count against (default: the one used); lets a new threshold be judged without refitting.
    bins
        Histogram bins.
    {ax_show_save}

    {returns_axes}
    """
    u = tool_output(adata, key, "consensus_nmf")
    thr = float(u["params"]["density_threshold"]) if threshold is None else check_number("threshold", threshold, low=0)
    bins = check_int("bins", bins, minimum=1)
    ax = single_ax(ax, "the histogram", (4.5, 3.2))
    dens = u["components"]["local_density"].to_numpy(dtype=float)
    finite = dens[np.isfinite(dens)]
    n_drop = int((~np.isfinite(dens) | (dens >= thr)).sum())
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    span = hi - lo if hi > lo else max(abs(hi), 1e-12)
    # bins over the densities alone (also when they are all equal), so that each bar has a visible width
    ax.hist(finite, bins=bins, range=(lo - 0.05 * span, hi + 0.05 * span), color="0.5")
    inside = lo - 0.5 * span <= thr <= hi + 0.5 * span
    if inside:
        ax.axvline(thr, color="red", ls="--", label=f"threshold {thr:g}")
        ax.legend(frameon=False, fontsize=8)
    else:
        right = thr > hi
        ax.annotate(
            f"threshold {thr:g} {'→' if right else '←'}",
            xy=(1.0 if right else 0.0, 0.97),
            xycoords="axes fraction",
            ha="right" if right else "left",
            va="top",
            color="red",
            fontsize=8,
        )
    x0, x1 = lo - 0.1 * span, hi + 0.1 * span
    if inside:
        x0, x1 = min(x0, thr - 0.05 * span), max(x1, thr + 0.05 * span)
    ax.set_xlim(x0, x1)
    metric = u["params"].get("metric", "")
    ax.set(
        xlabel=f"local density (mean {metric} distance to {u.get('n_neighbors', '?')} neighbours)",
        ylabel="components",
        title=f"{n_drop} of {dens.size} dropped",
    )
    return finish(ax, show, save=save)


@plot_function
def nmf_clustergram(
    adata: AnnData,
    *,
    key: str = _keys.NMF,
    cmap: str = "viridis_r",
    ax: Axes | None = None,
    show: bool | None = None,
    save: str | bool | None = None,
) -> Axes | None:
    """Pairwise distances between the kept pooled components, ordered by consensus cluster (cNMF's clustergram).

    Parameters
    ----------
    adata
        AnnData after :func:`gpuc.tl.consensus_nmf` (with at most 2,000 pooled components, so the distances were kept).
    key
        Its ``key_added``.
    cmap
        Colour map of the distances.
    {ax_show_save}

    {returns_axes}
    """
    u = tool_output(adata, key, "consensus_nmf")
    if "distances" not in u:
        msg = f"adata.uns[{key!r}] holds no 'distances' (more than 2,000 pooled components); nothing to draw."
        raise KeyError(msg)
    cmap = check_cmap(cmap)
    ax = single_ax(ax, "the clustergram", (4.8, 4.2))
    comp = u["components"]
    kept = comp["kept"].to_numpy(dtype=bool)
    cl = comp["cluster"].to_numpy()
    idx = np.flatnonzero(kept)
    # order by cluster, then by silhouette within the cluster (most typical first)
    sil = comp["silhouette"].to_numpy(dtype=float)
    order = idx[np.lexsort((-sil[idx], cl[idx]))]
    d = np.asarray(u["distances"], dtype=float)[np.ix_(order, order)]
    im = ax.imshow(d, cmap=cmap, interpolation="nearest")
    bounds = np.flatnonzero(np.diff(cl[order])) + 0.5
    for b in bounds:
        ax.axhline(b, color="white", lw=0.6)
        ax.axvline(b, color="white", lw=0.6)
    ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label=f"{u['params'].get('metric', '')} distance")
    ax.set(xticks=[], yticks=[], title=f"{len(order)} components in {len(np.unique(cl[order]))} clusters")
    return finish(ax, show, save=save)


@plot_function
def nmf_programs(
    adata: AnnData,
    *,
    key: str = _keys.NMF,
    n_genes: int = 10,
    by: Literal["score", "tpm", "weight"] = "score",
    ncols: int = 4,
    ax: Any = None,
    show: bool | None = None,
    save: str | bool | None = None,
) -> Figure | None:
    """Top genes of each programme, one bar chart per programme (:func:`gpuc.get.nmf_top_genes`).

    By default the genes are ranked by cNMF's gene spectra score (z-score units: how much a gene's expression
    rises with the programme's usage); with ``by="weight"`` by the consensus spectra weights, shown as percentages
    of the programme with ``normalization="sum"`` (the default), where each programme's weights sum to 1.

    Parameters
    ----------
    {consensus_run}
    n_genes
        Genes per programme.
    by
        ``"score"``, ``"tpm"`` or ``"weight"``, as in :func:`gpuc.get.nmf_top_genes` (scores and TPM rank every
        gene, weights the factorised ones).
    ncols
        Panels per row.
    ax
        A sequence of at least k Axes (extras are hidden); a new figure when ``None``.
    {show_save}

    {returns_figure}
    """
    from matplotlib.ticker import MaxNLocator

    n_genes = check_int("n_genes", n_genes, minimum=1)
    ncols = check_ncols(ncols)
    top = nmf_top_genes(adata, n_genes, key=key, by=by)
    names = list(top["program"].cat.categories)
    rows = min(n_genes, int((top["program"] == names[0]).sum()))
    fig, axes = panels(ax, len(names), "one per programme", (2.6, 0.22 * rows + 0.9), ncols=ncols, at_least=True)
    percent = by == "weight" and adata.uns.get(key, {}).get("params", {}).get("normalization", "sum") == "sum"
    xlabel = {
        "score": "score (z-score per unit usage)",
        "tpm": "TPM",
        "weight": "% of programme" if percent else "weight (L2-normalised)",
    }
    for j, p in enumerate(names):
        sub = top[top["program"] == p]
        a = axes[j]
        w = sub[by].to_numpy() * (100.0 if percent else 1.0)
        a.barh(np.arange(len(sub))[::-1], w, color=f"C{j % 10}")
        a.set_yticks(np.arange(len(sub))[::-1], sub["gene"], fontsize=7)
        a.set_title(p, fontsize=9)
        a.xaxis.set_major_locator(MaxNLocator(nbins=3))
        a.tick_params(axis="x", labelsize=7)
        a.set_xlabel(xlabel[by], fontsize=7)
    return finish(fig, show, save=save, layout=ax is None)


def _check_programs(programs: Any, k: int) -> list[int]:
    """Programme indices (0-based): all ``k`` for ``None``, else a non-empty sequence of distinct ints in [0, k)."""
    if programs is None:
        return list(range(k))
    if isinstance(programs, int | np.integer):
        programs = [programs]
    if not isinstance(programs, Sequence | np.ndarray) or isinstance(programs, str):
        msg = f"programs must be a sequence of programme indices (0-based), got {programs!r}."
        raise TypeError(msg)
    sel = list(programs)
    if not sel:
        msg = "programs is empty; pass None for all programmes or indices in [0, k)."
        raise ValueError(msg)
    if not all(isinstance(p, int | np.integer) and not isinstance(p, bool) for p in sel):
        msg = f"programs must hold integer indices (0-based: 0 is P1), got {sel!r}."
        raise TypeError(msg)
    bad = [int(p) for p in sel if not 0 <= p < k]
    if bad:
        msg = f"programs {bad} out of range: the fit has {k} programmes, indices 0 (P1) to {k - 1} (P{k})."
        raise ValueError(msg)
    if len(set(sel)) != len(sel):
        msg = f"programs lists a programme twice: {sel!r}."
        raise ValueError(msg)
    return [int(p) for p in sel]


@plot_function
def nmf_usage(
    adata: AnnData,
    *,
    basis: str = "umap",
    key: str = _keys.NMF,
    programs: Sequence[int] | None = None,
    normalize: bool = True,
    ncols: int = 4,
    size: float | None = None,
    cmap: str = "viridis",
    ax: Any = None,
    show: bool | None = None,
    save: str | bool | None = None,
) -> Figure | None:
    """Programme usages on an embedding (``obsm['X_' + basis]``), one panel per programme.

    The title says which fit the programmes come from: one on these observations (cells or metacells), or a separate
    fit when ``obsm['X_' + key]`` was copied in without its ``uns[key]`` (e.g. metacell usages mapped to cells), or
    usages of these cells on programmes fitted elsewhere (:func:`gpuc.tl.nmf_project`).
    Programme numbers (``P1`` ..., ordered by total usage) belong to one :func:`gpuc.tl.consensus_nmf` call, so ``P1``
    of a fit on metacells need not be ``P1`` of a fit on their cells.

    Parameters
    ----------
    adata
        AnnData after :func:`gpuc.tl.consensus_nmf` (or :func:`gpuc.tl.nmf_project`), with ``obsm['X_' + basis]``
        (cells or metacells).
    basis
        Embedding name (``"umap"``, ``"pca"``, ...).
    key
        The consensus (or projection) ``key_added``.
    programs
        Indices (0-based) of programmes to draw; all by default.
    normalize
        Show each cell's usage as a fraction of its total (cNMF's normalised usage) instead of the raw refit values.
    ncols
        Panels per row.
    size
        Point size (default ``12000 / n_obs``, between 1 and 60, so that few metacells do not hide each other).
    cmap
        Colour map.
    ax
        A sequence of Axes, at least one per programme drawn (extras are hidden); a new figure when ``None``.
    {show_save}

    {returns_figure}
    """
    check_adata(adata)
    projected = _keys.written_by(adata, key, _keys.NMF_PROJECT_MARKER)  # usages from gpuc.tl.nmf_project
    if key in adata.uns and not projected:
        tool_output(adata, key, "consensus_nmf")  # a key that holds another tool's output is refused
    uk = _keys.nmf_usages(key)
    check_key(adata.obsm, uk, "adata.obsm", f"Run gpuc.tl.consensus_nmf(adata, k, key_added={key!r}) first.")
    ek = f"X_{basis}"
    check_key(adata.obsm, ek, "adata.obsm", f"Compute the embedding first (e.g. sc.tl.{basis}).")
    usage = np.asarray(adata.obsm[uk], dtype=float)
    sel = _check_programs(programs, usage.shape[1])
    ncols = check_ncols(ncols)
    cmap = check_cmap(cmap)
    if size is not None:
        size = check_number("size", size, low=0, strict=True)
    if normalize:
        usage = usage / np.maximum(usage.sum(axis=1, keepdims=True), 1e-300)
    emb = np.asarray(adata.obsm[ek])[:, :2]
    names = program_names(usage.shape[1])
    size = size if size is not None else float(np.clip(12000 / max(adata.n_obs, 1), 1.0, 60.0))
    fig, axes = panels(ax, len(sel), "one per programme drawn", (3.0, 2.8), ncols=ncols, at_least=True)
    for a, j in zip(axes, sel, strict=False):
        order = np.argsort(usage[:, j])
        sc_ = a.scatter(
            emb[order, 0], emb[order, 1], c=usage[order, j], s=size, cmap=cmap, linewidths=0, rasterized=True
        )
        fig.colorbar(sc_, ax=a, fraction=0.046, pad=0.02)
        a.set(xticks=[], yticks=[], title=names[j])
        a.set_xlabel(f"{basis.upper()}1", fontsize=7)
        a.set_ylabel(f"{basis.upper()}2", fontsize=7)
    if ax is None:
        what = "metacells" if _keys.METACELL_SOURCE in adata.uns else "cells"
        k = usage.shape[1]
        source = (
            "projected onto programmes fitted elsewhere (nmf_project)"
            if projected
            else f"fitted on these {adata.n_obs} {what}"
            if key in adata.uns
            else f"from a separate fit (no uns[{key!r}] in this AnnData)"
        )
        fig.suptitle(
            f"{'share of ' if normalize else ''}usage of the {k} programmes {key!r}, {source}; "
            "P numbers belong to that fit",
            fontsize=9,
        )
        fig.tight_layout()
    return finish(fig, show, save=save)
