"""CPU benchmark of gpuc.tl.metacells, side by side with SEACells 0.3.3 in the same run.

Each (tool, dataset) runs in its own subprocess so that peak memory (ru_maxrss) is per tool; the driver collects the
JSON lines, writes ``benchmarks/results/metacells_cpu.json`` and a markdown table.

Datasets
--------
* ``cd34like``: 6,881 cells (the CD34 tutorial size), k = 92: scanpy's pbmc68k_reduced PCs resampled with 15%-SD
  jitter (``_metacells_data.jittered_pcs``).
* ``pbmc68k``: scanpy's ``pbmc68k_reduced`` (700 cells), k = 9.
* ``pbmc3k``: gpuc's bundled pbmc3k after the demo preprocessing (2,638 cells, 50 PCs), k = 35.
* ``manifold<N>``: N cells interpolated between real neighbouring cells (``_metacells_data.manifold_pcs``; the
  jittered recipe degenerates into disconnected clumps past ~10k cells), k = round(N / 75); gpuc only unless
  --with-seacells.

Usage
-----
    python benchmarks/bench_metacells.py compare               # cd34like (tutorial settings) + pbmc68k/pbmc3k (defaults)
    python benchmarks/bench_metacells.py scale 10000 50000 100000
    python benchmarks/bench_metacells.py one --tool gpuc --data cd34like --eps 1e-5 --max-iter 50   # one subprocess

SEACells needs ``pip install seacells==0.3.3 ipywidgets`` in the same environment.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))


def _data(name: str):
    import numpy as np
    from anndata import AnnData

    if name == "pbmc68k":
        import scanpy as sc

        return sc.datasets.pbmc68k_reduced()
    if name == "pbmc3k":
        from gpuc._demo import preprocess_pbmc3k

        return preprocess_pbmc3k(lambda *_: None)
    from _metacells_data import jittered_pcs, manifold_pcs

    if name == "cd34like":
        x = jittered_pcs(6881)
    elif name.startswith("jitter"):
        x = jittered_pcs(int(name.removeprefix("jitter")))
    else:
        x = manifold_pcs(int(name.removeprefix("manifold")))
    n = x.shape[0]
    ad = AnnData(np.zeros((n, 1), dtype=np.float32), obsm={"X_pca": x})
    ad.obs_names = [f"c{i}" for i in range(n)]
    return ad


def _peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def run_one(tool: str, data: str, eps: float, max_iter: int, min_iter: int, k: int | None) -> dict:
    import numpy as np

    t_load = time.perf_counter()
    ad = _data(data)
    k = k or round(ad.n_obs / 75)
    load_s = time.perf_counter() - t_load
    base_gb = _peak_gb()
    out = {
        "tool": tool,
        "data": data,
        "n_cells": int(ad.n_obs),
        "k": int(k),
        "eps": eps,
        "max_iter": max_iter,
        "min_iter": min_iter,
        "load_s": round(load_s, 2),
    }
    if tool == "gpuc":
        import gpuc
        from gpuc._settings import settings

        settings.progress = False
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            gpuc.tl.metacells(ad, k, convergence_epsilon=eps, max_iter=max_iter, min_iter=min_iter, device="cpu")
            total = time.perf_counter() - t0
        info = ad.uns["metacell"]
        out.update(
            total_s=total, kernel_s=info["timings"]["kernel"], init_s=info["timings"]["init"], fit_s=info["timings"]["fit"],
            n_iter=int(info["n_iter"]), converged=bool(info["converged"]), rss0=float(info["rss"][0]), rss=float(info["rss"][-1]),
            s_per_iter=info["timings"]["fit"] / max(info["n_iter"], 1), a0=info["a0"],
        )  # fmt: skip
    else:
        import scanpy as sc
        from anndata import AnnData

        # warm numba/pynndescent JIT on a throwaway object so the timing is SEACells' own work
        tiny = AnnData(np.random.default_rng(0).normal(size=(200, 10)).astype(np.float32))
        sc.pp.neighbors(tiny, use_rep="X", n_neighbors=15)
        import SEACells

        np.random.seed(0)  # noqa: NPY002 - SEACells 0.3.3 draws from the global RNG
        t0 = time.perf_counter()
        model = SEACells.core.SEACells(
            ad, build_kernel_on="X_pca", n_SEACells=k, n_waypoint_eigs=10, convergence_epsilon=eps, verbose=False
        )
        model.construct_kernel_matrix()
        t1 = time.perf_counter()
        model.initialize_archetypes()
        t2 = time.perf_counter()
        converged = True
        try:
            model.fit(min_iter=min_iter, max_iter=max_iter)
        except RuntimeWarning:  # 0.3.3 raises on non-convergence after writing its results
            converged = False
        t3 = time.perf_counter()
        rss = model.RSS_iters
        out.update(
            total_s=t3 - t0, kernel_s=t1 - t0, init_s=t2 - t1, fit_s=t3 - t2, n_iter=len(rss) - 1, converged=converged,
            rss0=float(rss[0]), rss=float(rss[-1]), s_per_iter=(t3 - t2) / max(len(rss) - 1, 1),
        )  # fmt: skip
    out["peak_gb"] = round(_peak_gb(), 3)
    out["peak_gb_above_data"] = round(out["peak_gb"] - base_gb, 3)
    return out


def _spawn(tool: str, data: str, eps: float, max_iter: int, min_iter: int = 10, timeout: int = 7200) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "one",
        "--tool",
        tool,
        "--data",
        data,
        "--eps",
        str(eps),
        "--max-iter",
        str(max_iter),
        "--min-iter",
        str(min_iter),
    ]
    print("  $", " ".join(cmd[1:]), flush=True)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        return {"tool": tool, "data": data, "error": f"timeout after {timeout} s"}
    for line in proc.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            res = json.loads(line)
            print("   ", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}, flush=True)
            return res
    return {"tool": tool, "data": data, "error": proc.stderr[-2000:]}


def _machine() -> str:
    import psutil

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {psutil.cpu_count()} cores, {psutil.virtual_memory().total / 1024**3:.0f} GB RAM, Python {platform.python_version()}"


def _save(name: str, payload: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["compare", "scale", "one"])
    ap.add_argument("sizes", nargs="*", type=int)
    ap.add_argument("--tool", default="gpuc")
    ap.add_argument("--data", default="cd34like")
    ap.add_argument("--eps", type=float, default=1e-3)
    ap.add_argument("--max-iter", type=int, default=100)
    ap.add_argument("--min-iter", type=int, default=10)
    ap.add_argument("--k", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-seacells", action="store_true")
    ap.add_argument("--with-seacells", action="store_true")
    args = ap.parse_args()
    if args.mode == "one":
        print(json.dumps(run_one(args.tool, args.data, args.eps, args.max_iter, args.min_iter, args.k)), flush=True)
        return
    machine = _machine()
    print("machine:", machine, flush=True)
    rows = []
    if args.mode == "compare":
        # cd34-sized run with the SEACells tutorial settings (epsilon 1e-5, fit(min_iter=10, max_iter=50))
        for _ in range(args.repeats):
            rows.append(_spawn("gpuc", "cd34like", 1e-5, 50))
        if not args.skip_seacells:
            rows.append(_spawn("seacells", "cd34like", 1e-5, 50))
        # full default runs (epsilon 1e-3, max_iter 100) for the final-RSS comparison
        for data in ("pbmc68k", "pbmc3k"):
            rows.append(_spawn("gpuc", data, 1e-3, 100))
            if not args.skip_seacells:
                rows.append(_spawn("seacells", data, 1e-3, 100))
        _save("metacells_cpu_compare", {"machine": machine, "command": " ".join(sys.argv), "rows": rows})
    else:
        for n in args.sizes or [10_000, 50_000, 100_000]:
            rows.append(_spawn("gpuc", f"manifold{n}", 1e-3, 100, timeout=10800))
            if args.with_seacells:
                rows.append(_spawn("seacells", f"manifold{n}", 1e-3, 100, timeout=10800))
            _save("metacells_cpu_scale", {"machine": machine, "command": " ".join(sys.argv), "rows": rows})


if __name__ == "__main__":
    main()
