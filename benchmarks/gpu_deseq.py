"""Prepared GPU check for gpuc.tl.deseq (CuPy): CPU = GPU parity to 1e-6 and float64 timings.

    OUT=/some/dir python benchmarks/gpu_deseq.py [--quick]

1. Parity: pasilla (~type + condition, Wald + normal shrinkage, and an LRT) and simulated 100 x 10k, CPU vs GPU;
   max relative difference of LFC, lfcSE, stat, p-value and of the dispersion stages must be < 1e-6 and the NaN
   patterns identical.
2. Timing (float64, GPU, median of 3 after a warm-up): simulated 100 x 10k and 500 x 30k, the engine
   (``run_deseq`` + ``results``) and the whole ``gpuc.tl.deseq`` call; the CPU time of the same call for scale.
   Every run asserts the backend is the GPU one (there is no CPU fallback inside the engine).
Writes $OUT/deseq_gpu.json and $OUT/deseq_gpu.md (also prints them). Runs in a few minutes on one GPU.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if not np.array_equal(np.isnan(a), np.isnan(b)):
        return float("inf")
    ok = np.isfinite(b) & (np.abs(b) > 1e-300)
    return float(np.max(np.abs(a[ok] - b[ok]) / np.abs(b[ok]))) if ok.any() else 0.0


def _adata(n: int, g: int):
    import anndata as ad
    from _deseq_sim import simulate

    counts, meta, _ = simulate(n, g, seed=0)
    a = ad.AnnData(X=counts, obs=meta)
    a.var_names = [f"g{j}" for j in range(g)]
    return a


def parity(report: dict) -> None:
    import gpuc

    cases = [
        (
            "pasilla ~type+condition wald+normal",
            lambda: gpuc.datasets.pasilla(),
            dict(design="~type + condition", contrast=["condition", "treated", "untreated"], lfc_shrink="normal"),
        ),
        (
            "pasilla LRT ~type",
            lambda: gpuc.datasets.pasilla(),
            dict(design="~type + condition", test="lrt", reduced="~type"),
        ),
        ("pasilla apeglm", lambda: gpuc.datasets.pasilla(), dict(design="~condition", lfc_shrink="apeglm")),
        ("sim 100x10k", lambda: _adata(100, 10_000), dict(design="~condition", contrast=["condition", "B", "A"])),
    ]
    out = []
    for name, make, kw in cases:
        kw = dict(kw)
        design = kw.pop("design")
        fits = {}
        for dev in ("cpu", "gpu"):
            a = make()
            gpuc.tl.deseq(a, design, device=dev, **kw)
            assert a.uns["deseq"]["params"]["device"] == dev
            fits[dev] = a
        rc, rg = gpuc.get.deseq_results(fits["cpu"]), gpuc.get.deseq_results(fits["gpu"])
        # tolerances as tests/deseq/test_deseq_device.py: results within rtol 1e-6 / atol 1e-6 (apeglm and the LRT
        # statistic stop at the optimisers' tolerances); gene-wise dispersions compared where the likelihood is
        # not flat near zero (below 1e-4 both paths stop at the optimiser's tolerance, at different points)
        errs = {c: _rel(rg[c], rc[c]) for c in rc.columns if c != "padj"}
        close = {c: bool(np.allclose(rg[c], rc[c], rtol=1e-6, atol=1e-6, equal_nan=True)) for c in rc.columns}
        errs["padj_nan_pattern_equal"] = bool(np.array_equal(rc["padj"].isna(), rg["padj"].isna()))
        for f in ("dispFit", "dispMAP", "dispersion"):
            errs[f] = _rel(fits["gpu"].var[f"deseq_{f}"], fits["cpu"].var[f"deseq_{f}"])
            close[f] = errs[f] < 1e-6
        ge_g = fits["gpu"].var["deseq_dispGeneEst"].to_numpy()
        ge_c = fits["cpu"].var["deseq_dispGeneEst"].to_numpy()
        flat = ge_c < 1e-4
        errs["dispGeneEst_not_flat"] = _rel(ge_g[~flat], ge_c[~flat])
        close["dispGeneEst"] = errs["dispGeneEst_not_flat"] < 1e-6 and bool((ge_g[flat] < 1e-4).all())
        worst = max(v for v in errs.values() if not isinstance(v, bool))
        out.append(
            {
                "case": name,
                "max_rel": worst,
                "ok": bool(all(close.values()) and errs["padj_nan_pattern_equal"]),
                "detail": errs,
                "allclose": close,
            }
        )
        print("parity", name, worst, flush=True)
    # VST
    a, b = gpuc.datasets.pasilla(), gpuc.datasets.pasilla()
    gpuc.tl.vst(a, device="cpu")
    gpuc.tl.vst(b, device="gpu")
    out.append(
        {
            "case": "pasilla vst blind",
            "max_rel": _rel(b.layers["vst"], a.layers["vst"]),
            "ok": _rel(b.layers["vst"], a.layers["vst"]) < 1e-6,
        }
    )
    report["parity"] = out


def timing(report: dict, sizes: list[tuple[int, int]]) -> None:
    import cupy as cp

    import gpuc
    from gpuc._backend import get_backend
    from gpuc.deseq import build_design, contrast_vector, results, run_deseq

    bk = get_backend("gpu")
    rows = []
    for n, g in sizes:
        a = _adata(n, g)
        d = build_design(a.obs, "~condition")
        c = contrast_vector(d, ["condition", "B", "A"])[0]
        x_host = np.asarray(a.X)
        x_dev = cp.asarray(x_host)

        def engine(x, d=d, c=c) -> float:
            cp.cuda.get_current_stream().synchronize()
            t = time.perf_counter()
            fit = run_deseq(bk, x, d.matrix)
            results(fit, c)
            cp.cuda.get_current_stream().synchronize()
            return time.perf_counter() - t

        def tool(dev: str, a=a) -> float:
            b = a.copy()
            t = time.perf_counter()
            gpuc.tl.deseq(b, "~condition", contrast=["condition", "B", "A"], device=dev)
            if dev == "gpu":
                cp.cuda.get_current_stream().synchronize()
            return time.perf_counter() - t

        engine(x_dev)  # warm-up (kernel compilation)
        eng_dev = float(np.median([engine(x_dev) for _ in range(3)]))
        eng_host = float(np.median([engine(x_host) for _ in range(3)]))
        tool(dev="gpu")
        t_gpu = float(np.median([tool("gpu") for _ in range(3)]))
        t_cpu = tool("cpu")
        row = {
            "size": f"{n}x{g}",
            "engine_gpu_input_on_device_s": eng_dev,
            "engine_gpu_input_on_host_s": eng_host,
            "tl_deseq_gpu_s": t_gpu,
            "tl_deseq_cpu_s": t_cpu,
            "cpu_over_gpu": t_cpu / t_gpu,
        }
        rows.append(row)
        print("timing", row, flush=True)
    report["timing"] = rows


def main() -> None:
    import cupy as cp

    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    quick = "--quick" in sys.argv
    props = cp.cuda.runtime.getDeviceProperties(0)
    report: dict = {
        "device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "cupy": cp.__version__,
    }
    t0 = time.perf_counter()
    parity(report)
    timing(report, [(100, 10_000)] if quick else [(100, 10_000), (500, 30_000)])
    report["total_seconds"] = time.perf_counter() - t0
    (out / "deseq_gpu.json").write_text(json.dumps(report, indent=2, default=str))
    lines = [
        f"GPU: {report['device']}, CuPy {report['cupy']}, float64.",
        "",
        "| parity case | max rel. diff CPU vs GPU | ok (rtol 1e-6, atol 1e-6) |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {p['case']} | {p['max_rel']:.2e} | {p['ok']} |" for p in report["parity"]]
    lines += [
        "",
        "| data | engine, counts on GPU (s) | engine, counts on host (s) | tl.deseq GPU (s) | tl.deseq CPU (s) | CPU/GPU |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['size']} | {r['engine_gpu_input_on_device_s']:.3f} | {r['engine_gpu_input_on_host_s']:.3f} | {r['tl_deseq_gpu_s']:.3f} | {r['tl_deseq_cpu_s']:.2f} | {r['cpu_over_gpu']:.0f}x |"
        for r in report["timing"]
    ]
    (out / "deseq_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not all(p["ok"] for p in report["parity"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
