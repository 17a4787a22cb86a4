"""Issue 31, copies: ``copy=True`` (and the AnnData-returning tools) never share a mutable object (array, sparse
buffer, DataFrame, dict, list) with the original AnnData, in any slot, and leave the original as it was."""

from __future__ import annotations

from collections.abc import Iterator

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import gpuc


def _mutables(obj, path: str) -> Iterator[tuple[str, object]]:
    """Every mutable object reachable from an AnnData slot, with its path."""
    if isinstance(obj, np.ndarray):
        yield path, obj
    elif sp.issparse(obj):
        yield path, obj
        for part in ("data", "indices", "indptr"):
            if hasattr(obj, part):
                yield f"{path}.{part}", getattr(obj, part)
    elif isinstance(obj, pd.DataFrame):
        yield path, obj
        for c in obj.columns:
            col = obj[c]
            yield f"{path}[{c!r}]", col.cat.codes.to_numpy() if hasattr(col, "cat") else col.to_numpy()
    elif isinstance(obj, dict) or hasattr(obj, "keys"):
        yield path, obj
        for k in obj.keys():
            yield from _mutables(obj[k], f"{path}[{k!r}]")
    elif isinstance(obj, list):
        yield path, obj
        for i, v in enumerate(obj):
            yield from _mutables(v, f"{path}[{i}]")


def _all_mutables(a: ad.AnnData) -> list[tuple[str, object]]:
    out = list(_mutables(a.X, "X")) if a.X is not None else []
    for slot in ("obs", "var", "layers", "obsm", "varm", "obsp", "uns"):
        out += list(_mutables(getattr(a, slot), slot))
    return out


def assert_nothing_shared(new: ad.AnnData, old: ad.AnnData) -> None:
    old_objs = _all_mutables(old)
    ids = {id(o): p for p, o in old_objs}
    arrays = [(p, o) for p, o in old_objs if isinstance(o, np.ndarray) and o.size]
    for path, obj in _all_mutables(new):
        assert id(obj) not in ids, f"{path} is the original's {ids[id(obj)]}"
        if isinstance(obj, np.ndarray) and obj.size and obj.dtype != object:
            for p, o in arrays:
                assert not np.shares_memory(obj, o), f"{path} shares memory with the original's {p}"


def _bulk() -> ad.AnnData:
    rng = np.random.default_rng(0)
    counts = rng.negative_binomial(5, 0.1, (8, 30)).astype(np.int64)
    a = ad.AnnData(
        counts, obs=pd.DataFrame({"c": pd.Categorical(np.repeat(["A", "B"], 4))}, index=[f"s{i}" for i in range(8)])
    )
    a.layers["counts"] = counts.copy()
    return a


def _cells() -> ad.AnnData:
    rng = np.random.default_rng(0)
    a = ad.AnnData(sp.csr_matrix(rng.poisson(2, (90, 6)).astype(np.float32)))
    a.obsm["X_pca"] = rng.normal(0, 1, (90, 4))
    a.obs["ct"] = pd.Categorical(np.tile(["T", "B", "NK"], 30))
    return a


_MC = {"n_metacells": 3, "n_neighbors": 8, "n_waypoint_eigs": 4, "max_iter": 3, "min_iter": 1, "device": "cpu"}
_NMF = {"n_runs": 3, "mask_var": None, "device": "cpu", "max_iter": 40}

CALLS = {
    "deseq": (_bulk, lambda a, **kw: gpuc.tl.deseq(a, "~c", **kw)),
    "deseq twice": (_bulk, lambda a, **kw: gpuc.tl.deseq(a, "~c", **kw)),
    "vst": (_bulk, lambda a, **kw: gpuc.tl.vst(a, fit_type="mean", **kw)),
    "metacells": (_cells, lambda a, **kw: gpuc.tl.metacells(a, **_MC, **kw)),
    "metacell_quality": (_cells, lambda a, **kw: gpuc.tl.metacell_quality(a, device="cpu", **kw)),
    "metacell_assignment_quality": (_cells, lambda a, **kw: gpuc.tl.metacell_assignment_quality(a, **kw)),
    "consensus_nmf": ("programs", lambda a, **kw: gpuc.tl.consensus_nmf(a, 3, **_NMF, **kw)),
    "nmf_refine": ("programs", lambda a, **kw: gpuc.tl.nmf_refine(a, 2.0, **kw)),
    "nmf_refine elsewhere": ("programs", lambda a, **kw: gpuc.tl.nmf_refine(a, 2.0, key_added="other", **kw)),
    "nmf_k_sweep": ("programs", lambda a, **kw: gpuc.tl.nmf_k_sweep(a, [2, 3], **_NMF, **kw)),
}


def _prepared(name: str, planted_programs) -> ad.AnnData:
    make, _ = CALLS[name]
    a = planted_programs(40, 20) if make == "programs" else make()
    # each tool runs on an AnnData that already holds earlier results, as in a session
    if name in ("metacell_quality", "metacell_assignment_quality"):
        gpuc.tl.metacells(a, **_MC)
    if name.startswith("nmf_refine") or name == "consensus_nmf":
        gpuc.tl.consensus_nmf(a, 3, **_NMF)
    if name == "deseq twice":
        gpuc.tl.deseq(a, "~c", size_factors=np.linspace(0.5, 2, 8))
    return a


@pytest.mark.parametrize("name", list(CALLS))
def test_copy_true_shares_nothing_and_leaves_the_original(name, planted_programs, unchanged):
    a = _prepared(name, planted_programs)
    with unchanged(a):
        out = CALLS[name][1](a, copy=True)
    assert isinstance(out, ad.AnnData)
    assert_nothing_shared(out, a)


def test_new_anndata_tools_share_nothing_with_their_input(planted_programs):
    cells = _cells()
    cells.obs["sample"] = np.repeat(["a", "b", "c"], 30)
    pb = gpuc.tl.pseudobulk(cells, "sample", min_cells=1)
    assert_nothing_shared(pb, cells)
    gpuc.tl.metacells(cells, **_MC)
    for soft in (False, True, "sum"):
        assert_nothing_shared(gpuc.tl.aggregate_metacells(cells, soft=soft, celltype_key="ct"), cells)
