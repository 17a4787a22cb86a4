"""The GPU code path of the metacell tools on the stand-in GPU (device-resident obsm / X, as rapids-singlecell leaves
them) equals the CPU path; nothing but the final results comes to the host (see gpuc._testing.standin)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import gpuc
from gpuc._backend import is_cupy_array
from gpuc._testing.standin import Transfers


def test_metacells_device_resident_equals_reference(on_device, pbmc68k, mc_ref):
    d = on_device(pbmc68k)
    assert is_cupy_array(d.obsm["X_pca"]) and is_cupy_array(d.X)
    Transfers.reset()
    gpuc.tl.metacells(d, convergence_epsilon=1e-5, max_iter=50, min_iter=10, random_state=0)  # auto: data on the GPU
    assert d.uns["metacell"]["device"] == "gpu"
    np.testing.assert_array_equal(d.obs["metacell"].astype(str).to_numpy(), mc_ref["labels"])
    np.testing.assert_allclose(d.uns["metacell"]["rss"], mc_ref["rss"], rtol=1e-6)  # float32 kNN distances
    # results on the host; what came back is the results (weights, archetypes, kernel) and scalars, not the data
    assert sp.issparse(d.obsm["metacell_weights"]) and sp.issparse(d.obsp["metacell_kernel"])
    results = sum(m.data.nbytes + m.indices.nbytes + m.indptr.nbytes for m in (d.obsm["metacell_weights"], d.obsm["metacell_archetypes"], d.obsp["metacell_kernel"]))  # fmt: skip
    assert Transfers.to_host <= results + 50_000, (Transfers.to_host, results)
    assert is_cupy_array(d.obsm["X_pca"])  # the input stays on the device


def test_metacells_gpu_on_host_data_equals_cpu(standin_gpu, pbmc68k_fitted, pbmc68k):
    gpuc.tl.metacells(pbmc68k, convergence_epsilon=1e-5, max_iter=50, min_iter=10, random_state=0, device="gpu")
    assert pbmc68k.uns["metacell"]["device"] == "gpu"
    pd.testing.assert_series_equal(pbmc68k.obs["metacell"], pbmc68k_fitted.obs["metacell"])
    w_gpu, w_cpu = pbmc68k.obsm["metacell_weights"], pbmc68k_fitted.obsm["metacell_weights"]
    assert abs(w_gpu - w_cpu).max() < 1e-12


@pytest.mark.parametrize("soft", [False, True])
def test_aggregate_and_quality_device_equal_cpu(on_device, pbmc68k_fitted, soft):
    cpu = pbmc68k_fitted.copy()
    cpu.layers["counts"] = sp.csr_matrix(np.abs(cpu.X))
    d = on_device(cpu)
    Transfers.reset()
    want = gpuc.tl.aggregate_metacells(cpu, layer="counts", soft=soft, celltype_key="bulk_labels")
    got = gpuc.tl.aggregate_metacells(d, layer="counts", soft=soft, celltype_key="bulk_labels")
    assert sp.issparse(got.X) and (abs(got.X - want.X) > 1e-9 * abs(want.X).max()).nnz == 0
    pd.testing.assert_frame_equal(got.obs, want.obs)
    for k in want.obsm:
        np.testing.assert_allclose(got.obsm[k], want.obsm[k], rtol=1e-10, atol=1e-12)
    assert Transfers.to_host < cpu.layers["counts"].data.nbytes  # the sums came back, not the counts
    gx = gpuc.tl.aggregate_metacells(d, soft=soft)  # dense X on the device
    wx = gpuc.tl.aggregate_metacells(cpu, soft=soft)
    np.testing.assert_allclose(gx.X, wx.X, rtol=1e-10, atol=1e-10)


def test_metacell_quality_device_equals_cpu(on_device, pbmc68k_fitted):
    d = on_device(pbmc68k_fitted)
    want = gpuc.tl.metacell_quality(pbmc68k_fitted, celltype_key="bulk_labels", inplace=False, device="cpu")
    got = gpuc.tl.metacell_quality(d, celltype_key="bulk_labels", inplace=False)
    pd.testing.assert_frame_equal(got, want, rtol=1e-6)


def test_n_distinct_on_device(standin_gpu):
    from gpuc.tl._metacells import _n_distinct

    x = np.random.default_rng(0).normal(size=(50, 4))
    x[10] = x[3]
    x[20] = x[3]
    assert _n_distinct(x) == 48
    assert _n_distinct(standin_gpu.asarray(x)) == 48
    x[30, 0] = x[3, 0]  # the first column ties, the rows differ: the lexicographic count
    assert _n_distinct(x) == 48
    y = np.random.default_rng(1).normal(size=(50, 4))  # all first-column values distinct: every row
    assert _n_distinct(y) == _n_distinct(standin_gpu.asarray(y)) == 50


# ---- reusing an existing neighbour graph (sc.pp.neighbors / rsc.pp.neighbors) -------------------------------------
@pytest.fixture(scope="module")
def with_graphs():
    import scanpy as sc

    a = sc.datasets.pbmc68k_reduced()
    for k, key in ((30, "nn30"), (15, "nn15")):
        sc.pp.neighbors(a, n_neighbors=k, use_rep="X_pca", key_added=key)
    sc.pp.neighbors(a, n_neighbors=30, use_rep="X_pca", metric="cosine", key_added="cos")
    return a


def test_neighbors_key_reuses_the_graph(with_graphs, pbmc68k_fitted):
    a = with_graphs.copy()
    graphs = {k: a.obsp[k].copy() for k in a.obsp}
    kw = {"convergence_epsilon": 1e-5, "max_iter": 50, "min_iter": 10, "random_state": 0, "device": "cpu"}
    gpuc.tl.metacells(a, neighbors_key="nn30", **kw)
    # below 4,096 cells scanpy's graph is the exact kNN: the same metacells as building it
    pd.testing.assert_series_equal(a.obs["metacell"], pbmc68k_fitted.obs["metacell"])
    np.testing.assert_allclose(a.uns["metacell"]["rss"], pbmc68k_fitted.uns["metacell"]["rss"], rtol=1e-5)
    assert a.uns["metacell"]["params"]["neighbors_key"] == "nn30"
    assert set(a.obsp) == {*graphs, "metacell_kernel"}  # the graphs are read, not touched
    assert all((a.obsp[k] != g).nnz == 0 for k, g in graphs.items())


def test_neighbors_key_on_device_graph(on_device, with_graphs):
    from gpuc._testing.standin import to_device

    a = with_graphs.copy()
    cpu = a.copy()
    gpuc.tl.metacells(cpu, neighbors_key="nn15", init="greedy", max_iter=20, device="cpu")
    d = on_device(a)
    d.obsp["nn15_distances"] = to_device(a.obsp["nn15_distances"])
    Transfers.reset()
    gpuc.tl.metacells(d, neighbors_key="nn15", init="greedy", max_iter=20)
    assert Transfers.to_host < a.obsp["nn15_distances"].data.nbytes + d.obsp["metacell_kernel"].data.nbytes * 3
    pd.testing.assert_series_equal(d.obs["metacell"], cpu.obs["metacell"])


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"neighbors_key": "nn15"}, ValueError, "fewer than 29 stored neighbours.*n_neighbors"),
        ({"neighbors_key": "nn15", "n_neighbors": 20, "init": "greedy"}, ValueError, "fewer than 19"),
        ({"neighbors_key": "cos"}, ValueError, "metric='cosine'"),
        ({"neighbors_key": "nn30", "groupby": "bulk_labels", "n_metacells": 2}, ValueError, "groupby"),
        ({"neighbors_key": "missing"}, KeyError, "missing"),
    ],
)
def test_neighbors_key_refusals_leave_adata_unchanged(with_graphs, unchanged, kwargs, err, match):
    a = with_graphs.copy()
    with unchanged(a), pytest.raises(err, match=match):
        gpuc.tl.metacells(a, max_iter=10, device="cpu", **kwargs)
