"""Fixtures for the metacell tests: the SEACells 0.3.3 reference run on scanpy's pbmc68k_reduced (tests/data/metacells)."""

from __future__ import annotations

import numpy as np
import pytest
import scanpy as sc
import scipy.sparse as sp
from anndata import AnnData

REF = "pbmc68k_reduced_seacells033_seed0.npz"


@pytest.fixture(scope="session")
def mc_ref(test_data) -> dict[str, np.ndarray]:
    """SEACells 0.3.3 (PyPI) run: n_SEACells=9, epsilon 1e-5, fit(min_iter=10, max_iter=50), np.random.seed(0)."""
    z = np.load(test_data / "metacells" / REF, allow_pickle=False)
    return {k: z[k] for k in z.files}


@pytest.fixture(scope="session")
def mc_ref_kernel(mc_ref) -> sp.csr_matrix:
    return sp.csr_matrix((mc_ref["kernel_data"], mc_ref["kernel_indices"], mc_ref["kernel_indptr"]), shape=(700, 700))


@pytest.fixture(scope="session")
def _pbmc68k() -> AnnData:
    return sc.datasets.pbmc68k_reduced()


@pytest.fixture
def pbmc68k(_pbmc68k) -> AnnData:
    """A fresh copy of scanpy's pbmc68k_reduced (700 cells, X_pca, X_umap, bulk_labels)."""
    return _pbmc68k.copy()


@pytest.fixture(scope="session")
def pbmc68k_fitted(_pbmc68k) -> AnnData:
    """pbmc68k_reduced after gpuc.tl.metacells with the reference run's settings (shared, do not modify)."""
    import gpuc

    ad = _pbmc68k.copy()
    gpuc.tl.metacells(ad, convergence_epsilon=1e-5, max_iter=50, min_iter=10, device="cpu", random_state=0)
    return ad
