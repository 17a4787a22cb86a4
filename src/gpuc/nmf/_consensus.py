"""Consensus of pooled NMF restarts (cNMF / bixverse): density filter, k-means, silhouette, median, NNLS refit.

The pool has ``n_runs * k`` components (rows) in gene space (``target="spectra"``) or cell space (``"usage"``); it is
small in the number of rows, so the pool is brought to the host and clustered there on either device (every
pairwise distance exactly, as one ``(P, P)`` matrix product); only the NNLS refit runs on the device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

# loaded with the tool rather than on first use: every consensus needs them, so their import (0.15 s quiet, seconds
# on a busy machine) belongs to loading gpuc.tl.consensus_nmf, not to its first call's time
from sklearn.cluster import KMeans
from sklearn.metrics import silhouette_samples

from gpuc._backend import Backend, get_backend, to_host
from gpuc._dask import map_units, n_workers, scattered
from gpuc._utils import SMALL_BLAS_FLOPS, serial_blas, threaded
from gpuc.nmf._hals import HalsOptions, HalsResult, Operator, nnls_refit
from gpuc.nmf._run import (
    SWEEP_BATCH_BYTES,
    Group,
    fit_groups,
    fit_ranks,
    join_restarts,
    join_units,
    owned_ranks,
    pack_groups,
    plan_units,
    unit_cost,
    unit_label,
)

Metric = Literal["cosine", "euclidean"]
Target = Literal["spectra", "usage"]
Normalization = Literal["sum", "l2"]
METRICS = ("cosine", "euclidean")
TARGETS = ("spectra", "usage")
NORMALIZATIONS = ("sum", "l2")

COLLAPSED_NORM = 1e-12
MAX_STORED_POOL = 2000  # pooled-component distance matrices up to 2000 x 2000 (16 MB) are returned for plots


class ConsensusError(ValueError):
    """Fewer than ``k`` components survive the density filter (or none are usable)."""


@dataclass
class PoolDensity:
    """Pooled unit-norm components and their local densities.

    Attributes
    ----------
    unit
        ``(P, d)`` on the device: the pooled components, each scaled to unit L2 norm (collapsed ones left at zero).
    dist
        ``(P, P)`` on the device: pairwise distances under ``metric`` (collapsed rows/cols meaningless).
    density
        ``(P,)`` host: mean distance to the ``n_neighbors`` nearest other live components; ``inf`` for collapsed ones.
    run, component
        ``(P,)`` host int: which restart and which of its components each row is.
    n_neighbors
        Neighbours used.
    """

    unit: Any
    dist: Any
    density: np.ndarray
    run: np.ndarray
    component: np.ndarray
    n_neighbors: int
    metric: str


@dataclass
class ConsensusResult:
    """Consensus factors and diagnostics (host arrays).

    ``usages`` is ``(m, k)``, ``spectra`` ``(k, n)``; programmes are ordered by total usage, largest first.
    ``table`` columns: run, component, cluster (-1 if dropped), local_density, silhouette (NaN if dropped), kept.
    """

    usages: np.ndarray
    spectra: np.ndarray
    stability: float
    loss: float
    rel_error: float
    cluster_sizes: np.ndarray
    n_dropped: int
    n_empty_clusters: int
    table: dict[str, np.ndarray]
    params: dict[str, Any] = field(default_factory=dict)
    distances: np.ndarray | None = None


@dataclass(frozen=True)
class ConsensusOptions:
    """How pooled restarts become a consensus (the tools' consensus options, passed as one object to the engine).

    Attributes
    ----------
    target
        Cluster the runs' ``"spectra"`` (gene space) or ``"usage"`` columns (cell space).
    metric
        Distance for the local density and the silhouette: ``"cosine"`` or ``"euclidean"``.
    density_threshold
        Keep pooled components whose local density is ``<`` this (2.0 keeps all).
    normalization
        Consensus rows rescaled to ``"sum"`` 1 (cNMF) or unit ``"l2"`` norm (bixverse).
    neighborhood
        Fraction of the runs used as neighbours for the local density.
    kmeans_n_init
        k-means restarts.
    random_state
        Seed of the k-means.
    """

    target: Target = "spectra"
    metric: Metric = "cosine"
    density_threshold: float = 0.5
    normalization: Normalization = "sum"
    neighborhood: float = 0.3
    kmeans_n_init: int = 10
    random_state: int = 0

    def checked(self) -> ConsensusOptions:
        """The options, checked with the tools' messages; thresholds as floats, the seed as an int
        (:func:`gpuc._validate.resolve_random_state`: a generator is drawn from once).
        """
        from gpuc._validate import check_choice, check_int, check_number, resolve_random_state

        check_choice("metric", self.metric, METRICS)
        check_choice("target", self.target, TARGETS)
        check_choice("normalization", self.normalization, NORMALIZATIONS)
        threshold = check_number(
            "density_threshold", self.density_threshold, low=0, high=2, hint="2 turns the filter off."
        )
        neighborhood = check_number("neighborhood", self.neighborhood, low=0, high=1, low_open=True)
        check_int("kmeans_n_init", self.kmeans_n_init, minimum=1)
        return dataclasses.replace(
            self,
            density_threshold=float(threshold),
            neighborhood=float(neighborhood),
            random_state=resolve_random_state(self.random_state),
        )

    def kwargs(self) -> dict[str, Any]:
        """The options as :func:`consensus`'s keywords."""
        return dataclasses.asdict(self)


def _one_openmp_thread() -> Any:
    """scikit-learn's OpenMP loops on one thread (a no-op context without threadpoolctl)."""
    from gpuc._utils import one_thread_pools

    # through the shared limits: a limit saved and restored here would restore a concurrent call's limit
    return one_thread_pools("openmp")


def n_neighbors_for(n_runs: int, fraction: float = 0.3) -> int:
    """``ceil(fraction * n_runs)``, at least 1 (cNMF's ``int()`` gives 0 below 4 runs and drops everything)."""
    return max(1, math.ceil(fraction * n_runs - 1e-12))


def pool_components(backend: Backend, fits: HalsResult, target: Target) -> tuple[Any, np.ndarray, np.ndarray]:
    """Stack the runs' components as rows: spectra ``(R*k, n)`` or usage columns ``(R*k, m)``; run-major order."""
    xp = backend.xp
    src = fits.spectra_t if target == "spectra" else fits.usages  # (rows, R, k)
    rows, n_runs, k = src.shape
    pool = xp.ascontiguousarray(src.reshape(rows, n_runs * k).T).astype(xp.float64)
    run = np.repeat(np.arange(n_runs), k)
    comp = np.tile(np.arange(k), n_runs)
    return pool, run, comp


def local_density(
    backend: Backend,
    pool: Any,
    run: np.ndarray,
    component: np.ndarray,
    n_runs: int,
    *,
    metric: Metric = "cosine",
    neighborhood: float = 0.3,
) -> PoolDensity:
    """Unit-normalise the pool, drop collapsed rows, and compute each row's local density under ``metric``.

    ``"cosine"``: distance ``1 - cos``; ``"euclidean"``: distance between the unit rows (cNMF). Density = mean distance
    to the ``ceil(neighborhood * n_runs)`` nearest other live components (clamped to ``[1, live - 1]``).
    """
    xp = backend.xp
    norms = xp.sqrt((pool * pool).sum(axis=1))
    live = norms > COLLAPSED_NORM
    unit = pool / xp.where(live, norms, 1.0)[:, None]
    unit = unit * live[:, None]
    # a pool product too small to gain from BLAS threads runs on one (serial_blas: idle OpenBLAS threads would spin
    # through the k-means and refit that follow, and through the next call's fit)
    with serial_blas(xp is np and 2.0 * unit.shape[0] ** 2 * unit.shape[1] < SMALL_BLAS_FLOPS):
        sim = xp.clip(unit @ unit.T, -1.0, 1.0)
    dist = 1.0 - sim if metric == "cosine" else xp.sqrt(xp.maximum(2.0 - 2.0 * sim, 0.0))
    live_h = np.asarray(backend.to_host(live), dtype=bool)
    n_live = int(live_h.sum())
    nn = min(n_neighbors_for(n_runs, neighborhood), max(n_live - 1, 1))
    density = np.full(pool.shape[0], np.inf)
    if n_live >= 2:
        li = xp.asarray(np.flatnonzero(live_h))
        dl = dist[li][:, li].copy()
        xp.fill_diagonal(dl, xp.inf)
        part = xp.partition(dl, nn - 1, axis=1)[:, :nn]
        density[live_h] = np.asarray(backend.to_host(part.mean(axis=1)), dtype=np.float64)
    elif n_live == 1:
        density[live_h] = 0.0
    return PoolDensity(unit, dist, density, run, component, nn, metric)


def silhouette(dist: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per-sample silhouette from a precomputed distance matrix: scikit-learn's ``silhouette_samples`` (singletons 0).

    The diagonal is set to 0 (Euclidean distances between unit rows leave ~1e-8 there, which scikit-learn refuses);
    with fewer than 2 clusters, or only singletons, every sample gets 0 (scikit-learn raises there).
    """
    n = dist.shape[0]
    n_labels = np.unique(labels).size
    if n_labels < 2 or n_labels == n:
        return np.zeros(n)
    dist = np.array(to_host(dist), dtype=np.float64)
    np.fill_diagonal(dist, 0.0)
    return silhouette_samples(dist, labels, metric="precomputed")


def cluster_median(xp: Any, unit: Any, labels_h: np.ndarray, k: int) -> tuple[Any, int]:
    """Per-cluster, per-coordinate median of the unit rows; empty clusters give zero rows. Returns (centres, n_empty)."""
    out = xp.zeros((k, unit.shape[1]), dtype=unit.dtype)
    n_empty = 0
    for c in range(k):
        idx = np.flatnonzero(labels_h == c)
        if idx.size == 0:
            n_empty += 1
            continue
        out[c] = xp.median(unit[xp.asarray(idx)], axis=0)
    return out, n_empty


@threaded
def consensus(
    backend: Backend,
    op: Operator,
    fits: HalsResult,
    k: int,
    *,
    target: Target = "spectra",
    metric: Metric = "cosine",
    density_threshold: float = 0.5,
    neighborhood: float = 0.3,
    normalization: Normalization = "sum",
    kmeans_n_init: int = 10,
    random_state: int = 0,
    refit_max_iter: int = 1000,
    refit_tol: float = 1e-6,
    density: PoolDensity | None = None,
    refit: bool = True,
    n_jobs: int | None = None,
) -> ConsensusResult:
    """Consensus programmes from a batch of restarts.

    Steps: pool the runs' components (``target``), L2-normalise and drop collapsed ones, local density under
    ``metric`` (keep ``density < density_threshold``; 2.0 keeps every live component), k-means (scikit-learn's
    ``KMeans`` as in cNMF, Euclidean on the unit rows, best of ``kmeans_n_init`` starts), silhouette under ``metric``
    (the stability), per-cluster per-coordinate median,
    rows rescaled (``normalization``: ``"sum"`` to sum 1 like cNMF, ``"l2"`` to unit norm like bixverse), then the
    partner factor refitted by NNLS against the fixed consensus. Programmes are ordered by total usage after
    normalising each cell's usage to sum 1 (cNMF's order). ``n_jobs``: CPU threads (:func:`gpuc._utils.cpu_threads`);
    the k-means runs on one thread whatever it is (scikit-learn merges its threads' partial sums in whichever order
    they finish, so its result could depend on the thread count). ``density``: the pool's local density, when already
    computed (:func:`pool_density`).

    Raises
    ------
    ConsensusError
        When fewer than ``k`` components survive the filter.
    """
    # The pool has n_runs * k rows: clustering it is cheap and stays on the host (as in bixverse.gpu); only the
    # pooled factors come back from the device, and only the NNLS refit (which needs V) runs on ``backend``.
    hb = get_backend("cpu")
    n_runs = fits.usages.shape[1]
    if density is None:
        pool, run, comp = pool_components(backend, fits, target)
        density = local_density(
            hb, hb.asarray(backend.to_host(pool)), run, comp, n_runs, metric=metric, neighborhood=neighborhood
        )
    rule = ConsensusOptions(
        target=target,
        metric=metric,
        density_threshold=density_threshold,
        normalization=normalization,
        neighborhood=neighborhood,
        kmeans_n_init=kmeans_n_init,
        random_state=random_state,
    )
    return consensus_of_pool(
        backend, op, density, k, rule, refit_max_iter=refit_max_iter, refit_tol=refit_tol, refit=refit
    )


def stored_pool(backend: Backend, fits: HalsResult, target: Target) -> np.ndarray:
    """The pooled components on the host in the fits' own precision (``(n_runs * k, d)``, run-major).

    This is what :func:`gpuc.tl.consensus_nmf` keeps so that the consensus can be redone with another density
    threshold without refitting: :func:`pool_components` is this array cast to float64, so a consensus from the
    stored pool is bit-identical to one from the fits.
    """
    src = fits.spectra_t if target == "spectra" else fits.usages  # (rows, R, k)
    rows, n_runs, k = src.shape
    return np.ascontiguousarray(np.asarray(backend.to_host(src)).reshape(rows, n_runs * k).T)


def pool_density(
    pool: np.ndarray, n_runs: int, k: int, *, metric: Metric = "cosine", neighborhood: float = 0.3
) -> PoolDensity:
    """:func:`local_density` of a stored pool (from :func:`stored_pool`), on the host, in float64."""
    hb = get_backend("cpu")
    run = np.repeat(np.arange(n_runs), k)
    comp = np.tile(np.arange(k), n_runs)
    return local_density(
        hb, np.asarray(pool, dtype=np.float64), run, comp, n_runs, metric=metric, neighborhood=neighborhood
    )


@threaded
def consensus_of_pool(
    backend: Backend,
    op: Operator,
    density: PoolDensity,
    k: int,
    rule: ConsensusOptions,
    *,
    refit_max_iter: int = 1000,
    refit_tol: float = 1e-6,
    refit: bool = True,
    n_jobs: int | None = None,
) -> ConsensusResult:
    """The steps of :func:`consensus` after the local density: filter, k-means, silhouette, median, NNLS refit, under
    the options ``rule`` (whose ``neighborhood`` went into ``density``; the others as :func:`consensus`'s keywords,
    as are ``n_jobs`` and the refit's).
    """
    xp = get_backend("cpu").xp
    dens = density.density
    kept = np.isfinite(dens) & (dens < rule.density_threshold)
    n_kept = int(kept.sum())
    n_total = dens.size
    if n_kept < k:
        msg = (
            f"only {n_kept} of {n_total} pooled components have local density < {rule.density_threshold} "
            f"({rule.metric} distance), fewer than k={k}; raise density_threshold (2.0 turns the filter off), "
            "add runs, or lower k."
        )
        raise ConsensusError(msg)
    ki = xp.asarray(np.flatnonzero(kept))
    unit_k = density.unit[ki]
    km = KMeans(n_clusters=k, n_init=rule.kmeans_n_init, random_state=rule.random_state)
    with _one_openmp_thread():
        km.fit(np.asarray(unit_k))
    labels_h = np.asarray(km.labels_, dtype=np.int64)
    sil_h = silhouette(density.dist[ki][:, ki], labels_h)
    stability = float(sil_h.mean())
    centres, n_empty = cluster_median(xp, unit_k, labels_h, k)
    if rule.normalization == "sum":
        scale = centres.sum(axis=1, keepdims=True)
    else:
        scale = xp.sqrt((centres * centres).sum(axis=1, keepdims=True))
    centres = centres / xp.where(scale > 0, scale, 1.0)
    # refit the partner factor with the consensus fixed
    if not refit:  # k sweep: only the diagnostics are needed
        sizes = np.bincount(labels_h, minlength=k)
        return ConsensusResult(
            np.empty((0, k)),
            np.empty((k, 0)),
            stability,
            float("nan"),
            float("nan"),
            sizes,
            int(n_total - n_kept),
            int(n_empty),
            {},
            {"n_neighbors": density.n_neighbors},
        )
    if rule.target == "spectra":
        spectra = centres  # (k, n)
        usages, loss = nnls_refit(backend, op, spectra, max_iter=refit_max_iter, tol=refit_tol)
    else:
        usages = centres.T  # (m, k)
        st, loss = nnls_refit(backend, op.transposed(), centres, max_iter=refit_max_iter, tol=refit_tol)
        spectra = st.T
    usages_h = np.asarray(backend.to_host(usages), dtype=np.float64)
    spectra_h = np.asarray(backend.to_host(spectra), dtype=np.float64)
    # order by total per-cell-normalised usage, largest first
    rs = usages_h.sum(axis=1, keepdims=True)
    share = (usages_h / np.where(rs > 0, rs, 1.0)).sum(axis=0)
    order = np.argsort(-share, kind="stable")
    rank_of = np.empty(k, dtype=np.int64)
    rank_of[order] = np.arange(k)
    usages_h = usages_h[:, order]
    spectra_h = spectra_h[order]
    cluster = np.full(n_total, -1, dtype=np.int64)
    cluster[kept] = rank_of[labels_h]
    sil_all = np.full(n_total, np.nan)
    sil_all[kept] = sil_h
    sizes = np.bincount(cluster[kept], minlength=k)
    table = {
        "run": density.run.astype(np.int64),
        "component": density.component.astype(np.int64),
        "cluster": cluster,
        "local_density": dens.astype(np.float64),
        "silhouette": sil_all,
        "kept": kept,
    }
    return ConsensusResult(
        usages=usages_h,
        spectra=spectra_h,
        stability=stability,
        loss=float(loss),
        rel_error=float(loss) / max(op.norm2, 1e-300),
        cluster_sizes=sizes,
        n_dropped=int(n_total - n_kept),
        n_empty_clusters=int(n_empty),
        table=table,
        params={"n_neighbors": density.n_neighbors, "metric": rule.metric, "target": rule.target},
        distances=(np.asarray(density.dist, dtype=np.float32) if n_total <= MAX_STORED_POOL else None),
    )


@dataclass
class KSweepRow:
    """One row of a k sweep."""

    k: int
    stability: float
    best_error: float
    median_error: float
    consensus_failed: bool
    n_dropped: int
    n_empty_clusters: int
    n_converged: int


def sweep_batches(
    ks: Sequence[int],
    n_runs: int,
    shape: tuple[int, int],
    itemsize: int,
    budget_bytes: int = SWEEP_BATCH_BYTES,
    max_columns: int | None = None,
) -> list[list[int]]:
    """Split the ranks of a sweep into batches fitted together, each holding at most ``budget_bytes`` of factors
    and, when given, at most ``max_columns`` factor columns (the CPU's cache-friendly width,
    :func:`gpuc.nmf._run.cpu_batch_columns`).

    A batch of ranks holds ``C = n_runs * sum(k)`` factor columns of ``m + n`` rows in about six arrays (current,
    extrapolated and output factors); ranks are packed in order until the next one would exceed a bound (a rank
    alone is always allowed). On pbmc3k the whole 2..12 sweep fits one batch by memory (~90 MB); at a million cells
    each rank is its own batch.
    """
    whole = [(int(k), range(n_runs)) for k in ks]
    return [[k for k, _ in batch] for batch in pack_groups(whole, shape, itemsize, budget_bytes, max_columns)]


def fit_peak_bytes(k_cols: int, shape: tuple[int, int], itemsize: int) -> float:
    """Estimated peak memory of a batch of HALS fits with ``k_cols = n_runs * sum(k)`` factor columns.

    About ten ``(m + n) x k_cols`` arrays in the working precision: the random starts (which become the outputs),
    the flat current, extrapolated and new factors, the two data products and the extrapolation's temporaries
    (the array code; the fused kernels need fewer). Checked against ``tracemalloc`` peaks in
    ``tests/nmf/test_nmf_memory.py``.
    """
    return 10.0 * (shape[0] + shape[1]) * itemsize * k_cols


def consensus_peak_bytes(k: int, n_runs: int, shape: tuple[int, int], target: Target = "spectra") -> float:
    """Estimated peak memory of :func:`consensus` for one rank, ``P = n_runs * k`` pooled components of the
    clustered dimension ``d``: about five float64 ``(P, d)`` arrays (the pool in the working precision and in float64,
    the unit rows and their temporary, the kept rows k-means clusters) and a dozen float64 ``(P, P)`` matrices
    (similarities, distances and their temporaries, the live and kept blocks, the partition, the silhouette's
    copies and work). Checked against ``tracemalloc`` peaks in ``tests/nmf/test_nmf_memory.py``.
    """
    pool = float(n_runs) * k
    dim = shape[1] if target == "spectra" else shape[0]
    return 48.0 * pool * dim + 96.0 * pool * pool


@threaded
def run_ks(
    backend: Backend,
    op: Operator,
    ks: Sequence[int],
    n_runs: int,
    random_state: int,
    options: HalsOptions | None = None,
    *,
    client: Any = None,
    progress: Any = None,
    n_jobs: int | None = None,
    **schedule: Any,
) -> list[HalsResult]:
    """All restarts of the ranks ``ks``: in one batch in this process, or as Dask tasks with a ``client``.

    ``options`` is the HALS schedule (:class:`~gpuc.nmf._hals.HalsOptions`; default its defaults), and keywords
    ``schedule`` (``max_iter=``, ``tol=``, ...) replace its fields. Run ``i`` of rank ``k`` is seeded from
    ``(random_state, k, i)`` only, and every run's iterates are independent of the others in the batch, so a k's
    result does not depend on which other ranks are fitted with it, nor on where it runs
    (:func:`gpuc.nmf._run.fit_ranks`). ``n_jobs``: CPU threads of the fused kernels (row chunks in parallel) and of
    BLAS (:func:`gpuc._utils.cpu_threads`), per Dask unit on a cluster. ``progress``: as in :func:`fit_hals_groups`.
    """
    options = dataclasses.replace(options or HalsOptions(), **schedule)
    return fit_ranks(
        backend, op, ks, n_runs, random_state, options, client=client, progress=progress, n_jobs=n_jobs, what="nmf"
    )


def run_k(
    backend: Backend, op: Operator, k: int, n_runs: int, random_state: int, *args: Any, **kwargs: Any
) -> HalsResult:
    """All restarts of rank ``k`` (:func:`run_ks` with one rank)."""
    return run_ks(backend, op, [k], n_runs, random_state, *args, **kwargs)[0]


def sweep_row(backend: Backend, op: Operator, fits: HalsResult, k: int, **consensus_kwargs: Any) -> KSweepRow:
    """Consensus of one k's restarts reduced to its sweep row; a failed consensus is a row, not an error."""
    rel = fits.rel_errors
    n_conv = int(fits.converged.sum())
    try:
        res = consensus(backend, op, fits, k, refit=False, **consensus_kwargs)
    except ConsensusError:
        n_runs = fits.usages.shape[1]
        return KSweepRow(k, float("nan"), float(np.min(rel)), float(np.median(rel)), True, k * n_runs, 0, n_conv)
    return KSweepRow(
        k, res.stability, float(np.min(rel)), float(np.median(rel)), False, res.n_dropped, res.n_empty_clusters, n_conv
    )


def _sweep_row_unit(
    backend: Backend, k: int, fits: HalsResult, *, op: Operator, options: dict, n_jobs: int | None
) -> dict:
    """The sweep row of one rank from its restarts (consensus without the refit), as a dict (a Dask unit)."""
    return vars(sweep_row(backend, op, fits.moved(backend.asarray), k, **options, n_jobs=n_jobs))


def sweep_rows(
    backend: Backend,
    op: Operator,
    ks: Sequence[int],
    fits: Sequence[HalsResult],
    options: ConsensusOptions,
    *,
    client: Any = None,
    n_jobs: int | None = None,
) -> list[dict[str, Any]]:
    """The k sweep's rows (as dicts) of the ranks ``ks`` from their restarts ``fits``: in this process, or one Dask
    task per rank with a ``client`` (the data scattered once per worker); the rows are the same.
    """
    if client is None:
        return [
            vars(sweep_row(backend, op, f, int(k), **options.kwargs(), n_jobs=n_jobs))
            for k, f in zip(ks, fits, strict=True)
        ]
    return map_units(
        _sweep_row_unit,
        [(f"k={k}", (backend, int(k), f.moved(to_host))) for k, f in zip(ks, fits, strict=True)],
        client=client,
        shared={"op": op, "options": options.kwargs()},
        n_jobs=n_jobs,
        what="nmf_k_sweep",
        costs=list(ks),
    )


def _sweep_unit(
    backend: Backend,
    groups: list[Group],
    owned: set[int],
    *,
    op: Operator,
    random_state: int,
    options: dict,
    rule: dict,
    n_jobs: int | None,
) -> list[Any]:
    """One Dask unit of a k sweep: the restarts of its groups fitted together, then, on the same worker, the row
    (a dict) of every rank ``owned`` (all its restarts are here); for a part of a split rank its restarts, on the
    host.
    """
    fits = fit_groups(backend, op, groups, random_state, options)
    return [
        vars(sweep_row(backend, op, f, k, **rule, n_jobs=n_jobs)) if k in owned else f.moved(to_host)
        for (k, _), f in zip(groups, fits, strict=True)
    ]


def sweep_on_cluster(
    client: Any,
    backend: Backend,
    op: Operator,
    ks: Sequence[int],
    n_runs: int,
    random_state: int,
    options: HalsOptions,
    rule: ConsensusOptions,
    *,
    n_jobs: int | None = None,
) -> list[dict[str, Any]]:
    """The rows of a k sweep on a Dask cluster: one task per worker (:func:`gpuc.nmf._run.plan_units`) that fits
    its restarts together (one pass over the data per iteration for all of them) and computes there the rows of
    the ranks whose restarts it holds all of, so only those rows come back. A rank split between units (sparse
    data, when keeping it whole would unbalance the workers) has its restarts joined here and its row computed as
    one small task after them. The data are scattered once to every worker and stay there for both steps. The rows
    equal the in-process sweep's.
    """
    ks = [int(k) for k in ks]
    units = plan_units(op, ks, n_runs, n_workers(client))
    owned = owned_ranks(units, n_runs)
    with scattered(client, {"op": op}) as data:
        parts = map_units(
            _sweep_unit,
            [(unit_label(u, n_runs), (backend, u, o)) for u, o in zip(units, owned, strict=True)],
            client=client,
            shared={**data, "random_state": random_state, "options": options.kwargs(), "rule": rule.kwargs()},
            n_jobs=n_jobs,
            what="nmf_k_sweep",
            costs=[sum(unit_cost(k, len(r)) for k, r in u) for u in units],
        )
        by_k = join_units(units, parts, ks)
        mine = set().union(*owned)
        rows = {k: by_k[k][0] for k in ks if k in mine}
        split = [k for k in ks if k not in mine]
        if split:
            fits = [join_restarts(by_k[k]) for k in split]
            rows.update(
                zip(
                    split, sweep_rows(backend, data["op"], split, fits, rule, client=client, n_jobs=n_jobs), strict=True
                )
            )
    return [rows[k] for k in ks]


SUGGEST_TOL = 0.05
SUGGEST_MIN_GAIN = 0.05


def suggest_k(
    k: Sequence[int],
    stability: Sequence[float],
    error: Sequence[float],
    *,
    tol: float = SUGGEST_TOL,
    min_gain: float = SUGGEST_MIN_GAIN,
) -> int:
    """The number of programmes a k sweep points to: a stable k at which the error is still falling.

    With the ks in increasing order, the gain of a k is how much its error is below that of the previous k in the
    sweep; the first k counts as a gain. A k *still lowers the error* when its gain is at least ``min_gain`` times the
    total drop over the sweep (first error minus the smallest). Among those ks, the suggestion is the largest whose
    stability is within ``tol`` of the best stability among them. ks with a NaN stability (failed consensus) are
    never suggested.

    Rationale: beyond the number of programmes the data hold, an extra component fits noise, so the error keeps
    falling but by a small, nearly constant amount, and the restarts split noise differently, so stability drops;
    below it the restarts agree but merge real programmes. The error criterion excludes the first kind, the
    stability criterion picks the largest reproducible k among the rest. On simulated counts with 3-10 planted
    programmes (see the benchmarks page) the defaults recover the planted number in every case tried.

    Parameters
    ----------
    k
        The ranks of the sweep.
    stability
        Their stabilities (mean silhouettes).
    error
        Their relative reconstruction errors (e.g. the median over restarts).
    tol
        How far below the best stability a k may be.
    min_gain
        Smallest error drop, as a fraction of the total drop over the sweep, for a k to count as still lowering it.

    Returns
    -------
    The suggested k.
    """
    k = np.asarray(k, dtype=np.int64)
    stab = np.asarray(stability, dtype=np.float64)
    err = np.asarray(error, dtype=np.float64)
    if not (k.shape == stab.shape == err.shape) or k.size == 0:
        msg = "k, stability and error must be non-empty and of the same length."
        raise ValueError(msg)
    order = np.argsort(k, kind="stable")
    k, stab, err = k[order], stab[order], err[order]
    total = float(err[0] - np.nanmin(err))
    gain = np.r_[np.inf, err[:-1] - err[1:]]
    falling = gain >= min_gain * total
    ok = falling & np.isfinite(stab)
    if not ok.any():
        ok = np.isfinite(stab)
        if not ok.any():
            return int(k[0])
    best = float(stab[ok].max())
    return int(k[ok & (stab >= best - tol)].max())
