"""GPU check for gpuc.tl.deseq (CuPy): CPU = GPU parity to 1e-6 and float64 timings (``_harness.gpu_main``).

    OUT=/some/dir python benchmarks/gpu_deseq.py [--quick] [--smoke]

1. Parity: pasilla (~type + condition, Wald + normal shrinkage, and an LRT), simulated 100 x 10k and a near-Poisson
   10 x 2000 set whose parametric trend fails (R's local fit takes over), CPU vs GPU; max relative difference of LFC,
   lfcSE, stat, p-value and of the dispersion stages must be < 1e-6 and the NaN patterns identical.
2. Timing (float64, GPU, median of 3 after a warm-up): simulated 100 x 10k and 500 x 30k, the engine
   (``run_deseq`` + ``results``) and the whole ``gpuc.tl.deseq`` call; the CPU time of the same call for scale.
3. Solver stages on 100 x 10k (GPU, median of 3 after a warm-up): the genewise dispersion fit and the GLM fit with
   the numba-cuda kernels (gpuc.deseq._kernels_gpu) and with the batched CuPy path they replace.

Cold-run mode (``python benchmarks/_harness.py cold``): ``fill`` makes every call of this stage and of gpu_rsc.py on
tiny data; ``cold`` times a fresh process's first ``tl.deseq`` / ``tl.vst`` on 100 x 10,000.
Writes $OUT/deseq_gpu.json and $OUT/deseq_gpu.md; exit status 1 when a parity check fails. ``--smoke``: tiny data on
the stand-in GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # first: smoke mode must switch numba's CUDA simulator on before numba is imported
import numpy as np
from _harness import SMOKE, log, rel_diff, timed

GENES = 200 if SMOKE else None  # smoke: pasilla's first 200 genes, simulated sets of 200 genes


def sim(n: int, g: int):
    """Simulated negative-binomial counts (``_deseq_sim.simulate``), ``~condition`` B vs A."""
    import anndata as ad
    from _deseq_sim import simulate

    counts, meta, _ = simulate(n, g, seed=0)
    a = ad.AnnData(X=counts, obs=meta)
    a.var_names = [f"g{j}" for j in range(g)]
    return a


def pasilla():
    import gpuc

    a = gpuc.datasets.pasilla()
    return a[:, :GENES].copy() if GENES else a


def near_poisson(g: int = 2000, seed: int = 1, n: int = 10):
    """Poisson counts (no overdispersion: the parametric trend fails), two groups, 10% of genes changed."""
    from gpuc._testing.simulated import near_poisson_adata

    return near_poisson_adata(g, seed, n)


def parity(report: dict, args) -> None:
    import gpuc

    wald = {"contrast": ["condition", "treated", "untreated"], "lfc_shrink": "normal"}
    ab = {"contrast": ["condition", "B", "A"]}
    cases = [
        ("pasilla ~type+condition wald+normal", pasilla, "~type + condition", wald),
        ("pasilla LRT ~type", pasilla, "~type + condition", {"test": "lrt", "reduced": "~type"}),
        ("pasilla apeglm", pasilla, "~condition", {"lfc_shrink": "apeglm"}),
        ("sim 100x10k", lambda: sim(12, GENES) if SMOKE else sim(100, 10_000), "~condition", ab),
        ("near-Poisson 10x2000 (local trend)", lambda: near_poisson(GENES or 2000), "~condition", ab),
    ]
    report["parity"] = out = []
    for name, make, design, kw in cases:
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
        errs = {c: rel_diff(rg[c], rc[c]) for c in rc.columns if c != "padj"}
        close = {c: bool(np.allclose(rg[c], rc[c], rtol=1e-6, atol=1e-6, equal_nan=True)) for c in rc.columns}
        errs["padj_nan_pattern_equal"] = bool(np.array_equal(rc["padj"].isna(), rg["padj"].isna()))
        for f in ("dispFit", "dispMAP", "dispersion"):
            errs[f] = rel_diff(fits["gpu"].var[f"deseq_{f}"], fits["cpu"].var[f"deseq_{f}"])
            close[f] = errs[f] < 1e-6
        ge_g = fits["gpu"].var["deseq_dispGeneEst"].to_numpy()
        ge_c = fits["cpu"].var["deseq_dispGeneEst"].to_numpy()
        flat = ge_c < 1e-4
        errs["dispGeneEst_not_flat"] = rel_diff(ge_g[~flat], ge_c[~flat])
        close["dispGeneEst"] = errs["dispGeneEst_not_flat"] < 1e-6 and bool((ge_g[flat] < 1e-4).all())
        worst = max(v for v in errs.values() if not isinstance(v, bool))
        ok = bool(all(close.values()) and errs["padj_nan_pattern_equal"])
        out.append({"case": name, "max_rel": worst, "ok": ok, "detail": errs, "allclose": close})
        log("parity", name, worst)
    a, b = pasilla(), pasilla()
    gpuc.tl.vst(a, device="cpu")
    gpuc.tl.vst(b, device="gpu")
    d = rel_diff(b.layers["vst"], a.layers["vst"])
    out.append({"case": "pasilla vst blind", "max_rel": d, "ok": d < 1e-6})


def timing(report: dict, args) -> None:
    import gpuc
    from gpuc._backend import get_backend
    from gpuc.deseq import build_design, contrast_vector, results, run_deseq

    bk = get_backend("gpu")
    sizes = [(12, GENES)] if SMOKE else [(100, 10_000)] if args.quick else [(100, 10_000), (500, 30_000)]
    report["timing"] = rows = []
    for n, g in sizes:
        a = sim(n, g)
        d = build_design(a.obs, "~condition")
        c = contrast_vector(d, ["condition", "B", "A"])[0]
        x_host = np.asarray(a.X)
        x_dev = bk.asarray(x_host)

        def engine(x, d=d, c=c) -> None:
            results(run_deseq(bk, x, d.matrix), c)

        def tool(b, dev: str = "gpu") -> None:
            gpuc.tl.deseq(b, "~condition", contrast=["condition", "B", "A"], device=dev)

        engine(x_dev)  # warm-up (kernels compiled or loaded from the caches)
        tool(a.copy())
        t_gpu = timed(tool, setup=a.copy)["s"]  # the copy of the input outside the clock
        t_cpu = timed(lambda b: tool(b, "cpu"), 1, dev="cpu", setup=a.copy)["s"]
        row = {
            "size": f"{n}x{g}",
            "engine_gpu_input_on_device_s": timed(lambda x=x_dev: engine(x))["s"],
            "engine_gpu_input_on_host_s": timed(lambda x=x_host: engine(x))["s"],
            "tl_deseq_gpu_s": t_gpu,
            "tl_deseq_cpu_s": t_cpu,
            "cpu_over_gpu": t_cpu / t_gpu,
        }
        rows.append(row)
        log("timing", row)


def stages(report: dict, args) -> None:
    from gpuc._backend import get_backend
    from gpuc.deseq import _kernels, build_design
    from gpuc.deseq._dispersion import dispersion_mu, fit_log_alpha, rough_moments_init
    from gpuc.deseq._glm import fit_nb_glm
    from gpuc.deseq._size_factors import size_factors_ratio

    bk = get_backend("gpu")
    a = sim(12, GENES) if SMOKE else sim(100, 10_000)
    d = build_design(a.obs, "~condition")
    y = bk.xp.ascontiguousarray(bk.xp.asarray(np.asarray(a.X, dtype=np.float64).T))
    y = y[(y > 0).any(axis=1)]
    x = bk.asarray(d.matrix)
    sf = size_factors_ratio(bk, y, None)
    n = x.shape[0]
    a0 = rough_moments_init(bk, y, sf, x, min_disp=1e-8, max_disp=max(10.0, n))
    mu = dispersion_mu(bk, y, sf, x, a0)
    real = _kernels.gpu_kernels
    calls = {
        "genewise_dispersion_s": lambda: fit_log_alpha(
            bk, y, mu, x, a0, min_disp=1e-8, max_disp=max(10.0, n), r_flat_start=True
        ),
        "glm_s": lambda: fit_nb_glm(bk, y, sf, x, a0),
    }
    report["stages_100x10k"] = rows = {}
    for label, loader in (("kernels", real), ("batched CuPy", lambda *args: None)):
        _kernels.gpu_kernels = loader
        try:
            rows[label] = {k: timed(fn, 4)["all"] for k, fn in calls.items()}  # the first call warms up
            rows[label] = {k: _harness.median(v[1:]) for k, v in rows[label].items()}
        finally:
            _kernels.gpu_kernels = real
        log("stages", label, rows[label])


def render(report: dict) -> str:
    f = _harness.fmt_s
    lines = [f"GPU: {report.get('device')}, CuPy {report.get('cupy')}, float64.", ""]
    if "parity" in report:
        rows = [[p["case"], f"{p['max_rel']:.2e}", p["ok"]] for p in report["parity"]]
        lines.append(_harness.md_table(["parity case", "max rel. diff CPU vs GPU", "ok (rtol 1e-6, atol 1e-6)"], rows))
    if report.get("timing"):
        head = ["data", "engine, counts on GPU (s)", "engine, counts on host (s)", "tl.deseq GPU (s)",
                "tl.deseq CPU (s)", "CPU/GPU"]  # fmt: skip
        rows = [[r["size"], f(r["engine_gpu_input_on_device_s"]), f(r["engine_gpu_input_on_host_s"]),
                 f(r["tl_deseq_gpu_s"]), f(r["tl_deseq_cpu_s"]), _harness.fmt_x(r["tl_deseq_cpu_s"], r["tl_deseq_gpu_s"])]
                for r in report["timing"]]  # fmt: skip
        lines.append(_harness.md_table(head, rows))
    st = report.get("stages_100x10k")
    if st:
        rows = [[k, f"{st['kernels'][k]:.4f}", f"{st['batched CuPy'][k]:.4f}"] for k in st["kernels"]]
        lines.append(_harness.md_table(["100x10k stage (GPU s)", "kernels", "batched CuPy"], rows))
    lines += [f"- {e}" for e in report.get("errors", [])]
    return "\n".join(lines) + "\n"


def fill(dev: str, call) -> None:
    """The calls of this stage and of gpu_rsc.py's DESeq2 part on tiny data (cold-run mode)."""
    import gpuc

    pas = lambda: gpuc.datasets.pasilla()[:, : 300 if SMOKE else 1500].copy()  # noqa: E731
    ab = ["condition", "B", "A"]
    call("deseq wald", lambda: gpuc.tl.deseq(sim(16, 400), "~condition", contrast=ab, device=dev))
    call("deseq wald+normal", lambda: gpuc.tl.deseq(pas(), "~type + condition", device=dev, lfc_shrink="normal",
                                                     contrast=["condition", "treated", "untreated"]))  # fmt: skip
    call("deseq lrt", lambda: gpuc.tl.deseq(pas(), "~type + condition", test="lrt", reduced="~type", device=dev))
    call("deseq apeglm", lambda: gpuc.tl.deseq(pas(), "~condition", lfc_shrink="apeglm", device=dev))
    call("vst", lambda: gpuc.tl.vst(pas(), device=dev))
    if dev == "gpu":
        from gpuc._backend import get_backend
        from gpuc.deseq import build_design, contrast_vector, results, run_deseq

        a = sim(16, 400)
        d = build_design(a.obs, "~condition")
        c = contrast_vector(d, ab)[0]
        bk = get_backend("gpu")
        for where, x in (("device", bk.asarray(np.asarray(a.X))), ("host", np.asarray(a.X))):
            call(f"engine, counts on {where}", lambda x=x: results(run_deseq(bk, x, d.matrix), c))
        to_gpu = lambda a: gpuc.get.to_gpu(a, convert_all=True, copy=True)  # noqa: E731
        call("vst, device AnnData", lambda: gpuc.tl.vst(to_gpu(sim(16, 400)), copy=True))


def cold() -> list:
    """A fresh process's first ``tl.deseq`` and ``tl.vst`` (cold-run mode)."""
    import gpuc

    n, g = (12, 300) if SMOKE else (100, 10_000)

    def deseq():
        a = sim(n, g)
        return lambda: gpuc.tl.deseq(a.copy(), "~condition", contrast=["condition", "B", "A"], device="gpu")

    def vst():
        a = sim(n, g)
        return lambda: gpuc.tl.vst(a, device="gpu", copy=True)

    return [("tl.deseq", f"{n} x {g:,}", deseq), ("tl.vst", f"{n} x {g:,}", vst)]


SCRIPT = _harness.GpuScript(
    name="deseq_gpu",
    steps=[parity, timing, stages],
    render=render,
    ok=lambda r: bool(r.get("parity")) and all(p["ok"] for p in r["parity"]),
    options=lambda ap: ap.add_argument("--quick", action="store_true", help="timing on 100 x 10,000 only"),
    fill=fill,
    cold=cold,
)

if __name__ == "__main__":
    sys.exit(_harness.gpu_main(SCRIPT, __file__))
