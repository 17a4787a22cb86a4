"""Build a large multi-sample atlas on disk from the bundled pbmc3k counts, streamed, for the Dask benchmarks.

Every new cell is a real pbmc3k cell (its source, of the cell type the sample's composition asks for) whose counts
are resampled with biological noise:

    count ~ Poisson(source_count * L_s * g_sg * 2 ** (lfc_tg * [s treated]))

``L_s`` a per-sample library-size factor (log-normal, sd 0.25), ``g_sg`` a per-sample, per-gene log-normal factor
(sd ``--gene-sd``, mean 1: donor-to-donor variation, shared by the sample's cell types), ``lfc_tg`` the log2 fold
change of gene g in cell type t between the conditions (nonzero only for the true DE genes of a few cell types;
listed in ``uns["true_de"]``). Zeros of the source cell stay zero. Samples alternate between ``control`` and
``treated``; each sample's cell-type composition is drawn from a Dirichlet around pbmc3k's proportions
(concentration ``--concentration``). ``obsm["X_pca"]`` holds the source cell's 50 PCs (Scanpy: normalize_total,
log1p, 2,000 seurat HVGs, scale, PCA) plus Gaussian noise of 10% of each component's SD, float32, as a user's PCA of
these cells would look. Cells are stored sample by sample.

The counts are written one sample at a time (``anndata.io.write_elem`` then ``sparse_dataset(...).append`` on
resizable h5py datasets), so the matrix is never in memory: peak RSS stays near pbmc3k plus one sample.

    python benchmarks/atlas_build.py --cells 1000000 --samples 200 --out /work/atlas/atlas_1m.h5ad --seed 0
    python benchmarks/atlas_build.py --cells 20000 --samples 20 --out /work/atlas/atlas_20k.h5ad --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import scipy.sparse as sp

DE_TYPES = ("CD14+ Mono", "B", "Naive CD4 T")  # cell types with a condition effect
N_DE_PER_TYPE = 100
H5_CHUNK = 1 << 18  # elements per h5py chunk of data/indices


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def source_data(seed: int) -> dict:
    """pbmc3k cells with a cell type, their counts (CSR int32), cell-type codes, PCs and HVG flags."""
    import scanpy as sc

    import gpuc

    src = gpuc.datasets.pbmc3k()
    src = src[src.obs["cell_type"].notna()].copy()
    counts = sp.csr_matrix(src.layers["counts"], dtype=np.int32)
    counts.sort_indices()
    pp = ad.AnnData(X=counts.astype(np.float32), obs=src.obs[[]].copy(), var=src.var[[]].copy())
    sc.pp.normalize_total(pp, target_sum=1e4)
    sc.pp.log1p(pp)
    sc.pp.highly_variable_genes(pp, n_top_genes=2000, flavor="seurat")
    hvg = pp.var["highly_variable"].to_numpy()
    pp = pp[:, hvg].copy()
    pp.X = pp.X.toarray()  # 2,638 x 2,000: scale densifies anyway
    sc.pp.scale(pp, max_value=10)
    sc.pp.pca(pp, n_comps=50, random_state=seed)
    ct = src.obs["cell_type"].astype(str)
    types = np.array(sorted(ct.unique()))
    codes = np.searchsorted(types, ct.to_numpy())
    return {
        "counts": counts,
        "pcs": np.asarray(pp.obsm["X_pca"], dtype=np.float32),
        "types": types,
        "codes": codes,
        "hvg": hvg,
        "var": src.var.copy(),
    }


def plan(src: dict, n_cells: int, n_samples: int, seed: int, concentration: float, gene_sd: float) -> dict:
    """Per-sample composition, cells (source index), noise factors and the true DE genes (all small)."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0]))
    types, codes, counts = src["types"], src["codes"], src["counts"]
    n_types, n_genes = len(types), counts.shape[1]
    prop = np.bincount(codes, minlength=n_types) / codes.size
    # true DE genes: in each DE type, genes detected in >= 10% of its cells, half up, half down
    lfc = np.zeros((n_types, n_genes))
    rows = []
    for t in DE_TYPES:
        ti = int(np.searchsorted(types, t))
        sub = counts[codes == ti]
        frac = np.asarray((sub > 0).mean(axis=0)).ravel()
        cand = np.flatnonzero(frac >= 0.10)
        genes = np.sort(rng.choice(cand, size=min(N_DE_PER_TYPE, cand.size), replace=False))
        sign = np.where(rng.random(genes.size) < 0.5, -1.0, 1.0)
        mag = rng.uniform(0.5, 1.5, genes.size)
        lfc[ti, genes] = sign * mag
        rows += [(t, src["var"].index[g], int(g), float(v)) for g, v in zip(genes, sign * mag, strict=True)]
    true_de = pd.DataFrame(rows, columns=["cell_type", "gene", "gene_index", "log2fc"])
    # samples: equal sizes (remainder to the first ones), alternating conditions, Dirichlet compositions
    sizes = np.full(n_samples, n_cells // n_samples)
    sizes[: n_cells % n_samples] += 1
    treated = np.arange(n_samples) % 2 == 1
    comp = rng.dirichlet(concentration * prop, size=n_samples)
    lib = np.exp(rng.normal(0.0, 0.25, n_samples))
    by_type = [np.flatnonzero(codes == t) for t in range(n_types)]
    src_idx, cell_sample = [], []
    for s in range(n_samples):
        srng = np.random.default_rng(np.random.SeedSequence([seed, 1, s]))
        n_t = srng.multinomial(sizes[s], comp[s])
        # keep the cells of a sample grouped by type, then shuffled within the sample
        idx = np.concatenate([srng.choice(by_type[t], size=n_t[t], replace=True) for t in range(n_types)])
        src_idx.append(idx[srng.permutation(idx.size)])
        cell_sample.append(np.full(idx.size, s, dtype=np.int32))
    src_idx = np.concatenate(src_idx)
    cell_sample = np.concatenate(cell_sample)
    return {
        "sizes": sizes,
        "treated": treated,
        "comp": comp,
        "lib": lib,
        "lfc": lfc,
        "true_de": true_de,
        "src_idx": src_idx,
        "cell_sample": cell_sample,
        "gene_sd": gene_sd,
    }


def sample_counts(src: dict, pl: dict, s: int, seed: int) -> sp.csr_matrix:
    """The resampled counts of sample ``s`` (its cells x genes, CSR int32)."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 2, s]))
    counts, codes = src["counts"], src["codes"]
    n_genes = counts.shape[1]
    sd = pl["gene_sd"]
    g = np.exp(rng.normal(-0.5 * sd**2, sd, n_genes))  # mean-1 donor factor per gene
    fac = pl["lib"][s] * g[None, :] * (2.0 ** pl["lfc"] if pl["treated"][s] else np.ones_like(pl["lfc"]))
    idx = pl["src_idx"][pl["cell_sample"] == s]
    x = counts[idx]
    row_type = np.repeat(codes[idx], np.diff(x.indptr))
    lam = x.data * fac[row_type, x.indices]
    x = sp.csr_matrix((rng.poisson(lam).astype(np.int32), x.indices, x.indptr), shape=x.shape)
    x.eliminate_zeros()
    return x


def build(
    n_cells: int, n_samples: int, out: Path, seed: int, concentration: float = 200.0, gene_sd: float = 0.2
) -> dict:
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    src = source_data(seed)
    pl = plan(src, n_cells, n_samples, seed, concentration, gene_sd)
    types = src["types"]
    samples = np.array([f"S{s:03d}" for s in range(n_samples)])
    cs = pl["cell_sample"]
    obs = pd.DataFrame(
        {
            "sample": pd.Categorical(samples[cs], categories=samples),
            "condition": pd.Categorical(
                np.where(pl["treated"][cs], "treated", "control"), categories=["control", "treated"]
            ),
            "cell_type": pd.Categorical(types[src["codes"][pl["src_idx"]]], categories=types),
            "source_cell": pl["src_idx"].astype(np.int32),
        },
        index=pd.Index([f"c{i:07d}" for i in range(cs.size)]),
    )
    var = src["var"].copy()
    var["highly_variable"] = src["hvg"]
    rng = np.random.default_rng(np.random.SeedSequence([seed, 3]))
    pcs = src["pcs"]
    pca = pcs[pl["src_idx"]]
    pca += (0.1 * pcs.std(axis=0)[None, :] * rng.standard_normal(pca.shape)).astype(np.float32)
    params = {
        "n_cells": int(cs.size),
        "n_samples": int(n_samples),
        "seed": int(seed),
        "concentration": float(concentration),
        "gene_sd": float(gene_sd),
        "library_sd": 0.25,
        "de_types": list(DE_TYPES),
        "n_de_per_type": N_DE_PER_TYPE,
        "source": "gpuc.datasets.pbmc3k() (cells with a cell type)",
    }
    uns = {"atlas": {"params": params}, "true_de": pl["true_de"]}
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.unlink()
    # everything but X, then X streamed sample by sample
    ad.AnnData(obs=obs, var=var, obsm={"X_pca": pca}, uns=uns).write_h5ad(out)
    del pca
    t_meta = time.perf_counter() - t0
    nnz = 0
    with h5py.File(out, "a") as f:
        kw = {"chunks": (H5_CHUNK,)}  # anndata makes them resizable (maxshape=None)
        for s in range(n_samples):
            x = sample_counts(src, pl, s, seed)
            nnz += x.nnz
            if s == 0:
                x.indptr = x.indptr.astype(np.int64)
                ad.io.write_elem(f, "X", x, dataset_kwargs=kw)
                xd = ad.io.sparse_dataset(f["X"])
            else:
                xd.append(x)
            if s % max(1, n_samples // 10) == 0:
                print(
                    f"  sample {s + 1}/{n_samples}: {x.shape[0]} cells, nnz so far {nnz:,}, "
                    f"{time.perf_counter() - t0:.1f} s, peak RSS {_peak_rss_gb():.2f} GB",
                    flush=True,
                )
        assert xd.shape == (cs.size, var.shape[0])
    wall = time.perf_counter() - t0
    info = {
        "out": str(out),
        "shape": [int(cs.size), int(var.shape[0])],
        "nnz": int(nnz),
        "file_bytes": out.stat().st_size,
        "n_true_de": len(pl["true_de"]),
        "wall_s": round(wall, 2),
        "metadata_s": round(t_meta, 2),
        "peak_rss_gb": round(_peak_rss_gb(), 3),
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg(),
        "params": params,
    }
    return info


def check(path: Path) -> dict:
    """Read the atlas back lazily and compare a few rows' sums with an eager read of the same rows."""
    t0 = time.perf_counter()
    try:  # read_lazy reads obs/var as xarray Datasets and needs xarray
        lazy = repr(ad.experimental.read_lazy(path)).splitlines()[0]
    except ImportError as err:
        lazy = f"not available: {err}"
    with h5py.File(path, "r") as f:
        x = ad.experimental.read_elem_lazy(f["X"])
        n = x.shape[0]
        rows = np.r_[0 : min(1000, n)]
        head = x[: rows.size].compute()
        direct = ad.io.sparse_dataset(f["X"])[: rows.size]
        assert (head != direct).nnz == 0
        obs = ad.io.read_elem(f["obs"])
        pca = f["obsm/X_pca"]
        info = {
            "read_lazy": lazy,
            "X_lazy": repr(x),
            "X_dtype": str(direct.dtype),
            "X_pca": [list(pca.shape), str(pca.dtype)],
            "cell_types": obs["cell_type"].value_counts().to_dict(),
            "cells_per_sample_median": float(obs["sample"].value_counts().median()),
            "first_rows_total_count": int(head.sum()),
            "check_s": round(time.perf_counter() - t0, 2),
        }
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", type=int, default=1_000_000)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path("/work/atlas/atlas_1m.h5ad"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concentration", type=float, default=200.0, help="Dirichlet concentration of compositions")
    p.add_argument("--gene-sd", type=float, default=0.2, help="sd of the per-sample per-gene log-normal factor")
    p.add_argument("--no-check", action="store_true")
    a = p.parse_args()
    info = build(a.cells, a.samples, a.out, a.seed, a.concentration, a.gene_sd)
    if not a.no_check:
        info["check"] = check(a.out)
    print(json.dumps(info, indent=1, default=str))


if __name__ == "__main__":
    main()
