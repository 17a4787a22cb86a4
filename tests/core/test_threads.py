"""Threads as the platform grants them (CPU affinity capped by cgroup v1/v2 CPU quotas) and process-wide thread pools
that concurrent calls never leave changed."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gpuc._utils import _SharedLimits, available_cores, cgroup_cpu_quota, cpu_threads, serial_blas


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_of_the_process_cgroup_and_its_parents(tmp_path):
    proc = tmp_path / "cgroup"
    _write(proc, "0::/kubepods/pod1/ctr\n")
    root = tmp_path / "fs"
    _write(root / "cpu.max", "max 100000\n")
    _write(root / "kubepods" / "cpu.max", "max 100000\n")
    _write(root / "kubepods" / "pod1" / "cpu.max", "250000 100000\n")  # 2.5 CPUs -> 3 threads (rounded up)
    _write(root / "kubepods" / "pod1" / "ctr" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(str(root), str(proc)) == 3
    _write(root / "kubepods" / "pod1" / "ctr" / "cpu.max", "100000 100000\n")  # the tighter of the two
    assert cgroup_cpu_quota(str(root), str(proc)) == 1


def test_cgroup_v1_quota_and_no_quota(tmp_path):
    proc = tmp_path / "cgroup"
    _write(proc, "4:memory:/x\n2:cpu,cpuacct:/slurm/job7\n0::/\n")
    root = tmp_path / "fs"
    _write(root / "cpu" / "slurm" / "job7" / "cpu.cfs_quota_us", "400000\n")
    _write(root / "cpu" / "slurm" / "job7" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(str(root), str(proc)) == 4
    _write(root / "cpu" / "slurm" / "job7" / "cpu.cfs_quota_us", "-1\n")  # v1's "no quota"
    assert cgroup_cpu_quota(str(root), str(proc)) is None
    assert cgroup_cpu_quota(str(tmp_path / "absent"), str(tmp_path / "absent")) is None


def test_available_cores_is_capped_by_the_quota(monkeypatch):
    import gpuc._utils as utils

    monkeypatch.setattr(utils.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(utils, "cgroup_cpu_quota", lambda: 2)
    assert available_cores() == 2
    monkeypatch.setattr(utils, "cgroup_cpu_quota", lambda: None)
    assert available_cores() == 64


# ---- n_jobs=None takes the cores other processes leave free ---------------------------------------------------------
def _affinity(monkeypatch, n, online=None):
    import gpuc._utils as utils

    monkeypatch.setattr(utils.os, "sched_getaffinity", lambda pid: set(range(n)))
    monkeypatch.setattr(utils.os, "cpu_count", lambda: online or n)
    monkeypatch.setattr(utils, "cgroup_cpu_quota", lambda: None)


def test_runnable_counts_from_proc_files(tmp_path):
    import gpuc._utils as utils

    _write(tmp_path / "loadavg", "3.50 2.10 1.00 7/412 12345\n")
    assert utils._runnable_total(str(tmp_path / "loadavg")) == 7
    assert utils._runnable_total(str(tmp_path / "absent")) is None
    tasks = tmp_path / "task"
    # the command name may hold spaces and parentheses; the state follows the last ")"
    _write(tasks / "10" / "stat", "10 (python) R 1 10 10 0 -1\n")
    _write(tasks / "11" / "stat", "11 (numba (worker) 1) S 1 10 10 0 -1\n")
    _write(tasks / "12" / "stat", "12 (OpenBLAS x) R 1 10 10 0 -1\n")
    assert utils._runnable_own(str(tasks)) == 2
    assert utils._runnable_own(str(tmp_path / "absent")) == 1


def test_other_runnable_drops_own_threads_and_passing_ones(monkeypatch):
    import gpuc._utils as utils

    # this process has 3 runnable threads (itself, two spinning BLAS threads); a passing thread shows up once
    totals = iter([8, 6, 7])
    monkeypatch.setattr(utils, "_runnable_total", lambda: next(totals))
    monkeypatch.setattr(utils, "_runnable_own", lambda: 3)
    monkeypatch.setattr(utils, "LOAD_SAMPLE_PAUSE_S", 0.0)
    assert utils._sample_other_runnable() == 3
    monkeypatch.setattr(utils, "_runnable_total", lambda: 1)
    monkeypatch.setattr(utils, "_runnable_own", lambda: 0)  # the caller counts as running whatever its file said
    assert utils._sample_other_runnable() == 0
    monkeypatch.setattr(utils, "_runnable_total", lambda: None)
    assert utils._sample_other_runnable() is None


@pytest.mark.parametrize(
    ("affinity", "online", "quota", "others", "share"),
    [
        (2, 2, None, 0, 2),  # quiet: every core
        (2, 2, None, 1, 1),
        (2, 2, None, 2, 1),  # busy: never fewer than one thread
        (2, 2, None, 4, 1),
        (2, 2, None, None, 2),  # load unreadable: the cores available
        (64, 64, 2, 10, 2),  # a pod's quota on a big host with room left
        (64, 64, 2, 63, 1),
        (16, 16, None, 5, 11),
        (8, 32, None, 16, 4),  # affinity to a quarter of the CPUs: a quarter of the others' threads
    ],
)
def test_share_of_cores(monkeypatch, affinity, online, quota, others, share):
    import gpuc._utils as utils

    _affinity(monkeypatch, affinity, online)
    monkeypatch.setattr(utils, "cgroup_cpu_quota", lambda: quota)
    monkeypatch.setattr(utils, "other_runnable", lambda: others)
    assert utils.share_of_cores() == share
    assert utils.cores_report()["available"] == (min(affinity, quota) if quota else affinity)


def test_default_n_jobs_takes_the_share_and_an_explicit_one_is_obeyed(monkeypatch):
    import gpuc._utils as utils
    from gpuc._settings import settings

    _affinity(monkeypatch, 4)
    monkeypatch.setattr(utils, "other_runnable", lambda: 3)
    assert utils.resolve_n_jobs(None) == 1
    assert utils.resolve_n_jobs(-1) == 4
    assert utils.resolve_n_jobs(3) == 3
    monkeypatch.setattr(settings, "n_jobs", 3)  # a count the user set is obeyed whatever the load
    assert utils.resolve_n_jobs(None) == 3
    monkeypatch.setattr(settings, "n_jobs", -1)
    with cpu_threads(-1) as n:  # inside a call, n_jobs=None is the call's count (one count for the whole call)
        assert n == 4
        assert utils.resolve_n_jobs(None) == 4 and utils.current_n_jobs() == 4
        with cpu_threads(None) as inner:
            assert inner == 4
    monkeypatch.setattr(utils, "other_runnable", lambda: 0)
    assert utils.resolve_n_jobs(None) == 4


def test_a_busy_process_is_counted():
    import subprocess
    import sys

    import gpuc._utils as utils

    if utils._runnable_total() is None:
        pytest.skip("no /proc/loadavg")
    busy = subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"])
    try:
        import time

        time.sleep(0.3)  # started and spinning
        # the spinner is runnable in every sample (runnable = running or waiting for a core)
        assert utils._sample_other_runnable() >= 1
    finally:
        busy.kill()
        busy.wait()


def test_other_runnable_reuses_a_fresh_reading(monkeypatch):
    import gpuc._utils as utils

    calls = []
    monkeypatch.setattr(utils, "_sample_other_runnable", lambda: calls.append(1) or 5)
    monkeypatch.setattr(utils, "_LOAD_CACHE", [float("-inf"), None, -1])
    assert utils.other_runnable() == 5 and utils.other_runnable() == 5
    assert len(calls) == 1
    monkeypatch.setattr(utils, "LOAD_CACHE_S", 0.0)
    utils.other_runnable()
    assert len(calls) == 2


def test_shared_limits_hold_the_smallest_request_and_restore_the_original_last():
    state = {"n": 8}
    applied = []

    def set_limits(limits):
        prev = state["n"]
        state["n"] = limits["x"]
        applied.append(limits["x"])
        return lambda: state.update(n=prev)

    shared = _SharedLimits(set_limits)
    a, b = shared.hold(x=2), shared.hold(x=1)
    a.__enter__()
    assert state["n"] == 2
    b.__enter__()
    assert state["n"] == 1
    a.__exit__(None, None, None)  # the first holder leaves first: the other's limit stays
    assert state["n"] == 1
    b.__exit__(None, None, None)
    assert state["n"] == 8  # the limit before the first holder, not the first holder's
    assert applied == [2, 1, 1]


def test_concurrent_calls_leave_the_process_blas_pool_as_it_was():
    from threadpoolctl import threadpool_info

    def blas() -> list[int]:
        return [d["num_threads"] for d in threadpool_info() if d["user_api"] == "blas"]

    before = blas()
    barrier = threading.Barrier(4)
    errors = []

    def work(n: int) -> None:
        try:
            for _ in range(20):
                with cpu_threads(n):
                    barrier.wait(timeout=10) if n else None
                    with serial_blas():
                        np.ones((30, 30)) @ np.ones((30, 30))
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(1 + i % 2,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert blas() == before


@pytest.mark.parametrize("n", [1, 2])
def test_cpu_threads_inside_worker_threads_sees_its_own_count(n):
    seen = []

    def work():
        with cpu_threads(n) as got:
            seen.append(got)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == [n]


def test_fixed_block_matmul_is_independent_of_threads_and_blas_pool():
    from threadpoolctl import threadpool_limits

    from gpuc.nmf._hals import MATMUL_BLOCK_ROWS, fixed_block_matmul

    rng = np.random.default_rng(0)
    a = rng.random((3 * MATMUL_BLOCK_ROWS + 17, 300))
    b = rng.random((300, 60))
    f_ordered = np.asfortranarray(a)  # as V^T is held: a transposed view
    with cpu_threads(1):
        want, want_f = fixed_block_matmul(a, b), fixed_block_matmul(f_ordered, b)
    np.testing.assert_allclose(want, a @ b, rtol=1e-12)
    for n in (2, 3):
        with cpu_threads(n), threadpool_limits(n):  # BLAS's pool as another caller may have left it
            np.testing.assert_array_equal(fixed_block_matmul(a, b), want)
            np.testing.assert_array_equal(fixed_block_matmul(f_ordered, b), want_f)


def test_dense_consensus_nmf_identical_for_any_n_jobs_at_a_size_where_blas_threads():
    import anndata as ad

    import gpuc

    rng = np.random.default_rng(1)
    k, m, n = 5, 600, 400
    spectra = rng.gamma(0.5, 1.0, (k, n))
    usage = rng.dirichlet(np.full(k, 0.3), m) * 30
    a = ad.AnnData(rng.poisson(usage @ spectra).astype(np.float32))
    a.var_names = [f"g{j}" for j in range(n)]
    a.var["highly_variable"] = True
    for nj in (1, 2):
        gpuc.tl.consensus_nmf(a, k, n_runs=8, device="cpu", n_jobs=nj, key_added=f"j{nj}")
    np.testing.assert_array_equal(a.varm["j1_spectra"], a.varm["j2_spectra"])
    np.testing.assert_array_equal(a.obsm["X_j1"], a.obsm["X_j2"])
    np.testing.assert_array_equal(a.uns["j1"]["run_errors"], a.uns["j2"]["run_errors"])


_PARALLEL_CALL = """
from numba import njit, prange

@njit(parallel=True)
def f(n):
    s = 0.0
    for i in prange(n):
        s += i
    return s

f(10)
import numba
print("layer", numba.threading_layer())
"""


def _gomp_spincount(imports: str) -> str | None:
    """The spin count of the libgomp that numba loads, in a fresh process running ``imports`` first."""
    import os
    import re
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "NUMBA_THREADING"))}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"  # libgomp prints its settings to stderr when it starts
    out = subprocess.run(
        [sys.executable, "-c", imports + _PARALLEL_CALL], env=env, capture_output=True, text=True, check=True
    )
    if "layer omp" not in out.stdout:
        return None
    # the last libgomp to start is numba's (scikit-learn, imported by scanpy, brings its own, started at import)
    counts = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr)
    return counts[-1] if counts else None


@pytest.mark.parametrize("imports", ["import gpuc\nimport numba\n", "import numba\nimport gpuc\n"])
def test_numba_openmp_threads_wait_passively_whoever_starts_them(imports):
    # a parallel numba function of another library (here: the test's own) starts numba's threads, not gpuc: with gpuc
    # imported before or after numba, libgomp starts with the passive policy (spin count 0)
    control = _gomp_spincount("import numba\n")  # without gpuc: libgomp's default, threads spin before sleeping
    if control is None:
        pytest.skip("numba does not use libgomp here")
    assert control != "0"
    assert _gomp_spincount(imports) == "0"
