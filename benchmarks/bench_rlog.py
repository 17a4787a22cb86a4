"""rlog on the CPU: gpuc.tl.rlog against R DESeq2 1.38's rlog(blind=TRUE), side by side in one run.

Data: ``_deseq_sim.simulate(n, g, seed=0)`` (the DESeq2 benchmark's simulated negative-binomial counts). R:
``bench_rlog.R`` (``rlog`` alone timed inside R: start-up and reading excluded), run once (it takes minutes). gpuc:
``gpuc.tl.rlog`` in a fresh process (first call: includes loading and numba's compiled kernels of the genewise
dispersion fit, from its cache when filled) and then warm (median of ``--repeats``), both at the default threads.
Also reports the largest difference of the values from R's.

    python benchmarks/bench_rlog.py                    # 100 x 10,000; R takes several minutes
    python benchmarks/bench_rlog.py --n 24 --g 2000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _deseq_sim import simulate  # noqa: E402

GPUC = """
import json, sys, time
t0 = time.perf_counter()
import anndata as ad, numpy as np, gpuc
x = np.load(sys.argv[1])
a = ad.AnnData(x)
t1, c1 = time.perf_counter(), time.process_time()
gpuc.tl.rlog(a, device="cpu")
t2, c2 = time.perf_counter(), time.process_time()
warm, warm_cpu = [], []
for _ in range(int(sys.argv[3])):
    b = ad.AnnData(x)
    s, c = time.perf_counter(), time.process_time()
    gpuc.tl.rlog(b, device="cpu")
    warm.append(time.perf_counter() - s)
    warm_cpu.append(time.process_time() - c)
np.save(sys.argv[2], a.layers["rlog"])
print(json.dumps({"import_and_read": t1 - t0, "first_call": t2 - t1, "first_call_cpu": c2 - c1, "warm": warm,
                  "warm_cpu": warm_cpu,
                  "beta_prior_var": a.uns["rlog"]["beta_prior_var"]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--g", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-r", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results" / "cpu_rlog.json"))
    args = ap.parse_args()
    counts, meta, _ = simulate(args.n, args.g, seed=0)
    out: dict = {"case": f"{args.n}x{args.g}"}
    with tempfile.TemporaryDirectory() as tmp:
        np.save(f"{tmp}/x.npy", counts)
        res = subprocess.run(
            [sys.executable, "-c", GPUC, f"{tmp}/x.npy", f"{tmp}/v.npy", str(args.repeats)],
            capture_output=True,
            text=True,
            check=True,
        )
        out["gpuc"] = json.loads(res.stdout.strip().splitlines()[-1])
        out["gpuc"]["warm_median"] = float(np.median(out["gpuc"]["warm"]))
        ours = np.load(f"{tmp}/v.npy")
        if not args.no_r:
            genes = [f"g{j + 1}" for j in range(counts.shape[1])]
            pd.DataFrame(counts.T, index=genes, columns=meta.index).to_csv(f"{tmp}/counts.csv")
            t0 = time.perf_counter()
            subprocess.run(
                ["Rscript", str(HERE / "bench_rlog.R"), f"{tmp}/counts.csv", f"{tmp}/r.csv", f"{tmp}/r_time.csv"],
                check=True,
                capture_output=True,
            )
            tim = pd.read_csv(f"{tmp}/r_time.csv")
            r_vals = pd.read_csv(f"{tmp}/r.csv", index_col=0).to_numpy().T
            out["R"] = {
                "rlog_seconds": float(tim["seconds"].iloc[0]),
                "rlog_cpu_seconds": float(tim["cpu_seconds"].iloc[0]) if "cpu_seconds" in tim else None,
                "wall_with_startup": time.perf_counter() - t0,
                "beta_prior_var": float(tim["betaPriorVar"].iloc[0]),
                "version": str(tim["version"].iloc[0]),
            }
            diff = np.abs(ours - r_vals)
            out["max_abs_diff_vs_R"] = float(diff.max())
            out["p99_abs_diff_vs_R"] = float(np.quantile(diff, 0.99))
            out["speedup_first_call"] = out["R"]["rlog_seconds"] / out["gpuc"]["first_call"]
            out["speedup_warm"] = out["R"]["rlog_seconds"] / out["gpuc"]["warm_median"]
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
