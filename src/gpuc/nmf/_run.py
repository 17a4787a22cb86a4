"""Where the restarts of a fit run: in this process (all ranks in the same data products) or as Dask tasks.

On a cluster the restarts of every rank become units (:func:`restart_chunks`), the data scattered once to every
worker (:func:`gpuc._dask.map_units`); each unit's factors come back to the host and a rank's units are joined in
run order (:func:`join_restarts`), so the result is the in-process one.
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


def restart_chunks(op: Operator, ks: Sequence[int], n_runs: int, workers: int) -> list[tuple[int, range]]:
    """The units of a distributed fit: ``(k, runs)`` pairs covering every restart of every rank.

    On sparse data a run's iterates do not depend on the other runs of its batch (per-row sums in a fixed order), so
    restarts are grouped into units of at most about half a worker's share of the work (a run's cost grows with its
    k), so that the units, started costliest first, balance the workers; a rank's runs stay together up to that size,
    as they share the passes over the data (a split rank passes over it once per unit). Dense products go through
    BLAS, which may round a column differently with the width of the product: there each rank stays one unit, so the
    runs are bit-identical to the in-process fit.
    """
    if not op.sparse:
        return [(k, range(n_runs)) for k in ks]
    target = sum(k * n_runs for k in ks) / (2.0 * workers)  # work per unit, in run-ranks
    out = []
    for k in ks:
        size = max(1, min(n_runs, round(target / k)))
        n_units = -(-n_runs // size)
        bounds = np.linspace(0, n_runs, n_units + 1).round().astype(int)  # even split of the k's runs
        out += [(k, range(int(lo), int(hi))) for lo, hi in itertools.pairwise(bounds)]
    return out


def fit_restarts(
    backend: Backend, k: int, runs: range, *, op: Operator, random_state: int, options: dict, n_jobs: int | None
) -> HalsResult:
    """One unit: restarts ``runs`` of rank ``k``, factors brought to the host (``n_jobs``: set by the unit runner)."""
    groups = [(k, seeds_of(random_state, k, runs))]
    return fit_hals_groups(backend, op, groups, **options)[0].moved(to_host)


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
    """Every restart of ranks ``ks`` as Dask tasks (the data scattered once per worker); ``{k: restarts}`` on the
    host.
    """
    chunks = restart_chunks(op, ks, n_runs, n_workers(client))
    units = [(f"k={k} runs {r.start}-{r.stop - 1}", (backend, k, r)) for k, r in chunks]
    parts = map_units(
        fit_restarts,
        units,
        client=client,
        shared={"op": op, "random_state": random_state, "options": options.kwargs()},
        n_jobs=n_jobs,
        what=what,
        costs=[k * len(r) for k, r in chunks],
    )
    return {k: join_restarts([p for (kk, _), p in zip(chunks, parts, strict=True) if kk == k]) for k in ks}
