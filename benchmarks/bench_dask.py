"""gpuc on a Dask cluster: in process vs 1 vs 2 local workers, wall time, peak RSS per worker, identical results.

Cases (subcommands), on the atlas written by ``benchmarks/atlas_build.py``:

``pipeline``
    Lazy read (``X`` = ``anndata.experimental.read_elem_lazy`` of the h5ad's ``X``; obs/var loaded),
    ``gpuc.tl.pseudobulk(adata, "sample", groupby="cell_type")`` (a chunked reduction over the cells on the
    workers), then ``gpuc.tl.deseq(pb, "~condition", groupby="cell_type", client=client)`` (one task per cell type);
    true DE genes recovered at padj < 0.05.
``metacells``
    ``gpuc.tl.metacells(adata, groupby="sample", client=client)`` on the first ``--samples`` samples (``X_pca``
    in memory; one task per sample).
``nmf``
    ``gpuc.tl.nmf_k_sweep(adata, range(2, 13), n_runs=20, mask_var=None, client=client)`` on ``--cells`` cells drawn
    from the atlas, top 2,000 HVG, normalize_total + log1p.
``deseq_blocks`` (no atlas)
    One large design as gene blocks: ``gpuc.tl.deseq(adata, "~condition", client=client, copy=True)`` on
    ``--samples`` x ``--genes`` simulated counts (``_deseq_sim.simulate``); the per-gene steps run as gene-block
    tasks on the workers, the global steps in the driver.

Every configuration (``--configs``, default ``inproc,1,2``) runs in this process in turn: ``inproc`` is
``client=None`` (default threads), ``W`` a fresh ``distributed.LocalCluster(n_workers=W, threads_per_worker=1,
processes=True, memory_limit=--memory-limit)``. A thread of this process samples the RSS of this process (the
driver, which also hosts the scheduler) and of every worker process every 0.2 s with psutil; per step we keep the
peaks. Before the timed call each configuration is warmed (imports and numba kernels loaded: a tiny call in this
process, or on every worker with ``client.run``), and that time is reported apart. On a cluster the task stream
(``distributed.get_task_stream``) gives every task's compute and transfer times, and a wrapper around
``gpuc._dask.map_units`` records the bytes of each unit's arguments (shipped with its task) and of the shared
arguments (scattered once to every worker); both feed the scaling projection of docs/benchmarks.md.

    python benchmarks/bench_dask.py pipeline --atlas /work/atlas/atlas_1m.h5ad
    python benchmarks/bench_dask.py metacells --atlas /work/atlas/atlas_1m.h5ad --samples 16
    python benchmarks/bench_dask.py nmf --atlas /work/atlas/atlas_1m.h5ad --cells 50000
    python benchmarks/bench_dask.py deseq_blocks --samples 1000 --genes 60000 --configs inproc,2

Results go to ``benchmarks/results/dask_<case>.json`` and ``.md`` (``--tag`` appends a suffix).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
MACHINE: dict | None = None


# --------------------------------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------------------------------
class RSSMonitor:
    """Peak RSS of named processes (the driver, each worker), sampled every ``interval`` s in a thread, and their
    CPU seconds (with the machine's: what other jobs on a shared machine took)."""

    def __init__(self, interval: float = 0.2) -> None:
        import psutil

        self._psutil = psutil
        self.interval = interval
        self.procs: dict[str, Any] = {"driver": psutil.Process(os.getpid())}
        self.peaks: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def set_workers(self, pids: dict[str, int]) -> None:
        with self._lock:
            self.procs = {"driver": self.procs["driver"]}
            for i, (_, pid) in enumerate(sorted(pids.items())):
                self.procs[f"worker{i}"] = self._psutil.Process(pid)

    def _sample(self) -> None:
        with self._lock:
            for name, proc in self.procs.items():
                try:
                    rss = proc.memory_info().rss
                except self._psutil.Error:
                    continue
                if rss > self.peaks.get(name, 0):
                    self.peaks[name] = rss

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _cpu(self) -> dict[str, float]:
        """CPU seconds (user + system) of each named process, and of the whole machine ("machine")."""
        out = {}
        with self._lock:
            for name, proc in self.procs.items():
                with contextlib.suppress(self._psutil.Error):
                    t = proc.cpu_times()
                    out[name] = t.user + t.system
        t = self._psutil.cpu_times()
        out["machine"] = (
            t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
        )
        return out

    def reset(self) -> None:
        with self._lock:
            self.peaks = {}
        self._cpu0 = self._cpu()
        self._sample()

    def cpu_used(self) -> dict[str, float]:
        """CPU seconds since :meth:`reset`, per process; "others" = the machine's less ours (other jobs)."""
        now = self._cpu()
        d = {k: round(now[k] - self._cpu0.get(k, 0.0), 2) for k in now}
        d["others"] = round(d["machine"] - sum(v for k, v in d.items() if k != "machine"), 2)
        return d

    def snapshot(self) -> dict[str, float]:
        self._sample()
        with self._lock:
            return {k: round(v / 1e9, 3) for k, v in sorted(self.peaks.items())}

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class UnitRecorder:
    """Wraps ``gpuc._dask.map_units`` (where the tools imported it) to record unit and shared argument sizes."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self._patched: list[tuple[Any, Any]] = []

    def __enter__(self) -> UnitRecorder:
        import gpuc._dask as gd

        orig = gd.map_units

        def wrapper(fn, units, *, client, shared=None, **kw):
            t0 = time.perf_counter()
            out = orig(fn, units, client=client, shared=shared, **kw)
            # sizes are measured later (summarize_units), outside the timed step
            self.calls.append(
                {"what": kw.get("what"), "units": units, "shared": dict(shared or {}), "out": out,
                 "wall_s": time.perf_counter() - t0, "on_cluster": client is not None}
            )  # fmt: skip
            return out

        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("gpuc") and getattr(mod, "map_units", None) is orig:
                self._patched.append((mod, orig))
                mod.map_units = wrapper
        return self

    def __exit__(self, *exc: Any) -> None:
        for mod, orig in self._patched:
            mod.map_units = orig


def _pickled(obj: Any) -> int:
    """Bytes of ``obj`` as it travels to or from a worker (cloudpickle, protocol 5, buffers included)."""
    import cloudpickle

    buffers: list = []
    head = cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return len(head) + sum(memoryview(b).nbytes for b in buffers)


def summarize_units(calls: list[dict]) -> list[dict]:
    out = []
    for c in calls:
        b = np.asarray([_pickled(args) for _, args in c["units"]], dtype=float)
        r = np.asarray([_pickled(v) for v in c["out"]], dtype=float)
        out.append(
            {
                "what": c["what"],
                "n_units": len(c["units"]),
                "unit_arg_MB_median": round(float(np.median(b)) / 1e6, 3) if b.size else 0.0,
                "unit_arg_MB_total": round(float(b.sum()) / 1e6, 3),
                "unit_result_MB_median": round(float(np.median(r)) / 1e6, 3) if r.size else 0.0,
                "unit_result_MB_total": round(float(r.sum()) / 1e6, 3),
                "shared_MB": round(_pickled(c["shared"]) / 1e6, 3),
                "map_units_wall_s": round(c["wall_s"], 3),
            }
        )
        c.clear()  # drop the references to the data
    return out


def summarize_tasks(records: list[dict], wall: float | None = None) -> dict:
    """Task stream -> per-prefix counts, compute / transfer seconds, result bytes, busy span."""
    groups: dict[str, dict] = {}
    starts, stops = [], []
    for r in records:
        key = r["key"]
        key = key[0] if isinstance(key, tuple) else key
        key = str(key)
        prefix = key.split("-")[0] if not key.startswith("gpuc-") else "-".join(key.split("-")[:2])
        if "grouped-sum" in key or key.startswith(("gpuc-grouped", "sum-", "gpuc-count")):
            prefix = key.rsplit("-", 1)[0][:40]
        g = groups.setdefault(prefix, {"n": 0, "compute": [], "transfer_s": 0.0, "nbytes": []})
        g["n"] += 1
        comp = 0.0
        for ss in r.get("startstops", ()):
            d = ss["stop"] - ss["start"]
            if ss["action"] == "compute":
                comp += d
                starts.append(ss["start"])
                stops.append(ss["stop"])
            elif ss["action"] == "transfer":
                g["transfer_s"] += d
        g["compute"].append(comp)
        g["nbytes"].append(r.get("nbytes", 0))
    out = {}
    for p, g in groups.items():
        c = np.asarray(g["compute"])
        out[p] = {
            "n_tasks": g["n"],
            "compute_s_total": round(float(c.sum()), 3),
            "compute_s_median": round(float(np.median(c)), 4),
            "compute_s_max": round(float(c.max()), 4),
            "transfer_s_total": round(g["transfer_s"], 3),
            "result_MB_median": round(float(np.median(g["nbytes"])) / 1e6, 4),
        }
    summ = {"by_prefix": out, "n_tasks": len(records)}
    # every gpuc unit (a group, a rank's restarts): its label, compute seconds and worker, for the projection
    units = []
    for r in records:
        key = str(r["key"][0] if isinstance(r["key"], tuple) else r["key"])
        if key.startswith("gpuc-") and not key.startswith(("gpuc-grouped", "gpuc-count")):
            comp = sum(ss["stop"] - ss["start"] for ss in r.get("startstops", ()) if ss["action"] == "compute")
            units.append({"key": key.split("-", 4)[-1], "compute_s": round(comp, 4), "worker": r.get("worker")})
    summ["units"] = units
    if starts:
        summ["first_start_to_last_stop_s"] = round(max(stops) - min(starts), 3)
    return summ


@contextlib.contextmanager
def cluster(n_workers: int, memory_limit: str, mon: RSSMonitor):
    from distributed import Client, LocalCluster

    t0 = time.perf_counter()
    lc = LocalCluster(
        n_workers=n_workers,
        threads_per_worker=1,
        processes=True,
        memory_limit=memory_limit,
        dashboard_address=None,
        silence_logs=40,
    )
    client = Client(lc)
    client.wait_for_workers(n_workers)
    mon.set_workers(client.run(os.getpid))
    start_s = time.perf_counter() - t0
    try:
        yield client, start_s
    finally:
        client.close()
        lc.close()
        mon.set_workers({})


class Runner:
    """Times steps of one configuration: wall, load average, peak RSS of driver and workers."""

    def __init__(self, mon: RSSMonitor, name: str) -> None:
        self.mon, self.name = mon, name
        self.steps: dict[str, dict] = {}

    @contextlib.contextmanager
    def step(self, label: str):
        la0 = os.getloadavg()
        self.mon.reset()
        t0 = time.perf_counter()
        yield
        wall = time.perf_counter() - t0
        self.steps[label] = {
            "wall_s": round(wall, 3),
            "peak_rss_gb": self.mon.snapshot(),
            "cpu_s": self.mon.cpu_used(),
            "loadavg_before": [round(v, 2) for v in la0],
            "loadavg_after": [round(v, 2) for v in os.getloadavg()],
        }
        print(f"[{self.name}] {label}: {wall:.2f} s  peak RSS {self.steps[label]['peak_rss_gb']}  "
              f"load {self.steps[label]['loadavg_before'][0]:.2f}->{self.steps[label]['loadavg_after'][0]:.2f}  "
              f"CPU s {self.steps[label]['cpu_s']}",
              flush=True)  # fmt: skip


def machine() -> dict:
    import hashlib

    import _harness
    import dask
    import distributed
    import psutil

    import gpuc

    src = Path(gpuc.__file__).parent
    h = hashlib.sha1()
    for f in sorted(src.rglob("*.py")):
        h.update(f.read_bytes())
    return {
        "gpuc_src_sha1": h.hexdigest()[:12],  # the code under test (the tree was being edited during these runs)
        "cpu": _harness.cpu_name(),
        "logical_cpus": os.cpu_count(),
        "affinity": _harness.cores(),
        "ram_gb": round(psutil.virtual_memory().total / 1e9, 1),
        "python": platform.python_version(),
        "gpuc": getattr(gpuc, "__version__", "?"),
        "dask": dask.__version__,
        "distributed": distributed.__version__,
        "anndata": importlib.metadata.version("anndata"),
        "numpy": np.__version__,
    }


# --------------------------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------------------------
def lazy_atlas(path: Path, chunk_rows: int):
    """AnnData with obs/var in memory and X a dask array of CSR chunks read from the h5ad on demand."""
    import anndata as ad
    import h5py

    f = h5py.File(path, "r")
    obs = ad.io.read_elem(f["obs"])
    var = ad.io.read_elem(f["var"])
    true_de = ad.io.read_elem(f["uns/true_de"])
    x = ad.experimental.read_elem_lazy(f["X"], chunks=(chunk_rows, var.shape[0]))
    adata = ad.AnnData(X=x, obs=obs, var=var)
    return adata, true_de, f


def pca_atlas(path: Path, n_samples: int | None):
    """obs + obsm['X_pca'] of the first ``n_samples`` samples, in memory (no X)."""
    import anndata as ad
    import h5py

    with h5py.File(path, "r") as f:
        obs = ad.io.read_elem(f["obs"])
        keep = np.ones(obs.shape[0], bool)
        if n_samples is not None:
            cats = obs["sample"].cat.categories[:n_samples]
            keep = obs["sample"].isin(cats).to_numpy()
        rows = np.flatnonzero(keep)
        pca = f["obsm/X_pca"][rows[0] : rows[-1] + 1][rows - rows[0]]  # cells are stored sample by sample
    obs = obs.iloc[rows].copy()
    obs["sample"] = obs["sample"].cat.remove_unused_categories()
    return ad.AnnData(obs=obs, obsm={"X_pca": np.ascontiguousarray(pca, dtype=np.float32)})


def nmf_matrix(path: Path, n_cells: int, n_hvg: int, seed: int):
    """``n_cells`` random atlas cells, normalize_total + log1p, top ``n_hvg`` seurat HVGs (CSR float32)."""
    import anndata as ad
    import h5py
    import scanpy as sc

    with h5py.File(path, "r") as f:
        obs = ad.io.read_elem(f["obs"])
        var = ad.io.read_elem(f["var"])
        rng = np.random.default_rng(seed)
        rows = np.sort(rng.choice(obs.shape[0], size=min(n_cells, obs.shape[0]), replace=False))
        x = ad.io.sparse_dataset(f["X"])[rows]
    a = ad.AnnData(X=x.astype(np.float32), obs=obs.iloc[rows].copy(), var=var[[]].copy())
    sc.pp.normalize_total(a, target_sum=1e4)
    sc.pp.log1p(a)
    sc.pp.highly_variable_genes(a, n_top_genes=n_hvg, flavor="seurat")
    a = a[:, a.var["highly_variable"].to_numpy()].copy()
    a.X = a.X.tocsr().astype(np.float32)
    return a


# --------------------------------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------------------------------
def _warm_worker_imports() -> int:
    import anndata  # noqa: F401
    import scanpy  # noqa: F401

    import gpuc  # noqa: F401

    return os.getpid()


def _tiny_metacells() -> int:
    import anndata as ad

    import gpuc

    rng = np.random.default_rng(0)
    a = ad.AnnData(obs={"g": np.repeat(["a"], 300)}, obsm={"X_pca": rng.standard_normal((300, 10)).astype(np.float32)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpuc.tl.metacells(a, 4, n_jobs=1)
    return os.getpid()


def _tiny_nmf() -> int:
    import anndata as ad
    import scipy.sparse as sp

    import gpuc

    x = sp.random(200, 50, density=0.3, random_state=0, format="csr", dtype=np.float32)
    a = ad.AnnData(X=x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpuc.tl.nmf_k_sweep(a, range(2, 4), n_runs=3, mask_var=None, n_jobs=1)
    return os.getpid()


def _tiny_deseq() -> int:
    import gpuc

    pb = gpuc.datasets.pasilla()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpuc.tl.deseq(pb, "~condition", n_jobs=1)
    return os.getpid()


def warm(client: Any, fns: list) -> float:
    t0 = time.perf_counter()
    for fn in fns:
        if client is None:
            fn()
        else:
            client.run(fn)
    return round(time.perf_counter() - t0, 3)


def run_configs(args: argparse.Namespace, case_fn, warm_fns: list, mon: RSSMonitor) -> dict:
    from distributed import get_task_stream

    out: dict[str, Any] = {}
    for cfg in args.configs.split(","):
        name = "in-process" if cfg == "inproc" else f"{cfg} worker{'s' if cfg != '1' else ''}"
        reps = []
        for rep in range(args.repeats):
            runner = Runner(mon, f"{name} #{rep + 1}")
            info: dict[str, Any] = {}
            if cfg == "inproc":
                info["warm_s"] = warm(None, warm_fns)
                with UnitRecorder() as ur:
                    result = case_fn(None, runner)
                info["units"] = summarize_units(ur.calls)
            else:
                with cluster(int(cfg), args.memory_limit, mon) as (client, start_s):
                    info["cluster_start_s"] = round(start_s, 3)
                    info["warm_s"] = warm(client, [_warm_worker_imports, *warm_fns])
                    with UnitRecorder() as ur, get_task_stream(client=client) as ts:
                        result = case_fn(client, runner)
                    info["units"] = summarize_units(ur.calls)
                    info["tasks"] = summarize_tasks(ts.data)
            info["steps"] = runner.steps
            info["check"] = result.pop("_check_summary", None)
            reps.append((info, result))
        out[name] = {"repeats": [r[0] for r in reps], "result": reps[0][1]}
    return out


def compare(results: dict, fields: list[str]) -> dict:
    """Whether every configuration's result arrays equal the first's (np.array_equal, NaN == NaN)."""
    names = list(results)
    ref = results[names[0]]["result"]
    eq = {}
    for n in names[1:]:
        r = results[n]["result"]
        eq[n] = {}
        for fld in fields:
            a, b = np.asarray(ref[fld]), np.asarray(r[fld])
            same = a.shape == b.shape and (
                np.array_equal(a, b, equal_nan=True) if a.dtype.kind == "f" else np.array_equal(a, b)
            )
            eq[n][fld] = bool(same)
            if not same and a.shape == b.shape and a.dtype.kind == "f":
                eq[n][fld + "_max_abs_diff"] = float(np.nanmax(np.abs(a - b)))
    return {"reference": names[0], "identical": eq}


def case_pipeline(args: argparse.Namespace, mon: RSSMonitor) -> dict:
    import gpuc

    def run(client, runner):
        adata, true_de, fh = lazy_atlas(args.atlas, args.chunk_rows)
        try:
            with runner.step("pseudobulk"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pb = gpuc.tl.pseudobulk(adata, "sample", groupby="cell_type")
            with runner.step("deseq"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                gpuc.tl.deseq(pb, "~condition", groupby="cell_type", client=client)
        finally:
            fh.close()
        padj, lfc, rec = [], [], {}
        for ct in sorted(pb.obs["cell_type"].cat.categories):
            try:
                r = gpuc.get.deseq_results(pb, group=ct)
            except (KeyError, ValueError):
                continue
            padj.append(r["padj"].to_numpy())
            lfc.append(r["log2FoldChange"].to_numpy())
            sig = r.index[(r["padj"] < 0.05).to_numpy()]
            t = true_de[true_de["cell_type"] == ct]
            hit = t[t["gene"].isin(sig)]
            sign_ok = int((np.sign(r.loc[hit["gene"], "log2FoldChange"].to_numpy()) == np.sign(hit["log2fc"])).sum())
            rec[ct] = {
                "n_sig": len(sig),
                "n_true": len(t),
                "true_found": len(hit),
                "true_found_right_sign": sign_ok,
                "false_pos": len(set(sig) - set(t["gene"])),
            }
        return {
            "pb_X": pb.X,
            "padj": np.concatenate(padj),
            "lfc": np.concatenate(lfc),
            "_check_summary": {"pb_shape": list(pb.shape), "recovery": rec},
        }

    with lazy_atlas_info(args) as meta:
        res = run_configs(args, run, [_tiny_deseq], mon)
    res["_meta"] = meta
    return res


@contextlib.contextmanager
def lazy_atlas_info(args):
    adata, true_de, fh = lazy_atlas(args.atlas, args.chunk_rows)
    meta = {
        "shape": list(adata.shape),
        "X": repr(adata.X),
        "n_chunks": int(adata.X.numblocks[0]),
        "nnz": int(fh["X/data"].shape[0]),
        "file_GB": round(args.atlas.stat().st_size / 1e9, 2),
        "n_true_de": len(true_de),
    }
    fh.close()
    yield meta


def case_metacells(args: argparse.Namespace, mon: RSSMonitor) -> dict:
    import gpuc

    adata = pca_atlas(args.atlas, args.samples)
    sizes = adata.obs["sample"].value_counts()
    meta = {
        "n_cells": adata.n_obs,
        "n_samples": int(sizes.size),
        "cells_per_sample_median": float(sizes.median()),
        "X_pca": list(adata.obsm["X_pca"].shape),
    }

    def run(client, runner):
        a = adata.copy()
        with runner.step("metacells"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gpuc.tl.metacells(a, groupby="sample", client=client)
        return {"labels": a.obs["metacell"].astype(str).to_numpy()}

    res = run_configs(args, run, [_tiny_metacells], mon)
    res["_meta"] = meta
    return res


def case_nmf(args: argparse.Namespace, mon: RSSMonitor) -> dict:
    import gpuc

    t0 = time.perf_counter()
    adata = nmf_matrix(args.atlas, args.cells, args.hvg, args.seed)
    meta = {
        "shape": list(adata.shape),
        "nnz": int(adata.X.nnz),
        "prep_s": round(time.perf_counter() - t0, 2),
        "k_range": [2, 12],
        "n_runs": args.n_runs,
    }

    def run(client, runner):
        a = adata.copy()
        with runner.step("nmf_k_sweep"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gpuc.tl.nmf_k_sweep(a, range(2, 13), n_runs=args.n_runs, mask_var=None, client=client)
        tab = a.uns["nmf_k_sweep"]["table"]
        return {
            "stability": tab["stability"].to_numpy(float),
            "median_error": tab["median_error"].to_numpy(float),
            "best_error": tab["best_error"].to_numpy(float),
            "_check_summary": {
                "suggested_k": int(a.uns["nmf_k_sweep"]["suggested_k"]),
                "table": tab[["k", "stability", "median_error", "n_converged"]].round(5).to_dict("list"),
            },
        }

    res = run_configs(args, run, [_tiny_nmf], mon)
    res["_meta"] = meta
    return res


def case_deseq_blocks(args: argparse.Namespace, mon: RSSMonitor) -> dict:
    import anndata as ad
    from _deseq_sim import simulate

    import gpuc
    from gpuc.deseq._blocks import default_block_genes

    counts, obs, _ = simulate(args.samples, args.genes, seed=args.seed)
    adata = ad.AnnData(counts, obs=obs)
    adata.var_names = [f"g{j}" for j in range(adata.n_vars)]
    meta = {"shape": list(adata.shape), "gene_blocks": -(-adata.n_vars // default_block_genes(adata.n_obs))}

    def run(client, runner):
        with runner.step("deseq"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = gpuc.tl.deseq(adata, "~condition", client=client, copy=True)
        r = gpuc.get.deseq_results(out)
        cols = ("baseMean", "log2FoldChange", "lfcSE", "stat", "pvalue", "padj")
        return {c: r[c].to_numpy(float) for c in cols} | {
            "_check_summary": {"n_padj_0.05": int((r["padj"] < 0.05).sum())}
        }

    res = run_configs(args, run, [_tiny_deseq], mon)
    res["_meta"] = meta
    return res


CASES = {
    "pipeline": (case_pipeline, ["pb_X", "padj", "lfc"], ["pseudobulk", "deseq"]),
    "metacells": (case_metacells, ["labels"], ["metacells"]),
    "nmf": (case_nmf, ["stability", "median_error", "best_error"], ["nmf_k_sweep"]),
    "deseq_blocks": (
        case_deseq_blocks,
        ["baseMean", "log2FoldChange", "lfcSE", "stat", "pvalue", "padj"],
        ["deseq"],
    ),
}


# --------------------------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------------------------
def _med(vals: list[float]) -> float:
    return float(np.median(vals))


def table_md(case: str, res: dict, steps: list[str]) -> str:
    lines = []
    configs = [k for k in res if not k.startswith("_")]
    head = "| configuration | " + " | ".join(f"{s} wall (s)" for s in steps)
    head += " | peak RSS driver (GB) | peak RSS per worker (GB) | speed-up vs 1 worker | load avg before/after |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    t1 = None
    for c in configs:
        reps = res[c]["repeats"]
        walls = {s: _med([r["steps"][s]["wall_s"] for r in reps]) for s in steps}
        total = sum(walls.values())
        if c == "1 worker":
            t1 = total
        drv = max(r["steps"][s]["peak_rss_gb"].get("driver", 0) for r in reps for s in steps)
        wk = {}
        for r in reps:
            for s in steps:
                for k, v in r["steps"][s]["peak_rss_gb"].items():
                    if k.startswith("worker"):
                        wk[k] = max(wk.get(k, 0), v)
        la0 = reps[0]["steps"][steps[0]]["loadavg_before"][0]
        la1 = reps[-1]["steps"][steps[-1]]["loadavg_after"][0]
        sp_ = f"{t1 / total:.2f}x" if t1 and c != "in-process" else "-"
        wks = ", ".join(f"{v:.2f}" for _, v in sorted(wk.items())) or "-"
        lines.append(
            f"| {c} | "
            + " | ".join(f"{walls[s]:.2f}" for s in steps)
            + f" | {drv:.2f} | {wks} | {sp_} | {la0:.2f} / {la1:.2f} |"
        )
    return "\n".join(lines)


def write_report(case: str, args: argparse.Namespace, res: dict, fields: list[str], steps: list[str]) -> None:
    res["_compare"] = compare({k: v for k, v in res.items() if not k.startswith("_")}, fields)
    res["_machine"] = MACHINE or machine()
    res["_args"] = {k: str(v) for k, v in vars(args).items() if k != "func"}
    for k, v in list(res.items()):
        if not k.startswith("_"):
            v["result"] = None  # arrays are compared above; not stored
    tag = f"_{args.tag}" if args.tag else ""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"dask_{case}{tag}.json").write_text(json.dumps(res, indent=1, default=str))
    md = [f"# bench_dask {case}{tag}", "", f"`python benchmarks/bench_dask.py {' '.join(sys.argv[1:])}`", ""]
    m = res["_machine"]
    md += [f"Machine: {m['cpu']}, {m['affinity']} cores, {m['ram_gb']} GB; python {m['python']}, dask "
           f"{m['dask']}, distributed {m['distributed']}, anndata {m['anndata']}. Data: {json.dumps(res['_meta'])}", ""]  # fmt: skip
    md += [f"Medians of {args.repeats} repeat(s).", "", table_md(case, res, steps), ""]
    md += ["Identical to the in-process result: " + json.dumps(res["_compare"]["identical"]), ""]
    for c, v in res.items():
        if c.startswith("_"):
            continue
        r0 = v["repeats"][0]
        md.append(f"- {c}: warm-up {r0.get('warm_s')} s, cluster start {r0.get('cluster_start_s', '-')} s; "
                  f"units {json.dumps(r0.get('units'))}")  # fmt: skip
        if r0.get("tasks"):
            md.append(f"  tasks {json.dumps(r0['tasks'])}")
        if r0.get("check"):
            md.append(f"  check {json.dumps(r0['check'])}")
    (RESULTS / f"dask_{case}{tag}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="case", required=True)
    for name in CASES:
        s = sub.add_parser(name)
        s.add_argument("--atlas", type=Path, default=Path("/work/atlas/atlas_1m.h5ad"))
        s.add_argument("--configs", default="inproc,1,2", help="comma list: inproc and/or numbers of workers")
        s.add_argument("--repeats", type=int, default=1)
        s.add_argument("--memory-limit", default="4GB", help="per worker (LocalCluster memory_limit)")
        s.add_argument("--tag", default="", help="suffix of the result files")
        s.add_argument("--seed", type=int, default=0)
        if name == "pipeline":
            s.add_argument("--chunk-rows", type=int, default=10_000, help="rows per dask chunk of the lazy X")
        if name == "metacells":
            s.add_argument("--samples", type=int, default=16, help="first N samples (the atlas has 200)")
        if name == "deseq_blocks":
            s.add_argument("--samples", type=int, default=1000)
            s.add_argument("--genes", type=int, default=60_000)
        if name == "nmf":
            s.add_argument("--cells", type=int, default=50_000)
            s.add_argument("--hvg", type=int, default=2_000)
            s.add_argument("--n-runs", type=int, default=20)
    args = p.parse_args()
    fn, fields, steps = CASES[args.case]
    global MACHINE
    MACHINE = machine()  # at the start: the gpuc source hash of the code that runs
    print(f"bench_dask {args.case}: load average {os.getloadavg()}, gpuc source {MACHINE['gpuc_src_sha1']}", flush=True)
    mon = RSSMonitor(0.2)
    try:
        res = fn(args, mon)
    finally:
        mon.close()
    write_report(args.case, args, res, fields, steps)


if __name__ == "__main__":
    main()
