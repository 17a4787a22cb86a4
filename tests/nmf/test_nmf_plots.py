"""get.nmf_top_genes and the five NMF plots read only what tl wrote and return Axes/Figure with show=False."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

import gpuc
from gpuc._errors import GpucWarning


@pytest.fixture(scope="module")
def fitted(program_factory):
    ad = program_factory(seed=4)
    gpuc.tl.nmf_k_sweep(ad, [2, 3, 4], n_runs=4, layer="counts", device="cpu")
    gpuc.tl.nmf_k_sweep(
        ad, [2, 3], n_runs=3, layer="counts", device="cpu", density_threshold=0.0, key_added="failed_sweep"
    )
    gpuc.tl.consensus_nmf(ad, 3, n_runs=6, layer="counts", device="cpu", density_threshold=0.3)
    ad.obsm["X_umap"] = np.random.default_rng(0).normal(size=(ad.n_obs, 2))
    return ad


def test_nmf_top_genes_by_weight(fitted):
    top = gpuc.get.nmf_top_genes(fitted, 5, by="weight")
    assert list(top.columns) == ["program", "rank", "gene", "weight"]
    assert len(top) == 15
    spectra = fitted.varm["nmf_spectra"]
    for j, (_, sub) in enumerate(top.groupby("program", observed=True)):
        assert (np.diff(sub["weight"].to_numpy()) <= 0).all()
        expected = fitted.var_names[np.argsort(-spectra[:, j], kind="stable")[:5]]
        assert list(sub["gene"]) == list(expected)
    # planted programmes are disjoint gene blocks: a programme's top genes come from one block (g0-19, g20-39, g40-59)
    for _, sub in top.groupby("program", observed=True):
        blocks = {int(g[1:]) // 20 for g in sub["gene"]}
        assert len(blocks) == 1
    wide = gpuc.get.nmf_top_genes(fitted, 5, by="weight", wide=True)
    assert list(wide.columns) == ["P1", "P2", "P3"] and wide.shape == (5, 3)
    with pytest.raises(KeyError, match="consensus_nmf"):
        gpuc.get.nmf_top_genes(fitted, key="other")
    with pytest.raises(ValueError, match="by="):
        gpuc.get.nmf_top_genes(fitted, by="usage")


def test_nmf_top_genes_by_score_is_the_default_and_names_the_planted_blocks(fitted):
    top = gpuc.get.nmf_top_genes(fitted, 5)
    assert list(top.columns) == ["program", "rank", "gene", "score"]
    scores = gpuc.get.nmf_gene_scores(fitted)
    assert list(scores.columns) == ["P1", "P2", "P3"]
    for p, sub in top.groupby("program", observed=True):
        assert (np.diff(sub["score"].to_numpy()) <= 0).all()
        assert list(sub["gene"]) == list(scores[p].sort_values(ascending=False, kind="stable").index[:5])
        assert len({int(g[1:]) // 20 for g in sub["gene"]}) == 1
    # each programme's score genes come from another planted block
    firsts = top[top["rank"] == 1]["gene"]
    assert len({int(g[1:]) // 20 for g in firsts}) == 3


def test_nmf_gene_scores_are_least_squares_of_z_scored_expression(fitted):
    # independent dense computation over every gene: cells scaled to the same total (preprocessing='none' here:
    # normalize=True asked for), genes z-scored with the population SD, then ordinary least squares on the usages
    counts = fitted.layers["counts"].toarray().astype(np.float64)
    tpm = counts / counts.sum(1, keepdims=True) * 1e6
    z = (tpm - tpm.mean(0)) / tpm.std(0)
    want = np.linalg.lstsq(fitted.obsm["X_nmf"], z, rcond=None)[0].T
    got = gpuc.get.nmf_gene_scores(fitted, normalize=True)
    assert list(got.index) == list(fitted.var_names)
    np.testing.assert_allclose(got.to_numpy(), want, rtol=1e-8, atol=1e-10)
    # the default for preprocessing='none' reads the layer as it is: the stored varm scores, and the same recomputed
    z = (counts - counts.mean(0)) / counts.std(0)
    want = np.linalg.lstsq(fitted.obsm["X_nmf"], z, rcond=None)[0].T
    np.testing.assert_allclose(gpuc.get.nmf_gene_scores(fitted).to_numpy(), want, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(fitted.varm["nmf_spectra_score"], want, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(
        gpuc.get.nmf_gene_scores(fitted, normalize=False).to_numpy(), want, rtol=1e-8, atol=1e-10
    )


def test_nmf_gene_scores_match_cnmf(test_data, cnmf_counts):
    """cNMF 1.7.1's gene_spectra_score (k=7 on the pbmc68k counts, refit_usage=False so that the stored usages are
    those it regressed on), recomputed from its usages and the counts of its 500 HVGs (each score depends only on its
    own gene; the cells' totals over all 765 genes, which cNMF's TPM divides by, are stored with the reference)."""
    from gpuc.get._nmf import gene_scores

    ref = np.load(test_data / "nmf" / "cnmf_k7_gene_spectra_score.npz", allow_pickle=False)
    assert list(ref["genes"]) == list(cnmf_counts.var_names)
    assert list(ref["cells"]) == list(cnmf_counts.obs_names)
    got = gene_scores(cnmf_counts.X, ref["usages"], ref["totals"])
    # cNMF z-scores its TPM in float32: agreement to 1e-7 of the largest score
    np.testing.assert_allclose(got, ref["scores"], rtol=0, atol=1e-7 * np.abs(ref["scores"]).max())
    # cNMF's top genes of each programme are ours
    for j in range(got.shape[0]):
        assert set(np.argsort(-got[j])[:10]) == set(np.argsort(-ref["scores"][j])[:10])


def test_nmf_plot_k_sweep(fitted):
    fig = gpuc.pl.nmf_k_sweep(fitted, show=False)
    a0, a1 = fig.axes[:2]
    np.testing.assert_array_equal(a0.lines[0].get_xdata(), [2, 3, 4])
    np.testing.assert_allclose(a1.lines[0].get_ydata(), fitted.uns["nmf_k_sweep"]["table"]["median_error"])
    plt.close(fig)
    fig = gpuc.pl.nmf_k_sweep(fitted, key="failed_sweep", show=False)
    assert any(line.get_label() == "consensus failed" for line in fig.axes[0].lines)
    plt.close(fig)


def test_nmf_plot_density_counts_dropped(fitted):
    comp = fitted.uns["nmf"]["components"]
    ax = gpuc.pl.nmf_density(fitted, show=False)
    assert ax.get_title() == f"{int((~comp['kept']).sum())} of {len(comp)} dropped"
    plt.close(ax.figure)
    ax = gpuc.pl.nmf_density(fitted, threshold=2.0, show=False)
    assert ax.get_title() == f"0 of {len(comp)} dropped"
    plt.close(ax.figure)


def test_nmf_plot_clustergram_programs_usage(fitted):
    ax = gpuc.pl.nmf_clustergram(fitted, show=False)
    n_kept = int(fitted.uns["nmf"]["components"]["kept"].sum())
    assert ax.images[0].get_array().shape == (n_kept, n_kept)
    plt.close(ax.figure)
    fig = gpuc.pl.nmf_programs(fitted, n_genes=4, show=False)
    assert sum(a.get_visible() for a in fig.axes) == 3
    plt.close(fig)
    fig = gpuc.pl.nmf_usage(fitted, basis="umap", show=False)
    assert [a.get_title() for a in fig.axes if a.get_title()] == ["P1", "P2", "P3"]
    plt.close(fig)
    with pytest.raises(KeyError, match="X_tsne"):
        gpuc.pl.nmf_usage(fitted, basis="tsne", show=False)


def test_nmf_plots_on_metacell_like_anndata(program_factory):
    # metacell AnnData (summed counts per metacell, no HVG column needed when mask_var=None)
    cells = program_factory(n_cells=300, seed=7, sparse=False)
    groups = np.repeat(np.arange(60), 5)
    summed = pd.DataFrame(cells.layers["counts"]).groupby(groups).sum().to_numpy()
    import anndata as ad

    mc = ad.AnnData(summed.astype(np.float32))
    mc.var_names = cells.var_names
    gpuc.tl.consensus_nmf(mc, 3, n_runs=5, mask_var=None, device="cpu")
    mc.obsm["X_umap"] = np.random.default_rng(1).normal(size=(mc.n_obs, 2))
    fig = gpuc.pl.nmf_usage(mc, show=False)
    assert len([a for a in fig.axes if a.get_title()]) == 3
    plt.close(fig)


def test_top_genes_rank_every_gene_by_score_and_tpm_and_factorised_genes_by_weight(fitted):
    factorised = set(fitted.var_names[fitted.var["highly_variable"]])
    assert len(factorised) == 40
    for by, ranked in (("score", set(fitted.var_names)), ("tpm", set(fitted.var_names)), ("weight", factorised)):
        top = gpuc.get.nmf_top_genes(fitted, 100, by=by)  # more than there are: every ranked gene, once each
        assert len(top) == 3 * len(ranked)
        for _, sub in top.groupby("program", observed=True):
            assert set(sub["gene"]) == ranked
    assert set(gpuc.get.nmf_gene_scores(fitted).index) == set(fitted.var_names)
    # genes outside the factorised ones reach a programme's top genes by score: every third gene (g2, g5, ...) was
    # left out of the fit, and the planted blocks hold them too
    top = gpuc.get.nmf_top_genes(fitted, 10)
    for _, sub in top.groupby("program", observed=True):
        assert set(sub["gene"]) - factorised
        assert len({int(g[1:]) // 20 for g in sub["gene"]}) == 1


def test_density_histogram_bars_are_visible_when_densities_are_small(fitted):
    dens = fitted.uns["nmf"]["components"]["local_density"].to_numpy()
    assert dens.max() < 0.3 / 10  # agreed restarts: densities far below the threshold of 0.3
    ax = gpuc.pl.nmf_density(fitted, show=False)
    fig = ax.figure
    fig.canvas.draw()
    bars = [p for p in ax.patches if p.get_height() > 0]
    assert sum(p.get_height() for p in ax.patches) == len(dens)
    lo, hi = ax.get_xlim()
    assert lo <= dens.min() and dens.max() <= hi
    to_px = ax.transData.transform
    # the bars together span a good part of the axis (not a sliver at 0)
    x0 = to_px((min(p.get_x() for p in bars), 0))[0]
    x1 = to_px((max(p.get_x() + p.get_width() for p in bars), 0))[0]
    assert x1 - x0 > 0.5 * ax.get_window_extent().width
    # the threshold, far to the right, is named at the edge of the axis rather than drawn to scale
    assert any("threshold 0.3" in t.get_text() and "→" in t.get_text() for t in ax.texts)
    plt.close(fig)
    # a threshold within the densities is drawn as a line where it is
    thr = float(np.median(dens))
    ax = gpuc.pl.nmf_density(fitted, threshold=thr, show=False)
    assert any(np.allclose(line.get_xdata(), [thr, thr]) for line in ax.lines)
    plt.close(ax.figure)


def _overlap(a, b) -> bool:
    return not (a.x1 <= b.x0 or b.x1 <= a.x0 or a.y1 <= b.y0 or b.y1 <= a.y0)


@pytest.mark.parametrize("mark_k", [2, 3, 4])
def test_k_sweep_legends_clear_the_marked_k(fitted, mark_k):
    fig = gpuc.pl.nmf_k_sweep(fitted, mark_k=mark_k, show=False)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    for a in fig.axes:
        legend = a.get_legend().get_window_extent(r)
        vlines = [ln for ln in a.lines if list(np.ravel(ln.get_xdata())) == [mark_k, mark_k]]
        assert vlines
        for ln in a.lines:  # the marked k and the curves
            assert not _overlap(legend, ln.get_window_extent(r)), (mark_k, ln.get_label())
        # and the legend stays inside the figure
        fb = fig.bbox
        assert fb.x0 <= legend.x0 and legend.x1 <= fb.x1 and fb.y0 <= legend.y0
    plt.close(fig)


def test_k_sweep_when_every_consensus_failed(fitted):
    with pytest.warns(GpucWarning, match="failed for every k"):
        assert gpuc.get.nmf_suggest_k(fitted, key="failed_sweep") is None
    fig = gpuc.pl.nmf_k_sweep(fitted, key="failed_sweep", show=False)
    assert "no k suggested" in fig._suptitle.get_text()
    assert not [ln for a in fig.axes for ln in a.lines if ln.get_linestyle() == "--" and len(set(ln.get_xdata())) == 1]
    plt.close(fig)


def test_nmf_gene_scores_on_device_and_lazy_data(fitted, standin_gpu):
    da = pytest.importorskip("dask.array")  # the lazy layer needs the dask extra

    from gpuc.get._nmf import gene_scores

    counts = fitted.layers["counts"]
    usages = fitted.obsm["X_nmf"]
    totals = np.asarray(counts.sum(1)).ravel()
    want = gene_scores(counts, usages, totals)
    # CuPy (here the stand-in device): the same numbers, computed where the data lives
    np.testing.assert_array_equal(gene_scores(standin_gpu.asarray(counts), usages, totals), want)
    # a lazily read layer (dask, sparse chunks): the factorised genes are loaded, the totals summed chunk by chunk
    lazy = fitted.copy()
    lazy.layers["counts"] = da.from_array(counts, chunks=(50, 60))
    np.testing.assert_allclose(
        gpuc.get.nmf_gene_scores(lazy, normalize=True), gpuc.get.nmf_gene_scores(fitted, normalize=True), rtol=1e-12
    )
