"""Simulated count data shared by the tests and the benchmarks."""

from __future__ import annotations

from typing import Any

import numpy as np


def near_poisson_counts(n_genes: int, seed: int, n: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Samples x genes Poisson counts (technical replicates: no overdispersion, so DESeq2's parametric dispersion
    trend fails and R's local fit takes over) and each sample's group (0 or 1, ``n // 2`` each).

    Means ``2 ** U(0, 10)``, size factors ``exp(N(0, 0.1))``, 10% of genes changed by a log2 fold change ``N(0, 1)``
    in group 1; numpy ``default_rng(seed)``.
    """
    rng = np.random.default_rng(seed)
    mean = 2 ** rng.uniform(0, 10, n_genes)
    sf = np.exp(rng.normal(0, 0.1, n))
    cond = np.repeat([0, 1], n // 2)
    lfc = np.where(rng.random(n_genes) < 0.1, rng.normal(0, 1, n_genes), 0.0)
    y = rng.poisson(sf[:, None] * mean[None, :] * 2 ** np.outer(cond, lfc))
    return y, cond


def near_poisson_adata(n_genes: int = 2000, seed: int = 1, n: int = 10) -> Any:
    """:func:`near_poisson_counts` as an AnnData (int64 ``X``; ``obs["condition"]``: ``"A"`` for group 0, ``"B"``
    for group 1; samples ``s0, s1, ...``, genes ``g0, g1, ...``).
    """
    import anndata as ad
    import pandas as pd

    y, cond = near_poisson_counts(n_genes, seed, n)
    obs = pd.DataFrame({"condition": pd.Categorical(np.where(cond == 1, "B", "A"))}, index=[f"s{i}" for i in range(n)])
    a = ad.AnnData(X=y.astype(np.int64), obs=obs)
    a.var_names = [f"g{j}" for j in range(n_genes)]
    return a
