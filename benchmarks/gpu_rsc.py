"""GPU check: pbmc3k as rapids-singlecell leaves it on the device, through every gpuc tool, against the CPU.

rapids-singlecell itself needs cuML, which the GPU machine cannot install, so its preprocessing is done with Scanpy
on the host and the result is put on the device the way ``rsc.get.anndata_to_GPU(adata, convert_all=True)``
leaves it (``X`` and every layer as cupyx CSR, through :func:`gpuc.get.to_gpu`), plus ``obsm['X_pca']`` as a CuPy
array (where ``rsc.pp.pca`` leaves it). Every tool then runs on the device-resident AnnData (``device`` left at its
default: the data select the GPU) and on a host copy with ``device="cpu"``; the script records per tool the
warm seconds on each (the median of the calls after the first; ``GPUC_RSC_CALLS`` calls on each device, default 3)
and the first call's, the agreement, and whether the inputs stayed on the device. Writes ``$OUT/rsc_gpu.json`` and
``$OUT/rsc_gpu.md`` (``_harness.gpu_main``); exit status 1 when a tool fails or disagrees.

    OUT=/tmp/out python benchmarks/gpu_rsc.py
    OUT=/tmp/out python benchmarks/gpu_rsc.py --smoke   # 300 cells on the stand-in GPU (no CuPy needed)
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # first: smoke mode must be set up before numba is imported
import numpy as np
import pandas as pd
from _harness import SMOKE, log, timed

CALLS = max(1, int(os.environ.get("GPUC_RSC_CALLS", "3")))


def prepare():
    """pbmc3k after the standard Scanpy (= rapids-singlecell) preprocessing, on the host (smoke: 300 cells)."""
    import scanpy as sc

    import gpuc

    a = gpuc.datasets.pbmc3k()
    a = a[a.obs["cell_type"].notna()].copy()
    if SMOKE:
        a = a[:300].copy()
        a = a[:, np.asarray(a.layers["counts"].sum(0)).ravel() >= 10].copy()
    a.layers["counts"] = a.layers["counts"].astype(np.float32)  # cupyx sparse holds float data only
    a.X = a.layers["counts"].copy()
    sc.pp.normalize_total(a, target_sum=1e4)
    sc.pp.log1p(a)
    sc.pp.highly_variable_genes(a, n_top_genes=200 if SMOKE else 2000)
    sc.pp.pca(a, n_comps=20 if SMOKE else 50, mask_var="highly_variable")
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


def run(report: dict, name: str, cpu_fn, gpu_fn, compare) -> None:
    """Time ``cpu_fn`` and ``gpu_fn`` (each returns its result), compare them, record; errors are recorded too.

    ``cpu_s`` / ``gpu_s`` are warm: the median of the calls after the first (the first call's when there is only
    one); ``cpu_first_s`` / ``gpu_first_s`` the first call of each in this process.
    """
    r: dict = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for dev, fn in (("cpu", cpu_fn), ("gpu", gpu_fn)):
                t = timed(fn, CALLS, dev=dev)
                warm = _harness.median(t["all"][1:]) if len(t["all"]) > 1 else t["all"][0]
                r.update({f"{dev}_s": round(warm, 4), f"{dev}_first_s": round(t["all"][0], 4)})
                r[dev] = t["out"]
        r["calls"] = len(t["all"])
        r.update(compare(r.pop("gpu"), r.pop("cpu")))
    except Exception as err:
        r = {k: v for k, v in r.items() if k not in ("cpu", "gpu")}
        r["error"] = f"{type(err).__name__}: {err}"
        r["traceback"] = traceback.format_exc()[-2000:]
    report["tools"][name] = r
    log(name, {k: v for k, v in r.items() if k != "traceback"})


def tools(report: dict, args) -> None:
    import gpuc
    from gpuc._backend import is_cupy_array

    report["tools"] = {}
    host = prepare()
    dev = on_device(host)
    report["shape"] = list(host.shape)
    log("pbmc3k:", host.shape, "X on device:", is_cupy_array(dev.X), "X_pca on device:",
        is_cupy_array(dev.obsm["X_pca"]))  # fmt: skip
    kw_mc = {"random_state": 0, **({"max_iter": 3, "min_iter": 2} if SMOKE else {})}

    def mc_cmp(got, want):
        lab_g, lab_c = got.obs["metacell"].astype(str), want.obs["metacell"].astype(str)
        return {
            "device": got.uns["metacell"]["device"],
            "label_agreement": float((lab_g == lab_c).mean()),
            "rss_rel_diff": abs(got.uns["metacell"]["rss"][-1] / want.uns["metacell"]["rss"][-1] - 1),
            "ok": got.uns["metacell"]["device"] == "gpu" and float((lab_g == lab_c).mean()) >= 0.95,
        }

    run(
        report,
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
        report,
        "aggregate_metacells",
        lambda: gpuc.tl.aggregate_metacells(host, layer="counts"),
        lambda: gpuc.tl.aggregate_metacells(dev, layer="counts"),
        agg_cmp,
    )

    def q_cmp(got, want):
        d = float(np.nanmax(np.abs(got["compactness"] - want["compactness"]) / np.abs(want["compactness"])))
        return {"compactness_max_rel_diff": d, "ok": d < 1e-3}

    run(
        report,
        "metacell_quality",
        lambda: gpuc.tl.metacell_quality(host, celltype_key="cell_type", inplace=False, device="cpu"),
        lambda: gpuc.tl.metacell_quality(dev, celltype_key="cell_type", inplace=False),
        q_cmp,
    )
    kw_nmf = {"layer": "counts", "preprocessing": "sd", "n_runs": 3 if SMOKE else 10, "random_state": 0}

    def sweep_cmp(got, want):
        tg, tc = got.uns["nmf_k_sweep"]["table"], want.uns["nmf_k_sweep"]["table"]
        d = float(np.max(np.abs(tg["stability"] - tc["stability"])))
        return {"device": got.uns["nmf_k_sweep"]["device"], "stability_max_abs_diff": d, "ok": d < 0.05}

    run(
        report,
        "nmf_k_sweep",
        lambda: gpuc.tl.nmf_k_sweep(host, k_range=range(2, 4 if SMOKE else 7), device="cpu", copy=True, **kw_nmf),
        lambda: gpuc.tl.nmf_k_sweep(dev, k_range=range(2, 4 if SMOKE else 7), copy=True, **kw_nmf),
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
        report,
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
        pb["gpu"] = gpuc.tl.pseudobulk(dev, "sample", groupby="cell_type", layer="counts", min_cells=2 if SMOKE else 10)
        return pb["gpu"]

    run(
        report,
        "pseudobulk",
        lambda: gpuc.tl.pseudobulk(host, "sample", groupby="cell_type", layer="counts", min_cells=2 if SMOKE else 10),
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
            report,
            "deseq",
            lambda: gpuc.tl.deseq(mono, "~condition", contrast=["condition", "b", "a"], device="cpu", copy=True),
            lambda: gpuc.tl.deseq(mono, "~condition", contrast=["condition", "b", "a"], device="gpu", copy=True),
            de_cmp,
        )

        def vst_cmp(got, want):
            d = float(np.max(np.abs(got.layers["vst"] - want.layers["vst"])))
            return {"max_abs_diff": d, "ok": d < 1e-6}

        run(
            report,
            "vst",
            lambda: gpuc.tl.vst(mono, device="cpu", copy=True),
            lambda: gpuc.tl.vst(gpuc.get.to_gpu(mono, copy=True), copy=True),
            vst_cmp,
        )
    report["inputs_still_on_device"] = bool(is_cupy_array(dev.X) and is_cupy_array(dev.layers["counts"]))


def render(report: dict) -> str:
    lines = [
        f"GPU: {report.get('device')} (CuPy {report.get('cupy')}); pbmc3k {report.get('shape')} on the device as "
        "rsc.get.anndata_to_GPU(convert_all=True) leaves it, X_pca as CuPy",
        "",
    ]
    rows = []
    for name, r in report.get("tools", {}).items():
        if "error" in r:
            rows.append([name, "", "", "", "", f"error: {r['error'][:100]}", "no"])
            continue
        skip = ("cpu_s", "gpu_s", "ok", "cpu_first_s", "gpu_first_s", "calls")
        agree = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k not in skip)
        rows.append([name, r["cpu_s"], r["gpu_s"], r.get("cpu_first_s", "-"), r.get("gpu_first_s", "-"), agree,
                     "yes" if r.get("ok") else "NO"])  # fmt: skip
    head = ["tool", "CPU s (warm)", "GPU s (warm)", "CPU first call s", "GPU first call s", "agreement", "ok"]
    lines += [_harness.md_table(head, rows), f"inputs still on the device after every tool: "
              f"{report.get('inputs_still_on_device')}"]  # fmt: skip
    lines += [f"- {e}" for e in report.get("errors", [])]
    return "\n".join(lines) + "\n"


SCRIPT = _harness.GpuScript(
    name="rsc_gpu",
    steps=[tools],
    render=render,
    ok=lambda r: bool(r.get("inputs_still_on_device")) and all(t.get("ok") for t in r.get("tools", {}).values()),
)

if __name__ == "__main__":
    sys.exit(_harness.gpu_main(SCRIPT, __file__))
