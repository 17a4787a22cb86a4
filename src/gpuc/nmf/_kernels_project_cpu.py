"""Compiled CPU kernels (numba) of :mod:`gpuc.nmf._project`: one pass over a host CSR block that reads only the
reference's genes, without copying them out.

A query block holds every gene of the data set (tens of thousands), of which the reference uses a few thousand; the
array path copies the selected columns out (scipy's column indexing, two passes over the block) before summing or
multiplying them. Here ``pos`` maps each column of the block to its position among the selected genes (-1: not used)
and each stored value is looked up once.

:func:`selected_moments` sums per gene in ``N_CHUNKS`` fixed row chunks run in parallel and adds the chunk partials in
chunk order; :func:`selected_product` writes each row of the product independently. Neither result depends on the
thread count.

:func:`compact_selected` copies the selected genes' values out of a whole in-memory matrix once (a count pass over
the column indices, then one pass over every stored value that also sums the per-gene moments), so that the product
then reads only those values: on a query with 13,714 genes of which the reference uses 2,000, a fifth of the stored
values. The copy keeps each row's values in their stored order, so the kernels above add exactly the same numbers in
the same order on the copy as on the original (bit-identical results).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

N_CHUNKS = 16


@njit(cache=True, nogil=True, parallel=True)
def selected_moments(indptr, indices, data, pos, n_sel):  # pragma: no cover - compiled
    """``(2, n_sel)`` float64: per selected gene the sum and the sum of squares of its stored values."""
    rows = indptr.size - 1
    part = np.zeros((N_CHUNKS, 2, n_sel))
    for c in prange(N_CHUNKS):
        for i in range(rows * c // N_CHUNKS, rows * (c + 1) // N_CHUNKS):
            for p in range(indptr[i], indptr[i + 1]):
                j = pos[indices[p]]
                if j >= 0:
                    v = np.float64(data[p])
                    part[c, 0, j] += v
                    part[c, 1, j] += v * v
    out = np.zeros((2, n_sel))
    for c in range(N_CHUNKS):
        out += part[c]
    return out


@njit(cache=True, nogil=True, parallel=True)
def selected_product(indptr, indices, data, pos, w, d, out, row_norm2, row_min):  # pragma: no cover - compiled
    """``out[i] = sum_p data[p] * w[pos[indices[p]]]`` over the row's selected values (``w``: ``(n_sel, k)``, the
    spectra transposed and scaled by ``d``), ``row_norm2[i]`` = the row's ``sum (data * d[pos])^2`` in float64 (NaN
    or inf when a value is), and ``row_min[i]`` its smallest selected value (0 when none is stored).
    """
    rows = indptr.size - 1
    k = w.shape[1]
    for i in prange(rows):
        for t in range(k):
            out[i, t] = 0
        acc = 0.0
        low = 0.0
        for p in range(indptr[i], indptr[i + 1]):
            j = pos[indices[p]]
            if j >= 0:
                v = data[p]
                if v < low:
                    low = v
                for t in range(k):
                    out[i, t] += v * w[j, t]
                s = np.float64(v) * d[j]
                acc += s * s
        row_norm2[i] = acc
        row_min[i] = low


@njit(cache=True, nogil=True, parallel=True)
def compact_selected(indptr, indices, data, pos, n_sel, block_rows):  # pragma: no cover - compiled
    """The selected columns of a CSR matrix as CSR ``(indptr, indices, data)`` (column ``c`` becomes ``pos[c]``,
    ``-1``: dropped; each row's values in their stored order), and the ``(blocks, 2, n_sel)`` moments of every row
    block of ``block_rows`` rows, each summed exactly as :func:`selected_moments` sums that block (the same
    ``N_CHUNKS`` row chunks, added in chunk order), while copying.

    Two parallel passes: the count of selected values per row (reading the column indices only), then the copy of
    each chunk of rows into its place with the chunk's partial sums. No scratch copy is made.
    """
    rows = indptr.size - 1
    n_blocks = max((rows + block_rows - 1) // block_rows, 1)
    n_chunks = n_blocks * N_CHUNKS
    counts = np.empty(rows, dtype=np.int64)
    for i in prange(rows):
        n = 0
        for p in range(indptr[i], indptr[i + 1]):
            n += pos[indices[p]] >= 0
        counts[i] = n
    new_indptr = np.empty(rows + 1, dtype=np.int64)
    new_indptr[0] = 0
    for i in range(rows):
        new_indptr[i + 1] = new_indptr[i] + counts[i]
    out_indices = np.empty(new_indptr[rows], dtype=np.int32)
    out_data = np.empty(new_indptr[rows], dtype=data.dtype)
    bounds = np.empty(n_chunks + 1, dtype=np.int64)  # first row of each chunk (a block's chunks as in selected_moments)
    for cc in range(n_chunks):
        a0 = (cc // N_CHUNKS) * block_rows
        bounds[cc] = a0 + min(block_rows, rows - a0) * (cc % N_CHUNKS) // N_CHUNKS
    bounds[n_chunks] = rows
    part = np.zeros((n_chunks, 2, n_sel))
    for cc in prange(n_chunks):
        q = new_indptr[bounds[cc]]
        for p in range(indptr[bounds[cc]], indptr[bounds[cc + 1]]):
            j = pos[indices[p]]
            if j >= 0:
                v = data[p]
                out_indices[q] = j
                out_data[q] = v
                q += 1
                f = np.float64(v)
                part[cc, 0, j] += f
                part[cc, 1, j] += f * f
    moments = np.zeros((n_blocks, 2, n_sel))
    for b in range(n_blocks):  # each block's partial sums, in chunk order
        for c in range(N_CHUNKS):
            moments[b] += part[b * N_CHUNKS + c]
    return new_indptr, out_indices, out_data, moments
