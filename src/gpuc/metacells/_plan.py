"""Planning a metacells call before any fit (no AnnData): the embedding's scale, the groups' sizes, the initial
archetypes and the memory check, each raising before anything is computed or written.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from gpuc import _keys
from gpuc._backend import Backend, backend_of
from gpuc._errors import GpucWarning
from gpuc._validate import align_labels, check_int, check_memory, check_unique_names
from gpuc.metacells._pipeline import metacells_peak_bytes

CELLS_PER_METACELL = 75
# below this many cells per metacell on average the fit is pathological: each metacell holds a handful of cells and
# the cost grows as cells x metacells, so the call warns
MIN_CELLS_PER_METACELL = 5
# the embedding's largest absolute value is brought into [2**-EXTREME_EXP, 2**EXTREME_EXP] before the kernel
EXTREME_EXP = 40


@dataclass(frozen=True)
class GroupPlan:
    """One independent fit: the group's label as given (None without groupby), its cells' positions and its size."""

    group: Any
    positions: np.ndarray
    k: int

    @property
    def name(self) -> str:
        """The group as messages name it: ``'all cells'`` or the label's repr."""
        return "all cells" if self.group is None else repr(self.group)


def scaled_to_range(x: Any) -> Any:
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


def n_distinct(x: Any) -> int:
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


def default_n(n_cells: int) -> int:
    """SEACells' recommended size: one metacell per :data:`CELLS_PER_METACELL` cells."""
    return round(n_cells / CELLS_PER_METACELL)


def plan_groups(
    x: Any,
    n_metacells: Any,
    units: list[tuple[Any, np.ndarray]] | None,
    *,
    n_neighbors: int,
    groupby: str | None = None,
) -> list[GroupPlan]:
    """One :class:`GroupPlan` per group after checking every size; raises before any fit.

    Parameters
    ----------
    x
        The (cells x components) embedding.
    n_metacells
        An int (every group), None (:func:`default_n` per group), or with ``units`` a mapping or Series
        ``{group: n}`` (see :func:`sizes_by_group`).
    units
        The groups as :func:`gpuc._units.split_groups` gives them, or None for one fit on every cell.
    n_neighbors
        A group needs at least this many cells.
    groupby
        The group column's name, for messages.

    Returns
    -------
    The fits in the order of ``units``. Warns (:class:`~gpuc.GpucWarning`) when a fit has fewer than
    :data:`MIN_CELLS_PER_METACELL` cells per metacell.
    """
    if isinstance(n_metacells, pd.Series):  # {group: n} given as a Series: its labels are the groups
        n_metacells = n_metacells.to_dict()
    if units is None:
        if isinstance(n_metacells, Mapping):
            msg = "n_metacells may be a mapping {group: n} only together with groupby=."
            raise TypeError(msg)
        units = [(None, np.arange(x.shape[0]))]
        sizes = None
    else:
        sizes = (
            sizes_by_group(n_metacells, [g for g, _ in units], groupby) if isinstance(n_metacells, Mapping) else None
        )
    plan, too_small = [], []
    for g, idx in units:
        n_g = n_metacells if sizes is None else sizes.get(str(g))
        n_g = check_int(
            f"n_metacells{'' if g is None else f' in group {g!r}'}", default_n(idx.size) if n_g is None else n_g
        )
        distinct = n_distinct(x[idx])
        if n_g < 2 or n_g > distinct or idx.size < n_neighbors:
            where = "all cells" if g is None else repr(g)
            too_small.append(f"{where}: {idx.size} cells ({distinct} distinct), n_metacells={n_g}")
            continue
        plan.append(GroupPlan(g, idx, n_g))
    if too_small:
        hint = (
            "n_metacells must be >= 2 and <= the number of distinct cells, and a group needs >= "
            f"n_neighbors={n_neighbors} cells (the default is round(n_cells / {CELLS_PER_METACELL}))."
        )
        if groupby is not None:
            hint += f" Pass n_metacells={{group: n}} or drop these groups from adata.obs[{groupby!r}]."
        msg = "Cannot build metacells for: " + "; ".join(too_small) + ". " + hint
        raise ValueError(msg)
    crowded = [
        f"{p.name}: {p.positions.size} cells, n_metacells={p.k}"
        for p in plan
        if p.positions.size < MIN_CELLS_PER_METACELL * p.k
    ]
    if crowded:
        msg = (
            f"fewer than {MIN_CELLS_PER_METACELL} cells per metacell ({'; '.join(crowded)}): metacells of a few cells "
            f"average little noise away and the fit's cost grows with cells x metacells, so it can take very long. "
            f"SEACells recommends about one metacell per {CELLS_PER_METACELL} cells (the default n_metacells)."
        )
        warnings.warn(msg, GpucWarning, stacklevel=3)
    return plan


def sizes_by_group(n_metacells: Mapping, groups: Any, groupby: str | None) -> dict[str, Any]:
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


def archetype_positions(arche: Any, obs_names: pd.Index, k: int) -> np.ndarray:
    """Positions of the initial archetypes: cell positions, obs names (a list, array, Index or the values of a
    Series), or a boolean mask over the cells (an array in obs order, or a Series matched to ``obs_names`` by label).
    """
    n_obs = len(obs_names)
    if isinstance(arche, pd.Series | Mapping) and (
        pd.api.types.is_bool_dtype(pd.Series(arche).dtype) if isinstance(arche, pd.Series) else True
    ):
        arche = align_labels(arche, obs_names, "initial_archetypes", "adata.obs_names").to_numpy(dtype=bool)
    arr = np.asarray(arche)
    if arr.dtype == bool:
        if arr.shape != (n_obs,):
            msg = f"initial_archetypes as a boolean mask must have one entry per cell ({n_obs}), got shape {arr.shape}."
            raise ValueError(msg)
        arr = np.flatnonzero(arr)
    elif arr.dtype.kind in "OUS":
        check_unique_names(
            obs_names,
            "adata.obs_names",
            "initial_archetypes given as names needs unique names: run adata.obs_names_make_unique() first, or pass "
            "cell positions.",
        )
        pos = obs_names.get_indexer(arr.astype(str))
        if (pos < 0).any():
            msg = f"initial_archetypes names not in adata.obs_names: {list(arr[pos < 0][:5])}."
            raise KeyError(msg)
        arr = pos
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        msg = "initial_archetypes must be a 1-D list of cell positions, obs names, or a boolean mask over the cells."
        raise TypeError(msg)
    if arr.size != k or np.unique(arr).size != arr.size or arr.min() < 0 or arr.max() >= n_obs:
        msg = (
            f"initial_archetypes must be {k} distinct cells (n_metacells), got {arr.size} entries "
            f"({np.unique(arr).size} distinct)."
        )
        raise ValueError(msg)
    return arr.astype(np.int64)


def check_plan_memory(backend: Backend, plan: list[GroupPlan], *, n_neighbors: int, fw_iters: int) -> None:
    """Raise :class:`~gpuc.InsufficientMemoryError` when the largest fit's estimated peak
    (:func:`~gpuc.metacells._pipeline.metacells_peak_bytes`) exceeds the device's free memory. Groups are fitted one
    after the other in a process, so the largest fit bounds the peak.
    """
    needs = [
        metacells_peak_bytes(p.positions.size, p.k, n_neighbors=n_neighbors, fw_iters=fw_iters, gpu=backend.is_gpu)
        for p in plan
    ]
    big = max(range(len(plan)), key=lambda i: (needs[i], str(plan[i].group), plan[i].positions.size, plan[i].k))
    p, need = plan[big], needs[big]
    check_memory(
        backend,
        need,
        f"metacells on {p.positions.size} cells with n_metacells={p.k}"
        + ("" if p.group is None else f" (group {str(p.group)!r})"),
        "Use fewer metacells, or split the cells with groupby= (e.g. by sample).",
    )
