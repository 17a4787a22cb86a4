"""Fused CPU kernels (numba) for the extrapolated batched HALS of :func:`gpuc.nmf._hals.fit_hals` on sparse ``V``.

The generic ``xp`` code does a half-iteration as separate passes: one SpMM (``V^T W`` or ``V H^T``, all runs at
once), a Gram product, the Gauss-Seidel sweep, the extrapolation and the loss terms, each reading or writing the
``rows x (R*k)`` factor blocks. On the CPU these passes are memory- and dispatch-bound. Here one compiled pass per
half-iteration walks the CSR rows of ``V`` (or of ``V^T``) and, for each row, forms that row of the product in a
``R*k`` buffer, runs the HALS sweep of the row for every run, applies the extrapolation, and accumulates in float64
what the next step needs (the new factor's Gram, the loss cross term). The product matrix is never stored.

Rows are split into a fixed number of chunks (not the thread count), each chunk accumulates its own partial Grams
and the partials are added in chunk order, so results do not depend on the number of threads, nor (every sum is per
run) on which runs share the batch. ``numba`` runs the chunks in parallel over ``NUMBA_NUM_THREADS`` threads.
"""

from __future__ import annotations

import functools
from typing import Any

N_CHUNKS = 16


@functools.cache
def kernels() -> Any:
    """``(spectra_half, usage_half)`` compiled with numba, or ``None`` when numba is unavailable."""
    try:
        import numba
    except ImportError:  # pragma: no cover - numba comes with scanpy
        return None
    import numpy as np

    @numba.njit(cache=True, inline="always")
    def _row_product(indptr, indices, data, f, i, buf):  # pragma: no cover - compiled
        rk = buf.shape[0]
        for t in range(rk):
            buf[t] = 0
        # eight (then four) non-zeros per pass over the buffer: the buffer's loads and stores, not the FMAs, bound
        # this loop (one non-zero per pass ran at 18 GFLOP/s, four at 29, eight ~8% faster again at 60-140 columns)
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

    @numba.njit(cache=True, inline="always")
    def _to_t(src, dst, n_runs, k):  # pragma: no cover - compiled
        # (R*k,) run-major row -> (k, R) component-major scratch, so the per-run work below is SIMD across runs
        for r in range(n_runs):
            for c in range(k):
                dst[c, r] = src[r * k + c]

    @numba.njit(cache=True, inline="always")
    def _row_sweep(xt, qt, gt, acc, eps, n_runs, k):  # pragma: no cover - compiled
        # Gauss-Seidel over components, all runs side by side: same arithmetic per run as the generic sweep
        for c in range(k):
            for r in range(n_runs):
                acc[r] = 0.0
            for j in range(k):
                for r in range(n_runs):
                    acc[r] += xt[j, r] * gt[c, j, r]
            for r in range(n_runs):
                d = gt[c, c, r]
                if d > 0:
                    v = xt[c, r] + (qt[c, r] - acc[r]) / d
                    xt[c, r] = v if v > eps else eps

    @numba.njit(cache=True, inline="always")
    def _gram_add(acc, xt, n_runs, k):  # pragma: no cover - compiled
        # upper triangle of each run's x x^T, float64, (k, k, R)
        for a in range(k):
            for b in range(a, k):
                for r in range(n_runs):
                    acc[a, b, r] += np.float64(xt[a, r]) * xt[b, r]

    @numba.njit(cache=True)
    def _finish_gram(part, n_runs, k):  # pragma: no cover - compiled
        out = np.zeros((n_runs, k, k))
        for ch in range(part.shape[0]):
            for a in range(k):
                for b in range(a, k):
                    for r in range(n_runs):
                        out[r, a, b] += part[ch, a, b, r]
        for r in range(n_runs):
            for a in range(k):
                for b in range(a + 1, k):
                    out[r, b, a] = out[r, a, b]
        return out

    @numba.njit(cache=True, nogil=True)
    def spectra_half(indptr, indices, data, w_hat, g_w, ht, h_hat, beta, extrap, eps, n_runs, k, n_inner):  # pragma: no cover
        """Spectra half-iteration on the rows (genes) of ``V^T``: ``h_new = sweep(h_hat; V^T w_hat, W^T W)``;
        ``h_hat <- h_new + beta (h_new - ht)`` (or ``h_new`` when not ``extrap``); ``ht <- h_new``.
        ``w_hat``, ``ht``, ``h_hat`` are ``(rows, R*k)``. Returns the float64 Gram of the new ``h_hat``, ``(R, k, k)``.
        """
        n = ht.shape[0]
        rk = n_runs * k
        nch = min(N_CHUNKS, n)
        gt = np.empty((k, k, n_runs), dtype=ht.dtype)
        for r in range(n_runs):
            for a in range(k):
                for b in range(k):
                    gt[b, a, r] = g_w[r, a, b]
        part = np.zeros((nch, k, k, n_runs))
        for ch in range(nch):
            buf = np.empty(rk, dtype=ht.dtype)
            qt = np.empty((k, n_runs), dtype=ht.dtype)
            xt = np.empty((k, n_runs), dtype=ht.dtype)
            acc = np.empty(n_runs)
            for j in range(ch * n // nch, (ch + 1) * n // nch):
                _row_product(indptr, indices, data, w_hat, j, buf)
                hh = h_hat[j]
                hc = ht[j]
                _to_t(buf, qt, n_runs, k)
                _to_t(hh, xt, n_runs, k)
                for _ in range(n_inner):
                    _row_sweep(xt, qt, gt, acc, eps, n_runs, k)
                for r in range(n_runs):
                    b = beta[r] if extrap else 0.0
                    for c in range(k):
                        xv = xt[c, r]
                        t = r * k + c
                        xh = xv + b * (xv - hc[t]) if extrap else xv
                        hh[t] = xh
                        hc[t] = xv
                        xt[c, r] = xh
                _gram_add(part[ch], xt, n_runs, k)
        return _finish_gram(part, n_runs, k)

    @numba.njit(cache=True, nogil=True)
    def usage_half(indptr, indices, data, h_hat, g_h, w, w_hat, beta, eps, n_runs, k, n_inner):  # pragma: no cover
        """Usage half-iteration on the rows (cells) of ``V``: ``w_new = sweep(w_hat; V h_hat, H H^T)``; then
        ``w_hat <- w_new + beta (w_new - w)`` and ``w <- w_new``. Returns float64 ``cross (R,) = <w_new, V h_hat>``,
        ``gram_new = w_new^T w_new`` and ``gram_hat = w_hat^T w_hat`` (``(R, k, k)`` each).
        """
        m = w.shape[0]
        rk = n_runs * k
        nch = min(N_CHUNKS, m)
        gt = np.empty((k, k, n_runs), dtype=w.dtype)
        for r in range(n_runs):
            for a in range(k):
                for b in range(k):
                    gt[b, a, r] = g_h[r, a, b]
        p_cross = np.zeros((nch, n_runs))
        p_new = np.zeros((nch, k, k, n_runs))
        p_hat = np.zeros((nch, k, k, n_runs))
        for ch in range(nch):
            buf = np.empty(rk, dtype=w.dtype)
            qt = np.empty((k, n_runs), dtype=w.dtype)
            xt = np.empty((k, n_runs), dtype=w.dtype)
            xh = np.empty((k, n_runs), dtype=w.dtype)
            acc = np.empty(n_runs)
            for i in range(ch * m // nch, (ch + 1) * m // nch):
                _row_product(indptr, indices, data, h_hat, i, buf)
                wh = w_hat[i]
                wc = w[i]
                _to_t(buf, qt, n_runs, k)
                _to_t(wh, xt, n_runs, k)
                for _ in range(n_inner):
                    _row_sweep(xt, qt, gt, acc, eps, n_runs, k)
                for r in range(n_runs):
                    b = beta[r]
                    s = 0.0
                    for c in range(k):
                        xv = xt[c, r]
                        t = r * k + c
                        s += np.float64(xv) * qt[c, r]
                        xv_h = xv + b * (xv - wc[t])
                        wh[t] = xv_h
                        wc[t] = xv
                        xh[c, r] = xv_h
                    p_cross[ch, r] += s
                _gram_add(p_new[ch], xt, n_runs, k)
                _gram_add(p_hat[ch], xh, n_runs, k)
        cross = np.zeros(n_runs)
        for ch in range(nch):
            cross += p_cross[ch]
        return cross, _finish_gram(p_new, n_runs, k), _finish_gram(p_hat, n_runs, k)

    return spectra_half, usage_half
