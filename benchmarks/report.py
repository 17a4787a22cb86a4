"""Renders the benchmark result files into ``docs/benchmarks.md``, between marker comments.

A block of the page::

    <!-- generated: cpu_nmf -->
    (anything: replaced)
    <!-- /generated: cpu_nmf -->

is replaced by the rendering of ``results/cpu_nmf.json``: a side-by-side result (``_harness.render``: the tables at
default threads and at equal core counts, the work against the machine's limits, the machine and the load); a GPU
script's result (``gpu_<tool>.py``'s ``render``: a ``kind: gpu`` file names its script, a recorded run's older
``<tool>_gpu.json`` is matched by its name), the cold-run stage's ``warmup.json`` (``_harness.render_cold``) and a
device run's ``summary.json`` (``gpu_summary.markdown``); for any other result, the markdown file the script wrote
beside it (``results/NAME.md``). NAME may name a folder under ``results/`` (``gpu_h200/h200-run2/deseq_gpu``). Text
outside the blocks is left as it is; a block whose result file is missing is left as it is and named on stderr.

    python benchmarks/report.py                 # rewrite docs/benchmarks.md
    python benchmarks/report.py --check         # exit 1 when the page is not what the results render to
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness

DOC = _harness.ROOT / "docs" / "benchmarks.md"
BLOCK = re.compile(r"(<!-- generated: ([\w./-]+) -->\n)(.*?)(<!-- /generated: \2 -->)", re.DOTALL)


GPU_STEMS = {f"{t}_gpu": f"gpu_{t}" for t in _harness.GPU_SCRIPTS}  # result file stem -> GPU script module


def gpu_renderer(res: dict, stem: str):
    """The function that renders a GPU result, None for other results."""
    kind = res.get("kind")
    if kind == "gpu_cold" or (kind is None and stem == "warmup" and "measure" in res):
        return _harness.render_cold
    if kind == "gpu_summary" or (kind is None and stem == "summary" and "crossover" in res):
        return importlib.import_module("gpu_summary").markdown
    module = Path(res["script"]).stem if kind == "gpu" and res.get("script") else GPU_STEMS.get(stem)
    return importlib.import_module(module).render if module else None


def render_result(name: str, results: Path) -> str | None:
    """The markdown of result ``name`` under ``results``; None when it has no file."""
    js, md = results / f"{name}.json", results / f"{name}.md"
    if js.exists():
        res = json.loads(js.read_text())
        if res.get("kind") == "side_by_side":
            return _harness.render(res)
        render = gpu_renderer(res, js.stem)
        if render is not None:
            return render(res)
    return md.read_text() if md.exists() else None


def fill(text: str, results: Path) -> tuple[str, list[str]]:
    """``text`` with every generated block rendered from ``results``; and the names with no result file."""
    missing: list[str] = []

    def sub(m: re.Match) -> str:
        body = render_result(m.group(2), results)
        if body is None:
            missing.append(m.group(2))
            return m.group(0)
        return m.group(1) + body.rstrip("\n") + "\n" + m.group(4)

    return BLOCK.sub(sub, text), missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--results", type=Path, default=_harness.RESULTS)
    ap.add_argument("--check", action="store_true", help="only check that the page is up to date")
    args = ap.parse_args(argv)
    old = args.doc.read_text()
    new, missing = fill(old, args.results)
    for name in missing:
        print(f"no result file for block {name!r} under {args.results}: left as it is", file=sys.stderr)
    if args.check:
        if new != old:
            print(f"{args.doc} is not what the results render to: run benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    if new != old:
        args.doc.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
