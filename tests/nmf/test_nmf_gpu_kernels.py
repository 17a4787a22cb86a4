"""The fused GPU kernels of the HALS engine (gpuc.nmf._kernels_gpu) on the stand-in GPU, run by numba-cuda's CUDA
simulator: same factors and losses as the CPU path, and a launch budget per iteration that does not grow with the
size of the data, the ranks or the number of restarts.

The simulator runs each CUDA thread as a Python thread, so the cases are tiny.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from gpuc._backend import get_backend, launch_stats
from gpuc._testing.standin import counting, simulator_status
from gpuc._utils import derive_seed
from gpuc.nmf import _kernels_gpu
from gpuc.nmf._hals import Operator, _fused_kernels, fit_hals, fit_hals_groups, nnls_refit

pytestmark = pytest.mark.skipif(not simulator_status()[0], reason=simulator_status()[1])

CPU = get_backend("cpu")
MAX_OPS_PER_ITER = 12
MAX_READS_PER_10_ITER = 1


def _matrix(m: int, n: int, *, sparse: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    v = rng.poisson(1.0, (m, n)).astype(np.float64)
    v[:, v.sum(0) == 0] += 1.0
    return sp.csr_matrix(v) if sparse else v


def _groups(ks, n_runs: int, seed: int = 3):
    return [(k, [derive_seed(seed, k, r) for r in range(n_runs)]) for k in ks]


def test_engine_picks_the_gpu_kernels_on_the_gpu(standin_gpu, disable_numba):
    op = Operator.build(standin_gpu, standin_gpu.asarray(_matrix(10, 8, sparse=True)), dtype=np.float64)
    assert _fused_kernels(standin_gpu, op, 4) is _kernels_gpu
    assert _fused_kernels(standin_gpu, op, _kernels_gpu.KMAX + 1) is None  # larger ranks: the array code
    assert _fused_kernels(CPU, Operator.build(CPU, _matrix(10, 8, sparse=True)), 4) is not _kernels_gpu
    disable_numba()
    assert _fused_kernels(standin_gpu, op, 4) is None


# the simulator runs every block of the reduction kernels (one per Gram entry) as Python threads: about 80 s a case on
# 2 cores, so README's quick run keeps one case (sparse, extrapolated) and CI's second step runs the other three
@pytest.mark.parametrize(
    ("sparse", "extrapolate"),
    [
        (True, True),
        pytest.param(False, True, marks=pytest.mark.slow),
        pytest.param(True, False, marks=pytest.mark.slow),
        pytest.param(False, False, marks=pytest.mark.slow),
    ],
)
def test_fused_gpu_path_equals_cpu_path(standin_gpu, sparse, extrapolate):
    # 60 x 40, ranks {2, 3, 4} x 3 restarts in one batch; 30 iterations cover the plain warm-up, extrapolated
    # iterations with restarts of the step, checks every 5 and runs stopping between two host reads
    v = _matrix(60, 40, sparse=sparse)
    groups = _groups((2, 3, 4), 3)
    kw = {"max_iter": 30, "tol": 1e-4, "extrapolate": extrapolate}
    cpu = fit_hals_groups(CPU, Operator.build(CPU, v, dtype=np.float64), groups, **kw)
    op = Operator.build(standin_gpu, standin_gpu.asarray(v), dtype=np.float64)
    with counting() as c:
        dev = fit_hals_groups(standin_gpu, op, groups, **kw)
    assert c.by_name["kernel.half_step"] > 0, c.top()  # the fused kernels ran
    # ... and the array sweep (k launches per rank group) only for the first usage update, before the iterations
    assert c.by_name["standin.einsum"] == sum(k for k, _ in groups), c.top()
    stopped_early = False
    for rc, rd in zip(cpu, dev, strict=True):
        np.testing.assert_array_equal(rd.n_iter, rc.n_iter)
        np.testing.assert_array_equal(rd.converged, rc.converged)
        stopped_early |= bool((rc.n_iter % 10 != 0).any())
        np.testing.assert_allclose(rd.losses, rc.losses, rtol=1e-10)
        scale_w, scale_h = np.abs(rc.usages).max(), np.abs(rc.spectra_t).max()
        np.testing.assert_allclose(rd.usages.get(), rc.usages, rtol=0, atol=1e-10 * scale_w)
        np.testing.assert_allclose(rd.spectra_t.get(), rc.spectra_t, rtol=0, atol=1e-10 * scale_h)
    # a run stopped at a check between two reads and was frozen on the device until the read
    assert stopped_early or not extrapolate


@pytest.mark.slow  # 35 s under the simulator on 2 cores
def test_fused_gpu_run_does_not_depend_on_its_batch(standin_gpu):
    v = _matrix(40, 30, sparse=True, seed=1)
    groups = _groups((2, 3), 2)
    op = Operator.build(standin_gpu, standin_gpu.asarray(v), dtype=np.float64)
    both = fit_hals_groups(standin_gpu, op, groups, max_iter=20)
    for (k, seeds), rb in zip(groups, both, strict=True):
        alone = fit_hals(standin_gpu, op, k, seeds, max_iter=20)
        np.testing.assert_array_equal(alone.losses, rb.losses)
        np.testing.assert_array_equal(alone.usages.get(), rb.usages.get())
        np.testing.assert_array_equal(alone.spectra_t.get(), rb.spectra_t.get())


def _count(standin_gpu, v, ks, n_runs: int, n_iter: int):
    op = Operator.build(standin_gpu, standin_gpu.asarray(v), dtype=np.float64)
    groups = _groups(ks, n_runs)
    with counting() as c, launch_stats() as launches:
        res = fit_hals_groups(standin_gpu, op, groups, max_iter=n_iter, tol=0.0)
    assert all((r.n_iter == n_iter).all() for r in res)  # tol=0: no run stops early
    c.launches, c.views = launches.launches, launches.views  # type: ignore[attr-defined]
    return c


@pytest.mark.parametrize(
    ("m", "n", "ks", "n_runs", "sparse"),
    [
        (24, 16, (2,), 2, True),
        pytest.param(50, 36, (2, 3, 4), 3, True, marks=pytest.mark.slow),
        (30, 20, (3,), 2, False),  # dense: one product per rank group (BLAS rounding may depend on the width)
        pytest.param(50, 36, (3,), 4, False, marks=pytest.mark.slow),
    ],
)
def test_launch_budget_per_iteration(standin_gpu, m, n, ks, n_runs, sparse):
    v = _matrix(m, n, sparse=sparse)
    short = _count(standin_gpu, v, ks, n_runs, 20)
    long = _count(standin_gpu, v, ks, n_runs, 40)
    ops = (long.ops - short.ops) / 20  # set-up and the final write-out cancel
    reads = (long.reads - short.reads) / 20
    detail = long.top()
    assert ops <= MAX_OPS_PER_ITER, f"{ops} device operations per iteration: {detail}"
    assert reads * 10 <= MAX_READS_PER_10_ITER, f"{reads} reads per iteration: {detail}"
    # the whole iteration: two products, two sweeps, two Gram reductions, the step, the restore of risen runs
    assert long.by_name["kernel.half_step"] - short.by_name["kernel.half_step"] == 2 * 20
    assert long.by_name["kernel.step"] - short.by_name["kernel.step"] == 20
    # host side: Python-level launches per iteration (5 on the warm-up's plain iterations, 6 after), and no new
    # kernel views after set-up (the products go into per-batch buffers; one kernel session per fit)
    assert 5 * 20 <= long.launches - short.launches <= 6 * 20, (long.launches, short.launches)
    assert long.views == short.views, (long.views, short.views)
    assert short.views <= 40, short.views  # set-up: a view per distinct array of the batch, made once


@pytest.mark.gpu
def test_fused_gpu_run_does_not_depend_on_its_batch_on_a_real_gpu():
    # on a real GPU (skipped without one): the question of issue 29 defect (3), whether a rank fitted with others
    # (one cuSPARSE product over all their columns) gives bit-for-bit the fit of that rank alone, in float32
    gpu = get_backend("gpu")
    v = _matrix(400, 300, sparse=True, seed=2).astype(np.float32)
    op = Operator.build(gpu, v)
    groups = _groups((3, 4, 5, 6, 7), 6)
    both = fit_hals_groups(gpu, op, groups)
    for (k, seeds), rb in zip(groups, both, strict=True):
        alone = fit_hals(gpu, op, k, seeds)
        np.testing.assert_array_equal(alone.losses, rb.losses)
        np.testing.assert_array_equal(gpu.to_host(alone.usages), gpu.to_host(rb.usages))


def test_nnls_refit_sweeps_with_one_launch_each(standin_gpu):
    rng = np.random.default_rng(4)
    v = _matrix(50, 30, sparse=True)
    h = rng.random((4, 30))
    w_cpu, loss_cpu = nnls_refit(
        CPU, Operator.build(CPU, v, dtype=np.float64), h, warm_start=False, max_iter=40, tol=0.0
    )
    op = Operator.build(standin_gpu, standin_gpu.asarray(v), dtype=np.float64)
    with counting() as c:
        w_dev, loss_dev = nnls_refit(standin_gpu, op, standin_gpu.asarray(h), warm_start=False, max_iter=40, tol=0.0)
    assert c.by_name["kernel.half_step"] == 40, c.top()
    assert c.ops < 40 + 60, c.top()  # set-up and 4 loss checks, not k array operations per sweep
    np.testing.assert_allclose(loss_dev, loss_cpu, rtol=1e-12)
    np.testing.assert_allclose(w_dev.get(), w_cpu, rtol=0, atol=1e-12 * np.abs(w_cpu).max())


@pytest.mark.gpu
@pytest.mark.parametrize("sparse", [True, False])
def test_fused_gpu_path_equals_cpu_path_on_a_real_gpu(sparse):
    # on a real GPU (skipped without one): the compiled kernels, with CuPy's products, against the CPU path
    gpu = get_backend("gpu")
    v = _matrix(300, 200, sparse=sparse, seed=5)
    groups = _groups((2, 3, 4, 7), 5)
    cpu = fit_hals_groups(CPU, Operator.build(CPU, v, dtype=np.float64), groups)
    dev = fit_hals_groups(gpu, Operator.build(gpu, v, dtype=np.float64), groups)
    for rc, rd in zip(cpu, dev, strict=True):
        np.testing.assert_array_equal(rd.n_iter, rc.n_iter)
        np.testing.assert_allclose(rd.losses, rc.losses, rtol=1e-9)
        np.testing.assert_allclose(gpu.to_host(rd.spectra_t), rc.spectra_t, rtol=1e-5, atol=1e-7)


# ---- compiled for a device ----------------------------------------------------------------------------------------
PTX_SCRIPT = """
import json, re
from numba import cuda, types as T
import gpuc.nmf._kernels_gpu as kg
f8, i8 = T.float64, T.int64
out = {}
for dt in (T.float32, T.float64):
    x2, x3 = dt[:, ::1], dt[:, :, ::1]  # the products are copied into C-ordered per-batch buffers
    d2, d3, d4, iv = f8[:, ::1], f8[:, :, ::1], f8[:, :, :, ::1], i8[::1]
    sigs = {
        "half_step": (x2, x3, x2, x2, dt[::1], i8, i8, f8, iv, iv, d2, i8, i8, d4, d4, d2),
        "gram_finish": (d4, d4, iv, d2, i8, d3, x3, d3, d3, d3),
        "step": (d2, d3, iv, i8, f8, i8, i8, i8, i8, f8, dt[::1], dt[::1], dt[::1], f8[::1], d2, d2, T.int32[::1],
                 d3, d3, d3, x3),
        "restore": (x2, x2, x2, x2, iv, iv, T.int32[::1], i8, i8),
    }
    for name, sig in sigs.items():
        ptx, _ = cuda.compile_ptx(getattr(kg, name).py_func, sig, cc=(9, 0))
        depot = re.findall(r"__local_depot\\d+\\[(\\d+)\\]", ptx)
        out[f"{name}-{dt}"] = int(depot[0]) if depot else 0
print(json.dumps(out))
"""


def test_kernels_compile_for_a_device(compile_outside_simulator):
    """Outside the simulator the four kernels compile to PTX (sm_90) for both precisions, with at most the row array
    as thread-local memory. Needs libNVVM and NVRTC (a CUDA toolkit or its wheels), not a GPU; skipped without them.
    """
    local = compile_outside_simulator(PTX_SCRIPT)
    assert len(local) == 8
    assert max(local.values()) <= 8 * _kernels_gpu.KMAX, local
