"""Lazily read (dask) matrices in the tools: chunked grouped sums, chunked count checks, and loading of small blocks.

``anndata.experimental.read_lazy`` and ``read_elem_lazy`` give ``X`` and ``layers`` as :class:`dask.array.Array`
with numpy or scipy.sparse chunks (cupy ones under ``dask_cuda``). The tools that only *sum* over cells
(:func:`gpuc.tl.pseudobulk`, :func:`gpuc.tl.aggregate_metacells`) never load such a matrix: every row chunk is
multiplied by the columns of the sparse group indicator that belong to its cells, giving dense partial rows for the
groups present in the chunk, and the partials are added by a tree reduction that Dask schedules. The peak memory is
therefore a few chunks plus a few partials (at most groups x genes each), whatever the number of cells. The tools that need a whole block in memory
(NMF, DESeq2) load only that block with :func:`load`, after selecting what they need lazily.

Every function here is pure (arrays in, arrays out; no AnnData). dask is imported inside the functions only, so
``import gpuc`` works without it. ``dask.compute`` runs on the active ``distributed.Client`` when there is one, in
this process otherwise; the results are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp

from gpuc import _log as logg
from gpuc._backend import backend_of, is_sparse, to_host
from gpuc._dask import is_dask_array

# bits of the per-chunk verdict of the count checks (OR-ed across chunks)
_NON_INTEGER = 1  # a NaN, an infinity or a non-whole value (float data only)
_NEGATIVE = 2  # a value below zero


@dataclass(frozen=True)
class CountFlags:
    """Verdicts of the raw-counts checks over a whole (lazily read) matrix.

    Attributes
    ----------
    non_integer
        Some value is NaN, infinite or not a whole number (only float data can be).
    negative
        Some value is below zero.
    """

    non_integer: bool
    negative: bool

    @classmethod
    def from_code(cls, code: int) -> CountFlags:
        """The flags of an OR-ed bit code (``_NON_INTEGER | _NEGATIVE``)."""
        return cls(non_integer=bool(code & _NON_INTEGER), negative=bool(code & _NEGATIVE))


# --------------------------------------------------------------------------------------------------------------------
# chunk functions (module level, so that Dask workers can import them)
# --------------------------------------------------------------------------------------------------------------------
def _block_code(block: Any) -> int:
    """The count-check bit code of one chunk, computed where the chunk lives (CPU or GPU); only the code returns."""
    data = block.data if is_sparse(block) else block  # the stored values; implicit zeros are whole and >= 0
    xp = backend_of(data).xp
    data = xp.asarray(data)
    code = 0
    if data.dtype.kind == "f" and (not bool(xp.isfinite(data).all()) or bool((data != xp.round(data)).any())):
        code |= _NON_INTEGER
    if data.dtype.kind in "if" and bool((data < 0).any()):
        code |= _NEGATIVE
    return code


def _flags_chunk(block: Any, axis: Any = None, keepdims: bool = True) -> np.ndarray:
    """``da.reduction`` chunk step: the chunk's code as a 1 x 1 array (reduced axes kept, as dask expects)."""
    return np.full((1,) * block.ndim, _block_code(block), dtype=np.uint8)


def _flags_combine(codes: np.ndarray, axis: Any = None, keepdims: bool = False) -> np.ndarray:
    """``da.reduction`` combine/aggregate step: OR of the codes of several chunks."""
    return np.bitwise_or.reduce(codes, axis=axis, keepdims=keepdims)


def _partial_rows(ind_t: Any, block: Any) -> tuple[np.ndarray, np.ndarray]:
    """One chunk's contribution to the grouped sums, on the groups that have a cell in the chunk only.

    ``ind_t`` holds the indicator's columns for the chunk's cells, transposed (chunk cells x groups, CSR). Returns
    the positions of the groups present and their dense float64 rows ``ind_t[:, present].T @ block``; the product
    runs on the device of the chunk and only those rows come to the host. An atlas stored sample by sample has a
    few samples per chunk, so a partial is a few rows, not every profile.
    """
    ind_t = sp.csr_matrix(ind_t)
    present = np.flatnonzero(np.bincount(ind_t.indices, minlength=ind_t.shape[1]))
    bk = backend_of(block)
    ind = bk.asarray(sp.csr_matrix(ind_t[:, present].T))  # a no-op on the CPU; a small upload for a cupy chunk
    blk = block if block.dtype == np.float64 else block.astype(np.float64)  # sums in float64, as in memory
    part = ind @ blk
    part = part.toarray() if is_sparse(part) else part
    return present, np.asarray(to_host(part), dtype=np.float64)


def _add_partials(*parts: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """A node of the tree reduction: the sum of several partials (union of their groups), in the order given."""
    ids = np.unique(np.concatenate([p[0] for p in parts]))
    out = np.zeros((ids.size, parts[0][1].shape[1]), dtype=np.float64)
    for p_ids, rows in parts:
        out[np.searchsorted(ids, p_ids)] += rows
    return ids, out


def _place_partials(n_groups: int, *columns: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """The dense groups x genes result from the reduced partial of every gene chunk (side by side)."""
    out = np.zeros((n_groups, sum(rows.shape[1] for _, rows in columns)), dtype=np.float64)
    start = 0
    for ids, rows in columns:
        out[ids, start : start + rows.shape[1]] = rows
        start += rows.shape[1]
    return out


# --------------------------------------------------------------------------------------------------------------------
# lazy graphs
# --------------------------------------------------------------------------------------------------------------------
def _check_rows(x: Any) -> None:
    """Refuse what the chunked sums cannot handle: non-2-D arrays and unknown chunk sizes."""
    if x.ndim != 2:
        msg = f"expected a 2-D (cells x genes) dask array, got {x.ndim} dimensions."
        raise ValueError(msg)
    if any(np.isnan(c) for c in x.chunks[0]):
        msg = "the dask array has unknown row chunk sizes; call x.compute_chunk_sizes() first."
        raise ValueError(msg)


def _count_flags_graph(x: Any, split_every: int | None) -> Any:
    """A lazy 0-d uint8 array: the OR of every chunk's count-check code (a tree reduction)."""
    import dask.array as da

    return da.reduction(
        x,
        chunk=_flags_chunk,
        combine=_flags_combine,
        aggregate=_flags_combine,
        axis=(0, 1),
        dtype=np.uint8,
        split_every=split_every,
        meta=np.empty((), dtype=np.uint8),
        name="gpuc-count-checks",  # a prefix: dask appends a hash of the inputs
    )


def _grouped_sum_graph(indicator: Any, x: Any, split_every: int | None) -> Any:
    """A lazy (dask.delayed) dense float64 groups x genes array: ``indicator @ x``, summed chunk by chunk.

    Each block of ``x`` (row chunk r, gene chunk g) gives a partial over the groups present in its rows
    (:func:`_partial_rows`); per gene chunk the partials are added by a tree of :func:`_add_partials` nodes,
    ``split_every`` at a time, that Dask schedules like any reduction; the last step places the rows.
    """
    import dask

    _check_rows(x)
    ind = sp.csr_matrix(indicator, dtype=np.float64)
    if ind.shape[1] != x.shape[0]:
        msg = f"the indicator has {ind.shape[1]} columns but the matrix has {x.shape[0]} rows."
        raise ValueError(msg)
    fan_in = max(2, int(split_every or 8))
    ind_t = ind.T.tocsr()  # cells x groups: the rows of a chunk's cells are a cheap slice
    bounds = np.r_[0, np.cumsum(x.chunks[0])].astype(np.int64)
    blocks = x.to_delayed()  # (row chunks, gene chunks) of delayed blocks; the read stays fused with its block
    partial = dask.delayed(_partial_rows, pure=True)
    add = dask.delayed(_add_partials, pure=True)
    columns = []
    for g in range(blocks.shape[1]):
        level = [partial(ind_t[bounds[r] : bounds[r + 1]], blocks[r, g]) for r in range(blocks.shape[0])]
        while len(level) > 1:
            level = [
                add(*level[i : i + fan_in]) if len(level[i : i + fan_in]) > 1 else level[i]
                for i in range(0, len(level), fan_in)
            ]
        columns.append(level[0])
    return dask.delayed(_place_partials, pure=True)(ind.shape[0], *columns)


# --------------------------------------------------------------------------------------------------------------------
# public functions
# --------------------------------------------------------------------------------------------------------------------
def grouped_sum(indicator: Any, x: Any, *, split_every: int | None = None) -> np.ndarray:
    """``indicator @ x`` for a lazily read cells x genes matrix, without loading it: a dense float64 result.

    Parameters
    ----------
    indicator
        Groups x cells weights (scipy sparse or dense, host memory): ones for hard labels, assignment weights for
        soft ones.
    x
        A 2-D :class:`dask.array.Array` (cells x genes) with numpy, scipy.sparse or cupy chunks and known chunk
        sizes.
    split_every
        How many partials the tree reduction adds at a time (dask's ``split_every``; ``None``: dask's default).

    Returns
    -------
    The groups x genes sums as a numpy float64 array. Each row chunk contributes ``indicator[:, rows] @ chunk`` in
    float64; integer counts are summed exactly (up to 2**53), other values agree with the in-memory product to
    rounding (the additions run in another order).
    """
    import dask

    (sums,) = dask.compute(_grouped_sum_graph(indicator, x, split_every))
    return np.asarray(sums)


def count_checks(x: Any, *, split_every: int | None = None) -> CountFlags:
    """Whether a lazily read matrix holds non-integer / non-finite or negative values, chunk by chunk.

    Parameters
    ----------
    x
        A :class:`dask.array.Array` with numpy, scipy.sparse or cupy chunks.
    split_every
        Fan-in of the tree reduction of the per-chunk verdicts.

    Returns
    -------
    The :class:`CountFlags` of the whole matrix (only a code per chunk is brought back).
    """
    import dask

    (code,) = dask.compute(_count_flags_graph(x, split_every))
    return CountFlags.from_code(int(code))


def grouped_sum_and_count_checks(
    indicator: Any, x: Any, *, split_every: int | None = None
) -> tuple[np.ndarray, CountFlags]:
    """:func:`grouped_sum` and :func:`count_checks` in one pass over the data (one ``dask.compute``).

    Each chunk is read once and feeds both reductions. The caller raises on bad counts before using the sums.

    Parameters
    ----------
    indicator
        Groups x cells weights, as in :func:`grouped_sum`.
    x
        A 2-D :class:`dask.array.Array` (cells x genes).
    split_every
        Fan-in of both tree reductions.

    Returns
    -------
    The groups x genes float64 sums and the :class:`CountFlags` of ``x``.
    """
    import dask

    sums, code = dask.compute(_grouped_sum_graph(indicator, x, split_every), _count_flags_graph(x, split_every))
    return np.asarray(sums), CountFlags.from_code(int(code))


def _nbytes(x: Any) -> int:
    """Bytes held by a dense or sparse (CSR/CSC/COO) array."""
    if is_sparse(x):
        parts = [getattr(x, name, None) for name in ("data", "indices", "indptr", "row", "col")]
        return int(sum(p.nbytes for p in parts if p is not None))
    return int(x.nbytes)


def load(x: Any, what: str) -> Any:
    """Bring a lazily read (dask) matrix into memory; any other array is returned unchanged.

    Used for what must be whole in memory: a gene block for NMF, the samples x genes counts of DESeq2. Select the
    rows and columns you need lazily first (``x[:, cols]``), so that only those are read.

    Parameters
    ----------
    x
        A :class:`dask.array.Array` (numpy, scipy.sparse or cupy chunks) or an in-memory array.
    what
        The matrix, for the log line (e.g. ``"adata.X"``).

    Returns
    -------
    The computed array: numpy (or cupy) for dense chunks, a CSR matrix (scipy or cupyx) for sparse chunks. A line
    at scanpy's ``info`` level says its shape and size.
    """
    if not is_dask_array(x):
        return x
    import dask

    (out,) = dask.compute(x)
    if is_sparse(out) and out.format != "csr":
        out = out.tocsr()  # chunks joined along genes come back in another sparse format
    logg.info(
        f"{what}: loaded a lazily read {out.shape[0]} x {out.shape[1]} {'sparse ' if is_sparse(out) else ''}"
        f"{out.dtype} matrix into memory ({_nbytes(out) / 1e6:.2f} MB)"
    )
    return out
