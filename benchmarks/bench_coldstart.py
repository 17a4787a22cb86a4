"""Cold start of the CPU tools: the first call in a fresh process against a warm call in the same process.

The numba kernels are compiled once and cached on disk; a fresh process should load them from the cache instead of
compiling again. For each case this script

1. empties a numba cache folder (``NUMBA_CACHE_DIR``, a temporary one unless ``--cache-dir``) and runs one process:
   its first call compiles every numba function it meets (gpuc's kernels and those of its dependencies), the
   ``compile`` column;
2. runs ``--repeats`` further fresh processes on the filled cache: their first call is the ``cold`` column;
3. in every process, times ``--warm-calls`` more calls after the first: the ``warm`` column.

Each process imports gpuc and loads its data before the clock starts; only the tool call is timed. Columns are
medians over processes (cold) or over all warm calls (warm). The load average is read before and after the runs.

Whichever numba function a process calls first, from gpuc or from another package, also pays numba's one-time set-up
of its compiler context (imports and registries), even when the function comes from the cache. With ``--numba-init``
each process does that set-up before the clock starts, so that ``cold - warm`` shows what remains.

Cases
-----
* ``nmf_k7``: ``tl.consensus_nmf`` k=7 x 20 runs on a 6,881 x 2,000 sparse matrix (``_nmf_data.cd34_sized``).
* ``nmf_small``: ``tl.consensus_nmf`` k=5 x 4 runs on scanpy's pbmc68k_reduced (700 x 765, ``raw.X``).
* ``deseq``: ``tl.deseq`` on the bundled pasilla, ``~type + condition``, treated vs untreated, normal shrinkage.
* ``metacells_pbmc68k``: ``tl.metacells`` k=9 on scanpy's pbmc68k_reduced (700 cells).
* ``metacells_pbmc3k``: ``tl.metacells`` k=35 on the bundled pbmc3k after the demo preprocessing (2,638 cells).

Usage
-----
    python benchmarks/bench_coldstart.py                       # all cases, 3 fresh processes each
    python benchmarks/bench_coldstart.py --cases deseq --repeats 5
    python benchmarks/bench_coldstart.py --numba-init          # numba's set-up done before the timed calls
    python benchmarks/bench_coldstart.py one deseq --warm-calls 2   # one process (what the driver spawns)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = ("nmf_k7", "nmf_small", "deseq", "metacells_pbmc68k", "metacells_pbmc3k")


def _prepare(case: str) -> Callable[[], object]:
    """Load the data of ``case`` and return the timed call (each call works on its own copy of the data)."""
    import gpuc

    gpuc.settings.progress = False
    if case in ("nmf_k7", "nmf_small"):
        from anndata import AnnData

        if case == "nmf_k7":
            sys.path.insert(0, str(HERE))
            from _nmf_data import cd34_sized

            ad, k, n_runs = AnnData(cd34_sized()), 7, 20
        else:
            import scanpy as sc

            ad, k, n_runs = AnnData(sc.datasets.pbmc68k_reduced().raw.X), 5, 4
        kw = {"mask_var": None, "density_threshold": 2.0, "device": "cpu", "copy": True}
        return lambda: gpuc.tl.consensus_nmf(ad, k, n_runs=n_runs, **kw)
    if case == "deseq":
        pb = gpuc.datasets.pasilla()
        contrast = ["condition", "treated", "untreated"]
        return lambda: gpuc.tl.deseq(
            pb.copy(), "~type + condition", contrast=contrast, alpha=0.1, lfc_shrink="normal", device="cpu"
        )
    if case == "metacells_pbmc68k":
        import scanpy as sc

        ad, k = sc.datasets.pbmc68k_reduced(), 9
    else:
        from gpuc._demo import preprocess_pbmc3k

        ad, k = preprocess_pbmc3k(lambda *_: None), 35
    return lambda: gpuc.tl.metacells(ad, k, device="cpu", copy=True)


def one(case: str, warm_calls: int, numba_init: bool) -> dict:
    """Times of the first and of ``warm_calls`` more calls of ``case`` in this process."""
    call = _prepare(case)
    if numba_init:
        from numba.core.registry import cpu_target

        cpu_target.target_context.refresh()
    times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(1 + warm_calls):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    return {"case": case, "first": times[0], "warm": times[1:]}


def _spawn(case: str, warm_calls: int, numba_init: bool, cache_dir: Path) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    cmd = [sys.executable, __file__, "one", case, "--warm-calls", str(warm_calls)] + ["--numba-init"] * numba_init
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run(cases: list[str], repeats: int, warm_calls: int, numba_init: bool, cache_dir: Path) -> list[dict]:
    rows = []
    for case in cases:
        shutil.rmtree(cache_dir, ignore_errors=True)
        cache_dir.mkdir(parents=True)
        first = _spawn(case, warm_calls, numba_init, cache_dir)
        fresh = [_spawn(case, warm_calls, numba_init, cache_dir) for _ in range(repeats)]
        warm = first["warm"] + [t for r in fresh for t in r["warm"]]
        row = {
            "case": case,
            "compile_s": first["first"],
            "cold_s": statistics.median(r["first"] for r in fresh),
            "warm_s": statistics.median(warm),
            "cold_all": [r["first"] for r in fresh],
            "warm_all": warm,
        }
        row["cold_minus_warm_s"] = row["cold_s"] - row["warm_s"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="all", choices=["all", "one"])
    ap.add_argument("case", nargs="?", help="the case of 'one'")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes on the filled cache per case")
    ap.add_argument("--warm-calls", type=int, default=2, help="calls after the first in each process")
    ap.add_argument("--cache-dir", type=Path, default=None, help="numba cache folder (emptied per case)")
    ap.add_argument("--numba-init", action="store_true", help="set numba's compiler context up before the timed calls")
    args = ap.parse_args()
    if args.mode == "one":
        print(json.dumps(one(args.case, args.warm_calls, args.numba_init)), flush=True)
        return
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = args.cache_dir or Path(tmp) / "numba_cache"
        rows = _run(args.cases.split(","), args.repeats, args.warm_calls, args.numba_init, cache_dir)
    load1 = os.getloadavg()
    print("\nload average (1, 5, 15 min) before", *(f"{x:.2f}" for x in load0), "after", *(f"{x:.2f}" for x in load1))
    print(f"command: python {' '.join(sys.argv)}  ({os.cpu_count()} CPUs)\n")
    print("| case | compile (empty cache) s | cold (fresh process) s | warm s | cold - warm s |")
    print("|---|---|---|---|---|")
    for r in rows:
        cells = (r["compile_s"], r["cold_s"], r["warm_s"])
        print(f"| {r['case']} |", " | ".join(f"{x:.2f}" for x in cells), f"| {r['cold_minus_warm_s']:+.2f} |")


if __name__ == "__main__":
    main()
