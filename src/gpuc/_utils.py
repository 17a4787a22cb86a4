"""Small helpers shared by the tools: seeds, progress bars, copy handling."""

from __future__ import annotations

import functools
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


def numba_kernels(build: Callable[[Any], Any]) -> Callable[[], Any]:
    """Decorator for a builder of numba-compiled CPU kernels: ``build(numba)`` runs once, on the first call of the
    returned loader (numba compiles lazily and caches on disk with ``cache=True``); the loader returns ``None`` when
    numba cannot be imported, and callers then use their array code (the code the GPU runs).
    """

    @functools.cache
    @functools.wraps(build)
    def load() -> Any:
        try:
            import numba
        except ImportError:  # pragma: no cover - numba comes with scanpy
            return None
        return build(numba)

    return load
