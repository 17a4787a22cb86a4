"""gpuc.tl.nmf_project: usages of new cells on fixed programmes.

References: starCAT (starcatpy 1.0.10) ``fit_transform`` usages on cNMF 1.7.1's k=7 programmes
(``tests/data/nmf/starcat``, made by the script there), scipy's exact active-set NNLS, and gpuc's own
``consensus_nmf`` usages for the self-projection.
"""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
import scipy.optimize
import scipy.sparse as sp
from anndata import AnnData

import gpuc
from gpuc._errors import GpucWarning
from gpuc.nmf._project import GeneMoments, ProjectOptions, block_moments, gene_factors, project


# ---- fixtures -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def starcat(test_data):
    """The query counts, the starCAT reference (genes x programmes) and starCAT's usages."""
    d = test_data / "nmf"
    z = np.load(d / "pbmc68k_counts_700x500.npz", allow_pickle=False)
    x = sp.csr_matrix((z["data"].astype(np.float32), z["indices"], z["indptr"]), shape=tuple(z["shape"]))
    obs = pd.DataFrame(index=z["obs"].astype(str))
    s = dict(np.load(d / "starcat" / "starcat_usages.npz", allow_pickle=False))
    thin = sp.csr_matrix(
        (s["thinned_data"].astype(np.float32), s["thinned_indices"], s["thinned_indptr"]),
        shape=tuple(s["thinned_shape"]),
    )
    queries = {
        "same": AnnData(x, obs=obs.copy(), var=pd.DataFrame(index=z["var"].astype(str))),
        "thinned": AnnData(thin, obs=obs.copy(), var=pd.DataFrame(index=s["thinned_genes"].astype(str))),
    }
    ref = pd.read_csv(d / "starcat" / "reference.tsv", sep="\t", index_col=0).T  # starCAT files: programmes x genes
    return queries, ref, s


@pytest.fixture(scope="module")
def fitted(program_factory):
    """A small consensus_nmf fit (cNMF-style: counts, genes scaled by their SD) to project onto."""
    a = program_factory(n_cells=160, n_genes=60, k=3, seed=3)
    gpuc.tl.consensus_nmf(a, 3, n_runs=4, layer="counts", preprocessing="sd", device="cpu", dtype="float64")
    return a


def _pearson(a, b):
    return np.array([np.corrcoef(a[:, i], b[:, i])[0, 1] for i in range(a.shape[1])])


# ---- what it computes ----------------------------------------------------------------------------------------------
def test_self_projection_gives_consensus_usages(fitted):
    q = fitted.copy()
    for scale in ("query", "reference"):
        gpuc.tl.nmf_project(q, fitted, layer="counts", scale=scale, dtype="float64", device="cpu", key_added=scale)
        u, want = q.obsm[f"X_{scale}"], fitted.obsm["X_nmf"]
        np.testing.assert_allclose(u, want, rtol=0, atol=1e-4 * np.abs(want).max())
        np.testing.assert_allclose(q.uns[scale]["rel_error"], fitted.uns["nmf"]["rel_error"], rtol=1e-6)
        assert q.uns[scale]["params"]["preprocessing"] == "sd"  # the reference's, read from its params
    # row blocks: the same usages within the stopping rule
    gpuc.tl.nmf_project(q, fitted, layer="counts", dtype="float64", device="cpu", block_size=37, key_added="b")
    assert q.uns["b"]["n_blocks"] == 5
    np.testing.assert_allclose(q.obsm["X_b"], fitted.obsm["X_nmf"], rtol=0, atol=1e-4 * fitted.obsm["X_nmf"].max())


@pytest.mark.parametrize("name", ["same", "thinned"])
def test_starcat_parity(starcat, name):
    queries, ref, s = starcat
    q = queries[name].copy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gpuc.tl.nmf_project(q, ref, normalize=True, device="cpu")
    missing = [str(w.message) for w in caught if issubclass(w.category, GpucWarning)]
    if name == "thinned":  # 20 of the 500 reference genes are absent: warned, with the fraction
        assert len(missing) == 1 and "20 of the reference's 500 genes (4.0%)" in missing[0]
    else:
        assert not missing
    out = q.uns["nmf_project"]
    assert list(out["programs"]) == list(s["programs"]) and out["params"]["preprocessing"] == "sd"
    assert sorted(out["genes"]) == sorted(s[f"{name}_overlap_genes"])
    assert out["fraction_missing"] == pytest.approx(0.04 if name == "thinned" else 0.0)
    # starCAT's MU solver stops at tol 1e-4 short of the optimum; per-programme Pearson is the bar (0.99)
    assert _pearson(q.obsm["X_nmf_project"], s[f"{name}_usage"]).min() > 0.999
    assert _pearson(q.obsm["X_nmf_project_normalized"], s[f"{name}_usage_norm"]).min() > 0.999
    np.testing.assert_allclose(q.obsm["X_nmf_project_normalized"].sum(1), 1.0, rtol=1e-12)
    # the same scale as starCAT's usages (its SD has ddof=0: usages differ by sqrt((n-1)/n) = 0.9993)
    big = s[f"{name}_usage"] > 0.1 * s[f"{name}_usage"].max()
    ratio = np.median(q.obsm["X_nmf_project"][big] / s[f"{name}_usage"][big])
    assert abs(ratio - 1) < 0.01


def test_usages_are_the_exact_nnls_optimum(starcat):
    queries, ref, _ = starcat
    q = queries["thinned"].copy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GpucWarning)
        gpuc.tl.nmf_project(q, ref, dtype="float64", device="cpu", tol=1e-10, max_iter=5000)
    out = q.uns["nmf_project"]
    cols = q.var_names.get_indexer(out["genes"])
    x = q.X[:, cols].toarray().astype(np.float64) * out["gene_scale"][None, :]
    # the gene scale is the query's own SD (ddof=1)
    np.testing.assert_allclose(
        out["gene_scale"], 1 / q.X[:, cols].toarray().astype(np.float64).std(0, ddof=1), rtol=1e-6
    )
    s = out["spectra"].T
    for i in range(0, 700, 35):
        u, _ = scipy.optimize.nnls(s.T, x[i])
        np.testing.assert_allclose(q.obsm["X_nmf_project"][i], u, rtol=0, atol=1e-6 * max(u.max(), 1))


def test_engine_blocks_on_dense_and_sparse_agree(fitted, disable_numba):
    s = fitted.varm["nmf_spectra"][fitted.var["highly_variable"].to_numpy()].T
    cols = np.flatnonzero(fitted.var["highly_variable"].to_numpy())
    x = fitted.layers["counts"]
    mom = block_moments(x, cols)
    assert isinstance(mom, GeneMoments) and mom.n == x.shape[0]
    f = gene_factors(mom, "sd")
    opts = ProjectOptions(dtype=np.float64)
    a = project(x, s, f, genes=cols, block_rows=50, options=opts)
    b = project(x.toarray(), s, f, genes=cols, block_rows=50, options=opts)
    np.testing.assert_allclose(a.usages, b.usages, rtol=1e-7, atol=1e-9)
    assert a.n_blocks == 4 and a.rel_error == pytest.approx(b.rel_error, rel=1e-8)
    # the fused CPU kernels (above) against the array code the GPU runs, on the same sparse blocks
    fused = (block_moments(x, cols), a)
    disable_numba()
    mom2 = block_moments(x, cols)
    np.testing.assert_allclose(mom2.total_sq, fused[0].total_sq, rtol=1e-12)
    c = project(x, s, f, genes=cols, block_rows=50, options=opts)
    np.testing.assert_allclose(c.usages, a.usages, rtol=1e-7, atol=1e-9)


# ---- inputs and outputs -------------------------------------------------------------------------------------------
def test_missing_genes_past_threshold_refused(starcat, unchanged):
    queries, ref, _ = starcat
    q = queries["same"][:, :350].copy()  # 30 % of the reference's genes missing
    with unchanged(q), pytest.raises(ValueError, match=r"150 of the reference's 500 genes \(30.0%\).*max_missing=0.2"):
        gpuc.tl.nmf_project(q, ref)
    with pytest.warns(GpucWarning, match=r"30.0%"):
        gpuc.tl.nmf_project(q, ref, max_missing=0.5, device="cpu")
    assert len(q.uns["nmf_project"]["missing_genes"]) == 150
    with unchanged(q), pytest.raises(ValueError, match="none of the reference"):
        gpuc.tl.nmf_project(q, ref.set_axis([f"x{i}" for i in range(500)]))


def test_bad_arguments_refused_before_any_write(starcat, fitted, unchanged):
    queries, ref, _ = starcat
    q = queries["same"].copy()
    with unchanged(q), pytest.raises(TypeError, match="genes x programmes"):
        gpuc.tl.nmf_project(q, ref.to_numpy())
    with unchanged(q), pytest.raises(ValueError, match="scale='reference' needs the reference's matrix"):
        gpuc.tl.nmf_project(q, ref, scale="reference")
    with unchanged(q), pytest.raises(ValueError, match="non-negative"):
        gpuc.tl.nmf_project(q, -ref)
    with unchanged(q), pytest.raises(KeyError, match="consensus_nmf"):
        gpuc.tl.nmf_project(q, fitted, key="other")
    neg = q.copy()
    neg.X = neg.X.copy()
    neg.X.data[0] = -1
    with unchanged(neg), pytest.raises(ValueError, match="negative values"):
        gpuc.tl.nmf_project(neg, ref, preprocessing="none")
    with unchanged(q), pytest.raises(ValueError, match="max_missing"):
        gpuc.tl.nmf_project(q, ref, max_missing=1.0)
    q.obsm["X_pca"] = np.zeros((q.n_obs, 2))
    with unchanged(q), pytest.raises(ValueError, match="would overwrite"):
        gpuc.tl.nmf_project(q, ref, key_added="pca")


def test_write_read_round_trip_and_copy(starcat, tmp_path, same):
    queries, ref, _ = starcat
    q = queries["thinned"].copy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GpucWarning)
        out = gpuc.tl.nmf_project(q, ref, normalize=True, copy=True, device="cpu")
    assert "nmf_project" not in q.uns and "X_nmf_project" not in q.obsm
    out.write_h5ad(tmp_path / "p.h5ad")
    back = __import__("anndata").read_h5ad(tmp_path / "p.h5ad")
    same(back, out)
    # a rerun without normalize drops the earlier normalised usages
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GpucWarning)
        gpuc.tl.nmf_project(out, ref, device="cpu")
    assert "X_nmf_project_normalized" not in out.obsm


def test_projected_usages_plot(starcat):
    queries, ref, _ = starcat
    q = queries["same"].copy()
    q.obsm["X_umap"] = np.random.default_rng(0).normal(size=(q.n_obs, 2))
    gpuc.tl.nmf_project(q, ref, device="cpu")
    fig = gpuc.pl.nmf_usage(q, key="nmf_project", show=False)
    assert "projected onto programmes fitted elsewhere" in fig._suptitle.get_text()
    assert [a.get_title() for a in fig.axes if a.get_title()][:2] == ["P1", "P2"]


def test_empty_cells_get_zero_usages(starcat):
    queries, ref, _ = starcat
    q = queries["same"].copy()
    x = q.X.tolil()
    x[3, :] = 0
    q.X = x.tocsr()
    with pytest.warns(GpucWarning, match="1 cell"):
        gpuc.tl.nmf_project(q, ref, normalize=True, device="cpu")
    assert (q.obsm["X_nmf_project"][3] == 0).all() and (q.obsm["X_nmf_project_normalized"][3] == 0).all()
    assert q.uns["nmf_project"]["n_empty_cells"] == 1


# ---- devices and Dask --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sparse", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_standin_gpu_equals_cpu(starcat, standin_gpu, sparse):
    # the GPU path (fused numba-cuda sweep under the CUDA simulator, arrays that refuse host round trips) vs the CPU
    queries, ref, _ = starcat
    q = queries["same"][:64].copy()
    if not sparse:
        q.X = q.X.toarray()
    gpuc.tl.nmf_project(q, ref, device="cpu", block_size=32, key_added="cpu", dtype="float64")
    gpuc.tl.nmf_project(q, ref, device="gpu", block_size=32, key_added="gpu", dtype="float64")
    assert q.uns["gpu"]["device"] == "gpu" and isinstance(q.obsm["X_gpu"], np.ndarray)
    np.testing.assert_allclose(q.obsm["X_gpu"], q.obsm["X_cpu"], rtol=1e-6, atol=1e-9 * q.obsm["X_cpu"].max())


def test_lazy_matrix_equals_in_memory(starcat):
    da = pytest.importorskip("dask.array")
    queries, ref, _ = starcat
    q = queries["same"].copy()
    gpuc.tl.nmf_project(q, ref, device="cpu", block_size=128, key_added="mem")
    lazy = q.copy()
    lazy.X = da.from_array(q.X, chunks=(100, 500), asarray=False)
    gpuc.tl.nmf_project(lazy, ref, device="cpu", block_size=128, key_added="lazy")
    np.testing.assert_array_equal(lazy.obsm["X_lazy"], q.obsm["X_mem"])
    np.testing.assert_array_equal(lazy.uns["lazy"]["gene_scale"], q.uns["mem"]["gene_scale"])


@pytest.mark.slow
def test_dask_cluster_equals_in_process(starcat, local_cluster):
    da = pytest.importorskip("dask.array")
    queries, ref, _ = starcat
    q = queries["thinned"].copy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GpucWarning)
        gpuc.tl.nmf_project(q, ref, device="cpu", block_size=128, key_added="here")
        lazy = q.copy()
        lazy.X = da.from_array(q.X, chunks=(200, 480), asarray=False)
        with local_cluster(2) as client:
            gpuc.tl.nmf_project(q, ref, device="cpu", block_size=128, client=client, key_added="there")
            gpuc.tl.nmf_project(lazy, ref, device="cpu", block_size=128, client=client, key_added="lazy")
    assert q.uns["there"]["n_blocks"] == 6
    np.testing.assert_array_equal(q.obsm["X_there"], q.obsm["X_here"])
    np.testing.assert_array_equal(lazy.obsm["X_lazy"], q.obsm["X_here"])
