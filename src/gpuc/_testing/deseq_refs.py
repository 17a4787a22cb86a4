"""Loaders of the DESeq2 reference sets that the tests and ``benchmarks/deseq_vs_r.py`` compare ``gpuc.tl.deseq``
with: PyDESeq2's test sets (R DESeq2 1.38.3 intermediates beside them), the R sets made by
``tests/data/deseq/r_sets/*/make_reference.R`` and airway (R's per-gene output in the shared data folder).

Each loader returns the counts as an AnnData (samples x genes, int64 counts, the metadata as ``obs``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd

# PyDESeq2's test cases: the design each is fitted with (R's 1.38.3 intermediates were made with these)
PYDESEQ2_DESIGNS = {
    "single_factor": "~condition",
    "single_factor_meanfit": "~condition",
    "multi_factor": "~group + condition",
    "continuous": "~group + condition + measurement",
    "wide": "~group + condition",
    "large_counts": "~condition",
}
DISPERSION_COLUMNS = ["dispGeneEst", "dispFit", "dispMAP", "dispersion"]


def _as_adata(counts: pd.DataFrame, meta: pd.DataFrame) -> ad.AnnData:
    """Samples x genes counts and their metadata (rows matched by sample name) as an AnnData."""
    a = ad.AnnData(X=counts.to_numpy().astype(np.int64), obs=meta.loc[counts.index].copy())
    a.var_names = counts.columns.astype(str)
    return a


def pydeseq2_counts_and_metadata(refs: Path, case: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Samples x genes counts and sample metadata of a PyDESeq2 test case under ``refs`` (``tests/data/deseq/refs``)."""
    if case in ("single_factor", "single_factor_meanfit", "multi_factor"):
        c = pd.read_csv(refs / "synthetic" / "test_counts.csv.gz", index_col=0).T
        m = pd.read_csv(refs / "synthetic" / "test_metadata.csv.gz", index_col=0)
    elif case == "large_counts":
        c = pd.read_csv(refs / "large_counts" / "test_counts_from_inline_test.csv.gz", index_col=0)
        m = pd.read_csv(refs / "large_counts" / "test_metadata_from_inline_test.csv.gz", index_col=0)
        if c.shape[0] != m.shape[0]:
            c = c.T
    else:
        c = pd.read_csv(refs / case / "test_counts.csv.gz", index_col=0).T
        m = pd.read_csv(refs / case / "test_metadata.csv.gz", index_col=0)
    return c, m


def pydeseq2_case(refs: Path, case: str) -> ad.AnnData:
    """A PyDESeq2 test case's counts as an AnnData."""
    return _as_adata(*pydeseq2_counts_and_metadata(refs, case))


def pydeseq2_contrast(case: str) -> Any:
    """The contrast R's 1.38.3 intermediates of a PyDESeq2 case were made with."""
    return "measurement" if case == "continuous" else ["condition", "B", "A"]


def r_set(folder: Path) -> tuple[ad.AnnData, dict, pd.DataFrame]:
    """An R set made by its ``make_reference.R``: the counts, its ``spec.json`` (design, contrast, categorical levels,
    tl.deseq keywords) and R's per-gene output (``gene_fit.csv.gz``).
    """
    spec = json.loads((folder / "spec.json").read_text())
    c = pd.read_csv(folder / "counts.csv.gz", index_col=0)  # genes x samples
    m = pd.read_csv(folder / "metadata.csv", index_col=0)
    for k in spec.get("categorical", []):
        m[k] = pd.Categorical(m[k].astype(str), categories=spec["levels"][k])
    ref = pd.read_csv(folder / "gene_fit.csv.gz", index_col=0, skipinitialspace=True, na_values=["NA"])
    return _as_adata(c.T, m), spec, ref


AIRWAY_DESIGNS = {"dex": "~dex", "cell_dex": "~cell + dex"}


def airway(shared: Path) -> ad.AnnData:
    """Airway's counts from the shared data folder, ``dex`` (untrt the reference) and ``cell`` as R's factors."""
    base = shared / "bulk" / "airway"
    counts = pd.read_csv(base / "counts.csv", index_col=0)
    meta = pd.read_csv(base / "metadata.csv", index_col=0)
    meta["dex"] = pd.Categorical(meta["dex"], ["untrt", "trt"])
    meta["cell"] = pd.Categorical(meta["cell"])
    a = ad.AnnData(X=counts.T.to_numpy(), obs=meta.loc[counts.columns])
    a.var_names = counts.index
    return a


def airway_reference(shared: Path, tag: str) -> pd.DataFrame:
    """R's per-gene dispersions and results on airway for the design ``AIRWAY_DESIGNS[tag]``."""
    d = shared / "bulk" / "airway" / "deseq2_R_reference"
    g = pd.read_csv(d / f"gene_fit_{tag}.csv.gz", index_col=0)
    r = pd.read_csv(d / f"results_{tag}.csv.gz", index_col=0)
    return g[DISPERSION_COLUMNS].join(r)
