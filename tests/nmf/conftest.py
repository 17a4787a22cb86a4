"""Fixtures for the NMF tests: cNMF's 700 x 500 pbmc68k matrix (shipped in tests/data/nmf) and small synthetic data."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from anndata import AnnData


@pytest.fixture(scope="session")
def cnmf_counts(test_data) -> AnnData:
    """700 cells x 500 genes integer counts (CSR), every gene flagged highly variable."""
    z = np.load(test_data / "nmf" / "pbmc68k_counts_700x500.npz", allow_pickle=False)
    x = sp.csr_matrix((z["data"].astype(np.float32), z["indices"], z["indptr"]), shape=tuple(z["shape"]))
    ad = AnnData(x, obs=pd.DataFrame(index=z["obs"].astype(str)), var=pd.DataFrame(index=z["var"].astype(str)))
    ad.var["highly_variable"] = True
    return ad


@pytest.fixture(scope="session")
def cnmf_matrix(cnmf_counts) -> np.ndarray:
    """The matrix cNMF factorises: counts with each gene divided by its SD (ddof=1), dense float64."""
    d = cnmf_counts.X.toarray().astype(np.float64)
    return d / d.std(axis=0, ddof=1)


@pytest.fixture(scope="session")
def cnmf_k7_spectra(test_data) -> np.ndarray:
    """cNMF 1.7.1's k=7 consensus median spectra (7 x 500, rows sum to 1, density threshold 0.5)."""
    return np.load(test_data / "nmf" / "cnmf_k7_dt0_5_median_spectra.npz", allow_pickle=False)["median_spectra"]


def make_programs(n_cells: int = 120, n_genes: int = 60, k: int = 3, seed: int = 0, *, sparse: bool = True) -> AnnData:
    """Poisson counts from ``k`` planted non-overlapping programmes (each cell mostly one), HVG flags on 2/3 of genes."""
    rng = np.random.default_rng(seed)
    spectra = np.full((k, n_genes), 0.05)
    for j, block in enumerate(np.array_split(np.arange(n_genes), k)):
        spectra[j, block] = rng.uniform(2, 6, block.size)
    usage = rng.dirichlet(np.full(k, 0.3), size=n_cells) * rng.uniform(0.5, 1.5, (n_cells, 1))
    counts = rng.poisson(3 * usage @ spectra).astype(np.float32)
    counts[:, counts.sum(0) == 0] += 1  # no empty gene
    counts[counts.sum(1) == 0, 0] += 1  # no empty cell
    ad = AnnData(sp.csr_matrix(counts) if sparse else counts)
    ad.obs_names = [f"c{i}" for i in range(n_cells)]
    ad.var_names = [f"g{i}" for i in range(n_genes)]
    ad.layers["counts"] = ad.X.copy()
    ad.var["highly_variable"] = np.arange(n_genes) % 3 != 2
    ad.obs["truth"] = pd.Categorical(usage.argmax(1).astype(str))
    return ad


@pytest.fixture
def programs() -> AnnData:
    """A fresh small synthetic AnnData (120 x 60, 3 planted programmes, sparse counts)."""
    return make_programs()


@pytest.fixture(scope="session")
def program_factory():
    """:func:`make_programs`, for tests that need other sizes or seeds."""
    return make_programs
