"""Interrupts: an exception landing at any step of a tool leaves exactly the old or exactly the new AnnData, gives the
thread state back, and reaches the caller unchanged (issue 41)."""

from __future__ import annotations

import threading

import anndata as ad
import numpy as np
import pandas as pd
import pytest

import gpuc
from gpuc._atomic import atomic_writes, critical
from gpuc._errors import interruptible


def _cells(n=60, seed=0):
    rng = np.random.default_rng(seed)
    a = ad.AnnData(rng.poisson(2.0, (n, 12)).astype(np.float32))
    a.obsm["X_pca"] = rng.normal(size=(n, 5)) + np.repeat(np.eye(5) * 6, n // 5 + 1, axis=0)[:n]
    a.obs["ct"] = pd.Categorical(rng.choice(["a", "b"], n))
    return a


def _bulk(seed=0):
    rng = np.random.default_rng(seed)
    a = ad.AnnData(rng.negative_binomial(5, 0.2, (8, 30)).astype(np.int64))
    a.obs["condition"] = pd.Categorical(["u", "t"] * 4)
    return a


def _fake_gpuc_module(source):
    """Functions compiled as if they were in a gpuc module (the injector only counts gpuc's frames)."""
    namespace = {"__name__": "gpuc._injector_selftest"}
    exec(compile(source, "<gpuc._injector_selftest>", "exec"), namespace)  # a fixed snippet
    return namespace


def test_the_injector_reports_a_swallowed_exception_and_skips_generator_finalizers(steps_of):
    ns = _fake_gpuc_module(
        "def swallow():\n"
        "    try:\n"
        "        inner()\n"
        "    except Exception:\n"
        "        return 0\n"
        "def inner():\n"
        "    return 1\n"
        "def early_exit(values):\n"
        "    return any(v == 1 for v in values)\n"
    )
    total, err = steps_of(ns["swallow"], None)
    assert (total, err) == (2, None)
    _, err = steps_of(ns["swallow"], 2)  # raised in inner(), caught by swallow(): reported
    assert isinstance(err, AssertionError)
    assert "swallowed" in str(err)
    # any() stops at the first value; the suspended generator is closed when freed, which resumes it (step 3): an
    # exception there goes to sys.unraisablehook in any Python code, so the step counts as not reached
    total, err = steps_of(lambda: ns["early_exit"]([1, 2, 3]), None)
    assert (total, err) == (3, None)
    assert steps_of(lambda: ns["early_exit"]([1, 2, 3]), 3) == (0, None)
    _, err = steps_of(lambda: ns["early_exit"]([1, 2, 3]), 2)  # the generator's first step: raised to the caller
    assert type(err).__name__ == "Injected"


# ---- fault injection: every tool that writes into the AnnData --------------------------------------------------------
@pytest.mark.slow
def test_consensus_nmf_and_its_rerun(inject_faults, planted_programs):
    def make():
        a = planted_programs(40, 24, seed=1)
        gpuc.tl.consensus_nmf(a, 3, n_runs=3, max_iter=30, random_state=1)  # the rerun replaces this result
        return a

    inject_faults(make, lambda a: gpuc.tl.consensus_nmf(a, 3, n_runs=3, max_iter=30, random_state=2), n=10, tail=16)


def test_nmf_refine_keeps_its_pool(inject_faults, planted_programs):
    def make():
        a = planted_programs(40, 24, seed=1)
        gpuc.tl.consensus_nmf(a, 3, n_runs=4, max_iter=30, random_state=1)
        return a

    inject_faults(make, lambda a: gpuc.tl.nmf_refine(a, 0.3), n=8, tail=12)


def test_nmf_k_sweep(inject_faults, planted_programs):
    inject_faults(
        lambda: planted_programs(30, 20, seed=2),
        lambda a: gpuc.tl.nmf_k_sweep(a, [2, 3], n_runs=2, max_iter=20),
        n=6,
        tail=8,
    )


@pytest.mark.slow
def test_metacells_and_quality(inject_faults):
    def make():
        a = _cells()
        gpuc.tl.metacells(a, 4, n_neighbors=8, n_waypoint_eigs=4, max_iter=5, min_iter=1)
        return a

    inject_faults(
        make, lambda a: gpuc.tl.metacells(a, 5, n_neighbors=8, n_waypoint_eigs=4, max_iter=5, min_iter=1), n=8, tail=12
    )
    inject_faults(make, lambda a: gpuc.tl.metacell_quality(a, celltype_key="ct"), n=6, tail=8)


def test_deseq_and_vst(inject_faults):
    def make():
        a = _bulk()
        gpuc.tl.deseq(a, "~condition", contrast=["condition", "t", "u"], fit_type="mean")
        return a

    inject_faults(make, lambda a: gpuc.tl.deseq(a, "~condition", fit_type="mean"), n=10, tail=12)
    inject_faults(make, lambda a: gpuc.tl.vst(a, fit_type="mean"), n=6, tail=8)


def test_tools_that_return_a_new_anndata_leave_theirs_unchanged(inject_faults):
    def make():
        a = _cells()
        a.obs["sample"] = np.repeat(["s1", "s2", "s3"], 20)
        gpuc.tl.metacells(a, 4, n_neighbors=8, n_waypoint_eigs=4, max_iter=5, min_iter=1)
        return a

    inject_faults(make, lambda a: gpuc.tl.pseudobulk(a, "sample", groupby="ct", min_cells=1), n=6, tail=6)
    inject_faults(make, lambda a: gpuc.tl.aggregate_metacells(a, celltype_key="ct", soft=True), n=6, tail=6)


# ---- the swap itself ---------------------------------------------------------------------------------------------------
def test_a_failing_write_puts_every_slot_back(unchanged):
    a = _cells(20)
    a.uns["keep"] = {"x": 1}
    a.obsm["X_other"] = np.zeros((20, 2))

    def writes():
        with atomic_writes(a):
            del a.obsm["X_other"]
            a.obs["new"] = 1
            del a.obs["ct"]
            a.uns["keep"] = 2
            a.obsm["bad"] = np.zeros((3, 2))  # anndata refuses it: everything above is undone

    with unchanged(a), pytest.raises(ValueError, match="shape"):
        writes()


class Timeout(Exception):
    """A user's timer exception."""


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_a_signal_during_a_critical_section_is_raised_after_it():
    import os
    import signal

    seen = []

    def handler(signum, frame):
        raise Timeout

    def block():
        with critical():
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(1000):  # the handler would run within these bytecodes
                seen.append(1)

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        with pytest.raises(Timeout):
            block()
        assert len(seen) == 1000  # the block ran to its end, then the user's exception came
        assert signal.getsignal(signal.SIGUSR1) is handler
    finally:
        signal.signal(signal.SIGUSR1, old)


def _compiled_call_reports(user, context):
    """What CPython raises when a C function (a numba kernel) returns with a signal handler's exception set."""
    with context:
        try:
            raise user
        except Timeout as err:
            raise SystemError("CPUDispatcher(<function k>) returned a result with an exception set") from err


def test_a_users_exception_from_a_compiled_call_is_not_a_system_error():
    from gpuc._utils import cpu_threads

    user = Timeout("alarm")
    with pytest.raises(Timeout) as info:
        _compiled_call_reports(user, interruptible("tool"))
    assert info.value is user
    with pytest.raises(Timeout) as info:
        _compiled_call_reports(user, cpu_threads(1))
    assert info.value is user


def test_an_exception_in_the_design_build_is_the_users(monkeypatch):
    """A timer's exception while formulaic builds the model matrix is not reported as a bad design."""
    import formulaic_contrasts

    def boom(*args, **kwargs):
        raise Timeout("alarm")

    monkeypatch.setattr(formulaic_contrasts, "FormulaicContrasts", boom)
    with pytest.raises(Timeout):
        gpuc.tl.deseq(_bulk(), "~condition")


def test_thread_limits_survive_an_exception_at_every_step(inject_faults):
    """cpu_threads and serial_blas give every limit back whatever step the exception lands on."""
    from gpuc._utils import cpu_threads, serial_blas

    def work(_):
        with cpu_threads(1), serial_blas(force=True):
            np.ones((4, 4)) @ np.ones((4, 4))

    inject_faults(lambda: ad.AnnData(np.ones((2, 2))), work, n=8)
