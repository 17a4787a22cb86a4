"""gpuc.tl.deseq gene by gene against R DESeq2 1.38.3's own per-gene output (issue 42).

Sets: the branches R takes, simulated and run through R by ``tests/data/deseq/r_sets/make_reference.R`` (2 vs 2 with
the simulated prior variance, local trend fallback, mean trend, outlier replacement with 7 replicates, a continuous
covariate, an interaction); PyDESeq2's test sets with R 1.38.3's intermediates; pasilla (both designs). Every
column equals R to 1e-6 relative on every gene (p-values on the log scale, which is what a 1e-6 change of a Wald
statistic of 20 moves by: p-values near 1e-120 move by 2e-5 relative), except where a test says otherwise and why.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest

import gpuc
from gpuc._testing.deseq_refs import airway, pydeseq2_case, pydeseq2_contrast, r_set

DATA = Path(__file__).resolve().parents[1] / "data" / "deseq"
DISP = ("dispGeneEst", "dispFit", "dispMAP", "dispersion")
# in the shared pasilla and airway gene tables: -2 logLike (at the unfloored means) and the largest Cook's distance
FIT = ("deviance", "maxCooks")
RES = ("log2FoldChange", "lfcSE", "stat", "pvalue", "padj")


def _load_set(name: str) -> tuple[ad.AnnData, dict, pd.DataFrame]:
    return r_set(DATA / "r_sets" / name)


def _fit(name: str) -> tuple[ad.AnnData, pd.DataFrame, pd.DataFrame]:
    a, spec, ref = _load_set(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpuc.tl.deseq(a, spec["design"], contrast=spec["contrast"], alpha=0.1, device="cpu", **spec["kwargs"])
    return a, gpuc.get.deseq_results(a), ref


def _close(mine: np.ndarray, ref: np.ndarray, rtol: float, what: str, *, mask: np.ndarray | None = None) -> None:
    mine, ref = np.asarray(mine, dtype=float), np.asarray(ref, dtype=float)
    np.testing.assert_array_equal(np.isnan(mine), np.isnan(ref), err_msg=f"NaN pattern of {what}")
    ok = ~np.isnan(ref) if mask is None else (~np.isnan(ref) & mask)
    if what in ("pvalue", "padj"):
        mine, ref = np.log(np.maximum(mine, 1e-300)), np.log(np.maximum(ref, 1e-300))
        np.testing.assert_allclose(mine[ok], ref[ok], rtol=rtol, atol=rtol, err_msg=what)
    else:
        np.testing.assert_allclose(mine[ok], ref[ok], rtol=rtol, atol=0, err_msg=what)


def _padj_sets_equal(res: pd.DataFrame, ref: pd.DataFrame) -> None:
    a = set(res.index[res["padj"].to_numpy() < 0.1])
    b = set(ref.index[ref["padj"].to_numpy() < 0.1])
    assert a == b, (sorted(a - b), sorted(b - a))


@pytest.mark.parametrize("name", ["two_vs_two", "mean_trend", "outliers_7", "continuous_cov", "interaction"])
def test_r_branch_sets_gene_by_gene(name):
    a, res, ref = _fit(name)
    for col in DISP:
        _close(a.var[f"deseq_{col}"], ref[col], 1e-6, col)
    for col in RES:
        _close(res[col], ref[col], 1e-6, col)
    _padj_sets_equal(res, ref)
    np.testing.assert_array_equal(a.var["deseq_dispOutlier"].to_numpy(), ref["dispOutlier"].fillna(False).to_numpy())
    if name == "outliers_7":  # 20 planted outliers: R replaces and refits the same genes
        np.testing.assert_array_equal(a.var["deseq_replace"].to_numpy(), ref["replace"].fillna(False).to_numpy())
        assert ref["replace"].sum() == 20
    g = pd.read_csv(DATA / "r_sets" / name / "globals.csv", index_col=0)["value"]
    tr = a.uns["deseq"]["trend"]
    assert tr["type"] == g["fitType"]
    if g["fitType"] == "parametric":
        assert tr["asymptDisp"] == pytest.approx(float(g["asymptDisp"]), rel=1e-8)
        assert tr["extraPois"] == pytest.approx(float(g["extraPois"]), rel=1e-8)
    else:
        assert tr["mean"] == pytest.approx(float(g["mean"]), rel=1e-8)
    assert a.uns["deseq"]["prior_disp_var"] == pytest.approx(float(g["dispPriorVar"]), rel=1e-8)


def test_local_fallback_set():
    """Poisson counts: R's parametric fit fails and locfit takes over. gpuc evaluates locfit's tree as R does, and
    beyond the range of the means the fit used (six genes with lower means, whose gene-wise estimates were too small
    to enter the fit) extrapolates as locfit does (linear in the vertex values less locfit's global quadratic, which
    is then added back): every column equals R's to 1e-6 on every gene."""
    a, res, ref = _fit("local_fallback")
    assert a.uns["deseq"]["trend"]["type"] == "local"
    bm, ge = a.var["deseq_baseMean"].to_numpy(), a.var["deseq_dispGeneEst"].to_numpy()
    used = ge > 1e-6
    assert ((bm < bm[used].min()) | (bm > bm[used].max())).sum() == 6  # the extrapolated genes
    for col in DISP:
        _close(a.var[f"deseq_{col}"], ref[col], 1e-6, col)
    for col in RES:
        _close(res[col], ref[col], 1e-6, col)
    _padj_sets_equal(res, ref)


PYDESEQ2_SETS = {
    "single_factor": ("~condition", "parametric"),
    "single_factor_meanfit": ("~condition", "mean"),
    "multi_factor": ("~group + condition", "parametric"),
    "continuous": ("~group + condition + measurement", "parametric"),
    "wide": ("~group + condition", "parametric"),
    "large_counts": ("~condition", "parametric"),
}


@pytest.mark.parametrize("case", list(PYDESEQ2_SETS))
def test_pydeseq2_sets_vs_r_1_38_3_intermediates(case):
    """Every stage equals R 1.38.3 to 1e-8 (measured: 1e-12 and below)."""
    design, fit_type = PYDESEQ2_SETS[case]
    r = DATA / "refs"

    def r_stage(case: str, what: str) -> pd.DataFrame:
        return pd.read_csv(r / "r_1.38.3" / f"{case}_{what}.csv.gz", index_col=0)

    a, contrast = pydeseq2_case(r, case), pydeseq2_contrast(case)
    gpuc.tl.deseq(a, design, contrast=contrast, alpha=0.1, fit_type=fit_type, device="cpu")
    p = r_stage(case, "gene_params")
    for col in DISP:
        _close(a.var[f"deseq_{col}"], p[col], 1e-8, col)
    res = gpuc.get.deseq_results(a)
    ref = r_stage(case, "res")
    for col in RES:
        _close(res[col], ref[col], 1e-8, col)
    coef = r_stage(case, "coef_log2").to_numpy()
    np.testing.assert_allclose(a.varm["deseq_coef"], coef, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(a.layers["deseq_cooks"], r_stage(case, "cooks").to_numpy().T, rtol=1e-8, atol=1e-14)


def test_pasilla_condition_gene_by_gene(shared_data):
    """pasilla ~condition against R's full-precision output: every column of every gene equals R's to 1e-6 (measured:
    6e-14 for the dispersions, 2e-11 for the fold changes), the trend's coefficients to 1e-12."""
    _, res, r = _pasilla_vs_r_output(shared_data, "condition", (0.0139582879764355, 2.72303937826357))
    for col in RES:
        _close(res[col], r[col], 1e-6, col)
    _padj_sets_equal(res, r)


def _pasilla_vs_r_output(shared: Path, tag: str, trend: tuple[float, float]):
    """pasilla fitted with the design of ``tag`` (type's reference level paired-end, as R's), its dispersions and
    trend checked against R's full-precision output (1e-6 on every gene, the coefficients to 1e-12); returns the
    fit, its results and R's results."""
    ref_dir = shared / "bulk" / "pasilla" / "deseq2_R_reference"
    a = gpuc.datasets.pasilla()
    a.obs["type"] = a.obs["type"].cat.reorder_categories(["paired-end", "single-read"])
    design = {"condition": "~condition", "type_condition": "~type + condition"}[tag]
    gpuc.tl.deseq(a, design, contrast=["condition", "treated", "untreated"], alpha=0.1, device="cpu")
    g = pd.read_csv(ref_dir / f"gene_fit_{tag}.csv.gz", index_col=0)
    for col in DISP + FIT:
        _close(a.var[f"deseq_{col}"], g[col], 1e-6, col)
    tr = a.uns["deseq"]["trend"]
    assert tr["asymptDisp"] == pytest.approx(trend[0], rel=1e-12)
    assert tr["extraPois"] == pytest.approx(trend[1], rel=1e-12)
    return a, gpuc.get.deseq_results(a), pd.read_csv(ref_dir / f"results_{tag}.csv", index_col=0)


def test_pasilla_type_condition_gene_by_gene(shared_data):
    """pasilla ~type + condition (R's reference level for type: paired-end; its IRLS means start the gene-wise
    search, linear-model means do not apply): every dispersion column of every gene equals R's to 1e-6, the trend's
    coefficients to 1e-12, and the results too, including the 5 genes whose IRLS reaches 100 iterations and which
    R refits by optim's L-BFGS-B (gpuc runs the same search: :mod:`gpuc.deseq._optim`)."""
    a, res, r = _pasilla_vs_r_output(shared_data, "type_condition", (0.00798417862402958, 2.56858439454833))
    optim = a.var["deseq_betaIter"].to_numpy() >= 100
    assert optim.sum() == 5
    for col in RES:
        _close(res[col], r[col], 1e-6, col)
        _close(res[col][optim], r[col][optim], 1e-12, col)
    _padj_sets_equal(res, r)


def test_airway_cell_dex_gene_by_gene(shared_data):
    """airway ~cell + dex (five coefficients: Armadillo's Cholesky inverse in the Cox-Reid derivative, the IRLS means
    of eight cells): every dispersion and result column of every gene equals R's to 1e-6."""
    ref_dir = shared_data / "bulk" / "airway" / "deseq2_R_reference"
    a = airway(shared_data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gpuc.GpucWarning)  # n - p = 3: the prior variance by R's simulation
        gpuc.tl.deseq(a, "~cell + dex", contrast=["dex", "trt", "untrt"], alpha=0.1, device="cpu")
    g = pd.read_csv(ref_dir / "gene_fit_cell_dex.csv.gz", index_col=0)
    r = pd.read_csv(ref_dir / "results_cell_dex.csv.gz", index_col=0)
    for col in DISP + FIT:
        _close(a.var[f"deseq_{col}"], g[col], 1e-6, col)
    res = gpuc.get.deseq_results(a)
    for col in RES:
        _close(res[col], r[col], 1e-6, col)
    _padj_sets_equal(res, r)
