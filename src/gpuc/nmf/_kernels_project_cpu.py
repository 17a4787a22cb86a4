"""Compiled CPU kernels (numba) of :mod:`gpuc.nmf._project`: one pass over a host CSR block that reads only the
reference's genes, without copying them out.

A query block holds every gene of the data set (tens of thousands), of which the reference uses a few thousand; the
array path copies the selected columns out (scipy's column indexing, two passes over the block) before summing or
multiplying them. Here ``pos`` maps each column of the block to its position among the selected genes (-1: not used)
and each stored value is looked up once.

:func:`selected_moments` sums per gene in ``N_CHUNKS`` fixed row chunks run in parallel and adds the chunk partials in
chunk order; :func:`selected_product` writes each row of the product independently. Neither result depends on the
thread count.
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
