"""GPU check for consensus NMF: GPU = CPU parity, then timings (CuPy only; ``_harness.gpu_main``).

1. Parity on cNMF's 700 x 500 pbmc68k matrix (tests/data/nmf): the same 20 seeded restarts at k=7 on CPU and GPU in
   float64 (same iterations, same losses) and float32; ``tl.consensus_nmf`` with cNMF's settings on both devices.
2. Timings on a 6,881 x 2,000 sparse matrix (the size of bixverse.gpu's CD34 example: pbmc3k cells resampled to
   6,881 with binomial thinning, log1p(CP10k) on the 2,000 most dispersed genes detected in >= 6% of cells, 10.6%
   non-zero; ``_nmf_data.cd34_sized``), warm, in float64 (the issue's H200 targets: one batched HALS iteration at
   k=7 x 20 <= 0.5 ms, k=7 x 20 runs + consensus <= 0.12 s, the k=2..12 x 10 sweep <= 1 s) and in float32 (the
   default): the time of one batched HALS iteration against the device's FLOP and byte limits, k=7 x 20 + consensus
   (bixverse.gpu 6.15 s on an M1 Max, CPU 20.53 s), the sweep; gpuc's CPU path on all cores (both dtypes); rank 200.

    OUT=/tmp/out python benchmarks/gpu_nmf.py [--smoke]   # writes $OUT/nmf_gpu.json and $OUT/nmf_gpu.md

Cold-run mode (``python benchmarks/_harness.py cold``): ``fill`` makes this stage's calls and gpu_rsc.py's NMF calls
on tiny data; ``cold`` times a fresh process's first ``tl.consensus_nmf`` and ``tl.nmf_k_sweep`` on 2,000 x 2,000.
Runs in about a minute on an H100/H200 once the cold-run stage has filled the kernel caches.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # first: smoke mode must be set up before numba is imported
import numpy as np
import scipy.sparse as sp
from _harness import SMOKE, log, timed

ITERS = 5 if SMOKE else 50  # iterations timed for the per-iteration figure
RUNS = 4 if SMOKE else 20  # restarts at k=7
SHAPE = (300, 200) if SMOKE else (6881, 2000)
KW = {"mask_var": None, "density_threshold": 2.0, "copy": True}
SWEEP_RUNS = 2 if SMOKE else 10  # restarts per k of the sweep
CAP = {"max_iter": 20} if SMOKE else {}  # smoke: the stand-in's array calls are slow; the restarts stop early


def fixture_counts():
    """cNMF's 700 x 500 pbmc68k counts (smoke: the first 200 cells) and the same matrix scaled as cNMF's ``sd``."""
    import pandas as pd
    from anndata import AnnData

    z = np.load(_harness.ROOT / "tests" / "data" / "nmf" / "pbmc68k_counts_700x500.npz", allow_pickle=False)
    x = sp.csr_matrix((z["data"].astype(np.float32), z["indices"], z["indptr"]), shape=tuple(z["shape"]))
    obs = z["obs"].astype(str)
    if SMOKE:  # the first 200 cells, the genes detected in them
        x, obs = x[:200], obs[:200]
        genes = np.flatnonzero(x.getnnz(axis=0) > 0)
        x, var = x[:, genes], z["var"].astype(str)[genes]
    else:
        var = z["var"].astype(str)
    ad = AnnData(x, obs=pd.DataFrame(index=obs), var=pd.DataFrame(index=var))
    ad.var["highly_variable"] = True
    d = x.toarray().astype(np.float64)
    return ad, d / np.maximum(d.std(axis=0, ddof=1), 1e-12)


def seeds(n: int = RUNS) -> list[int]:
    from gpuc._utils import derive_seed

    return [derive_seed(0, 7, r) for r in range(n)]


def parity(report: dict, args) -> None:
    import gpuc
    from gpuc._backend import get_backend
    from gpuc.nmf._hals import Operator, fit_hals

    cpu, gpu = get_backend("cpu"), get_backend("gpu")
    ad, v = fixture_counts()
    report["runs"] = RUNS
    report["parity"] = res = {}
    for dt in ("float64", "float32"):
        fc = fit_hals(cpu, Operator.build(cpu, sp.csr_matrix(v), dtype=dt), 7, seeds(), **CAP)
        fg = fit_hals(gpu, Operator.build(gpu, sp.csr_matrix(v), dtype=dt), 7, seeds(), **CAP)
        hs_c, hs_g = fc.spectra_t, gpu.to_host(fg.spectra_t)
        res[dt] = {
            "max_abs_rel_error_diff": float(np.max(np.abs(fc.rel_errors - gpu.to_host(fg.rel_errors)))),
            "same_n_iter_runs": int((fc.n_iter == gpu.to_host(fg.n_iter)).sum()),
            "max_rel_spectra_diff": float(np.max(np.abs(hs_c - hs_g)) / np.max(np.abs(hs_c))),
            "cpu_best_rel_error": float(fc.rel_errors.min()),
            "gpu_best_rel_error": float(gpu.to_host(fg.rel_errors).min()),
        }
        log(f"parity engine {dt}: {res[dt]}")
    kw = {"n_runs": RUNS, "preprocessing": "sd", "metric": "euclidean", "density_threshold": 0.5, **CAP}
    c = gpuc.tl.consensus_nmf(ad, 7, device="cpu", normalization="sum", copy=True, **kw)
    g = gpuc.tl.consensus_nmf(ad, 7, device="gpu", normalization="sum", copy=True, **kw)
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
    res["pass"] = bool(
        res["float64"]["max_abs_rel_error_diff"] < 1e-8
        and res["float32"]["max_abs_rel_error_diff"] < 1e-4
        and res["tl_consensus"]["min_best_cosine"] > 0.99
        # cNMF's loss on the whole fixture (smoke: a part of it, no reference)
        and (SMOKE or abs(res["tl_consensus"]["gpu_rel_error"] - 0.59046) < 2e-4)
    )


def iteration_cost(x, dtype: str) -> tuple[int, int]:
    """FLOPs and bytes of one batched HALS iteration (both halves) at k=7 x 20 runs on the sparse ``x``."""
    m, n = x.shape
    rk = RUNS * 7
    item = np.dtype(dtype).itemsize
    flops = 2 * 2 * x.nnz * rk + 2 * (m + n) * RUNS * 49 + 2 * (m + n) * RUNS * 7 * 10 + 3 * m * rk
    bytes_ = 2 * x.nnz * (item + 4) + 2 * (m + n) * rk * item * 3
    return flops, bytes_


@functools.cache
def data():
    """The timing matrix (and its AnnData) and a 500-cell part of it for warming up."""
    from _nmf_data import cd34_sized
    from anndata import AnnData

    x = cd34_sized(*SHAPE)
    sub = x[:500]
    return x, AnnData(x), AnnData(sub[:, np.flatnonzero(np.asarray(sub.sum(0)).ravel() > 0)])


def timing_gpu(report: dict, args) -> None:
    """The issue's cases in float64 (its targets: warm, float64), then float32 (the default). Keys of the float32
    results carry no suffix (as the first H200 run wrote them); the float64 ones end in ``_float64``."""
    import gpuc
    from gpuc._backend import get_backend
    from gpuc.nmf._hals import Operator, fit_hals

    gpu = get_backend("gpu")
    x, ad, sub = data()
    report["runs"] = RUNS
    log(f"matrix {x.shape}, nnz {x.nnz} ({x.nnz / np.prod(x.shape):.3f})")
    report["matrix"] = {"shape": list(x.shape), "nnz": int(x.nnz), "input_dtype": str(x.dtype)}
    for dt in ("float64", "float32"):  # warm-up: kernels compiled, or loaded from the caches the cold stage filled
        gpuc.tl.consensus_nmf(sub, 7, n_runs=3, device="gpu", dtype=dt, **KW, **CAP)
        gpuc.tl.nmf_k_sweep(sub, range(2, 5) if SMOKE else range(2, 13), n_runs=2, device="gpu", dtype=dt, **KW, **CAP)
    for dt in ("float64", "float32"):
        sfx = "_float64" if dt == "float64" else ""
        t = timed(lambda dt=dt: gpuc.tl.consensus_nmf(ad, 7, n_runs=RUNS, device="gpu", dtype=dt, **KW, **CAP))
        u = t["out"].uns["nmf"]
        report["k7x20_gpu" + sfx] = {"seconds": t["s"], "all": t["all"], "dtype": dt, "stability": u["stability"],
                                     "rel_error": u["rel_error"], "n_converged": u["n_converged"],
                                     "cluster_sizes": np.asarray(u["cluster_sizes"]).tolist()}  # fmt: skip
        log(f"k=7 x {RUNS} + consensus, GPU {dt}: {t['s']:.3f} s (stability {u['stability']:.4f})")
        op = Operator.build(gpu, x, dtype=dt)
        t = timed(lambda op=op: fit_hals(gpu, op, 7, seeds(), **CAP))
        n_iter = float(np.mean(gpu.to_host(t["out"].n_iter)))
        report["k7x20_gpu_fit_only" + sfx] = {"seconds": t["s"], "mean_iter": n_iter, "dtype": dt}
        # one batched iteration against the device limits: ITERS iterations with the stopping rule switched off
        per = timed(lambda op=op: fit_hals(gpu, op, 7, seeds(), max_iter=ITERS, tol=1e-300))["s"] / ITERS
        flops, bytes_ = iteration_cost(x, dt)
        report["iteration" + sfx] = {"seconds": per, "dtype": dt, "flops": flops, "bytes": bytes_,
                                     "tflops": flops / per / 1e12, "tbytes_per_s": bytes_ / per / 1e12,
                                     "device": report["device"]}  # fmt: skip
        log(f"iteration {dt}: {per * 1e3:.3f} ms, {flops / per / 1e12:.3f} TFLOP/s")
        ks = range(2, 5) if SMOKE else range(2, 13)
        t = timed(
            lambda dt=dt, ks=ks: gpuc.tl.nmf_k_sweep(ad, ks, n_runs=SWEEP_RUNS, device="gpu", dtype=dt, **KW, **CAP), 2
        )
        tab = t["out"].uns["nmf_k_sweep"]["table"]
        report["sweep_2_12x10_gpu" + sfx] = {"seconds": t["s"], "all": t["all"], "dtype": dt,
                                             "table": tab.to_dict(orient="list")}  # fmt: skip
        log(f"sweep, GPU {dt}: {t['s']:.3f} s")


def timing_cpu(report: dict, args) -> None:
    """gpuc's own CPU path on all cores, at the default dtype and in float64 (warm: a small call loads the kernels)."""
    import gpuc

    _, ad, sub = data()
    threads = _harness.cores()
    for dt in ("float32", "float64"):
        gpuc.tl.consensus_nmf(sub, 7, n_runs=3, device="cpu", dtype=dt, **KW, **CAP)
        call = lambda dt=dt: gpuc.tl.consensus_nmf(ad, 7, n_runs=RUNS, device="cpu", dtype=dt, **KW, **CAP)  # noqa: E731
        t = timed(call, 1, dev="cpu")
        u = t["out"].uns["nmf"]
        report["k7x20_cpu" + ("_float64" if dt == "float64" else "")] = {
            "seconds": t["s"], "threads": threads, "dtype": dt, "stability": u["stability"], "rel_error": u["rel_error"],
        }  # fmt: skip
        log(f"k=7 x {RUNS} + consensus, CPU {dt} ({threads} cores): {t['s']:.2f} s")


def rank200(report: dict, args) -> None:
    """Rank 200 (bixverse.gpu refuses k > 128); smoke: rank 30."""
    import gpuc

    ad = data()[1]
    k = 30 if SMOKE else 200
    t = timed(lambda: gpuc.tl.consensus_nmf(ad, k, n_runs=3, max_iter=5 if SMOKE else 50, device="gpu", **KW), 1)
    big = t["out"]
    report["rank200"] = {"k": k, "seconds": t["s"], "rel_error": big.uns["nmf"]["rel_error"],
                         "usages_shape": list(big.obsm["X_nmf"].shape),
                         "finite": bool(np.isfinite(big.obsm["X_nmf"]).all())}  # fmt: skip
    log(f"rank {k} x 3 runs: {report['rank200']}")


def render(r: dict) -> str:
    runs = r.get("runs", 20)  # restarts at k=7 (smoke: 4)
    lines = [
        f"gpuc consensus NMF, GPU: {r.get('device') or r.get('iteration', {}).get('device', '?')}.",
        "",
    ]
    p = r.get("parity")
    if p and "tl_consensus" in p:
        lines += [
            f"Parity (cNMF 700 x 500, k=7 x {runs}): pass={p.get('pass')}; float64 max |d rel_error| "
            f"{p['float64']['max_abs_rel_error_diff']:.2e} ({p['float64']['same_n_iter_runs']}/{runs} runs same "
            f"iterations); float32 {p['float32']['max_abs_rel_error_diff']:.2e}; tl cosine "
            f"{p['tl_consensus']['min_best_cosine']:.5f}, rel_error CPU {p['tl_consensus']['cpu_rel_error']:.6f} GPU "
            f"{p['tl_consensus']['gpu_rel_error']:.6f}",
            "",
        ]
    g = lambda key: r.get(key, {}).get("seconds")  # noqa: E731
    f = _harness.fmt_s
    ms = lambda v: f(None if v is None else v * 1e3)  # noqa: E731
    shape = r.get("matrix", {}).get("shape", [6881, 2000])
    if "k7x20_gpu" in r or "k7x20_gpu_float64" in r:
        head = [f"case ({shape[0]:,} x {shape[1]:,}, sparse)", "GPU float64 (s)", "GPU float32 (s)", "CPU float64 (s)",
                "CPU float32 (s)", "bixverse.gpu M1 Max (s)"]  # fmt: skip
        rows = [
            [f"k=7 x {runs} runs + consensus", f"{f(g('k7x20_gpu_float64'))} (fit {f(g('k7x20_gpu_fit_only_float64'))})",
             f"{f(g('k7x20_gpu'))} (fit {f(g('k7x20_gpu_fit_only'))})", f(g("k7x20_cpu_float64")), f(g("k7x20_cpu")),
             "6.15 (CPU 20.53)"],
            ["k sweep 2..12 x 10 runs", f(g("sweep_2_12x10_gpu_float64")), f(g("sweep_2_12x10_gpu")), "-", "-", "-"],
            [f"one HALS iteration, k=7 x {runs} (ms)", ms(g("iteration_float64")), ms(g("iteration")), "-", "-", "-"],
        ]  # fmt: skip
        if "rank200" in r:
            rows.append([f"rank {r['rank200'].get('k', 200)} x 3 runs (float32)", "-", f(g("rank200")), "-", "-",
                         "refused (k > 128)"])  # fmt: skip
        lines.append(_harness.md_table(head, rows))
    for key in ("iteration_float64", "iteration"):
        if key in r:
            it = r[key]
            lines.append(
                f"One batched HALS iteration (k=7 x {runs}, {it.get('dtype', 'float32')}): {it['seconds'] * 1e3:.3f} ms "
                f"on {it['device']}, {it['flops'] / 1e6:.0f} MFLOP and {it['bytes'] / 1e6:.1f} MB -> "
                f"{it['tflops']:.3f} TFLOP/s, {it['tbytes_per_s'] * 1e3:.0f} GB/s.\n"
            )
    if r.get("errors"):
        lines += ["Errors:", *[f"- {e}" for e in r["errors"]]]
    return "\n".join(lines) + "\n"


def cells(n: int = 400, g: int = 300):
    """A tiny cells x genes AnnData: float32 CSR counts (also in layers['counts']), X_pca, sample / condition /
    cell_type columns (the cold-run fills of this script and of gpu_metacells.py)."""
    import anndata as ad
    import pandas as pd
    from _metacells_data import jittered_pcs

    rng = np.random.default_rng(0)
    x = sp.random(n, g, density=0.2, format="csr", random_state=1, dtype=np.float64)
    x.data = np.ceil(x.data * 20)
    x = x.astype(np.float32)
    a = ad.AnnData(x)
    a.layers["counts"] = x.copy()
    a.obsm["X_pca"] = jittered_pcs(n)[:, :30].astype(np.float32)
    a.obs["sample"] = pd.Categorical(np.asarray([f"s{i}" for i in range(4)])[np.arange(n) % 4])
    a.obs["condition"] = pd.Categorical(np.where(np.isin(a.obs["sample"], ["s0", "s1"]), "a", "b"))
    a.obs["cell_type"] = pd.Categorical(rng.choice(["T", "B"], n))
    return a


def fill(dev: str, call) -> None:
    """This stage's calls and gpu_rsc.py's NMF calls on tiny data (cold-run mode)."""
    from _nmf_data import cd34_sized
    from anndata import AnnData

    import gpuc
    from gpuc._backend import get_backend
    from gpuc.nmf._hals import Operator, fit_hals

    ad = AnnData(cd34_sized(400, 300))
    kw = {**KW, "device": dev}
    bk = get_backend(dev)
    for dt in ("float32", "float64"):
        call(f"consensus_nmf {dt}", lambda dt=dt: gpuc.tl.consensus_nmf(ad, 7, n_runs=4, dtype=dt, **kw))
        call(f"nmf_k_sweep {dt}", lambda dt=dt: gpuc.tl.nmf_k_sweep(ad, range(2, 5), n_runs=3, dtype=dt, **kw))
        op = Operator.build(bk, sp.csr_matrix(ad.X, dtype=np.float64), dtype=dt)
        call(f"fit_hals {dt}", lambda op=op: fit_hals(bk, op, 7, seeds(4), max_iter=20, tol=1e-300))
        dense = Operator.build(bk, np.asarray(ad.X.toarray(), dtype=np.float64), dtype=dt)
        call(f"fit_hals dense {dt}", lambda op=dense: fit_hals(bk, op, 7, seeds(2), max_iter=10))
    if dev == "gpu":  # a rank above 128 (the rank-200 case runs on the GPU only)
        call("consensus_nmf k=150", lambda: gpuc.tl.consensus_nmf(ad, 150, n_runs=2, max_iter=3, **kw))
    # cNMF's settings on a counts layer, as the parity and the rapids-singlecell stages call them; on the GPU the
    # device-resident data select the device, as in the rapids-singlecell stage
    src = gpuc.get.to_gpu(cells(), convert_all=True, copy=True) if dev == "gpu" else cells()
    cnmf = {"layer": "counts", "preprocessing": "sd", "metric": "euclidean", "density_threshold": 0.5,
            "normalization": "sum", "mask_var": None, "n_runs": 4, "copy": True}  # fmt: skip
    cnmf.update({"device": "cpu"} if dev == "cpu" else {})
    call("consensus_nmf cNMF settings", lambda: gpuc.tl.consensus_nmf(src, 5, **cnmf))


def cold() -> list:
    """A fresh process's first ``tl.consensus_nmf`` (k=7 x 20) and ``tl.nmf_k_sweep`` (k=2..7 x 5)."""
    from _nmf_data import cd34_sized
    from anndata import AnnData

    import gpuc

    shape = (300, 200) if SMOKE else (2000, 2000)
    kw = {**KW, "device": "gpu"}

    def consensus():
        ad = AnnData(cd34_sized(*shape))
        return lambda: gpuc.tl.consensus_nmf(ad, 7, n_runs=RUNS, **kw)

    def sweep():
        ad = AnnData(cd34_sized(*shape))
        return lambda: gpuc.tl.nmf_k_sweep(ad, range(2, 8), n_runs=5, **kw)

    size = f"{shape[0]:,} x {shape[1]:,}"
    return [
        ("tl.consensus_nmf", f"k=7 x {RUNS} on {size}", consensus),
        ("tl.nmf_k_sweep", f"k=2..7 x 5 on {size}", sweep),
    ]


SCRIPT = _harness.GpuScript(
    name="nmf_gpu",
    steps=[parity, timing_gpu, timing_cpu, rank200],
    render=render,
    ok=lambda r: bool(r.get("parity", {}).get("pass")),
    fill=fill,
    cold=cold,
)

if __name__ == "__main__":
    os.environ.setdefault("MPLBACKEND", "Agg")
    sys.exit(_harness.gpu_main(SCRIPT, __file__))
