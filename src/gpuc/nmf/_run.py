"""Where the restarts of a fit run: in this process (all ranks in the same data products) or as Dask tasks.

On a cluster the restarts of every rank are dealt into one unit per worker (:func:`plan_units`), the data scattered
once to every worker (:func:`gpuc._dask.map_units`); a unit fits all its restarts together, as the in-process fit
does, its factors come back to the host and a rank's parts are joined in run order (:func:`join_restarts`), so the
result is the in-process one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpuc._backend import Backend, to_host
from gpuc._dask import map_units, n_workers
from gpuc._utils import derive_seed
from gpuc.nmf._hals import HalsOptions, HalsResult, Operator, fit_hals_groups

SWEEP_BATCH_BYTES = 1 << 30  # factor state of one batch of a k sweep (see gpuc.nmf._consensus.sweep_batches)

# a restart's relative cost grows faster than its rank: its products with V grow with k, its Gram sweeps with k^2,
# and larger ranks take more iterations to converge
COST_POWER = 1.5
# on sparse data a rank whose restarts cost more than this fraction of a unit's share is spread evenly over the units,
# so that the units' balance does not rest on the estimated cost of the largest ranks
SPREAD_FRACTION = 0.25
# a smaller rank is split between units (sparse data only) when keeping it whole would put a unit this far above its
# share
SPLIT_SLACK = 0.05

# factor state (cells + genes rows x factor columns, in the working precision) of one batch on the CPU: wider
# batches share each pass over the data among more runs, but once the factor rows they gather outgrow the last-level
# cache (32 MiB on the machines measured) every gather misses; docs/benchmarks.md has the measurements
CPU_BATCH_FACTOR_BYTES = 16 << 20
# below this many columns in that budget (about 100,000 cells at 2,000 genes) the factors miss the cache at any useful
# width, and batches are bounded by memory alone, sharing each pass over the data among as many ranks as fit
MIN_CACHED_COLUMNS = 120


def cpu_batch_columns(shape: tuple[int, int], itemsize: int) -> int | None:
    """The most factor columns of a batch fitted on the CPU (:data:`CPU_BATCH_FACTOR_BYTES` of factor rows), or
    None (no bound but memory) when fewer than :data:`MIN_CACHED_COLUMNS` would fit.
    """
    cols = CPU_BATCH_FACTOR_BYTES // ((int(shape[0]) + int(shape[1])) * int(itemsize))
    return int(cols) if cols >= MIN_CACHED_COLUMNS else None


def batch_columns(backend: Backend, op: Operator) -> int | None:
    """The most factor columns of one batch of fits of ``op`` on ``backend``: the cache's bound on the CPU
    (:func:`cpu_batch_columns`), none on a GPU, which wants its batches wide.
    """
    return None if backend.is_gpu else cpu_batch_columns(op.shape, op.dtype.itemsize)


Group = tuple[int, range]  # (k, runs): restarts `runs` of rank k


def seeds_of(random_state: int, k: int, runs: Sequence[int]) -> list[np.random.SeedSequence]:
    """The seeds of restarts ``runs`` of rank ``k``: from ``(random_state, k, run)`` alone."""
    return [derive_seed(random_state, int(k), int(i)) for i in runs]


def fit_ranks(
    backend: Backend,
    op: Operator,
    ks: Sequence[int],
    n_runs: int,
    random_state: int,
    options: HalsOptions,
    *,
    client: Any = None,
    progress: Any = None,
    n_jobs: int | None = None,
    what: str = "nmf",
) -> list[HalsResult]:
    """Every restart of the ranks ``ks``: one batch in this process (``client=None``), or Dask tasks.

    Run ``i`` of rank ``k`` is seeded from ``(random_state, k, i)`` only and its iterates do not depend on the other
    runs of its batch, so the restarts are the same wherever they run. ``progress`` (in process only) is passed to
    :func:`fit_hals_groups`; ``n_jobs`` are the CPU threads of each Dask unit (in process, the caller's threads are
    used). The factors are on ``backend``'s device.
    """
    if client is None:
        groups = [(int(k), seeds_of(random_state, k, range(n_runs))) for k in ks]
        return fit_hals_groups(backend, op, groups, **options.kwargs(), progress=progress)
    fits = fit_on_cluster(client, backend, op, [int(k) for k in ks], n_runs, random_state, options, what, n_jobs)
    return [fits[int(k)].moved(backend.asarray) for k in ks]


def unit_cost(k: int, n: int) -> float:
    """Relative cost of ``n`` restarts of rank ``k`` (:data:`COST_POWER`)."""
    return n * float(k) ** COST_POWER


def plan_units(op: Operator, ks: Sequence[int], n_runs: int, workers: int) -> list[list[Group]]:
    """The units of a distributed fit: one per worker, each a list of ``(k, runs)`` groups fitted together, covering
    every restart of every rank once.

    Ranks are dealt costliest first (:func:`unit_cost`) to the unit with the least work so far, whole, so that a
    unit holds all the restarts of most of its ranks (their consensus can run where they were fitted). On sparse
    data two kinds of rank are split: one costing more than :data:`SPREAD_FRACTION` of a unit's share is spread in
    even parts over the units (the cost of a large rank is the least certain: its iterations to convergence vary
    most, and a misjudged large rank alone unbalances the units), and one that would put its unit more than
    :data:`SPLIT_SLACK` above its share fills the least loaded units up to their share, in run order. A sparse
    run's iterates do not depend on the other runs of its batch (per-row sums in a fixed order). Dense products go
    through BLAS, which may round a column differently with the width of a rank's block, so there a rank is never
    split and its runs are bit-identical to the in-process fit. Units that would be empty (fewer ranks than workers
    on dense data) are left out.
    """
    ks = sorted({int(k) for k in ks}, reverse=True)
    n_units = max(1, min(int(workers), len(ks) * n_runs if op.sparse else len(ks)))
    share = sum(unit_cost(k, n_runs) for k in ks) / n_units
    units: list[list[Group]] = [[] for _ in range(n_units)]
    load = [0.0] * n_units

    def least() -> int:
        return min(range(n_units), key=lambda i: (load[i], i))

    def add(j: int, k: int, runs: range) -> None:
        if units[j] and units[j][-1][0] == k and units[j][-1][1].stop == runs.start:  # adjacent runs: one group
            units[j][-1] = (k, range(units[j][-1][1].start, runs.stop))
        else:
            units[j].append((k, runs))
        load[j] += unit_cost(k, len(runs))

    for k in ks:
        if op.sparse and n_units > 1 and unit_cost(k, n_runs) > share * SPREAD_FRACTION:
            bounds = np.linspace(0, n_runs, min(n_units, n_runs) + 1).round().astype(int)
            parts = sorted((range(int(lo), int(hi)) for lo, hi in itertools.pairwise(bounds)), key=len, reverse=True)
            for runs in parts:  # the larger parts to the less loaded units
                add(least(), k, runs)
            continue
        j = least()
        if not op.sparse or load[j] + unit_cost(k, n_runs) <= share * (1 + SPLIT_SLACK):
            add(j, k, range(n_runs))
            continue
        start = 0
        while start < n_runs:
            j = least()
            stop = min(n_runs, start + max(1, round((share - load[j]) / unit_cost(k, 1))))
            add(j, k, range(start, stop))
            start = stop
    return [u for u in units if u]


def owned_ranks(units: list[list[Group]], n_runs: int) -> list[set[int]]:
    """Per unit, the ranks whose every restart it holds (their consensus can run in that unit)."""
    return [{k for k, r in u if len(r) == n_runs} for u in units]


def pack_groups(
    groups: list[Group], shape: tuple[int, int], itemsize: int, budget_bytes: int, max_columns: int | None = None
) -> list[list[Group]]:
    """A unit's groups in batches fitted one after the other, in order, each of at most ``max_columns`` factor
    columns (None: no bound) and ``budget_bytes`` of factor state in about six ``(m + n)``-row arrays (a group
    alone is always allowed; :func:`gpuc.nmf._consensus.sweep_batches` packs whole ranks with it).
    """
    per_column = 6 * (shape[0] + shape[1]) * itemsize
    batches: list[list[Group]] = []
    cols = 0
    for k, r in groups:
        c = k * len(r)
        fits = (cols + c) * per_column <= budget_bytes and (max_columns is None or cols + c <= max_columns)
        if batches and fits:
            batches[-1].append((k, r))
            cols += c
        else:
            batches.append([(k, r)])
            cols = c
    return batches


def fit_groups(
    backend: Backend, op: Operator, groups: list[Group], random_state: int, options: dict
) -> list[HalsResult]:
    """The restarts of ``groups`` (one result per group, on ``backend``'s device), in batches of bounded width
    (:func:`pack_groups`; :func:`cpu_batch_columns` on the CPU); a run's iterates do not depend on the other runs of
    its batch, so the batching does not change the result.
    """
    out: list[HalsResult] = []
    width = batch_columns(backend, op)
    for batch in pack_groups(groups, op.shape, op.dtype.itemsize, SWEEP_BATCH_BYTES, width):
        seeded = [(k, seeds_of(random_state, k, r)) for k, r in batch]
        out += fit_hals_groups(backend, op, seeded, **options)
    return out


def fit_unit(
    backend: Backend,
    groups: list[Group],
    *,
    op: Operator,
    random_state: int,
    options: dict,
    n_jobs: int | None,
) -> list[HalsResult]:
    """One unit: the restarts of its groups, factors brought to the host (``n_jobs``: set by the unit runner)."""
    return [f.moved(to_host) for f in fit_groups(backend, op, groups, random_state, options)]


def join_restarts(parts: list[HalsResult]) -> HalsResult:
    """One rank's restarts from its units, in run order."""
    if len(parts) == 1:
        return parts[0]
    return HalsResult(
        np.concatenate([p.usages for p in parts], axis=1),
        np.concatenate([p.spectra_t for p in parts], axis=1),
        np.concatenate([p.losses for p in parts]),
        np.concatenate([p.n_iter for p in parts]),
        np.concatenate([p.converged for p in parts]),
        parts[0].norm2,
    )


def join_units(units: list[list[Group]], parts: list[list[Any]], ks: Sequence[int]) -> dict[int, list[Any]]:
    """Per rank, its groups' values from the units' results, in run order."""
    by_k: dict[int, list[tuple[int, Any]]] = {int(k): [] for k in ks}
    for groups, values in zip(units, parts, strict=True):
        for (k, r), v in zip(groups, values, strict=True):
            by_k[k].append((r.start, v))
    return {k: [v for _, v in sorted(vs, key=lambda t: t[0])] for k, vs in by_k.items()}


def unit_label(groups: list[Group], n_runs: int) -> str:
    """A unit's name in errors, warnings and the dashboard, e.g. ``k=12, k=9, k=3 runs 0-9``."""
    return ", ".join(f"k={k}" if len(r) == n_runs else f"k={k} runs {r.start}-{r.stop - 1}" for k, r in groups)


def fit_on_cluster(
    client: Any,
    backend: Backend,
    op: Operator,
    ks: list[int],
    n_runs: int,
    random_state: int,
    options: HalsOptions,
    what: str,
    n_jobs: int | None = None,
) -> dict[int, HalsResult]:
    """Every restart of ranks ``ks`` as Dask tasks, one unit per worker (the data scattered once per worker);
    ``{k: restarts}`` on the host.
    """
    units = plan_units(op, ks, n_runs, n_workers(client))
    parts = map_units(
        fit_unit,
        [(unit_label(u, n_runs), (backend, u)) for u in units],
        client=client,
        shared={"op": op, "random_state": random_state, "options": options.kwargs()},
        n_jobs=n_jobs,
        what=what,
        costs=[sum(unit_cost(k, len(r)) for k, r in u) for u in units],
    )
    return {k: join_restarts(v) for k, v in join_units(units, parts, ks).items()}
