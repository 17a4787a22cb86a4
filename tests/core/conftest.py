"""Fault injection for the core tests: an exception raised at any step of a gpuc call, as a Ctrl-C or a timer's
exception would land there, to check that the call leaves exactly the old or exactly the new state behind."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest


class Injected(Exception):
    """The exception the fault injector raises (it stands for a user's timer exception: an ``Exception``, so a
    ``except Exception`` in gpuc that would swallow or rename it is caught by the tests)."""


def _steps_of(fn: Callable[[], Any], at: int | None) -> tuple[int, BaseException | None]:
    """Run ``fn`` and count its steps: entries into (or resumptions of) a function of gpuc outside a
    :func:`gpuc._atomic.critical` section, where a signal handler could raise. With ``at``, raise :class:`Injected`
    at that step. Returns the number of steps and the exception the call raised (None when it returned).
    """
    from gpuc._atomic import critical_depth

    count = 0
    where: list[str] = []

    def tracer(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("gpuc") or module == "gpuc._atomic" or critical_depth():
            return
        count += 1
        if count == at:
            sys.settrace(None)
            where.append(f"{module}.{frame.f_code.co_qualname}")
            raise Injected(f"step {at} in {where[0]}")

    # A generator left suspended (``any(... for ...)`` stopping early) is closed when it is freed, which resumes its
    # frame: a step. An exception raised there goes to sys.unraisablehook, as Python ignores every exception of a
    # finalizer (a real Ctrl-C landing there is dropped by Python too), so such a step is not one gpuc can pass on.
    in_finalizer: list[BaseException] = []
    old_hook = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, Injected):
            in_finalizer.append(unraisable.exc_value)
        else:
            old_hook(unraisable)

    old = sys.gettrace()
    sys.unraisablehook = hook
    sys.settrace(tracer)
    try:
        fn()
        err = None
    except BaseException as e:  # reported to the test
        err = e
    finally:
        sys.settrace(old)
        sys.unraisablehook = old_hook
    if err is None and in_finalizer:  # landed in a generator's close: not reached (the caller skips the step)
        return 0, None
    if err is None and where:  # injected, but the call went on: some code swallowed the exception
        err = AssertionError(f"the exception injected in {where[0]} was swallowed")
    return count, err


@pytest.fixture
def steps_of() -> Callable[..., tuple[int, BaseException | None]]:
    """The fault injector's step counter, :func:`_steps_of`, for the tests of the injector itself."""
    return _steps_of


def thread_state() -> dict[str, Any]:
    """The process state a gpuc call may change and must give back: BLAS/OpenMP threads, numba's threads, the
    shared limits' holders and the enclosing thread scope."""
    import numba

    from gpuc._utils import _FAISS_LIMITS, _POOL_LIMITS, _SCOPE, threadpool_controller

    controller = threadpool_controller()
    pools = sorted((i["internal_api"], i["num_threads"]) for i in controller.info()) if controller else []
    return {
        "pools": pools,
        "numba": numba.get_num_threads(),
        "requests": (dict(_POOL_LIMITS._requests), dict(_FAISS_LIMITS._requests)),
        "restore": (_POOL_LIMITS._restore, _FAISS_LIMITS._restore),
        "scope": _SCOPE.get(),
    }


@pytest.fixture
def inject_faults(same):
    """``inject_faults(make, call, *, n=24, tail=24)``: run ``call(adata)`` on ``adata = make()`` once to count its
    steps, then again with :class:`Injected` raised at ``n`` steps spread over the call and at each of its last
    ``tail`` steps (the write). Each interrupted call must raise the injected exception itself, and leave the
    AnnData exactly as before or exactly as the uninterrupted call left it (``uns[...]['seconds']`` aside), and the
    thread state (:func:`thread_state`) as it was. Returns the number of steps of the call.
    """
    import numpy as np

    assert_same = same

    def drop_times(entry: Any) -> None:
        if isinstance(entry, dict):
            for name in ("seconds", "timings"):
                entry.pop(name, None)
            for v in entry.values():
                drop_times(v)

    def strip(adata: Any) -> Any:
        out = adata.copy()
        drop_times(out.uns)
        return out

    def run(make: Callable[[], Any], call: Callable[[Any], Any], *, n: int = 24, tail: int = 24) -> int:
        reference = make()
        before = strip(reference)
        total, err = _steps_of(lambda: call(reference), None)
        assert err is None, f"the call failed without injection: {err!r}"
        after = strip(reference)
        state = thread_state()  # after a call, so that every library the call loads is counted
        steps = sorted(set(np.linspace(1, total, n).astype(int)) | set(range(max(1, total - tail + 1), total + 1)))
        for at in steps:
            adata = make()
            reached, err = _steps_of(lambda a=adata: call(a), at)
            if err is None and reached < at:  # this run took fewer steps (a cache, a timed reading): not reached
                continue
            assert isinstance(err, Injected), f"step {at}/{total}: the call raised {err!r}, not the injected exception"
            got = strip(adata)
            try:
                assert_same(got, before)
            except AssertionError as old:
                try:
                    assert_same(got, after)
                except AssertionError as new:
                    msg = f"step {at}/{total}: neither the old state ({old}) nor the new one ({new})"
                    raise AssertionError(msg) from None
            assert thread_state() == state, f"step {at}/{total}: thread state changed"
        return total

    return run


def _axpy_kernel() -> Any:
    """A fresh numba-cuda kernel ``y[i] += a * x[i]`` (compiled for the simulator on its first launch)."""
    # the simulator finds `cuda` among the kernel's module globals (not in a closure), as it does in gpuc's kernels
    global cuda
    from numba import cuda

    @cuda.jit
    def axpy(a, x, y):
        i = cuda.grid(1)
        if i < y.size:
            y[i] += a * x[i]

    return axpy


@pytest.fixture
def make_axpy() -> Callable[[], Any]:
    """Makes a new axpy kernel on each call (the kernel-launch tests of the stand-in and of kernel sessions)."""
    return _axpy_kernel
