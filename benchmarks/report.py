"""Renders the benchmark result files into ``docs/benchmarks.md``, between marker comments.

A block of the page::

    <!-- generated: cpu_nmf -->
    (anything: replaced)
    <!-- /generated: cpu_nmf -->

is replaced by the rendering of ``results/cpu_nmf.json``: a side-by-side result (``_harness.render``: the tables at
default threads and at equal core counts, the work against the machine's limits, the machine and the load), or, for
any other result, the markdown file the script wrote beside it (``results/NAME.md``). Text outside the blocks is
left as it is; a block whose result file is missing is left as it is and named on stderr.

    python benchmarks/report.py                 # rewrite docs/benchmarks.md
    python benchmarks/report.py --check         # exit 1 when the page is not what the results render to
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness

DOC = _harness.ROOT / "docs" / "benchmarks.md"
BLOCK = re.compile(r"(<!-- generated: ([\w./-]+) -->\n)(.*?)(<!-- /generated: \2 -->)", re.DOTALL)


def render_result(name: str, results: Path) -> str | None:
    """The markdown of result ``name`` under ``results``; None when it has no file."""
    js, md = results / f"{name}.json", results / f"{name}.md"
    if js.exists():
        res = json.loads(js.read_text())
        if res.get("kind") == "side_by_side":
            return _harness.render(res)
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
