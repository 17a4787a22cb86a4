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


def soft_membership(weights: Any, names: list[str]) -> tuple[sp.csr_matrix, list[str]]:
    """The transposed cells x metacells assignment ``weights`` (host or device), without metacells that no cell
    is assigned to: (metacells x cells, their names among ``names``).
    """
    agg = sp.csr_matrix(sp.csr_matrix(to_host(weights)).T)
    keep = np.asarray(agg.sum(axis=1)).ravel() > 0
    return agg[keep], [nm for nm, kp in zip(names, keep, strict=True) if kp]


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
