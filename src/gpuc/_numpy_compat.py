"""A numpy shim that lets numba-cuda 0.30 compile kernels under numpy >= 2.5 (gpuc's fused GPU kernels).

numpy 2.5 removed ``np.row_stack`` (an alias of ``np.vstack``, deprecated since numpy 2.0). numba-cuda 0.30.4 (the
newest release pip resolves in 2026-12) registers a typing overload for it, ``overload(np.row_stack)``, in
``numba/cuda/np/arrayobj.py``, a module it imports lazily on the first kernel compilation; under numpy 2.5 that line
raises ``AttributeError: module 'numpy' has no attribute 'row_stack'`` and no kernel compiles at all. On Python
3.12+, ``pip install 'gpuc[gpu-cu12]'`` resolves numpy 2.5, so without this shim every GPU engine fell back to its
CuPy array code.

:func:`restore_row_stack` puts back ``np.row_stack`` as a thin function around ``np.vstack``, only when numpy lacks
it and numba-cuda is installed. It is applied when :mod:`gpuc` is imported, before any of gpuc's kernels can compile.
It is a separate function object (not ``np.vstack`` itself), so numba-cuda's overload for it attaches to the shim
and ``np.vstack``'s own overload set is unchanged. Nothing in gpuc or its kernels calls ``np.row_stack``; numba-cuda
only needs the name to exist. The other numpy names numba-cuda 0.30 registers conditionally (``np.trapz``,
``np.in1d``, ``np.round_``) are already guarded by numpy version checks in numba-cuda itself.

Drop this module once a numba-cuda release guards that overload (``numpy_version < (2, 5)``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np

__all__ = ["restore_row_stack", "row_stack_shimmed"]


def _row_stack(tup: Any, *, dtype: Any = None, casting: str = "same_kind") -> Any:
    """``np.vstack(tup, dtype=dtype, casting=casting)``: numpy's removed ``row_stack`` alias, restored by gpuc so that
    numba-cuda 0.30 can register its overloads (:mod:`gpuc._numpy_compat`).
    """
    return np.vstack(tup, dtype=dtype, casting=casting)


_row_stack.__name__ = "row_stack"
_row_stack.__qualname__ = "row_stack"


def row_stack_shimmed() -> bool:
    """Whether ``np.row_stack`` is gpuc's shim in this process (numpy without it, numba-cuda installed)."""
    return getattr(np, "row_stack", None) is _row_stack


def restore_row_stack() -> bool:
    """Give numpy back ``row_stack`` when it lacks it and numba-cuda is installed; returns whether the shim is on.

    Idempotent; a numpy that still has ``row_stack`` (numpy < 2.5) is left as it is.
    """
    if "row_stack" in np.__dict__:  # numpy's own (< 2.5) or the shim already in place
        return row_stack_shimmed()
    try:
        has_numba_cuda = importlib.util.find_spec("numba_cuda") is not None
    except (ImportError, ValueError):  # pragma: no cover - a broken install: nothing to fix
        has_numba_cuda = False
    if not has_numba_cuda:
        return False
    setattr(np, "row_stack", _row_stack)  # noqa: B010 (the name numpy 2.5 removed; ruff's NPY201 flags np.row_stack)
    return True


restore_row_stack()
