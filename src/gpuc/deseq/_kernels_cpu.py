"""CPU only: compiled (numba, a scanpy dependency) per-gene loops of the NB GLM (IRLS) and its likelihood constant.

:func:`irls` is R DESeq2's ``fitBeta`` (C++, ``useQR``) with the linear algebra it calls done in the order of
Armadillo 12 and reference LAPACK / BLAS 3.11 (Householder QR by ``dgeqr2`` and ``dorg2r``, ``dgemv``, the
triangular solve), so that its coefficients, and the means the dispersion searches start from, are R's doubles
(Golub & Van Loan, *Matrix Computations*, 4th ed., 5.1-5.2; Anderson et al., *LAPACK Users' Guide*). R's
dispersion search has its compiled CPU loops beside its per-gene source, in :mod:`gpuc.deseq._fitdisp`. For integer
counts below ``K``, :func:`nb_const` takes lgamma(y + r) - lgamma(r) from the exact recurrence log prod_{k<y} (r + k)
at r = 1/alpha, free of the cancellation of large lgamma values at small alpha.

The GPU runs the same steps as numba-cuda kernels (:mod:`gpuc.deseq._kernels_gpu`, one thread per gene).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

K = 64  # integer counts below this use the recurrences (per-gene tables)
LOG_FACT = np.array([math.lgamma(k + 1.0) for k in range(K)])  # lgamma(y + 1) of the small integer counts


@njit(cache=True, nogil=True, inline="always")
def householder_reflector(a, col, m):  # pragma: no cover - compiled
    """LAPACK ``dlarfg`` on column ``col`` of ``a`` (m rows, from the diagonal down): makes H = I - tau v v' with
    v = (1, a[col+1:, col]) and H a[col:, col] = (beta, 0, ...); returns tau, leaves beta on the diagonal.
    """
    alpha = a[col, col]
    ss = 0.0  # reference BLAS 3.10+ dnrm2 for moderate entries: the square root of the ordered sum of squares
    for r in range(col + 1, m):
        ss += abs(a[r, col]) * abs(a[r, col])
    xnorm = math.sqrt(ss)
    if xnorm == 0.0:
        return 0.0
    # dlapy2(alpha, xnorm): sqrt(alpha^2 + xnorm^2) without overflow
    aa = abs(alpha)
    big = max(aa, xnorm)
    small = min(aa, xnorm)
    hyp = big if small == 0.0 else big * math.sqrt(1.0 + (small / big) * (small / big))
    beta = -math.copysign(hyp, alpha)
    tau = (beta - alpha) / beta
    scale = 1.0 / (alpha - beta)
    for r in range(col + 1, m):
        a[r, col] = scale * a[r, col]
    a[col, col] = beta
    return tau


@njit(cache=True, nogil=True, inline="always")
def apply_reflector(a, col, m, p, tau, work):  # pragma: no cover - compiled
    """LAPACK ``dlarf`` from the left: columns col+1..p-1 of ``a`` (rows col..m-1) times H = I - tau v v', v the
    reflector stored in column ``col`` with a[col, col] taken as 1 (the caller sets it): w = C' v (``dgemv``, each
    entry summed down the rows), then C - tau v w' (``dger``).
    """
    if tau == 0.0:
        return
    for c in range(col + 1, p):
        t = 0.0
        for r in range(col, m):
            t += a[r, c] * a[r, col]
        work[c] = t
    for c in range(col + 1, p):
        if work[c] != 0.0:
            t = -tau * work[c]
            for r in range(col, m):
                a[r, c] = a[r, c] + a[r, col] * t


@njit(cache=True, nogil=True, inline="always")
def thin_qr(a, m, p, r_out, tau, work):  # pragma: no cover - compiled
    """Armadillo's ``qr_econ`` of the m x p ``a`` (m > p) as LAPACK 3.11 computes it for p below its block size:
    ``dgeqr2`` (reflectors), R copied from the upper triangle, then ``dorg2r`` forms the thin Q in ``a``.
    """
    for i in range(p):
        tau[i] = householder_reflector(a, i, m)
        if i < p - 1:
            aii = a[i, i]
            a[i, i] = 1.0
            apply_reflector(a, i, m, p, tau[i], work)
            a[i, i] = aii
    for c in range(p):
        for r in range(p):
            r_out[r, c] = a[r, c] if r <= c else 0.0
    for i in range(p - 1, -1, -1):
        if i < p - 1:
            a[i, i] = 1.0
            apply_reflector(a, i, m, p, tau[i], work)
        for r in range(i + 1, m):
            a[r, i] = -tau[i] * a[r, i]
        a[i, i] = 1.0 - tau[i]
        for r in range(i):
            a[r, i] = 0.0


@njit(cache=True, nogil=True)
def irls(
    y, nf, x, alpha, ll_const, lam, beta, min_mu, maxit, tol, large, iters, converged, failed, dev
):  # pragma: no cover - compiled
    """R DESeq2's ``fitBeta`` (``useQR``) for every gene, in place, operation for operation: the weighted design
    with the ridge rows sqrt(lambda) below it, its thin QR (:func:`thin_qr`), gamma = Q' (z sqrt(w)) (``dgemv``),
    R beta = gamma by back substitution (``dtrsm``), mu = nf exp(X beta) (``dgemv``, then the C library's exp),
    floored at ``min_mu``. ``nf``: (1, n) size factors or (G, n) normalisation factors.

    The loop stops as R's: a coefficient above ``large`` in absolute value (``failed``), a deviance change under
    ``tol`` relative after the first step (``converged``), a non-finite change (``failed``), or ``maxit`` steps. The
    deviance (-2 log-likelihood at the floored mu) is gpuc's ``ll_const`` plus the mu terms, not R's ``dnbinom``;
    it only decides the stop (its relative change against 1e-8) and equals R's to rounding.
    """
    G, n = y.shape
    p = x.shape[1]
    m = n + p
    per_gene = nf.shape[0] > 1
    a = np.empty((m, p))
    r_mat = np.empty((p, p))
    tau = np.empty(p)
    work = np.empty(p)
    bz = np.zeros(m)
    b = np.empty(p)
    mu = np.empty(n)
    lin = np.empty(n)  # X beta per sample
    ex = np.empty(n)  # exp(X beta)
    lnf = np.empty(n)
    sqrt_lam = np.sqrt(lam)
    log_min_mu = math.log(min_mu)
    # samples with equal design rows have equal X beta (the same operations on the same values): each distinct row
    # is evaluated once, at its first sample
    first = np.empty(n, dtype=np.int64)
    for j in range(n):
        first[j] = j
        for jj in range(j):
            same = True
            for c in range(p):
                if x[jj, c] != x[j, c]:
                    same = False
                    break
            if same:
                first[j] = jj
                break
    for i in range(G):
        k = i if per_gene else 0
        al = alpha[i]
        inv_a = 1.0 / al
        loga = math.log(al)
        if i == 0 or per_gene:
            for j in range(n):
                lnf[j] = math.log(nf[k, j])
        linear_means(beta[i], x, nf[k], first, min_mu, lin, ex, mu)
        dev_old = 0.0
        d = 0.0
        conv = False
        bad = False
        for t in range(maxit):
            iters[i] += 1
            for j in range(n):
                w = mu[j] / (1.0 + al * mu[j])
                sw = math.sqrt(w)
                for c in range(p):
                    a[j, c] = x[j, c] * sw
                z = math.log(mu[j] / nf[k, j]) + (y[i, j] - mu[j]) / mu[j]
                bz[j] = z * sw
            for r in range(p):
                for c in range(p):
                    a[n + r, c] = sqrt_lam[c] if r == c else 0.0
            thin_qr(a, m, p, r_mat, tau, work)
            for c in range(p):
                g = 0.0
                for r in range(m):
                    g += a[r, c] * bz[r]
                b[c] = g
            for kk in range(p - 1, -1, -1):
                if b[kk] != 0.0:
                    b[kk] = b[kk] / r_mat[kk, kk]
                    for r in range(kk):
                        b[r] = b[r] - b[kk] * r_mat[r, kk]
            for c in range(p):
                beta[i, c] = b[c]
            big = False
            for c in range(p):
                if abs(b[c]) > large:
                    big = True
            if big:
                bad = True
                break
            linear_means(b, x, nf[k], first, min_mu, lin, ex, mu)
            acc = 0.0
            for j in range(n):
                v = mu[j]
                lv = lin[j] + lnf[j] if v > min_mu else log_min_mu  # log mu (to rounding)
                l1p = math.log1p(al * v)
                acc += -l1p * inv_a + y[i, j] * (loga + lv - l1p)
            d = -2.0 * (ll_const[i] + acc)
            ct = abs(d - dev_old) / (abs(d) + 0.1)
            if not math.isfinite(ct):
                bad = True
                break
            if t > 0 and ct < tol:
                conv = True
                break
            dev_old = d
        converged[i] = conv
        failed[i] = bad
        dev[i] = d


@njit(cache=True, nogil=True, inline="always")
def linear_means(beta, x, nf, first, min_mu, lin, ex, mu):  # pragma: no cover - compiled
    """R's mu = fmax(nf exp(X beta), min_mu) sample by sample, X beta summed over the coefficients in order
    (``dgemv``); the linear predictor and its exp taken once per distinct design row (``first``: a sample's first
    sample with the same row).
    """
    for j in range(x.shape[0]):
        f = first[j]
        if f == j:
            e = 0.0
            for c in range(x.shape[1]):
                e = e + beta[c] * x[j, c]
            lin[j] = e
            ex[j] = math.exp(e)
        else:
            lin[j] = lin[f]
            ex[j] = ex[f]
        v = nf[j] * ex[j]
        mu[j] = v if v >= min_mu else min_mu  # fmax(mu, minmu)


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
