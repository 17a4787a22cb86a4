"""Engine tests: HALS optimum, batched == one-at-a-time, loss expansion, consensus pieces, cNMF parity."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.metrics import silhouette_score

from gpuc._backend import get_backend
from gpuc._utils import derive_seed
from gpuc.nmf._consensus import (
    ConsensusError,
    consensus,
    local_density,
    n_neighbors_for,
    pool_components,
    run_k,
    silhouette,
)
from gpuc.nmf._hals import Operator, fit_hals, fit_hals_groups, nnls_refit

CPU = get_backend("cpu")


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return a @ b.T


@pytest.mark.parametrize("extrapolate", [True, False])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_nmf_single_fit_reaches_sklearn_optimum(cnmf_matrix, sparse, dtype, extrapolate):
    # sklearn cd (cNMF's solver) reaches ||V-WH||^2/||V||^2 = 0.5904612 on this matrix at k=7 (scikit-learn 1.x, cNMF 1.7.1 settings)
    v = sp.csr_matrix(cnmf_matrix) if sparse else cnmf_matrix
    op = Operator.build(CPU, v, dtype=dtype)
    res = fit_hals(CPU, op, 7, [derive_seed(3, 7, 0)], extrapolate=extrapolate)
    assert res.converged[0]
    assert abs(res.rel_errors[0] - 0.59046) < 1e-4
    # the loss reported by the Gram expansion is the true squared error of the returned factors
    w, h = res.usage(0), res.spectra(0)
    direct = ((cnmf_matrix - w @ h) ** 2).sum()
    exact = dtype == np.float64
    assert res.losses[0] == pytest.approx(direct, rel=1e-9 if exact else 1e-4)
    # usage columns have unit norm, entries are non-negative
    np.testing.assert_allclose(np.linalg.norm(w.astype(np.float64), axis=0), 1.0, rtol=1e-12 if exact else 1e-5)
    assert (w >= 0).all() and (h >= 0).all()


SCHEDULES = [
    {},  # the default: usages first, plain HALS warm-up, then extrapolation
    {"warmup": 0},
    {"update_order": "spectra", "warmup": 0},
    {"update_order": "spectra", "warmup": 7},  # warm-up ending between two checks
    {"extrapolate": False},
    {"extrapolate": False, "update_order": "spectra"},
]
SCHEDULE_IDS = ["default", "usages-w0", "spectra-w0", "spectra-w7", "plain-usages", "plain-spectra"]


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=SCHEDULE_IDS)
def test_nmf_batched_equals_one_at_a_time(cnmf_matrix, schedule, sparse):
    v = sp.csr_matrix(cnmf_matrix) if sparse else cnmf_matrix  # sparse: fused numba kernels; dense: generic path
    op = Operator.build(CPU, v, dtype=np.float64)
    seeds = [derive_seed(11, 6, r) for r in range(5)]
    batched = fit_hals(CPU, op, 6, seeds, **schedule)
    # runs stop at different iterations, so the batch shrinks during the fit
    assert len(set(batched.n_iter.tolist())) > 1
    for r, ss in enumerate(seeds):
        alone = fit_hals(CPU, op, 6, [ss], **schedule)
        assert alone.n_iter[0] == batched.n_iter[r]
        assert alone.losses[0] == pytest.approx(batched.losses[r], rel=1e-10)
        np.testing.assert_allclose(alone.spectra(0), batched.spectra(r), rtol=1e-7, atol=1e-9)
        np.testing.assert_allclose(alone.usage(0), batched.usage(r), rtol=1e-7, atol=1e-9)


# (rank, runs) groups: three ranks merged into one zero-padded lane group of the fused kernels, and two that are not
RANK_GROUPS = {"merged": [(4, 3), (2, 3), (3, 3)], "unmerged": [(2, 6), (6, 1)]}


@pytest.mark.parametrize("path", ["fused", "generic-sparse", "dense"])
@pytest.mark.parametrize(
    "schedule", [SCHEDULES[0], SCHEDULES[2], SCHEDULES[4]], ids=["default", "spectra-w0", "plain-usages"]
)
@pytest.mark.parametrize("layout", list(RANK_GROUPS))
def test_nmf_rank_groups_equal_separate_fits(cnmf_matrix, schedule, path, layout, disable_numba):
    # a k sweep fits all ranks in the same products; every run must be bit-identical to its rank fitted alone,
    # including after other ranks' runs have left the batch (columns shift, arrays are compacted)
    from gpuc.nmf._hals import _Layout

    ranks = np.concatenate([np.full(n, k) for k, n in RANK_GROUPS[layout]])
    n_lane_groups = len(
        _Layout.of(
            ranks, np.repeat(np.arange(len(RANK_GROUPS[layout])), [n for _, n in RANK_GROUPS[layout]])
        ).kernel_args[0]
    )
    assert n_lane_groups == (1 if layout == "merged" else 2)
    if path == "generic-sparse":
        disable_numba()
    v = cnmf_matrix[:300, :200].astype(np.float32)
    op = Operator.build(CPU, v if path == "dense" else sp.csr_matrix(v))
    groups = [(k, [derive_seed(5, k, r) for r in range(n)]) for k, n in RANK_GROUPS[layout]]
    together = fit_hals_groups(CPU, op, groups, **schedule)
    ends = np.concatenate([r.n_iter for r in together])
    assert len(set(ends.tolist())) > 1  # runs leave the batch at different iterations
    for (k, seeds), res in zip(groups, together, strict=True):
        alone = fit_hals(CPU, op, k, seeds, **schedule)
        assert res.usages.shape == (300, len(seeds), k) and res.spectra_t.shape == (200, len(seeds), k)
        np.testing.assert_array_equal(alone.n_iter, res.n_iter)
        np.testing.assert_array_equal(alone.losses, res.losses)
        np.testing.assert_array_equal(alone.usages, res.usages)
        np.testing.assert_array_equal(alone.spectra_t, res.spectra_t)


def test_nmf_sweep_batches_respect_the_memory_budget():
    from gpuc.nmf._consensus import sweep_batches

    ks = list(range(2, 13))
    assert sweep_batches(ks, 10, (2638, 2000), 4) == [ks]  # pbmc3k: one batch
    per_column = 6 * (1000 + 500) * 4
    batches = sweep_batches(ks, 10, (1000, 500), 4, budget_bytes=200 * per_column)
    assert [k for b in batches for k in b] == ks
    assert all(sum(b) * 10 <= 200 or len(b) == 1 for b in batches)
    assert len(batches) > 1
    assert sweep_batches([50], 10, (10**6, 2000), 4) == [[50]]  # a rank alone always runs


@pytest.mark.parametrize("schedule", SCHEDULES, ids=SCHEDULE_IDS)
def test_nmf_every_schedule_reaches_sklearn_optimum(cnmf_matrix, schedule):
    # every update order / warm-up: same optimum, loss expansion still exact, unit usage columns
    op = Operator.build(CPU, sp.csr_matrix(cnmf_matrix), dtype=np.float64)
    res = fit_hals(CPU, op, 7, [derive_seed(3, 7, 0)], **schedule)
    assert res.converged[0]
    assert abs(res.rel_errors[0] - 0.59046) < 1e-4
    w, h = res.usage(0), res.spectra(0)
    assert res.losses[0] == pytest.approx(((cnmf_matrix - w @ h) ** 2).sum(), rel=1e-9)
    np.testing.assert_allclose(np.linalg.norm(w, axis=0), 1.0, rtol=1e-12)


def test_nmf_default_schedule_follows_sklearn_cd_from_the_same_start(cnmf_matrix):
    # the default schedule (usages first, plain HALS warm-up, then extrapolation) is meant to pick the same local
    # optimum as scikit-learn's cd (cNMF's solver) from the same random start, restart by restart
    from sklearn.decomposition import non_negative_factorization

    from gpuc.nmf._hals import random_init

    op = Operator.build(CPU, sp.csr_matrix(cnmf_matrix), dtype=np.float64)
    k = 7
    seeds = [derive_seed(5, k, r) for r in range(6)]
    w0, h0 = random_init(seeds, *op.shape, k, op.mean, np.float64)
    ours = fit_hals(CPU, op, k, seeds).rel_errors
    for r in range(len(seeds)):
        w, h, _ = non_negative_factorization(
            cnmf_matrix,
            W=w0[:, r, :].copy(),
            H=h0[:, r, :].T.copy(),
            n_components=k,
            init="custom",
            solver="cd",
            tol=1e-4,
            max_iter=1000,
        )
        ref = ((cnmf_matrix - w @ h) ** 2).sum() / op.norm2
        assert ours[r] == pytest.approx(ref, abs=2e-5), r


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"update_order": "genes"}, "update_order="),
        ({"warmup": -1}, "warmup="),
        ({"warmup": 2.5}, "warmup="),
        ({"warmup": True}, "warmup="),
    ],
)
def test_nmf_fit_hals_rejects_bad_schedule(cnmf_matrix, kwargs, match):
    op = Operator.build(CPU, sp.csr_matrix(cnmf_matrix))
    with pytest.raises(ValueError, match=match):
        fit_hals(CPU, op, 3, [derive_seed(0, 3, 0)], **kwargs)


def test_nmf_seeds_depend_only_on_k_and_run(cnmf_matrix):
    op = Operator.build(CPU, cnmf_matrix[:200])
    a = run_k(CPU, op, 4, 3, random_state=5)
    b = run_k(CPU, op, 4, 3, random_state=5)
    c = run_k(CPU, op, 4, 3, random_state=6)
    np.testing.assert_array_equal(a.spectra_t, b.spectra_t)
    assert not np.allclose(a.spectra_t, c.spectra_t)


def test_nmf_nnls_refit_matches_scipy_nnls(cnmf_matrix):
    from scipy.optimize import nnls

    rng = np.random.default_rng(0)
    h = rng.gamma(0.3, 1.0, (5, cnmf_matrix.shape[1]))  # well-conditioned, mostly-disjoint programmes
    op = Operator.build(CPU, cnmf_matrix[:20], dtype=np.float64)
    w, loss = nnls_refit(CPU, op, h, tol=1e-12, max_iter=5000, check_every=1)
    for i in range(20):
        ref, _ = nnls(h.T, cnmf_matrix[i])
        np.testing.assert_allclose(w[i], ref, atol=1e-6)
    assert loss == pytest.approx(((cnmf_matrix[:20] - w @ h) ** 2).sum(), rel=1e-8)


def test_nmf_neighbour_count_and_collapsed_components():
    assert n_neighbors_for(3) == 1  # cNMF's int(0.3 * 3) = 0 would drop everything
    assert n_neighbors_for(10) == 3
    assert n_neighbors_for(20) == 6
    assert n_neighbors_for(21) == 7
    rng = np.random.default_rng(1)
    pool = rng.uniform(0, 1, (12, 8))
    pool[5] = 0.0  # a collapsed component
    run, comp = np.repeat(np.arange(4), 3), np.tile(np.arange(3), 4)
    dens = local_density(CPU, pool, run, comp, 4, metric="cosine")
    assert np.isinf(dens.density[5])
    assert np.isfinite(np.delete(dens.density, 5)).all()
    # density = mean of the 2 smallest cosine distances to other live rows
    unit = pool / np.maximum(np.linalg.norm(pool, axis=1, keepdims=True), 1e-300)
    d = 1 - unit @ unit.T
    live = np.delete(np.arange(12), 5)
    i = 0
    others = np.sort(d[i, live[live != i]])
    assert dens.n_neighbors == 2
    assert dens.density[i] == pytest.approx(others[:2].mean(), rel=1e-12)


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
def test_nmf_silhouette_matches_sklearn(metric):
    rng = np.random.default_rng(2)
    x = np.abs(rng.normal(size=(40, 6))) + np.repeat(np.eye(4, 6) * 3, 10, axis=0)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    labels = np.repeat(np.arange(4), 10)
    labels[0] = 1
    sim = x @ x.T
    dist = 1 - sim if metric == "cosine" else np.sqrt(np.maximum(2 - 2 * sim, 0))
    ours = silhouette(dist, labels).mean()  # the ~1e-8 Euclidean diagonal is zeroed, as scikit-learn requires
    np.fill_diagonal(dist, 0)
    assert ours == pytest.approx(silhouette_score(dist, labels, metric="precomputed"), abs=1e-10)


def test_nmf_silhouette_degenerate_labels_are_zero():
    dist = 1 - np.eye(5)
    assert np.array_equal(silhouette(dist, np.zeros(5, dtype=int)), np.zeros(5))  # one cluster
    assert np.array_equal(silhouette(dist, np.arange(5)), np.zeros(5))  # only singletons
    s = silhouette(dist, np.array([0, 0, 1, 1, 2]))
    assert s[4] == 0.0  # a singleton scores 0


def test_nmf_consensus_matches_cnmf_k7(cnmf_matrix, cnmf_k7_spectra):
    op = Operator.build(CPU, cnmf_matrix)
    fits = run_k(CPU, op, 7, 20, random_state=0)
    res = consensus(CPU, op, fits, 7, metric="euclidean", density_threshold=0.5, normalization="sum")
    np.testing.assert_allclose(res.spectra.sum(axis=1), 1.0, rtol=1e-12)
    cos = _cos(cnmf_k7_spectra, res.spectra)
    assert cos.max(axis=1).min() >= 0.99
    assert sorted(cos.argmax(axis=1).tolist()) == list(range(7))  # one-to-one
    # cNMF reports Euclidean stability 0.9665 in its 5..8 sweep (0.9434 stand-alone); same optimum error
    assert res.stability > 0.9
    assert res.rel_error == pytest.approx(0.59046, abs=2e-4)
    assert res.cluster_sizes.sum() == 140 - res.n_dropped
    # programmes ordered by total normalised usage, largest first
    share = (res.usages / res.usages.sum(axis=1, keepdims=True)).sum(axis=0)
    assert (np.diff(share) <= 1e-12).all()


def test_nmf_consensus_usage_target_agrees_with_spectra_target(cnmf_matrix):
    op = Operator.build(CPU, cnmf_matrix)
    fits = run_k(CPU, op, 7, 8, random_state=1)
    a = consensus(CPU, op, fits, 7, target="spectra", density_threshold=2.0)
    b = consensus(CPU, op, fits, 7, target="usage", density_threshold=2.0)
    assert _cos(a.spectra, b.spectra).max(axis=1).min() > 0.95
    assert b.rel_error == pytest.approx(a.rel_error, abs=5e-3)


def test_nmf_consensus_too_few_components(cnmf_matrix):
    op = Operator.build(CPU, cnmf_matrix[:100])
    fits = run_k(CPU, op, 3, 4, random_state=0)
    pool, run, comp = pool_components(CPU, fits, "spectra")
    dens = local_density(CPU, pool, run, comp, 4)
    with pytest.raises(ConsensusError, match="fewer than k=3"):
        consensus(CPU, op, fits, 3, density_threshold=0.0, density=dens)
    # the cached densities let another threshold be applied without refitting
    res = consensus(CPU, op, fits, 3, density_threshold=2.0, density=dens)
    assert res.n_dropped == 0


@pytest.mark.parametrize(
    "schedule",
    [{}, {"update_order": "spectra", "warmup": 0}, {"extrapolate": False}],
    ids=["default", "spectra-w0", "plain"],
)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_nmf_fused_cpu_kernel_matches_generic_path(cnmf_matrix, disable_numba, dtype, schedule):
    # the numba-fused half-iterations (sparse V, extrapolation) follow the same iterates as the generic xp code
    pytest.importorskip("numba")
    op = Operator.build(CPU, sp.csr_matrix(cnmf_matrix), dtype=dtype)
    seeds = [derive_seed(2, 5, r) for r in range(4)]
    fused = fit_hals(CPU, op, 5, seeds, **schedule)
    disable_numba()
    generic = fit_hals(CPU, op, 5, seeds, **schedule)
    if dtype == np.float64:
        np.testing.assert_array_equal(fused.n_iter, generic.n_iter)
    else:  # float32 losses differ by rounding (~1e-7 relative, tol is 1e-6): a run may stop one check earlier or later
        assert np.abs(fused.n_iter - generic.n_iter).max() <= 5
    rel = 1e-9 if dtype == np.float64 else 1e-4
    np.testing.assert_allclose(fused.losses, generic.losses, rtol=rel)
    if dtype == np.float64:  # float32 rounding differs (float64 Grams in the kernel), so only the losses are compared
        np.testing.assert_allclose(fused.spectra_t, generic.spectra_t, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(fused.usages, generic.usages, rtol=1e-5, atol=1e-6)
