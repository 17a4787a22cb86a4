"""The plan of an NMF call before any fit: device and working precision, the ranks fitted together, memory.

:func:`plan_fit` takes the factorised block (an array, never an AnnData) and decides where and in which precision
the restarts run, which ranks share a batch (:func:`gpuc.nmf._consensus.sweep_batches`), and refuses work whose
estimated peak exceeds the device's free memory.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuc._backend import Backend, Device, backend_of, get_backend, is_sparse
from gpuc._errors import GpucWarning
from gpuc._validate import check_int, check_memory
from gpuc.nmf._consensus import consensus_peak_bytes, fit_peak_bytes, sweep_batches
from gpuc.nmf._hals import Operator
from gpuc.nmf._run import batch_columns

# the largest |V|**2 * n_cells * n_genes (a bound on ||V||^2 and on the products HALS forms) each precision holds with
# a margin of 1000 below its largest finite value
_SAFE_SQUARES = {np.dtype(np.float32): float(np.finfo(np.float32).max) / 1e3, np.dtype(np.float64): 1e305}


@dataclass
class FitPlan:
    """Where and how the restarts of an NMF call run.

    Attributes
    ----------
    backend
        The device backend.
    op
        The factorised block on that device, in the working precision.
    ks
        The ranks, sorted.
    batches
        The ranks fitted together, one batch after the other, in this process (every rank in one batch on a Dask
        cluster, where :func:`gpuc.nmf._run.plan_units` deals them into one task per worker).
    """

    backend: Backend
    op: Operator
    ks: list[int]
    batches: list[list[int]]


def check_rank(k: Any, shape: tuple[int, int], name: str = "k") -> int:
    """``k`` as an int, refused unless ``2 <= k < min(shape)``."""
    k = check_int(name, k, minimum=2)
    limit = min(shape)
    if k >= limit:
        msg = f"{name}={k} must be smaller than min(n_cells, n_genes) = min{tuple(shape)} = {limit}."
        raise ValueError(msg)
    return k


def plan_fit(
    block: Any,
    ks: Sequence[int],
    n_runs: int,
    *,
    target: str,
    device: Device | None,
    dtype: Any,
    distributed: bool = False,
) -> FitPlan:
    """The plan of fitting ``n_runs`` restarts of every rank ``ks`` to ``block`` (cells x genes) and pooling them.

    Ranks are fitted together in batches bounded in memory (one pass over ``V`` per iteration serves every rank of a
    batch); ``distributed``: the restarts run as Dask tasks, all ranks submitted at once.

    Raises
    ------
    InsufficientMemoryError
        When the restarts and the consensus would need more memory than the device has free.
    """
    backend, op = backend_and_op(block, device, dtype, stacklevel=5)
    ks = sorted(int(k) for k in ks)
    batches = sweep_batches(ks, n_runs, op.shape, op.dtype.itemsize, max_columns=batch_columns(backend, op))
    check_fit_memory(backend, op, batches, n_runs, target)
    return FitPlan(backend, op, ks, [ks] if distributed else batches)


def backend_and_op(block: Any, device: Device | None, dtype: Any, *, stacklevel: int = 4) -> tuple[Backend, Operator]:
    """The backend for ``device`` and ``block`` uploaded once in the working precision (:func:`working_dtype`;
    ``stacklevel`` is its warning's, 4 when a tool calls this directly).
    """
    if dtype is not None and np.dtype(dtype) not in (np.float32, np.float64):
        msg = f"dtype={dtype!r} is not supported; use 'float32' (default) or 'float64'."
        raise ValueError(msg)
    backend = get_backend(device, block, tool="nmf", work=float(block.shape[0]) * float(block.shape[1]))
    dtype = working_dtype(block, dtype, stacklevel=stacklevel)
    return backend, Operator.build(backend, block, dtype=dtype)


def working_dtype(block: Any, dtype: Any, *, stacklevel: int = 2) -> np.dtype | None:
    """The precision of the fit: ``dtype``, or float64 when the default float32 would overflow on these values.

    Values whose squares summed over the matrix exceed float32 (counts near 1e18) would turn errors and refits into
    inf/NaN: by default the fit then runs in float64, with a warning; an explicit ``dtype="float32"`` is refused, and
    so are values too large even for float64.
    """
    data = block.data if is_sparse(block) else block
    top = float(backend_of(data).xp.abs(data).max()) if data.size else 0.0
    bound = top * top * float(block.shape[0]) * float(block.shape[1])
    if bound > _SAFE_SQUARES[np.dtype(np.float64)]:
        msg = (
            f"the factorised values reach {top:.3g}: their squares overflow even float64. Rescale the data (e.g. "
            "normalise to counts per 10,000) before NMF."
        )
        raise ValueError(msg)
    if bound <= _SAFE_SQUARES[np.dtype(np.float32)]:
        return None if dtype is None else np.dtype(dtype)
    if dtype is not None and np.dtype(dtype) == np.float32:
        msg = (
            f"the factorised values reach {top:.3g}, whose squares overflow float32; pass dtype='float64' (or leave "
            "dtype=None), or rescale the data."
        )
        raise ValueError(msg)
    if dtype is None:
        warnings.warn(
            f"the factorised values reach {top:.3g}, whose squares overflow float32: the fit runs in float64.",
            GpucWarning,
            stacklevel=stacklevel,
        )
    return np.dtype(np.float64)


def fit_memory_bytes(op: Operator, batches: list[list[int]], n_runs: int, target: str) -> tuple[float, float]:
    """Estimated peak memory of the largest batch of restarts and of the largest consensus: ``(fit, pool)`` bytes."""
    fit = max(fit_peak_bytes(n_runs * sum(b), op.shape, op.dtype.itemsize) for b in batches)
    pool = max(consensus_peak_bytes(k, n_runs, op.shape, target) for b in batches for k in b)
    return fit, pool


def check_fit_memory(backend: Backend, op: Operator, batches: list[list[int]], n_runs: int, target: str) -> None:
    """Refuse, before any fit, a sweep or consensus whose estimated peak exceeds the device's free memory."""
    fit, pool = fit_memory_bytes(op, batches, n_runs, target)
    ks = sorted(k for b in batches for k in b)
    check_memory(
        backend,
        fit + pool,
        f"NMF with k={ks[-1] if len(ks) == 1 else ks} and n_runs={n_runs} on {op.shape[0]} x {op.shape[1]}",
        f"The restarts alone need {fit / 2**30:.1f} GiB and the consensus of {n_runs * ks[-1]} pooled components "
        f"{pool / 2**30:.1f} GiB: use fewer runs (n_runs), a smaller k, or fewer genes (highly variable genes).",
    )
