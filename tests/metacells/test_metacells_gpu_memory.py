"""Device memory of the metacell fit's GPU path, measured on the stand-in device (its arrays counted while alive, as
CuPy's pool counts used bytes) against :func:`gpuc.metacells.metacells_peak_bytes`. The fused kernels run under
numba-cuda's CUDA simulator, so the fits are small (200 cells, 8-24 metacells, 3 Frank-Wolfe steps)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from gpuc._backend import get_backend
from gpuc._testing.standin import counting, device_memory, simulator_status, standin_backend
from gpuc.metacells import _solver, build_kernel, compute_knn, fit, initial_archetypes
from gpuc.metacells._pipeline import metacells_peak_bytes

pytestmark = pytest.mark.skipif(not simulator_status()[0], reason=simulator_status()[1])

CPU = get_backend("cpu")
N, T, NN = 200, 3, 15


@pytest.fixture(scope="module")
def problem(_pbmc68k):
    x = np.ascontiguousarray(np.asarray(_pbmc68k.obsm["X_pca"])[:N], dtype=np.float64)
    knn = compute_knn(CPU, x, NN)
    mmat, _ = build_kernel(CPU, x, n_neighbors=NN, knn=knn)
    kmat = sp.csr_matrix(mmat @ mmat.T)
    return mmat, kmat, knn


def _fit_peak(problem, k, monkeypatch):
    """Peak device bytes of one fused fit (M, K and a dense random A0 uploaded inside the measurement)."""
    mmat, kmat, knn = problem
    arche = np.asarray(initial_archetypes(CPU, kmat, knn, k, np.random.RandomState(0), n_components=5))
    a0 = np.random.RandomState(1).random((k, N))
    a0 /= a0.sum(0)
    gpu = standin_backend()
    monkeypatch.setattr(_solver, "SIMULATOR_MAX_WORK", N * k * T)
    with device_memory() as mem, counting() as c:
        m_dev = gpu.asarray(mmat)
        fit(gpu, m_dev, arche, k=k, a0=gpu.asarray(a0), kmat=gpu.asarray(kmat), max_iter=1, min_iter=1, fw_iters=T)
    assert c.by_name["kernel.fw_a_cells"] == 2, c.top()  # the fused kernels ran
    return mem.peak


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::gpuc.metacells.MetacellConvergenceWarning")
def test_fit_peak_matches_the_estimate(problem, monkeypatch):
    """The estimate bounds the measured peak from above within a factor 2 (it counts the kernel's square at
    12 n_neighbors entries per cell, more than these 200 cells have). Each added cell x metacell costs about 42 bytes
    here: the two (k, n) float64 work arrays and A0 (24 bytes) plus ``K B``, nearly dense at 200 cells (K's rows
    reach half of them); the fit before held seven such arrays and A0 and measured 67 bytes."""
    peaks = {k: _fit_peak(problem, k, monkeypatch) for k in (8, 48)}
    est = {k: metacells_peak_bytes(N, k, n_neighbors=NN, fw_iters=T, gpu=True) for k in peaks}
    for k in peaks:
        assert peaks[k] <= est[k] <= 2.0 * peaks[k], (k, peaks[k], est[k])
    per_entry = (peaks[48] - peaks[8]) / (N * 40)
    assert 24.0 <= per_entry < 48.0, per_entry


def test_the_estimate_at_200k_cells_fits_12_gb():
    assert metacells_peak_bytes(200_000, 2_667, gpu=True) <= 12e9
