"""Small helpers shared by the tools: seeds, progress bars, copy handling."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from gpuc._settings import settings


def derive_seed(random_state: int, *unit: int) -> np.random.SeedSequence:
    """A seed for one independent unit (e.g. a k and a run), fixed by ``(random_state, *unit)`` alone.

    A k's result in a sweep therefore never depends on which other k's are in the sweep.
    """
    return np.random.SeedSequence([int(random_state), *map(int, unit)])


def progress(iterable: Any = None, **kwargs: Any) -> tqdm:
    """A tqdm bar that shows only where a person watches: see :func:`progress_enabled`."""
    kwargs.setdefault("disable", not progress_enabled())
    kwargs.setdefault("leave", False)
    return tqdm(iterable, **kwargs)


def progress_enabled() -> bool:
    """Whether progress bars show: ``gpuc.settings.progress`` is True, Scanpy's verbosity is at its default
    (warning) or above, and the output is a terminal or a Jupyter notebook (never a log file or a pipe).
    """
    import sys

    import scanpy as sc

    if not settings.progress or int(sc.settings.verbosity) < 1:
        return False
    if "ipykernel" in sys.modules:
        return True
    stream = sys.stderr
    return bool(getattr(stream, "isatty", None) and stream.isatty())


def numba_kernels(module: str, name: str | None = None) -> Callable[[], Any]:
    """A loader of numba-compiled CPU kernels kept in their own module.

    The kernels are module-level ``@numba.njit(cache=True)`` functions, so numba compiles each one lazily on its first
    call and a fresh process reloads it from the on-disk cache instead of compiling it again. (A kernel built inside a
    function and capturing another compiled function is cached under a key that changes from process to process, so
    every process would compile it again.) The module is imported on the first call of the loader, keeping numba out
    of the import of the modules that use it.

    Parameters
    ----------
    module
        Dotted name of the module that defines the kernels.
    name
        An attribute of ``module`` to return instead of the module itself.

    Returns
    -------
    A function of no arguments that returns the module (or its attribute ``name``), or ``None`` when numba cannot be
    imported or ``gpuc.settings.numba`` is False; callers then use their array code (the code the GPU runs).
    """

    @functools.cache
    def import_kernels() -> Any:
        try:
            import numba  # noqa: F401
        except ImportError:  # pragma: no cover - numba comes with scanpy
            return None
        kernels = importlib.import_module(module)
        return kernels if name is None else getattr(kernels, name)

    def load() -> Any:
        return import_kernels() if settings.numba else None

    return load
