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


def separation(dc: np.ndarray, labels: np.ndarray, order: list[str], *, nth_neighbor: int = 1) -> pd.Series:
    """Per metacell: distance from its centroid to the ``nth_neighbor``-th nearest other centroid."""
    cent = pd.DataFrame(dc).groupby(labels, observed=True).mean().reindex(order).to_numpy()
    m = cent.shape[0]
    if m <= nth_neighbor:
        return pd.Series(np.nan, index=order, name="separation")
    d2 = (cent * cent).sum(1)[:, None] - 2 * cent @ cent.T + (cent * cent).sum(1)[None, :]
    d = np.sqrt(np.maximum(d2, 0))
    np.fill_diagonal(d, np.inf)
    sep = np.sort(d, axis=1)[:, nth_neighbor - 1]
    return pd.Series(sep, index=order, name="separation")


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
    n_jobs: int | None = None,
) -> pd.DataFrame:
    """One row per metacell of ``order``: ``size``, ``compactness`` and ``separation`` in the diffusion space of
    ``x`` (:func:`diffusion_space`), and with ``celltypes`` the majority type and its fraction (columns
    ``celltype_key`` and ``celltype_key + "_purity"``). ``labels``: each cell's metacell as a string.
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
    return df
