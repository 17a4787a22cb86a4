"""What the NMF figures show: readable programme bars, usage panels that say which fit they come from."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pytest

import gpuc


@pytest.fixture(scope="module")
def fitted(program_factory):
    ad = program_factory(80, 60, 4, seed=3)
    ad.var_names = [f"LONGGENENAME{i}-AS1" for i in range(ad.n_vars)]
    gpuc.tl.consensus_nmf(ad, 4, n_runs=6, layer="counts", preprocessing="sd")
    ad.obsm["X_umap"] = np.random.default_rng(0).normal(size=(ad.n_obs, 2))
    return ad


@pytest.mark.parametrize(("by", "xlabel", "scale"), [("weight", "% of programme", 100.0), ("score", "score", 1.0)])
def test_programs_labels_do_not_overlap(fitted, by, xlabel, scale):
    fig = gpuc.pl.nmf_programs(fitted, n_genes=12, by=by, show=False)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    texts = []
    for a in fig.axes:
        if not a.get_visible():
            continue
        assert a.get_xlabel().startswith(xlabel)
        texts += [t for t in a.get_yticklabels() + a.get_xticklabels() if t.get_text()]
    boxes = [t.get_window_extent(r) for t in texts]
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            b, c = boxes[i], boxes[j]
            assert b.x1 <= c.x0 or c.x1 <= b.x0 or b.y1 <= c.y0 or c.y1 <= b.y0, (texts[i], texts[j])
    # the bars are those of nmf_top_genes (weights as percentages of the programme): the top gene of P1
    top = gpuc.get.nmf_top_genes(fitted, 1, by=by)
    widths = [p.get_width() for p in fig.axes[0].patches]
    assert max(widths) == pytest.approx(scale * top[by].iloc[0])
    ticks = {t.get_position()[1]: t.get_text() for t in fig.axes[0].get_yticklabels()}
    assert ticks[max(ticks)] == top["gene"].iloc[0]  # the top bar is the top gene
    plt.close("all")


def test_usage_marker_size_and_source(fitted):
    small = fitted[:35].copy()
    fig = gpuc.pl.nmf_usage(small, show=False)
    sizes = {float(s) for a in fig.axes for c in a.collections if len(c.get_offsets()) == 35 for s in c.get_sizes()}
    assert sizes and max(sizes) <= 60
    assert "fitted on these 35 cells" in fig._suptitle.get_text()
    # usages copied in from another fit (no uns[key] here): the title says so
    other = fitted.copy()
    other.obsm["X_mcfit"] = other.obsm["X_nmf"]
    fig = gpuc.pl.nmf_usage(other, key="mcfit", show=False)
    assert "separate fit" in fig._suptitle.get_text()
    plt.close("all")
