"""Synthetic scale-up data for the metacell benchmarks: real pbmc68k_reduced PCs resampled with jitter.

Same recipe as anchors/seacells.md section 10: draw N cells with replacement from scanpy's pbmc68k_reduced X_pca
and add Gaussian noise with 15% of each component's standard deviation.
"""

from __future__ import annotations

import numpy as np


def jittered_pcs(n_cells: int, seed: int = 0, jitter: float = 0.15) -> np.ndarray:
    import scanpy as sc

    x = np.asarray(sc.datasets.pbmc68k_reduced().obsm["X_pca"], dtype=np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.shape[0], n_cells)
    out = x[idx] + jitter * x.std(axis=0)[None, :] * rng.standard_normal((n_cells, x.shape[1]))
    return out.astype(np.float32)
