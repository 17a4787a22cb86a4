"""Backend.kernel_session (issue 40, cheap launches): inside a session a kernel launch reuses each array's device view
instead of making a new one per launch (numba's as_cuda_array: tens of microseconds each); launch_stats counts
Python-level launches and views; the stand-in records each launch's grid and argument types."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from gpuc._backend import _SESSION, launch_stats
from gpuc._testing.standin import recording, simulator_status, standin_backend

pytestmark = pytest.mark.skipif(not simulator_status()[0], reason=simulator_status()[1])


@pytest.fixture(scope="module")
def bk():
    return standin_backend()


def test_outside_a_session_every_launch_makes_its_views(bk, make_axpy):
    axpy, x, y = make_axpy(), bk.xp.asarray(np.arange(4.0)), bk.xp.asarray(np.zeros(4))
    with launch_stats() as s:
        for _ in range(3):
            bk.launch(axpy, 1, 8, 1.0, x, y)
    assert (s.launches, s.views) == (3, 6)
    np.testing.assert_array_equal(y.get(), 3.0 * np.arange(4.0))


def test_a_session_makes_each_view_once_and_forgets_arrays_that_die(bk, make_axpy):
    axpy, x, y = make_axpy(), bk.xp.asarray(np.arange(4.0)), bk.xp.asarray(np.zeros(4))
    with bk.kernel_session() as session, launch_stats() as s:
        for _ in range(5):
            bk.launch(axpy, 1, 8, 2.0, x, y)
        assert (s.launches, s.views) == (5, 2)
        assert len(session.views) == 2
        tmp = bk.xp.asarray(np.ones(4))
        bk.launch(axpy, 1, 8, 1.0, tmp, y)
        assert len(session.views) == 3
        del tmp
        gc.collect()
        assert len(session.views) == 2  # the session does not keep a dead array's view (nor the array)
        with bk.kernel_session() as inner:  # nested: the same session
            assert inner is session
            bk.launch(axpy, 1, 8, 0.0, x, y)
    assert s.views == 3
    assert _SESSION.get() is None
    np.testing.assert_array_equal(y.get(), 10.0 * np.arange(4.0) + 1.0)


def test_a_new_array_at_a_dead_arrays_address_gets_its_own_view(bk, make_axpy):
    axpy, y = make_axpy(), bk.xp.asarray(np.zeros(3))
    with bk.kernel_session():
        for v in (1.0, 2.0, 3.0):  # each x is a new array (ids may repeat once the old one is gone)
            x = bk.xp.asarray(np.full(3, v))
            bk.launch(axpy, 1, 8, 1.0, x, y)
            del x
    np.testing.assert_array_equal(y.get(), np.full(3, 6.0))


def test_the_stand_in_records_grids_and_argument_types(bk, make_axpy):
    import numba

    axpy, x, y = make_axpy(), bk.xp.asarray(np.arange(4.0, dtype=np.float32)), bk.xp.asarray(np.zeros(4))
    with recording() as rec:
        bk.launch(axpy, 3, 8, 2, x, y)
    (r,) = rec
    assert (r.name, r.blocks, r.threads, r.n_threads) == ("axpy", 3, 8, 24)
    assert r.signature == (numba.int64, numba.float32[::1], numba.float64[::1])


def test_host_arrays_are_refused_in_a_session_too(bk, make_axpy):
    axpy, y = make_axpy(), bk.xp.asarray(np.zeros(3))
    with bk.kernel_session(), pytest.raises(TypeError, match="host array"):
        bk.launch(axpy, 1, 8, 1.0, np.ones(3), y)
