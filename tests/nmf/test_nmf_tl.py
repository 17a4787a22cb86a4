"""AnnData adapters: what consensus_nmf / nmf_k_sweep write, cNMF parity through the public API, bad input."""

from __future__ import annotations

import anndata
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from anndata import AnnData

import gpuc
from gpuc._backend import gpu_available
from gpuc.nmf._hals import WARMUP


def test_nmf_consensus_nmf_cnmf_settings_match_cnmf(cnmf_counts, cnmf_k7_spectra):
    ad = cnmf_counts.copy()
    gpuc.tl.consensus_nmf(
        ad,
        7,
        n_runs=20,
        preprocessing="sd",
        metric="euclidean",
        density_threshold=0.5,
        normalization="sum",
        device="cpu",
    )
    spectra = ad.varm["nmf_spectra"].T
    np.testing.assert_allclose(spectra.sum(axis=1), 1.0, rtol=1e-12)
    a = cnmf_k7_spectra / np.linalg.norm(cnmf_k7_spectra, axis=1, keepdims=True)
    b = spectra / np.linalg.norm(spectra, axis=1, keepdims=True)
    assert (a @ b.T).max(axis=1).min() >= 0.99
    u = ad.uns["nmf"]
    assert abs(u["rel_error"] - 0.59046) < 2e-4
    assert u["stability"] > 0.9
    assert u["params"]["preprocessing"] == "sd" and u["params"]["metric"] == "euclidean"


def test_nmf_consensus_nmf_writes_fields(programs, tmp_path, same):
    ad = programs
    hv = ad.var["highly_variable"].to_numpy()
    gpuc.tl.consensus_nmf(ad, 3, n_runs=6, layer="counts", device="cpu", random_state=1)
    assert ad.obsm["X_nmf"].shape == (ad.n_obs, 3)
    assert ad.varm["nmf_spectra"].shape == (ad.n_vars, 3)
    assert (ad.varm["nmf_spectra"][~hv] == 0).all()
    assert (ad.obsm["X_nmf"] >= 0).all()
    u = ad.uns["nmf"]
    assert set(u["params"]) >= {
        "k",
        "n_runs",
        "layer",
        "preprocessing",
        "density_threshold",
        "metric",
        "random_state",
        "warmup",
        "update_order",
    }
    assert u["params"]["update_order"] == "usages" and u["params"]["warmup"] == WARMUP
    comp = u["components"]
    assert list(comp.columns) == ["run", "component", "cluster", "local_density", "silhouette", "kept"]
    assert len(comp) == 18 and u["run_errors"].shape == (6,)
    assert u["cluster_sizes"].sum() == 18 - u["n_dropped"]
    assert list(u["genes"]) == list(ad.var_names[hv])
    # the planted programmes are recovered: each cell's top programme agrees with its truth label up to relabelling
    top = ad.obsm["X_nmf"].argmax(1)
    ct = pd.crosstab(top, ad.obs["truth"])
    assert ct.max(axis=1).sum() / ad.n_obs > 0.9
    # reproducible from the stored params; key_added renames every output
    ad2 = programs.copy()
    params = dict(u["params"])
    params.pop("dtype")
    params["device"] = "cpu"
    gpuc.tl.consensus_nmf(ad2, key_added="rerun", **params)
    np.testing.assert_allclose(ad2.obsm["X_rerun"], ad.obsm["X_nmf"])
    assert "rerun_spectra" in ad2.varm and "rerun" in ad2.uns
    ad.write_h5ad(tmp_path / "nmf.h5ad")
    same(anndata.read_h5ad(tmp_path / "nmf.h5ad"), ad)


@pytest.mark.parametrize("schedule", [{"update_order": "spectra", "warmup": 0}, {"warmup": 0}, {"extrapolate": False}])
def test_nmf_schedule_options_reach_the_engine(programs, schedule):
    # the tl options select the engine's schedule: run errors equal those of fit_hals with the same settings
    from gpuc._backend import get_backend
    from gpuc.nmf._consensus import run_k
    from gpuc.nmf._hals import Operator
    from gpuc.tl._nmf import _prepare_block

    ad = programs.copy()
    gpuc.tl.consensus_nmf(ad, 3, n_runs=4, layer="counts", device="cpu", random_state=2, **schedule)
    block, _ = _prepare_block(ad, "counts", "highly_variable", "none")
    cpu = get_backend("cpu")
    fits = run_k(cpu, Operator.build(cpu, block), 3, 4, 2, **schedule)
    np.testing.assert_allclose(ad.uns["nmf"]["run_errors"], fits.rel_errors, rtol=1e-12)
    assert {k: ad.uns["nmf"]["params"][k] for k in schedule} == schedule


def test_nmf_tl_schedule_defaults_match_engine():
    import inspect

    from gpuc.nmf._hals import UPDATE_ORDER, fit_hals_groups

    engine = inspect.signature(fit_hals_groups).parameters
    for fn in (gpuc.tl.consensus_nmf, gpuc.tl.nmf_k_sweep):
        sig = inspect.signature(fn).parameters
        assert sig["warmup"].default == WARMUP == engine["warmup"].default
        assert sig["tol"].default == engine["tol"].default
        assert sig["update_order"].default == UPDATE_ORDER == "usages"


def test_nmf_copy_returns_copy_and_leaves_input(programs, unchanged):
    with unchanged(programs):
        out = gpuc.tl.consensus_nmf(programs, 3, n_runs=3, layer="counts", device="cpu", copy=True)
    assert isinstance(out, AnnData) and "X_nmf" in out.obsm
    with unchanged(programs):
        out = gpuc.tl.nmf_k_sweep(programs, [2, 3], n_runs=3, layer="counts", device="cpu", copy=True)
    assert "nmf_k_sweep" in out.uns
    assert gpuc.tl.consensus_nmf(programs, 2, n_runs=3, layer="counts", device="cpu") is None


def test_nmf_k_sweep_table_and_independence(programs):
    ad = programs
    gpuc.tl.nmf_k_sweep(ad, range(2, 6), n_runs=4, layer="counts", device="cpu", random_state=3)
    t = ad.uns["nmf_k_sweep"]["table"]
    assert list(t.columns) == [
        "k",
        "stability",
        "best_error",
        "median_error",
        "consensus_failed",
        "n_dropped",
        "n_empty_clusters",
        "n_converged",
    ]
    assert t["k"].tolist() == [2, 3, 4, 5]
    assert (t["best_error"] <= t["median_error"]).all()
    assert t["median_error"].is_monotonic_decreasing
    # the planted rank is the most stable k above 2
    assert t.set_index("k")["stability"].loc[3] > 0.95
    # a k's row does not depend on which other ks are in the sweep
    alone = gpuc.tl.nmf_k_sweep(ad, [4], n_runs=4, layer="counts", device="cpu", random_state=3, copy=True).uns[
        "nmf_k_sweep"
    ]["table"]
    row = t.set_index("k").loc[4]
    assert alone["stability"].iloc[0] == pytest.approx(row["stability"], abs=1e-12)
    assert alone["median_error"].iloc[0] == pytest.approx(row["median_error"], rel=1e-12)
    # and consensus_nmf at the same k, seed and settings gives the sweep's stability
    gpuc.tl.consensus_nmf(ad, 4, n_runs=4, layer="counts", device="cpu", random_state=3, density_threshold=2.0)
    assert ad.uns["nmf"]["stability"] == pytest.approx(row["stability"], abs=1e-12)


def test_nmf_k_sweep_failed_row(programs):
    gpuc.tl.nmf_k_sweep(programs, [2, 3], n_runs=3, layer="counts", device="cpu", density_threshold=0.0)
    t = programs.uns["nmf_k_sweep"]["table"]
    assert t["consensus_failed"].all()
    assert t["stability"].isna().all()
    assert t["n_dropped"].tolist() == [6, 9]


def _bad(ad: AnnData, kind: str) -> AnnData:
    ad = ad.copy()
    x = ad.layers["counts"].toarray()
    if kind == "negative":
        x[3, 0] = -1
    elif kind == "nan":
        x[3, 0] = np.nan
    elif kind == "inf":
        x[3, 0] = np.inf
    elif kind == "zero_cell":
        x[5, :40] = 0  # the test block is the first 40 genes
    elif kind == "zero_gene":
        x[:, 0] = 0
    elif kind == "constant_gene":
        x[:, 0] = 2
    ad.layers["counts"] = sp.csr_matrix(x)
    return ad


BAD_INPUT = [
    ("negative", {}, "negative values"),
    ("nan", {}, "NaN or infinite"),
    ("inf", {}, "NaN or infinite"),
    ("zero_cell", {}, "1 cell"),
    ("zero_gene", {}, "zero in every cell"),
    ("constant_gene", {"preprocessing": "sd"}, "zero variance"),
    (None, {"k": 40}, "smaller than min"),
    (None, {"k": 1}, "too small"),
    (None, {"n_runs": 1}, "n_runs=1 is too small"),
    (None, {"density_threshold": 0.0}, "fewer than k"),
    (None, {"density_threshold": 3.0}, "must be a number in"),
    (None, {"metric": "manhattan"}, "metric="),
    (None, {"preprocessing": "zscore"}, "preprocessing="),
    (None, {"layer": "missing"}, "not found"),
    (None, {"dtype": "float16"}, "dtype="),
    (None, {"device": "tpu"}, "device="),
    (None, {"update_order": "genes"}, "update_order="),
    (None, {"warmup": -1}, "warmup=-1 is too small"),
    (None, {"warmup": 1.5}, "warmup must be an integer"),
]


@pytest.mark.parametrize(
    ("kind", "kwargs", "match"), BAD_INPUT, ids=[f"{b[0]}-{next(iter(b[1]), '')}" for b in BAD_INPUT]
)
def test_nmf_consensus_nmf_bad_input_leaves_adata_unchanged(programs, kind, kwargs, match, unchanged):
    ad = _bad(programs, kind) if kind else programs[:, :]
    ad = ad.copy()
    ad.var["highly_variable"] = np.arange(ad.n_vars) < 40  # small block: 40 genes, so k=40 is too large
    call = {"k": 3, "n_runs": 3, "layer": "counts", "device": "cpu"} | kwargs
    with unchanged(ad), pytest.raises((ValueError, TypeError, KeyError), match=match):
        gpuc.tl.consensus_nmf(ad, **call)
    sweep = {k: v for k, v in call.items() if k not in ("k",)}
    if kind is None and ("k" in kwargs or ("density_threshold" in kwargs and kwargs["density_threshold"] == 0.0)):
        return  # k is checked per entry below; a failed consensus is a row in the sweep
    with unchanged(ad), pytest.raises((ValueError, TypeError, KeyError), match=match):
        gpuc.tl.nmf_k_sweep(ad, [2, 3], **sweep)


def test_nmf_k_sweep_bad_k_range(programs, unchanged):
    for k_range, match in [([2, 300], "smaller than min"), ([], "empty"), ([1, 2], "too small"), ([2.5], "integer")]:
        with unchanged(programs), pytest.raises((ValueError, TypeError), match=match):
            gpuc.tl.nmf_k_sweep(programs, k_range, n_runs=3, layer="counts", device="cpu")


def test_nmf_missing_hvg_column(programs):
    ad = programs.copy()
    del ad.var["highly_variable"]
    with pytest.raises(KeyError, match="highly_variable_genes"):
        gpuc.tl.consensus_nmf(ad, 2, n_runs=3, layer="counts", device="cpu")
    gpuc.tl.consensus_nmf(ad, 2, n_runs=3, layer="counts", device="cpu", mask_var=None)
    assert ad.varm["nmf_spectra"].shape == (60, 2) and (ad.varm["nmf_spectra"] > 0).any(axis=1).all()


def test_nmf_dense_and_sparse_input_agree(programs):
    dense = programs.copy()
    dense.layers["counts"] = dense.layers["counts"].toarray()
    a = gpuc.tl.consensus_nmf(
        programs, 3, n_runs=4, layer="counts", preprocessing="sqrt_sd", device="cpu", dtype="float64", copy=True
    )
    b = gpuc.tl.consensus_nmf(
        dense, 3, n_runs=4, layer="counts", preprocessing="sqrt_sd", device="cpu", dtype="float64", copy=True
    )
    np.testing.assert_allclose(a.obsm["X_nmf"], b.obsm["X_nmf"], rtol=1e-6, atol=1e-8)
    assert a.uns["nmf"]["stability"] == pytest.approx(b.uns["nmf"]["stability"], abs=1e-9)


@pytest.mark.gpu
def test_nmf_gpu_matches_cpu(cnmf_counts):
    assert gpu_available()
    cpu = gpuc.tl.consensus_nmf(cnmf_counts, 7, n_runs=10, preprocessing="sd", device="cpu", copy=True)
    gpu = gpuc.tl.consensus_nmf(cnmf_counts, 7, n_runs=10, preprocessing="sd", device="gpu", dtype="float64", copy=True)
    a, b = cpu.varm["nmf_spectra"].T, gpu.varm["nmf_spectra"].T
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    assert (a @ b.T).max(axis=1).min() > 0.999
    assert gpu.uns["nmf"]["rel_error"] == pytest.approx(cpu.uns["nmf"]["rel_error"], abs=1e-6)
    g32 = gpuc.tl.consensus_nmf(cnmf_counts, 7, n_runs=10, preprocessing="sd", device="gpu", copy=True)
    assert g32.uns["nmf"]["rel_error"] == pytest.approx(cpu.uns["nmf"]["rel_error"], abs=1e-4)


@pytest.mark.gpu
def test_nmf_k_sweep_gpu_matches_cpu(cnmf_counts):
    # the sweep fits all ranks in one batch on both devices (one SpMM per half-iteration on the GPU)
    assert gpu_available()
    kw = dict(k_range=range(2, 7), n_runs=4, preprocessing="sd", dtype="float64", copy=True)
    cpu = gpuc.tl.nmf_k_sweep(cnmf_counts, device="cpu", **kw).uns["nmf_k_sweep"]["table"]
    gpu = gpuc.tl.nmf_k_sweep(cnmf_counts, device="gpu", **kw).uns["nmf_k_sweep"]["table"]
    np.testing.assert_allclose(gpu["best_error"], cpu["best_error"], atol=1e-5)
    np.testing.assert_allclose(gpu["stability"], cpu["stability"], atol=0.05)


@pytest.mark.parametrize("sparse", [True, False])
def test_nmf_k_sweep_in_column_capped_batches_equals_one_batch(program_factory, monkeypatch, sparse):
    # on the CPU the sweep's ranks are fitted in batches of at most cpu_batch_columns factor columns (for the cache);
    # a restart's iterates do not depend on the other ranks of its batch, so every output is the one-batch output
    import gpuc.nmf._plan as plan
    import gpuc.nmf._run as run

    ad = program_factory(160, 60, sparse=sparse)
    kw = {"n_runs": 5, "layer": "counts", "device": "cpu", "random_state": 1, "copy": True}
    monkeypatch.setattr(run, "cpu_batch_columns", lambda shape, itemsize: 10**6)
    one = gpuc.tl.nmf_k_sweep(ad, range(2, 8), **kw)
    monkeypatch.setattr(run, "cpu_batch_columns", lambda shape, itemsize: 25)
    capped = gpuc.tl.nmf_k_sweep(ad, range(2, 8), **kw)
    assert plan.sweep_batches(range(2, 8), 5, (160, 60), 4, max_columns=25) == [[2, 3], [4], [5], [6], [7]]
    pd.testing.assert_frame_equal(one.uns["nmf_k_sweep"]["table"], capped.uns["nmf_k_sweep"]["table"], check_exact=True)
    for key in one.uns["nmf_k_sweep"]:
        if isinstance(one.uns["nmf_k_sweep"][key], np.ndarray):
            np.testing.assert_array_equal(one.uns["nmf_k_sweep"][key], capped.uns["nmf_k_sweep"][key])
    for key in set(one.varm) | set(one.obsm):
        store = one.varm if key in one.varm else one.obsm
        other = capped.varm if key in capped.varm else capped.obsm
        np.testing.assert_array_equal(store[key], other[key])


def test_cpu_batches_keep_their_factor_rows_in_cache():
    from gpuc.nmf._consensus import sweep_batches
    from gpuc.nmf._run import CPU_BATCH_FACTOR_BYTES, cpu_batch_columns

    ks = list(range(2, 13))
    # pbmc3k-sized (2,638 x 2,000, 10 runs: 770 columns, 14 MB of factor rows) stays one batch
    assert sweep_batches(ks, 10, (2638, 2000), 4, max_columns=cpu_batch_columns((2638, 2000), 4)) == [ks]
    # 6,881 x 2,000 with 20 runs (1,540 columns, 55 MB) is split into batches whose factor rows fit the budget
    width = cpu_batch_columns((6881, 2000), 4)
    batches = sweep_batches(ks, 20, (6881, 2000), 4, max_columns=width)
    assert len(batches) > 1 and [k for b in batches for k in b] == ks
    assert all(20 * sum(b) * (6881 + 2000) * 4 <= CPU_BATCH_FACTOR_BYTES for b in batches)
    # at 100,000 cells no useful width fits: memory alone bounds the batches
    assert cpu_batch_columns((100_000, 2000), 4) is None
