"""GPU check for gpuc.tl.metacells: GPU = CPU parity on the same kernel, then timings at 7k / 50k / 200k
(``_harness.gpu_main``).

Parity (exit status 1 when one fails): the SEACells reference trajectory on pbmc68k (RSS to 1e-10, labels equal);
the 6,881-cell, k = 92 fit from a random A0 on both devices (RSS trajectory to 1e-8, labels agreeing for 99.9% of
the cells); and every A- and B-update of that CPU fit rerun on the GPU from identical inputs (the CPU's A, B and K),
whose picks must all be equal. Beside them it reports where the devices part if they do: K = M M^T on each device
(pattern, largest difference, exact symmetry), the GPU fit from the CPU's K, and, for the updates that pick
differently, the smallest gap between the two lowest gradient entries those picks met on the CPU (near 1e-16:
floating-point tie-breaking; larger: the GPU computes something else).

Needs only CuPy (no FAISS-GPU, no cuML): kNN falls back to exact blocked products in cupy. Writes
``$OUT/metacells_gpu.json`` and ``$OUT/metacells_gpu.md``. Runs in a few minutes on one H100/H200-class GPU.
Cold-run mode (``python benchmarks/_harness.py cold``): ``fill`` makes this stage's and gpu_rsc.py's metacell calls
on tiny data; ``cold`` times a fresh process's first ``tl.metacells`` on 2,000 cells. ``--smoke``: tiny data (the
reference trajectory's first 3 iterations, 300 cells) on the stand-in GPU.

    python benchmarks/gpu_metacells.py                  # parity + 7k, 50k, 200k
    python benchmarks/gpu_metacells.py --sizes 6881     # parity + one size
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # first: smoke mode must be set up before numba is imported
import numpy as np
import scipy.sparse as sp
from _harness import SMOKE, log, timed

REF = _harness.ROOT / "tests" / "data" / "metacells" / "pbmc68k_reduced_seacells033_seed0.npz"
N, K, ITERS = (300, 8, 2) if SMOKE else (6881, 92, 8)  # the CPU = GPU fit: cells, metacells, iterations


def _a_gaps(kmat: sp.csr_matrix, b: sp.spmatrix, a_prev, n_steps: int) -> np.ndarray:
    """Per cell, the smallest non-zero gap between the two lowest gradient entries over the A-update's steps, relative
    to the gradient's largest magnitude (the array code of the A-update replayed with numpy)."""
    kb = (kmat @ b).toarray()
    q = b.T @ kb
    qa = (q @ (a_prev.toarray() if sp.issparse(a_prev) else a_prev)).T
    gap = np.full(kb.shape[0], np.inf)
    for t in range(n_steps):
        g = qa - kb
        two = np.partition(g, 1, axis=1)[:, :2]
        d = two[:, 1] - two[:, 0]  # exact ties (0) go to the lowest index on both devices
        gap = np.where(d > 0, np.minimum(gap, d / np.maximum(np.abs(g).max(axis=1), 1e-300)), gap)
        amin = g.argmin(axis=1)
        qa = q[amin] if t == 0 else qa + (q[amin] - qa) * (2.0 / (t + 2.0))
    return gap


def _b_gaps(kmat: sp.csr_matrix, a: sp.spmatrix, b_prev: sp.spmatrix, n_steps: int) -> np.ndarray:
    """Per archetype column, the smallest non-zero relative gap between the two lowest gradient entries over the
    B-update's steps (numpy replay)."""
    at = a.T.toarray()
    r, s = at.T @ at, kmat @ at
    y = (kmat @ b_prev) @ r
    gap = np.full(at.shape[1], np.inf)
    for t in range(n_steps):
        g = y - s
        two = np.partition(g, 1, axis=0)[:2]
        d = two[1] - two[0]
        gap = np.where(d > 0, np.minimum(gap, d / np.maximum(np.abs(g).max(axis=0), 1e-300)), gap)
        z = kmat[g.argmin(axis=0)].T @ r
        y = z if t == 0 else y + (z - y) * (2.0 / (t + 2.0))
    return gap


def identical_inputs(cpu, gpu, kh: sp.csr_matrix, arche: np.ndarray, a0, iters: int, fw_iters: int = 50) -> dict:
    """The CPU fit's sequence of updates, each also run on the GPU from the same inputs (the CPU's A, B and K): how
    many cells (A) and archetypes (B) pick differently, and, where some do, the smallest relative gap between the two
    lowest gradient entries those cells / columns met on the CPU (near 1e-16: floating-point tie-breaking; larger:
    the GPU computes something else), beside the median over all of them, for the first update that differs."""
    from gpuc.metacells import update_a, update_b
    from gpuc.metacells._solver import one_hot_b

    n, k = kh.shape[0], len(arche)
    kg = gpu.asarray(kh)
    b = one_hot_b(cpu, arche, n, k)
    a = update_a(cpu, kh, b, a0, fw_iters)
    steps = []
    for it in range(1, iters + 1):
        a_new = update_a(cpu, kh, b, a, fw_iters)
        a_gpu = gpu.to_host(update_a(gpu, kg, gpu.asarray(b), gpu.asarray(a), fw_iters)).toarray()
        cells = np.flatnonzero((a_gpu != a_new.toarray()).any(axis=0))
        b_new = update_b(cpu, kh, a_new, b, fw_iters, gradient="dense")
        b_gpu = gpu.to_host(update_b(gpu, kg, gpu.asarray(a_new), gpu.asarray(b), fw_iters)).toarray()
        cols = np.flatnonzero((b_gpu != b_new.toarray()).any(axis=0))
        row = {"iteration": it, "A_cells_differing": int(cells.size), "B_columns_differing": int(cols.size)}
        first = not any(r["A_cells_differing"] or r["B_columns_differing"] for r in steps)  # gaps: first only
        if cells.size and first:
            gap = _a_gaps(kh, b, a, fw_iters)
            row |= {"A_min_gap_differing": float(gap[cells].min()), "A_median_gap": float(np.median(gap))}
        if cols.size and first:
            gap = _b_gaps(kh, a_new, b, fw_iters)
            row |= {"B_min_gap_differing": float(gap[cols].min()), "B_median_gap": float(np.median(gap))}
        steps.append(row)
        a, b = a_new, b_new
    return {
        "updates": steps,
        "all_picks_equal": all(not (r["A_cells_differing"] or r["B_columns_differing"]) for r in steps),
    }


def warm_up(report: dict, args) -> None:
    """The kernels compiled (or loaded from the caches the cold-run stage filled) on a tiny problem, so that the
    parity fit's and the timings' seconds are steady-state."""
    from _metacells_data import jittered_pcs

    from gpuc._backend import get_backend
    from gpuc.metacells import run_metacells

    gpu = get_backend("gpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_metacells(gpu, gpu.asarray(jittered_pcs(600)), 8, max_iter=2, min_iter=2)


def parity(report: dict, args) -> None:
    """Reference trajectory on the GPU, and GPU = CPU on the same kernel and archetypes."""
    if args.skip_parity:
        return
    from _metacells_data import jittered_pcs

    from gpuc._backend import get_backend
    from gpuc.metacells import build_kernel, compute_knn, fit, initial_archetypes
    from gpuc.metacells._solver import kernel_times

    cpu, gpu = get_backend("cpu"), get_backend("gpu")
    z = np.load(REF)
    m = sp.csr_matrix((z["kernel_data"], z["kernel_indices"], z["kernel_indptr"]), shape=(700, 700))
    it = {"max_iter": 3, "min_iter": 3} if SMOKE else {"max_iter": 50, "min_iter": 10}
    res = fit(gpu, gpu.asarray(m), z["archetypes"], a0=gpu.asarray(z["A0"]), convergence_epsilon=1e-5, **it)
    a = gpu.to_host(res.A).toarray()
    ref_rss = z["rss"][: len(res.rss)] if SMOKE else z["rss"]  # smoke: the trajectory's first iterations
    same_len = len(res.rss) == len(ref_rss)
    rss_rel = float(np.max(np.abs(np.asarray(res.rss) - ref_rss) / ref_rss)) if same_len else float("inf")
    labels_ok = bool(np.array_equal(np.array([f"SEACell-{j}" for j in a.argmax(0)]), z["labels"]))
    report["parity_reference_pbmc68k"] = r = {"n_iter": res.n_iter, "rss_max_rel_diff": rss_rel,
                                              "A_max_abs_diff": float(np.abs(a - z["A"]).max()),
                                              "labels_equal": labels_ok}  # fmt: skip
    r["ok"] = bool(rss_rel <= 1e-10 and (labels_ok or SMOKE))  # smoke: 3 iterations do not reach its labels
    log("reference parity (GPU vs SEACells 0.3.3 trajectory):", r)

    x = jittered_pcs(N)
    knn = compute_knn(cpu, x, 30)
    mh, _ = build_kernel(cpu, x, knn=knn)
    kh = sp.csr_matrix(mh @ mh.T)
    arche = initial_archetypes(cpu, kh, knn, K, np.random.RandomState(0))
    a0 = np.random.RandomState(1).random((K, N))
    a0 /= a0.sum(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = fit(cpu, mh, arche, a0=a0.copy(), kmat=kh, max_iter=ITERS, min_iter=ITERS)
        t = timed(lambda: fit(gpu, gpu.asarray(mh), arche, a0=gpu.asarray(a0), max_iter=ITERS, min_iter=ITERS), 1)
    rg = t["out"]
    diff = float(np.max(np.abs(np.asarray(rc.rss) - np.asarray(rg.rss)) / np.asarray(rc.rss)))
    a_c, a_g = cpu.to_host(rc.A).toarray(), gpu.to_host(rg.A).toarray()
    b_c, b_g = cpu.to_host(rc.B).toarray(), gpu.to_host(rg.B).toarray()
    same_labels = float(np.mean(a_c.argmax(0) == a_g.argmax(0)))
    report["parity_cpu_gpu_cd34like"] = r = {
        "n": N, "k": K, "iters": ITERS, "rss_max_rel_diff": diff, "A_max_abs_diff": float(np.abs(a_c - a_g).max()),
        "B_max_abs_diff": float(np.abs(b_c - b_g).max()), "label_agreement": same_labels, "gpu_fit_s": t["s"],
        "ok": bool(diff <= 1e-8 and same_labels >= 0.999),
    }  # fmt: skip
    log("CPU vs GPU on the same kernel:", r)
    # where the trajectories part: the kernel K = M M^T on each device, the GPU fit from the CPU's K, and every
    # update of the CPU fit run on both devices from identical inputs
    kg = gpu.to_host(kernel_times(gpu, gpu.asarray(mh), gpu.asarray(mh).T)).tocsr()
    kg.sort_indices()
    ks = kh.copy()
    ks.sort_indices()
    same_pattern = bool(
        kg.nnz == ks.nnz and np.array_equal(kg.indices, ks.indices) and np.array_equal(kg.indptr, ks.indptr)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rk = fit(gpu, gpu.asarray(mh), arche, a0=gpu.asarray(a0), kmat=gpu.asarray(kh), max_iter=ITERS,
                 min_iter=ITERS)  # fmt: skip
        same_inputs = identical_inputs(cpu, gpu, kh, arche, a0.copy(), ITERS)
    report["parity_cpu_gpu_identical_inputs"] = r = {
        "K_same_pattern": same_pattern,
        "K_max_rel_diff": float(abs(kg - ks).max() / abs(ks).max()) if same_pattern else None,
        "K_gpu_symmetric_exactly": bool((kg != kg.T).nnz == 0),
        "fit_with_cpu_K_label_agreement": float(np.mean(a_c.argmax(0) == gpu.to_host(rk.A).toarray().argmax(0))),
        "fit_with_cpu_K_rss_max_rel_diff": float(
            np.max(np.abs(np.asarray(rc.rss) - np.asarray(rk.rss)) / np.asarray(rc.rss))
        ),
        **same_inputs,
        "ok": same_inputs["all_picks_equal"],
    }
    log("CPU vs GPU from identical inputs:", json.dumps(r, default=float))


def timing(report: dict, args) -> None:
    """One ``run_metacells`` call per size (kernel + init + fit)."""
    from _metacells_data import jittered_pcs, manifold_pcs

    from gpuc._backend import get_backend
    from gpuc.metacells import run_metacells

    gpu = get_backend("gpu")
    pool = None
    if not SMOKE:
        import cupy

        pool = cupy.get_default_memory_pool()
    report["timings"] = rows = []
    for n in [300] if SMOKE else args.sizes:
        try:
            x = jittered_pcs(n) if n in (6881, 300) else manifold_pcs(n)
            k = round(n / 75)
            eps, max_iter = (1e-5, 50) if n == 6881 else (1e-3, 100)  # 6,881: the SEACells tutorial settings
            max_iter = 3 if SMOKE else max_iter
            if pool is not None:
                pool.free_all_blocks()
            kw = {"max_iter": max_iter, "min_iter": min(10, max_iter), "convergence_epsilon": eps}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                xg = gpu.asarray(x)
                t = timed(lambda xg=xg, k=k, kw=kw: run_metacells(gpu, xg, k, **kw), 1)
            res = t["out"]
            r = {
                "n": n, "k": k, "eps": eps, "max_iter": max_iter, "total_s": round(t["s"], 3),
                **{f"{a}_s": round(b, 3) for a, b in res.timings.items()}, "n_iter": res.fit.n_iter,
                "converged": res.fit.converged, "rss0": res.fit.rss[0], "rss": res.fit.rss[-1],
                "s_per_iter": round(float(np.median(res.fit.seconds_per_iter)), 4), "a0": res.a0,
                "gpu_pool_peak_gb": None if pool is None else round(pool.total_bytes() / 1024**3, 2),
            }  # fmt: skip
            del res, t, xg
        except Exception as err:  # recorded; the next size still runs
            r = {"n": n, "error": f"{type(err).__name__}: {err}"}
        rows.append(r)
        log("timing:", r)
        if pool is not None:
            pool.free_all_blocks()


PARITY = ("parity_reference_pbmc68k", "parity_cpu_gpu_cd34like", "parity_cpu_gpu_identical_inputs")


def render(report: dict) -> str:
    lines = [f"GPU: {report.get('device')} (cupy {report.get('cupy')}); command: `{report.get('command')}`", ""]
    head = ["cells", "k", "kernel s", "init s", "fit s", "total s", "iters", "s/iter", "RSS0 -> final", "GPU pool GB"]
    rows = []
    for r in report.get("timings", []):
        if "error" in r:
            rows.append([r["n"], "", "", "", "", f"error: {r['error'][:80]}", "", "", "", ""])
            continue
        rows.append([f"{r['n']:,}", r["k"], r.get("kernel_s"), r.get("init_s"), r.get("fit_s"), r["total_s"],
                     r["n_iter"], r["s_per_iter"], f"{r['rss0']:.4f} -> {r['rss']:.4f}", r["gpu_pool_peak_gb"]])  # fmt: skip
    lines.append(_harness.md_table(head, rows))
    lines += [f"{key}: {json.dumps(report[key], default=float)}\n" for key in PARITY if key in report]
    lines += [f"- {e}" for e in report.get("errors", [])]
    return "\n".join(lines) + "\n"


def options(ap) -> None:
    ap.add_argument("--sizes", type=int, nargs="*", default=[6881, 50_000, 200_000])
    ap.add_argument("--skip-parity", action="store_true")


def fill(dev: str, call) -> None:
    """This stage's and gpu_rsc.py's metacell calls on tiny data (cold-run mode)."""
    from _metacells_data import jittered_pcs
    from gpu_nmf import cells

    import gpuc
    from gpuc._backend import get_backend
    from gpuc.metacells import run_metacells

    bk = get_backend(dev)
    x = jittered_pcs(700)
    for a0 in ("random", "uniform"):
        call(f"run_metacells a0={a0}", lambda a0=a0: run_metacells(bk, bk.asarray(x), 9, max_iter=3, min_iter=2, a0=a0))
    src = cells(700)
    if dev == "gpu":
        src = gpuc.get.to_gpu(src, convert_all=True, copy=True)
        src.obsm["X_pca"] = bk.asarray(src.obsm["X_pca"])
    where = {"device": "cpu"} if dev == "cpu" else {}
    call("tl.metacells", lambda: gpuc.tl.metacells(src, 9, max_iter=3, min_iter=2, **where))
    if "metacell" in src.obs:
        call("aggregate_metacells", lambda: gpuc.tl.aggregate_metacells(src, layer="counts"))
        call("metacell_quality",
             lambda: gpuc.tl.metacell_quality(src, celltype_key="cell_type", inplace=False, **where))  # fmt: skip
    grouped = cells(700)
    call("tl.metacells groupby",
         lambda: gpuc.tl.metacells(grouped, groupby="sample", max_iter=2, min_iter=2, device=dev, copy=True))  # fmt: skip


def cold() -> list:
    """A fresh process's first ``tl.metacells`` at default k."""
    import anndata as ad
    from _metacells_data import jittered_pcs

    import gpuc

    n = 300 if SMOKE else 2000

    def metacells():
        a = ad.AnnData(np.zeros((n, 1), dtype=np.float32))
        a.obsm["X_pca"] = jittered_pcs(n)
        kw = {"max_iter": 3, "min_iter": 2} if SMOKE else {}
        return lambda: gpuc.tl.metacells(a, device="gpu", copy=True, **kw)

    return [("tl.metacells", f"{n:,} cells, default k", metacells)]


SCRIPT = _harness.GpuScript(
    name="metacells_gpu",
    steps=[warm_up, parity, timing],
    render=render,
    ok=lambda r: all(r[k]["ok"] for k in PARITY if k in r),
    options=options,
    fill=fill,
    cold=cold,
)

if __name__ == "__main__":
    sys.exit(_harness.gpu_main(SCRIPT, __file__))
