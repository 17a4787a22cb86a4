"""Fixtures for the DESeq2 tests: small simulated negative-binomial bulk data."""

from __future__ import annotations

from collections.abc import Callable

import anndata as ad
import numpy as np
import pandas as pd
import pytest


def _sim(n_per: int = 4, n_genes: int = 300, seed: int = 0, levels: tuple[str, ...] = ("A", "B")) -> ad.AnnData:
    rng = np.random.default_rng(seed)
    n = n_per * len(levels)
    mean = 2 ** rng.normal(5, 2, n_genes)
    lfc = np.where(rng.random(n_genes) < 0.2, rng.normal(0, 2, n_genes), 0.0)
    cond = np.repeat(levels, n_per)
    grp = np.tile(["X", "Y"], n // 2)
    sf = np.exp(rng.normal(0, 0.2, n))
    mu = sf[:, None] * mean[None, :] * 2 ** (np.outer(cond != levels[0], lfc))
    disp = 0.05 + 2 / mean
    counts = rng.negative_binomial(1 / disp, 1 / (1 + mu * disp))
    obs = pd.DataFrame(
        {"condition": pd.Categorical(cond, list(levels)), "batch": grp, "x": rng.normal(size=n)},
        index=[f"s{i}" for i in range(n)],
    )
    return ad.AnnData(X=counts.astype(np.int64), obs=obs, var=pd.DataFrame(index=[f"g{j}" for j in range(n_genes)]))


@pytest.fixture(scope="session")
def sim_bulk() -> Callable[..., ad.AnnData]:
    """Factory ``sim_bulk(n_per=4, n_genes=300, seed=0, levels=("A", "B"))``: a fresh samples x genes AnnData of
    integer NB counts, ``n_per`` samples per ``condition`` level, about 20% of genes changed against the first level;
    obs also has ``batch`` (X/Y alternating) and a continuous ``x``."""
    return _sim
