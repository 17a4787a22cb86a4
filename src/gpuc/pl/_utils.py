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
