"""Prepared GPU check for gpuc.tl.deseq (CuPy): CPU = GPU parity to 1e-6 and float64 timings.

    OUT=/some/dir python benchmarks/gpu_deseq.py [--quick]

1. Parity: pasilla (~type + condition, Wald + normal shrinkage, and an LRT), simulated 100 x 10k and a near-Poisson
   10 x 2000 set whose parametric trend fails (R's local fit takes over), CPU vs GPU; max relative difference of LFC,
   lfcSE, stat, p-value and of the dispersion stages must be < 1e-6 and the NaN patterns identical.
2. Timing (float64, GPU, median of 3 after a warm-up): simulated 100 x 10k and 500 x 30k, the engine
   (``run_deseq`` + ``results``) and the whole ``gpuc.tl.deseq`` call; the CPU time of the same call for scale.
   Every run asserts the backend is the GPU one (there is no CPU fallback inside the engine).
3. Solver stages on 100 x 10k (GPU, median of 3 after a warm-up): the genewise dispersion fit and the GLM fit with
   the numba-cuda kernels (gpuc.deseq._kernels_gpu) and with the batched CuPy path they replace.
4. Cold start: the first gpuc.tl.deseq of a fresh process on a small set, with empty numba and CuPy kernel caches and
   again with the caches the first process filled.
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


def _near_poisson(g: int = 2000, seed: int = 1, n: int = 10):
    """Poisson counts (no overdispersion: the parametric trend fails), two groups, 10% of genes changed."""
    import anndata as ad
    import pandas as pd

    rng = np.random.default_rng(seed)
    mean = 2 ** rng.uniform(0, 10, g)
    sf = np.exp(rng.normal(0, 0.1, n))
    cond = np.repeat([0, 1], n // 2)
    lfc = np.where(rng.random(g) < 0.1, rng.normal(0, 1, g), 0.0)
    y = rng.poisson(sf[:, None] * mean[None, :] * 2 ** np.outer(cond, lfc))
    obs = pd.DataFrame({"condition": pd.Categorical(np.where(cond == 1, "B", "A"))}, index=[f"s{i}" for i in range(n)])
    a = ad.AnnData(X=y.astype(np.int64), obs=obs)
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
        (
            "near-Poisson 10x2000 (local trend)",
            lambda: _near_poisson(),
            dict(design="~condition", contrast=["condition", "B", "A"]),
        ),
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


def stages(report: dict) -> None:
    import cupy as cp

    from gpuc._backend import get_backend
    from gpuc.deseq import _kernels, build_design
    from gpuc.deseq._dispersion import dispersion_mu, fit_log_alpha, rough_moments_init
    from gpuc.deseq._glm import fit_nb_glm
    from gpuc.deseq._size_factors import size_factors_ratio

    bk = get_backend("gpu")
    a = _adata(100, 10_000)
    d = build_design(a.obs, "~condition")
    y = cp.ascontiguousarray(cp.asarray(np.asarray(a.X), dtype=cp.float64).T)
    y = y[(y > 0).any(axis=1)]
    x = cp.asarray(d.matrix)
    sf = size_factors_ratio(bk, y, None)
    n = x.shape[0]
    a0 = rough_moments_init(bk, y, sf, x, min_disp=1e-8, max_disp=max(10.0, n))
    mu = dispersion_mu(bk, y, sf, x, a0)
    real = _kernels.gpu_kernels

    def timed(fn) -> float:
        fn()  # warm-up (compilation)
        ts = []
        for _ in range(3):
            cp.cuda.get_current_stream().synchronize()
            t = time.perf_counter()
            fn()
            cp.cuda.get_current_stream().synchronize()
            ts.append(time.perf_counter() - t)
        return float(np.median(ts))

    rows = {}
    for label, loader in (("kernels", real), ("batched CuPy", lambda *args: None)):
        _kernels.gpu_kernels = loader
        try:
            rows[label] = {
                "genewise_dispersion_s": timed(
                    lambda: fit_log_alpha(bk, y, mu, x, a0, min_disp=1e-8, max_disp=max(10.0, n), r_flat_start=True)
                ),
                "glm_s": timed(lambda: fit_nb_glm(bk, y, sf, x, a0)),
            }
        finally:
            _kernels.gpu_kernels = real
        print("stages", label, rows[label], flush=True)
    report["stages_100x10k"] = rows


COLD = """
import time, warnings
warnings.simplefilter("ignore")
t0 = time.perf_counter()
import numpy as np, anndata as ad, pandas as pd, cupy as cp
import gpuc
rng = np.random.default_rng(0)
y = rng.negative_binomial(5, 0.1, size=(8, 500))
a = ad.AnnData(X=y, obs=pd.DataFrame({"condition": pd.Categorical(list("AAAABBBB"))}, index=[f"s{i}" for i in range(8)]))
a.var_names = [f"g{j}" for j in range(500)]
t1 = time.perf_counter()
gpuc.tl.deseq(a, "~condition", contrast=["condition", "B", "A"], device="gpu")
cp.cuda.get_current_stream().synchronize()
t2 = time.perf_counter()
gpuc.tl.deseq(a, "~condition", contrast=["condition", "B", "A"], device="gpu")
cp.cuda.get_current_stream().synchronize()
print(t1 - t0, t2 - t1, time.perf_counter() - t2)
"""


def cold_start(report: dict) -> None:
    import subprocess
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "NUMBA_CACHE_DIR": f"{tmp}/numba", "CUPY_CACHE_DIR": f"{tmp}/cupy"}
        for label in ("empty caches", "caches filled by the first process"):
            out = subprocess.run([sys.executable, "-c", COLD], env=env, capture_output=True, text=True, check=True)
            imp, first, second = (float(v) for v in out.stdout.strip().splitlines()[-1].split())
            rows.append({"caches": label, "import_s": imp, "first_tl_deseq_s": first, "second_tl_deseq_s": second})
            print("cold", rows[-1], flush=True)
    report["cold_start"] = rows


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
    stages(report)
    cold_start(report)
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
    lines += ["", "| 100x10k stage (GPU s) | kernels | batched CuPy |", "| --- | --- | --- |"]
    st = report["stages_100x10k"]
    lines += [
        f"| {k} | {st['kernels'][k]:.4f} | {st['batched CuPy'][k]:.4f} |" for k in ("genewise_dispersion_s", "glm_s")
    ]
    lines += [
        "",
        "| fresh process, 8x500 | import (s) | first tl.deseq (s) | second (s) |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['caches']} | {r['import_s']:.2f} | {r['first_tl_deseq_s']:.2f} | {r['second_tl_deseq_s']:.3f} |"
        for r in report["cold_start"]
    ]
    (out / "deseq_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not all(p["ok"] for p in report["parity"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
