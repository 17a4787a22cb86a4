"""R DESeq2's per-gene dispersion search (C++ ``fitDisp`` and ``fitDispGrid``), one source for CPU and GPU kernels.

The functions here are plain Python registered as jitable for both numba targets (:func:`jitable`): the CPU kernels
(:mod:`gpuc.deseq._kernels_cpu`, ``numba.njit``) and the GPU kernels (:mod:`gpuc.deseq._kernels_gpu`,
``numba.cuda.jit``; run as Python under numba-cuda's simulator) call the same code, so both devices take the same
steps. The batched array form (:func:`gpuc.deseq._dispersion._fitdisp_array`) follows the same arithmetic.

What R computes (DESeq2 1.38, ``src/DESeq2.cpp``), and therefore what these functions compute, operation for
operation where the order changes rounding:

- log posterior in log alpha: ``sum_j [lgamma(y_j + 1/a) - lgamma(1/a) - y_j log(mu_j + 1/a)
  - (1/a) log(1 + mu_j a)]`` (R's own ``lgammafn``, see :func:`r_lgamma`), plus the log-normal prior
  ``-(log a - m)^2 / (2 s2)`` for MAP, plus the Cox-Reid term ``-log det(X' W X) / 2`` with
  ``W = 1 / (1/mu + a)``. The count terms lose digits at small alpha (differences of large lgamma values); R's
  search, and its stopping decisions, see exactly those rounded values, so gpuc computes them the same way.
- derivative in log alpha: ``a^-1 * sum_j [psi(1/a) + log(1 + mu_j a) - mu_j a / (1 + mu_j a) - psi(y_j + 1/a)
  + y_j / (mu_j + 1/a)] + a * (-trace((X'WX)^-1 X' W^2 X) / 2)`` plus ``-(log a - m) / s2``.
- search (:func:`fit_disp_gene`): steepest ascent on log alpha with Armijo backtracking (constant 1e-4): the
  proposal ``a + kappa * dlp`` is accepted when the log posterior rises by at least ``1e-4 kappa dlp^2``; else kappa
  halves. Proposals are limited to [-30, 10] (kappa is shortened to reach the limit). After an accepted step the
  search stops when the log posterior rose by less than ``tol`` or log alpha fell below ``min_log_alpha``; else
  kappa grows by 1.1 (at most kappa_0) and halves after every fifth accepted step. At most ``maxit`` proposals.
- grid (:func:`fit_disp_grid_gene`): the log posterior on 20 points from log 1e-8 to log max(10, n), then on 20
  points spanning one coarse step either side of the best; the first maximum wins.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

try:  # numba-cuda registers a function for both targets (the CPU's numba registry too)
    from numba.cuda.extending import overload as _cuda_overload
except ImportError:  # pragma: no cover - without numba-cuda only the CPU kernels exist
    _cuda_overload = None
from numba.extending import register_jitable as _register_jitable

LN_SQRT_2PI = 0.918938533204672741780329736406  # log(sqrt(2 pi)), R's M_LN_SQRT_2PI
ARMIJO = 1.0e-4  # R's epsilon in fitDisp
# Above this dispersion R's count terms are computed from exact per-gene tables instead of R's formula (see
# log_posterior); below it R's formula itself, whose rounding R's search sees there.
TABLE_MIN_ALPHA = 1e-4
TABLE = 64  # integer counts below this take the tables; the scratch ``b`` holds p * p + TABLE values


def jitable(fn):
    """Register ``fn`` (plain Python) so that numba CPU and numba-cuda kernels can both call it; returns ``fn``."""
    if _cuda_overload is not None:
        _cuda_overload(fn, target="generic", strict=False, inline="never")(lambda *args: fn)
    else:  # pragma: no cover
        _register_jitable(fn)
    return fn


@jitable
def stirling_corr(x):
    """lgamma(x) - [(x - 1/2) log x - x + log sqrt(2 pi)] for x > 10 by the Stirling series (8 terms, error below
    2e-18); R uses a 5-term Chebyshev series there, equal to well below the rounding of lgamma itself.
    """
    v = 1.0 / x
    z = v * v
    s = 1.0 / 156.0 - z * (3617.0 / 122400.0)
    s = 691.0 / 360360.0 - z * s
    s = 1.0 / 1188.0 - z * s
    s = 1.0 / 1680.0 - z * s
    s = 1.0 / 1260.0 - z * s
    s = 1.0 / 360.0 - z * s
    s = 1.0 / 12.0 - z * s
    return s * v


@jitable
def r_lgamma(x):
    """lgamma(x) for x > 0 with R's ``lgammafn`` branches (R's ``src/nmath/lgamma.c``): the C library's value up to
    10, then ``log sqrt(2 pi) + (x - 1/2) log x - x`` plus the Stirling correction up to 4934720, without it above
    that, and ``x (log x - 1)`` above 1e17. The branches matter at small dispersions, where R's line search works on
    lgamma values near 1e9 whose rounding it sees.
    """
    if x <= 10.0:
        return math.lgamma(x)
    return r_lgamma_log(x, math.log(x))


@jitable
def r_lgamma_log(x, lx):
    """:func:`r_lgamma` for x > 10 given ``lx`` = log(x) (the search keeps it for :func:`r_digamma_log`)."""
    if x > 1e17:
        return x * (lx - 1.0)
    base = LN_SQRT_2PI + (x - 0.5) * lx - x
    if x > 4934720.0:
        return base
    return base + stirling_corr(x)


@jitable
def r_digamma(x):
    """psi(x) for x > 0: the recurrence up to x >= 10, then the asymptotic series (absolute error below 1e-15).

    Only the derivative uses it, and only its accuracy matters there: R's own digamma differs in the last bits, which
    moves a proposal by as little as those bits; the decisions of the search are taken on the log posterior.
    """
    acc = 0.0
    while x < 10.0:
        acc -= 1.0 / x
        x += 1.0
    return acc + r_digamma_log(x, math.log(x))


@jitable
def r_digamma_log(x, lx):
    """The asymptotic series of :func:`r_digamma` for x >= 10 given ``lx`` = log(x)."""
    v = 1.0 / x
    z = v * v
    s = 691.0 / 32760.0 - z / 12.0
    s = 1.0 / 132.0 - z * s
    s = 1.0 / 240.0 - z * s
    s = 1.0 / 252.0 - z * s
    s = 1.0 / 120.0 - z * s
    s = 1.0 / 12.0 - z * s
    return lx - 0.5 * v - z * s


@jitable
def cr_matrices(alpha, mu, off, sj, n, x, p, b, db, want_db):
    """``b = X' W X`` and (``want_db``) ``db = -X' W^2 X`` (flat p x p), W = 1 / (1/mu + alpha), for the gene whose
    means are ``mu[off + j * sj]``; ``x`` is the n x p design, flat and row-major.
    """
    for k in range(p * p):
        b[k] = 0.0
        if want_db:
            db[k] = 0.0
    for j in range(n):
        # R: w = 1 / (1/mu + alpha), dw = -1 / (1/mu + alpha)^2; the same values up to the last bit, which moves
        # log det(X' W X) by less than its own rounding
        mj = mu[off + j * sj]
        w = mj / (1.0 + mj * alpha)
        dw = -(w * w)
        for r in range(p):
            xr = x[j * p + r]
            if xr == 0.0:
                continue
            for c in range(p):
                t = xr * x[j * p + c]
                b[r * p + c] += t * w
                if want_db:
                    db[r * p + c] += t * dw


@jitable
def cholesky_logdet(b, p):
    """Cholesky factor of the symmetric positive definite ``b`` (flat p x p) in place (lower triangle); returns
    log det(b), NaN when it is not positive definite (R then gets the log of a non-positive determinant).
    """
    logdet = 0.0
    for j in range(p):
        s = b[j * p + j]
        for k in range(j):
            s -= b[j * p + k] * b[j * p + k]
        if not s > 0.0:
            return math.nan
        d = math.sqrt(s)
        b[j * p + j] = d
        logdet += 2.0 * math.log(d)
        for i in range(j + 1, p):
            s = b[i * p + j]
            for k in range(j):
                s -= b[i * p + k] * b[j * p + k]
            b[i * p + j] = s / d
    return logdet


@jitable
def chol_trace_solve(lf, db, p):
    """trace(b^-1 db) from the Cholesky factor ``lf`` of b (:func:`cholesky_logdet`); overwrites ``db``."""
    tr = 0.0
    for c in range(p):
        # solve L z = db[:, c], then L' u = z, in place in column c of db
        for i in range(p):
            s = db[i * p + c]
            for k in range(i):
                s -= lf[i * p + k] * db[k * p + c]
            db[i * p + c] = s / lf[i * p + i]
        for i in range(p - 1, -1, -1):
            s = db[i * p + c]
            for k in range(i + 1, p):
                s -= lf[k * p + i] * db[k * p + c]
            db[i * p + c] = s / lf[i * p + i]
        tr += db[c * p + c]
    return tr


@jitable
def max_small_count(y, off, sj, n):
    """The largest integer count below :data:`TABLE` of the gene, or -1 when a count is not an integer."""
    m = 0
    for j in range(n):
        yj = y[off + j * sj]
        if yj != math.floor(yj):
            return -1
        if yj < TABLE and yj > m:
            m = int(yj)
    return m


@jitable
def cr_from_weights(wts, n, x, p, b, db, want_db):
    """:func:`cr_matrices` from the weights W already in ``wts[0:n]`` (:func:`log_posterior_k` keeps them), one
    element of ``b`` (and ``db``) at a time in a scalar: each element adds the same terms in the same order as
    :func:`cr_matrices` (samples whose row entry is 0 skipped alike), so the sums are the same to the bit.
    """
    for r in range(p):
        for c in range(p):
            s = 0.0
            ds = 0.0
            for j in range(n):
                xr = x[j * p + r]
                if xr == 0.0:
                    continue
                t = xr * x[j * p + c]
                w = wts[j]
                s += t * w
                if want_db:
                    ds += t * (-(w * w))
            b[r * p + c] = s
            if want_db:
                db[r * p + c] = ds


@jitable
def cr_matrices_kept(alpha, mu, off, sj, n, x, p, b, db, want_db, cache, kept):
    """:func:`cr_matrices`, from the weights in ``cache[n:2n]`` where ``kept`` (:func:`log_posterior_k` put them
    there at this alpha), else from the means.
    """
    if kept:
        cr_from_weights(cache[n:], n, x, p, b, db, want_db)
    else:
        cr_matrices(alpha, mu, off, sj, n, x, p, b, db, want_db)


@jitable
def log_posterior(la, y, mu, off, sj, n, x, p, pm, pv, use_prior, use_cr, b, cache):
    """R's ``log_posterior`` of one gene (counts ``y[off + j * sj]``, means ``mu[...]``) at log alpha ``la``; ``b``
    is scratch of p * p + :data:`TABLE` values; ``cache``: see :func:`log_posterior_k`.
    """
    k = max_small_count(y, off, sj, n)
    return log_posterior_k(la, y, mu, off, sj, n, x, p, pm, pv, use_prior, use_cr, b, cache, k)


@jitable
def log_posterior_k(la, y, mu, off, sj, n, x, p, pm, pv, use_prior, use_cr, b, cache, kmax):
    """:func:`log_posterior` with the gene's :func:`max_small_count` ``kmax`` (it depends on the counts only, so the
    search takes it once per gene). ``cache`` (3 n values, or fewer for none) receives per sample, for
    :func:`dlog_posterior_k` at the same point: log(1 + mu alpha), the Cox-Reid weight W and, for counts whose
    y + 1/alpha exceeds 10, log(y + 1/alpha); the same values the derivative would compute afresh.

    The count terms are R's expression, operation for operation, except above :data:`TABLE_MIN_ALPHA` (where R's
    rounding is far below its tolerances) for the counts from 1 to :data:`TABLE` - 1 of a gene with more samples
    than its largest such count: there lgamma(y + r) - lgamma(r) = sum_{i<y} log(r + i) comes from a
    per-evaluation table and y log(mu + r) = y (log r + log(1 + mu alpha)), one logarithm per sample instead of
    three, equal to R's expression to its rounding (about 1e-13 relative).
    """
    alpha = math.exp(la)
    keep = cache.shape[0] >= 3 * n
    r = 1.0 / alpha
    lgr = r_lgamma(r)
    ll = 0.0
    k = kmax if alpha >= TABLE_MIN_ALPHA else -1
    table = k > 0 and k < n
    lr = 0.0
    t = p * p  # b[t + c]: sum_{i<c} log(r + i)
    if table:
        acc = 0.0  # the running sum in a register (the same additions)
        b[t] = acc
        for c in range(1, k + 1):
            acc = acc + math.log(r + (c - 1))
            b[t + c] = acc
        lr = math.log(r)
    for j in range(n):
        yj = y[off + j * sj]
        mj = mu[off + j * sj]
        u = 1.0 + mj * alpha
        l1 = math.log(u)
        if keep:
            cache[j] = l1
            if use_cr:
                # R: w = 1 / (1/mu + alpha); the same value up to the last bit (see cr_matrices)
                cache[n + j] = mj / u
        if yj == 0.0:
            # lgamma(0 + r) - lgamma(r) and 0 * log(mu + r) are exactly 0 in R's sum too
            ll += 0.0 - r * l1
        elif table and yj < TABLE:
            ll += b[t + int(yj)] - yj * lr - (yj + r) * l1
        else:  # R's expression (for the large counts, whose rounding is the largest, also in the table case)
            xg = yj + r
            if xg > 10.0:
                lx = math.log(xg)
                if keep:
                    cache[2 * n + j] = lx
                lg = r_lgamma_log(xg, lx)
            else:
                lg = math.lgamma(xg)
            ll += lg - lgr - yj * math.log(mj + r) - r * l1
    cr = 0.0
    if use_cr:
        cr_matrices_kept(alpha, mu, off, sj, n, x, p, b, b, False, cache, keep)
        cr = -0.5 * cholesky_logdet(b, p)
    prior = 0.0
    if use_prior:
        d = la - pm
        prior = -0.5 * (d * d) / pv
    return ll + prior + cr


@jitable
def dlog_posterior(la, y, mu, off, sj, n, x, p, pm, pv, use_prior, use_cr, b, db, cache, cached):
    """R's ``dlog_posterior`` (derivative in log alpha) of one gene at log alpha ``la``; see
    :func:`dlog_posterior_k`.
    """
    k = max_small_count(y, off, sj, n)
    return dlog_posterior_k(la, y, mu, off, sj, n, x, p, pm, pv, use_prior, use_cr, b, db, cache, cached, k)


@jitable
def dlog_posterior_k(la, y, mu, off, sj, n, x, p, pm, pv, use_prior, use_cr, b, db, cache, cached, kmax):
    """R's ``dlog_posterior`` (derivative in log alpha) of one gene at log alpha ``la``, with the gene's
    :func:`max_small_count` ``kmax``; above :data:`TABLE_MIN_ALPHA`, for integer counts below :data:`TABLE`,
    psi(r) - psi(y + r) is the exact sum -sum_{i<y} 1 / (r + i) (a per-evaluation table in ``b``), below it R's
    expression. With ``cached``, ``cache`` holds the values :func:`log_posterior_k` kept at this point.
    """
    alpha = math.exp(la)
    cached = cached and cache.shape[0] >= 3 * n
    cr = 0.0
    if use_cr:
        cr_matrices_kept(alpha, mu, off, sj, n, x, p, b, db, True, cache, cached)
        cholesky_logdet(b, p)
        cr = -0.5 * chol_trace_solve(b, db, p)
    r = 1.0 / alpha
    r2 = 1.0 / (alpha * alpha)
    dgr = r_digamma(r)
    k = kmax if alpha >= TABLE_MIN_ALPHA else -1
    t = p * p  # b[t + c]: sum_{i<c} 1 / (r + i)
    acc = 0.0  # the running sum in a register (the same additions)
    b[t] = acc
    for c in range(1, k + 1):
        acc = acc + 1.0 / (r + (c - 1))
        b[t + c] = acc
    s = 0.0
    for j in range(n):
        yj = y[off + j * sj]
        mj = mu[off + j * sj]
        ma = mj * alpha
        u = 1.0 + ma
        lu = cache[j] if cached else math.log(u)
        if yj == 0.0:
            s += lu - ma / u
        elif k >= 0 and yj < TABLE:
            s += lu - ma / u - b[t + int(yj)] + yj / (mj + r)
        else:
            xg = yj + r
            if cached and xg > 10.0:
                dg = r_digamma_log(xg, cache[2 * n + j])
            else:
                dg = r_digamma(xg)
            s += dgr + lu - ma / u - dg + yj / (mj + r)
    prior = 0.0
    if use_prior:
        prior = -1.0 * (la - pm) / pv
    return (r2 * s + cr) * alpha + prior


@jitable
def fit_disp_gene(
    a, y, mu, off, sj, n, x, p, pm, pv, use_prior, min_log_alpha, kappa_0, tol, maxit, use_cr, b, db, cache, res
):
    """R's ``fitDisp`` line search for one gene from log alpha ``a``; writes ``res[0:4]`` = (log alpha, proposals
    made, initial log posterior, last log posterior). ``cache``: 3 n values of scratch, or fewer for none (see
    :func:`log_posterior_k`).
    """
    keep = cache.shape[0] >= 3 * n
    k = max_small_count(y, off, sj, n)
    lp = log_posterior_k(a, y, mu, off, sj, n, x, p, pm, pv, use_prior, use_cr, b, cache, k)
    dlp = dlog_posterior_k(a, y, mu, off, sj, n, x, p, pm, pv, use_prior, use_cr, b, db, cache, keep, k)
    kappa = kappa_0
    initial_lp = lp
    it = 0
    accepted = 0
    for _t in range(maxit):
        it += 1
        a_propose = a + kappa * dlp
        if a_propose < -30.0:
            kappa = (-30.0 - a) / dlp
        if a_propose > 10.0:
            kappa = (10.0 - a) / dlp
        theta_kappa = -1.0 * log_posterior_k(
            a + kappa * dlp, y, mu, off, sj, n, x, p, pm, pv, use_prior, use_cr, b, cache, k
        )
        theta_hat_kappa = -1.0 * lp - kappa * ARMIJO * (dlp * dlp)
        if theta_kappa <= theta_hat_kappa:
            accepted += 1
            a = a + kappa * dlp
            lpnew = -theta_kappa  # R evaluates the same point again; the value is the same
            change = lpnew - lp
            if change < tol:
                lp = lpnew
                break
            if a < min_log_alpha:
                break
            lp = lpnew
            # the last log posterior evaluated was at this point: its per-sample values are in the cache
            dlp = dlog_posterior_k(a, y, mu, off, sj, n, x, p, pm, pv, use_prior, use_cr, b, db, cache, keep, k)
            kappa = min(kappa * 1.1, kappa_0)
            if accepted % 5 == 0:
                kappa = kappa / 2.0
        else:
            kappa = kappa / 2.0
    res[0] = a
    res[1] = it
    res[2] = initial_lp
    res[3] = lp


@jitable
def fit_disp_grid_gene(y, mu, off, sj, n, x, p, pm, pv, use_prior, use_cr, lo, hi, ngrid, b):
    """R's ``fitDispGrid`` for one gene: the best of ``ngrid`` points from ``lo`` to ``hi`` (R's ``seq``), then the
    best of ``ngrid`` points one coarse step either side of it (Armadillo's ``linspace``); returns log alpha.
    """
    delta = (hi - lo) / (ngrid - 1)
    best = -math.inf
    a_hat = lo
    for t in range(ngrid):
        if t == 0:
            g = lo
        elif t == ngrid - 1:
            g = hi
        else:
            g = lo + t * delta
        v = log_posterior(g, y, mu, off, sj, n, x, p, pm, pv, use_prior, use_cr, b, b[:0])
        if v > best:
            best = v
            a_hat = g
    d1 = (lo + delta) - lo  # R: disp_grid(1) - disp_grid(0)
    start = a_hat - d1
    end = a_hat + d1
    step = (end - start) / (ngrid - 1)
    best = -math.inf
    out = start
    for t in range(ngrid):
        g = end if t == ngrid - 1 else start + t * step
        v = log_posterior(g, y, mu, off, sj, n, x, p, pm, pv, use_prior, use_cr, b, b[:0])
        if v > best:
            best = v
            out = g
    return out


def grid_bounds(n: int) -> tuple[float, float]:
    """R's ``fitDispGridWrapper`` range: log(1e-8) to log(max(10, n)) (R fixes 1e-8 whatever minDisp is)."""
    return math.log(1e-8), math.log(max(10.0, float(n)))


# --------------------------------------------------------------------------------------------------------------------
# CPU kernels (numba): a loop over the genes of a block; gene-major counts and means (G, n), C-contiguous. They live
# here, beside the code they compile, so that numba's on-disk cache (keyed on this file) cannot outlive an edit of it.
# --------------------------------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def block_inputs(y, mu, x):  # pragma: no cover
    """Genes, samples and coefficients of a block, its counts, means and design flat, and a gene's scratch ``b``."""
    G, n = y.shape
    p = x.shape[1]
    return G, n, p, y.reshape(-1), mu.reshape(-1), x.reshape(-1), np.empty(p * p + TABLE)


@njit(cache=True, nogil=True)
def fit_disp_cpu(la0, y, mu, x, pm, pv, use_prior, min_log_alpha, kappa_0, tol, maxit, use_cr, out):  # pragma: no cover
    """:func:`fit_disp_gene` for every gene; ``out`` (4, G) receives log alpha, proposals, initial and last lp."""
    G, n, p, yf, mf, xf, b = block_inputs(y, mu, x)
    db = np.empty(p * p)
    cache = np.empty(3 * n)
    res = np.empty(4)
    for i in range(G):
        m = pm[i] if use_prior else 0.0
        fit_disp_gene(
            la0[i], yf, mf, i * n, 1, n, xf, p, m, pv, use_prior, min_log_alpha, kappa_0, tol, maxit, use_cr, b, db,
            cache, res,
        )  # fmt: skip
        for k in range(4):
            out[k, i] = res[k]


@njit(cache=True, nogil=True)
def fit_disp_grid_cpu(y, mu, x, pm, pv, use_prior, use_cr, lo, hi, ngrid, out):  # pragma: no cover
    """:func:`fit_disp_grid_gene` for every gene; ``out`` (G,) receives log alpha."""
    G, n, p, yf, mf, xf, b = block_inputs(y, mu, x)
    for i in range(G):
        m = pm[i] if use_prior else 0.0
        out[i] = fit_disp_grid_gene(yf, mf, i * n, 1, n, xf, p, m, pv, use_prior, use_cr, lo, hi, ngrid, b)
