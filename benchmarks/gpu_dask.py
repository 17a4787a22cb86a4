"""GPU check, Dask stage: the tools' independent units on GPU workers give the results of the in-process GPU run.

Starts ``dask_cuda.LocalCUDACluster`` (one worker per visible GPU, CuPy arrays on each); when dask-cuda cannot be
imported (its cuda-core wheel is left out of the carried wheels to stay under 64 MiB) it starts a
``distributed.LocalCluster`` with one worker process per GPU instead and says so. Then, with ``device="gpu"``:
``metacells(groupby=)`` on pbmc3k's PCA split into 4 pseudo-samples, ``deseq(groupby=)`` on a pseudobulk of those,
and ``nmf_k_sweep`` on the top 1,000 genes, each in process and on the cluster, compared for equality.

Writes ``$OUT/dask_gpu.json`` and ``$OUT/dask_gpu.md``. CPU dry run (no GPU): ``GPUC_DASK_DRY=1`` (device="cpu").
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np


def _cluster(n_gpus: int, dry: bool):
    import distributed

    if not dry:
        try:
            from dask_cuda import LocalCUDACluster

            return LocalCUDACluster(threads_per_worker=1, dashboard_address=":0"), "dask_cuda.LocalCUDACluster"
        except Exception as err:  # any failure to start dask-cuda is reported in the output
            why = f"{type(err).__name__}: {err}"
    else:
        why = "dry run"
    cluster = distributed.LocalCluster(
        n_workers=max(1, n_gpus), threads_per_worker=1, processes=True, dashboard_address=":0"
    )
    return cluster, f"distributed.LocalCluster ({why})"


def _same(a, b) -> bool:
    import pandas as pd
    import scipy.sparse as sp

    if isinstance(a, pd.DataFrame):
        return a.equals(b)
    if sp.issparse(a):
        return (a != b).nnz == 0
    return bool(np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True))


def main() -> None:
    import distributed
    import scanpy as sc

    import gpuc

    dry = os.environ.get("GPUC_DASK_DRY") == "1"
    device = "cpu" if dry else "gpu"
    out_dir = Path(os.environ.get("OUT", "gpu_results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    n_gpus = 0
    if not dry:
        import cupy

        n_gpus = cupy.cuda.runtime.getDeviceCount()
    cluster, kind = _cluster(n_gpus, dry)
    client = distributed.Client(cluster)
    report = {"cluster": kind, "workers": len(client.scheduler_info()["workers"]), "device": device, "checks": {}}

    adata = gpuc.datasets.pbmc3k()
    counts = adata.X.copy()
    sc.pp.normalize_total(adata)
    sc.pp.log1p(adata)
    sc.pp.highly_variable_genes(adata, n_top_genes=1000)
    sc.pp.pca(adata, n_comps=30, mask_var="highly_variable")
    adata.layers["counts"] = counts
    adata.obs["sample"] = np.asarray(["s0", "s1", "s2", "s3"])[np.arange(adata.n_obs) % 4]
    adata.obs["condition"] = np.where(np.isin(adata.obs["sample"], ["s0", "s1"]), "a", "b")

    def timed(name, call, compare):
        t0 = time.perf_counter()
        here = call(None)
        t1 = time.perf_counter()
        there = call(client)
        t2 = time.perf_counter()
        report["checks"][name] = {"identical": bool(compare(here, there)), "in_process_s": t1 - t0, "dask_s": t2 - t1}
        print(name, report["checks"][name], flush=True)

    timed(
        "metacells_groupby",
        lambda c: gpuc.tl.metacells(adata, groupby="sample", device=device, client=c, copy=True).obs["metacell"],
        lambda a, b: a.equals(b),
    )
    cell_type = next(c for c in ("cell_type", "louvain", "celltype") if c in adata.obs)
    pb = gpuc.tl.pseudobulk(adata, "sample", groupby=cell_type, layer="counts", min_cells=5)
    keep = pb.obs[cell_type].value_counts()
    pb = pb[pb.obs[cell_type].isin(keep.index[keep == 4])].copy()
    timed(
        "deseq_groupby",
        lambda c: gpuc.tl.deseq(pb, "~condition", groupby=cell_type, device=device, client=c, copy=True),
        lambda a, b: all(
            _same(a.uns["deseq"]["groups"][g]["results"][r], b.uns["deseq"]["groups"][g]["results"][r])
            for g in a.uns["deseq"]["groups"]
            for r in a.uns["deseq"]["groups"][g]["results"]
        ),
    )
    timed(
        "nmf_k_sweep",
        lambda c: gpuc.tl.nmf_k_sweep(adata, range(3, 8), n_runs=6, device=device, client=c, copy=True).uns[
            "nmf_k_sweep"
        ]["table"],
        _same,
    )
    client.close()
    cluster.close()
    report["all_identical"] = all(v["identical"] for v in report["checks"].values())
    (out_dir / "dask_gpu.json").write_text(json.dumps(report, indent=2))
    lines = [f"# Dask on GPU workers ({kind}, {report['workers']} workers, device={device})", ""]
    lines += ["| check | identical | in process (s) | on the cluster (s) |", "| --- | --- | --- | --- |"]
    lines += [
        f"| {n} | {v['identical']} | {v['in_process_s']:.2f} | {v['dask_s']:.2f} |" for n, v in report["checks"].items()
    ]
    (out_dir / "dask_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
