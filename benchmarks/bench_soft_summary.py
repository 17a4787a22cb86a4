"""Soft metacell summaries: ``gpuc.tl.aggregate_metacells(soft=True)`` against SEACells 0.3.3's
``summarize_by_soft_SEACell`` on the same soft assignments, in one process, CPU.

Needs SEACells 0.3.3 beside gpuc (``pip install -e . seacells==0.3.3 ipywidgets``)::

    python benchmarks/bench_soft_summary.py --cells 10000 --genes 2000 --repeats 3

The input is synthetic: Poisson counts (density ~10%) and soft assignments shaped like a fit's (each cell's weight
on 1 to 30 of ``cells / 75`` metacells, near ones favoured, rows summing to 1). Prints the medians and their ratio,
and the largest difference between the two results (relative to the largest value).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pandas as pd
import scipy.sparse as sp
from anndata import AnnData


def data(n: int, g: int, seed: int = 0) -> tuple[AnnData, sp.csr_matrix]:
    rng = np.random.default_rng(seed)
    counts = sp.random(n, g, density=0.1, format="csr", random_state=seed, data_rvs=lambda m: rng.poisson(3, m) + 1)
    k = max(2, round(n / 75))
    home = rng.integers(0, k, n)
    rows, cols, vals = [], [], []
    for i in range(n):
        m = int(rng.integers(1, 31))
        js = np.unique(np.clip(home[i] + rng.integers(-m, m + 1, m), 0, k - 1))
        w = rng.dirichlet(np.full(js.size, 0.5))
        rows += [i] * js.size
        cols += list(js)
        vals += list(w)
    weights = sp.csr_matrix((vals, (rows, cols)), shape=(n, k))
    ad = AnnData(X=counts.astype(np.float32), obs=pd.DataFrame(index=[f"c{i}" for i in range(n)]))
    ad.layers["counts"] = counts.astype(np.float32)
    return ad, weights


def main() -> None:
    import SEACells.core
    import tqdm

    import gpuc

    SEACells.core.tqdm = tqdm.tqdm  # SEACells' notebook progress bar needs a Jupyter front end (its issue #71)
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", type=int, default=10000)
    ap.add_argument("--genes", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    ad, weights = data(a.cells, a.genes)
    k = weights.shape[1]
    # the AnnData a gpuc.tl.metacells run leaves (only what aggregate_metacells reads)
    names = [f"SEACell-{j}" for j in range(k)]
    ad.obs["metacell"] = pd.Categorical(np.asarray(names)[np.asarray(weights.argmax(axis=1)).ravel()], categories=names)
    ad.obsm["metacell_weights"] = weights
    ad.uns["metacell"] = {"params": {"use_rep": "X_pca"}, "metacells": pd.DataFrame({"group": ""}, index=names)}

    def ours():
        return gpuc.tl.aggregate_metacells(ad, layer="counts", soft=True)

    def theirs():
        return SEACells.core.summarize_by_soft_SEACell(ad, weights.toarray().T, summarize_layer="counts")

    times = {}
    for name, f in (("gpuc", ours), ("SEACells", theirs)):
        f()  # warm
        t = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            out = f()
            t.append(time.perf_counter() - t0)
        times[name] = (statistics.median(t), out)
    g, s = times["gpuc"][1], times["SEACells"][1]
    keep = np.asarray(s.obs["Pseudo-sizes"] > 0)
    ref = np.asarray(s.X.toarray())[keep]
    diff = np.abs(g.X.toarray() - ref).max() / np.abs(ref).max()
    print(
        f"{a.cells} cells x {a.genes} genes, {k} metacells, {weights.nnz} weights: "
        f"gpuc {times['gpuc'][0]:.3f} s, SEACells {times['SEACells'][0]:.3f} s "
        f"({times['SEACells'][0] / times['gpuc'][0]:.0f}x), max rel. difference {diff:.1e}"
    )


if __name__ == "__main__":
    main()
