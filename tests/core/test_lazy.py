"""Lazily read (dask) AnnData in the tools: chunked sums and checks, loaded blocks, results equal to in memory.

The data are written with ``write_h5ad`` and read back with ``anndata.experimental.read_elem_lazy`` in 64-row chunks
(so every sum runs over several chunks and a tree reduction); each tool's output is compared with the same call on
the in-memory AnnData, and the file must be unchanged afterwards.
"""

from __future__ import annotations

import hashlib
import warnings

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import gpuc

da = pytest.importorskip("dask.array")
h5py = pytest.importorskip("h5py")

CHUNK = 64
N_CELLS, N_GENES = 300, 50


def _cells(seed: int = 0) -> ad.AnnData:
    """300 cells x 50 genes of counts: sparse float32 ``X``, dense int64 ``layers['dense']``, non-integer
    ``layers['float']``; six samples (three per condition), three cell types, a 10-d embedding, 30 HVGs.
    """
    rng = np.random.default_rng(seed)
    mu = rng.gamma(0.5, 4.0, (N_CELLS, N_GENES))
    counts = rng.poisson(mu)
    counts[counts < 2] = 0  # sparse enough for CSR
    sample = np.asarray([f"s{i}" for i in range(6)])[rng.integers(0, 6, N_CELLS)]
    obs = pd.DataFrame(
        {
            "sample": pd.Categorical(sample),
            "condition": pd.Categorical(np.where(np.isin(sample, ["s0", "s1", "s2"]), "ctrl", "treated")),
            "cell_type": pd.Categorical(np.asarray(["T", "B", "NK"])[rng.integers(0, 3, N_CELLS)]),
        },
        index=[f"c{i}" for i in range(N_CELLS)],
    )
    var = pd.DataFrame({"highly_variable": np.arange(N_GENES) % 5 != 0}, index=[f"g{j}" for j in range(N_GENES)])
    a = ad.AnnData(sp.csr_matrix(counts.astype(np.float32)), obs=obs, var=var)
    a.layers["dense"] = counts.astype(np.int64)
    a.layers["float"] = counts * rng.uniform(0.5, 1.5, counts.shape)
    a.obsm["X_pca"] = np.log1p(counts) @ rng.normal(size=(N_GENES, 10))
    return a


def _untimed(uns: dict) -> dict:
    """``uns`` without the wall-clock ``seconds`` entries (the only thing that may differ between two runs)."""
    return {k: _untimed(v) if isinstance(v, dict) else v for k, v in uns.items() if k != "seconds"}


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The cells (with metacells computed in memory) and their h5ad file, kept open for lazy reads."""
    mem = _cells()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpuc.tl.metacells(mem, 8, device="cpu", max_iter=5, min_iter=2, random_state=0)
    path = tmp_path_factory.mktemp("lazy") / "cells.h5ad"
    mem.write_h5ad(path)
    sha = _sha(path)
    with h5py.File(path, "r") as f:
        yield mem, path, f
    assert _sha(path) == sha


def _lazy(mem: ad.AnnData, f, *, layers=("dense", "float")) -> ad.AnnData:
    """``mem`` with X and layers replaced by dask arrays read lazily from the file (64-row chunks, dense ones also
    split along genes); obs/var/obsm/uns are the in-memory ones (the metacell results included).
    """
    lazy = ad.AnnData(
        ad.experimental.read_elem_lazy(f["X"], chunks=(CHUNK, N_GENES)),
        obs=mem.obs.copy(),
        var=mem.var.copy(),
        obsm={k: v.copy() for k, v in mem.obsm.items()},
        uns=dict(mem.uns),
    )
    for name in layers:
        lazy.layers[name] = ad.experimental.read_elem_lazy(f[f"layers/{name}"], chunks=(CHUNK, 20))
    return lazy


def test_lazy_matrices_are_dask_with_several_chunks(files):
    mem, _, f = files
    lazy = _lazy(mem, f)
    assert isinstance(lazy.X, da.Array) and sp.issparse(lazy.X._meta)
    assert isinstance(lazy.layers["dense"], da.Array) and isinstance(lazy.layers["dense"]._meta, np.ndarray)
    assert lazy.X.numblocks[0] == 5 and lazy.layers["dense"].numblocks == (5, 3)


# ---- pseudobulk: exact chunked sums and the same count checks ---------------------------------------------------------
@pytest.mark.parametrize(("layer", "groupby"), [(None, None), ("dense", "cell_type"), (None, "cell_type")])
def test_pseudobulk_lazy_equals_in_memory(files, same, layer, groupby):
    mem, _, f = files
    want = gpuc.tl.pseudobulk(mem, "sample", groupby=groupby, layer=layer, min_cells=5)
    got = gpuc.tl.pseudobulk(_lazy(mem, f), "sample", groupby=groupby, layer=layer, min_cells=5)
    same(got, want)
    assert got.X.dtype == np.int64


def test_pseudobulk_lazy_with_missing_samples_warns(files, same):
    mem, _, f = files
    mem = mem.copy()
    mem.obs["sample"] = mem.obs["sample"].astype(object).where(np.arange(N_CELLS) % 7 != 0)
    with pytest.warns(gpuc.GpucWarning, match="left out of the pseudobulk"):
        want = gpuc.tl.pseudobulk(mem, "sample", min_cells=1)
    with pytest.warns(gpuc.GpucWarning, match="left out of the pseudobulk"):
        got = gpuc.tl.pseudobulk(_lazy(mem, f), "sample", min_cells=1)
    same(got, want)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda x: x - 1, "contains negative values"),
        (lambda x: x * 0.5, "must hold raw integer counts"),
        (lambda x: np.where(np.arange(N_CELLS)[:, None] == 250, np.nan, x), "must hold raw integer counts"),
    ],
)
def test_pseudobulk_lazy_refuses_bad_counts_like_in_memory(unchanged, change, match):
    a = _cells()
    bad = change(a.layers["dense"].astype(np.float64))
    a.layers["bad"] = bad
    with unchanged(a), pytest.raises(ValueError, match=match):
        gpuc.tl.pseudobulk(a, "sample", layer="bad")
    a.layers["bad"] = da.from_array(bad, chunks=(CHUNK, 20))  # the bad values sit in one chunk only
    with unchanged(a), pytest.raises(ValueError, match=match):
        gpuc.tl.pseudobulk(a, "sample", layer="bad")
    a.layers["bad"] = da.from_array(sp.csr_matrix(bad), chunks=(CHUNK, N_GENES), asarray=False)  # sparse chunks
    with pytest.raises(ValueError, match=match):
        gpuc.tl.pseudobulk(a, "sample", layer="bad")


def test_pseudobulk_lazy_bad_counts_come_before_missing_samples():
    a = _cells()
    a.obs["sample"] = np.nan
    a.layers["bad"] = da.from_array(-a.layers["dense"], chunks=(CHUNK, 20))
    with pytest.raises(ValueError, match="contains negative values"):
        gpuc.tl.pseudobulk(a, "sample", layer="bad")
    a.layers["bad"] = da.from_array(a.layers["dense"], chunks=(CHUNK, 20))
    with pytest.raises(ValueError, match="every cell has a missing"):
        gpuc.tl.pseudobulk(a, "sample", layer="bad")


# ---- aggregate_metacells: hard and soft sums, CSR kept -----------------------------------------------------------------
@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("layer", [None, "dense", "float"])
def test_aggregate_metacells_lazy_equals_in_memory(files, same, soft, layer):
    mem, _, f = files
    want = gpuc.tl.aggregate_metacells(mem, layer=layer, soft=soft, celltype_key="cell_type")
    got = gpuc.tl.aggregate_metacells(_lazy(mem, f), layer=layer, soft=soft, celltype_key="cell_type")
    assert sp.issparse(got.X) == sp.issparse(want.X)
    if sp.issparse(want.X):
        assert got.X.format == "csr"
    g = got.X.toarray() if sp.issparse(got.X) else got.X
    w = want.X.toarray() if sp.issparse(want.X) else want.X
    if layer == "float" or soft:  # float sums added in another order: 1e-12 relative
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=0)
    else:  # integer-valued sums: exact
        np.testing.assert_array_equal(g, w)
    got.X = want.X
    same(got, want)


def test_grouped_sum_tree_reduction_matches_product():
    from gpuc._lazy import grouped_sum

    rng = np.random.default_rng(1)
    x = rng.poisson(2.0, (300, 7)).astype(np.float32)
    ind = sp.random(9, 300, density=0.3, random_state=1, format="csr")
    for split_every in (2, 3, None):
        got = grouped_sum(ind, da.from_array(x, chunks=(17, 4)), split_every=split_every)
        np.testing.assert_allclose(got, ind @ x.astype(np.float64), rtol=1e-12)
    with pytest.raises(ValueError, match="indicator has 300 columns but the matrix has 299 rows"):
        grouped_sum(ind, da.from_array(x[:299], chunks=(17, 4)))


def test_grouped_sum_peak_memory_is_chunks_not_the_matrix():
    import tracemalloc

    from gpuc._lazy import grouped_sum_and_count_checks

    n, g = 100_000, 40  # a 32 MB float64 matrix, generated chunk by chunk (2,000 rows: 0.64 MB)
    ind = sp.csr_matrix((np.ones(n), (np.arange(n) % 10, np.arange(n))), shape=(10, n))
    grouped_sum_and_count_checks(ind[:, :100], da.ones((100, g), chunks=(50, g)))  # first-call imports not counted
    x = da.random.default_rng(0).random((n, g), chunks=(2_000, g))
    tracemalloc.start()
    try:
        sums, flags = grouped_sum_and_count_checks(ind, x)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not flags.negative and flags.non_integer
    assert sums.shape == (10, g) and np.isclose(sums.sum(), x.sum().compute(), rtol=1e-12)
    assert peak < 0.35 * n * g * 8, f"peak {peak / 1e6:.1f} MB"  # about 4.5 MB: the indicator and a few chunks


# ---- NMF: only the mask_var block is loaded; results bit-identical -----------------------------------------------------
@pytest.mark.filterwarnings("ignore::gpuc.ConvergenceWarning")  # max_iter is kept small
@pytest.mark.parametrize("layer", [None, "dense"])
def test_consensus_nmf_lazy_is_bit_identical(files, same, layer):
    mem, _, f = files
    opts = {"n_runs": 3, "max_iter": 30, "layer": layer, "device": "cpu", "random_state": 1}
    want = gpuc.tl.consensus_nmf(mem, 3, **opts, copy=True)
    lazy = _lazy(mem, f)
    got = gpuc.tl.consensus_nmf(lazy, 3, **opts, copy=True)
    # cNMF's all-gene outputs sum over the cells chunk by chunk (never loading the matrix), in another order than in
    # memory: 1e-12 relative, amplified a little by their NNLS solves; everything else is bit-identical
    for slot, name in (("obsm", "X_nmf_refit"), ("varm", "nmf_spectra_tpm"), ("varm", "nmf_spectra_score")):
        g, w = getattr(got, slot).pop(name), getattr(want, slot).pop(name)
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12 * np.abs(w).max(), err_msg=name)
    for slot in ("obs", "var", "obsm", "varm"):
        same(getattr(got, slot), getattr(want, slot), f"adata.{slot}")
    # the matrix fingerprint nmf_refine checks is four sums over the matrix, also summed chunk by chunk
    g, w = got.uns["nmf"]["inputs"].pop("fingerprint"), want.uns["nmf"]["inputs"].pop("fingerprint")
    np.testing.assert_allclose(g, w, rtol=1e-12, atol=0)
    same(_untimed(got.uns), _untimed(want.uns), "adata.uns")
    assert isinstance(got.X, da.Array)  # the AnnData keeps its lazy matrix


@pytest.mark.filterwarnings("ignore::gpuc.ConvergenceWarning")  # max_iter is kept small
def test_nmf_k_sweep_lazy_is_bit_identical(files, same):
    mem, _, f = files
    opts = {"n_runs": 3, "max_iter": 30, "device": "cpu", "random_state": 2}
    want = gpuc.tl.nmf_k_sweep(mem, [2, 3], **opts, copy=True)
    got = gpuc.tl.nmf_k_sweep(_lazy(mem, f), [2, 3], **opts, copy=True)
    same(_untimed(got.uns), _untimed(want.uns), "adata.uns")


def test_prepare_block_loads_only_the_selected_genes(files, monkeypatch):
    import gpuc._lazy
    from gpuc.tl._nmf import _prepare_block

    mem, _, f = files
    lazy = _lazy(mem, f)
    logged: list[str] = []
    monkeypatch.setattr(gpuc._lazy.logg, "info", lambda msg, **kw: logged.append(msg))
    block, mask = _prepare_block(lazy, None, "highly_variable", "none")
    assert sp.issparse(block) and block.format == "csr" and block.shape == (N_CELLS, int(mask.sum()))
    nbytes = block.data.nbytes + block.indices.nbytes + block.indptr.nbytes
    assert logged == [
        f"adata.X: loaded a lazily read 300 x 40 sparse float32 matrix into memory ({nbytes / 1e6:.2f} MB)"
    ]
    want, _ = _prepare_block(mem, None, "highly_variable", "none")
    assert (block != want).nnz == 0 and np.array_equal(block.indices, want.indices)


# ---- DESeq2 and VST: the small samples x genes counts are loaded -------------------------------------------------------
def test_vst_and_deseq_lazy_equal_in_memory(files, same, tmp_path):
    mem, _, _ = files
    pb = gpuc.tl.pseudobulk(mem, "sample", min_cells=1)
    pb.write_h5ad(tmp_path / "pb.h5ad")
    with h5py.File(tmp_path / "pb.h5ad", "r") as f:
        lazy = ad.AnnData(
            ad.experimental.read_elem_lazy(f["X"], chunks=(2, N_GENES)),
            obs=pb.obs,
            var=pb.var,
            uns=dict(pb.uns),
            layers=dict(pb.layers),  # pseudobulk's psbulk_props
        )
        assert isinstance(lazy.X, da.Array)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a few genes' fits warn the same way in both
            for a in (pb, lazy):
                gpuc.tl.vst(a, fit_type="mean", device="cpu")
                gpuc.tl.deseq(a, "~condition", fit_type="mean", device="cpu")
        lazy.X = pb.X
        same(lazy, pb)


# ---- anndata.experimental.read_lazy (needs xarray for the dataframes) --------------------------------------------------
def test_read_lazy_anndata(files, same):
    pytest.importorskip("xarray")
    mem, path, _ = files
    lazy = ad.experimental.read_lazy(path)
    assert isinstance(lazy.X, da.Array) and isinstance(lazy.layers["dense"], da.Array)
    with pytest.raises(TypeError, match=r"adata.obs is not in memory .*adata.obs = adata.obs.to_memory\(\)"):
        gpuc.tl.pseudobulk(lazy, "sample", layer="dense")
    lazy.obs, lazy.var = lazy.obs.to_memory(), lazy.var.to_memory()  # the matrices stay lazy
    for layer in (None, "dense"):
        same(gpuc.tl.pseudobulk(lazy, "sample", layer=layer), gpuc.tl.pseudobulk(mem, "sample", layer=layer))
    assert isinstance(lazy.obsm["metacell_weights"], da.Array)  # obsm and uns tables are lazy too
    for soft in (False, True):
        got = gpuc.tl.aggregate_metacells(lazy, layer="dense", soft=soft, celltype_key="cell_type")
        want = gpuc.tl.aggregate_metacells(mem, layer="dense", soft=soft, celltype_key="cell_type")
        np.testing.assert_allclose(got.X, want.X, rtol=1e-12, atol=0)
        np.testing.assert_allclose(got.obsm["X_pca"], want.obsm["X_pca"], rtol=1e-12, atol=1e-12)
        got.X, got.obsm["X_pca"] = want.X, want.obsm["X_pca"]
        same(got, want)


# ---- a real cluster: two worker processes read the file's chunks ------------------------------------------------------
@pytest.fixture(scope="module")
def dask_client():
    distributed = pytest.importorskip("distributed")
    import dask

    with (
        # forked workers start with gpuc already imported (spawned ones spend seconds importing it and scanpy); they
        # also start with the test process's memory (its data and numba's compiled code, about 1 GB after the kernels
        # compile in a fresh checkout), so a per-worker memory limit would pause them before their first task
        dask.config.set({"distributed.worker.multiprocessing-method": "fork"}),
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0", memory_limit=0
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        yield client


def test_pseudobulk_and_aggregate_lazy_on_a_cluster(files, same, dask_client):
    from distributed import get_task_stream

    mem, _, f = files
    lazy = _lazy(mem, f)
    with get_task_stream(dask_client) as ts:
        got_pb = gpuc.tl.pseudobulk(lazy, "sample", groupby="cell_type")
        got = gpuc.tl.aggregate_metacells(lazy, layer="dense", soft=True)
    same(got_pb, gpuc.tl.pseudobulk(mem, "sample", groupby="cell_type"))
    want = gpuc.tl.aggregate_metacells(mem, layer="dense", soft=True)
    np.testing.assert_allclose(got.X, want.X, rtol=1e-12, atol=0)
    # the chunks were read and reduced by the two worker processes
    assert len(dask_client.scheduler_info()["workers"]) == 2
    # (dask fuses the partial products into the reduction's first step, named "sum")
    names = [(t["key"][0] if isinstance(t["key"], tuple) else t["key"], t["worker"]) for t in ts.data]
    workers = {w for name, w in names if name.startswith(("make_dask_chunk", "sum-"))}
    assert len(workers) == 2


def test_metacells_on_a_lazy_embedding_loads_it_and_matches():
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(3)
    x = rng.normal(size=(240, 6)).astype(np.float32)
    eager = ad.AnnData(np.zeros((240, 1), np.float32))
    eager.obsm["X_pca"] = x
    lazy = eager.copy()
    lazy.obsm["X_pca"] = da.from_array(x, chunks=(50, 6))
    want = gpuc.tl.metacells(eager, 4, max_iter=10, copy=True)
    got = gpuc.tl.metacells(lazy, 4, max_iter=10, copy=True)
    assert got.obs["metacell"].equals(want.obs["metacell"])
    assert (got.obsm["metacell_weights"] != want.obsm["metacell_weights"]).nnz == 0
