"""Compiled CPU kernels (numba) of the HALS engine, module-level so that numba's disk cache serves fresh processes.

:func:`sweep` is the plain Gauss-Seidel sweep of :func:`gpuc.nmf._hals.sweep`. :func:`spectra_half` and
:func:`usage_half` fuse the half-iterations of the extrapolated batched HALS of :func:`gpuc.nmf._hals.fit_hals_groups`
on sparse ``V``.

The generic ``xp`` code does a half-iteration as separate passes: one SpMM (``V^T W`` or ``V H^T``, all runs at
once), a Gram product, the Gauss-Seidel sweep, the extrapolation and the loss terms, each reading or writing the
``rows x C`` factor blocks. On the CPU these passes are memory- and dispatch-bound. Here one compiled pass per
half-iteration walks the CSR rows of ``V`` (or of ``V^T``) and, for each row, forms that row of the product in a
``C``-float buffer, runs the HALS sweep of the row for every run, applies the extrapolation, and accumulates in
float64 what the next step needs (the new factor's Gram, the loss cross term). The product matrix is never stored.

The ``C`` columns hold groups of runs, each group of one rank (a k sweep fits all its ranks in one pass over ``V``):
walking a CSR row costs about as much as tens of factor columns, so a wider row amortises it (docs/benchmarks.md,
"Where the time goes").

Rows are split into a fixed number of chunks (``N_CHUNKS``), which run in parallel (numba ``prange``, on the threads
that :func:`gpuc._utils.cpu_threads` sets from ``n_jobs``); each chunk accumulates its own partial Grams and the
partials are added in chunk order, so results do not depend on which runs or groups share the batch (every sum is
per run) nor on how many threads run the chunks. Rows are independent otherwise (each writes only its own factor row).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

N_CHUNKS = 16


@njit(cache=True, nogil=True, parallel=True)
def sweep(x, q, g, eps):  # pragma: no cover - compiled
    """The CPU twin of :func:`gpuc.nmf._hals.sweep` (no mask), in place on ``x: (rows, R, k)``; rows in parallel (each
    row is independent, so any thread count gives the same result).
    """
    rows, n_runs, k = x.shape
    for i in prange(rows):
        for r in range(n_runs):
            for c in range(k):
                d = g[r, c, c]
                if d <= 0:
                    continue
                acc = 0.0
                for j in range(k):
                    acc += x[i, r, j] * g[r, j, c]
                v = x[i, r, c] + (q[i, r, c] - acc) / d
                x[i, r, c] = v if v > eps else eps


SWEEP_ROWS = 16  # rows swept side by side by :func:`sweeps`


@njit(cache=True, nogil=True, parallel=True)
def sweeps(x, q, g, eps, n):  # pragma: no cover - compiled
    """``n`` consecutive :func:`sweep` calls in one pass over the rows, bit-identical to them: rows are independent,
    so each row goes through exactly the operations of ``n`` separate sweeps, only in another interleaving. The rows
    are taken ``SWEEP_ROWS`` at a time and swept side by side while they are in cache: one row's update is a chain of
    dependent adds and a division per component, and the independent chains of the other rows fill its wait.
    """
    rows, n_runs, k = x.shape
    for b in prange((rows + SWEEP_ROWS - 1) // SWEEP_ROWS):
        i0 = b * SWEEP_ROWS
        m = min(SWEEP_ROWS, rows - i0)
        acc = np.empty(SWEEP_ROWS)  # the rows' dot products (one array per chunk: private to its thread)
        for _ in range(n):
            for r in range(n_runs):
                for c in range(k):
                    d = g[r, c, c]
                    if d <= 0:
                        continue
                    for t in range(m):
                        acc[t] = 0.0
                    for j in range(k):
                        gj = g[r, j, c]
                        for t in range(m):
                            acc[t] += x[i0 + t, r, j] * gj
                    for t in range(m):
                        v = x[i0 + t, r, c] + (q[i0 + t, r, c] - acc[t]) / d
                        x[i0 + t, r, c] = v if v > eps else eps


@njit(cache=True, inline="always")
def _row_product(indptr, indices, data, f, i, buf):  # pragma: no cover - compiled
    rk = buf.shape[0]
    for t in range(rk):
        buf[t] = 0
    # eight (then four) non-zeros per pass over the buffer: the buffer's loads and stores, not the FMAs, bound this
    # loop, so each pass over it does as many multiply-adds as it can (docs/benchmarks.md)
    p = indptr[i]
    e = indptr[i + 1]
    while p + 7 < e:
        v0 = data[p]
        v1 = data[p + 1]
        v2 = data[p + 2]
        v3 = data[p + 3]
        v4 = data[p + 4]
        v5 = data[p + 5]
        v6 = data[p + 6]
        v7 = data[p + 7]
        r0 = f[indices[p]]
        r1 = f[indices[p + 1]]
        r2 = f[indices[p + 2]]
        r3 = f[indices[p + 3]]
        r4 = f[indices[p + 4]]
        r5 = f[indices[p + 5]]
        r6 = f[indices[p + 6]]
        r7 = f[indices[p + 7]]
        for t in range(rk):
            buf[t] += ((v0 * r0[t] + v1 * r1[t]) + (v2 * r2[t] + v3 * r3[t])) + (
                (v4 * r4[t] + v5 * r5[t]) + (v6 * r6[t] + v7 * r7[t])
            )
        p += 8
    while p + 3 < e:
        v0 = data[p]
        v1 = data[p + 1]
        v2 = data[p + 2]
        v3 = data[p + 3]
        r0 = f[indices[p]]
        r1 = f[indices[p + 1]]
        r2 = f[indices[p + 2]]
        r3 = f[indices[p + 3]]
        for t in range(rk):
            buf[t] += (v0 * r0[t] + v1 * r1[t]) + (v2 * r2[t] + v3 * r3[t])
        p += 4
    while p < e:
        v = data[p]
        row = f[indices[p]]
        for t in range(rk):
            buf[t] += v * row[t]
        p += 1


@njit(cache=True, inline="always")
def _to_t(src, roff, rk, r0, dst, n_runs, k):  # pragma: no cover - compiled
    # the row's columns of runs r0 .. r0 + n_runs (run r at src[roff[r]:roff[r] + rk[r]]) -> (k, R)
    # component-major scratch, zero past each run's own rank, so the per-run work below is SIMD across runs
    for r in range(n_runs):
        o = roff[r0 + r]
        kr = rk[r0 + r]
        for c in range(kr):
            dst[c, r] = src[o + c]
        for c in range(kr, k):
            dst[c, r] = 0


@njit(cache=True, inline="always")
def _row_sweep(xt, qt, gt, q, acc, eps, n_runs, k):  # pragma: no cover - compiled
    # Gauss-Seidel over components, all runs side by side: same arithmetic per run as the generic sweep.
    # Group q's Grams are indexed in place in the (G, kmax, kmax, Rpad) scratch.
    for c in range(k):
        for r in range(n_runs):
            acc[r] = 0.0
        for j in range(k):
            for r in range(n_runs):
                acc[r] += xt[j, r] * gt[q, c, j, r]
        for r in range(n_runs):
            d = gt[q, c, c, r]
            if d > 0:
                v = xt[c, r] + (qt[c, r] - acc[r]) / d
                xt[c, r] = v if v > eps else eps


@njit(cache=True, inline="always")
def _group_sweep(buf, x_row, roff, rk, gk, gr0, gnr, qt, xt, gt, q, acc, eps, n_inner):  # pragma: no cover - compiled
    # lane group q of one row: product and current factor into (k, R) scratch, then n_inner Gauss-Seidel sweeps;
    # returns the group's rank, number of runs and first run
    k = gk[q]
    nr = gnr[q]
    r0 = gr0[q]
    _to_t(buf, roff, rk, r0, qt, nr, k)
    _to_t(x_row, roff, rk, r0, xt, nr, k)
    for _ in range(n_inner):
        _row_sweep(xt, qt, gt, q, acc, eps, nr, k)
    return k, nr, r0


@njit(cache=True, inline="always")
def _gram_add(acc, ch, q, xt, n_runs, k):  # pragma: no cover - compiled
    # upper triangle of each run's x x^T into chunk ch, group q of the float64 (nch, G, kmax, kmax, Rmax) partials
    for a in range(k):
        for b in range(a, k):
            for r in range(n_runs):
                acc[ch, q, a, b, r] += np.float64(xt[a, r]) * xt[b, r]


@njit(cache=True)
def _group_grams(g, gk, gr0, gnr, dtype_of):  # pragma: no cover - compiled
    # padded per-run Grams (R, kmax, kmax) -> per-group (G, kmax, kmax, Rmax) scratch, transposed for the sweep
    n_groups = gk.shape[0]
    gt = np.zeros((n_groups, g.shape[1], g.shape[1], max(gnr.max(), 1)), dtype=dtype_of.dtype)
    for q in range(n_groups):
        for r in range(gnr[q]):
            for a in range(gk[q]):
                for b in range(gk[q]):
                    gt[q, b, a, r] = g[gr0[q] + r, a, b]
    return gt


@njit(cache=True)
def _finish_gram(part, gk, gr0, gnr, n_runs):  # pragma: no cover - compiled
    # chunk partials (nch, G, kmax, kmax, Rmax), upper triangles -> full padded per-run Grams (R, kmax, kmax)
    kmax = part.shape[2]
    out = np.zeros((n_runs, kmax, kmax))
    for ch in range(part.shape[0]):
        for q in range(gk.shape[0]):
            for a in range(gk[q]):
                for b in range(a, gk[q]):
                    for r in range(gnr[q]):
                        out[gr0[q] + r, a, b] += part[ch, q, a, b, r]
    for r in range(n_runs):
        for a in range(kmax):
            for b in range(a + 1, kmax):
                out[r, b, a] = out[r, a, b]
    return out


@njit(cache=True, inline="always")
def _chunk_scratch(f, gt):  # pragma: no cover - compiled
    # the scratch of one row chunk: a row of the product (C,), a lane group's product and factor (kmax, Rmax) in the
    # factor's precision, and the float64 per-run sums of a sweep (Rmax,)
    kmax = gt.shape[1]
    rmax = gt.shape[3]
    buf = np.empty(f.shape[1], dtype=f.dtype)
    return buf, np.empty((kmax, rmax), dtype=f.dtype), np.empty((kmax, rmax), dtype=f.dtype), np.empty(rmax)


@njit(cache=True, nogil=True)
def _spectra_rows(
    ch, nch, indptr, indices, data, w_hat, gt, ht, h_hat, beta, extrap, eps, gk, gr0, gnr, rk, roff, n_inner, part
):  # pragma: no cover - compiled
    # rows ch * n // nch .. (ch + 1) * n // nch of spectra_half, partial Grams into part[ch]
    n = ht.shape[0]
    n_groups = gk.shape[0]
    buf, qt, xt, acc = _chunk_scratch(ht, gt)
    for j in range(ch * n // nch, (ch + 1) * n // nch):
        _row_product(indptr, indices, data, w_hat, j, buf)
        hh = h_hat[j]
        hc = ht[j]
        for q in range(n_groups):
            k, nr, r0 = _group_sweep(buf, hh, roff, rk, gk, gr0, gnr, qt, xt, gt, q, acc, eps, n_inner)
            for r in range(nr):
                b = beta[r0 + r] if extrap else 0.0
                o = roff[r0 + r]
                for c in range(rk[r0 + r]):
                    xv = xt[c, r]
                    t = o + c
                    xh = xv + b * (xv - hc[t]) if extrap else xv
                    hh[t] = xh
                    hc[t] = xv
                    xt[c, r] = xh
            _gram_add(part, ch, q, xt, nr, k)


@njit(cache=True, nogil=True, parallel=True)
def spectra_half(
    indptr, indices, data, w_hat, g_w, ht, h_hat, beta, extrap, eps, gk, gr0, gnr, rk, roff, n_inner
):  # pragma: no cover
    """Spectra half-iteration on the rows (genes) of ``V^T``: ``h_new = sweep(h_hat; V^T w_hat, W^T W)``;
    ``h_hat <- h_new + beta (h_new - ht)`` (or ``h_new`` when not ``extrap``); ``ht <- h_new``.
    ``w_hat``, ``ht``, ``h_hat`` are ``(rows, C)``; run ``r`` owns columns ``roff[r]:roff[r] + rk[r]``. Runs are
    processed in lane groups: group ``q`` is runs ``gr0[q]:gr0[q] + gnr[q]`` swept side by side at rank ``gk[q]``
    (the largest of its runs'; smaller ranks are zero-padded, which adds exact zeros). ``g_w`` is the padded per-run
    Gram ``(R, kmax, kmax)``. Returns the float64 Gram of the new ``h_hat``, padded ``(R, kmax, kmax)``.
    """
    n = ht.shape[0]
    nch = min(N_CHUNKS, n)
    gt = _group_grams(g_w, gk, gr0, gnr, ht)
    part = np.zeros((nch, gk.shape[0], g_w.shape[1], g_w.shape[1], gt.shape[3]))
    for ch in prange(nch):  # row chunks in parallel (the serial chunk kernel keeps the parallel region small)
        _spectra_rows(
            ch,
            nch,
            indptr,
            indices,
            data,
            w_hat,
            gt,
            ht,
            h_hat,
            beta,
            extrap,
            eps,
            gk,
            gr0,
            gnr,
            rk,
            roff,
            n_inner,
            part,
        )
    return _finish_gram(part, gk, gr0, gnr, beta.shape[0])


@njit(cache=True, nogil=True)
def _usage_rows(
    ch,
    nch,
    indptr,
    indices,
    data,
    h_hat,
    gt,
    w,
    w_hat,
    beta,
    eps,
    gk,
    gr0,
    gnr,
    rk,
    roff,
    n_inner,
    p_cross,
    p_new,
    p_hat,
):  # pragma: no cover - compiled
    # rows ch * m // nch .. (ch + 1) * m // nch of usage_half, partial sums into p_cross[ch], p_new[ch], p_hat[ch]
    m = w.shape[0]
    n_groups = gk.shape[0]
    buf, qt, xt, acc = _chunk_scratch(w, gt)
    xh = np.empty_like(xt)
    for i in range(ch * m // nch, (ch + 1) * m // nch):
        _row_product(indptr, indices, data, h_hat, i, buf)
        wh = w_hat[i]
        wc = w[i]
        for q in range(n_groups):
            k, nr, r0 = _group_sweep(buf, wh, roff, rk, gk, gr0, gnr, qt, xt, gt, q, acc, eps, n_inner)
            for r in range(nr):
                b = beta[r0 + r]
                o = roff[r0 + r]
                kr = rk[r0 + r]
                s = 0.0
                for c in range(kr):
                    xv = xt[c, r]
                    t = o + c
                    s += np.float64(xv) * qt[c, r]
                    xv_h = xv + b * (xv - wc[t])
                    wh[t] = xv_h
                    wc[t] = xv
                    xh[c, r] = xv_h
                for c in range(kr, k):
                    xh[c, r] = 0
                p_cross[ch, r0 + r] += s
            _gram_add(p_new, ch, q, xt, nr, k)
            _gram_add(p_hat, ch, q, xh, nr, k)


@njit(cache=True, nogil=True, parallel=True)
def usage_half(
    indptr, indices, data, h_hat, g_h, w, w_hat, beta, eps, gk, gr0, gnr, rk, roff, n_inner
):  # pragma: no cover
    """Usage half-iteration on the rows (cells) of ``V``: ``w_new = sweep(w_hat; V h_hat, H H^T)``; then
    ``w_hat <- w_new + beta (w_new - w)`` and ``w <- w_new``. Layout as in ``spectra_half``. Returns float64
    ``cross (R,) = <w_new, V h_hat>``, ``gram_new = w_new^T w_new`` and ``gram_hat = w_hat^T w_hat`` (padded
    ``(R, kmax, kmax)`` each).
    """
    m = w.shape[0]
    n_runs = beta.shape[0]
    nch = min(N_CHUNKS, m)
    gt = _group_grams(g_h, gk, gr0, gnr, w)
    shape = (nch, gk.shape[0], g_h.shape[1], g_h.shape[1], gt.shape[3])
    p_cross = np.zeros((nch, n_runs))
    p_new = np.zeros(shape)
    p_hat = np.zeros(shape)
    for ch in prange(nch):  # row chunks in parallel; partials merged in chunk order below
        _usage_rows(
            ch, nch, indptr, indices, data, h_hat, gt, w, w_hat, beta, eps, gk, gr0, gnr, rk, roff, n_inner, p_cross,
            p_new, p_hat,
        )  # fmt: skip
    cross = np.zeros(n_runs)
    for ch in range(nch):
        for r in range(n_runs):
            cross[r] += p_cross[ch, r]
    return cross, _finish_gram(p_new, gk, gr0, gnr, n_runs), _finish_gram(p_hat, gk, gr0, gnr, n_runs)
