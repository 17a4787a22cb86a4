"""Before the fit: gpuc.tl.pseudobulk's quality-control fields against decoupler's pseudobulk and filters, and the
genes decoupler's filter_by_expr keeps on gpuc's output against edgeR's filterByExpr (R, edgeR 3.40.2; references and
the script that made them in tests/data/deseq/prefit/)."""

from __future__ import annotations

import importlib.util
import warnings

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import gpuc
from gpuc._errors import GpucWarning

dc = pytest.importorskip("decoupler")


def _cells(n: int = 600, g: int = 60, seed: int = 0, *, sparse: bool = True) -> ad.AnnData:
    rng = np.random.default_rng(seed)
    lam = rng.gamma(0.3, 4.0, size=g)
    x = rng.poisson(lam[None, :] * rng.gamma(2.0, 0.5, size=(n, 1))).astype(np.float32)
    a = ad.AnnData(sp.csr_matrix(x) if sparse else x, var=pd.DataFrame(index=[f"g{j}" for j in range(g)]))
    a.obs_names = [f"c{i}" for i in range(n)]
    donor = rng.integers(0, 8, n)
    a.obs["donor"] = pd.Categorical([f"d{i}" for i in donor])
    a.obs["condition"] = pd.Categorical(np.where(donor < 4, "ctrl", "stim"))
    a.obs["cell_type"] = pd.Categorical(rng.choice(["B", "T", "NK"], n, p=[0.45, 0.45, 0.1]))
    return a


def _decoupler_pb(cells: ad.AnnData, groupby: str | None) -> ad.AnnData:
    pb = dc.pp.pseudobulk(cells, sample_col="donor", groups_col=groupby)
    return pb[pb.obs["psbulk_cells"] > 0].copy()


@pytest.mark.parametrize("groupby", [None, "cell_type"])
@pytest.mark.parametrize("sparse", [True, False])
def test_pseudobulk_qc_fields_equal_decouplers(groupby, sparse):
    cells = _cells(sparse=sparse)
    got = gpuc.tl.pseudobulk(cells, "donor", groupby=groupby, min_cells=1)
    want = _decoupler_pb(cells, groupby)
    assert sorted(got.obs_names) == sorted(want.obs_names)
    want = want[got.obs_names]
    np.testing.assert_array_equal(got.X, want.X)
    np.testing.assert_array_equal(got.obs["psbulk_cells"], want.obs["psbulk_cells"])
    np.testing.assert_array_equal(got.obs["psbulk_cells"], got.obs["n_cells"])
    np.testing.assert_array_equal(got.obs["psbulk_counts"], want.obs["psbulk_counts"])
    np.testing.assert_allclose(got.layers["psbulk_props"], want.layers["psbulk_props"], rtol=1e-15, atol=0)
    assert got.layers["psbulk_props"].max() <= 1.0 and (got.layers["psbulk_props"] > 0).any()


def test_min_counts_drops_shallow_profiles_as_filter_samples():
    cells = _cells()
    everything = gpuc.tl.pseudobulk(cells, "donor", groupby="cell_type", min_cells=1)
    cut = float(np.median(everything.obs["psbulk_counts"]))
    with pytest.warns(GpucWarning, match="total count below min_counts"):
        got = gpuc.tl.pseudobulk(cells, "donor", groupby="cell_type", min_cells=5, min_counts=cut)
    want = _decoupler_pb(cells, "cell_type")
    dc.pp.filter_samples(want, min_cells=5, min_counts=cut)
    assert sorted(got.obs_names) == sorted(want.obs_names)
    assert got.uns["pseudobulk"]["params"]["min_counts"] == cut
    assert got.uns["pseudobulk"]["n_dropped"] == everything.n_obs - got.n_obs
    with pytest.warns(GpucWarning):  # replayable from its params
        again = gpuc.tl.pseudobulk(cells, **got.uns["pseudobulk"]["params"])
    np.testing.assert_array_equal(again.X, got.X)
    with pytest.raises(ValueError, match="min_counts"):
        gpuc.tl.pseudobulk(cells, "donor", min_counts=1e12)
    with pytest.raises((TypeError, ValueError), match="min_counts"):
        gpuc.tl.pseudobulk(cells, "donor", min_counts=-1)


def test_decoupler_filters_keep_the_same_on_gpuc_and_decoupler_pseudobulk():
    cells = gpuc.datasets.pbmc3k()
    cells = cells[cells.obs["cell_type"].isin(["B", "CD14+ Mono"])].copy()
    rng = np.random.default_rng(1)
    donor = rng.integers(0, 8, cells.n_obs)
    cells.obs["donor"] = pd.Categorical([f"d{i}" for i in donor])
    cells.obs["condition"] = pd.Categorical(np.where(donor < 4, "ctrl", "stim"))
    cells.obs["cell_type"] = cells.obs["cell_type"].cat.remove_unused_categories()
    cells.X = cells.layers["counts"]
    del cells.layers["counts"]
    ours = gpuc.tl.pseudobulk(cells, "donor", groupby="cell_type", min_cells=1)
    theirs = _decoupler_pb(cells, "cell_type")[ours.obs_names]
    for pb in (ours, theirs):
        dc.pp.filter_samples(pb, min_cells=10, min_counts=1000)
    assert list(ours.obs_names) == list(theirs.obs_names)
    for ct in ("B", "CD14+ Mono"):
        a = ours[ours.obs["cell_type"] == ct].copy()
        b = theirs[theirs.obs["cell_type"] == ct].copy()
        kept_prop = dc.pp.filter_by_prop(a, min_prop=0.1, min_smpls=2, inplace=False)
        assert list(kept_prop) == list(dc.pp.filter_by_prop(b, min_prop=0.1, min_smpls=2, inplace=False))
        kept = dc.pp.filter_by_expr(a, group="condition", inplace=False)
        assert list(kept) == list(dc.pp.filter_by_expr(b, group="condition", inplace=False))
        assert 0 < len(kept) < a.n_vars and 0 < len(kept_prop) < a.n_vars


def test_decoupler_plots_run_on_gpuc_pseudobulk():
    import matplotlib.pyplot as plt

    cells = _cells()
    pb = gpuc.tl.pseudobulk(cells, "donor", groupby="cell_type", min_cells=1)
    for fig in (
        dc.pl.filter_samples(pb, groupby=["cell_type", "condition"], return_fig=True),
        dc.pl.filter_by_expr(pb[pb.obs["cell_type"] == "B"].copy(), group="condition", return_fig=True),
        dc.pl.filter_by_prop(pb[pb.obs["cell_type"] == "B"].copy(), return_fig=True),
    ):
        assert fig is not None and any(ax.has_data() for ax in fig.axes)
        plt.close(fig)


def test_pseudobulk_qc_fields_lazy_and_device_equal_in_memory(on_device):
    da = pytest.importorskip("dask.array", reason="the lazy case needs the dask extra: pip install '.[dask]'")

    cells = _cells(n=500, g=40)
    want = gpuc.tl.pseudobulk(cells, "donor", groupby="cell_type", min_cells=3)
    for x in (da.from_array(cells.X, chunks=(128, 16)), da.from_array(cells.X.toarray(), chunks=(100, 25))):
        lazy = cells.copy()
        lazy.X = x
        got = gpuc.tl.pseudobulk(lazy, "donor", groupby="cell_type", min_cells=3)
        np.testing.assert_array_equal(got.X, want.X)
        np.testing.assert_array_equal(got.layers["psbulk_props"], want.layers["psbulk_props"])
        pd.testing.assert_frame_equal(got.obs, want.obs)
    got = gpuc.tl.pseudobulk(on_device(cells), "donor", groupby="cell_type", min_cells=3)
    assert isinstance(got.layers["psbulk_props"], np.ndarray)
    np.testing.assert_array_equal(got.layers["psbulk_props"], want.layers["psbulk_props"])
    pd.testing.assert_frame_equal(got.obs, want.obs)


def test_pseudobulk_qc_fields_survive_h5ad(tmp_path, same):
    pb = gpuc.tl.pseudobulk(_cells(), "donor", groupby="cell_type", min_cells=1, min_counts=10)
    pb.write_h5ad(tmp_path / "pb.h5ad")
    back = ad.read_h5ad(tmp_path / "pb.h5ad")
    same(back, pb)


# ---- edgeR filterByExpr ---------------------------------------------------------------------------------------------
def _pbmc_cd14(test_data):
    path = test_data / "deseq" / "prefit" / "make_pbmc_pseudobulk.py"
    spec = importlib.util.spec_from_file_location("make_pbmc_pseudobulk", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.pbmc_cd14_pseudobulk()


@pytest.mark.parametrize("name", ["pasilla", "pbmc_cd14"])
def test_filter_by_expr_on_gpuc_output_equals_edger(name, test_data):
    """decoupler's filter_by_expr on gpuc's pseudobulk keeps exactly the genes edgeR's filterByExpr(group=) keeps.

    pbmc_cd14 (12 vs 12 pseudo-donors) takes filterByExpr's large-n branch (MinSampleSize 10 + 2 x 0.7), pasilla
    (3 vs 4 samples) the small one."""
    ref = pd.read_csv(test_data / "deseq" / "prefit" / f"filterByExpr_{name}_R.csv.gz", index_col=0)["keep"]
    if name == "pasilla":
        pb, group = gpuc.datasets.pasilla(), "condition"
    else:
        _, pb = _pbmc_cd14(test_data)
        group = "group"
        stored = pd.read_csv(test_data / "deseq" / "prefit" / "pbmc_cd14_counts.csv.gz", index_col=0)
        # the counts R read are gpuc's pseudobulk of these cells (genes with a count), unchanged
        np.testing.assert_array_equal(pb[:, stored.index].X.T, stored[list(pb.obs_names)].to_numpy())
        pb = pb[:, stored.index].copy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kept = dc.pp.filter_by_expr(pb, group=group, inplace=False)
    assert ref.sum() > 100
    assert set(kept) == set(ref.index[ref.to_numpy()])
