"""GPU check of the fused kernels themselves (issue 40): which path runs, then per-kernel device times, host time per
launch and the sparse-vs-dense product choice, each beside gpuc's CPU path in the same run.

1. ``status``: versions and the fused-kernel status (``gpuc._backend.fused_kernels_status``); on a GPU the script
   stops here with an error when the kernels are off (they would not be timed at all).
2. ``hals``: one batched HALS iteration at 6,881 x 2,000 (``_nmf_data.cd34_sized``, 10.6% non-zero), k=7 x 20
   restarts, float32 and float64: each launch and each product timed with CUDA events (medians over the timed
   iterations), the host microseconds per Python-level launch, and the CPU path's time per iteration (all cores).
   Target (issue 29, H200): one iteration <= 0.5 ms in float64.
3. ``metacells``: two outer iterations of the fit at 6,881 cells, k=90, T=50 (``_metacells_data.jittered_pcs``):
   each kernel's median time, one B-step (``fw_b_rows`` + ``fw_b_cols``), per outer iteration; CPU beside it.
4. ``deseq``: ``run_deseq`` on 100 samples x 10,000 genes (``_deseq_sim``): each kernel's time (R's dispersion line
   search is one ``fit_disp`` launch per pass); CPU beside it.
5. ``launch``: host microseconds per launch of a trivial kernel, with a new device view per argument (gpuc before
   issue 40) and inside a kernel session (views made once).
6. ``products``: cuSPARSE SpMM ``V^T W`` and ``V H^T`` at 6,881 x 2,000 against dense GEMM on the same matrix.

    OUT=/tmp/out python benchmarks/gpu_kernels.py [--smoke]   # writes $OUT/kernels_gpu.json and .md

Smoke mode runs every step on tiny data on the stand-in device (no events: wall clock), the kernels under the CUDA
simulator when GPUC_SMOKE_KERNELS=1, else the array code (the steps then record no kernel times).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # first: smoke mode must be set up before numba is imported
import numpy as np
from _harness import SMOKE, GpuScript, gpu_main, log, md_table

HALS_SHAPE = (120, 80) if SMOKE else (6881, 2000)
HALS_RUNS, HALS_K = (3, 3) if SMOKE else (20, 7)
HALS_ITERS = 6 if SMOKE else 60
MC_N, MC_K, MC_T = (60, 3, 4) if SMOKE else (6881, 90, 50)
DESEQ = (8, 100) if SMOKE else (100, 10_000)
LAUNCHES = 50 if SMOKE else 2000
TARGET_HALS_ITER_MS = 0.5


# ---------------------------------------------------------------------------------------------- timing of launches
class LaunchTimer:
    """Wraps :meth:`gpuc._backend.Backend.launch` while active: each launch is bracketed by CUDA events on CuPy's
    current stream (wall clock around a synchronised launch on the stand-in) and its host time (the Python call
    itself, no synchronisation) is kept; :meth:`summary` gives per-kernel medians once the device is synchronised.
    """

    def __init__(self, bk):
        self.bk = bk
        self.events = defaultdict(list)  # kernel -> [(start, end)] events, or [seconds] on the stand-in
        self.host = defaultdict(list)
        self._real = bk.is_gpu and bk.launcher is None

    @contextlib.contextmanager
    def active(self):
        from gpuc import _backend

        cls = _backend.Backend
        orig = cls.launch
        timer = self

        def launch(self, kernel, blocks, threads, *args, shared_bytes=0):
            name = getattr(getattr(kernel, "py_func", kernel), "__name__", "kernel")
            if timer._real:
                cp = self.xp
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record()
                t = time.perf_counter()
                orig(self, kernel, blocks, threads, *args, shared_bytes=shared_bytes)
                timer.host[name].append(time.perf_counter() - t)
                e1.record()
                timer.events[name].append((e0, e1))
            else:
                t = time.perf_counter()
                orig(self, kernel, blocks, threads, *args, shared_bytes=shared_bytes)
                dt = time.perf_counter() - t
                timer.host[name].append(dt)
                timer.events[name].append(dt)

        cls.launch = launch
        try:
            yield self
        finally:
            cls.launch = orig

    def summary(self) -> dict:
        self.bk.synchronize()
        out = {}
        for name, evs in self.events.items():
            if self._real:
                import cupy

                ms = [cupy.cuda.get_elapsed_time(a, b) for a, b in evs]
            else:
                ms = [1e3 * s for s in evs]
            out[name] = {
                "launches": len(ms),
                "device_ms_median": float(np.median(ms)),
                "device_ms_total": float(np.sum(ms)),
                "host_us_median": 1e6 * float(np.median(self.host[name])),
            }
        return out


def event_time(bk, fn, repeats: int = 10) -> float:
    """Median milliseconds of ``fn()`` on the device (CUDA events; wall clock on the stand-in)."""
    out = []
    for _ in range(repeats):
        if bk.is_gpu and bk.launcher is None:
            cp = bk.xp
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            out.append(cp.cuda.get_elapsed_time(e0, e1))
        else:
            t = time.perf_counter()
            fn()
            out.append(1e3 * (time.perf_counter() - t))
    return float(np.median(out))


def _gpu():
    from gpuc._backend import get_backend

    return get_backend("gpu")


# ---------------------------------------------------------------------------------------------- steps
def status(report: dict, args) -> None:
    import warnings

    from gpuc._backend import FusedKernelsWarning, fused_kernels_status

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FusedKernelsWarning)
        ok, why = fused_kernels_status()
    report["fused"] = {"on": ok, "why": why}
    report["versions"] = _harness.versions(("numpy", "numba", "numba-cuda", "cupy-cuda12x", "cupy-cuda13x"))
    log("fused kernels:", "on" if ok else "OFF", "-", why)
    if not ok and not SMOKE:
        msg = f"the fused GPU kernels are off: {why}"
        raise SystemExit(msg)


def hals(report: dict, args) -> None:
    import scipy.sparse as sp
    from _nmf_data import cd34_sized

    import gpuc.nmf._hals as hals_mod
    from gpuc._backend import get_backend
    from gpuc._utils import derive_seed

    bk, cpu = _gpu(), get_backend("cpu")
    v = sp.csr_matrix(cd34_sized(*HALS_SHAPE))
    groups = [(HALS_K, [derive_seed(0, HALS_K, r) for r in range(HALS_RUNS)])]
    report["hals"] = rows = []
    for dtype in (np.float32, np.float64):
        op = hals_mod.Operator.build(bk, bk.asarray(v), dtype=dtype)
        kw = {"max_iter": HALS_ITERS, "tol": 0.0}
        hals_mod.fit_hals_groups(bk, op, groups, max_iter=3, tol=0.0)  # warm-up (compile or load)
        # the products, timed with events inside the loop (the launches by the timer)
        prod_ms = defaultdict(list)
        real_product = hals_mod._product

        def product(xp, dot, x, layout, sparse, out=None, _real=real_product, op=op, prod_ms=prod_ms):
            name = "V^T W_hat (SpMM)" if dot == op.tdot else "V H_hat^T (SpMM)"
            res = []
            prod_ms[name].append(event_time(bk, lambda: res.append(_real(xp, dot, x, layout, sparse, out)), 1))
            return res[-1]

        timer = LaunchTimer(bk)
        hals_mod._product = product
        try:
            with timer.active():
                t0 = time.perf_counter()
                hals_mod.fit_hals_groups(bk, op, groups, **kw)
                bk.synchronize()
                wall = time.perf_counter() - t0
        finally:
            hals_mod._product = real_product
        kern = timer.summary()
        per_iter_ms = sum(d["device_ms_total"] for d in kern.values()) / HALS_ITERS
        per_iter_ms += sum(float(np.sum(v)) for v in prod_ms.values()) / HALS_ITERS
        opc = hals_mod.Operator.build(cpu, v, dtype=dtype)
        t0 = time.perf_counter()
        hals_mod.fit_hals_groups(cpu, opc, groups, **kw)
        cpu_iter_ms = 1e3 * (time.perf_counter() - t0) / HALS_ITERS
        row = {
            "dtype": np.dtype(dtype).name,
            "kernels": kern,
            "products_ms_median": {k: float(np.median(x)) for k, x in prod_ms.items()},
            "device_ms_per_iteration": per_iter_ms,
            "wall_ms_per_iteration": 1e3 * wall / HALS_ITERS,
            "cpu_ms_per_iteration": cpu_iter_ms,
            "target_ms": TARGET_HALS_ITER_MS if dtype == np.float64 else None,
        }
        rows.append(row)
        log("HALS", row["dtype"], {k: round(v["device_ms_median"], 4) for k, v in kern.items()}, row)


def metacells(report: dict, args) -> None:
    import warnings

    import scipy.sparse as sp
    from _metacells_data import jittered_pcs

    from gpuc._backend import get_backend
    from gpuc.metacells import build_kernel, compute_knn, fit, initial_archetypes

    bk, cpu = _gpu(), get_backend("cpu")
    x = jittered_pcs(MC_N)
    knn = compute_knn(cpu, x, 30 if not SMOKE else 8)
    mh, _ = build_kernel(cpu, x, knn=knn)
    kh = sp.csr_matrix(mh @ mh.T)
    arche = initial_archetypes(cpu, kh, knn, MC_K, np.random.RandomState(0))
    kw = {"max_iter": 2, "min_iter": 2, "fw_iters": MC_T}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(bk, bk.asarray(mh), arche, **kw)  # warm-up
        timer = LaunchTimer(bk)
        with timer.active():
            t0 = time.perf_counter()
            fit(bk, bk.asarray(mh), arche, **kw)
            bk.synchronize()
            wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        fit(cpu, mh, arche, **kw)
        cpu_s = time.perf_counter() - t0
    kern = timer.summary()
    b_step = sum(kern.get(n, {}).get("device_ms_median", 0.0) for n in ("fw_b_rows", "fw_b_cols"))
    report["metacells"] = {
        "size": f"{MC_N} cells, k={MC_K}, T={MC_T}, 2 outer iterations (+ the start)",
        "kernels": kern,
        "b_step_ms": b_step,
        "gpu_wall_s": wall,
        "cpu_wall_s": cpu_s,
    }
    log("metacells", report["metacells"])


def deseq(report: dict, args) -> None:
    import warnings

    from _deseq_sim import simulate

    from gpuc._backend import get_backend
    from gpuc.deseq import build_design, run_deseq

    bk, cpu = _gpu(), get_backend("cpu")
    n, g = DESEQ
    counts, meta, _ = simulate(n, g, seed=0)
    d = build_design(meta, "~condition")
    y = np.asarray(counts, dtype=np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_deseq(bk, bk.asarray(y), d.matrix)  # warm-up
        timer = LaunchTimer(bk)
        with timer.active():
            t0 = time.perf_counter()
            run_deseq(bk, bk.asarray(y), d.matrix)
            bk.synchronize()
            wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        run_deseq(cpu, y, d.matrix)
        cpu_s = time.perf_counter() - t0
    report["deseq"] = {"size": f"{n} samples x {g} genes", "kernels": timer.summary(), "gpu_wall_s": wall,
                       "cpu_wall_s": cpu_s}  # fmt: skip
    log("deseq", report["deseq"])


def launch(report: dict, args) -> None:
    global cuda  # the simulator finds `cuda` among the kernel's module globals
    from numba import cuda

    from gpuc._backend import launch_stats
    from gpuc._testing.standin import simulator_status

    bk = _gpu()
    if bk.launcher is not None and not simulator_status()[0]:  # smoke mode without the simulator: nothing to launch
        report["launch"] = {}
        log("launch: skipped (stand-in without the CUDA simulator)")
        return

    @cuda.jit
    def touch(x, y, z, a):  # pragma: no cover - compiled
        i = cuda.grid(1)
        if i < x.size:
            z[i] = x[i] * a + y[i]

    xp = bk.xp
    x, y, z = (xp.asarray(np.ones(256)) for _ in range(3))
    bk.launch(touch, 1, 256, x, y, z, 1.0)  # compile
    bk.synchronize()
    out = {}
    for mode in ("new views per launch", "kernel session"):
        ctx = bk.kernel_session() if mode == "kernel session" else contextlib.nullcontext()
        with ctx, launch_stats() as s:
            t0 = time.perf_counter()
            for _ in range(LAUNCHES):
                bk.launch(touch, 1, 256, x, y, z, 1.0)
            host = time.perf_counter() - t0
            bk.synchronize()
            total = time.perf_counter() - t0
        out[mode] = {"host_us_per_launch": 1e6 * host / LAUNCHES, "wall_us_per_launch": 1e6 * total / LAUNCHES,
                     "views": s.views, "launches": s.launches}  # fmt: skip
    report["launch"] = out
    log("launch", out)


def products(report: dict, args) -> None:
    import scipy.sparse as sp
    from _nmf_data import cd34_sized

    bk = _gpu()
    xp = bk.xp
    v = sp.csr_matrix(cd34_sized(*HALS_SHAPE)).astype(np.float32)
    cols = HALS_K * HALS_RUNS
    rng = np.random.default_rng(0)
    w = xp.asarray(rng.random((v.shape[0], cols), dtype=np.float32))
    h = xp.asarray(rng.random((v.shape[1], cols), dtype=np.float32))
    vs, vst = bk.asarray(v), bk.asarray(sp.csr_matrix(v.T))
    vd = xp.asarray(v.toarray())
    report["products"] = {
        "shape": f"{v.shape[0]} x {v.shape[1]}, {v.nnz / np.prod(v.shape):.1%} non-zero, {cols} columns, float32",
        "spmm_vt_w_ms": event_time(bk, lambda: vst @ w),
        "gemm_vt_w_ms": event_time(bk, lambda: vd.T @ w),
        "spmm_v_h_ms": event_time(bk, lambda: vs @ h),
        "gemm_v_h_ms": event_time(bk, lambda: vd @ h),
    }
    log("products", report["products"])


# ---------------------------------------------------------------------------------------------- report
def render(r: dict) -> str:
    out = [f"# Fused GPU kernels ({r.get('device', '?')})", ""]
    f = r.get("fused")
    if f:
        out += [f"Fused kernels: {'on' if f['on'] else 'OFF'} ({f['why']})", ""]
    for row in r.get("hals", []):
        out += [f"## One HALS iteration, {HALS_SHAPE[0]:,} x {HALS_SHAPE[1]:,}, k={HALS_K} x {HALS_RUNS}, {row['dtype']}",
                ""]  # fmt: skip
        rows = [[k, v["launches"], f"{v['device_ms_median']:.4f}", f"{v['host_us_median']:.1f}"]
                for k, v in row["kernels"].items()]  # fmt: skip
        rows += [[k, HALS_ITERS, f"{v:.4f}", ""] for k, v in row["products_ms_median"].items()]
        out += [md_table(["kernel", "launches", "device ms (median)", "host µs per launch"], rows), ""]
        tgt = f" (target {row['target_ms']} ms)" if row["target_ms"] else ""
        out += [f"Device time per iteration {row['device_ms_per_iteration']:.3f} ms{tgt}; wall "
                f"{row['wall_ms_per_iteration']:.3f} ms; CPU path {row['cpu_ms_per_iteration']:.3f} ms.", ""]  # fmt: skip
    for key in ("metacells", "deseq"):
        m = r.get(key)
        if not m:
            continue
        out += [f"## {key}: {m['size']}", ""]
        rows = [[k, v["launches"], f"{v['device_ms_median']:.4f}", f"{v['host_us_median']:.1f}"]
                for k, v in m["kernels"].items()]  # fmt: skip
        out += [md_table(["kernel", "launches", "device ms (median)", "host µs per launch"], rows), ""]
        extra = f"one B-step {m['b_step_ms']:.4f} ms; " if "b_step_ms" in m else ""
        out += [f"{extra}GPU wall {m['gpu_wall_s']:.3f} s, CPU wall {m['cpu_wall_s']:.3f} s.", ""]
    if r.get("launch"):
        rows = [[k, f"{v['host_us_per_launch']:.1f}", f"{v['wall_us_per_launch']:.1f}", v["views"]]
                for k, v in r["launch"].items()]  # fmt: skip
        out += ["## Host time per launch", "", md_table(["mode", "host µs", "wall µs", "views made"], rows), ""]
    p = r.get("products")
    if p:
        rows = [["V^T W", f"{p['spmm_vt_w_ms']:.4f}", f"{p['gemm_vt_w_ms']:.4f}"],
                ["V H^T", f"{p['spmm_v_h_ms']:.4f}", f"{p['gemm_v_h_ms']:.4f}"]]  # fmt: skip
        out += [f"## Products ({p['shape']})", "", md_table(["product", "cuSPARSE SpMM ms", "dense GEMM ms"], rows), ""]
    if r.get("errors"):
        out += ["Errors:", "", *[f"- {e}" for e in r["errors"]], ""]
    return "\n".join(out)


SCRIPT = GpuScript(
    name="kernels_gpu",
    steps=[status, launch, products, hals, metacells, deseq],
    render=render,
    ok=lambda r: bool(r.get("fused", {}).get("on")) or SMOKE,
)

if __name__ == "__main__":
    os.environ.setdefault("MPLBACKEND", "Agg")
    sys.exit(gpu_main(SCRIPT, __file__))
