"""Soft summaries, assignment checks and separation within cell types against SEACells 0.3.3's own functions.

The reference (``tests/data/metacells/seacells033_soft_reference.npz``) is what SEACells 0.3.3 returned on the soft
assignments of a stored gpuc run (40 metacells on pbmc68k_reduced, ``pbmc68k_gpuc_k40.h5ad``) and the 700 x 500
pbmc68k count matrix; ``make_soft_reference.py`` beside them made both.
"""

from __future__ import annotations

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from anndata import AnnData

import gpuc
from gpuc.get._checks import identify
from gpuc.metacells._aggregate import sparsify_weights
from gpuc.metacells._quality import cluster_separation, purity, separation

TOL = {"rtol": 1e-10, "atol": 1e-10}


@pytest.fixture(scope="module")
def ref(test_data) -> dict[str, np.ndarray]:
    z = np.load(test_data / "metacells" / "seacells033_soft_reference.npz", allow_pickle=False)
    return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def _k40(test_data, _pbmc68k) -> AnnData:
    run = ad.read_h5ad(test_data / "metacells" / "pbmc68k_gpuc_k40.h5ad")
    z = np.load(test_data / "nmf" / "pbmc68k_counts_700x500.npz", allow_pickle=False)
    counts = sp.csr_matrix((z["data"], z["indices"], z["indptr"]), shape=tuple(z["shape"]))
    assert list(z["obs"]) == list(run.obs_names) == list(_pbmc68k.obs_names)
    out = AnnData(X=counts.astype(np.float32), obs=run.obs.copy(), var=pd.DataFrame(index=z["var"]))
    out.layers["counts"] = counts
    out.obsm.update(run.obsm)
    for basis in ("X_pca", "X_umap"):
        out.obsm[basis] = _pbmc68k.obsm[basis]
    out.uns["metacell"] = run.uns["metacell"]
    return out


@pytest.fixture
def k40(_k40) -> AnnData:
    """The stored gpuc run (40 metacells) with the pbmc68k counts, X_pca and X_umap; a fresh copy."""
    return _k40.copy()


def _ref_csr(ref, w, shape):
    return sp.csr_matrix(
        (ref[f"sparsify_{w}_data"], ref[f"sparsify_{w}_indices"], ref[f"sparsify_{w}_indptr"]), shape=shape
    )


@pytest.mark.parametrize("w", [0.05, 0.2])
def test_sparsify_equals_seacells(k40, ref, w):
    weights = k40.obsm["metacell_weights"]
    got = sparsify_weights(weights, w)
    want = _ref_csr(ref, w, weights.shape)
    assert (got != 0).sum() == (want != 0).sum()
    assert ((got != 0) != (want != 0)).nnz == 0  # the same weights survive
    np.testing.assert_allclose(got.toarray(), want.toarray(), **TOL)
    # the fixture exercises SEACells' 95th-percentile fallback: where a cell's 95th percentile of non-zero weights
    # lies below the cut, the percentile is the cut, and some of those cells keep weights below minimum_weight
    dense = weights.toarray()
    p95 = np.array([np.percentile(r[r > 0], 95) for r in dense])
    fallback = p95 < w
    assert fallback.sum() >= 3
    kept = got.toarray() > 0
    assert ((dense < w) & kept)[fallback].any()
    assert not ((dense < w) & kept)[~fallback].any()
    np.testing.assert_allclose(np.asarray(got.sum(axis=1)).ravel(), 1.0, rtol=1e-12)


def test_sparsify_keeps_every_weight_at_zero(k40):
    weights = k40.obsm["metacell_weights"]
    np.testing.assert_allclose(sparsify_weights(weights, 0.0).toarray(), weights.toarray(), rtol=1e-14)


@pytest.mark.parametrize(("soft", "w"), [(True, 0.05), ("mean", 0.05), ("mean", 0.2)])
def test_soft_mean_equals_summarize_by_soft_seacell(k40, ref, soft, w):
    mc = gpuc.tl.aggregate_metacells(k40, layer="counts", soft=soft, minimum_weight=w, celltype_key="bulk_labels")
    # SEACells' rows are the rows of A (metacell j = column j of the weights); every metacell keeps weight here
    assert list(mc.obs_names) == list(k40.uns["metacell"]["metacells"].index)
    np.testing.assert_allclose(mc.X.toarray(), ref[f"soft_{w}_X"], **TOL)
    np.testing.assert_allclose(mc.obs["size"], ref[f"soft_{w}_sizes"], **TOL)
    assert list(mc.obs["bulk_labels"].astype(str)) == list(ref[f"soft_{w}_celltype"])
    np.testing.assert_allclose(mc.obs["bulk_labels_purity"], ref[f"soft_{w}_purity"], **TOL)
    assert mc.uns["metacell_source"]["soft"] == "mean"


def test_soft_sum_is_mean_times_size_and_keeps_totals(k40, ref):
    mc = gpuc.tl.aggregate_metacells(k40, layer="counts", soft="sum")
    np.testing.assert_allclose(mc.X.toarray(), ref["soft_0.05_X"] * ref["soft_0.05_sizes"][:, None], **TOL)
    counts = k40.layers["counts"]
    np.testing.assert_allclose(mc.X.sum(), counts.sum(), rtol=1e-12)
    np.testing.assert_allclose(mc.obs["size"].sum(), k40.n_obs, rtol=1e-12)
    # minimum_weight=0: every weight, the plain product weights.T @ counts
    mc0 = gpuc.tl.aggregate_metacells(k40, layer="counts", soft="sum", minimum_weight=0)
    w = k40.obsm["metacell_weights"]
    np.testing.assert_allclose(mc0.X.toarray(), (w.T @ counts).toarray(), rtol=1e-12)


def test_aggregate_round_trip_and_redo(k40, tmp_path):
    mc = gpuc.tl.aggregate_metacells(k40, layer="counts", soft="sum", minimum_weight=0.1, celltype_key="bulk_labels")
    path = tmp_path / "mc.h5ad"
    mc.write_h5ad(path)
    back = ad.read_h5ad(path)
    src = dict(back.uns["metacell_source"])
    assert src["soft"] == "sum" and src["minimum_weight"] == pytest.approx(0.1)
    np.testing.assert_allclose(back.X.toarray(), mc.X.toarray())
    pd.testing.assert_frame_equal(back.obs, mc.obs)
    again = gpuc.tl.aggregate_metacells(k40, **src)
    np.testing.assert_allclose(again.X.toarray(), mc.X.toarray())


@pytest.mark.parametrize(
    ("kwargs", "err"),
    [({"soft": "median"}, ValueError), ({"soft": 1}, ValueError), ({"soft": True, "minimum_weight": 1.5}, ValueError)],
)
def test_aggregate_refuses_bad_soft_options(k40, kwargs, err):
    with pytest.raises(err):
        gpuc.tl.aggregate_metacells(k40, layer="counts", **kwargs)


def test_assignment_quality_equals_seacells_definitions(k40, ref, tmp_path):
    before = set(k40.obs.columns)
    gpuc.tl.metacell_assignment_quality(k40)
    added = set(k40.obs.columns) - before
    assert added == {"metacell_entropy", "metacell_max_weight", "metacell_n_assigned"}
    np.testing.assert_allclose(k40.obs["metacell_entropy"], ref["entropy"], **TOL)
    np.testing.assert_array_equal(k40.obs["metacell_max_weight"], ref["top5"][:, 0])
    np.testing.assert_array_equal(k40.obs["metacell_n_assigned"], ref["n_nontrivial"])
    assert (ref["n_nontrivial"] == 0).any()  # the fixture has cells without a non-trivial weight
    info = k40.uns["metacell_assignment_quality"]
    assert info["params"] == {"key": "metacell", "threshold": 0.1}
    assert info["unassigned"] == pytest.approx(np.mean(ref["n_nontrivial"] == 0))
    assert identify(info) == "gpuc.tl.metacell_assignment_quality"  # named in the plots' and getters' messages
    path = tmp_path / "qc.h5ad"
    k40.write_h5ad(path)
    back = ad.read_h5ad(path)
    for c in added:
        np.testing.assert_array_equal(back.obs[c], k40.obs[c])
    assert back.uns["metacell_assignment_quality"]["params"]["threshold"] == 0.1
    # another threshold, into a copy: the original keeps its columns
    out = gpuc.tl.metacell_assignment_quality(k40, threshold=0.3, copy=True)
    w = k40.obsm["metacell_weights"].toarray()
    np.testing.assert_array_equal(out.obs["metacell_n_assigned"], (w > 0.3).sum(axis=1))
    np.testing.assert_array_equal(k40.obs["metacell_n_assigned"], ref["n_nontrivial"])
    # under another prefix, beside the first
    gpuc.tl.metacell_assignment_quality(k40, threshold=0.3, key_added="qc03")
    np.testing.assert_array_equal(k40.obs["qc03_n_assigned"], (w > 0.3).sum(axis=1))
    assert k40.uns["qc03_assignment_quality"]["params"]["threshold"] == 0.3


def test_assignment_quality_refuses_foreign_columns(k40):
    k40.obs["metacell_entropy"] = 1.0
    snapshot = k40.obs.copy()
    with pytest.raises(ValueError, match="did not write"):
        gpuc.tl.metacell_assignment_quality(k40)
    pd.testing.assert_frame_equal(k40.obs, snapshot)
    assert "metacell_assignment_quality" not in k40.uns
    with pytest.raises(ValueError, match="threshold"):
        gpuc.tl.metacell_assignment_quality(k40, threshold=1.0)


def _labels(run):
    return run.obs["metacell"].astype(str).to_numpy(), [str(c) for c in run.obs["metacell"].cat.categories]


def test_separation_engine_equals_seacells_on_its_diffusion_space(k40, ref):
    labels, order = _labels(k40)
    dc = ref["dc"]  # Palantir's multiscale space, as SEACells' evaluate.separation computes it
    want = pd.Series(ref["sep_all1_values"], index=ref["sep_all1_labels"])
    np.testing.assert_allclose(separation(dc, labels, order).reindex(want.index), want, **TOL)
    majority = purity(labels, k40.obs["bulk_labels"], order, "m")["m"].to_numpy()
    for case, nth in (("bulk1", 1), ("bulk2", 2)):
        got = cluster_separation(dc, labels, order, majority, nth_neighbor=nth)
        want = pd.Series(ref[f"sep_{case}_values"], index=ref[f"sep_{case}_labels"])
        assert 0 < want.size < len(order)  # SEACells drops the metacells whose neighbour is of another type
        assert set(got.dropna().index) == set(want.index)
        np.testing.assert_allclose(got.reindex(want.index), want, **TOL)


def test_separation_nearest_of_the_same_type(k40, ref):
    labels, order = _labels(k40)
    dc = ref["dc"]
    majority = purity(labels, k40.obs["bulk_labels"], order, "m")["m"].to_numpy()
    got = cluster_separation(dc, labels, order, majority, nth_neighbor=1, mode="nearest")
    cent = pd.DataFrame(dc).groupby(labels).mean().reindex(order).to_numpy()
    for i in range(len(order)):
        same = [j for j in range(len(order)) if j != i and majority[j] == majority[i]]
        want = min(np.linalg.norm(cent[i] - cent[j]) for j in same) if same else np.nan
        np.testing.assert_allclose(got.iloc[i], want, rtol=1e-12)
    # never closer than the unrestricted nearest metacell; equal to it wherever SEACells keeps the metacell
    sep = separation(dc, labels, order).to_numpy()
    assert (got.dropna() >= sep[got.notna().to_numpy()] - 1e-15).all()
    seacells = cluster_separation(dc, labels, order, majority, nth_neighbor=1)
    kept = seacells.notna().to_numpy()
    np.testing.assert_allclose(got[kept], seacells[kept], rtol=1e-15)


def test_metacell_quality_celltype_separation(k40, ref, tmp_path):
    gpuc.tl.metacell_quality(k40, celltype_key="bulk_labels", celltype_separation="neighbor", device="cpu")
    q = k40.uns["metacell_quality"]
    assert list(q.columns) == [
        "size", "compactness", "separation", "bulk_labels", "bulk_labels_purity", "bulk_labels_separation",
    ]  # fmt: skip
    # gpuc's diffusion space is Palantir's up to the eigensolver's tolerance: the same metacells are kept and
    # the distances agree to 1e-3
    want = pd.Series(ref["sep_bulk1_values"], index=ref["sep_bulk1_labels"])
    got = q["bulk_labels_separation"]
    assert set(got.dropna().index) == set(want.index)
    np.testing.assert_allclose(got.reindex(want.index), want, rtol=1e-3)  # measured: 5e-5
    near = gpuc.tl.metacell_quality(k40, celltype_key="bulk_labels", celltype_separation="nearest", inplace=False)
    assert near["bulk_labels_separation"].notna().sum() > got.notna().sum()
    path = tmp_path / "q.h5ad"
    k40.write_h5ad(path)
    pd.testing.assert_frame_equal(ad.read_h5ad(path).uns["metacell_quality"], q, check_index_type=False)
    with pytest.raises(ValueError, match="celltype_separation"):
        gpuc.tl.metacell_quality(k40, celltype_key="bulk_labels", celltype_separation="other", inplace=False)
    with pytest.raises(ValueError, match="needs celltype_key"):
        gpuc.tl.metacell_quality(k40, celltype_separation="nearest", inplace=False)


# ---- plots ---------------------------------------------------------------------------------------------------------
def test_plot_assignment_quality(k40):
    import matplotlib.pyplot as plt

    n_open = len(plt.get_fignums())
    with pytest.raises(KeyError, match="metacell_assignment_quality"):
        gpuc.pl.metacell_assignment_quality(k40, show=False)
    assert len(plt.get_fignums()) == n_open  # refused before drawing
    gpuc.tl.metacell_assignment_quality(k40)
    fig = gpuc.pl.metacell_assignment_quality(k40, show=False)
    a_ent, a_max, a_n = fig.axes
    assert sum(p.get_height() for p in a_ent.patches) == k40.n_obs
    assert sum(p.get_height() for p in a_max.patches) == k40.n_obs
    assert a_max.get_xlim() == (0, 1)
    n = k40.obs["metacell_n_assigned"].to_numpy()
    heights = [p.get_height() for p in a_n.patches]
    assert heights == list(np.bincount(n))
    assert a_n.patches[0].get_facecolor() != a_n.patches[1].get_facecolor()  # cells without any: drawn apart
    assert f"{(n == 0).sum()} cells" in a_n.get_title()
    assert all(a.get_xlabel() and a.get_ylabel() for a in fig.axes)
    plt.close("all")


def test_plot_initialization_marks_the_initial_archetypes(k40):
    import matplotlib.pyplot as plt

    ax = gpuc.pl.metacell_initialization(k40, "umap", show=False)
    names = k40.uns["metacell"]["metacells"]["initial_archetype"].to_numpy(dtype=str)
    want = k40.obsm["X_umap"][k40.obs_names.get_indexer(names), :2]
    cells, arche = ax.collections
    assert cells.get_offsets().shape[0] == k40.n_obs
    np.testing.assert_array_equal(np.asarray(arche.get_offsets()), want)
    assert ax.get_title() == "40 initial archetypes (red) over 700 cells (metacell)"
    with pytest.raises(KeyError, match="basis"):
        gpuc.pl.metacell_initialization(k40, "tsne", show=False)
    plt.close("all")


def test_plot_quality_shows_separation_within_types(k40):
    import matplotlib.pyplot as plt

    gpuc.tl.metacell_quality(k40, celltype_key="bulk_labels", celltype_separation="neighbor", device="cpu")
    fig = gpuc.pl.metacell_quality(k40, show=False)
    titles = [a.get_title() for a in fig.axes]
    assert len(titles) == 4 and titles[2].startswith("bulk_labels_separation")
    n_nan = int(k40.uns["metacell_quality"]["bulk_labels_separation"].isna().sum())
    assert f"{n_nan} NaN" in titles[2]
    plt.close("all")


def test_metacells_without_weight_after_the_cut_are_left_out():
    from gpuc.metacells._aggregate import soft_membership

    # metacell "c" only ever holds weights below 0.05 in cells whose 95th percentile is above the cut
    w = sp.csr_matrix(np.array([[0.6, 0.37, 0.03], [0.2, 0.78, 0.02], [0.5, 0.5, 0.0]]))
    agg, names = soft_membership(w, ["a", "b", "c"], minimum_weight=0.05)
    assert names == ["a", "b"]
    np.testing.assert_allclose(agg.toarray(), [[0.6 / 0.97, 0.2 / 0.98, 0.5], [0.37 / 0.97, 0.78 / 0.98, 0.5]])
    agg0, names0 = soft_membership(w, ["a", "b", "c"], minimum_weight=0.0)
    assert names0 == ["a", "b", "c"]
    np.testing.assert_allclose(agg0.toarray(), w.toarray().T)


def test_separation_ignores_metacells_without_cells(ref, k40):
    labels, order = _labels(k40)
    dc = ref["dc"]
    full = separation(dc, labels, order)
    # a metacell category without cells (a subset AnnData keeps unused categories): NaN, the others unchanged
    gone = labels != order[0]
    sub = separation(dc[gone], labels[gone], order)
    assert np.isnan(sub.iloc[0])
    cent = pd.DataFrame(dc).groupby(labels).mean().reindex(order).to_numpy()
    for i in range(1, len(order)):
        d = [np.linalg.norm(cent[i] - cent[j]) for j in range(1, len(order)) if j != i]
        np.testing.assert_allclose(sub.iloc[i], min(d), rtol=1e-12)
    assert (sub.iloc[1:] >= full.iloc[1:] - 1e-15).all()
