"""One ``n_jobs`` convention for all CPU work: the settings default, ``-1``, bad values, and results bit-identical for
any thread count (every parallel sum is merged in a fixed order)."""

from __future__ import annotations

import os
import threading
import warnings

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scanpy as sc
import scipy.sparse as sp

import gpuc
from gpuc._settings import settings
from gpuc._utils import cpu_threads, current_n_jobs, resolve_n_jobs

CORES = len(os.sched_getaffinity(0))


def _programs(n_cells: int = 160, n_genes: int = 60, k: int = 3, seed: int = 0, *, sparse: bool = True) -> ad.AnnData:
    rng = np.random.default_rng(seed)
    spectra = np.full((k, n_genes), 0.05)
    for j, block in enumerate(np.array_split(np.arange(n_genes), k)):
        spectra[j, block] = rng.uniform(2, 6, block.size)
    usage = rng.dirichlet(np.full(k, 0.3), n_cells) * rng.uniform(20, 40, (n_cells, 1))
    x = rng.poisson(usage @ spectra).astype(np.float32)
    a = ad.AnnData(sp.csr_matrix(x) if sparse else x)
    a.var_names = [f"g{j}" for j in range(n_genes)]
    a.var["highly_variable"] = True
    return a


def _bulk(n_genes: int = 600, seed: int = 0) -> ad.AnnData:
    rng = np.random.default_rng(seed)
    mean = rng.gamma(2.0, 50.0, n_genes)
    x = rng.negative_binomial(5, 5 / (5 + np.outer(np.r_[np.ones(4), np.full(4, 1.5)], mean)))
    obs = pd.DataFrame({"condition": np.repeat(["a", "b"], 4)}, index=[f"s{i}" for i in range(8)])
    return ad.AnnData(x.astype(np.int64), obs=obs)


# ---- the convention ------------------------------------------------------------------------------------------------
@pytest.fixture
def quiet_machine(monkeypatch):
    """No other process's threads runnable: the default n_jobs takes every core (see test_threads for the load)."""
    import gpuc._utils as utils

    monkeypatch.setattr(utils, "other_runnable", lambda: 0)


def test_settings_default_is_all_cores_and_minus_one_means_all_cores(monkeypatch, quiet_machine):
    assert settings.n_jobs == -1
    assert resolve_n_jobs(None) == CORES
    assert resolve_n_jobs(-1) == CORES
    assert resolve_n_jobs(3) == 3
    monkeypatch.setattr(settings, "n_jobs", 1)
    assert resolve_n_jobs(None) == 1
    assert "n_jobs=1" in repr(settings)


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True])
def test_bad_n_jobs_raise(bad, monkeypatch):
    err = ValueError if isinstance(bad, int) and not isinstance(bad, bool) else TypeError
    with pytest.raises(err, match="n_jobs"):
        resolve_n_jobs(bad)
    with pytest.raises(err, match="n_jobs"):
        settings.n_jobs = bad
    assert settings.n_jobs == -1
    a = _programs(80, 30)
    before = a.copy()
    with pytest.raises(err, match="n_jobs"):
        gpuc.tl.consensus_nmf(a, 3, n_runs=4, device="cpu", n_jobs=bad)
    assert set(a.uns) == set(before.uns) and set(a.obsm) == set(before.obsm)


def test_cpu_threads_sets_and_restores_numba_and_blas(quiet_machine):
    import numba
    from threadpoolctl import threadpool_info

    from gpuc.nmf._hals_cpu import kernels

    def blas() -> list[int]:
        return [d["num_threads"] for d in threadpool_info() if d["user_api"] == "blas"]

    kernels()  # numba loaded
    n0, b0 = numba.get_num_threads(), blas()
    with cpu_threads(1) as n:
        assert n == 1 and current_n_jobs() == 1
        kernels()
        assert numba.get_num_threads() == 1
        assert all(t == 1 for t in blas())
        with cpu_threads(1):  # nested, same count: nothing changes
            assert numba.get_num_threads() == 1
    assert numba.get_num_threads() == n0 and blas() == b0
    assert current_n_jobs() == resolve_n_jobs(None)


# ---- results do not depend on the thread count ---------------------------------------------------------------------
@pytest.mark.parametrize("sparse", [True, False])
def test_consensus_nmf_identical_for_any_n_jobs(sparse):
    a = _programs(sparse=sparse)
    for nj in (1, 2):
        gpuc.tl.consensus_nmf(a, 3, n_runs=6, device="cpu", n_jobs=nj, key_added=f"j{nj}")
    assert a.uns["j1"]["params"]["n_jobs"] == 1 and a.uns["j2"]["params"]["n_jobs"] == 2
    np.testing.assert_array_equal(a.obsm["X_j1"], a.obsm["X_j2"])
    np.testing.assert_array_equal(a.varm["j1_spectra"], a.varm["j2_spectra"])
    np.testing.assert_array_equal(a.uns["j1"]["run_errors"], a.uns["j2"]["run_errors"])
    np.testing.assert_array_equal(a.uns["j1"]["run_n_iter"], a.uns["j2"]["run_n_iter"])
    assert a.uns["j1"]["stability"] == a.uns["j2"]["stability"]


def test_nmf_k_sweep_identical_for_any_n_jobs():
    a = _programs()
    for nj in (1, 2):
        gpuc.tl.nmf_k_sweep(a, [2, 3, 4], n_runs=4, device="cpu", n_jobs=nj, key_added=f"s{nj}")
    pd.testing.assert_frame_equal(a.uns["s1"]["table"], a.uns["s2"]["table"], check_exact=True)


@pytest.mark.filterwarnings("ignore::gpuc.ConvergenceWarning")
def test_consensus_kmeans_with_many_components_identical_for_any_n_jobs():
    # a pool of 12 x 30 = 360 components: more than one of scikit-learn's 256-row k-means chunks
    a = _programs(200, 80, k=4)
    for nj in (1, 2):
        gpuc.tl.consensus_nmf(a, 12, n_runs=30, max_iter=30, device="cpu", n_jobs=nj, key_added=f"m{nj}")
    np.testing.assert_array_equal(a.varm["m1_spectra"], a.varm["m2_spectra"])
    pd.testing.assert_frame_equal(a.uns["m1"]["components"], a.uns["m2"]["components"], check_exact=True)


def _pbmc() -> ad.AnnData:
    a = sc.datasets.pbmc68k_reduced()
    a.X = sp.csr_matrix(np.rint(np.abs(a.X) * 3).astype(np.float32))
    return a


def test_metacells_identical_for_any_n_jobs():
    a = _pbmc()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gpuc.ConvergenceWarning)
        for nj in (1, 2):
            gpuc.tl.metacells(a, 20, device="cpu", max_iter=4, min_iter=4, n_jobs=nj, key_added=f"mc{nj}")
            gpuc.tl.metacell_quality(a, key=f"mc{nj}", device="cpu", n_jobs=nj)
    np.testing.assert_array_equal(a.obs["mc1"].astype(str), a.obs["mc2"].astype(str))
    assert (a.obsm["mc1_weights"] != a.obsm["mc2_weights"]).nnz == 0
    assert (a.obsm["mc1_archetypes"] != a.obsm["mc2_archetypes"]).nnz == 0
    np.testing.assert_array_equal(a.uns["mc1"]["rss"], a.uns["mc2"]["rss"])
    pd.testing.assert_frame_equal(a.uns["mc1_quality"], a.uns["mc2_quality"], check_exact=True)


@pytest.mark.parametrize("gradient", ["dense", "restricted"])
def test_metacell_b_update_identical_for_any_n_jobs(gradient):
    """Both B-update kernels (row chunks in parallel, column minima merged in chunk order) against one thread."""
    from gpuc._backend import get_backend
    from gpuc.metacells._kernel import build_kernel
    from gpuc.metacells._solver import update_a, update_b

    bk = get_backend("cpu")
    x = _pbmc().obsm["X_pca"][:, :10].astype(np.float64)
    m, _ = build_kernel(bk, x)
    kmat = sp.csr_matrix(m @ m.T)
    rng = np.random.default_rng(0)
    b0 = sp.csc_matrix(
        (np.ones(25), (rng.choice(x.shape[0], 25, replace=False), np.arange(25))), shape=(x.shape[0], 25)
    )
    out = []
    for nj in (1, 2):
        with cpu_threads(nj):
            a = update_a(bk, kmat, b0, "uniform", 20)
            b = update_b(bk, kmat, a, b0, 20, gradient=gradient)
        out.append((a, b))
    assert (out[0][0] != out[1][0]).nnz == 0 and (out[0][1] != out[1][1]).nnz == 0


def test_deseq_and_vst_identical_for_any_n_jobs(monkeypatch):
    import gpuc.deseq._threads as threads

    monkeypatch.setattr(threads, "BLOCK_ENTRIES", 1024)  # 128-gene blocks: several blocks run in the thread pool
    a = _bulk()
    _small_stage_spans(monkeypatch)
    for nj in (1, 2):
        gpuc.tl.deseq(a, design="~condition", device="cpu", n_jobs=nj, key_added=f"d{nj}")
        gpuc.tl.vst(a, device="cpu", n_jobs=nj, key_added=f"v{nj}")
    for field in [c[3:] for c in a.var.columns if c.startswith("d1_")]:
        np.testing.assert_array_equal(a.var[f"d1_{field}"].to_numpy(), a.var[f"d2_{field}"].to_numpy(), err_msg=field)
    np.testing.assert_array_equal(a.layers["v1"], a.layers["v2"])
    assert a.uns["d2"]["params"]["n_jobs"] == 2


def _small_stage_spans(monkeypatch) -> None:
    import gpuc.deseq._threads as threads

    # 200-gene stage spans (each with two solver blocks inside) instead of 2^17 entries
    monkeypatch.setattr(threads, "STAGE_ENTRIES", 1)
    monkeypatch.setattr(threads, "STAGE_MIN_GENES", 200)


def test_deseq_with_cooks_refit_identical_for_any_n_jobs(monkeypatch):
    """Stage spans run the outlier replacement and refit inside each span, in parallel."""
    import gpuc.deseq._threads as threads

    monkeypatch.setattr(threads, "BLOCK_ENTRIES", 1024)
    _small_stage_spans(monkeypatch)
    rng = np.random.default_rng(3)
    n_genes, n = 700, 16
    mean = rng.gamma(2.0, 50.0, n_genes)
    x = rng.negative_binomial(5, 5 / (5 + np.outer(np.r_[np.ones(8), np.full(8, 1.5)], mean)))
    x[0, rng.choice(n_genes, 60, replace=False)] *= 40  # outliers: Cook's replacement and refit
    obs = pd.DataFrame({"condition": np.repeat(["a", "b"], 8)}, index=[f"s{i}" for i in range(n)])
    a = ad.AnnData(x.astype(np.int64), obs=obs)
    for nj in (1, 2):
        gpuc.tl.deseq(a, design="~condition", device="cpu", n_jobs=nj, key_added=f"d{nj}")
    assert a.var["d1_replace"].sum() > 0  # the refit ran
    for field in [c[3:] for c in a.var.columns if c.startswith("d1_")]:
        np.testing.assert_array_equal(a.var[f"d1_{field}"].to_numpy(), a.var[f"d2_{field}"].to_numpy(), err_msg=field)


def test_deseq_lrt_in_stage_spans_equals_one_span(monkeypatch):
    """The likelihood-ratio test and the Cook's refit computed span by span equal the fit of all genes in one span."""
    rng = np.random.default_rng(4)
    n_genes, n = 700, 16
    mean = rng.gamma(2.0, 50.0, n_genes)
    x = rng.negative_binomial(5, 5 / (5 + np.outer(np.r_[np.ones(8), np.full(8, 1.5)], mean)))
    x[0, rng.choice(n_genes, 60, replace=False)] *= 40
    obs = pd.DataFrame({"condition": np.repeat(["a", "b"], 8)}, index=[f"s{i}" for i in range(n)])
    a = ad.AnnData(x.astype(np.int64), obs=obs)
    kw = {"design": "~condition", "test": "lrt", "reduced": "~1", "fit_type": "mean", "device": "cpu"}
    gpuc.tl.deseq(a, key_added="one", **kw)  # 700 x 16 entries: one span
    with monkeypatch.context() as m:
        import gpuc.deseq._threads as threads

        m.setattr(threads, "STAGE_ENTRIES", 1)
        m.setattr(threads, "STAGE_MIN_GENES", 150)  # 5 spans
        gpuc.tl.deseq(a, key_added="spans", **kw)
    assert a.var["one_replace"].sum() > 0
    for field in [c[4:] for c in a.var.columns if c.startswith("one_")]:
        ref, got = a.var[f"one_{field}"].to_numpy(), a.var[f"spans_{field}"].to_numpy()
        if ref.dtype.kind in "biuO":
            np.testing.assert_array_equal(got, ref, err_msg=field)
        else:  # BLAS may round a span's trailing rows with another micro-kernel
            np.testing.assert_allclose(got, ref, rtol=1e-12, atol=0, equal_nan=True, err_msg=field)
    ref, got = gpuc.get.deseq_results(a, key="one"), gpuc.get.deseq_results(a, key="spans")
    assert "stat" in ref and ref["pvalue"].notna().sum() > 600  # the LRT's table
    for col in ref.select_dtypes("number").columns:
        np.testing.assert_allclose(got[col], ref[col], rtol=1e-12, atol=0, equal_nan=True, err_msg=col)


def test_gene_blocks_run_on_n_jobs_threads(monkeypatch):
    import gpuc.deseq._threads as threads

    seen = []

    class Pool:
        def __init__(self, max_workers: int, **kwargs: object) -> None:
            seen.append(max_workers)

        def map(self, fn, blocks):
            return map(fn, blocks)

    monkeypatch.setattr(threads, "ThreadPoolExecutor", Pool)
    monkeypatch.setattr(threads, "_POOLS", {})
    blocks = [slice(i, i + 1) for i in range(8)]
    with cpu_threads(1):
        assert threads.map_blocks(blocks, lambda b: b.start) == list(range(8))
    with cpu_threads(3):
        assert threads.map_blocks(blocks, lambda b: b.start) == list(range(8))
        # each block sees the caller's thread count, and a second map reuses the executor
        assert threads.map_blocks(blocks, lambda b: threads.n_threads()) == [3] * 8
    assert seen == [3]


def test_gene_blocks_in_real_threads_keep_block_order():
    import gpuc.deseq._threads as threads

    blocks = [slice(i, i + 1) for i in range(40)]
    with cpu_threads(2):
        names = threads.map_blocks(blocks, lambda b: (b.start, threading.current_thread().name))
    assert [i for i, _ in names] == list(range(40))
    assert all(name.startswith("gpuc-deseq") for _, name in names)


def test_exact_knn_identical_for_any_n_jobs():
    """More queries than FAISS's SGEMM block (4,096): a multi-threaded SGEMM rounded some distances differently."""
    from gpuc._backend import get_backend

    x = np.random.default_rng(0).normal(size=(4500, 30)).astype(np.float32)
    with cpu_threads(1):
        d1, i1 = get_backend("cpu").knn(x, 15, method="exact")
    with cpu_threads(2):
        d2, i2 = get_backend("cpu").knn(x, 15, method="exact")
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_array_equal(d1, d2)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_gene_blocks_in_a_forked_child_get_their_own_threads():
    """A forked child inherits the parent's executor but not its threads: it must not queue work on it (a hang)."""
    import multiprocessing

    import gpuc.deseq._threads as threads

    blocks = [slice(i, i + 1) for i in range(8)]
    with cpu_threads(2):
        threads.map_blocks(blocks, lambda b: b.start)  # the parent's executor exists now
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        result = pool.apply_async(_map_blocks_in_child).get(timeout=60)
    assert result == list(range(8))


def _map_blocks_in_child() -> list[int]:
    import gpuc.deseq._threads as threads

    with cpu_threads(2):
        return threads.map_blocks([slice(i, i + 1) for i in range(8)], lambda b: b.start)
