"""gpuc.pl.pca (R plotPCA) and gpuc.pl.counts (R plotCounts): the numbers drawn equal R's returnData (DESeq2 1.38.3,
tests/data/deseq/prefit/make_reference.R), and the figures carry their labels and legends."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

import gpuc
from gpuc._backend import get_backend
from gpuc.deseq._dispersion import DispersionFunction
from gpuc.deseq._rlog import regularized_log
from gpuc.deseq._vst import sample_pca


def _prefit(test_data):
    return test_data / "deseq" / "prefit"


@pytest.fixture(scope="module")
def pasilla_rlog(request):
    """Pasilla with R's blind rlog recomputed exactly (R's trend given), in layers["rlog"]."""
    from pathlib import Path

    d = Path(request.config.rootpath) / "tests" / "data" / "deseq" / "prefit"
    glob = pd.read_csv(d / "globals_R.csv", index_col=0).loc["pasilla"]
    a = gpuc.datasets.pasilla()
    trend = DispersionFunction("parametric", coefs=(glob["blind_asymptDisp"], glob["blind_extraPois"]))
    a.layers["rlog"] = regularized_log(get_backend("cpu"), a.X, trend=trend).values
    return a


def test_sample_pca_equals_r_plotpca(pasilla_rlog, test_data):
    ref = pd.read_csv(_prefit(test_data) / "plotPCA_pasilla_R.csv")
    ref = ref[ref["mode"] == "blind"].set_index("sample").loc[pasilla_rlog.obs_names]
    scores, frac = sample_pca(pasilla_rlog.layers["rlog"], 500)
    for k, col in enumerate(("PC1", "PC2")):
        sign = np.sign(scores[:, k] @ ref[col].to_numpy())
        np.testing.assert_allclose(sign * scores[:, k], ref[col], rtol=0, atol=1e-5)
    np.testing.assert_allclose(frac[:2], [ref["percentVar1"].iloc[0], ref["percentVar2"].iloc[0]], rtol=1e-6)


def test_pl_pca_draws_the_scores(pasilla_rlog, tmp_path):
    ax = gpuc.pl.pca(pasilla_rlog, ["condition", "type"], show=False, save=tmp_path / "pca.png")
    scores, frac = sample_pca(pasilla_rlog.layers["rlog"], 500)
    drawn = np.concatenate([c.get_offsets() for c in ax.collections])
    assert drawn.shape == (7, 2)
    # every sample's (PC1, PC2) is drawn once
    got = sorted(map(tuple, np.round(drawn, 8)))
    assert got == sorted(map(tuple, np.round(scores[:, :2], 8)))
    assert ax.get_xlabel() == f"PC1: {round(100 * frac[0])}% variance"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert sorted(labels) == sorted(
        {f"{c}:{t}" for c, t in zip(pasilla_rlog.obs["condition"], pasilla_rlog.obs["type"], strict=True)}
    )
    fig = ax.figure
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    assert ax.get_legend().get_window_extent(r).x0 >= ax.get_window_extent(r).x1  # outside the data
    assert (tmp_path / "pca.png").stat().st_size > 5000
    with pytest.raises(KeyError, match="vst"):
        gpuc.pl.pca(pasilla_rlog, "condition", key="vst", show=False)
    with pytest.raises(KeyError, match="nope"):
        gpuc.pl.pca(pasilla_rlog, "nope", show=False)
    with pytest.raises(ValueError, match="components"):
        gpuc.pl.pca(pasilla_rlog, "condition", components=(1, 9), show=False)
    plt.close("all")


def test_pl_counts_draws_r_plotcounts(test_data, tmp_path):
    ref = pd.read_csv(_prefit(test_data) / "plotCounts_pasilla_R.csv")
    a = gpuc.datasets.pasilla()
    gene = ref["gene"].iloc[0]
    ax = gpuc.pl.counts(a, gene, "condition", show=False, save=tmp_path / "counts.png")  # size factors computed here
    drawn = {}
    for coll in ax.collections:
        xy = coll.get_offsets()
        drawn[coll.get_label()] = np.sort(xy[:, 1])
    for level, part in ref.groupby("group"):
        np.testing.assert_allclose(drawn[level], np.sort(part["count"].to_numpy()), rtol=1e-10)
    assert ax.get_yscale() == "log" and ax.get_title() == gene
    assert [t.get_text() for t in ax.get_xticklabels()] == list(a.obs["condition"].cat.categories)
    # after a deseq run its size factors are used: the same values here (both median-of-ratios)
    gpuc.tl.deseq(a, "~condition")
    ax2 = gpuc.pl.counts(a, gene, "condition", show=False)
    np.testing.assert_allclose(
        np.sort(np.concatenate([c.get_offsets()[:, 1] for c in ax2.collections])),
        np.sort(ref["count"].to_numpy()),
        rtol=1e-10,
    )
    ax3 = gpuc.pl.counts(a, gene, "condition", normalized=False, log=False, show=False)
    raw = np.asarray(a[:, gene].X).ravel()
    np.testing.assert_array_equal(
        np.sort(np.concatenate([c.get_offsets()[:, 1] for c in ax3.collections])), np.sort(raw)
    )
    with pytest.raises(KeyError, match="not in"):
        gpuc.pl.counts(a, "nope", show=False)
    plt.close("all")
