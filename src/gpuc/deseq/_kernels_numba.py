"""CPU only: compiled (numba, a scanpy dependency) per-gene loops of the dispersion solver and the IRLS.

The vectorised numpy form of the NB log posterior in log(alpha) makes ~30 passes over the (genes x samples) arrays
per evaluation (gammaln, digamma and trigamma of y + 1/alpha, log1p, temporaries); the compiled loop makes one pass
and keeps everything in registers. For integer counts below ``K`` the count-dependent special functions use the
exact recurrences from the per-gene values at r = 1/alpha:

    lgamma(y + r) - lgamma(r) = log prod_{k<y} (r + k),   psi(y + r) - psi(r) = sum_{k<y} 1 / (r + k),
    psi_1(y + r) - psi_1(r) = -sum_{k<y} 1 / (r + k)^2,

which are also free of the cancellation of the differences of large lgamma values (small alpha). Larger or
non-integer counts use lgamma and asymptotic series for psi and psi_1 (absolute error < 1e-15 for x >= 10).

The GPU path (and the CPU without numba) uses the vectorised form in ``_dispersion._logpost``; both compute the
same function.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

K = 64  # integer counts below this use the recurrences (per-gene tables)
HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
LOG_FACT = np.array([math.lgamma(k + 1.0) for k in range(K)])  # lgamma(y + 1) of the small integer counts


@njit(cache=True, nogil=True, inline="always")
def psi_big(x):  # pragma: no cover - compiled; x >= 10
    z = 1.0 / (x * x)
    return (
        math.log(x)
        - 0.5 / x
        - z
        * (
            1.0 / 12.0
            - z
            * (
                1.0 / 120.0
                - z * (1.0 / 252.0 - z * (1.0 / 240.0 - z * (1.0 / 132.0 - z * (691.0 / 32760.0 - z / 12.0))))
            )
        )
    )


@njit(cache=True, nogil=True, inline="always")
def tri_big(x):  # pragma: no cover - compiled; x >= 10
    v = 1.0 / x
    z = v * v
    return v + z * (
        0.5
        + v
        * (1.0 / 6.0 - z * (1.0 / 30.0 - z * (1.0 / 42.0 - z * (1.0 / 30.0 - z * (5.0 / 66.0 - z * (691.0 / 2730.0))))))
    )


@njit(cache=True, nogil=True)
def psi(x):  # pragma: no cover - compiled; x > 0
    acc = 0.0
    while x < 10.0:
        acc -= 1.0 / x
        x += 1.0
    return acc + psi_big(x)


@njit(cache=True, nogil=True)
def tri(x):  # pragma: no cover - compiled; x > 0
    acc = 0.0
    while x < 10.0:
        acc += 1.0 / (x * x)
        x += 1.0
    return acc + tri_big(x)


@njit(cache=True, nogil=True)
def nb_logpost(la, y, mu, xx, derivs, cr, f, ga, ha, m, a2, a3):  # pragma: no cover - compiled
    """The per-gene NB terms of :func:`gpuc.deseq._dispersion._logpost`, written into ``f, ga, ha, m, a2, a3``."""
    G, n = y.shape
    pp = xx.shape[1]
    # per-gene tables over integer counts t < K: log prod_{k<t} (r + k), sum 1/(r + k), sum 1/(r + k)^2,
    # filled lazily up to the largest small count met in the gene
    t_lg = np.empty(K)
    t_dg = np.empty(K)
    t_tg = np.empty(K)
    wb = np.empty(n)
    for i in range(G):
        alpha = math.exp(la[i])
        r = 1.0 / alpha
        lgr = math.lgamma(r)
        dgr = 0.0
        tgr = 0.0
        if derivs:
            dgr = psi(r)
            tgr = tri(r)
        t_lg[0] = 0.0
        t_dg[0] = 0.0
        t_tg[0] = 0.0
        filled = 0  # entries 0..filled are valid
        lg_acc = 0.0  # log of the product up to `filled`, in two parts to avoid overflow
        prod = 1.0
        s_lg = 0.0  # sum lgamma(y + r) - lgamma(r)
        s_dg = 0.0  # sum psi(y + r) - psi(r)
        s_tg = 0.0  # sum psi_1(y + r) - psi_1(r)
        s_y = 0.0
        s_yrl = 0.0
        s_l1p = 0.0
        s_w = 0.0
        s_ym = 0.0
        s_ym2 = 0.0
        for j in range(n):
            yj = y[i, j]
            mj = mu[i, j]
            amu = alpha * mj
            u1 = 1.0 + amu
            inv_one = 1.0 / u1
            l1p = math.log(u1) + (amu - (u1 - 1.0)) * inv_one  # log1p(amu), accurate to a few ulp
            yr = yj + r
            s_y += yj
            s_yrl += yr * l1p
            if yj > 0.0:
                if yj < K and yj == math.floor(yj):
                    k = int(yj)
                    while filled < k:
                        q = r + filled
                        prod *= q
                        if prod > 1e250:
                            lg_acc += math.log(prod)
                            prod = 1.0
                        iq = 1.0 / q
                        filled += 1
                        t_lg[filled] = lg_acc + math.log(prod)
                        t_dg[filled] = t_dg[filled - 1] + iq
                        t_tg[filled] = t_tg[filled - 1] - iq * iq
                    s_lg += t_lg[k]
                    s_dg += t_dg[k]
                    s_tg += t_tg[k]
                elif yr >= K:
                    # Stirling / asymptotic series sharing log(y + r) and 1/(y + r) (truncation < 1e-17 at 64)
                    lx = math.log(yr)
                    v = 1.0 / yr
                    z = v * v
                    s_lg += (
                        (yr - 0.5) * lx
                        - yr
                        + HALF_LOG_2PI
                        + v * (1.0 / 12.0 - z * (1.0 / 360.0 - z * (1.0 / 1260.0 - z * (1.0 / 1680.0 - z / 1188.0))))
                        - lgr
                    )
                    if derivs:
                        s_dg += (
                            lx - 0.5 * v - z * (1.0 / 12.0 - z * (1.0 / 120.0 - z * (1.0 / 252.0 - z / 240.0)))
                        ) - dgr
                        s_tg += (v + z * (0.5 + v * (1.0 / 6.0 - z * (1.0 / 30.0 - z * (1.0 / 42.0 - z / 30.0))))) - tgr
                else:
                    s_lg += math.lgamma(yr) - lgr
                    if derivs:
                        s_dg += psi(yr) - dgr
                        s_tg += tri(yr) - tgr
            if derivs or cr:
                w = mj * inv_one
                if derivs:
                    ym = (yj - mj) * inv_one
                    s_l1p += l1p
                    s_w += w
                    s_ym += ym
                    s_ym2 += ym * (2.0 - inv_one)
                wb[j] = w
        if cr:
            # X^T diag(w^k) X for k = 1 (and 2, 3 with derivatives), from the n weights of the gene
            for u in range(pp):
                c1 = 0.0
                c2 = 0.0
                c3 = 0.0
                if derivs:
                    for j in range(n):
                        w = wb[j]
                        xv = xx[j, u]
                        w2 = w * w
                        c1 += w * xv
                        c2 += w2 * xv
                        c3 += w2 * w * xv
                    a2[i, u] = c2
                    a3[i, u] = c3
                else:
                    for j in range(n):
                        c1 += wb[j] * xx[j, u]
                m[i, u] = c1
        f[i] = s_lg + la[i] * s_y - s_yrl
        if derivs:
            base = -s_dg + s_l1p
            ga[i] = r * r * base + r * s_ym
            ha[i] = -2.0 * r * r * r * base + r * r * (s_w + r * r * s_tg) - r * r * s_ym2


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
    rhs = np.empty(p)
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
                rhs[u] = 0.0
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
                    rhs[u] += wz * xu
                    wxu = w * xu
                    for v in range(u, p):
                        mat[u, v] += wxu * x[j, v]
            for u in range(p):
                mat[u, u] += lam[u]
                for v in range(u):
                    mat[u, v] = mat[v, u]
            # Gaussian elimination with partial pivoting (as LAPACK gesv)
            for c in range(p):
                piv = c
                best = abs(mat[c, c])
                for r_ in range(c + 1, p):
                    if abs(mat[r_, c]) > best:
                        best = abs(mat[r_, c])
                        piv = r_
                if piv != c:
                    for v in range(p):
                        tmp = mat[c, v]
                        mat[c, v] = mat[piv, v]
                        mat[piv, v] = tmp
                    tmp = rhs[c]
                    rhs[c] = rhs[piv]
                    rhs[piv] = tmp
                d0 = mat[c, c]
                for r_ in range(c + 1, p):
                    fct = mat[r_, c] / d0
                    if fct != 0.0:
                        for v in range(c, p):
                            mat[r_, v] -= fct * mat[c, v]
                        rhs[r_] -= fct * rhs[c]
            for c in range(p - 1, -1, -1):
                s = rhs[c]
                for v in range(c + 1, p):
                    s -= mat[c, v] * b[v]
                b[c] = s / mat[c, c]
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
