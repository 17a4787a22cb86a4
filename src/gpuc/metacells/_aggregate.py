"""Summing cells into metacells (SEACells ``summarize_by_SEACell`` / ``summarize_by_soft_SEACell``), no AnnData.

A metacells x cells membership matrix (ones for hard labels, assignment weights for soft metacells) times a cells x
genes matrix, computed where the matrix lives (host, GPU, or chunk by chunk for a lazily read dask array); only the
metacells x genes result comes back to the host.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from gpuc._backend import backend_of, is_sparse, to_host
from gpuc._dask import is_dask_array
from gpuc._lazy import grouped_sum


def non_integer(x: Any) -> bool:
    """Whether a dense or sparse matrix holds a non-integer value (computed where it lives; one verdict back)."""
    data = x.data if is_sparse(x) else x
    if np.dtype(data.dtype).kind != "f":
        return False
    xp = backend_of(data).xp
    data = xp.asarray(data)
    return bool((data != xp.round(data)).any())


def hard_membership(labels: pd.Series) -> tuple[sp.csr_matrix, list[str]]:
    """Ones for each cell's metacell, from a categorical ``labels`` column: (metacells x cells, metacell names).

    Every category is a metacell (in category order); unlabelled cells belong to none.
    """
    names = [str(c) for c in labels.cat.categories]
    codes = labels.cat.codes.to_numpy()
    ok = codes >= 0
    agg = sp.csr_matrix((np.ones(int(ok.sum())), (codes[ok], np.flatnonzero(ok))), shape=(len(names), len(labels)))
    return agg, names


def sparsify_weights(weights: Any, minimum_weight: float = 0.05, *, percentile: float = 95.0) -> sp.csr_matrix:
    """SEACells 0.3.3 ``core.sparsify_assignments(A, thresh=minimum_weight)`` on cells x metacells ``weights``.

    Per cell, the cut is ``min(minimum_weight, p)`` with ``p`` the ``percentile``-th percentile (numpy's linear
    interpolation) of the cell's non-zero weights; weights below the cut become 0 and the cell's remaining weights
    are rescaled to sum to 1. The percentile is SEACells' fallback for cells whose weight is spread thinly: their
    largest weights survive even when all lie below ``minimum_weight``. ``minimum_weight=0`` keeps every weight.
    Returns a host CSR matrix (float64); cells without weight stay empty.
    """
    w = sp.csr_matrix(to_host(weights), dtype=np.float64, copy=True)
    w.eliminate_zeros()
    n = w.shape[0]
    nnz = np.diff(w.indptr)
    cut = np.zeros(n)
    # SEACells takes the percentile over the non-zero entries of each dense row (zeros set to NaN); rows are
    # grouped by their number of non-zeros so that numpy computes each group's percentiles in one call
    for m in np.unique(nnz[nnz > 0]):
        rows = np.flatnonzero(nnz == m)
        vals = w.data[w.indptr[rows][:, None] + np.arange(m)[None, :]]
        cut[rows] = np.percentile(vals, percentile, axis=1)
    cut = np.minimum(cut, minimum_weight)
    row_of = np.repeat(np.arange(n), nnz)
    w.data[w.data < cut[row_of]] = 0.0
    w.eliminate_zeros()
    total = np.asarray(w.sum(axis=1)).ravel()
    w.data /= total[np.repeat(np.arange(n), np.diff(w.indptr))]
    return w


def soft_membership(
    weights: Any, names: list[str], *, minimum_weight: float | None = None
) -> tuple[sp.csr_matrix, list[str]]:
    """The transposed cells x metacells assignment ``weights`` (host or device), without metacells that no cell
    is assigned to: (metacells x cells, their names among ``names``). With ``minimum_weight``, the weights are
    first sparsified as SEACells does (:func:`sparsify_weights`).
    """
    w = sp.csr_matrix(to_host(weights)) if minimum_weight is None else sparsify_weights(weights, minimum_weight)
    agg = sp.csr_matrix(w.T)
    keep = np.asarray(agg.sum(axis=1)).ravel() > 0
    return agg[keep], [nm for nm, kp in zip(names, keep, strict=True) if kp]


def divided_rows(sums: Any, size: np.ndarray) -> Any:
    """``sums`` (dense or CSR, metacells x genes) with row i divided by ``size[i]``: the weighted means."""
    if sp.issparse(sums):
        return sp.csr_matrix(sp.diags(1.0 / size) @ sums)
    return sums / size[:, None]


def summed(agg: sp.csr_matrix, mat: Any) -> Any:
    """``agg @ mat`` in float64 (as scipy sums), on the host: CSR when ``mat`` is sparse, else a dense array.

    A dask ``mat`` is summed chunk by chunk (each row chunk times its cells' columns of ``agg``, the partials added
    by dask's tree reduction), never whole in one process.
    """
    if is_dask_array(mat):
        sums = grouped_sum(agg, mat)
        return sp.csr_matrix(sums) if is_sparse(mat._meta) else sums
    bk = backend_of(mat)  # the sums run where the matrix lives
    sums = to_host(bk.asarray(agg) @ (mat if mat.dtype == np.float64 else mat.astype(np.float64)))
    return sp.csr_matrix(sums) if sp.issparse(sums) else np.asarray(sums)


def member_means(agg: sp.csr_matrix, embeddings: dict[str, Any], size: np.ndarray) -> dict[str, np.ndarray]:
    """The member mean (weighted by ``agg``) of each cells x components embedding, divided by ``size`` (the
    metacells' total weights; empty metacells divide by 1).
    """
    denom = np.where(size > 0, size, 1.0)[:, None]
    out = {}
    for name, emb in embeddings.items():
        if is_dask_array(emb):  # read_lazy: obsm is lazy too; summed chunk by chunk like the counts
            out[name] = grouped_sum(agg, emb) / denom
        else:
            out[name] = np.asarray(to_host(backend_of(emb).asarray(agg) @ emb)) / denom
    return out
