"""What every gpuc plot shares: argument checks before drawing, the shared docstring parts, and the end of a plot.

A plot ends by saving if asked, then showing as Scanpy does or returning the drawing.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from gpuc._docs import doc_params as _fill_docs
from gpuc._validate import check_int
from gpuc._validate import check_number as _check_number

# ---- docstring parts shared by every plot: ``{name}`` on a line of its own is replaced by the text, indented alike --
_SHOW_SAVE = """\
show
    Show the figure (default: ``scanpy.settings.autoshow``, as in Scanpy) and return ``None``; ``False``
    returns it for further drawing.
save
    Save the figure: a path (any format matplotlib writes, e.g. ``.png`` or ``.pdf``), or ``True`` for Scanpy's
    default file, ``scanpy.settings.figdir / (<plot name> + scanpy.settings.plot_suffix + '.' +
    scanpy.settings.file_format_figs)``. Checked before anything is drawn."""
_METACELL_ADATA = "adata\n    AnnData on which :func:`gpuc.tl.metacells` ran.\n"
_METACELL_KEY = "key\n    ``key_added`` of the metacell run."
_DESEQ_ADATA = "adata\n    AnnData after :func:`gpuc.tl.deseq`.\n"
_DESEQ_KEY = "key, group\n    As in :func:`gpuc.get.deseq_results`."
DOC = {
    "show_save": _SHOW_SAVE,
    "ax_show_save": "ax\n    Axes to draw into; a new figure when ``None``.\n" + _SHOW_SAVE,
    "metacell_run": _METACELL_ADATA + _METACELL_KEY,
    "metacell_embedding": _METACELL_ADATA
    + 'basis\n    Embedding: ``obsm["X_" + basis]`` (or ``obsm[basis]``), first two columns.\n'
    + _METACELL_KEY,
    "deseq_run": _DESEQ_ADATA + _DESEQ_KEY,
    "deseq_results": _DESEQ_ADATA + "contrast\n    Which results (see :func:`gpuc.get.deseq_results`).\n" + _DESEQ_KEY,
    "consensus_run": "adata\n    AnnData after :func:`gpuc.tl.consensus_nmf`.\nkey\n    Its ``key_added``.",
    "label_genes": (
        "n_top\n    Number of most significant genes to label (labels never overlap; one that finds no free place is left"
        " out).\ngene_symbols\n    ``var`` column to label genes with; default: a symbol column of ``var`` if there is"
        " one\n    (``gene_symbols``, ``symbol``, ``gene_name`` ...), else the gene names."
    ),
    "returns_axes": "Returns\n-------\nThe :class:`~matplotlib.axes.Axes` when ``show=False``, else ``None``.",
    "returns_figure": "Returns\n-------\nThe :class:`~matplotlib.figure.Figure` when ``show=False``, else ``None``.",
}


def doc_params(func: Callable) -> Callable:
    """Fill the plots' shared parts (:data:`DOC`) and the package's (:mod:`gpuc._docs`) into ``func``'s docstring."""
    return _fill_docs(**DOC)(func)


# ---- argument checks, all before any figure is made -------------------------------------------------------------
def check_show(show: Any) -> bool | None:
    """``show`` must be ``None``, ``True`` or ``False``."""
    if show is not None and not isinstance(show, bool | np.bool_):
        msg = f"show must be None, True or False, got {show!r}."
        raise TypeError(msg)
    return show


def resolve_save(save: Any, name: str) -> Path | None:
    """The file a plot saves to, checked before drawing: ``None``/``False`` (none), ``True`` (Scanpy's default file
    for the plot ``name``) or a path whose format matplotlib writes and whose folder exists.
    """
    if save is None or save is False:
        return None
    if save is True:
        import scanpy as sc

        path = Path(sc.settings.figdir) / f"{name}{sc.settings.plot_suffix}.{sc.settings.file_format_figs}"
        path.parent.mkdir(parents=True, exist_ok=True)  # Scanpy creates its figure folder too
        return path
    if not isinstance(save, str | os.PathLike) or not str(save):
        msg = f"save must be None, True, False or a file path, got {save!r}."
        raise TypeError(msg)
    path = Path(save)
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    ext = path.suffix.lstrip(".").lower()
    if ext and ext not in formats:
        msg = f"save={str(save)!r}: matplotlib cannot write {ext!r} files; use one of {', '.join(sorted(formats))}."
        raise ValueError(msg)
    if not path.parent.is_dir():
        msg = f"save={str(save)!r}: the folder {str(path.parent)!r} does not exist."
        raise ValueError(msg)
    return path


def check_axes(ax: Any, n: int | None, what: str, *, at_least: bool = False) -> list[Axes] | None:
    """``ax`` as a list of Axes: ``None`` (the plot makes its figure), one Axes (when ``n`` is 1), or a sequence or
    array of ``n`` Axes (``at_least``: ``n`` or more; ``n=None``: any number); a :class:`ValueError` before drawing
    otherwise, naming ``what`` the Axes are for.
    """
    if ax is None:
        return None
    axes = [ax] if isinstance(ax, Axes) else (list(np.ravel(np.asarray(ax, dtype=object))) if _seq(ax) else None)
    if axes is None or not all(isinstance(a, Axes) for a in axes):
        msg = f"ax must be a matplotlib Axes or a sequence of Axes ({what}), got {type(ax).__name__}."
        raise TypeError(msg)
    if n is not None and (len(axes) < n if at_least else len(axes) != n):
        need = f"at least {n}" if at_least else f"{n}"
        msg = f"ax must hold {need} Axes ({what}); got {len(axes)}."
        raise ValueError(msg)
    return axes


def single_ax(ax: Any, what: str, figsize: tuple[float, float]) -> Axes:
    """The caller's Axes (checked: one Axes, for ``what``) or that of a new figure of ``figsize``."""
    import matplotlib.pyplot as plt

    axes = check_axes(ax, 1, what)
    return plt.subplots(figsize=figsize)[1] if axes is None else axes[0]


def panels(
    ax: Any, n: int, what: str, size: tuple[float, float], *, ncols: int | None = None, at_least: bool = False
) -> tuple[Figure, list[Axes]]:
    """``n`` panels: the caller's Axes (checked by :func:`check_axes`, ``n`` of them, or ``at_least`` ``n`` with the
    extras hidden), or a new figure of ``ncols`` panels per row (default: one row), each panel ``size`` inches.
    """
    import matplotlib.pyplot as plt

    axes = check_axes(ax, n, what, at_least=at_least)
    if axes is None:
        nc = n if ncols is None else min(ncols, n)
        nrow = int(np.ceil(n / nc))
        _, grid = plt.subplots(nrow, nc, figsize=(size[0] * nc, size[1] * nrow), squeeze=False)
        axes = list(grid.ravel())
    for a in axes[n:]:
        a.set_visible(False)
    return axes[0].figure, axes


def _seq(x: Any) -> bool:
    return isinstance(x, Sequence | np.ndarray) and not isinstance(x, str)


def check_ncols(ncols: Any) -> int:
    """``ncols`` (panels per row) must be an integer >= 1."""
    return check_int("ncols", ncols, minimum=1)


def check_number(name: str, value: Any, *, low: float | None = None, high: float | None = None, strict: bool = False):
    """``value`` must be a real number within ``[low, high]`` (``strict``: ``(low, high)``); returns it as a float.

    The package's one number check (:func:`gpuc._validate.check_number`), with the plots' ``strict`` shorthand; an
    infinite value is refused too (no axis or threshold of a plot can be infinite).
    """
    value = _check_number(name, value, low=low, high=high, low_open=strict, high_open=strict)
    if not np.isfinite(value):
        msg = f"{name}={value!r} must be a finite number."
        raise ValueError(msg)
    return value


def check_cmap(cmap: Any) -> Any:
    """``cmap`` must name a matplotlib colour map (or be one)."""
    from matplotlib import colormaps
    from matplotlib.colors import Colormap

    if isinstance(cmap, Colormap):
        return cmap
    if not isinstance(cmap, str) or cmap not in colormaps:
        msg = f"cmap={cmap!r} is not a matplotlib colour map (e.g. 'viridis'; see matplotlib.colormaps)."
        raise ValueError(msg)
    return cmap


def plot_function(func: Callable) -> Callable:
    """Make ``func`` a gpuc plot: the shared docstring parts filled in, ``show`` and ``save`` checked before it
    draws (``save`` arrives resolved to a path or ``None``), and any figure it opened closed again if it fails, so
    that a bad argument leaves no open figure behind.
    """
    import matplotlib.pyplot as plt

    doc_params(func)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        check_show(kwargs.get("show"))
        kwargs["save"] = resolve_save(kwargs.get("save"), func.__name__)
        before = set(plt.get_fignums())
        try:
            return func(*args, **kwargs)
        except Exception:
            for num in set(plt.get_fignums()) - before:
                plt.close(num)
            raise

    return wrapper


def finish(drawn: Any, show: bool | None, *, save: Path | None = None, layout: bool = False) -> Any:
    """Save ``drawn`` (an Axes or a Figure) if ``save`` is given; show it and return None, or return it.

    ``layout`` first applies ``tight_layout`` to the figure (for figures the plot made itself). ``show=None``
    follows ``scanpy.settings.autoshow`` (True by default), as Scanpy's plots do; ``show=False`` returns the Axes or
    Figure for further drawing.
    """
    import matplotlib.pyplot as plt

    fig = drawn if isinstance(drawn, Figure) else drawn.figure
    if layout:
        fig.tight_layout()
    if save is not None:
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
