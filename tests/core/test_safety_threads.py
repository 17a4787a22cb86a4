"""Concurrent calls give the sequential results and leave no thread limit behind (issue 41)."""

from __future__ import annotations

import threading
import warnings

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp

import gpuc
from gpuc._utils import cpu_threads, serial_blas, threadpool_controller
from gpuc.nmf._consensus import _one_openmp_thread


def _limits():
    controller = threadpool_controller()
    return sorted((i["internal_api"], i["filepath"], i["num_threads"]) for i in controller.info())


def _data(seed):
    rng = np.random.default_rng(seed)
    a = ad.AnnData(sp.csr_matrix(rng.poisson(3, (120, 40)).astype(np.float32)))
    a.var["highly_variable"] = True
    return a


@pytest.mark.parametrize(
    "interleaving",
    [
        ("cpu_threads", "openmp", "cpu_threads", "openmp"),  # holder A enters, B enters, A leaves first, then B
        ("openmp", "cpu_threads", "openmp", "cpu_threads"),
        ("serial_blas", "cpu_threads", "serial_blas", "cpu_threads"),
    ],
)
def test_limits_released_out_of_order_restore_the_original(interleaving):
    """Two calls in two threads take and give back their limits in any order: the process ends as it began (a limit
    saved and restored by one call would restore the other call's limit instead)."""
    np.ones((8, 8)) @ np.ones((8, 8))  # BLAS loaded
    before = _limits()
    make = {
        "cpu_threads": lambda: cpu_threads(1),
        "openmp": _one_openmp_thread,  # consensus k-means' limit
        "serial_blas": lambda: serial_blas(force=True),
    }
    first, second = make[interleaving[0]](), make[interleaving[1]]()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    second.__exit__(None, None, None)
    assert _limits() == before


def test_two_threads_give_the_sequential_consensus_and_leave_no_limit():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = []
        for seed in (0, 1):
            a = _data(seed)
            gpuc.tl.consensus_nmf(a, 3, n_runs=4, max_iter=60)
            ref.append(a.obsm["X_nmf"])
        before = _limits()  # after a call: every library it loads is there
        out: list = [None, None]
        errors: list = []

        def run(i):
            try:
                a = _data(i)
                gpuc.tl.consensus_nmf(a, 3, n_runs=4, max_iter=60)
                out[i] = a.obsm["X_nmf"]
            except Exception as err:  # reported below, in the test's thread
                errors.append(err)

        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    for i in (0, 1):
        np.testing.assert_array_equal(out[i], ref[i])
    assert _limits() == before
