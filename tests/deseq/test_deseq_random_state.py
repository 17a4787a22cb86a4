"""``tl.deseq(random_state=)`` seeds R's simulated dispersion prior variance (designs with <= 3 residual degrees of
freedom); the default keeps earlier results and the seed is replayed from the stored params."""

from __future__ import annotations

import warnings

import anndata as ad
import numpy as np
import pandas as pd

import gpuc


def _few_replicates(seed: int = 0) -> ad.AnnData:
    rng = np.random.default_rng(seed)
    mean = rng.gamma(2.0, 60.0, 400)
    size = 1.0 / (0.2 * np.exp(rng.normal(0.0, 1.5, 400)))  # dispersions spread widely around their trend
    x = np.vstack([rng.negative_binomial(size, size / (size + f * mean)) for f in (1, 1, 1.6, 1.6)])
    a = ad.AnnData(x.astype(np.float64), obs=pd.DataFrame({"condition": ["a", "a", "b", "b"]}, index=list("pqrs")))
    a.var_names = [f"g{j}" for j in range(x.shape[1])]
    return a


def _run(a: ad.AnnData, key: str, **kw) -> None:
    kw = {"design": "~condition", "device": "cpu", **kw}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpuc.tl.deseq(a, key_added=key, **kw)


def test_seed_changes_only_the_simulated_prior_and_replays():
    a = _few_replicates()
    _run(a, "d2")
    _run(a, "s2", random_state=0)
    _run(a, "s7", random_state=7)
    default, same, other = (gpuc.get.deseq_results(a, key=k) for k in ("d2", "s2", "s7"))
    pd.testing.assert_frame_equal(default, same)  # 0 is the default
    assert a.uns["s7"]["params"]["random_state"] == 7
    # n - p = 2: the prior variance is simulated, so another seed moves the MAP dispersions a little
    assert not np.array_equal(default["log2FoldChange"].to_numpy(), other["log2FoldChange"].to_numpy())
    np.testing.assert_allclose(default["log2FoldChange"], other["log2FoldChange"], rtol=0.05, atol=0.05)
    again = a.copy()
    _run(again, "r7", **a.uns["s7"]["params"])
    pd.testing.assert_frame_equal(gpuc.get.deseq_results(again, key="r7"), other)
