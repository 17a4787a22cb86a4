"""Compile report of gpuc's fused GPU kernels: every kernel, at every argument signature the engines launch, compiled
for sm_80 (A100) and sm_90 (H100/H200) without a GPU; registers, local memory and spills per thread from ``ptxas -v``.

Two steps, in two processes (numba's CUDA simulator is chosen when numba is first imported):

1. :func:`record_signatures` (simulator on): small fits of every engine on the stand-in device
   (:mod:`gpuc._testing.standin`) with :func:`gpuc._testing.standin.recording` on; each launch's argument types are
   numba's types for the same call on a GPU (arrays by dtype, dimensions and layout; Python ints int64, floats
   float64, bools boolean), so the set is what the engines make numba compile on a device;
2. :func:`compile_report` (simulator off): ``numba.cuda.compile_ptx`` of each kernel and signature for each target,
   then the PTX assembled to machine code by nvJitLink with ``-verbose`` (ptxas's report: registers, stack frame =
   local memory, spill stores and loads), or by a ``ptxas -v`` found on the machine.

Needs numba-cuda with libNVVM and nvJitLink: both GPU extras bring them as NVIDIA's wheels (``gpu-cu12``:
``nvidia-cuda-nvcc-cu12``, ``nvidia-nvjitlink-cu12``; ``gpu-cu13``: ``nvidia-nvvm``, ``nvidia-nvjitlink``; the
CUDA 13 set has no ptxas binary, nvJitLink assembles instead). :func:`toolchain_status` says what is missing. Run it as
``python -m gpuc._testing.kernel_report --out report.json --markdown report.md`` (``benchmarks/gpu_compile_report.py``
also rewrites its block of ``docs/benchmarks.md``); ``tests/core/test_kernel_report.py`` holds :data:`BOUNDS`.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import glob
import importlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from typing import Any

TARGETS = ((8, 0), (9, 0))

# Bounds per thread that tests/core/test_kernel_report.py holds on every target and signature: registers (the hot
# loops' kernels at most 128, so that at least 2 blocks of 256 threads, 512 threads, fit per SM of 65,536 registers)
# and local memory in bytes (thread-local arrays; numba-cuda places no other data there when nothing spills). No
# kernel may spill. The local-memory bounds are the kernels' own arrays: HALS's row (KMAX float64 = 1,024 bytes),
# the metacells B-step's chunk of z (JCHUNK float64 = 256 bytes), DESeq2's per-gene p x p systems and work vectors
# (MAXP-sized arrays; the DESeq2 kernels are owned by their own issue, their bounds are today's values).
# Spills: none, except up to 64 B in the DESeq2 kernels (32 B were measured under CUDA 12.9's NVVM in the former
# Newton kernels and nb_const, none under CUDA 13.5's), allowed here as a known defect of those kernels.
BOUNDS: dict[str, tuple[int, int, int]] = {
    # kernel: (max registers, max local bytes, max spill bytes stored + loaded)
    "gpuc.nmf._kernels_gpu.half_step": (128, 1024, 0),
    "gpuc.nmf._kernels_gpu.gram_finish": (128, 0, 0),
    "gpuc.nmf._kernels_gpu.step": (128, 0, 0),
    "gpuc.nmf._kernels_gpu.restore": (128, 0, 0),
    "gpuc.metacells._kernels_gpu.fw_a_cells": (128, 0, 0),
    "gpuc.metacells._kernels_gpu.fw_kb_r": (128, 0, 0),
    "gpuc.metacells._kernels_gpu.fw_s_rows": (128, 0, 0),
    "gpuc.metacells._kernels_gpu.fw_kba_values": (128, 0, 0),
    "gpuc.metacells._kernels_gpu.fw_b_rows": (128, 256, 0),
    "gpuc.metacells._kernels_gpu.fw_b_cols": (128, 0, 0),
    "gpuc.metacells._kernels_gpu.fw_columns": (128, 0, 0),
    "gpuc.metacells._kernels_gpu.compact_columns": (128, 0, 0),
    "gpuc.deseq._kernels_gpu.irls": (255, 16384, 64),
    "gpuc.deseq._kernels_gpu.nb_const": (128, 16384, 64),
    # R's line search with R's own lgamma / digamma (Chebyshev series) and the C library's pow: CUDA 13.5's NVVM gave
    # it 144 registers on sm_80 (122 on sm_90; 132 / 124 before R's arithmetic); with the Cox-Reid derivative's
    # inverse in LAPACK's order (dgetrf + dgetri, dpotrf + dpotri, in a local array) CUDA 12's gives 197 / 186. At 128
    # threads per block that keeps 2 blocks per SM (3 below 170; launch bounds of 4 blocks made an earlier version
    # spill 80 B, which costs more than the occupancy; not yet timed on a device)
    "gpuc.deseq._kernels_gpu.fit_disp": (208, 16384, 64),
    "gpuc.deseq._kernels_gpu.fit_disp_grid": (128, 16384, 64),
}

# the engines' fused kernels: every one must be launched by the signature run
KERNEL_MODULES = ("gpuc.nmf._kernels_gpu", "gpuc.metacells._kernels_gpu", "gpuc.deseq._kernels_gpu")


# --------------------------------------------------------------------------------------------------------------------
# 1. signatures (under the CUDA simulator)
# --------------------------------------------------------------------------------------------------------------------
def _nmf_cases(bk: Any) -> None:
    import numpy as np
    import scipy.sparse as sp

    from gpuc._utils import derive_seed
    from gpuc.nmf._hals import Operator, fit_hals_groups, nnls_refit

    rng = np.random.default_rng(0)
    v = rng.poisson(1.0, (24, 16)).astype(np.float64)
    v[:, v.sum(0) == 0] += 1.0
    groups = [(k, [derive_seed(1, k, r) for r in range(2)]) for k in (2, 3)]
    for dtype in (np.float32, np.float64):
        for mat in (sp.csr_matrix(v), v):
            op = Operator.build(bk, bk.asarray(mat), dtype=dtype)
            fit_hals_groups(bk, op, groups, max_iter=12)
            nnls_refit(bk, op, bk.asarray(np.abs(rng.normal(size=(3, 16))).astype(dtype)), max_iter=3)


def _metacells_cases(bk: Any) -> None:
    import numpy as np
    import scipy.sparse as sp

    from gpuc._backend import get_backend
    from gpuc.metacells import build_kernel, compute_knn, fit, initial_archetypes, update_b

    cpu = get_backend("cpu")
    x = np.random.default_rng(0).normal(size=(60, 5))
    knn = compute_knn(cpu, x, 8)
    mmat, _ = build_kernel(cpu, x, knn=knn)
    kmat = sp.csr_matrix(mmat @ mmat.T)
    arche = np.asarray(initial_archetypes(cpu, kmat, knn, 3, np.random.RandomState(0), n_components=3))
    a0 = np.random.default_rng(1).random((3, 60))
    a0 /= a0.sum(0)
    for start in ("uniform", bk.asarray(a0), bk.sparse.csr_matrix(sp.csr_matrix(a0))):
        res = fit(bk, bk.asarray(mmat), arche, a0=start, max_iter=2, min_iter=2, fw_iters=4)
    update_b(bk, bk.asarray(kmat), res.A, res.B, 4)


def _deseq_cases(bk: Any) -> None:
    import warnings

    import numpy as np
    import pandas as pd

    from gpuc.deseq import build_design, run_deseq

    rng = np.random.default_rng(0)
    n, g = 8, 120
    meta = pd.DataFrame({"condition": ["a", "b"] * (n // 2)}, index=[f"s{i}" for i in range(n)])
    mu = rng.gamma(2.0, 50.0, size=g) * np.exp(rng.normal(0, 0.5, size=(n, g)))
    y = rng.negative_binomial(5, 5 / (5 + mu)).astype(np.float64)
    x = build_design(meta, "~condition").matrix
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_deseq(bk, bk.asarray(y), x)
    # R's fitDispGrid, which the pipeline runs only for genes whose line search does not converge: with and without
    # a prior, on a three-column design
    from gpuc.deseq._dispersion import _fitdisp_grid
    from gpuc.deseq._fitdisp import grid_bounds

    x3 = np.column_stack([x, rng.normal(size=n)])
    mu3 = np.maximum(mu.T[:24], 0.5)
    lo, hi = grid_bounds(n)
    for prior in (None, bk.asarray(rng.normal(-2, 1, 24))):
        use_prior = prior is not None
        _fitdisp_grid(
            bk,
            bk.asarray(y.T[:24]),
            bk.asarray(mu3),
            bk.asarray(x3),
            prior,
            0.6 if use_prior else 1.0,
            use_prior,
            True,
            lo,
            hi,
            20,
        )


CASES = {"nmf": _nmf_cases, "metacells": _metacells_cases, "deseq": _deseq_cases}


def record_signatures(engines: tuple[str, ...] = tuple(CASES)) -> list[dict[str, Any]]:
    """Run the engines' small cases on the stand-in device under the CUDA simulator and return each distinct
    (kernel, argument types) launched, with the largest grid seen: ``{"kernel", "signature" (readable),
    "types" (pickled numba types, base64), "launches", "max_threads"}``.
    """
    import numba

    if not numba.config.ENABLE_CUDASIM:
        msg = "record_signatures runs the kernels under the CUDA simulator: set NUMBA_ENABLE_CUDASIM=1 first"
        raise RuntimeError(msg)
    from gpuc._testing.standin import recording, standin_backend

    bk = standin_backend()
    out: dict[tuple[str, tuple], dict[str, Any]] = {}
    with recording() as rec:
        for name in engines:
            CASES[name](bk)
    for r in rec:
        key = (r.kernel_id, r.signature)
        row = out.setdefault(
            key,
            {
                "kernel": r.kernel_id,
                "signature": ", ".join(str(t) for t in r.signature),
                "types": base64.b64encode(pickle.dumps(r.signature)).decode(),
                "launches": 0,
                "max_threads": 0,
            },
        )
        row["launches"] += 1
        row["max_threads"] = max(row["max_threads"], r.n_threads)
    return sorted(out.values(), key=lambda d: (d["kernel"], d["signature"]))


def signatures_in_subprocess(engines: tuple[str, ...] = tuple(CASES)) -> list[dict[str, Any]]:
    """:func:`record_signatures` in a fresh Python process with the simulator on (this one may have it off)."""
    code = (
        "import json, sys; from gpuc._testing.kernel_report import record_signatures; "
        f"print(json.dumps(record_signatures({tuple(engines)!r})))"
    )
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        msg = f"recording the kernels' signatures failed:\n{out.stderr[-4000:]}"
        raise RuntimeError(msg)
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------------------------------
# 2. compiling (simulator off)
# --------------------------------------------------------------------------------------------------------------------
def find_ptxas() -> str | None:
    """NVIDIA's ``ptxas``: from the CUDA wheels in this environment's site-packages (``nvidia/cuda_nvcc/bin``, the
    CUDA 13 wheels' ``nvidia/cu13/bin``), else ``$CUDA_HOME/bin``, else ``PATH``; ``None`` if none.
    """
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}
    for root in sorted(r for r in roots if r and os.path.isdir(r)):
        for pattern in ("nvidia/cuda_nvcc/bin/ptxas", "nvidia/cu1*/bin/ptxas", "nvidia/*/bin/ptxas"):
            for path in sorted(glob.glob(os.path.join(root, pattern))):
                if os.access(path, os.X_OK):
                    return path
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var) and os.access(os.path.join(os.environ[var], "bin", "ptxas"), os.X_OK):
            return os.path.join(os.environ[var], "bin", "ptxas")
    return shutil.which("ptxas")


def toolchain_status() -> tuple[bool, str]:
    """Whether this process can compile the kernels for a device and read their resources (numba-cuda with libNVVM,
    the simulator off, ptxas), and what is missing.
    """
    from gpuc._backend import _probe_cuda_compiler

    try:
        import numba
    except ImportError as err:
        return False, f"numba is not installed ({err})"
    if numba.config.ENABLE_CUDASIM:
        return False, "numba's CUDA simulator is on in this process (NUMBA_ENABLE_CUDASIM=1): nothing compiles"
    why = _probe_cuda_compiler()
    if why is not None:
        return False, f"{why}; the GPU extras bring libNVVM and NVRTC: pip install '.[gpu-cu12]' or '.[gpu-cu13]'"
    how = assembler()
    if how is None:
        return False, "neither nvJitLink (cuda-bindings with the CUDA wheels) nor ptxas (a CUDA toolkit) is available"
    return True, f"numba-cuda compiles; PTX assembled by {how}"


_PTXAS_FUNC = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def _nvjitlink_log(ptx: str, arch: str) -> str:
    """PTX -> cubin with nvJitLink (``-verbose``: its info log carries ptxas's resource lines)."""
    from cuda.bindings import nvjitlink

    handle = nvjitlink.create(2, [f"-arch={arch}", "-verbose"])
    try:
        data = ptx.encode()
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel.ptx")
        nvjitlink.complete(handle)
        buf = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, buf)
    finally:
        nvjitlink.destroy(handle)
    return buf.decode(errors="replace")


def _ptxas_log(ptx: str, arch: str, ptxas: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as fh:
            fh.write(ptx)
        out = subprocess.run(
            [ptxas, "-v", f"-arch={arch}", src, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True,
            text=True,
            check=False,
        )
    if out.returncode != 0:
        msg = f"ptxas failed for {arch}:\n{(out.stdout + out.stderr)[-3000:]}"
        raise RuntimeError(msg)
    return out.stdout + out.stderr


def assembler() -> str | None:
    """What turns PTX into machine code here: ``"nvjitlink"`` (the CUDA wheels' nvJitLink, through cuda-bindings,
    which numba-cuda depends on), else the path of a ``ptxas`` (:func:`find_ptxas`), else ``None``.
    """
    try:
        from cuda.bindings import nvjitlink

        nvjitlink.version()
        return "nvjitlink"
    except Exception:
        return find_ptxas()


def ptxas_resources(ptx: str, cc: tuple[int, int], how: str) -> dict[str, int]:
    """Registers, local memory (stack frame) and spills per thread of the one entry function in ``ptx``, from
    ptxas's verbose report (through nvJitLink when ``how`` is ``"nvjitlink"``, else the ``ptxas`` at path ``how``).
    """
    arch = f"sm_{cc[0]}{cc[1]}"
    log = _nvjitlink_log(ptx, arch) if how == "nvjitlink" else _ptxas_log(ptx, arch, how)
    frame = _PTXAS_FRAME.search(log)
    regs = _PTXAS_REGS.search(log)
    if frame is None or regs is None:
        msg = f"the assembler printed no resource usage:\n{log[-2000:]}"
        raise RuntimeError(msg)
    return {
        "registers": int(regs.group(1)),
        "local_bytes": int(frame.group(1)),
        "spill_stores": int(frame.group(2)),
        "spill_loads": int(frame.group(3)),
    }


@contextlib.contextmanager
def _device_functions_for(cc: tuple[int, int]) -> Iterator[None]:
    """Compile device functions (``cuda.jit(device=True)``, which the DESeq2 kernels call) without a GPU.

    numba-cuda 0.30 compiles a device function called from a kernel for the current device's compute capability
    (``CUDADispatcher.compile_device`` asks the driver), so ``compile_ptx`` of such a kernel fails on a machine
    without a driver. Within the block that question is answered with ``cc``. A device function is compiled once per
    process, as on a GPU (its NVVM IR is linked into each kernel, whose PTX is generated for the kernel's target);
    dropping its overloads between targets made numba link two copies and changed the kernels' resources.
    """
    import types as pytypes

    from numba.cuda import dispatcher

    saved = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = saved


def _kernel(kernel_id: str) -> Any:
    module, name = kernel_id.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def compile_report(records: list[dict[str, Any]], targets: tuple[tuple[int, int], ...] = TARGETS) -> dict[str, Any]:
    """Compile each recorded (kernel, signature) for each target and read its resources with ptxas."""
    ok, why = toolchain_status()
    if not ok:
        raise RuntimeError(why)
    from importlib import metadata

    from numba import cuda

    how = assembler()
    assert how is not None
    rows = []
    for rec in records:
        types = pickle.loads(base64.b64decode(rec["types"]))  # written by record_signatures (trusted)
        func = _kernel(rec["kernel"]).py_func
        for cc in targets:
            t0 = time.perf_counter()
            with _device_functions_for(cc):
                ptx, _ = cuda.compile_ptx(func, types, cc=cc)
            secs = time.perf_counter() - t0
            rows.append(
                {
                    "kernel": rec["kernel"],
                    "signature": rec["signature"],
                    "target": f"sm_{cc[0]}{cc[1]}",
                    "compile_s": round(secs, 2),
                    **ptxas_resources(ptx, cc, how),
                }
            )
    versions = {}
    dists = ("numba-cuda", "numba", "numpy", "cuda-bindings", "nvidia-nvjitlink-cu12", "nvidia-nvjitlink")
    for dist in (*dists, "nvidia-cuda-nvcc-cu12", "nvidia-nvvm"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    if how == "nvjitlink":
        from cuda.bindings import nvjitlink

        tool = "nvJitLink {}.{}".format(*nvjitlink.version())
    else:
        out = subprocess.run([how, "--version"], capture_output=True, text=True, check=False).stdout.strip()
        tool = out.splitlines()[-1] if out else how
    return {
        "python": sys.version.split()[0],
        "versions": versions,
        "ptxas": tool,
        "rows": rows,
        "missing": sorted(set(all_kernels()) - {r["kernel"] for r in records}),
    }


def all_kernels() -> list[str]:
    """Every fused kernel (not device function) of gpuc's kernel modules, as ``module.name``."""
    import numba

    from gpuc._numpy_compat import restore_row_stack

    restore_row_stack()
    out = []
    for mod_name in KERNEL_MODULES:
        mod = importlib.import_module(mod_name)
        for name, obj in vars(mod).items():
            if getattr(obj, "py_func", None) is None or getattr(obj.py_func, "__module__", None) != mod_name:
                continue
            device = getattr(obj, "targetoptions", {}).get("device", False)
            if numba.config.ENABLE_CUDASIM:
                device = getattr(obj, "_device", device)
            if not device:
                out.append(f"{mod_name}.{name}")
    return sorted(out)


def check_bounds(report: dict[str, Any]) -> list[str]:
    """What breaks :data:`BOUNDS` (or spills, or has no bound) in a :func:`compile_report` result; empty if nothing."""
    problems = []
    for r in report["rows"]:
        where = f"{r['kernel']} [{r['signature']}] {r['target']}"
        bound = BOUNDS.get(r["kernel"])
        if bound is None:
            problems.append(f"{where}: no bound in BOUNDS")
            continue
        if r["spill_stores"] + r["spill_loads"] > bound[2]:
            problems.append(f"{where}: spills {r['spill_stores']} B stored, {r['spill_loads']} B loaded")
        if r["registers"] > bound[0]:
            problems.append(f"{where}: {r['registers']} registers > {bound[0]}")
        if r["local_bytes"] > bound[1]:
            problems.append(f"{where}: {r['local_bytes']} bytes of local memory > {bound[1]}")
    problems += [f"{k}: never launched by the signature run" for k in report.get("missing", [])]
    return problems


def markdown(report: dict[str, Any]) -> str:
    """The report as a table: per kernel and target, the largest registers / local bytes over its signatures."""
    per: dict[tuple[str, str], dict[str, Any]] = {}
    for r in report["rows"]:
        key = (r["kernel"].removeprefix("gpuc."), r["target"])
        d = per.setdefault(key, {"sigs": 0, "registers": 0, "local_bytes": 0, "spills": 0, "compile_s": 0.0})
        d["sigs"] += 1
        d["registers"] = max(d["registers"], r["registers"])
        d["local_bytes"] = max(d["local_bytes"], r["local_bytes"])
        d["spills"] = max(d["spills"], r["spill_stores"] + r["spill_loads"])
        d["compile_s"] = max(d["compile_s"], r["compile_s"])
    vers = ", ".join(f"{k} {v}" for k, v in report["versions"].items())
    lines = [
        f"Python {report['python']}, {vers}; {report['ptxas']}.",
        "",
        "| kernel | target | signatures | registers (max) | local bytes (max) | spill bytes | bound (regs / local / spill) "
        "| compile s (max) |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for (kernel, target), d in sorted(per.items()):
        b = BOUNDS.get("gpuc." + kernel)
        bound = f"{b[0]} / {b[1]} / {b[2]}" if b else "none"
        lines.append(
            f"| {kernel} | {target} | {d['sigs']} | {d['registers']} | {d['local_bytes']} | {d['spills']} | {bound} "
            f"| {d['compile_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m gpuc._testing.kernel_report``: record the signatures, compile, write JSON / markdown, check."""
    parser = argparse.ArgumentParser(prog="python -m gpuc._testing.kernel_report", description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the report as JSON here")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--engines", default=",".join(CASES), help="engines whose kernels to report (comma-separated)")
    args = parser.parse_args(argv)
    ok, why = toolchain_status()
    if not ok:
        print(f"cannot compile the kernels here: {why}", file=sys.stderr)
        return 2
    records = signatures_in_subprocess(tuple(e for e in args.engines.split(",") if e))
    report = compile_report(records)
    if args.engines != ",".join(CASES):
        wanted = tuple(f"gpuc.{e}." for e in args.engines.split(","))
        report["missing"] = [k for k in report["missing"] if k.startswith(wanted)]
    report["problems"] = check_bounds(report)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    table = markdown(report)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(table)
    print(table)
    for p in report["problems"]:
        print("PROBLEM:", p)
    return 1 if report["problems"] else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
