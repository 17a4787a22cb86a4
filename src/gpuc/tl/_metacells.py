"""``gpuc.tl.metacells``, ``aggregate_metacells`` and ``metacell_quality``: AnnData adapters over :mod:`gpuc.metacells`."""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd
import scipy.sparse as sp
from anndata import AnnData
from scanpy import logging as logg

from gpuc import _keys
from gpuc._backend import Backend, Device, backend_of, get_backend, is_sparse, to_host
from gpuc._dask import is_dask_array, map_units, resolve_client
from gpuc._errors import GpucWarning, interruptible
from gpuc._lazy import grouped_sum, load
from gpuc._utils import progress
from gpuc._validate import (
    SeedLike,
    align_to_obs,
    check_adata,
    check_bool,
    check_choice,
    check_finite,
    check_in_memory,
    check_int,
    check_key,
    check_key_added,
    check_memory,
    check_number,
    check_printable_labels,
    check_unique_names,
    get_matrix,
    resolve_random_state,
)
from gpuc.metacells._kernel import knn_from_graph
from gpuc.metacells._pipeline import KNN_DIFFUSION, metacells_peak_bytes, run_metacells
from gpuc.metacells._quality import compactness, diffusion_space, purity, purity_from_membership, separation

_GRAPHS = ("union", "intersection")
_INITS = ("waypoint", "greedy", "random")
_A0 = ("auto", "random", "uniform")
CELLS_PER_METACELL = 75
# below this many cells per metacell on average the fit is pathological: each metacell holds a handful of cells and
# the cost grows as cells x metacells, so the call warns
MIN_CELLS_PER_METACELL = 5


def _label(group: Any, j: int) -> str:
    return f"SEACell-{j}" if group is None else f"{group}-SEACell-{j}"


def _embedding(adata: AnnData, use_rep: str) -> Any:
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
    return _scaled_to_range(x)


# the embedding's largest absolute value is brought into [2**-EXTREME_EXP, 2**EXTREME_EXP] before the kernel
EXTREME_EXP = 40


def _scaled_to_range(x: Any) -> Any:
    """``x`` times a power of two when its values are extreme (e.g. scaled by 1e19, whose squared distances overflow
    float32), else ``x`` itself.

    The SEACells kernel, the diffusion map and every result derived from them do not change when the embedding is
    multiplied by a constant (neighbours, bandwidths and ``d**2 / (sigma_i sigma_j)`` are scale-free), and a power of
    two multiplies every float exactly, so the result is the one of the unscaled computation, without overflow.
    """
    xp = backend_of(x).xp
    top = float(xp.abs(x).max()) if x.size else 0.0
    if top == 0.0 or 2.0**-EXTREME_EXP <= top <= 2.0**EXTREME_EXP:
        return x
    return x * x.dtype.type(2.0 ** (-int(np.round(np.log2(top)))))


def _n_distinct(x: Any) -> int:
    """Distinct rows of ``x``, computed where ``x`` lives: every row when the first column's values are all
    distinct (the usual embedding; one sorted column), else rows sorted lexicographically, then neighbours compared.
    """
    xp = backend_of(x).xp
    if x.shape[0] < 2:
        return int(x.shape[0])
    first = xp.sort(x[:, 0])
    if bool((first[1:] != first[:-1]).all()):
        return int(x.shape[0])
    s = x[xp.lexsort(x.T)]
    return 1 + int((s[1:] != s[:-1]).any(axis=1).sum())


def _default_n(n_cells: int) -> int:
    return round(n_cells / CELLS_PER_METACELL)


def _plan_groups(
    adata: AnnData, x: Any, n_metacells: Any, groupby: str | None, n_neighbors: int
) -> list[tuple[Any, np.ndarray, int]]:
    """[(group or None, cell positions, n_metacells)] after checking every size; raises before anything is written."""
    if isinstance(n_metacells, pd.Series):  # {group: n} given as a Series: its labels are the groups
        n_metacells = n_metacells.to_dict()
    if groupby is None:
        if isinstance(n_metacells, Mapping):
            msg = "n_metacells may be a mapping {group: n} only together with groupby=."
            raise TypeError(msg)
        plan = [(None, np.arange(adata.n_obs), n_metacells)]
    else:
        check_key(adata.obs, groupby, "adata.obs")
        col = adata.obs[groupby]
        # every cell gets a label, so a missing group is an error; 1 and "1" would share labels: refused
        check_printable_labels(col, f"adata.obs[{groupby!r}]")
        if col.isna().any():
            msg = (
                f"adata.obs[{groupby!r}] has {int(col.isna().sum())} missing value(s) (NaN/None); every cell needs a "
                "group: fill them in, or subset to the cells with a group first."
            )
            raise ValueError(msg)
        cats = col.cat.categories if isinstance(col.dtype, pd.CategoricalDtype) else pd.unique(col)
        codes = np.asarray(col)
        plan = []
        sizes = _sizes_by_group(n_metacells, cats, groupby) if isinstance(n_metacells, Mapping) else None
        for g in cats:
            idx = np.flatnonzero(codes == g)
            if idx.size == 0:
                continue
            n_g = sizes.get(str(g)) if sizes is not None else n_metacells
            plan.append((g, idx, n_g))
    out = []
    too_small = []
    for g, idx, n_g in plan:
        where = "" if g is None else f" in group {g!r}"
        if n_g is None:
            n_g = _default_n(idx.size)
        n_g = check_int(f"n_metacells{where}", n_g)
        n_distinct = _n_distinct(x[idx])
        if n_g < 2 or n_g > n_distinct or idx.size < n_neighbors:
            too_small.append(
                f"{'all cells' if g is None else repr(g)}: {idx.size} cells ({n_distinct} distinct), n_metacells={n_g}"
            )
            continue
        out.append((g, idx, n_g))
    if too_small:
        hint = (
            f"n_metacells must be >= 2 and <= the number of distinct cells, and a group needs >= n_neighbors={n_neighbors} cells "
            f"(the default is round(n_cells / {CELLS_PER_METACELL}))."
        )
        if groupby is not None:
            hint += f" Pass n_metacells={{group: n}} or drop these groups from adata.obs[{groupby!r}]."
        msg = "Cannot build metacells for: " + "; ".join(too_small) + ". " + hint
        raise ValueError(msg)
    crowded = [
        f"{'all cells' if g is None else repr(g)}: {idx.size} cells, n_metacells={n_g}"
        for g, idx, n_g in out
        if idx.size < MIN_CELLS_PER_METACELL * n_g
    ]
    if crowded:
        msg = (
            f"fewer than {MIN_CELLS_PER_METACELL} cells per metacell ({'; '.join(crowded)}): metacells of a few cells "
            f"average little noise away and the fit's cost grows with cells x metacells, so it can take very long. "
            f"SEACells recommends about one metacell per {CELLS_PER_METACELL} cells (the default n_metacells)."
        )
        warnings.warn(msg, GpucWarning, stacklevel=3)
    return out


def _sizes_by_group(n_metacells: Mapping, groups: Any, groupby: str) -> dict[str, Any]:
    """``{printed group: n}`` from ``{group: n}``. A key is the group it equals as given (``1`` is the integer group
    1); a key that equals no group but prints as exactly one (the percent-encoded string keys of a stored
    ``params["n_metacells"]``, e.g. after ``write_h5ad``) is that group. Unknown keys are an error.
    """
    groups = list(groups)
    out: dict[str, Any] = {}
    unknown = []
    for key, n in n_metacells.items():
        hit = [g for g in groups if isinstance(g, str) == isinstance(key, str) and _equal(g, key)]
        if not hit:
            hit = [g for g in groups if str(g) == _keys.decode_name(str(key))]
        if len(hit) != 1:
            unknown.append(key)
            continue
        out[str(hit[0])] = n
    if unknown:
        msg = (
            f"n_metacells names groups not in adata.obs[{groupby!r}]: {sorted(map(repr, unknown))} "
            f"(groups: {sorted(map(repr, groups))[:20]})."
        )
        raise ValueError(msg)
    return out


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


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
    device
        ``"auto"``, ``"cpu"`` or ``"gpu"``; ``None`` follows :attr:`gpuc.settings.device`.
    n_jobs
        CPU threads: ``None`` follows :attr:`gpuc.settings.n_jobs` (all cores available to the process), ``-1`` all
        cores. Results do not depend on it. In a Dask task, at most the worker's threads.
    client
        Where the fits of the groups run: ``None`` follows :attr:`gpuc.settings.client` (default: one after the other
        in this process); ``"default"`` or a ``distributed.Client``: one Dask task per group (see
        :func:`gpuc._dask.map_units`). Results are identical wherever they run.
    random_state
        Seed: an int, ``None`` (fresh entropy) or a numpy ``RandomState``/``Generator`` (drawn from once); the int
        used is recorded in ``params``. ``np.random.RandomState(seed)`` is consumed exactly as SEACells consumes the
        global RNG after ``np.random.seed(seed)``, so the default settings reproduce such a SEACells run when the kNN
        agree.
    key_added
        Prefix of every key written (see Returns). Entries under these names that an earlier :func:`metacells` did
        not write (e.g. ``key_added="leiden"`` over a Leiden column) are never replaced: the call is refused.
    copy
        Return a modified copy instead of writing into ``adata``.

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
        survive ``write_h5ad``), each entry holding its original name under ``group``.

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
    check_adata(adata)
    x = _embedding(adata, use_rep)
    n_neighbors = check_int("n_neighbors", n_neighbors, minimum=3)
    n_waypoint_eigs = check_int("n_waypoint_eigs", n_waypoint_eigs, minimum=2)
    max_iter = check_int("max_iter", max_iter, minimum=1)
    min_iter = check_int("min_iter", min_iter, minimum=0)
    fw_iters = check_int("fw_iters", fw_iters, minimum=1)
    random_state = resolve_random_state(random_state)
    if max_iter < min_iter:
        msg = f"max_iter={max_iter} is lower than min_iter={min_iter}."
        raise ValueError(msg)
    if n_waypoint_eigs > n_neighbors:
        msg = f"n_waypoint_eigs={n_waypoint_eigs} cannot exceed n_neighbors={n_neighbors} (the number of diffusion components SEACells computes)."
        raise ValueError(msg)
    convergence_epsilon = check_number("convergence_epsilon", convergence_epsilon, low=0, low_open=True)
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
    plan = _plan_groups(adata, x, n_metacells, groupby, n_neighbors)
    init_arch = None
    if initial_archetypes is not None:
        if groupby is not None:
            msg = "initial_archetypes cannot be combined with groupby."
            raise ValueError(msg)
        init_arch = _archetype_positions(adata, initial_archetypes, plan[0][2])
    # "auto" keeps fits the GPU does not speed up on the CPU (the largest group decides)
    backend = get_backend(device, x, tool="metacells", work=max(idx.size for _, idx, _ in plan))
    # groups are fitted one after the other: the largest fit bounds the peak
    need, g_big, n_big, k_big = max(
        (
            metacells_peak_bytes(idx.size, k, n_neighbors=n_neighbors, fw_iters=fw_iters, gpu=backend.is_gpu),
            str(g),
            idx.size,
            k,
        )
        for g, idx, k in plan
    )
    check_memory(
        backend,
        need,
        f"metacells on {n_big} cells with n_metacells={k_big}{'' if groupby is None else f' (group {g_big!r})'}",
        "Use fewer metacells, or split the cells with groupby= (e.g. by sample).",
    )

    start = logg.info(f"computing metacells on {use_rep!r} ({backend.name})")
    t_all = time.perf_counter()
    n = adata.n_obs
    weights_blocks, arche_blocks, kernel_blocks = [], [], []
    labels = np.empty(n, dtype=object)
    tables, per_group = [], {}
    offset = 0
    knn = None
    if graph_dist is not None:  # only without groupby: one fit
        need = n_neighbors if init != "waypoint" or init_arch is not None else max(n_neighbors, KNN_DIFFUSION)
        knn = knn_from_graph(backend, graph_dist, need, where=f"the {neighbors_key!r} graph")
    dask_client = resolve_client(client)
    options = {
        "n_neighbors": n_neighbors, "n_waypoint_eigs": n_waypoint_eigs, "graph": graph, "max_iter": max_iter,
        "min_iter": min_iter, "convergence_epsilon": float(convergence_epsilon), "fw_iters": fw_iters,
        "random_state": random_state, "init": init, "initial_archetypes_": init_arch, "a0": a0,
        "knn_method": knn_method, "knn": knn,
    }  # fmt: skip
    # each group is one unit: fitted here one after the other, or as Dask tasks on the client
    with interruptible("metacells"):
        fits = map_units(
            _fit_group,
            [
                ("" if g is None else f"group {g!r}", (backend, x[idx], k, None if g is None else str(g)))
                for g, idx, k in plan
            ],
            client=dask_client,
            shared={"options": options},
            n_jobs=n_jobs,
            what="metacells",
            costs=[idx.size * k for _, idx, k in plan],  # on a cluster the largest groups start first
        )
    for (g, idx, k), fit in zip(plan, fits, strict=True):
        where = "" if g is None else f" group {g!r}:"
        a_t, b = fit.a_t, fit.b
        hard = _row_argmax(a_t)
        labels[idx] = [_label(g, j) for j in hard]
        obs_idx = adata.obs_names[idx]
        centers = obs_idx[np.asarray(b.argmax(axis=0)).ravel()]
        init_names = np.full(k, "", dtype=object)
        init_names[: len(fit.archetypes)] = obs_idx[fit.archetypes]
        sizes = np.bincount(hard, minlength=k)
        tables.append(
            pd.DataFrame(
                {
                    "group": "" if g is None else str(g), "archetype": np.arange(k), "center": np.asarray(centers, dtype=object),
                    "initial_archetype": init_names, "size": sizes, "column": offset + np.arange(k),
                },
                index=pd.Index([_label(g, j) for j in range(k)], name="metacell"),
            )
        )  # fmt: skip
        weights_blocks.append((idx, a_t))
        arche_blocks.append((idx, b))
        kernel_blocks.append((idx, fit.kernel))
        per_group["all" if g is None else _keys.encode_name(g)] = {
            **({} if g is None else {"group": str(g)}),
            "rss": fit.rss,
            "n_iter": int(fit.n_iter),
            "converged": bool(fit.converged),
            "convergence_threshold": float(fit.convergence_threshold),
            "n_metacells": int(k),
            "a0": fit.a0,
            "seconds": fit.seconds,
        }
        logg.info(
            f"   {where} {k} metacells, {fit.n_iter} iterations, RSS {fit.rss[0]:.6g} -> {fit.rss[-1]:.6g}{'' if fit.converged else ' (not converged)'}"
        )
        offset += k
    weights = _assemble(weights_blocks, n)
    arche = _assemble(arche_blocks, n)
    kernel = _assemble(kernel_blocks, n, square=True)
    table = pd.concat(tables)
    labelled = set(labels)  # built once: the membership test below runs once per metacell
    present = [lab for lab in table.index if lab in labelled]
    uns: dict[str, Any] = {
        "params": {
            "n_metacells": {_keys.encode_name(g): int(k) for g, _, k in plan} if groupby is not None else int(plan[0][2]),
            "use_rep": use_rep, "n_neighbors": n_neighbors, "n_waypoint_eigs": n_waypoint_eigs, "max_iter": max_iter,
            "min_iter": min_iter, "convergence_epsilon": float(convergence_epsilon), "fw_iters": fw_iters, "graph": graph,
            "groupby": groupby, "init": init, "a0": a0, "knn_method": knn_method, "neighbors_key": neighbors_key,
            "random_state": random_state, "device": device, "n_jobs": n_jobs,
            "initial_archetypes": None if init_arch is None else np.asarray(adata.obs_names[init_arch], dtype=str),
        },
        "device": backend.name,
        "metacells": table,
        "seconds": float(time.perf_counter() - t_all),
    }  # fmt: skip
    if groupby is None:
        only = per_group["all"]
        uns.update({key: only[key] for key in ("rss", "n_iter", "converged", "convergence_threshold", "a0")})
        uns["timings"] = only["seconds"]
    else:
        uns["groups"] = per_group
        uns["converged"] = all(v["converged"] for v in per_group.values())
        uns["n_iter"] = {gk: v["n_iter"] for gk, v in per_group.items()}

    # ---- everything computed and checked: write ----------------------------------------------------------------
    adata = adata.copy() if copy else adata
    _keys.drop_outputs(adata, _keys.metacell_outputs(key_added))
    adata.obs[key_added] = pd.Categorical(labels, categories=present)
    adata.obsm[_keys.metacell_weights(key_added)] = weights
    adata.obsm[_keys.metacell_archetypes(key_added)] = arche
    adata.obsp[_keys.metacell_kernel(key_added)] = kernel
    adata.uns[key_added] = uns
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


@dataclass
class _GroupFit:
    """What the tool keeps of one group's fit, on the host: A transposed, B and the kernel as CSR, and diagnostics."""

    a_t: sp.csr_matrix
    b: sp.csr_matrix
    kernel: sp.csr_matrix
    archetypes: np.ndarray
    rss: np.ndarray
    n_iter: int
    converged: bool
    convergence_threshold: float
    a0: str
    seconds: dict[str, float]


def _fit_group(backend: Backend, x: Any, k: int, group: str | None, *, options: dict, n_jobs: int | None) -> _GroupFit:
    """One group's SEACells fit (a unit of :func:`gpuc._dask.map_units`: in this process or a Dask task)."""
    with progress(total=options["max_iter"], desc=f"metacells{'' if group is None else ' ' + group}") as bar:

        def _cb(it: int, rss: float) -> None:
            bar.update(1)
            bar.set_postfix(rss=f"{rss:.4g}")

        res = run_metacells(backend, backend.asarray(x), k, **options, callback=_cb, n_jobs=n_jobs)
    fit = res.fit
    return _GroupFit(
        a_t=sp.csr_matrix(to_host(fit.A).T),
        b=sp.csr_matrix(to_host(fit.B)),
        kernel=sp.csr_matrix(to_host(res.kernel)),
        archetypes=np.asarray(fit.archetypes),
        rss=np.asarray(fit.rss, dtype=np.float64),
        n_iter=int(fit.n_iter),
        converged=bool(fit.converged),
        convergence_threshold=float(fit.convergence_threshold),
        a0=res.a0,
        seconds={key: float(v) for key, v in res.timings.items()},
    )


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


def _archetype_positions(adata: AnnData, arche: Any, k: int) -> np.ndarray:
    """Positions of the initial archetypes: cell positions, obs names (a list, array, Index or the values of a
    Series), or a boolean mask over the cells (an array in obs order, or a Series matched to obs_names by label).
    """
    if isinstance(arche, pd.Series | Mapping) and (
        pd.api.types.is_bool_dtype(pd.Series(arche).dtype) if isinstance(arche, pd.Series) else True
    ):
        arche = align_to_obs(arche, adata, "initial_archetypes").to_numpy(dtype=bool)
    arr = np.asarray(arche)
    if arr.dtype == bool:
        if arr.shape != (adata.n_obs,):
            msg = f"initial_archetypes as a boolean mask must have one entry per cell ({adata.n_obs}), got shape {arr.shape}."
            raise ValueError(msg)
        arr = np.flatnonzero(arr)
    elif arr.dtype.kind in "OUS":
        check_unique_names(
            adata.obs_names,
            "adata.obs_names",
            "initial_archetypes given as names needs unique names: run adata.obs_names_make_unique() first, or pass "
            "cell positions.",
        )
        pos = adata.obs_names.get_indexer(arr.astype(str))
        if (pos < 0).any():
            msg = f"initial_archetypes names not in adata.obs_names: {list(arr[pos < 0][:5])}."
            raise KeyError(msg)
        arr = pos
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        msg = "initial_archetypes must be a 1-D list of cell positions, obs names, or a boolean mask over the cells."
        raise TypeError(msg)
    if arr.size != k or np.unique(arr).size != arr.size or arr.min() < 0 or arr.max() >= adata.n_obs:
        msg = f"initial_archetypes must be {k} distinct cells (n_metacells), got {arr.size} entries ({np.unique(arr).size} distinct)."
        raise ValueError(msg)
    return arr.astype(np.int64)


def _row_argmax(m: sp.csr_matrix) -> np.ndarray:
    """``m.argmax(axis=1)`` of a CSR matrix (scipy's answer, ties to the lowest column) without scipy's per-row loop.

    Rows whose largest stored value is positive (every row of the assignments A^T) are done at once: the first stored
    maximum after sorting the indices. The others (empty rows, rows with no positive entry, where implicit zeros
    compete) keep scipy's rule, row by row.
    """
    m = m.tocsr(copy=True)
    m.sum_duplicates()  # sorted indices, as scipy's argmax makes them
    n_rows = m.shape[0]
    counts = np.diff(m.indptr)
    out = np.full(n_rows, -1, dtype=np.intp)
    filled = np.flatnonzero(counts)
    if filled.size:
        starts = m.indptr[:-1][filled]
        data = m.data[: m.indptr[-1]]
        row_max = np.maximum.reduceat(data, starts)
        owner = np.repeat(np.arange(filled.size), counts[filled])
        position = np.where(data == row_max[owner], np.arange(data.size), data.size)
        first = np.minimum.reduceat(position, starts)
        good = row_max > 0
        out[filled[good]] = m.indices[first[good]]
    for i in np.flatnonzero(out < 0):  # rare: scipy's rule, where implicit zeros compete
        out[i] = int(m[[i]].argmax(axis=1)[0, 0])
    return out


def _assemble(blocks: list[tuple[np.ndarray, sp.csr_matrix]], n: int, *, square: bool = False) -> sp.csr_matrix:
    """Place per-group matrices (the group's cell positions, a group-cells x columns matrix) into one n-row CSR.

    Columns of successive groups are stacked side by side; with ``square`` the columns are cells too (the kernel),
    so each block lands on its group's rows and columns (block-diagonal).
    """
    if len(blocks) == 1 and np.array_equal(blocks[0][0], np.arange(n)):
        return blocks[0][1].tocsr()
    rows, cols, vals = [], [], []
    offset = 0
    for idx, m in blocks:
        c = m.tocoo()
        rows.append(idx[c.row])
        cols.append(idx[c.col] if square else c.col + offset)
        vals.append(c.data)
        offset += m.shape[1]
    shape = (n, n if square else offset)
    out = sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=shape)
    out.sort_indices()
    return out


# --------------------------------------------------------------------------------------------------------------------
# aggregation and quality
# --------------------------------------------------------------------------------------------------------------------
def _check_metacells(adata: AnnData, key: str) -> dict[str, Any]:
    check_adata(adata)
    if key not in adata.obs or key not in adata.uns or _keys.metacell_weights(key) not in adata.obsm:
        msg = f"No metacells under key {key!r}: run gpuc.tl.metacells(adata, key_added={key!r}) first."
        raise KeyError(msg)
    return adata.uns[key]


def _non_integer(x: Any) -> bool:
    """Whether a dense or sparse matrix holds a non-integer value (computed where it lives; one verdict back)."""
    data = x.data if is_sparse(x) else x
    if np.dtype(data.dtype).kind != "f":
        return False
    xp = backend_of(data).xp
    data = xp.asarray(data)
    return bool((data != xp.round(data)).any())


def aggregate_metacells(
    adata: AnnData,
    key: str = _keys.METACELL,
    *,
    layer: str | None = None,
    soft: bool = False,
    celltype_key: str | None = None,
) -> AnnData:
    """Metacell x gene AnnData of summed counts (SEACells ``summarize_by_SEACell`` / ``summarize_by_soft_SEACell``).

    Parameters
    ----------
    adata
        AnnData on which :func:`gpuc.tl.metacells` ran.
    key
        ``key_added`` of that run.
    layer
        Matrix to sum: ``adata.layers[layer]``; None uses ``adata.X``. Sum raw counts (e.g. ``layer="counts"``): when
        ``X`` is used and holds non-integer values (log-normalised data), a warning says so.
        A dask array (``anndata.experimental.read_lazy`` or ``read_elem_lazy``) is summed chunk by chunk, never
        loaded whole.
    soft
        False: sum the cells labelled with each metacell. True: every cell contributes to every metacell with its
        assignment weight (``obsm[key + "_weights"]``), so the total counts are preserved.
    celltype_key
        ``obs`` column; adds the majority cell type per metacell and its purity (weighted by the assignments when
        ``soft``).

    Returns
    -------
    AnnData with one row per metacell (obs_names = labels) and the genes of ``adata``:

    ``X``
        Summed (or weighted-summed) counts, sparse CSR when the input is sparse.
    ``obs['size']``
        Cells per metacell (sum of weights when ``soft``); ``obs['group']`` with groupby; ``obs[celltype_key]`` and
        ``obs[celltype_key + '_purity']`` when ``celltype_key`` is given.
    ``obsm[<basis>]``
        Member mean (weighted mean when ``soft``) of every dense 2-D ``obsm`` array named ``X_*`` (``X_pca``,
        ``X_umap``...), so metacells can be drawn over cells; not the cells' :func:`consensus_nmf` usages (their
        ``uns`` result stays with the cells; run consensus_nmf on the metacells instead).
    ``uns['metacell_source']``
        The arguments of the call (key, layer, soft, celltype_key): ``aggregate_metacells(adata, **source)`` redoes it.
    """
    info = _check_metacells(adata, key)
    if not isinstance(soft, bool):
        msg = f"soft must be True or False, got {soft!r}."
        raise TypeError(msg)
    mat = get_matrix(adata, layer=layer)
    if celltype_key is not None:
        check_key(adata.obs, celltype_key, "adata.obs")
        check_printable_labels(adata.obs[celltype_key], f"adata.obs[{celltype_key!r}]")
    if layer is None and not is_dask_array(mat) and _non_integer(mat):
        warnings.warn(
            "aggregate_metacells sums adata.X, which holds non-integer values (log-normalised or scaled data?); "
            "sums of those are not counts. Pass layer= naming the raw counts (e.g. layer='counts') for pseudobulk "
            "counts per metacell.",
            GpucWarning,
            stacklevel=2,
        )
    bk = backend_of(mat)  # the sums run where the matrix lives; only the metacells x genes result comes back
    table: pd.DataFrame = info["metacells"]
    if not isinstance(table, pd.DataFrame) and hasattr(table, "to_memory"):
        table = table.to_memory()  # anndata.experimental.read_lazy gives uns tables as xarray-backed Dataset2D
    if soft:
        wkey = _keys.metacell_weights(key)
        # (n, k), a result (host unless moved); a lazily read one is small (k entries per cell at most): loaded
        w = sp.csr_matrix(to_host(load(adata.obsm[wkey], f"adata.obsm[{wkey!r}]")))
        agg = sp.csr_matrix(w.T)  # (k, n)
        names = list(table.index)
        keep = np.asarray(agg.sum(axis=1)).ravel() > 0
        agg = agg[keep]
        names = [nm for nm, kp in zip(names, keep, strict=True) if kp]
    else:
        lab = adata.obs[key]
        names = [str(c) for c in lab.cat.categories]
        codes = lab.cat.codes.to_numpy()
        ok = codes >= 0
        agg = sp.csr_matrix((np.ones(int(ok.sum())), (codes[ok], np.flatnonzero(ok))), shape=(len(names), adata.n_obs))
    if is_dask_array(mat):
        # lazily read: each row chunk times its cells' columns of agg, the dense partials added by dask's tree
        # reduction (the matrix is never whole in one process); sparse chunks give a CSR result, as in memory
        sums = grouped_sum(agg, mat)
        if is_sparse(mat._meta):
            sums = sp.csr_matrix(sums)
    else:
        agg_d = bk.asarray(agg)
        sums = to_host(agg_d @ (mat if mat.dtype == np.float64 else mat.astype(np.float64)))  # float64, as scipy
        if sp.issparse(sums):
            sums = sp.csr_matrix(sums)
        else:
            sums = np.asarray(sums)
    size = np.asarray(agg.sum(axis=1)).ravel()
    obs = pd.DataFrame({"size": size if soft else size.astype(np.int64)}, index=pd.Index(names, name=None))
    if "group" in table and (table["group"] != "").any():
        obs["group"] = pd.Categorical(table.loc[names, "group"].to_numpy())
    if celltype_key is not None:
        majority, frac = purity_from_membership(agg, adata.obs[celltype_key])
        ct = adata.obs[celltype_key].astype("category")
        obs[celltype_key] = pd.Categorical(majority, categories=ct.cat.categories)
        obs[f"{celltype_key}_purity"] = frac
    out = AnnData(X=sums, obs=obs, var=adata.var.copy())
    denom = np.where(size > 0, size, 1.0)[:, None]
    for name, emb in adata.obsm.items():
        if not name.startswith("X_") or is_sparse(getattr(emb, "_meta", emb)) or isinstance(emb, pd.DataFrame):
            continue
        if _keys.written_by(adata, name[2:], _keys.NMF_MARKER):
            # the cells' NMF usages belong to their uns entry, which the metacells do not get: averaged here they
            # would sit where consensus_nmf on the metacells writes, without a result describing them
            continue
        if emb.ndim != 2 or not np.issubdtype(np.dtype(emb.dtype), np.number):
            continue
        if is_dask_array(emb):  # read_lazy: obsm is lazy too; summed chunk by chunk like the counts
            out.obsm[name] = grouped_sum(agg, emb) / denom
            continue
        eb = backend_of(emb)
        out.obsm[name] = np.asarray(to_host(eb.asarray(agg) @ emb)) / denom
    out.uns[_keys.METACELL_SOURCE] = {"key": key, "layer": layer, "soft": soft, "celltype_key": celltype_key}
    return out


def metacell_quality(
    adata: AnnData,
    key: str = _keys.METACELL,
    *,
    celltype_key: str | None = None,
    use_rep: str | None = None,
    nth_neighbor: int = 1,
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
    adata
        AnnData on which :func:`gpuc.tl.metacells` ran.
    key
        ``key_added`` of that run.
    celltype_key
        ``obs`` column for purity (most frequent label per metacell and its fraction).
    use_rep
        Embedding for the diffusion space; default: the one the metacells were built on.
    nth_neighbor
        Separation is the distance to the ``nth_neighbor``-th nearest other metacell centroid.
    device
        ``"auto"``, ``"cpu"`` or ``"gpu"``; ``None`` follows :attr:`gpuc.settings.device`.
    n_jobs
        CPU threads: ``None`` follows :attr:`gpuc.settings.n_jobs` (all cores available to the process), ``-1`` all
        cores. Results do not depend on it.
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
    With ``inplace=False`` the table: one row per metacell; columns ``size``, ``compactness`` (lower is better),
    ``separation`` (higher is better), and ``<celltype_key>``, ``<celltype_key>_purity``. Otherwise ``None`` (or
    the modified copy with ``copy=True``), having written the table to ``adata.uns[key_added]``.
    """
    info = _check_metacells(adata, key)
    use_rep = use_rep if use_rep is not None else info["params"]["use_rep"]
    x = _embedding(adata, use_rep)
    nth_neighbor = check_int("nth_neighbor", nth_neighbor, minimum=1)
    if celltype_key is not None:
        check_key(adata.obs, celltype_key, "adata.obs")
        check_printable_labels(adata.obs[celltype_key], f"adata.obs[{celltype_key!r}]")
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
    backend = get_backend(device, x)
    labels = np.asarray(adata.obs[key].astype(str))
    order = [str(c) for c in adata.obs[key].cat.categories]
    with interruptible("metacell_quality"):
        dc = diffusion_space(backend, backend.asarray(x), n_jobs=n_jobs)
        df = pd.DataFrame(index=pd.Index(order, name="metacell"))
        df["size"] = pd.Series(labels).value_counts().reindex(order).to_numpy()
        df["compactness"] = compactness(dc, labels, order).to_numpy()
        df["separation"] = separation(dc, labels, order, nth_neighbor=nth_neighbor).to_numpy()
    if celltype_key is not None:
        pur = purity(labels, adata.obs[celltype_key], order, celltype_key)
        df[celltype_key] = pur[celltype_key].to_numpy()
        df[f"{celltype_key}_purity"] = pur[f"{celltype_key}_purity"].to_numpy().astype(float)
    logg.info(
        f"metacell quality: compactness median {np.nanmedian(df['compactness']):.3g}, "
        f"separation median {np.nanmedian(df['separation']):.3g}"
    )
    if not inplace:
        return df
    adata = adata.copy() if copy else adata
    adata.uns[key_added] = df
    return adata if copy else None
