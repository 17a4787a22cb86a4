"""CPU only: compiled (numba, a scanpy dependency) per-gene loops of the NB GLM (IRLS) and its likelihood constant.

R's dispersion search has its compiled CPU loops beside its per-gene source, in :mod:`gpuc.deseq._fitdisp`. For
integer counts below ``K``, :func:`nb_const` takes lgamma(y + r) - lgamma(r) from the exact recurrence
log prod_{k<y} (r + k) at r = 1/alpha, free of the cancellation of large lgamma values at small alpha.

The GPU runs the same per-gene code as numba-cuda kernels (:mod:`gpuc.deseq._kernels_gpu`, one thread per gene).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

K = 64  # integer counts below this use the recurrences (per-gene tables)
LOG_FACT = np.array([math.lgamma(k + 1.0) for k in range(K)])  # lgamma(y + 1) of the small integer counts


@njit(cache=True, nogil=True, inline="always")
def solve_pivoted(a, rhs, p, want_logdet, want_solve):  # pragma: no cover - compiled
    """Gaussian elimination with partial pivoting (LAPACK's ``getrf``/``getrs`` order) of the p x p ``a`` against the
    right-hand sides ``rhs`` (p x q), in place: with ``want_solve`` ``rhs`` ends as ``a^-1 rhs``. Returns log|det a|
    when ``want_logdet`` (else 0). Only the upper triangle of ``a`` is kept up to date (the rest is never read).
    """
    q = rhs.shape[1]
    logdet = 0.0
    for c in range(p):
        piv = c
        best = abs(a[c, c])
        for r_ in range(c + 1, p):
            if abs(a[r_, c]) > best:
                best = abs(a[r_, c])
                piv = r_
        if piv != c:
            for v in range(p):
                tmp = a[c, v]
                a[c, v] = a[piv, v]
                a[piv, v] = tmp
            for k in range(q):
                tmp = rhs[c, k]
                rhs[c, k] = rhs[piv, k]
                rhs[piv, k] = tmp
        d0 = a[c, c]
        if want_logdet:
            logdet += math.log(abs(d0))
        for r_ in range(c + 1, p):
            fct = a[r_, c] / d0
            if fct != 0.0:
                for v in range(c + 1, p):
                    a[r_, v] -= fct * a[c, v]
                for k in range(q):
                    rhs[r_, k] -= fct * rhs[c, k]
    if want_solve:  # back substitution, column by column
        for k in range(q):
            for c in range(p - 1, -1, -1):
                acc = rhs[c, k]
                for v in range(c + 1, p):
                    acc -= a[c, v] * rhs[v, k]
                rhs[c, k] = acc / a[c, c]
    return logdet


@njit(cache=True, nogil=True)
def irls(
    y, sf, x, cell, xc, alpha, ll_const, lam, beta, min_mu, maxit, tol, large, iters, converged, failed, dev
):  # pragma: no cover - compiled
    """The per-gene IRLS loop of ``gpuc.deseq._glm._fit_nb_glm`` (same steps and stopping rules), in place."""
    # x: (n, p) design; xc: (n_cells, p) its distinct rows and cell: (n,) the row of each sample, so that
    # exp(X beta) is taken once per cell: mu_j = sf_j exp(xc[cell_j] beta), floored at min_mu
    G, n = y.shape
    p = x.shape[1]
    nc = xc.shape[0]
    log_min_mu = math.log(min_mu)
    logsf = np.log(sf)
    mat = np.empty((p, p))
    rhs = np.empty((p, 1))
    b = np.empty(p)
    ec = np.empty(nc)
    lc = np.empty(nc)
    lm = np.empty(n)  # log mu - log sf (the linear predictor, or the floor's)
    mb = np.empty(n)
    ib = np.empty(n)  # 1 / (1 + alpha mu)
    for i in range(G):
        a = alpha[i]
        inv_a = 1.0 / a
        loga = math.log(a)
        for c in range(nc):
            e = 0.0
            for u in range(p):
                e += beta[i, u] * xc[c, u]
            lc[c] = e
            ec[c] = math.exp(e)
        for j in range(n):
            m_ = sf[j] * ec[cell[j]]
            if m_ < min_mu:
                m_ = min_mu
                lm[j] = log_min_mu - logsf[j]
            else:
                lm[j] = lc[cell[j]]
            mb[j] = m_
            ib[j] = 1.0 / (1.0 + a * m_)
        dev_old = 0.0
        conv = False
        bad = False
        for t in range(maxit):
            for u in range(p):
                rhs[u, 0] = 0.0
                for v in range(p):
                    mat[u, v] = 0.0
            for j in range(n):
                m_ = mb[j]
                inv_one = ib[j]
                w = m_ * inv_one
                # w z = w (log mu - log sf) + w (y - mu) / mu
                wz = w * lm[j] + (y[i, j] - m_) * inv_one
                for u in range(p):
                    xu = x[j, u]
                    rhs[u, 0] += wz * xu
                    wxu = w * xu
                    for v in range(u, p):
                        mat[u, v] += wxu * x[j, v]
            for u in range(p):
                mat[u, u] += lam[u]
                for v in range(u):
                    mat[u, v] = mat[v, u]
            solve_pivoted(mat, rhs, p, False, True)  # as LAPACK gesv
            for u in range(p):
                b[u] = rhs[u, 0]
            iters[i] += 1
            big = False
            for u in range(p):
                if not (abs(b[u]) <= large):
                    big = True
            for c in range(nc):
                e = 0.0
                for u in range(p):
                    e += b[u] * xc[c, u]
                lc[c] = e
                ec[c] = math.exp(e)
            acc = 0.0
            for j in range(n):
                m_ = sf[j] * ec[cell[j]]
                if m_ < min_mu:
                    m_ = min_mu
                    e = log_min_mu - logsf[j]
                else:
                    e = lc[cell[j]]
                mb[j] = m_
                lm[j] = e
                # log1p(a mu) as log(u) + (a mu - (u - 1)) / u, u = 1 + a mu, sharing 1/u with the weights
                am = a * m_
                u1 = 1.0 + am
                iu = 1.0 / u1
                ib[j] = iu
                l1p = math.log(u1) + (am - (u1 - 1.0)) * iu
                acc += -l1p * inv_a + y[i, j] * (loga + e + logsf[j] - l1p)
            d = -2.0 * (ll_const[i] + acc)
            ct = abs(d - dev_old) / (abs(d) + 0.1)
            bad = big or not math.isfinite(ct)
            conv = (not bad) and ct < tol and t > 0
            for u in range(p):
                beta[i, u] = b[u]
            dev_old = d
            if conv or bad:
                break
        converged[i] = conv
        failed[i] = bad
        dev[i] = dev_old


@njit(cache=True, nogil=True)
def nb_const(y, alpha, out):  # pragma: no cover - compiled
    """Per-gene sum over samples of lgamma(y + r) - lgamma(r) - lgamma(y + 1), r = 1/alpha, into ``out``."""
    G, n = y.shape
    t_lg = np.empty(K)
    for i in range(G):
        r = 1.0 / alpha[i]
        lgr = math.lgamma(r)
        t_lg[0] = 0.0
        filled = 0
        lg_acc = 0.0
        prod = 1.0
        s = 0.0
        for j in range(n):
            yj = y[i, j]
            if yj > 0.0:
                if yj < K and yj == math.floor(yj):
                    k = int(yj)
                    while filled < k:
                        prod *= r + filled
                        if prod > 1e250:
                            lg_acc += math.log(prod)
                            prod = 1.0
                        filled += 1
                        t_lg[filled] = lg_acc + math.log(prod)
                    s += t_lg[k] - LOG_FACT[k]
                elif yj >= K:
                    # Stirling series for lgamma(y + r) and lgamma(y + 1) (truncation < 1e-17 at 64; the
                    # log(2 pi) / 2 terms cancel)
                    x1 = yj + r
                    v1 = 1.0 / x1
                    z1 = v1 * v1
                    x2 = yj + 1.0
                    v2 = 1.0 / x2
                    z2 = v2 * v2
                    l1 = (
                        (x1 - 0.5) * math.log(x1)
                        - x1
                        + v1
                        * (1.0 / 12.0 - z1 * (1.0 / 360.0 - z1 * (1.0 / 1260.0 - z1 * (1.0 / 1680.0 - z1 / 1188.0))))
                    )
                    l2 = (
                        (x2 - 0.5) * math.log(x2)
                        - x2
                        + v2
                        * (1.0 / 12.0 - z2 * (1.0 / 360.0 - z2 * (1.0 / 1260.0 - z2 * (1.0 / 1680.0 - z2 / 1188.0))))
                    )
                    s += l1 - l2 - lgr
                else:
                    s += math.lgamma(yj + r) - lgr - math.lgamma(yj + 1.0)
        out[i] = s
