"""Issue 31, cluster faults (part): a closed Dask client is a clear error before anything runs; a unit that fails in
process is named in the error's notes, as a cluster names it, and keeps its exception type."""

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
