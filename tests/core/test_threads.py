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
