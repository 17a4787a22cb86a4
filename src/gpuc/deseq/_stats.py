"""Wald and likelihood-ratio statistics, alternative hypotheses, Cook's filter, BH and independent filtering."""

from __future__ import annotations

import math

import numpy as np
import scipy.special

LN2 = float(np.log(2.0))


def _norm_sf(x: np.ndarray) -> np.ndarray:
    """Upper tail of the standard normal: what ``scipy.stats.norm.sf`` computes (``ndtr(-x)``), without loading
    ``scipy.stats`` (about a quarter of a second at import).
    """
    return scipy.special.ndtr(-np.asarray(x, dtype=np.float64))


def wald(
    beta: np.ndarray, cov: np.ndarray, c: np.ndarray, *, lfc_threshold: float = 0.0, alt: str = "greaterAbs"
) -> dict[str, np.ndarray]:
    """Wald test of c^T beta (natural log inputs; threshold on the log2 scale) as R's ``results()``.

    ``alt`` is one of greaterAbs (two-sided; with a threshold R's "greaterAbs2014" form), lessAbs, greater, less.
    Returns log2FoldChange, lfcSE, stat and pvalue.
    """
    lfc = (beta @ c) / LN2
    se = np.sqrt(np.maximum(np.einsum("i,gij,j->g", c, cov, c), 0.0)) / LN2
    t = abs(lfc_threshold)
    with np.errstate(divide="ignore", invalid="ignore"):
        if alt == "greaterAbs":
            if t == 0:
                stat = lfc / se
                pv = 2.0 * _norm_sf(np.abs(stat))
            else:
                stat = np.sign(lfc) * np.maximum((np.abs(lfc) - t) / se, 0)
                pv = np.minimum(1.0, 2.0 * _norm_sf((np.abs(lfc) - t) / se))
        elif alt == "greater":
            z = (lfc - t) / se
            stat = np.maximum(z, 0)
            pv = _norm_sf(z)
        elif alt == "less":
            z = (lfc + t) / se
            stat = np.minimum(z, 0)
            pv = _norm_sf(-z)
        elif alt == "lessAbs":
            above = (t - lfc) / se
            below = (lfc + t) / se
            stat = np.minimum(np.maximum(above, 0), np.maximum(below, 0))
            pv = np.maximum(_norm_sf(above), _norm_sf(below))
        else:
            msg = f"alt_hypothesis={alt!r} is not valid."
            raise ValueError(msg)
    return {"log2FoldChange": lfc, "lfcSE": se, "stat": stat, "pvalue": pv}


def lrt(dev_reduced: np.ndarray, dev_full: np.ndarray, df: int) -> tuple[np.ndarray, np.ndarray]:
    """Likelihood-ratio statistic (difference of deviances) and its chi-square p-value."""
    stat = dev_reduced - dev_full
    # scipy.stats.chi2.sf(stat, df): 1 at and below 0 (a reduced fit that ends a hair better than the full one)
    return stat, scipy.special.chdtrc(df, np.maximum(stat, 0.0))


def _bh_of_sorted(p_sorted: np.ndarray) -> np.ndarray:
    """BH-adjusted values of ascending p-values with scipy's ``false_discovery_control`` operations (``p * (m / i)``,
    reverse running minimum, clipped to [0, 1]). Ties get equal values whatever their order, so any sort of the same
    values gives the same adjusted values.
    """
    m = p_sorted.shape[0]
    adj = p_sorted * (m / np.arange(1, m + 1, dtype=np.float64))
    np.minimum.accumulate(adj[::-1], out=adj[::-1])
    return np.clip(adj, 0.0, 1.0)


def _bh_rejections(p_sorted: np.ndarray, alpha: float) -> int:
    """How many BH-adjusted values of ascending ``p_sorted`` are below ``alpha`` (``alpha <= 1``), without forming them.

    The adjusted value at rank i is the minimum of ``p_(j) * (m / j)`` over j >= i (clipping to [0, 1] does not move
    a value across ``alpha``), so it is below ``alpha`` exactly for the ranks up to the last j whose own
    ``p_(j) * (m / j)`` is: the count is that j. The products are :func:`_bh_of_sorted`'s, so the count is the same.
    """
    m = p_sorted.shape[0]
    below = np.flatnonzero(p_sorted * (m / np.arange(1, m + 1, dtype=np.float64)) < alpha)
    return int(below[-1]) + 1 if below.size else 0


def p_adjust_bh(p: np.ndarray) -> np.ndarray:
    """R ``p.adjust(method="BH")`` ignoring NaN (n = number of non-NaN p-values; NaN stays NaN)."""
    p = np.asarray(p, dtype=np.float64)
    out = np.full(p.shape, np.nan)
    order = np.argsort(p)  # NaN last
    order = order[~np.isnan(p[order])]
    out[order] = _bh_of_sorted(p[order])
    return out


def lowess(
    x: np.ndarray, y: np.ndarray, f: float = 2.0 / 3.0, iters: int = 3, delta: float | None = None
) -> np.ndarray:
    """R ``stats::lowess`` (Cleveland's clowess): local linear fits with tricube weights and robustness iterations.

    ``x`` must be sorted. Returns the fitted values at ``x``. Written out rather than taken from statsmodels because
    the independent-filtering threshold must follow R's clowess, whose robustness weights statsmodels' lowess
    computes differently. The element loops run on Python floats (the same IEEE operations as numpy's float64
    scalars, several times faster per operation); the sums over a window stay numpy's.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = x.shape[0]
    if n < 2:
        return y.copy()
    xl = x.tolist()
    if delta is None:
        delta = 0.01 * (xl[-1] - xl[0])
    ns = max(min(int(f * n + 1e-7), n), 2)
    rw = np.ones(n)
    ys = np.zeros(n)
    w = np.zeros(n)
    for it in range(iters + 1):
        rwl = rw.tolist()
        nleft, nright = 0, ns - 1
        last = -1
        i = 0
        while True:
            if nright < n - 1:
                d1 = xl[i] - xl[nleft]
                d2 = xl[nright + 1] - xl[i]
                if d1 > d2:
                    nleft += 1
                    nright += 1
                    continue
            fit, ok = _lowest(x, xl, y, xl[i], nleft, nright, rwl, it > 0, w)
            ys[i] = fit if ok else y[i]
            if last < i - 1:
                denom = xl[i] - xl[last]
                yi, ylast = float(ys[i]), float(ys[last])
                for j in range(last + 1, i):
                    alpha = (xl[j] - xl[last]) / denom
                    ys[j] = alpha * yi + (1 - alpha) * ylast
            last = i
            cut = xl[last] + delta
            i = last + 1
            while i < n:
                if xl[i] > cut:
                    break
                if xl[i] == xl[last]:
                    ys[i] = ys[last]
                    last = i
                i += 1
            i = max(last + 1, i - 1)
            if last >= n - 1:
                break
        res = y - ys
        if it >= iters:
            break
        sc = np.sum(np.abs(res)) / n
        cmad = 6.0 * float(np.median(np.abs(res)))
        if cmad < 1e-7 * sc:
            break
        c9, c1 = 0.999 * cmad, 0.001 * cmad
        r = np.abs(res)
        with np.errstate(divide="ignore", invalid="ignore"):
            rw = np.where(r <= c1, 1.0, np.where(r <= c9, (1 - (r / cmad) ** 2) ** 2, 0.0))
    return ys


def _lowest(
    x: np.ndarray,
    xl: list[float],
    y: np.ndarray,
    xs: float,
    nleft: int,
    nright: int,
    rwl: list[float],
    userw: bool,
    w: np.ndarray,
) -> tuple[float, bool]:
    # clowess's local weighted linear fit at xs over x[nleft:nright + 1] (``xl``, ``rwl``: x and the robustness
    # weights as lists); ``w`` is scratch of length n
    n = len(xl)
    rng = xl[-1] - xl[0]
    h = max(xs - xl[nleft], xl[nright] - xs)
    h9, h1 = 0.999 * h, 0.001 * h
    j = nleft
    a = 0.0
    while j < n:
        r = abs(xl[j] - xs)
        if r <= h9:
            wj = 1.0 if r <= h1 else (1 - (r / h) ** 3) ** 3
            if userw:
                wj *= rwl[j]
            w[j] = wj
            a += wj
        elif xl[j] > xs:
            break
        else:
            w[j] = 0.0
        j += 1
    nrt = j - 1
    if a <= 0:
        return 0.0, False
    win = slice(nleft, nrt + 1)
    total = np.add.reduce  # np.sum without its wrapper (the same summation)
    w[win] /= a
    if h > 0:
        a = float(total(w[win] * x[win]))
        b = xs - a
        c = float(total(w[win] * (x[win] - a) ** 2))
        if math.sqrt(c) > 0.001 * rng:
            b /= c
            w[win] *= b * (x[win] - a) + 1.0
    return float(total(w[win] * y[win])), True


def independent_filtering(base_mean: np.ndarray, pvalue: np.ndarray, alpha: float) -> tuple[np.ndarray, dict]:
    """R ``pvalueAdjustment`` (genefilter ``filtered_p`` over a 50-point theta grid, lowess with f=1/5).

    The p-values are sorted once: each filter keeps a subset of the genes, and a subset of a sorted array is sorted,
    so every threshold's BH adjustment (:func:`p_adjust_bh` of that subset) is :func:`_bh_of_sorted` of a masked
    slice; only the chosen threshold's adjusted p-values are scattered back to genes.
    """
    lower = float(np.mean(base_mean == 0))
    upper = 0.95 if lower < 0.95 else 1.0
    theta = np.linspace(lower, upper, 50)
    cutoffs = np.quantile(base_mean, theta)
    pvalue = np.asarray(pvalue, dtype=np.float64)
    order = np.argsort(pvalue)  # NaN last
    order = order[~np.isnan(pvalue[order])]
    p_sorted, mean_sorted = pvalue[order], base_mean[order]
    num_rej = np.zeros(theta.shape[0], dtype=np.int64)
    for j, cut in enumerate(cutoffs):  # 50 filter thresholds
        keep = mean_sorted >= cut
        if keep.any():
            num_rej[j] = _bh_rejections(p_sorted[keep], alpha)
    fit = lowess(theta, num_rej.astype(np.float64), f=1.0 / 5.0)
    if num_rej.max() <= 10:
        j = 0
    else:
        resid = np.array([0.0]) if np.all(num_rej == 0) else (num_rej[num_rej > 0] - fit[num_rej > 0])
        thresh = fit.max() - np.sqrt(np.mean(resid**2))
        above = np.nonzero(num_rej > thresh)[0]
        j = int(above[0]) if above.size else 0
    info = {
        "theta": theta,
        "cutoffs": cutoffs,
        "num_rejections": num_rej,
        "lowess": fit,
        "filter_theta": float(theta[j]),
        "filter_threshold": float(cutoffs[j]),
    }
    padj = np.full(base_mean.shape[0], np.nan)
    keep = mean_sorted >= cutoffs[j]
    padj[order[keep]] = _bh_of_sorted(p_sorted[keep])
    return padj, info
