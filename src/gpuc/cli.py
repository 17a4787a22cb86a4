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
    """Versions of gpuc and its dependencies, the device ``auto`` resolves to, and the GPU libraries found."""
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
    lines.append(f"settings.device = {settings.device!r} -> device used: {resolve_device(settings.device)}")
    # a long reason (e.g. CuPy's import error) or platform string continues on indented lines
    return "\n".join(
        textwrap.fill(line, MAX_COLUMNS, subsequent_indent="    ", break_on_hyphens=False) for line in lines
    )


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
    sub.add_parser(
        "info", help="print versions, the chosen device and the GPU libraries found", formatter_class=_formatter
    )
    args = parser.parse_args(argv)
    if args.command == "info":
        print(info())
        return 0
    from gpuc._demo import run_demo

    try:
        run_demo(args.out, device=args.device)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
