from __future__ import annotations

from collections.abc import Callable
from importlib.resources import files
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd

_DATA = files("gpuc.datasets") / "data"


def _read(name: str, reader: Callable[..., Any], **kwargs: Any) -> Any:
    """``reader`` on the bundled file ``data/<name>`` (opened as a binary file, so it also works from a zip)."""
    with (_DATA / name).open("rb") as fh:
        return reader(fh, **kwargs)


def pbmc3k() -> ad.AnnData:
    """2,700 PBMCs from a healthy donor (10x Genomics), raw UMI counts with cell-type labels.

    The 13,714 genes detected in at least 3 cells (of 32,738) are kept; counts are unchanged (int32 CSR, cells x
    genes; the total count of the kept genes is that of ``scanpy.datasets.pbmc3k()`` less the genes dropped).

    Returns
    -------
    AnnData with

    ``X``
        Raw integer UMI counts (``scipy.sparse.csr_matrix``, int32).
    ``obs['cell_type']``
        Seurat v3 pbmc3k-tutorial annotation (9 types; NaN for the 62 cells removed by that tutorial's QC).
    ``obs['passed_seurat_qc']``, ``obs['seurat_clusters']``, ``obs['total_counts']``, ``obs['n_genes_by_counts']``
        Tutorial QC flag and clusters; totals recomputed from the full counts.
    ``var['gene_ids']``, ``var['gene_symbols']``
        Ensembl IDs and original symbols; ``var_names`` are unique symbols as in Scanpy.
    ``obsm['X_umap_seurat']``
        The Seurat tutorial's UMAP.

    Notes
    -----
    Provenance: 10x Genomics "3k PBMCs from a Healthy Donor" (Cell Ranger 1.1.0, hg19), licensed CC BY 4.0. Counts
    from GitHub ``Fred-Hutch-Innovation-Lab/FHIL.SC.utils`` (``data/pbmc3k.rda``, MIT), gene IDs from
    ``Amartya101/PBMC3k_Data``, labels from ``rnabioco/clustifyr`` (``data/pbmc_meta.rda``, MIT).

    Examples
    --------
    >>> import gpuc
    >>> adata = gpuc.datasets.pbmc3k()
    >>> adata.shape
    (2700, 13714)
    """
    adata = _read("pbmc3k_counts.h5ad", ad.read_h5ad)
    adata.layers["counts"] = adata.X.copy()
    return adata


def pasilla() -> ad.AnnData:
    """Pasilla RNAi bulk RNA-seq (Brooks et al. 2011), 7 samples x 14,599 genes of raw read counts.

    Returns
    -------
    AnnData (samples x genes) with

    ``X``
        Integer read counts (``numpy.ndarray``, int64).
    ``obs['condition']``
        ``'untreated'`` (reference, 4 samples) or ``'treated'`` (3 samples), a categorical.
    ``obs['type']``
        ``'single-read'`` or ``'paired-end'`` (the batch used in the DESeq2 vignette's ``~ type + condition``).
    ``obs['number of lanes']``, ``obs['total number of reads']``, ``obs['exon counts']``
        Sample annotation from the pasilla package.

    Notes
    -----
    Provenance: Drosophila S2-DRSC cells, GEO GSE18508, as in the Bioconductor ``pasilla`` package; files taken from
    the PyPI sdist ``inmoose-0.9.1`` (GPL-3.0-or-later). Sample names lost their "fb" suffix and rows follow the
    count columns, as in the DESeq2 vignette.

    Examples
    --------
    >>> import gpuc
    >>> pb = gpuc.datasets.pasilla()
    >>> pb.shape
    (7, 14599)
    """
    counts = _read("pasilla_counts.csv.gz", pd.read_csv, index_col=0, compression="gzip")
    meta = _read("pasilla_metadata.csv", pd.read_csv, index_col=0)
    meta = meta.loc[counts.columns]
    meta["condition"] = pd.Categorical(meta["condition"], categories=["untreated", "treated"])
    meta["type"] = pd.Categorical(meta["type"], categories=["single-read", "paired-end"])
    meta.index.name = None
    var = pd.DataFrame(index=counts.index.astype(str))
    var.index.name = None
    return ad.AnnData(X=np.ascontiguousarray(counts.to_numpy(dtype=np.int64).T), obs=meta, var=var)
