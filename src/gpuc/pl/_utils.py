"""What every gpuc plot does at the end: save if asked, then show (Scanpy semantics) or return the drawing."""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure


def finish(drawn: Any, show: bool | None, *, save: str | None = None) -> Any:
    """Save ``drawn`` (an Axes or a Figure) if ``save`` is given; show it and return None, or return it.

    ``show=None`` follows ``scanpy.settings.autoshow`` (True by default), as Scanpy's plots do; ``show=False``
    returns the Axes or Figure for further drawing.
    """
    import matplotlib.pyplot as plt

    if save:
        fig = drawn if isinstance(drawn, Figure) else drawn.figure
        fig.savefig(save, dpi=150, bbox_inches="tight")
    if show is None:
        import scanpy as sc

        show = sc.settings.autoshow
    if show:
        plt.show()
        return None
    return drawn


def category_colors(adata: Any, key: str, categories: Any) -> list[Any]:
    """Colours of the categories of ``obs[key]``, the ones Scanpy's plots use.

    ``uns[key + '_colors']`` when it has one colour per category (Scanpy writes it the first time it plots the
    column), else the colours Scanpy would choose for that many categories (matplotlib's colour cycle when it is
    long enough, else Scanpy's default palettes), so a column has the same colours in ``sc.pl.umap`` and in gpuc's
    plots.
    """
    from matplotlib import rcParams
    from scanpy.plotting import palettes

    n = len(categories)
    stored = adata.uns.get(f"{key}_colors")
    if stored is not None and len(stored) == n:
        return list(stored)
    # the same choice as scanpy.plotting._utils._set_default_colors_for_categorical_obs
    cycle = rcParams["axes.prop_cycle"].by_key()["color"]
    if len(cycle) >= n:
        return list(cycle[:n])
    if n <= 20:
        pal = palettes.default_20
    elif n <= 28:
        pal = palettes.default_28
    elif n <= len(palettes.default_102):
        pal = palettes.default_102
    else:
        return ["grey"] * n
    return list(pal[:n])


def spread_colors(xy: Any, palette: list[Any], n_neighbors: int = 8) -> list[Any]:
    """One colour per point of ``xy`` (``(n, 2)``) such that no point shares its colour with any of its
    ``n_neighbors`` nearest points (greedy colouring of the symmetric kNN graph, in order of most neighbours first);
    when the palette is too short for a point, the colour least used among its neighbours is taken.
    """
    import numpy as np

    xy = np.asarray(xy, dtype=float)
    n = xy.shape[0]
    if n == 0:
        return []
    nn = min(n_neighbors, n - 1)
    from scipy.spatial import cKDTree

    near = cKDTree(xy).query(xy, k=nn + 1)[1][:, 1:] if nn > 0 else np.zeros((n, 0), dtype=int)
    adj = [set() for _ in range(n)]
    for i in range(n):
        for j in near[i]:
            if j == i:
                continue
            adj[i].add(int(j))
            adj[int(j)].add(i)
    order = sorted(range(n), key=lambda i: (-len(adj[i]), i))
    colour = [-1] * n
    for i in order:
        used = [colour[j] for j in adj[i] if colour[j] >= 0]
        free = [c for c in range(len(palette)) if c not in used]
        colour[i] = free[0] if free else int(np.argmin(np.bincount(used, minlength=len(palette))))
    return [palette[c] for c in colour]


def place_labels(ax: Any, x: Any, y: Any, labels: Any, *, fontsize: float = 7) -> list[Any]:
    """Label the points ``(x, y)`` of ``ax`` without overlapping labels (in order: put the most important first).

    Each label tries positions around its point at growing distances and takes the first whose box overlaps no
    label placed before it, no other labelled point and stays inside the Axes; a thin line joins a label to its
    point when it had to move away. A label that finds no free place is left out. Returns the Text objects.
    """
    import numpy as np

    fig = ax.figure
    ax.get_xlim(), ax.get_ylim()  # apply pending autoscaling before data -> display transforms
    renderer = fig.canvas.get_renderer()
    pts = ax.transData.transform(np.column_stack([np.asarray(x, float), np.asarray(y, float)]))
    axbox = ax.get_window_extent(renderer)
    placed: list[Any] = []
    texts = []
    pad = 2.0
    dirs = [(1, 1), (-1, 1), (1, -1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1)]
    for i, label in enumerate(labels):
        t = ax.annotate(
            str(label), (x[i], y[i]), xytext=(0, 0), textcoords="offset points", fontsize=fontsize, zorder=4
        )
        bb = t.get_window_extent(renderer)
        w, h = bb.width, bb.height
        px, py = pts[i]
        done = False
        for r in (4, 10, 18, 28, 40, 55):
            for dx, dy in dirs:
                # box corner so that the box sits on the side (dx, dy) of the point
                x0 = px + dx * r - (w if dx < 0 else (w / 2 if dx == 0 else 0))
                y0 = py + dy * r - (h if dy < 0 else (h / 2 if dy == 0 else 0))
                box = (x0 - pad, y0 - pad, x0 + w + pad, y0 + h + pad)
                if box[0] < axbox.x0 or box[2] > axbox.x1 or box[1] < axbox.y0 or box[3] > axbox.y1:
                    continue
                if any(not (box[2] < b[0] or box[0] > b[2] or box[3] < b[1] or box[1] > b[3]) for b in placed):
                    continue
                if any(box[0] <= qx <= box[2] and box[1] <= qy <= box[3] for j, (qx, qy) in enumerate(pts) if j != i):
                    continue
                dpi = fig.dpi / 72.0
                t.set_position(((x0 - px) / dpi, (y0 - py) / dpi))
                t.set_horizontalalignment("left")
                t.set_verticalalignment("bottom")
                if r > 10:
                    ax.annotate(
                        "",
                        (x[i], y[i]),
                        xytext=((x0 + (w if dx < 0 else 0) - px) / dpi, (y0 + (h if dy < 0 else 0) - py) / dpi),
                        textcoords="offset points",
                        arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.4"},
                    )
                placed.append(box)
                texts.append(t)
                done = True
                break
            if done:
                break
        if not done:
            t.remove()
    return texts
