"""cNMF's all-gene outputs (gene_spectra_tpm, gene_spectra_score, the final refit usages) of consensus_nmf and
nmf_refine, against cNMF 1.7.1's own files (``tests/data/nmf/cnmf_k7_all_genes.npz``, made by
``make_cnmf_all_genes.py`` beside it: pbmc68k_reduced counts, 700 cells x 765 genes, 500 factorised, k=7, density
thresholds 0.5 and 2.0), and on the stand-in GPU, on lazily read data and in small blocks against the CPU in memory.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from anndata import AnnData
from scipy.optimize import linear_sum_assignment, nnls

import gpuc
from gpuc._backend import get_backend
from gpuc.nmf._all_genes import gene_spectra, nnls_gram
from gpuc.nmf._hals import Operator, nnls_refit

CPU = get_backend("cpu")
THRESHOLDS = {"dt0_5": 0.5, "dt2_0": 2.0}  # cNMF's tutorial thresholds, as the reference names them
# the gates, per programme: Pearson r of the TPM and score spectra, overlap of the top 30 genes by score
MIN_R, TOP, MIN_TOP = 0.99, 30, 27


@pytest.fixture(scope="module")
def ref(test_data):
    z = np.load(test_data / "nmf" / "cnmf_k7_all_genes.npz", allow_pickle=False)
    return {name: z[name] for name in z.files}


@pytest.fixture(scope="module")
def pbmc(ref) -> AnnData:
    """The counts cNMF was given (all 765 genes), its 500 factorised genes flagged highly variable."""
    x = sp.csr_matrix((ref["data"], ref["indices"], ref["indptr"]), shape=tuple(ref["shape"]))
    ad = AnnData(x, obs=pd.DataFrame(index=ref["cells"]), var=pd.DataFrame(index=ref["genes"]))
    ad.var["highly_variable"] = ad.var_names.isin(ref["hvgs"])
    assert list(ad.var_names[ad.var["highly_variable"]]) == list(ref["hvgs"])  # cNMF keeps the file's gene order
    return ad


def _gates(tpm, score, usages, ref, dt, order=None):
    """The per-programme gates (``order[i]``: the reference programme matched to ours ``i``); returns the numbers."""
    order = np.arange(tpm.shape[0]) if order is None else order
    r_tpm, r_score, r_usage, top = [], [], [], []
    for i, j in enumerate(order):
        r_tpm.append(np.corrcoef(tpm[i], ref[f"{dt}_gene_spectra_tpm"][j])[0, 1])
        r_score.append(np.corrcoef(score[i], ref[f"{dt}_gene_spectra_score"][j])[0, 1])
        r_usage.append(np.corrcoef(usages[:, i], ref[f"{dt}_usages"][:, j])[0, 1])
        ours = np.argsort(-score[i], kind="stable")[:TOP]
        theirs = np.argsort(-ref[f"{dt}_gene_spectra_score"][j], kind="stable")[:TOP]
        top.append(len(set(ours) & set(theirs)))
    assert min(r_tpm) >= MIN_R, r_tpm
    assert min(r_score) >= MIN_R, r_score
    assert min(top) >= MIN_TOP, top
    return np.array(r_tpm), np.array(r_score), np.array(r_usage), np.array(top)


@pytest.mark.parametrize("dt", list(THRESHOLDS))
def test_all_gene_outputs_equal_cnmf_given_its_consensus(pbmc, ref, dt):
    """Given cNMF's consensus spectra, the engine's products equal cNMF's up to the accuracy of cNMF's own solvers
    (scikit-learn coordinate descent at tol 1e-4, TPM in float32)."""
    f = np.flatnonzero(pbmc.var["highly_variable"].to_numpy())
    counts = pbmc.X[:, f].toarray().astype(np.float64)
    op = Operator.build(CPU, counts / counts.std(axis=0, ddof=1), dtype=np.float64)  # cNMF's factorised matrix
    usages, _ = nnls_refit(CPU, op, ref[f"{dt}_median_spectra"])
    want = ref[f"{dt}_usages_consensus"]
    np.testing.assert_allclose(usages, want, rtol=0, atol=1e-3 * want.max())
    out = gene_spectra(pbmc.X, usages, f)
    r_tpm, r_score, r_usage, top = _gates(out.tpm, out.score, out.usages, ref, dt)
    assert r_tpm.min() > 0.99999 and r_score.min() > 0.99999 and r_usage.min() > 0.99999
    assert (top == TOP).all()
    for name, got in (("gene_spectra_tpm", out.tpm), ("gene_spectra_score", out.score), ("usages", out.usages)):
        theirs = ref[f"{dt}_{name}"]
        np.testing.assert_allclose(got, theirs, rtol=0, atol=1e-3 * np.abs(theirs).max(), err_msg=name)
    # on cNMF's own consensus usages the score is its OLS to rounding; the NNLS to cNMF's tolerance
    out = gene_spectra(pbmc.X, want, f)
    theirs = ref[f"{dt}_gene_spectra_score"]
    np.testing.assert_allclose(out.score, theirs, rtol=0, atol=1e-6 * np.abs(theirs).max())
    theirs = ref[f"{dt}_gene_spectra_tpm"]
    np.testing.assert_allclose(out.tpm, theirs, rtol=0, atol=1e-4 * np.abs(theirs).max())


@pytest.fixture(scope="module")
def fitted(pbmc):
    """consensus_nmf with cNMF's settings at both thresholds (the first also re-thresholded by nmf_refine)."""
    out = {}
    kw = {"n_runs": 20, "preprocessing": "sd", "metric": "euclidean", "device": "cpu", "random_state": 0}
    for dt, thr in THRESHOLDS.items():
        ad = pbmc.copy()
        gpuc.tl.consensus_nmf(ad, 7, density_threshold=thr, **kw)
        out[dt] = ad
    return out


@pytest.mark.parametrize("dt", list(THRESHOLDS))
def test_consensus_nmf_all_gene_outputs_match_cnmf(fitted, ref, dt):
    """End to end (gpuc's own restarts and consensus, cNMF's settings): the issue's gates per programme, programmes
    matched to cNMF's by their scores."""
    ad = fitted[dt]
    tpm, score = ad.varm["nmf_spectra_tpm"].T, ad.varm["nmf_spectra_score"].T
    assert tpm.shape == score.shape == (7, ad.n_vars)
    c = np.corrcoef(score, ref[f"{dt}_gene_spectra_score"])[:7, 7:]
    _, order = linear_sum_assignment(-c)
    _, _, r_usage, _ = _gates(tpm, score, ad.obsm["X_nmf_refit"], ref, dt, order)
    assert r_usage.min() >= 0.99
    # the getters return the same, as tables over every gene / cell
    got = gpuc.get.nmf_gene_spectra(ad, "tpm")
    assert list(got.index) == list(ad.var_names) and list(got.columns) == [f"P{i}" for i in range(1, 8)]
    np.testing.assert_array_equal(got.to_numpy(), ad.varm["nmf_spectra_tpm"])
    np.testing.assert_array_equal(gpuc.get.nmf_gene_scores(ad).to_numpy(), ad.varm["nmf_spectra_score"])
    usage = gpuc.get.nmf_usages(ad)  # cNMF's load_results(norm_usage=True)
    theirs = ref[f"{dt}_usages"][:, order]
    np.testing.assert_allclose(usage.to_numpy(), theirs / theirs.sum(1, keepdims=True), rtol=0, atol=0.02)
    np.testing.assert_allclose(usage.sum(axis=1), 1.0, rtol=1e-12)
    raw = gpuc.get.nmf_usages(ad, normalize=False)
    np.testing.assert_array_equal(raw.to_numpy(), ad.obsm["X_nmf_refit"])
    cons = gpuc.get.nmf_usages(ad, "consensus", normalize=False)
    np.testing.assert_array_equal(cons.to_numpy(), ad.obsm["X_nmf"])


def test_top_genes_by_score_rank_every_gene_like_cnmf(fitted, ref):
    """cNMF's top genes (load_results) rank its score over every gene; so does nmf_top_genes: genes outside the
    factorised 500 reach the programmes' top 30, where cNMF puts them."""
    ad, dt = fitted["dt0_5"], "dt0_5"
    top = gpuc.get.nmf_top_genes(ad, TOP, wide=True)
    c = np.corrcoef(ad.varm["nmf_spectra_score"].T, ref[f"{dt}_gene_spectra_score"])[:7, 7:]
    _, order = linear_sum_assignment(-c)
    hvg = set(ref["hvgs"])
    outside = 0
    for i, j in enumerate(order):
        theirs = set(ref["genes"][np.argsort(-ref[f"{dt}_gene_spectra_score"][j], kind="stable")[:TOP]])
        assert len(set(top[f"P{i + 1}"]) & theirs) >= MIN_TOP
        outside += len(set(top[f"P{i + 1}"]) - hvg)
    assert outside > 0
    weight = gpuc.get.nmf_top_genes(ad, 1000, by="weight")
    assert set(weight["gene"]) == hvg  # the consensus spectra hold only the factorised genes


def test_refine_recomputes_all_gene_outputs(fitted, same):
    """nmf_refine from the 2.0 consensus to 0.5 writes what consensus_nmf at 0.5 writes, all-gene outputs included."""
    ad = fitted["dt2_0"].copy()
    gpuc.tl.nmf_refine(ad, 0.5)
    want = fitted["dt0_5"]
    for slot, name in (("varm", "nmf_spectra_tpm"), ("varm", "nmf_spectra_score"), ("obsm", "X_nmf_refit")):
        np.testing.assert_array_equal(getattr(ad, slot)[name], getattr(want, slot)[name])


def test_all_gene_outputs_round_trip_h5ad(fitted, tmp_path, same):
    import anndata

    ad = fitted["dt0_5"]
    ad.write_h5ad(tmp_path / "a.h5ad")
    back = anndata.read_h5ad(tmp_path / "a.h5ad")
    same(back.varm, ad.varm)
    same(back.obsm, ad.obsm)
    assert back.uns["nmf"]["params"]["all_genes"] is True or back.uns["nmf"]["params"]["all_genes"] == 1
    for kind in ("score", "tpm", "consensus"):
        pd.testing.assert_frame_equal(gpuc.get.nmf_gene_spectra(back, kind), gpuc.get.nmf_gene_spectra(ad, kind))
    pd.testing.assert_frame_equal(gpuc.get.nmf_usages(back), gpuc.get.nmf_usages(ad))


# --------------------------------------------------------------------------------------------------------------------
# what the outputs are, on small data: an independent dense computation with scipy's exact NNLS
# --------------------------------------------------------------------------------------------------------------------
def _by_hand(counts: np.ndarray, usages: np.ndarray, f: np.ndarray, normalize: bool = True):
    """cNMF's three products, written out: dense, float64, scipy.optimize.nnls gene by gene and cell by cell."""
    t = counts / counts.sum(1, keepdims=True) * 1e6 if normalize else counts
    norm = usages / usages.sum(1, keepdims=True)
    tpm = np.array([nnls(norm, t[:, g])[0] for g in range(t.shape[1])]).T
    z = (t - t.mean(0)) / np.sqrt(np.maximum(t.var(0), 1e-12))
    score = np.linalg.lstsq(usages, z, rcond=None)[0]
    spec = tpm[:, f] / t[:, f].std(0)  # the spectra by the population SD (cNMF's tpm_stats)
    scaled = t[:, f] / t[:, f].std(0, ddof=1)  # the TPM by the sample SD (sc.pp.scale)
    final = np.array([nnls(spec.T, row)[0] for row in scaled])
    return tpm, score, final


def test_counts_layer_is_scaled_to_tpm_and_factorised_layer_follows_preprocessing(program_factory):
    ad = program_factory(n_cells=90, n_genes=45, seed=3)
    counts = ad.layers["counts"].toarray().astype(np.float64)
    ad.X = sp.csr_matrix(np.log1p(counts / counts.sum(1, keepdims=True) * 1e4))
    f = np.flatnonzero(ad.var["highly_variable"].to_numpy())
    kw = {"n_runs": 4, "device": "cpu", "density_threshold": 2.0}
    # bixverse-style fit on the log layer, cNMF's outputs from the counts: TPM of layers["counts"] over every gene
    a = ad.copy()
    gpuc.tl.consensus_nmf(a, 3, counts_layer="counts", **kw)
    tpm, score, final = _by_hand(counts, a.obsm["X_nmf"], f)
    np.testing.assert_allclose(a.varm["nmf_spectra_tpm"], tpm.T, rtol=1e-7, atol=1e-7 * tpm.max())
    np.testing.assert_allclose(a.varm["nmf_spectra_score"], score.T, rtol=1e-9, atol=1e-9 * np.abs(score).max())
    np.testing.assert_allclose(a.obsm["X_nmf_refit"], final, rtol=1e-6, atol=1e-7 * final.max())
    # without counts_layer and with preprocessing='none': the factorised layer over every gene, as it is
    b = ad.copy()
    gpuc.tl.consensus_nmf(b, 3, **kw)
    tpm, score, final = _by_hand(ad.X.toarray(), b.obsm["X_nmf"], f, normalize=False)
    np.testing.assert_allclose(b.varm["nmf_spectra_tpm"], tpm.T, rtol=1e-7, atol=1e-7 * tpm.max())
    np.testing.assert_allclose(b.varm["nmf_spectra_score"], score.T, rtol=1e-9, atol=1e-9 * np.abs(score).max())
    np.testing.assert_allclose(b.obsm["X_nmf_refit"], final, rtol=1e-6, atol=1e-7 * final.max())
    assert b.uns["nmf"]["params"]["counts_layer"] is None and b.uns["nmf"]["params"]["all_genes"] is True


def test_nnls_gram_matches_scipy_nnls():
    rng = np.random.default_rng(2)
    b = rng.gamma(0.5, size=(60, 6))
    b[:, 1] = 0.9 * b[:, 0] + 0.1 * b[:, 1]  # correlated columns: a harder problem
    y = rng.normal(size=(60, 40)) + b @ rng.gamma(1.0, size=(6, 40))
    got = nnls_gram(np, b.T @ b, b.T @ y)
    want = np.array([nnls(b, y[:, j])[0] for j in range(y.shape[1])]).T
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7 * np.abs(want).max())
    assert (got >= 0).all()


# --------------------------------------------------------------------------------------------------------------------
# where the matrix lives: blocks, the stand-in GPU, a lazily read (dask) layer
# --------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small(pbmc, ref):
    f = np.flatnonzero(pbmc.var["highly_variable"].to_numpy())
    return pbmc.X[:300], ref["dt0_5_usages_consensus"][:300], f


@pytest.mark.parametrize("form", ["csr", "csc", "dense"])
def test_blocks_give_the_same_outputs(small, form):
    x, u, f = small
    want = gene_spectra(x, u, f)
    x = {"csr": x, "csc": x.tocsc(), "dense": x.toarray()}[form]
    got = gene_spectra(x, u, f, block_bytes=20_000)  # dozens of blocks
    for name in ("tpm", "score", "usages", "mean", "sd"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("sparse", [True, False])
def test_all_gene_outputs_on_device_equal_cpu(standin_gpu, small, sparse):
    """The stand-in GPU (arrays that refuse implicit host copies): same numbers, computed where the data lives; only
    the k x genes and cells x k results (and a few scalars) come back."""
    from gpuc._testing.standin import Transfers

    x, u, f = small
    x = x if sparse else x.toarray()
    want = gene_spectra(x, u, f, block_bytes=200_000)
    xd = standin_gpu.asarray(x)
    Transfers.reset()
    got = gene_spectra(xd, u, f, block_bytes=200_000)
    k, m, n = u.shape[1], x.shape[0], x.shape[1]
    assert Transfers.to_host < 8 * (4 * k * n + 2 * m * k + 2 * n) + 10_000  # never the matrix (8 * m * n bytes)
    for name in ("tpm", "score", "usages", "mean", "sd"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-12, atol=1e-14, err_msg=name)


def test_all_gene_outputs_of_a_lazily_read_layer(pbmc, small):
    da = pytest.importorskip("dask.array")
    x, u, f = small
    want = gene_spectra(x, u, f)
    got = gene_spectra(da.from_array(x, chunks=(70, 200)), u, f)
    for name in ("tpm", "score", "usages", "mean", "sd"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-10, atol=1e-12, err_msg=name)
    # through the tool: a lazily read AnnData gives what the same data in memory gives
    ad = pbmc.copy()
    lazy = ad.copy()
    lazy.X = da.from_array(ad.X, chunks=(250, 300))
    kw = {"n_runs": 3, "preprocessing": "sd", "device": "cpu", "density_threshold": 2.0}
    gpuc.tl.consensus_nmf(ad, 5, **kw)
    gpuc.tl.consensus_nmf(lazy, 5, **kw)
    for slot, name in (("varm", "nmf_spectra_tpm"), ("varm", "nmf_spectra_score"), ("obsm", "X_nmf_refit")):
        got, want = getattr(lazy, slot)[name], getattr(ad, slot)[name]
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12 * np.abs(want).max(), err_msg=name)


# --------------------------------------------------------------------------------------------------------------------
# options and refusals
# --------------------------------------------------------------------------------------------------------------------
def test_all_genes_off_and_refusals(program_factory, unchanged):
    ad = program_factory(n_cells=80, n_genes=30, seed=5)
    kw = {"n_runs": 3, "device": "cpu", "density_threshold": 2.0}
    with unchanged(ad), pytest.raises(KeyError, match=r"'raw' not found in adata\.layers"):
        gpuc.tl.consensus_nmf(ad, 2, counts_layer="raw", **kw)
    ad.layers["scaled"] = ad.layers["counts"].toarray() - 1.0
    with unchanged(ad), pytest.raises(ValueError, match=r"negative values.*counts_layer=.*Nothing was written"):
        gpuc.tl.consensus_nmf(ad, 2, layer="counts", counts_layer="scaled", **kw)
    with unchanged(ad), pytest.raises(TypeError, match="all_genes"):
        gpuc.tl.consensus_nmf(ad, 2, layer="counts", all_genes="yes", **kw)
    gpuc.tl.consensus_nmf(ad, 2, layer="counts", all_genes=False, **kw)
    assert "nmf_spectra_tpm" not in ad.varm and "X_nmf_refit" not in ad.obsm
    with pytest.raises(KeyError, match="all_genes=True"):
        gpuc.get.nmf_gene_spectra(ad, "tpm")
    with pytest.raises(KeyError, match="all_genes=True"):
        gpuc.get.nmf_usages(ad)
    with pytest.raises(ValueError, match="kind="):
        gpuc.get.nmf_usages(ad, "final")
    with pytest.raises(ValueError, match="kind="):
        gpuc.get.nmf_gene_spectra(ad, "median")
    # scores are computed from the matrix when not stored: over every gene
    assert gpuc.get.nmf_gene_scores(ad).shape == (ad.n_vars, 2)
    # a later call with the outputs on replaces them; one without removes the earlier ones
    gpuc.tl.consensus_nmf(ad, 2, layer="counts", **kw)
    assert ad.varm["nmf_spectra_tpm"].shape == (ad.n_vars, 2)
    gpuc.tl.consensus_nmf(ad, 2, layer="counts", all_genes=False, **kw)
    assert "nmf_spectra_tpm" not in ad.varm and "X_nmf_refit" not in ad.obsm
