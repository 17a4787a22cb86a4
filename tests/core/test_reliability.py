"""Nothing lost, nothing stale, nothing silent: one case per class of hostile input, and an h5ad round trip of
every tool's output with awkward names.

Each error case checks the message and that the AnnData is left exactly as it was (the ``unchanged`` fixture).
"""

from __future__ import annotations

import tracemalloc
import warnings

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scanpy as sc
import scipy.sparse as sp

import gpuc
from gpuc._backend import Backend

AWKWARD_GROUPS = ["T/NK", "T_NK", "B cell.1", "Ünïcode γδ"]
AWKWARD_KEY = "my key.v2 ü"


# ---- data ----------------------------------------------------------------------------------------------------------
def _bulk(n_per: int = 4, n_genes: int = 150, seed: int = 0, groups: list[str] | None = None) -> ad.AnnData:
    """Samples x genes NB counts: condition ctrl vs "kd/siRNA" (a real effect on 20 genes), optional groups."""
    rng = np.random.default_rng(seed)
    groups = groups or ["all"]
    rows, obs = [], []
    base = rng.gamma(1.0, 60.0, n_genes) + 1.0
    for gi, g in enumerate(groups):
        for cond in ("ctrl", "kd/siRNA"):
            for r in range(n_per):
                mu = base * (1 + 0.3 * gi) * np.where((np.arange(n_genes) < 20) & (cond != "ctrl"), 3.0, 1.0)
                rows.append(rng.negative_binomial(5, 5 / (5 + mu)))
                obs.append({"condition": cond, "cell_type": g, "sample": f"{g}|{cond}|{r}"})
    obs = pd.DataFrame(obs, index=[f"s{i}" for i in range(len(obs))])
    obs["condition"] = pd.Categorical(obs["condition"], ["ctrl", "kd/siRNA"])
    return ad.AnnData(
        np.asarray(rows, dtype=np.int64), obs=obs, var=pd.DataFrame(index=[f"g{j}" for j in range(n_genes)])
    )


@pytest.fixture(scope="module")
def _pbmc68k() -> ad.AnnData:
    a = sc.datasets.pbmc68k_reduced()
    a.obs["sample"] = pd.Categorical(np.asarray(AWKWARD_GROUPS)[np.arange(a.n_obs) % len(AWKWARD_GROUPS)])
    return a


@pytest.fixture
def pbmc(_pbmc68k) -> ad.AnnData:
    return _pbmc68k.copy()


# ---- class 1: a design that tests the wrong thing -------------------------------------------------------------------
def test_single_level_factor_is_refused(unchanged):
    a = _bulk()
    a.obs["one"] = "x"
    with unchanged(a), pytest.raises(ValueError, match=r"'one' \(only 'x'\) has a single level"):
        gpuc.tl.deseq(a, design="~one", device="cpu")
    # also next to a real factor: R refuses any factor with fewer than two levels anywhere in the design
    with unchanged(a), pytest.raises(ValueError, match="at least 2 levels"):
        gpuc.tl.deseq(a, design="~one + condition", device="cpu")


def test_contrast_that_cannot_be_formed_is_refused(unchanged):
    a = _bulk()
    with unchanged(a), pytest.raises(ValueError, match="no effect to test"):
        gpuc.tl.deseq(a, design="~1", device="cpu")
    with unchanged(a), pytest.raises(ValueError, match="not a level"):
        gpuc.tl.deseq(a, design="~condition", contrast=["condition", "kd", "ctrl"], device="cpu")


def test_groupby_skips_a_group_where_a_factor_has_one_level():
    a = _bulk(groups=["A", "B"])
    a = a[~((a.obs["cell_type"] == "B") & (a.obs["condition"] == "ctrl"))].copy()
    with pytest.warns(gpuc.GpucWarning, match=r"group 'B' skipped: .*single level"):
        gpuc.tl.deseq(a, design="~condition", groupby="cell_type", device="cpu")
    assert list(a.uns["deseq"]["groups"]) == ["A"]


# ---- class 2: key_added and names from the data survive write_h5ad --------------------------------------------------
@pytest.mark.parametrize("bad", ["a/b", "", 3])
def test_bad_key_added_gives_the_same_exception_in_every_tool(pbmc, unchanged, bad, planted_programs):
    expected = TypeError if not isinstance(bad, str) else ValueError
    fitted = pbmc.copy()
    gpuc.tl.metacells(fitted, device="cpu", max_iter=2, min_iter=1)
    bulk, nmf = _bulk(), planted_programs(90, 40)
    nmf_fitted = nmf.copy()
    gpuc.tl.consensus_nmf(nmf_fitted, 3, n_runs=4, device="cpu")
    calls = {
        "metacells": (pbmc, lambda a, **kw: gpuc.tl.metacells(a, device="cpu", **kw)),
        "metacell_quality": (fitted, lambda a, **kw: gpuc.tl.metacell_quality(a, device="cpu", **kw)),
        "metacell_assignment_quality": (fitted, lambda a, **kw: gpuc.tl.metacell_assignment_quality(a, **kw)),
        "nmf_k_sweep": (nmf, lambda a, **kw: gpuc.tl.nmf_k_sweep(a, [2, 3], n_runs=3, device="cpu", **kw)),
        "consensus_nmf": (nmf, lambda a, **kw: gpuc.tl.consensus_nmf(a, 3, n_runs=4, device="cpu", **kw)),
        "nmf_refine": (nmf_fitted, lambda a, **kw: gpuc.tl.nmf_refine(a, 0.5, **kw)),
        "nmf_project": (nmf, lambda a, **kw: gpuc.tl.nmf_project(a, nmf_fitted, device="cpu", **kw)),
        "deseq": (bulk, lambda a, **kw: gpuc.tl.deseq(a, "~condition", device="cpu", **kw)),
        "vst": (bulk, lambda a, **kw: gpuc.tl.vst(a, device="cpu", **kw)),
        "rlog": (bulk, lambda a, **kw: gpuc.tl.rlog(a, device="cpu", **kw)),
        "normalized_counts": (bulk, lambda a, **kw: gpuc.tl.normalized_counts(a, **kw)),
    }
    assert set(calls) == {n for n in gpuc.tl.__all__ if n not in ("aggregate_metacells", "pseudobulk")}
    for data, call in calls.values():
        with unchanged(data), pytest.raises(expected, match="key_added"):
            call(data, key_added=bad)


def test_every_tool_output_survives_h5ad_with_awkward_names(pbmc, tmp_path, same, planted_programs):
    # data-derived names with '/', '.', spaces and unicode; key_added with '.', a space and unicode
    bulk = _bulk(groups=AWKWARD_GROUPS)
    gpuc.tl.deseq(
        bulk,
        "~condition",
        contrast=["condition", "kd/siRNA", "ctrl"],
        groupby="cell_type",
        device="cpu",
        key_added=AWKWARD_KEY,
    )
    gpuc.tl.deseq(bulk, "~condition", contrast=["condition", "kd/siRNA", "ctrl"], device="cpu")
    gpuc.tl.vst(bulk, device="cpu", key_added="vst ü.1")
    gpuc.tl.rlog(bulk, device="cpu", key_added="rlog ü.1")
    gpuc.tl.normalized_counts(bulk, fpm=True, key_added="fpm ü.1")
    gpuc.tl.metacells(pbmc, groupby="sample", device="cpu", max_iter=3, min_iter=1, key_added=AWKWARD_KEY)
    gpuc.tl.metacell_quality(pbmc, AWKWARD_KEY, celltype_key="bulk_labels", device="cpu")
    gpuc.tl.metacell_assignment_quality(pbmc, AWKWARD_KEY)
    mc = gpuc.tl.aggregate_metacells(pbmc, AWKWARD_KEY, celltype_key="bulk_labels")
    nmf = planted_programs(90, 40)
    gpuc.tl.nmf_k_sweep(nmf, [2, 3], n_runs=3, device="cpu", key_added=AWKWARD_KEY)
    gpuc.tl.consensus_nmf(nmf, 3, n_runs=4, device="cpu", key_added=AWKWARD_KEY)
    cells = pbmc.copy()
    cells.X = sp.csr_matrix(np.rint(np.abs(cells.X) * 3).astype(np.float32))
    pb = gpuc.tl.pseudobulk(cells, "sample", groupby="bulk_labels", layer=None, min_cells=1)

    for name, obj in {"bulk": bulk, "pbmc": pbmc, "mc": mc, "nmf": nmf, "pb": pb}.items():
        path = tmp_path / f"{name}.h5ad"
        obj.write_h5ad(path)
        back = ad.read_h5ad(path)
        same(back, obj, name)

        if name == "bulk":
            # the original names are what a user passes back in
            for g in AWKWARD_GROUPS:
                want = gpuc.get.deseq_results(obj, key=AWKWARD_KEY, group=g)
                got = gpuc.get.deseq_results(back, ["condition", "kd/siRNA", "ctrl"], key=AWKWARD_KEY, group=g)
                pd.testing.assert_frame_equal(got, want)
            assert {e["group"] for e in back.uns[AWKWARD_KEY]["groups"].values()} == set(AWKWARD_GROUPS)
            assert len(back.uns[AWKWARD_KEY]["groups"]) == len(AWKWARD_GROUPS)  # "T/NK" and "T_NK" did not collide
            gpuc.get.deseq_results(back, "condition_kd/siRNA_vs_ctrl")
        if name == "pbmc":
            groups = back.uns[AWKWARD_KEY]["groups"]
            assert sorted(e["group"] for e in groups.values()) == sorted(AWKWARD_GROUPS)
            gpuc.pl.metacell_convergence(back, AWKWARD_KEY, show=False)


# ---- class 3: no stale results under a reused key -------------------------------------------------------------------
def test_rerun_under_the_same_key_replaces_every_output(pbmc):
    a = _bulk(groups=["A", "B"])
    gpuc.tl.deseq(a, "~condition", device="cpu")
    assert "deseq_dispersion" in a.var and "deseq_cooks" in a.layers and "deseq_coef" in a.varm
    gpuc.tl.deseq(a, "~condition", groupby="cell_type", device="cpu")
    assert not [c for c in a.var if c.startswith("deseq_")]
    assert "deseq_cooks" not in a.layers and "deseq_coef" not in a.varm and "deseq_coef_cov" not in a.varm
    assert set(a.uns["deseq"]["groups"]) == {"A", "B"}

    gpuc.tl.metacells(pbmc, 9, device="cpu", max_iter=3, min_iter=1)
    gpuc.tl.metacell_quality(pbmc, device="cpu")
    gpuc.tl.metacell_assignment_quality(pbmc)
    assert "metacell_quality" in pbmc.uns and "metacell_entropy" in pbmc.obs
    gpuc.tl.metacells(pbmc, 7, device="cpu", max_iter=3, min_iter=1)
    assert "metacell_quality" not in pbmc.uns  # derived from the previous fit: dropped
    assert "metacell_assignment_quality" not in pbmc.uns and "metacell_entropy" not in pbmc.obs
    assert pbmc.obsm["metacell_weights"].shape[1] == 7


# ---- class 4: non-convergence is said ------------------------------------------------------------------------------
def test_nmf_non_convergence_warns_once_with_counts(planted_programs):
    a = planted_programs(90, 40)
    with pytest.warns(gpuc.ConvergenceWarning, match=r"max_iter=2 .*: 4 of 4 at k=3") as rec:
        gpuc.tl.consensus_nmf(a, 3, n_runs=4, max_iter=2, device="cpu")
    assert len([w for w in rec if issubclass(w.category, gpuc.ConvergenceWarning)]) == 1
    assert a.uns["nmf"]["n_converged"] == 0
    assert not a.uns["nmf"]["run_converged"].any() and (a.uns["nmf"]["run_n_iter"] == 2).all()
    with pytest.warns(gpuc.ConvergenceWarning, match=r"3 of 3 at k=2, 3 of 3 at k=3"):
        gpuc.tl.nmf_k_sweep(a, [2, 3], n_runs=3, max_iter=2, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", gpuc.ConvergenceWarning)
        gpuc.tl.consensus_nmf(a, 3, n_runs=4, device="cpu")  # converged: silent
    assert a.uns["nmf"]["run_converged"].all()


def test_deseq_non_convergence_warns_and_keeps_flags(monkeypatch):
    """As R: genes whose IRLS stops at max_iter are refitted by optim's L-BFGS-B, and betaConv is False (with one
    ConvergenceWarning that counts them) only where that search does not converge either."""
    import gpuc.deseq._optim as optim

    a = _bulk(n_per=5, n_genes=120)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gpuc.ConvergenceWarning)
        ref = gpuc.tl.deseq(a, "~condition", device="cpu", copy=True)
        short = gpuc.tl.deseq(a, "~condition", max_iter=1, device="cpu", copy=True)
    assert short.var["deseq_betaConv"].all() and (short.var["deseq_betaIter"][~short.var["deseq_allZero"]] == 1).all()
    lfc = gpuc.get.deseq_results(short)["log2FoldChange"]
    # optim stops on a relative reduction of 2e-9 in the objective, some genes a few 1e-2 from the IRLS optimum (as R)
    np.testing.assert_allclose(lfc, gpuc.get.deseq_results(ref)["log2FoldChange"], atol=0.05)

    search = optim.lbfgsb

    def stops_early(*args, **kwargs):
        res = search(*args, **kwargs)
        return optim.LBFGSBResult(res.par, res.value, 1, "NEW_X", res.evaluations)  # optim's code 1: maxit

    monkeypatch.setattr(optim, "lbfgsb", stops_early)
    with pytest.warns(
        gpuc.ConvergenceWarning, match=r"gene\(s\) did not converge in beta \(IRLS with max_iter=1"
    ) as rec:
        gpuc.tl.deseq(a, "~condition", max_iter=1, device="cpu")
    assert len([w for w in rec if issubclass(w.category, gpuc.ConvergenceWarning)]) == 1
    n_bad = int((~a.var["deseq_betaConv"].astype(bool) & ~a.var["deseq_allZero"].astype(bool)).sum())
    assert n_bad > 0 and f"{n_bad} gene(s)" in str(rec[0].message)
    monkeypatch.setattr(optim, "lbfgsb", search)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gpuc.ConvergenceWarning)
        gpuc.tl.deseq(a, "~condition", device="cpu")
    assert a.var["deseq_betaConv"].all()


# ---- class 5: work that cannot fit is refused up front -------------------------------------------------------------
def _refused_peak_bytes(call) -> int:
    tracemalloc.start()
    try:
        with pytest.raises(gpuc.InsufficientMemoryError) as err:
            call()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak, str(err.value)


def test_huge_consensus_nmf_is_refused_before_allocating(unchanged):
    rng = np.random.default_rng(0)
    a = ad.AnnData(sp.random(2700, 2000, density=0.05, format="csr", dtype=np.float32, random_state=rng))
    a.X.data[:] = rng.integers(1, 20, a.X.nnz)
    with unchanged(a):
        peak, msg = _refused_peak_bytes(lambda: gpuc.tl.consensus_nmf(a, 100, n_runs=5000, mask_var=None, device="cpu"))
    assert "GiB" in msg and "n_runs" in msg and "nothing was computed" in msg
    assert peak < 40e6  # the checks and the float copy of the block; no factor or distance matrix was allocated


def test_deseq_vst_and_metacells_refuse_what_does_not_fit(monkeypatch, unchanged, pbmc):
    monkeypatch.setattr(Backend, "free_memory", lambda self: 50 * 2**20)  # a device with 50 MiB free
    a = ad.AnnData(sp.random(200, 100_000, density=0.001, format="csr", random_state=0) * 10)
    a.X.data = np.ceil(a.X.data)
    a.obs["condition"] = np.repeat(["a", "b"], 100)
    with unchanged(a):
        peak, msg = _refused_peak_bytes(lambda: gpuc.tl.deseq(a, "~condition", device="cpu"))
    assert "DESeq2 on 200 samples x 100000 genes needs about" in msg and "0.0 GiB is free" in msg
    assert peak < 20e6
    with unchanged(a):
        peak, msg = _refused_peak_bytes(lambda: gpuc.tl.vst(a, device="cpu"))
    assert "the VST of 200 samples x 100000 genes needs about" in msg and peak < 20e6
    monkeypatch.setattr(Backend, "free_memory", lambda self: 4 * 2**20)
    with unchanged(pbmc):
        peak, msg = _refused_peak_bytes(lambda: gpuc.tl.metacells(pbmc, 350, device="cpu"))
    assert "metacells on 700 cells with n_metacells=350" in msg and "groupby=" in msg
    assert peak < 5e6


def test_metacells_close_to_one_per_cell_warns(pbmc):
    with pytest.warns(gpuc.GpucWarning, match="fewer than 5 cells per metacell"):
        gpuc.tl.metacells(pbmc[:200].copy(), 60, device="cpu", max_iter=2, min_iter=1)


# ---- class 6: backed or lazy AnnData gives an error that names the problem -----------------------------------------
def test_backed_anndata_is_named(tmp_path):
    a = _bulk()
    a.layers["counts"] = a.X.copy()
    a.write_h5ad(tmp_path / "bulk.h5ad")
    backed = ad.read_h5ad(tmp_path / "bulk.h5ad", backed="r")
    for call in (
        lambda: gpuc.tl.deseq(backed, "~condition", device="cpu"),
        lambda: gpuc.tl.vst(backed, device="cpu"),
        lambda: gpuc.tl.pseudobulk(backed, "sample", layer=None),
        lambda: gpuc.tl.consensus_nmf(backed, 2, mask_var=None, device="cpu"),
    ):
        with pytest.raises(TypeError, match=r"adata.X is not in memory .*backed mode.*to_memory\(\)"):
            call()
    backed.file.close()


def test_backed_sparse_is_named_and_lazy_works(tmp_path, planted_programs, same):
    # backed sparse X (anndata's on-disk CSR dataset) is refused as backed dense X is (test above); the same file
    # read lazily (dask) is summed chunk by chunk / loaded block-wise and gives the in-memory results
    pytest.importorskip("dask")
    import h5py

    a = planted_programs(90, 40)
    a.obs["sample"] = pd.Categorical(np.arange(a.n_obs) % 3)
    a.write_h5ad(tmp_path / "p.h5ad")
    backed = ad.read_h5ad(tmp_path / "p.h5ad", backed="r")
    for call in (
        lambda: gpuc.tl.consensus_nmf(backed, 2, device="cpu"),
        lambda: gpuc.tl.nmf_k_sweep(backed, [2], device="cpu"),
        lambda: gpuc.tl.pseudobulk(backed, "sample", layer=None),
    ):
        with pytest.raises(TypeError, match=r"adata.X is not in memory .*backed mode.*to_memory\(\)"):
            call()
    backed.file.close()
    with h5py.File(tmp_path / "p.h5ad") as f:
        lazy = ad.AnnData(ad.experimental.read_elem_lazy(f["X"], chunks=(32, 40)), obs=a.obs, var=a.var)
        same(gpuc.tl.pseudobulk(lazy, "sample", min_cells=1), gpuc.tl.pseudobulk(a, "sample", min_cells=1))
        opts = {"n_runs": 2, "max_iter": 20, "device": "cpu"}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", gpuc.ConvergenceWarning)
            got = gpuc.tl.consensus_nmf(lazy, 2, **opts, copy=True)
            want = gpuc.tl.consensus_nmf(a, 2, **opts, copy=True)
        # cNMF's all-gene outputs sum over cells chunk by chunk on the lazy matrix: another order of the same sums
        summed = {"obsm": ["X_nmf_refit"], "varm": ["nmf_spectra_tpm", "nmf_spectra_score"]}
        for slot, names in summed.items():
            for name in names:
                np.testing.assert_allclose(getattr(got, slot)[name], getattr(want, slot)[name], rtol=1e-10, atol=1e-12)
        same(
            {k: v for k, v in got.obsm.items() if k not in summed["obsm"]},
            {k: v for k, v in want.obsm.items() if k not in summed["obsm"]},
        )
        same(
            {k: v for k, v in got.varm.items() if k not in summed["varm"]},
            {k: v for k, v in want.varm.items() if k not in summed["varm"]},
        )
        # a lazily read embedding is loaded by metacells: tests/core/test_lazy.py compares it with the in-memory fit


# ---- class 7: float16 counts are refused up front -------------------------------------------------------------------
def test_float16_is_refused(unchanged):
    a = _bulk()
    a.X = a.X.astype(np.float16)
    for call in (
        lambda: gpuc.tl.deseq(a, "~condition", device="cpu"),
        lambda: gpuc.tl.pseudobulk(a, "sample", layer=None),
        lambda: gpuc.tl.consensus_nmf(a, 2, mask_var=None, device="cpu"),
    ):
        with unchanged(a), pytest.raises(TypeError, match=r"adata.X is float16.*astype\(np.float32\)"):
            call()
