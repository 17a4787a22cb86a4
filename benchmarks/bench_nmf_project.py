"""``gpuc.tl.nmf_project`` at atlas scale, and against starCAT's default path in the same run.

The reference: ``gpuc.tl.consensus_nmf`` (cNMF style: counts on 2,000 HVGs, genes divided by their SD, k=10,
10 runs) on the bundled pbmc3k cells that pass the Seurat QC; its programmes are handed to both tools as a table
(starCAT's reference format), and both scale the query genes by the query's own SD (starCAT's convention).

Configurations, each in a fresh process (imports and data before the clock; numba caches filled by an untimed
process first):

* ``cpu``: 1,000,000 cells made by resampling pbmc3k's 2,638 QC cells (all 13,714 genes, CSR, a dask array of
  ``--block``-row chunks generated on demand, so the atlas never exists whole anywhere), projected in process
  (``client=None``, default threads): each block is generated twice (the gene-SD pass and the projection), as it
  would be read twice from disk;
* ``dask``: the same on a ``LocalCluster`` of ``--workers`` worker processes with one thread each; the peak RSS of
  every worker (``VmHWM``) is read after the call;
* ``small-gpuc`` / ``small-starcat``: ``--small`` cells (in memory, the same resampling) through
  ``nmf_project`` (cold = first call of the process, then warm calls) and ``starCAT(reference=tsv).fit_transform``
  (starcatpy's defaults: scikit-learn ``non_negative_factorization``, ``solver='mu'``, ``tol=1e-4``,
  ``max_iter=1000``); the per-programme Pearson of their usages is reported.

Needs starcatpy for the starCAT rows (skipped when absent); run from a venv that has both:

    python benchmarks/bench_nmf_project.py [--cells 1000000] [--block 20000] [--small 20000] [--workers 2]

Writes ``benchmarks/results/nmf_project.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _harness as H  # noqa: E402

K = 10
N_RUNS = 10


# ---- data -------------------------------------------------------------------------------------------------------------
def pbmc_counts():
    """pbmc3k's QC cells: (counts CSR float32, gene names, HVG mask over 2,000 genes)."""
    import scanpy as sc

    import gpuc

    ad = gpuc.datasets.pbmc3k()
    ad = ad[np.asarray(ad.obs["passed_seurat_qc"]).astype(bool)].copy()
    ln = ad.copy()
    sc.pp.normalize_total(ln, target_sum=1e4)
    sc.pp.log1p(ln)
    sc.pp.highly_variable_genes(ln, n_top_genes=2000, flavor="seurat")
    x = ad.X.tocsr().astype(np.float32)
    return x, np.asarray(ad.var_names), ln.var["highly_variable"].to_numpy()


def make_chunk(x, seed: int, rows: int):
    """``rows`` cells resampled from ``x`` (CSR), from their own seed."""
    rng = np.random.default_rng([20261207, seed])
    return x[rng.integers(0, x.shape[0], rows)]


def atlas(x, genes, n_cells: int, block: int):
    """An AnnData whose X is a lazily generated dask array of ``n_cells`` resampled cells (CSR chunks of ``block``)."""
    import anndata
    import dask
    import dask.array as da
    import pandas as pd
    import scipy.sparse as sp

    src = dask.delayed(x)  # one key: every chunk task depends on the same copy
    parts = []
    for i, a in enumerate(range(0, n_cells, block)):
        rows = min(block, n_cells - a)
        d = dask.delayed(make_chunk)(src, i, rows)
        parts.append(
            da.from_delayed(d, shape=(rows, x.shape[1]), dtype=np.float32, meta=sp.csr_matrix((0, 0), dtype=np.float32))
        )
    xd = da.concatenate(parts, axis=0)
    obs = pd.DataFrame(index=pd.RangeIndex(n_cells).astype(str))
    return anndata.AnnData(xd, obs=obs, var=pd.DataFrame(index=genes))


def reference_table(tmp: Path) -> None:
    """Fit the reference once; write its programmes (genes x k, and starCAT's programmes x genes tsv)."""
    import anndata
    import pandas as pd

    import gpuc

    x, genes, hvg = pbmc_counts()
    ad = anndata.AnnData(x, var=pd.DataFrame(index=genes))
    ad.var["highly_variable"] = hvg
    t = time.perf_counter()
    gpuc.tl.consensus_nmf(ad, K, n_runs=N_RUNS, preprocessing="sd", device="cpu", random_state=0)
    fit_s = time.perf_counter() - t
    g = ad.uns["nmf"]["genes"]
    table = pd.DataFrame(
        ad.varm["nmf_spectra"][ad.var_names.get_indexer(g)], index=g, columns=[f"GEP{i + 1}" for i in range(K)]
    )
    table.to_pickle(tmp / "ref.pkl")
    table.T.to_csv(tmp / "ref.tsv", sep="\t")
    (tmp / "ref.json").write_text(json.dumps({"fit_s": fit_s, "stability": float(ad.uns["nmf"]["stability"])}))


# ---- one configuration (a fresh process) ------------------------------------------------------------------------------
def _worker_peak() -> float:
    """This process's peak RSS (VmHWM) since the last :func:`_reset_peak`, MB."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM")) / 1024


def _reset_peak() -> None:
    """Reset this process's VmHWM to its current RSS (Linux ``clear_refs`` 5), so the next peak is the call's."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def one(config: str, tmp: Path, args: argparse.Namespace) -> dict:
    import warnings

    import pandas as pd

    warnings.simplefilter("ignore")
    table = pd.read_pickle(tmp / "ref.pkl")
    x, genes, _ = pbmc_counts()
    out: dict = {"config": config, "load_before": H.loadavg()}
    if config in ("cpu", "dask"):
        import gpuc

        ad = atlas(x, genes, args.cells, args.block)
        client = cluster = None
        if config == "dask":
            from dask.distributed import Client, LocalCluster

            cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=":0")
            client = Client(cluster)
            client.run(lambda: __import__("gpuc.nmf._project"))  # workers import gpuc before the clock
        out["driver_rss_before_mb"] = _worker_peak()
        _reset_peak()
        if client is not None:
            client.run(_reset_peak)
        t = time.perf_counter()
        gpuc.tl.nmf_project(ad, table, block_size=args.block, client=client)
        out["wall_s"] = time.perf_counter() - t
        out["driver_peak_rss_mb"] = _worker_peak()
        out["n_blocks"] = ad.uns["nmf_project"]["n_blocks"]
        out["rel_error"] = ad.uns["nmf_project"]["rel_error"]
        out["cells"] = args.cells
        if client is not None:
            out["worker_peak_rss_mb"] = sorted(client.run(_worker_peak).values())
            client.close()
            cluster.close()
        # the generation alone (no projection): the part of the wall that is "reading" the atlas, per pass
        t = time.perf_counter()
        cols = ad.var_names.get_indexer(table.index)
        for b in ad.X.to_delayed().ravel():
            b.compute(scheduler="sync")
        out["generate_s_per_pass"] = time.perf_counter() - t
        nnz = sum(
            make_chunk(x, i, min(args.block, args.cells - a))[:, cols].nnz
            for i, a in enumerate(range(0, min(args.cells, 5 * args.block), args.block))
        )
        out["nnz_selected_est"] = nnz * args.cells / min(args.cells, 5 * args.block)
    else:
        import anndata
        import scipy.sparse as sp

        q = sp.vstack(
            [make_chunk(x, i, min(args.block, args.small - a)) for i, a in enumerate(range(0, args.small, args.block))]
        ).tocsr()
        ad = anndata.AnnData(
            q, obs=pd.DataFrame(index=pd.RangeIndex(q.shape[0]).astype(str)), var=pd.DataFrame(index=genes)
        )
        times, cpu = [], []  # wall and CPU time (this process, all its threads) per call
        out["rss_before_mb"] = _worker_peak()
        _reset_peak()
        if config == "small-gpuc":
            import gpuc

            for _ in range(1 + args.warm):
                c, t = time.process_time(), time.perf_counter()
                gpuc.tl.nmf_project(ad, table, block_size=args.block, normalize=True)
                times.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
            usage = ad.obsm["X_nmf_project_normalized"]
        else:
            import contextlib
            import io

            from starcat import starCAT

            for _ in range(1 + args.warm):
                c, t = time.process_time(), time.perf_counter()
                with contextlib.redirect_stdout(io.StringIO()):
                    cat = starCAT(reference=str(tmp / "ref.tsv"))
                    usage, _ = cat.fit_transform(ad)
                times.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
            usage = usage.to_numpy()
            # starCAT's solver iterations (it discards them): the same call on its prepared query, untimed
            from sklearn.decomposition import non_negative_factorization

            with contextlib.redirect_stdout(io.StringIO()):
                prepared = cat.prepare_query(ad)
            kw = {**cat._nmf_kwargs, "H": cat.ref[cat.overlap_genes].values, "n_components": cat.ref.shape[0]}
            out["starcat_mu_iterations"] = int(non_negative_factorization(prepared.X, **kw)[2])
        np.save(tmp / f"{config}.npy", usage)
        out.update(cold_s=times[0], warm_s=H.median(times[1:]) if len(times) > 1 else None, cells=args.small)
        out.update(cold_cpu_s=cpu[0], warm_cpu_s=H.median(cpu[1:]) if len(cpu) > 1 else None, warm_all_s=times[1:])
        out["stored_values"], out["stored_values_selected"] = (
            int(q.nnz),
            int(q[:, ad.var_names.get_indexer(table.index)].nnz),
        )
        out["peak_rss_mb"] = _worker_peak()
    out["load_after"] = H.loadavg()
    return out


def spawn(config: str, tmp: Path, argv: list[str]) -> dict:
    cmd = [sys.executable, __file__, "one", config, str(tmp), *argv]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if res.returncode:
        H.log(res.stderr[-3000:])
        return {"config": config, "error": res.stderr[-500:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---- report ------------------------------------------------------------------------------------------------------------
def render(rep: dict) -> str:
    m, hw, r = rep["machine"], rep["hardware"], rep["runs"]
    lines = [f"Machine: {H.machine_line(m)}; GEMM {hw['gemm_gflops']} GFLOP/s, triad {hw['triad_gbps']} GB/s.", ""]
    lines.append(
        f"Reference: consensus_nmf k={K}, {N_RUNS} runs on pbmc3k (2,638 x 2,000 HVG), {rep['reference']['fit_s']:.1f} s."
    )
    lines.append("")
    rows = []
    for c in ("cpu", "dask"):
        x = r.get(c, {})
        if "wall_s" not in x:
            continue
        peaks = x.get("worker_peak_rss_mb")
        rows.append([c if c == "cpu" else f"dask, {rep['args']['workers']} workers x 1 thread", f"{x['cells']:,}", x["n_blocks"],
                     H.fmt_s(x["wall_s"]), f"{x['cells'] / x['wall_s']:,.0f}", H.fmt_s(x["generate_s_per_pass"]),
                     f"{x['driver_peak_rss_mb']:.0f}", ", ".join(f"{p:.0f}" for p in peaks) if peaks else "-",
                     f"{x['load_before'][0]} / {x['load_after'][0]}"])  # fmt: skip
    lines.append(
        H.md_table(
            [
                "config",
                "cells",
                "blocks",
                "wall",
                "cells/s",
                "generating the cells, one pass",
                "driver peak RSS MB",
                "worker peak RSS MB",
                "load before/after",
            ],
            rows,
        )
    )
    lines.append("")
    g, s = r.get("small-gpuc", {}), r.get("small-starcat", {})
    if "cold_s" in g and "cold_s" in s:

        def cpu(x: dict) -> list[str]:  # CPU seconds (all threads), when the run recorded them
            return [H.fmt_s(x[f]) if x.get(f) is not None else "-" for f in ("cold_cpu_s", "warm_cpu_s")]

        lines.append(H.md_table(
            ["tool", "cells", "cold", "warm (median)", "cold CPU", "warm CPU (median)", "peak RSS MB", "load before/after"],
            [["gpuc nmf_project", f"{g['cells']:,}", H.fmt_s(g["cold_s"]), H.fmt_s(g["warm_s"]), *cpu(g),
              f"{g['peak_rss_mb']:.0f}", f"{g['load_before'][0]} / {g['load_after'][0]}"],
             ["starCAT fit_transform", f"{s['cells']:,}", H.fmt_s(s["cold_s"]), H.fmt_s(s["warm_s"]), *cpu(s),
              f"{s['peak_rss_mb']:.0f}", f"{s['load_before'][0]} / {s['load_after'][0]}"]],
        ))  # fmt: skip
        lines.append("")
        lines.append(
            f"starCAT / gpuc: cold {s['cold_s'] / g['cold_s']:.1f}x, warm {s['warm_s'] / g['warm_s']:.1f}x"
            + (
                f" (CPU time: cold {s['cold_cpu_s'] / g['cold_cpu_s']:.1f}x, warm {s['warm_cpu_s'] / g['warm_cpu_s']:.1f}x)"
                if g.get("warm_cpu_s") and s.get("warm_cpu_s")
                else ""
            )
            + "; "
            f"normalised usages Pearson per programme min {min(rep['pearson']):.5f}; starCAT's MU solver stopped "
            f"after {s.get('starcat_mu_iterations', '?')} iterations (tol 1e-4). Peak RSS: VmHWM reset before the "
            "call (pbmc3k and the libraries loaded before it are not counted)."
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cells", type=int, default=1_000_000)
    p.add_argument("--block", type=int, default=20_000)
    p.add_argument("--small", type=int, default=20_000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--configs", default="small-gpuc,small-starcat,cpu,dask")
    p.add_argument("--out", default=str(HERE / "results" / "nmf_project"))
    if len(sys.argv) > 1 and sys.argv[1] == "one":
        config, tmp = sys.argv[2], Path(sys.argv[3])
        args = p.parse_args(sys.argv[4:])
        print(json.dumps(one(config, tmp, args)))
        return
    args = p.parse_args()
    argv = [
        f"--cells={args.cells}",
        f"--block={args.block}",
        f"--small={args.small}",
        f"--workers={args.workers}",
        f"--warm={args.warm}",
    ]
    rep: dict = {"machine": H.machine(), "hardware": H.hardware_limits(), "args": vars(args), "runs": {}}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        reference_table(tmp)
        rep["reference"] = json.loads((tmp / "ref.json").read_text())
        for c in args.configs.split(","):
            if c == "small-starcat":
                try:
                    import starcat  # noqa: F401
                except ImportError:
                    H.log("starcatpy not installed: no starCAT rows")
                    continue
            H.log(f"running {c}")
            rep["runs"][c] = spawn(c, tmp, argv)
            H.log(json.dumps(rep["runs"][c]))
        if (tmp / "small-gpuc.npy").exists() and (tmp / "small-starcat.npy").exists():
            a, b = np.load(tmp / "small-gpuc.npy"), np.load(tmp / "small-starcat.npy")
            rep["pearson"] = [float(np.corrcoef(a[:, i], b[:, i])[0, 1]) for i in range(a.shape[1])]
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(rep, indent=1))
    text = render(rep)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
