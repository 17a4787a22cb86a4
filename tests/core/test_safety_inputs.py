"""Fits know their inputs: refine, getters and plots align by name where that is defined, and refuse reordered or
changed matrices, objects joined by ``anndata.concat`` and hand-edited entries with a message that says what to do
(issue 41)."""

from __future__ import annotations

import anndata as ad
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

import gpuc


def _programs(n_cells=40, n_genes=24, seed=3):
    """Poisson counts from 3 planted programmes (sparse float32), every gene highly variable."""
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    spectra = np.full((3, n_genes), 0.05)
    for j, block in enumerate(np.array_split(np.arange(n_genes), 3)):
        spectra[j, block] = rng.uniform(2, 6, block.size)
    usage = rng.dirichlet(np.full(3, 0.3), n_cells) * rng.uniform(20, 40, (n_cells, 1))
    a = ad.AnnData(sp.csr_matrix(rng.poisson(usage @ spectra).astype(np.float32)))
    a.var_names = [f"g{j}" for j in range(n_genes)]
    a.var["highly_variable"] = True
    return a


@pytest.fixture(scope="module")
def nmf_fit():
    a = _programs()
    gpuc.tl.consensus_nmf(a, 3, n_runs=4, max_iter=40)
    return a


def _bulk(seed=0, n_genes=30):
    rng = np.random.default_rng(seed)
    a = ad.AnnData(rng.negative_binomial(5, 0.2, (8, n_genes)).astype(np.int64))
    a.obs_names = [f"s{seed}_{i}" for i in range(8)]
    a.var_names = [f"g{j}" for j in range(n_genes)]
    a.obs["condition"] = pd.Categorical(["u", "t"] * 4)
    return a


@pytest.fixture(scope="module")
def deseq_fit():
    a = _bulk()
    gpuc.tl.deseq(a, "~condition", fit_type="mean")
    return a


def _metacell_fit(seed):
    rng = np.random.default_rng(seed)
    a = ad.AnnData(rng.poisson(2.0, (40, 10)).astype(np.float32))
    a.obs_names = [f"c{seed}_{i}" for i in range(40)]
    a.obsm["X_pca"] = rng.normal(size=(40, 4)) + np.repeat(np.eye(4) * 6, 10, axis=0)
    gpuc.tl.metacells(a, 4, n_neighbors=8, n_waypoint_eigs=4, max_iter=5, min_iter=1)
    return a


# ---- nmf_refine: the matrix must be the one the fit read ------------------------------------------------------------
def test_refine_refuses_reordered_genes(nmf_fit, unchanged):
    perm = np.random.default_rng(0).permutation(nmf_fit.n_vars)
    a = nmf_fit[:, perm].copy()
    with unchanged(a), pytest.raises(ValueError, match="another order"):
        gpuc.tl.nmf_refine(a, 0.3)


def test_refine_refuses_a_matrix_changed_in_place(nmf_fit, unchanged):
    a = nmf_fit.copy()
    a.X = a.X.log1p()  # sc.pp.log1p after the fit
    with unchanged(a), pytest.raises(ValueError, match="has changed since the fit"):
        gpuc.tl.nmf_refine(a, 0.3)


def test_refine_of_the_unchanged_object_works_and_equals_a_refit(nmf_fit):
    a = nmf_fit.copy()
    gpuc.tl.nmf_refine(a, 2.0)
    b = nmf_fit.copy()
    gpuc.tl.consensus_nmf(b, 3, n_runs=4, max_iter=40, density_threshold=2.0)
    np.testing.assert_array_equal(a.obsm["X_nmf"], b.obsm["X_nmf"])


# ---- anndata.concat of fitted objects ---------------------------------------------------------------------------------
@pytest.mark.parametrize("uns_merge", [None, "same", "first"])
def test_concat_of_two_metacell_fits_is_not_read_as_one(uns_merge):
    joined = ad.concat([_metacell_fit(0), _metacell_fit(1)], uns_merge=uns_merge, axis=0)
    for call in (
        lambda: gpuc.pl.metacells(joined, basis="pca", show=False),
        lambda: gpuc.tl.aggregate_metacells(joined),
    ):
        with pytest.raises((KeyError, ValueError), match="concat"):
            call()
    plt.close("all")


@pytest.mark.parametrize("uns_merge", [None, "same", "first"])
def test_concat_of_two_nmf_fits_is_not_read_as_one(nmf_fit, uns_merge):
    other = nmf_fit.copy()
    other.obs_names = [f"x{i}" for i in range(other.n_obs)]
    other.uns["nmf"]["inputs"]["obs_digest"] = "0" * 16  # another object's fit (names differ)
    joined = ad.concat([nmf_fit, other], uns_merge=uns_merge, axis=0, merge="same")
    with pytest.raises((KeyError, ValueError), match="concat"):
        gpuc.get.nmf_top_genes(joined)


# ---- DESeq2: a gene subset returns those genes ----------------------------------------------------------------------
def test_deseq_gene_subset_returns_those_genes(deseq_fit):
    genes = ["g5", "g2", "g17"]
    sub = deseq_fit[:, genes]
    res = gpuc.get.deseq_results(sub)
    assert list(res.index) == genes
    full = gpuc.get.deseq_results(deseq_fit)
    pd.testing.assert_frame_equal(res, full.loc[genes])
    gpuc.pl.volcano(sub, show=False)  # draws the subset only
    assert len(plt.gca().collections[0].get_offsets()) <= len(genes)
    plt.close("all")


def test_deseq_joined_with_other_genes_or_samples_is_refused(deseq_fit):
    other = _bulk(seed=1)
    gpuc.tl.deseq(other, "~condition", fit_type="mean")
    joined = ad.concat([deseq_fit, other], uns_merge="first", axis=0, merge="same")
    with pytest.raises(ValueError, match="concat"):
        gpuc.get.deseq_results(joined)
    wider = ad.concat([deseq_fit, _bulk(n_genes=35)[:, 30:]], axis=1, uns_merge="first", merge="same")
    with pytest.raises(ValueError, match="did not see"):
        gpuc.get.deseq_results(wider)


# ---- hand-edited uns entries ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda u: u.pop("results"), "'results' is missing"),
        (lambda u: u.__setitem__("results", [1, 2]), "'results' is a list"),
        (lambda u: u["results"].__setitem__(next(iter(u["results"])), "x"), "not tables"),
        (lambda u: u.__setitem__("params", 3), "'params' is a int"),
    ],
)
def test_hand_edited_deseq_entry_names_the_field(deseq_fit, edit, match):
    a = deseq_fit.copy()
    edit(a.uns["deseq"])
    with pytest.raises(ValueError, match=match):
        gpuc.get.deseq_results(a)


def test_hand_edited_nmf_entry_names_the_field(nmf_fit):
    a = nmf_fit.copy()
    a.uns["nmf"]["components"] = "x"
    with pytest.raises(ValueError, match="'components' is a str"):
        gpuc.pl.nmf_density(a, show=False)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda u: u["params"].__setitem__("k", "three"), r"params\['k'\] = 'three' is not a int"),
        (lambda u: u["params"].pop("metric"), r"params\['metric'\] is missing"),
        (lambda u: u.__setitem__("params", [1]), "'params' is a list"),
    ],
)
def test_hand_edited_nmf_params_are_named_before_refine(nmf_fit, edit, match, unchanged):
    a = nmf_fit.copy()
    edit(a.uns["nmf"])
    with unchanged(a), pytest.raises(ValueError, match=match):
        gpuc.tl.nmf_refine(a, 0.3)


def test_hand_edited_trend_is_named_before_vst(deseq_fit, unchanged):
    a = deseq_fit.copy()
    gpuc.tl.vst(a, blind=False)  # the stored trend as written works
    del a.uns["deseq"]["trend"]["mean"]
    with unchanged(a), pytest.raises(ValueError, match="'trend'"):
        gpuc.tl.vst(a, blind=False)


def test_hand_edited_metacell_params_are_named():
    a = _metacell_fit(0)
    a.uns["metacell"]["params"]["use_rep"] = 3
    with pytest.raises(ValueError, match="pass use_rep="):
        gpuc.tl.metacell_quality(a)
    gpuc.tl.metacell_quality(a, use_rep="X_pca")
