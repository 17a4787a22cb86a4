"""Issue 31, legal designs: what R DESeq2 / formulaic accept works (integer-coded factors, boolean and nullable
boolean columns, C(x), backtick-quoted names), with results equal to R's on one such design; contrast levels are
matched as given (and, for replays read back from h5ad, by their printed form)."""

from __future__ import annotations

import warnings
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.stats

import gpuc
from gpuc._errors import GpucWarning

REF = Path(__file__).resolve().parents[1] / "data" / "deseq" / "legal_design_pasilla_R.csv.gz"
COLUMNS = ("baseMean", "log2FoldChange", "lfcSE", "stat", "pvalue", "padj")


def _pasilla() -> ad.AnnData:
    """Pasilla, every 10th gene, with R's design columns (tests/data/deseq/make_legal_design_reference.R)."""
    pb = gpuc.datasets.pasilla()[:, ::10].copy()
    pb.obs["treated"] = (pb.obs["condition"] == "treated").to_numpy()  # a logical column in R
    pb.obs["lanes2"] = pd.Categorical((pb.obs["number of lanes"] == 2).astype(int).to_numpy())  # factor(0/1)
    return pb


def _assert_like_r(res: pd.DataFrame, ref: pd.DataFrame, prefix: str) -> None:
    """The gates of the pasilla reference tests (tests/deseq/test_deseq_pasilla.py): baseMean to 1e-6; LFC Pearson
    >= 0.9999 and |diff| <= 0.02 where baseMean >= 10; same NaN pattern of p-values; p-value Spearman >= 0.999;
    Jaccard of padj < 0.1 >= 0.98."""
    r = {c: ref[f"{prefix}_{c}"].to_numpy() for c in COLUMNS}
    assert list(res.index) == list(ref.index)
    np.testing.assert_allclose(res["baseMean"], r["baseMean"], rtol=1e-6)
    a, b = res["log2FoldChange"].to_numpy(), r["log2FoldChange"]
    ok = np.isfinite(a) & np.isfinite(b)
    assert np.corrcoef(a[ok], b[ok])[0, 1] >= 0.9999
    big = ok & (r["baseMean"] >= 10)
    assert np.max(np.abs(a[big] - b[big])) <= 0.02
    pa, pb = res["pvalue"].to_numpy(), r["pvalue"]
    np.testing.assert_array_equal(np.isnan(pa), np.isnan(pb))
    both = ~np.isnan(pa)
    assert scipy.stats.spearmanr(pa[both], pb[both])[0] >= 0.999
    sa, sb = set(np.flatnonzero(res["padj"].to_numpy() < 0.1)), set(np.flatnonzero(r["padj"] < 0.1))
    assert len(sa) > 10 and len(sa & sb) / len(sa | sb) >= 0.98


@pytest.fixture(scope="module")
def r_ref() -> pd.DataFrame:
    return pd.read_csv(REF, index_col=0)


@pytest.fixture(scope="module")
def fitted() -> ad.AnnData:
    pb = _pasilla()
    gpuc.tl.deseq(
        pb,
        "~lanes2 + treated",
        contrast={"treated": ["treated", True, False], "lanes2": ["lanes2", 1, 0]},
        alpha=0.1,  # R results()' default
        device="cpu",
    )
    return pb


@pytest.mark.parametrize("which", ["treated", "lanes2"])
def test_boolean_and_integer_coded_factor_match_r(fitted, r_ref, which):
    _assert_like_r(gpuc.get.deseq_results(fitted, contrast=which), r_ref, which)


def test_c_of_an_integer_column_and_backtick_names_give_the_same_fit(fitted):
    pb = _pasilla()
    pb.obs["lanes 2"] = pb.obs["lanes2"].astype(int)  # plain integers, made a factor by C() in the formula
    gpuc.tl.deseq(pb, "~C(`lanes 2`) + treated", contrast=["lanes 2", 1, 0], device="cpu")
    np.testing.assert_allclose(
        gpuc.get.deseq_results(pb)["log2FoldChange"],
        gpuc.get.deseq_results(fitted, contrast="lanes2")["log2FoldChange"],
        rtol=1e-10,
    )


def _bulk() -> ad.AnnData:
    rng = np.random.default_rng(0)
    n_genes = 50
    cond = np.repeat([False, True], 4)
    mean = 2 ** rng.normal(6, 1.5, n_genes)
    mu = mean[None, :] * 2 ** np.outer(cond, np.where(np.arange(n_genes) < 10, 2.0, 0.0))
    counts = rng.negative_binomial(10, 10 / (10 + mu)).astype(np.int64)
    obs = pd.DataFrame({"flag": cond, "name": np.where(cond, "B", "A")}, index=[f"s{i}" for i in range(8)])
    return ad.AnnData(counts, obs=obs, var=pd.DataFrame(index=[f"g{j}" for j in range(n_genes)]))


def _lfc(a: ad.AnnData) -> np.ndarray:
    return gpuc.get.deseq_results(a)["log2FoldChange"].to_numpy()


@pytest.mark.parametrize(
    ("column", "contrast"),
    [
        (lambda c: c, ["flag", True, False]),
        (lambda c: pd.array(c, dtype="boolean"), ["flag", True, False]),  # nullable boolean
        (lambda c: pd.Categorical(c.astype(int)), ["flag", 1, 0]),
        (lambda c: pd.Categorical(c.astype(int)), ["flag", "1", "0"]),  # printed levels, as read back from h5ad
        (lambda c: np.where(c, "yes", "no"), ("flag", "yes", "no")),
    ],
)
def test_every_coding_of_a_two_level_factor_gives_the_same_lfc(column, contrast):
    ref = _bulk()
    gpuc.tl.deseq(ref, "~name", contrast=["name", "B", "A"], device="cpu")
    a = _bulk()
    a.obs["flag"] = column(a.obs["flag"].to_numpy())
    gpuc.tl.deseq(a, "~flag", contrast=contrast, device="cpu")
    np.testing.assert_allclose(_lfc(a), _lfc(ref), rtol=1e-10)
    b = _bulk()
    b.obs["flag"] = column(b.obs["flag"].to_numpy())
    gpuc.tl.deseq(b, "~flag", contrast=list(contrast)[:1] + list(contrast)[:0:-1], device="cpu")  # reversed
    np.testing.assert_allclose(_lfc(b), -_lfc(ref), rtol=1e-10)


@pytest.mark.parametrize(
    ("contrast", "match"),
    [
        (["flag", 2, 0], "not a level of 'flag'"),
        (["flag", 1, 1], "both"),
        (["x", 1, 0], "numeric \\(continuous\\)"),
        (["nope", 1, 0], "not a categorical variable"),
    ],
)
def test_contrast_errors_say_what_to_do(contrast, match, unchanged):
    a = _bulk()
    a.obs["flag"] = pd.Categorical(a.obs["flag"].astype(int))
    a.obs["x"] = np.arange(8.0)
    with unchanged(a), pytest.raises(ValueError, match=match):
        gpuc.tl.deseq(a, "~flag + x", contrast=contrast, device="cpu")


def test_mixed_case_reference_level_warns_and_is_documented():
    a = _bulk()
    a.obs["arm"] = np.where(a.obs["flag"], "Treated", "control")  # "T" sorts before "c" by character code
    with pytest.warns(GpucWarning, match="reference level of 'arm' is 'Treated'.*would take 'control'"):
        gpuc.tl.deseq(a, "~arm", device="cpu")
    assert list(a.uns["deseq"]["results"]) == ["arm_control"]  # the documented choice: character-code order
    b = _bulk()
    b.obs["arm"] = np.where(b.obs["flag"], "treated", "Control")  # code order and R's agree: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", GpucWarning)
        gpuc.tl.deseq(b, "~arm", device="cpu")


def test_non_numeric_design_dataframe_is_refused(unchanged):
    a = _bulk()
    design = pd.DataFrame({"Intercept": 1.0, "arm": a.obs["name"]}, index=a.obs_names)
    with unchanged(a), pytest.raises(TypeError, match="not numeric"):
        gpuc.tl.deseq(a, design, device="cpu")


def test_normal_shrinkage_same_for_string_and_integer_coded_factor():
    ref = _bulk()
    gpuc.tl.deseq(ref, "~name", contrast=["name", "B", "A"], lfc_shrink="normal", device="cpu")
    a = _bulk()
    a.obs["flag"] = pd.Categorical(a.obs["flag"].astype(int), categories=[0, 1])
    gpuc.tl.deseq(a, "~flag", contrast=["flag", 1, 0], lfc_shrink="normal", device="cpu")
    got, want = (gpuc.get.deseq_results(x)["log2FoldChange_shrunk"].to_numpy() for x in (a, ref))
    assert np.abs(want).max() > 0.5  # the planted changes survive shrinkage
    np.testing.assert_allclose(got, want, rtol=1e-10)
