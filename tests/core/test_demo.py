"""``gpuc demo`` end to end on CPU: every step leaves a summary row, and every figure it writes shows something."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from gpuc._demo import DEMO_STEPS
from gpuc._utils import MAX_COLUMNS
from gpuc.cli import main

pytestmark = pytest.mark.slow  # the whole demo (Scanpy preprocessing + every tool on pbmc3k) takes about a minute

# Thresholds sit well below what the demo draws (measured: 5.5-34% non-background pixels, 270-15,000 distinct colours,
# 0.5-29% saturated pixels) and well above an empty set of axes, which has labels and ticks but no saturated pixel.
MIN_INK = 0.03  # fraction of pixels that differ from the background
MIN_COLOURS = 100  # distinct RGB values
MIN_SATURATED = 0.002  # fraction of clearly coloured (not grey) pixels: the data, every demo plot draws it in colour
# named figures: how many distinct hues (of 24 bins) each must show (measured: 7, 7, 7, 17, 17)
MIN_HUES = {
    "umap_cell_types.png": 5,  # one colour per cell type
    "metacells_umap.png": 5,  # cell types beside the metacell assignment
    "nmf_programs.png": 5,  # one bar colour per programme
    "nmf_usage_umap.png": 8,  # a continuous colour map over the cells
    "nmf_usage_metacells.png": 8,
}
RED, BLUE = {0, 23}, {13, 14}  # hue bins of the significant / fitted (red) and gene-wise / final (blue) points
MUST_SHOW = {
    "deseq_volcano.png": (RED,),  # significant genes in red
    "deseq_dispersion.png": (RED, BLUE),  # the fitted trend in red over the final dispersions in blue
    "deseq_ma_shrunk.png": (BLUE,),
}


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The demo's output folder and what it printed."""
    out = tmp_path_factory.mktemp("demo")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["demo", "--out", str(out), "--device", "cpu"]) == 0
    return out, printed.getvalue()


@pytest.fixture(scope="module")
def demo_out(demo_run: tuple[Path, str]) -> Path:
    return demo_run[0]


def test_demo_prints_within_100_columns(demo_run: tuple[Path, str]) -> None:
    lines = demo_run[1].splitlines()
    assert any(line.startswith("DESeq2:") for line in lines), "the summary is printed"
    too_wide = [line for line in lines if len(line) > MAX_COLUMNS]
    assert not too_wide, f"{len(too_wide)} printed lines wider than {MAX_COLUMNS} columns: {too_wide[:3]}"


def _hues(rgb: np.ndarray, saturated: np.ndarray) -> set[int]:
    """Hue bins (24 around the circle) that hold at least 0.1% of the figure's pixels among saturated pixels."""
    from matplotlib.colors import rgb_to_hsv

    bins = np.floor(rgb_to_hsv(rgb[saturated])[:, 0] * 24).astype(int) % 24
    values, counts = np.unique(bins, return_counts=True)
    return set(values[counts >= 0.001 * saturated.size].tolist())


def test_demo_runs_every_step_and_writes_summary(demo_out: Path) -> None:
    summary = pd.read_csv(demo_out / "summary.tsv", sep="\t")
    assert list(summary.columns) == ["step", "what", "value", "device", "seconds"]
    assert summary.loc[0, "step"] == "preprocessing"
    for step, _ in DEMO_STEPS:
        rows = summary[summary["step"] == step]
        assert len(rows) >= 1, f"demo step {step!r} left no row"
        assert not (rows["value"] == "not implemented yet").any(), f"demo step {step!r} is missing"
        assert (rows["device"] == "cpu").all()


def test_demo_writes_figures(demo_out: Path) -> None:
    from matplotlib.image import imread

    pngs = sorted(p.name for p in demo_out.glob("*.png"))
    assert "umap_cell_types.png" in pngs
    assert len(pngs) >= 1 + 2 * len(DEMO_STEPS)
    assert set(MIN_HUES) | set(MUST_SHOW) <= set(pngs), "a figure checked below is no longer written"
    for name in pngs:
        rgb = imread(demo_out / name)[..., :3]
        ink = np.abs(rgb - rgb[0, 0]).max(axis=-1) > 0.02
        assert ink.mean() >= MIN_INK, f"{name}: only {ink.mean():.1%} of pixels drawn"
        q = np.round(rgb * 255).astype(np.uint32)
        n_colours = len(np.unique((q[..., 0] << 16) | (q[..., 1] << 8) | q[..., 2]))
        assert n_colours >= MIN_COLOURS, f"{name}: {n_colours} distinct colours"
        saturated = rgb.max(axis=-1) - rgb.min(axis=-1) > 0.25
        assert saturated.mean() >= MIN_SATURATED, f"{name}: no data drawn in colour ({saturated.mean():.2%})"
        hues = _hues(rgb, saturated)
        if name in MIN_HUES:
            assert len(hues) >= MIN_HUES[name], f"{name}: {len(hues)} hues {sorted(hues)}"
        for want in MUST_SHOW.get(name, ()):
            assert hues & want, f"{name}: none of hue bins {sorted(want)} in {sorted(hues)}"
