"""The compiled passes behind ``gpuc.tl.nmf_project``'s speed: each must give exactly what the code it replaces gives.

References: scipy's column indexing (``x[:, genes]``), :func:`gpuc.nmf._project.gene_moments` (the per-block moments
read in place) and repeated single HALS sweeps (:func:`gpuc.nmf._kernels_cpu.sweep`).
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from gpuc.nmf._project import gene_moments, select_genes


def _query(rows: int = 203, cols: int = 90, seed: int = 0) -> sp.csr_matrix:
    rng = np.random.default_rng(seed)
    x = sp.random(rows, cols, density=0.3, format="csr", random_state=rng, dtype=np.float64)
    x.data = np.floor(x.data * 20).astype(np.float32)  # counts, some stored zeros
    x = x.astype(np.float32).tocsr()
    x.data[x.indptr[5] : x.indptr[6]] = 0  # a row of stored zeros only
    return x


@pytest.mark.parametrize("block_rows", [37, 203, 1000])
def test_select_genes_is_column_indexing_and_the_moments_are_bit_identical(block_rows):
    x = _query()
    genes = np.array([7, 3, 88, 40, 41, 0, 60, 12], dtype=np.int64)  # not sorted: the reference's order
    sub, rest, moments = select_genes(x, genes, block_rows=block_rows)
    assert rest is None and sub.shape == (x.shape[0], len(genes))
    np.testing.assert_array_equal(sub.toarray(), x[:, genes].toarray())
    # each row keeps its values in their stored order, so the compiled passes add them in the same order
    for i in range(x.shape[0]):
        row = x.indices[x.indptr[i] : x.indptr[i + 1]]
        kept = [c for c in row if c in set(genes)]
        np.testing.assert_array_equal(genes[sub.indices[sub.indptr[i] : sub.indptr[i + 1]]], kept)
    ref = gene_moments(x, genes, block_rows=block_rows)
    assert moments.n == ref.n == x.shape[0]
    np.testing.assert_array_equal(moments.total, ref.total)
    np.testing.assert_array_equal(moments.total_sq, ref.total_sq)


def test_select_genes_leaves_other_inputs_alone(disable_numba):
    x = _query()
    genes = np.array([1, 2], dtype=np.int64)
    dense = x.toarray()
    assert select_genes(dense, genes)[0] is dense
    assert select_genes(x.tocsc(), genes)[2] is None
    assert select_genes(x, None)[0] is x
    disable_numba()
    assert select_genes(x, genes)[0] is x


@pytest.mark.parametrize("rows", [1, 16, 101])
def test_fused_sweeps_equal_single_sweeps(rows):
    from gpuc.nmf._kernels_cpu import sweep, sweeps

    rng = np.random.default_rng(rows)
    k, runs = 6, 2
    h = rng.random((runs, k, 30)).astype(np.float32)
    g = np.ascontiguousarray(h @ h.transpose(0, 2, 1))
    g[1, 2, :] = g[1, :, 2] = 0  # a component without signal in one run: left unchanged
    q = rng.random((rows, runs, k)).astype(np.float32) * 5
    x0 = rng.random((rows, runs, k)).astype(np.float32)
    one = x0.copy()
    for _ in range(7):
        sweep(one, q, g, 0.0)
    many = x0.copy()
    sweeps(many, q, g, 0.0, 7)
    np.testing.assert_array_equal(many, one)
    assert not np.array_equal(many, x0)
