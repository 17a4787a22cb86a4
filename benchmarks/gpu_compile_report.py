"""Put the fused GPU kernels' compile reports into docs/benchmarks.md (issue 40).

The reports come from ``python -m gpuc._testing.kernel_report --out DIR/py<version>-<extra>.json`` run in a venv with
a GPU extra (``.ci/compile_kernels`` makes one per (Python, extra) pair; ``GPUC_COMPILE_OUT=DIR`` keeps them). This
script renders each (``gpuc._testing.kernel_report.markdown``) and replaces the text between the markers
``<!-- compile-report:start -->`` and ``<!-- compile-report:end -->`` of docs/benchmarks.md; the JSONs are copied to
benchmarks/results/compile_report/.

    GPUC_COMPILE_OUT=/tmp/cr .ci/compile_kernels && python benchmarks/gpu_compile_report.py /tmp/cr
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from gpuc._testing.kernel_report import markdown  # noqa: E402

START, END = "<!-- compile-report:start -->", "<!-- compile-report:end -->"


def main(folder: str) -> int:
    reports = sorted(Path(folder).glob("py*-gpu-cu*.json"))
    if not reports:
        print(f"no py*-gpu-cu*.json in {folder}", file=sys.stderr)
        return 1
    keep = ROOT / "benchmarks" / "results" / "compile_report"
    keep.mkdir(parents=True, exist_ok=True)
    parts = []
    for path in reports:
        rep = json.loads(path.read_text())
        shutil.copy(path, keep / path.name)
        status = "no problems" if not rep.get("problems") else "PROBLEMS: " + "; ".join(rep["problems"])
        parts += [f"**{path.stem}** ({len(rep['rows'])} compilations, {status})", "", markdown(rep)]
    doc = ROOT / "docs" / "benchmarks.md"
    text = doc.read_text()
    if START not in text or END not in text:
        print(f"markers {START} / {END} not found in {doc}", file=sys.stderr)
        return 1
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(head + START + "\n" + "\n".join(parts) + END + tail)
    print(f"{len(reports)} reports written into {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/compile_report"))
