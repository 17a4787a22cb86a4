"""R's random streams and R DESeq2's simulated dispersion prior variance (n - p = 1, 2, 3), against R itself.

References: ``tests/data/deseq/priorvar/`` made by ``make_reference.R`` beside them (R 4.2.2, DESeq2 1.38.3).
"""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest

import gpuc
from gpuc.deseq._dispersion import prior_variance
from gpuc.deseq._rrandom import RStream, kl_curve, loess_interpolate

DATA = Path(__file__).resolve().parents[1] / "data" / "deseq" / "priorvar"


def _csv(path: Path, **kw) -> pd.DataFrame:
    """R's 17-digit numbers, parsed exactly (pandas' default parser can be off in the last bit)."""
    return pd.read_csv(path, float_precision="round_trip", **kw)


@pytest.fixture(scope="module")
def streams() -> pd.DataFrame:
    return _csv(DATA / "rng_streams.csv")


@pytest.fixture(scope="module")
def prior_ref() -> pd.Series:
    return _csv(DATA / "prior_var_R.csv", index_col=0)["dispPriorVar"]


@pytest.mark.parametrize(
    ("column", "draw"),
    [
        ("runif", lambda r, k: r.runif(k)),
        ("rnorm", lambda r, k: r.rnorm(k)),
        ("rexp", lambda r, k: r.rexp(k)),
        ("rchisq1", lambda r, k: r.rchisq(k, 1)),  # rgamma shape 0.5: GS
        ("rchisq2", lambda r, k: r.rchisq(k, 2)),  # shape 1: GD
        ("rchisq3", lambda r, k: r.rchisq(k, 3)),  # shape 1.5: GD
        (
            "mixed",
            lambda r, k: np.concatenate([r.rchisq(k // 3, 3), r.rnorm(k // 3, 0.0), r.rnorm(k // 3, np.sqrt(8 / 199))]),
        ),
    ],
)
def test_streams_equal_r(streams, column, draw):
    """After set.seed(2) every draw equals R's (1e-15 relative; in practice bit for bit)."""
    want = streams[column].to_numpy()
    got = draw(RStream(2), want.shape[0])
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)


def test_stream_other_seed_differs(streams):
    assert not np.allclose(RStream(3).runif(10), streams["runif"].to_numpy()[:10])


def test_loess_interpolate_equals_r():
    """R's loess(y ~ x, span = 0.2) (interpolate surface) on the 200-point variance grid, predicted on 1,000 points."""
    y = _csv(DATA / "loess_y.csv")["y"].to_numpy()
    want = _csv(DATA / "loess_fit_R.csv")["fit"].to_numpy()
    got = loess_interpolate(np.linspace(0, 8, 200), y, np.linspace(0, 8, 1000), span=0.2)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


def _resid(genes: pd.DataFrame) -> np.ndarray:
    """R's dispResiduals[aboveMinDisp] from its per-gene values (all-zero genes are NA there)."""
    g = genes.dropna(subset=["dispGeneEst"])
    ge, fit = g["dispGeneEst"].to_numpy(), g["dispFit"].to_numpy()
    above = ge >= 1e-8 * 100
    return np.log(ge[above]) - np.log(fit[above])


def test_kl_curve_equals_r():
    """R's klDivs (hist densities, KL sums) for the df = 3 set's residuals, on the 200-point variance grid."""
    genes = _csv(DATA / "genes_df3.csv.gz", index_col=0)
    want = _csv(DATA / "kl_df3_R.csv")["kl"].to_numpy()
    np.testing.assert_allclose(kl_curve(_resid(genes), 3, np.linspace(0, 8, 200)), want, rtol=1e-15, atol=0)


@pytest.mark.parametrize("df", [1, 2, 3])
def test_prior_variance_from_r_residuals(prior_ref, df):
    """prior_variance on R's residuals returns R's dispPriorVar exactly (a point of R's 1,000-point grid)."""
    genes = _csv(DATA / f"genes_df{df}.csv.gz", index_col=0)
    pv, method = prior_variance(_resid(genes), float("nan"), df + 2, 2)
    assert method == "simulation"
    assert pv == prior_ref[f"df{df}"]
    assert pv > 0.25  # the sets are made so that the floor does not hide the simulation


@pytest.mark.parametrize("df", [1, 2, 3])
def test_deseq_prior_variance_and_dispersions_equal_r(prior_ref, df):
    """End to end: tl.deseq's prior variance is R's, and so are its final dispersions (1e-6 on >= 99.9% of genes)."""
    counts = _csv(DATA / f"counts_df{df}.csv.gz", index_col=0)
    m = counts.shape[1]
    cond = pd.Categorical(np.repeat(["A", "B"], [(m + 1) // 2, m // 2]), ["A", "B"])
    a = ad.AnnData(X=counts.T.to_numpy(), obs=pd.DataFrame({"condition": cond}, index=counts.columns))
    a.var_names = counts.index
    with pytest.warns(UserWarning, match="matched by simulation"):
        gpuc.tl.deseq(a, "~condition", contrast=["condition", "B", "A"], device="cpu")
    assert a.uns["deseq"]["prior_disp_var"] == prior_ref[f"df{df}"]
    assert a.uns["deseq"]["prior_disp_var_method"] == "simulation"
    ref = _csv(DATA / f"genes_df{df}.csv.gz", index_col=0)["dispersion"].to_numpy()
    got = a.var["deseq_dispersion"].to_numpy()
    ok = np.isfinite(ref)
    assert np.array_equal(ok, np.isfinite(got))
    rel = np.abs(got[ok] / ref[ok] - 1)
    assert np.mean(rel <= 1e-6) >= 0.999


def test_airway_prior_variance_from_r_residuals(shared_data, prior_ref):
    """airway ~cell + dex (n - p = 3) from R's per-gene output: R's 0.5285..."""
    genes = _csv(shared_data / "bulk" / "airway" / "deseq2_R_reference" / "gene_fit_cell_dex.csv.gz", index_col=0)
    pv, _ = prior_variance(_resid(genes), float("nan"), 8, 5)
    assert pv == prior_ref["airway_cell_dex"]
