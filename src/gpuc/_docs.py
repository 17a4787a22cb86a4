"""Shared parameter descriptions for the tools' numpydoc docstrings (Scanpy's ``_doc_params`` habit).

A tool's docstring names a fragment as ``{name}`` alone on a line, indented like the parameter it describes;
:func:`doc_params` fills it in when the module is imported, so a parameter that several tools take is described once.
A fragment is the parameter's name on its first line and its description indented by 4 spaces below; it is
re-indented to the placeholder's indentation. Literal braces elsewhere in a decorated docstring stay as they are.
"""

from __future__ import annotations

import re
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
    CPU threads: ``None`` follows :attr:`gpuc.settings.n_jobs`: by default the cores available to the process (CPU
    affinity and cgroup quota) less those other processes keep busy when the call starts, at least one; ``-1`` all
    available cores, whatever the load. Results do not depend on it. In a Dask task, at most the worker's threads."""

COPY = """\
copy
    Return a modified copy instead of writing into ``adata``; the copy shares no mutable object with ``adata``."""

RANDOM_STATE = """\
random_state
    Seed: an int, ``None`` (fresh entropy) or a numpy ``RandomState``/``Generator`` (drawn from once); the int
    used is recorded in ``params``."""

FRAGMENTS = {"device": DEVICE, "n_jobs": N_JOBS, "copy": COPY, "random_state": RANDOM_STATE}

# a placeholder: optional indentation, {name}, nothing else on the line
_PLACEHOLDER = re.compile(r"^(?P<indent>[ \t]*)\{(?P<name>\w+)\}[ \t]*$", re.MULTILINE)


def doc_params(**extra: str) -> Callable[[F], F]:
    """Fill ``{name}`` placeholder lines of the decorated function's docstring.

    Parameters
    ----------
    **extra
        Fragments beyond the shared ones (:data:`FRAGMENTS`), for parameters that a few tools of one engine share.

    Returns
    -------
    The decorator; it raises ``KeyError`` at import time for a placeholder without a fragment.
    """
    fragments = {**FRAGMENTS, **extra}

    def fill(match: re.Match) -> str:
        indent = match["indent"]
        text = fragments[match["name"]]
        return "\n".join(indent + line if line else line for line in text.splitlines())

    def decorate(func: F) -> F:
        if func.__doc__:
            func.__doc__ = _PLACEHOLDER.sub(fill, func.__doc__)
        return func

    return decorate
