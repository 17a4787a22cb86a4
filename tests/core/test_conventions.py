"""Behaviour every tool shares: settings.device, random_state forms, progress bars, pseudobulk semantics."""

from __future__ import annotations

import warnings

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scanpy as sc
import scipy.sparse as sp

import gpuc
from gpuc._settings import settings
from gpuc._utils import progress_enabled


def _bulk(seed: int = 0) -> ad.AnnData:
    rng = np.random.default_rng(seed)
    x = rng.negative_binomial(5, 0.1, size=(8, 60))
    obs = pd.DataFrame({"condition": np.repeat(["a", "b"], 4)}, index=[f"s{i}" for i in range(8)])
    return ad.AnnData(x.astype(np.int64), obs=obs)


# ---- settings.device ----------------------------------------------------------------------------------------------
def test_settings_device_is_followed_when_device_is_none(monkeypatch):
    import gpuc._backend as backend

    # a machine that reports a GPU whose CuPy cannot be used: only the settings keep the tools on the CPU
    monkeypatch.setattr(backend, "gpu_available", lambda: True)
    monkeypatch.setattr(backend, "gpu_status", lambda: (True, ""))
    monkeypatch.setattr(settings, "device", "cpu")
    a = _bulk()
    gpuc.tl.vst(a)
    assert a.uns["vst"]["device"] == "cpu" and a.uns["vst"]["params"]["device"] is None
    monkeypatch.setattr(settings, "device", "auto")
    monkeypatch.setattr(backend, "AUTO_GPU_MIN_WORK", {})  # no size rule: "auto" then means the (unusable) GPU
    with pytest.raises(ImportError, match="cupy"):
        gpuc.tl.vst(a)


# ---- random_state ---------------------------------------------------------------------------------------------------
def test_random_state_forms_are_reproducible(planted_programs):
    a = planted_programs(80, 30)
    gpuc.tl.consensus_nmf(a, 3, n_runs=4, device="cpu", random_state=7, key_added="int")
    assert a.uns["int"]["params"]["random_state"] == 7

    gpuc.tl.consensus_nmf(a, 3, n_runs=4, device="cpu", random_state=None, key_added="none")
    drawn = a.uns["none"]["params"]["random_state"]
    assert isinstance(drawn, int) and 0 <= drawn < 2**32
    gpuc.tl.consensus_nmf(a, 3, n_runs=4, device="cpu", random_state=drawn, key_added="again")
    np.testing.assert_array_equal(a.uns["again"]["run_errors"], a.uns["none"]["run_errors"])

    for rng, make in (
        (np.random.RandomState(3), np.random.RandomState),
        (np.random.default_rng(3), np.random.default_rng),
    ):
        gpuc.tl.consensus_nmf(a, 3, n_runs=4, device="cpu", random_state=rng, key_added="rng")
        seed = a.uns["rng"]["params"]["random_state"]
        twin = make(3)
        expected = (
            twin.randint(0, 2**32, dtype=np.uint64)
            if isinstance(twin, np.random.RandomState)
            else twin.integers(0, 2**32, dtype=np.uint64)
        )
        assert seed == int(expected)  # the generator was drawn from exactly once
        gpuc.tl.consensus_nmf(a, 3, n_runs=4, device="cpu", random_state=seed, key_added="seed")
        np.testing.assert_array_equal(a.uns["seed"]["run_errors"], a.uns["rng"]["run_errors"])

    for bad, err in ((-1, ValueError), (2**32, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(err, match="random_state"):
            gpuc.tl.consensus_nmf(a, 3, n_runs=4, device="cpu", random_state=bad)


def test_params_are_the_call_and_identical_between_identical_runs(planted_programs):
    a = planted_programs(80, 30)
    gpuc.tl.consensus_nmf(a, 3, n_runs=4, key_added="r1")
    gpuc.tl.consensus_nmf(a, 3, n_runs=4, key_added="r2")
    p1, p2 = a.uns["r1"]["params"], a.uns["r2"]["params"]
    assert set(p1) == set(p2) and all(np.array_equal(p1[k], p2[k]) if p1[k] is not None else p2[k] is None for k in p1)
    assert p1["device"] is None and p1["dtype"] is None and a.uns["r1"]["device"] == "cpu"
    assert "seconds" in a.uns["r1"] and "seconds" not in p1


# ---- progress bars --------------------------------------------------------------------------------------------------
def test_progress_bars_follow_verbosity_terminal_and_switch(monkeypatch):
    import sys

    class Tty:
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(settings, "progress", True)
    monkeypatch.setattr(sys, "stderr", Tty())
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    verbosity = sc.settings.verbosity
    try:
        sc.settings.verbosity = 1  # Scanpy's default (warning)
        assert progress_enabled()
        sc.settings.verbosity = 0
        assert not progress_enabled()
        sc.settings.verbosity = 2
        monkeypatch.setattr(settings, "progress", False)
        assert not progress_enabled()
        monkeypatch.setattr(settings, "progress", True)
        with open(__file__) as not_a_terminal:
            monkeypatch.setattr(sys, "stderr", not_a_terminal)
            assert not progress_enabled()
    finally:
        sc.settings.verbosity = verbosity


# ---- pseudobulk -----------------------------------------------------------------------------------------------------
def test_pseudobulk_equals_scanpy_aggregate_and_drops_missing_labels():
    rng = np.random.default_rng(0)
    n = 300
    x = sp.csr_matrix(rng.poisson(2.0, size=(n, 40)).astype(np.float32))
    obs = pd.DataFrame(
        {
            "donor": pd.Categorical(rng.choice(["d1", "d2", "d3"], n)),
            "cell_type": pd.Categorical(rng.choice(["T", "B"], n)),
        },
        index=[f"c{i}" for i in range(n)],
    )
    cells = ad.AnnData(x, obs=obs)
    cells.layers["counts"] = x.copy()
    cells.obs.loc[cells.obs_names[:7], "cell_type"] = np.nan
    cells.obs.loc[cells.obs_names[7:10], "donor"] = np.nan

    with pytest.warns(gpuc.GpucWarning, match="10 cell"):
        pb = gpuc.tl.pseudobulk(cells, "donor", groupby="cell_type", layer="counts", min_cells=1)
    assert not any("nan" in name for name in pb.obs_names)
    assert pb.obs["n_cells"].sum() == n - 10 and pb.uns["pseudobulk"]["n_cells_missing"] == 10

    complete = cells[cells.obs[["donor", "cell_type"]].notna().all(axis=1).to_numpy()].copy()
    ref = sc.get.aggregate(complete, by=["donor", "cell_type"], func="sum", layer="counts")
    ref_sums = pd.DataFrame(np.asarray(ref.layers["sum"]), index=ref.obs_names)
    for name in pb.obs_names:
        donor, ct = name.split("_")
        match = ref.obs_names[(ref.obs["donor"] == donor).to_numpy() & (ref.obs["cell_type"] == ct).to_numpy()]
        np.testing.assert_array_equal(pb[name].X.ravel(), ref_sums.loc[match[0]].to_numpy())

    with warnings.catch_warnings():
        warnings.simplefilter("error", gpuc.GpucWarning)
        gpuc.tl.pseudobulk(cells[10:].copy(), "donor", groupby="cell_type", min_cells=1)


# ---- metacells: hard sums as scanpy's aggregate, multi-panel plots take their Axes ---------------------------------
def test_aggregate_metacells_equals_scanpy_aggregate_and_quality_plot_takes_axes():
    import matplotlib.pyplot as plt

    a = sc.datasets.pbmc68k_reduced()
    a.X = sp.csr_matrix(np.rint(np.abs(a.X) * 3).astype(np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gpuc.ConvergenceWarning)
        gpuc.tl.metacells(a, device="cpu", max_iter=3, min_iter=1)
    mc = gpuc.tl.aggregate_metacells(a, celltype_key="bulk_labels")
    ref = sc.get.aggregate(a, by="metacell", func="sum")
    ref_sums = pd.DataFrame(np.asarray(ref.layers["sum"]), index=ref.obs_names.astype(str))
    np.testing.assert_array_equal(mc.X.toarray(), ref_sums.loc[mc.obs_names].to_numpy())

    gpuc.tl.metacell_quality(a, celltype_key="bulk_labels", device="cpu")
    fig, axes = plt.subplots(1, 3)
    assert gpuc.pl.metacell_quality(a, ax=axes, show=False) is fig
    assert [ax.get_title().split("\n")[0] for ax in axes] == ["compactness", "separation", "bulk_labels_purity"]
    with pytest.raises(ValueError, match="one per panel"):
        gpuc.pl.metacell_quality(a, ax=axes[:2], show=False)
    plt.close("all")
