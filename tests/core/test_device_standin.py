"""The stand-in GPU itself (gpuc._testing.standin): it must refuse what CuPy refuses, or the device tests prove
nothing; and the backend's device helpers (kNN, transfers) on it."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.neighbors import NearestNeighbors

from gpuc._backend import backend_of, get_backend, is_cupy_array, is_sparse, knn_blocked, to_host
from gpuc._testing.standin import DeviceArray, DeviceSparse, HostArrayError, Transfers


@pytest.fixture
def dev(standin_gpu):
    return standin_gpu.asarray(np.arange(12.0).reshape(3, 4))


def test_implicit_host_conversion_fails(dev):
    for convert in (np.asarray, np.ascontiguousarray, lambda x: np.array(x, dtype=float), lambda x: float(x)):
        with pytest.raises(TypeError):
            convert(dev)
    with pytest.raises(TypeError):
        range(dev[0, 0])  # no __index__, as CuPy
    assert isinstance(to_host(dev), np.ndarray) and float(dev[1, 2]) == 6.0  # explicit reads are fine


def test_host_arrays_in_device_work_fail(standin_gpu, dev):
    xp = standin_gpu.xp
    host = np.ones((3, 4))
    for op in (lambda: dev + host, lambda: host * dev, lambda: xp.exp(host), lambda: xp.concatenate([dev, host])):
        with pytest.raises(HostArrayError):
            op()
    with pytest.raises(HostArrayError):
        dev[0] = np.ones(4)
    s = standin_gpu.asarray(sp.random(3, 4, density=0.5, format="csr", random_state=0))
    with pytest.raises(HostArrayError):
        s @ np.ones(4)
    with pytest.raises(TypeError):
        np.asarray(s)
    with pytest.raises((TypeError, ValueError)):  # scipy turns the refusal into "unrecognized ... input"
        sp.csr_matrix(s)


def test_only_cupy_names_and_numpy_dispatch(standin_gpu, dev):
    xp = standin_gpu.xp
    for missing in ("errstate", "nanquantile_xyz", "ma"):
        with pytest.raises(AttributeError):
            getattr(xp, missing)
    with pytest.raises(AttributeError):
        dev.tofile_xyz  # noqa: B018
    out = np.sum(dev, axis=0)  # numpy functions dispatch to the device (CuPy's __array_function__)
    assert isinstance(out, DeviceArray)
    with pytest.raises(TypeError):  # ... only those CuPy has
        np.lib.stride_tricks.sliding_window_view(dev, 2)
    r = dev.sum()
    assert isinstance(r, DeviceArray) and r.ndim == 0  # reductions stay on the device as 0-d arrays
    assert isinstance(xp.linalg.inv(xp.eye(3)), DeviceArray)


def test_type_checks_and_transfers(standin_gpu, dev):
    s = standin_gpu.asarray(sp.random(30, 20, density=0.2, format="csr", random_state=0))
    assert isinstance(s, DeviceSparse) and is_sparse(s) and is_cupy_array(s) and not sp.issparse(s)
    assert is_cupy_array(dev) and not is_sparse(dev) and backend_of(dev) is standin_gpu
    Transfers.reset()
    back = to_host(s)
    assert sp.issparse(back) and Transfers.to_host == back.data.nbytes + back.indices.nbytes + back.indptr.nbytes
    assert get_backend("auto", dev) is standin_gpu  # device-resident data selects the GPU


@pytest.mark.parametrize(("n", "k", "block"), [(400, 10, 64), (257, 30, 1000), (50, 50, 7), (40, 1, 16)])
def test_blocked_knn_matches_sklearn(standin_gpu, n, k, block):
    x = np.random.default_rng(n).normal(size=(n, 6))
    ref_d, ref_i = NearestNeighbors(n_neighbors=k, algorithm="brute").fit(x).kneighbors(x)
    for xp, data in ((np, x), (standin_gpu.xp, standin_gpu.asarray(x))):
        d, i = knn_blocked(xp, data, k, block_size=block)
        np.testing.assert_array_equal(to_host(i), ref_i)
        # scikit-learn >= 1.9 leaves a point's distance to itself at up to ~1e-7 (sqrt of float64 rounding, not
        # clipped); the blocked kNN gives the exact 0
        np.testing.assert_allclose(to_host(d), ref_d, atol=2e-7)
        assert (to_host(d)[:, 0] == 0).all()


def test_backend_knn_on_device_without_faiss_gpu(standin_gpu):
    x = np.random.default_rng(3).normal(size=(300, 5)).astype(np.float32)
    Transfers.reset()
    d, i = standin_gpu.knn(standin_gpu.asarray(x), 15, method="exact")
    assert isinstance(i, DeviceArray) and Transfers.to_host == 0
    cd, ci = get_backend("cpu").knn(x, 15, method="exact")
    assert (to_host(i) == ci).mean() > 0.99  # float32 rounding may swap near-ties
    np.testing.assert_allclose(to_host(d), cd, rtol=1e-4, atol=1e-4)
    with pytest.raises(ImportError, match="FAISS build with GPU support"):
        standin_gpu.knn(standin_gpu.asarray(x), 15, method="ivf")


def test_blocked_knn_ties_go_to_the_lower_index(standin_gpu):
    # integer points: many exactly equal distances; the result must be a stable full sort cut at k
    x = np.random.default_rng(0).integers(0, 3, size=(300, 3)).astype(np.float64)
    q = np.random.default_rng(1).integers(0, 3, size=(40, 3)).astype(np.float64)
    d2 = ((q[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    want = np.argsort(d2, axis=1, kind="stable")[:, :12]
    d, i = knn_blocked(standin_gpu.xp, standin_gpu.asarray(x), 12, queries=standin_gpu.asarray(q), block_size=16)
    np.testing.assert_array_equal(to_host(i), want)
    np.testing.assert_array_equal(to_host(d), np.sqrt(np.take_along_axis(d2, want, axis=1)))


def test_device_memory_counts_live_buffers_once_and_keeps_the_peak():
    from gpuc._testing.standin import device_memory, standin_backend

    xp = standin_backend().xp
    with device_memory() as mem:
        a = xp.zeros((100, 10))  # 8,000 bytes
        view = a[:50].T  # a view: no new buffer
        b = a + 1.0  # 8,000 more
        del b  # freed: back to 8,000
        s = standin_backend().sparse.csr_matrix(xp.ones((4, 4)))  # data, indices, indptr of 16 entries
        del view
    assert mem.peak == 16_000
    assert mem.at_exit == 8_000 + 16 * 8 + s.indices.nbytes + s.indptr.nbytes  # a and s (its dense source is freed)
    del a
