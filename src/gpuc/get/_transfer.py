"""Move an AnnData's matrices between host and GPU memory (same semantics as rapids-singlecell's helpers)."""

from __future__ import annotations

from anndata import AnnData

from gpuc._backend import get_backend, is_cupy_array, to_host
from gpuc._validate import check_adata


def to_gpu(adata: AnnData, *, layers: bool = True, obsm: bool = True, copy: bool = False) -> AnnData | None:
    """Move ``X`` (and, by default, every layer and ``obsm`` matrix) to GPU memory as cupy / cupyx arrays.

    Equivalent to ``rapids_singlecell.get.anndata_to_GPU``; gpuc tools then run on the GPU without host round trips.

    Parameters
    ----------
    adata
        The annotated data matrix.
    layers
        Also move ``adata.layers``.
    obsm
        Also move the array entries of ``adata.obsm`` (DataFrames stay on the host).
    copy
        Work on a copy and return it.

    Returns
    -------
    ``None`` (modifies ``adata``) or, with ``copy=True``, the moved copy.

    Raises
    ------
    RuntimeError
        If no usable GPU (cupy + CUDA device) is present.
    """
    check_adata(adata)
    backend = get_backend("gpu")
    adata = adata.copy() if copy else adata
    if adata.X is not None:
        adata.X = backend.asarray(adata.X)
    if layers:
        for k in list(adata.layers.keys()):
            adata.layers[k] = backend.asarray(adata.layers[k])
    if obsm:
        for k in list(adata.obsm.keys()):
            if hasattr(adata.obsm[k], "shape") and not hasattr(adata.obsm[k], "columns"):
                adata.obsm[k] = backend.asarray(adata.obsm[k])
    return adata if copy else None


def to_cpu(adata: AnnData, *, copy: bool = False) -> AnnData | None:
    """Move every cupy / cupyx matrix in ``X``, ``layers``, ``obsm``, ``varm``, ``obsp`` and ``varp`` to host memory.

    Parameters
    ----------
    adata
        The annotated data matrix.
    copy
        Work on a copy and return it.

    Returns
    -------
    ``None`` (modifies ``adata``) or, with ``copy=True``, the moved copy.
    """
    check_adata(adata)
    if copy:
        adata = adata.copy()
    if is_cupy_array(adata.X):
        adata.X = to_host(adata.X)
    for mapping in (adata.layers, adata.obsm, adata.varm, adata.obsp, adata.varp):
        for k in list(mapping.keys()):
            if is_cupy_array(mapping[k]):
                mapping[k] = to_host(mapping[k])
    return adata if copy else None
