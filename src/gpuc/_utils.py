"""Small helpers shared by the tools: seeds, progress bars, CPU threads, copy handling."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from gpuc._atomic import critical
from gpuc._errors import user_exception
from gpuc._settings import check_n_jobs, passive_numba_launch, settings


def derive_seed(random_state: int, *unit: int) -> np.random.SeedSequence:
    """A seed for one independent unit (e.g. a k and a run), fixed by ``(random_state, *unit)`` alone.

    A k's result in a sweep therefore never depends on which other k's are in the sweep.
    """
    return np.random.SeedSequence([int(random_state), *map(int, unit)])


# printed output (progress bars, the CLI, the demo) fits this many columns
MAX_COLUMNS = 100


def progress(iterable: Any = None, **kwargs: Any) -> tqdm:
    """A tqdm bar that shows only where a person watches (see :func:`progress_enabled`), at most
    :data:`MAX_COLUMNS` wide in a terminal.
    """
    kwargs.setdefault("disable", not progress_enabled())
    kwargs.setdefault("leave", False)
    if "ipykernel" not in sys.modules:  # a notebook's bar is a widget, whose ncols would be pixels
        kwargs.setdefault("ncols", _terminal_columns())
    return tqdm(iterable, **kwargs)


def iteration_progress(max_iter: int, desc: str, **kwargs: Any) -> IterationBar:
    """A bar for an iterative fit: the iterations used so far against the limit, not a bar filling up to ``max_iter``.

    A fit usually stops at its tolerance long before its limit, so the bar shows ``desc: 37 it (limit 1000)``, the
    convergence criterion against its tolerance once :meth:`IterationBar.criterion` reports it, and the elapsed
    time. Like :func:`progress` it shows only where a person watches. Use as a context manager or call ``close()``.
    """
    kwargs.setdefault("disable", not progress_enabled())
    kwargs.setdefault("leave", False)
    if "ipykernel" not in sys.modules:
        kwargs.setdefault("ncols", _terminal_columns())
    return IterationBar(total=max_iter, desc=desc, bar_format=ITERATION_FORMAT, **kwargs)


ITERATION_FORMAT = "{desc}: {n_fmt} it (limit {total_fmt}){postfix} [{elapsed}]"


class IterationBar(tqdm):
    """The bar of :func:`iteration_progress`: ``update(n)`` counts iterations, :meth:`criterion` shows convergence."""

    def criterion(self, value: float, tol: float, name: str = "change") -> None:
        """Show the convergence criterion ``value`` against the tolerance ``tol`` at which the fit stops."""
        mark = " reached" if value <= tol else ""
        self.set_postfix_str(f"{name} {value:.2g} (tol {tol:.2g}{mark})", refresh=False)


def _terminal_columns() -> int:
    """The width of the terminal on stderr (where bars go), at most :data:`MAX_COLUMNS`."""
    try:
        columns = os.get_terminal_size(sys.stderr.fileno()).columns
    except (AttributeError, OSError, ValueError):
        columns = MAX_COLUMNS
    return max(20, min(MAX_COLUMNS, columns))


def progress_enabled() -> bool:
    """Whether progress bars show: ``gpuc.settings.progress`` is True, Scanpy's verbosity is at its default
    (warning) or above, and the output is a terminal or a Jupyter notebook (never a log file or a pipe).
    """
    from gpuc._log import verbosity

    if not settings.progress or verbosity() < 1:
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
        if not settings.numba:
            return None
        kernels = import_kernels()
        scope = _SCOPE.get()
        if scope is not None and kernels is not None:
            scope.limit_numba()
        return kernels

    return load


# ---------------------------------------------------------------------------------------------------------------------
# CPU threads: one n_jobs convention for the compiled kernels, BLAS and FAISS


def available_cores() -> int:
    """The cores this process may use: its CPU affinity, capped by the CPU quota of its cgroup (v1 or v2).

    A container or Slurm job limited to 2 CPUs on a 64-core host sees 64 cores in its affinity but gets 2 CPUs' worth
    of time: starting 64 threads there makes every parallel loop wait for descheduled threads. The quota is rounded
    up, as joblib/loky count it (``ceil(quota / period)``).
    """
    try:
        affinity = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        affinity = max(1, os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    return max(1, min(affinity, quota)) if quota is not None else affinity


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """CPUs granted by the CPU quota of this process's cgroup and its parents (the smallest), or None without one.

    Reads cgroup v2's ``cpu.max`` (``"<quota> <period>"`` or ``"max <period>"``) and cgroup v1's
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (quota ``-1``: none), along the process's own cgroup path from
    ``/proc/self/cgroup`` and each parent up to the mount point ``root`` (inside a container's cgroup namespace the
    path is ``/`` and the root's files hold the container's limit).
    """
    v2_path, v1_path = "/", "/"
    try:
        with open(proc_cgroup) as fh:
            for line in fh:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                if parts[0] == "0" and parts[1] == "":
                    v2_path = parts[2] or "/"
                elif "cpu" in parts[1].split(","):
                    v1_path = parts[2] or "/"
    except OSError:
        pass
    limits = []
    for base, rel, v1 in ((root, v2_path, False), (os.path.join(root, "cpu"), v1_path, True),
                          (os.path.join(root, "cpu,cpuacct"), v1_path, True)):  # fmt: skip
        rel = rel.strip("/")
        while True:
            limit = _read_cpu_limit(os.path.join(base, rel), v1=v1)
            if limit is not None:
                limits.append(limit)
            if not rel:
                break
            rel = os.path.dirname(rel)
    return min(limits) if limits else None


def _read_cpu_limit(folder: str, *, v1: bool) -> int | None:
    """``ceil(quota / period)`` from one cgroup folder (v1 or v2 files), or None when unlimited or unreadable."""
    try:
        if v1:
            with open(os.path.join(folder, "cpu.cfs_quota_us")) as fh:
                quota = fh.read().strip()
            with open(os.path.join(folder, "cpu.cfs_period_us")) as fh:
                period = fh.read().strip()
        else:
            with open(os.path.join(folder, "cpu.max")) as fh:
                quota, _, period = fh.read().strip().partition(" ")
        q, per = int(quota), int(period)
    except (OSError, ValueError):  # absent, "max", or malformed
        return None
    if q <= 0 or per <= 0:
        return None
    return max(1, -(-q // per))


def cores_report() -> dict[str, Any]:
    """How :func:`available_cores` and :func:`share_of_cores` are derived here and now, for ``gpuc info``.

    Returns
    -------
    ``online`` (``os.cpu_count()``), ``affinity`` (CPUs in this process's affinity mask), ``quota`` (CPUs granted by
    the cgroup CPU quota, None without one), ``available`` (:func:`available_cores`), ``others_running`` (runnable
    threads of other processes now, :func:`other_runnable`; None where unreadable) and ``share`` (:func:`share_of_cores`,
    the threads of ``n_jobs=None`` at the default settings).
    """
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        affinity = os.cpu_count() or 1
    others = _sample_other_runnable()
    return {
        "online": os.cpu_count() or 1,
        "affinity": affinity,
        "quota": cgroup_cpu_quota(),
        "available": available_cores(),
        "others_running": others,
        "share": _share(available_cores(), others),
    }


# /proc/loadavg's fourth field: "<runnable scheduling entities now>/<all of them>" (threads, the whole machine)
LOADAVG = "/proc/loadavg"
# samples of the runnable count, and the pause between them: a thread that runs all along (another job's worker) is
# in every sample, a thread that wakes for a moment (a shell, a daemon) in few of them; the smallest count keeps the
# first and drops the second
LOAD_SAMPLES = 3
LOAD_SAMPLE_PAUSE_S = 5e-4
# a reading is reused this long (calls outside a cpu_threads block resolve their threads often)
LOAD_CACHE_S = 0.5
_LOAD_CACHE: list[Any] = [float("-inf"), None, -1]  # (time, value, pid)


def other_runnable() -> int | None:
    """Threads of other processes that are runnable (running or waiting for a core) on the machine now, or None
    where this cannot be read (not Linux).

    Linux counts the runnable threads of the whole machine in ``/proc/loadavg`` (its fourth field); this process's
    own runnable threads (``/proc/self/task/*/stat``: the caller, OpenBLAS threads still spinning after a product)
    are not counted against it. The smallest of :data:`LOAD_SAMPLES` readings is kept (see there); a reading is reused
    for :data:`LOAD_CACHE_S` seconds.
    """
    now = time.monotonic()
    stamp, value, pid = _LOAD_CACHE
    if pid == os.getpid() and now - stamp < LOAD_CACHE_S:
        return value
    value = _sample_other_runnable()
    _LOAD_CACHE[:] = [time.monotonic(), value, os.getpid()]
    return value


def _sample_other_runnable() -> int | None:
    counts = []
    for i in range(LOAD_SAMPLES):
        if i:
            time.sleep(LOAD_SAMPLE_PAUSE_S)
        total, own = _runnable_total(), _runnable_own()
        if total is None:
            return None
        counts.append(max(0, total - max(own, 1)))  # the calling thread is running, whatever its stat file said
    return min(counts)


def _runnable_total(path: str = LOADAVG) -> int | None:
    try:
        with open(path, "rb") as fh:
            return int(fh.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None


def _runnable_own(task_dir: str = "/proc/self/task") -> int:
    own = 0
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return 1
    for tid in tids:
        try:
            with open(os.path.join(task_dir, tid, "stat"), "rb") as fh:
                stat = fh.read()
        except OSError:  # the thread ended meanwhile
            continue
        end = stat.rfind(b")")  # the command name, in parentheses, may hold spaces
        own += stat[end + 2 : end + 3] == b"R"
    return own


def _share(available: int, others: int | None) -> int:
    """The threads left for this process when ``others`` threads of other processes are runnable."""
    if others is None:
        return available
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        affinity = os.cpu_count() or 1
    online = max(affinity, os.cpu_count() or affinity)
    # the count is the whole machine's: when this process may run on a part of the CPUs only, the others' threads
    # are taken as spread evenly over all of them
    busy = others * affinity / online
    return max(1, min(available, int(affinity - busy)))


def share_of_cores() -> int:
    """The threads of ``n_jobs=None`` at the default ``gpuc.settings.n_jobs`` (-1): the cores available to the
    process (:func:`available_cores`) less those that other processes keep busy now (:func:`other_runnable`), at
    least one.

    On a shared machine (a JupyterHub, a Slurm node running other jobs, a laptop building something) more threads
    than free cores make every parallel loop of the compiled kernels wait for its slowest thread, which the kernel's
    scheduler has set aside for the other processes' threads; the call can then be slower than on one thread. Taking
    the free cores only keeps it at least as fast as one thread and leaves the others their cores. An explicit
    ``n_jobs`` (``-1`` included) is obeyed as given.
    """
    return _share(available_cores(), other_runnable())


def resolve_n_jobs(n_jobs: int | None) -> int:
    """The number of CPU threads ``n_jobs`` means.

    ``None`` is the count of the enclosing :func:`cpu_threads` block (one count for the whole call), else
    ``gpuc.settings.n_jobs``: at its default (-1) the cores left free by other processes (:func:`share_of_cores`),
    else that many threads. ``-1`` is all cores available to the process (scikit-learn's meaning; CPU affinity and
    cgroup quota, :func:`available_cores`), a positive int is itself. Other values raise (``TypeError`` for a
    non-integer, ``ValueError`` for 0 or another negative).
    """
    value = check_n_jobs(n_jobs)
    if value is None:
        scope = _SCOPE.get()
        if scope is not None:
            return scope.n
        return share_of_cores() if settings.n_jobs == -1 else settings.n_jobs
    return available_cores() if value == -1 else value


class _ThreadScope:
    """The thread count of one :func:`cpu_threads` block and how to undo what it changed."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._undo: list[Callable[[], None]] = []
        self._numba = False
        self._faiss = False

    def limit_numba(self) -> None:
        """Numba's threads for this thread (numba keeps the count per calling thread), once; restored on exit."""
        if self._numba:
            return
        numba = sys.modules.get("numba")
        if numba is None:
            self._numba = True
            return
        _launch_numba_threads()
        with critical():  # the change and its undo together: an exception cannot land between them
            self._numba = True
            prev = numba.get_num_threads()
            self._undo.append(lambda: numba.set_num_threads(prev))
            numba.set_num_threads(max(1, min(self.n, numba.config.NUMBA_NUM_THREADS)))

    def limit_faiss(self, faiss: Any) -> None:
        """FAISS's OpenMP threads (process-wide, shared with concurrent calls: see :class:`_SharedLimits`), once;
        released on exit.
        """
        if self._faiss or not hasattr(faiss, "omp_set_num_threads"):
            return
        with critical():
            self._faiss = True
            hold = _FAISS_LIMITS.hold(faiss=self.n)
            hold.__enter__()
            self._undo.append(lambda: hold.__exit__(None, None, None))

    def close(self) -> None:
        """Undo every change, the last first; every undo runs even when one fails (the first error is raised)."""
        error = None
        with critical():
            while self._undo:
                try:
                    self._undo.pop()()
                except Exception as err:  # pragma: no cover - a library that cannot set its threads back
                    error = error or err
        if error is not None:  # pragma: no cover
            raise error


def _launch_numba_threads() -> None:
    """Start numba's thread pool with OpenMP's passive wait policy unless the user chose one (``OMP_WAIT_POLICY``);
    see :func:`gpuc._settings.passive_numba_launch`. Nothing when the pool runs already.
    """
    try:
        from numba.np.ufunc import parallel
    except ImportError:  # pragma: no cover - layout of other numba versions
        return
    if getattr(parallel, "_is_initialized", True):
        return
    passive_numba_launch(parallel)
    parallel._launch_threads()


_CONTROLLER: list[Any] = [None, -1]  # threadpoolctl's controller and len(sys.modules) when it was made


def threadpool_controller() -> Any:
    """The ``ThreadpoolController`` of threadpoolctl (BLAS and OpenMP libraries of the process), or None without it.

    Finding the libraries walks every loaded shared object (~10 ms), so the controller is kept and made again only when
    modules were imported since (a new native library comes with an import).
    """
    if _CONTROLLER[0] is None or _CONTROLLER[1] != len(sys.modules):
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:  # pragma: no cover - threadpoolctl comes with scikit-learn
            return None
        _CONTROLLER[0] = ThreadpoolController()
        _CONTROLLER[1] = len(sys.modules)
    return _CONTROLLER[0]


class _SharedLimits:
    """Process-wide thread limits (BLAS / OpenMP through threadpoolctl, FAISS's OpenMP) that concurrent gpuc calls ask
    for, held together.

    These libraries keep one thread count per process, so two calls running in two Python threads cannot each save
    and restore it: the second would save the first's limit and restore it after the first restored the original,
    leaving the process's pools limited. Here every call registers its request; while any request is held the pools
    run at the smallest one (never more threads than any caller asked for), and when the last is released the
    limits the process had before the first request are restored.

    ``set_limits(effective)`` applies a ``{pool: threads}`` mapping and returns how to undo it (or None when it
    cannot apply it); only the undo of the first application is kept.
    """

    def __init__(self, set_limits: Callable[[dict[str, int]], Callable[[], None] | None]) -> None:
        self._set_limits = set_limits
        self._lock = threading.Lock()
        self._requests: dict[int, dict[str, int]] = {}
        self._next = 0
        self._restore: Callable[[], None] | None = None

    @contextlib.contextmanager
    def hold(self, **limits: int) -> Iterator[None]:
        """Limit the named pools inside the block (threads never raised above another holder's request).

        The request is registered and released in :func:`gpuc._atomic.critical` sections inside the ``try``, so an
        exception (a Ctrl-C, a timer's) cannot leave a request behind, nor the limits applied after the last holder.
        """
        token = None
        try:
            with critical(), self._lock:
                token = self._next
                self._next += 1
                self._requests[token] = limits
                self._apply()
            yield
        finally:
            with critical(), self._lock:
                if token is not None:
                    del self._requests[token]
                    if self._requests:
                        self._apply()
                    elif self._restore is not None:
                        restore, self._restore = self._restore, None
                        restore()

    def _apply(self) -> None:
        effective: dict[str, int] = {}
        for req in self._requests.values():
            for pool, n in req.items():
                effective[pool] = min(n, effective.get(pool, n))
        undo = self._set_limits(effective)
        if self._restore is None:
            self._restore = undo


def _set_pool_limits(limits: dict[str, int]) -> Callable[[], None] | None:
    controller = threadpool_controller()
    if controller is None:
        return None
    return controller.limit(limits=limits).restore_original_limits


def _set_faiss_limits(limits: dict[str, int]) -> Callable[[], None] | None:
    faiss = sys.modules.get("faiss")
    if faiss is None or not hasattr(faiss, "omp_set_num_threads"):
        return None
    prev = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(limits["faiss"])
    return lambda: faiss.omp_set_num_threads(prev)


_POOL_LIMITS = _SharedLimits(_set_pool_limits)
_FAISS_LIMITS = _SharedLimits(_set_faiss_limits)

_SCOPE: contextvars.ContextVar[_ThreadScope | None] = contextvars.ContextVar("gpuc_cpu_threads", default=None)


def current_n_jobs() -> int:
    """The CPU threads of the enclosing :func:`cpu_threads` block, else those of ``gpuc.settings.n_jobs``."""
    scope = _SCOPE.get()
    return scope.n if scope is not None else resolve_n_jobs(None)


@contextlib.contextmanager
def cpu_threads(n_jobs: int | None = None) -> Iterator[int]:
    """Run the enclosed CPU work on ``resolve_n_jobs(n_jobs)`` threads; yields that number.

    Sets numba's threads (for the calling thread, when numba is loaded or as soon as a kernel loader loads it), the
    BLAS and OpenMP thread pools through threadpoolctl (a scikit-learn dependency; skipped when absent) and FAISS's
    threads (:meth:`_ThreadScope.limit_faiss`, called where FAISS is used), and restores all of them on exit. Inside
    an enclosing block with the same count it does nothing. The parallel kernels merge their per-thread partial results
    in a fixed order, so the thread count never changes a result.
    """
    n = resolve_n_jobs(n_jobs)
    outer = _SCOPE.get()
    if outer is not None and outer.n == n:
        with _user_exceptions():
            yield n
        return
    scope = _ThreadScope(n)
    token = None
    try:
        # every change is made together with the registration of its undo (critical sections), inside the try
        with critical():
            token = _SCOPE.set(scope)
            hold = _POOL_LIMITS.hold(blas=n, openmp=n)
            hold.__enter__()
            scope._undo.append(lambda: hold.__exit__(None, None, None))
        if "numba" in sys.modules:
            scope.limit_numba()
        with _user_exceptions():
            yield n
    finally:
        with critical():
            scope.close()
            if token is not None:
                _SCOPE.reset(token)


@contextlib.contextmanager
def _user_exceptions() -> Iterator[None]:
    """Re-raise the user's exception that CPython reports as a ``SystemError`` after a compiled call (a timer's or
    Ctrl-C's exception raised inside a numba kernel): see :func:`gpuc._errors.user_exception`.
    """
    try:
        yield
    except SystemError as err:
        inner = user_exception(err)
        if inner is None or isinstance(inner, KeyboardInterrupt):  # Ctrl-C: the tool's interruptible() says so
            raise
        raise inner from None


# a BLAS product below this many floating-point operations (~0.05 s on one core) gains less from threads than the
# idle threads' spinning afterwards costs (OpenBLAS's threads spin ~0.1 s after each call): it runs on one thread
SMALL_BLAS_FLOPS = 1e9


@contextlib.contextmanager
def serial_blas(enabled: bool = True, *, force: bool = False) -> Iterator[None]:
    """Run the enclosed code with BLAS on one thread (the other thread pools keep their counts); nothing when not
    ``enabled``.

    For loops that alternate compiled parallel kernels with small BLAS products: OpenBLAS's threads keep spinning for
    a while after each call and take the cores that numba's threads need next, while products that small gain
    nothing from threads. It also makes those products round exactly as in a one-thread run (a multi-threaded GEMM
    may split its output and round the pieces differently). Inside a one-thread :func:`cpu_threads` block BLAS is
    already on one thread and nothing is done, unless ``force`` (for callers that may run outside such a block).
    """
    if not enabled or (current_n_jobs() == 1 and not force):
        yield
        return
    with _POOL_LIMITS.hold(blas=1):
        yield


@contextlib.contextmanager
def one_thread_pools(*pools: str) -> Iterator[None]:
    """Run the enclosed code with the named threadpoolctl pools (``"blas"``, ``"openmp"``) on one thread, through the
    process-wide shared limits (:class:`_SharedLimits`), so concurrent calls never restore each other's limits.
    """
    with _POOL_LIMITS.hold(**dict.fromkeys(pools, 1)):
        yield


def limit_faiss_threads(faiss: Any) -> None:
    """Give FAISS the threads of the enclosing :func:`cpu_threads` block (nothing outside one)."""
    scope = _SCOPE.get()
    if scope is not None:
        scope.limit_faiss(faiss)


def threaded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run an engine entry point inside ``cpu_threads(n_jobs)``, ``n_jobs`` being its keyword argument (default None).

    The engine keeps ``n_jobs`` in its signature (and passes it on, e.g. to nested engine calls, which then find the
    same thread count and change nothing).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with cpu_threads(kwargs.get("n_jobs")):
            return fn(*args, **kwargs)

    return wrapper
