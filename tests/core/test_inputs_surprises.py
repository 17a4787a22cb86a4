"""Issue 31, quietly surprising behaviour, each decided: an error, a warning that says what happened, or a documented
choice with a test. Raw counts and other tools' outputs are never overwritten unless the user names them as their
own; Ctrl-C raises KeyboardInterrupt and leaves the AnnData as it was."""

from __future__ import annotations

import warnings

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import gpuc
from gpuc._errors import GpucWarning


def _bulk(n: int = 8) -> ad.AnnData:
    rng = np.random.default_rng(0)
    counts = rng.negative_binomial(5, 0.05, (n, 30)).astype(np.int64)
    obs = pd.DataFrame({"c": pd.Categorical(np.repeat(["A", "B"], n // 2))}, index=[f"s{i}" for i in range(n)])
    a = ad.AnnData(counts, obs=obs)
    a.layers["counts"] = counts.copy()
    return a


def _cells(n: int = 90) -> ad.AnnData:
    rng = np.random.default_rng(0)
    a = ad.AnnData(sp.csr_matrix(rng.poisson(2, (n, 6)).astype(np.float32)))
    a.layers["counts"] = a.X.copy()
    a.obsm["X_pca"] = rng.normal(0, 1, (n, 4))
    return a


_MC = {"n_metacells": 3, "n_neighbors": 8, "n_waypoint_eigs": 4, "max_iter": 3, "min_iter": 1, "device": "cpu"}
_NMF = {"n_runs": 3, "mask_var": None, "device": "cpu", "max_iter": 40}


# ---- never overwrite what the tool did not write --------------------------------------------------------------------
def test_vst_never_replaces_the_counts_it_reads(unchanged):
    a = _bulk()
    with unchanged(a), pytest.raises(ValueError, match="would replace the counts it transforms"):
        gpuc.tl.vst(a, layer="counts", key_added="counts", device="cpu")
    a.layers["mine"] = a.X.astype(float)  # the user's layer, not a vst output
    with unchanged(a), pytest.raises(ValueError, match=r"would overwrite adata.layers\['mine'\]"):
        gpuc.tl.vst(a, layer="counts", key_added="mine", fit_type="mean", device="cpu")
    gpuc.tl.vst(a, layer="counts", key_added="v", fit_type="mean", device="cpu")
    gpuc.tl.vst(a, layer="counts", key_added="v", fit_type="mean", device="cpu")  # its own output: replaced


def test_consensus_nmf_never_replaces_x_pca(planted_programs, unchanged):
    a = planted_programs(40, 20)
    a.obsm["X_pca"] = np.ones((a.n_obs, 2))
    with unchanged(a), pytest.raises(ValueError, match=r"would overwrite adata.obsm\['X_pca'\]"):
        gpuc.tl.consensus_nmf(a, 3, key_added="pca", **_NMF)
    gpuc.tl.consensus_nmf(a, 3, key_added="prog", **_NMF)
    gpuc.tl.consensus_nmf(a, 3, key_added="prog", **_NMF)  # a rerun replaces its own output
    with unchanged(a), pytest.raises(ValueError, match="did not write"):
        gpuc.tl.nmf_refine(a, 2.0, key="prog", key_added="pca")


def test_metacells_never_replaces_another_tools_column(unchanged):
    a = _cells()
    a.obs["leiden"] = pd.Categorical(np.tile(["0", "1", "2"], 30))
    with unchanged(a), pytest.raises(ValueError, match=r"would overwrite adata.obs\['leiden'\]"):
        gpuc.tl.metacells(a, key_added="leiden", **_MC)
    a.uns["nmf_k_sweep"] = {"note": "mine"}
    with unchanged(a), pytest.raises(ValueError, match=r"adata.uns\['nmf_k_sweep'\]"):
        gpuc.tl.nmf_k_sweep(a, [2], n_runs=3, mask_var=None, device="cpu")


def test_deseq_and_quality_never_replace_foreign_entries(unchanged):
    a = _bulk()
    a.obs["deseq_size_factors"] = 1.0  # e.g. computed by hand
    with unchanged(a), pytest.raises(ValueError, match="deseq_size_factors"):
        gpuc.tl.deseq(a, "~c", device="cpu")
    c = _cells()
    gpuc.tl.metacells(c, **_MC)
    c.uns["metacell_quality"] = {"mine": 1}
    with unchanged(c), pytest.raises(ValueError, match="not a metacell quality table"):
        gpuc.tl.metacell_quality(c, device="cpu")


# ---- warnings that say what happened --------------------------------------------------------------------------------
def test_aggregate_metacells_warns_when_summing_non_counts():
    a = _cells()
    gpuc.tl.metacells(a, **_MC)
    a.X = a.X.copy()
    a.X.data = np.log1p(a.X.data)
    with pytest.warns(GpucWarning, match="non-integer values"):
        gpuc.tl.aggregate_metacells(a)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GpucWarning)
        gpuc.tl.aggregate_metacells(a, layer="counts")  # raw counts named: no warning


def test_pseudobulk_says_which_profiles_it_drops():
    a = _cells()
    a.obs["sample"] = ["a"] * 50 + ["b"] * 37 + ["c"] * 3
    with pytest.warns(GpucWarning, match=r"1 of 3 .* fewer than min_cells=10 .*'c'"):
        pb = gpuc.tl.pseudobulk(a, "sample", layer="counts")
    assert list(pb.obs_names) == ["a", "b"] and pb.uns["pseudobulk"]["n_dropped"] == 1


def test_deseq_on_single_cells_points_to_pseudobulk():
    rng = np.random.default_rng(0)
    counts = rng.negative_binomial(1, 0.3, (240, 40)).astype(np.int64)
    counts[:, 0] += 1  # every cell has a count
    a = ad.AnnData(counts)
    a.obs["c"] = pd.Categorical(np.repeat(["A", "B"], 120))
    with pytest.warns(GpucWarning, match=r"look like single cells.*gpuc.tl.pseudobulk"):
        gpuc.tl.deseq(a, "~c", device="cpu")
    with warnings.catch_warnings():  # bulk samples: no hint
        warnings.simplefilter("error", GpucWarning)
        gpuc.tl.deseq(_bulk(), "~c", device="cpu")


# ---- errors instead of surprises ------------------------------------------------------------------------------------
def test_nmf_k_sweep_with_a_bare_int_shows_the_range(planted_programs, unchanged):
    a = planted_programs(40, 20)
    with unchanged(a), pytest.raises(TypeError, match=r"k_range=range\(2, 10 \+ 1\).*k_range=\[10\]"):
        gpuc.tl.nmf_k_sweep(a, 10, **_NMF)
    with unchanged(a), pytest.raises(TypeError, match="iterable of integers"):
        gpuc.tl.nmf_k_sweep(a, "2-5", **_NMF)
    gpuc.tl.nmf_k_sweep(a, np.array([2, 3]), **_NMF)


def test_metacell_quality_inplace_and_copy_combinations(unchanged):
    a = _cells()
    gpuc.tl.metacells(a, **_MC)
    with unchanged(a):
        table = gpuc.tl.metacell_quality(a, inplace=False, device="cpu")
        out = gpuc.tl.metacell_quality(a, copy=True, device="cpu")
        with pytest.raises(ValueError, match="cannot be combined with inplace=False"):
            gpuc.tl.metacell_quality(a, inplace=False, copy=True, device="cpu")
    pd.testing.assert_frame_equal(out.uns["metacell_quality"], table)
    assert gpuc.tl.metacell_quality(a, device="cpu") is None
    pd.testing.assert_frame_equal(a.uns["metacell_quality"], table)


# ---- Ctrl-C ---------------------------------------------------------------------------------------------------------
def _interrupt_as_a_kernel_does(*args, **kwargs):
    """What CPython reports when SIGINT lands in a compiled function: a SystemError caused by KeyboardInterrupt."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as err:
        raise SystemError("<built-in function> returned a result with an exception set") from err


@pytest.mark.parametrize(
    ("target", "make", "call"),
    [
        ("gpuc.tl._deseq.map_units", _bulk, lambda a: gpuc.tl.deseq(a, "~c", device="cpu")),
        ("gpuc.metacells._groups.map_units", _cells, lambda a: gpuc.tl.metacells(a, **_MC)),
        ("gpuc.tl._nmf.run_k", None, lambda a: gpuc.tl.consensus_nmf(a, 3, **_NMF)),
        ("gpuc.tl._nmf.run_ks", None, lambda a: gpuc.tl.nmf_k_sweep(a, [2, 3], **_NMF)),
        ("gpuc.tl._nmf.consensus_of_pool", "nmf", lambda a: gpuc.tl.nmf_refine(a, 2.0)),
        ("gpuc.metacells._quality.diffusion_space", "mc", lambda a: gpuc.tl.metacell_quality(a, device="cpu")),
        ("gpuc.deseq._vst.variance_stabilize", _bulk, lambda a: gpuc.tl.vst(a, device="cpu")),
    ],
)
def test_ctrl_c_in_a_kernel_raises_keyboardinterrupt_and_changes_nothing(
    target, make, call, planted_programs, monkeypatch, unchanged
):
    a = make() if callable(make) else planted_programs(40, 20)
    if make == "nmf":
        gpuc.tl.consensus_nmf(a, 3, **_NMF)
    if make == "mc":
        a = _cells()
        gpuc.tl.metacells(a, **_MC)
    monkeypatch.setattr(target, _interrupt_as_a_kernel_does)
    with unchanged(a), pytest.raises(KeyboardInterrupt, match="the AnnData is unchanged"):
        call(a)


def test_other_system_errors_are_not_turned_into_interrupts(monkeypatch):
    def broken(*args, **kwargs):
        raise SystemError("a real bug")

    monkeypatch.setattr("gpuc.tl._deseq.map_units", broken)
    with pytest.raises(SystemError, match="a real bug"):
        gpuc.tl.deseq(_bulk(), "~c", device="cpu")


def test_another_gpuc_result_under_the_named_key_is_replaced_with_a_warning(planted_programs):
    a = planted_programs(40, 20)
    gpuc.tl.nmf_k_sweep(a, [2, 3], key_added="run1", **_NMF)
    with pytest.warns(GpucWarning, match=r"replaces the gpuc.tl.nmf_k_sweep result .*adata.uns\['run1'\]"):
        gpuc.tl.consensus_nmf(a, 3, key_added="run1", **_NMF)
    assert "k" in a.uns["run1"]["params"]


def test_aggregate_metacells_leaves_the_cells_nmf_usages_behind(planted_programs):
    a = planted_programs(90, 20)
    a.obsm["X_pca"] = np.random.default_rng(0).normal(0, 1, (a.n_obs, 4))
    gpuc.tl.consensus_nmf(a, 3, **_NMF)
    gpuc.tl.metacells(a, **_MC)
    mc = gpuc.tl.aggregate_metacells(a)
    assert "X_pca" in mc.obsm and "X_nmf" not in mc.obsm and "X_nmf_refit" not in mc.obsm
    gpuc.tl.consensus_nmf(mc, 2, **_NMF)  # nothing of another result to refuse
    carried = planted_programs(40, 20)
    carried.obsm["X_nmf"] = np.ones((carried.n_obs, 3))  # e.g. after ad.concat, without uns["nmf"]
    with pytest.raises(ValueError, match=r"would overwrite adata.obsm\['X_nmf'\].*delete it first"):
        gpuc.tl.consensus_nmf(carried, 3, **_NMF)
