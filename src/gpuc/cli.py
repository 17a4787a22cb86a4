"""The ``gpuc`` command line: ``gpuc demo`` and ``gpuc info``."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import shutil
import sys
import textwrap

from gpuc._utils import MAX_COLUMNS


def info() -> str:
    """Versions of gpuc and its dependencies, the device ``auto`` resolves to, the GPU libraries found, whether gpuc's
    fused GPU kernels can be built here (:func:`fused_line`) and the CPU cores gpuc uses (:func:`cores_lines`).
    """
    from gpuc._backend import gpu_status, resolve_device
    from gpuc._settings import settings

    lines = [f"gpuc {_version('gpuc')}", f"python {platform.python_version()} on {platform.platform()}"]
    for pkg in (
        "anndata",
        "scanpy",
        "numpy",
        "scipy",
        "pandas",
        "scikit-learn",
        "faiss-cpu",
        "formulaic",
        "matplotlib",
        "numba",
        "numba-cuda",
    ):
        lines.append(f"  {pkg:<14} {_version(pkg)}")
    ok, reason = gpu_status()
    lines.append(f"GPU: {'usable' if ok else 'not usable'} ({reason})")
    for pkg in (
        "cupy-cuda12x",
        "cupy-cuda13x",
        "rapids-singlecell",
        "rapids-singlecell-cu12",
        "rapids-singlecell-cu13",
    ):
        v = _version(pkg)
        if v != "not installed":
            lines.append(f"  {pkg:<22} {v}")
    try:
        import faiss

        lines.append(
            f"faiss {getattr(faiss, '__version__', '?')} ({'with' if hasattr(faiss, 'StandardGpuResources') else 'without'} GPU support)"
        )
    except ImportError:
        lines.append("faiss: not importable")
    lines.append(fused_line())
    lines.append(f"settings.device = {settings.device!r} -> device used: {resolve_device(settings.device)}")
    lines += cores_lines()
    # a long reason (e.g. CuPy's import error) or platform string continues on indented lines
    return "\n".join(
        textwrap.fill(line, MAX_COLUMNS, subsequent_indent="    ", break_on_hyphens=False) for line in lines
    )


def fused_line() -> str:
    """``gpuc info``'s line on the fused GPU kernels (numba-cuda): ``on`` or ``OFF`` and why
    (:func:`gpuc._backend.fused_kernels_status`; probed without a device too: PTX for sm_80).
    """
    import warnings

    from gpuc._backend import FusedKernelsWarning, fused_kernels_status

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FusedKernelsWarning)  # the line says it all
        ok, why = fused_kernels_status()
    if ok:
        return f"fused GPU kernels: on ({why})"
    return f"fused GPU kernels: OFF, the GPU path runs its slower CuPy array code ({why})"


def cores_lines(report: dict | None = None) -> list[str]:
    """The CPU cores gpuc uses and how they were derived (:func:`gpuc._utils.cores_report`), as ``gpuc info`` lines.

    ``n_jobs=-1`` uses the cores available to the process: its CPU affinity, capped by its cgroup's CPU quota.
    ``n_jobs=None`` at the default settings uses those less the cores that other processes keep busy now.
    """
    from gpuc._settings import settings
    from gpuc._utils import cores_report

    r = cores_report() if report is None else report
    quota = "no cgroup CPU quota" if r["quota"] is None else f"cgroup CPU quota {r['quota']}"
    lines = [
        f"CPU cores available: {r['available']} (n_jobs=-1) = min(CPU affinity {r['affinity']} of {r['online']} "
        f"online, {quota})"
    ]
    if settings.n_jobs != -1:
        lines.append(f"n_jobs=None: {_threads(settings.n_jobs)} (settings.n_jobs = {settings.n_jobs})")
    elif r["others_running"] is None:
        lines.append(f"n_jobs=None: {_threads(r['share'])} (the machine's load is not readable here)")
    else:
        lines.append(
            f"n_jobs=None now: {_threads(r['share'])} = {r['available']} available less the cores busy with "
            f"{_threads(r['others_running'])} of other processes (runnable now, /proc/loadavg), at least 1"
        )
    return lines


def _threads(n: int) -> str:
    return f"{n} thread{'s' * (n != 1)}"


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _formatter(prog: str) -> argparse.HelpFormatter:
    """The help of argparse, wrapped to the terminal but never wider than :data:`gpuc._utils.MAX_COLUMNS`."""
    return argparse.HelpFormatter(prog, width=min(MAX_COLUMNS, shutil.get_terminal_size().columns))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gpuc`` console script."""
    parser = argparse.ArgumentParser(
        prog="gpuc",
        description="Metacells, consensus NMF and DESeq2 for AnnData on CPU or GPU.",
        formatter_class=_formatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="run the whole chain on the bundled data and write figures + a summary table",
        formatter_class=_formatter,
    )
    demo.add_argument("--out", default="gpuc_demo", help="output folder (default: ./gpuc_demo)")
    demo.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "gpu"], help="where to compute (default: auto)"
    )
    demo.add_argument(
        "--overwrite", action="store_true", help="write into an output folder that holds files (default: refuse)"
    )
    info_cmd = sub.add_parser(
        "info",
        help="print versions, the chosen device, the GPU libraries found, the fused GPU kernels' status and the CPU "
        "cores used",
        formatter_class=_formatter,
    )
    info_cmd.add_argument(
        "--require-fused",
        action="store_true",
        help="exit with status 3 when the fused GPU kernels (numba-cuda) cannot be built here",
    )
    args = parser.parse_args(argv)
    if args.command == "info":
        print(info())
        if args.require_fused:
            from gpuc._backend import fused_kernels_usable

            if not fused_kernels_usable():
                print("error: the fused GPU kernels are off (see the line above)", file=sys.stderr)
                return 3
        return 0
    from gpuc._demo import run_demo

    try:
        run_demo(args.out, device=args.device, overwrite=args.overwrite)
    except (RuntimeError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
