"""Issue 31, stored params replay: for every tool, ``tool(adata, **uns[key]["params"])`` on the same input reproduces
the result, also with the params read back from h5ad (contrasts of every kind, integer group keys, given size
factors, design DataFrames)."""

from __future__ import annotations

import anndata as ad
import numpy as np
import pandas as pd
import pytest

import gpuc

_TIMES = ("seconds", "timings")


def _without_times(a: ad.AnnData) -> ad.AnnData:
    a = a.copy()
    for key, entry in a.uns.items():
        if isinstance(entry, dict):
            a.uns[key] = {k: v for k, v in entry.items() if k not in _TIMES}
            if isinstance(a.uns[key].get("groups"), dict):
                a.uns[key]["groups"] = {
                    g: {k: v for k, v in e.items() if k not in _TIMES} if isinstance(e, dict) else e
                    for g, e in a.uns[key]["groups"].items()
                }
    return a


def _bulk(seed: int = 0) -> ad.AnnData:
    rng = np.random.default_rng(seed)
    n_genes, n = 40, 12
    cond = np.tile(np.repeat([0, 1], 3), 2)
    mean = 2 ** rng.normal(6, 1.5, n_genes)
    mu = mean[None, :] * 2 ** np.outer(cond, np.where(np.arange(n_genes) < 10, 2.0, 0.0))
    counts = rng.negative_binomial(10, 10 / (10 + mu)).astype(np.int64)
    obs = pd.DataFrame(
        {"cond": pd.Categorical(cond), "batch": pd.Categorical(np.repeat(["x", "y"], 6)), "grp": np.tile([1, 2], 6)},
        index=[f"s{i}" for i in range(n)],
    )
    return ad.AnnData(counts, obs=obs, var=pd.DataFrame(index=[f"g{j}" for j in range(n_genes)]))


def _design(a: ad.AnnData) -> pd.DataFrame:
    return pd.DataFrame({"Intercept": 1.0, "c1": (a.obs["cond"] == 1).to_numpy(float)}, index=a.obs_names)


DESEQ_CALLS = {
    "factor": {"design": "~batch + cond", "contrast": ["cond", 1, 0]},
    "several": {"design": "~batch + cond", "contrast": [["cond", 1, 0], "batch[T.y]", np.array([0, 0, 1.0])]},
    "series": {"design": "~cond", "contrast": pd.Series({"cond[T.1]": 1.0, "Intercept": 0.0})},
    "given sf": {"design": "~cond", "size_factors": pd.Series(np.linspace(0.5, 2, 12), index=[f"s{i}" for i in range(12)])},
    "dataframe": {"design": _design, "contrast": "c1"},
    "lrt": {"design": "~batch + cond", "test": "lrt", "reduced": "~batch"},
    "groupby": {"design": "~cond", "groupby": "grp", "contrast": ["cond", 1, 0]},
}  # fmt: skip


def _replay(same, tool, a: ad.AnnData, key: str, fresh: ad.AnnData, *, through=None) -> None:
    """Replay ``tool`` on ``fresh`` with the params stored in ``a`` (optionally read back from h5ad) and compare."""
    params = a.uns[key]["params"]
    if through is not None:
        a.write_h5ad(through)
        params = ad.read_h5ad(through).uns[key]["params"]
    tool(fresh, **params)
    same(_without_times(fresh), _without_times(a))


@pytest.mark.parametrize("case", list(DESEQ_CALLS))
@pytest.mark.parametrize("h5ad", [False, True])
def test_deseq_replays(case, h5ad, tmp_path, same):
    a = _bulk()
    call = dict(DESEQ_CALLS[case])
    if callable(call["design"]):
        call["design"] = call["design"](a)
    gpuc.tl.deseq(a, **call, device="cpu")
    _replay(same, gpuc.tl.deseq, a, "deseq", _bulk(), through=tmp_path / "a.h5ad" if h5ad else None)


def test_vst_and_pseudobulk_replay(same):
    a = _bulk()
    gpuc.tl.vst(a, fit_type="mean", device="cpu")
    _replay(same, gpuc.tl.vst, a, "vst", _bulk())
    rng = np.random.default_rng(0)
    cells = ad.AnnData(rng.poisson(2, (60, 8)).astype(np.float32))
    cells.obs["sample"] = np.repeat(["a", "b", "c"], 20)
    cells.obs["ct"] = np.tile(["T", "B"], 30)
    pb = gpuc.tl.pseudobulk(cells, "sample", groupby="ct", min_cells=5)
    again = gpuc.tl.pseudobulk(cells, **pb.uns["pseudobulk"]["params"])
    same(again, pb)


@pytest.mark.parametrize("h5ad", [False, True])
def test_nmf_tools_replay(planted_programs, h5ad, tmp_path, same):
    through = tmp_path / "a.h5ad" if h5ad else None
    a = planted_programs(40, 24)
    a.var["hv"] = np.arange(a.n_vars) < 20
    gpuc.tl.consensus_nmf(a, 3, n_runs=3, mask_var=pd.Series(a.var["hv"].to_numpy()[::-1], index=a.var_names[::-1]),
                          density_threshold=np.float32(0.5), random_state=np.random.default_rng(3), device="cpu",
                          max_iter=50)  # fmt: skip
    fresh = planted_programs(40, 24)
    fresh.var["hv"] = a.var["hv"]
    _replay(same, gpuc.tl.consensus_nmf, a, "nmf", fresh, through=through)
    gpuc.tl.nmf_refine(a, 2.0)  # its params are those of consensus_nmf at the new threshold
    fresh = planted_programs(40, 24)
    fresh.var["hv"] = a.var["hv"]
    _replay(same, gpuc.tl.consensus_nmf, a, "nmf", fresh)
    b = planted_programs(40, 24)
    gpuc.tl.nmf_k_sweep(b, range(2, 4), n_runs=3, mask_var=None, device="cpu", max_iter=50)
    _replay(same, gpuc.tl.nmf_k_sweep, b, "nmf_k_sweep", planted_programs(40, 24), through=through)


def _cells(groups=(1, 2)) -> ad.AnnData:
    rng = np.random.default_rng(0)
    n = 40 * len(groups)
    a = ad.AnnData(rng.poisson(2, (n, 6)).astype(np.float32), obs=pd.DataFrame(index=[f"c{i}" for i in range(n)]))
    a.obsm["X_pca"] = rng.normal(0, 1, (n, 4))
    a.obs["grp"] = np.repeat(np.asarray(groups), 40)
    a.obs["ct"] = pd.Categorical(np.tile(["T", "B"], n // 2))
    return a


_MC = {"n_neighbors": 8, "n_waypoint_eigs": 4, "max_iter": 3, "min_iter": 1, "device": "cpu"}


@pytest.mark.parametrize("h5ad", [False, True])
@pytest.mark.parametrize(
    "call",
    [
        {"n_metacells": {1: 3, 2: 4}, "groupby": "grp", "random_state": None},
        {"n_metacells": 4, "initial_archetypes": [1, 20, 41, 70], "random_state": np.random.RandomState(5)},
    ],
)
def test_metacells_replays(call, h5ad, tmp_path, same):
    a = _cells()
    gpuc.tl.metacells(a, **call, **_MC)
    _replay(same, gpuc.tl.metacells, a, "metacell", _cells(), through=tmp_path / "a.h5ad" if h5ad else None)
    mc = gpuc.tl.aggregate_metacells(a, celltype_key="ct")
    same(gpuc.tl.aggregate_metacells(a, **mc.uns["metacell_source"]), mc)
