"""Writes pbmc_cd14_counts.csv.gz / pbmc_cd14_metadata.csv, the input of make_reference.R (and of
tests/deseq/test_prefit.py, which rebuilds it and checks it is the same):

    PYTHONPATH=src python tests/data/deseq/prefit/make_pbmc_pseudobulk.py tests/data/deseq/prefit

pbmc3k (one donor) has no replicates, so its CD14+ monocytes are split at random (numpy default_rng(0)) into 24
pseudo-donors, d00-d11 labelled "ctrl" and d12-d23 "stim", and summed per donor with gpuc.tl.pseudobulk; genes with
no count in any profile are left out (they change neither filterByExpr nor rlog).
"""

import sys
from pathlib import Path

import numpy as np
import pandas as pd

import gpuc


def pbmc_cd14_pseudobulk():
    cells = gpuc.datasets.pbmc3k()
    cells = cells[cells.obs["cell_type"] == "CD14+ Mono"].copy()
    rng = np.random.default_rng(0)
    donor = rng.integers(0, 24, cells.n_obs)
    cells.obs["donor"] = pd.Categorical([f"d{i:02d}" for i in donor])
    cells.obs["group"] = pd.Categorical(np.where(donor < 12, "ctrl", "stim"))
    return cells, gpuc.tl.pseudobulk(cells, "donor", layer="counts", min_cells=1)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    _, pb = pbmc_cd14_pseudobulk()
    pb = pb[:, np.asarray(pb.X.sum(axis=0)).ravel() > 0]
    pd.DataFrame(pb.X.T, index=pb.var_names, columns=pb.obs_names).rename_axis("gene_id").to_csv(
        out / "pbmc_cd14_counts.csv.gz"
    )
    pb.obs[["group", "psbulk_cells", "psbulk_counts"]].rename_axis("sample").to_csv(out / "pbmc_cd14_metadata.csv")
