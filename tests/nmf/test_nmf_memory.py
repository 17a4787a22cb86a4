"""The NMF memory check's estimates against measured peaks (``tracemalloc``, CPU path, small sizes).

:func:`gpuc.nmf._plan.check_fit_memory` refuses a call whose estimated peak (the largest batch of restarts plus
the largest consensus) exceeds the free memory. An estimate below the measured peak lets a call start that then
runs out of memory; one far above refuses calls that would fit. Stated factor: each estimate lies between the
measured peak and 3 times it.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import scipy.sparse as sp

from gpuc._backend import get_backend
from gpuc.nmf._consensus import ConsensusOptions, consensus, run_ks, sweep_batches, sweep_rows
from gpuc.nmf._hals import HalsOptions, Operator
from gpuc.nmf._plan import fit_memory_bytes

CPU = get_backend("cpu")
FACTOR = 3.0  # an estimate may exceed the measured peak by at most this factor


def _peak(fn):
    """``fn()``'s value and the peak of memory traced while it ran, above what was allocated before."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        out = fn()
        return out, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    # the numba kernels compile (and allocate) on their first call, scikit-learn fills its caches on its first
    # k-means and silhouette: not part of a call's peak
    op = Operator.build(CPU, sp.random(50, 40, density=0.3, format="csr", dtype=np.float32, random_state=0))
    fits = run_ks(CPU, op, [2, 3], 3, 0, max_iter=10, n_jobs=1)
    sweep_rows(CPU, op, [2, 3], fits, ConsensusOptions(density_threshold=2.0), n_jobs=1)


@pytest.mark.parametrize(
    ("m", "n", "ks", "n_runs", "sparse", "target"),
    [
        (400, 300, [3, 4, 5], 8, True, "spectra"),  # a k sweep, fused CPU kernels
        (400, 300, [3, 4, 5], 8, False, "spectra"),  # a k sweep, the array code
        (1000, 100, [5], 30, False, "usage"),  # one rank, clustered in cell space
        (200, 2000, [4], 40, True, "spectra"),  # one rank, many genes
    ],
)
def test_memory_estimates_bound_the_measured_peaks(m, n, ks, n_runs, sparse, target):
    v = np.random.default_rng(0).poisson(1.0, (m, n)).astype(np.float32)
    op = Operator.build(CPU, sp.csr_matrix(v) if sparse else v)
    fit_est, pool_est = fit_memory_bytes(op, sweep_batches(ks, n_runs, op.shape, 4), n_runs, target)
    fits, fit_peak = _peak(lambda: run_ks(CPU, op, ks, n_runs, 0, HalsOptions(max_iter=60), n_jobs=1))
    rule = ConsensusOptions(target=target, density_threshold=2.0)
    if len(ks) > 1:
        _, pool_peak = _peak(lambda: sweep_rows(CPU, op, ks, fits, rule, n_jobs=1))
    else:
        _, pool_peak = _peak(lambda: consensus(CPU, op, fits[0], ks[0], **rule.kwargs(), n_jobs=1))
    assert fit_peak <= fit_est <= FACTOR * fit_peak, (fit_peak, fit_est)
    assert pool_peak <= pool_est <= FACTOR * pool_peak, (pool_peak, pool_est)
