"""Issue 31, cluster faults: a closed Dask client is a clear error before anything runs; a unit that fails in process
is named in the error's notes, as a cluster names it, and keeps its exception type; units lost with a killed worker
(their scattered data gone) are resubmitted from the client and give the in-process result."""

from __future__ import annotations

import anndata as ad
import numpy as np
import pandas as pd
import pytest

import gpuc
from gpuc._dask import map_units

distributed = pytest.importorskip("distributed")


def _bulk() -> ad.AnnData:
    rng = np.random.default_rng(0)
    counts = rng.negative_binomial(5, 0.05, (16, 30)).astype(np.int64)
    obs = pd.DataFrame(
        {"c": pd.Categorical(np.tile(np.repeat(["A", "B"], 4), 2)), "g": np.repeat(["g1", "g2"], 8)},
        index=[f"s{i}" for i in range(16)],
    )
    return ad.AnnData(counts, obs=obs)


def test_closed_client_is_a_clear_error(unchanged):
    client = distributed.Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=":0")
    client.close()
    a = _bulk()
    with unchanged(a), pytest.raises(RuntimeError, match=r"the Dask client is closed.*client=None"):
        gpuc.tl.deseq(a, "~c", groupby="g", client=client, device="cpu")


def _fails_on_two(x: int, *, n_jobs: int | None = None) -> int:
    if x == 2:
        msg = "no fit"
        raise ValueError(msg)
    return x


def test_in_process_failure_names_the_unit():
    with pytest.raises(ValueError, match="no fit") as info:
        map_units(_fails_on_two, [(f"group {x!r}", (x,)) for x in (1, 2, 3)], client=None, what="demo")
    assert "demo failed on group 2." in getattr(info.value, "__notes__", [])


def _groups(n_groups: int = 3, n_per: int = 300) -> ad.AnnData:
    rng = np.random.default_rng(0)
    x = np.vstack([rng.normal(3 * g, 1, (n_per, 5)) for g in range(n_groups)])
    a = ad.AnnData(np.zeros((x.shape[0], 2), dtype=np.float32))
    a.obsm["X_pca"] = x
    a.obs["sample"] = np.repeat([f"s{g}" for g in range(n_groups)], n_per)
    return a


def _without_seconds(a: ad.AnnData) -> ad.AnnData:
    uns = a.uns["metacell"]
    uns.pop("seconds")
    for entry in uns["groups"].values():
        entry.pop("seconds")
    return a


def test_units_lost_with_the_only_worker_are_resubmitted(same, local_cluster, kill_busy_worker):
    """SIGKILL the single worker process while it fits: its scattered data are gone with it; the units are
    resubmitted from the client (a warning says so) and the result is the in-process one."""
    a = _groups()
    kw = {"groupby": "sample", "max_iter": 25, "min_iter": 25, "device": "cpu", "copy": True}
    want = _without_seconds(gpuc.tl.metacells(a, 6, **kw))
    with local_cluster(1) as client:
        with kill_busy_worker(client, settle=0.3), pytest.warns(gpuc.GpucWarning, match="lost .* resubmitted"):
            got = gpuc.tl.metacells(a, 6, client=client, **kw)
        same(_without_seconds(got), want)
