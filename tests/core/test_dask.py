"""Independent units on a real dask.distributed LocalCluster (worker processes): same results in process, on one
worker and on two, whatever the placement; a killed worker costs only its tasks; a failed unit is named."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from anndata import AnnData

import gpuc

pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def clients(local_cluster):
    """A 1-worker and a 2-worker cluster (1 thread each, worker processes), as CI runs them."""
    with local_cluster(1) as one, local_cluster(2) as two:
        yield {1: one, 2: two}


def _embedding_groups(n_groups: int = 4, n_per: int = 120, seed: int = 0) -> AnnData:
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 4, (6, 8))
    x = centres[rng.integers(0, 6, n_groups * n_per)] + rng.normal(0, 1, (n_groups * n_per, 8))
    a = AnnData(np.zeros((x.shape[0], 1), dtype=np.float32))
    a.obsm["X_pca"] = x.astype(np.float32)
    a.obs["sample"] = pd.Categorical([f"s{i // n_per}" for i in range(x.shape[0])])
    return a


def _pseudobulk(seed: int = 0) -> AnnData:
    rng = np.random.default_rng(seed)
    n_genes = 150
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical(np.repeat(["B", "T/NK", "Mono"], 8)),
            "condition": pd.Categorical(np.tile(np.repeat(["ctrl", "stim"], 4), 3)),
        },
        index=[f"p{i}" for i in range(24)],
    )
    mu = rng.gamma(2, 50, n_genes)[None, :] * rng.uniform(0.7, 1.3, (24, 1))
    mu = mu * np.where((obs["condition"] == "stim").to_numpy()[:, None] & (np.arange(n_genes) < 20), 3.0, 1.0)
    counts = rng.negative_binomial(5, 5 / (5 + mu))
    return AnnData(counts.astype(np.int64), obs=obs, var=pd.DataFrame(index=[f"g{j}" for j in range(n_genes)]))


def _planted(n_cells: int = 200, n_genes: int = 60, *, sparse: bool, seed: int = 0) -> AnnData:
    rng = np.random.default_rng(seed)
    spectra = np.full((3, n_genes), 0.05)
    for j, block in enumerate(np.array_split(np.arange(n_genes), 3)):
        spectra[j, block] = rng.uniform(2, 6, block.size)
    usage = rng.dirichlet(np.full(3, 0.3), n_cells) * rng.uniform(20, 40, (n_cells, 1))
    counts = rng.poisson(usage @ spectra).astype(np.float32)
    a = AnnData(sp.csr_matrix(counts) if sparse else counts)
    a.var_names = [f"g{j}" for j in range(n_genes)]
    return a


def _three_ways(call, clients, same):
    """The tool's result in process, on 1 worker and on 2 workers: all identical (NaN equals NaN)."""
    results = [call(None), call(clients[1]), call(clients[2])]
    for got in results[1:]:
        same(got, results[0])
    return results[0]


def _drop_seconds(adata: AnnData, key: str) -> AnnData:
    """Wall times differ from run to run; every other output must be identical."""
    uns = adata.uns[key]
    uns.pop("seconds", None)
    uns.pop("timings", None)
    for entry in uns.get("groups", {}).values():
        entry.pop("seconds", None)
    return adata


def test_metacells_groups_identical_in_process_and_on_workers(clients, same):
    a = _embedding_groups()

    def call(client):
        out = gpuc.tl.metacells(a, 4, groupby="sample", max_iter=15, device="cpu", client=client, copy=True)
        return _drop_seconds(out, "metacell")

    out = _three_ways(call, clients, same)
    assert out.obs["metacell"].nunique() == 16


def test_deseq_groups_identical_in_process_and_on_workers(clients, same):
    pb = _pseudobulk()

    def call(client):
        return gpuc.tl.deseq(
            pb, "~condition", contrast=["condition", "stim", "ctrl"], groupby="cell_type", client=client, copy=True
        )

    out = _three_ways(call, clients, same)
    table = gpuc.get.deseq_results(out, group="T/NK")
    assert (table["padj"].to_numpy()[:20] < 0.1).mean() > 0.5  # the planted effect is found (at R's alpha)


def test_deseq_one_design_as_gene_blocks_on_workers(clients, same):
    """Without groupby the fit runs as gene-block tasks (tests/deseq/test_deseq_blocks.py covers many blocks)."""
    pb = _pseudobulk()

    def call(client):
        return gpuc.tl.deseq(
            pb, "~cell_type + condition", contrast=["condition", "stim", "ctrl"], client=client, copy=True
        )

    out = _three_ways(call, clients, same)
    assert (gpuc.get.deseq_results(out)["padj"].to_numpy()[:20] < 0.05).mean() > 0.5


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_nmf_sweep_and_consensus_identical_in_process_and_on_workers(clients, same, sparse):
    a = _planted(sparse=sparse)

    def sweep(client):
        out = gpuc.tl.nmf_k_sweep(a, [2, 3, 4], n_runs=4, mask_var=None, max_iter=60, client=client, copy=True)
        return _drop_seconds(out, "nmf_k_sweep")

    def consensus(client):
        out = gpuc.tl.consensus_nmf(a, 3, n_runs=6, mask_var=None, max_iter=60, client=client, copy=True)
        return _drop_seconds(out, "nmf")

    _three_ways(sweep, clients, same)
    out = _three_ways(consensus, clients, same)
    assert out.obsm["X_nmf"].shape == (a.n_obs, 3)


def test_settings_client_default_and_errors(clients, same):
    a = _pseudobulk()
    want = gpuc.tl.deseq(a, "~condition", groupby="cell_type", copy=True)
    with clients[2].as_current():
        got = gpuc.tl.deseq(a, "~condition", groupby="cell_type", client="default", copy=True)
    same(got, want)
    old = gpuc.settings.client
    try:
        gpuc.settings.client = clients[2]
        same(gpuc.tl.deseq(a, "~condition", groupby="cell_type", copy=True), want)
    finally:
        gpuc.settings.client = old
    with pytest.raises(TypeError, match=r"client must be a distributed\.Client"):
        gpuc.tl.deseq(a, "~condition", client=3)
    with pytest.raises(ValueError, match="client='nope' is not valid"):
        gpuc.tl.deseq(a, "~condition", client="nope")


def _fail_on_group(group_size: int):
    """Inside a worker: make every metacell fit of ``group_size`` cells raise (stands for a bug or a bad group)."""
    import gpuc.metacells._groups as tlm

    real = tlm.run_metacells

    def broken(backend, x, *args, **kwargs):
        if x.shape[0] == group_size:
            msg = "planted failure"
            raise RuntimeError(msg)
        return real(backend, x, *args, **kwargs)

    tlm._real_run_metacells = real
    tlm.run_metacells = broken


def _restore():
    import gpuc.metacells._groups as tlm

    tlm.run_metacells = getattr(tlm, "_real_run_metacells", tlm.run_metacells)


def test_failed_unit_names_the_group_and_leaves_adata_unchanged(clients, unchanged):
    a = _embedding_groups()
    a.obs["sample"] = pd.Categorical(np.r_[np.repeat(["s0", "s1", "s2"], 100), np.repeat(["bad"], 180)])
    client = clients[2]
    client.run(_fail_on_group, 180)
    try:
        with unchanged(a), pytest.raises(gpuc.DaskTaskError, match=r"metacells failed on group 'bad'.*planted"):
            gpuc.tl.metacells(a, 4, groupby="sample", max_iter=10, device="cpu", client=client)
    finally:
        client.run(_restore)


def test_killed_worker_costs_only_its_tasks(same, local_cluster, kill_busy_worker):
    """SIGKILL one worker process while its units run: Dask reruns them on the other (and the restarted) worker."""
    a = _embedding_groups(n_groups=6, n_per=300)

    def call(client):
        out = gpuc.tl.metacells(
            a, 6, groupby="sample", max_iter=25, min_iter=25, device="cpu", client=client, copy=True
        )
        return _drop_seconds(out, "metacell")

    want = call(None)
    with local_cluster(2) as client:
        with kill_busy_worker(client, settle=0.3):
            got = call(client)
        same(got, want)
