"""Fused CPU kernels for the Frank-Wolfe inner loops (numba, which scanpy already requires).

They perform exactly the floating-point operations of the array code in :mod:`gpuc.metacells._solver` (same
operation order, no fast-math), so the picks are identical; they only avoid the many passes over (n, k) arrays that
numpy needs. The kernels are module-level so that numba's disk cache serves fresh processes; the solver imports this
module on first use through a loader that gives ``None`` when numba cannot be imported, and then uses its array code
(the same code the GPU runs).

Parallel (numba ``prange``, on the threads that :func:`gpuc._utils.cpu_threads` sets from ``n_jobs``): the A-update
over cells (each cell's steps are independent), the B-update over fixed row chunks whose column minima are merged in
chunk order keeping the earlier row on ties (so the picks are those of one serial pass, whatever the thread count),
and the row-independent products. ``gram_of_columns`` stays serial: its sums over cells would change order.

The sparse products of the fit (``csr_matmat`` for K B and K A^T, ``csr_times_dense`` for K A^T with a dense A^T and
K B R, ``picked_columns`` for K[:, picks], ``frank_wolfe_columns`` for A and B) reproduce scipy's and numpy's results
array for array (same sums in the same order, same index order), so they give the picks of the scipy calls they
replace; they avoid scipy's per-call overhead, which exceeds the work at a few thousand cells, and run rows in
parallel.
``fw_b_update`` runs all steps of a dense-gradient B-update in one call (no Python, no thread wake-up between steps);
each step's row chunks gather their own part of K[:, picks] from a copy of K bucketed once per fit by chunk
(``chunk_buckets``), so no serial transpose is left between the parallel steps.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

N_CHUNKS = 16  # row chunks of the B-update kernels (any number gives the same picks)


@njit(cache=True, nogil=True, inline="always")
def fw_blend(y: float, z: float, gam: float) -> float:  # pragma: no cover - compiled
    """``y + g (z - y)`` in the reference's operation order (every B-update kernel must round alike)."""
    d = z - y
    d = d * gam
    return y + d


@njit(cache=True, nogil=True, parallel=True)
def fw_a_block(q: Any, p: Any, qa: Any, picks: Any, s0: int) -> None:  # pragma: no cover - compiled
    """T Frank-Wolfe steps of the A-update for the cells of one block (rows of ``qa``/``p``), cells in parallel."""
    c, k = qa.shape
    n_steps = picks.shape[0]
    for i in prange(c):
        for t in range(n_steps):
            best = np.inf
            bi = 0
            for m in range(k):
                g = qa[i, m] - p[i, m]
                if g < best:
                    best = g
                    bi = m
            picks[t, s0 + i] = bi
            if t + 1 < n_steps:
                if t == 0:
                    for m in range(k):
                        qa[i, m] = q[bi, m]
                else:
                    gam = 2.0 / (t + 2.0)
                    for m in range(k):
                        d = q[bi, m] - qa[i, m]
                        d = d * gam
                        qa[i, m] = qa[i, m] + d


@njit(cache=True, nogil=True)
def merge_argmin(best: Any, idx: Any) -> Any:  # pragma: no cover - compiled
    """Per-column argmin over row chunks ``(n_chunks, k)`` in chunk order: strict ``<`` keeps the earlier chunk (the
    earlier row) on ties, numpy's first-index rule, so the result is that of one pass over all rows.
    """
    out = idx[0].copy()
    val = best[0].copy()
    for c in range(1, best.shape[0]):
        for j in range(best.shape[1]):
            if best[c, j] < val[j]:
                val[j] = best[c, j]
                out[j] = idx[c, j]
    return out


@njit(cache=True, nogil=True, parallel=True)
def col_argmin_diff(y: Any, s: Any) -> Any:  # pragma: no cover - compiled
    """Column argmin of ``y - s`` (first index on ties, as numpy); row chunks in parallel."""
    n, k = y.shape
    n_chunks = max(1, min(N_CHUNKS, n))
    best = np.full((n_chunks, k), np.inf)
    idx = np.zeros((n_chunks, k), dtype=np.int64)
    for c in prange(n_chunks):
        for i in range(c * n // n_chunks, (c + 1) * n // n_chunks):
            for j in range(k):
                g = y[i, j] - s[i, j]
                if g < best[c, j]:
                    best[c, j] = g
                    idx[c, j] = i
    return merge_argmin(best, idx)


@njit(cache=True, nogil=True, inline="always")
def row_times_columns(
    z: Any, i: int, ip: Any, ix: Any, dx: Any, r: Any, cols: Any, c0: int, width: int
) -> None:  # pragma: no cover - compiled
    """``z[:width] = X[i] @ R[:, cols[c0:c0 + width]]`` for a CSR X: the entries of row ``i`` added in stored order
    into zeros (the B-update kernels that form columns of ``K B R`` must round alike).
    """
    for p in range(width):
        z[p] = 0.0
    for q in range(ip[i], ip[i + 1]):
        m = ix[q]
        v = dx[q]
        for p in range(width):
            z[p] += v * r[m, cols[c0 + p]]


@njit(cache=True, nogil=True, parallel=True)
def fw_b_step_restricted(
    y: Any, s_ip: Any, s_ix: Any, s_dx: Any, ip: Any, ix: Any, dx: Any, r: Any, gam: float, first: bool, k: int
) -> Any:  # pragma: no cover - compiled
    """:func:`fw_b_step` on the stored entries of ``S = K A^T`` only (``y`` holds K B R on that pattern).

    Returns the column minima of ``y - s`` over the pattern and their rows (first row on ties). Off the
    pattern the gradient is ``K B R >= 0``, so a negative pattern minimum is the column's true minimum. Row chunks
    run in parallel and are merged in chunk order (the earlier row keeps a tie).
    """
    n = s_ip.shape[0] - 1
    n_chunks = max(1, min(N_CHUNKS, n))
    best_c = np.full((n_chunks, k), np.inf)
    idx_c = np.zeros((n_chunks, k), dtype=np.int64)
    width = 0
    for i in range(n):
        width = max(width, s_ip[i + 1] - s_ip[i])
    for c in prange(n_chunks):
        z = np.zeros(max(width, 1))
        for i in range(c * n // n_chunks, (c + 1) * n // n_chunks):
            a0 = s_ip[i]
            w = s_ip[i + 1] - a0
            row_times_columns(z, i, ip, ix, dx, r, s_ix, a0, w)
            for p in range(w):
                yv = z[p] if first else fw_blend(y[a0 + p], z[p], gam)
                y[a0 + p] = yv
                g = yv - s_dx[a0 + p]
                j = s_ix[a0 + p]
                if g < best_c[c, j]:
                    best_c[c, j] = g
                    idx_c[c, j] = i
    idx = merge_argmin(best_c, idx_c)
    best = np.empty(k)
    for j in range(k):
        best[j] = np.inf
        for c in range(n_chunks):
            if best_c[c, j] < best[j]:
                best[j] = best_c[c, j]
    return best, idx


@njit(cache=True, nogil=True, parallel=True)
def dense_columns_step(
    ycols: Any, cols: Any, ip: Any, ix: Any, dx: Any, r: Any, gam: float, replace: bool
) -> None:  # pragma: no cover - compiled
    """The dense-path update of a few whole columns of ``K B R`` (same operations as :func:`fw_b_step`).

    With ``z = X @ R[:, cols]`` (X an (n, k) CSR, accumulated in stored order): ``y = z`` when ``replace``
    (X = K B_prev at the start of the update, or the first step, whose g is 1), else ``y += gam (z - y)``.
    """
    n = ip.shape[0] - 1
    m_cols = cols.shape[0]
    n_chunks = max(1, min(N_CHUNKS, n))
    for ch in prange(n_chunks):  # rows are independent
        z = np.zeros(m_cols)
        for i in range(ch * n // n_chunks, (ch + 1) * n // n_chunks):
            row_times_columns(z, i, ip, ix, dx, r, cols, 0, m_cols)
            for c in range(m_cols):
                ycols[i, c] = z[c] if replace else fw_blend(ycols[i, c], z[c], gam)


@njit(cache=True, nogil=True)
def gram_of_columns(indptr: Any, indices: Any, data: Any, k: int) -> Any:  # pragma: no cover - compiled
    """``A A^T`` (dense k x k) of a CSC (k, n) matrix: a sum of per-column outer products."""
    out = np.zeros((k, k))
    for c in range(indptr.shape[0] - 1):
        for p in range(indptr[c], indptr[c + 1]):
            lp = indices[p]
            vp = data[p]
            for q in range(indptr[c], indptr[c + 1]):
                out[lp, indices[q]] += vp * data[q]
    return out


@njit(cache=True, nogil=True, parallel=True)
def csr_times_csr_dense(ip: Any, ix: Any, dx: Any, jp: Any, jx: Any, dj: Any, k: int) -> Any:  # pragma: no cover
    """Dense ``X @ Y`` of two CSR matrices (n x m) and (m x k), accumulated in scipy's order; rows in parallel."""
    n = ip.shape[0] - 1
    out = np.zeros((n, k))
    for i in prange(n):
        for p in range(ip[i], ip[i + 1]):
            j = ix[p]
            v = dx[p]
            for q in range(jp[j], jp[j + 1]):
                out[i, jx[q]] += v * dj[q]
    return out


@njit(cache=True, nogil=True, inline="always")
def add_scaled_rows(acc: Any, ix: Any, dx: Any, x: Any, start: int, end: int) -> None:  # pragma: no cover - compiled
    """``acc += dx[p] * x[ix[p]]`` for ``p`` in ``start..end``, in that order (each entry of ``acc`` gets its terms
    one by one, as a loop over ``p`` gives them), four rows of ``x`` per pass over ``acc``: a quarter of its loads and
    stores, the same sums bit for bit.
    """
    k = acc.shape[0]
    p = start
    while p + 4 <= end:
        v0, v1, v2, v3 = dx[p], dx[p + 1], dx[p + 2], dx[p + 3]
        x0, x1, x2, x3 = x[ix[p]], x[ix[p + 1]], x[ix[p + 2]], x[ix[p + 3]]
        for c in range(k):
            a = acc[c] + v0 * x0[c]
            a = a + v1 * x1[c]
            a = a + v2 * x2[c]
            acc[c] = a + v3 * x3[c]
        p += 4
    while p < end:
        v0 = dx[p]
        x0 = x[ix[p]]
        for c in range(k):
            acc[c] += v0 * x0[c]
        p += 1


@njit(cache=True, nogil=True, parallel=True)
def csr_times_dense(ip: Any, ix: Any, dx: Any, x: Any) -> Any:  # pragma: no cover - compiled
    """Dense ``X @ x`` of a CSR matrix X (n x m) and a dense (m, k) array, each row summed in stored order from zero
    (scipy's ``csr_matvecs`` order, so the result is scipy's bit for bit); rows in parallel.
    """
    n = ip.shape[0] - 1
    k = x.shape[1]
    out = np.zeros((n, k))
    for i in prange(n):
        add_scaled_rows(out[i], ix, dx, x, ip[i], ip[i + 1])
    return out


@njit(cache=True, nogil=True, parallel=True)
def csr_rows_dense(ip: Any, ix: Any, dx: Any, n_cols: int) -> Any:  # pragma: no cover - compiled
    """The rows of a CSR matrix given by ``ip`` (a slice of its indptr: absolute offsets into ``ix``/``dx``) as a
    dense array, entries added in stored order into zeros (scipy's ``toarray`` of the row slice); rows in parallel.
    """
    n = ip.shape[0] - 1
    out = np.zeros((n, n_cols))
    for i in prange(n):
        for p in range(ip[i], ip[i + 1]):
            out[i, ix[p]] += dx[p]
    return out


@njit(cache=True, nogil=True, parallel=True)
def elementwise_product_values(
    xp: Any, xx: Any, xd: Any, yp: Any, yx: Any, yd: Any, n_cols: int
) -> Any:  # pragma: no cover - compiled
    """The stored values of ``X.multiply(Y)`` for CSR X and Y of ``n_cols`` columns in canonical order (rows in
    order, columns increasing, duplicates summed first, exact zeros dropped): the array whose numpy sum is scipy's
    ``X.multiply(Y).sum()`` (scipy sorts the product's entries before summing its data). Rows in parallel; each
    row's product has at most Y's entries in that row, so it is written from Y's row offset and packed after.
    """
    n = xp.shape[0] - 1
    n_chunks = max(1, min(N_CHUNKS, n))
    slots = np.empty(yp[n])
    kept = np.zeros(n, dtype=np.int64)
    for ch in prange(n_chunks):
        bx = np.zeros(n_cols)
        by = np.zeros(n_cols)
        seen = np.zeros(n_cols, dtype=np.bool_)
        cols = np.empty(n_cols, dtype=np.int64)
        for i in range(ch * n // n_chunks, (ch + 1) * n // n_chunks):
            for p in range(xp[i], xp[i + 1]):
                bx[xx[p]] += xd[p]
            m = 0
            for p in range(yp[i], yp[i + 1]):
                j = yx[p]
                by[j] += yd[p]
                if not seen[j]:
                    seen[j] = True
                    cols[m] = j
                    m += 1
            for u in range(1, m):  # Y's distinct columns, increasing (insertion sort: rows are short)
                j = cols[u]
                w = u
                while w > 0 and cols[w - 1] > j:
                    cols[w] = cols[w - 1]
                    w -= 1
                cols[w] = j
            out = yp[i]
            for u in range(m):
                j = cols[u]
                v = bx[j] * by[j]
                if v != 0.0:
                    slots[out] = v
                    out += 1
                seen[j] = False
                by[j] = 0.0
            kept[i] = out - yp[i]
            for p in range(xp[i], xp[i + 1]):
                bx[xx[p]] = 0.0
    offsets = np.zeros(n + 1, dtype=np.int64)
    for i in range(n):
        offsets[i + 1] = offsets[i] + kept[i]
    vals = np.empty(offsets[n])
    for i in prange(n):
        vals[offsets[i] : offsets[i + 1]] = slots[yp[i] : yp[i] + kept[i]]
    return vals


@njit(cache=True, nogil=True)
def picked_columns(kp: Any, kx: Any, kd: Any, picks: Any, n: int) -> Any:  # pragma: no cover - compiled
    """``K[:, picks]`` of a symmetric CSR kernel K as an (n, len(picks)) CSR matrix with sorted rows: row ``picks[m]``
    of K becomes column ``m`` (scipy's ``csr_matrix(K[picks].T)`` after ``sort_indices``, without its overheads).
    """
    k = picks.shape[0]
    indptr = np.zeros(n + 1, dtype=np.int64)
    for m in range(k):
        r = picks[m]
        for p in range(kp[r], kp[r + 1]):
            indptr[kx[p] + 1] += 1
    for i in range(n):
        indptr[i + 1] += indptr[i]
    fill = indptr[:-1].copy()
    indices = np.empty(indptr[n], dtype=np.int64)
    data = np.empty(indptr[n])
    for m in range(k):  # columns in increasing order, so every row comes out sorted
        r = picks[m]
        for p in range(kp[r], kp[r + 1]):
            i = kx[p]
            indices[fill[i]] = m
            data[fill[i]] = kd[p]
            fill[i] += 1
    return indptr, indices, data


@njit(cache=True, nogil=True, parallel=True)
def frank_wolfe_columns(picks: Any, n_rows: int) -> Any:  # pragma: no cover - compiled
    """CSC parts of the (n_rows, n_cols) matrix whose column ``c`` is the Frank-Wolfe iterate after visiting
    ``picks[:, c]`` (row positions below ``n_rows``).

    The operations of :func:`gpuc.metacells._solver._from_argmins` (the reference's recursion ``v <- v + g (e - v)``
    on the distinct picks only, rows sorted). Column chunks run in parallel, each with a row-position table of
    ``n_rows`` entries, so a step finds its entry by one lookup; with few rows (A: the k archetypes) the distinct
    picks are read off the table in order instead of sorted.
    """
    n_steps, n_cols = picks.shape
    pt = np.ascontiguousarray(picks.T)  # each column's picks contiguous
    n_chunks = max(1, min(N_CHUNKS, n_cols))
    counts = np.zeros(n_cols, dtype=np.int64)
    for ch in prange(n_chunks):  # distinct picks per column
        last_col = np.full(n_rows, -1, dtype=np.int64)
        for c in range(ch * n_cols // n_chunks, (ch + 1) * n_cols // n_chunks):
            u = 0
            for t in range(n_steps):
                v = pt[c, t]
                if last_col[v] != c:
                    last_col[v] = c
                    u += 1
            counts[c] = u
    indptr = np.zeros(n_cols + 1, dtype=np.int64)
    for c in range(n_cols):
        indptr[c + 1] = indptr[c] + counts[c]
    indices = np.empty(indptr[n_cols], dtype=np.int64)
    data = np.zeros(indptr[n_cols])
    for ch in prange(n_chunks):
        pos = np.full(n_rows, -1, dtype=np.int64)  # row -> its entry in the current column, -1 elsewhere
        for c in range(ch * n_cols // n_chunks, (ch + 1) * n_cols // n_chunks):
            u = counts[c]
            base = indptr[c]
            m = 0
            for t in range(n_steps):  # mark the distinct rows
                v = pt[c, t]
                if pos[v] < 0:
                    pos[v] = 0
                    indices[base + m] = v
                    m += 1
            if n_rows <= 4 * n_steps:
                e = 0
                for v in range(n_rows):
                    if pos[v] == 0:
                        indices[base + e] = v
                        pos[v] = e
                        e += 1
            else:
                srt = np.sort(indices[base : base + u])
                for e in range(u):
                    indices[base + e] = srt[e]
                    pos[srt[e]] = e
            vals = data[base : base + u]
            for t in range(n_steps):
                h = pos[pt[c, t]]
                if t == 0:
                    vals[h] = 1.0
                    continue
                gam = 2.0 / (t + 2.0)
                vh = vals[h]
                for e in range(u):
                    vals[e] = vals[e] - vals[e] * gam
                vals[h] = vh + gam * (1.0 - vh)
            for e in range(u):
                pos[indices[base + e]] = -1
    return indptr, indices, data


@njit(cache=True, nogil=True, parallel=True)
def chunk_buckets(kp: Any, kx: Any, kd: Any) -> Any:  # pragma: no cover - compiled
    """Each row of a square CSR kernel K with its entries grouped by the B-update row chunk of their column (the
    chunks of :func:`fw_b_step`, ``N_CHUNKS`` of them), keeping the stored order within a group.

    Returns ``(bounds, indices, data)``: the entries of row ``r`` whose column falls in chunk ``c`` are
    ``indices[bounds[r, c]:bounds[r, c + 1]]`` (and ``data``). Built once per fit, it lets every chunk of a B-step
    gather its part of ``K[:, picks]`` itself, in parallel, instead of one serial transpose per step.
    """
    n = kp.shape[0] - 1
    n_chunks = max(1, min(N_CHUNKS, n))
    chunk_of = np.empty(n, dtype=np.int64)
    for c in range(n_chunks):
        chunk_of[c * n // n_chunks : (c + 1) * n // n_chunks] = c
    bounds = np.empty((n, n_chunks + 1), dtype=np.int64)
    indices = np.empty_like(kx)
    data = np.empty_like(kd)
    for ch in prange(n_chunks):  # rows of K in chunks: a counting sort of each row by its entries' chunks
        fill = np.empty(n_chunks + 1, dtype=np.int64)
        for r in range(ch * n // n_chunks, (ch + 1) * n // n_chunks):
            fill[:] = 0
            for p in range(kp[r], kp[r + 1]):
                fill[chunk_of[kx[p]] + 1] += 1
            fill[0] = kp[r]
            for c in range(n_chunks):
                fill[c + 1] += fill[c]
            bounds[r] = fill
            for p in range(kp[r], kp[r + 1]):
                c = chunk_of[kx[p]]
                indices[fill[c]] = kx[p]
                data[fill[c]] = kd[p]
                fill[c] += 1
    return bounds, indices, data


@njit(cache=True, nogil=True, parallel=True)
def fw_b_step(
    y: Any, s: Any, bounds: Any, bx: Any, bd: Any, prev: Any, r: Any, gam: float, first: bool
) -> Any:  # pragma: no cover - compiled
    """One B-step: ``y += gam (K[:, prev] R - y)`` (``y = ...`` when ``first``), then the column argmin of
    ``y - s``. ``(bounds, bx, bd)`` is K bucketed by :func:`chunk_buckets`. Each row chunk adds
    ``K[prev[m], i] R[m]`` into a zeroed (rows, k) block for its cells ``i`` with ``m`` increasing, so every
    entry of ``z = K[:, prev] R`` gets its terms in the order of the CSR rows of :func:`picked_columns` that the
    array code multiplies by R (the same sums, bit for bit, without building those rows); then it updates its rows
    of ``y``. The chunks run in parallel and their minima are merged keeping the earliest row on ties (numpy's rule).
    """
    n, k = y.shape
    n_chunks = bounds.shape[1] - 1
    best = np.full((n_chunks, k), np.inf)
    idx = np.zeros((n_chunks, k), dtype=np.int64)
    for c in prange(n_chunks):
        lo = c * n // n_chunks
        rows = (c + 1) * n // n_chunks - lo
        z = np.zeros((rows, k))
        for m in range(k):
            r_m = r[m]
            pr = prev[m]
            for p in range(bounds[pr, c], bounds[pr, c + 1]):
                z_i = z[bx[p] - lo]
                v = bd[p]
                for j in range(k):
                    z_i[j] += v * r_m[j]
        best_c = np.full(k, np.inf)  # this chunk's minima in arrays of its own, copied out at the end
        idx_c = np.zeros(k, dtype=np.int64)
        for i in range(rows):
            row = lo + i
            y_row = y[row]
            s_row = s[row]
            z_row = z[i]
            for j in range(k):
                yv = z_row[j] if first else fw_blend(y_row[j], z_row[j], gam)
                y_row[j] = yv
                g = yv - s_row[j]
                if g < best_c[j]:
                    best_c[j] = g
                    idx_c[j] = row
        best[c] = best_c
        idx[c] = idx_c
    return merge_argmin(best, idx)


@njit(cache=True, nogil=True)
def fw_b_update(y: Any, s: Any, bounds: Any, bx: Any, bd: Any, r: Any, picks: Any) -> None:  # pragma: no cover
    """Steps 1.. of the dense-gradient B-update in one call: ``picks[0]`` (the argmin of ``K B_prev R - S``) is given;
    step t gathers ``K[:, picks[t - 1]]`` from the bucketed K of :func:`chunk_buckets` and runs
    :func:`fw_b_step` with step size ``2 / (t + 1)``, writing ``picks[t]``. The same operations as the
    step-by-step loop, without a Python round trip (and a thread wake-up) between steps.
    """
    for t in range(1, picks.shape[0]):
        picks[t] = fw_b_step(y, s, bounds, bx, bd, picks[t - 1], r, 2.0 / (t + 1.0), t == 1)


@njit(cache=True, nogil=True, inline="always")
def _rows_with_entries(ap: Any, ax: Any, nonempty: Any, i: int, visit: Any) -> int:  # pragma: no cover - compiled
    """The positions of row ``i`` of X whose column is a row of Y with entries (``nonempty`` is 1 there, else 0),
    in X's stored order, written to ``visit``; returns how many. Branch-free: every position is written and the
    count advances by the flag, so a kernel row whose neighbours are hit at random (K B: about a third of the
    cells carry B's entries) costs no mispredicted branches.
    """
    m = 0
    for p in range(ap[i], ap[i + 1]):
        visit[m] = p
        m += nonempty[ax[p]]
    return m


@njit(cache=True, nogil=True, inline="always")
def _product_row(
    ax: Any, ad: Any, bp: Any, bx: Any, bd: Any, visit: Any, n_visit: int, sums: Any, nxt: Any
) -> Any:  # pragma: no cover
    """One row of ``X @ Y`` accumulated into ``sums`` as scipy's ``csr_matmat`` does, over the positions
    ``visit[:n_visit]`` of X (:func:`_rows_with_entries`: X's stored order without the columns whose row of Y is
    empty, which add nothing); its columns form a linked list through ``nxt`` from the returned head (the reverse
    of their first appearance), with the returned length.
    """
    head = -2
    length = 0
    for u in range(n_visit):
        p = visit[u]
        j = ax[p]
        v = ad[p]
        for q in range(bp[j], bp[j + 1]):
            c = bx[q]
            sums[c] += v * bd[q]
            if nxt[c] == -1:
                nxt[c] = head
                head = c
                length += 1
    return head, length


@njit(cache=True, nogil=True, inline="always")
def _flush_row(head: int, length: int, sums: Any, nxt: Any, idx: Any, val: Any, out: int) -> int:  # pragma: no cover
    """Write the non-zero sums of one :func:`_product_row` from position ``out`` in list order, reset the
    accumulator, and return the position after the last one written (exact zeros are dropped, as scipy does).
    """
    for _ in range(length):
        if sums[head] != 0:
            idx[out] = head
            val[out] = sums[head]
            out += 1
        tmp = head
        head = nxt[head]
        nxt[tmp] = -1
        sums[tmp] = 0.0
    return out


@njit(cache=True, nogil=True, parallel=True)
def csr_matmat(
    ap: Any, ax: Any, ad: Any, bp: Any, bx: Any, bd: Any, n_cols: int, slots_max: int
) -> Any:  # pragma: no cover - compiled
    """CSR parts of ``X @ Y`` for CSR X (n x m) and CSR Y (m x n_cols), exactly as scipy's ``csr_matmat`` computes
    them: each row summed in X's stored order, its columns in scipy's output order (the reverse of their first
    appearance) and exact zeros dropped, so the matrix equals scipy's product array for array. Row chunks run in
    parallel, each with its own accumulator. Up to ``slots_max`` entries of n x n_cols, every row is
    written once into ``n_cols`` slots of its own and the kept entries are packed after; above, a first pass counts
    each row's columns (an upper bound of its stored entries) so that the rows are written in place.
    """
    n = ap.shape[0] - 1
    n_chunks = max(1, min(N_CHUNKS, n))
    direct = n * n_cols <= slots_max
    upper = np.zeros(n + 1, dtype=np.int64)
    if direct:
        for i in range(n):
            upper[i + 1] = upper[i] + n_cols
    else:
        for ch in prange(n_chunks):  # structural entries per row
            seen = np.full(n_cols, -1, dtype=np.int64)
            for i in range(ch * n // n_chunks, (ch + 1) * n // n_chunks):
                cnt = 0
                for p in range(ap[i], ap[i + 1]):
                    j = ax[p]
                    for q in range(bp[j], bp[j + 1]):
                        c = bx[q]
                        if seen[c] != i:
                            seen[c] = i
                            cnt += 1
                upper[i + 1] = cnt
        for i in range(n):
            upper[i + 1] += upper[i]
    idx = np.empty(upper[n], dtype=np.int64)
    val = np.empty(upper[n])
    kept = np.zeros(n, dtype=np.int64)
    m = bp.shape[0] - 1
    nonempty = np.empty(m, dtype=np.int64)
    for j in range(m):
        nonempty[j] = 1 if bp[j + 1] > bp[j] else 0
    longest = 0
    for i in range(n):
        longest = max(longest, ap[i + 1] - ap[i])
    for ch in prange(n_chunks):
        nxt = np.full(n_cols, -1, dtype=np.int64)
        sums = np.zeros(n_cols)
        visit = np.empty(longest, dtype=np.int64)
        for i in range(ch * n // n_chunks, (ch + 1) * n // n_chunks):
            n_visit = _rows_with_entries(ap, ax, nonempty, i, visit)
            head, length = _product_row(ax, ad, bp, bx, bd, visit, n_visit, sums, nxt)
            kept[i] = _flush_row(head, length, sums, nxt, idx, val, upper[i]) - upper[i]
    indptr = np.zeros(n + 1, dtype=np.int64)
    for i in range(n):
        indptr[i + 1] = indptr[i] + kept[i]
    if indptr[n] == upper[n]:
        return indptr, idx, val
    indices = np.empty(indptr[n], dtype=np.int64)
    data = np.empty(indptr[n])
    for i in prange(n):
        indices[indptr[i] : indptr[i + 1]] = idx[upper[i] : upper[i] + kept[i]]
        data[indptr[i] : indptr[i + 1]] = val[upper[i] : upper[i] + kept[i]]
    return indptr, indices, data
