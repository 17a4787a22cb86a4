"""The stand-in device counts device operations and synchronising reads, and launches custom kernels under numba-cuda's
CUDA simulator: the basis of the per-iteration launch budgets of the GPU engines."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from gpuc._testing.standin import counting, simulator_status, standin_backend


@pytest.fixture
def bk():
    return standin_backend()


def test_counts_operations_views_and_reads(bk):
    xp = bk.xp
    a = xp.asarray(np.arange(12.0).reshape(3, 4))
    with counting() as c:
        b = a * 2.0  # ufunc
        _ = b.reshape(4, 3).T  # views
        _ = b[1:, ::2]  # basic slice: a view
        idx = xp.asarray(np.array([0, 2]))
        _ = b[idx]  # advanced indexing: a gather kernel
        b[0, 0] = 1.0  # a write
        s = xp.sum(b)  # reduction: 0-d device array, no read yet
        _ = xp.empty((5,))  # allocation only
    assert c.ops == 5, c.top()  # multiply, asarray(idx), b[idx], setitem, sum
    assert c.reads == 0
    with counting() as c:
        float(s)
        _ = b.get()
        _ = bool(s > 0)
    assert c.reads == 3
    assert c.ops == 1  # the comparison
    assert c.by_name["read:float"] == 1


def test_counts_sparse_products(bk):
    m = bk.asarray(sp.random(20, 10, density=0.3, format="csr", random_state=0))
    x = bk.xp.asarray(np.ones((10, 3)))
    with counting() as c:
        _ = m @ x
        _ = m.T @ bk.xp.ones((20, 2))
        _ = m.data  # a device view of the same memory
    assert c.ops == 3, c.top()


def test_nested_counting_adds_to_the_outer_block(bk):
    a = bk.xp.asarray(np.ones(3))
    with counting() as outer:
        _ = a + 1
        with counting() as inner:
            _ = a + 2
        _ = a + 3
    assert inner.ops == 1
    assert outer.ops == 3


@pytest.mark.skipif(not simulator_status()[0], reason=simulator_status()[1])
def test_launch_runs_a_numba_cuda_kernel_in_place_and_counts_it(bk, make_axpy):
    axpy = make_axpy()
    x = bk.xp.asarray(np.arange(5.0))
    y = bk.xp.asarray(np.ones(5))
    with counting() as c:
        bk.launch(axpy, 1, 32, 2.0, x, y)
    assert c.ops == 1 and c.by_name["kernel.axpy"] == 1
    np.testing.assert_array_equal(y.get(), 1.0 + 2.0 * np.arange(5.0))
    with pytest.raises(TypeError, match="host array"):
        bk.launch(axpy, 1, 32, 2.0, np.arange(5.0), y)


def test_cpu_backend_refuses_custom_kernel_launches():
    from gpuc._backend import get_backend

    with pytest.raises(RuntimeError, match="GPU kernels"):
        get_backend("cpu").launch(lambda: None, 1, 1)
