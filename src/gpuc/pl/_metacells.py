"""Plots of what :func:`gpuc.tl.metacells` and :func:`gpuc.tl.metacell_quality` wrote."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from anndata import AnnData
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from gpuc import _keys
from gpuc._validate import check_int
from gpuc.get._checks import metacell_labels, metacell_quality_table, tool_output
from gpuc.pl._utils import check_number, finish, panels, plot_function, single_ax


@plot_function
def metacells(
    adata: AnnData,
    basis: str = "umap",
    *,
    key: str = _keys.METACELL,
    color: str | None = None,
    show_centers: bool = True,
    size: float | None = None,
    center_size: float = 40.0,
    ax: Axes | None = None,
    show: bool | None = None,
    save: str | bool | None = None,
) -> Axes | None:
    """Cells on an embedding coloured by metacell (or by ``color``), with each metacell's centre on top.

    Metacells are coloured so that no metacell shares its colour with its 8 nearest metacells on the embedding
    (a 20-colour palette assigned greedily), so neighbours stay apart however many metacells there are. A
    categorical ``color`` uses the colours Scanpy uses for that column (``uns[color + '_colors']``, or Scanpy's
    default palette), so a cell type has the same colour here as in ``sc.pl.umap``. Each centre is drawn at the
    member cell nearest to the mean position of the metacell's cells, so it always lies on the cells it stands for.

    Parameters
    ----------
    {metacell_embedding}
    color
        ``obs`` column to colour cells by instead of the metacell label.
    show_centers
        Overlay each metacell's centre (its member cell nearest to the members' mean position).
    size
        Cell marker size (default scales with the number of cells).
    center_size
        Marker size of the metacell centres.
    {ax_show_save}

    {returns_axes}
    """
    from scanpy.plotting import palettes

    from gpuc.pl._utils import category_colors, spread_colors

    labels = metacell_labels(adata, key)
    emb_key = basis if basis in adata.obsm else f"X_{basis}"
    if emb_key not in adata.obsm:
        msg = f"basis {basis!r} not found in adata.obsm (looked for {basis!r} and 'X_{basis}')."
        raise KeyError(msg)
    if color is not None and color not in adata.obs:
        msg = f"color={color!r} is not a column of adata.obs."
        raise KeyError(msg)
    if size is not None:
        size = check_number("size", size, low=0, strict=True)
    center_size = check_number("center_size", center_size, low=0)
    ax = single_ax(ax, "the embedding", (5.5, 5))
    xy = np.asarray(adata.obsm[emb_key], dtype=float)[:, :2]
    codes = labels.cat.codes.to_numpy()
    n_mc = labels.cat.categories.size
    centres = metacell_centers(xy, codes, n_mc)
    s = size if size is not None else max(1.0, 120000 / max(adata.n_obs, 1) / 20)
    if color is None:
        from matplotlib.colors import to_rgba

        mc_cols = np.tile(np.array([0.8, 0.8, 0.8, 1.0]), (n_mc, 1))
        live = np.isfinite(centres[:, 0])
        mc_cols[live] = [to_rgba(c) for c in spread_colors(centres[live], list(palettes.default_20))]
        cols = np.tile(np.array([0.8, 0.8, 0.8, 1.0]), (adata.n_obs, 1))
        cols[codes >= 0] = mc_cols[codes[codes >= 0]]
        ax.scatter(xy[:, 0], xy[:, 1], c=cols, s=s, linewidths=0, rasterized=True)
        title = f"{n_mc} metacells ({key})"
    else:
        vals = adata.obs[color]
        if isinstance(vals.dtype, pd.CategoricalDtype) or vals.dtype == object or vals.dtype == bool:
            cat = vals.astype("category")
            palette = category_colors(adata, color, cat.cat.categories)
            for i, c in enumerate(cat.cat.categories):
                m = (cat == c).to_numpy()
                ax.scatter(xy[m, 0], xy[m, 1], color=palette[i], s=s, linewidths=0, label=str(c), rasterized=True)
            missing = cat.isna().to_numpy()
            if missing.any():
                ax.scatter(xy[missing, 0], xy[missing, 1], color="lightgrey", s=s, linewidths=0, label="NA")
            ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False, markerscale=3, fontsize=8)
        else:
            sc_ = ax.scatter(
                xy[:, 0], xy[:, 1], c=np.asarray(vals, dtype=float), s=s, linewidths=0, cmap="viridis", rasterized=True
            )
            ax.figure.colorbar(sc_, ax=ax, shrink=0.6, label=color)
        title = f"{color}, with the {n_mc} metacells" if show_centers else color
    if show_centers:
        ax.scatter(
            centres[:, 0],
            centres[:, 1],
            s=center_size,
            c="black",
            edgecolors="white",
            linewidths=0.8,
            zorder=3,
            label="_metacell centres",
        )
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel(f"{basis.upper()}1")
    ax.set_ylabel(f"{basis.upper()}2")
    ax.set_title(title)
    return finish(ax, show, save=save)


def metacell_centers(xy: np.ndarray, codes: np.ndarray, n: int) -> np.ndarray:
    """``(n, 2)``: for each metacell, the position of its member cell nearest to its members' mean (NaN if empty)."""
    out = np.full((n, 2), np.nan)
    idx = np.flatnonzero(codes >= 0)
    c = codes[idx]
    count = np.bincount(c, minlength=n)
    mean = np.stack([np.bincount(c, weights=xy[idx, d], minlength=n) for d in (0, 1)], axis=1)
    mean /= np.maximum(count, 1)[:, None]
    dist = ((xy[idx] - mean[c]) ** 2).sum(axis=1)
    order = np.lexsort((dist, c))  # by metacell, nearest first
    first = order[np.r_[True, c[order][1:] != c[order][:-1]]] if idx.size else order
    out[c[first]] = xy[idx[first]]
    return out


@plot_function
def metacell_sizes(
    adata: AnnData,
    key: str = _keys.METACELL,
    *,
    bins: int = 30,
    ax: Axes | None = None,
    show: bool | None = None,
    save: str | bool | None = None,
) -> Axes | None:
    """Histogram of the number of cells per metacell (hard labels).

    Parameters
    ----------
    {metacell_run}
    bins
        Histogram bins.
    {ax_show_save}

    {returns_axes}
    """
    labels = metacell_labels(adata, key)
    bins = check_int("bins", bins, minimum=1)
    ax = single_ax(ax, "the histogram", (4.5, 3.5))
    sizes = labels.value_counts().to_numpy()
    ax.hist(sizes, bins=bins, color="#4c72b0", edgecolor="white")
    ax.axvline(np.median(sizes), color="black", ls="--", lw=1, label=f"median {np.median(sizes):.0f}")
    ax.set_xlabel("cells per metacell")
    ax.set_ylabel("metacells")
    ax.legend(frameon=False)
    ax.set_title(f"{len(sizes)} metacells, {adata.n_obs} cells")
    return finish(ax, show, save=save)


@plot_function
def metacell_quality(
    adata: AnnData,
    key: str = _keys.METACELL,
    *,
    quality_key: str | None = None,
    ax: Sequence[Axes] | None = None,
    show: bool | None = None,
    save: str | bool | None = None,
) -> Figure | None:
    """Distributions of compactness, separation and (if computed) the separation within cell types and purity, one
    panel each.

    Compactness and separation are drawn on a log axis when they span more than a factor of 30 (isolated metacells
    would otherwise flatten the boxes); every metacell is a dot over the box.

    Parameters
    ----------
    adata
        AnnData on which :func:`gpuc.tl.metacell_quality` ran.
    key
        ``key_added`` of the metacell run.
    quality_key
        ``uns`` key of the quality table (default ``key + "_quality"``).
    ax
        One Axes per panel (compactness, separation, then each ``*_separation`` and purity column), e.g. from
        ``plt.subplots(1, 3)``; a new figure when ``None``.
    {show_save}

    {returns_figure}
    """
    df = metacell_quality_table(adata, key, quality_key)
    cols = ["compactness", "separation"]
    cols += [c for c in df.columns if c.endswith("_separation")] + [c for c in df.columns if c.endswith("_purity")]
    fig, axes = panels(ax, len(cols), f"one per panel: {', '.join(cols)}", (3.2, 3.4))
    ylabels = {
        "compactness": "variance within the metacell\n(diffusion components)",
        "separation": "distance to the nearest metacell\n(diffusion components)",
    }
    for a, c in zip(axes, cols, strict=True):
        v = pd.to_numeric(df[c], errors="coerce").dropna().to_numpy()
        # compactness and separation span orders of magnitude (a few isolated metacells are far from the rest): a
        # log axis shows the bulk and the outliers together
        if c.endswith("_separation"):
            ylabels[c] = f"distance to a metacell of the same\n{c.removesuffix('_separation')} (diffusion components)"
        log = c in ylabels and v.size > 0 and (v > 0).all() and v.max() / v.min() > 30
        a.boxplot(v, widths=0.5, showfliers=False)
        a.scatter(np.random.default_rng(0).normal(1, 0.05, v.size), v, s=8, alpha=0.6, color="#4c72b0")
        if log:
            a.set_yscale("log")
        a.set_xticks([])
        better = "lower is better" if c == "compactness" else "higher is better"
        if c.endswith("_separation") and v.size < len(df):
            better += f"; {len(df) - v.size} NaN"
        a.set_title(f"{c}\n({better})", fontsize=10)
        a.set_ylabel(
            ylabels.get(c, f"fraction of cells of the majority {c.removesuffix('_purity')}")
            + (" (log scale)" if log else ""),
            fontsize=8,
        )
    return finish(fig, show, save=save, layout=ax is None)


@plot_function
def metacell_convergence(
    adata: AnnData,
    key: str = _keys.METACELL,
    *,
    ax: Axes | None = None,
    show: bool | None = None,
    save: str | bool | None = None,
) -> Axes | None:
    """The RSS trace ``||M - M B A||_F`` per iteration (one line per group with ``groupby``).

    Parameters
    ----------
    {metacell_run}
    {ax_show_save}

    {returns_axes}
    """
    metacell_labels(adata, key)
    info = tool_output(adata, key, "metacells")
    ax = single_ax(ax, "the RSS trace", (4.5, 3.5))
    traces = {v.get("group", g): v["rss"] for g, v in info["groups"].items()} if "groups" in info else {"": info["rss"]}
    for g, r in traces.items():
        r = np.asarray(r)
        ax.plot(np.arange(r.size), r, marker="o", ms=3, label=g or None)
    if len(traces) > 1:
        ax.legend(frameon=False, fontsize=8)
    ax.set_xlabel("iteration (0 = initialisation)")
    ax.set_ylabel("RSS  ||M - MBA||")
    ax.set_title("metacell convergence")
    return finish(ax, show, save=save)


@plot_function
def metacell_assignment_quality(
    adata: AnnData,
    key: str = _keys.METACELL,
    *,
    quality_key: str | None = None,
    bins: int = 30,
    ax: Sequence[Axes] | None = None,
    show: bool | None = None,
    save: str | bool | None = None,
) -> Figure | None:
    """How clearly cells belong to their metacells: entropy of the soft assignments, the largest weight, and the
    number of non-trivial weights per cell (the SEACells tutorial's checks), one panel each.

    The third panel draws the cells without any weight above the threshold in red: many of them suggest too many
    metacells for the data (SEACells issue #43).

    Parameters
    ----------
    adata
        AnnData on which :func:`gpuc.tl.metacell_assignment_quality` ran.
    key
        ``key_added`` of the metacell run.
    quality_key
        ``key_added`` of :func:`gpuc.tl.metacell_assignment_quality` (default ``key``).
    bins
        Histogram bins of the first two panels.
    ax
        Three Axes (entropy, largest weight, number of non-trivial weights), e.g. from ``plt.subplots(1, 3)``; a new
        figure when ``None``.
    {show_save}

    {returns_figure}
    """
    metacell_labels(adata, key)
    qk = key if quality_key is None else quality_key
    cols = _keys.metacell_assignment_columns(qk)
    entry = adata.uns.get(_keys.metacell_assignment_quality(qk))
    if (
        not isinstance(entry, Mapping)
        or "threshold" not in entry.get("params", {})
        or any(c not in adata.obs for c in cols.values())
    ):
        msg = f"No assignment checks under {qk!r}: run gpuc.tl.metacell_assignment_quality(adata, {key!r}) first."
        raise KeyError(msg)
    bins = check_int("bins", bins, minimum=1)
    threshold = float(entry["params"]["threshold"])
    fig, axes = panels(ax, 3, "one per panel: entropy, largest weight, non-trivial weights", (3.4, 3.2))
    k = adata.obsm[_keys.metacell_weights(key)].shape[1]
    ent = np.asarray(adata.obs[cols["entropy"]], dtype=float)
    ent = ent[np.isfinite(ent)]
    axes[0].hist(ent, bins=bins, color="#4c72b0", edgecolor="white")
    axes[0].axvline(np.median(ent), color="black", ls="--", lw=1)
    axes[0].set_xlabel(f"entropy of the weights (nats)\nmedian {np.median(ent):.2f} (dashed)")
    axes[0].set_title(f"assignment entropy\n(lower is clearer; even over all {k}: {np.log(k):.1f})", fontsize=10)
    mx = np.asarray(adata.obs[cols["max_weight"]], dtype=float)
    axes[1].hist(mx, bins=np.linspace(0, 1, bins + 1), color="#4c72b0", edgecolor="white")
    axes[1].axvline(np.median(mx), color="black", ls="--", lw=1)
    axes[1].set_xlim(0, 1)
    axes[1].set_xlabel(f"largest weight of the cell\nmedian {np.median(mx):.2f} (dashed)")
    axes[1].set_title("strongest assignment\n(higher is clearer)", fontsize=10)
    for a in axes[:2]:
        a.set_ylabel("cells")
    n = np.asarray(adata.obs[cols["n_assigned"]], dtype=np.int64)
    counts = np.bincount(n)
    colours = ["#c44e52"] + ["#4c72b0"] * (counts.size - 1)
    bars = axes[2].bar(np.arange(counts.size), counts, color=colours, edgecolor="white", width=0.9)
    axes[2].bar_label(bars, fontsize=7)  # a handful of cells at 0 would be invisible as a bar alone
    axes[2].margins(y=0.12)
    axes[2].set_xticks(np.arange(counts.size))
    axes[2].set_xlabel(f"weights > {threshold:g}")
    axes[2].set_ylabel("cells")
    axes[2].set_title(
        f"non-trivial (> {threshold:g}) assignments\n{counts[0]} cells ({100 * counts[0] / max(n.size, 1):.1f}%) with none",
        fontsize=10,
    )
    return finish(fig, show, save=save, layout=ax is None)


@plot_function
def metacell_initialization(
    adata: AnnData,
    basis: str = "umap",
    *,
    key: str = _keys.METACELL,
    size: float | None = None,
    archetype_size: float = 20.0,
    ax: Axes | None = None,
    show: bool | None = None,
    save: str | bool | None = None,
) -> Axes | None:
    """The initial archetypes (the cells the fit started from) over the cells on an embedding, as SEACells'
    ``plot.plot_initialization``: they should spread over the whole phenotypic space.

    Parameters
    ----------
    {metacell_embedding}
    size
        Cell marker size (default scales with the number of cells).
    archetype_size
        Marker size of the initial archetypes.
    {ax_show_save}

    {returns_axes}
    """
    metacell_labels(adata, key)
    info = tool_output(adata, key, "metacells")
    emb_key = basis if basis in adata.obsm else f"X_{basis}"
    if emb_key not in adata.obsm:
        msg = f"basis {basis!r} not found in adata.obsm (looked for {basis!r} and 'X_{basis}')."
        raise KeyError(msg)
    if size is not None:
        size = check_number("size", size, low=0, strict=True)
    archetype_size = check_number("archetype_size", archetype_size, low=0)
    table = info["metacells"]
    if not isinstance(table, pd.DataFrame) and hasattr(table, "to_memory"):
        table = table.to_memory()
    names = np.asarray(table["initial_archetype"], dtype=str)
    names = names[names != ""]
    if not adata.obs_names.is_unique:
        msg = "the initial archetypes are stored by obs name, and adata.obs_names are not unique."
        raise ValueError(msg)
    pos = adata.obs_names.get_indexer(names)
    if (pos < 0).any():
        msg = f"initial archetypes not among adata.obs_names: {list(names[pos < 0][:5])} (was adata subset?)."
        raise KeyError(msg)
    ax = single_ax(ax, "the embedding", (5, 5))
    xy = np.asarray(adata.obsm[emb_key], dtype=float)[:, :2]
    s = size if size is not None else max(1.0, 120000 / max(adata.n_obs, 1) / 20)
    ax.scatter(xy[:, 0], xy[:, 1], s=s, color="lightgrey", linewidths=0, rasterized=True)
    ax.scatter(
        xy[pos, 0], xy[pos, 1], s=archetype_size, color="#c44e52", edgecolors="black", linewidths=0.5, zorder=3,
    )  # fmt: skip
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel(f"{basis.upper()}1")
    ax.set_ylabel(f"{basis.upper()}2")
    ax.set_title(f"{pos.size} initial archetypes (red) over {adata.n_obs:,} cells ({key})")
    return finish(ax, show, save=save)
