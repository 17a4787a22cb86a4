"""gpuc.tl.deseq against PyDESeq2 0.5.4 (n_cpus=2) and R DESeq2, side by side on simulated NB data (CPU).

    python benchmarks/bench_deseq.py [--sizes 100x10000 200x20000] [--repeats 3] [--skip-pydeseq2] [--skip-r]

Each tool runs in its own subprocess on the same counts; wall time of the fit + results is taken inside the
process (gpuc: median of --repeats warm runs after one warm-up run, timed apart as first_run_seconds; PyDESeq2
and R: one run, they take minutes), peak memory is the RSS of the process tree sampled every 50 ms. Agreement is
measured against R.
Results go to benchmarks/results/deseq_cpu.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


# ---------------------------------------------------------------------------------------------- workers (subprocess)
def _worker_gpuc(counts_npy: str, meta_csv: str, out_csv: str, repeats: int) -> dict:
    import anndata as ad

    import gpuc

    counts = np.load(counts_npy)
    meta = pd.read_csv(meta_csv, index_col=0)
    times, cpu = [], []
    for i in range(repeats + 1):
        a = ad.AnnData(X=counts, obs=meta.copy())
        a.var_names = [f"g{j + 1}" for j in range(counts.shape[1])]
        t, c = time.perf_counter(), time.process_time()
        gpuc.tl.deseq(a, "~condition", contrast=["condition", "B", "A"], alpha=0.1, device="cpu")
        if i > 0:
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        else:
            first = time.perf_counter() - t  # includes loading (or, on a fresh install, compiling) the numba kernels
    gpuc.get.deseq_results(a).to_csv(out_csv)
    return {
        "seconds": float(np.median(times)),
        "cpu_seconds": float(np.median(cpu)),
        "all_seconds": times,
        "first_run_seconds": first,
    }


def _worker_pydeseq2(counts_npy: str, meta_csv: str, out_csv: str, repeats: int) -> dict:
    from pydeseq2.dds import DeseqDataSet
    from pydeseq2.ds import DeseqStats

    counts = pd.DataFrame(np.load(counts_npy), index=pd.read_csv(meta_csv, index_col=0).index)
    counts.columns = [f"g{j + 1}" for j in range(counts.shape[1])]
    meta = pd.read_csv(meta_csv, index_col=0)
    import psutil

    me = psutil.Process()

    def tree_cpu() -> float:
        procs = [me, *me.children(recursive=True)]
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    c0 = tree_cpu()
    t = time.perf_counter()
    dds = DeseqDataSet(counts=counts, metadata=meta, design="~condition", n_cpus=2, quiet=True)
    dds.deseq2()
    st = DeseqStats(dds, contrast=["condition", "B", "A"], alpha=0.1, n_cpus=2, quiet=True)
    st.summary()
    sec = time.perf_counter() - t
    cpu = tree_cpu() - c0  # main process and loky workers (alive until exit)
    st.results_df.to_csv(out_csv)
    import pydeseq2

    return {"seconds": sec, "cpu_seconds": cpu, "version": pydeseq2.__version__}


# ---------------------------------------------------------------------------------------------- driver
def _run_tree(cmd: list[str], timeout: float) -> tuple[int, float, str]:
    """Run ``cmd``; return (return code, peak RSS in MB of the process tree, stdout)."""
    import psutil

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0.0]
    stop = threading.Event()

    def poll() -> None:
        try:
            p = psutil.Process(proc.pid)
            while not stop.is_set():
                try:
                    rss = p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
                    peak[0] = max(peak[0], rss)
                except psutil.Error:
                    pass
                time.sleep(0.05)
        except psutil.Error:
            pass

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    stop.set()
    th.join()
    if proc.returncode != 0:
        sys.stderr.write(err[-3000:])
    return proc.returncode, peak[0] / 2**20, out


def _agreement(res: pd.DataFrame, ref: pd.DataFrame) -> dict:
    import scipy.stats

    a, b = res["log2FoldChange"].to_numpy(), ref["log2FoldChange"].to_numpy()
    ok = np.isfinite(a) & np.isfinite(b)
    big = ok & (ref["baseMean"].to_numpy() >= 10)
    pa, pb = res["pvalue"].to_numpy(), ref["pvalue"].to_numpy()
    both = np.isfinite(pa) & np.isfinite(pb)
    sa, sb = set(np.nonzero(res["padj"].to_numpy() < 0.1)[0]), set(np.nonzero(ref["padj"].to_numpy() < 0.1)[0])
    return {
        "lfc_pearson": float(np.corrcoef(a[ok], b[ok])[0, 1]),
        "lfc_max_abs_diff_baseMean_ge_10": float(np.max(np.abs(a[big] - b[big]))),
        "pvalue_spearman": float(scipy.stats.spearmanr(pa[both], pb[both])[0]),
        "pvalue_nan_mismatch": int((np.isnan(pa) != np.isnan(pb)).sum()),
        "padj_nan_mismatch": int((np.isnan(res["padj"].to_numpy()) != np.isnan(ref["padj"].to_numpy())).sum()),
        "n_padj_lt_0.1": len(sa),
        "jaccard_padj_lt_0.1": float(len(sa & sb) / max(len(sa | sb), 1)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["100x10000", "200x20000"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-pydeseq2", action="store_true")
    ap.add_argument("--skip-r", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=str(HERE / "results" / "deseq_cpu"))
    args = ap.parse_args()

    from _deseq_sim import simulate

    rows = []
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            n, g = map(int, size.split("x"))
            counts, meta, _ = simulate(n, g, seed=0)
            npy, meta_csv, counts_csv = f"{tmp}/counts.npy", f"{tmp}/meta.csv", f"{tmp}/counts.csv"
            np.save(npy, counts)
            meta.to_csv(meta_csv)
            pd.DataFrame(counts.T, index=[f"g{j + 1}" for j in range(g)], columns=meta.index).to_csv(counts_csv)
            entry: dict = {"size": size, "n_samples": n, "n_genes": g}
            results = {}
            for tool in ["gpuc"] + ([] if args.skip_pydeseq2 else ["pydeseq2"]):
                out_csv = f"{tmp}/{tool}.csv"
                rc, mb, out = _run_tree(
                    [sys.executable, __file__, "--worker", tool, npy, meta_csv, out_csv, str(args.repeats)],
                    args.timeout,
                )
                info = json.loads(out.strip().splitlines()[-1]) if rc == 0 else {"seconds": float("nan")}
                entry[tool] = {**info, "peak_rss_mb": mb}
                if rc == 0:
                    results[tool] = pd.read_csv(out_csv, index_col=0)
                print(size, tool, entry[tool], flush=True)
            if not args.skip_r:
                out_csv, timing_csv = f"{tmp}/r.csv", f"{tmp}/r_timing.csv"
                t = time.perf_counter()
                rc, mb, _ = _run_tree(
                    ["Rscript", str(HERE / "bench_deseq.R"), counts_csv, meta_csv, out_csv, timing_csv], args.timeout
                )
                wall = time.perf_counter() - t
                if rc == 0:
                    tim = pd.read_csv(timing_csv)
                    sec = float(tim.loc[tim.stage.isin(["DESeq", "results"]), "seconds"].sum())
                    cpu = float(tim.loc[tim.stage.isin(["DESeq", "results"]), "cpu_seconds"].sum())
                    entry["R"] = {
                        "seconds": sec,
                        "cpu_seconds": cpu,
                        "wall_with_startup_io": wall,
                        "version": str(tim.version.iloc[0]),
                        "peak_rss_mb": mb,
                    }
                    results["R"] = pd.read_csv(out_csv, index_col=0)
                print(size, "R", entry.get("R"), flush=True)
            if "R" in results:
                for tool in ("gpuc", "pydeseq2"):
                    if tool in results:
                        entry[tool]["vs_R"] = _agreement(results[tool], results["R"])
            for tool in ("pydeseq2", "R"):
                if tool in entry and "seconds" in entry[tool]:
                    entry[f"speedup_vs_{tool}"] = entry[tool]["seconds"] / entry["gpuc"]["seconds"]
                    entry[f"cpu_ratio_vs_{tool}"] = entry[tool]["cpu_seconds"] / entry["gpuc"]["cpu_seconds"]
            rows.append(entry)
    import gpuc

    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "gpuc": gpuc.__version__,
        "load_average_start_end": [load_start[0], os.getloadavg()[0]],
    }
    try:
        with open("/proc/cpuinfo") as fh:
            machine["cpu"] = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    lines = [
        f"Machine: {machine['cpu']}, {machine['cores']} cores shared with other jobs (1-min load average {load_start[0]:.1f} at start, {machine['load_average_start_end'][1]:.1f} at end), Python {machine['python']}, numpy {machine['numpy']}.",
        "",
        "| data | wall s gpuc | PyDESeq2 n_cpus=2 | R DESeq2 | wall ratio vs PyDESeq2 | vs R | CPU s gpuc / PyDESeq2 / R | CPU ratio vs PyDESeq2 / R | peak RSS gpuc / PyDESeq2 / R (MB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        g, p, rr = r["gpuc"], r.get("pydeseq2", {}), r.get("R", {})
        nan = float("nan")
        lines.append(
            f"| {r['size']} | {g['seconds']:.2f} | {p.get('seconds', nan):.1f} | {rr.get('seconds', nan):.1f} | {r.get('speedup_vs_pydeseq2', nan):.0f}x | {r.get('speedup_vs_R', nan):.1f}x"
            f" | {g.get('cpu_seconds', nan):.2f} / {p.get('cpu_seconds', nan):.1f} / {rr.get('cpu_seconds', nan):.1f} | {r.get('cpu_ratio_vs_pydeseq2', nan):.0f}x / {r.get('cpu_ratio_vs_R', nan):.1f}x"
            f" | {g['peak_rss_mb']:.0f} / {p.get('peak_rss_mb', nan):.0f} / {rr.get('peak_rss_mb', nan):.0f} |"
        )
    lines += [
        "",
        "Agreement with R DESeq2 (all genes; LFC diff over baseMean >= 10):",
        "",
        "| data | tool | LFC Pearson | max abs LFC diff | p Spearman | Jaccard padj<0.1 | NaN mismatches p / padj |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        for tool in ("gpuc", "pydeseq2"):
            v = r.get(tool, {}).get("vs_R")
            if v:
                lines.append(
                    f"| {r['size']} | {tool} | {v['lfc_pearson']:.8f} | {v['lfc_max_abs_diff_baseMean_ge_10']:.1e} | {v['pvalue_spearman']:.6f} | {v['jaccard_padj_lt_0.1']:.4f} | {v['pvalue_nan_mismatch']} / {v['padj_nan_mismatch']} |"
                )
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        tool, npy, meta_csv, out_csv, reps = sys.argv[2:7]
        fn = {"gpuc": _worker_gpuc, "pydeseq2": _worker_pydeseq2}[tool]
        print(json.dumps(fn(npy, meta_csv, out_csv, int(reps))))
    else:
        main()
