"""Consensus NMF on the CPU: gpuc vs cNMF 1.7.1, side by side in one run, on bundled pbmc3k (2,000 HVG counts).

Cases (both tools get the same cells, cNMF's own 2,000 over-dispersed genes and cNMF's matrix recipe: raw counts on
the HVGs divided by the gene SD, no centring):

* ``k7``: k=7 x 20 runs + consensus (density threshold 0.5). cNMF: prepare + factorize + combine + consensus
  (no figure); gpuc: ``tl.consensus_nmf(..., metric="euclidean", normalization="sum")`` on the counts layer.
* ``sweep``: k=2..12 x 10 runs. cNMF: prepare + factorize + combine + k_selection_plot; gpuc: ``tl.nmf_k_sweep``.
* ``stability`` (not timed; ``--cases stability``): the k=2..12 x 10-run stability over ``--stability-sets`` seed
  sets. cNMF's factorisations are reproduced by scikit-learn's ``cd`` solver with cNMF's own settings and seed scheme
  (``np.random.seed(14 + i)``, one ``randint(1, 2**31 - 1)`` per (k, run) in sorted-k order; this reproduces cnmf
  1.7.1's ``factorize`` exactly) and scored with cNMF's k-selection rule (``KMeans(k, n_init=10, random_state=1)``
  and the Euclidean silhouette of the unit spectra); gpuc is ``tl.nmf_k_sweep(..., random_state=i)``. Also, for
  ``--agree-sets`` seed sets: from the *same* random starts, the fraction of runs in which gpuc's HALS and sklearn's
  ``cd`` end in the same optimum (relative errors within 2e-5).

* ``paired`` (not timed; ``--cases paired``, ``--paired-sets``): paired stability. For each seed set and k, gpuc's
  10 random starts (``random_init`` with ``derive_seed(i, k, run)``, sklearn's distribution) are fitted by both
  gpuc's default HALS schedule and scikit-learn's ``cd`` (cNMF's solver and settings, ``init="custom"``); both sets of
  fits go through the same consensus scoring, so the stability difference is the solver's alone, without the
  seed-to-seed noise of the unpaired comparison. Written to ``nmf_cpu_paired.{json,md}``.

Stability is the Euclidean silhouette of the pooled unit spectra without density filter (cNMF's k-selection number)
for both tools. BLAS is pinned to ``--threads`` threads (default 1) for both, and cNMF runs one worker.
Also measured: time and FLOP/byte counts of a fixed number of batched HALS iterations (the roofline note).

    python benchmarks/bench_nmf.py --repeats 3 --out benchmarks/results

Writes ``nmf_cpu.json`` and ``nmf_cpu.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sweep-repeats", type=int, default=None, help="repeats of the sweep case (default: --repeats)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cases", default="k7,sweep")
    p.add_argument("--skip-cnmf", action="store_true")
    p.add_argument(
        "--tols", default="1e-6", help="gpuc HALS tolerances to run (one table row each; 1e-6 is the default)"
    )
    p.add_argument("--stability-sets", type=int, default=8, help="seed sets of the stability case")
    p.add_argument("--agree-sets", type=int, default=2, help="seed sets of the same-start optimum agreement check")
    p.add_argument("--paired-sets", type=int, default=8, help="seed sets of the paired case")
    p.add_argument("--stability-ks", default="2-12", help="ranks of the stability case, 'a-b' (cNMF seeds assume 2-12)")
    p.add_argument("--out", default="benchmarks/results")
    return p.parse_args()


ARGS = _args()
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)

import warnings  # noqa: E402

import numpy as np  # noqa: E402
import scanpy as sc  # noqa: E402
import scipy.sparse as sp  # noqa: E402

import gpuc  # noqa: E402
from gpuc._backend import get_backend  # noqa: E402
from gpuc._utils import derive_seed  # noqa: E402
from gpuc.nmf._hals import Operator, fit_hals  # noqa: E402

warnings.filterwarnings("ignore")
gpuc.settings.progress = False
sc.settings.verbosity = 0


def load_pbmc3k() -> sc.AnnData:
    ad = gpuc.datasets.pbmc3k()
    sc.pp.filter_cells(ad, min_genes=200)
    ad = ad[ad.obs["passed_seurat_qc"].astype(bool)].copy()
    ad.X = ad.layers["counts"].astype(np.float32)
    return ad


def cos_match(a: np.ndarray, b: np.ndarray) -> float:
    """For each row of a, best cosine with a row of b; return the worst of those."""
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a @ b.T).max(axis=1).min())


def run_cnmf(counts_fn: str, workdir: str, name: str, ks: list[int], n_iter: int, sweep: bool, seed: int) -> dict:
    from cnmf import cNMF

    times = {}
    cpu0 = time.process_time()
    obj = cNMF(output_dir=workdir, name=name)
    t = time.perf_counter()
    obj.prepare(counts_fn=counts_fn, components=ks, n_iter=n_iter, seed=seed, num_highvar_genes=2000)
    times["prepare"] = time.perf_counter() - t
    t = time.perf_counter()
    obj.factorize(worker_i=0, total_workers=1)
    times["factorize"] = time.perf_counter() - t
    t = time.perf_counter()
    obj.combine()
    times["combine"] = time.perf_counter() - t
    out: dict = {}
    if sweep:
        t = time.perf_counter()
        obj.k_selection_plot(close_fig=True)
        times["k_selection"] = time.perf_counter() - t
        from cnmf.cnmf import load_df_from_npz

        stats = load_df_from_npz(obj.paths["k_selection_stats"])
        out["stability"] = {int(r.k): float(r.silhouette) for r in stats.itertuples()}
        out["error_abs"] = {int(r.k): float(r.prediction_error) for r in stats.itertuples()}
    else:
        t = time.perf_counter()
        obj.consensus(ks[0], density_threshold=0.5, show_clustering=False, close_clustergram_fig=True)
        times["consensus"] = time.perf_counter() - t
        # stability (untimed): cNMF's k-selection silhouette for this k
        stats = obj.consensus(
            ks[0], skip_density_and_return_after_stats=True, show_clustering=False, close_clustergram_fig=True
        ).stats
        out["stability"] = {ks[0]: float(stats["silhouette"])}
        from cnmf.cnmf import load_df_from_npz

        spectra = load_df_from_npz(obj.paths["consensus_spectra"] % (ks[0], "0_5"))
        out["spectra"] = spectra.values
        out["spectra_genes"] = np.asarray(spectra.columns)
    times["total"] = sum(times.values())
    times["cpu"] = time.process_time() - cpu0
    genes = open(obj.paths["nmf_genes_list"]).read().split()
    norm = sc.read_h5ad(obj.paths["normalized_counts"])
    out.update(
        times=times,
        genes=genes,
        norm2=float((norm.X.data.astype(np.float64) ** 2).sum())
        if sp.issparse(norm.X)
        else float((np.asarray(norm.X, dtype=np.float64) ** 2).sum()),
    )
    return out


def run_gpuc(ad: sc.AnnData, ks: list[int], n_runs: int, sweep: bool, seed: int, tol: float) -> dict:
    ad = ad.copy()
    common = {
        "layer": "counts",
        "preprocessing": "sd",
        "metric": "euclidean",
        "device": "cpu",
        "random_state": seed,
        "tol": tol,
    }
    t = time.perf_counter()
    cpu0 = time.process_time()
    if sweep:
        gpuc.tl.nmf_k_sweep(ad, ks, n_runs=n_runs, density_threshold=2.0, **common)
        total = time.perf_counter() - t
        cpu = time.process_time() - cpu0
        tab = ad.uns["nmf_k_sweep"]["table"]
        return {
            "times": {"total": total, "cpu": cpu},
            "stability": dict(zip(tab.k.astype(int), tab.stability.astype(float), strict=True)),
            "median_error": dict(zip(tab.k.astype(int), tab.median_error.astype(float), strict=True)),
        }
    gpuc.tl.consensus_nmf(ad, ks[0], n_runs=n_runs, density_threshold=0.5, normalization="sum", **common)
    total = time.perf_counter() - t
    cpu = time.process_time() - cpu0
    u = ad.uns["nmf"]
    # cNMF's stability number (silhouette without density filter), from the same restarts (untimed): threshold 2
    ad2 = ad.copy()
    gpuc.tl.nmf_k_sweep(ad2, [ks[0]], n_runs=n_runs, density_threshold=2.0, **common)
    hv = ad.var["highly_variable"].to_numpy()
    return {
        "times": {"total": total, "cpu": cpu},
        "stability": {ks[0]: float(ad2.uns["nmf_k_sweep"]["table"].stability.iloc[0])},
        "stability_filtered": float(u["stability"]),
        "rel_error": float(u["rel_error"]),
        "n_dropped": int(u["n_dropped"]),
        "spectra": ad.varm["nmf_spectra"][hv].T,
        "spectra_genes": np.asarray(ad.var_names[hv]),
        "n_converged": int(u["n_converged"]),
    }


SCHEDULES = {"default": {}, "spectra first, no warm-up": {"update_order": "spectra", "warmup": 0}}


def sklearn_cd(x: sp.csr_matrix, n2: float, k: int, **kw: object) -> tuple[np.ndarray, np.ndarray, float]:
    """One scikit-learn ``cd`` fit with cNMF 1.7.1's settings: ``(W, H, relative error)``."""
    from sklearn.decomposition import non_negative_factorization

    w, h, _ = non_negative_factorization(
        x,
        n_components=k,
        solver="cd",
        beta_loss="frobenius",
        tol=1e-4,
        max_iter=1000,
        alpha_W=0.0,
        alpha_H=0.0,
        l1_ratio=0.0,
        **kw,
    )
    return w, h, float(n2 - 2 * (w * (x @ h.T)).sum() + ((w.T @ w) * (h @ h.T)).sum()) / n2


def stability_case(ad: sc.AnnData, genes: list[str], n_sets: int, n_agree: int) -> dict:
    """Stability over many seed sets: cNMF's solver (sklearn cd, cNMF's seeds and k-selection rule) vs gpuc."""
    from sklearn.cluster import KMeans
    from sklearn.metrics import silhouette_score

    from gpuc.nmf._hals import random_init
    from gpuc.tl._nmf import _prepare_block

    lo, hi = (int(v) for v in ARGS.stability_ks.split("-"))
    ks, n_runs = list(range(lo, hi + 1)), 10
    ad = ad.copy()
    ad.var["highly_variable"] = ad.var_names.isin(genes)
    block, _ = _prepare_block(ad, "counts", True, "sd")  # cNMF's matrix: HVG counts / SD (ddof=1)
    x = sp.csr_matrix(block, dtype=np.float64)
    n2 = float(x.multiply(x).sum())

    def sk_fit(k: int, **kw: object) -> tuple[np.ndarray, float]:
        _, h, rel = sklearn_cd(x, n2, k, **kw)
        return h, rel

    out: dict = {
        "k": ks,
        "n_sets": n_sets,
        "cnmf_solver": {k: [] for k in ks},
        **{f"gpuc {n}": {k: [] for k in ks} for n in SCHEDULES},
    }
    for i in range(n_sets):
        # cNMF's scheme (cnmf.prepare: np.random.seed(seed); randint): one seed per (k, run), sorted k
        seeds = np.random.RandomState(14 + i).randint(1, 2**31 - 1, size=len(ks) * n_runs)
        t = time.perf_counter()
        for j, k in enumerate(ks):
            spectra = np.concatenate(
                [sk_fit(k, init="random", random_state=int(seeds[j * n_runs + r]))[0] for r in range(n_runs)]
            )
            unit = spectra / np.linalg.norm(spectra, axis=1, keepdims=True)
            labels = KMeans(n_clusters=k, n_init=10, random_state=1).fit(unit).labels_
            out["cnmf_solver"][k].append(float(silhouette_score(unit, labels, metric="euclidean")))
        t_sk = time.perf_counter() - t
        for name, kw in SCHEDULES.items():
            b = ad.copy()
            gpuc.tl.nmf_k_sweep(
                b,
                ks,
                n_runs=n_runs,
                layer="counts",
                preprocessing="sd",
                metric="euclidean",
                density_threshold=2.0,
                device="cpu",
                random_state=i,
                **kw,
            )
            tab = b.uns["nmf_k_sweep"]["table"]
            for k, v in zip(tab.k.astype(int), tab.stability.astype(float), strict=True):
                out[f"gpuc {name}"][k].append(v)
        print(
            f"[stability set {i}] sklearn cd {t_sk:.0f} s; "
            + "; ".join(
                f"{n}: " + " ".join(f"{out[n][k][-1]:.3f}" for k in ks) for n in out if n not in ("k", "n_sets")
            ),
            flush=True,
        )
    # same starts: does each gpuc run end in the optimum sklearn's cd reaches from the same (W0, H0)?
    be = get_backend("cpu")
    op = Operator.build(be, block)
    agree = {name: {k: [] for k in ks} for name in SCHEDULES}
    for i in range(n_agree):
        for k in ks:
            seeds = [derive_seed(i, k, r) for r in range(n_runs)]
            w0, h0 = random_init(seeds, op.shape[0], op.shape[1], k, op.mean, np.float64)
            ref = np.array(
                [sk_fit(k, init="custom", W=w0[:, r, :].copy(), H=h0[:, r, :].T.copy())[1] for r in range(n_runs)]
            )
            for name, kw in SCHEDULES.items():
                rel = fit_hals(be, op, k, seeds, **kw).rel_errors
                agree[name][k] += (np.abs(rel - ref) < 2e-5).tolist()
        print(
            f"[agreement set {i}] "
            + "; ".join(f"{n}: {np.mean([v for k in ks for v in agree[n][k]]):.2f}" for n in SCHEDULES),
            flush=True,
        )
    out["agreement"] = {
        name: {k: float(np.mean(v)) if v else float("nan") for k, v in d.items()} for name, d in agree.items()
    }
    out["agree_sets"] = n_agree
    return out


def paired_case(ad: sc.AnnData, genes: list[str], n_sets: int) -> dict:
    """Stability of gpuc's default HALS and sklearn cd fitted from the same random starts, scored identically."""

    from gpuc.nmf._consensus import sweep_row
    from gpuc.nmf._hals import HalsResult, random_init
    from gpuc.tl._nmf import _backend_and_op, _prepare_block

    lo, hi = (int(v) for v in ARGS.stability_ks.split("-"))
    ks, n_runs = list(range(lo, hi + 1)), 10
    ad = ad.copy()
    ad.var["highly_variable"] = ad.var_names.isin(genes)
    block, _ = _prepare_block(ad, "counts", True, "sd")
    be, op = _backend_and_op(block, "cpu", None)  # what tl.nmf_k_sweep fits (float32)
    x = sp.csr_matrix(block, dtype=np.float64)
    n2 = float(x.multiply(x).sum())
    score = {
        "target": "spectra",
        "metric": "euclidean",
        "density_threshold": 2.0,
        "kmeans_n_init": 10,
        "random_state": 0,
    }
    out: dict = {
        "k": ks,
        "n_sets": n_sets,
        "sklearn": {k: [] for k in ks},
        "gpuc": {k: [] for k in ks},
        "same_optimum": {k: [] for k in ks},
    }
    for i in range(n_sets):
        t = time.perf_counter()
        for k in ks:
            seeds = [derive_seed(i, k, r) for r in range(n_runs)]
            w0, h0 = random_init(seeds, op.shape[0], op.shape[1], k, op.mean, np.float64)
            ws, hs, losses = [], [], []
            for r in range(n_runs):
                w, h, rel = sklearn_cd(x, n2, k, init="custom", W=w0[:, r, :].copy(), H=h0[:, r, :].T.copy())
                nrm = np.linalg.norm(w, axis=0)
                nrm[nrm == 0] = 1.0
                w, h = w / nrm, h * nrm[:, None]
                ws.append(w)
                hs.append(h.T)
                losses.append(rel * n2)
            skf = HalsResult(
                np.stack(ws, 1).astype(np.float32),
                np.stack(hs, 1).astype(np.float32),
                np.asarray(losses),
                np.zeros(n_runs, int),
                np.ones(n_runs, bool),
                n2,
            )
            gf = fit_hals(be, op, k, seeds)
            out["sklearn"][k].append(float(sweep_row(be, op, skf, k, **score).stability))
            out["gpuc"][k].append(float(sweep_row(be, op, gf, k, **score).stability))
            out["same_optimum"][k].append(
                float(np.mean(np.abs(np.asarray(gf.rel_errors) - np.asarray(skf.rel_errors)) < 2e-5))
            )
        print(
            f"[paired set {i}] {time.perf_counter() - t:.0f} s; gpuc - sklearn: "
            + " ".join(f"{k}:{out['gpuc'][k][-1] - out['sklearn'][k][-1]:+.3f}" for k in ks),
            flush=True,
        )
    return out


def _paired_markdown(pr: dict, machine: str) -> str:
    ks = pr["k"]
    lines = [
        machine,
        "",
        f"**Paired stability, k={ks[0]}..{ks[-1]} x 10 runs, {pr['n_sets']} seed sets: gpuc default HALS and sklearn cd (cNMF's solver) from the same random starts, same consensus scoring**",
        "",
    ]
    lines += [
        "| k | sklearn cd (mean) | gpuc (mean) | gpuc - sklearn: mean [min, max] over sets | sets with gpuc >= sklearn - 0.005 | runs in the same optimum |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for k in ks:
        a = np.asarray(pr["sklearn"].get(k, pr["sklearn"].get(str(k))))
        g = np.asarray(pr["gpuc"].get(k, pr["gpuc"].get(str(k))))
        same = np.asarray(pr["same_optimum"].get(k, pr["same_optimum"].get(str(k))))
        d = g - a
        lines.append(
            f"| {k} | {a.mean():.3f} | {g.mean():.3f} | {d.mean():+.3f} [{d.min():+.3f}, {d.max():+.3f}] | {(d >= -0.005).sum()}/{len(d)} | {same.mean():.2f} |"
        )
    return "\n".join(lines) + "\n"


def roofline(ad: sc.AnnData, k: int = 7, n_runs: int = 20, iters: int = 40) -> dict:
    """Time ``iters`` batched HALS iterations (no early stop) and count FLOPs and bytes per iteration."""
    hv = ad.var["highly_variable"].to_numpy()
    x = ad.layers["counts"][:, hv].astype(np.float32).tocsr()
    m, n = x.shape
    mean = np.asarray(x.mean(0)).ravel()
    sd = np.sqrt(np.maximum(np.asarray(x.multiply(x).mean(0)).ravel() - mean**2, 0) * m / (m - 1))
    x = (x @ sp.diags(1 / sd)).tocsr()
    be = get_backend("cpu")
    op = Operator.build(be, x)
    seeds = [derive_seed(0, k, r) for r in range(n_runs)]
    fit_hals(be, op, k, seeds, max_iter=2, tol=1e-300)
    t = time.perf_counter()
    c0 = time.process_time()
    fit_hals(be, op, k, seeds, max_iter=iters, tol=1e-300)
    sec = (time.perf_counter() - t) / iters
    cpu_sec = (time.process_time() - c0) / iters
    # the sparse product alone (scipy, both halves) for reference
    w = np.ones((m, n_runs * k), dtype=np.float32)
    h = np.ones((n, n_runs * k), dtype=np.float32)
    c0 = time.process_time()
    for _ in range(5):
        op.vt @ w
        op.v @ h
    scipy_spmm = (time.process_time() - c0) / 5
    rk = n_runs * k
    nnz = x.nnz
    # the fused CPU kernel (gpuc.nmf._kernels_cpu): per half-iteration one SpMM row at a time, the Gauss-Seidel sweep of
    # that row, the extrapolation, and float64 Gram accumulation (upper triangles: new spectra, new usages and the
    # extrapolated usages), plus the loss cross term
    flops = {
        "spmm (V^T W, V H^T)": 2 * 2 * nnz * rk,
        "grams (3, upper triangles)": (2 * m + n) * n_runs * k * (k + 1),
        "sweeps": 2 * (m + n) * n_runs * k * (k + 1),
        "extrapolation + loss": 3 * (m + n) * rk + 2 * m * rk,
    }
    fl = sum(flops.values())
    # bytes from memory at least once per iteration: V twice (CSR of V and of V^T: 4-byte values + 4-byte indices),
    # the four factor blocks (W, W_hat, H, H_hat: read and written once each) and the gathered factor read once
    f4 = 4  # float32 (the default dtype)
    bytes_ = 2 * nnz * (f4 + 4) + (m + n) * rk * f4 * 5
    # bytes gathered from cache: one row of the other factor (rk floats) per non-zero, in each half-iteration
    gathered = 2 * nnz * rk * f4
    # machine: a STREAM-like triad and a dense GEMM on this core count
    gen = np.random.default_rng(0)
    a = gen.random(20_000_000)
    b = gen.random(20_000_000)
    t = time.perf_counter()
    for _ in range(3):
        c = a + 1.5 * b
    bw = 3 * 3 * a.nbytes / (time.perf_counter() - t)
    del c
    g = gen.random((2000, 2000))
    g @ g
    t = time.perf_counter()
    for _ in range(3):
        g @ g
    gemm = 3 * 2 * 2000**3 / (time.perf_counter() - t)
    return {
        "shape": [m, n],
        "nnz": nnz,
        "k": k,
        "n_runs": n_runs,
        "seconds_per_iter": sec,
        "cpu_seconds_per_iter": cpu_sec,
        "flops_per_iter": fl,
        "scipy_spmm_cpu_seconds": scipy_spmm,
        "gathered_bytes_per_iter": gathered,
        "flops_breakdown": flops,
        "bytes_per_iter": bytes_,
        "gflops": fl / sec / 1e9,
        "gbytes_per_s": bytes_ / sec / 1e9,
        "machine_stream_gbs": bw / 1e9,
        "machine_dgemm_gflops": gemm / 1e9,
    }


def main() -> None:
    out_dir = Path(ARGS.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = ARGS.cases.split(",")
    ad = load_pbmc3k()
    res: dict = {
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
            "threads": ARGS.threads,
            "cpu": _cpu_name(),
            "loadavg_start": os.getloadavg(),
        },
        "versions": _versions(),
        "cases": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        counts_fn = str(Path(tmp) / "pbmc3k_counts.h5ad")
        sc.AnnData(ad.layers["counts"].astype(np.float32), obs=ad.obs[[]], var=ad.var[[]]).write_h5ad(counts_fn)
        # untimed warm-up of both tools in this process (imports, numba/JIT caches), on 400 cells
        small = ad[:400].copy()
        small_fn = str(Path(tmp) / "small.h5ad")
        sc.AnnData(small.layers["counts"].astype(np.float32), obs=small.obs[[]], var=small.var[[]]).write_h5ad(small_fn)
        if not ARGS.skip_cnmf:
            run_cnmf(
                small_fn, str(Path(tmp) / "warm"), "warm", [3], 4, False, seed=1
            )  # >= 4 runs: cNMF int(0.3 n) neighbours
        small.var["highly_variable"] = np.asarray(small.layers["counts"].sum(0)).ravel() > 50
        for tol in [float(t) for t in ARGS.tols.split(",")]:
            run_gpuc(small, [3], 2, False, seed=1, tol=tol)
        genes = None
        for case in cases:
            if case in ("stability", "paired"):
                continue
            sweep = case == "sweep"
            ks = list(range(2, 13)) if sweep else [7]
            n_runs = 10 if sweep else 20
            reps = (ARGS.sweep_repeats or ARGS.repeats) if sweep else ARGS.repeats
            tols = [float(t) for t in ARGS.tols.split(",")]
            rows = {"cnmf": [], **{f"gpuc tol={t:g}": [] for t in tols}}
            genes = None
            for rep in range(reps):
                if not ARGS.skip_cnmf:
                    c = run_cnmf(
                        counts_fn, str(Path(tmp) / f"{case}{rep}"), f"{case}{rep}", ks, n_runs, sweep, seed=14 + rep
                    )
                    genes = c["genes"]
                    rows["cnmf"].append(c)
                    print(f"[{case} rep {rep}] cnmf {c['times']}", flush=True)
                if genes is None:  # no cNMF: scanpy's HVGs
                    b = ad.copy()
                    sc.pp.normalize_total(b)
                    sc.pp.log1p(b)
                    sc.pp.highly_variable_genes(b, n_top_genes=2000)
                    genes = list(b.var_names[b.var["highly_variable"]])
                ad.var["highly_variable"] = ad.var_names.isin(genes)
                for tol in tols:
                    g = run_gpuc(ad, ks, n_runs, sweep, seed=rep, tol=tol)
                    rows[f"gpuc tol={tol:g}"].append(g)
                    print(f"[{case} rep {rep}] gpuc tol={tol:g} {g['times']} stability {g['stability']}", flush=True)
            res["cases"][case] = _summarise(case, rows, ks)
        if ("stability" in cases or "paired" in cases) and genes is None:  # cNMF's HVGs (prepare only, untimed)
            from cnmf import cNMF

            obj = cNMF(output_dir=str(Path(tmp) / "hvg"), name="hvg")
            obj.prepare(counts_fn=counts_fn, components=[2], n_iter=4, seed=14, num_highvar_genes=2000)
            genes = open(obj.paths["nmf_genes_list"]).read().split()
        if "paired" in cases:
            pr = paired_case(ad, genes, ARGS.paired_sets)
            machine = f"Machine: {res['machine']['cpu']}, {res['machine']['cpus']} cores, threads {ARGS.threads}; {res['versions']}."
            (out_dir / "nmf_cpu_paired.json").write_text(
                json.dumps(
                    {"machine": res["machine"], "versions": res["versions"], "paired": pr}, indent=2, default=float
                )
            )
            (out_dir / "nmf_cpu_paired.md").write_text(_paired_markdown(pr, machine))
            print(_paired_markdown(pr, machine))
            if set(cases) == {"paired"}:
                return
        if "stability" in cases:
            try:
                res["stability"] = stability_case(ad, genes, ARGS.stability_sets, ARGS.agree_sets)
            except Exception as err:  # keep the timed cases' results
                import traceback

                traceback.print_exc()
                res["stability_error"] = repr(err)
        if any(c in cases for c in ("k7", "sweep")):
            res["roofline"] = roofline(ad)
    res["machine"]["loadavg_end"] = os.getloadavg()
    (out_dir / "nmf_cpu.json").write_text(json.dumps(res, indent=2, default=float))
    md = _markdown(res)
    (out_dir / "nmf_cpu.md").write_text(md)
    print(md)


def _summarise(case: str, rows: dict, ks: list[int]) -> dict:
    tools = [t for t in rows if rows[t]]
    s: dict = {"k": ks, "repeats": max(len(v) for v in rows.values()), "tools": tools}
    for tool in tools:
        steps = rows[tool][0]["times"].keys()
        s[tool] = {
            "times": {st: float(np.median([r["times"][st] for r in rows[tool]])) for st in steps},
            "all_totals": [r["times"]["total"] for r in rows[tool]],
        }
        s[tool]["stability"] = {k: float(np.median([r["stability"][k] for r in rows[tool]])) for k in ks}
        s[tool]["stability_all"] = {k: [r["stability"][k] for r in rows[tool]] for k in ks}
        if tool == "cnmf":
            continue
        g0 = rows[tool][0]
        if case == "k7":
            s[tool].update(
                rel_error=float(np.median([r["rel_error"] for r in rows[tool]])),
                stability_filtered=float(np.median([r["stability_filtered"] for r in rows[tool]])),
                n_dropped=[r["n_dropped"] for r in rows[tool]],
            )
        else:
            s[tool]["median_error"] = {k: float(np.median([r["median_error"][k] for r in rows[tool]])) for k in ks}
        if rows["cnmf"]:
            s[tool]["speedup"] = s["cnmf"]["times"]["total"] / s[tool]["times"]["total"]
            s[tool]["speedup_cpu"] = s["cnmf"]["times"]["cpu"] / s[tool]["times"]["cpu"]
            s[tool]["speedup_per_repeat"] = [
                c["times"]["total"] / g["times"]["total"] for c, g in zip(rows["cnmf"], rows[tool], strict=False)
            ]
            if case == "k7":
                c0 = rows["cnmf"][0]
                gi = {g: i for i, g in enumerate(g0["spectra_genes"])}
                idx = [gi[g] for g in c0["spectra_genes"]]
                s[tool]["min_best_cosine_vs_cnmf"] = cos_match(c0["spectra"], g0["spectra"][:, idx])
    if rows["cnmf"] and case == "sweep":
        s["cnmf"]["rel_error"] = {
            k: float(np.median([r["error_abs"][k] / r["norm2"] for r in rows["cnmf"]])) for k in ks
        }
    return s


def _markdown(res: dict) -> str:
    m = res["machine"]
    la0, la1 = m["loadavg_start"], m.get("loadavg_end", m["loadavg_start"])
    lines = [
        f"Machine: {m['cpu']}, {m['cpus']} cores shared with other jobs (1/5/15-min load average {la0[0]:.1f}/{la0[1]:.1f}/{la0[2]:.1f} at start, "
        f"{la1[0]:.1f}/{la1[1]:.1f}/{la1[2]:.1f} at end), BLAS and numba threads {m['threads']} ({m['platform']}, Python {m['python']}); {res['versions']}.",
        "",
    ]
    if "stability" in res:
        lines += _stability_markdown(res["stability"])
    for case, s in res["cases"].items():
        title = "k=7 x 20 runs + consensus (density 0.5)" if case == "k7" else "k sweep 2..12 x 10 runs"
        lines += [
            f"**{title}** on pbmc3k (2,638 cells x cNMF's 2,000 HVG counts / SD), median of {s['repeats']} repeats (seeds differ per repeat):",
            "",
        ]
        lines += [
            "| tool | steps (s) | total wall (s) | CPU (s) | speed-up wall (per repeat) | speed-up CPU | stability (median; all) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for tool in s["tools"]:
            st = ", ".join(f"{k} {v:.2f}" for k, v in s[tool]["times"].items() if k not in ("total", "cpu"))
            sp_ = (
                (f"{s[tool]['speedup']:.1f}x (" + "/".join(f"{v:.1f}" for v in s[tool]["speedup_per_repeat"]) + ")")
                if "speedup" in s[tool]
                else ""
            )
            spc = f"{s[tool]['speedup_cpu']:.1f}x" if "speedup_cpu" in s[tool] else ""
            stab = ""
            if case == "k7":
                allv = s[tool]["stability_all"][7]
                stab = f"{s[tool]['stability'][7]:.3f}; " + "/".join(f"{v:.3f}" for v in allv)
            lines.append(
                f"| {tool} | {st or '-'} | {s[tool]['times']['total']:.2f} | {s[tool]['times']['cpu']:.2f} | {sp_} | {spc} | {stab} |"
            )
        lines.append("")
        if case == "k7":
            for tool in s["tools"]:
                if tool == "cnmf":
                    continue
                g = s[tool]
                lines.append(
                    f"- {tool}: with the 0.5 density filter stability {g['stability_filtered']:.3f} (dropped {g['n_dropped']}), rel. error {g['rel_error']:.5f}"
                    + (
                        f", worst best-match cosine to cNMF's programmes {g['min_best_cosine_vs_cnmf']:.4f}"
                        if "min_best_cosine_vs_cnmf" in g
                        else ""
                    )
                    + "."
                )
        else:
            lines += ["| k | " + " | ".join(str(k) for k in s["k"]) + " |", "| --- |" + " --- |" * len(s["k"])]
            for tool in s["tools"]:
                lines.append(
                    f"| {tool} stability | " + " | ".join(f"{s[tool]['stability'][k]:.3f}" for k in s["k"]) + " |"
                )
            if "cnmf" in s:
                lines.append(
                    "| cnmf rel. error | " + " | ".join(f"{s['cnmf']['rel_error'][k]:.4f}" for k in s["k"]) + " |"
                )
            for tool in s["tools"]:
                if tool != "cnmf":
                    lines.append(
                        f"| {tool} median rel. error | "
                        + " | ".join(f"{s[tool]['median_error'][k]:.4f}" for k in s["k"])
                        + " |"
                    )
        lines.append("")
    if "roofline" not in res:
        return "\n".join(lines) + "\n"
    r = res["roofline"]
    lines.append(
        f"HALS iteration (k={r['k']} x {r['n_runs']} runs batched, {r['shape'][0]} x {r['shape'][1]}, nnz {r['nnz']:,}, float32, one thread): "
        f"{r['flops_per_iter'] / 1e6:.0f} MFLOP ({r['flops_breakdown']['spmm (V^T W, V H^T)'] / 1e6:.0f} in the two sparse products), "
        f">= {r['bytes_per_iter'] / 1e6:.0f} MB from memory and {r['gathered_bytes_per_iter'] / 1e6:.0f} MB of factor rows gathered from cache per iteration; "
        f"measured {r['seconds_per_iter'] * 1e3:.1f} ms wall ({r['cpu_seconds_per_iter'] * 1e3:.1f} ms CPU) = {r['flops_per_iter'] / r['cpu_seconds_per_iter'] / 1e9:.1f} GFLOP/s "
        f"of CPU time and {r['bytes_per_iter'] / r['cpu_seconds_per_iter'] / 1e9:.2f} GB/s from memory; scipy's two SpMMs alone take {r['scipy_spmm_cpu_seconds'] * 1e3:.1f} ms CPU. "
        f"This machine: dgemm {r['machine_dgemm_gflops']:.1f} GFLOP/s, triad {r['machine_stream_gbs']:.1f} GB/s."
    )
    return "\n".join(lines) + "\n"


def _stability_markdown(st: dict) -> list[str]:
    ks = st["k"]
    tools = [t for t in st if t == "cnmf_solver" or t.startswith("gpuc ")]
    lines = [
        f"**Stability, k=2..12 x 10 runs, over {st['n_sets']} seed sets** (mean / median [min-max]; cNMF = sklearn cd with cNMF's seeds and k-selection rule):",
        "",
    ]
    lines += [
        "| k | " + " | ".join("cNMF" if t == "cnmf_solver" else t for t in tools) + " | gpuc default - cNMF (means) |",
        "| --- |" + " --- |" * (len(tools) + 1),
    ]
    for k in ks:
        cells = []
        for t in tools:
            v = np.asarray(st[t][k] if k in st[t] else st[t][str(k)])
            cells.append(f"{v.mean():.3f} / {np.median(v):.3f} [{v.min():.3f}-{v.max():.3f}]")
        c = np.asarray(st["cnmf_solver"].get(k, st["cnmf_solver"].get(str(k))))
        g = np.asarray(st["gpuc default"].get(k, st["gpuc default"].get(str(k))))
        cells.append(f"{g.mean() - c.mean():+.3f}")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines.append("")
    if st.get("agree_sets"):
        lines += [
            f"Same random starts ({st['agree_sets']} seed sets x 10 runs per k): fraction of runs ending in the optimum sklearn's cd reaches:",
            "",
        ]
        lines += ["| schedule | " + " | ".join(str(k) for k in ks) + " | all |", "| --- |" + " --- |" * (len(ks) + 1)]
        for name, d in st["agreement"].items():
            vals = [d.get(k, d.get(str(k))) for k in ks]
            lines.append(f"| gpuc {name} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {np.mean(vals):.2f} |")
        lines.append("")
    return lines


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _versions() -> str:
    from importlib.metadata import version

    out = []
    for pkg in ("gpuc", "cnmf", "scikit-learn", "numpy", "scipy"):
        try:
            out.append(f"{pkg} {version(pkg)}")
        except Exception:
            pass
    return ", ".join(out)


if __name__ == "__main__":
    main()
