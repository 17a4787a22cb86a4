"""Simulated negative-binomial counts for the DESeq2 benchmarks (a PyDESeq2/DESeq2-style simulation)."""

from __future__ import annotations

import numpy as np
import pandas as pd


def simulate(n_samples: int, n_genes: int, seed: int = 0) -> tuple[np.ndarray, pd.DataFrame, np.ndarray]:
    """Counts (samples x genes, int64), metadata (condition A/B balanced) and the true log2 fold changes.

    log2 base mean ~ N(4, 2); 10% of genes DE with log2FC ~ N(0, 1); dispersion 0.1 + 4/mu; size factors
    lognormal(0, 0.2); numpy default_rng(seed).
    """
    rng = np.random.default_rng(seed)
    base = 2.0 ** rng.normal(4, 2, n_genes)
    de = rng.random(n_genes) < 0.1
    lfc = np.where(de, rng.normal(0, 1, n_genes), 0.0)
    cond = np.repeat(["A", "B"], [n_samples // 2, n_samples - n_samples // 2])
    sf = np.exp(rng.normal(0, 0.2, n_samples))
    mu = sf[:, None] * base[None, :] * 2.0 ** (np.outer(cond == "B", lfc))
    disp = 0.1 + 4.0 / base
    counts = rng.negative_binomial(1.0 / disp[None, :], 1.0 / (1.0 + mu * disp[None, :]))
    meta = pd.DataFrame({"condition": cond}, index=[f"s{i + 1}" for i in range(n_samples)])
    return counts.astype(np.int64), meta, lfc
