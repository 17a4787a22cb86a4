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

import pandas as pd
from anndata import AnnData

from gpuc import _keys
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
        msg = f"{key!r} not found in adata.uns. {_instead(adata, tool, key)}"
        raise KeyError(msg)
    entry = adata.uns[key]
    if not _is(entry, tool):
        msg = f"adata.uns[{key!r}] holds {_found(entry)}, not that of gpuc.tl.{tool}. {_instead(adata, tool, key)}"
        raise ValueError(msg)
    return entry


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
        return uns["groups"][stored]
    if group is not None:
        msg = f"uns[{key!r}] was computed without groupby; do not pass group=."
        raise ValueError(msg)
    return uns
