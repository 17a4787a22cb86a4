"""Uniform argument checks: each raises before any AnnData is touched, with a message that says what to do."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd
from anndata import AnnData

from gpuc._backend import Backend, backend_of, is_sparse
from gpuc._dask import is_dask_array
from gpuc._errors import InsufficientMemoryError

_GIB = float(1 << 30)


def check_adata(adata: Any) -> AnnData:
    """Raise a :class:`TypeError` unless ``adata`` is an AnnData (matrices are checked by :func:`get_matrix`)."""
    if not isinstance(adata, AnnData):
        msg = f"Expected an AnnData object as first argument, got {type(adata).__name__}."
        raise TypeError(msg)
    for slot in ("obs", "var"):
        frame = getattr(adata, slot)
        if not isinstance(frame, pd.DataFrame):  # anndata.experimental.read_lazy gives xarray-backed Dataset2D
            msg = (
                f"adata.{slot} is not in memory (a {type(frame).__name__}: the AnnData was read with "
                f"anndata.experimental.read_lazy); load it first: adata.{slot} = adata.{slot}.to_memory(). X and "
                "layers may stay lazy (dask)."
            )
            raise TypeError(msg)
    return adata


def check_key_added(key_added: Any, name: str = "key_added") -> str:
    """Return ``key_added`` if it can name AnnData entries that survive ``write_h5ad``; raise otherwise.

    A non-string raises :class:`TypeError`; an empty string or one containing ``/`` (which HDF5 and zarr read as a
    nested group) raises :class:`ValueError`. Every tool applies this same check.
    """
    if not isinstance(key_added, str):
        msg = f"{name} must be a string, got {key_added!r}."
        raise TypeError(msg)
    if not key_added or "/" in key_added:
        msg = (
            f"{name}={key_added!r} cannot be used as an AnnData key: it must be non-empty and must not contain '/' "
            "(write_h5ad would store it as a nested group). Use e.g. '_' instead."
        )
        raise ValueError(msg)
    return key_added


def check_in_memory(x: Any, where: str, *, allow_dask: bool = False) -> Any:
    """Raise a :class:`TypeError` naming ``where`` unless ``x`` is an array gpuc can compute on.

    Backed datasets (``read_h5ad(..., backed="r")``: h5py or zarr datasets, anndata's on-disk sparse datasets) and
    float16 data (which cannot hold counts above 2,048 exactly and overflows in sums) are refused with a message that
    says what to do. Dask arrays (``anndata.experimental.read_lazy`` / ``read_elem_lazy``) are accepted with
    ``allow_dask=True``, for the matrices whose tools handle them chunk by chunk (:mod:`gpuc._lazy`), and refused
    otherwise.
    """
    mod = type(x).__module__
    lazy = allow_dask and is_dask_array(x)  # summed chunk by chunk or loaded by the tool; other dask objects refused
    # anndata's own array classes are its on-disk datasets, except the views of in-memory arrays (adata[mask].X)
    if not lazy and (
        mod.startswith(("dask", "h5py", "zarr")) or (mod.startswith("anndata") and not mod.endswith(".views"))
    ):
        msg = (
            f"{where} is not in memory (a {type(x).__module__}.{type(x).__name__}: the AnnData was read in backed mode, "
            "read_h5ad(..., backed='r'), or lazily); gpuc needs it loaded: adata = adata.to_memory(), after "
            "subsetting to the cells and genes you need."
        )
        raise TypeError(msg)
    dtype = getattr(x, "dtype", None)
    if dtype is not None and np.dtype(dtype) == np.float16:
        msg = (
            f"{where} is float16, which keeps about 3 significant digits (counts above 2,048 are not exact) and "
            "overflows above 65,504 in sums; convert it first, e.g. adata.X = adata.X.astype(np.float32)."
        )
        raise TypeError(msg)
    return x


def check_memory(backend: Backend, need_bytes: float, what: str, reduce: str) -> None:
    """Refuse, before anything is allocated, work whose estimated peak exceeds the device's free memory.

    Raises :class:`~gpuc.InsufficientMemoryError` saying how much ``what`` needs, how much is free and how to reduce
    it (``reduce``). Nothing is checked when the free memory cannot be read.
    """
    free = backend.free_memory()
    if free is None or need_bytes <= free:
        return
    msg = (
        f"{what} needs about {need_bytes / _GIB:.1f} GiB of {'GPU' if backend.is_gpu else 'host'} memory but only "
        f"{free / _GIB:.1f} GiB is free; nothing was computed. {reduce}"
    )
    raise InsufficientMemoryError(msg)


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


SeedLike = int | np.integer | np.random.RandomState | np.random.Generator | None


def resolve_random_state(random_state: SeedLike) -> int:
    """The integer seed of a call, from Scanpy's accepted ``random_state`` forms.

    An int (>= 0, below 2**32) is used as is, so per-unit seeds and SEACells parity are exactly those of that int.
    A :class:`numpy.random.RandomState` or :class:`numpy.random.Generator` is consumed once to draw the int; ``None``
    draws it from fresh OS entropy. Tools record the int in ``uns[key]["params"]["random_state"]``, so every run can
    be reproduced by passing it back.
    """
    if isinstance(random_state, bool):
        msg = f"random_state must be an int, None, a numpy RandomState or Generator, got {random_state!r}."
        raise TypeError(msg)
    if random_state is None:
        return int(np.random.SeedSequence().generate_state(1, dtype=np.uint32)[0])
    if isinstance(random_state, np.random.RandomState):
        return int(random_state.randint(0, 2**32, dtype=np.uint64))
    if isinstance(random_state, np.random.Generator):
        return int(random_state.integers(0, 2**32, dtype=np.uint64))
    if isinstance(random_state, int | np.integer):
        return check_int("random_state", random_state, minimum=0, maximum=2**32 - 1)
    msg = f"random_state must be an int, None, a numpy RandomState or Generator, got {type(random_state).__name__}."
    raise TypeError(msg)


def check_key(mapping: Any, key: str, where: str, hint: str = "") -> None:
    """Raise a :class:`KeyError` naming ``where`` unless ``key`` is present."""
    if key not in mapping:
        avail = ", ".join(map(repr, list(mapping.keys())[:20])) or "none"
        msg = f"{key!r} not found in {where} (available: {avail}).{(' ' + hint) if hint else ''}"
        raise KeyError(msg)


def check_finite(name: str, x: Any) -> None:
    """Raise a :class:`ValueError` if a dense or sparse array holds NaN or inf."""
    data = x.data if is_sparse(x) else x
    xp = backend_of(data).xp
    if not bool(xp.isfinite(xp.asarray(data)).all()):
        msg = f"{name} contains NaN or infinite values; remove or impute them first."
        raise ValueError(msg)


def get_matrix(adata: AnnData, *, layer: str | None = None, use_rep: str | None = None) -> Any:
    """Return ``adata.X``, ``adata.layers[layer]`` or ``adata.obsm[use_rep]`` (exactly one source), checking the key.

    ``X`` and layers may come back as :class:`dask.array.Array` (a lazily read AnnData): callers sum them chunk by
    chunk or load the block they need with :mod:`gpuc._lazy`. ``obsm`` entries must be in memory.
    """
    if layer is not None and use_rep is not None:
        msg = "Pass either layer= or use_rep=, not both."
        raise ValueError(msg)
    if use_rep is not None:
        check_key(adata.obsm, use_rep, "adata.obsm", "Compute it first, e.g. sc.pp.pca(adata) for 'X_pca'.")
        return check_in_memory(adata.obsm[use_rep], f"adata.obsm[{use_rep!r}]")
    if layer is not None:
        check_key(adata.layers, layer, "adata.layers")
        return check_in_memory(adata.layers[layer], f"adata.layers[{layer!r}]", allow_dask=True)
    if adata.X is None:
        msg = "adata.X is empty; pass layer= naming the matrix to use."
        raise ValueError(msg)
    return check_in_memory(adata.X, "adata.X", allow_dask=True)
