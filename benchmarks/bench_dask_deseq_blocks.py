"""One large DESeq2 design as gene blocks on a LocalCluster against the in-process fit: wall time, peak RSS, agreement.

    python benchmarks/bench_dask_deseq_blocks.py --samples 1000 --genes 60000 --workers 2

Simulated counts (benchmarks/_deseq_sim.py), design ``~condition``. Runs ``gpuc.tl.deseq`` in process, then with
``client=`` on ``--workers`` worker processes of one thread each (the per-gene steps as gene-block tasks, the global
steps in the driver), and reports both wall times, the driver's and every worker's peak RSS (psutil, sampled every
0.2 s), the number of gene blocks, and how far the two tables are apart (integer/boolean fields exactly, floats as the
largest relative difference). Writes ``benchmarks/results/dask_deseq_blocks.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def _peak_rss(pids: dict[str, int], stop: threading.Event, out: dict[str, float]) -> None:
    import psutil

    procs = {name: psutil.Process(pid) for name, pid in pids.items()}
    while not stop.is_set():
        for name, p in procs.items():
            try:
                out[name] = max(out.get(name, 0.0), p.memory_info().rss / 1e9)
            except psutil.Error:
                pass
        time.sleep(0.2)


def _timed(call, pids):
    stop, peaks = threading.Event(), {}
    t = threading.Thread(target=_peak_rss, args=(pids, stop, peaks))
    t.start()
    t0 = time.perf_counter()
    out = call()
    wall = time.perf_counter() - t0
    stop.set()
    t.join()
    return out, wall, peaks


def _max_rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    ok = np.isfinite(a) & np.isfinite(b)
    if not np.array_equal(np.isfinite(a), np.isfinite(b)):
        return float("inf")
    return float(np.max(np.abs(a[ok] - b[ok]) / np.maximum(np.abs(b[ok]), 1e-300), initial=0.0))


def main() -> None:
    import anndata as ad
    import distributed
    from _deseq_sim import simulate

    import gpuc
    from gpuc.deseq._blocks import default_block_genes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--genes", type=int, default=60000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    counts, meta, _ = simulate(args.samples, args.genes, seed=0)
    a = ad.AnnData(counts, obs=meta)
    a.var_names = [f"g{j}" for j in range(a.n_vars)]
    load0 = os.getloadavg()
    here, t_here, p_here = _timed(lambda: gpuc.tl.deseq(a, "~condition", copy=True), {"driver": os.getpid()})
    cluster = distributed.LocalCluster(
        n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=":0"
    )
    client = distributed.Client(cluster)
    pids = {"driver": os.getpid()} | {f"worker{i}": pid for i, pid in enumerate(client.run(os.getpid).values())}
    there, t_there, p_there = _timed(lambda: gpuc.tl.deseq(a, "~condition", client=client, copy=True), pids)
    client.close()
    cluster.close()
    load1 = os.getloadavg()

    th, tt = gpuc.get.deseq_results(here), gpuc.get.deseq_results(there)
    exact = {c: bool(np.array_equal(here.var[c], there.var[c])) for c in here.var if here.var[c].dtype.kind in "biu"}
    rel = {c: _max_rel(tt[c], th[c]) for c in ("baseMean", "log2FoldChange", "lfcSE", "stat", "pvalue", "padj")}
    n_blocks = -(-a.n_vars // default_block_genes(a.n_obs))
    report = {
        "shape": [int(a.n_obs), int(a.n_vars)],
        "workers": args.workers,
        "gene_blocks": int(n_blocks),
        "in_process_s": t_here,
        "dask_s": t_there,
        "peak_rss_gb": {"in_process": p_here, "dask": p_there},
        "integer_and_boolean_fields_identical": exact,
        "max_relative_difference": rel,
        "same_significant_genes": bool(np.array_equal(th["padj"] < 0.05, tt["padj"] < 0.05)),
        "loadavg_before_after": [load0, load1],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dask_deseq_blocks.json").write_text(json.dumps(report, indent=1))
    lines = [
        "# DESeq2 as gene blocks (bench_dask_deseq_blocks.py)",
        "",
        f"`python benchmarks/bench_dask_deseq_blocks.py --samples {args.samples} --genes {args.genes} "
        f"--workers {args.workers}`; load average {load0[0]:.2f} -> {load1[0]:.2f}",
        "",
        "| run | wall (s) | peak RSS (GB) |",
        "| --- | --- | --- |",
        f"| in process | {t_here:.1f} | driver {p_here.get('driver', 0):.2f} |",
        f"| {args.workers} workers, {n_blocks} gene blocks | {t_there:.1f} | "
        + ", ".join(f"{k} {v:.2f}" for k, v in p_there.items())
        + " |",
        "",
        f"Integer and boolean per-gene fields identical: {all(exact.values())}; largest relative difference of the "
        f"results table: {max(rel.values()):.2e}; same genes at padj < 0.05: {report['same_significant_genes']}.",
    ]
    (RESULTS / "dask_deseq_blocks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
