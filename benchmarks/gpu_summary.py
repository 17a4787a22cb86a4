"""Collect the JSON files of one device run (benchmarks/gpu_check.sh) into $OUT/summary.md and $OUT/summary.json,
with the issue's H200 targets beside each timing. Reads whatever parts finished; a missing part is reported as such.

    OUT=/tmp/out python benchmarks/gpu_summary.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

OUT = Path(os.environ.get("OUT", Path(__file__).resolve().parents[1] / "gpu_results"))
# the targets on an H200, seconds
TARGETS = {
    "metacells 6,881 cells": 2.0,
    "metacells 200,000 cells": 60.0,
    "NMF k=7 x 20 on 6,881 x 2,000": 0.5,
    "NMF k=2..12 sweep": 3.0,
    "DESeq2 100 x 10,000": 0.1,
    "DESeq2 500 x 30,000": 0.5,
}


def _load(name: str) -> dict | None:
    p = OUT / name
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _find(obj: object, *keys: str) -> object:
    for k in keys:
        if not isinstance(obj, dict) or k not in obj:
            return None
        obj = obj[k]
    return obj


def main() -> int:
    rows: list[tuple[str, object]] = []
    mc = _load("metacells_gpu.json")
    for r in (mc or {}).get("timings", []):
        label = f"metacells {r['n']:,} cells"
        rows.append((label, r.get("total_s", r.get("error"))))
    nmf = _load("nmf_gpu.json")
    if nmf:
        rows.append(("NMF k=7 x 20 on 6,881 x 2,000", _find(nmf, "k7x20_gpu", "seconds")))
        rows.append(("NMF k=2..12 sweep", _find(nmf, "sweep_2_12x10_gpu", "seconds")))
    de = _load("deseq_gpu.json")
    for r in (de or {}).get("timing", []):
        size = str(r.get("size", ""))
        label = "DESeq2 100 x 10,000" if "100" in size.split("x")[0] else "DESeq2 500 x 30,000"
        rows.append((label, r.get("tl_deseq_gpu_s")))
    lines = ["| case | GPU s | target s | met |", "| --- | --- | --- | --- |"]
    summary: dict = {"timings": {}, "parts": {}}
    for label, val in rows:
        target = TARGETS.get(label)
        met = "" if target is None or not isinstance(val, int | float) else ("yes" if val < target else "NO")
        lines.append(f"| {label} | {val} | {target if target is not None else ''} | {met} |")
        summary["timings"][label] = {"seconds": val, "target": target, "met": met}
    for part in ("metacells_gpu.json", "nmf_gpu.json", "deseq_gpu.json", "rsc_gpu.json"):
        summary["parts"][part] = "present" if (OUT / part).exists() else "missing (failed or timed out)"
    lines += ["", *(f"- {p}: {s}" for p, s in summary["parts"].items())]
    for name in ("stage_status.txt",):
        if (OUT / name).exists():
            lines += ["", "stages (exit status, seconds):", "", "```", (OUT / name).read_text().strip(), "```"]
    (OUT / "summary.md").write_text("\n".join(lines) + "\n")
    (OUT / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
