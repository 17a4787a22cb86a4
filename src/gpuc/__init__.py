"""gpuc: SEACells metacells, consensus NMF and DESeq2 for AnnData, one implementation on CPU and NVIDIA GPU."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from gpuc import datasets, get, pl, tl
from gpuc._errors import ConvergenceWarning, DaskTaskError, GpucWarning, InsufficientMemoryError
from gpuc._settings import settings

try:
    __version__ = version("gpuc")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "ConvergenceWarning",
    "DaskTaskError",
    "GpucWarning",
    "InsufficientMemoryError",
    "__version__",
    "datasets",
    "get",
    "pl",
    "settings",
    "tl",
]
