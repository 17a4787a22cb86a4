"""``gpuc.tl.metacells``, ``aggregate_metacells`` and ``metacell_quality``: AnnData adapters over :mod:`gpuc.metacells`.

Each tool checks its arguments and reads its inputs from the AnnData, plans the work (groups, sizes, memory), makes
one engine call and writes the results; the orchestration lives in :mod:`gpuc.metacells` (``_plan``, ``_groups``,
``_aggregate``, ``_quality``) and :mod:`gpuc._units`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import pandas as pd
from anndata import AnnData

from gpuc import _keys
from gpuc import _log as logg
from gpuc._atomic import atomic_writes
from gpuc._backend import Device, get_backend, is_sparse
from gpuc._dask import is_dask_array, resolve_client
from gpuc._docs import doc_params
from gpuc._errors import GpucWarning, interruptible
from gpuc._inputs import record as record_inputs
from gpuc._lazy import load
from gpuc._units import split_groups
from gpuc._validate import (
    SeedLike,
    check_adata,
    check_bool,
    check_choice,
    check_finite,
    check_in_memory,
    check_int,
    check_key,
    check_key_added,
    check_number,
    check_printable_labels,
    get_matrix,
    resolve_random_state,
)
from gpuc.metacells._aggregate import (
    divided_rows,
    hard_membership,
    member_means,
    non_integer,
    soft_membership,
    summed,
)
from gpuc.metacells._groups import fit_groups
from gpuc.metacells._plan import archetype_positions, check_plan_memory, plan_groups, scaled_to_range
from gpuc.metacells._plan import n_distinct as _n_distinct  # noqa: F401  (importable here, as before the split)
from gpuc.metacells._quality import assignment_stats, purity_from_membership, quality_table

_GRAPHS = ("union", "intersection")
_INITS = ("waypoint", "greedy", "random")
_A0 = ("auto", "random", "uniform")


@doc_params()
def metacells(
    adata: AnnData,
    n_metacells: int | Mapping[Any, int] | None = None,
    *,
    use_rep: str = "X_pca",
    n_neighbors: int = 15,
    n_waypoint_eigs: int = 10,
    max_iter: int = 100,
    min_iter: int = 10,
    convergence_epsilon: float = 1e-3,
    fw_iters: int = 50,
    graph: Literal["union", "intersection"] = "union",
    groupby: str | None = None,
    init: Literal["waypoint", "greedy", "random"] = "waypoint",
    initial_archetypes: Any = None,
    a0: Literal["auto", "random", "uniform"] = "auto",
    knn_method: Literal["auto", "exact", "ivf"] = "auto",
    neighbors_key: str | None = None,
    device: Device | None = None,
    n_jobs: int | None = None,
    client: Any = None,
    random_state: SeedLike = 0,
    key_added: str = _keys.METACELL,
    copy: bool = False,
) -> AnnData | None:
    """SEACells metacells (Persad et al. 2023), the published 0.3.3 algorithm, on the CPU or the GPU.

    Builds the SEACells adaptive Gaussian kernel M on a kNN graph of ``obsm[use_rep]``, initialises archetypes from
    diffusion-map waypoints plus greedy column selection, and fits the kernel archetypal analysis
    ``min ||M - M B A||`` by alternating Frank-Wolfe updates. A and B are kept sparse and the error is computed in
    reduced form, so memory grows as O(nnz(K) + n * fw_iters + n * n_metacells) and nothing n x n is formed.
    ``obsp['distances']``, ``obsp['connectivities']`` and ``uns['neighbors']`` are left untouched.

    Parameters
    ----------
    adata
        Annotated data matrix with a low-dimensional embedding in ``obsm[use_rep]``.
    n_metacells
        Number of metacells; default ``round(n_obs / 75)``. With ``groupby``: an int for every group, a mapping
        (or Series) ``{group: n}`` whose keys are the groups as they are in ``obs`` (the string keys stored in
        ``params`` are accepted too), or None for ``round(n_group / 75)`` per group.
    use_rep
        ``obsm`` key of the embedding the kernel is built on (``"X_pca"`` for RNA, ``"X_svd"``/LSI for ATAC). A
        lazily read (dask) embedding is loaded into memory (cells x components, e.g. 200 MB for 1,000,000 cells
        x 50 float32), with a log line; the counts are never read.
    n_neighbors
        kNN size including the cell itself (bandwidth = distance to the ``n_neighbors // 2``-th neighbour); also the
        number of diffusion components for the waypoints (as in SEACells).
    n_waypoint_eigs
        Diffusion eigenvectors used for waypoint sampling (components 1..n-1).
    max_iter, min_iter
        Bounds on the outer iterations.
    convergence_epsilon
        Stop when the RSS changes by less than ``convergence_epsilon * RSS_0`` (the SEACells tutorial uses 1e-5).
    fw_iters
        Frank-Wolfe steps per A- and B-update (at most this many non-zeros per column of A and B).
    graph
        Symmetrisation of the kNN graph: ``"union"`` or ``"intersection"``.
    groupby
        ``obs`` column; metacells are computed independently per group (e.g. per sample), labels prefixed by the
        group. Every cell needs a group (missing labels are an error), and two labels that print the same (``1``
        and ``"1"``) are an error, raised before anything is written.
    init
        Archetype initialisation: ``"waypoint"`` (SEACells: waypoints + greedy), ``"greedy"`` (greedy column
        selection only) or ``"random"`` (distinct random cells, for very large n).
    initial_archetypes
        The initial archetypes, overriding ``init`` (not with ``groupby``): cell positions, obs names (needs unique
        ``obs_names``), or a boolean mask over the cells (an array in ``obs`` order, or a Series matched to
        ``obs_names`` by label).
    a0
        Initial assignments: ``"random"`` (SEACells: dense uniform random, column-normalised, k x n),
        ``"uniform"`` (1/k everywhere, no k x n buffer) or ``"auto"`` (random while k * n <= 1e7, i.e. up to
        ~27k cells at one metacell per 75 cells; uniform above).
    knn_method
        ``"exact"`` or ``"ivf"`` (FAISS) kNN; ``"auto"`` is exact up to 50,000 cells (on the GPU: always exact,
        blocked CuPy products).
    neighbors_key
        ``None`` (default): build the exact kNN of ``obsm[use_rep]`` (SEACells parity). Or the key of an existing
        neighbour graph (``"neighbors"`` after ``sc.pp.neighbors`` / ``rsc.pp.neighbors``): its stored distances
        (``obsp[uns[neighbors_key]["distances_key"]]``, read on the device where they live) are reused, when every
        cell has at least ``n_neighbors - 1`` stored neighbours, and 29 with ``init="waypoint"`` (Palantir's
        30-neighbour diffusion map: build the graph with ``n_neighbors=30``, or use ``init="greedy"``). The graph
        must be Euclidean on ``use_rep``; not with ``groupby``.
    {device}
    {n_jobs}
    client
        Where the fits of the groups run: ``None`` follows :attr:`gpuc.settings.client` (default: one after the other
        in this process); ``"default"`` or a ``distributed.Client``: one Dask task per group (see
        :func:`gpuc._dask.map_units`). Results are identical wherever they run.
    {random_state}
        ``np.random.RandomState(seed)`` is consumed exactly as SEACells consumes the global RNG after
        ``np.random.seed(seed)``, so the default settings reproduce such a SEACells run when the kNN agree.
    key_added
        Prefix of every key written (see Returns). Entries under these names that an earlier :func:`metacells` did
        not write (e.g. ``key_added="leiden"`` over a Leiden column) are never replaced: the call is refused.
    {copy}

    Returns
    -------
    None, or the modified copy when ``copy=True``. Writes

    ``adata.obs[key_added]``
        Categorical hard label ``"SEACell-<j>"`` (``"<group>-SEACell-<j>"`` with groupby) = argmax of the cell's
        assignment weights.
    ``adata.obsm[key_added + "_weights"]``
        (n_obs x k) sparse soft assignments (A transposed; rows sum to 1), column j = metacell j.
    ``adata.obsm[key_added + "_archetypes"]``
        (n_obs x k) sparse B; column j holds the cells that make up archetype j (sums to 1).
    ``adata.obsp[key_added + "_kernel"]``
        The SEACells kernel M (block-diagonal with groupby).
    ``adata.uns[key_added]``
        ``params``; ``rss`` (trace of the unsquared ``||M - M B A||_F``, RSS_0 first; one per group under
        ``groups``), ``n_iter``, ``converged``, ``convergence_threshold``, ``device``, ``seconds``, and
        ``metacells``: a table with one row per column of the weights (label, group, ``center`` = the obs name
        with the largest weight in B, ``initial_archetype``, ``size`` = number of cells labelled). With
        ``groupby``, ``groups`` is keyed by the group names percent-encoded (``"T/NK"`` as ``"T%2FNK"``, so they
        survive ``write_h5ad``), each entry holding its original name under ``group``. ``inputs``: the number and
        a digest of the cell names, by which readers refuse objects joined by ``anndata.concat`` after the fit.

    Outputs of an earlier run under the same ``key_added`` are removed first, including the quality table
    ``uns[key_added + "_quality"]`` that :func:`metacell_quality` derived from it.

    Warns
    -----
    MetacellConvergenceWarning
        When ``max_iter`` is reached before convergence; the result is written all the same.
    GpucWarning
        When a fit has fewer than 5 cells per metacell on average (pathologically slow, little averaging).

    Raises
    ------
    InsufficientMemoryError
        Before any fit, when the estimated peak memory exceeds the device's free memory.
    """
    # ---- validate: every argument and input, before anything is computed or written ----------------------------------
    check_adata(adata)
    x = _embedding(adata, use_rep)
    n_neighbors, n_waypoint_eigs, max_iter, min_iter, fw_iters, convergence_epsilon = _loop_controls(
        n_neighbors, n_waypoint_eigs, max_iter, min_iter, fw_iters, convergence_epsilon
    )
    random_state = resolve_random_state(random_state)
    check_bool("copy", copy)
    graph = "intersection" if graph == "intersect" else graph
    check_choice("graph", graph, _GRAPHS)
    check_choice("init", init, _INITS)
    check_choice("a0", a0, _A0)
    check_choice("knn_method", knn_method, ("auto", "exact", "ivf"))
    check_key_added(key_added)
    _keys.check_not_foreign(
        adata, _keys.metacell_outputs(key_added), key_added, "gpuc.tl.metacells", _keys.METACELL_MARKER
    )
    if adata.n_obs < n_neighbors:
        msg = f"adata has {adata.n_obs} cells, fewer than n_neighbors={n_neighbors}."
        raise ValueError(msg)
    graph_dist = _neighbors_graph(adata, neighbors_key, use_rep, groupby)
    units = None
    if groupby is not None:  # every cell needs a group; 1 and "1" would share labels: both refused
        check_key(adata.obs, groupby, "adata.obs")
        units = split_groups(adata.obs[groupby], f"adata.obs[{groupby!r}]", missing="error")

    # ---- plan: the fits, their sizes, the initial archetypes, the device and its memory ------------------------------
    plan = plan_groups(x, n_metacells, units, n_neighbors=n_neighbors, groupby=groupby)
    init_arch = None
    if initial_archetypes is not None:
        if groupby is not None:
            msg = "initial_archetypes cannot be combined with groupby."
            raise ValueError(msg)
        init_arch = archetype_positions(initial_archetypes, adata.obs_names, plan[0].k)
    # "auto" keeps fits the GPU does not speed up on the CPU (the largest group decides)
    backend = get_backend(device, x, tool="metacells", work=max(p.positions.size for p in plan))
    check_plan_memory(backend, plan, n_neighbors=n_neighbors, fw_iters=fw_iters)

    # ---- one engine call: each group a unit, fitted here one after the other or as Dask tasks on the client ----------
    start = logg.info(f"computing metacells on {use_rep!r} ({backend.name})")
    t_all = time.perf_counter()
    options = {
        "n_neighbors": n_neighbors, "n_waypoint_eigs": n_waypoint_eigs, "graph": graph, "max_iter": max_iter,
        "min_iter": min_iter, "convergence_epsilon": convergence_epsilon, "fw_iters": fw_iters,
        "random_state": random_state, "init": init, "initial_archetypes_": init_arch, "a0": a0,
        "knn_method": knn_method,
    }  # fmt: skip
    with interruptible("metacells"):
        res = fit_groups(
            backend, x, plan, adata.obs_names, options=options, graph_distances=graph_dist,
            neighbors_key=neighbors_key, client=resolve_client(client), n_jobs=n_jobs,
        )  # fmt: skip
    for p, line in zip(plan, res.summaries(), strict=True):
        logg.info(f"   {'' if p.group is None else f' group {p.group!r}:'} {line}")
    params = {
        "n_metacells": {_keys.encode_name(p.group): p.k for p in plan} if groupby is not None else plan[0].k,
        "use_rep": use_rep, **{k: v for k, v in options.items() if k != "initial_archetypes_"}, "groupby": groupby,
        "neighbors_key": neighbors_key, "device": device, "n_jobs": n_jobs,
        "initial_archetypes": None if init_arch is None else np.asarray(adata.obs_names[init_arch], dtype=str),
    }  # fmt: skip
    uns = {"params": params, "device": backend.name, "metacells": res.table, "seconds": time.perf_counter() - t_all}
    uns["inputs"] = record_inputs(obs_names=adata.obs_names)  # readers recognise objects joined after the fit

    # ---- write: everything computed and checked ----------------------------------------------------------------------
    adata = adata.copy() if copy else adata
    with atomic_writes(adata):  # all or nothing: the old outputs or the new ones
        _keys.drop_outputs(adata, _keys.metacell_outputs(key_added))
        adata.obs[key_added] = pd.Categorical(res.labels, categories=res.present)
        adata.obsm[_keys.metacell_weights(key_added)] = res.weights
        adata.obsm[_keys.metacell_archetypes(key_added)] = res.archetypes
        adata.obsp[_keys.metacell_kernel(key_added)] = res.kernel
        adata.uns[key_added] = {**uns, **res.diagnostics(grouped=groupby is not None)}
    logg.info(
        "    finished",
        time=start,
        deep=(
            f"added\n    '{key_added}', hard labels (adata.obs)\n    '{_keys.metacell_weights(key_added)}', "
            f"'{_keys.metacell_archetypes(key_added)}' (adata.obsm)\n    '{_keys.metacell_kernel(key_added)}' (adata.obsp)\n"
            f"    '{key_added}', fit diagnostics (adata.uns)"
        ),
    )
    return adata if copy else None


def _loop_controls(
    n_neighbors: Any, n_waypoint_eigs: Any, max_iter: Any, min_iter: Any, fw_iters: Any, convergence_epsilon: Any
) -> tuple[int, int, int, int, int, float]:
    """The fit's size and loop arguments, checked one by one and against each other."""
    n_neighbors = check_int("n_neighbors", n_neighbors, minimum=3)
    n_waypoint_eigs = check_int("n_waypoint_eigs", n_waypoint_eigs, minimum=2)
    max_iter = check_int("max_iter", max_iter, minimum=1)
    min_iter = check_int("min_iter", min_iter, minimum=0)
    fw_iters = check_int("fw_iters", fw_iters, minimum=1)
    if max_iter < min_iter:
        msg = f"max_iter={max_iter} is lower than min_iter={min_iter}."
        raise ValueError(msg)
    if n_waypoint_eigs > n_neighbors:
        msg = f"n_waypoint_eigs={n_waypoint_eigs} cannot exceed n_neighbors={n_neighbors} (the number of diffusion components SEACells computes)."
        raise ValueError(msg)
    convergence_epsilon = check_number("convergence_epsilon", convergence_epsilon, low=0, low_open=True)
    return n_neighbors, n_waypoint_eigs, max_iter, min_iter, fw_iters, float(convergence_epsilon)


def _embedding(adata: AnnData, use_rep: str) -> Any:
    """``obsm[use_rep]`` checked (dense, 2-D, numeric, finite), loaded when lazy, and brought into a safe range."""
    if not isinstance(use_rep, str):
        msg = f"use_rep must be the name of an adata.obsm entry, got {use_rep!r}."
        raise TypeError(msg)
    check_key(adata.obsm, use_rep, "adata.obsm", "Compute it first, e.g. sc.pp.pca(adata) for 'X_pca'.")
    # a lazily read embedding (anndata.experimental.read_lazy) is loaded: it is small (cells x components)
    x = load(
        check_in_memory(adata.obsm[use_rep], f"adata.obsm[{use_rep!r}]", allow_dask=True), f"adata.obsm[{use_rep!r}]"
    )
    if isinstance(x, pd.DataFrame):
        x = x.to_numpy()
    if is_sparse(x):
        msg = f"adata.obsm[{use_rep!r}] is sparse; metacells need a dense low-dimensional embedding (e.g. 'X_pca')."
        raise TypeError(msg)
    if x.ndim != 2 or x.shape[1] < 1:
        msg = f"adata.obsm[{use_rep!r}] must be a 2-D (cells x components) array, got shape {x.shape}."
        raise ValueError(msg)
    if not np.issubdtype(np.dtype(x.dtype), np.number):
        msg = f"adata.obsm[{use_rep!r}] must be numeric, got dtype {x.dtype}."
        raise TypeError(msg)
    check_finite(f"adata.obsm[{use_rep!r}]", x)
    scaled = scaled_to_range(x)
    if scaled is not x:  # exact (a power of two) and harmless to the result, but such values point to a problem
        top = float(abs(x).max())
        warnings.warn(
            f"adata.obsm[{use_rep!r}] has values of magnitude up to {top:.3g}, far from those of an embedding (PCA "
            "of log-normalised data is of order 1-100); it was rescaled by a power of two, which leaves the "
            "metacells unchanged, but check how it was computed.",
            GpucWarning,
            stacklevel=3,
        )
    return scaled


def _neighbors_graph(adata: AnnData, neighbors_key: str | None, use_rep: str, groupby: str | None) -> Any:
    """The stored distances of ``uns[neighbors_key]`` (scanpy's layout), after checking they fit; None for None."""
    if neighbors_key is None:
        return None
    if not isinstance(neighbors_key, str):
        msg = f"neighbors_key must be None or the uns key of a neighbour graph, got {neighbors_key!r}."
        raise TypeError(msg)
    check_key(
        adata.uns,
        neighbors_key,
        "adata.uns",
        "Run sc.pp.neighbors (or rsc.pp.neighbors) first, or pass neighbors_key=None.",
    )
    info = adata.uns[neighbors_key]
    dkey = info.get("distances_key", "distances") if isinstance(info, Mapping) else "distances"
    check_key(adata.obsp, dkey, "adata.obsp")
    params = info.get("params", {}) if isinstance(info, Mapping) else {}
    metric = params.get("metric", "euclidean")
    rep = params.get("use_rep")
    if metric != "euclidean" or (rep is not None and rep != use_rep):
        msg = (
            f"the {neighbors_key!r} graph was built with metric={metric!r} on {rep or 'its default representation'!r}; "
            f"the SEACells kernel needs Euclidean distances on use_rep={use_rep!r}. Pass neighbors_key=None."
        )
        raise ValueError(msg)
    if groupby is not None:
        msg = "neighbors_key cannot be combined with groupby (the graph links cells across groups); pass neighbors_key=None."
        raise ValueError(msg)
    return check_in_memory(adata.obsp[dkey], f"adata.obsp[{dkey!r}]")


# --------------------------------------------------------------------------------------------------------------------
# aggregation and quality
# --------------------------------------------------------------------------------------------------------------------
# the first two parameters of the tools that read a metacells result
_METACELLS_RUN = """\
adata
    AnnData on which :func:`gpuc.tl.metacells` ran.
key
    ``key_added`` of that run."""


def _check_metacells(adata: AnnData, key: str) -> dict[str, Any]:
    check_adata(adata)
    if key in adata.obs and key not in adata.uns:
        from gpuc.get._checks import tool_output

        tool_output(adata, key, "metacells")  # labels without their fit (anndata.concat drops uns): says so
    if key not in adata.obs or key not in adata.uns or _keys.metacell_weights(key) not in adata.obsm:
        msg = f"No metacells under key {key!r}: run gpuc.tl.metacells(adata, key_added={key!r}) first."
        raise KeyError(msg)
    from gpuc.get._checks import tool_output

    return tool_output(adata, key, "metacells")  # its fields checked; objects joined after their fits refused


@doc_params(metacells_run=_METACELLS_RUN)
def aggregate_metacells(
    adata: AnnData,
    key: str = _keys.METACELL,
    *,
    layer: str | None = None,
    soft: bool | Literal["mean", "sum"] = False,
    minimum_weight: float = 0.05,
    celltype_key: str | None = None,
) -> AnnData:
    """Metacell x gene AnnData of the metacells' counts, as SEACells ``summarize_by_SEACell`` (hard labels) or
    ``summarize_by_soft_SEACell`` (soft assignments) compute them.

    Parameters
    ----------
    {metacells_run}
    layer
        Matrix to sum: ``adata.layers[layer]``; None uses ``adata.X``. Sum raw counts (e.g. ``layer="counts"``): when
        ``X`` is used and holds non-integer values (log-normalised data), a warning says so.
        A dask array (``anndata.experimental.read_lazy`` or ``read_elem_lazy``) is summed chunk by chunk, never
        loaded whole.
    soft
        ``False`` (default): the sum of the counts of the cells labelled with each metacell, SEACells 0.3.3
        ``core.summarize_by_SEACell``; integer counts give integer sums, ready for :func:`gpuc.tl.deseq`.

        ``"mean"`` (or ``True``): SEACells 0.3.3 ``core.summarize_by_soft_SEACell(ad, A,
        minimum_weight=minimum_weight)``. The soft assignments (``obsm[key + "_weights"]``) are first sparsified as
        SEACells' ``sparsify_assignments`` does (see ``minimum_weight``), then every metacell gets the weighted
        *mean* of its cells' counts, ``sum_i w_i x_i / sum_i w_i`` (SEACells' docstring says "summing", its code
        divides by the total weight): a profile on the scale of one cell.

        ``"sum"``: the weighted *sum* ``sum_i w_i x_i`` with the same sparsified weights (``"mean"`` times
        ``obs['size']``). Each cell's kept weights sum to 1, so the metacells' totals add up to the cells' total
        counts: pseudobulk counts of soft metacells. They are not integers; :func:`gpuc.tl.deseq` (like R's
        DESeq2) accepts only integer counts, so round them first (``mc.X = mc.X.rint()`` for the sparse result
        of sparse counts, ``np.rint(mc.X)`` for a dense one), or use the hard sums (``soft=False``), which are
        integer already.
    minimum_weight
        With ``soft``: SEACells' cut on the soft assignments (its default, 0.05). Per cell, weights below
        ``min(minimum_weight, p95)`` are set to 0, where ``p95`` is the 95th percentile of the cell's non-zero
        weights (SEACells 0.3.3's fallback, so that a cell whose weight is spread thinly keeps its largest
        weights), and the cell's remaining weights are rescaled to sum to 1. ``0`` keeps every weight (each cell
        contributes to every metacell it has weight in). Ignored without ``soft``.
    celltype_key
        ``obs`` column; adds the majority cell type per metacell and its purity (with ``soft``, weighted by the
        sparsified assignments, as SEACells' ``celltype`` and ``celltype_purity``).

    Returns
    -------
    AnnData with one row per metacell (obs_names = labels) and the genes of ``adata``:

    ``X``
        Summed counts (``soft=False``), weighted means (``"mean"``) or weighted sums (``"sum"``), sparse CSR when
        the input is sparse, float64.
    ``obs['size']``
        Cells per metacell; with ``soft``, the sum of its sparsified weights (SEACells' ``Pseudo-sizes``).
        ``obs['group']`` with groupby; ``obs[celltype_key]`` and ``obs[celltype_key + '_purity']`` when
        ``celltype_key`` is given.
    ``obsm[<basis>]``
        Member mean (weighted mean with ``soft``) of every dense 2-D ``obsm`` array named ``X_*`` (``X_pca``,
        ``X_umap``...), so metacells can be drawn over cells; not the cells' :func:`consensus_nmf` usages (their
        ``uns`` result stays with the cells; run consensus_nmf on the metacells instead).
    ``uns['metacell_source']``
        The arguments of the call (key, layer, soft, minimum_weight, celltype_key):
        ``aggregate_metacells(adata, **source)`` redoes it.

    Metacells that keep no weight after the cut (SEACells returns a row of NaN for them) are left out, as are
    metacells no cell is labelled with in the hard case.
    """
    # ---- validate ----------------------------------------------------------------------------------------------------
    info = _check_metacells(adata, key)
    if not (isinstance(soft, bool | np.bool_) or soft in ("mean", "sum")):
        msg = f"soft={soft!r} is not valid; choose False, True, 'mean' or 'sum'."
        raise ValueError(msg)
    summary = soft if isinstance(soft, str) else ("mean" if soft else False)  # True is SEACells' soft summary
    minimum_weight = check_number("minimum_weight", minimum_weight, low=0, high=1)
    mat = get_matrix(adata, layer=layer)
    if celltype_key is not None:
        check_key(adata.obs, celltype_key, "adata.obs")
        check_printable_labels(adata.obs[celltype_key], f"adata.obs[{celltype_key!r}]")
    if layer is None and not is_dask_array(mat) and non_integer(mat):
        warnings.warn(
            "aggregate_metacells sums adata.X, which holds non-integer values (log-normalised or scaled data?); "
            "sums of those are not counts. Pass layer= naming the raw counts (e.g. layer='counts') for pseudobulk "
            "counts per metacell.",
            GpucWarning,
            stacklevel=2,
        )
    table: pd.DataFrame = info["metacells"]
    if not isinstance(table, pd.DataFrame) and hasattr(table, "to_memory"):
        table = table.to_memory()  # anndata.experimental.read_lazy gives uns tables as xarray-backed Dataset2D

    # ---- plan: the metacells x cells membership (ones, or the assignment weights when soft) --------------------------
    if summary:
        wkey = _keys.metacell_weights(key)
        # (n, k), a result (host unless moved); a lazily read one is small (k entries per cell at most): loaded;
        # sparsified as SEACells' sparsify_assignments does
        weights = load(adata.obsm[wkey], f"adata.obsm[{wkey!r}]")
        agg, names = soft_membership(weights, list(table.index), minimum_weight=minimum_weight)
    else:
        agg, names = hard_membership(adata.obs[key])

    # ---- one engine call: the sums, where the matrix lives (chunk by chunk when lazy) --------------------------------
    sums = summed(agg, mat)
    size = np.asarray(agg.sum(axis=1)).ravel()
    if summary == "mean":
        sums = divided_rows(sums, size)

    # ---- write: a new AnnData ----------------------------------------------------------------------------------------
    obs = pd.DataFrame({"size": size if summary else size.astype(np.int64)}, index=pd.Index(names, name=None))
    if "group" in table and (table["group"] != "").any():
        obs["group"] = pd.Categorical(table.loc[names, "group"].to_numpy())
    if celltype_key is not None:
        majority, frac = purity_from_membership(agg, adata.obs[celltype_key])
        obs[celltype_key] = pd.Categorical(
            majority, categories=adata.obs[celltype_key].astype("category").cat.categories
        )
        obs[f"{celltype_key}_purity"] = frac
    out = AnnData(X=sums, obs=obs, var=adata.var.copy())
    for name, mean in member_means(agg, _cell_embeddings(adata), size).items():
        out.obsm[name] = mean
    out.uns[_keys.METACELL_SOURCE] = {
        "key": key, "layer": layer, "soft": summary, "minimum_weight": minimum_weight, "celltype_key": celltype_key,
    }  # fmt: skip
    return out


def _cell_embeddings(adata: AnnData) -> dict[str, Any]:
    """The dense 2-D numeric ``obsm`` arrays named ``X_*`` that metacells average, except NMF usages."""
    out = {}
    nmf = {
        name
        for key in adata.uns
        if _keys.written_by(adata, key, _keys.NMF_MARKER)
        for name in _keys.nmf_outputs(key)["obsm"]
    }
    for name, emb in adata.obsm.items():
        if not name.startswith("X_") or is_sparse(getattr(emb, "_meta", emb)) or isinstance(emb, pd.DataFrame):
            continue
        if name in nmf or _keys.written_by(adata, name[2:], _keys.NMF_MARKER):
            # the cells' NMF usages belong to their uns entry, which the metacells do not get: averaged here they
            # would sit where consensus_nmf on the metacells writes, without a result describing them
            continue
        if emb.ndim == 2 and np.issubdtype(np.dtype(emb.dtype), np.number):
            out[name] = emb
    return out


@doc_params(metacells_run=_METACELLS_RUN)
def metacell_quality(
    adata: AnnData,
    key: str = _keys.METACELL,
    *,
    celltype_key: str | None = None,
    use_rep: str | None = None,
    nth_neighbor: int = 1,
    celltype_separation: Literal["neighbor", "nearest"] | None = None,
    device: Device | None = None,
    n_jobs: int | None = None,
    key_added: str | None = None,
    inplace: bool = True,
    copy: bool = False,
) -> pd.DataFrame | AnnData | None:
    """Compactness, separation and purity of the hard metacells, as SEACells' ``evaluate`` module defines them.

    Both geometric metrics use Palantir's multiscale diffusion space of ``obsm[use_rep]`` (10 diffusion components
    on a 30-NN adaptive kernel, components 1..9 scaled by lambda / (1 - lambda)).

    Parameters
    ----------
    {metacells_run}
    celltype_key
        ``obs`` column for purity (most frequent label per metacell and its fraction).
    use_rep
        Embedding for the diffusion space; default: the one the metacells were built on.
    nth_neighbor
        Separation is the distance to the ``nth_neighbor``-th nearest other metacell centroid.
    celltype_separation
        With ``celltype_key``, also the separation among metacells of one cell type (a metacell's type is its
        most frequent ``celltype_key`` label among its cells, as for purity; ties go to the first label in sorted
        order), in column ``<celltype_key>_separation``. ``"neighbor"``: SEACells 0.3.3
        ``evaluate.separation(cluster=celltype_key, nth_nbr=nth_neighbor)``, the distance to the
        ``nth_neighbor``-th nearest other metacell, kept only where that metacell has the same type (NaN for the
        others, which SEACells leaves out of its result). ``"nearest"``: the distance to the ``nth_neighbor``-th
        nearest metacell *of the same type*, whichever metacells of other types lie closer (NaN where fewer than
        ``nth_neighbor`` others share the type). ``None`` (default): not computed.
    device
        ``"auto"``, ``"cpu"`` or ``"gpu"``; ``None`` follows :attr:`gpuc.settings.device`.
    {n_jobs}
    key_added
        ``uns`` key of the table; default ``key + "_quality"``.
    inplace
        Write the table to ``adata.uns[key_added]`` (default) or, with ``False``, return it and write nothing
        (as :func:`scanpy.pp.calculate_qc_metrics`).
    copy
        With ``inplace``, write into a copy and return it. The four combinations: ``inplace=True, copy=False``
        writes into ``adata`` and returns None; ``inplace=True, copy=True`` returns a copy with the table;
        ``inplace=False, copy=False`` returns the table; ``inplace=False, copy=True`` is refused (a ValueError: there
        would be nothing to write into the copy).

    Returns
    -------
    With ``inplace=False`` the table: one row per metacell; columns ``size``, ``compactness`` (lower is better,
    SEACells ``evaluate.compactness``), ``separation`` (higher is better, ``evaluate.separation``), with
    ``celltype_key`` the columns ``<celltype_key>`` and ``<celltype_key>_purity`` (``compute_celltype_purity``), and
    with ``celltype_separation`` the column ``<celltype_key>_separation``. Otherwise ``None`` (or the modified copy
    with ``copy=True``), having written the table to ``adata.uns[key_added]``.

    See Also
    --------
    metacell_assignment_quality : per-cell checks of the soft assignments (entropy, maximum weight).
    """
    # ---- validate ----------------------------------------------------------------------------------------------------
    info = _check_metacells(adata, key)
    stored = info.get("params", {}).get("use_rep") if isinstance(info.get("params"), Mapping) else None
    if use_rep is None and not isinstance(stored, str):
        msg = f"adata.uns[{key!r}]['params'] does not name the embedding the metacells were built on; pass use_rep=."
        raise ValueError(msg)
    use_rep = use_rep if use_rep is not None else stored
    x = _embedding(adata, use_rep)
    nth_neighbor = check_int("nth_neighbor", nth_neighbor, minimum=1)
    if celltype_key is not None:
        check_key(adata.obs, celltype_key, "adata.obs")
        check_printable_labels(adata.obs[celltype_key], f"adata.obs[{celltype_key!r}]")
    check_choice("celltype_separation", celltype_separation, (None, "neighbor", "nearest"))
    if celltype_separation is not None and celltype_key is None:
        msg = f"celltype_separation={celltype_separation!r} needs celltype_key= (the obs column of cell types)."
        raise ValueError(msg)
    key_added = check_key_added(_keys.metacell_quality(key) if key_added is None else key_added)
    if not isinstance(inplace, bool) or not isinstance(copy, bool):
        msg = "inplace and copy must be True or False."
        raise TypeError(msg)
    if copy and not inplace:
        msg = "copy=True writes into a copy; it cannot be combined with inplace=False."
        raise ValueError(msg)
    old = adata.uns.get(key_added)
    if inplace and old is not None and not (isinstance(old, pd.DataFrame) and "compactness" in old.columns):
        msg = (
            f"gpuc.tl.metacell_quality with key_added={key_added!r} would overwrite adata.uns[{key_added!r}], which "
            "is not a metacell quality table. Pass another key_added, or delete it first if it may go."
        )
        raise ValueError(msg)

    # ---- plan: the device, each cell's metacell and the metacells' order ---------------------------------------------
    backend = get_backend(device, x)
    labels = np.asarray(adata.obs[key].astype(str))
    order = [str(c) for c in adata.obs[key].cat.categories]

    # ---- one engine call ---------------------------------------------------------------------------------------------
    with interruptible("metacell_quality"):
        df = quality_table(
            backend, x, labels, order, nth_neighbor=nth_neighbor, n_jobs=n_jobs,
            celltypes=None if celltype_key is None else adata.obs[celltype_key], celltype_key=celltype_key,
            clusters=None if celltype_separation is None else adata.obs[celltype_key], cluster_key=celltype_key,
            cluster_mode=celltype_separation or "neighbor",
        )  # fmt: skip
    logg.info(
        f"metacell quality: compactness median {np.nanmedian(df['compactness']):.3g}, "
        f"separation median {np.nanmedian(df['separation']):.3g}"
    )

    # ---- write -------------------------------------------------------------------------------------------------------
    if not inplace:
        return df
    adata = adata.copy() if copy else adata
    with atomic_writes(adata):
        adata.uns[key_added] = df
    return adata if copy else None


@doc_params(metacells_run=_METACELLS_RUN)
def metacell_assignment_quality(
    adata: AnnData,
    key: str = _keys.METACELL,
    *,
    threshold: float = 0.1,
    key_added: str | None = None,
    copy: bool = False,
) -> AnnData | None:
    """Per-cell checks of the soft assignments: entropy, largest weight and number of non-trivial weights.

    The checks of the SEACells tutorial and of its ``plot.plot_assignment_entropy``, from the soft assignments
    ``obsm[key + "_weights"]`` (SEACells' ``A`` transposed). Cells with low entropy and a large maximum weight
    belong clearly to one metacell; many cells without a single weight above ``threshold`` suggest too many
    metacells for the data (SEACells issue #43). Draw them with :func:`gpuc.pl.metacell_assignment_quality`.

    Parameters
    ----------
    {metacells_run}
    threshold
        A weight above it counts as a non-trivial assignment (the tutorial's 0.1).
    key_added
        Prefix of the ``obs`` columns written; default ``key``.
    copy
        Write into a copy and return it.

    Returns
    -------
    None, or the modified copy when ``copy=True``. Writes

    ``adata.obs[key_added + "_entropy"]``
        ``scipy.stats.entropy`` of the cell's weights (natural log; 0 = wholly in one metacell, ``log(k)`` = even
        over ``k``): ``scipy.stats.entropy(A, axis=0)``, the ``Metacell_Entropy`` column that the pre-release
        SEACells model wrote and that SEACells 0.3.3's ``plot_assignment_entropy`` expects (nothing in 0.3.3 writes
        it).
    ``adata.obs[key_added + "_max_weight"]``
        The cell's largest weight (the first column of the tutorial's "strength of top 5 strongest
        assignments", ``np.sort(np.partition(A.T, -5)[:, -5:])[:, ::-1]``).
    ``adata.obs[key_added + "_n_assigned"]``
        Number of the cell's weights above ``threshold``: the tutorial's ``(A.T > 0.1).sum(axis=1)``, "non-trivial
        (> 0.1) assignments per cell".
    ``adata.uns[key_added + "_assignment_quality"]``
        ``params`` (``key``, ``threshold``) and ``unassigned``, the fraction of cells without a non-trivial
        assignment.

    A new :func:`metacells` run under ``key`` removes these entries (those of the default ``key_added``).
    """
    # ---- validate ----------------------------------------------------------------------------------------------------
    _check_metacells(adata, key)
    threshold = check_number("threshold", threshold, low=0, high=1, high_open=True)
    key_added = check_key_added(key if key_added is None else key_added)
    check_bool("copy", copy)
    cols = _keys.metacell_assignment_columns(key_added)
    ukey = _keys.metacell_assignment_quality(key_added)
    old = adata.uns.get(ukey)
    mine = isinstance(old, Mapping) and "threshold" in old.get("params", {})
    present = [f"adata.obs[{c!r}]" for c in cols.values() if c in adata.obs.columns]
    present += [f"adata.uns[{ukey!r}]"] if old is not None else []
    if present and not mine:  # entries under these names that an earlier call did not write
        msg = (
            f"gpuc.tl.metacell_assignment_quality with key_added={key_added!r} would overwrite {', '.join(present)}, "
            "which it did not write. Pass another key_added, or delete them first if they may go."
        )
        raise ValueError(msg)
    wkey = _keys.metacell_weights(key)
    weights = load(adata.obsm[wkey], f"adata.obsm[{wkey!r}]")

    # ---- one engine call ---------------------------------------------------------------------------------------------
    stats = assignment_stats(weights, threshold=threshold)
    unassigned = float(np.mean(stats["n_assigned"] == 0))
    logg.info(
        f"metacell assignments: entropy median {np.nanmedian(stats['entropy']):.3g}, max weight median "
        f"{np.median(stats['max_weight']):.3g}, {100 * unassigned:.1f}% of cells without a weight > {threshold:g}"
    )

    # ---- write -------------------------------------------------------------------------------------------------------
    adata = adata.copy() if copy else adata
    for name, col in cols.items():
        adata.obs[col] = stats[name]
    adata.uns[ukey] = {"params": {"key": key, "threshold": threshold}, "unassigned": unassigned}
    return adata if copy else None
