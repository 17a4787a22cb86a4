"""Dask: the independent units of a tool (groups, ranks, restart batches, gene blocks) as tasks on a
``dask.distributed`` cluster, and the type checks for dask arrays.

gpuc never schedules work itself: a tool that is given a client (``client=`` or :attr:`gpuc.settings.client`) hands
each unit to :meth:`distributed.Client.submit`, and Dask places, retries (a unit whose worker dies is run again) and
moves the data. Without a client the same unit functions run one after the other in the calling process, so the two
paths compute exactly the same thing: every unit is a pure function of its inputs and its seed.

Nothing here imports dask or distributed at module import: ``import gpuc`` works without them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuc._backend import optional_import
from gpuc._errors import DaskTaskError, GpucWarning
from gpuc._settings import settings

DEFAULT_CLIENT = "default"


def is_dask_array(x: Any) -> bool:
    """Whether ``x`` is a :class:`dask.array.Array` (checked without importing dask)."""
    da = sys.modules.get("dask.array")
    return da is not None and isinstance(x, da.Array)


def resolve_client(client: Any = None) -> Any:
    """The ``distributed.Client`` a tool runs its units on, or ``None`` to run them in this process.

    ``client=None`` follows :attr:`gpuc.settings.client` (default ``None``: in process). ``"default"`` is the client
    Dask itself would use, :func:`distributed.get_client` (the most recently created one in this process, or the
    worker's own client inside a task); an explicit :class:`distributed.Client` is used as given.
    """
    value = settings.client if client is None else client
    if value is None or value is False:
        return None
    distributed = optional_import("distributed", "dask", "running gpuc on a Dask cluster")
    if isinstance(value, str):
        if value != DEFAULT_CLIENT:
            msg = f"client={value!r} is not valid: pass a distributed.Client, 'default' (the active client) or None."
            raise ValueError(msg)
        try:
            return distributed.get_client()
        except ValueError:
            msg = (
                "client='default' but no dask.distributed client is active in this process. Start one first, e.g. "
                "from dask.distributed import Client; client = Client() (or LocalCUDACluster on GPUs), or pass "
                "client=None to run in this process."
            )
            raise RuntimeError(msg) from None
    if not isinstance(value, distributed.Client):
        msg = f"client must be a distributed.Client, 'default' or None, got {type(value).__name__}."
        raise TypeError(msg)
    status = getattr(value, "status", "running")
    if status not in ("running", "connecting", "newly-created"):
        msg = (
            f"the Dask client is {status} (client.close() was called, or its cluster went away), so nothing can run "
            "on it; start a new one (from dask.distributed import Client; client = Client(...)) or pass client=None "
            "to run in this process. Nothing was computed."
        )
        raise RuntimeError(msg)
    return value


def n_workers(client: Any) -> int:
    """The workers the client's scheduler knows of now (at least 1)."""
    return max(1, len(client.scheduler_info().get("workers", {})))


def runs_on(backend: Any, client: Any) -> str:
    """Where a tool's units run, for its log line: the device, and the cluster's size when there is one."""
    return backend.name if client is None else f"{backend.name}, dask with {n_workers(client)} workers"


@dataclass
class UnitResult:
    """What a unit returns: its value and the warnings it raised (replayed on the client, naming the unit)."""

    value: Any
    warnings: list[tuple[type[Warning], str]]


def _worker_threads() -> int | None:
    """The threads of the worker running this task (None outside a worker)."""
    distributed = sys.modules.get("distributed")
    if distributed is None:
        return None
    try:
        worker = distributed.get_worker()
    except ValueError:
        return None
    return int(worker.state.nthreads)


def aligned(obj: Any) -> Any:
    """``obj`` with every numpy array in it aligned: arrays, scipy sparse matrices, and tuples, lists, dicts and
    dataclasses of them, walked recursively (anything else is returned as it is).

    Arrays that reach a Dask worker can lie at any byte offset of a message (a scattered design matrix arrives at
    offset 27, say); numpy then multiplies them with its own loops instead of BLAS, which rounds differently in the
    last bit. A copy in the same memory order (C or Fortran) makes the worker compute what this process does.
    """
    import numpy as np
    import scipy.sparse

    if isinstance(obj, np.ndarray):
        return obj if obj.flags.aligned else obj.copy(order="K")
    if isinstance(obj, tuple | list):
        return type(obj)(aligned(v) for v in obj)
    if isinstance(obj, dict):
        return {k: aligned(v) for k, v in obj.items()}
    if scipy.sparse.issparse(obj):
        for name in ("data", "indices", "indptr", "row", "col", "offsets"):
            part = getattr(obj, name, None)
            if isinstance(part, np.ndarray) and not part.flags.aligned:
                setattr(obj, name, part.copy())
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changed = {}
        for f in dataclasses.fields(obj):
            if f.init:
                value = getattr(obj, f.name)
                new = aligned(value)
                if new is not value:
                    changed[f.name] = new
        return dataclasses.replace(obj, **changed) if changed else obj
    return obj


def _run_unit(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any], n_jobs: int | None) -> UnitResult:
    """Run one unit, on ``n_jobs`` CPU threads (inside a worker: at most the worker's own threads, and on aligned
    copies of any misaligned array it received, see :func:`aligned`).
    """
    from gpuc._utils import cpu_threads, resolve_n_jobs

    threads = _worker_threads()
    n = resolve_n_jobs(n_jobs)
    if threads is not None:
        n = min(n, threads)
        args, kwargs = aligned(tuple(args)), aligned(dict(kwargs))
    with warnings.catch_warnings(record=True) as caught, cpu_threads(n):
        warnings.simplefilter("always")
        value = fn(*args, **kwargs, n_jobs=n)
    return UnitResult(value, [(w.category, str(w.message)) for w in caught])


@dataclass(frozen=True)
class Scattered:
    """Data already on every worker (:func:`scattered`): its future there and this process's copy (scattered again
    from it when a worker holding it was lost).
    """

    value: Any
    future: Any


def _scatter(client: Any, value: Any) -> Any:
    """``value`` broadcast to every worker under a key of its own, so two calls, or two threads, scattering the same
    data never share, and never cancel, each other's copy.

    ``hash=False`` gives a random key, but ``Client.scatter`` takes a dict as one object per entry under the
    entry's name (``options={"random_state": 0}`` would be scattered as key ``"random_state"``, the same in every
    call); wrapped in a list, the value is scattered whole under a random key.
    """
    return client.scatter([value], broadcast=True, hash=False)[0]


@contextlib.contextmanager
def scattered(client: Any, shared: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """``shared`` scattered once to every worker for several :func:`map_units` calls (pass the yielded dict as their
    ``shared``); released on exit. Without a client the values are yielded as they are.
    """
    if client is None:
        yield dict(shared)
        return
    handles = {k: Scattered(v, _scatter(client, v)) for k, v in shared.items()}
    try:
        yield handles
    finally:
        client.cancel([h.future for h in handles.values()])


def _plain(shared: Mapping[str, Any]) -> dict[str, Any]:
    """``shared`` with every :class:`Scattered` handle replaced by its value (the in-process path)."""
    return {k: v.value if isinstance(v, Scattered) else v for k, v in shared.items()}


# a unit whose input or worker was lost (a worker killed, e.g. by its memory limit, taking the scattered data with
# it) is resubmitted from the client, with its data scattered again, at most this many times
MAX_RESUBMITS = 2


def _lost(err: BaseException) -> bool:
    """Whether a unit failed because the cluster lost it (cancelled: its worker or its scattered data are gone), not
    because its own code raised.
    """
    import concurrent.futures

    return isinstance(err, concurrent.futures.CancelledError)


def _run_on_cluster(
    fn: Callable[..., Any],
    units: Sequence[tuple[str, tuple]],
    client: Any,
    shared: dict[str, Any],
    n_jobs: int | None,
    what: str,
    costs: Sequence[float] | None,
    scatter_args: bool = False,
) -> list[UnitResult]:
    """The units as Dask tasks, their shared data scattered to every worker (and with ``scatter_args`` each unit's
    arguments to one worker); units lost with a worker are resubmitted from this process (data scattered again), the
    others' results kept.
    """
    priority = [0.0] * len(units) if costs is None else [float(c) for c in costs]
    results: list[UnitResult | None] = [None] * len(units)
    for attempt in range(MAX_RESUBMITS + 1):
        pending = [i for i, r in enumerate(results) if r is None]
        # data scattered before the call (Scattered) are used as they are on the first attempt and belong to the
        # caller; the rest, and everything on a later attempt (its copies may have died with a worker), are
        # scattered here and released after the attempt
        futures_shared: dict[str, Any] = {}
        owned_shared: list[Any] = []
        for k, v in shared.items():
            if isinstance(v, Scattered) and attempt == 0:
                futures_shared[k] = v.future
            else:
                futures_shared[k] = _scatter(client, v.value if isinstance(v, Scattered) else v)
                owned_shared.append(futures_shared[k])
        # a unit's own data as one scattered object (the task resolves it to its argument tuple), scattered afresh on
        # every attempt from this process's copy: the copy on a dead worker is gone with it
        args = (
            dict(zip(pending, client.scatter([units[i][1] for i in pending], hash=False), strict=True))
            if scatter_args and pending
            else {i: units[i][1] for i in pending}
        )
        token = uuid.uuid4().hex[:8]  # keys name the unit in the dashboard; the token keeps two calls apart
        futures = {
            i: client.submit(
                _run_unit,
                fn,
                args[i],
                futures_shared,
                n_jobs,
                pure=False,
                key=f"gpuc-{what}-{token}-{i}-{units[i][0]}",
                priority=priority[i],
            )
            for i in pending
        }
        lost: list[int] = []
        try:
            for i, fut in futures.items():
                label = units[i][0]
                try:
                    results[i] = fut.result()
                except Exception as err:
                    if _lost(err) and attempt < MAX_RESUBMITS:
                        lost.append(i)
                        continue
                    msg = f"{what} failed on {label or 'its only unit'}: {type(err).__name__}: {err}"
                    raise DaskTaskError(msg) from err
        finally:
            unit_data = list(args.values()) if scatter_args else []
            client.cancel(list(futures.values()) + owned_shared + unit_data)
        if not lost:
            break
        names = ", ".join(units[i][0] or "its only unit" for i in lost)
        warnings.warn(
            f"{what}: the cluster lost {len(lost)} unit(s) ({names}) with a worker (killed, e.g. by its memory "
            "limit); resubmitted to the cluster from this process, with their data.",
            GpucWarning,
            stacklevel=4,
        )
    return [r for r in results if r is not None]


def map_units(
    fn: Callable[..., Any],
    units: Sequence[tuple[str, tuple]],
    *,
    client: Any,
    shared: Mapping[str, Any] | None = None,
    n_jobs: int | None = None,
    what: str = "gpuc",
    replay_warnings: bool = True,
    stacklevel: int = 2,
    costs: Sequence[float] | None = None,
    scatter_args: bool = False,
) -> list[Any]:
    """``[fn(*args, **shared, n_jobs=...) for (label, args) in units]``, as Dask tasks when ``client`` is a client.

    Parameters
    ----------
    fn
        A module-level function (workers import it) taking the unit's positional arguments, the ``shared`` keyword
        arguments and ``n_jobs``; it must be pure: its result depends only on its arguments.
    units
        ``(label, args)`` per unit; the label names the unit in errors and warnings (e.g. ``"group 'B'"``; an empty
        label, for a tool's only unit, adds no prefix to its warnings).
    client
        A ``distributed.Client`` (from :func:`resolve_client`) or ``None`` to run the units here, in order.
    shared
        Keyword arguments every unit takes (the data of a sweep, the design): on a cluster they are scattered once to
        every worker (``broadcast=True``), not shipped with each task. A value that is a :class:`Scattered` handle
        (from :func:`scattered`) is already there and is reused, so several calls share one copy per worker.
    n_jobs
        CPU threads of each unit; inside a worker never more than the worker's threads.
    what
        The tool, for error messages.
    replay_warnings
        Re-emit each unit's warnings here (in the order of the units), prefixed by its label.
    stacklevel
        Where the replayed warnings point, counted from the caller of :func:`map_units` as :func:`warnings.warn`
        counts (2: the caller's caller, e.g. the user's call of a tool that calls :func:`map_units` itself).
    costs
        Estimated relative cost of each unit: on a cluster the costliest start first (Dask task priorities), so a
        long unit does not end up alone at the tail. The order of the results is not affected.
    scatter_args
        On a cluster, scatter each unit's arguments to a worker before its task is submitted (large per-unit data,
        e.g. a block of counts, travel once to one worker instead of through the scheduler inside the task), and
        scatter them again from this process when the unit is resubmitted after its worker died.

    Returns
    -------
    The units' values, in the order of ``units``.

    Raises
    ------
    DaskTaskError
        On a cluster, when a unit raised: the message names the unit and the original error; the other units are
        cancelled. A unit lost with its worker (killed, its scattered data gone) is not an error: it is resubmitted
        with its data, up to ``MAX_RESUBMITS`` times, with a warning. In process the unit's own exception propagates with its type, the unit named in a note
        (shown in the traceback).
    """
    shared = dict(shared or {})
    if client is None:
        shared = _plain(shared)
        out = []
        for label, args in units:
            try:
                out.append(_run_unit(fn, args, shared, n_jobs))
            except Exception as err:
                if label:  # the unit is named in the traceback, as on a cluster; the exception keeps its type
                    err.add_note(f"{what} failed on {label}.")
                raise
    else:
        out = _run_on_cluster(fn, units, client, shared, n_jobs, what, costs, scatter_args)
    if replay_warnings:
        for (label, _), res in zip(units, out, strict=True):
            for category, message in res.warnings:
                warnings.warn(f"{label}: {message}" if label else message, category, stacklevel=stacklevel + 1)
    return [r.value for r in out]
