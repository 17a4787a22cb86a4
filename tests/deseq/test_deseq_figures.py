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
