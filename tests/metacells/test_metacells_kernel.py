"""The SEACells kernel M and the archetype initialisation against the SEACells 0.3.3 reference run."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from gpuc._backend import get_backend
from gpuc.metacells import build_kernel, compute_knn, greedy_centers, initial_archetypes
from gpuc.metacells._kernel import KnnResult, non_self


@pytest.fixture(scope="module")
def cpu():
    return get_backend("cpu")


def test_kernel_equals_seacells_reference(pbmc68k, mc_ref, mc_ref_kernel, cpu):
    assert np.array_equal(np.asarray(pbmc68k.obs_names), mc_ref["obs_names"])
    m, sigma = build_kernel(cpu, pbmc68k.obsm["X_pca"], n_neighbors=15, graph="union")
    assert m.shape == (700, 700)
    assert m.nnz == mc_ref_kernel.nnz == 16600
    # identical sparsity pattern, values within 1e-6 (float32 kNN distances in scanpy)
    assert (m != 0).astype(int).__ne__((mc_ref_kernel != 0).astype(int)).nnz == 0
    assert abs(m - mc_ref_kernel).max() <= 1e-6
    assert np.allclose(m.diagonal(), 1.0)
    assert abs(m - m.T).max() == 0.0
    assert (sigma > 0).all()


def test_kernel_does_not_depend_on_the_block_size(pbmc68k, cpu):
    x = pbmc68k.obsm["X_pca"]
    m, sigma = build_kernel(cpu, x)
    for chunk in (1, 37, 10**7):
        other, other_sigma = build_kernel(cpu, x, chunk=chunk)
        for part in ("data", "indices", "indptr"):
            np.testing.assert_array_equal(getattr(other, part), getattr(m, part))
        np.testing.assert_array_equal(other_sigma, sigma)


def test_greedy_reads_the_symmetric_kernel_by_rows(mc_ref_kernel, cpu):
    # K = M M^T is exactly symmetric, so reading column p as row p changes nothing (the CSC copy is gone)
    k = sp.csr_matrix(mc_ref_kernel @ mc_ref_kernel.T)
    assert (k != k.T).nnz == 0
    np.testing.assert_array_equal(k[[5]].toarray().ravel(), k.tocsc()[:, 5].toarray().ravel())


def test_intersection_graph_is_the_mutual_subset(pbmc68k, cpu):
    union, _ = build_kernel(cpu, pbmc68k.obsm["X_pca"], graph="union")
    inter, _ = build_kernel(cpu, pbmc68k.obsm["X_pca"], graph="intersection")
    assert inter.nnz < union.nnz
    # every intersection edge is a union edge with the same weight
    diff = (union - inter).multiply(inter != 0)
    assert abs(diff).max() <= 1e-12
    with pytest.raises(ValueError, match="graph="):
        build_kernel(cpu, pbmc68k.obsm["X_pca"], graph="mutual")


def test_archetypes_equal_seacells_reference(pbmc68k, mc_ref, cpu):
    x = pbmc68k.obsm["X_pca"]
    knn = compute_knn(cpu, x, 30)
    m, _ = build_kernel(cpu, x, knn=knn)
    k = sp.csr_matrix(m @ m.T)
    arche = initial_archetypes(cpu, k, knn, 9, np.random.RandomState(0))
    np.testing.assert_array_equal(arche, mc_ref["archetypes"])


def _greedy_dense_reference(kmat: np.ndarray, n_centers: int) -> list[int]:
    """Farahat et al.'s greedy CSSP written from the paper, with SEACells' sign of the g update (g += omega^2)."""
    n = kmat.shape[0]
    f = (kmat * kmat).sum(axis=0)
    g = np.diag(kmat).copy()
    omegas: list[np.ndarray] = []
    out = []
    for _ in range(n_centers):
        p = int(np.argmax(f / g))
        delta = kmat[:, p] - sum((w[p] * w for w in omegas), np.zeros(n))
        delta[p] = max(0.0, delta[p])
        w = delta / max(np.sqrt(delta[p]), 1e-6)
        proj = sum(((wr @ w) * wr for wr in omegas), np.zeros(n))
        f = f - 2.0 * w * (kmat @ w - proj) + (w @ w) * w * w
        g = g + w * w
        omegas.append(w)
        out.append(p)
    return out


def test_greedy_selection_matches_a_dense_replay(mc_ref_kernel, cpu):
    k = sp.csr_matrix(mc_ref_kernel @ mc_ref_kernel.T)
    got = greedy_centers(cpu, k, 12)
    want = _greedy_dense_reference(k.toarray(), 12)
    assert list(got) == want
    assert len(set(want)) == 12


def test_non_self_neighbours_are_scanpy_style(cpu):
    from sklearn.neighbors import NearestNeighbors

    points = np.random.default_rng(0).normal(size=(400, 8))
    _, idx = non_self(cpu, compute_knn(cpu, points, 15), 15)
    assert idx.shape == (400, 14) and not (idx == np.arange(400)[:, None]).any()
    ref = NearestNeighbors(n_neighbors=14).fit(points).kneighbors_graph(mode="distance").tocsr().sorted_indices()
    np.testing.assert_array_equal(np.sort(idx, axis=1).ravel(), ref.indices)


def test_non_self_with_duplicates_keeps_k_minus_one(cpu):
    dist = np.array([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    idx = np.array([[1, 2, 0], [0, 1, 5]])  # row 0: self ranked last among ties; row 1: self present
    d, i = non_self(cpu, KnnResult(dist, idx), 3)
    assert i.tolist() == [[1, 2], [0, 5]] and d.tolist() == [[0.0, 0.0], [0.0, 1.0]]
    x = np.vstack([np.zeros((3, 2)), np.random.default_rng(0).normal(size=(20, 2))])
    _, i = non_self(cpu, compute_knn(cpu, x, 4), 4)
    assert i.shape == (23, 3) and not (i == np.arange(23)[:, None]).any()
