"""What the metacell figures show: Scanpy's colours, distinct colours between neighbouring metacells, centres on
member cells, titles that follow ``color``, readable quality axes."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pytest
import scanpy as sc
from matplotlib.colors import to_rgba

import gpuc


@pytest.fixture(scope="module")
def many(_pbmc68k):
    ad = _pbmc68k.copy()
    gpuc.tl.metacells(ad, n_metacells=40, device="cpu", random_state=0)
    return ad


def _cell_colors(ax, n_obs):
    cols = [c for c in ax.collections if len(c.get_offsets()) == n_obs]
    assert len(cols) == 1
    return np.asarray(cols[0].get_facecolors())


def test_categorical_colors_are_scanpys(many):
    ad = many.copy()
    ad.uns.pop("bulk_labels_colors", None)
    # without uns colours: the ones sc.pl.umap would pick
    ax = gpuc.pl.metacells(ad, color="bulk_labels", show=False)
    assert "bulk_labels_colors" not in ad.uns  # plotting writes nothing
    cats = ad.obs["bulk_labels"].cat.categories
    sc.pl.umap(ad, color="bulk_labels", show=False)  # writes uns['bulk_labels_colors']
    want = [to_rgba(c) for c in ad.uns["bulk_labels_colors"]]
    by_label = {c.get_label(): to_rgba(c.get_facecolor()[0]) for c in ax.collections if c.get_label() in cats}
    assert [by_label[c] for c in cats] == want
    # more categories than matplotlib's colour cycle: Scanpy's 20-colour palette, as sc.pl.umap picks
    ad.obs["many"] = ad.obs["metacell"].cat.codes.astype(str).astype("category")
    ax = gpuc.pl.metacells(ad, color="many", show=False)
    sc.pl.umap(ad, color="many", show=False)
    assert len(ad.obs["many"].cat.categories) > 10
    cats = ad.obs["many"].cat.categories
    by_label = {c.get_label(): to_rgba(c.get_facecolor()[0]) for c in ax.collections if c.get_label() in cats}
    assert [by_label[c] for c in cats] == [to_rgba(c) for c in ad.uns["many_colors"]]
    # with user colours in uns: those
    ad.uns["bulk_labels_colors"] = ["#000000"] * len(cats)
    ax = gpuc.pl.metacells(ad, color="bulk_labels", show=False)
    assert all(to_rgba(c.get_facecolor()[0]) == (0, 0, 0, 1) for c in ax.collections if c.get_label() in cats)
    assert ax.get_title() == "bulk_labels, with the 40 metacells"
    plt.close("all")


def test_metacell_palette_differs_between_neighbours_and_centres_sit_on_members(many):
    from scipy.spatial import cKDTree

    ax = gpuc.pl.metacells(many, show=False)
    assert ax.get_title() == "40 metacells (metacell)"
    xy = many.obsm["X_umap"][:, :2]
    codes = many.obs["metacell"].cat.codes.to_numpy()
    cols = _cell_colors(ax, many.n_obs)
    mc_col = np.array([cols[codes == c][0] for c in range(40)])
    assert all((cols[codes == c] == mc_col[c]).all() for c in range(40))  # one colour per metacell
    centres = np.asarray(next(c for c in ax.collections if len(c.get_offsets()) == 40).get_offsets())
    for c in range(40):  # each centre is one of the metacell's own cells
        assert (np.abs(xy[codes == c] - centres[c]).sum(axis=1) < 1e-9).any()
    near = cKDTree(centres).query(centres, k=9)[1][:, 1:]
    for c in range(40):
        for j in near[c]:
            assert not np.allclose(mc_col[c], mc_col[j]), f"metacells {c} and {j} are neighbours with one colour"
    assert len({tuple(x) for x in mc_col}) > 8
    plt.close("all")


def test_quality_axes_labelled_and_log_for_outliers(many):
    ad = many.copy()
    gpuc.tl.metacell_quality(ad, celltype_key="bulk_labels")
    q = ad.uns["metacell_quality"]
    q.loc[q.index[0], "compactness"] = q["compactness"].median() * 1000  # one isolated metacell
    fig = gpuc.pl.metacell_quality(ad, show=False)
    axes = fig.axes
    assert [a.get_yscale() for a in axes[:1]] == ["log"]
    assert axes[2].get_yscale() == "linear"  # purity stays linear
    assert all(a.get_ylabel() for a in axes)
    plt.close("all")
