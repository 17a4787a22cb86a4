"""Issue 31, group keys: labels compared as given; missing labels dropped with a counting warning (an error where
every cell needs a group); two labels printing the same refused, naming them, before anything is written; generated
names (pseudobulk profiles, contrasts, groups) unique by construction and kept through write_h5ad."""

from __future__ import annotations

import anndata as ad
import numpy as np
import pandas as pd
import pytest

import gpuc
from gpuc._errors import GpucWarning


def _bulk(groups, seed: int = 0, n_genes: int = 40) -> ad.AnnData:
    """Samples x genes counts, 4 A and 4 B samples per entry of ``groups`` (each entry a group label)."""
    rng = np.random.default_rng(seed)
    n = 8 * len(groups)
    mean = 2 ** rng.normal(6, 1.5, n_genes)
    cond = np.tile(np.repeat(["A", "B"], 4), len(groups))
    mu = mean[None, :] * 2 ** np.outer(cond == "B", np.where(np.arange(n_genes) < 10, 2.0, 0.0))
    counts = rng.negative_binomial(10, 10 / (10 + mu)).astype(np.int64)
    grp = np.empty(n, dtype=object)
    for i, g in enumerate(groups):
        grp[8 * i : 8 * (i + 1)] = [g] * 8
    obs = pd.DataFrame({"condition": pd.Categorical(cond), "grp": grp}, index=[f"s{i}" for i in range(n)])
    return ad.AnnData(counts, obs=obs, var=pd.DataFrame(index=[f"g{j}" for j in range(n_genes)]))


@pytest.mark.parametrize(("g1", "g2"), [(1, "1"), (np.nan, "nan"), (1.5, "1.5"), (True, "True")])
def test_deseq_groupby_labels_printing_the_same_are_refused(g1, g2, unchanged):
    a = _bulk(["x", "y"])
    a.obs["grp"] = [g1] * 8 + [g2] * 8
    with unchanged(a), pytest.raises(ValueError, match="would print the same"):
        gpuc.tl.deseq(a, "~condition", groupby="grp", device="cpu")


def test_deseq_groupby_missing_labels_are_dropped_with_a_count():
    a = _bulk(["x", "y"])
    gone = [10, 11, 14, 15]
    a.obs.loc[a.obs_names[gone], "grp"] = None
    ref = a[:8].copy()
    with pytest.warns(GpucWarning, match="4 sample\\(s\\) with a missing adata.obs\\['grp'\\]"):
        gpuc.tl.deseq(a, "~condition", groupby="grp", device="cpu")
    groups = a.uns["deseq"]["groups"]
    assert set(groups) == {"x", "y"}  # no group called "nan" or "None"
    assert groups["y"]["n_samples"] == 4
    assert np.isnan(a.obs["deseq_size_factors"].to_numpy()[gone]).all()
    gpuc.tl.deseq(ref, "~condition", device="cpu")
    np.testing.assert_allclose(
        gpuc.get.deseq_results(a, group="x")["log2FoldChange"], gpuc.get.deseq_results(ref)["log2FoldChange"]
    )


def test_deseq_integer_group_labels_round_trip(tmp_path):
    a = _bulk([1, 2])
    a.obs["grp"] = a.obs["grp"].astype(np.int64)
    gpuc.tl.deseq(a, "~condition", groupby="grp", device="cpu")
    a.write_h5ad(tmp_path / "a.h5ad")
    b = ad.read_h5ad(tmp_path / "a.h5ad")
    for g in (1, 2):
        pd.testing.assert_frame_equal(gpuc.get.deseq_results(b, group=str(g)), gpuc.get.deseq_results(a, group=str(g)))


def test_two_contrasts_with_the_same_name_are_refused(unchanged):
    a = _bulk(["x"])
    with unchanged(a), pytest.raises(ValueError, match="same name"):
        gpuc.tl.deseq(a, "~condition", contrast=[["condition", "B", "A"], ["condition", "B", "A"]], device="cpu")
    with unchanged(a), pytest.raises(ValueError, match="same name"):  # same weights written two ways
        gpuc.tl.deseq(a, "~condition", contrast=[np.array([0, 1.0]), {"Intercept": 0, "condition[T.B]": 1}])


def test_named_contrasts_keep_the_names_given():
    a = _bulk(["x"])
    gpuc.tl.deseq(a, "~condition", contrast={"up": ["condition", "B", "A"], "down": ["condition", "A", "B"]})
    res = a.uns["deseq"]["results"]
    assert list(res) == ["up", "down"]
    np.testing.assert_allclose(res["up"]["log2FoldChange"], -res["down"]["log2FoldChange"])


def _cells(sample, group) -> ad.AnnData:
    rng = np.random.default_rng(0)
    n = len(sample)
    a = ad.AnnData(rng.poisson(3, (n, 5)).astype(np.float32), obs=pd.DataFrame(index=[f"c{i}" for i in range(n)]))
    a.obs["sample"] = np.asarray(sample, dtype=object)
    if group is not None:
        a.obs["ct"] = np.asarray(group, dtype=object)
    return a


def test_pseudobulk_names_unique_by_construction(tmp_path):
    a = _cells(["a_b"] * 10 + ["a"] * 10, ["c"] * 10 + ["b_c"] * 10)
    with pytest.warns(GpucWarning, match="would give the same name"):
        pb = gpuc.tl.pseudobulk(a, "sample", groupby="ct", min_cells=1)
    assert pb.obs_names.is_unique and pb.n_obs == 2
    assert sorted(pb.obs_names) == ["a_b|c", "a|b_c"]
    pb.write_h5ad(tmp_path / "pb.h5ad")
    back = ad.read_h5ad(tmp_path / "pb.h5ad")
    assert list(back.obs_names) == list(pb.obs_names)
    assert back.obs["sample"].tolist() == pb.obs["sample"].tolist()


def test_pseudobulk_keeps_underscore_names_when_unambiguous():
    a = _cells(["donor_1"] * 10 + ["donor_2"] * 10, ["T"] * 20)
    pb = gpuc.tl.pseudobulk(a, "sample", groupby="ct", min_cells=1)
    assert list(pb.obs_names) == ["donor_1_T", "donor_2_T"]


@pytest.mark.parametrize("col", ["sample", "ct"])
def test_pseudobulk_labels_printing_the_same_are_refused(col):
    a = _cells(["s1"] * 10 + ["s2"] * 10, ["T"] * 20)
    a.obs[col] = np.asarray([1] * 10 + ["1"] * 10, dtype=object)
    with pytest.raises(ValueError, match=r"1 \(int\) and '1' \(str\)"):
        gpuc.tl.pseudobulk(a, "sample", groupby="ct", min_cells=1)


def _embedded(groups) -> ad.AnnData:
    rng = np.random.default_rng(0)
    n = 40 * len(groups)
    a = ad.AnnData(np.zeros((n, 2), dtype=np.float32), obs=pd.DataFrame(index=[f"c{i}" for i in range(n)]))
    a.obsm["X_pca"] = rng.normal(0, 1, (n, 4))
    a.obs["grp"] = np.repeat(np.asarray(groups, dtype=object), 40)
    return a


_MC = {"n_neighbors": 8, "n_waypoint_eigs": 4, "max_iter": 3, "min_iter": 1, "device": "cpu"}


def test_metacells_groupby_1_and_str_1_refused_before_earlier_results_are_deleted(unchanged):
    a = _embedded(["a", "b"])
    gpuc.tl.metacells(a, 3, groupby="grp", **_MC)
    a.obs["grp"] = np.repeat(np.asarray([1, "1"], dtype=object), 40)
    with unchanged(a), pytest.raises(ValueError, match="would print the same"):
        gpuc.tl.metacells(a, 3, groupby="grp", **_MC)
    assert "metacell" in a.obs  # the earlier run is still there


def test_metacells_groupby_missing_group_is_an_error(unchanged):
    a = _embedded(["a", "b"])
    a.obs.loc[a.obs_names[:3], "grp"] = np.nan
    with unchanged(a), pytest.raises(ValueError, match="3 missing value"):
        gpuc.tl.metacells(a, 3, groupby="grp", **_MC)


def test_metacells_n_metacells_keys_as_given_or_as_stored(tmp_path):
    a = _embedded([1, 2])
    gpuc.tl.metacells(a, {1: 3, 2: 4}, groupby="grp", **_MC)
    sizes = a.uns["metacell"]["params"]["n_metacells"]
    assert sizes == {"1": 3, "2": 4}
    b = _embedded([1, 2])
    gpuc.tl.metacells(b, sizes, groupby="grp", **_MC)  # the stored (string) keys name the same groups
    np.testing.assert_array_equal(b.obs["metacell"], a.obs["metacell"])
    c = _embedded([1, 2])
    gpuc.tl.metacells(c, pd.Series({2: 4, 1: 3}), groupby="grp", **_MC)  # a Series: matched by its labels
    np.testing.assert_array_equal(c.obs["metacell"], a.obs["metacell"])
    with pytest.raises(ValueError, match="names groups not in"):
        gpuc.tl.metacells(b, {3: 3}, groupby="grp", **_MC)


def test_celltype_labels_printing_the_same_are_refused():
    a = _embedded(["a", "b"])
    gpuc.tl.metacells(a, 3, **_MC)
    a.obs["ct"] = np.asarray(["1"] * 40 + [1] * 40, dtype=object)
    with pytest.raises(ValueError, match="would print the same"):
        gpuc.tl.aggregate_metacells(a, celltype_key="ct")
