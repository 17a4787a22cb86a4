"""The GPU kernels of the metacell fit (gpuc.metacells._kernels_gpu) on the stand-in device, run by numba-cuda's CUDA
simulator: the picks, iterates and RSS of the CPU path (ties to the lowest index), and the launch budget of one outer
iteration. The simulator runs a Python thread per CUDA thread, so the fits are small (120-160 cells, 3-5
metacells, 6-12 Frank-Wolfe steps)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from gpuc._backend import get_backend, launch_stats
from gpuc._testing.standin import counting, simulator_status, standin_backend
from gpuc.metacells import _solver, build_kernel, compute_knn, fit, initial_archetypes, update_a, update_b

pytestmark = pytest.mark.skipif(not simulator_status()[0], reason=simulator_status()[1])

CPU = get_backend("cpu")


@pytest.fixture(scope="module")
def gpu():
    return standin_backend()


def _problem(pcs: np.ndarray, n: int, k: int) -> tuple[sp.csr_matrix, sp.csr_matrix, np.ndarray]:
    """Kernel M, K = M M^T and initial archetypes for the first ``n`` cells of ``pcs``."""
    x = np.ascontiguousarray(pcs[:n], dtype=np.float64)
    knn = compute_knn(CPU, x, 10)
    mmat, _ = build_kernel(CPU, x, knn=knn)
    kmat = sp.csr_matrix(mmat @ mmat.T)
    arche = initial_archetypes(CPU, kmat, knn, k, np.random.RandomState(0), n_components=5)
    return mmat, kmat, np.asarray(arche)


@pytest.fixture(scope="module")
def pcs(_pbmc68k) -> np.ndarray:
    return np.asarray(_pbmc68k.obsm["X_pca"])


@pytest.fixture(scope="module")
def small(pcs):
    return _problem(pcs, 120, 4)


def _fit_both(gpu, mmat, arche, a0, *, n_iter=2, fw_iters=8, kmat_gpu=None):
    cpu_res = fit(CPU, mmat, arche, a0=a0, max_iter=n_iter, min_iter=n_iter, fw_iters=fw_iters)
    a0_gpu = a0 if isinstance(a0, str) else gpu.asarray(a0)
    with counting() as c:
        gpu_res = fit(
            gpu, gpu.asarray(mmat), arche, a0=a0_gpu, kmat=kmat_gpu, max_iter=n_iter, min_iter=n_iter, fw_iters=fw_iters
        )
    assert c.by_name["kernel.fw_a_cells"] == n_iter + 1, c.top()  # the kernels ran (not the array code)
    return cpu_res, gpu_res


def _assert_same_fit(cpu_res, gpu_res, gpu):
    a, b = gpu.to_host(gpu_res.A), gpu.to_host(gpu_res.B)
    np.testing.assert_array_equal(a.toarray(), cpu_res.A.toarray())
    np.testing.assert_array_equal(b.toarray(), cpu_res.B.toarray())
    assert a.nnz == cpu_res.A.nnz and b.nnz == cpu_res.B.nnz  # compacted: no explicit zeros left
    np.testing.assert_array_equal(a.toarray().argmax(0), cpu_res.A.toarray().argmax(0))
    np.testing.assert_allclose(gpu_res.rss, cpu_res.rss, rtol=1e-13)


@pytest.mark.parametrize(
    "start", ["uniform", pytest.param("dense", marks=pytest.mark.slow), pytest.param("sparse", marks=pytest.mark.slow)]
)
def test_fit_matches_cpu(gpu, small, start):
    mmat, _, arche = small
    k, n = len(arche), mmat.shape[0]
    if start == "uniform":
        a0 = "uniform"
    elif start == "dense":
        a0 = np.random.RandomState(1).random((k, n))
        a0 /= a0.sum(0)
    else:  # a sparse A from a short CPU fit
        a0 = fit(CPU, mmat, arche, max_iter=1, min_iter=1, fw_iters=5).A
    _assert_same_fit(*_fit_both(gpu, mmat, arche, a0), gpu)


def test_updates_on_identical_inputs_pick_as_the_cpu(gpu, small):
    """One A-update and one B-update from the same A, B and K on both devices give the same iterates exactly."""
    mmat, kmat, arche = small
    res = fit(CPU, mmat, arche, max_iter=1, min_iter=1, fw_iters=6)
    kg = gpu.asarray(kmat)
    a_cpu = update_a(CPU, kmat, res.B, res.A, 7)
    a_gpu = update_a(gpu, kg, gpu.asarray(res.B), gpu.asarray(res.A), 7)
    np.testing.assert_array_equal(gpu.to_host(a_gpu).toarray(), a_cpu.toarray())
    b_cpu = update_b(CPU, kmat, a_cpu, res.B, 7, gradient="dense")
    with counting() as c:
        b_gpu = update_b(gpu, kg, gpu.asarray(a_cpu), gpu.asarray(res.B), 7)
    assert c.by_name["kernel.fw_b_cols"] == 7, c.top()
    np.testing.assert_array_equal(gpu.to_host(b_gpu).toarray(), b_cpu.toarray())


@pytest.mark.slow
def test_ties_go_to_the_lowest_index(gpu, small):
    """Archetypes starting on the same cell give tied gradients at every A-step (equal rows of B^T K B, equal
    columns of K B): every cell picks the first of them. The later ones are then unused, so their B-gradient columns
    are zero for every cell: a tie of all cells, which goes to cell 0."""
    mmat, kmat, arche = small
    n = mmat.shape[0]
    dup = np.array([arche[0], arche[1], arche[0], arche[2], arche[1]])
    b0 = _solver.one_hot_b(CPU, dup, n, len(dup))
    a_cpu = update_a(CPU, kmat, b0, "uniform", 6)
    kg = gpu.asarray(kmat)
    a_gpu = update_a(gpu, kg, _solver.one_hot_b(gpu, dup, n, len(dup)), "uniform", 6)
    assert not a_cpu.toarray()[[2, 4]].any()
    np.testing.assert_array_equal(gpu.to_host(a_gpu).toarray(), a_cpu.toarray())
    b_cpu = update_b(CPU, kmat, a_cpu, b0, 6, gradient="dense")
    b_gpu = update_b(gpu, kg, a_gpu, gpu.asarray(b0), 6)
    np.testing.assert_array_equal(b_cpu.toarray()[:, [2, 4]], np.eye(n)[:, [0, 0]])
    np.testing.assert_array_equal(gpu.to_host(b_gpu).toarray(), b_cpu.toarray())
    _assert_same_fit(*_fit_both(gpu, mmat, dup, "uniform", fw_iters=6), gpu)


@pytest.mark.slow
def test_summation_order_of_the_kernel_does_not_change_the_fit(gpu, small):
    """K's rows stored in reversed column order (as a GPU sparse product may leave them) change the order of the
    sums in K B, K A^T and B^T K B, not the picks: the same iterates and RSS to 1e-12 as the CPU with sorted K.
    """
    mmat, kmat, arche = small
    kr = kmat.copy()
    for i in range(kr.shape[0]):
        s, e = kr.indptr[i], kr.indptr[i + 1]
        kr.indices[s:e] = kr.indices[s:e][::-1].copy()
        kr.data[s:e] = kr.data[s:e][::-1].copy()
    cpu_res, gpu_res = _fit_both(gpu, mmat, arche, "uniform", n_iter=3, kmat_gpu=gpu.asarray(kr))
    np.testing.assert_array_equal(gpu.to_host(gpu_res.A).toarray(), cpu_res.A.toarray())
    np.testing.assert_array_equal(gpu.to_host(gpu_res.B).toarray(), cpu_res.B.toarray())
    np.testing.assert_allclose(gpu_res.rss, cpu_res.rss, rtol=1e-12)


# ---- kernels on crafted inputs ------------------------------------------------------------------------------------
def test_column_argmin_takes_the_first_of_tied_minima(gpu):
    from gpuc.metacells import _kernels_gpu as kern

    n, k = 70, 3
    g = np.random.default_rng(0).random((k, n))
    g[0, [5, 40, 66]] = -1.0  # tied minima in rows handled by different threads of the block
    g[1, [63, 17]] = -2.0
    g[2] = 0.0  # every row ties
    kmat = sp.random(n, n, density=0.1, random_state=1, format="csr")
    kg = gpu.asarray(kmat)
    k_args = (kg.indptr, kg.indices, kg.data)
    xp = gpu.xp
    cap = 4
    slots = (xp.zeros((cap, n), dtype=xp.int32), xp.zeros((cap, n)), xp.zeros(n, dtype=xp.int32))
    picks = xp.zeros((2, k), dtype=xp.int64)
    y, s = xp.asarray(g + 0.5), xp.full((k, n), 0.5)  # the gradient y - s is g, formed in the kernel
    gpu.launch(kern.fw_b_cols, k, kern.COL_THREADS, y, s, picks, 0, *slots, *k_args, True)
    np.testing.assert_array_equal(picks.get()[0], [5, 17, 0])
    # every cell c got (j, K[picks[0, j], c]) for the columns j whose pick has c in its row of K, in any order
    slot_m, slot_v, cnt = (a.get() for a in slots)
    want = kmat[[5, 17, 0]].toarray()  # row j: row picks[0, j] of K
    np.testing.assert_array_equal(cnt, (want != 0).sum(axis=0))
    for c in range(n):
        got = dict(zip(slot_m[: cnt[c], c].tolist(), slot_v[: cnt[c], c].tolist(), strict=True))
        assert got == {j: want[j, c] for j in range(k) if want[j, c] != 0}
    g2 = np.full((k, n), 1.0)
    g2[:, 9] = 0.5
    slots[2][...] = 0
    gpu.launch(kern.fw_b_cols, k, kern.COL_THREADS, xp.asarray(g2), xp.zeros((k, n)), picks, 1, *slots, *k_args, False)
    np.testing.assert_array_equal(picks.get()[1], [9, 9, 9])
    assert not slots[2].get().any()  # nothing handed on when no next step follows


@pytest.mark.slow
@pytest.mark.parametrize("n_slots", [0, 1])
def test_cells_with_more_neighbouring_picks_than_slots_pick_as_the_cpu(gpu, small, monkeypatch, n_slots):
    """With no slot (every cell that has neighbouring picks looks them up in K^T) or one (most such cells fit, the
    others look up), the B-steps sum the same terms in the same order: the CPU's iterates and RSS."""
    from gpuc.metacells import _kernels_gpu as kern

    mmat, _, arche = small
    monkeypatch.setattr(kern, "SLOTS", n_slots)
    _assert_same_fit(*_fit_both(gpu, mmat, arche, "uniform", fw_iters=6), gpu)


@pytest.mark.parametrize(("n_rows", "n_steps"), [(4, 9), (30, 9), (500, 12)])
def test_iterates_from_picks_equal_the_cpu_kernel(gpu, n_rows, n_steps):
    from gpuc.metacells import _kernels_cpu as cpu_kern
    from gpuc.metacells import _kernels_gpu as kern

    n_cols = 23
    rng = np.random.default_rng(n_rows)
    picks = rng.integers(0, min(n_rows, 6), (n_steps, n_cols)) * (n_rows // min(n_rows, 6))  # repeats, gaps
    picks[:, 0] = n_rows - 1  # one row only
    xp = gpu.xp
    idx, vals = xp.empty((n_steps, n_cols), dtype=xp.int64), xp.empty((n_steps, n_cols))
    cnt, dense = xp.zeros(n_cols, dtype=xp.int64), xp.zeros((n_cols, n_rows))
    gpu.launch(kern.fw_columns, kern.blocks_for(n_cols), kern.THREADS, xp.asarray(picks), idx, vals, cnt, dense, True)
    indptr, indices, data = cpu_kern.frank_wolfe_columns(picks, n_rows)
    want = sp.csc_matrix((data, indices, indptr), shape=(n_rows, n_cols))
    np.testing.assert_array_equal(dense.get(), want.toarray().T)
    np.testing.assert_array_equal(cnt.get(), np.diff(indptr))
    indptr_d = xp.asarray(indptr.astype(np.int32))
    out_ix, out_dx = xp.empty(indptr[-1], dtype=xp.int32), xp.empty(indptr[-1])
    gpu.launch(kern.compact_columns, kern.blocks_for(n_cols), kern.THREADS, idx, vals, indptr_d, out_ix, out_dx)
    np.testing.assert_array_equal(out_ix.get(), indices)
    np.testing.assert_array_equal(out_dx.get(), data)


# ---- launch budget ------------------------------------------------------------------------------------------------
def _per_iteration(gpu, mmat, arche, fw_iters):
    counts = {}
    for n_iter in (1, 2):
        with counting() as c:
            fit(gpu, gpu.asarray(mmat), arche, max_iter=n_iter, min_iter=n_iter, fw_iters=fw_iters)
        counts[n_iter] = c
    one, two = counts[1], counts[2]
    assert one.by_name["kernel.fw_a_cells"] == 2, one.top()
    return two.ops - one.ops, two.reads - one.reads, two.top()


@pytest.mark.slow
def test_launch_budget_per_outer_iteration(gpu, pcs):
    """Operations and synchronising reads of one outer iteration (two iterations minus one, so set-up cancels):
    at most 40 plus 3 per Frank-Wolfe step and at most 2 reads, the same at two sizes and growing only with the
    number of steps."""
    per = {}
    for n, k in ((60, 3), (90, 4)):
        mmat, _, arche = _problem(pcs, n, k)
        for fw_iters in (4, 7):
            per[n, k, fw_iters] = _per_iteration(gpu, mmat, arche, fw_iters)
    for (_, _, fw_iters), (ops, reads, top) in per.items():
        assert ops <= 40 + 3 * fw_iters, (ops, top)
        assert reads <= 2, (reads, top)
    for fw_iters in (4, 7):  # independent of n and k
        assert per[60, 3, fw_iters][:2] == per[90, 4, fw_iters][:2]
    assert per[60, 3, 7][0] - per[60, 3, 4][0] <= 3 * 3  # at most 3 per added step


def test_simulator_falls_back_to_the_array_code_for_large_fits(gpu, small, monkeypatch):
    mmat, _, arche = small
    monkeypatch.setattr(_solver, "SIMULATOR_MAX_WORK", 100)
    with counting() as c:
        fit(gpu, gpu.asarray(mmat), arche, max_iter=1, min_iter=1, fw_iters=4)
    assert not any(name.startswith("kernel.") for name in c.by_name), c.top()


# ---- compiled for a device ----------------------------------------------------------------------------------------
PTX_SCRIPT = """
import json
from numba import cuda, types as T
import gpuc.metacells._kernels_gpu as kg
f8_2, i8_2, f8_1, i8_1, i4_1 = T.float64[:, ::1], T.int64[:, ::1], T.float64[::1], T.int64[::1], T.int32[::1]
i4_2 = T.int32[:, ::1]
sigs = {
    "fw_a_cells": (f8_2, i4_1, i4_1, f8_1, i8_2, f8_2, i8_1, f8_1, T.int64, f8_2, f8_2, i8_2),
    "fw_b_rows": (i4_2, f8_2, i4_1, i4_1, i4_1, f8_1, i8_2, T.int64, f8_2, f8_2, T.float64, T.boolean),
    "fw_b_cols": (f8_2, f8_2, i8_2, T.int64, i4_2, f8_2, i4_1, i4_1, i4_1, f8_1, T.boolean),
    "fw_kb_r": (i4_1, i4_1, f8_1, f8_2, f8_2),
    "fw_s_rows": (i4_1, i4_1, f8_1, i8_2, f8_2, i8_1, f8_2),
    "fw_kba_values": (i4_1, i4_1, f8_1, i8_2, f8_2, i8_1, f8_2),
    "fw_columns": (i8_2, i8_2, f8_2, i8_1, f8_2, T.boolean),
    "compact_columns": (i8_2, f8_2, i4_1, i4_1, f8_1),
}
out = {}
for name, sig in sigs.items():
    ptx, _ = cuda.compile_ptx(getattr(kg, name).py_func, sig, cc=(9, 0))
    out[name] = ptx.count("fma.rn.f64")
print(json.dumps(out))
"""


def test_kernels_compile_for_a_device_without_fused_multiply_adds(compile_outside_simulator):
    """Outside the simulator the kernels compile to PTX (sm_90) with their products rounded on their own: no fused
    multiply-add, which would round ``a + b c`` once where the CPU rounds twice. Needs libNVVM and NVRTC (a CUDA
    toolkit or its wheels), not a GPU; skipped without them."""
    fmas = compile_outside_simulator(PTX_SCRIPT)
    assert set(fmas) == {
        "fw_a_cells",
        "fw_b_rows",
        "fw_b_cols",
        "fw_kb_r",
        "fw_s_rows",
        "fw_kba_values",
        "fw_columns",
        "compact_columns",
    }
    assert not any(fmas.values()), fmas


def test_kernel_views_are_made_once_per_fit_not_per_step(gpu, pcs):
    """Host-side work of the fused loop: the kernels' device views of the fit's arrays are made once (one kernel
    session per fit); an outer iteration adds views only for the arrays its new products bring (K B's three arrays,
    B^T K B, A A^T, the RSS terms, B's compacted arrays: at most 9), and a Frank-Wolfe step adds none. Python-level
    launches: two per B-step plus a fixed number per outer iteration."""
    mmat, _, arche = _problem(pcs, 60, 3)
    got = {}
    for n_iter, fw_iters in ((1, 4), (2, 4), (1, 7)):
        with launch_stats() as s:
            fit(gpu, gpu.asarray(mmat), arche, max_iter=n_iter, min_iter=n_iter, fw_iters=fw_iters)
        got[n_iter, fw_iters] = s
    per_iter = got[2, 4].views - got[1, 4].views
    assert per_iter <= 9, per_iter
    assert got[1, 7].views == got[1, 4].views  # no view per Frank-Wolfe step
    # launches: two per added B-step (a one-iteration fit makes one B-update)
    per_step = (got[1, 7].launches - got[1, 4].launches) / 3
    assert per_step == 2, per_step
    assert got[2, 4].launches - got[1, 4].launches <= 12 + 2 * 4, got[2, 4].launches - got[1, 4].launches
