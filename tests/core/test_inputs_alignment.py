"""Issue 31, labelled inputs: every labelled argument (Series, DataFrame, dict) of a tl function is matched to
obs_names / var_names by label; missing, duplicated or foreign labels are an error that leaves the AnnData as it was;
arrays stay positional."""

from __future__ import annotations

import anndata as ad
import numpy as np
import pandas as pd
import pytest

import gpuc
from gpuc._validate import align_to_obs


def _bulk(n_per: int = 4, n_genes: int = 60, seed: int = 0) -> ad.AnnData:
    rng = np.random.default_rng(seed)
    n = 2 * n_per
    mean = 2 ** rng.normal(6, 1.5, n_genes)
    lfc = np.where(np.arange(n_genes) < 15, 2.0, 0.0)
    cond = np.repeat(["A", "B"], n_per)
    mu = mean[None, :] * 2 ** np.outer(cond == "B", lfc)
    counts = rng.negative_binomial(10, 10 / (10 + mu))
    obs = pd.DataFrame({"condition": pd.Categorical(cond)}, index=[f"s{i}" for i in range(n)])
    return ad.AnnData(counts.astype(np.int64), obs=obs, var=pd.DataFrame(index=[f"g{j}" for j in range(n_genes)]))


def _lfc(a: ad.AnnData, key: str = "deseq") -> np.ndarray:
    return gpuc.get.deseq_results(a, key=key)["log2FoldChange"].to_numpy()


def test_design_dataframe_in_another_order_gives_the_same_fit():
    a = _bulk()
    ref = a.copy()
    gpuc.tl.deseq(ref, "~condition", device="cpu")
    design = pd.DataFrame({"Intercept": 1.0, "B": (a.obs["condition"] == "B").astype(float)}, index=a.obs_names)
    shuffled = design.iloc[np.random.default_rng(1).permutation(a.n_obs)]
    gpuc.tl.deseq(a, shuffled, contrast="B", device="cpu")
    np.testing.assert_allclose(_lfc(a), _lfc(ref), rtol=1e-10)
    assert (_lfc(a)[:15] > 1).all()  # the planted changes keep their sign


@pytest.mark.parametrize(
    ("index", "match"),
    [
        (lambda a: [f"x{i}" for i in range(a.n_obs)], "not in adata.obs_names"),
        (lambda a: [*a.obs_names[:-1], a.obs_names[0]], "not unique"),
        (lambda a: range(a.n_obs), "not in adata.obs_names"),  # a RangeIndex is foreign to names s0..s7
    ],
)
def test_design_dataframe_with_foreign_or_duplicated_index_is_refused(index, match, unchanged):
    a = _bulk()
    design = pd.DataFrame({"Intercept": 1.0, "B": (a.obs["condition"] == "B").to_numpy(float)}, index=index(a))
    with unchanged(a), pytest.raises(ValueError, match=match):
        gpuc.tl.deseq(a, design, contrast="B", device="cpu")


def test_design_dataframe_missing_a_sample_is_refused(unchanged):
    a = _bulk()
    design = pd.DataFrame({"Intercept": 1.0, "B": (a.obs["condition"] == "B").to_numpy(float)}, index=a.obs_names)
    with unchanged(a), pytest.raises(ValueError, match=r"no entry for 1 of adata\.obs_names"):
        gpuc.tl.deseq(a, design.iloc[1:], contrast="B", device="cpu")


def test_design_dataframe_as_array_stays_positional():
    a = _bulk()
    ref = a.copy()
    gpuc.tl.deseq(ref, "~condition", device="cpu")
    design = pd.DataFrame({"Intercept": 1.0, "B": (a.obs["condition"] == "B").to_numpy(float)}, index=a.obs_names)
    gpuc.tl.deseq(a, pd.DataFrame(design.to_numpy(), columns=design.columns, index=a.obs_names), device="cpu")
    np.testing.assert_allclose(_lfc(a), _lfc(ref), rtol=1e-10)


def test_reduced_dataframe_is_aligned_by_label():
    a = _bulk()
    ref = a.copy()
    gpuc.tl.deseq(ref, "~condition", test="lrt", reduced="~1", device="cpu")
    reduced = pd.DataFrame({"Intercept": np.ones(a.n_obs)}, index=a.obs_names[::-1])
    gpuc.tl.deseq(a, "~condition", test="lrt", reduced=reduced, device="cpu")
    np.testing.assert_allclose(gpuc.get.deseq_results(a)["pvalue"], gpuc.get.deseq_results(ref)["pvalue"])


@pytest.mark.parametrize("as_dict", [False, True])
def test_size_factors_series_or_dict_matched_by_name(as_dict):
    a = _bulk()
    sf = np.linspace(0.5, 2.0, a.n_obs)
    by_pos = a.copy()
    gpuc.tl.deseq(by_pos, "~condition", size_factors=sf, device="cpu")
    labelled = pd.Series(sf, index=a.obs_names).iloc[::-1]
    gpuc.tl.deseq(a, "~condition", size_factors=dict(labelled) if as_dict else labelled, device="cpu")
    np.testing.assert_array_equal(a.obs["deseq_size_factors"], sf)
    np.testing.assert_allclose(_lfc(a), _lfc(by_pos), rtol=1e-12)


def test_size_factors_series_with_foreign_labels_is_refused(unchanged):
    a = _bulk()
    with unchanged(a), pytest.raises(ValueError, match=r"pass \.to_numpy\(\) to use it by position"):
        gpuc.tl.deseq(a, "~condition", size_factors=pd.Series(np.ones(a.n_obs)), device="cpu")


def test_contrast_series_is_matched_to_design_columns():
    a = _bulk()
    ref = a.copy()
    gpuc.tl.deseq(ref, "~condition", contrast=["condition", "B", "A"], device="cpu")
    gpuc.tl.deseq(a, "~condition", contrast=pd.Series({"condition[T.B]": 1.0, "Intercept": 0.0}), device="cpu")
    np.testing.assert_allclose(_lfc(a), _lfc(ref), rtol=1e-12)
    b = _bulk()
    gpuc.tl.deseq(b, "~condition", contrast={"condition[T.B]": 1.0, "Intercept": 0.0}, device="cpu")
    np.testing.assert_allclose(_lfc(b), _lfc(ref), rtol=1e-12)


def test_contrast_series_with_unknown_or_missing_columns_is_refused(unchanged):
    a = _bulk()
    with unchanged(a), pytest.raises(ValueError, match="not in the design columns"):
        gpuc.tl.deseq(a, "~condition", contrast=pd.Series({"condition[T.B]": 1.0, "batch": 0.0}), device="cpu")
    with unchanged(a), pytest.raises(ValueError, match="no entry for 1 of the design columns"):
        gpuc.tl.deseq(a, "~condition", contrast=pd.Series({"condition[T.B]": 1.0}), device="cpu")


def test_design_dataframe_with_groupby_uses_each_groups_rows():
    a = _bulk(n_per=6)
    a.obs["grp"] = np.tile(["g1", "g2"], a.n_obs // 2)
    ref = a.copy()
    gpuc.tl.deseq(ref, "~condition", groupby="grp", device="cpu")
    design = pd.DataFrame({"Intercept": 1.0, "B": (a.obs["condition"] == "B").to_numpy(float)}, index=a.obs_names)
    gpuc.tl.deseq(a, design.iloc[::-1], contrast="B", groupby="grp", device="cpu")
    for g in ("g1", "g2"):
        np.testing.assert_allclose(
            gpuc.get.deseq_results(a, group=g)["log2FoldChange"],
            gpuc.get.deseq_results(ref, group=g)["log2FoldChange"],
            rtol=1e-10,
        )


def test_mask_var_boolean_series_matched_by_gene_name(planted_programs):
    a = planted_programs(50, 30)
    mask = pd.Series(np.arange(a.n_vars) < 20, index=a.var_names)
    ref = a.copy()
    gpuc.tl.consensus_nmf(ref, 3, n_runs=3, mask_var=mask.to_numpy(), device="cpu", max_iter=50)
    gpuc.tl.consensus_nmf(a, 3, n_runs=3, mask_var=mask.iloc[::-1], device="cpu", max_iter=50)
    np.testing.assert_array_equal(a.uns["nmf"]["genes"], ref.uns["nmf"]["genes"])
    np.testing.assert_array_equal(a.varm["nmf_spectra"], ref.varm["nmf_spectra"])


def test_mask_var_series_with_foreign_genes_is_refused(planted_programs, unchanged):
    a = planted_programs(50, 30)
    with unchanged(a), pytest.raises(ValueError, match=r"not in adata\.var_names"):
        gpuc.tl.consensus_nmf(a, 3, n_runs=3, mask_var=pd.Series(np.ones(a.n_vars, bool)), device="cpu")
    with unchanged(a), pytest.raises(TypeError, match="must be boolean"):
        gpuc.tl.consensus_nmf(a, 3, n_runs=3, mask_var=pd.Series(1.0, index=a.var_names), device="cpu")


def _cells(n: int = 120, seed: int = 0) -> ad.AnnData:
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 5, (3, 4))
    x = centers[np.arange(n) % 3] + rng.normal(0, 1, (n, 4))
    a = ad.AnnData(np.zeros((n, 2), dtype=np.float32), obs=pd.DataFrame(index=[f"c{i}" for i in range(n)]))
    a.obsm["X_pca"] = x
    return a


_MC = {"n_metacells": 4, "n_neighbors": 8, "n_waypoint_eigs": 4, "max_iter": 5, "min_iter": 1, "device": "cpu"}


def test_initial_archetypes_as_names_positions_or_labelled_mask_agree():
    a = _cells()
    pos = np.array([3, 40, 77, 100])
    runs = {}
    mask = pd.Series(np.isin(np.arange(a.n_obs), pos), index=a.obs_names)
    for name, arche in {
        "positions": pos,
        "names": a.obs_names[pos],
        "mask": mask.to_numpy(),
        "labelled mask": mask.iloc[::-1],
    }.items():
        b = a.copy()
        gpuc.tl.metacells(b, initial_archetypes=arche, **_MC)
        runs[name] = b.obs["metacell"].to_numpy()
    for labels in runs.values():
        np.testing.assert_array_equal(labels, runs["positions"])


def test_initial_archetypes_names_with_duplicated_obs_names_is_refused(unchanged):
    a = _cells()
    a.obs_names = ["c0"] * 2 + list(a.obs_names[2:])
    with unchanged(a), pytest.raises(ValueError, match="obs_names_make_unique"):
        gpuc.tl.metacells(a, initial_archetypes=["c5", "c40", "c77", "c100"], **_MC)


def test_align_to_obs_rules():
    a = _bulk()
    s = pd.Series(np.arange(a.n_obs), index=a.obs_names)
    pd.testing.assert_series_equal(align_to_obs(s.iloc[::-1], a, "v"), s)
    arr = np.arange(a.n_obs)[::-1]
    assert align_to_obs(arr, a, "v") is arr  # positional: untouched
    ints = ad.AnnData(np.zeros((3, 1)))  # obs names "0", "1", "2": integer labels match them
    got = align_to_obs(pd.Series([10, 20, 30], index=[2, 0, 1]), ints, "v")
    assert got.tolist() == [20, 30, 10]
    with pytest.raises(ValueError, match="not unique"):
        align_to_obs(pd.Series([1, 2], index=["s0", "s0"]), a, "v")
