"""Getters and plots pointed at another tool's key, or a missing one, say what they found and which key to pass;
plot arguments are checked before any figure is made, and a failed plot leaves no open figure."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
import scanpy as sc
from anndata import AnnData

import gpuc


@pytest.fixture(scope="module")
def cells(request) -> AnnData:
    """Small counts with the outputs of metacells, nmf_k_sweep, consensus_nmf, and of Scanpy's leiden and pca."""
    rng = np.random.default_rng(0)
    k, n, g = 3, 90, 30
    spectra = np.full((k, g), 0.05)
    for j, block in enumerate(np.array_split(np.arange(g), k)):
        spectra[j, block] = rng.uniform(2, 6, block.size)
    usage = rng.dirichlet(np.full(k, 0.3), n) * rng.uniform(20, 40, (n, 1))
    a = AnnData(
        rng.poisson(usage @ spectra).astype(np.float32),
        obs=pd.DataFrame(index=[f"c{i}" for i in range(n)]),
        var=pd.DataFrame(index=[f"g{j}" for j in range(g)]),
    )
    a.var["highly_variable"] = np.arange(g) % 5 != 4
    a.obsm["X_pca"] = rng.normal(size=(n, 5))
    a.obsm["X_umap"] = a.obsm["X_pca"][:, :2]
    gpuc.tl.metacells(a, 6, n_neighbors=5, n_waypoint_eigs=3, max_iter=15, device="cpu")
    gpuc.tl.metacell_quality(a, device="cpu")
    gpuc.tl.nmf_k_sweep(a, [2, 3], n_runs=3, device="cpu")
    gpuc.tl.consensus_nmf(a, 3, n_runs=4, device="cpu", density_threshold=2.0)
    # what sc.tl.leiden writes (leidenalg is not a test dependency)
    a.obs["leiden"] = pd.Categorical(usage.argmax(1).astype(str))
    a.uns["leiden"] = {"params": {"resolution": 1.0, "random_state": 0, "n_iterations": -1}}
    a.uns["pca"] = {"params": {"zero_center": True}, "variance": np.ones(5), "variance_ratio": np.ones(5) / 5}
    return a


@pytest.fixture(scope="module")
def bulk() -> AnnData:
    """8 samples of NB counts after gpuc.tl.deseq and gpuc.tl.vst."""
    rng = np.random.default_rng(1)
    mean = 2 ** rng.normal(5, 1.5, 60)
    cond = np.repeat(["A", "B"], 4)
    counts = rng.negative_binomial(10, 10 / (10 + mean[None, :] * np.where(cond == "B", 2.0, 1.0)[:, None]))
    obs = pd.DataFrame({"condition": pd.Categorical(cond)}, index=[f"s{i}" for i in range(8)])
    b = AnnData(counts.astype(np.int64), obs=obs, var=pd.DataFrame(index=[f"g{j}" for j in range(60)]))
    gpuc.tl.deseq(b, "~condition", device="cpu")
    gpuc.tl.vst(b, device="cpu")
    return b


@pytest.fixture(autouse=True)
def _no_open_figures():
    plt.close("all")
    yield
    leaked = plt.get_fignums()
    plt.close("all")
    assert not leaked, f"figures left open: {leaked}"


# (call, what the key holds, what the message must point to)
WRONG_KEY = [
    (lambda a, b: gpuc.get.nmf_top_genes(a, key="metacell"), "gpuc.tl.metacells", "key='nmf'"),
    (lambda a, b: gpuc.get.nmf_top_genes(a, key="nmf_k_sweep", by="weight"), "gpuc.tl.nmf_k_sweep", "key='nmf'"),
    (lambda a, b: gpuc.get.nmf_gene_scores(a, key="leiden"), "scanpy.tl.leiden", "key='nmf'"),
    (lambda a, b: gpuc.get.nmf_suggest_k(a, key="nmf"), "gpuc.tl.consensus_nmf", "key='nmf_k_sweep'"),
    (lambda a, b: gpuc.get.deseq_results(b, key="vst"), "gpuc.tl.vst", "key='deseq'"),
    (lambda a, b: gpuc.pl.metacells(a, key="leiden", show=False), "scanpy.tl.leiden", "key='metacell'"),
    (lambda a, b: gpuc.pl.metacell_sizes(a, "nmf", show=False), "gpuc.tl.consensus_nmf", "key='metacell'"),
    (lambda a, b: gpuc.pl.metacell_quality(a, "pca", show=False), "scanpy.pp.pca", "key='metacell'"),
    (lambda a, b: gpuc.pl.metacell_convergence(a, "nmf", show=False), "gpuc.tl.consensus_nmf", "key='metacell'"),
    (lambda a, b: gpuc.pl.nmf_k_sweep(a, key="nmf", show=False), "gpuc.tl.consensus_nmf", "key='nmf_k_sweep'"),
    (lambda a, b: gpuc.pl.nmf_density(a, key="nmf_k_sweep", show=False), "gpuc.tl.nmf_k_sweep", "key='nmf'"),
    (lambda a, b: gpuc.pl.nmf_clustergram(a, key="metacell", show=False), "gpuc.tl.metacells", "key='nmf'"),
    (lambda a, b: gpuc.pl.nmf_programs(a, key="metacell", show=False), "gpuc.tl.metacells", "key='nmf'"),
    (lambda a, b: gpuc.pl.nmf_usage(a, key="metacell", show=False), "gpuc.tl.metacells", "key='nmf'"),
    (lambda a, b: gpuc.pl.volcano(b, key="vst", show=False), "gpuc.tl.vst", "key='deseq'"),
    (lambda a, b: gpuc.pl.ma(b, key="vst", show=False), "gpuc.tl.vst", "key='deseq'"),
    (lambda a, b: gpuc.pl.dispersion(b, key="vst", show=False), "gpuc.tl.vst", "key='deseq'"),
]


@pytest.mark.parametrize(("call", "found", "instead"), WRONG_KEY, ids=[f"{i}" for i in range(len(WRONG_KEY))])
def test_another_tools_key_names_what_it_holds_and_the_key_to_pass(cells, bulk, call, found, instead):
    with pytest.raises(ValueError, match="holds") as err:
        call(cells, bulk)
    assert found in str(err.value) and instead in str(err.value), str(err.value)


MISSING_KEY = [
    (lambda a, b: gpuc.get.nmf_top_genes(a, key="nope"), "consensus_nmf"),
    (lambda a, b: gpuc.get.nmf_gene_scores(a, key="nope"), "consensus_nmf"),
    (lambda a, b: gpuc.get.nmf_suggest_k(a, key="nope"), "nmf_k_sweep"),
    (lambda a, b: gpuc.get.deseq_results(b, key="nope"), "deseq"),
    (lambda a, b: gpuc.pl.metacells(a, key="nope", show=False), "metacells"),
    (lambda a, b: gpuc.pl.metacell_sizes(a, "nope", show=False), "metacell"),
    (lambda a, b: gpuc.pl.metacell_quality(a, "nope", show=False), "metacell_quality"),
    (lambda a, b: gpuc.pl.metacell_convergence(a, "nope", show=False), "metacells"),
    (lambda a, b: gpuc.pl.nmf_k_sweep(a, key="nope", show=False), "nmf_k_sweep"),
    (lambda a, b: gpuc.pl.nmf_density(a, key="nope", show=False), "consensus_nmf"),
    (lambda a, b: gpuc.pl.nmf_clustergram(a, key="nope", show=False), "consensus_nmf"),
    (lambda a, b: gpuc.pl.nmf_programs(a, key="nope", show=False), "consensus_nmf"),
    (lambda a, b: gpuc.pl.nmf_usage(a, key="nope", show=False), "consensus_nmf"),
    (lambda a, b: gpuc.pl.volcano(b, key="nope", show=False), "deseq"),
    (lambda a, b: gpuc.pl.ma(b, key="nope", show=False), "deseq"),
    (lambda a, b: gpuc.pl.dispersion(b, key="nope", show=False), "deseq"),
]


@pytest.mark.parametrize(("call", "tool"), MISSING_KEY, ids=[f"{i}" for i in range(len(MISSING_KEY))])
def test_missing_key_is_a_key_error_naming_the_tool(cells, bulk, call, tool):
    with pytest.raises(KeyError, match=tool):
        call(cells, bulk)


def test_message_names_the_keys_that_hold_the_tool(cells):
    a = cells.copy()
    a.uns["nmf7"] = a.uns["nmf"]
    with pytest.raises(ValueError, match=r"key='nmf', key='nmf7'"):
        gpuc.get.nmf_top_genes(a, key="metacell")
    # no consensus anywhere: the message says what to run
    b = cells.copy()
    del b.uns["nmf"]
    with pytest.raises(ValueError, match=r"Run gpuc\.tl\.consensus_nmf\(adata, k, key_added='metacell'\)"):
        gpuc.get.nmf_top_genes(b, key="metacell")
    # an entry no tool wrote
    b.uns["stuff"] = {"a": 1}
    with pytest.raises(ValueError, match="no gpuc tool wrote"):
        gpuc.pl.nmf_k_sweep(b, key="stuff", show=False)


def test_metacells_plot_needs_the_labels_of_its_run(cells):
    a = cells.copy()
    a.obs["metacell"] = a.obs["metacell"].astype(str)  # no longer the categorical labels the tool wrote
    with pytest.raises(KeyError, match="categorical labels"):
        gpuc.pl.metacells(a, show=False)


BAD_ARGS = [
    (lambda a, b, ax: gpuc.pl.nmf_programs(a, ax=ax[:1], show=False), ValueError, "at least 3 Axes"),
    (lambda a, b, ax: gpuc.pl.nmf_usage(a, ax=ax[:2], show=False), ValueError, "at least 3 Axes"),
    (lambda a, b, ax: gpuc.pl.nmf_usage(a, programs=[0, 1], ax=ax[:1], show=False), ValueError, "at least 2"),
    (lambda a, b, ax: gpuc.pl.nmf_k_sweep(a, ax=ax[:3], show=False), ValueError, "must hold 2 Axes"),
    (lambda a, b, ax: gpuc.pl.metacell_quality(a, ax=ax, show=False), ValueError, "one per panel"),
    (lambda a, b, ax: gpuc.pl.nmf_density(a, ax=ax[:2], show=False), ValueError, "must hold 1 Axes"),
    (lambda a, b, ax: gpuc.pl.volcano(b, ax="left", show=False), TypeError, "matplotlib Axes"),
    (lambda a, b, ax: gpuc.pl.nmf_usage(a, programs=[], show=False), ValueError, "programs is empty"),
    (lambda a, b, ax: gpuc.pl.nmf_usage(a, programs=[3], show=False), ValueError, "out of range"),
    (lambda a, b, ax: gpuc.pl.nmf_usage(a, programs=[-1], show=False), ValueError, "out of range"),
    (lambda a, b, ax: gpuc.pl.nmf_usage(a, programs=[1, 1], show=False), ValueError, "twice"),
    (lambda a, b, ax: gpuc.pl.nmf_usage(a, programs=["P1"], show=False), TypeError, "integer indices"),
    (lambda a, b, ax: gpuc.pl.nmf_usage(a, ncols=0, show=False), ValueError, "ncols=0"),
    (lambda a, b, ax: gpuc.pl.nmf_programs(a, ncols=0, show=False), ValueError, "ncols=0"),
    (lambda a, b, ax: gpuc.pl.nmf_usage(a, cmap="no_such_map", show=False), ValueError, "colour map"),
    (lambda a, b, ax: gpuc.pl.nmf_usage(a, size=0, show=False), ValueError, "size=0"),
    (lambda a, b, ax: gpuc.pl.nmf_density(a, bins=0, show=False), ValueError, "bins=0"),
    (lambda a, b, ax: gpuc.pl.nmf_density(a, threshold=-1, show=False), ValueError, "threshold"),
    (lambda a, b, ax: gpuc.pl.metacell_sizes(a, bins=0, show=False), ValueError, "bins=0"),
    (lambda a, b, ax: gpuc.pl.metacells(a, size=-2, show=False), ValueError, "size"),
    (lambda a, b, ax: gpuc.pl.volcano(b, alpha=1.5, show=False), ValueError, "alpha"),
    (lambda a, b, ax: gpuc.pl.volcano(b, lfc_threshold=-1, show=False), ValueError, "lfc_threshold"),
    (lambda a, b, ax: gpuc.pl.volcano(b, n_top=-1, show=False), ValueError, "n_top"),
    (lambda a, b, ax: gpuc.pl.ma(b, ylim=0, show=False), ValueError, "ylim"),
    (lambda a, b, ax: gpuc.pl.volcano(b, show="yes"), TypeError, "show"),
    (lambda a, b, ax: gpuc.pl.volcano(b, save="volcano.notaformat", show=False), ValueError, "cannot write"),
    (lambda a, b, ax: gpuc.pl.volcano(b, save="/no/such/folder/v.png", show=False), ValueError, "does not exist"),
    (lambda a, b, ax: gpuc.pl.volcano(b, save=3, show=False), TypeError, "save"),
]


@pytest.mark.parametrize(("call", "err", "match"), BAD_ARGS, ids=[f"{i}" for i in range(len(BAD_ARGS))])
def test_bad_plot_arguments_fail_before_drawing(cells, bulk, call, err, match):
    fig, axes = plt.subplots(1, 4)
    before = [len(a.get_children()) for a in axes]
    with pytest.raises(err, match=match):
        call(cells, bulk, list(axes))
    assert plt.get_fignums() == [fig.number]  # no figure of the plot's own left open
    assert [len(a.get_children()) for a in axes] == before  # nothing drawn into the given Axes
    plt.close(fig)


def test_a_plot_that_fails_while_drawing_closes_its_figure(bulk):
    b = bulk.copy()
    del b.var["deseq_dispFit"]
    with pytest.raises(KeyError, match="dispFit"):
        gpuc.pl.dispersion(b, show=False)
    assert plt.get_fignums() == []


def test_save_true_writes_scanpys_default_file(cells, bulk, tmp_path):
    saved = sc.settings.figdir, sc.settings.file_format_figs, sc.settings.plot_suffix
    sc.settings.figdir, sc.settings.file_format_figs, sc.settings.plot_suffix = tmp_path / "figures", "png", "_run1"
    try:
        gpuc.pl.volcano(bulk, save=True, show=False)
        gpuc.pl.nmf_k_sweep(cells, save=True, show=False)
    finally:
        sc.settings.figdir, sc.settings.file_format_figs, sc.settings.plot_suffix = saved
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == ["nmf_k_sweep_run1.png", "volcano_run1.png"]
    # a path is still a path, and save=False saves nothing
    out = tmp_path / "v.pdf"
    gpuc.pl.volcano(bulk, save=out, show=False)
    gpuc.pl.ma(bulk, save=False, show=False)
    assert out.stat().st_size > 0
    assert len(list(tmp_path.iterdir())) == 2
    plt.close("all")


def test_every_plot_fills_the_shared_docstring_parts():
    for name in gpuc.pl.__all__:
        doc = getattr(gpuc.pl, name).__doc__
        assert "{" not in doc.replace("{func}", ""), name
        assert "scanpy.settings.autoshow" in doc and "scanpy.settings.figdir" in doc, name
