"""How gpuc's CPU path scales with threads: each tool at 1, 4 and 16 threads (``n_jobs=``), warm.

Thread counts are 1, 4, 16 and the cores this process may use (``gpuc._utils.available_cores``: its CPU affinity
capped by the cgroup CPU quota), each kept only when it does not exceed those cores, and capped at
``GPUC_SCALING_MAX_THREADS`` (default 16). Cases, the calls and settings of the GPU check's timings so that the two
can be set side by side (``benchmarks/gpu_summary.py``'s crossover table):

* ``metacells``: the engine ``run_metacells`` on 6,881 cells, k = 92, epsilon 1e-5, max_iter 50, min_iter 10
  (``_metacells_data.jittered_pcs``, as ``gpu_metacells.py`` times it on the GPU);
* ``nmf``: ``tl.consensus_nmf`` k = 7 x 20 runs on 6,881 x 2,000 (``_nmf_data.cd34_sized``, float32, as
  ``gpu_nmf.py``);
* ``deseq``: ``tl.deseq`` on 500 samples x 30,000 genes (``_deseq_sim.simulate``, ``~condition``, B vs A, as
  ``gpu_deseq.py``).

Per case: one warm-up call (at the most threads; it also loads the compiled kernels), then rounds of one call at
each thread count (interleaved, so drift of the machine's load hits every count alike); the median of the rounds.
The speed-up is the 1-thread median over each count's median; the issue's goals are >= 8x at 16 threads for NMF and
DESeq2 and >= 6x for metacells. Every call's result is compared with the 1-thread call's (gpuc's results do not depend
on ``n_jobs``). Rounds stop early when the stage's time budget would be exceeded (at least one round per case).

Environment:

* ``OUT``: where ``cpu_scaling.json`` and ``cpu_scaling.md`` go (default ``gpu_results``); the JSON is rewritten after
  every round, so a stage cut off by its time limit still leaves what was measured.
* ``GPUC_SCALING_REPEATS``: rounds per case (default 3: on 16 cores of the H200 host the three cases take about
  30 s per round, ~6 s of 1-thread time each going by the 2-core times in docs/benchmarks.md, plus the warm-up calls
  and the data: ~120 s in all).
* ``GPUC_SCALING_SECONDS``: time budget of the rounds (default: the stage's limit ``GPUC_STAGE_SECONDS``, which
  gpu_check.sh sets, less 20 s; else 130).
* ``GPUC_SCALING_SMALL=1``: small sizes (1,500 cells k = 20; 1,200 x 500 k = 7 x 10; 60 x 3,000) to check the script
  on a small machine.
* ``GPUC_SCALING_CASES``: comma-separated subset of ``metacells,nmf,deseq``.

    OUT=/tmp/out python benchmarks/cpu_scaling.py
    GPUC_SCALING_SMALL=1 OUT=/tmp/out python benchmarks/cpu_scaling.py
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

OUT = Path(os.environ.get("OUT", HERE.parent / "gpu_results"))
SMALL = os.environ.get("GPUC_SCALING_SMALL") == "1"
REPEATS = max(1, int(os.environ.get("GPUC_SCALING_REPEATS", "3")))
# the budget of the rounds: GPUC_SCALING_SECONDS, else the stage's limit (gpu_check.sh) less a margin for the data
# and the last round's overrun, else 130 s
BUDGET_S = float(
    os.environ.get("GPUC_SCALING_SECONDS")
    or (float(os.environ["GPUC_STAGE_SECONDS"]) - 20 if os.environ.get("GPUC_STAGE_SECONDS") else 130)
)
MAX_THREADS = max(1, int(os.environ.get("GPUC_SCALING_MAX_THREADS", "16")))
CASES = tuple(c for c in os.environ.get("GPUC_SCALING_CASES", "metacells,nmf,deseq").split(",") if c)
# the goals: speed-up over one thread at 16 threads
GOALS = {"metacells": 6.0, "nmf": 8.0, "deseq": 8.0}
GOAL_THREADS = 16


def log(*a: object) -> None:
    print(*a, flush=True)


def thread_counts(available: int) -> list[int]:
    """1, 4, 16 and ``available`` (capped at ``MAX_THREADS``), those not above the cores this process may use."""
    cap = min(available, MAX_THREADS)
    return sorted({t for t in (1, 4, 16, cap) if t <= cap})


# ---- the cases: each returns (label, size description, call(n_jobs) -> fingerprint of the result) ----------------
def case_metacells() -> tuple[str, dict, Callable[[int], object]]:
    from _metacells_data import jittered_pcs

    from gpuc._backend import get_backend
    from gpuc.metacells import run_metacells

    n, k = (1500, 20) if SMALL else (6881, 92)
    cpu = get_backend("cpu")
    x = jittered_pcs(n)

    def call(n_jobs: int) -> object:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = run_metacells(cpu, x, k, max_iter=50, min_iter=10, convergence_epsilon=1e-5, n_jobs=n_jobs)
        labels = np.asarray(res.fit.A.argmax(0)).ravel()
        return (res.fit.n_iter, float(res.fit.rss[-1]), labels.tobytes())

    return f"metacells {n:,} cells, k={k}", {"cells": n, "k": k, "epsilon": 1e-5, "max_iter": 50}, call


def case_nmf() -> tuple[str, dict, Callable[[int], object]]:
    from _nmf_data import cd34_sized
    from anndata import AnnData

    import gpuc

    (m, g, runs) = (1200, 500, 10) if SMALL else (6881, 2000, 20)
    ad = AnnData(cd34_sized(m, g))
    kw = {"mask_var": None, "density_threshold": 2.0, "device": "cpu", "copy": True}

    def call(n_jobs: int) -> object:
        out = gpuc.tl.consensus_nmf(ad, 7, n_runs=runs, n_jobs=n_jobs, **kw)
        return (
            float(out.uns["nmf"]["rel_error"]),
            float(out.uns["nmf"]["stability"]),
            out.varm["nmf_spectra"].tobytes(),
        )

    size = {"shape": list(ad.shape), "k": 7, "n_runs": runs, "dtype": "float32", "nnz": int(ad.X.nnz)}
    return f"consensus NMF {ad.n_obs:,} x {ad.n_vars:,}, k=7 x {runs}", size, call


def case_deseq() -> tuple[str, dict, Callable[[int], object]]:
    import anndata as ad
    from _deseq_sim import simulate

    import gpuc

    n, g = (60, 3000) if SMALL else (500, 30_000)
    counts, meta, _ = simulate(n, g, seed=0)
    a = ad.AnnData(X=counts, obs=meta)
    a.var_names = [f"g{j}" for j in range(g)]

    def call(n_jobs: int) -> object:
        b = a.copy()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gpuc.tl.deseq(b, "~condition", contrast=["condition", "B", "A"], device="cpu", n_jobs=n_jobs)
        res = gpuc.get.deseq_results(b)
        return res[["log2FoldChange", "pvalue"]].to_numpy().tobytes()

    return f"DESeq2 {n} x {g:,}", {"samples": n, "genes": g, "design": "~condition"}, call


MAKERS = {"metacells": case_metacells, "nmf": case_nmf, "deseq": case_deseq}


def machine() -> dict:
    import _harness
    import numba

    from gpuc._utils import available_cores

    try:
        import faiss  # noqa: F401

        knn = "faiss-cpu"
    except ImportError:
        knn = "gpuc's blocked exact kNN (no faiss-cpu)"
    return {
        "cpu": _harness.cpu_name(),
        "os_cpu_count": os.cpu_count(),
        "affinity": _harness.cores(),
        "available_cores": available_cores(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
        "metacells_knn": knn,
        "small": SMALL,
        "repeats_requested": REPEATS,
        "budget_s": BUDGET_S,
    }


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"# gpuc CPU scaling ({m['cpu'] or 'CPU'}, {m['available_cores']} cores available, "
        f"affinity {m['affinity']}{', small sizes' if m['small'] else ''})",
        "",
        "Warm calls, median of the rounds; speed-up = 1-thread median / median; goals at 16 threads: "
        "metacells >= 6x, NMF and DESeq2 >= 8x.",
        "",
        "| case | threads | median s | rounds | speed-up vs 1 thread | same result as 1 thread |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, c in report["cases"].items():
        if "error" in c:
            lines.append(f"| {c.get('label', name)} | | | | error: {c['error'][:100]} | |")
            continue
        for t, r in c["threads"].items():
            sp_ = r.get("speedup")
            lines.append(
                f"| {c['label']} | {t} | {r['median_s']:.3f} | {len(r['all_s'])} | "
                f"{'' if sp_ is None else f'{sp_:.2f}x'} | {r.get('same_result', '')} |"
            )
    lines += ["", "| case | goal at 16 threads | measured | met |", "| --- | --- | --- | --- |"]
    for c in report["cases"].values():
        g = c.get("goal", {})
        if g:
            lines.append(f"| {c['label']} | >= {g['speedup']:.0f}x | {g['measured']} | {g['met']} |")
    return "\n".join(lines) + "\n"


def save(report: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "cpu_scaling.json").write_text(json.dumps(report, indent=1, default=str))
    (OUT / "cpu_scaling.md").write_text(markdown(report))


def summarise(name: str, c: dict, counts: list[int]) -> None:
    """Medians, speed-ups and the goal of one case from its recorded rounds."""
    for r in c["threads"].values():
        r["median_s"] = float(statistics.median(r["all_s"]))
    base = c["threads"].get("1", {}).get("median_s")
    for r in c["threads"].values():
        r["speedup"] = base / r["median_s"] if base else None
    goal = GOALS.get(name)
    if goal is None:
        return
    top = str(GOAL_THREADS)
    if top in c["threads"] and c["threads"][top]["speedup"] is not None:
        s = c["threads"][top]["speedup"]
        c["goal"] = {"speedup": goal, "measured": f"{s:.2f}x", "met": "yes" if s >= goal else "NO", "value": s}
    else:
        c["goal"] = {
            "speedup": goal,
            "measured": f"not measured: {max(counts)} threads at most on this machine",
            "met": "",
            "value": None,
        }


def main() -> int:
    import gpuc

    gpuc.settings.progress = False
    t_start = time.perf_counter()
    report: dict = {"machine": machine(), "cases": {}}
    counts = thread_counts(report["machine"]["available_cores"])
    report["thread_counts"] = counts
    report["load_before"] = os.getloadavg()
    log("machine:", report["machine"], "thread counts:", counts)
    save(report)
    names = [c for c in CASES if c in MAKERS]
    rc = 0
    for i, name in enumerate(names):
        c: dict = {"threads": {}}
        report["cases"][name] = c
        try:
            t0 = time.perf_counter()
            label, size, call = MAKERS[name]()
            c.update(label=label, size=size, prepare_s=time.perf_counter() - t0)
            t0 = time.perf_counter()
            call(max(counts))
            c["warmup_call_s"] = time.perf_counter() - t0
            log(
                f"{label}: data {c['prepare_s']:.1f} s, warm-up call at {max(counts)} threads {c['warmup_call_s']:.2f} s"
            )
            # this case's share of what is left of the budget
            share = (BUDGET_S - (time.perf_counter() - t_start)) / (len(names) - i)
            t_case = time.perf_counter()
            ref = None
            for rnd in range(REPEATS):
                t_round = time.perf_counter()
                for t in counts:
                    t0 = time.perf_counter()
                    fp = call(t)
                    dt = time.perf_counter() - t0
                    r = c["threads"].setdefault(str(t), {"all_s": []})
                    r["all_s"].append(dt)
                    if t == 1 and ref is None:
                        ref = fp
                    if ref is not None:
                        r["same_result"] = bool(r.get("same_result", True) and fp == ref)
                summarise(name, c, counts)
                save(report)
                per_round = time.perf_counter() - t_round
                log(
                    f"  round {rnd + 1}: "
                    + ", ".join(f"{t}: {c['threads'][str(t)]['all_s'][-1]:.3f} s" for t in counts)
                )
                if (time.perf_counter() - t_case) + per_round > share and rnd + 1 < REPEATS:
                    log(f"  stopping after {rnd + 1} round(s): the next would pass this case's {share:.0f} s share")
                    break
            c["rounds"] = len(c["threads"][str(counts[0])]["all_s"])
        except Exception as err:  # recorded, and the other cases still run
            import traceback

            c["error"] = f"{type(err).__name__}: {err}"
            c["traceback"] = traceback.format_exc()[-2000:]
            log(c["traceback"])
            rc = 1
        save(report)
    report["load_after"] = os.getloadavg()
    report["total_s"] = time.perf_counter() - t_start
    save(report)
    log(markdown(report))
    return rc


if __name__ == "__main__":
    sys.exit(main())
