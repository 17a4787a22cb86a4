"""Uniform argument checks: each raises before any AnnData is touched, with a message that says what to do."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from anndata import AnnData

from gpuc._backend import is_cupy_array, is_sparse


def check_adata(adata: Any) -> AnnData:
    """Raise a :class:`TypeError` unless ``adata`` is an AnnData."""
    if not isinstance(adata, AnnData):
        msg = f"Expected an AnnData object as first argument, got {type(adata).__name__}."
        raise TypeError(msg)
    return adata


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """Raise a :class:`ValueError` unless ``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        msg = f"{name}={value!r} is not valid; choose one of {', '.join(map(repr, choices))}."
        raise ValueError(msg)
    return value


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Raise unless ``value`` is an integer within ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        msg = f"{name} must be an integer, got {value!r}."
        raise TypeError(msg)
    if minimum is not None and value < minimum:
        msg = f"{name}={value} is too small; it must be >= {minimum}."
        raise ValueError(msg)
    if maximum is not None and value > maximum:
        msg = f"{name}={value} is too large; it must be <= {maximum}."
        raise ValueError(msg)
    return int(value)


def check_key(mapping: Any, key: str, where: str, hint: str = "") -> None:
    """Raise a :class:`KeyError` naming ``where`` unless ``key`` is present."""
    if key not in mapping:
        avail = ", ".join(map(repr, list(mapping.keys())[:20])) or "none"
        msg = f"{key!r} not found in {where} (available: {avail}).{(' ' + hint) if hint else ''}"
        raise KeyError(msg)


def check_finite(name: str, x: Any) -> None:
    """Raise a :class:`ValueError` if a dense or sparse array holds NaN or inf."""
    data = x.data if is_sparse(x) else x
    xp = _xp_of(data)
    if not bool(xp.isfinite(xp.asarray(data)).all()):
        msg = f"{name} contains NaN or infinite values; remove or impute them first."
        raise ValueError(msg)


def get_matrix(adata: AnnData, *, layer: str | None = None, use_rep: str | None = None) -> Any:
    """Return ``adata.X``, ``adata.layers[layer]`` or ``adata.obsm[use_rep]`` (exactly one source), checking the key."""
    if layer is not None and use_rep is not None:
        msg = "Pass either layer= or use_rep=, not both."
        raise ValueError(msg)
    if use_rep is not None:
        check_key(adata.obsm, use_rep, "adata.obsm", "Compute it first, e.g. sc.pp.pca(adata) for 'X_pca'.")
        return adata.obsm[use_rep]
    if layer is not None:
        check_key(adata.layers, layer, "adata.layers")
        return adata.layers[layer]
    if adata.X is None:
        msg = "adata.X is empty; pass layer= naming the matrix to use."
        raise ValueError(msg)
    return adata.X


def _xp_of(x: Any) -> Any:
    if is_cupy_array(x):
        import cupy

        return cupy
    return np
