"""Prepared GPU check for gpuc.tl.metacells: GPU = CPU parity on the same kernel, then timings at 7k / 50k / 200k.

Needs only CuPy (no FAISS-GPU, no cuML): kNN falls back to exact blocked products in cupy. Writes
``$OUT/metacells_gpu.json`` and ``$OUT/metacells_gpu.md`` (``--out`` or the ``OUT`` environment variable, default
``benchmarks/results``). Runs in a few minutes on one H100/H200-class GPU. Exit status 1 when a parity check fails.

    python benchmarks/gpu_metacells.py                  # parity + 7k, 50k, 200k
    python benchmarks/gpu_metacells.py --sizes 6881     # parity + one size
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import scipy.sparse as sp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "src"))

REF = ROOT / "tests" / "data" / "metacells" / "pbmc68k_reduced_seacells033_seed0.npz"


def _log(*a: object) -> None:
    print(*a, flush=True)


def parity(report: dict) -> bool:
    """Reference trajectory on the GPU, and GPU = CPU on the same 6,881-cell kernel and archetypes."""
    from _metacells_data import jittered_pcs

    from gpuc._backend import get_backend
    from gpuc.metacells import build_kernel, compute_knn, fit, initial_archetypes

    cpu, gpu = get_backend("cpu"), get_backend("gpu")
    ok = True
    z = np.load(REF)
    m = sp.csr_matrix((z["kernel_data"], z["kernel_indices"], z["kernel_indptr"]), shape=(700, 700))
    res = fit(
        gpu,
        gpu.asarray(m),
        z["archetypes"],
        a0=gpu.asarray(z["A0"]),
        max_iter=50,
        min_iter=10,
        convergence_epsilon=1e-5,
    )
    a = gpu.to_host(res.A).toarray()
    rss_rel = (
        float(np.max(np.abs(np.asarray(res.rss) - z["rss"]) / z["rss"]))
        if len(res.rss) == len(z["rss"])
        else float("inf")
    )
    labels_ok = bool(np.array_equal(np.array([f"SEACell-{j}" for j in a.argmax(0)]), z["labels"]))
    r = {
        "n_iter": res.n_iter,
        "rss_max_rel_diff": rss_rel,
        "A_max_abs_diff": float(np.abs(a - z["A"]).max()),
        "labels_equal": labels_ok,
    }
    report["parity_reference_pbmc68k"] = r
    ok &= rss_rel <= 1e-10 and labels_ok
    _log("reference parity (GPU vs SEACells 0.3.3 trajectory):", r)

    x = jittered_pcs(6881)
    knn = compute_knn(cpu, x, 30)
    mh, _ = build_kernel(cpu, x, knn=knn)
    kh = sp.csr_matrix(mh @ mh.T)
    arche = initial_archetypes(cpu, kh, knn, 92, np.random.RandomState(0))
    a0 = np.random.RandomState(1).random((92, 6881))
    a0 /= a0.sum(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = fit(cpu, mh, arche, a0=a0.copy(), kmat=kh, max_iter=8, min_iter=8)
        gpu.synchronize()
        t0 = time.perf_counter()
        rg = fit(gpu, gpu.asarray(mh), arche, a0=gpu.asarray(a0), max_iter=8, min_iter=8)
        gpu.synchronize()
        tg = time.perf_counter() - t0
    diff = float(np.max(np.abs(np.asarray(rc.rss) - np.asarray(rg.rss)) / np.asarray(rc.rss)))
    a_c, a_g = cpu.to_host(rc.A).toarray(), gpu.to_host(rg.A).toarray()
    b_c, b_g = cpu.to_host(rc.B).toarray(), gpu.to_host(rg.B).toarray()
    same_labels = float(np.mean(a_c.argmax(0) == a_g.argmax(0)))
    r = {
        "n": 6881,
        "k": 92,
        "iters": 8,
        "rss_max_rel_diff": diff,
        "A_max_abs_diff": float(np.abs(a_c - a_g).max()),
        "B_max_abs_diff": float(np.abs(b_c - b_g).max()),
        "label_agreement": same_labels,
        "gpu_fit_s": tg,
    }
    report["parity_cpu_gpu_cd34like"] = r
    ok &= diff <= 1e-8 and same_labels >= 0.999
    _log("CPU vs GPU on the same kernel:", r)
    return ok


def timing(n: int, report: dict) -> None:
    from _metacells_data import jittered_pcs, manifold_pcs

    from gpuc._backend import get_backend
    from gpuc.metacells import run_metacells

    gpu = get_backend("gpu")
    x = jittered_pcs(n) if n == 6881 else manifold_pcs(n)
    k = round(n / 75)
    eps, max_iter = (1e-5, 50) if n == 6881 else (1e-3, 100)  # 6,881: the SEACells tutorial settings
    import cupy

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    xg = gpu.asarray(x)
    gpu.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        res = run_metacells(gpu, xg, k, max_iter=max_iter, min_iter=10, convergence_epsilon=eps)
        gpu.synchronize()
        total = time.perf_counter() - t0
    r = {
        "n": n, "k": k, "eps": eps, "max_iter": max_iter, "total_s": round(total, 3), **{f"{a}_s": round(b, 3) for a, b in res.timings.items()},
        "n_iter": res.fit.n_iter, "converged": res.fit.converged, "rss0": res.fit.rss[0], "rss": res.fit.rss[-1],
        "s_per_iter": round(float(np.median(res.fit.seconds_per_iter)), 4), "gpu_pool_peak_gb": round(pool.total_bytes() / 1024**3, 2), "a0": res.a0,
    }  # fmt: skip
    report.setdefault("timings", []).append(r)
    _log("timing:", r)
    del res, xg
    pool.free_all_blocks()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="*", default=[6881, 50_000, 200_000])
    ap.add_argument("--out", default=os.environ.get("OUT", str(HERE / "results")))
    ap.add_argument("--skip-parity", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    report: dict = {
        "device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "cupy": cupy.__version__,
        "command": " ".join(sys.argv),
    }
    _log("device:", report["device"], "cupy", cupy.__version__)
    # warm-up: compile the kernels once on a tiny problem so timings are steady-state
    from _metacells_data import jittered_pcs

    from gpuc._backend import get_backend
    from gpuc.metacells import run_metacells

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_metacells(get_backend("gpu"), jittered_pcs(600), 8, max_iter=2, min_iter=2)
    ok = True
    if not args.skip_parity:
        ok = parity(report)
    for n in args.sizes:
        try:
            timing(n, report)
        except Exception as err:
            report.setdefault("timings", []).append({"n": n, "error": f"{type(err).__name__}: {err}"})
            _log("timing failed:", n, err)
        (out / "metacells_gpu.json").write_text(json.dumps(report, indent=1, default=float))
    lines = [
        f"GPU: {report['device']} (cupy {report['cupy']}); command: `{report['command']}`",
        "",
        "| cells | k | kernel s | init s | fit s | total s | iters | s/iter | RSS0 -> final | GPU pool GB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report.get("timings", []):
        if "error" in r:
            lines.append(f"| {r['n']} | | | | | error: {r['error'][:80]} | | | | |")
            continue
        lines.append(
            f"| {r['n']:,} | {r['k']} | {r['kernel_s']} | {r['init_s']} | {r['fit_s']} | {r['total_s']} | {r['n_iter']} | {r['s_per_iter']} | {r['rss0']:.4f} -> {r['rss']:.4f} | {r['gpu_pool_peak_gb']} |"
        )
    for key in ("parity_reference_pbmc68k", "parity_cpu_gpu_cd34like"):
        if key in report:
            lines.append("")
            lines.append(f"{key}: {json.dumps(report[key], default=float)}")
    (out / "metacells_gpu.md").write_text("\n".join(lines) + "\n")
    _log("\n".join(lines))
    _log("PARITY", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
