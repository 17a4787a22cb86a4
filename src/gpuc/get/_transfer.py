"""Move an AnnData's matrices between host and GPU memory, with rapids-singlecell's parameters and defaults.

:func:`to_gpu` / :func:`to_cpu` take the parameters of ``rapids_singlecell.get.anndata_to_GPU`` /
``anndata_to_CPU`` (``layer``, ``convert_all``, ``copy``) with the same defaults, so either pair can be used.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp
from anndata import AnnData

from gpuc._backend import get_backend, is_cupy_array, to_host
from gpuc._validate import check_adata, check_key


def _movable(x: Any) -> bool:
    """Numpy arrays and scipy CSR / CSC matrices (what rapids-singlecell moves); DataFrames and others stay."""
    if sp.issparse(x):
        return x.format in ("csr", "csc")
    return isinstance(x, np.ndarray)


def _targets(adata: AnnData, layer: str | None, convert_all: bool) -> list[str | None]:
    if not isinstance(convert_all, bool):
        msg = f"convert_all must be True or False, got {convert_all!r}."
        raise TypeError(msg)
    if layer is not None:
        check_key(adata.layers, layer, "adata.layers")
    if convert_all:
        return [None, *adata.layers.keys()]
    return [layer]


def _get(adata: AnnData, layer: str | None) -> Any:
    return adata.X if layer is None else adata.layers[layer]


def _set(adata: AnnData, layer: str | None, x: Any) -> None:
    if layer is None:
        adata.X = x
    else:
        adata.layers[layer] = x


def to_gpu(
    adata: AnnData, layer: str | None = None, *, convert_all: bool = False, copy: bool = False
) -> AnnData | None:
    """Move ``X`` (or one layer, or with ``convert_all`` X and every layer) to GPU memory as CuPy / cupyx arrays.

    The same parameters, defaults and result as ``rapids_singlecell.get.anndata_to_GPU``: numpy arrays become
    ``cupy.ndarray``, scipy CSR / CSC matrices ``cupyx.scipy.sparse`` CSR / CSC; anything else stays where it is.
    Every gpuc tool then reads the matrix where it is, without a host round trip.

    Parameters
    ----------
    adata
        The annotated data matrix.
    layer
        The layer to move instead of ``X``.
    convert_all
        Move ``X`` and every layer.
    copy
        Work on a copy and return it.

    Returns
    -------
    ``None`` (modifies ``adata``) or, with ``copy=True``, the moved copy.

    Raises
    ------
    RuntimeError
        If no usable GPU (CuPy + CUDA device) is present.
    """
    check_adata(adata)
    targets = _targets(adata, layer, convert_all)
    backend = get_backend("gpu")
    adata = adata.copy() if copy else adata
    for t in targets:
        x = _get(adata, t)
        if x is not None and _movable(x):
            _set(adata, t, backend.asarray(x))
    return adata if copy else None


def to_cpu(
    adata: AnnData, layer: str | None = None, *, convert_all: bool = False, copy: bool = False
) -> AnnData | None:
    """Move ``X`` (or one layer) from GPU memory to the host; with ``convert_all`` every device array of the AnnData.

    The parameters and defaults of ``rapids_singlecell.get.anndata_to_CPU``. With ``convert_all``, besides ``X``
    and the layers, device arrays in ``obsm``, ``varm``, ``obsp`` and ``varp`` come back too, so that the AnnData
    can be written with ``write_h5ad``.

    Parameters
    ----------
    adata
        The annotated data matrix, with matrices in GPU memory.
    layer
        Bring back this layer instead of ``X``.
    convert_all
        Bring back every device array.
    copy
        Work on a copy and return it.

    Returns
    -------
    ``None`` (modifies ``adata``) or, with ``copy=True``, the moved copy.
    """
    check_adata(adata)
    targets = _targets(adata, layer, convert_all)
    adata = adata.copy() if copy else adata
    for t in targets:
        x = _get(adata, t)
        if is_cupy_array(x):
            _set(adata, t, to_host(x))
    if convert_all:
        for mapping in (adata.obsm, adata.varm, adata.obsp, adata.varp):
            for k in list(mapping.keys()):
                if is_cupy_array(mapping[k]):
                    mapping[k] = to_host(mapping[k])
    return adata if copy else None
