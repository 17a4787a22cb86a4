"""On pbmc3k, the programmes at the suggested k are named by canonical cell-type markers in their top score genes
(cNMF's gene spectra score over every gene, markers outside the highly variable genes included).

Settings (those of tutorials/consensus_nmf.ipynb): Seurat-tutorial QC cells, 2,000 highly variable genes
(``sc.pp.highly_variable_genes`` on log-normalised data), cNMF's input (raw counts of those genes, each divided by its
SD without centring: ``layer="counts", preprocessing="sd"``), Euclidean metric; a sweep over k = 2..12 with 10 runs
each, then the consensus at the suggested k with 20 runs and density threshold 0.5.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpuc
from gpuc._demo import pbmc3k_hvg

# canonical markers (Seurat's pbmc3k tutorial, plus the usual T-cell genes)
MARKERS = {
    "T": {"CD3E", "CD3D", "IL7R", "CCR7", "LTB", "IL32", "CD2", "CD8A", "LDHB"},
    "monocyte": {"CD14", "LYZ", "FCGR3A", "MS4A7", "S100A8", "S100A9", "CST3", "FCN1"},
    "B": {"MS4A1", "CD79A", "CD79B", "TCL1A"},
    "NK": {"NKG7", "GNLY", "GZMB", "PRF1"},
    "platelet": {"PPBP", "PF4", "GP9", "ITGA2B", "GP1BA", "TUBB1", "GNG11", "SDPR"},
}


def _named(top) -> dict[str, str]:
    """Programme -> the cell type with the most markers in its top genes (programmes naming none, or two types
    equally, are left out; FCGR3A, CD16, is a monocyte marker that NK cells express too).
    """
    out = {}
    for p, genes in top.items():
        hits = {t: len(m & set(genes)) for t, m in MARKERS.items()}
        best = max(hits.values())
        if best and sum(v == best for v in hits.values()) == 1:
            out[p] = max(hits, key=hits.get)
    return out


@pytest.mark.slow
def test_pbmc3k_programmes_name_cell_types():
    adata = pbmc3k_hvg()
    opts = {"layer": "counts", "preprocessing": "sd", "metric": "euclidean"}
    gpuc.tl.nmf_k_sweep(adata, range(2, 13), n_runs=10, **opts)
    k = gpuc.get.nmf_suggest_k(adata)
    assert k == 5
    gpuc.tl.consensus_nmf(adata, k, n_runs=20, density_threshold=0.5, **opts)
    top = gpuc.get.nmf_top_genes(adata, 50, wide=True)  # cNMF's gene spectra score, over every gene
    by_score = _named(top)
    by_weight = _named(gpuc.get.nmf_top_genes(adata, 10, by="weight", wide=True))
    # the 5 programmes name 5 different cell types (the T-cell programme's first genes are ribosomal genes, which
    # T cells express more than the others; its markers follow: CD3D, CD3E, IL7R within its top 50)
    assert set(by_score.values()) == {"T", "monocyte", "B", "NK", "platelet"}, by_score
    # markers that sc.pp.highly_variable_genes left out, so never factorised, still reach their programme's top 50
    hvg = adata.var["highly_variable"]
    outside = {"T": ["CD3D", "CD3E", "IL7R"], "monocyte": ["CD14"]}
    for cell_type, genes in outside.items():
        prog = next(p for p, t in by_score.items() if t == cell_type)
        for gene in genes:
            assert not hvg[gene] and gene in set(top[prog]), (gene, prog)
    # the spectra weights (factorised genes only) name at most 3 in their top 10: ribosomal genes, MALAT1 and FTL
    # lead the T-cell and monocyte programmes
    assert len(by_weight) <= 3, by_weight
    # the cells of each named type use that programme most
    usage = adata.obsm["X_nmf"] / adata.obsm["X_nmf"].sum(1, keepdims=True)
    main = np.asarray([f"P{i + 1}" for i in usage.argmax(1)])
    types = adata.obs["cell_type"].astype(str).to_numpy()
    for cell_type, cells in (("B", "B"), ("NK", "NK"), ("monocyte", "CD14+ Mono"), ("T", "Naive CD4 T")):
        prog = next(p for p, t in by_score.items() if t == cell_type)
        assert (main[types == cells] == prog).mean() > 0.8, (cell_type, prog)
