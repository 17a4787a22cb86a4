"""Shared parameter descriptions for the tools' numpydoc docstrings (Scanpy's ``_doc_params`` habit).

A tool's docstring names a fragment as ``{name}`` at the start of a line, indented like the parameter it describes;
:func:`doc_params` fills it in when the module is imported, so a parameter that several tools take is described once.
Each fragment is written at the indentation of a numpydoc parameter entry (name at 4 spaces, text at 8). Literal
braces in a decorated docstring are doubled (``{{`` and ``}}``), as in :meth:`str.format`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

DEVICE = """\
device
        ``"auto"``, ``"cpu"`` or ``"gpu"``; ``None`` follows :attr:`gpuc.settings.device`. ``"auto"`` keeps data that
        is already on the GPU there, and moves host data to the GPU only above the size where the GPU was measured
        faster (see the benchmarks page)."""

N_JOBS = """\
n_jobs
        CPU threads: ``None`` follows :attr:`gpuc.settings.n_jobs` (all cores available to the process, CPU quotas
        included), ``-1`` all cores. Results do not depend on it. In a Dask task, at most the worker's threads."""

COPY = """\
copy
        Return a modified copy instead of writing into ``adata``; the copy shares no mutable object with ``adata``."""

RANDOM_STATE = """\
random_state
        Seed: an int, ``None`` (fresh entropy) or a numpy ``RandomState``/``Generator`` (drawn from once); the int
        used is recorded in ``params``."""

FRAGMENTS = {"device": DEVICE, "n_jobs": N_JOBS, "copy": COPY, "random_state": RANDOM_STATE}


def doc_params(**extra: str) -> Callable[[F], F]:
    """Fill ``{name}`` placeholders of the decorated function's docstring.

    Parameters
    ----------
    **extra
        Fragments beyond the shared ones (:data:`FRAGMENTS`), for parameters that a few tools of one engine share.

    Returns
    -------
    The decorator; it raises ``KeyError`` at import time for a placeholder without a fragment.
    """
    fragments = {**FRAGMENTS, **extra}

    def decorate(func: F) -> F:
        if func.__doc__:
            func.__doc__ = func.__doc__.format_map(fragments)
        return func

    return decorate
