"""GPU check, first stage: fill the kernel caches, then measure a fresh process's first call against its warm call.

A fresh device machine has no compiled kernels: CuPy compiles every elementwise/reduction kernel (NVRTC) on first use,
numba-cuda every ``@cuda.jit`` kernel, numba every CPU kernel. Left to the timing stages, that compilation ran the
first H200 run's DESeq2 and NMF stages past their limits. This stage

1. **fill**: runs each tool once on tiny data, on the GPU and on the CPU, with the calls and options the later stages
   use (dtypes, designs, shrinkage, LRT, VST, engine calls with device input, device-resident AnnData), so that
   CuPy's on-disk kernel cache (``CUPY_CACHE_DIR``) and numba's (``NUMBA_CACHE_DIR``, which numba-cuda's
   ``cache=True`` kernels use too) hold every kernel. By default each (tool, device) pair is its own process, all
   at once (compilation is single-threaded per process and the machine has 16 cores); ``GPUC_WARMUP_JOBS=1`` runs
   them one after the other in one process;
2. **measure**: starts a second, fresh process that calls each tool on small data: the first call (which should load
   its kernels from the caches) and two warm calls. The issue's target: the first call within 1 s of the warm call.
   The caches' file counts before and after each first call show whether anything was still compiled.

The process's one-time costs are timed apart and not charged to a tool: the imports, and the CUDA context (a first
CuPy operation). Writes ``$OUT/warmup.json`` and ``$OUT/warmup.md``.

    OUT=/tmp/out python benchmarks/gpu_warmup.py
    GPUC_STANDIN=1 OUT=/tmp/out python benchmarks/gpu_warmup.py   # dry run: the stand-in GPU (no CuPy needed)

Environment: ``CUPY_CACHE_DIR`` / ``NUMBA_CACHE_DIR`` (default ``benchmarks/_work/gpu_cache/{cupy,numba}``, set before
anything imports CuPy or numba; ``gpu_check.sh`` exports them for every stage), ``GPUC_WARMUP_FILL_SECONDS`` (limit of
the fill; default 62% of ``GPUC_STAGE_SECONDS``, the stage's limit that gpu_check.sh sets, else 90),
``GPUC_WARMUP_MEASURE_SECONDS`` (limit of the measuring process; default 30% of the stage's limit, else 60),
``GPUC_WARMUP_JOBS`` (``1``: one fill process).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE_ROOT = HERE / "_work" / "gpu_cache"  # benchmarks/_work/ is git-ignored
os.environ.setdefault("CUPY_CACHE_DIR", str(CACHE_ROOT / "cupy"))
os.environ.setdefault("NUMBA_CACHE_DIR", str(CACHE_ROOT / "numba"))
if os.environ.get("GPUC_STANDIN"):  # the stand-in GPU runs custom kernels under numba-cuda's CUDA simulator
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import scipy.sparse as sp  # noqa: E402

STANDIN = bool(os.environ.get("GPUC_STANDIN"))
OUT = Path(os.environ.get("OUT", ROOT / "gpu_results"))
TOOLS = ("deseq", "nmf", "metacells")
MEASURED = ("tl.deseq", "tl.vst", "tl.consensus_nmf", "tl.nmf_k_sweep", "tl.metacells")
TARGET_S = 1.0


def log(*a: object) -> None:
    print(*a, flush=True)


def cache_census() -> dict[str, int]:
    """Files in the two kernel caches: CuPy's (one per compiled kernel) and numba's ``.nbc`` (one per overload)."""
    out = {}
    for name, var, pattern in (("cupy", "CUPY_CACHE_DIR", "*"), ("numba", "NUMBA_CACHE_DIR", "*.nbc")):
        d = Path(os.environ[var])
        out[name] = sum(1 for p in d.rglob(pattern) if p.is_file()) if d.is_dir() else 0
    return out


def _standin_context():
    if STANDIN:
        from gpuc._testing.standin import use_standin

        return use_standin()
    import contextlib

    return contextlib.nullcontext()


def _sync(dev: str = "gpu") -> None:
    if dev == "gpu":
        from gpuc._backend import get_backend

        get_backend("gpu").synchronize()


def _to_gpu(a):
    import gpuc

    return gpuc.get.to_gpu(a, convert_all=True, copy=True)


# ---- fill: the later stages' calls on tiny data -----------------------------------------------------------------
def _sim_adata(n: int, g: int):
    import anndata as ad
    from _deseq_sim import simulate

    counts, meta, _ = simulate(n, g, seed=0)
    a = ad.AnnData(X=counts, obs=meta)
    a.var_names = [f"g{j}" for j in range(g)]
    return a


def _cells(n: int = 400, g: int = 300):
    """A tiny cells x genes AnnData: float32 CSR counts (also in layers['counts']), X_pca, sample / condition /
    cell_type columns."""
    import anndata as ad
    import pandas as pd
    from _metacells_data import jittered_pcs

    rng = np.random.default_rng(0)
    x = sp.random(n, g, density=0.2, format="csr", random_state=1, dtype=np.float64)
    x.data = np.ceil(x.data * 20).astype(np.float64)
    x = x.astype(np.float32)
    a = ad.AnnData(x)
    a.layers["counts"] = x.copy()
    a.obsm["X_pca"] = jittered_pcs(n)[:, :30].astype(np.float32)
    a.obs["sample"] = pd.Categorical(np.asarray([f"s{i}" for i in range(4)])[np.arange(n) % 4])
    a.obs["condition"] = pd.Categorical(np.where(np.isin(a.obs["sample"], ["s0", "s1"]), "a", "b"))
    a.obs["cell_type"] = pd.Categorical(rng.choice(["T", "B"], n))
    return a


def fill_deseq(dev: str, calls: dict) -> None:
    import gpuc

    def tl(name: str, make, design: str, **kw) -> None:
        _call(calls, name, lambda: gpuc.tl.deseq(make(), design, device=dev, **kw))

    pas = lambda: gpuc.datasets.pasilla()[:, :1500].copy()  # noqa: E731
    tl("deseq wald", lambda: _sim_adata(16, 400), "~condition", contrast=["condition", "B", "A"])
    tl(
        "deseq wald+normal",
        pas,
        "~type + condition",
        contrast=["condition", "treated", "untreated"],
        lfc_shrink="normal",
    )
    tl("deseq lrt", pas, "~type + condition", test="lrt", reduced="~type")
    tl("deseq apeglm", pas, "~condition", lfc_shrink="apeglm")
    _call(calls, "vst", lambda: gpuc.tl.vst(pas(), device=dev))
    if dev == "gpu":
        from gpuc._backend import get_backend
        from gpuc.deseq import build_design, contrast_vector, results, run_deseq

        a = _sim_adata(16, 400)
        d = build_design(a.obs, "~condition")
        c = contrast_vector(d, ["condition", "B", "A"])[0]
        bk = get_backend("gpu")
        for where, x in (("device", bk.asarray(np.asarray(a.X))), ("host", np.asarray(a.X))):
            _call(calls, f"engine, counts on {where}", lambda x=x: results(run_deseq(bk, x, d.matrix), c))
        _call(calls, "vst, device AnnData", lambda: gpuc.tl.vst(_to_gpu(_sim_adata(16, 400)), copy=True))
    cells = _cells()
    src = _to_gpu(cells) if dev == "gpu" else cells
    _call(
        calls, "pseudobulk", lambda: gpuc.tl.pseudobulk(src, "sample", groupby="cell_type", layer="counts", min_cells=5)
    )


def fill_nmf(dev: str, calls: dict) -> None:
    from _nmf_data import cd34_sized
    from anndata import AnnData

    import gpuc
    from gpuc._backend import get_backend
    from gpuc._utils import derive_seed
    from gpuc.nmf._hals import Operator, fit_hals

    ad = AnnData(cd34_sized(400, 300))
    kw = {"mask_var": None, "density_threshold": 2.0, "device": dev, "copy": True}
    seeds = [derive_seed(0, 7, r) for r in range(4)]
    for dt in ("float32", "float64"):
        _call(calls, f"consensus_nmf {dt}", lambda dt=dt: gpuc.tl.consensus_nmf(ad, 7, n_runs=4, dtype=dt, **kw))
        _call(calls, f"nmf_k_sweep {dt}", lambda dt=dt: gpuc.tl.nmf_k_sweep(ad, range(2, 5), n_runs=3, dtype=dt, **kw))
        bk = get_backend(dev)
        op = Operator.build(bk, sp.csr_matrix(ad.X, dtype=np.float64), dtype=dt)
        _call(calls, f"fit_hals {dt}", lambda op=op, bk=bk: fit_hals(bk, op, 7, seeds, max_iter=20, tol=1e-300))
        dense = Operator.build(bk, np.asarray(ad.X.toarray(), dtype=np.float64), dtype=dt)
        _call(calls, f"fit_hals dense {dt}", lambda op=dense, bk=bk: fit_hals(bk, op, 7, seeds[:2], max_iter=10))
    if dev == "gpu":  # a rank above 128 (the GPU check's rank-200 case runs on the GPU only)
        _call(calls, "consensus_nmf k=150", lambda: gpuc.tl.consensus_nmf(ad, 150, n_runs=2, max_iter=3, **kw))
    # cNMF's settings on a counts layer, as the parity and the rapids-singlecell stages call them
    cells = _cells()
    src = _to_gpu(cells) if dev == "gpu" else cells
    cnmf = {"layer": "counts", "preprocessing": "sd", "metric": "euclidean", "density_threshold": 0.5}
    cnmf.update(normalization="sum", mask_var=None, n_runs=4, copy=True)
    if dev == "cpu":  # on the GPU the device-resident data select the device, as in the rapids-singlecell stage
        cnmf["device"] = "cpu"
    _call(calls, "consensus_nmf cNMF settings", lambda: gpuc.tl.consensus_nmf(src, 5, **cnmf))


def fill_metacells(dev: str, calls: dict) -> None:
    from _metacells_data import jittered_pcs

    import gpuc
    from gpuc._backend import get_backend
    from gpuc.metacells import run_metacells

    bk = get_backend(dev)
    x = jittered_pcs(700)
    for a0 in ("random", "uniform"):
        _call(
            calls,
            f"run_metacells a0={a0}",
            lambda a0=a0: run_metacells(bk, bk.asarray(x), 9, max_iter=3, min_iter=2, a0=a0),
        )
    cells = _cells(700)
    src = _to_gpu(cells) if dev == "gpu" else cells
    if dev == "gpu":
        src.obsm["X_pca"] = bk.asarray(src.obsm["X_pca"])
    where = {"device": "cpu"} if dev == "cpu" else {}
    _call(calls, "tl.metacells", lambda: gpuc.tl.metacells(src, 9, max_iter=3, min_iter=2, **where))
    if "metacell" in src.obs:
        _call(calls, "aggregate_metacells", lambda: gpuc.tl.aggregate_metacells(src, layer="counts"))
        _call(
            calls,
            "metacell_quality",
            lambda: gpuc.tl.metacell_quality(src, celltype_key="cell_type", inplace=False, **where),
        )
    grouped = _cells(700)
    _call(
        calls,
        "tl.metacells groupby",
        lambda: gpuc.tl.metacells(grouped, groupby="sample", max_iter=2, min_iter=2, device=dev, copy=True),
    )


FILLERS: dict[str, Callable[[str, dict], None]] = {"deseq": fill_deseq, "nmf": fill_nmf, "metacells": fill_metacells}


def _call(calls: dict, name: str, fn: Callable[[], object]) -> None:
    """Run one warm-up call; record its seconds or its error (the fill goes on either way)."""
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
        _sync(calls.get("_device", "gpu"))
        calls[name] = round(time.perf_counter() - t0, 3)
    except Exception as err:
        calls[name] = f"error after {time.perf_counter() - t0:.1f} s: {type(err).__name__}: {err}"[:300]
        traceback.print_exc()
    log(f"  {name}: {calls[name]}")


def fill(tasks: list[str], out: Path) -> int:
    """One fill process: each ``tool:device`` task in turn; its calls' seconds go to the JSON file ``out``."""
    import gpuc

    gpuc.settings.progress = False
    result: dict = {}
    with _standin_context():
        for task in tasks:
            tool, dev = task.split(":")
            calls: dict = {"_device": dev}
            t0 = time.perf_counter()
            log(f"fill {task}")
            try:
                FILLERS[tool](dev, calls)
            except Exception as err:  # outside a recorded call (data, device set-up): recorded, the next task runs
                calls["set-up"] = f"error: {type(err).__name__}: {err}"[:300]
                traceback.print_exc()
            del calls["_device"]
            result[task] = {"seconds": round(time.perf_counter() - t0, 2), "calls": calls}
            out.write_text(json.dumps(result))
    return 0


# ---- measure: a fresh process's first call against its warm calls -------------------------------------------------
def _measure_cases() -> list[tuple[str, str, Callable[[], Callable[[], object]]]]:
    """(name, size, prepare) where prepare() builds the data (outside the clock) and returns the timed call."""
    import gpuc

    small = STANDIN

    def deseq():
        n, g = (20, 1000) if small else (100, 10_000)
        a = _sim_adata(n, g)
        return lambda: gpuc.tl.deseq(a.copy(), "~condition", contrast=["condition", "B", "A"], device="gpu")

    def vst():
        a = _sim_adata(*((20, 1000) if small else (100, 10_000)))
        return lambda: gpuc.tl.vst(a, device="gpu", copy=True)

    def nmf_data():
        from _nmf_data import cd34_sized
        from anndata import AnnData

        return AnnData(cd34_sized(*((300, 200) if small else (2000, 2000))))

    kw = {"mask_var": None, "density_threshold": 2.0, "device": "gpu", "copy": True}

    def consensus():
        ad = nmf_data()
        return lambda: gpuc.tl.consensus_nmf(ad, 7, n_runs=20, **kw)

    def sweep():
        ad = nmf_data()
        return lambda: gpuc.tl.nmf_k_sweep(ad, range(2, 8), n_runs=5, **kw)

    def metacells():
        import anndata as ad
        from _metacells_data import jittered_pcs

        n = 500 if small else 2000
        a = ad.AnnData(np.zeros((n, 1), dtype=np.float32))
        a.obsm["X_pca"] = jittered_pcs(n)
        return lambda: gpuc.tl.metacells(a, device="gpu", copy=True)

    return [
        ("tl.deseq", "20 x 1,000" if small else "100 x 10,000", deseq),
        ("tl.vst", "20 x 1,000" if small else "100 x 10,000", vst),
        ("tl.consensus_nmf", "k=7 x 20 on " + ("300 x 200" if small else "2,000 x 2,000"), consensus),
        ("tl.nmf_k_sweep", "k=2..7 x 5 on " + ("300 x 200" if small else "2,000 x 2,000"), sweep),
        ("tl.metacells", f"{500 if small else 2000:,} cells, default k", metacells),
    ]


def measure(out: Path, t_start: float) -> int:
    import gpuc

    res: dict = {"import_s": round(time.perf_counter() - t_start, 3), "tools": {}}  # import gpuc (and scanpy, anndata)
    gpuc.settings.progress = False
    with _standin_context():
        t0 = time.perf_counter()
        try:
            if not STANDIN:
                import cupy

                cupy.zeros(1).sum().item()  # the CUDA context; cuBLAS, cuSPARSE... are created by the tools themselves
        except Exception as err:
            res["error"] = f"{type(err).__name__}: {err}"[:300]
            out.write_text(json.dumps(res))
            raise
        res["cuda_context_s"] = round(time.perf_counter() - t0, 3)
        out.write_text(json.dumps(res))
        for name, size, prepare in _measure_cases():
            r: dict = {"size": size}
            res["tools"][name] = r
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    t0 = time.perf_counter()
                    call = prepare()
                    r["prepare_s"] = round(time.perf_counter() - t0, 3)
                    before = cache_census()
                    t0 = time.perf_counter()
                    call()
                    _sync()
                    r["first_s"] = time.perf_counter() - t0
                    after = cache_census()
                    r["compiled_during_first"] = {k: after[k] - before[k] for k in after}
                    warm = []
                    for _ in range(2):
                        t0 = time.perf_counter()
                        call()
                        _sync()
                        warm.append(time.perf_counter() - t0)
                r["warm_all_s"] = warm
                r["warm_s"] = statistics.median(warm)
                r["first_minus_warm_s"] = r["first_s"] - r["warm_s"]
                r["within_1s"] = r["first_minus_warm_s"] <= TARGET_S
            except Exception as err:
                r["error"] = f"{type(err).__name__}: {err}"[:300]
                traceback.print_exc()
            log(name, r)
            out.write_text(json.dumps(res))
    return 0


# ---- the stage --------------------------------------------------------------------------------------------------
def _run(cmd: list[str], limit: float, log_path: Path) -> tuple[int | str, float]:
    t0 = time.perf_counter()
    with open(log_path, "w") as fh:
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        try:
            rc: int | str = p.wait(timeout=max(1.0, limit))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = "timed out"
    return rc, time.perf_counter() - t0


def _device() -> dict:
    info: dict = {}
    if STANDIN:
        return {"device": "stand-in GPU (gpuc._testing.standin)", "cupy": "none"}
    try:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        info["device"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        info["cupy"] = cupy.__version__
    except Exception as err:
        info["device"] = f"no usable GPU: {type(err).__name__}: {err}"
    return info


def markdown(rep: dict) -> str:
    lines = [
        f"# Kernel caches and a fresh process's first call ({rep.get('device', '?')})",
        "",
        f"Fill ({rep['fill'].get('mode', '?')}): {rep['fill'].get('seconds', float('nan')):.1f} s; caches after it: "
        f"{rep.get('caches_after_fill')}; after the measuring process: {rep.get('caches_after_measure')}.",
        "",
        "| fill task | seconds | exit | errors |",
        "| --- | --- | --- | --- |",
    ]
    for task, t in rep["fill"].get("tasks", {}).items():
        errs = [f"{k}: {v}" for k, v in t.get("calls", {}).items() if isinstance(v, str)]
        lines.append(f"| {task} | {t.get('seconds', '')} | {t.get('rc', '')} | {'; '.join(errs)[:300]} |")
    m = rep.get("measure", {})
    lines += [
        "",
        f"Second process: imports {m.get('import_s', '?')} s, CUDA context {m.get('cuda_context_s', '?')} s (not "
        f"charged to a tool); exit {m.get('rc', '?')}{'; ' + m['error'] if m.get('error') else ''}. Target: first "
        f"call within {TARGET_S:.0f} s of the warm call.",
        "",
        "| tool | size | first call s | warm s | first - warm s | within 1 s | compiled during the first call |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in m.get("tools", {}).items():
        if "error" in r or "warm_s" not in r:
            lines.append(f"| {name} | {r.get('size', '')} | | | | | error: {r.get('error', 'did not finish')} |")
            continue
        lines.append(
            f"| {name} | {r['size']} | {r['first_s']:.3f} | {r['warm_s']:.3f} | {r['first_minus_warm_s']:+.3f} | "
            f"{'yes' if r['within_1s'] else 'NO'} | {r['compiled_during_first']} |"
        )
    lines += ["", f"all within 1 s: {rep.get('all_within_1s')}"]
    return "\n".join(lines) + "\n"


def _limit(var: str, share: float, default: float) -> float:
    """Seconds for one phase: ``var`` when set, else ``share`` of the stage's limit (``GPUC_STAGE_SECONDS``, which
    gpu_check.sh sets), else ``default``."""
    if os.environ.get(var):
        return float(os.environ[var])
    if os.environ.get("GPUC_STAGE_SECONDS"):
        return share * float(os.environ["GPUC_STAGE_SECONDS"])
    return default


def stage() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for var in ("CUPY_CACHE_DIR", "NUMBA_CACHE_DIR"):
        Path(os.environ[var]).mkdir(parents=True, exist_ok=True)
    rep: dict = {
        **_device(),
        "cache_dirs": {v: os.environ[v] for v in ("CUPY_CACHE_DIR", "NUMBA_CACHE_DIR")},
        "caches_before": cache_census(),
        "fill": {},
        "target": f"a second process's first call within {TARGET_S:.0f} s of its warm call",
    }

    def save() -> None:
        (OUT / "warmup.json").write_text(json.dumps(rep, indent=1, default=str))
        (OUT / "warmup.md").write_text(markdown(rep))

    save()
    tmp = Path(tempfile.mkdtemp(prefix="gpuc_warmup_"))
    me = [sys.executable, str(Path(__file__).resolve())]
    serial = os.environ.get("GPUC_WARMUP_JOBS") == "1"
    groups = (
        [[f"{t}:{d}" for t in TOOLS for d in ("gpu", "cpu")]]
        if serial
        else [[f"{t}:{d}"] for t in TOOLS for d in ("gpu", "cpu")]
    )
    limit = _limit("GPUC_WARMUP_FILL_SECONDS", 0.62, 90.0)
    t0 = time.perf_counter()
    procs = []
    for i, tasks in enumerate(groups):
        fh = open(tmp / f"fill{i}.log", "w")
        procs.append(
            (
                tasks,
                subprocess.Popen(
                    [*me, "fill", ",".join(tasks), str(tmp / f"fill{i}.json")], stdout=fh, stderr=subprocess.STDOUT
                ),
                fh,
                i,
            )
        )
    tasks_out: dict = {}
    for tasks, p, fh, i in procs:
        try:
            rc: int | str = p.wait(timeout=max(1.0, limit - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = "timed out"
        fh.close()
        got = json.loads((tmp / f"fill{i}.json").read_text()) if (tmp / f"fill{i}.json").exists() else {}
        for task in tasks:
            tasks_out[task] = {**got.get(task, {"calls": {}}), "rc": rc if task in got or rc != 0 else "not reached"}
        log(f"--- fill {','.join(tasks)} (exit {rc})\n{(tmp / f'fill{i}.log').read_text()[-3000:]}")
    rep["fill"] = {"mode": "one process" if serial else "one process per tool and device, concurrently",
                   "seconds": time.perf_counter() - t0, "tasks": tasks_out}  # fmt: skip
    rep["caches_after_fill"] = cache_census()
    save()

    limit = _limit("GPUC_WARMUP_MEASURE_SECONDS", 0.3, 60.0)
    rc, secs = _run([*me, "measure", str(tmp / "measure.json")], limit, tmp / "measure.log")
    log(f"--- measure (exit {rc}, {secs:.1f} s)\n{(tmp / 'measure.log').read_text()[-4000:]}")
    m = json.loads((tmp / "measure.json").read_text()) if (tmp / "measure.json").exists() else {"tools": {}}
    m.update(rc=rc, seconds=secs)
    rep["measure"] = m
    rep["caches_after_measure"] = cache_census()
    done = [r for r in m["tools"].values() if "within_1s" in r]
    rep["all_within_1s"] = len(done) == len(MEASURED) and all(r["within_1s"] for r in done)
    save()
    log(markdown(rep))
    fill_ok = all(
        t.get("rc") == 0 and not any(isinstance(v, str) for v in t.get("calls", {}).values())
        for t in tasks_out.values()
    )
    return 0 if fill_ok and rc == 0 else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "fill":
        sys.exit(fill(sys.argv[2].split(","), Path(sys.argv[3])))
    if len(sys.argv) > 1 and sys.argv[1] == "measure":
        _t0 = time.perf_counter()
        sys.exit(measure(Path(sys.argv[2]), _t0))
    sys.exit(stage())
