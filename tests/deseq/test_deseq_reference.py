"""gpuc.tl.deseq against R DESeq2 on PyDESeq2's reference cases (R 1.34 results, R 1.38.3 intermediates).

The R reference fixtures live in tests/data/deseq (copied from ../shared/data/deseq_refs); the loaders below read them.
"""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest

import gpuc
from gpuc._testing.deseq_refs import PYDESEQ2_DESIGNS, pydeseq2_counts_and_metadata

REFS = Path(__file__).resolve().parents[1] / "data" / "deseq"

DESIGNS = PYDESEQ2_DESIGNS


def counts_and_metadata(case: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Samples x genes counts and sample metadata of a PyDESeq2 reference case."""
    return pydeseq2_counts_and_metadata(REFS / "refs", case)


def r_file(case: str, name: str) -> pd.DataFrame:
    """An R DESeq2 1.34 output shipped with PyDESeq2 (tests/data/<case>/<name>.csv)."""
    return pd.read_csv(REFS / "refs" / case / f"{name}.csv.gz", index_col=0)


def r_stage(case: str, what: str) -> pd.DataFrame:
    """An R DESeq2 1.38.3 intermediate (<case>_<what>.csv)."""
    return pd.read_csv(REFS / "refs" / "r_1.38.3" / f"{case}_{what}.csv.gz", index_col=0)


def r_globals(case: str) -> dict:
    g = pd.read_csv(REFS / "refs" / "r_1.38.3" / f"{case}_globals.csv.gz")
    return dict(zip(g["key"], g["value"], strict=True))


def max_rel(a: np.ndarray, b: np.ndarray) -> float:
    """Max relative error over entries where the reference is finite and non-zero."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    ok = np.isfinite(b) & (b != 0)
    return float(np.max(np.abs(a[ok] - b[ok]) / np.abs(b[ok])))


def assert_res_close(
    res: pd.DataFrame,
    ref: pd.DataFrame,
    tol: float,
    cols: tuple[str, ...] = ("log2FoldChange", "lfcSE", "pvalue", "padj"),
) -> None:
    """Same NaN pattern for pvalue and padj, then max relative error below tol for each column."""
    for c in ("pvalue", "padj"):
        np.testing.assert_array_equal(
            np.isnan(res[c].to_numpy()), ref[c].isna().to_numpy(), err_msg=f"NaN pattern of {c}"
        )
    for c in cols:
        err = max_rel(res[c].to_numpy(), ref[c].to_numpy())
        assert err < tol, f"{c}: max relative error {err:.3g} >= {tol}"


CONTRAST = {"continuous": "measurement"}


def _run(case: str, **kwargs) -> ad.AnnData:
    c, m = counts_and_metadata(case)
    adata = ad.AnnData(X=c.to_numpy().astype(np.int64), obs=m.loc[c.index].copy())
    adata.var_names = c.columns.astype(str)
    kwargs.setdefault("contrast", CONTRAST.get(case, ["condition", "B", "A"]))
    kwargs.setdefault("alpha", 0.1)
    kwargs.setdefault("device", "cpu")
    gpuc.tl.deseq(adata, DESIGNS[case], **kwargs)
    return adata


@pytest.fixture(scope="module")
def fitted() -> dict[str, ad.AnnData]:
    return {case: _run(case, fit_type="mean" if case.endswith("meanfit") else "parametric") for case in DESIGNS}


@pytest.mark.parametrize(
    ("case", "folder", "tol"),
    [
        ("single_factor", "single_factor", 1e-6),
        ("multi_factor", "multi_factor", 1e-6),
        ("continuous", "continuous", 1e-6),
        ("wide", "wide", 1e-6),
        ("large_counts", "large_counts", 1e-6),
    ],
)
def test_results_vs_r(fitted, case, folder, tol):
    res = gpuc.get.deseq_results(fitted[case])
    assert_res_close(res, r_file(folder, "r_test_res"), tol)


def test_mean_fit_vs_r(fitted):
    assert_res_close(
        gpuc.get.deseq_results(fitted["single_factor_meanfit"]), r_file("single_factor", "r_test_res_mean_curve"), 1e-6
    )


@pytest.mark.parametrize("case", list(DESIGNS))
def test_stages_vs_r_1_38_3(fitted, case):
    """Per-stage R 1.38.3 intermediates, every stage to 1e-8 (gpuc runs R's own dispersion search and rules):
    size factors and baseMean 1e-10; gene-wise, trend, MAP and final dispersions, coefficients, SEs and Cook's
    distances 1e-8; outlier flags equal; the trend coefficients, varLogDispEsts and the prior variance 1e-8."""
    a = fitted[case]
    p = r_stage(case, "gene_params")
    sf = r_stage(case, "size_factors").iloc[:, 0].to_numpy()
    assert max_rel(a.obs["deseq_size_factors"], sf) < 1e-10
    v = lambda f: a.var[f"deseq_{f}"].to_numpy()  # noqa: E731
    assert max_rel(v("baseMean"), p["baseMean"]) < 1e-10
    assert max_rel(v("dispGeneEst"), p["dispGeneEst"]) < 1e-8
    assert max_rel(v("dispFit"), p["dispFit"]) < 1e-8
    assert max_rel(v("dispMAP"), p["dispMAP"]) < 1e-8
    assert max_rel(v("dispersion"), p["dispersion"]) < 1e-8
    np.testing.assert_array_equal(v("dispOutlier").astype(bool), p["dispOutlier"].to_numpy().astype(bool))
    coef = r_stage(case, "coef_log2")
    se = r_stage(case, "coefSE_log2")
    cov = a.varm["deseq_coef_cov"].reshape(a.n_vars, coef.shape[1], coef.shape[1])
    assert max_rel(a.varm["deseq_coef"], coef.to_numpy()) < 1e-8
    assert max_rel(np.sqrt(np.einsum("gii->gi", cov)), se.to_numpy()) < 1e-8
    assert max_rel(a.layers["deseq_cooks"], r_stage(case, "cooks").to_numpy().T) < 1e-8
    g = r_globals(case)
    trend = a.uns["deseq"]["trend"]
    if g["fitType"] == "parametric":
        assert abs(trend["asymptDisp"] / float(g["asymptDisp"]) - 1) < 1e-8
        assert abs(trend["extraPois"] / float(g["extraPois"]) - 1) < 1e-8
    else:
        assert abs(trend["mean"] / float(g["mean"]) - 1) < 1e-8
    assert abs(a.uns["deseq"]["var_log_disp_ests"] / float(g["varLogDispEsts"]) - 1) < 1e-8
    assert a.uns["deseq"]["prior_disp_var"] == pytest.approx(float(g["dispPriorVar"]))


@pytest.mark.parametrize("alt", ["greater", "less", "greaterAbs", "lessAbs"])
def test_alternative_hypotheses_vs_r(alt):
    """R's results(lfcThreshold=0.5, altHypothesis=...) p-values (R's formulas, not PyDESeq2's clipping)."""
    a = _run("single_factor", lfc_threshold=0.5, alt_hypothesis=alt)
    res = gpuc.get.deseq_results(a)
    ref = r_file("single_factor", f"r_test_res_{alt}")
    assert_res_close(res, ref, 1e-6, cols=("log2FoldChange", "lfcSE", "pvalue", "padj"))
    np.testing.assert_allclose(res["stat"], ref["stat"], rtol=1e-6, atol=1e-8)


def test_no_independent_filtering_vs_r():
    a = _run("single_factor", independent_filter=False)
    assert_res_close(gpuc.get.deseq_results(a), r_file("single_factor", "r_test_res_no_independent_filtering"), 1e-6)


@pytest.mark.parametrize(
    ("kind", "name", "col"),
    [("ratio", "r_test_size_factors", "x"), ("poscounts", "r_test_size_factors_poscount", "sizeFactor")],
)
def test_size_factors_vs_r(kind, name, col):
    a = _run("single_factor", size_factors=kind)
    np.testing.assert_allclose(a.obs["deseq_size_factors"], r_file("single_factor", name)[col].to_numpy(), rtol=1e-10)


def test_iterative_size_factors_vs_r():
    """R 1.34's type="iterate" on PyDESeq2's set (its CSV's digits: measured 1.4e-11)."""
    a = _run("single_factor", size_factors="iterative")
    ref = r_file("single_factor", "r_iterative_size_factors")["x"].to_numpy()
    assert max_rel(a.obs["deseq_size_factors"], ref) < 1e-9


@pytest.mark.parametrize("name", ["pasilla", "sim"])
def test_iterative_size_factors_are_r_bit_for_bit(name):
    """estimateSizeFactorsIterate of R 1.38 (tests/data/deseq/sizefactors/make_iterate_reference.R): R's rounds of
    estimateDispersions(fitType="mean") and optim's L-BFGS-B on the trimmed likelihood, the same doubles."""
    from gpuc._backend import get_backend
    from gpuc.deseq._pipeline import compute_size_factors

    folder = Path(__file__).parents[1] / "data" / "deseq" / "sizefactors"
    if name == "pasilla":
        base = Path(gpuc.__file__).parent / "datasets" / "data"
        counts = pd.read_csv(base / "pasilla_counts.csv.gz", index_col=0).iloc[::10]
    else:
        counts = pd.read_csv(folder / "iterate_sim_counts.csv", index_col=0)
    sf, kind, _ = compute_size_factors(get_backend("cpu"), counts.to_numpy(dtype=np.float64), "iterative")
    want = np.array([float.fromhex(v) for v in pd.read_csv(folder / f"iterate_{name}.csv")["sf"]])
    assert kind == "iterative"
    np.testing.assert_array_equal(np.asarray(sf), want)


def test_apeglm_shrinkage_vs_r():
    """lfcShrink(type="apeglm") (R 1.34 + apeglm): shrunken LFC within 2%, posterior SD within 2%."""
    for case, folder in (("single_factor", "single_factor"), ("multi_factor", "multi_factor")):
        a = _run(case, lfc_shrink="apeglm")
        res = gpuc.get.deseq_results(a)
        ref = r_file(folder, "r_test_lfc_shrink_res")
        assert max_rel(res["log2FoldChange_shrunk"], ref["log2FoldChange"]) < 0.02
        assert max_rel(res["lfcSE_shrunk"], ref["lfcSE"]) < 0.02
        np.testing.assert_allclose(res["pvalue"], ref["pvalue"], rtol=0.02)


@pytest.mark.parametrize(
    ("name", "blind", "fit_type"),
    [("r_vst", True, "parametric"), ("r_vst_with_design", False, "parametric"), ("r_mean_vst", True, "mean")],
)
def test_vst_vs_r(name, blind, fit_type):
    a = _run("single_factor")
    gpuc.tl.vst(a, blind=blind, fit_type=fit_type, device="cpu")
    ref = r_file("single_factor", name).to_numpy().T
    assert max_rel(a.layers["vst"], ref) < 1e-4


def test_lrt_vs_r():
    """LRT ~group + condition vs ~group against R 1.38.3 (tests/data/deseq/make_lrt_reference.R)."""
    a = _run("multi_factor", test="lrt", reduced="~group")
    ref = pd.read_csv(REFS / "lrt_multi_factor_R.csv", index_col=0)
    res = gpuc.get.deseq_results(a)
    assert_res_close(res, ref, 1e-6, cols=("log2FoldChange", "lfcSE", "stat", "pvalue", "padj"))
    assert a.uns["deseq"]["lrt_df"] == 1
