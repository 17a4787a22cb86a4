"""Choosing k: the rule of gpuc.get.nmf_suggest_k, validated on counts with planted programmes; and nmf_refine."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import anndata
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from anndata import AnnData

import gpuc
from gpuc._errors import GpucWarning
from gpuc.nmf._consensus import suggest_k

# ---- the planted-programme simulation (documented on the benchmarks page) ------------------------------------------
N_CELLS, N_GENES, GENES_PER_PROGRAM, DEPTH = 200, 150, 25, 1500.0


def planted(k: int, seed: int) -> AnnData:
    """Poisson counts of ``N_CELLS`` cells x ``N_GENES`` genes from ``k`` planted programmes.

    Each programme is a shared gamma(1, 1) gene baseline (weight 0.3) plus ``GENES_PER_PROGRAM`` random genes raised
    by 2-8 times the mean baseline (programmes may share genes); each cell mixes the programmes with Dirichlet(0.5)
    weights; library sizes are ``DEPTH`` x lognormal(0, 0.3) (about 1,500 counts per cell, ~10 per gene: the noise
    level of the validation).
    """
    rng = np.random.default_rng([k, seed])
    base = rng.gamma(1.0, 1.0, N_GENES)
    spectra = np.tile(base, (k, 1)) * 0.3
    for j in range(k):
        genes = rng.choice(N_GENES, GENES_PER_PROGRAM, replace=False)
        spectra[j, genes] += rng.uniform(2, 8, genes.size) * base.mean()
    spectra /= spectra.sum(1, keepdims=True)
    usage = rng.dirichlet(np.full(k, 0.5), size=N_CELLS)
    lib = DEPTH * rng.lognormal(0, 0.3, N_CELLS)
    counts = rng.poisson(lib[:, None] * (usage @ spectra)).astype(np.float32)
    counts[0, counts.std(0) == 0] += 1  # no constant gene (SD scaling)
    ad = AnnData(sp.csr_matrix(counts))
    ad.obs_names = [f"c{i}" for i in range(N_CELLS)]
    ad.var_names = [f"g{i}" for i in range(N_GENES)]
    return ad


SWEEP = {"n_runs": 10, "mask_var": None, "preprocessing": "sd", "tol": 1e-5, "kmeans_n_init": 4}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k_true", range(3, 11))
def test_planted_k_is_suggested(k_true: int, seed: int) -> None:
    ad = planted(k_true, seed)
    gpuc.tl.nmf_k_sweep(ad, range(2, 14), random_state=seed, **SWEEP)
    picked = ad.uns["nmf_k_sweep"]["suggested_k"]
    assert picked == gpuc.get.nmf_suggest_k(ad)
    assert picked == k_true, ad.uns["nmf_k_sweep"]["table"][["k", "stability", "median_error"]].to_string()


# ---- the rule itself ------------------------------------------------------------------------------------------------
def test_rule_takes_largest_stable_k_while_error_falls() -> None:
    k = np.arange(2, 11)
    err = np.array([1.0, 0.8, 0.6, 0.4, 0.39, 0.38, 0.37, 0.36, 0.35])  # falls fast to k=5, then by 0.01 per k
    stab = np.array([1.0, 0.99, 0.97, 0.98, 0.99, 0.7, 0.99, 0.6, 0.99])
    # total drop 0.65; gains of k=6.. are 0.01 < 0.05 * 0.65: only k = 2..5 still lower the error
    assert suggest_k(k, stab, err) == 5
    # with no error criterion, the stable k=10 qualifies
    assert suggest_k(k, stab, err, min_gain=0.0) == 10
    # a tighter tolerance drops k=4 and k=5 (0.97, 0.98 < 1.0 - 0.015)
    assert suggest_k(k, stab, err, tol=0.015) == 3
    # the order of the rows does not matter
    perm = np.random.default_rng(0).permutation(k.size)
    assert suggest_k(k[perm], stab[perm], err[perm]) == 5


def test_rule_skips_failed_consensus_and_single_k() -> None:
    k = np.array([2, 3, 4])
    assert suggest_k(k, [0.9, np.nan, 0.95], [1.0, 0.5, 0.2]) == 4
    assert suggest_k(k, [0.9, 0.95, np.nan], [1.0, 0.5, 0.2]) == 3
    assert suggest_k([5], [0.8], [0.3]) == 5
    with pytest.raises(ValueError, match="same length"):
        suggest_k([2, 3], [0.9], [1.0, 0.5])


def _sweep_adata(stab: list[float], err: list[float]) -> AnnData:
    ad = AnnData(np.zeros((3, 2)))
    k = np.arange(2, 2 + len(stab))
    table = pd.DataFrame({"k": k, "stability": stab, "median_error": err, "best_error": np.asarray(err) - 0.01})
    table["consensus_failed"] = np.isnan(stab)
    ad.uns["nmf_k_sweep"] = {"table": table, "suggested_k": suggest_k(k, stab, err)}
    return ad


def test_getter_options_and_errors() -> None:
    ad = _sweep_adata([1.0, 0.99, 0.97, 0.98, 0.99, 0.7], [1.0, 0.8, 0.6, 0.4, 0.39, 0.38])
    assert gpuc.get.nmf_suggest_k(ad) == ad.uns["nmf_k_sweep"]["suggested_k"] == 5
    assert isinstance(gpuc.get.nmf_suggest_k(ad), int)
    assert gpuc.get.nmf_suggest_k(ad, min_gain=0.0) == 6
    assert gpuc.get.nmf_suggest_k(ad, min_gain=0.0, tol=0.005) == 2
    with pytest.raises(KeyError, match="nmf_k_sweep"):
        gpuc.get.nmf_suggest_k(ad, key="other")
    with pytest.raises(ValueError, match="tol"):
        gpuc.get.nmf_suggest_k(ad, tol=-1)
    with pytest.raises(ValueError, match="error="):
        gpuc.get.nmf_suggest_k(ad, error="mean_error")


def test_getter_refuses_a_sweep_whose_every_consensus_failed() -> None:
    # the engine's rule falls back to the first k; the getter says there is nothing to suggest instead
    ad = _sweep_adata([np.nan, np.nan, np.nan], [1.0, 0.8, 0.6])
    assert ad.uns["nmf_k_sweep"]["suggested_k"] == 2
    with pytest.warns(GpucWarning, match=r"failed for every k .*density_threshold=2\.0"):
        assert gpuc.get.nmf_suggest_k(ad) is None
    fig = gpuc.pl.nmf_k_sweep(ad, show=False)  # drawn, with nothing marked
    assert "no k suggested" in fig._suptitle.get_text()
    plt.close(fig)


def test_sweep_records_suggestion_and_plot_marks_it(program_factory) -> None:
    ad = program_factory(150, 60, 3, seed=1)
    gpuc.tl.nmf_k_sweep(ad, range(2, 7), n_runs=6, layer="counts", preprocessing="sd", random_state=0)
    u = ad.uns["nmf_k_sweep"]
    assert isinstance(u["suggested_k"], int)
    assert u["suggested_k"] == gpuc.get.nmf_suggest_k(ad) == 3
    fig = gpuc.pl.nmf_k_sweep(ad, show=False)
    for a in fig.axes:
        vlines = [ln for ln in a.get_lines() if list(np.ravel(ln.get_xdata())) == [3, 3]]
        assert vlines, "the suggested k is not marked on every panel"
    assert "suggested k = 3" in fig._suptitle.get_text()
    fig2 = gpuc.pl.nmf_k_sweep(ad, mark_k=5, show=False)
    assert "chosen k = 5" in fig2._suptitle.get_text()
    plt.close("all")


# ---- re-thresholding without refitting ----------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["spectra", "usage"])
def test_refine_is_bit_identical_to_a_full_run(program_factory, same, target: str) -> None:
    ad = program_factory(150, 60, 4, seed=2)
    opts = {"n_runs": 8, "layer": "counts", "preprocessing": "sd", "random_state": 3, "target": target}
    gpuc.tl.consensus_nmf(ad, 4, density_threshold=2.0, **opts)
    pool = ad.uns["nmf"]["pool"]
    assert pool.shape == (8 * 4, 40 if target == "spectra" else 150) and pool.dtype == np.float32
    assert ad.uns["nmf"]["components"]["kept"].all()
    # a threshold that drops about half of the components
    thr = float(np.median(ad.uns["nmf"]["components"]["local_density"])) * 1.0001
    full = gpuc.tl.consensus_nmf(ad, 4, density_threshold=thr, copy=True, **opts)
    gpuc.tl.nmf_refine(ad, thr)
    assert 4 <= ad.uns["nmf"]["components"]["kept"].sum() < 8 * 4
    np.testing.assert_array_equal(ad.obsm["X_nmf"], full.obsm["X_nmf"])
    np.testing.assert_array_equal(ad.varm["nmf_spectra"], full.varm["nmf_spectra"])
    got = {k: v for k, v in ad.uns["nmf"].items() if k != "seconds"}
    want = {k: v for k, v in full.uns["nmf"].items() if k != "seconds"}
    same(got, want, "uns['nmf']")


def test_refine_key_added_copy_and_errors(program_factory, same) -> None:
    ad = program_factory(120, 60, 3, seed=0)
    gpuc.tl.consensus_nmf(ad, 3, n_runs=6, layer="counts", preprocessing="sd")
    snapshot = ad.copy()
    out = gpuc.tl.nmf_refine(ad, 0.3, key_added="nmf03", copy=True)
    assert out.uns["nmf03"]["params"]["density_threshold"] == 0.3
    assert "X_nmf03" in out.obsm and "X_nmf03" not in ad.obsm
    with pytest.raises(ValueError, match="density_threshold"):
        gpuc.tl.nmf_refine(ad, 3.0)
    with pytest.raises(KeyError, match="consensus_nmf"):
        gpuc.tl.nmf_refine(ad, 0.3, key="nope")
    bad = ad.copy()
    bad.uns["nmf"]["params"]["mask_var"] = None  # the factorised block changed: 60 genes instead of 40
    with pytest.raises(ValueError, match="changed"):
        gpuc.tl.nmf_refine(bad, 0.3)
    same(ad, snapshot)


def test_sweep_whose_every_consensus_failed_stores_no_suggestion(program_factory, tmp_path) -> None:
    # nothing to suggest: suggested_k is None (not the sweep's first k), and it survives write_h5ad as None
    ad = program_factory(60, 30, 3, seed=2)
    with pytest.warns(GpucWarning, match="consensus failed for k=\\[2, 3\\]"):
        gpuc.tl.nmf_k_sweep(ad, [2, 3], n_runs=3, layer="counts", density_threshold=0.0, random_state=0)
    assert ad.uns["nmf_k_sweep"]["table"]["consensus_failed"].all()
    assert ad.uns["nmf_k_sweep"]["suggested_k"] is None
    with pytest.warns(GpucWarning, match="no k can be suggested"):
        assert gpuc.get.nmf_suggest_k(ad) is None
    ad.write_h5ad(tmp_path / "sweep.h5ad")
    assert anndata.read_h5ad(tmp_path / "sweep.h5ad").uns["nmf_k_sweep"]["suggested_k"] is None
