"""Synthetic scale-up data for the metacell benchmarks, built from real cells (scanpy's pbmc68k_reduced X_pca).

* :func:`jittered_pcs` - resampled real cells with jitter (used for the SEACells comparison at the size of
  SEACells' CD34 tutorial data): draw N cells with replacement and add Gaussian noise with 15% of each component's SD. Past ~10k cells
  this gives ~700 tight, mutually disconnected clumps (every cell's neighbours are copies of the same real cell).
* :func:`manifold_pcs` - for the scaling runs: each new cell is a random point on the segment between a real cell and
  one of its 15 nearest real neighbours, plus 5%-SD noise, so the data stay one connected manifold at any N.
"""

from __future__ import annotations

import numpy as np


def _pbmc68k_pcs() -> np.ndarray:
    import scanpy as sc

    return np.asarray(sc.datasets.pbmc68k_reduced().obsm["X_pca"], dtype=np.float64)


def jittered_pcs(n_cells: int, seed: int = 0, jitter: float = 0.15) -> np.ndarray:
    x = _pbmc68k_pcs()
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.shape[0], n_cells)
    out = x[idx] + jitter * x.std(axis=0)[None, :] * rng.standard_normal((n_cells, x.shape[1]))
    return out.astype(np.float32)


def manifold_pcs(n_cells: int, seed: int = 0, jitter: float = 0.05, n_neighbors: int = 15) -> np.ndarray:
    x = _pbmc68k_pcs()
    rng = np.random.default_rng(seed)
    d2 = (x * x).sum(1)[:, None] - 2 * x @ x.T + (x * x).sum(1)[None, :]
    nn = np.argsort(d2, axis=1)[:, 1 : n_neighbors + 1]
    i = rng.integers(0, x.shape[0], n_cells)
    j = nn[i, rng.integers(0, n_neighbors, n_cells)]
    lam = rng.random(n_cells)[:, None]
    out = x[i] + lam * (x[j] - x[i]) + jitter * x.std(axis=0)[None, :] * rng.standard_normal((n_cells, x.shape[1]))
    return out.astype(np.float32)
