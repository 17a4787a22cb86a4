"""SEACells' metacell quality metrics (SEACells 0.3.3 ``evaluate``): compactness, separation, purity.

Both geometric metrics live in Palantir's multiscale diffusion space (10 components, 30-NN adaptive kernel, scaled
components 1..9).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from gpuc._backend import Backend
from gpuc._utils import threaded
from gpuc.metacells._init import diffusion_components, multiscale_space
from gpuc.metacells._kernel import compute_knn


@threaded
def diffusion_space(
    backend: Backend, x: Any, *, n_components: int = 10, knn: int = 30, n_eigs: int = 10, n_jobs: int | None = None
) -> np.ndarray:
    """Palantir ``run_diffusion_maps(n_components=10, knn=30)`` then ``determine_multiscale_space(n_eigs=10)``
    (``n_jobs``: CPU threads, :func:`gpuc._utils.cpu_threads`).
    """
    nn = compute_knn(backend, x, min(knn, x.shape[0]))
    vals, vecs = diffusion_components(backend, nn, n_components=n_components, knn_dm=min(knn, x.shape[0]))
    return np.asarray(backend.to_host(multiscale_space(vals, vecs, n_eigs)))


def compactness(dc: np.ndarray, labels: np.ndarray, order: list[str]) -> pd.Series:
    """Per metacell: sample variance (ddof 1) of each diffusion component over members, averaged (NaN for singletons)."""
    df = pd.DataFrame(dc)
    var = df.groupby(labels, observed=True).var(ddof=1).mean(axis=1)
    return var.reindex(order).rename("compactness")


def _centroids(dc: np.ndarray, labels: np.ndarray, order: list[str]) -> np.ndarray:
    """Mean diffusion components of the cells of each metacell of ``order`` (rows of NaN for absent ones)."""
    return pd.DataFrame(dc).groupby(labels, observed=True).mean().reindex(order).to_numpy()


def _nth_neighbors(points: np.ndarray, nth: int) -> tuple[np.ndarray, np.ndarray]:
    """Distance to and position of each point's ``nth`` nearest other point (exact Euclidean, as scikit-learn's
    ``NearestNeighbors.kneighbors()`` that SEACells calls); NaN and -1 when there are not ``nth`` others. Rows with
    NaN (metacells without cells, e.g. after subsetting the AnnData) take no part.
    """
    from scipy.spatial import cKDTree

    dist, idx = np.full(points.shape[0], np.nan), np.full(points.shape[0], -1)
    live = np.flatnonzero(np.isfinite(points).all(axis=1))
    m = live.size
    if m <= nth:
        return dist, idx
    d, i = cKDTree(points[live]).query(points[live], k=nth + 1)
    # each point is its own first neighbour; a duplicate centroid may be listed before it, so drop the point
    # itself wherever it appears and keep the nth of the others
    others = i != np.arange(m)[:, None]
    col = np.argmax(np.cumsum(others, axis=1) == nth, axis=1)
    dist[live], idx[live] = d[np.arange(m), col], live[i[np.arange(m), col]]
    return dist, idx


def separation(dc: np.ndarray, labels: np.ndarray, order: list[str], *, nth_neighbor: int = 1) -> pd.Series:
    """Per metacell: distance from its centroid to the ``nth_neighbor``-th nearest other centroid.

    SEACells 0.3.3 ``evaluate.separation`` (without ``cluster``).
    """
    cent = _centroids(dc, labels, order)
    sep, _ = _nth_neighbors(cent, nth_neighbor)
    return pd.Series(sep, index=order, name="separation")


def cluster_separation(
    dc: np.ndarray,
    labels: np.ndarray,
    order: list[str],
    majority: np.ndarray,
    *,
    nth_neighbor: int = 1,
    mode: str = "neighbor",
) -> pd.Series:
    """Separation among metacells of one cell type: ``majority`` holds each metacell's majority label (``order``).

    ``mode="neighbor"`` is SEACells 0.3.3 ``evaluate.separation(cluster=...)``: the distance to the
    ``nth_neighbor``-th nearest other centroid, kept only where that metacell has the same majority label (NaN
    elsewhere; SEACells leaves those metacells out). ``mode="nearest"``: the distance to the ``nth_neighbor``-th
    nearest centroid among the metacells of the same majority label (NaN when there are not that many).
    """
    cent = _centroids(dc, labels, order)
    majority = np.asarray(majority, dtype=object)
    out = np.full(len(order), np.nan)
    if mode == "neighbor":
        dist, nbr = _nth_neighbors(cent, nth_neighbor)
        ok = (nbr >= 0) & (majority != None)  # noqa: E711  (elementwise test of an object array)
        same = np.zeros(len(order), dtype=bool)
        same[ok] = majority[nbr[ok]] == majority[ok]
        out[same] = dist[same]
    else:
        for t in pd.unique(majority[majority != None]):  # noqa: E711
            members = np.flatnonzero(majority == t)
            out[members] = _nth_neighbors(cent[members], nth_neighbor)[0]
    return pd.Series(out, index=order, name="separation")


def assignment_stats(weights: Any, *, threshold: float = 0.1) -> dict[str, np.ndarray]:
    """Per-cell statistics of the cells x metacells soft assignments (host or device, dense or sparse).

    ``entropy``
        ``scipy.stats.entropy`` of the cell's weights (natural log, weights rescaled to sum to 1): the
        ``obs["Metacell_Entropy"]`` of the pre-release SEACells model, which SEACells 0.3.3's
        ``plot.plot_assignment_entropy`` plots. 0 for a cell wholly in one metacell, ``log(k)`` for even weights.
    ``max_weight``
        The largest weight (the first column of the SEACells tutorial's "top 5 strongest assignments").
    ``n_assigned``
        The number of weights above ``threshold``: the tutorial's "non-trivial (> 0.1) assignments per cell"
        (SEACells issue #43: many cells with none suggests too many metacells).
    """
    from gpuc._backend import to_host

    w = sp.csr_matrix(to_host(weights), dtype=np.float64)
    w.eliminate_zeros()
    n = w.shape[0]
    row = np.repeat(np.arange(n), np.diff(w.indptr))
    total = np.bincount(row, weights=w.data, minlength=n)
    p = w.data / total[row]
    entropy = 0.0 - np.bincount(row, weights=p * np.log(p), minlength=n)  # 0.0 - 0.0 is +0.0
    entropy[total == 0] = np.nan
    max_weight = np.zeros(n)
    np.maximum.at(max_weight, row, w.data)
    n_assigned = np.bincount(row, weights=w.data > threshold, minlength=n).astype(np.int64)
    return {"entropy": entropy, "max_weight": max_weight, "n_assigned": n_assigned}


def purity_from_membership(membership: Any, celltypes: Any) -> tuple[np.ndarray, np.ndarray]:
    """Majority cell type of each metacell and its fraction, from a metacells x cells membership matrix.

    ``membership`` holds 1 for a cell's hard metacell, or the cell's assignment weights for soft metacells; cells
    with a missing cell type do not vote. Ties go to the first type in sorted order (SEACells'
    ``compute_celltype_purity`` takes pandas' ``idxmax`` over sorted types). Metacells without votes get ``None``
    and NaN.
    """
    codes, types = pd.factorize(np.asarray(celltypes, dtype=object), sort=True)
    voting = np.flatnonzero(codes >= 0)
    onehot = sp.csr_matrix(
        (np.ones(voting.size), (voting, codes[voting])), shape=(membership.shape[1], max(len(types), 1))
    )
    votes = np.asarray(sp.csr_matrix(membership) @ onehot.toarray())
    total = votes.sum(axis=1)
    top = votes.argmax(axis=1)
    has = total > 0
    names = np.asarray(types, dtype=object)[top] if len(types) else np.full(len(top), None, dtype=object)
    majority = np.where(has, names, None)
    frac = np.where(has, votes[np.arange(len(top)), top] / np.where(has, total, 1.0), np.nan)
    return majority, frac


def purity(labels: np.ndarray, celltypes: pd.Series, order: list[str], name: str) -> pd.DataFrame:
    """Most frequent cell type per hard metacell (in ``order``) and its fraction (SEACells ``compute_celltype_purity``)."""
    pos = pd.Index(order).get_indexer(np.asarray(labels))
    cells = np.flatnonzero(pos >= 0)
    membership = sp.csr_matrix((np.ones(cells.size), (pos[cells], cells)), shape=(len(order), len(labels)))
    majority, frac = purity_from_membership(membership, celltypes)
    return pd.DataFrame({name: majority, f"{name}_purity": frac}, index=pd.Index(order))


def quality_table(
    backend: Backend,
    x: Any,
    labels: np.ndarray,
    order: list[str],
    *,
    nth_neighbor: int = 1,
    celltypes: pd.Series | None = None,
    celltype_key: str | None = None,
    clusters: pd.Series | None = None,
    cluster_key: str | None = None,
    cluster_mode: str = "neighbor",
    n_jobs: int | None = None,
) -> pd.DataFrame:
    """One row per metacell of ``order``: ``size``, ``compactness`` and ``separation`` in the diffusion space of
    ``x`` (:func:`diffusion_space`), with ``celltypes`` the majority type and its fraction (columns
    ``celltype_key`` and ``celltype_key + "_purity"``), and with ``clusters`` the separation among metacells of
    one majority cluster (column ``cluster_key + "_separation"``, :func:`cluster_separation` in ``cluster_mode``).
    ``labels``: each cell's metacell as a string.
    """
    dc = diffusion_space(backend, backend.asarray(x), n_jobs=n_jobs)
    df = pd.DataFrame(index=pd.Index(order, name="metacell"))
    df["size"] = pd.Series(labels).value_counts().reindex(order).to_numpy()
    df["compactness"] = compactness(dc, labels, order).to_numpy()
    df["separation"] = separation(dc, labels, order, nth_neighbor=nth_neighbor).to_numpy()
    if celltypes is not None:
        pur = purity(labels, celltypes, order, celltype_key)
        df[celltype_key] = pur[celltype_key].to_numpy()
        df[f"{celltype_key}_purity"] = pur[f"{celltype_key}_purity"].to_numpy().astype(float)
    if clusters is not None:
        # SEACells takes each metacell's most frequent label among its (hard) cells
        majority = purity(labels, clusters, order, "majority")["majority"].to_numpy()
        df[f"{cluster_key}_separation"] = cluster_separation(
            dc, labels, order, majority, nth_neighbor=nth_neighbor, mode=cluster_mode
        ).to_numpy()
    return df
