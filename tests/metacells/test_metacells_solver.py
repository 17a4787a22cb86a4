"""The alternating Frank-Wolfe solver against the SEACells 0.3.3 reference trajectory, and the reduced-form error."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.sparse as sp

from gpuc._backend import get_backend
from gpuc.metacells import MetacellConvergenceWarning, fit, fw_weights, rss_reduced, update_a, update_b
from gpuc.metacells._solver import one_hot_b


@pytest.fixture(scope="module")
def cpu():
    return get_backend("cpu")


@pytest.fixture(scope="module")
def fit_ref(mc_ref, mc_ref_kernel):
    """``fit_ref(**options)``: the CPU solver on the reference kernel and archetypes, from the reference A0."""
    return lambda **options: fit(
        get_backend("cpu"), mc_ref_kernel, mc_ref["archetypes"], a0=mc_ref["A0"].copy(), **options
    )


@pytest.fixture(scope="module")
def ref_fit(fit_ref):
    return fit_ref(max_iter=50, min_iter=10, convergence_epsilon=1e-5, fw_iters=50)


def test_solver_reproduces_reference_a_b_rss_labels(ref_fit, mc_ref):
    res = ref_fit
    assert res.converged
    assert res.n_iter == len(mc_ref["rss"]) - 1 == 33
    rss = np.asarray(res.rss)
    np.testing.assert_allclose(rss, mc_ref["rss"], rtol=1e-10, atol=0)
    a, b = res.A.toarray(), res.B.toarray()
    np.testing.assert_allclose(a, mc_ref["A"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(b, mc_ref["B"], rtol=1e-10, atol=1e-12)
    labels = np.array([f"SEACell-{j}" for j in a.argmax(axis=0)])
    np.testing.assert_array_equal(labels, mc_ref["labels"])
    assert res.convergence_threshold == pytest.approx(1e-5 * mc_ref["rss"][0], rel=1e-12)


def test_a_and_b_are_sparse_simplex_columns(ref_fit):
    for mat in (ref_fit.A, ref_fit.B):
        assert sp.issparse(mat)
        np.testing.assert_allclose(np.asarray(mat.sum(axis=0)).ravel(), 1.0, atol=1e-12)
        assert np.diff(mat.tocsc().indptr).max() <= 50
        assert mat.data.min() > 0


def test_fw_weights_are_the_closed_form_of_the_recursion():
    for steps in (1, 2, 7, 50):
        w = fw_weights(steps)
        v = np.zeros(steps)  # weight of each vertex under v <- v + 2/(t+2) (e_t - v)
        for t in range(steps):
            g = 2.0 / (t + 2.0)
            v *= 1 - g
            v[t] += g
        np.testing.assert_allclose(w, v, rtol=1e-13)
        assert w.sum() == pytest.approx(1.0)


def _dense_update_a(k, b, a, steps):
    """SEACells' dense _updateA, written from the anchor description."""
    p = (k @ b).T
    q = p @ b
    a = a.copy()
    for t in range(steps):
        g = 2.0 * (q @ a - p)
        e = np.zeros_like(a)
        e[g.argmin(axis=0), np.arange(a.shape[1])] = 1.0
        a += 2.0 / (t + 2.0) * (e - a)
    return a


def _dense_update_b(k, a, b, steps):
    r = a @ a.T
    s = k @ a.T
    b = b.copy()
    for t in range(steps):
        g = 2.0 * (k @ b @ r - s)
        e = np.zeros_like(b)
        e[g.argmin(axis=0), np.arange(b.shape[1])] = 1.0
        b += 2.0 / (t + 2.0) * (e - b)
    return b


@pytest.mark.parametrize("accel", [True, False])
@pytest.mark.parametrize("start", ["dense", "sparse", "uniform"])
def test_updates_match_dense_reference_for_every_start(mc_ref, mc_ref_kernel, cpu, start, accel, disable_numba):
    kmat = sp.csr_matrix(mc_ref_kernel @ mc_ref_kernel.T)
    kd = kmat.toarray()
    n, k = 700, 9
    b0 = one_hot_b(cpu, mc_ref["archetypes"], n, k)
    if start == "dense":
        a_start, a_dense = mc_ref["A0"].copy(), mc_ref["A0"]
    elif start == "sparse":
        a_start, a_dense = sp.csc_matrix(mc_ref["A"]), mc_ref["A"]
    else:
        a_start, a_dense = "uniform", np.full((k, n), 1.0 / k)
    if not accel:
        disable_numba()
    a = update_a(cpu, kmat, b0, a_start, 20, block=256)  # several blocks; numba or array code
    want_a = _dense_update_a(kd, b0.toarray(), a_dense, 20)
    np.testing.assert_allclose(a.toarray(), want_a, rtol=1e-12, atol=1e-14)
    b = update_b(cpu, kmat, a, sp.csc_matrix(mc_ref["B"]), 20, block=128)  # several row blocks
    want_b = _dense_update_b(kd, a.toarray(), mc_ref["B"], 20)
    np.testing.assert_allclose(b.toarray(), want_b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("gradient", ["dense", "restricted"])
def test_b_update_gradient_paths_give_the_same_picks(mc_ref, mc_ref_kernel, cpu, gradient):
    """Tracking K B R only on the pattern of K A^T gives the dense path's B exactly (reference A and B)."""
    kmat = sp.csr_matrix(mc_ref_kernel @ mc_ref_kernel.T)
    a, b0 = sp.csc_matrix(mc_ref["A"]), sp.csc_matrix(mc_ref["B"])
    got = update_b(cpu, kmat, a, b0, 50, gradient=gradient).toarray()
    want = _dense_update_b(kmat.toarray(), mc_ref["A"], mc_ref["B"], 50)
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(got, update_b(cpu, kmat, a, b0, 50, gradient="dense").toarray())


def test_compiled_dense_b_update_equals_the_array_code_exactly(mc_ref, mc_ref_kernel, cpu, disable_numba):
    """The compiled B-update (each row chunk gathering its part of K[:, picks] from the bucketed K) picks what the
    array code (the GPU's) picks, and gives its B bit for bit, also from a B0 with two archetypes on the same cells."""
    pytest.importorskip("numba")
    kmat = sp.csr_matrix(mc_ref_kernel @ mc_ref_kernel.T)
    a = sp.csc_matrix(mc_ref["A"])
    b0 = sp.csc_matrix(mc_ref["B"])
    b_twice = b0.tolil()
    b_twice[:, 1] = b_twice[:, 0]  # two archetypes starting on the same cells
    starts = (b0, sp.csc_matrix(b_twice))
    got = [update_b(cpu, kmat, a, start, 30, gradient="dense").tocsc() for start in starts]
    disable_numba()
    for fast, start in zip(got, starts, strict=True):
        want = update_b(cpu, kmat, a, start, 30, gradient="dense").tocsc()
        for part in ("indptr", "indices", "data"):
            np.testing.assert_array_equal(getattr(fast, part), getattr(want, part))


def test_restricted_b_update_promotes_columns_without_a_negative_pattern_minimum(mc_ref, mc_ref_kernel, cpu):
    """Columns whose gradient is >= 0 on the pattern (here exactly 0) and unused archetypes take the exact path."""
    kmat = sp.csr_matrix(mc_ref_kernel @ mc_ref_kernel.T)
    a = mc_ref["A"].copy()
    cell = int(np.argmax(a[0]))
    a[0] = 0.0  # archetype 0 serves only `cell`, and only it: K B R - K A^T is exactly 0 in that column
    a[:, cell] = 0.0
    a[0, cell] = 1.0
    a[1] = 0.0  # archetype 1 is unused: R[:, 1] = 0
    a[1, a.sum(0) == 0] = 0.0
    a[2, a.sum(0) == 0] = 1.0
    a /= a.sum(0)
    b = mc_ref["B"].copy()
    b[:, 0] = 0.0
    b[cell, 0] = 1.0
    for steps in (1, 2, 30):
        got = update_b(cpu, kmat, sp.csc_matrix(a), sp.csc_matrix(b), steps, gradient="restricted").toarray()
        want = update_b(cpu, kmat, sp.csc_matrix(a), sp.csc_matrix(b), steps, gradient="dense").toarray()
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(got, _dense_update_b(kmat.toarray(), a, b, steps), rtol=1e-12, atol=1e-14)
    assert got[0, 1] > 0  # the unused archetype's column picks row 0, like numpy's argmin of an all-zero column


def test_b_update_rejects_unknown_gradient(mc_ref, mc_ref_kernel, cpu, disable_numba):
    kmat = sp.csr_matrix(mc_ref_kernel @ mc_ref_kernel.T)
    with pytest.raises(ValueError, match="gradient"):
        update_b(cpu, kmat, sp.csc_matrix(mc_ref["A"]), sp.csc_matrix(mc_ref["B"]), 2, gradient="sparse")
    disable_numba()
    with pytest.raises(ValueError, match="numba"):
        update_b(cpu, kmat, sp.csc_matrix(mc_ref["A"]), sp.csc_matrix(mc_ref["B"]), 2, gradient="restricted")


def test_reduced_rss_equals_direct_norm_on_small_data(cpu):
    rng = np.random.default_rng(3)
    n, k = 60, 5
    x = rng.normal(size=(n, 4))
    d2 = ((x[:, None] - x[None]) ** 2).sum(-1)
    m = np.exp(-d2 / 4.0)
    m[m < 0.2] = 0.0  # sparse, symmetric
    msp = sp.csr_matrix(m)
    kmat = sp.csr_matrix(msp @ msp.T)
    a = rng.random((k, n))
    a[a < 0.6] = 0
    a[0, a.sum(0) == 0] = 1
    a /= a.sum(0)
    b = rng.random((n, k))
    b[b < 0.8] = 0
    b[0, b.sum(0) == 0] = 1
    b /= b.sum(0)
    direct = np.linalg.norm(m - m @ b @ a)
    got = rss_reduced(cpu, kmat, float((m * m).sum()), sp.csc_matrix(a), sp.csc_matrix(b))
    assert got == pytest.approx(direct, rel=1e-12)
    sq = rss_reduced(cpu, kmat, float((m * m).sum()), sp.csc_matrix(a), sp.csc_matrix(b), squared=True)
    assert sq == pytest.approx(direct**2, rel=1e-12)


def test_reduced_rss_on_reference_matches_dense_reference(mc_ref, mc_ref_kernel, cpu):
    m = mc_ref_kernel
    kmat = sp.csr_matrix(m @ m.T)
    got = rss_reduced(cpu, kmat, float((m.data**2).sum()), sp.csc_matrix(mc_ref["A"]), sp.csc_matrix(mc_ref["B"]))
    assert got == pytest.approx(mc_ref["rss"][-1], rel=1e-12)


def test_non_convergence_warns_and_keeps_result(mc_ref, fit_ref):
    with pytest.warns(MetacellConvergenceWarning, match="did not converge"):
        res = fit_ref(max_iter=3, min_iter=0, convergence_epsilon=1e-12)
    assert res.n_iter == 3 and not res.converged
    np.testing.assert_allclose(res.rss, mc_ref["rss"][:4], rtol=1e-10)


def test_min_iter_is_honoured_and_max_below_min_rejected(mc_ref, mc_ref_kernel, cpu):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = fit(
            cpu, mc_ref_kernel, mc_ref["archetypes"], a0="uniform", max_iter=20, min_iter=5, convergence_epsilon=0.5
        )
    assert res.n_iter == 5 and res.converged
    with pytest.raises(ValueError, match="max_iter"):
        fit(cpu, mc_ref_kernel, mc_ref["archetypes"], max_iter=2, min_iter=5)


def test_compiled_sparse_products_equal_scipy_array_for_array(mc_ref_kernel, cpu, disable_numba):
    """The numba products of the fit equal scipy's results exactly (values, index order, shapes)."""
    pytest.importorskip("numba")
    from gpuc.metacells import _kernels_cpu as kern
    from gpuc.metacells._solver import DIRECT_SLOTS_MAX, _from_argmins, _picked_kernel_columns, kernel_times

    kmat = sp.csr_matrix(mc_ref_kernel @ mc_ref_kernel.T)
    n = kmat.shape[0]
    rng = np.random.default_rng(0)
    b = sp.random(n, 12, density=0.02, format="csc", random_state=1)
    ref = kmat @ b.tocsr()
    got = kernel_times(cpu, kmat, b)
    for part in ("indptr", "indices", "data"):
        np.testing.assert_array_equal(getattr(got, part), getattr(ref, part))
    # a product too wide for one slot per column and row: its columns are counted in a first pass
    wide = sp.random(n, DIRECT_SLOTS_MAX // n + 1, density=0.002, format="csr", random_state=2)
    ref, got = kmat @ wide, kernel_times(cpu, kmat, wide)
    for part in ("indptr", "indices", "data"):
        np.testing.assert_array_equal(getattr(got, part), getattr(ref, part))
    # the RSS's tr(K B A): the product values in scipy's summing order, for an unsorted K B and for sorted rows
    a_t = sp.random(12, n, density=0.3, format="csc", random_state=3)
    for x in (kernel_times(cpu, kmat, b), sp.csr_matrix(b)):
        y = sp.csr_matrix(a_t.T)
        vals = kern.elementwise_product_values(x.indptr, x.indices, x.data, y.indptr, y.indices, y.data, 12)
        prod = x.multiply(a_t.T).tocsr()
        prod.sum_duplicates()
        np.testing.assert_array_equal(vals, prod.data)
        assert vals.sum() == x.multiply(a_t.T).sum()
    dense = rng.random((n, 12))
    np.testing.assert_array_equal(kern.csr_times_dense(kmat.indptr, kmat.indices, kmat.data, dense), kmat @ dense)
    # a row block through a slice of indptr (the A-update's blocks), as scipy's row slice gives it
    lo, hi = n // 3, n // 3 + 57
    ip = kmat.indptr[lo : hi + 1]
    np.testing.assert_array_equal(kern.csr_times_dense(ip, kmat.indices, kmat.data, dense), kmat[lo:hi] @ dense)
    np.testing.assert_array_equal(kern.csr_rows_dense(ip, kmat.indices, kmat.data, n), kmat[lo:hi].toarray())
    picks = rng.integers(0, n, 12)
    picks[3] = picks[7]  # a cell picked twice
    ka = sp.csr_matrix(kmat[picks].T)
    ka.sort_indices()
    got = _picked_kernel_columns(cpu, kmat, picks)
    for part in ("indptr", "indices", "data"):
        np.testing.assert_array_equal(getattr(got, part), getattr(ka, part))
    # Frank-Wolfe columns with few rows (A: rows read off in order) and with many (B: distinct picks sorted)
    cases = [(rng.integers(0, rows, (50, cols)), (rows, cols)) for rows, cols in ((40, 30), (1000, 12))]
    fws = [_from_argmins(cpu, steps, shape) for steps, shape in cases]
    disable_numba()  # the array code (the GPU's)
    for fw, (steps, shape) in zip(fws, cases, strict=True):
        ref = _from_argmins(cpu, steps, shape)
        for part in ("indptr", "indices", "data"):
            np.testing.assert_array_equal(getattr(fw, part), getattr(ref, part))
