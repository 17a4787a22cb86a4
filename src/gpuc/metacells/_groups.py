"""Metacells of every group (no AnnData): one SEACells fit per group (in process or as Dask tasks), then the groups'
results assembled into one labelling, one set of n-row matrices and one table, on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from gpuc import _keys
from gpuc._backend import Backend, to_host
from gpuc._dask import map_units
from gpuc._utils import iteration_progress
from gpuc.metacells._kernel import knn_from_graph
from gpuc.metacells._pipeline import KNN_DIFFUSION, run_metacells
from gpuc.metacells._plan import GroupPlan


def metacell_label(group: Any, j: int) -> str:
    """The name of metacell ``j``: ``"SEACell-<j>"``, or ``"<group>-SEACell-<j>"`` for a group."""
    return f"SEACell-{j}" if group is None else f"{group}-SEACell-{j}"


@dataclass
class GroupFit:
    """What is kept of one group's fit, on the host: A transposed, B and the kernel as CSR, and diagnostics."""

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


@dataclass
class GroupedMetacells:
    """The assembled metacells of every group, on the host.

    ``labels`` (one per cell, object) are the hard labels; ``present`` the labels in use, in table order;
    ``weights`` (A^T) and ``archetypes`` (B) are n x k CSR with the groups' columns side by side; ``kernel`` is the
    n x n block-diagonal kernel; ``table`` has one row per column; ``groups`` holds each fit's diagnostics keyed by
    the percent-encoded group (``"all"`` without groupby).
    """

    labels: np.ndarray
    present: list[str]
    weights: sp.csr_matrix
    archetypes: sp.csr_matrix
    kernel: sp.csr_matrix
    table: pd.DataFrame
    groups: dict[str, dict[str, Any]]

    def summaries(self) -> list[str]:
        """One line per fit, in plan order: metacells, iterations, first and last RSS, and whether it converged."""
        return [
            f"{v['n_metacells']} metacells, {v['n_iter']} iterations, RSS {v['rss'][0]:.6g} -> {v['rss'][-1]:.6g}"
            f"{'' if v['converged'] else ' (not converged)'}"
            for v in self.groups.values()
        ]

    def diagnostics(self, *, grouped: bool) -> dict[str, Any]:
        """The fit's entries of ``uns[key_added]``: without groupby the only fit's ``rss``, ``n_iter``, ``converged``,
        ``convergence_threshold``, ``a0`` and ``timings``; with groupby ``groups``, ``converged`` (all of them) and
        ``n_iter`` per group.
        """
        if not grouped:
            only = self.groups["all"]
            out = {key: only[key] for key in ("rss", "n_iter", "converged", "convergence_threshold", "a0")}
            return {**out, "timings": only["seconds"]}
        return {
            "groups": self.groups,
            "converged": all(v["converged"] for v in self.groups.values()),
            "n_iter": {gk: v["n_iter"] for gk, v in self.groups.items()},
        }


def fit_groups(
    backend: Backend,
    x: Any,
    plan: list[GroupPlan],
    obs_names: pd.Index,
    *,
    options: dict[str, Any],
    graph_distances: Any = None,
    neighbors_key: str | None = None,
    client: Any = None,
    n_jobs: int | None = None,
) -> GroupedMetacells:
    """SEACells on each planned group of the rows of ``x``, assembled.

    Parameters
    ----------
    backend
        Device backend of the fits.
    x
        The (cells x components) embedding, on the backend's device.
    plan
        The fits (:func:`gpuc.metacells._plan.plan_groups`).
    obs_names
        The cells' names, for the table's ``center`` and ``initial_archetype``.
    options
        Keyword arguments of :func:`~gpuc.metacells.run_metacells` shared by every fit.
    graph_distances
        A stored kNN distance graph to reuse (one fit only), read by :func:`~gpuc.metacells.knn_from_graph`.
    neighbors_key
        Its name, for messages.
    client
        ``None`` (fits one after the other here) or a ``distributed.Client`` (one Dask task per group, the largest
        first).
    n_jobs
        CPU threads of each fit.

    Returns
    -------
    :class:`GroupedMetacells`; results are identical wherever the fits ran.
    """
    options = dict(options)
    if graph_distances is not None:
        waypoints = options["init"] == "waypoint" and options["initial_archetypes_"] is None
        need = max(options["n_neighbors"], KNN_DIFFUSION) if waypoints else options["n_neighbors"]
        options["knn"] = knn_from_graph(backend, graph_distances, need, where=f"the {neighbors_key!r} graph")
    fits = map_units(
        fit_group,
        [("" if p.group is None else f"group {p.group!r}", (backend, x[p.positions], p.k, _name(p))) for p in plan],
        client=client,
        shared={"options": options},
        n_jobs=n_jobs,
        what="metacells",
        costs=[p.positions.size * p.k for p in plan],  # on a cluster the largest groups start first
    )
    return assemble(plan, fits, obs_names)


def _name(p: GroupPlan) -> str | None:
    return None if p.group is None else str(p.group)


def fit_group(backend: Backend, x: Any, k: int, group: str | None, *, options: dict, n_jobs: int | None) -> GroupFit:
    """One group's SEACells fit (a unit of :func:`gpuc._dask.map_units`: in this process or a Dask task).

    The progress bar counts the iterations used against ``max_iter`` and shows the RSS change against its
    tolerance (see :func:`gpuc._utils.iteration_progress`); it is silent at ``verbosity=0``.
    """
    eps = float(options["convergence_epsilon"])
    rss_seen: list[float] = []
    with iteration_progress(options["max_iter"], f"metacells{'' if group is None else ' ' + group}") as bar:

        def _cb(it: int, rss: float) -> None:
            # the solver stops at |RSS_{t-1} - RSS_t| < eps * RSS_0; RSS_0 precedes the first callback, so until
            # the fit returns the change is shown relative to RSS_1 (the RSS falls from RSS_0, so this is at least
            # the solver's criterion and "reached" does not show early)
            rss_seen.append(float(rss))
            bar.update(1)
            if len(rss_seen) > 1:
                bar.criterion(abs(rss_seen[-2] - rss_seen[-1]) / max(rss_seen[0], 1e-300), eps, "RSS change")

        res = run_metacells(backend, backend.asarray(x), k, **options, callback=_cb, n_jobs=n_jobs)
        rss = res.fit.rss
        if len(rss) > 1:  # the solver's own criterion, now that RSS_0 is known
            bar.criterion(abs(rss[-2] - rss[-1]) / max(rss[0], 1e-300), eps, "RSS change")
            bar.refresh()
    fit = res.fit
    return GroupFit(
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


def assemble(plan: list[GroupPlan], fits: list[GroupFit], obs_names: pd.Index) -> GroupedMetacells:
    """The groups' fits as one labelling, n-row matrices (columns of successive groups side by side) and a table."""
    n = len(obs_names)
    labels = np.empty(n, dtype=object)
    tables, per_group = [], {}
    offset = 0
    for p, fit in zip(plan, fits, strict=True):
        g, idx, k = p.group, p.positions, p.k
        hard = row_argmax(fit.a_t)
        labels[idx] = [metacell_label(g, j) for j in hard]
        names = obs_names[idx]
        init_names = np.full(k, "", dtype=object)
        init_names[: len(fit.archetypes)] = names[fit.archetypes]
        tables.append(
            pd.DataFrame(
                {
                    "group": "" if g is None else str(g), "archetype": np.arange(k),
                    "center": np.asarray(names[np.asarray(fit.b.argmax(axis=0)).ravel()], dtype=object),
                    "initial_archetype": init_names, "size": np.bincount(hard, minlength=k),
                    "column": offset + np.arange(k),
                },
                index=pd.Index([metacell_label(g, j) for j in range(k)], name="metacell"),
            )
        )  # fmt: skip
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
        offset += k
    table = pd.concat(tables)
    labelled = set(labels)  # built once: the membership test below runs once per metacell
    positions = [p.positions for p in plan]
    return GroupedMetacells(
        labels=labels,
        present=[lab for lab in table.index if lab in labelled],
        weights=stack_blocks(list(zip(positions, [f.a_t for f in fits], strict=True)), n),
        archetypes=stack_blocks(list(zip(positions, [f.b for f in fits], strict=True)), n),
        kernel=stack_blocks(list(zip(positions, [f.kernel for f in fits], strict=True)), n, square=True),
        table=table,
        groups=per_group,
    )


def stack_blocks(blocks: list[tuple[np.ndarray, sp.csr_matrix]], n: int, *, square: bool = False) -> sp.csr_matrix:
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


def row_argmax(m: sp.csr_matrix) -> np.ndarray:
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
