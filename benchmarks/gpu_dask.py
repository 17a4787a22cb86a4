"""GPU check, Dask stage: the tools' independent units on GPU workers give the results of the in-process GPU run.

Starts ``dask_cuda.LocalCUDACluster`` (one worker per visible GPU, CuPy arrays on each); when dask-cuda cannot be
imported (its cuda-core wheel is left out of the carried wheels to stay under 64 MiB) it starts a
``distributed.LocalCluster`` with one worker process per GPU instead and says so. Then, with ``device="gpu"``:
``metacells(groupby=)`` on pbmc3k's PCA split into 4 pseudo-samples, ``deseq(groupby=)`` on a pseudobulk of those,
and ``nmf_k_sweep`` on the top 1,000 genes, each in process and on the cluster, compared for equality.

Writes ``$OUT/dask_gpu.json`` and ``$OUT/dask_gpu.md`` (``_harness.gpu_main``). ``--smoke``: 400 cells with
``device="cpu"`` on a threaded ``LocalCluster``: not on the stand-in GPU, which patches gpuc's device lookup in
this process only, with a function that distributed cannot pickle (it pickles every task, threads or not).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # first: smoke mode must be set up before numba is imported
import numpy as np
from _harness import SMOKE, log, timed


def cluster():
    """(cluster, what it is): dask-cuda's, else one worker process per GPU; in smoke mode one threaded worker."""
    import distributed

    if SMOKE:
        return distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                        dashboard_address=":0"), "distributed.LocalCluster (threads, smoke)"  # fmt: skip
    try:
        from dask_cuda import LocalCUDACluster

        return LocalCUDACluster(threads_per_worker=1, dashboard_address=":0"), "dask_cuda.LocalCUDACluster"
    except Exception as err:  # any failure to start dask-cuda is reported in the output
        why = f"{type(err).__name__}: {err}"
    import cupy

    n_gpus = cupy.cuda.runtime.getDeviceCount()
    c = distributed.LocalCluster(n_workers=max(1, n_gpus), threads_per_worker=1, processes=True, dashboard_address=":0")
    return c, f"distributed.LocalCluster ({why})"


def same(a, b) -> bool:
    import pandas as pd
    import scipy.sparse as sp

    if isinstance(a, pd.DataFrame):
        return a.equals(b)
    if sp.issparse(a):
        return (a != b).nnz == 0
    return bool(np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True))


def checks(report: dict, args) -> None:
    import distributed
    import scanpy as sc

    import gpuc

    c, kind = cluster()
    client = distributed.Client(c)
    report.update(cluster=kind, workers=len(client.scheduler_info()["workers"]), checks={})
    adata = gpuc.datasets.pbmc3k()
    if SMOKE:
        adata = adata[:400].copy()
    counts = adata.X.copy()
    sc.pp.normalize_total(adata)
    sc.pp.log1p(adata)
    sc.pp.highly_variable_genes(adata, n_top_genes=200 if SMOKE else 1000)
    sc.pp.pca(adata, n_comps=20 if SMOKE else 30, mask_var="highly_variable")
    adata.layers["counts"] = counts
    adata.obs["sample"] = np.asarray(["s0", "s1", "s2", "s3"])[np.arange(adata.n_obs) % 4]
    adata.obs["condition"] = np.where(np.isin(adata.obs["sample"], ["s0", "s1"]), "a", "b")
    dev = "cpu" if SMOKE else "gpu"
    report["tool_device"] = dev
    it = {"max_iter": 3, "min_iter": 2, "n_metacells": 4} if SMOKE else {}

    def check(name, call, compare):
        here, there = timed(lambda: call(None), 1, dev=dev), timed(lambda: call(client), 1, dev=dev)
        report["checks"][name] = {"identical": bool(compare(here["out"], there["out"])), "in_process_s": here["s"],
                                  "dask_s": there["s"]}  # fmt: skip
        log(name, report["checks"][name])

    try:
        check("metacells_groupby",
              lambda c: gpuc.tl.metacells(adata, groupby="sample", device=dev, client=c, copy=True, **it).obs["metacell"],
              lambda a, b: a.equals(b))  # fmt: skip
        cell_type = next(c for c in ("cell_type", "louvain", "celltype") if c in adata.obs)
        pb = gpuc.tl.pseudobulk(adata, "sample", groupby=cell_type, layer="counts", min_cells=5)
        keep = pb.obs[cell_type].value_counts()
        pb = pb[pb.obs[cell_type].isin(keep.index[keep == 4])].copy()
        groups = lambda a: a.uns["deseq"]["groups"]  # noqa: E731
        check("deseq_groupby",
              lambda c: gpuc.tl.deseq(pb, "~condition", groupby=cell_type, device=dev, client=c, copy=True),
              lambda a, b: all(same(groups(a)[g]["results"][r], groups(b)[g]["results"][r])
                               for g in groups(a) for r in groups(a)[g]["results"]))  # fmt: skip
        ks, runs = (range(3, 5), 2) if SMOKE else (range(3, 8), 6)
        check("nmf_k_sweep",
              lambda c: gpuc.tl.nmf_k_sweep(adata, ks, n_runs=runs, device=dev, client=c, copy=True).uns[
                  "nmf_k_sweep"]["table"],
              same)  # fmt: skip
    finally:
        client.close()
        c.close()
    report["all_identical"] = all(v["identical"] for v in report["checks"].values())


def render(report: dict) -> str:
    dev = report.get("tool_device") or report.get("device")  # older runs: "device" was the tools' device
    gpu = f"; {report['device']}" if report.get("tool_device") else ""
    lines = [f"Dask on GPU workers ({report.get('cluster')}, {report.get('workers')} workers, device={dev}{gpu}).", ""]
    rows = [[n, v["identical"], f"{v['in_process_s']:.2f}", f"{v['dask_s']:.2f}"]
            for n, v in report.get("checks", {}).items()]  # fmt: skip
    lines.append(_harness.md_table(["check", "identical", "in process (s)", "on the cluster (s)"], rows))
    lines += [f"- {e}" for e in report.get("errors", [])]
    return "\n".join(lines) + "\n"


SCRIPT = _harness.GpuScript(
    name="dask_gpu", steps=[checks], render=render, ok=lambda r: bool(r.get("all_identical")), standin=False
)

if __name__ == "__main__":
    sys.exit(_harness.gpu_main(SCRIPT, __file__))
