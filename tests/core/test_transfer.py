from __future__ import annotations

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp

import gpuc
from gpuc import _backend


def _adata() -> ad.AnnData:
    a = ad.AnnData(sp.random(20, 10, density=0.3, format="csr", random_state=0, dtype=np.float32))
    a.layers["counts"] = a.X.copy()
    a.obsm["X_pca"] = np.random.default_rng(0).normal(size=(20, 3))
    return a


def test_to_gpu_without_device_raises_and_leaves_adata(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_backend, "gpu_status", lambda: (False, "cupy is not installed"))
    a = _adata()
    before = a.X.copy()
    with pytest.raises(RuntimeError, match="gpuc\\[gpu-cu12\\]"):
        gpuc.get.to_gpu(a)
    assert (a.X != before).nnz == 0 and sp.issparse(a.X)


def test_to_cpu_on_host_data_is_a_no_op() -> None:
    a = _adata()
    b = gpuc.get.to_cpu(a, copy=True)
    assert b is not a and (b.X != a.X).nnz == 0
    assert gpuc.get.to_cpu(a) is None


def test_wrong_type_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="Expected an AnnData"):
        gpuc.get.to_cpu(np.zeros((2, 2)))  # type: ignore[arg-type]


def test_rsc_parameters_on_the_standin(standin_gpu) -> None:
    from gpuc._testing.standin import ANNDATA_ACCEPTS

    if not ANNDATA_ACCEPTS:
        pytest.skip("CuPy is installed: AnnData accepts only real CuPy arrays")
    a = _adata()
    g = gpuc.get.to_gpu(a, copy=True)  # rsc's default: X only
    assert _backend.is_cupy_array(g.X) and _backend.is_sparse(g.X)
    assert sp.issparse(g.layers["counts"]) and isinstance(g.obsm["X_pca"], np.ndarray)
    gpuc.get.to_gpu(g, "counts")
    assert _backend.is_cupy_array(g.layers["counts"])
    h = gpuc.get.to_gpu(a, convert_all=True, copy=True)
    assert _backend.is_cupy_array(h.X) and _backend.is_cupy_array(h.layers["counts"])
    gpuc.get.to_cpu(g)  # X only
    assert sp.issparse(g.X) and _backend.is_cupy_array(g.layers["counts"])
    g.obsm["X_dev"] = standin_gpu.asarray(a.obsm["X_pca"])
    gpuc.get.to_cpu(g, convert_all=True)  # everything, obsm included, so that write_h5ad works
    assert (g.X != a.X).nnz == 0 and (g.layers["counts"] != a.layers["counts"]).nnz == 0
    np.testing.assert_array_equal(g.obsm["X_dev"], a.obsm["X_pca"])
    with pytest.raises(KeyError):
        gpuc.get.to_gpu(a, "missing")


@pytest.mark.gpu
def test_round_trip_through_gpu() -> None:
    a = _adata()
    g = gpuc.get.to_gpu(a, convert_all=True, copy=True)
    assert _backend.is_cupy_array(g.X) and _backend.is_cupy_array(g.layers["counts"])
    gpuc.get.to_cpu(g, convert_all=True)
    assert (g.X != a.X).nnz == 0 and (g.layers["counts"] != a.layers["counts"]).nnz == 0
