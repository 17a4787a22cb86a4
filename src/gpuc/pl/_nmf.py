"""Plots of consensus NMF results: k sweep, density histogram, clustergram, programme top genes, usages on an embedding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from anndata import AnnData

from gpuc import _keys
from gpuc._validate import check_adata, check_int, check_key
from gpuc.get._nmf import nmf_top_genes, program_names
from gpuc.pl._utils import finish

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def _uns(adata: AnnData, key: str, what: str) -> dict:
    check_adata(adata)
    check_key(adata.uns, key, "adata.uns", f"Run gpuc.tl.{what}(adata, ..., key_added={key!r}) first.")
    return adata.uns[key]


def nmf_k_sweep(
    adata: AnnData,
    *,
    key: str = _keys.NMF_K_SWEEP,
    mark_k: int | None = None,
    ax: Sequence[Axes] | None = None,
    show: bool | None = None,
    save: str | None = None,
) -> Figure | None:
    """Stability and relative reconstruction error against k, from :func:`gpuc.tl.nmf_k_sweep`.

    A stable k at which the error is still falling is the one to take; the k the sweep points to under the rule of
    :func:`gpuc.get.nmf_suggest_k` is marked (dashed line on both panels, ringed on the stability panel). ks whose
    consensus failed (too few components passed the density filter) are marked with a red cross on the stability
    panel.

    Parameters
    ----------
    adata
        AnnData after :func:`gpuc.tl.nmf_k_sweep`.
    key
        Its ``key_added``.
    mark_k
        The k to mark; ``None`` marks the sweep's suggestion (``uns[key]['suggested_k']``, the rule with its default
        options; pass ``mark_k=gpuc.get.nmf_suggest_k(adata, tol=...)`` for others).
    ax
        Two Axes (stability, error); a new figure when ``None``.
    show
        Show the figure (default: ``scanpy.settings.autoshow``, as in Scanpy) and return ``None``; ``False``
        returns it for further drawing.
    save
        Path to save the figure to (any format matplotlib writes, e.g. ``.png`` or ``.pdf``).

    Returns
    -------
    The :class:`~matplotlib.figure.Figure` when ``show=False``, else ``None``.
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    u = _uns(adata, key, "nmf_k_sweep")
    t = u["table"]
    if mark_k is None:
        from gpuc.get._nmf import nmf_suggest_k

        mark_k = int(u["suggested_k"]) if "suggested_k" in u else nmf_suggest_k(adata, key=key)
        what = "suggested"
    else:
        mark_k = check_int("mark_k", mark_k, minimum=1)
        what = "chosen"
    if ax is None:
        fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.4))
    else:
        if len(ax) != 2:
            msg = "ax must be two Axes: (stability, error)."
            raise ValueError(msg)
        axes = list(ax)
        fig = axes[0].figure
    k = t["k"].to_numpy()
    failed = t["consensus_failed"].to_numpy(dtype=bool)
    stab = t["stability"].to_numpy(dtype=float)
    a0, a1 = axes
    a0.plot(k[~failed], stab[~failed], "o-", color="C0")
    if failed.any():
        lo = np.nanmin(stab) if np.isfinite(stab).any() else 0.0
        a0.plot(k[failed], np.full(failed.sum(), lo), "x", color="red", ms=9, mew=2, label="consensus failed")
    a0.set(xlabel="k", ylabel="stability (mean silhouette)", title="stability")
    a1.plot(k, t["median_error"], "o-", color="C1", label="median over runs")
    a1.plot(k, t["best_error"], "--", color="C1", alpha=0.6, label="best run")
    a1.set(xlabel="k", ylabel="||V - WH||² / ||V||²", title="relative error")
    hit = k == mark_k
    if hit.any() and np.isfinite(stab[hit]).all():
        a0.plot(k[hit], stab[hit], "o", ms=13, mfc="none", mec="black", mew=1.5, zorder=3)
    for a in axes:
        a.axvline(mark_k, color="0.3", ls="--", lw=1, zorder=0, label=f"{what} k = {mark_k}")
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        a.grid(alpha=0.3)
    a0.legend(frameon=False, fontsize=8, loc="lower left")
    a1.legend(frameon=False, fontsize=8)
    fig.suptitle(
        f"{what} k = {mark_k}: a stable k at which adding a programme still lowers the error", fontsize=9, y=1.0
    )
    fig.tight_layout()
    return finish(fig, show, save=save)


def nmf_density(
    adata: AnnData,
    *,
    key: str = _keys.NMF,
    threshold: float | None = None,
    bins: int = 50,
    ax: Axes | None = None,
    show: bool | None = None,
    save: str | None = None,
) -> Axes | None:
    """Histogram of the pooled components' local densities with the density threshold and the number dropped.

    Parameters
    ----------
    adata
        AnnData after :func:`gpuc.tl.consensus_nmf`.
    key
        Its ``key_added``.
    threshold
        Threshold to draw and count against (default: the one used); lets a new threshold be judged without refitting.
    bins
        Histogram bins.
    ax
        Axes to draw into; a new figure when ``None``.
    show
        Show the figure (default: ``scanpy.settings.autoshow``, as in Scanpy) and return ``None``; ``False``
        returns it for further drawing.
    save
        Path to save the figure to (any format matplotlib writes, e.g. ``.png`` or ``.pdf``).

    Returns
    -------
    The :class:`~matplotlib.axes.Axes` when ``show=False``, else ``None``.
    """
    import matplotlib.pyplot as plt

    u = _uns(adata, key, "consensus_nmf")
    thr = float(u["params"]["density_threshold"] if threshold is None else threshold)
    dens = u["components"]["local_density"].to_numpy(dtype=float)
    finite = dens[np.isfinite(dens)]
    n_drop = int((~np.isfinite(dens) | (dens >= thr)).sum())
    if ax is None:
        _, ax = plt.subplots(figsize=(4.5, 3.2))
    ax.hist(finite, bins=bins, color="0.5")
    if thr <= max(finite.max(initial=0.0), 0) * 1.5 or thr < 2:
        ax.axvline(thr, color="red", ls="--", label=f"threshold {thr:g}")
        ax.legend(frameon=False, fontsize=8)
    metric = u["params"].get("metric", "")
    ax.set(
        xlabel=f"local density (mean {metric} distance to {u.get('n_neighbors', '?')} neighbours)",
        ylabel="components",
        title=f"{n_drop} of {dens.size} dropped",
    )
    return finish(ax, show, save=save)


def nmf_clustergram(
    adata: AnnData,
    *,
    key: str = _keys.NMF,
    cmap: str = "viridis_r",
    ax: Axes | None = None,
    show: bool | None = None,
    save: str | None = None,
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
    ax
        Axes to draw into; a new figure when ``None``.
    show
        Show the figure (default: ``scanpy.settings.autoshow``, as in Scanpy) and return ``None``; ``False``
        returns it for further drawing.
    save
        Path to save the figure to (any format matplotlib writes, e.g. ``.png`` or ``.pdf``).

    Returns
    -------
    The :class:`~matplotlib.axes.Axes` when ``show=False``, else ``None``.
    """
    import matplotlib.pyplot as plt

    u = _uns(adata, key, "consensus_nmf")
    if "distances" not in u:
        msg = f"adata.uns[{key!r}] holds no 'distances' (more than 2,000 pooled components); nothing to draw."
        raise KeyError(msg)
    comp = u["components"]
    kept = comp["kept"].to_numpy(dtype=bool)
    cl = comp["cluster"].to_numpy()
    idx = np.flatnonzero(kept)
    # order by cluster, then by silhouette within the cluster (most typical first)
    sil = comp["silhouette"].to_numpy(dtype=float)
    order = idx[np.lexsort((-sil[idx], cl[idx]))]
    d = np.asarray(u["distances"], dtype=float)[np.ix_(order, order)]
    if ax is None:
        _, ax = plt.subplots(figsize=(4.8, 4.2))
    im = ax.imshow(d, cmap=cmap, interpolation="nearest")
    bounds = np.flatnonzero(np.diff(cl[order])) + 0.5
    for b in bounds:
        ax.axhline(b, color="white", lw=0.6)
        ax.axvline(b, color="white", lw=0.6)
    ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label=f"{u['params'].get('metric', '')} distance")
    ax.set(xticks=[], yticks=[], title=f"{len(order)} components in {len(np.unique(cl[order]))} clusters")
    return finish(ax, show, save=save)


def nmf_programs(
    adata: AnnData,
    *,
    key: str = _keys.NMF,
    n_genes: int = 10,
    ncols: int = 4,
    ax: Any = None,
    show: bool | None = None,
    save: str | None = None,
) -> Figure | None:
    """Top genes of each programme (bar charts of the consensus spectra weights).

    With ``normalization="sum"`` (the default) each programme's weights sum to 1 over the genes; the bars show them as
    percentages.

    Parameters
    ----------
    adata
        AnnData after :func:`gpuc.tl.consensus_nmf`.
    key
        Its ``key_added``.
    n_genes
        Genes per programme.
    ncols
        Panels per row.
    ax
        A sequence of at least k Axes; a new figure when ``None``.
    show
        Show the figure (default: ``scanpy.settings.autoshow``, as in Scanpy) and return ``None``; ``False``
        returns it for further drawing.
    save
        Path to save the figure to (any format matplotlib writes, e.g. ``.png`` or ``.pdf``).

    Returns
    -------
    The :class:`~matplotlib.figure.Figure` when ``show=False``, else ``None``.
    """
    import matplotlib.pyplot as plt

    n_genes = check_int("n_genes", n_genes, minimum=1)
    top = nmf_top_genes(adata, n_genes, key=key)
    names = list(top["program"].cat.categories)
    k = len(names)
    if ax is None:
        nrow = int(np.ceil(k / ncols))
        fig, axes = plt.subplots(
            nrow, min(ncols, k), figsize=(2.6 * min(ncols, k), 0.22 * n_genes * nrow + 0.9 * nrow), squeeze=False
        )
        axes = axes.ravel()
    else:
        axes = np.ravel(ax)
        fig = axes[0].figure
    from matplotlib.ticker import MaxNLocator

    percent = adata.uns.get(key, {}).get("params", {}).get("normalization", "sum") == "sum"
    for j, p in enumerate(names):
        sub = top[top["program"] == p]
        a = axes[j]
        w = sub["weight"].to_numpy() * (100.0 if percent else 1.0)
        a.barh(np.arange(len(sub))[::-1], w, color=f"C{j % 10}")
        a.set_yticks(np.arange(len(sub))[::-1], sub["gene"], fontsize=7)
        a.set_title(p, fontsize=9)
        a.xaxis.set_major_locator(MaxNLocator(nbins=3))
        a.tick_params(axis="x", labelsize=7)
        a.set_xlabel("% of programme" if percent else "weight (L2-normalised)", fontsize=7)
    for a in axes[k:]:
        a.set_visible(False)
    fig.tight_layout()
    return finish(fig, show, save=save)


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
    save: str | None = None,
) -> Figure | None:
    """Programme usages on an embedding (``obsm['X_' + basis]``), one panel per programme.

    The title says which fit the programmes come from: one on these observations (cells or metacells), or a separate
    fit when ``obsm['X_' + key]`` was copied in without its ``uns[key]`` (e.g. metacell usages mapped to cells).
    Programme numbers (``P1`` ..., ordered by total usage) belong to one :func:`gpuc.tl.consensus_nmf` call, so ``P1``
    of a fit on metacells need not be ``P1`` of a fit on their cells.

    Parameters
    ----------
    adata
        AnnData after :func:`gpuc.tl.consensus_nmf`, with ``obsm['X_' + basis]`` (cells or metacells).
    basis
        Embedding name (``"umap"``, ``"pca"``, ...).
    key
        The consensus ``key_added``.
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
        A sequence of Axes, one per programme; a new figure when ``None``.
    show
        Show the figure (default: ``scanpy.settings.autoshow``, as in Scanpy) and return ``None``; ``False``
        returns it for further drawing.
    save
        Path to save the figure to (any format matplotlib writes, e.g. ``.png`` or ``.pdf``).

    Returns
    -------
    The :class:`~matplotlib.figure.Figure` when ``show=False``, else ``None``.
    """
    import matplotlib.pyplot as plt

    check_adata(adata)
    uk = _keys.nmf_usages(key)
    check_key(adata.obsm, uk, "adata.obsm", f"Run gpuc.tl.consensus_nmf(adata, k, key_added={key!r}) first.")
    ek = f"X_{basis}"
    check_key(adata.obsm, ek, "adata.obsm", f"Compute the embedding first (e.g. sc.tl.{basis}).")
    usage = np.asarray(adata.obsm[uk], dtype=float)
    if normalize:
        usage = usage / np.maximum(usage.sum(axis=1, keepdims=True), 1e-300)
    emb = np.asarray(adata.obsm[ek])[:, :2]
    names = program_names(usage.shape[1])
    sel = list(range(usage.shape[1])) if programs is None else [int(p) for p in programs]
    size = size if size is not None else float(np.clip(12000 / max(adata.n_obs, 1), 1.0, 60.0))
    if ax is None:
        nc = min(ncols, len(sel))
        nrow = int(np.ceil(len(sel) / nc))
        fig, axes = plt.subplots(nrow, nc, figsize=(3.0 * nc, 2.8 * nrow), squeeze=False)
        axes = axes.ravel()
    else:
        axes = np.ravel(ax)
        fig = axes[0].figure
    for a, j in zip(axes, sel, strict=False):
        order = np.argsort(usage[:, j])
        sc_ = a.scatter(
            emb[order, 0], emb[order, 1], c=usage[order, j], s=size, cmap=cmap, linewidths=0, rasterized=True
        )
        fig.colorbar(sc_, ax=a, fraction=0.046, pad=0.02)
        a.set(xticks=[], yticks=[], title=names[j])
        a.set_xlabel(f"{basis.upper()}1", fontsize=7)
        a.set_ylabel(f"{basis.upper()}2", fontsize=7)
    for a in axes[len(sel) :]:
        a.set_visible(False)
    if ax is None:
        what = "metacells" if _keys.METACELL_SOURCE in adata.uns else "cells"
        k = usage.shape[1]
        source = (
            f"fitted on these {adata.n_obs} {what}"
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
