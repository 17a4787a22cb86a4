"""The benchmark harness renders result files into tables, and the report fills docs/benchmarks.md's blocks.

Loads ``benchmarks/_harness.py`` and ``benchmarks/report.py`` from the checkout (they are scripts, not part of the
package) and renders a hand-made result: no tool or peer runs.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # report.py imports _harness by name
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def harness():
    return _load("_harness")


@pytest.fixture(scope="module")
def report(harness):
    return _load("report")


def _config(cold: float, warm: float, work: dict | None = None) -> dict:
    cfg = {"cold_s": cold, "warm_s": warm, "cold_all": [cold], "warm_all": [warm]}
    return cfg | ({"work": work} if work else {})


@pytest.fixture
def result() -> dict:
    row = {
        "case": "small",
        "about": "700 x 500, k=7 x 20",
        "load_before": [1.5, 1.0, 0.5],
        "load_after": [2.25, 1.1, 0.6],
        "gpuc": {"default": _config(0.5, 0.2, {"flops": 2e9, "bytes": 1e8}), "1": _config(0.6, 0.3)},
        "peer": {"default": _config(4.0, 3.0), "1": _config(4.5, 3.3)},
        "extra": {"R DESeq2": 2.5},
        "targets": {"cold": 4, "warm": 10},
    }
    return {
        "kind": "side_by_side",
        "tool": "nmf",
        "peer": "cnmf",
        "command": "python benchmarks/bench_nmf.py",
        "date": "2026-12-05 12:00 UTC",
        "machine": {
            "cpu": "Test CPU",
            "cores": 2,
            "memory_gb": 8.0,
            "python": "3.12.0",
            "commit": "abc1234",
            "versions": {"gpuc": "0.1"},
        },
        "hardware": {"gemm_gflops": 20.0, "triad_gbps": 10.0},
        "cores": [1],
        "rows": [row],
    }


def test_render_tables(harness, result):
    md = harness.render(result)
    lines = md.splitlines()
    head = next(line for line in lines if line.startswith("| case | load |"))
    cells = [c.strip() for c in lines[lines.index(head) + 2].strip("|").split("|")]
    # case, load, gpuc cold/warm, peer cold/warm, ratios (cold 4.0 / 0.5 = 8x: the >= 4x target met; warm 3.0 / 0.2
    # = 15x: >= 10x met), R and R / gpuc cold
    assert cells == ["small: 700 x 500, k=7 x 20", "1.50 / 2.25", "0.5", "0.2", "4", "3",
                     "**8.0x (met: >= 4x)**", "15.0x (met: >= 10x)", "2.5", "5.0x"]  # fmt: skip
    # equal cores: gpuc 0.6 / 0.3, peer 4.5 / 3.3, ratio 7.5x
    assert "| small | 0.6 | 0.3 | 4.5 | 3.3 | 7.5x |" in lines
    # work 2 GFLOP (0.1 s at 20 GFLOP/s), 0.1 GB (0.01 s at 10 GB/s): the warm 0.2 s is 2x from the limit
    assert "| small | 2 GFLOP, 0.1 GB | 2x | 0.2 |" in lines
    assert "Test CPU, 2 cores available, 8.0 GB" in md


def test_render_missed_target(harness, result):
    result["rows"][0]["peer"]["default"]["warm_s"] = 1.0  # 5x warm: under the 10x target
    assert "5.0x (missed: >= 10x)" in harness.render(result)


def test_report_fills_blocks(harness, report, result, tmp_path):
    harness.write_result(tmp_path / "cpu_nmf.json", result)
    assert json.loads((tmp_path / "cpu_nmf.json").read_text())["rows"][0]["case"] == "small"
    (tmp_path / "other.md").write_text("| a |\n| --- |\n| 1 |\n")
    doc = tmp_path / "doc.md"
    text = ("# Page\n\nhand-written\n\n<!-- generated: cpu_nmf -->\nold table\n<!-- /generated: cpu_nmf -->\n\n"
            "between\n<!-- generated: other -->\n<!-- /generated: other -->\n"
            "<!-- generated: absent -->\nkept\n<!-- /generated: absent -->\nend\n")  # fmt: skip
    doc.write_text(text)
    assert report.main(["--doc", str(doc), "--results", str(tmp_path), "--check"]) == 1
    assert report.main(["--doc", str(doc), "--results", str(tmp_path)]) == 0
    new = doc.read_text()
    assert "old table" not in new
    assert harness.render(result).rstrip("\n") in new
    assert "<!-- generated: other -->\n| a |\n| --- |\n| 1 |\n<!-- /generated: other -->" in new
    assert "<!-- generated: absent -->\nkept\n<!-- /generated: absent -->" in new
    assert new.startswith("# Page\n\nhand-written\n\n") and "\n\nbetween\n" in new and new.endswith("end\n")
    # rendering again changes nothing
    assert report.main(["--doc", str(doc), "--results", str(tmp_path), "--check"]) == 0


def test_summary_reads_cpu_scaling(harness, result, tmp_path, monkeypatch):
    # the GPU check's CPU stages write bench_<tool>.py results; the summary turns gpuc's warm medians per thread count
    # into speed-ups over one thread (2 cores here: no 16-thread goal to judge)
    result["rows"][0]["gpuc"]["4"] = _config(0.2, 0.1)
    harness.write_result(tmp_path / "cpu_nmf.json", result)
    summary = _load("gpu_summary")
    monkeypatch.setattr(summary, "OUT", tmp_path)
    cs = summary.cpu_scaling(tmp_path)
    assert cs["thread_counts"] == [1, 4] and set(cs["cases"]) == {"nmf"}
    threads = cs["cases"]["nmf"]["threads"]
    assert threads["1"]["median_s"] == 0.3 and threads["4"]["speedup"] == pytest.approx(3.0)
    assert cs["cases"]["nmf"]["goal"]["met"] == ""
    assert "| consensus NMF 700 x 500, k=7 x 20 | 0.300 s (1.00x) | 0.100 s (3.00x) |" in summary.markdown(
        summary.summarise()
    )
