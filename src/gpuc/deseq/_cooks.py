"""Cook's distances, R's robust method-of-moments dispersion, and outlier replacement."""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.special

from gpuc._backend import Backend
from gpuc.deseq._design import cells_of


def trimmed_mean(bk: Backend, v: Any, trim: float) -> Any:
    """R ``mean(x, trim=)`` along the last axis (sorted, drop floor(n*trim) at each end)."""
    xp = bk.xp
    n = v.shape[-1]
    lo = int(np.floor(n * trim))
    s = xp.sort(v, axis=-1)
    return s[..., lo : n - lo].mean(axis=-1)


def _trim_bin(n: int) -> tuple[float, float]:
    if n < 3.5:
        return 1.0 / 3.0, 2.04
    if n < 23.5:
        return 0.25, 1.86
    return 0.125, 1.51


def robust_disp(bk: Backend, norm: Any, x: np.ndarray) -> Any:
    """R ``robustMethodOfMomentsDisp``: trimmed within-cell variance (cells with >= 3 samples), floored at 0.04."""
    xp = bk.xp
    cells = cells_of(x)
    sizes = np.bincount(cells)
    big = [c for c in range(sizes.shape[0]) if sizes[c] >= 3]
    if big:
        vs = []
        for c in big:  # loop over design cells (a handful), each batched over genes
            sub = norm[:, xp.asarray(np.nonzero(cells == c)[0])]
            trim, scale = _trim_bin(int(sizes[c]))
            m = trimmed_mean(bk, sub, trim)
            vs.append(scale * trimmed_mean(bk, (sub - m[:, None]) ** 2, trim))
        v = vs[0]
        for other in vs[1:]:
            v = xp.maximum(v, other)
    else:
        m = trimmed_mean(bk, norm, 1.0 / 8.0)
        v = 1.51 * trimmed_mean(bk, (norm - m[:, None]) ** 2, 1.0 / 8.0)
    mean = norm.mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        alpha = (v - mean) / mean**2
    return xp.maximum(xp.where(xp.isfinite(alpha), alpha, 0.04), 0.04)


def cooks_distance(y: Any, mu: Any, hat: Any, robust_alpha: Any, p: int) -> Any:
    """(y - mu)^2 / (mu + a mu^2) / p * h / (1 - h)^2 with the robust dispersion (R ``calculateCooksDistance``)."""
    v = mu + robust_alpha[:, None] * mu**2
    return (y - mu) ** 2 / v / p * hat / (1.0 - hat) ** 2


def cooks_cutoff(n: int, p: int) -> float:
    """R's default cut-off, the 0.99 quantile of F(p, n - p)."""
    return float(scipy.special.fdtri(p, n - p, 0.99))  # scipy.stats.f.ppf(0.99, p, n - p)


def replace_outliers(
    bk: Backend, y: Any, sf: Any, cooks: Any, replaceable: Any, cutoff: float, trim: float = 0.2
) -> tuple[Any, Any]:
    """R ``replaceOutliers``: counts with Cook's above the cut-off in replaceable samples become the gene's 20%-trimmed
    mean of normalised counts times the sample's size factor (truncated to an integer).

    Returns the new counts and the per-gene mask of genes where a count was replaced.
    """
    xp = bk.xp
    out = (cooks > cutoff) & replaceable[None, :]
    offset = sf[None, :] if sf.ndim == 1 else sf  # normalisation factors: one per gene and sample
    norm = y / offset
    tm = trimmed_mean(bk, norm, trim)
    repl = xp.floor(tm[:, None] * offset)
    new = xp.where(out, repl, y)
    return new, out.any(axis=1)
