"""Prepared GPU check for consensus NMF: GPU = CPU parity, then timings (CuPy only; no FAISS-GPU or cuML needed).

1. Parity on cNMF's 700 x 500 pbmc68k matrix (tests/data/nmf): the same 20 seeded restarts at k=7 on CPU and GPU in
   float64 (same iterations, same losses) and float32; ``tl.consensus_nmf`` with cNMF's settings on both devices.
2. Timings on a 6,881 x 2,000 sparse matrix (the size of bixverse.gpu's CD34 example: pbmc3k cells resampled to
   6,881 with binomial thinning, log1p(CP10k) on the 2,000 most dispersed genes detected in >= 6% of cells, 10.6%
   non-zero; bixverse-style input), warm, in float64 (the issue's H200 targets: one batched HALS iteration at
   k=7 x 20 <= 0.5 ms, k=7 x 20 runs + consensus <= 0.12 s, the k=2..12 x 10 sweep <= 1 s) and in float32 (the
   default): the time of one batched HALS iteration against the device's FLOP and byte limits, k=7 x 20 + consensus
   (bixverse.gpu 6.15 s on an M1 Max, CPU 20.53 s), the sweep; gpuc's CPU path on all cores (both dtypes); rank 200.

    OUT=/tmp/out python benchmarks/gpu_nmf.py        # writes $OUT/nmf_gpu.json and $OUT/nmf_gpu.md

Runs in about a minute on an H100/H200 (the CPU reference for the k=7 case included) once the warm-up stage
(``gpu_warmup.py``) has filled the kernel caches.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from _nmf_data import cd34_sized

ROOT = Path(__file__).resolve().parents[1]
# GPU_NMF_DRY=1: run the whole script on the CPU with a smaller matrix, to check it without a device
DRY = os.environ.get("GPU_NMF_DRY") == "1"
DEV = "cpu" if DRY else "gpu"
OUT = Path(os.environ.get("OUT", ROOT / "gpu_results"))
OUT.mkdir(parents=True, exist_ok=True)
RESULT: dict = {"errors": []}
ITERS = 50  # iterations timed for the per-iteration figure


def log(msg: str) -> None:
    print(msg, flush=True)


def save() -> None:
    (OUT / "nmf_gpu.json").write_text(json.dumps(RESULT, indent=2, default=float))


def timed(fn, backend, repeats: int = 3, long_s: float = 3.0):
    """Median wall time of ``fn()`` (device synchronised) over ``repeats`` calls, all times, and the last result.

    A call longer than ``long_s`` is not repeated (the stage has a time limit; such a time is far from any target).
    """
    times = []
    out = None
    for _ in range(repeats):
        if times and times[0] > long_s:
            break
        backend.synchronize()
        t = time.perf_counter()
        out = fn()
        backend.synchronize()
        times.append(time.perf_counter() - t)
    return float(np.median(times)), times, out


def fixture_counts():
    import pandas as pd
    from anndata import AnnData

    z = np.load(ROOT / "tests" / "data" / "nmf" / "pbmc68k_counts_700x500.npz", allow_pickle=False)
    x = sp.csr_matrix((z["data"].astype(np.float32), z["indices"], z["indptr"]), shape=tuple(z["shape"]))
    ad = AnnData(x, obs=pd.DataFrame(index=z["obs"].astype(str)), var=pd.DataFrame(index=z["var"].astype(str)))
    ad.var["highly_variable"] = True
    d = x.toarray().astype(np.float64)
    return ad, d / d.std(axis=0, ddof=1)


def parity() -> None:
    import gpuc
    from gpuc._backend import get_backend
    from gpuc._utils import derive_seed
    from gpuc.nmf._hals import Operator, fit_hals

    cpu, gpu = get_backend("cpu"), get_backend(DEV)
    ad, v = fixture_counts()
    seeds = [derive_seed(0, 7, r) for r in range(20)]
    res = {}
    for dt in ("float64", "float32"):
        fc = fit_hals(cpu, Operator.build(cpu, sp.csr_matrix(v), dtype=dt), 7, seeds)
        fg = fit_hals(gpu, Operator.build(gpu, sp.csr_matrix(v), dtype=dt), 7, seeds)
        hs_c = fc.spectra_t
        hs_g = gpu.to_host(fg.spectra_t)
        res[dt] = {
            "max_abs_rel_error_diff": float(np.max(np.abs(fc.rel_errors - fg.rel_errors))),
            "same_n_iter_runs": int((fc.n_iter == fg.n_iter).sum()),
            "max_rel_spectra_diff": float(np.max(np.abs(hs_c - hs_g)) / np.max(np.abs(hs_c))),
            "cpu_best_rel_error": float(fc.rel_errors.min()),
            "gpu_best_rel_error": float(fg.rel_errors.min()),
        }
        log(f"parity engine {dt}: {res[dt]}")
    kw = {
        "n_runs": 20,
        "preprocessing": "sd",
        "metric": "euclidean",
        "density_threshold": 0.5,
        "normalization": "sum",
        "copy": True,
    }
    c = gpuc.tl.consensus_nmf(ad, 7, device="cpu", **kw)
    g = gpuc.tl.consensus_nmf(ad, 7, device=DEV, **kw)
    a, b = c.varm["nmf_spectra"].T, g.varm["nmf_spectra"].T
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    res["tl_consensus"] = {
        "cpu_stability": c.uns["nmf"]["stability"],
        "gpu_stability": g.uns["nmf"]["stability"],
        "cpu_rel_error": c.uns["nmf"]["rel_error"],
        "gpu_rel_error": g.uns["nmf"]["rel_error"],
        "min_best_cosine": float((a @ b.T).max(axis=1).min()),
    }
    log(f"parity tl: {res['tl_consensus']}")
    ok = (
        res["float64"]["max_abs_rel_error_diff"] < 1e-8
        and res["float32"]["max_abs_rel_error_diff"] < 1e-4
        and res["tl_consensus"]["min_best_cosine"] > 0.99
        and abs(res["tl_consensus"]["gpu_rel_error"] - 0.59046) < 2e-4
    )
    res["pass"] = bool(ok)
    RESULT["parity"] = res


def _iteration_cost(x, dtype: str) -> tuple[int, int]:
    """FLOPs and bytes of one batched HALS iteration (both halves) at k=7 x 20 runs on the sparse ``x``."""
    m, n = x.shape
    rk = 20 * 7
    item = np.dtype(dtype).itemsize
    flops = 2 * 2 * x.nnz * rk + 2 * (m + n) * 20 * 49 + 2 * (m + n) * 20 * 7 * 10 + 3 * m * rk
    bytes_ = 2 * x.nnz * (item + 4) + 2 * (m + n) * rk * item * 3
    return flops, bytes_


def _device_name() -> str:
    if DRY:
        return "CPU (dry run)"
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    return props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])


def timings() -> None:
    """The issue's cases in float64 (its targets: warm, float64), then float32 (the default), the CPU path at the
    default dtype and in float64 (all cores), and rank 200. Keys of the float32 results carry no suffix (as the first
    H200 run wrote them); the float64 ones end in ``_float64``.
    """
    from anndata import AnnData

    import gpuc
    from gpuc._backend import get_backend
    from gpuc._utils import derive_seed
    from gpuc.nmf._hals import Operator, fit_hals

    gpu = get_backend(DEV)
    x = cd34_sized(1500 if DRY else 6881)
    ad = AnnData(x)
    log(f"matrix {x.shape}, nnz {x.nnz} ({x.nnz / np.prod(x.shape):.3f})")
    RESULT["matrix"] = {"shape": list(x.shape), "nnz": int(x.nnz), "input_dtype": str(x.dtype)}
    kw = {"mask_var": None, "density_threshold": 2.0, "copy": True}
    # warm-up (kernel compilation, or loading from the caches the warm-up stage filled) on a small problem of the
    # same dtypes
    sub = x[:500]
    sub = AnnData(sub[:, np.flatnonzero(np.asarray(sub.sum(0)).ravel() > 0)])
    for dt in ("float64", "float32"):
        gpuc.tl.consensus_nmf(sub, 7, n_runs=3, device=DEV, dtype=dt, **kw)
        gpuc.tl.nmf_k_sweep(sub, range(2, 13), n_runs=2, device=DEV, dtype=dt, **kw)
    seeds = [derive_seed(0, 7, r) for r in range(20)]
    name = _device_name()

    for dt in ("float64", "float32"):
        sfx = "_float64" if dt == "float64" else ""
        t, ts, out = timed(lambda dt=dt: gpuc.tl.consensus_nmf(ad, 7, n_runs=20, device=DEV, dtype=dt, **kw), gpu, 3)
        u = out.uns["nmf"]
        RESULT["k7x20_gpu" + sfx] = {
            "seconds": t,
            "all": ts,
            "dtype": dt,
            "stability": u["stability"],
            "rel_error": u["rel_error"],
            "n_converged": u["n_converged"],
            "cluster_sizes": u["cluster_sizes"].tolist(),
        }
        log(
            f"k=7 x 20 + consensus, GPU {dt}: {t:.3f} s (stability {u['stability']:.4f}, rel_error {u['rel_error']:.5f})"
        )
        op = Operator.build(gpu, x, dtype=dt)
        tf, _, fits = timed(lambda op=op: fit_hals(gpu, op, 7, seeds), gpu, 3)
        RESULT["k7x20_gpu_fit_only" + sfx] = {"seconds": tf, "mean_iter": float(fits.n_iter.mean()), "dtype": dt}
        log(f"  fit only {tf:.3f} s, {fits.n_iter.mean():.0f} iterations per run")
        # one batched iteration against the device limits: ITERS iterations with the stopping rule switched off
        tr, _, _ = timed(lambda op=op: fit_hals(gpu, op, 7, seeds, max_iter=ITERS, tol=1e-300), gpu, 3)
        flops, bytes_ = _iteration_cost(x, dt)
        per = tr / ITERS
        RESULT["iteration" + sfx] = {
            "seconds": per,
            "dtype": dt,
            "flops": flops,
            "bytes": bytes_,
            "tflops": flops / per / 1e12,
            "tbytes_per_s": bytes_ / per / 1e12,
            "device": name,
        }
        log(f"iteration {dt}: {per * 1e3:.3f} ms, {flops / per / 1e12:.3f} TFLOP/s, {bytes_ / per / 1e9:.1f} GB/s")
        save()
        t, ts, out = timed(
            lambda dt=dt: gpuc.tl.nmf_k_sweep(ad, range(2, 13), n_runs=10, device=DEV, dtype=dt, **kw), gpu, 2
        )
        tab = out.uns["nmf_k_sweep"]["table"]
        RESULT["sweep_2_12x10_gpu" + sfx] = {"seconds": t, "all": ts, "dtype": dt, "table": tab.to_dict(orient="list")}
        log(f"sweep 2..12 x 10, GPU {dt}: {t:.3f} s\n{tab.to_string(index=False)}")
        save()

    # gpuc's own CPU path on all cores, at the default dtype and in float64 (warm: the kernels are loaded by a
    # small call first)
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for dt in ("float32", "float64"):
        gpuc.tl.consensus_nmf(sub, 7, n_runs=3, device="cpu", dtype=dt, **kw)
        t0 = time.perf_counter()
        cpu_out = gpuc.tl.consensus_nmf(ad, 7, n_runs=20, device="cpu", dtype=dt, **kw)
        tc = time.perf_counter() - t0
        RESULT["k7x20_cpu" + ("_float64" if dt == "float64" else "")] = {
            "seconds": tc,
            "threads": threads,
            "dtype": dt,
            "stability": cpu_out.uns["nmf"]["stability"],
            "rel_error": cpu_out.uns["nmf"]["rel_error"],
        }
        log(f"k=7 x 20 + consensus, CPU {dt} ({threads} cores): {tc:.2f} s")
        save()

    # rank 200 (bixverse.gpu refuses k > 128)
    t0 = time.perf_counter()
    big = gpuc.tl.consensus_nmf(ad, 200, n_runs=3, max_iter=50, device=DEV, **kw)
    gpu.synchronize()
    RESULT["rank200"] = {
        "seconds": time.perf_counter() - t0,
        "rel_error": big.uns["nmf"]["rel_error"],
        "usages_shape": list(big.obsm["X_nmf"].shape),
        "finite": bool(np.isfinite(big.obsm["X_nmf"]).all()),
    }
    log(f"rank 200 x 3 runs (50 iterations): {RESULT['rank200']}")
    save()


def markdown() -> str:
    r = RESULT
    lines = ["# gpuc consensus NMF on GPU", ""]
    if "parity" in r:
        p = r["parity"]
        lines += [
            f"Parity (cNMF 700 x 500, k=7 x 20): pass={p['pass']}; float64 max |d rel_error| {p['float64']['max_abs_rel_error_diff']:.2e} "
            f"({p['float64']['same_n_iter_runs']}/20 runs same iterations); float32 {p['float32']['max_abs_rel_error_diff']:.2e}; "
            f"tl cosine {p['tl_consensus']['min_best_cosine']:.5f}, rel_error CPU {p['tl_consensus']['cpu_rel_error']:.6f} GPU {p['tl_consensus']['gpu_rel_error']:.6f}",
            "",
        ]
    fmt = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    if "k7x20_gpu" in r or "k7x20_gpu_float64" in r:
        lines += [
            "| case (6,881 x 2,000, sparse) | GPU float64 (s) | GPU float32 (s) | CPU float64 (s) | CPU float32 (s) | bixverse.gpu M1 Max (s) |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        g = lambda key: r.get(key, {}).get("seconds")  # noqa: E731
        lines.append(
            f"| k=7 x 20 runs + consensus | {fmt(g('k7x20_gpu_float64'))} (fit {fmt(g('k7x20_gpu_fit_only_float64'))}) | "
            f"{fmt(g('k7x20_gpu'))} (fit {fmt(g('k7x20_gpu_fit_only'))}) | {fmt(g('k7x20_cpu_float64'), 2)} | "
            f"{fmt(g('k7x20_cpu'), 2)} | 6.15 (CPU 20.53) |"
        )
        lines.append(
            f"| k sweep 2..12 x 10 runs | {fmt(g('sweep_2_12x10_gpu_float64'))} | {fmt(g('sweep_2_12x10_gpu'))} | - | - | - |"
        )
        lines.append(
            f"| one HALS iteration, k=7 x 20 (ms) | {fmt((g('iteration_float64') or float('nan')) * 1e3)} | "
            f"{fmt((g('iteration') or float('nan')) * 1e3)} | - | - | - |"
        )
    if "rank200" in r:
        lines.append(
            f"| rank 200 x 3 runs, 50 iterations (float32) | - | {r['rank200']['seconds']:.2f} | - | - | refused (k > 128) |"
        )
    for key in ("iteration_float64", "iteration"):
        if key in r:
            it = r[key]
            lines += [
                "",
                f"One batched HALS iteration (k=7 x 20, {it.get('dtype', 'float32')}): {it['seconds'] * 1e3:.3f} ms on "
                f"{it['device']}, {it['flops'] / 1e6:.0f} MFLOP and {it['bytes'] / 1e6:.1f} MB -> {it['tflops']:.3f} "
                f"TFLOP/s, {it['tbytes_per_s'] * 1e3:.0f} GB/s.",
            ]
    if r["errors"]:
        lines += ["", "Errors:", *[f"- {e}" for e in r["errors"]]]
    return "\n".join(lines) + "\n"


def main() -> int:
    import gpuc
    from gpuc._backend import gpu_status

    gpuc.settings.progress = False

    ok, why = gpu_status()
    RESULT["gpu_status"] = why
    if DRY:
        log("dry run on the CPU (GPU_NMF_DRY=1)")
    elif not ok:
        log(f"no usable GPU: {why}")
        save()
        return 1
    for step in (parity, timings):
        try:
            step()
        except Exception as err:
            RESULT["errors"].append(f"{step.__name__}: {type(err).__name__}: {err}")
            traceback.print_exc()
        save()
    md = markdown()
    (OUT / "nmf_gpu.md").write_text(md)
    log(md)
    return 0 if not RESULT["errors"] and RESULT.get("parity", {}).get("pass") else 1


if __name__ == "__main__":
    sys.exit(main())
