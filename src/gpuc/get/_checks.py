"""What a getter or a plot reads: checks that ``uns[key]`` holds the output of the tool it expects.

Every :mod:`gpuc.get` and :mod:`gpuc.pl` function reads what one :mod:`gpuc.tl` tool wrote under one key. Pointed at
another tool's key (``gpuc.pl.metacells(adata, key="leiden")``) or at a missing one, they raise here, before any
figure is made, with a message that says which tool's output the key holds and which key to pass instead.

No tool writes a marker of its own into ``uns[key]['params']``, so a tool's output is recognised by the entries it
writes (:data:`_SIGNATURES`: the ``params`` fields only that tool records, and its result entries). Scanpy's common
``uns`` entries are recognised too, so that the message can name them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pandas as pd
from anndata import AnnData

from gpuc import _keys
from gpuc._inputs import joined_after_fit
from gpuc._validate import check_adata


def _params(u: Any) -> Mapping:
    p = u.get("params") if isinstance(u, Mapping) else None
    return p if isinstance(p, Mapping) else {}


def _has(u: Any, *names: str) -> bool:
    return isinstance(u, Mapping) and all(n in u for n in names)


def _params_have(u: Any, *names: str) -> bool:
    p = _params(u)
    return all(n in p for n in names)


def _frame_with(u: Any, *columns: str) -> bool:
    return isinstance(u, pd.DataFrame) and all(c in u.columns for c in columns)


# (name, how to make it, test on uns[key]); the first that matches names the entry, so the more specific come first
_SIGNATURES: list[tuple[str, str, Callable[[Any], bool]]] = [
    (
        "metacells",
        "gpuc.tl.metacells(adata, n_metacells, key_added={key!r})",
        lambda u: (
            _params_have(u, "n_waypoint_eigs") or (_has(u, "metacells") and (_has(u, "rss") or _has(u, "groups")))
        ),
    ),
    (
        "nmf_k_sweep",
        "gpuc.tl.nmf_k_sweep(adata, k_range, key_added={key!r})",
        lambda u: _params_have(u, "k_range") or (_has(u, "table") and _frame_with(u["table"], "k", "stability")),
    ),
    (
        "consensus_nmf",
        "gpuc.tl.consensus_nmf(adata, k, key_added={key!r})",
        lambda u: _params_have(u, "k", "normalization") or _has(u, "components", "cluster_sizes"),
    ),
    (
        "deseq",
        "gpuc.tl.deseq(adata, design, key_added={key!r})",
        lambda u: _params_have(u, "design", "contrast") or _has(u, "results", "contrasts"),
    ),
    ("vst", "gpuc.tl.vst(adata, key_added={key!r})", lambda u: _params_have(u, "blind", "fit_type")),
    (
        "pseudobulk",
        "gpuc.tl.pseudobulk(adata, sample_key, ...)",
        lambda u: _params_have(u, "sample_key", "min_cells"),
    ),
    (
        "aggregate_metacells",
        "gpuc.tl.aggregate_metacells(adata, key=...)",
        lambda u: _has(u, "key", "soft", "layer") and not _has(u, "params"),
    ),
    (
        "metacell_quality",
        "gpuc.tl.metacell_quality(adata, key)",
        lambda u: _frame_with(u, "compactness", "separation"),
    ),
    (
        "metacell_assignment_quality",
        "gpuc.tl.metacell_assignment_quality(adata, key)",
        lambda u: _params_have(u, "threshold") and _has(u, "unassigned"),
    ),
]

# Scanpy's own uns entries, recognised only to name them in a message
_SCANPY: list[tuple[str, Callable[[Any], bool]]] = [
    ("scanpy.pp.neighbors", lambda u: _has(u, "connectivities_key")),
    ("scanpy.tl.leiden (clusters)", lambda u: _params_have(u, "resolution", "n_iterations")),
    ("scanpy.tl.louvain (clusters)", lambda u: _params_have(u, "resolution")),
    ("scanpy.tl.rank_genes_groups", lambda u: _has(u, "names", "scores")),
    ("scanpy.pp.pca", lambda u: _has(u, "variance_ratio")),
    ("scanpy.tl.umap", lambda u: _params_have(u, "a", "b")),
    ("scanpy.tl.tsne", lambda u: _params_have(u, "perplexity")),
    ("scanpy.tl.dendrogram", lambda u: _has(u, "linkage")),
    ("scanpy.pp.highly_variable_genes", lambda u: _has(u, "flavor")),
    ("scanpy.pp.log1p", lambda u: _has(u, "base")),
]


def identify(entry: Any) -> str | None:
    """The tool whose output ``entry`` (an ``uns`` value) is: ``"gpuc.tl.<name>"``, a Scanpy function, or ``None``."""
    for name, _, test in _SIGNATURES:
        if test(entry):
            return f"gpuc.tl.{name}"
    for name, test in _SCANPY:
        if test(entry):
            return name
    return None


def _is(entry: Any, tool: str) -> bool:
    return next(test for name, _, test in _SIGNATURES if name == tool)(entry)


def keys_of(adata: AnnData, tool: str) -> list[str]:
    """The ``uns`` keys of ``adata`` that hold the output of ``gpuc.tl.<tool>``."""
    return [k for k, v in adata.uns.items() if _is(v, tool)]


def _instead(adata: AnnData, tool: str, key: str) -> str:
    """What to do instead: the keys that hold ``tool``'s output, or the call that makes it."""
    call = next(c for name, c, _ in _SIGNATURES if name == tool).format(key=key)
    found = keys_of(adata, tool)
    if found:
        return f"gpuc.tl.{tool} output in this AnnData: {', '.join(f'key={k!r}' for k in found)}; pass that key."
    return f"Run {call} first."


def _found(entry: Any) -> str:
    what = identify(entry)
    if what is not None:
        return f"the output of {what}"
    if isinstance(entry, Mapping):
        return f"an entry with fields {sorted(map(str, entry))[:8]} that no gpuc tool wrote"
    return f"a {type(entry).__name__} that no gpuc tool wrote"


def tool_output(adata: AnnData, key: str, tool: str) -> Any:
    """Return ``adata.uns[key]`` after checking that it holds what ``gpuc.tl.<tool>`` writes.

    Parameters
    ----------
    adata
        The AnnData a getter or plot reads.
    key
        The ``key_added`` of the tool's call, as passed to the getter or plot.
    tool
        The tool's name in :mod:`gpuc.tl` (``"metacells"``, ``"consensus_nmf"``, ``"nmf_k_sweep"``, ``"deseq"``,
        ``"metacell_quality"`` ...).

    Returns
    -------
    The entry ``adata.uns[key]``.

    Raises
    ------
    KeyError
        If ``adata.uns`` has no ``key``; the message names the keys that hold ``tool``'s output, or the call to make.
    ValueError
        If ``adata.uns[key]`` holds another tool's output (named in the message) or something no gpuc tool wrote.
    """
    check_adata(adata)
    if not isinstance(key, str):
        msg = f"key must be a string (the key_added of a gpuc.tl.{tool} call), got {key!r}."
        raise TypeError(msg)
    if key not in adata.uns:
        orphans = _orphaned_outputs(adata, key, tool)
        if orphans:
            msg = (
                f"{', '.join(orphans)} {'is' if len(orphans) == 1 else 'are'} in this AnnData but adata.uns[{key!r}], "
                f"the gpuc.tl.{tool} result {'it belongs' if len(orphans) == 1 else 'they belong'} to, is not: "
                "anndata.concat drops uns entries (or keeps only what all objects share), so the entries of objects "
                f"joined after their fits cannot be read as one fit. Refit on the joined object: {_call(tool, key)}."
            )
            raise KeyError(msg)
        msg = f"{key!r} not found in adata.uns. {_instead(adata, tool, key)}"
        raise KeyError(msg)
    entry = adata.uns[key]
    if not _is(entry, tool):
        msg = f"adata.uns[{key!r}] holds {_found(entry)}, not that of gpuc.tl.{tool}. {_instead(adata, tool, key)}"
        raise ValueError(msg)
    check_fields(entry, tool, key)
    why = joined_after_fit(adata, entry)
    if why is not None:
        msg = (
            f"adata.uns[{key!r}] (gpuc.tl.{tool}) cannot be read as one fit of this AnnData: {why}. Refit on this "
            f"AnnData: {_call(tool, key)}."
        )
        raise ValueError(msg)
    return entry


def _call(tool: str, key: str) -> str:
    return next(c for name, c, _ in _SIGNATURES if name == tool).format(key=key)


def _orphaned_outputs(adata: AnnData, key: str, tool: str) -> list[str]:
    """The per-cell or per-gene outputs of ``tool`` under ``key`` present without their ``uns`` entry."""
    outputs = {
        "metacells": _keys.metacell_outputs,
        "consensus_nmf": _keys.nmf_outputs,
        "deseq": _keys.deseq_outputs,
    }.get(tool)
    if outputs is None:
        return []
    found = []
    for slot, names in outputs(key).items():
        if slot == "uns":
            continue
        container = getattr(adata, slot)
        for name in names:
            if name in (container.columns if slot in ("obs", "var") else container):
                found.append(f"adata.{slot}[{name!r}]")
    return found


# ---- the fields each reader relies on, and their types ----------------------------------------------------------------
# A getter or plot checks these before reading, so an entry edited by hand (or half-merged by anndata.concat) gives a
# message naming the field instead of an internal TypeError or IndexError deep in the reader.
_MAPPING = (Mapping,)
_TABLE = (pd.DataFrame,)
_ARRAY = (np.ndarray, list, tuple)
# {tool: {field: (types, required)}}: a required field must be there; any of them, when there, must have its type
_FIELDS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "metacells": {"params": (_MAPPING, False), "metacells": (_TABLE, True)},
    "consensus_nmf": {"params": (_MAPPING, False), "components": (_TABLE, False), "genes": (_ARRAY, False)},
    "nmf_k_sweep": {"params": (_MAPPING, False), "table": (_TABLE, True)},
    "deseq": {"params": (_MAPPING, False)},
}
_DESEQ_ANALYSIS: dict[str, tuple[tuple[type, ...], bool]] = {
    "results": (_MAPPING, True),
    "contrasts": (_MAPPING, False),
}


def _field_problem(entry: Mapping, fields: dict[str, tuple[tuple[type, ...], bool]]) -> str | None:
    for name, (types, required) in fields.items():
        if name not in entry:
            if required:
                return f"the field {name!r} is missing"
            continue
        value = entry[name]
        if pd.DataFrame in types and hasattr(value, "to_memory"):
            continue  # a table read lazily (anndata.experimental.read_lazy's Dataset2D): the readers load it
        if not isinstance(value, types):
            want = " or ".join("mapping" if t is Mapping else t.__name__ for t in types)
            return f"the field {name!r} is a {type(value).__name__}, not a {want}"
    return None


def _is_kind(value: Any, kind: str) -> bool:
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if kind == "any":
        return True
    if kind == "int":
        return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)
    if kind == "number":
        return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool | np.bool_)
    if kind == "str":
        return isinstance(value, str)
    if kind == "str or None":
        return value is None or isinstance(value, str)
    raise ValueError(kind)  # pragma: no cover


def check_params(entry: Mapping, kinds: dict[str, str], tool: str, key: str) -> None:
    """Raise a :class:`ValueError` naming the first recorded argument of ``entry['params']`` that a tool replaying
    the call needs (``kinds``: ``{name: "int" | "number" | "str" | "str or None" | "any"}``) and that is missing or
    of another kind (a hand-edited file), saying how to refit.
    """
    params = entry.get("params")
    problem = None
    if not isinstance(params, Mapping):
        problem = "'params' is missing" if params is None else f"'params' is a {type(params).__name__}"
    else:
        for name, kind in kinds.items():
            if name not in params:
                problem = f"params[{name!r}] is missing"
            elif not _is_kind(params[name], kind):
                problem = f"params[{name!r}] = {params[name]!r} is not a {kind}"
            if problem:
                break
    if problem is not None:
        msg = (
            f"adata.uns[{key!r}] is not a complete gpuc.tl.{tool} result: {problem} (the entry was edited). "
            f"Refit: {_call(tool, key)}."
        )
        raise ValueError(msg)


def check_fields(entry: Any, tool: str, key: str) -> None:
    """Raise a :class:`ValueError` naming the first field of ``adata.uns[key]`` that ``gpuc.tl.<tool>`` writes and
    the readers need, when it is missing or of another type (an entry edited by hand, or joined by
    ``anndata.concat``), saying how to refit. Tables of results inside (DESeq2's ``results``) are checked too.
    """
    problem = _field_problem(entry, _FIELDS.get(tool, {}))
    if problem is None and tool == "deseq":
        groups = entry.get("groups")
        if groups is not None:
            if not isinstance(groups, Mapping):
                problem = f"the field 'groups' is a {type(groups).__name__}, not a mapping"
            else:
                for g, sub in groups.items():
                    where = _field_problem(sub, _DESEQ_ANALYSIS) if isinstance(sub, Mapping) else "it is not a mapping"
                    if where is not None:
                        problem = f"in groups[{g!r}], {where}"
                        break
        else:
            problem = _field_problem(entry, _DESEQ_ANALYSIS)
        tables = [entry.get("results", {})] if groups is None else [
            sub.get("results", {}) for sub in (groups.values() if isinstance(groups, Mapping) else [])
        ]  # fmt: skip
        for results in tables if problem is None else []:
            bad = [str(n) for n, t in results.items() if not isinstance(t, pd.DataFrame)]
            if bad:
                problem = f"the results {bad} are not tables"
                break
    if problem is not None:
        msg = (
            f"adata.uns[{key!r}] is not a complete gpuc.tl.{tool} result: {problem} (the entry was edited, or the "
            f"AnnData was joined by anndata.concat, which keeps only what all objects share). Refit: "
            f"{_call(tool, key)}."
        )
        raise ValueError(msg)


def metacell_labels(adata: AnnData, key: str) -> pd.Series:
    """``adata.obs[key]`` after checking that ``key`` names a :func:`gpuc.tl.metacells` run (labels and ``uns``)."""
    tool_output(adata, key, "metacells")
    if key not in adata.obs or not isinstance(adata.obs[key].dtype, pd.CategoricalDtype):
        msg = (
            f"adata.uns[{key!r}] holds gpuc.tl.metacells output but adata.obs[{key!r}] (its categorical labels) is "
            f"missing or was changed. Rerun gpuc.tl.metacells(adata, ..., key_added={key!r})."
        )
        raise KeyError(msg)
    return adata.obs[key]


def metacell_quality_table(adata: AnnData, key: str, quality_key: str | None) -> pd.DataFrame:
    """The table of :func:`gpuc.tl.metacell_quality` for the metacells ``key`` (``uns[quality_key]``)."""
    check_adata(adata)
    qk = quality_key or _keys.metacell_quality(key)
    if qk not in adata.uns:
        if key in adata.uns and not _is(adata.uns[key], "metacells"):
            tool_output(adata, key, "metacells")  # names what ``key`` holds instead
        msg = f"No quality table at adata.uns[{qk!r}]: run gpuc.tl.metacell_quality(adata, {key!r}) first."
        raise KeyError(msg)
    table = adata.uns[qk]
    if not _is(table, "metacell_quality"):
        msg = (
            f"adata.uns[{qk!r}] holds {_found(table)}, not the table of gpuc.tl.metacell_quality. "
            f"Run gpuc.tl.metacell_quality(adata, {key!r}) and pass quality_key= the key it wrote."
        )
        raise ValueError(msg)
    return table


def deseq_entry(adata: AnnData, key: str, group: str | None) -> Mapping:
    """The fit and results of one :func:`gpuc.tl.deseq` analysis (``uns[key]`` or ``uns[key]['groups'][group]``).

    Raises :class:`KeyError` / :class:`ValueError` as :func:`tool_output` does, :class:`ValueError` when ``group``
    is missing for a ``groupby`` run or given for a run without one, and :class:`KeyError` for an unknown group.
    """
    uns = tool_output(adata, key, "deseq")
    if "groups" in uns:
        names = [_keys.decode_name(g) for g in uns["groups"]]
        if group is None:
            msg = f"uns[{key!r}] holds per-group results (groups {names}); pass group=."
            raise ValueError(msg)
        stored = _keys.encode_name(group)
        if stored not in uns["groups"]:
            msg = f"group {group!r} not found in adata.uns[{key!r}]['groups'] (groups: {names})."
            raise KeyError(msg)
        return _genes_of(adata, uns["groups"][stored], key)
    if group is not None:
        msg = f"uns[{key!r}] was computed without groupby; do not pass group=."
        raise ValueError(msg)
    return _genes_of(adata, uns, key)


def _genes_of(adata: AnnData, entry: Mapping, key: str) -> Mapping:
    """``entry`` with its per-gene tables (``results``, ``genes``) aligned by name to ``adata.var_names``.

    A gene subset (``adata[:, genes]``) or reordering of a fitted AnnData gets the rows of its genes, in its order;
    genes the fit did not see are refused. The entry itself is not modified.
    """
    names = adata.var_names

    def aligned(table: pd.DataFrame, where: str) -> pd.DataFrame:
        if table.index.equals(names):
            return table
        if not table.index.is_unique:
            return table  # written by hand: left as it is
        missing = names[~names.isin(table.index)]
        if len(missing):
            msg = (
                f"{len(missing)} gene(s) of adata.var_names are not in {where} (e.g. {list(missing[:5])}): the "
                f"AnnData holds genes the DESeq2 fit under key={key!r} did not see (joined with other genes after "
                "the fit?). Refit gpuc.tl.deseq on this AnnData."
            )
            raise ValueError(msg)
        return table.loc[names]

    out = dict(entry)
    if "results" in out:
        out["results"] = {
            n: aligned(t, f"adata.uns[{key!r}] results {n!r}") for n, t in out["results"].items()
        }  # fmt: skip
    if isinstance(out.get("genes"), pd.DataFrame):
        out["genes"] = aligned(out["genes"], f"adata.uns[{key!r}] genes")
    return out
