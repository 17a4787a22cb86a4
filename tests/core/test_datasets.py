from __future__ import annotations

import numpy as np
import scipy.sparse as sp

import gpuc


def test_pbmc3k_is_raw_counts_with_labels() -> None:
    adata = gpuc.datasets.pbmc3k()
    assert adata.shape == (2700, 13714)
    assert sp.issparse(adata.X) and np.issubdtype(adata.X.dtype, np.integer)
    assert (adata.X.data > 0).all()
    assert (np.asarray((adata.X > 0).sum(axis=0)).ravel() >= 3).all()
    counts = adata.obs["cell_type"].value_counts()
    assert counts["Naive CD4 T"] == 697 and counts["Platelet"] == 14
    assert adata.obs["cell_type"].isna().sum() == 62
    assert "counts" in adata.layers


def test_pasilla_is_samples_by_genes() -> None:
    pb = gpuc.datasets.pasilla()
    assert pb.shape == (7, 14599)
    assert list(pb.obs_names[:2]) == ["untreated1", "untreated2"]
    assert list(pb.obs["condition"].cat.categories) == ["untreated", "treated"]
    assert pb.obs["condition"].value_counts().to_dict() == {"untreated": 4, "treated": 3}
    assert pb.X.dtype == np.int64 and pb.X.min() >= 0
    assert pb["treated1", "FBgn0000008"].X.item() == 140
