from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from gpuc._demo import DEMO_STEPS
from gpuc.cli import main


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    assert main(["demo", "--out", str(out), "--device", "cpu"]) == 0
    return out


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
    pngs = sorted(p.name for p in demo_out.glob("*.png"))
    assert "umap_cell_types.png" in pngs
    assert len(pngs) >= 1 + 2 * len(DEMO_STEPS)
    for p in demo_out.glob("*.png"):
        assert p.stat().st_size > 5_000
