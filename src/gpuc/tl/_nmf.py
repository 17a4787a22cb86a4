"""``gpuc.tl.nmf_k_sweep`` and ``gpuc.tl.consensus_nmf``: AnnData adapters over :mod:`gpuc.nmf`."""

from __future__ import annotations

import copy as copy_module
import itertools
import numbers
import time
import warnings
from collections.abc import Iterable
from typing import Any, Literal

import numpy as np
import pandas as pd
from anndata import AnnData
from scanpy import logging as logg

from gpuc import _keys
from gpuc._backend import Backend, Device, backend_of, get_backend, is_sparse, to_host
from gpuc._dask import map_units, n_workers, resolve_client, runs_on
from gpuc._errors import ConvergenceWarning, GpucWarning, interruptible
from gpuc._lazy import load
from gpuc._utils import derive_seed, progress
from gpuc._validate import (
    SeedLike,
    align_to_var,
    check_adata,
    check_bool,
    check_choice,
    check_int,
    check_key,
    check_key_added,
    check_memory,
    check_number,
    get_matrix,
    resolve_random_state,
)
from gpuc.nmf._consensus import (
    ConsensusError,
    consensus_of_pool,
    consensus_peak_bytes,
    fit_peak_bytes,
    pool_density,
    run_k,
    run_ks,
    stored_pool,
    suggest_k,
    sweep_batches,
    sweep_row,
)
from gpuc.nmf._hals import TOL, UPDATE_ORDERS, WARMUP, HalsResult, Operator, fit_hals_groups
from gpuc.nmf._prepare import PREPROCESSING, prepare_matrix

Preprocessing = Literal["none", "sd", "sqrt_sd"]
_METRICS = ("cosine", "euclidean")
_TARGETS = ("spectra", "usage")
_NORMALIZATIONS = ("sum", "l2")


# --------------------------------------------------------------------------------------------------------------------
# input checks and the factorised block
# --------------------------------------------------------------------------------------------------------------------
def _gene_mask(adata: AnnData, mask_var: str | np.ndarray | None) -> np.ndarray:
    """Boolean mask of the genes to factorise: ``var[mask_var]``, a boolean array over genes, or all (``None``)."""
    if mask_var is None:
        return np.ones(adata.n_vars, dtype=bool)
    # a boolean Series (or dict) is matched to var_names by label, never by position
    mask_var = align_to_var(mask_var, adata, "mask_var")
    if isinstance(mask_var, pd.Series):
        if not pd.api.types.is_bool_dtype(mask_var.dtype):
            msg = f"mask_var as a Series must be boolean, got dtype {mask_var.dtype}."
            raise TypeError(msg)
        mask_var = mask_var.to_numpy(dtype=bool)
    if isinstance(mask_var, str):
        if mask_var not in adata.var:
            msg = (
                f"mask_var={mask_var!r} but adata.var has no such column; run sc.pp.highly_variable_genes(adata, ...) "
                "first, or pass mask_var=None to use every gene."
            )
            raise KeyError(msg)
        mask = adata.var[mask_var].to_numpy()
        where = f"adata.var[{mask_var!r}]"
    else:
        mask = np.asarray(mask_var)
        where = "mask_var"
        if mask.shape != (adata.n_vars,):
            msg = f"mask_var as an array must have one entry per gene ({adata.n_vars}), got shape {mask.shape}."
            raise ValueError(msg)
    if mask.dtype != bool:
        msg = f"{where} must be boolean, got dtype {mask.dtype}."
        raise TypeError(msg)
    if mask.sum() == 0:
        msg = f"{where} selects no gene."
        raise ValueError(msg)
    return mask


def _prepare_block(
    adata: AnnData, layer: str | None, mask_var: str | np.ndarray | None, preprocessing: str
) -> tuple[Any, np.ndarray]:
    """The checked (and optionally scaled) cells x genes block that is factorised, and the gene mask; touches
    nothing in ``adata``. The block stays where the data lives (numpy/scipy or cupy/cupyx). A dask array (a lazily
    read AnnData) has its ``mask_var`` genes selected lazily, then only that block is loaded into memory.
    """
    check_choice("preprocessing", preprocessing, PREPROCESSING)
    mat = get_matrix(adata, layer=layer)
    mask = _gene_mask(adata, mask_var)
    block = mat[:, np.flatnonzero(mask)] if not mask.all() else mat
    where = f"adata.layers[{layer!r}]" if layer is not None else "adata.X"
    block = load(block, where)  # dask: reads only the selected genes (CSR for sparse chunks) and logs the size
    return prepare_matrix(block, preprocessing, gene_names=adata.var_names[mask], where=where), mask


def _check_common(
    n_runs: int,
    density_threshold: float,
    metric: str,
    target: str,
    normalization: str,
    max_iter: int,
    tol: float,
    extrapolate: bool = True,
    warmup: int = 0,
    update_order: str = "usages",
) -> None:
    check_int("n_runs", n_runs, minimum=2)
    if not isinstance(extrapolate, bool):
        msg = f"extrapolate must be True or False, got {extrapolate!r}."
        raise TypeError(msg)
    check_int("warmup", warmup, minimum=0)
    check_choice("update_order", update_order, UPDATE_ORDERS)
    check_choice("metric", metric, _METRICS)
    check_choice("target", target, _TARGETS)
    check_choice("normalization", normalization, _NORMALIZATIONS)
    check_int("max_iter", max_iter, minimum=1)
    check_number("density_threshold", density_threshold, low=0, high=2, hint="2 turns the filter off.")
    check_number("tol", tol, low=0, low_open=True)


def _check_k(k: Any, shape: tuple[int, int], name: str = "k") -> int:
    k = check_int(name, k, minimum=2)
    limit = min(shape)
    if k >= limit:
        msg = f"{name}={k} must be smaller than min(n_cells, n_genes) = min{tuple(shape)} = {limit}."
        raise ValueError(msg)
    return k


def _check_nmf_memory(backend: Backend, op: Operator, batches: list[list[int]], n_runs: int, target: str) -> None:
    """Refuse, before any fit, a sweep or consensus whose estimated peak exceeds the device's free memory."""
    fit = max(fit_peak_bytes(n_runs * sum(b), op.shape, op.dtype.itemsize) for b in batches)
    pool = max(consensus_peak_bytes(k, n_runs, op.shape, target) for b in batches for k in b)
    ks = sorted(k for b in batches for k in b)
    check_memory(
        backend,
        fit + pool,
        f"NMF with k={ks[-1] if len(ks) == 1 else ks} and n_runs={n_runs} on {op.shape[0]} x {op.shape[1]}",
        f"The restarts alone need {fit / 2**30:.1f} GiB and the consensus of {n_runs * ks[-1]} pooled components "
        f"{pool / 2**30:.1f} GiB: use fewer runs (n_runs), a smaller k, or fewer genes (highly variable genes).",
    )


def _warn_not_converged(n_not: dict[int, int], n_runs: int, max_iter: int, tol: float) -> None:
    """One :class:`ConvergenceWarning` for the restarts that stopped at ``max_iter`` ({k: count})."""
    n_not = {k: v for k, v in n_not.items() if v}
    if not n_not:
        return
    where = ", ".join(f"{v} of {n_runs} at k={k}" for k, v in n_not.items())
    msg = (
        f"NMF restarts stopped at max_iter={max_iter} before the loss change fell below tol={tol:g}: {where}. "
        "Their factors are used as they are; pass a larger max_iter (or a larger tol), and check the data is "
        "non-negative and not scaled to extreme values (per-run flags in uns[key]['run_converged'] / 'n_converged')."
    )
    warnings.warn(msg, ConvergenceWarning, stacklevel=3)


# --------------------------------------------------------------------------------------------------------------------
# restarts and ranks as Dask tasks
# --------------------------------------------------------------------------------------------------------------------
def _restart_chunks(op: Operator, ks: list[int], n_runs: int, client: Any) -> list[tuple[int, range]]:
    """The units of a distributed fit: ``(k, runs)`` pairs covering every restart of every rank.

    On sparse data a run's iterates do not depend on the other runs of its batch (per-row sums in a fixed order), so
    restarts are grouped into units of at most about half a worker's share of the work (a run's cost grows with its
    k), so that the units, started costliest first, balance the workers; a rank's runs stay together up to that size,
    as they share the passes over the data (a split rank passes over it once per unit). Dense
    products go through BLAS, which may round a column differently with the width of the product: there each rank
    stays one unit, so the runs are bit-identical to the in-process fit.
    """
    if not op.sparse:
        return [(k, range(n_runs)) for k in ks]
    target = sum(k * n_runs for k in ks) / (2.0 * n_workers(client))  # work per unit, in run-ranks
    out = []
    for k in ks:
        size = max(1, min(n_runs, round(target / k)))
        n_units = -(-n_runs // size)
        bounds = np.linspace(0, n_runs, n_units + 1).round().astype(int)  # even split of the k's runs
        out += [(k, range(int(lo), int(hi))) for lo, hi in itertools.pairwise(bounds)]
    return out


def _fit_restarts(
    backend: Backend, k: int, runs: range, *, op: Operator, random_state: int, options: dict, n_jobs: int | None
) -> HalsResult:
    """Restarts ``runs`` of rank ``k`` (seeds from ``(random_state, k, run)``), factors brought to the host."""
    seeds = [derive_seed(random_state, k, i) for i in runs]
    return fit_hals_groups(backend, op, [(k, seeds)], **options)[0].moved(to_host)


def _join_restarts(parts: list[HalsResult]) -> HalsResult:
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


def _fit_on_cluster(
    client: Any,
    backend: Backend,
    op: Operator,
    ks: list[int],
    n_runs: int,
    random_state: int,
    options: dict,
    n_jobs: int | None,
    what: str,
) -> dict[int, HalsResult]:
    """Every restart of ranks ``ks`` as Dask tasks (the data scattered once per worker); ``{k: restarts}``."""
    chunks = _restart_chunks(op, ks, n_runs, client)
    units = [(f"k={k} runs {r.start}-{r.stop - 1}", (backend, k, r)) for k, r in chunks]
    parts = map_units(
        _fit_restarts,
        units,
        client=client,
        shared={"op": op, "random_state": random_state, "options": options},
        n_jobs=n_jobs,
        what=what,
        costs=[k * len(r) for k, r in chunks],
    )
    return {k: _join_restarts([p for (kk, _), p in zip(chunks, parts, strict=True) if kk == k]) for k in ks}


def _sweep_row_unit(
    backend: Backend, k: int, fits: HalsResult, *, op: Operator, options: dict, n_jobs: int | None
) -> dict:
    """The sweep row of one rank from its restarts (consensus without the refit), as a dict."""
    return vars(sweep_row(backend, op, fits.moved(backend.asarray), k, **options, n_jobs=n_jobs))


def _stored_mask(mask_var: Any, mask: np.ndarray) -> Any:
    """``params["mask_var"]``: a column name or None as given; any other form (an array, a labelled Series) as the
    boolean array over ``var_names`` it selected, so a replay selects the same genes.
    """
    return mask_var if mask_var is None or isinstance(mask_var, str) else mask.copy()


def _call_params(**call: Any) -> dict[str, Any]:
    """``uns[key]["params"]`` of an NMF tool: its call as made, with arrays and dtypes in forms h5ad can store."""
    out = dict(call)
    mask_var = out["mask_var"]
    if mask_var is not None and not isinstance(mask_var, str):
        out["mask_var"] = np.asarray(mask_var)
    out["dtype"] = None if out["dtype"] is None else str(np.dtype(out["dtype"]))
    for name in ("density_threshold", "neighborhood", "tol"):
        if name in out:
            out[name] = float(out[name])
    return out


# the largest |V|**2 * n_cells * n_genes (a bound on ||V||^2 and on the products HALS forms) each precision holds with
# a margin of 1000 below its largest finite value
_SAFE_SQUARES = {np.dtype(np.float32): float(np.finfo(np.float32).max) / 1e3, np.dtype(np.float64): 1e305}


def _backend_and_op(block: Any, device: Device | None, dtype: Any) -> tuple[Backend, Operator]:
    if dtype is not None and np.dtype(dtype) not in (np.float32, np.float64):
        msg = f"dtype={dtype!r} is not supported; use 'float32' (default) or 'float64'."
        raise ValueError(msg)
    backend = get_backend(device, block, tool="nmf", work=float(block.shape[0]) * float(block.shape[1]))
    dtype = _working_dtype(block, dtype)
    return backend, Operator.build(backend, block, dtype=dtype)


def _working_dtype(block: Any, dtype: Any) -> np.dtype | None:
    """The precision of the fit: ``dtype``, or float64 when the default float32 would overflow on these values.

    Values whose squares summed over the matrix exceed float32 (counts near 1e18) would turn errors and refits into
    inf/NaN: by default the fit then runs in float64, with a warning; an explicit ``dtype="float32"`` is refused, and
    so are values too large even for float64.
    """
    data = block.data if is_sparse(block) else block
    top = float(backend_of(data).xp.abs(data).max()) if data.size else 0.0
    bound = top * top * float(block.shape[0]) * float(block.shape[1])
    if bound > _SAFE_SQUARES[np.dtype(np.float64)]:
        msg = (
            f"the factorised values reach {top:.3g}: their squares overflow even float64. Rescale the data (e.g. "
            "normalise to counts per 10,000) before NMF."
        )
        raise ValueError(msg)
    if bound <= _SAFE_SQUARES[np.dtype(np.float32)]:
        return None if dtype is None else np.dtype(dtype)
    if dtype is not None and np.dtype(dtype) == np.float32:
        msg = (
            f"the factorised values reach {top:.3g}, whose squares overflow float32; pass dtype='float64' (or leave "
            "dtype=None), or rescale the data."
        )
        raise ValueError(msg)
    if dtype is None:
        warnings.warn(
            f"the factorised values reach {top:.3g}, whose squares overflow float32: the fit runs in float64.",
            GpucWarning,
            stacklevel=4,
        )
    return np.dtype(np.float64)


# --------------------------------------------------------------------------------------------------------------------
# k sweep
# --------------------------------------------------------------------------------------------------------------------
def nmf_k_sweep(
    adata: AnnData,
    k_range: Iterable[int] = range(2, 13),
    *,
    n_runs: int = 10,
    layer: str | None = None,
    mask_var: str | np.ndarray | None = "highly_variable",
    preprocessing: Preprocessing = "none",
    density_threshold: float = 2.0,
    metric: Literal["cosine", "euclidean"] = "cosine",
    target: Literal["spectra", "usage"] = "spectra",
    max_iter: int = 500,
    tol: float = TOL,
    extrapolate: bool = True,
    warmup: int = WARMUP,
    update_order: Literal["usages", "spectra"] = "usages",
    kmeans_n_init: int = 10,
    device: Device | None = None,
    n_jobs: int | None = None,
    client: Any = None,
    dtype: Any = None,
    random_state: SeedLike = 0,
    key_added: str = _keys.NMF_K_SWEEP,
    copy: bool = False,
) -> AnnData | None:
    """Consensus NMF stability and reconstruction error across ranks, to choose ``k``.

    The ``n_runs`` random HALS restarts of every ``k`` are fitted together, all ranks in the same data products (one
    pass over the matrix per half-iteration for the whole sweep, in memory-bounded batches of ranks), then each k's
    runs are pooled and clustered exactly as in :func:`consensus_nmf`, but only the diagnostics are kept. Each run's
    seed comes from ``(random_state, k, run)`` and its iterates do not depend on the other runs of the batch, so a
    k's row does not depend on which other ks are in the sweep.
    The k the sweep points to (a stable k at which adding a programme still lowers the error) is recorded as
    ``suggested_k``; see :func:`gpuc.get.nmf_suggest_k` for the rule, and :func:`gpuc.pl.nmf_k_sweep` to look at it.

    Parameters
    ----------
    adata
        Cells (or metacells) x genes.
    k_range
        Ranks to try (integers >= 2, each smaller than the number of cells and of genes), e.g. ``range(2, 13)``. A
        bare integer is refused (``nmf_k_sweep(adata, 10)`` would sweep k=10 only): pass ``range(2, 11)``.
    n_runs
        Restarts per k (>= 2).
    layer
        Layer to factorise (default ``adata.X``): raw counts with ``preprocessing="sd"`` for cNMF-style programmes,
        a log-normalised layer with ``"none"`` for bixverse-style ones. Must be finite and non-negative.
    mask_var
        Genes to factorise: a boolean ``var`` column (``"highly_variable"``, the default, as left by
        :func:`scanpy.pp.highly_variable_genes`), a boolean array over genes (in ``var`` order), a boolean Series
        labelled by ``var_names`` (matched by name), or ``None`` for every gene.
    preprocessing
        ``"none"``, ``"sd"`` (divide each gene by its SD, ddof=1, no centring, as cNMF) or ``"sqrt_sd"``.
    density_threshold
        Components with local density ``>=`` this are dropped before clustering; 2.0 (default here) keeps all.
    metric
        Distance for the density and the silhouette: ``"cosine"`` (1 - cos) or ``"euclidean"`` (cNMF, on unit rows).
    target
        Cluster the runs' ``"spectra"`` (gene space, cNMF) or ``"usage"`` columns (cell space).
    max_iter, tol
        HALS iteration limit and tolerance: a run stops when its loss changed by less than ``tol * ||V||^2`` over the
        last 10 iterations (checked every 5).
        From identical random starts the defaults (``tol=1e-6, warmup=5``) give the restart-to-restart stability of
        cNMF's solver (scikit-learn coordinate descent); a looser ``tol`` is faster and slightly less stable (see
        the benchmarks page).
    extrapolate
        Ang & Gillis extrapolation of the HALS iterates (per-run adaptive step with restarts) after the ``warmup``
        iterations: far fewer iterations than plain HALS. ``False`` gives plain HALS throughout.
    warmup
        Iterations of plain HALS before the extrapolation starts. Which optimum a random start ends in is decided
        early; plain HALS there, from the usages first, lands in the same optima as cNMF's solver and gives its
        restart-to-restart stability, the extrapolation then converges fast. 0 extrapolates from the start.
    update_order
        ``"usages"``: the usages are updated first, from the random spectra, as scikit-learn's coordinate descent
        (cNMF's solver) does; ``"spectra"``: the spectra first (bixverse's order).
    kmeans_n_init
        k-means restarts for the consensus clustering.
    device
        ``"auto"``, ``"cpu"`` or ``"gpu"``; ``None`` follows :attr:`gpuc.settings.device`.
    n_jobs
        CPU threads: ``None`` follows :attr:`gpuc.settings.n_jobs` (all cores available to the process), ``-1`` all
        cores. Results do not depend on it. In a Dask task, at most the worker's threads.
    client
        Where the restarts run: ``None`` follows :attr:`gpuc.settings.client` (default: in this process, all ranks
        in the same data products); ``"default"`` or a ``distributed.Client``: batches of restarts of each rank as
        Dask tasks (on sparse data several per rank, on dense data one per rank), the data scattered once to every
        worker, then one consensus task per rank. Runs and rows are identical wherever they run.
    dtype
        Working precision of the data and factors: float32 (default, on both devices; losses are still accumulated
        in float64) or float64. With the default, values whose squares would overflow float32 (counts near 1e18)
        are fitted in float64, with a warning; ``dtype="float32"`` is then refused.
    random_state
        Master seed: an int, ``None`` (fresh entropy) or a numpy ``RandomState``/``Generator`` (drawn from once);
        the int used is recorded in ``params``.
    key_added
        ``uns`` key of the result.
    copy
        Return a modified copy instead of writing into ``adata``.

    Returns
    -------
    ``None``, or a copy of ``adata`` with ``copy=True``. Sets

    ``adata.uns[key_added]['params']``
        The arguments of the call.
    ``adata.uns[key_added]['table']``
        :class:`pandas.DataFrame`, one row per k: ``k``, ``stability`` (mean silhouette, NaN if the consensus failed),
        ``best_error`` and ``median_error`` (relative errors ``||V - WH||^2 / ||V||^2`` over the restarts),
        ``consensus_failed``, ``n_dropped``, ``n_empty_clusters``, ``n_converged``.
    ``adata.uns[key_added]['suggested_k']``
        The k the sweep points to under :func:`gpuc.get.nmf_suggest_k`'s rule with its default options (an int;
        call that function to apply other options).

    Warns
    -----
    ConvergenceWarning
        When restarts stopped at ``max_iter`` before meeting ``tol`` (once per call, with counts per k).

    Raises
    ------
    InsufficientMemoryError
        Before any fit, when the restarts and the consensus would need more memory than the device has free.
    """
    check_adata(adata)
    if isinstance(k_range, numbers.Integral) and not isinstance(k_range, bool | np.bool_):
        msg = (
            f"k_range={k_range!r} is a single rank, not a range of ranks to compare. To sweep k = 2..{k_range}, pass "
            f"k_range=range(2, {k_range} + 1); for this rank alone, pass k_range=[{k_range}]."
        )
        raise TypeError(msg)
    if isinstance(k_range, str) or not isinstance(k_range, Iterable):
        msg = f"k_range must be an iterable of integers such as range(2, 13), got {k_range!r}."
        raise TypeError(msg)
    ks = list(k_range)
    if len(ks) == 0:
        msg = "k_range is empty."
        raise ValueError(msg)
    _check_common(n_runs, density_threshold, metric, target, "sum", max_iter, tol, extrapolate, warmup, update_order)
    check_int("kmeans_n_init", kmeans_n_init, minimum=1)
    random_state = resolve_random_state(random_state)
    check_key_added(key_added)
    check_bool("copy", copy)
    _keys.check_not_foreign(adata, {"uns": [key_added]}, key_added, "gpuc.tl.nmf_k_sweep", _keys.NMF_K_SWEEP_MARKER)
    block, mask = _prepare_block(adata, layer, mask_var, preprocessing)
    ks = sorted({_check_k(k, block.shape, "k_range entry") for k in ks})
    backend, op = _backend_and_op(block, device, dtype)
    # ranks are fitted together, in batches bounded in memory (one pass over V per iteration serves every rank)
    batches = sweep_batches(ks, n_runs, op.shape, op.dtype.itemsize)
    _check_nmf_memory(backend, op, batches, n_runs, target)

    dask_client = resolve_client(client)
    start = logg.info(
        f"NMF k sweep: k={ks}, {n_runs} runs each, {op.shape[0]} x {op.shape[1]} ({runs_on(backend, dask_client)})"
    )
    rows = []
    t0 = time.perf_counter()
    hals = {
        "max_iter": max_iter,
        "tol": tol,
        "extrapolate": extrapolate,
        "warmup": warmup,
        "update_order": update_order,
    }
    row_options = {
        "target": target, "metric": metric, "density_threshold": float(density_threshold),
        "kmeans_n_init": kmeans_n_init, "random_state": random_state,
    }  # fmt: skip
    bar = progress(total=len(ks), desc="k sweep")
    with interruptible("nmf_k_sweep"):
        if dask_client is not None:
            # restarts (and ranks) as tasks, then one consensus task per rank; same runs and rows as in process
            fitted = _fit_on_cluster(dask_client, backend, op, ks, n_runs, random_state, hals, n_jobs, "nmf_k_sweep")
            rows = map_units(
                _sweep_row_unit,
                [(f"k={k}", (backend, k, fitted[k])) for k in ks],
                client=dask_client,
                shared={"op": op, "options": row_options},
                n_jobs=n_jobs,
                what="nmf_k_sweep",
                costs=ks,
            )
        for batch in batches if dask_client is None else []:
            ranks = f"k={batch[0]}" if len(batch) == 1 else f"k={batch[0]}..{batch[-1]}"
            hals_bar = progress(total=max_iter, desc=f"HALS {ranks}")
            fits_of = run_ks(
                backend,
                op,
                batch,
                n_runs,
                random_state,
                max_iter=max_iter,
                tol=tol,
                extrapolate=extrapolate,
                warmup=warmup,
                update_order=update_order,
                progress=hals_bar.update,
                n_jobs=n_jobs,
            )
            hals_bar.close()
            logg.debug(
                f"    HALS {ranks}: {len(batch) * n_runs} runs fitted together, "
                f"{max(int(f.n_iter.max()) for f in fits_of)} iterations"
            )
            for k, fits in zip(batch, fits_of, strict=True):
                row = sweep_row(backend, op, fits, k, **row_options, n_jobs=n_jobs)
                rows.append(vars(row))
                bar.update(1)
    bar.close()
    table = pd.DataFrame(rows)
    if table["consensus_failed"].any():
        msg = (
            f"consensus failed for k={table.loc[table.consensus_failed, 'k'].tolist()}: too few components passed the "
            "density filter; their stability is NaN. Raise density_threshold (2.0 keeps every component)."
        )
        warnings.warn(msg, GpucWarning, stacklevel=2)
    if (table["n_empty_clusters"] > 0).any():
        msg = f"the consensus k-means left empty clusters for k={table.loc[table.n_empty_clusters > 0, 'k'].tolist()}"
        warnings.warn(msg, GpucWarning, stacklevel=2)
    _warn_not_converged(dict(zip(table["k"], n_runs - table["n_converged"], strict=True)), n_runs, max_iter, tol)

    adata = adata.copy() if copy else adata
    adata.uns[key_added] = {
        "params": _call_params(
            k_range=np.asarray(ks, dtype=np.int64),
            n_runs=n_runs,
            layer=layer,
            mask_var=_stored_mask(mask_var, mask),
            preprocessing=preprocessing,
            density_threshold=density_threshold,
            metric=metric,
            target=target,
            max_iter=max_iter,
            tol=tol,
            extrapolate=extrapolate,
            warmup=warmup,
            update_order=update_order,
            kmeans_n_init=kmeans_n_init,
            dtype=dtype,
            random_state=random_state,
            device=device,
            n_jobs=n_jobs,
        ),
        "device": backend.name,
        "dtype": str(op.dtype),
        "table": table,
        "suggested_k": suggest_k(table["k"], table["stability"], table["median_error"]),
        "seconds": time.perf_counter() - t0,
    }
    logg.info(
        "    finished",
        time=start,
        deep=f"added\n    'uns[{key_added!r}]' (params, table, suggested_k={adata.uns[key_added]['suggested_k']})",
    )
    return adata if copy else None


# --------------------------------------------------------------------------------------------------------------------
# consensus at one k
# --------------------------------------------------------------------------------------------------------------------
def consensus_nmf(
    adata: AnnData,
    k: int,
    *,
    n_runs: int = 20,
    layer: str | None = None,
    mask_var: str | np.ndarray | None = "highly_variable",
    preprocessing: Preprocessing = "none",
    density_threshold: float = 0.5,
    metric: Literal["cosine", "euclidean"] = "cosine",
    target: Literal["spectra", "usage"] = "spectra",
    normalization: Literal["sum", "l2"] = "sum",
    neighborhood: float = 0.3,
    max_iter: int = 500,
    tol: float = TOL,
    extrapolate: bool = True,
    warmup: int = WARMUP,
    update_order: Literal["usages", "spectra"] = "usages",
    kmeans_n_init: int = 10,
    device: Device | None = None,
    n_jobs: int | None = None,
    client: Any = None,
    dtype: Any = None,
    random_state: SeedLike = 0,
    key_added: str = _keys.NMF,
    copy: bool = False,
) -> AnnData | None:
    """Consensus NMF gene expression programmes (cNMF / bixverse) from batched HALS restarts.

    ``n_runs`` random restarts of rank ``k`` are fitted together by HALS; their components are pooled and
    L2-normalised, components with a high local density (mean distance to their ``ceil(neighborhood * n_runs)``
    nearest neighbours) are dropped, the rest clustered by k-means into ``k`` groups, the per-cluster median taken as
    the consensus, and the partner factor refitted by non-negative least squares. cNMF's settings are
    ``metric="euclidean", density_threshold=0.5, normalization="sum"`` on raw counts with ``preprocessing="sd"``.

    Parameters
    ----------
    adata
        Cells (or metacells) x genes.
    k
        Number of programmes (>= 2, smaller than the number of cells and of genes).
    n_runs
        Restarts (>= 2).
    layer, mask_var, preprocessing
        The factorised block, as in :func:`nmf_k_sweep`.
    density_threshold
        Keep components with local density ``<`` this (0.5 default; 2.0 keeps all). Read the histogram
        (:func:`gpuc.pl.nmf_density`) before tightening it.
    metric
        Distance for the density and the silhouette: ``"cosine"`` (default) or ``"euclidean"`` (cNMF).
    target
        Cluster ``"spectra"`` (gene space, default) or ``"usage"`` columns (cell space; then the spectra are refitted).
    normalization
        Consensus rows rescaled to ``"sum"`` 1 (cNMF) or unit ``"l2"`` norm (bixverse); the refitted factor takes the
        scale.
    neighborhood
        Fraction of ``n_runs`` used as the number of neighbours for the local density.
    max_iter, tol, extrapolate, warmup, update_order, kmeans_n_init, device, n_jobs, client, dtype, random_state
        As in :func:`nmf_k_sweep`; run seeds derive from ``(random_state, k, run)``. With a client, batches of
        restarts are Dask tasks and the consensus runs in this process.
    key_added
        Key prefix: ``obsm['X_' + key_added]``, ``varm[key_added + '_spectra']``, ``uns[key_added]``. Entries there
        that an earlier consensus_nmf under this key did not write (``key_added="pca"`` would replace ``X_pca``) are
        never replaced: the call is refused.
    copy
        Return a modified copy instead of writing into ``adata``.

    Returns
    -------
    ``None``, or a copy of ``adata`` with ``copy=True``. Sets

    ``adata.obsm['X_nmf']``
        Cells x k usages (programmes ordered by total usage, largest first).
    ``adata.varm['nmf_spectra']``
        Genes x k consensus programmes (zero for genes not factorised).
    ``adata.uns['nmf']``
        ``params``; ``stability`` (mean silhouette of the kept components); ``rel_error`` of the consensus refit;
        ``run_errors`` (each restart's relative error); ``n_converged``, ``run_converged`` and ``run_n_iter``
        (whether and after how many iterations each restart met ``tol``); ``cluster_sizes``; ``n_dropped``;
        ``n_empty_clusters``; ``n_neighbors``; ``components`` (one row per pooled component: run, component,
        cluster (-1 if dropped), local_density, silhouette, kept); ``genes`` (the factorised genes); ``distances``
        (pooled-component distance matrix under ``metric``, float32, for the clustergram; only when there are at
        most 2,000 pooled components); ``pool`` (the pooled components of the restarts, ``n_runs * k`` rows in the
        working precision, spectra over the factorised genes or usages over the cells per ``target``), from which
        :func:`nmf_refine` redoes the consensus with another density threshold without refitting.

    Outputs of an earlier run under the same ``key_added`` are replaced.

    Warns
    -----
    ConvergenceWarning
        When restarts stopped at ``max_iter`` before meeting ``tol`` (once per call, with the count).

    Raises
    ------
    InsufficientMemoryError
        Before any fit, when the restarts and the consensus would need more memory than the device has free.
    """
    check_adata(adata)
    _check_common(
        n_runs, density_threshold, metric, target, normalization, max_iter, tol, extrapolate, warmup, update_order
    )
    check_int("kmeans_n_init", kmeans_n_init, minimum=1)
    random_state = resolve_random_state(random_state)
    neighborhood = check_number("neighborhood", neighborhood, low=0, high=1, low_open=True)
    check_key_added(key_added)
    check_bool("copy", copy)
    _keys.check_not_foreign(adata, _keys.nmf_outputs(key_added), key_added, "gpuc.tl.consensus_nmf", _keys.NMF_MARKER)
    block, mask = _prepare_block(adata, layer, mask_var, preprocessing)
    k = _check_k(k, block.shape)
    backend, op = _backend_and_op(block, device, dtype)
    _check_nmf_memory(backend, op, [[k]], n_runs, target)

    dask_client = resolve_client(client)
    start = logg.info(
        f"consensus NMF: k={k}, {n_runs} runs, {op.shape[0]} x {op.shape[1]} ({runs_on(backend, dask_client)})"
    )
    t0 = time.perf_counter()
    hals = {
        "max_iter": max_iter,
        "tol": tol,
        "extrapolate": extrapolate,
        "warmup": warmup,
        "update_order": update_order,
    }
    with interruptible("consensus_nmf"):
        if dask_client is not None:
            # batches of restarts as tasks; the consensus of the pooled runs is computed here, as in process
            fits = _fit_on_cluster(dask_client, backend, op, [k], n_runs, random_state, hals, n_jobs, "consensus_nmf")[
                k
            ]
            fits = fits.moved(backend.asarray)
        else:
            bar = progress(total=max_iter, desc=f"HALS k={k}")
            fits = run_k(backend, op, k, n_runs, random_state, **hals, progress=bar.update, n_jobs=n_jobs)
            bar.close()
        params = _call_params(
            k=k,
            n_runs=n_runs,
            layer=layer,
            mask_var=_stored_mask(mask_var, mask),
            preprocessing=preprocessing,
            density_threshold=density_threshold,
            metric=metric,
            target=target,
            normalization=normalization,
            neighborhood=neighborhood,
            max_iter=max_iter,
            tol=tol,
            extrapolate=extrapolate,
            warmup=warmup,
            update_order=update_order,
            kmeans_n_init=kmeans_n_init,
            dtype=dtype,
            random_state=random_state,
            device=device,
            n_jobs=n_jobs,
        )
    runs = {
        "run_errors": fits.rel_errors.astype(np.float64),
        "n_converged": int(fits.converged.sum()),
        "run_converged": np.asarray(to_host(fits.converged), dtype=bool),
        "run_n_iter": np.asarray(to_host(fits.n_iter), dtype=np.int64),
        "pool": stored_pool(backend, fits, target),
    }
    _warn_not_converged({k: int((~fits.converged).sum())}, n_runs, max_iter, tol)
    return _consensus_and_write(
        adata, backend, op, mask, params, runs, key_added=key_added, copy=copy, start=start, t0=t0
    )


def _consensus_and_write(
    adata: AnnData,
    backend: Backend,
    op: Operator,
    mask: np.ndarray,
    params: dict[str, Any],
    runs: dict[str, Any],
    *,
    key_added: str,
    copy: bool,
    start: Any,
    t0: float,
) -> AnnData | None:
    """Consensus of the stored pool (density, filter, k-means, median, refit) and the writes of
    :func:`consensus_nmf`; :func:`nmf_refine` calls it with the pool of an earlier run.
    """
    k = int(params["k"])
    with interruptible("consensus_nmf"):
        density = pool_density(
            runs["pool"], int(params["n_runs"]), k, metric=params["metric"], neighborhood=float(params["neighborhood"])
        )
        try:
            res = consensus_of_pool(
                backend,
                op,
                density,
                k,
                target=params["target"],
                metric=params["metric"],
                density_threshold=float(params["density_threshold"]),
                normalization=params["normalization"],
                kmeans_n_init=int(params["kmeans_n_init"]),
                random_state=int(params["random_state"]),
                n_jobs=params.get("n_jobs"),
            )
        except ConsensusError as err:
            raise ValueError(str(err)) from None
    if res.n_empty_clusters:
        warnings.warn(
            f"{res.n_empty_clusters} of the {k} consensus k-means clusters are empty; their programmes are zero. "
            "Use a smaller k or a higher density_threshold.",
            GpucWarning,
            stacklevel=3,
        )
    if not (np.isfinite(res.usages).all() and np.isfinite(res.spectra).all() and np.isfinite(res.rel_error)):
        msg = (
            f"the consensus at k={k} gave non-finite values (overflow in dtype {op.dtype}); nothing was written. "
            "Pass dtype='float64', or rescale the data."
        )
        raise FloatingPointError(msg)
    spectra = np.zeros((adata.n_vars, k))
    spectra[mask] = res.spectra.T
    comp = pd.DataFrame(res.table)
    adata = adata.copy() if copy else adata
    _keys.drop_outputs(adata, _keys.nmf_outputs(key_added))
    adata.obsm[_keys.nmf_usages(key_added)] = res.usages
    adata.varm[_keys.nmf_spectra(key_added)] = spectra
    adata.uns[key_added] = {
        "params": params,
        "device": backend.name,
        "dtype": str(op.dtype),
        "stability": res.stability,
        "rel_error": res.rel_error,
        "run_errors": runs["run_errors"],
        "n_converged": runs["n_converged"],
        "run_converged": runs["run_converged"],
        "run_n_iter": runs["run_n_iter"],
        "cluster_sizes": res.cluster_sizes.astype(np.int64),
        "n_dropped": res.n_dropped,
        "n_empty_clusters": res.n_empty_clusters,
        "n_neighbors": int(res.params["n_neighbors"]),
        "components": comp,
        "genes": np.asarray(adata.var_names[mask]).astype(str),
        **({"distances": res.distances} if res.distances is not None else {}),
        "pool": runs["pool"],
        "seconds": time.perf_counter() - t0,
    }
    logg.info(
        "    finished",
        time=start,
        deep=(
            f"added\n    'obsm[{_keys.nmf_usages(key_added)!r}]', 'varm[{_keys.nmf_spectra(key_added)!r}]', "
            f"'uns[{key_added!r}]' (stability {res.stability:.3f}, {res.n_dropped}/{len(comp)} dropped)"
        ),
    )
    return adata if copy else None


# --------------------------------------------------------------------------------------------------------------------
# a new consensus from the stored restarts
# --------------------------------------------------------------------------------------------------------------------
def nmf_refine(
    adata: AnnData,
    density_threshold: float,
    *,
    neighborhood: float | None = None,
    key: str = _keys.NMF,
    key_added: str | None = None,
    copy: bool = False,
) -> AnnData | None:
    """Redo the consensus of an earlier :func:`consensus_nmf` with another density threshold, without refitting.

    :func:`consensus_nmf` keeps the pooled components of its restarts (``uns[key]['pool']``). This reruns the steps
    after the fits on them (local density, filter, k-means, silhouette, median, NNLS refit of the partner factor)
    with the new ``density_threshold`` and the earlier call's other options, on the same matrix, so the result is
    bit-identical to ``consensus_nmf(adata, **params)`` with that threshold (``params`` from ``uns[key]``), in the
    time of the consensus alone. Read :func:`gpuc.pl.nmf_density` (with ``threshold=``) to choose the threshold.

    Parameters
    ----------
    adata
        AnnData after :func:`gpuc.tl.consensus_nmf`, with the matrix it factorised unchanged.
    density_threshold
        Keep components with local density ``<`` this (2.0 keeps all).
    neighborhood
        Fraction of the runs used as neighbours for the local density; ``None`` keeps the earlier one.
    key
        The ``key_added`` of the :func:`consensus_nmf` call.
    key_added
        Where to write the new consensus (``None``: replace the one under ``key``).
    copy
        Return a modified copy instead of writing into ``adata``.

    Returns
    -------
    ``None``, or a copy of ``adata`` with ``copy=True``. Writes the same fields as :func:`consensus_nmf` under
    ``key_added`` (``params['density_threshold']`` and ``params['neighborhood']`` updated); the previous outputs
    under that key are replaced.
    """
    check_adata(adata)
    check_key(adata.uns, key, "adata.uns", f"Run gpuc.tl.consensus_nmf(adata, k, key_added={key!r}) first.")
    old = adata.uns[key]
    if "pool" not in old:
        msg = (
            f"adata.uns[{key!r}] holds no 'pool' (written by an older gpuc); rerun gpuc.tl.consensus_nmf with the "
            "new density_threshold instead."
        )
        raise KeyError(msg)
    key_added = key if key_added is None else key_added
    check_key_added(key_added)
    params = copy_module.deepcopy(dict(old["params"]))  # nothing of the earlier result is shared with the new one
    params["density_threshold"] = density_threshold
    if neighborhood is not None:
        params["neighborhood"] = neighborhood
    _check_common(
        int(params["n_runs"]),
        params["density_threshold"],
        params["metric"],
        params["target"],
        params["normalization"],
        int(params["max_iter"]),
        float(params["tol"]),
    )
    check_number("neighborhood", params["neighborhood"], low=0, high=1, low_open=True)
    check_bool("copy", copy)
    if key_added != key:
        _keys.check_not_foreign(adata, _keys.nmf_outputs(key_added), key_added, "gpuc.tl.nmf_refine", _keys.NMF_MARKER)
    params["density_threshold"] = float(params["density_threshold"])
    params["neighborhood"] = float(params["neighborhood"])
    mask_var = params["mask_var"]
    block, mask = _prepare_block(adata, params["layer"], mask_var, params["preprocessing"])
    pool = np.array(old["pool"])
    k = int(params["k"])
    d_expected = block.shape[1] if params["target"] == "spectra" else block.shape[0]
    if pool.shape != (int(params["n_runs"]) * k, d_expected):
        msg = (
            f"adata.uns[{key!r}]['pool'] has shape {pool.shape} but the factorised matrix gives "
            f"({int(params['n_runs']) * k}, {d_expected}); the AnnData changed since consensus_nmf ran."
        )
        raise ValueError(msg)
    backend, op = _backend_and_op(block, params["device"], params["dtype"])
    start = logg.info(f"consensus NMF refine: k={k}, density_threshold={params['density_threshold']:g}")
    t0 = time.perf_counter()
    runs = {
        name: copy_module.deepcopy(old[name]) for name in ("run_errors", "n_converged", "run_converged", "run_n_iter")
    }
    runs["pool"] = pool
    return _consensus_and_write(
        adata, backend, op, mask, params, runs, key_added=key_added, copy=copy, start=start, t0=t0
    )
