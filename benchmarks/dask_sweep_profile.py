"""The NMF k sweep on a Dask ``LocalCluster`` of 1 and 2 worker processes: wall time and the CPU seconds the workers
spent, per repeat, with the load average around each call.

``gpuc.tl.nmf_k_sweep(adata, range(2, 13), n_runs=20, mask_var=None, client=client)`` on the 6,881 x 2,000
CD34-sized matrix (``_nmf_data.cd34_sized``), each worker with ``threads_per_worker`` threads (default 1). Wall time
on a 2-core machine that other jobs share is noisy; the summed worker CPU seconds show the work the tasks did, and
``1 worker / 2 workers`` of each is the speed-up the plan allows when the cores are free. The table of every call is
compared with the in-process one (``np.array_equal``, NaN = NaN).

    python benchmarks/dask_sweep_profile.py --repeats 3 --tag after

writes ``benchmarks/results/dask_sweep_profile[_tag].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
RESULTS = HERE / "results"


def _proc_cpu(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def _table(adata) -> dict:
    tab = adata.uns["nmf_k_sweep"]["table"]
    return {c: tab[c].to_numpy().tolist() for c in tab.columns}


def _same(a: dict, b: dict) -> bool:
    return all(np.array_equal(np.asarray(a[c]), np.asarray(b[c]), equal_nan=True) for c in a)


def _sweep(adata, ks, n_runs, client):
    import gpuc

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gpuc.tl.nmf_k_sweep(adata, ks, n_runs=n_runs, mask_var=None, client=client, copy=True)


def run_config(adata, ks, n_runs, n_workers: int, threads: int, repeats: int, ref: dict | None) -> dict:
    from distributed import Client, LocalCluster

    import gpuc

    cluster = LocalCluster(n_workers=n_workers, threads_per_worker=threads, processes=True, dashboard_address=":0")
    client = Client(cluster)
    try:
        pids = list(client.run(os.getpid).values())
        where = set(client.run(lambda: __import__("gpuc").__file__).values())
        small = adata[:600].copy()
        _sweep(small, [2, 3], 2, client)  # warm: imports and the cached kernels in every worker
        reps = []
        for _ in range(repeats):
            load0 = os.getloadavg()[0]
            cpu0 = {p: _proc_cpu(p) for p in pids}
            me0 = _proc_cpu(os.getpid())
            t0 = time.perf_counter()
            out = _sweep(adata, ks, n_runs, client)
            wall = time.perf_counter() - t0
            cpu = {p: _proc_cpu(p) - cpu0[p] for p in pids}
            tab = _table(out)
            reps.append(
                {
                    "wall_s": wall,
                    "worker_cpu_s": sum(cpu.values()),
                    "per_worker_cpu_s": list(cpu.values()),
                    "driver_cpu_s": _proc_cpu(os.getpid()) - me0,
                    "load_before": load0,
                    "load_after": os.getloadavg()[0],
                    "identical_to_in_process": None if ref is None else _same(tab, ref),
                    "suggested_k": out.uns["nmf_k_sweep"]["suggested_k"],
                    "table": tab,
                }
            )
            shown = {k: v for k, v in reps[-1].items() if k != "table"}
            print(f"  {n_workers} worker(s) x {threads} thread(s): {json.dumps(shown, default=float)}", flush=True)
    finally:
        client.close()
        cluster.close()
    return {
        "n_workers": n_workers,
        "threads_per_worker": threads,
        "gpuc": sorted(where),
        "repeats": reps,
        "median_wall_s": statistics.median(r["wall_s"] for r in reps),
        "median_worker_cpu_s": statistics.median(r["worker_cpu_s"] for r in reps),
        "gpuc_here": gpuc.__file__,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="threads per worker")
    p.add_argument("--workers", default="1,2", help="cluster sizes, comma separated")
    p.add_argument("--n-runs", type=int, default=20)
    p.add_argument("--no-inproc", action="store_true", help="skip the in-process reference call")
    p.add_argument("--tag", default="")
    a = p.parse_args()

    from _nmf_data import cd34_sized
    from anndata import AnnData

    adata = AnnData(cd34_sized())
    ks = list(range(2, 13))
    out: dict = {
        "shape": list(adata.shape),
        "nnz": int(adata.X.nnz),
        "ks": ks,
        "n_runs": a.n_runs,
        "cpus": os.cpu_count(),
    }
    ref = None
    if not a.no_inproc:
        t0 = time.perf_counter()
        load0 = os.getloadavg()[0]
        ref = _table(_sweep(adata, ks, a.n_runs, None))
        out["in_process"] = {
            "wall_s": time.perf_counter() - t0,
            "load_before": load0,
            "load_after": os.getloadavg()[0],
            "table": ref,
        }
        print(f"in process: wall {out['in_process']['wall_s']:.1f} s, load {load0:.2f}", flush=True)
    out["configs"] = {}
    for w in (int(x) for x in a.workers.split(",")):
        out["configs"][f"{w}x{a.threads}"] = run_config(adata, ks, a.n_runs, w, a.threads, a.repeats, ref)
    cfg = out["configs"]
    one, two = cfg.get(f"1x{a.threads}"), cfg.get(f"2x{a.threads}")
    if one and two:
        out["speedup_wall"] = one["median_wall_s"] / two["median_wall_s"]
        # the speed-up the 2-worker plan allows with the cores free: one worker's CPU time over the busiest worker's
        two_max = statistics.median(max(r["per_worker_cpu_s"]) for r in two["repeats"])
        out["speedup_cpu"] = one["median_worker_cpu_s"] / two_max
        print(
            f"speed-up 2 vs 1 worker: wall {out['speedup_wall']:.2f}x, CPU (busiest worker) {out['speedup_cpu']:.2f}x"
        )
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"dask_sweep_profile{'_' + a.tag if a.tag else ''}.json"
    path.write_text(json.dumps(out, indent=1, default=float) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
