"""What the DESeq2 figures show: non-overlapping gene labels (symbols when var has them), legend outside, a title."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pytest

import gpuc


@pytest.fixture(scope="module")
def fit():
    pb = gpuc.datasets.pasilla()
    pb.var["gene_symbols"] = [f"sym{i}" for i in range(pb.n_vars)]
    gpuc.tl.deseq(pb, "~condition", contrast=["condition", "treated", "untreated"], lfc_shrink="normal")
    return pb


def _boxes_overlap(a, b) -> bool:
    return not (a.x1 <= b.x0 or b.x1 <= a.x0 or a.y1 <= b.y0 or b.y1 <= a.y0)


@pytest.mark.parametrize("plot", ["volcano", "ma"])
def test_labels_legend_title(fit, plot):
    ax = getattr(gpuc.pl, plot)(fit, n_top=20, show=False, **({"shrunk": True} if plot == "ma" else {}))
    fig = ax.figure
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    labels = [t for t in ax.texts if t.get_text()]
    assert len(labels) >= 10
    assert all(t.get_text().startswith("sym") for t in labels)  # symbols, not var_names
    boxes = [t.get_window_extent(r) for t in labels]
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            assert not _boxes_overlap(boxes[i], boxes[j]), (labels[i].get_text(), labels[j].get_text())
    axbox = ax.get_window_extent(r)
    assert all(axbox.x0 <= b.x0 and b.x1 <= axbox.x1 and axbox.y0 <= b.y0 and b.y1 <= axbox.y1 for b in boxes)
    legend = ax.get_legend().get_window_extent(r)
    assert legend.x0 >= axbox.x1  # outside the data
    assert "treated_vs_untreated" in ax.get_title()
    # the most significant gene is labelled
    res = gpuc.get.deseq_results(fit).sort_values("pvalue")
    assert fit.var.loc[res.index[0], "gene_symbols"] in {t.get_text() for t in labels}
    plt.close("all")


def test_gene_symbols_option(fit):
    with pytest.raises(KeyError, match="gene_symbols"):
        gpuc.pl.volcano(fit, gene_symbols="nope", show=False)
    ax = gpuc.pl.volcano(fit, gene_symbols="gene_symbols", n_top=3, show=False)
    assert len([t for t in ax.texts if t.get_text()]) == 3
    del fit.var["gene_symbols"]
    ax = gpuc.pl.volcano(fit, n_top=3, show=False)
    assert all(t.get_text().startswith("FBgn") for t in ax.texts if t.get_text())
    np.testing.assert_equal(len(ax.texts) >= 3, True)
    plt.close("all")


def _with_results(fit, **columns):
    """A copy of ``fit`` whose stored results table has the given columns replaced."""
    out = fit.copy()
    name = next(iter(out.uns["deseq"]["results"]))
    df = out.uns["deseq"]["results"][name].copy()
    for col, values in columns.items():
        df[col] = values
    out.uns["deseq"]["results"][name] = df
    return out


def test_volcano_marks_p_values_capped_at_the_axis(fit):
    res = gpuc.get.deseq_results(fit)
    p = res["pvalue"].to_numpy().copy()
    top = np.argsort(np.where(np.isfinite(p), p, np.inf))[:5]
    p[top] = 0.0  # underflowed: -log10 is infinite
    capped = _with_results(fit, pvalue=p)
    ax = gpuc.pl.volcano(capped, show=False)
    marked = [c for c in ax.collections if "p = 0" in str(c.get_label())]
    assert len(marked) == 1
    lfc = res["log2FoldChange"].to_numpy()
    np.testing.assert_allclose(np.sort(marked[0].get_offsets()[:, 0]), np.sort(lfc[top]))
    # a distinct marker (not the circles of the other genes), at the top of the axis, above every measured gene
    circle = next(c for c in ax.collections if c.get_label() == "n.s.")
    assert marked[0].get_paths()[0].vertices.shape != circle.get_paths()[0].vertices.shape
    y_cap = marked[0].get_offsets()[:, 1]
    others = np.concatenate([c.get_offsets()[:, 1] for c in ax.collections if c is not marked[0]])
    assert (y_cap > others.max()).all() and np.isfinite(y_cap).all()
    assert ax.get_ylim()[1] >= y_cap.max()
    assert others.max() > 0.8 * y_cap.max()  # the measured genes keep the height of the axis (no cap at 300)
    assert any("p = 0" in t.get_text() for t in ax.get_legend().get_texts())
    plt.close("all")


def test_volcano_and_ma_label_nothing_when_nothing_is_significant(fit):
    n = fit.n_vars
    none = _with_results(fit, padj=np.ones(n))
    for plot in (gpuc.pl.volcano, gpuc.pl.ma):
        ax = plot(none, n_top=10, show=False)
        assert [t.get_text() for t in ax.texts if t.get_text()] == []
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert any("no gene with padj <" in t for t in legend), legend
        plt.close("all")
    # with some significant genes, only those are labelled
    res = gpuc.get.deseq_results(fit)
    padj = np.ones(n)
    keep = np.argsort(res["pvalue"].fillna(1).to_numpy())[:3]
    padj[keep] = 1e-6
    three = _with_results(fit, padj=padj)
    ax = gpuc.pl.volcano(three, n_top=10, show=False)
    labels = {t.get_text() for t in ax.texts if t.get_text()}
    allowed = set(fit.var_names[keep])
    if "gene_symbols" in fit.var:  # another test of this module removes them
        allowed |= set(fit.var["gene_symbols"].iloc[keep])
    assert labels and labels <= allowed
    plt.close("all")
