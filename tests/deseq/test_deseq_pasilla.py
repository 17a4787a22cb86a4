"""pasilla (bundled) against R DESeq2 1.38.3, both designs; airway when ../shared is present."""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.stats

import gpuc
from gpuc._testing.deseq_refs import airway

DATA = Path(__file__).resolve().parents[1] / "data" / "deseq"
DESIGN = {"condition": "~condition", "type_condition": "~type + condition"}


def _gates(
    res: pd.DataFrame,
    ref: pd.DataFrame,
    *,
    lfc: str = "log2FoldChange",
    ref_lfc: str = "log2FoldChange",
    padj: bool = True,
    jaccard: float = 0.98,
) -> None:
    """Issue 5 gates: LFC Pearson >= 0.9999 and |diff| <= 0.02 (baseMean >= 10); p Spearman >= 0.999; Jaccard of the
    genes at padj < 0.1 >= ``jaccard``."""
    a, b = res[lfc].to_numpy(), ref[ref_lfc].to_numpy()
    ok = np.isfinite(a) & np.isfinite(b)
    assert np.corrcoef(a[ok], b[ok])[0, 1] >= 0.9999
    big = ok & (ref["baseMean"].to_numpy() >= 10)
    assert np.max(np.abs(a[big] - b[big])) <= 0.02
    if not padj:
        return
    pa, pb = res["pvalue"].to_numpy(), ref["pvalue"].to_numpy()
    np.testing.assert_array_equal(np.isnan(pa), np.isnan(pb))
    both = ~np.isnan(pa) & ~np.isnan(pb)
    assert scipy.stats.spearmanr(pa[both], pb[both])[0] >= 0.999
    sa, sb = set(np.nonzero(res["padj"].to_numpy() < 0.1)[0]), set(np.nonzero(ref["padj"].to_numpy() < 0.1)[0])
    assert len(sa & sb) / max(len(sa | sb), 1) >= jaccard


@pytest.fixture(scope="module")
def pasilla_fits() -> dict[str, ad.AnnData]:
    out = {}
    for tag, design in DESIGN.items():
        a = gpuc.datasets.pasilla()
        # R's factor levels (alphabetical): paired-end is type's reference level in the R run, as here; the ridge
        # penalty of the fit, and so the last digits of every result, depend on the parametrisation
        a.obs["type"] = a.obs["type"].cat.reorder_categories(["paired-end", "single-read"])
        gpuc.tl.deseq(
            a, design, contrast=["condition", "treated", "untreated"], alpha=0.1, lfc_shrink="normal", device="cpu"
        )
        out[tag] = a
    return out


@pytest.mark.parametrize("tag", list(DESIGN))
def test_pasilla_vs_r(pasilla_fits, tag):
    ref = pd.read_csv(DATA / f"pasilla_{tag}_R.csv.gz", index_col=0)
    a = pasilla_fits[tag]
    res = gpuc.get.deseq_results(a, ["condition", "treated", "untreated"])
    assert list(res.index) == list(ref.index)
    np.testing.assert_allclose(res["baseMean"], ref["baseMean"], rtol=1e-6)
    _gates(res, ref)
    # gene by gene (R's values are rounded to 7 significant digits here, at most 5e-7 relative, so 1e-6 applies).
    # gpuc computes R's dispersions, trend and fits with R's arithmetic: every dispersion column of every gene equals
    # R's to the references' rounding, and every result column too, the 5 genes of ~type + condition whose IRLS
    # reaches 100 iterations included (R refits them by optim's L-BFGS-B; so does gpuc, step for step).
    ok = np.isfinite(ref["dispFit"].to_numpy())
    for f in ("dispGeneEst", "dispFit", "dispersion"):
        assert np.abs(a.var[f"deseq_{f}"].to_numpy()[ok] / ref[f].to_numpy()[ok] - 1).max() < 1e-6, f
    optim = a.var["deseq_betaIter"].to_numpy() >= 100
    assert optim.sum() == (0 if tag == "condition" else 5)
    for col in ("log2FoldChange", "lfcSE", "pvalue", "padj"):
        m, r = res[col].to_numpy(), ref[col].to_numpy()
        np.testing.assert_array_equal(np.isnan(m), np.isnan(r))
        fin = np.isfinite(r)
        np.testing.assert_allclose(m[fin], r[fin], rtol=1e-6, atol=0, err_msg=col)
    sig, sig_r = set(res.index[res["padj"] < 0.1]), set(ref.index[ref["padj"] < 0.1])
    assert sig == sig_r, (sorted(sig - sig_r), sorted(sig_r - sig))


@pytest.mark.parametrize("tag", list(DESIGN))
def test_pasilla_lfcshrink_normal_vs_r(pasilla_fits, tag):
    """lfcShrink(type = "normal"): the prior variance and the ridge refit are R's, so every shrunken fold change and
    SE equals R's within the reference's 7 significant digits."""
    ref = pd.read_csv(DATA / f"pasilla_{tag}_R.csv.gz", index_col=0)
    res = gpuc.get.deseq_results(pasilla_fits[tag])
    for mine, theirs in (("log2FoldChange_shrunk", "shrunk_log2FoldChange"), ("lfcSE_shrunk", "shrunk_lfcSE")):
        m, r = res[mine].to_numpy(), ref[theirs].to_numpy()
        np.testing.assert_array_equal(np.isnan(m), np.isnan(r))
        fin = np.isfinite(r)
        np.testing.assert_allclose(m[fin], r[fin], rtol=1e-6, atol=0, err_msg=mine)


def test_pasilla_lrt_vs_r():
    """LRT ~type + condition vs ~type (type's reference level paired-end, as R's) gene by gene: R's statistic is a
    difference of log-likelihoods (DESeq2's nbinomLogLike: R's dnbinom and long-double row sums at the unfloored means;
    a gene refitted by optim at the floored ones), so gpuc takes R's own: R's 98 negative statistics (rounding, and 3
    optim genes by up to -0.17) come out negative too. Every column within the reference's 7 significant digits."""
    a = gpuc.datasets.pasilla()
    a.obs["type"] = a.obs["type"].cat.reorder_categories(["paired-end", "single-read"])
    gpuc.tl.deseq(a, "~type + condition", test="lrt", reduced="~type", alpha=0.1, device="cpu")
    ref = pd.read_csv(DATA / "lrt_pasilla_type_condition_R.csv.gz", index_col=0)
    res = gpuc.get.deseq_results(a)
    assert (res["stat"] < 0).sum() == (ref["stat"] < 0).sum() == 98
    for col in ("log2FoldChange", "stat", "pvalue", "padj"):
        m, r = res[col].to_numpy(), ref[col].to_numpy()
        np.testing.assert_array_equal(np.isnan(m), np.isnan(r))
        fin = np.isfinite(r)
        np.testing.assert_allclose(m[fin], r[fin], rtol=1e-6, atol=0, err_msg=col)
    assert set(res.index[res["padj"] < 0.1]) == set(ref.index[ref["padj"] < 0.1])


def test_pasilla_vst_blind_vs_r():
    """R's vst() fits the trend on 1,000 random genes, so agreement is to ~0.03 on the log2 scale, not exact."""
    a = gpuc.datasets.pasilla()
    gpuc.tl.vst(a, device="cpu")
    ref = pd.read_csv(DATA / "pasilla_vst_blind_every10th_R.csv.gz", index_col=0)
    got = pd.DataFrame(a.layers["vst"].T, index=a.var_names, columns=a.obs_names).loc[ref.index, ref.columns].to_numpy()
    assert np.max(np.abs(got - ref.to_numpy())) < 0.03
    assert np.corrcoef(got.ravel(), ref.to_numpy().ravel())[0, 1] > 0.99999


@pytest.mark.slow
@pytest.mark.parametrize(("tag", "design"), [("dex", "~dex"), ("cell_dex", "~cell + dex")])
def test_airway_vs_r(shared_data, tag, design):
    base = shared_data / "bulk" / "airway"
    a = airway(shared_data)
    gpuc.tl.deseq(a, design, contrast=["dex", "trt", "untrt"], alpha=0.1, lfc_shrink="normal", device="cpu")
    adata = a
    res = gpuc.get.deseq_results(a)
    ref = pd.read_csv(base / "deseq2_R_reference" / f"results_{tag}.csv.gz", index_col=0)
    _gates(res, ref)
    shr = pd.read_csv(base / "deseq2_R_reference" / f"lfcShrink_normal_{tag}.csv.gz", index_col=0)
    a, b = res["log2FoldChange_shrunk"].to_numpy(), shr["log2FoldChange"].to_numpy()
    ok = np.isfinite(a) & np.isfinite(b)
    assert np.corrcoef(a[ok], b[ok])[0, 1] >= 0.9999
    big = ok & (shr["baseMean"].to_numpy() >= 10)
    # with ~cell + dex, n - p = 3 and the dispersion prior variance comes from R's seeded simulation, which
    # gpuc.deseq._rrandom replays draw for draw: both designs agree with R gene by gene (measured: 99th percentile
    # 2e-12 / 2e-11; every dispersion and every result within 1e-6, identical padj < 0.1 sets)
    assert np.percentile(np.abs(a[big] - b[big]), 99) <= 1e-9
    for col in ("log2FoldChange", "lfcSE", "stat", "pvalue", "padj"):
        m, r = res[col].to_numpy(), ref[col].to_numpy()
        np.testing.assert_array_equal(np.isnan(m), np.isnan(r))
        fin = np.isfinite(r)
        np.testing.assert_allclose(m[fin], r[fin], rtol=1e-6, atol=0, err_msg=col)
    disp = pd.read_csv(base / "deseq2_R_reference" / f"gene_fit_{tag}.csv.gz", index_col=0)["dispersion"].to_numpy()
    mine = adata.var["deseq_dispersion"].to_numpy()
    fin = np.isfinite(disp)
    assert np.array_equal(fin, np.isfinite(mine))
    assert np.abs(mine[fin] / disp[fin] - 1).max() <= 1e-6
    pa, pb = res["padj"].to_numpy(), ref["padj"].to_numpy()
    assert set(np.nonzero(pa < 0.1)[0]) == set(np.nonzero(pb < 0.1)[0])
