"""The NMF k sweep on a Dask cluster: the plan of one unit per worker, the same table as in process, the data
scattered once under keys of its own."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.sparse as sp
from anndata import AnnData

import gpuc
from gpuc._dask import map_units, scattered
from gpuc.nmf._run import SPLIT_SLACK, owned_ranks, plan_units, unit_cost

distributed = pytest.importorskip("distributed")

SPARSE, DENSE = SimpleNamespace(sparse=True), SimpleNamespace(sparse=False)


def _covered(units, ks, n_runs):
    """Every restart of every rank exactly once, in contiguous run ranges."""
    seen = {k: [] for k in ks}
    for u in units:
        for k, r in u:
            assert r.step == 1 and len(r) > 0
            seen[k] += list(r)
    assert all(sorted(v) == list(range(n_runs)) for v in seen.values())


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 8])
def test_plan_one_balanced_unit_per_worker(workers):
    ks, n_runs = list(range(2, 13)), 20
    units = plan_units(SPARSE, ks, n_runs, workers)
    _covered(units, ks, n_runs)
    assert len(units) == workers
    loads = [sum(unit_cost(k, len(r)) for k, r in u) for u in units]
    share = sum(unit_cost(k, n_runs) for k in ks) / workers
    assert max(loads) <= share * (1 + SPLIT_SLACK) + unit_cost(max(ks), 1)
    if workers == 1:  # one task fitting every rank together, as in process
        assert units == [[(k, range(n_runs)) for k in sorted(ks, reverse=True)]]
    if workers == 2:  # the three costliest ranks in halves, the others whole (their consensus runs in the unit)
        assert set().union(*owned_ranks(units, n_runs)) == set(range(2, 10))
        assert [[(k, r) for k, r in u if k >= 10] for u in units] == [
            [(k, range(0, 10)) for k in (12, 11, 10)],
            [(k, range(10, 20)) for k in (12, 11, 10)],
        ]


def test_plan_splits_only_sparse_ranks():
    # one rank on two workers: its runs split in two on sparse data, kept whole on dense data (BLAS widths)
    assert plan_units(SPARSE, [7], 20, 2) == [[(7, range(0, 10))], [(7, range(10, 20))]]
    assert plan_units(DENSE, [7], 20, 2) == [[(7, range(20))]]
    dense = plan_units(DENSE, range(2, 13), 20, 3)
    _covered(dense, list(range(2, 13)), 20)
    assert all(len(r) == 20 for u in dense for _, r in u)
    assert len(plan_units(DENSE, [3, 4], 5, 8)) == 2  # no empty units


@pytest.fixture(scope="module")
def client():
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0")
    c = distributed.Client(cluster, set_as_default=False)
    yield c
    c.close()
    cluster.close()


def _planted(n_cells: int = 160, n_genes: int = 50, seed: int = 0) -> AnnData:
    rng = np.random.default_rng(seed)
    spectra = np.full((3, n_genes), 0.05)
    for j, block in enumerate(np.array_split(np.arange(n_genes), 3)):
        spectra[j, block] = rng.uniform(2, 6, block.size)
    usage = rng.dirichlet(np.full(3, 0.3), n_cells) * rng.uniform(20, 40, (n_cells, 1))
    a = AnnData(sp.csr_matrix(rng.poisson(usage @ spectra).astype(np.float32)))
    a.var_names = [f"g{j}" for j in range(n_genes)]
    return a


@pytest.mark.filterwarnings("ignore::gpuc.ConvergenceWarning")
@pytest.mark.parametrize(
    ("ks", "whole"),
    # ranks spread over both units (their rows as extra tasks) beside ranks kept whole; every rank split
    [(list(range(2, 9)), {2, 3, 4}), ([2, 8], set())],
    ids=["mixed", "all-split"],
)
def test_sweep_on_two_workers_equals_in_process(client, ks, whole):
    a = _planted()
    assert set().union(*owned_ranks(plan_units(SPARSE, ks, 4, 2), 4)) == whole
    kw = {"n_runs": 4, "mask_var": None, "max_iter": 60, "random_state": 3, "copy": True}
    want = gpuc.tl.nmf_k_sweep(a, ks, **kw).uns["nmf_k_sweep"]
    got = gpuc.tl.nmf_k_sweep(a, ks, client=client, **kw).uns["nmf_k_sweep"]
    for col in want["table"].columns:
        np.testing.assert_array_equal(got["table"][col].to_numpy(), want["table"][col].to_numpy(), err_msg=col)
    assert got["suggested_k"] == want["suggested_k"]


def _dot(v, *, data, n_jobs):
    return float(data @ v)


def test_scattered_data_have_keys_of_their_own(client):
    x = np.arange(1000.0)
    with scattered(client, {"data": x}) as first, scattered(client, {"data": x}) as second:
        assert first["data"].future.key != second["data"].future.key  # the same data, two copies: no shared key
        # a dict (the options every unit takes) is scattered whole under a random key, not one key per entry
        with (
            scattered(client, {"options": {"random_state": 0}}) as opts,
            scattered(client, {"o": {"random_state": 0}}) as again,
        ):
            assert opts["options"].future.key != again["o"].future.key
            assert "random_state" not in (opts["options"].future.key, again["o"].future.key)
            assert opts["options"].future.result() == {"random_state": 0}
        # calls at once on the same data, two with scatters of their own and two reusing the handles: none cancels
        # another's copy
        out = {}

        def call(name, shared):
            out[name] = map_units(_dot, [("", (x,))], client=client, shared=shared, what=name)

        calls = {"a": {"data": x}, "b": {"data": x}, "c": first, "d": second}
        threads = [threading.Thread(target=call, args=item) for item in calls.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert out == {name: [float(x @ x)] for name in calls}
        assert first["data"].future.status == "finished"  # the handle outlives the calls that used it
    assert first["data"].future.status == "cancelled"  # and is released with its `with`
    assert map_units(_dot, [("", (x,))], client=None, shared=first) == [float(x @ x)]  # in process: the value
