"""The warning and exception classes gpuc raises, shared by every tool.

Rule: what the user should act on (a fit that stopped at its iteration limit, a fallback, dropped cells or groups)
is a :class:`GpucWarning` through :func:`warnings.warn`; progress and facts go to Scanpy's logging. Mistakes in the
arguments are :class:`TypeError` (wrong type), :class:`KeyError` (a key that is not in the AnnData) or
:class:`ValueError` (a value out of range); work that cannot fit in memory is refused up front with
:class:`InsufficientMemoryError`.
"""

from __future__ import annotations


class GpucWarning(UserWarning):
    """Something in a gpuc result the user should look at (non-convergence, a fallback, dropped data)."""


class ConvergenceWarning(GpucWarning):
    """A fit stopped at its iteration limit before its convergence criterion was met.

    The result is written all the same; the per-run or per-gene convergence flags are kept with it.
    """


class InsufficientMemoryError(MemoryError):
    """A fit would need more memory than the device has free; raised before anything is allocated.

    The message says how much is needed, how much is free and how to make the problem smaller.
    """


class DaskTaskError(RuntimeError):
    """A unit of work (a group, a rank's restarts, a gene block) failed on a Dask cluster.

    The message names the unit and the original error (chained as ``__cause__``); the AnnData is unchanged.
    """
