"""SEACells' metacell quality metrics (SEACells 0.3.3 ``evaluate``): compactness, separation, purity.

Both geometric metrics live in Palantir's multiscale diffusion space (10 components, 30-NN adaptive kernel, scaled
components 1..9).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from gpuc._backend import Backend
from gpuc.metacells._init import diffusion_components, multiscale_space
from gpuc.metacells._kernel import compute_knn


def diffusion_space(backend: Backend, x: Any, *, n_components: int = 10, knn: int = 30, n_eigs: int = 10) -> np.ndarray:
    """Palantir ``run_diffusion_maps(n_components=10, knn=30)`` then ``determine_multiscale_space(n_eigs=10)``."""
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


def purity(labels: np.ndarray, celltypes: pd.Series, order: list[str], name: str) -> pd.DataFrame:
    """Most frequent cell type per metacell and its fraction (SEACells ``compute_celltype_purity``)."""
    df = pd.DataFrame({"mc": labels, "ct": np.asarray(celltypes, dtype=object)})
    df = df[pd.notna(df["ct"])]
    counts = df.groupby(["mc", "ct"], observed=True).size().unstack(fill_value=0)
    top = counts.idxmax(axis=1)
    frac = counts.max(axis=1) / counts.sum(axis=1)
    out = pd.DataFrame({name: top, f"{name}_purity": frac}).reindex(order)
    return out
