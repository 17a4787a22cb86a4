"""The warning and exception classes gpuc raises, shared by every tool.

Rule: what the user should act on (a fit that stopped at its iteration limit, a fallback, dropped cells or groups)
is a :class:`GpucWarning` through :func:`warnings.warn`; progress and facts go to Scanpy's logging. Mistakes in the
arguments are :class:`TypeError` (wrong type), :class:`KeyError` (a key that is not in the AnnData) or
:class:`ValueError` (a value out of range); work that cannot fit in memory is refused up front with
:class:`InsufficientMemoryError`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


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


def _interrupted(err: BaseException) -> bool:
    """Whether ``err`` was caused by a Ctrl-C: a KeyboardInterrupt somewhere in its chain of causes."""
    seen = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def user_exception(err: BaseException) -> BaseException | None:
    """The exception a compiled call wrapped, when ``err`` is CPython's report of one.

    A signal handler (Ctrl-C, a timer's alarm) that raises while a compiled function (numba, a C extension) runs
    leaves its exception pending until the function returns; CPython then raises ``SystemError: ... returned a
    result with an exception set`` with the pending exception as its cause. Returns that cause (the user's
    exception), or None when ``err`` is not such a report.
    """
    if not isinstance(err, SystemError) or type(err) is not SystemError:
        return None
    inner = err.__cause__ or err.__context__
    if inner is None or isinstance(inner, SystemError):
        return None
    return inner


@contextlib.contextmanager
def interruptible(tool: str) -> Iterator[None]:
    """Let an exception raised inside a compiled kernel reach the user as the exception that was raised.

    A SIGINT (or a timer's signal whose handler raises) that arrives while a compiled function (numba, a C
    extension) runs is raised when it returns, and CPython may report it as ``SystemError: ... returned a result
    with an exception set``; such reports are replaced by the user's exception itself (:func:`user_exception`), and
    any exception whose cause is a KeyboardInterrupt is re-raised as the KeyboardInterrupt the user pressed. Tools
    compute everything before they write, so an interrupted call leaves the AnnData as it was. A context manager
    (not a decorator), so the tools' warnings keep pointing at the user's line.
    """
    try:
        yield
    except KeyboardInterrupt:
        raise
    except Exception as err:
        inner = user_exception(err)
        if inner is not None and not isinstance(inner, KeyboardInterrupt):
            raise inner from None
        if _interrupted(err):
            raise KeyboardInterrupt(f"{tool} was interrupted; the AnnData is unchanged.") from err
        raise
