"""Names and the remaining cases of issue 41: every group label anndata can hold survives h5ad and zarr, duplicated
names are refused up front, labelled inputs replay by label, and the last internal errors and silent degenerate
inputs become clear errors or warnings."""

from __future__ import annotations

import warnings

import anndata as ad
import numpy as np
import pandas as pd
import pytest

import gpuc
from gpuc._errors import GpucWarning
from gpuc._keys import decode_name, encode_name

AWKWARD = ["", ".", "..", ".zattrs", "a/b", "\\", "%2F", "x y", "é"]


def _bulk(labels, per=4, seed=0):
    rng = np.random.default_rng(seed)
    n = per * len(labels)
    a = ad.AnnData(rng.negative_binomial(5, 0.2, (n, 15)).astype(np.int64))
    a.obs["grp"] = np.repeat(np.asarray(labels, dtype=object), per)
    a.obs["condition"] = pd.Categorical(np.tile(["u", "t"], n // 2))
    return a


def test_encoding_is_reversible_and_one_to_one():
    names = [*AWKWARD, "%", "%25", "%2E", "a\x00b", "T_NK", "T%2FNK"]
    keys = [encode_name(n) for n in names]
    assert [decode_name(k) for k in keys] == names
    assert len(set(keys)) == len(keys)
    assert all(k and not k.startswith(".") and "/" not in k and "\\" not in k and "\x00" not in k for k in keys)


@pytest.mark.parametrize("fmt", ["h5ad", pytest.param("zarr", marks=pytest.mark.slow)])  # zarr: many small files
def test_deseq_groups_with_awkward_labels_survive_writing(tmp_path, fmt):
    labels = ["", ".", ".zattrs", "a/b", "\\"]
    a = _bulk(labels)
    gpuc.tl.deseq(a, "~condition", groupby="grp", fit_type="mean")
    path = tmp_path / f"a.{fmt}"
    getattr(a, f"write_{fmt}")(path)
    b = getattr(ad, f"read_{fmt}")(path)
    for label in labels:
        pd.testing.assert_frame_equal(gpuc.get.deseq_results(b, group=label), gpuc.get.deseq_results(a, group=label))


@pytest.mark.parametrize("fmt", ["h5ad", pytest.param("zarr", marks=pytest.mark.slow)])
def test_metacell_groups_with_awkward_labels_survive_writing(tmp_path, fmt):
    rng = np.random.default_rng(0)
    labels = ["", ".", "a/b"]
    a = ad.AnnData(rng.poisson(2, (60, 5)).astype(np.float32))
    a.obsm["X_pca"] = rng.normal(size=(60, 4))
    a.obs["grp"] = np.repeat(labels, 20)
    gpuc.tl.metacells(a, 2, groupby="grp", n_neighbors=6, n_waypoint_eigs=3, max_iter=3, min_iter=1)
    path = tmp_path / f"a.{fmt}"
    getattr(a, f"write_{fmt}")(path)
    b = getattr(ad, f"read_{fmt}")(path)
    assert {v["group"] for v in b.uns["metacell"]["groups"].values()} == set(labels)
    gpuc.tl.aggregate_metacells(b)


@pytest.mark.parametrize("axis", ["obs", "var"])
def test_duplicated_names_are_refused_up_front(axis, unchanged):
    a = _bulk(["a", "b"])
    names = list(getattr(a, f"{axis}_names"))
    names[1] = names[0]
    setattr(a, f"{axis}_names", names)
    for call in (
        lambda: gpuc.tl.deseq(a, "~condition", fit_type="mean"),
        lambda: gpuc.tl.vst(a, fit_type="mean"),
        lambda: gpuc.tl.pseudobulk(a, "grp", min_cells=1),
    ):
        with unchanged(a), pytest.raises(ValueError, match=f"{axis}_names_make_unique"):
            call()


def test_given_size_factors_replay_by_sample_name(tmp_path):
    a = _bulk(["a", "b"])
    sf = pd.Series(np.linspace(0.5, 2.0, a.n_obs), index=a.obs_names)
    gpuc.tl.deseq(a, "~condition", size_factors=sf, fit_type="mean")
    a.write_h5ad(tmp_path / "a.h5ad")
    params = ad.read_h5ad(tmp_path / "a.h5ad").uns["deseq"]["params"]
    perm = np.random.default_rng(1).permutation(a.n_obs)
    b = _bulk(["a", "b"])[perm].copy()  # the same samples in another order
    gpuc.tl.deseq(b, **params)
    got = b.obs["deseq_size_factors"]
    np.testing.assert_array_equal(got.to_numpy(), sf.loc[b.obs_names].to_numpy())


def test_a_mask_replays_by_gene_name():
    import scipy.sparse as sp

    rng = np.random.default_rng(0)
    a = ad.AnnData(sp.csr_matrix(rng.poisson(3, (30, 12)).astype(np.float32)))
    mask = np.arange(12) % 3 != 0
    gpuc.tl.nmf_k_sweep(a, [2], n_runs=2, mask_var=mask, max_iter=20)
    stored = a.uns["nmf_k_sweep"]["params"]["mask_var"]
    assert list(stored.index) == list(a.var_names)
    b = a[:, ::-1].copy()
    from gpuc.tl._nmf import _gene_mask

    np.testing.assert_array_equal(_gene_mask(b, stored), mask[::-1])


def test_a_string_matrix_is_refused_with_a_message():
    a = ad.AnnData(np.array([["1", "2"], ["3", "4"], ["5", "6"]]))
    a.obs["s"] = ["a", "b", "a"]
    with pytest.raises(TypeError, match="not numbers"):
        gpuc.tl.pseudobulk(a, "s", min_cells=1)


@pytest.mark.parametrize("n", [3, 4])
def test_metacells_on_very_few_cells(n):
    a = ad.AnnData(np.ones((n, 2)))
    a.obsm["X_pca"] = np.random.default_rng(0).normal(size=(n, 2))
    gpuc.tl.metacells(a, 2, n_neighbors=3, n_waypoint_eigs=2)
    assert a.obs["metacell"].nunique() == 2


@pytest.mark.parametrize("scale", [1e19, 1e-25])
def test_extreme_embeddings_warn(scale):
    rng = np.random.default_rng(0)
    a = ad.AnnData(np.ones((60, 2)))
    a.obsm["X_pca"] = rng.normal(size=(60, 5)) * scale
    with pytest.warns(GpucWarning, match="magnitude"):
        gpuc.tl.metacells(a, 3, n_neighbors=8, n_waypoint_eigs=4, max_iter=3, min_iter=1)


def test_demo_refuses_a_folder_with_files(tmp_path, capsys):
    from gpuc.cli import main

    (tmp_path / "notes.txt").write_text("mine")
    assert main(["demo", "--out", str(tmp_path), "--device", "cpu"]) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_zarr_read_back_consensus_draws(tmp_path):
    import matplotlib.pyplot as plt
    import scipy.sparse as sp

    rng = np.random.default_rng(0)
    a = ad.AnnData(sp.csr_matrix(rng.poisson(2, (40, 20)).astype(np.float32)))
    a.var["highly_variable"] = True
    gpuc.tl.consensus_nmf(a, 3, n_runs=3, max_iter=30)
    a.write_zarr(tmp_path / "a.zarr")
    b = ad.read_zarr(tmp_path / "a.zarr")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpuc.pl.nmf_programs(b, show=False)
        gpuc.tl.nmf_refine(b, 0.4)
    plt.close("all")
