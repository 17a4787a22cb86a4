"""aggregate_metacells, metacell_quality (against the numbers of SEACells' evaluate module) and the plots."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from matplotlib.axes import Axes
from matplotlib.figure import Figure

import gpuc


@pytest.fixture
def fitted(pbmc68k_fitted):
    ad = pbmc68k_fitted.copy()
    ad.layers["counts"] = (
        sp.csr_matrix(np.round(np.expm1(ad.raw.X.toarray()))) if ad.raw is not None else sp.csr_matrix(ad.X)
    )
    return ad


def test_aggregate_hard_sums(fitted):
    mc = gpuc.tl.aggregate_metacells(fitted, layer="counts", celltype_key="bulk_labels")
    labels = fitted.obs["metacell"].astype(str)
    assert list(mc.obs_names) == list(fitted.obs["metacell"].cat.categories)
    counts = fitted.layers["counts"].toarray()
    for name in mc.obs_names[:4]:
        m = (labels == name).to_numpy()
        np.testing.assert_allclose(mc[name].X.toarray().ravel(), counts[m].sum(0))
        assert mc.obs.loc[name, "size"] == m.sum()
        np.testing.assert_allclose(
            mc.obsm["X_umap"][mc.obs_names.get_loc(name)], fitted.obsm["X_umap"][m].mean(0), rtol=1e-6
        )
        top = fitted.obs.loc[m, "bulk_labels"].value_counts()
        assert mc.obs.loc[name, "bulk_labels"] == top.index[0]
        assert mc.obs.loc[name, "bulk_labels_purity"] == pytest.approx(top.iloc[0] / m.sum())
    assert sp.issparse(mc.X) and mc.n_vars == fitted.n_vars
    assert mc.X.sum() == pytest.approx(counts.sum())


def test_aggregate_soft_preserves_totals(fitted):
    # the weighted sums over every weight (minimum_weight=0); soft=True is SEACells' weighted mean
    mc = gpuc.tl.aggregate_metacells(fitted, layer="counts", soft="sum", minimum_weight=0)
    w = fitted.obsm["metacell_weights"]
    assert mc.n_obs == int((np.asarray(w.sum(axis=0)).ravel() > 0).sum())
    np.testing.assert_allclose(mc.X.sum(), fitted.layers["counts"].sum(), rtol=1e-10)
    np.testing.assert_allclose(mc.obs["size"].sum(), fitted.n_obs)
    want = (w.T @ fitted.layers["counts"]).toarray()[0]
    np.testing.assert_allclose(mc.X[0].toarray().ravel(), want)


def test_aggregate_requires_a_run(pbmc68k):
    with pytest.raises(KeyError, match=r"gpuc\.tl\.metacells"):
        gpuc.tl.aggregate_metacells(pbmc68k)


def test_quality_matches_seacells_evaluate_numbers(fitted):
    # SEACells 0.3.3 evaluate.compactness / separation / compute_celltype_purity on the same run
    # gave compactness mean 0.152 (median 0.027), separation mean 1.09
    # (median 0.57), bulk_labels purity mean 0.715 (min 0.349, max 1.0)
    q = gpuc.tl.metacell_quality(fitted, celltype_key="bulk_labels", inplace=False)
    assert isinstance(q, pd.DataFrame) and len(q) == 9
    assert q["compactness"].mean() == pytest.approx(0.152, abs=0.0015)
    assert q["compactness"].median() == pytest.approx(0.027, abs=0.0015)
    assert q["separation"].mean() == pytest.approx(1.09, abs=0.01)
    assert q["separation"].median() == pytest.approx(0.57, abs=0.01)
    assert q["bulk_labels_purity"].mean() == pytest.approx(0.715, abs=0.001)
    assert q["bulk_labels_purity"].min() == pytest.approx(0.349, abs=0.001)
    assert "metacell_quality" not in fitted.uns  # inplace=False writes nothing
    gpuc.tl.metacell_quality(fitted, celltype_key="bulk_labels")
    pd.testing.assert_frame_equal(fitted.uns["metacell_quality"], q)
    out = gpuc.tl.metacell_quality(fitted, key_added="q2", copy=True)
    assert "q2" in out.uns and "q2" not in fitted.uns


def test_plots_return_axes_and_figure(fitted):
    gpuc.tl.metacell_quality(fitted, celltype_key="bulk_labels")
    ax = gpuc.pl.metacells(fitted, "umap", show=False)
    assert isinstance(ax, Axes)
    # cells + the 9 centres
    offsets = [c.get_offsets().shape[0] for c in ax.collections]
    assert offsets == [700, 9]
    ax2 = gpuc.pl.metacells(fitted, "umap", color="bulk_labels", show=False)
    assert len(ax2.get_legend().get_texts()) == fitted.obs["bulk_labels"].nunique()
    ax3 = gpuc.pl.metacell_sizes(fitted, show=False)
    assert isinstance(ax3, Axes) and sum(p.get_height() for p in ax3.patches) == 9
    ax4 = gpuc.pl.metacell_convergence(fitted, show=False)
    np.testing.assert_allclose(ax4.lines[0].get_ydata(), fitted.uns["metacell"]["rss"])
    fig = gpuc.pl.metacell_quality(fitted, show=False)
    assert isinstance(fig, Figure) and len(fig.axes) == 3
    plt.close("all")
    with pytest.raises(KeyError, match="basis"):
        gpuc.pl.metacells(fitted, "tsne", show=False)
