"""Prepared GPU check: pbmc3k as rapids-singlecell leaves it on the device, through every gpuc tool, against the CPU.

rapids-singlecell itself needs cuML, which the GPU machine cannot install, so its preprocessing is done with Scanpy
on the host and the result is put on the device the way ``rsc.get.anndata_to_GPU(adata, convert_all=True)``
leaves it (``X`` and every layer as cupyx CSR, through :func:`gpuc.get.to_gpu`), plus ``obsm['X_pca']`` as a CuPy
array (where ``rsc.pp.pca`` leaves it). Every tool then runs on the device-resident AnnData (``device`` left at its
default: the data select the GPU) and on a host copy with ``device="cpu"``; the script records per tool the
warm seconds on each (the median of the calls after the first; ``GPUC_RSC_CALLS`` calls on each device, default 3)
and the first call's, the agreement, and whether the inputs stayed on the device. Writes ``$OUT/rsc_gpu.json`` and
``$OUT/rsc_gpu.md``; exit status 1 when a tool fails or disagrees.

    OUT=/tmp/out python benchmarks/gpu_rsc.py
    GPUC_STANDIN=1 OUT=/tmp/out python benchmarks/gpu_rsc.py   # dry run on the stand-in GPU (no CuPy needed)
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
OUT = Path(os.environ.get("OUT", ROOT / "gpu_results"))
OUT.mkdir(parents=True, exist_ok=True)
REPORT: dict = {"tools": {}}
CALLS = max(1, int(os.environ.get("GPUC_RSC_CALLS", "3")))


def log(*a: object) -> None:
    print(*a, flush=True)


def save() -> None:
    (OUT / "rsc_gpu.json").write_text(json.dumps(REPORT, indent=1, default=str))


def prepare():
    """pbmc3k after the standard Scanpy (= rapids-singlecell) preprocessing, on the host."""
    import scanpy as sc

    import gpuc

    a = gpuc.datasets.pbmc3k()
    a = a[a.obs["cell_type"].notna()].copy()
    a.layers["counts"] = a.layers["counts"].astype(np.float32)  # cupyx sparse holds float data only
    a.X = a.layers["counts"].copy()
    sc.pp.normalize_total(a, target_sum=1e4)
    sc.pp.log1p(a)
    sc.pp.highly_variable_genes(a, n_top_genes=2000)
    sc.pp.pca(a, n_comps=50, mask_var="highly_variable")
    rng = np.random.default_rng(0)
    a.obs["sample"] = pd.Categorical(rng.choice([f"d{i}" for i in range(6)], a.n_obs))
    a.obs["condition"] = pd.Categorical(a.obs["sample"].map(lambda s: "a" if s in ("d0", "d1", "d2") else "b"))
    return a


def on_device(a):
    import gpuc
    from gpuc._backend import get_backend

    d = gpuc.get.to_gpu(a, convert_all=True, copy=True)
    d.obsm["X_pca"] = get_backend("gpu").asarray(d.obsm["X_pca"])
    return d


def _timed(fn, calls: int, sync) -> tuple[object, float, float]:
    """``calls`` calls of ``fn``: (last result, the first call's seconds, the median of the later calls' seconds, or
    the first call's when there is only one)."""
    times, out = [], None
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    warm = float(np.median(times[1:])) if len(times) > 1 else times[0]
    return out, times[0], warm


def run(name: str, cpu_fn, gpu_fn, compare) -> None:
    """Time ``cpu_fn`` and ``gpu_fn`` (each returns its result), compare them, record; errors are recorded too.

    ``cpu_s`` / ``gpu_s`` are warm: the median of the calls after the first (``GPUC_RSC_CALLS``, default 3 calls on
    each device); ``cpu_first_s`` / ``gpu_first_s`` the first call of each in this process.
    """
    from gpuc._backend import get_backend

    gpu = get_backend("gpu")
    r: dict = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want, first, warm = _timed(cpu_fn, CALLS, lambda: None)
            r.update(cpu_s=round(warm, 4), cpu_first_s=round(first, 4))
            got, first, warm = _timed(gpu_fn, CALLS, gpu.synchronize)
            r.update(gpu_s=round(warm, 4), gpu_first_s=round(first, 4), calls=CALLS)
        r.update(compare(got, want))
    except Exception as err:
        r["error"] = f"{type(err).__name__}: {err}"
        r["traceback"] = traceback.format_exc()[-2000:]
    REPORT["tools"][name] = r
    log(name, {k: v for k, v in r.items() if k != "traceback"})
    save()


def main() -> int:
    import gpuc
    from gpuc._backend import is_cupy_array

    if os.environ.get("GPUC_STANDIN"):  # dry run of this script on a machine without a GPU
        REPORT["device"], REPORT["cupy"] = "stand-in GPU (gpuc._testing.standin)", "none"
    else:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        REPORT["device"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        REPORT["cupy"] = cupy.__version__
    t0 = time.perf_counter()
    host = prepare()
    dev = on_device(host)
    REPORT["prepare_s"] = round(time.perf_counter() - t0, 2)
    REPORT["shape"] = list(host.shape)
    log(
        "pbmc3k:",
        host.shape,
        "X on device:",
        is_cupy_array(dev.X),
        "X_pca on device:",
        is_cupy_array(dev.obsm["X_pca"]),
    )
    kw_mc = {"random_state": 0}

    def mc_cmp(got, want):
        lab_g, lab_c = got.obs["metacell"].astype(str), want.obs["metacell"].astype(str)
        return {
            "device": got.uns["metacell"]["device"],
            "label_agreement": float((lab_g == lab_c).mean()),
            "rss_rel_diff": abs(got.uns["metacell"]["rss"][-1] / want.uns["metacell"]["rss"][-1] - 1),
            "ok": got.uns["metacell"]["device"] == "gpu" and float((lab_g == lab_c).mean()) >= 0.95,
        }

    run(
        "metacells",
        lambda: gpuc.tl.metacells(host, device="cpu", copy=True, **kw_mc),
        lambda: gpuc.tl.metacells(dev, copy=True, **kw_mc),
        mc_cmp,
    )
    # the rest runs on the CPU fit's metacells for both, so the tools themselves are compared
    if "metacell" not in host.obs:
        gpuc.tl.metacells(host, device="cpu", **kw_mc)
    for k in ("metacell",):
        dev.obs[k] = host.obs[k]
        for slot in ("obsm", "obsp"):
            for key in list(getattr(host, slot)):
                if key.startswith(k):
                    getattr(dev, slot)[key] = getattr(host, slot)[key]
        dev.uns[k] = host.uns[k]

    def agg_cmp(got, want):
        diff = abs(got.X - want.X).max()
        return {"max_abs_diff": float(diff), "ok": bool(diff <= 1e-6 * abs(want.X).max())}

    run(
        "aggregate_metacells",
        lambda: gpuc.tl.aggregate_metacells(host, layer="counts"),
        lambda: gpuc.tl.aggregate_metacells(dev, layer="counts"),
        agg_cmp,
    )

    def q_cmp(got, want):
        d = float(np.nanmax(np.abs(got["compactness"] - want["compactness"]) / np.abs(want["compactness"])))
        return {"compactness_max_rel_diff": d, "ok": d < 1e-3}

    run(
        "metacell_quality",
        lambda: gpuc.tl.metacell_quality(host, celltype_key="cell_type", inplace=False, device="cpu"),
        lambda: gpuc.tl.metacell_quality(dev, celltype_key="cell_type", inplace=False),
        q_cmp,
    )
    kw_nmf = {"layer": "counts", "preprocessing": "sd", "n_runs": 10, "random_state": 0}

    def sweep_cmp(got, want):
        tg, tc = got.uns["nmf_k_sweep"]["table"], want.uns["nmf_k_sweep"]["table"]
        d = float(np.max(np.abs(tg["stability"] - tc["stability"])))
        return {"device": got.uns["nmf_k_sweep"]["device"], "stability_max_abs_diff": d, "ok": d < 0.05}

    run(
        "nmf_k_sweep",
        lambda: gpuc.tl.nmf_k_sweep(host, k_range=range(2, 7), device="cpu", copy=True, **kw_nmf),
        lambda: gpuc.tl.nmf_k_sweep(dev, k_range=range(2, 7), copy=True, **kw_nmf),
        sweep_cmp,
    )

    def cnmf_cmp(got, want):
        sg, sc_ = got.varm["nmf_spectra"], want.varm["nmf_spectra"]
        cos = (sg * sc_).sum(0) / (np.linalg.norm(sg, axis=0) * np.linalg.norm(sc_, axis=0))
        return {
            "device": got.uns["nmf"]["device"],
            "min_spectra_cosine": float(cos.min()),
            "ok": float(cos.min()) > 0.99,
        }

    run(
        "consensus_nmf",
        lambda: gpuc.tl.consensus_nmf(host, 7, device="cpu", copy=True, **kw_nmf),
        lambda: gpuc.tl.consensus_nmf(dev, 7, copy=True, **kw_nmf),
        cnmf_cmp,
    )

    def pb_cmp(got, want):
        same = bool(np.array_equal(got.X, want.X) and got.obs.equals(want.obs))
        return {"equal": same, "ok": same}

    pb = {}

    def pb_gpu():
        pb["gpu"] = gpuc.tl.pseudobulk(dev, "sample", groupby="cell_type", layer="counts", min_cells=10)
        return pb["gpu"]

    run(
        "pseudobulk",
        lambda: gpuc.tl.pseudobulk(host, "sample", groupby="cell_type", layer="counts", min_cells=10),
        pb_gpu,
        pb_cmp,
    )
    if "gpu" in pb:
        mono = pb["gpu"][pb["gpu"].obs["cell_type"] == pb["gpu"].obs["cell_type"].value_counts().index[0]].copy()
        mono = mono[:, np.asarray(mono.X.sum(0)).ravel() >= 10].copy()

        def de_cmp(got, want):
            rg, rc = gpuc.get.deseq_results(got), gpuc.get.deseq_results(want)
            ok = np.isfinite(rc["log2FoldChange"]) & (rc["log2FoldChange"].abs() > 1e-8)
            d = float(np.max(np.abs(rg["log2FoldChange"][ok] / rc["log2FoldChange"][ok] - 1))) if ok.any() else 0.0
            return {"device": got.uns["deseq"]["device"], "lfc_max_rel_diff": d, "ok": d < 1e-6}

        run(
            "deseq",
            lambda: gpuc.tl.deseq(mono, "~condition", contrast=["condition", "b", "a"], device="cpu", copy=True),
            lambda: gpuc.tl.deseq(mono, "~condition", contrast=["condition", "b", "a"], device="gpu", copy=True),
            de_cmp,
        )

        def vst_cmp(got, want):
            d = float(np.max(np.abs(got.layers["vst"] - want.layers["vst"])))
            return {"max_abs_diff": d, "ok": d < 1e-6}

        run(
            "vst",
            lambda: gpuc.tl.vst(mono, device="cpu", copy=True),
            lambda: gpuc.tl.vst(gpuc.get.to_gpu(mono, copy=True), copy=True),
            vst_cmp,
        )
    REPORT["inputs_still_on_device"] = bool(is_cupy_array(dev.X) and is_cupy_array(dev.layers["counts"]))
    save()
    lines = [
        f"GPU: {REPORT['device']} (CuPy {REPORT['cupy']}); pbmc3k {REPORT['shape']} on the device as "
        "rsc.get.anndata_to_GPU(convert_all=True) leaves it, X_pca as CuPy",
        "",
        "| tool | CPU s (warm) | GPU s (warm) | CPU first call s | GPU first call s | agreement | ok |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    bad = 0
    for name, r in REPORT["tools"].items():
        if "error" in r:
            lines.append(f"| {name} | | | | | error: {r['error'][:100]} | no |")
            bad += 1
            continue
        agree = ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in r.items()
            if k not in ("cpu_s", "gpu_s", "ok", "cpu_first_s", "gpu_first_s", "calls")
        )
        lines.append(
            f"| {name} | {r['cpu_s']} | {r['gpu_s']} | {r['cpu_first_s']} | {r['gpu_first_s']} | {agree} | "
            f"{'yes' if r.get('ok') else 'NO'} |"
        )
        bad += not r.get("ok")
    lines.append("")
    lines.append(f"inputs still on the device after every tool: {REPORT['inputs_still_on_device']}")
    (OUT / "rsc_gpu.md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))
    return 1 if bad or not REPORT["inputs_still_on_device"] else 0


if __name__ == "__main__":
    if os.environ.get("GPUC_STANDIN"):
        from gpuc._testing.standin import use_standin

        with use_standin():
            sys.exit(main())
    sys.exit(main())
