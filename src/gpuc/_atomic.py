"""All-or-nothing writes and interrupt-safe sections.

Every tool computes its whole result first and then swaps its old outputs for the new ones with
:func:`replace_outputs`: the swap runs in a :func:`critical` section (signals such as Ctrl-C or a timer's alarm are
held until it ends) and restores the previous entries if anything fails inside it, so an interrupt at any moment
leaves the AnnData exactly as it was or exactly as the finished call leaves it.

Process state that a call changes (thread limits, settings) is taken and given back inside :func:`critical`
sections too, so an exception cannot land between a change and the registration of its undo.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

_LOCAL = threading.local()


def critical_depth() -> int:
    """How many :func:`critical` sections the calling thread is inside (0: an exception may land anywhere)."""
    return getattr(_LOCAL, "depth", 0)


# signals whose Python handler may raise into the running code: each is held during a critical section
_HELD = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
)


@contextlib.contextmanager
def critical() -> Iterator[None]:
    """Run the block without being interrupted by a signal handler; handlers of signals that arrived meanwhile run
    (and may raise, e.g. :class:`KeyboardInterrupt`) when the block ends.

    Python runs signal handlers in the main thread only, between bytecodes; inside the block each held signal's
    handler is replaced by one that records it, and the recorded signals are handed to the original handlers once
    the previous handlers are back. Outside the main thread no handler can run, and nothing is changed. Nested
    sections hold the signals until the outermost ends.
    """
    depth = critical_depth()
    _LOCAL.depth = depth + 1
    if depth or threading.current_thread() is not threading.main_thread():
        try:
            yield
        finally:
            _LOCAL.depth = depth
        return
    pending: list[tuple[int, Any]] = []
    saved: dict[int, Any] = {}
    try:
        for sig in _HELD:
            handler = signal.getsignal(sig)
            if callable(handler):
                saved[sig] = handler
                signal.signal(sig, lambda signum, frame: pending.append((signum, frame)))
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        _LOCAL.depth = depth
        for signum, frame in pending:  # the user's handler, with the user's exception, after the block
            saved[signum](signum, frame)


_FRAMES = ("obs", "var")
_MAPPINGS = ("obsm", "varm", "obsp", "varp", "layers", "uns")


@contextlib.contextmanager
def atomic_writes(adata: Any) -> Iterator[Any]:
    """Make the enclosed writes to ``adata`` all or nothing; yields ``adata``.

    Wrap a tool's write step (removing its earlier outputs, then setting the new ones) in this block, after
    everything has been computed. The block runs in a :func:`critical` section, so a Ctrl-C or a timer's exception
    arrives before it starts or after it ends, never in between; if the block raises (anndata refuses a shape, memory
    runs out), ``obs``, ``var``, ``obsm``, ``varm``, ``obsp``, ``varp``, ``layers`` and ``uns`` are put back as they
    were (the same values in the same order) and the error is raised. The snapshot holds references only: the
    columns and entries themselves are not copied. A view is made an AnnData of its own first, as anndata does on
    the first write to a view.
    """
    with critical():
        if getattr(adata, "is_view", False):
            # a write makes a view an AnnData of its own (anndata's rule); on failure it is made the same view again
            view = (adata._adata_ref, adata._oidx, adata._vidx)
            try:
                yield adata
            except BaseException:
                if not adata.is_view:
                    adata._init_as_view(*view)
                raise
            return
        saved = {s: getattr(adata, s).copy(deep=False) for s in _FRAMES}
        saved |= {s: list(getattr(adata, s).items()) for s in _MAPPINGS}
        try:
            yield adata
        except BaseException:
            for s in _FRAMES:
                object.__setattr__(adata, f"_{s}", saved[s])  # not re-validated: it was valid before
            for s in _MAPPINGS:
                _restore(getattr(adata, s), saved[s])
            raise


def _restore(container: Any, saved: list[tuple[str, Any]]) -> None:
    """Put a mapping slot back to ``saved`` (its items, in order), without re-validating them."""
    if list(container.keys()) == [k for k, _ in saved] and all(container[k] is v for k, v in saved):
        return
    store = getattr(container, "_data", container)  # AxisArrays keep their entries in _data; uns is a dict
    store.clear()
    for k, v in saved:
        store[k] = v
