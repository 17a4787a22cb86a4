"""gpuc.tl.metacells on AnnData: parity with SEACells 0.3.3 end to end, outputs, bad input, groupby."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from anndata import AnnData

import gpuc
from gpuc.metacells import MetacellConvergenceWarning


def test_end_to_end_reproduces_seacells_run(pbmc68k_fitted, mc_ref):
    ad = pbmc68k_fitted
    info = ad.uns["metacell"]
    # archetypes, iterations and labels identical; the RSS trace equal up to the 1e-7 kernel difference
    np.testing.assert_array_equal(
        ad.obs_names.get_indexer(info["metacells"]["initial_archetype"]), mc_ref["archetypes"]
    )
    assert info["n_iter"] == 33 and info["converged"]
    np.testing.assert_allclose(info["rss"], mc_ref["rss"], rtol=1e-6)
    np.testing.assert_array_equal(ad.obs["metacell"].astype(str).to_numpy(), mc_ref["labels"])
    w = ad.obsm["metacell_weights"]
    np.testing.assert_allclose(w.toarray(), mc_ref["A"].T, atol=1e-6)


def test_outputs_and_untouched_neighbors(pbmc68k):
    ad = pbmc68k
    dist, conn, neigh = ad.obsp["distances"].copy(), ad.obsp["connectivities"].copy(), dict(ad.uns["neighbors"])
    gpuc.tl.metacells(ad, 8, device="cpu", key_added="mc")
    assert (ad.obsp["distances"] != dist).nnz == 0 and (ad.obsp["connectivities"] != conn).nnz == 0
    assert ad.uns["neighbors"].keys() == neigh.keys()
    assert isinstance(ad.obs["mc"].dtype, pd.CategoricalDtype)
    w, b, m = ad.obsm["mc_weights"], ad.obsm["mc_archetypes"], ad.obsp["mc_kernel"]
    assert sp.issparse(w) and sp.issparse(b) and sp.issparse(m)
    assert w.shape == b.shape == (700, 8) and m.shape == (700, 700)
    np.testing.assert_allclose(np.asarray(w.sum(axis=1)).ravel(), 1.0)
    np.testing.assert_allclose(np.asarray(b.sum(axis=0)).ravel(), 1.0)
    hard = np.asarray(w.argmax(axis=1)).ravel()
    np.testing.assert_array_equal(ad.obs["mc"].astype(str).to_numpy(), [f"SEACell-{j}" for j in hard])
    info = ad.uns["mc"]
    assert info["params"]["n_metacells"] == 8 and info["params"]["use_rep"] == "X_pca"
    assert info["device"] == "cpu" and info["rss"][0] >= info["rss"].min()
    table = info["metacells"]
    assert list(table.index) == [f"SEACell-{j}" for j in range(8)]
    np.testing.assert_array_equal(table["center"].to_numpy(), ad.obs_names[np.asarray(b.argmax(axis=0)).ravel()])
    assert table["size"].sum() == 700
    # reproducible from uns params
    again = pbmc68k.copy()
    del again.obs["mc"]
    p = info["params"]
    gpuc.tl.metacells(
        again, p["n_metacells"], use_rep=p["use_rep"], random_state=p["random_state"], device="cpu", key_added="mc"
    )
    np.testing.assert_array_equal(again.obs["mc"].to_numpy(), ad.obs["mc"].to_numpy())


def test_default_n_and_copy(pbmc68k, unchanged):
    with unchanged(pbmc68k):
        out = gpuc.tl.metacells(pbmc68k, device="cpu", copy=True, max_iter=12)
    assert out is not pbmc68k
    assert out.obsm["metacell_weights"].shape[1] == round(700 / 75)
    assert gpuc.tl.metacells(pbmc68k, device="cpu", max_iter=12) is None
    assert "metacell" in pbmc68k.obs


def test_h5ad_roundtrip(pbmc68k_fitted, tmp_path, same):
    import anndata

    path = tmp_path / "mc.h5ad"
    pbmc68k_fitted.write_h5ad(path)
    back = anndata.read_h5ad(path)
    same(back, pbmc68k_fitted)
    np.testing.assert_array_equal(back.uns["metacell"]["rss"], pbmc68k_fitted.uns["metacell"]["rss"])
    assert (back.obsm["metacell_weights"] != pbmc68k_fitted.obsm["metacell_weights"]).nnz == 0


def _dup_adata(n_distinct: int, copies: int) -> AnnData:
    rng = np.random.default_rng(0)
    base = rng.normal(size=(n_distinct, 5)).astype(np.float32)
    x = np.repeat(base, copies, axis=0)
    return AnnData(np.zeros((x.shape[0], 2), dtype=np.float32), obsm={"X_pca": x})


@pytest.mark.parametrize(
    ("mutate", "kwargs", "err", "match"),
    [
        (None, {"use_rep": "X_missing"}, KeyError, "X_missing"),
        ("nan", {}, ValueError, "NaN or infinite"),
        ("inf", {}, ValueError, "NaN or infinite"),
        (None, {"n_metacells": 1}, ValueError, "n_metacells must be >= 2"),
        (None, {"n_metacells": 0}, ValueError, "n_metacells"),
        (None, {"n_metacells": 2.5}, TypeError, "integer"),
        (None, {"n_metacells": 701}, ValueError, "distinct"),
        (None, {"n_neighbors": 2}, ValueError, "n_neighbors"),
        (None, {"max_iter": 3, "min_iter": 5}, ValueError, "max_iter"),
        (None, {"graph": "mutual"}, ValueError, "graph"),
        (None, {"init": "kmeans"}, ValueError, "init"),
        (None, {"convergence_epsilon": -1.0}, ValueError, "convergence_epsilon"),
        (None, {"groupby": "no_such_column"}, KeyError, "no_such_column"),
        (None, {"groupby": "phase"}, ValueError, "'G2M': 17 cells"),
        (None, {"groupby": "phase", "n_metacells": {"G1": 5, "S": 2, "G2M": 30}}, ValueError, "G2M"),
        (None, {"initial_archetypes": [1, 2, 3]}, ValueError, "initial_archetypes"),
        (None, {"device": "tpu"}, ValueError, "device"),
    ],
)
def test_bad_input_raises_and_leaves_adata_unchanged(pbmc68k, mutate, kwargs, err, match, unchanged):
    ad = pbmc68k
    if mutate is not None:
        x = ad.obsm["X_pca"].copy()
        x[3, 2] = np.nan if mutate == "nan" else np.inf
        ad.obsm["X_pca"] = x
    kwargs = {"device": "cpu", **kwargs}
    with unchanged(ad), pytest.raises(err, match=match):
        gpuc.tl.metacells(ad, **kwargs)


def test_more_metacells_than_distinct_cells_raises(unchanged):
    ad = _dup_adata(40, 3)
    with unchanged(ad), pytest.raises(ValueError, match="40 distinct"):
        gpuc.tl.metacells(ad, 41, device="cpu")


def test_duplicate_cells_zero_bandwidth_raises(unchanged):
    ad = _dup_adata(60, 10)  # every cell has 9 exact copies: no non-zero distance among its 14 neighbours
    with unchanged(ad), pytest.raises(ValueError, match="zero kernel bandwidth"):
        gpuc.tl.metacells(ad, 5, device="cpu")


def test_non_convergence_warns_and_writes(pbmc68k):
    with pytest.warns(MetacellConvergenceWarning, match="did not converge"):
        gpuc.tl.metacells(pbmc68k, 9, max_iter=2, min_iter=0, convergence_epsilon=1e-12, device="cpu")
    assert pbmc68k.uns["metacell"]["converged"] is False
    assert pbmc68k.uns["metacell"]["n_iter"] == 2
    assert "metacell" in pbmc68k.obs


def test_groupby_equals_independent_runs(pbmc68k):
    ad = pbmc68k
    rng = np.random.default_rng(1)
    ad.obs["sample"] = pd.Categorical(np.where(rng.random(ad.n_obs) < 0.45, "s1", "s2"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MetacellConvergenceWarning)
        gpuc.tl.metacells(ad, groupby="sample", device="cpu", max_iter=15)
    info = ad.uns["metacell"]
    assert set(info["groups"]) == {"s1", "s2"}
    w = ad.obsm["metacell_weights"]
    for g in ("s1", "s2"):
        mask = (ad.obs["sample"] == g).to_numpy()
        labs = ad.obs.loc[mask, "metacell"].astype(str)
        assert labs.str.startswith(f"{g}-SEACell-").all()
        n_g = info["groups"][g]["n_metacells"]
        assert n_g == round(mask.sum() / 75)
        sub = ad[mask].copy()
        for key in list(sub.obsm):
            if key.startswith("metacell"):
                del sub.obsm[key]
        del sub.obs["metacell"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MetacellConvergenceWarning)
            gpuc.tl.metacells(sub, device="cpu", max_iter=15)
        np.testing.assert_array_equal(
            labs.str.replace(f"{g}-", "", regex=False).to_numpy(), sub.obs["metacell"].astype(str).to_numpy()
        )
        np.testing.assert_allclose(info["groups"][g]["rss"], sub.uns["metacell"]["rss"], rtol=1e-12)
        # a cell's weights live only on its own group's columns
        cols = info["metacells"]["column"][info["metacells"]["group"] == g].to_numpy()
        other = np.setdiff1d(np.arange(w.shape[1]), cols)
        assert w[mask][:, other].nnz == 0
    assert ad.obsp["metacell_kernel"][np.ix_(ad.obs["sample"] == "s1", ad.obs["sample"] == "s2")].nnz == 0


def test_groupby_with_explicit_sizes(pbmc68k):
    gpuc.tl.metacells(pbmc68k, {"G1": 6, "S": 3, "G2M": 2}, groupby="phase", device="cpu", max_iter=10)
    info = pbmc68k.uns["metacell"]
    assert {g: v["n_metacells"] for g, v in info["groups"].items()} == {"G1": 6, "S": 3, "G2M": 2}
    assert pbmc68k.obsm["metacell_weights"].shape[1] == 11


@pytest.mark.parametrize("seed", range(40))
def test_hard_labels_argmax_equals_scipys(seed):
    # the adapter's vectorised row argmax gives scipy's answer on ties, negatives, stored zeros and empty rows
    from gpuc.metacells._groups import row_argmax as _row_argmax

    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 60)), int(rng.integers(1, 15))
    m = sp.random(n, k, density=float(rng.uniform(0.0, 1.0)), format="csr", random_state=seed)
    if seed % 3 == 0:
        m.data = np.round(m.data * 3) / 3  # ties between stored entries
    if seed % 5 == 0:
        m.data -= 0.5  # negative maxima, where implicit zeros win
    if seed % 7 == 0:
        m.data[::3] = 0.0  # stored zeros
    np.testing.assert_array_equal(_row_argmax(m), np.asarray(m.argmax(axis=1)).ravel())


class _Terminal:
    """A stderr that says it is a terminal and records what is written to it."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True

    def lines(self) -> list[str]:
        return [line.strip() for line in self.text.replace("\r", "\n").split("\n") if line.strip()]


@pytest.mark.parametrize("verbosity", [1, 0])
def test_progress_shows_iterations_and_the_rss_criterion_and_is_silent_at_verbosity_0(pbmc68k, monkeypatch, verbosity):
    import sys

    import scanpy as sc

    monkeypatch.setattr(gpuc.settings, "progress", True)
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    before, sc.settings.verbosity = sc.settings.verbosity, verbosity
    try:
        gpuc.tl.metacells(pbmc68k, 9, device="cpu", max_iter=50, min_iter=10, convergence_epsilon=1e-3)
    finally:
        sc.settings.verbosity = before
    info = pbmc68k.uns["metacell"]
    assert info["converged"]
    if verbosity == 0:
        assert terminal.text == ""
        return
    # iterations used against the limit (not a bar filling to max_iter), the solver's criterion against its tolerance
    rss = info["rss"]
    change = abs(rss[-2] - rss[-1]) / rss[0]
    last = [line for line in terminal.lines() if line.startswith("metacells:")][-1]
    assert last.startswith(f"metacells: {info['n_iter']} it (limit 50), RSS change {change:.2g} (tol 0.001 reached) [")
    assert "%" not in last and "|" not in last
    assert all(len(line) <= 100 for line in terminal.lines())
