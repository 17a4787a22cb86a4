from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.neighbors import NearestNeighbors

import gpuc
from gpuc import _backend
from gpuc._backend import get_backend, knn_blocked, resolve_device


@pytest.fixture
def points() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(400, 8))


def _sklearn_knn(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    return NearestNeighbors(n_neighbors=k, algorithm="brute").fit(x).kneighbors(x)


# ---- device resolution ------------------------------------------------------------------------------------------
def test_resolve_cpu_and_auto_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_backend, "gpu_status", lambda: (False, "no cupy"))
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == "cpu"
    assert get_backend("auto").xp is np


def test_forced_gpu_without_device_raises_with_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_backend, "gpu_status", lambda: (False, "cupy is not installed"))
    with pytest.raises(RuntimeError, match=r"gpuc\[gpu-cu12\].*gpu-cu13.*device='cpu'"):
        resolve_device("gpu")


def test_invalid_device_value() -> None:
    with pytest.raises(ValueError, match="device='tpu' is not valid"):
        resolve_device("tpu")  # type: ignore[arg-type]


def test_settings_device_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_backend, "gpu_status", lambda: (False, "none"))
    monkeypatch.setattr(gpuc.settings, "_device", "gpu")
    with pytest.raises(RuntimeError):
        resolve_device(None)
    with pytest.raises(ValueError, match="must be one of"):
        gpuc.settings.device = "cuda"


def test_auto_is_gpu_when_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_backend, "gpu_status", lambda: (True, "1 CUDA device(s)"))
    assert resolve_device("auto") == "gpu"
    assert resolve_device("cpu") == "cpu"


def test_optional_import_names_the_extra() -> None:
    with pytest.raises(ImportError, match=r"pip install 'gpuc\[gpu-cu12\]' \(or 'gpuc\[gpu-cu13\]'"):
        _backend.optional_import("surely_not_a_module_xyz", "gpu", "testing")
    with pytest.raises(ImportError, match=r"for testing .* pip install 'gpuc\[dask\]'"):
        _backend.optional_import("surely_not_a_module_xyz", "dask", "testing")


# ---- kNN ----------------------------------------------------------------------------------------------------------
def test_knn_exact_matches_sklearn(points: np.ndarray) -> None:
    backend = get_backend("cpu")
    dist, idx = backend.knn(points, 10, method="exact")
    ref_d, ref_i = _sklearn_knn(points, 10)
    np.testing.assert_array_equal(idx, ref_i)
    np.testing.assert_allclose(dist, ref_d, atol=1e-4)


def test_knn_blocked_matches_sklearn_in_float64(points: np.ndarray) -> None:
    dist, idx = knn_blocked(np, points, 12, block_size=64)
    ref_d, ref_i = _sklearn_knn(points, 12)
    np.testing.assert_array_equal(idx, ref_i)
    # scikit-learn >= 1.9 takes sqrt(||a||^2 - 2 a.b + ||b||^2) without clipping tiny residues, so a point's distance
    # to itself comes back as up to ~1e-7 (sqrt of float64 rounding) instead of 0; knn_blocked gives the exact 0
    np.testing.assert_allclose(dist, ref_d, atol=2e-7)
    assert (dist[:, 0] == 0).all()


def test_knn_ivf_recall(points: np.ndarray) -> None:
    x = np.random.default_rng(1).normal(size=(3000, 8))
    _, idx = get_backend("cpu").knn(x, 10, method="ivf", n_lists=16, n_probe=16)  # probing every list is exact
    _, ref_i = _sklearn_knn(x, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(idx, ref_i, strict=True)])
    assert recall >= 0.999


def test_knn_bad_k(points: np.ndarray) -> None:
    with pytest.raises(ValueError, match="between 1 and the number of points"):
        get_backend("cpu").knn(points, 0)


# ---- transfers and small solves ------------------------------------------------------------------------------------
def test_cpu_asarray_round_trip() -> None:
    backend = get_backend("cpu")
    x = sp.random(20, 10, density=0.3, format="csr", random_state=0)
    assert backend.asarray(x) is x
    np.testing.assert_array_equal(
        backend.to_host(backend.asarray(x.toarray(), dtype=np.float32)), x.toarray().astype(np.float32)
    )


def test_batched_solves() -> None:
    rng = np.random.default_rng(0)
    m = rng.normal(size=(50, 4, 4))
    a = m @ np.swapaxes(m, 1, 2) + 4 * np.eye(4)
    b = rng.normal(size=(50, 4))
    backend = get_backend("cpu")
    expected = np.stack([np.linalg.solve(a[i], b[i]) for i in range(50)])
    np.testing.assert_allclose(backend.solve_batched(a, b), expected, rtol=1e-10)


# ---- the same functions on the GPU ---------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_knn_and_transfers_match_cpu(points: np.ndarray) -> None:
    gpu = get_backend("gpu")
    xg = gpu.asarray(points)
    dist, idx = gpu.knn(xg, 10, method="exact")
    ref_d, ref_i = _sklearn_knn(points, 10)
    np.testing.assert_array_equal(gpu.to_host(idx), ref_i)
    np.testing.assert_allclose(gpu.to_host(dist), ref_d, atol=1e-4)
    x = sp.random(30, 10, density=0.2, format="csr", random_state=0)
    back = gpu.to_host(gpu.asarray(x))
    assert (back != x).nnz == 0


def test_auto_keeps_small_host_problems_on_the_cpu_and_large_ones_on_the_gpu(monkeypatch):
    from gpuc import _backend

    monkeypatch.setattr(_backend, "gpu_status", lambda: (True, "pretend"))
    small = _backend.AUTO_GPU_MIN_WORK["deseq"] / 2
    assert _backend.resolve_device("auto", tool="deseq", work=small) == "cpu"
    assert _backend.resolve_device("auto", tool="deseq", work=2 * small) == "gpu"
    assert _backend.resolve_device("auto") == "gpu"  # no size given: the device decides
    assert _backend.resolve_device("gpu", tool="deseq", work=1) == "gpu"  # an explicit choice is kept
    for tool in ("metacells", "nmf"):
        assert _backend.resolve_device("auto", tool=tool, work=1) == "cpu"


def test_auto_keeps_device_resident_data_on_the_gpu_whatever_its_size():
    from gpuc._backend import resolve_device
    from gpuc._testing.standin import to_device, use_standin

    with use_standin():
        x = to_device(np.ones((3, 3)))
        assert resolve_device("auto", x, tool="deseq", work=9) == "gpu"
