"""gpuc: SEACells metacells, consensus NMF and DESeq2 for AnnData, one implementation on CPU and NVIDIA GPU."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# _numpy_compat first: numba-cuda 0.30 needs np.row_stack, which numpy 2.5 removed (see the module)
from gpuc import _numpy_compat, datasets, get, pl, tl  # noqa: F401
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
