"""Uniform argument checks: each raises before any AnnData is touched, with a message that says what to do."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pandas as pd
from anndata import AnnData

from gpuc._backend import Backend, backend_of, is_sparse
from gpuc._dask import is_dask_array
from gpuc._errors import GpucWarning, InsufficientMemoryError

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
    for axis, what in (("obs", "Observation"), ("var", "Variable")):
        names = getattr(adata, f"{axis}_names")
        if not names.is_unique:  # every result is keyed by these names: refused before anything is read
            dup = pd.unique(np.asarray(names[names.duplicated()]))
            msg = (
                f"{what} names are not unique ({_show(dup)} occur more than once), so gpuc's results could not be "
                f"matched to them. To make them unique, call `.{axis}_names_make_unique` (adata.{axis}_names_make_unique())."
            )
            raise ValueError(msg)
    return adata


def str_array(values: Any) -> np.ndarray:
    """``values`` (an array of strings as h5ad, zarr or numpy 2's ``StringDType`` give them, a list, an Index) as a
    numpy array of Python ``str`` (``<U``). ``np.asarray(x).astype(str)`` fails on a ``StringDType`` array that
    ``read_zarr`` returns.
    """
    arr = np.asarray(values, dtype=object).ravel()
    return np.array([str(v) for v in arr], dtype=str) if arr.size else np.zeros(0, dtype=str)


def check_key_added(key_added: Any, name: str = "key_added") -> str:
    """Return ``key_added`` if it can name AnnData entries that survive ``write_h5ad``; raise otherwise.

    A non-string raises :class:`TypeError`; an empty string or one containing ``/`` (which HDF5 and zarr read as a
    nested group) raises :class:`ValueError`. Every tool applies this same check.
    """
    if not isinstance(key_added, str):
        msg = f"{name} must be a string, got {key_added!r}."
        raise TypeError(msg)
    if not key_added or "/" in key_added or "\\" in key_added or "\x00" in key_added or key_added.startswith("."):
        msg = (
            f"{name}={key_added!r} cannot be used as an AnnData key: it must be non-empty, must not contain '/' "
            "(write_h5ad would store it as a nested group), '\\' or a NUL character, and must not start with '.' "
            "(names HDF5 and zarr reserve). Use e.g. '_' instead."
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
    if dtype is not None and np.dtype(dtype).kind not in "biuf":
        msg = (
            f"{where} holds {np.dtype(dtype)} values, not numbers (a matrix read from text, or of strings); convert "
            "it first, e.g. adata.X = adata.X.astype(np.float32)."
        )
        raise TypeError(msg)
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
    """Raise unless ``value`` is an integer (a Python or numpy integer, not a bool) within ``[minimum, maximum]``."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        msg = f"{name} must be an integer, got {value!r}."
        raise TypeError(msg)
    if minimum is not None and value < minimum:
        msg = f"{name}={value} is too small; it must be >= {minimum}."
        raise ValueError(msg)
    if maximum is not None and value > maximum:
        msg = f"{name}={value} is too large; it must be <= {maximum}."
        raise ValueError(msg)
    return int(value)


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    lo = "(-inf" if low is None else f"{'(' if low_open else '['}{low:g}"
    hi = "inf)" if high is None else f"{high:g}{')' if high_open else ']'}"
    return f"{lo}, {hi}"


def check_number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    hint: str = "",
) -> float:
    """Return ``value`` as a float if it is a real number in the interval; raise otherwise, with one message shape.

    Every real number type is accepted (Python int and float, numpy integer and floating scalars such as
    ``np.float32(0.5)``, 0-d arrays, :class:`fractions.Fraction`); a bool, a string or NaN is not a number here.
    A wrong type raises :class:`TypeError`, a value outside the interval :class:`ValueError`; both name the interval
    (``[0, 2]``, ``(0, 1]``, ``(0, inf)``).
    """
    interval = _interval(low, high, low_open, high_open)
    extra = f" {hint}" if hint else ""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        msg = f"{name} must be a real number in {interval}, got {value!r} ({type(value).__name__}).{extra}"
        raise TypeError(msg)
    v = float(value)
    below = low is not None and (v <= low if low_open else v < low)
    above = high is not None and (v >= high if high_open else v > high)
    if np.isnan(v) or below or above:
        what = "not a number" if np.isnan(v) else ("too small" if below else "too large")
        msg = f"{name}={value!r} is {what}; it must be a number in {interval}.{extra}"
        raise ValueError(msg)
    return v


def check_bool(name: str, value: Any) -> bool:
    """Return ``value`` as a bool if it is ``True``/``False`` (Python or numpy); raise :class:`TypeError` otherwise."""
    if not isinstance(value, bool | np.bool_):
        msg = f"{name} must be True or False, got {value!r}."
        raise TypeError(msg)
    return bool(value)


# ---- labelled inputs -------------------------------------------------------------------------------------------------
# One rule for every argument that can carry labels (a pandas Series or DataFrame, a dict): it is matched to
# ``adata.obs_names`` / ``var_names`` (or another named axis) by label, never by position. Labels that are missing,
# duplicated or foreign are an error; arrays and lists without labels stay positional (their length is checked by
# the caller).


def _as_labels(index: pd.Index) -> pd.Index:
    """An index as the strings AnnData names are: integer labels 0, 1, ... match obs names "0", "1", ..."""
    if index.dtype.kind in "iub":
        return pd.Index(index.astype(str))
    return index


def _show(labels: Iterable[Any], n: int = 5) -> str:
    labels = list(labels)
    more = f" and {len(labels) - n} more" if len(labels) > n else ""
    return ", ".join(map(repr, labels[:n])) + more


def check_unique_names(names: pd.Index, where: str, fix: str) -> None:
    """Raise a :class:`ValueError` naming the duplicated entries of ``names`` (``where``), saying how to fix it."""
    if names.is_unique:
        return
    dup = pd.unique(np.asarray(names[names.duplicated()]))
    msg = f"{where} are not unique ({_show(dup)} occur more than once), so labels cannot be matched to them. {fix}"
    raise ValueError(msg)


def align_labels(value: Any, names: pd.Index, name: str, where: str) -> Any:
    """``value`` reordered to ``names`` when it carries labels (Series, DataFrame rows, dict keys); else unchanged.

    ``where`` names the axis (``"adata.obs_names"``). A dict becomes a Series. Raises :class:`ValueError` when the
    labels are duplicated, when some of ``names`` have no label (missing) or some labels are not in ``names``
    (foreign), saying how to pass positions instead.
    """
    if isinstance(value, Mapping) and not isinstance(value, pd.Series | pd.DataFrame):
        value = pd.Series(dict(value), dtype=object if not value else None)
    if not isinstance(value, pd.Series | pd.DataFrame):
        return value
    check_unique_names(names, where, f"Make them unique first (e.g. adata.{where.split('.')[-1]}_make_unique()).")
    labels = _as_labels(value.index)
    check_unique_names(labels, f"the labels of {name}", f"Give {name} one entry per name of {where}.")
    missing = names[~names.isin(labels)]
    foreign = labels[~labels.isin(names)]
    if len(missing) or len(foreign):
        parts = []
        if len(foreign):
            parts.append(f"{len(foreign)} label(s) not in {where} ({_show(foreign)})")
        if len(missing):
            parts.append(f"no entry for {len(missing)} of {where} ({_show(missing)})")
        msg = (
            f"{name} is matched to {where} by its labels (index or keys), but it has " + " and ".join(parts) + ". "
            f"Reindex it to {where}, or pass .to_numpy() to use it by position."
        )
        raise ValueError(msg)
    out = value.copy()
    out.index = labels
    return out.loc[names]


def align_to_obs(value: Any, adata: AnnData, name: str) -> Any:
    """:func:`align_labels` on ``adata.obs_names``."""
    return align_labels(value, adata.obs_names, name, "adata.obs_names")


def align_to_var(value: Any, adata: AnnData, name: str) -> Any:
    """:func:`align_labels` on ``adata.var_names``."""
    return align_labels(value, adata.var_names, name, "adata.var_names")


# ---- group labels ----------------------------------------------------------------------------------------------------
# Labels are compared as the user gave them; missing ones (NaN, None, pd.NA) belong to no group. Two different labels
# that print the same (1 and "1", a float 1.0 and the string "1.0", np.nan and "nan") would share one name in every
# output (obs names, uns keys, h5ad), so they are an error that names them.


def check_printable_labels(values: Any, where: str) -> None:
    """Raise a :class:`ValueError` when two distinct labels of ``values`` would print the same (``str``)."""
    if isinstance(values, pd.Series) and isinstance(values.dtype, pd.CategoricalDtype):
        uniq = list(values.cat.remove_unused_categories().cat.categories)  # unique: a few, however many entries
        has_na = bool(values.isna().any())
    else:
        obj = pd.Series(np.asarray(values, dtype=object))
        has_na = bool(obj.isna().any())
        uniq = list(pd.unique(obj.dropna()))
    by_name: dict[str, list[Any]] = {}
    for u in uniq:
        by_name.setdefault(str(u), []).append(u)
    nan_like = [u for u in uniq if str(u).lower() in ("nan", "none", "<na>")]
    clashes = [v for v in by_name.values() if len(v) > 1]
    if clashes or (nan_like and has_na):
        pairs = "; ".join(" and ".join(f"{x!r} ({type(x).__name__})" for x in v) for v in clashes)
        if nan_like and has_na:
            pairs = "; ".join(p for p in (pairs, f"{nan_like[0]!r} (a label) and missing values (NaN/None)") if p)
        msg = (
            f"{where} has labels that are different but would print the same: {pairs}. Results are named by the "
            "printed label, so they would be merged or overwrite each other; make the labels distinct, e.g. "
            "convert the column with .astype(str) if they are meant to be one group."
        )
        raise ValueError(msg)


def group_labels(column: pd.Series, where: str, *, missing: str = "warn", what: str = "cell(s)") -> np.ndarray:
    """The group of every entry of ``column`` as strings (None where the label is missing), after the group rules.

    Two labels printing the same are an error (:func:`check_printable_labels`). Missing labels: ``missing="warn"``
    leaves those entries out with a :class:`~gpuc.GpucWarning` that counts them; ``"error"`` refuses them.
    """
    check_printable_labels(column, where)
    raw = column.to_numpy(dtype=object)
    na = pd.isna(raw)
    if na.any():
        if missing == "error":
            msg = f"{where} has {int(na.sum())} missing value(s) (NaN/None); give every entry a group or subset first."
            raise ValueError(msg)
        warnings.warn(
            f"{int(na.sum())} {what} with a missing {where} (NaN/None) belong to no group and were left out.",
            GpucWarning,
            stacklevel=3,
        )
    out = np.empty(raw.shape[0], dtype=object)
    out[~na] = [str(v) for v in raw[~na]]
    out[na] = None
    return out


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
