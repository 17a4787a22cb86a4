"""``gpuc.tl.nmf_k_sweep``, ``gpuc.tl.consensus_nmf`` and ``gpuc.tl.nmf_refine``: AnnData adapters over
:mod:`gpuc.nmf`.

Each tool checks its arguments, extracts the factorised block (:func:`_prepare_block`), plans the fit
(:func:`gpuc.nmf._plan.plan_fit`: device, precision, batches of ranks, memory), runs the engine (restarts in this
process or on a Dask cluster, then their consensus) and writes the results.
"""

from __future__ import annotations

import contextlib
import copy as copy_module
import inspect
import numbers
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import numpy as np
import pandas as pd
from anndata import AnnData

from gpuc import _keys
from gpuc import _log as logg
from gpuc._atomic import atomic_writes
from gpuc._backend import Backend, Device, to_host
from gpuc._dask import resolve_client, runs_on
from gpuc._docs import doc_params
from gpuc._errors import ConvergenceWarning, GpucWarning, interruptible
from gpuc._inputs import matrix_fingerprint, names_digest, same_fingerprint
from gpuc._inputs import record as record_inputs
from gpuc._lazy import load
from gpuc._utils import iteration_progress
from gpuc._validate import (
    SeedLike,
    align_to_var,
    check_adata,
    check_bool,
    check_choice,
    check_int,
    check_key,
    check_key_added,
    get_matrix,
    str_array,
)
from gpuc.nmf._all_genes import GeneSpectra, gene_spectra
from gpuc.nmf._consensus import (
    ConsensusError,
    ConsensusOptions,
    ConsensusResult,
    consensus_of_pool,
    pool_density,
    run_k,
    run_ks,
    stored_pool,
    suggest_k,
    sweep_on_cluster,
    sweep_rows,
)
from gpuc.nmf._docs import FRAGMENTS
from gpuc.nmf._hals import TOL, WARMUP, HalsOptions, HalsResult, Operator
from gpuc.nmf._plan import backend_and_op, check_rank, plan_fit
from gpuc.nmf._prepare import PREPROCESSING, prepare_matrix

Preprocessing = Literal["none", "sd", "sqrt_sd"]


# --------------------------------------------------------------------------------------------------------------------
# input checks, the factorised block, progress and the recorded call
# --------------------------------------------------------------------------------------------------------------------
def _gene_mask(adata: AnnData, mask_var: str | np.ndarray | None) -> np.ndarray:
    """Boolean mask of the genes to factorise: ``var[mask_var]``, a boolean array over genes, or all (``None``)."""
    if mask_var is None:
        return np.ones(adata.n_vars, dtype=bool)
    # a boolean Series (or dict) is matched to var_names by label, never by position
    if isinstance(mask_var, pd.DataFrame) and mask_var.shape[1] == 1:
        mask_var = mask_var.iloc[:, 0]  # as params stores a mask: one column labelled by var_names
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


def _check_k_range(k_range: Any) -> list[Any]:
    """``k_range`` as a non-empty list (each rank is checked against the block's shape later)."""
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
    return ks


def _hals_bar(hals: HalsOptions, ks: list[int], client: Any) -> Any:
    """The bar of one batch of restarts (iterations used and the loss change against ``tol``); none on a cluster,
    where the restarts run elsewhere. Silent at verbosity 0 and outside a terminal or notebook.
    """
    if client is not None:
        return contextlib.nullcontext()
    ranks = f"k={ks[0]}" if len(ks) == 1 else f"k={ks[0]}..{ks[-1]}"
    return iteration_progress(hals.max_iter, f"HALS {ranks}")


def _warn_not_converged(n_not: dict[int, int], n_runs: int, max_iter: int, tol: float, stacklevel: int = 3) -> None:
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
    warnings.warn(msg, ConvergenceWarning, stacklevel=stacklevel)


def _warn_sweep(table: pd.DataFrame, n_runs: int, hals: HalsOptions) -> None:
    """The k sweep's warnings: failed consensus, empty k-means clusters, restarts that did not converge."""
    if table["consensus_failed"].any():
        msg = (
            f"consensus failed for k={table.loc[table.consensus_failed, 'k'].tolist()}: too few components passed the "
            "density filter; their stability is NaN. Raise density_threshold (2.0 keeps every component)."
        )
        warnings.warn(msg, GpucWarning, stacklevel=3)
    if (table["n_empty_clusters"] > 0).any():
        msg = f"the consensus k-means left empty clusters for k={table.loc[table.n_empty_clusters > 0, 'k'].tolist()}"
        warnings.warn(msg, GpucWarning, stacklevel=3)
    n_not = dict(zip(table["k"], n_runs - table["n_converged"], strict=True))
    _warn_not_converged(n_not, n_runs, hals.max_iter, hals.tol, stacklevel=4)


def _suggested_k(table: pd.DataFrame) -> int | None:
    """``uns[key]['suggested_k']``: the engine's suggestion, or ``None`` when every consensus failed (there is
    nothing to suggest; :func:`gpuc.get.nmf_suggest_k` then says so).
    """
    if not np.isfinite(table["stability"].to_numpy(dtype=np.float64)).any():
        return None
    return suggest_k(table["k"], table["stability"], table["median_error"])


def _stored_mask(mask_var: Any, mask: np.ndarray, var_names: Any = None) -> Any:
    """``params["mask_var"]``: a column name or None as given; any other form (an array, a labelled Series) as the
    boolean mask it selected, labelled by ``var_names`` (a one-column DataFrame), so a replay selects the same genes
    by name even after the genes were reordered.
    """
    if mask_var is None or isinstance(mask_var, str):
        return mask_var
    if var_names is None:
        return np.asarray(mask.copy())
    return pd.DataFrame({"mask_var": np.asarray(mask, dtype=bool)}, index=pd.Index(var_names).copy())


def _all_gene_source(
    adata: AnnData, layer: str | None, counts_layer: str | None, preprocessing: str
) -> tuple[Any, bool, str]:
    """The matrix of cNMF's all-gene outputs (all genes, in place: numpy/scipy, CuPy/cupyx or dask), whether its
    cells are scaled to 10⁶ (cNMF's TPM), and its name for messages; touches nothing in ``adata``.

    ``counts_layer`` names raw counts, always scaled. Without it the matrix the programmes were fitted on
    (``layer``) is used over every gene: scaled when ``preprocessing`` says it holds counts (``"sd"``, ``"sqrt_sd"``,
    cNMF's input), as it is for ``"none"`` (an already normalised layer).
    """
    if counts_layer is not None:
        if not isinstance(counts_layer, str):
            msg = f"counts_layer must be a layer name or None, got {counts_layer!r}."
            raise TypeError(msg)
        return get_matrix(adata, layer=counts_layer), True, f"adata.layers[{counts_layer!r}]"
    where = f"adata.layers[{layer!r}]" if layer is not None else "adata.X"
    return get_matrix(adata, layer=layer), preprocessing != "none", where


def _all_gene_outputs(
    adata: AnnData, params: dict[str, Any], mask: np.ndarray, usages: np.ndarray
) -> GeneSpectra | None:
    """The all-gene outputs (cNMF's) of a consensus (:func:`gpuc.nmf._all_genes.gene_spectra`), computed where the matrix
    lives, before anything is written; ``None`` when ``params['all_genes']`` is off.
    """
    if not params.get("all_genes", False):
        return None
    layer = params["layer"]
    mat, normalize, where = _all_gene_source(adata, layer, params.get("counts_layer"), params["preprocessing"])
    t0 = time.perf_counter()
    try:
        with interruptible("consensus_nmf"):
            out = gene_spectra(mat, usages, np.flatnonzero(mask), normalize=normalize)
    except ValueError as err:
        msg = (
            f"{err} (cNMF's all-gene outputs read {where}; pass counts_layer= naming the raw counts to "
            "gpuc.tl.consensus_nmf, or all_genes=False to skip them). Nothing was written."
        )
        raise ValueError(msg) from None
    logg.debug(f"    all-gene spectra from {where} ({adata.n_vars} genes) in {time.perf_counter() - t0:.2f} s")
    return out


# what each fitting tool writes under its (checked) key_added, and the marker of its result
_WRITES: dict[str, tuple[Callable[[str], dict[str, list[str]]], tuple[str, ...]]] = {
    "nmf_k_sweep": (lambda key: {"uns": [key]}, _keys.NMF_K_SWEEP_MARKER),
    "consensus_nmf": (_keys.nmf_outputs, _keys.NMF_MARKER),
}


def _checked_options(
    tool: str, adata: AnnData, n_runs: Any, hals: HalsOptions, rule: ConsensusOptions, key_added: Any, copy: Any
) -> tuple[HalsOptions, ConsensusOptions]:
    """The checks the fitting tools share (restarts, HALS and consensus options, where and how ``tool`` writes),
    and the checked options: the consensus seed resolved to the int recorded in params.
    """
    check_int("n_runs", n_runs, minimum=2)
    hals = hals.checked()
    rule = rule.checked()
    check_key_added(key_added)
    check_bool("copy", copy)
    outputs, marker = _WRITES[tool]
    _keys.check_not_foreign(adata, outputs(key_added), key_added, f"gpuc.tl.{tool}", marker)
    return hals, rule


def _log_start(what: str, op: Operator, backend: Backend, client: Any) -> tuple[Any, float]:
    """Log the start of a fit (``what``, the block's shape, where it runs); the log's time and ``perf_counter()``."""
    start = logg.info(f"{what}, {op.shape[0]} x {op.shape[1]} ({runs_on(backend, client)})")
    return start, time.perf_counter()


# arguments of a tool that say where or how to return, not what is computed: not recorded in params
_NOT_RECORDED = ("adata", "client", "key_added", "copy")


def _call_params(tool: Callable, call: dict[str, Any], **checked: Any) -> dict[str, Any]:
    """``uns[key]["params"]`` of an NMF tool: every parameter of ``tool`` but :data:`_NOT_RECORDED`, valued as in
    ``call`` (the tool's ``locals()``, holding the checked values) or ``checked``, in forms h5ad can store.
    """
    names = [p for p in inspect.signature(tool).parameters if p not in _NOT_RECORDED]
    out = {name: checked[name] if name in checked else call[name] for name in names}
    out["dtype"] = None if out["dtype"] is None else str(np.dtype(out["dtype"]))
    for name in ("density_threshold", "neighborhood", "tol"):
        if name in out:
            out[name] = float(out[name])
    return out


# --------------------------------------------------------------------------------------------------------------------
# k sweep
# --------------------------------------------------------------------------------------------------------------------
@doc_params(**FRAGMENTS)
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
    {input}
    density_threshold
        Components with local density ``>=`` this are dropped before clustering; 2.0 (default here) keeps all.
    {metric}
    {target}
    {restarts}
    key_added
        ``uns`` key of the result.
    {copy}

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
        call that function to apply other options), or ``None`` when the consensus failed for every k.

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
    ks = _check_k_range(k_range)
    hals = HalsOptions(max_iter, tol, extrapolate, warmup, update_order)
    rule = ConsensusOptions(target, metric, density_threshold, kmeans_n_init=kmeans_n_init, random_state=random_state)
    hals, rule = _checked_options("nmf_k_sweep", adata, n_runs, hals, rule, key_added, copy)
    random_state = rule.random_state
    block, mask = _prepare_block(adata, layer, mask_var, preprocessing)
    ks = sorted({check_rank(k, block.shape, "k_range entry") for k in ks})
    dask_client = resolve_client(client)
    plan = plan_fit(block, ks, n_runs, target=target, device=device, dtype=dtype, distributed=dask_client is not None)
    be, op = plan.backend, plan.op
    start, t0 = _log_start(f"NMF k sweep: k={ks}, {n_runs} runs each", op, be, dask_client)
    with interruptible("nmf_k_sweep"):
        if dask_client is not None:  # one task per worker: its restarts and the rows of its ranks
            rows = sweep_on_cluster(dask_client, be, op, ks, n_runs, random_state, hals, rule, n_jobs=n_jobs)
        else:
            rows = []
            for batch in plan.batches:  # ranks fitted together, one batch after the other
                with _hals_bar(hals, batch, None) as bar:
                    fits = run_ks(be, op, batch, n_runs, random_state, hals, progress=bar, n_jobs=n_jobs)
                logg.debug(f"    HALS k={batch}: {max(int(f.n_iter.max()) for f in fits)} iterations")
                rows += sweep_rows(be, op, batch, fits, rule, n_jobs=n_jobs)
    table = pd.DataFrame(rows)
    _warn_sweep(table, n_runs, hals)

    adata = adata.copy() if copy else adata
    with atomic_writes(adata):
        adata.uns[key_added] = {
            "params": _call_params(
                nmf_k_sweep,
                locals(),
                k_range=np.asarray(ks, dtype=np.int64),
                mask_var=_stored_mask(mask_var, mask, adata.var_names),
            ),
            "device": be.name,
            "dtype": str(op.dtype),
            "table": table,
            "suggested_k": _suggested_k(table),
            "seconds": time.perf_counter() - t0,
        }
    suggested = adata.uns[key_added]["suggested_k"]
    logg.info(
        "    finished", time=start, deep=f"added\n    'uns[{key_added!r}]' (params, table, suggested_k={suggested})"
    )
    return adata if copy else None


# --------------------------------------------------------------------------------------------------------------------
# consensus at one k
# --------------------------------------------------------------------------------------------------------------------
@doc_params(**FRAGMENTS)
def consensus_nmf(
    adata: AnnData,
    k: int,
    *,
    n_runs: int = 20,
    layer: str | None = None,
    mask_var: str | np.ndarray | None = "highly_variable",
    preprocessing: Preprocessing = "none",
    counts_layer: str | None = None,
    all_genes: bool = True,
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
    Run seeds derive from ``(random_state, k, run)``, as in :func:`nmf_k_sweep`.

    Parameters
    ----------
    adata
        Cells (or metacells) x genes.
    k
        Number of programmes (>= 2, smaller than the number of cells and of genes).
    n_runs
        Restarts (>= 2).
    {input}
    counts_layer
        Raw counts over every gene for cNMF's all-gene outputs (``all_genes``): ``adata.layers[counts_layer]``,
        each cell scaled to 10⁶ over all its genes (cNMF's TPM, from the counts file it is given). ``None``
        (default): the matrix that is factorised (``layer``), over every gene: scaled to 10⁶ likewise when
        ``preprocessing`` is ``"sd"`` or ``"sqrt_sd"`` (the layer holds counts, cNMF's input), used as it is for
        ``"none"`` (an already normalised layer; the "TPM" spectra are then in its units).
    all_genes
        Compute cNMF's outputs over every gene (``varm[key_added + '_spectra_tpm']``,
        ``varm[key_added + '_spectra_score']``, ``obsm['X_' + key_added + '_refit']``): one more pass over the
        matrix (all genes) and one over the factorised genes, in memory-bounded blocks, on the device where the
        matrix lives (chunk by chunk for a lazily read one). The matrix must be non-negative.
    density_threshold
        Keep components with local density ``<`` this (0.5 default; 2.0 keeps all). Read the histogram
        (:func:`gpuc.pl.nmf_density`) before tightening it.
    {metric}
    {target}
    normalization
        Consensus rows rescaled to ``"sum"`` 1 (cNMF) or unit ``"l2"`` norm (bixverse); the refitted factor takes the
        scale.
    neighborhood
        Fraction of ``n_runs`` used as the number of neighbours for the local density.
    {restarts}
    key_added
        Key prefix: ``obsm['X_' + key_added]``, ``varm[key_added + '_spectra']``, ``uns[key_added]``. Entries there
        that an earlier consensus_nmf under this key did not write (``key_added="pca"`` would replace ``X_pca``) are
        never replaced: the call is refused.
    {copy}

    Returns
    -------
    ``None``, or a copy of ``adata`` with ``copy=True``. Sets

    ``adata.obsm['X_nmf']``
        Cells x k usages (programmes ordered by total usage, largest first): the non-negative refit of the
        factorised matrix with the consensus spectra fixed. With cNMF's settings, cNMF's usages before its final
        refit (the ``consensus_usages`` file of ``consensus(..., refit_usage=False)``).
    ``adata.varm['nmf_spectra']``
        Genes x k consensus programmes (zero for genes not factorised); cNMF's ``consensus_spectra``
        (``median_spectra``) with ``normalization="sum"``.
    ``adata.varm['nmf_spectra_tpm']``
        Genes x k, every gene (with ``all_genes``): cNMF's ``gene_spectra_tpm``, each programme in TPM units, the
        non-negative least-squares refit of the TPM matrix (``counts_layer``) on the usages normalised to sum 1
        per cell, ``min_{S >= 0} ||TPM - N S||²``.
    ``adata.varm['nmf_spectra_score']``
        Genes x k, every gene (with ``all_genes``): cNMF's ``gene_spectra_score``, the least-squares coefficients
        (no intercept) of each gene's z-scored TPM (population SD) on ``obsm['X_nmf']``; the marker ranking cNMF's
        authors recommend reading and feeding to enrichment (:func:`gpuc.get.nmf_top_genes`).
    ``adata.obsm['X_nmf_refit']``
        Cells x k (with ``all_genes``): cNMF's final usages (its ``consensus_usages`` file, default
        ``refit_usage=True``): the non-negative refit of the TPM of the factorised genes, each divided by its SD,
        on the TPM spectra divided by the same SD. :func:`gpuc.get.nmf_usages` returns them, normalised to sum 1
        per cell as cNMF's ``load_results(norm_usage=True)``.
    ``adata.uns['nmf']``
        ``params``; ``stability`` (mean silhouette of the kept components); ``rel_error`` of the consensus refit;
        ``run_errors`` (each restart's relative error); ``n_converged``, ``run_converged`` and ``run_n_iter``
        (whether and after how many iterations each restart met ``tol``); ``cluster_sizes``; ``n_dropped``;
        ``n_empty_clusters``; ``n_neighbors``; ``components`` (one row per pooled component: run, component,
        cluster (-1 if dropped), local_density, silhouette, kept); ``genes`` (the factorised genes); ``distances``
        (pooled-component distance matrix under ``metric``, float32, for the clustergram; only when there are at
        most 2,000 pooled components); ``pool`` (the pooled components of the restarts, ``n_runs * k`` rows in the
        working precision, spectra over the factorised genes or usages over the cells per ``target``), from which
        :func:`nmf_refine` redoes the consensus with another density threshold without refitting; ``inputs`` (the
        number and a digest of the cell and factorised gene names in order, and a fingerprint of the factorised
        matrix), by which :func:`nmf_refine` refuses a reordered or changed matrix.

    Outputs of an earlier run under the same ``key_added`` are replaced. The arrays are host numpy whatever the
    device, so :meth:`anndata.AnnData.write_h5ad` stores them.

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
    hals = HalsOptions(max_iter, tol, extrapolate, warmup, update_order)
    rule = ConsensusOptions(target, metric, density_threshold, normalization, neighborhood, kmeans_n_init, random_state)
    hals, rule = _checked_options("consensus_nmf", adata, n_runs, hals, rule, key_added, copy)
    random_state, neighborhood = rule.random_state, rule.neighborhood
    check_bool("all_genes", all_genes)
    if all_genes:
        _all_gene_source(adata, layer, counts_layer, preprocessing)  # the layer exists (read after the fit)
    block, mask = _prepare_block(adata, layer, mask_var, preprocessing)
    k = check_rank(k, block.shape)
    dask_client = resolve_client(client)
    plan = plan_fit(block, [k], n_runs, target=target, device=device, dtype=dtype, distributed=dask_client is not None)
    be, op = plan.backend, plan.op
    start, t0 = _log_start(f"consensus NMF: k={k}, {n_runs} runs", op, be, dask_client)
    with interruptible("consensus_nmf"), _hals_bar(hals, [k], dask_client) as bar:
        fits = run_k(be, op, k, n_runs, random_state, hals, client=dask_client, progress=bar, n_jobs=n_jobs)
    params = _call_params(consensus_nmf, locals(), mask_var=_stored_mask(mask_var, mask, adata.var_names))
    _warn_not_converged({k: int((~fits.converged).sum())}, n_runs, max_iter, hals.tol)
    runs = {"pool": stored_pool(be, fits, target), **_run_diagnostics(fits)}
    res = _consensus(be, op, runs["pool"], n_runs, k, rule, n_jobs)
    genes = _all_gene_outputs(adata, params, mask, res.usages)
    inputs = record_inputs(obs_names=adata.obs_names, var_names=adata.var_names[mask], matrix=block)
    with atomic_writes(adata):  # all or nothing: the old outputs or the new ones
        out = _write_consensus(
            adata, be, op, mask, params, runs, res, genes, key_added=key_added, copy=copy, start=start, t0=t0
        )
        (adata if out is None else out).uns[key_added]["inputs"] = inputs  # what nmf_refine recognises
    return out


def _run_diagnostics(fits: HalsResult) -> dict[str, Any]:
    """What ``uns[key]`` keeps of the restarts themselves: errors, convergence flags and iterations."""
    return {
        "run_errors": fits.rel_errors.astype(np.float64),
        "n_converged": int(fits.converged.sum()),
        "run_converged": np.asarray(to_host(fits.converged), dtype=bool),
        "run_n_iter": np.asarray(to_host(fits.n_iter), dtype=np.int64),
    }


def _consensus(
    backend: Backend, op: Operator, pool: np.ndarray, n_runs: int, k: int, rule: ConsensusOptions, n_jobs: int | None
) -> ConsensusResult:
    """The consensus of a stored pool (density, filter, k-means, median, refit), checked before anything is written:
    a failed consensus is a :class:`ValueError`, non-finite factors a :class:`FloatingPointError`, empty clusters
    a warning.
    """
    with interruptible("consensus_nmf"):
        density = pool_density(pool, n_runs, k, metric=rule.metric, neighborhood=rule.neighborhood)
        try:
            res = consensus_of_pool(backend, op, density, k, rule, n_jobs=n_jobs)
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
    return res


def _write_consensus(
    adata: AnnData,
    backend: Backend,
    op: Operator,
    mask: np.ndarray,
    params: dict[str, Any],
    runs: dict[str, Any],
    res: ConsensusResult,
    genes: GeneSpectra | None,
    *,
    key_added: str,
    copy: bool,
    start: Any,
    t0: float,
) -> AnnData | None:
    """The writes of :func:`consensus_nmf` (and :func:`nmf_refine`): usages, spectra over every gene, cNMF's
    all-gene outputs (``genes``, when computed), ``uns``.
    """
    k = int(params["k"])
    spectra = np.zeros((adata.n_vars, k))
    spectra[mask] = res.spectra.T
    comp = pd.DataFrame(res.table)
    adata = adata.copy() if copy else adata
    _keys.drop_outputs(adata, _keys.nmf_outputs(key_added))
    adata.obsm[_keys.nmf_usages(key_added)] = res.usages
    adata.varm[_keys.nmf_spectra(key_added)] = spectra
    if genes is not None:
        adata.obsm[_keys.nmf_usages_refit(key_added)] = genes.usages
        adata.varm[_keys.nmf_spectra_tpm(key_added)] = genes.tpm.T
        adata.varm[_keys.nmf_spectra_score(key_added)] = genes.score.T
    adata.uns[key_added] = {
        "params": params,
        "device": backend.name,
        "dtype": str(op.dtype),
        "stability": res.stability,
        "rel_error": res.rel_error,
        **{name: runs[name] for name in ("run_errors", "n_converged", "run_converged", "run_n_iter")},
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
    added = [f"obsm[{_keys.nmf_usages(key_added)!r}]", f"varm[{_keys.nmf_spectra(key_added)!r}]"]
    if genes is not None:
        added += [
            f"obsm[{_keys.nmf_usages_refit(key_added)!r}]",
            f"varm[{_keys.nmf_spectra_tpm(key_added)!r}]",
            f"varm[{_keys.nmf_spectra_score(key_added)!r}]",
        ]
    logg.info(
        "    finished",
        time=start,
        deep=(
            f"added\n    {', '.join(repr(a) for a in added)}, "
            f"'uns[{key_added!r}]' (stability {res.stability:.3f}, {res.n_dropped}/{len(comp)} dropped)"
        ),
    )
    return adata if copy else None


# --------------------------------------------------------------------------------------------------------------------
# a new consensus from the stored restarts
# --------------------------------------------------------------------------------------------------------------------
@doc_params()
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
    {copy}

    Returns
    -------
    ``None``, or a copy of ``adata`` with ``copy=True``. Writes the same fields as :func:`consensus_nmf` under
    ``key_added`` (``params['density_threshold']`` and ``params['neighborhood']`` updated), cNMF's all-gene
    outputs included (recomputed on the new consensus, from the matrix the earlier call recorded; a result of a
    gpuc without them gets them, from the factorised layer); the previous outputs under that key are replaced.
    """
    check_adata(adata)
    check_key(adata.uns, key, "adata.uns", f"Run gpuc.tl.consensus_nmf(adata, k, key_added={key!r}) first.")
    from gpuc.get._checks import check_params, tool_output

    old = tool_output(adata, key, "consensus_nmf")  # a foreign, edited or joined entry: refused, saying why
    check_params(old, _REFINE_PARAMS, "consensus_nmf", key)
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
    check_int("n_runs", int(params["n_runs"]), minimum=2)
    HalsOptions(int(params["max_iter"]), float(params["tol"])).checked()
    rule = _stored_rule(params).checked()
    check_bool("copy", copy)
    if key_added != key:
        _keys.check_not_foreign(adata, _keys.nmf_outputs(key_added), key_added, "gpuc.tl.nmf_refine", _keys.NMF_MARKER)
    params["density_threshold"], params["neighborhood"] = rule.density_threshold, rule.neighborhood
    block, mask = _prepare_block(adata, params["layer"], params["mask_var"], params["preprocessing"])
    _check_same_input(adata, old, key, mask, block)
    pool = np.array(old["pool"])
    n_runs, k = int(params["n_runs"]), int(params["k"])
    d_expected = block.shape[1] if rule.target == "spectra" else block.shape[0]
    if pool.shape != (n_runs * k, d_expected):
        msg = (
            f"adata.uns[{key!r}]['pool'] has shape {pool.shape} but the factorised matrix gives "
            f"({n_runs * k}, {d_expected}); the AnnData changed since consensus_nmf ran."
        )
        raise ValueError(msg)
    backend, op = backend_and_op(block, params["device"], params["dtype"])
    start = logg.info(f"consensus NMF refine: k={k}, density_threshold={rule.density_threshold:g}")
    t0 = time.perf_counter()
    runs = {
        name: copy_module.deepcopy(old[name]) for name in ("run_errors", "n_converged", "run_converged", "run_n_iter")
    }
    runs["pool"] = pool
    res = _consensus(backend, op, pool, n_runs, k, rule, params.get("n_jobs"))
    params.setdefault("counts_layer", None)  # a result of an older gpuc: its all-gene outputs are made now
    params.setdefault("all_genes", True)
    genes = _all_gene_outputs(adata, params, mask, res.usages)
    inputs = record_inputs(obs_names=adata.obs_names, var_names=adata.var_names[mask], matrix=block)
    with atomic_writes(adata):  # all or nothing: the old outputs and pool, or the new ones
        out = _write_consensus(
            adata, backend, op, mask, params, runs, res, genes, key_added=key_added, copy=copy, start=start, t0=t0
        )
        (adata if out is None else out).uns[key_added]["inputs"] = inputs
    return out


# what nmf_refine reads of the recorded call, and the kinds the values must be
_REFINE_PARAMS = {
    "k": "int", "n_runs": "int", "max_iter": "int", "kmeans_n_init": "int", "random_state": "int",
    "tol": "number", "density_threshold": "number", "neighborhood": "number",
    "target": "str", "metric": "str", "normalization": "str", "preprocessing": "str",
    "layer": "str or None", "device": "str or None", "dtype": "str or None", "mask_var": "any",
}  # fmt: skip


def _check_same_input(adata: AnnData, old: Any, key: str, mask: np.ndarray, block: Any) -> None:
    """Refuse to refine when the factorised matrix is not the one :func:`consensus_nmf` read: other genes or the
    same genes in another order (the pooled components are over the genes in the fit's order), other cells, or other
    values (a matrix transformed in place after the fit).
    """
    redo = f"Rerun gpuc.tl.consensus_nmf(adata, k, ..., key_added={key!r}) on the AnnData as it is now."
    genes = np.asarray(adata.var_names[mask]).astype(str)
    stored = str_array(old.get("genes", genes))
    if not np.array_equal(genes, stored):
        same_set = genes.size == stored.size and set(genes) == set(stored)
        what = "in another order (adata[:, perm] after the fit?)" if same_set else "not the ones it factorised"
        msg = (
            f"nmf_refine: the genes changed since consensus_nmf ran under {key!r}: they are {what}. The pooled "
            f"components of its restarts are over the genes in the fit's order, so a new consensus would mix genes "
            f"up. {redo}"
        )
        raise ValueError(msg)
    inputs = old.get("inputs")
    if not isinstance(inputs, Mapping):
        return  # written before inputs were recorded: the shape checks below are all there is
    if "obs_digest" in inputs and inputs["obs_digest"] != names_digest(adata.obs_names):
        msg = f"nmf_refine: the cells of this AnnData are not those consensus_nmf factorised under {key!r}. {redo}"
        raise ValueError(msg)
    if "fingerprint" in inputs and not same_fingerprint(inputs["fingerprint"], matrix_fingerprint(block)):
        msg = (
            f"nmf_refine: the matrix consensus_nmf factorised under {key!r} has changed since the fit (transformed "
            f"in place, e.g. sc.pp.log1p, or another layer). {redo}"
        )
        raise ValueError(msg)


def _stored_rule(params: dict[str, Any]) -> ConsensusOptions:
    """The consensus options of a recorded :func:`consensus_nmf` call."""
    return ConsensusOptions(
        params["target"],
        params["metric"],
        params["density_threshold"],
        params["normalization"],
        params["neighborhood"],
        int(params["kmeans_n_init"]),
        int(params["random_state"]),
    )
