"""SEACells kernel: adaptive-bandwidth Gaussian affinities on a symmetrised kNN graph (SEACells 0.3.3).

Only neighbour pairs are ever touched: O(n k d) work and O(n k) memory, the same code for numpy and cupy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuc._backend import Backend
from gpuc._utils import limit_faiss_threads


@dataclass
class KnnResult:
    """Exact (or IVF) kNN of every cell, self first where present; arrays on the backend's device."""

    distances: Any  # (n, m) float, sorted ascending
    indices: Any  # (n, m) int64


def compute_knn(backend: Backend, x: Any, n_neighbors: int, *, method: str = "auto") -> KnnResult:
    """KNN including each cell itself (scanpy's ``n_neighbors`` convention).

    On the GPU ``"auto"`` means exact (blocked distance products in cupy when FAISS-GPU is absent).
    """
    if backend.is_gpu and method == "auto":
        method = "exact"
    if not backend.is_gpu:  # FAISS's OpenMP threads follow n_jobs (cpu_threads), when FAISS is there
        try:
            import faiss
        except ImportError:  # pragma: no cover - faiss-cpu is a dependency
            pass
        else:
            limit_faiss_threads(faiss)
    dist, idx = backend.knn(x, min(n_neighbors, x.shape[0]), method=method)
    return KnnResult(backend.asarray(dist), backend.asarray(idx))


def knn_from_graph(backend: Backend, distances: Any, n_neighbors: int, *, where: str = "the graph") -> KnnResult:
    """The ``n_neighbors`` nearest cells (self first, at distance 0) from a stored kNN distance graph.

    ``distances`` is an (n, n) sparse matrix of neighbour distances without the cell itself (scanpy's and
    rapids-singlecell's ``obsp['distances']``), on the host or the device; it is read where it lives. Each row's
    stored entries are sorted by distance (stable: ties go to the lower index) and the first ``n_neighbors - 1``
    kept. Raises :class:`ValueError` when a row holds fewer.
    """
    xp = backend.xp
    g = backend.sparse.csr_matrix(backend.asarray(distances))
    n = g.shape[0]
    m = n_neighbors - 1
    counts = g.indptr[1:] - g.indptr[:-1]
    width = max(int(counts.max()) if n else 0, 1)
    slot = xp.arange(width)[None, :]
    valid = slot < counts[:, None]
    pos = xp.where(valid, g.indptr[:-1, None] + slot, 0)
    nbr = xp.where(valid, g.indices[pos], -1)
    valid &= nbr != xp.arange(n)[:, None]  # a stored self entry is not a neighbour
    short = int((valid.sum(axis=1) < m).sum())
    if short:
        msg = (
            f"{short} cell(s) have fewer than {m} stored neighbours in {where}; {n_neighbors} neighbours (the cell "
            "included) are needed. Recompute the graph with more neighbours (sc.pp.neighbors(adata, n_neighbors=...)) "
            "or pass neighbors_key=None to build the exact kNN."
        )
        raise ValueError(msg)
    d = xp.where(valid, g.data[pos], xp.inf)
    order = xp.argsort(d, axis=1, kind="stable")[:, :m]
    dist = xp.concatenate([xp.zeros((n, 1), dtype=d.dtype), xp.take_along_axis(d, order, axis=1)], axis=1)
    idx = xp.concatenate([xp.arange(n)[:, None], xp.take_along_axis(nbr, order, axis=1)], axis=1)
    return KnnResult(dist, idx.astype(xp.int64))


def non_self(backend: Backend, knn: KnnResult, n_neighbors: int) -> tuple[Any, Any]:
    """The ``n_neighbors - 1`` non-self neighbours per row (scanpy's ``obsp['distances']`` rows).

    When a duplicate point displaced a cell from its own list, the last neighbour is dropped instead.
    """
    xp = backend.xp
    idx = knn.indices[:, :n_neighbors]
    dist = knn.distances[:, :n_neighbors]
    n, m = idx.shape
    rows = xp.arange(n)[:, None]
    is_self = idx == rows
    has_self = is_self.any(axis=1)
    drop = is_self.copy()
    drop[:, m - 1] |= ~has_self
    # move the dropped entry to the end with a stable sort on the drop flag, then cut it
    order = xp.argsort(drop.astype(xp.int8), axis=1, kind="stable")
    idx = xp.take_along_axis(idx, order, axis=1)[:, : m - 1]
    dist = xp.take_along_axis(dist, order, axis=1)[:, : m - 1]
    return dist, idx


def bandwidths(backend: Backend, dist: Any, rank: int) -> Any:
    """Per-cell sigma = the ``rank``-th smallest strictly positive non-self distance (0 when there are fewer).

    SEACells ranks the stored kNN distances ignoring zeros; ``rank = n_neighbors // 2``.
    """
    xp = backend.xp
    d = xp.where(dist > 0, dist, xp.inf)
    d = xp.sort(d, axis=1)
    if rank < 1 or rank > d.shape[1]:
        return xp.zeros(d.shape[0], dtype=dist.dtype)
    s = d[:, rank - 1]
    return xp.where(xp.isfinite(s), s, 0.0)


def build_kernel(
    backend: Backend,
    x: Any,
    *,
    n_neighbors: int = 15,
    graph: str = "union",
    knn: KnnResult | None = None,
    dtype: Any = np.float64,
    chunk: int | None = None,
) -> tuple[Any, Any]:
    """The SEACells kernel ``M`` (n x n sparse CSR on the backend's device) and the bandwidths.

    Parameters
    ----------
    backend
        Device backend.
    x
        ``(n, d)`` embedding (used as is, no scaling).
    n_neighbors
        kNN size including the cell itself (SEACells / scanpy convention, default 15).
    graph
        ``"union"`` (edge if i->j or j->i) or ``"intersection"`` (both).
    knn
        Precomputed :func:`compute_knn` result with at least ``n_neighbors`` columns.
    dtype
        Floating type of ``M``.
    chunk
        Edges per block when computing squared distances; default: ~1 MB of (edges x d) differences per block on
        the CPU (the gathered rows and their differences stay in cache), ~256 MB on the GPU (three such buffers are
        alive per block). The distances do not depend on it.

    Returns
    -------
    ``(M, sigma)``: ``M[i, j] = exp(-||x_i - x_j||^2 / (sigma_i sigma_j))`` on the symmetrised kNN pattern plus the
    diagonal, ``sigma`` the per-cell bandwidth (distance to the ``n_neighbors // 2``-th non-self neighbour).
    """
    xp, sparse = backend.xp, backend.sparse
    x = backend.asarray(x)
    n = x.shape[0]
    if knn is None:
        knn = compute_knn(backend, x, n_neighbors)
    dist, idx = non_self(backend, knn, n_neighbors)
    sigma = bandwidths(backend, dist, n_neighbors // 2).astype(dtype)
    # binary pattern: stored kNN entries with non-zero distance (SEACells binarises the distances), plus the diagonal
    keep = dist.ravel() > 0
    rows = xp.repeat(xp.arange(n), idx.shape[1])[keep]
    cols = idx.ravel()[keep]
    ones = xp.ones(rows.shape[0], dtype=dtype)
    g = sparse.coo_matrix((ones, (rows, cols)), shape=(n, n)).tocsr()
    g.sum_duplicates()
    g.data[:] = 1
    if graph == "union":
        pat = g + g.T
    elif graph in ("intersection", "intersect"):
        pat = g.multiply(g.T)
    else:
        msg = f"graph={graph!r} is not valid; use 'union' or 'intersection'."
        raise ValueError(msg)
    pat = sparse.csr_matrix(pat) + sparse.identity(n, dtype=dtype, format="csr")
    pat = sparse.csr_matrix(pat)
    pat.sum_duplicates()
    pat.sort_indices()
    coo = pat.tocoo()
    r, c = coo.row, coo.col
    xd = x.astype(dtype) if x.dtype != dtype else x
    if chunk is None:
        chunk = max(256, (1 << (28 if backend.is_gpu else 20)) // (8 * max(1, xd.shape[1])))
    d2 = xp.empty(r.shape[0], dtype=dtype)
    for s in range(0, r.shape[0], chunk):
        diff = xd[r[s : s + chunk]] - xd[c[s : s + chunk]]
        d2[s : s + chunk] = (diff * diff).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        vals = xp.exp(-d2 / (sigma[r] * sigma[c]))
    vals = xp.where(r == c, 1.0, vals)  # exp(-0/0): a cell is always its own neighbour with weight 1
    m = sparse.csr_matrix((vals.astype(dtype), (r, c)), shape=(n, n))
    m.sort_indices()
    return m, sigma
