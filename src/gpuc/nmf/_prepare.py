"""Checks and gene scaling of the cells x genes matrix before NMF (cNMF's per-gene SD scaling, without centring)."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuc._backend import backend_of, is_sparse, to_host

PREPROCESSING = ("none", "sd", "sqrt_sd")


def prepare_matrix(block: Any, preprocessing: str, *, gene_names: Any, where: str = "the matrix") -> Any:
    """Return the float matrix that is factorised, after checking it, on the device where ``block`` lives.

    Raises :class:`ValueError` (naming ``where`` and up to five genes) for NaN/inf or negative values, cells or genes
    without any signal, and, with ``preprocessing="sd"`` or ``"sqrt_sd"``, genes of zero variance. Those two
    divide every gene by its standard deviation (ddof=1), or by its square root, as cNMF does with ``"sd"``.
    """
    bk = backend_of(block)
    xp = bk.xp
    if bk.is_gpu or is_sparse(block):
        kind = block.dtype.kind
        block = block.tocsr() if is_sparse(block) else block
        block = block.astype(block.dtype if kind == "f" else (np.float32 if bk.is_gpu else np.float64))
    else:
        block = np.asarray(block)
        if block.dtype.kind not in "fiub":
            msg = f"{where} must be numeric, got dtype {block.dtype}."
            raise TypeError(msg)
        block = block.astype(np.float64) if block.dtype.kind != "f" else block
    sparse = is_sparse(block)
    data = block.data if sparse else block
    if not bool(xp.isfinite(data).all()):
        msg = f"{where} contains NaN or infinite values on the selected genes; NMF needs finite non-negative input."
        raise ValueError(msg)
    if data.size and float(data.min()) < 0:
        msg = (
            f"{where} has negative values on the selected genes (min {float(data.min()):.4g}); NMF needs non-negative "
            "input: use raw counts (cNMF style, with preprocessing='sd') or a log-normalised layer, never scaled data."
        )
        raise ValueError(msg)
    row_sums = xp.asarray(block.sum(axis=1)).ravel()
    col_sums = xp.asarray(block.sum(axis=0)).ravel()
    n_zero_cells = int((row_sums <= 0).sum())
    if n_zero_cells:
        msg = (
            f"{n_zero_cells} cell(s) have no signal on the {block.shape[1]} selected genes; remove them first, e.g. "
            "adata = adata[np.asarray(adata[:, adata.var.highly_variable].X.sum(1)).ravel() > 0].copy()."
        )
        raise ValueError(msg)
    n_zero_genes = int((col_sums <= 0).sum())
    if n_zero_genes:
        names = list(np.asarray(gene_names)[np.flatnonzero(to_host(col_sums <= 0))][:5])
        msg = (
            f"{n_zero_genes} selected gene(s) are zero in every cell (e.g. {names}); drop them "
            "(sc.pp.filter_genes(adata, min_cells=1)) or leave them out of the gene selection (mask_var)."
        )
        raise ValueError(msg)
    if preprocessing == "none":
        return block
    m = block.shape[0]
    if m < 2:
        msg = "preprocessing by SD needs at least 2 cells."
        raise ValueError(msg)
    mean = col_sums / m
    sq = xp.asarray((block.multiply(block) if sparse else block * block).sum(axis=0)).ravel() / m
    sd = xp.sqrt(xp.maximum(sq - mean * mean, 0.0) * m / (m - 1))
    bad = sd <= 1e-12 * xp.maximum(mean, 1.0)
    if bool(bad.any()):
        names = list(np.asarray(gene_names)[np.flatnonzero(to_host(bad))][:5])
        msg = (
            f"{int(bad.sum())} selected gene(s) have zero variance (e.g. {names}); preprocessing={preprocessing!r} "
            "would divide by zero. Drop them from the gene selection or use preprocessing='none'."
        )
        raise ValueError(msg)
    factor = 1.0 / (sd if preprocessing == "sd" else xp.sqrt(sd))
    if sparse:
        return (block @ bk.sparse.diags(factor)).tocsr()
    return block * factor[None, :]
