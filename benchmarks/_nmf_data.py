"""A CD34-sized NMF input built from real cells (gpuc's bundled pbmc3k), shared by the NMF GPU check and the
cold-start benchmark.

:func:`cd34_sized` is the size of bixverse.gpu's CD34 example: pbmc3k cells resampled with binomial thinning,
log1p(CP10k) on the most dispersed genes detected in >= 6% of cells.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp


def cd34_sized(n_cells: int = 6881, n_genes: int = 2000, seed: int = 0) -> sp.csr_matrix:
    import gpuc

    ad = gpuc.datasets.pbmc3k()
    x = ad.layers["counts"].tocsr().astype(np.float64)
    keep = np.asarray(ad.obs["passed_seurat_qc"]).astype(bool)
    x = x[keep]
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, x.shape[0], n_cells)
    y = x[rows].tocsr()
    y.data = rng.binomial(y.data.astype(np.int64), 0.85).astype(np.float64)
    y.eliminate_zeros()
    lib = np.asarray(y.sum(1)).ravel()
    y = sp.diags(1e4 / np.maximum(lib, 1)) @ y
    y.data = np.log1p(y.data)
    y = y.tocsr()
    mean = np.asarray(y.mean(0)).ravel()
    var = np.asarray(y.multiply(y).mean(0)).ravel() - mean**2
    detected = np.asarray((y > 0).mean(0)).ravel()
    disp = np.where(detected >= 0.06, var / np.maximum(mean, 1e-12), -np.inf)
    # the most dispersed genes seen in >= 6% of cells (10.6% non-zero; CD34's HVGs: 10.4%)
    genes = np.argsort(-disp)[:n_genes]
    y = y[:, np.sort(genes)].tocsr()
    y = y[np.asarray(y.sum(1)).ravel() > 0]
    return y.astype(np.float32)
