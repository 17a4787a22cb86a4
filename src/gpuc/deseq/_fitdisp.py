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
  ``W = 1 / (1 / mu + a)`` (R's ``pow(pow(mu, -1) + a, -1)``, which the compiler turns into divisions; see
  :func:`cr_matrices`). The count terms lose digits at small
  alpha (differences of large lgamma values); R's search, and its stopping decisions, see exactly those rounded
  values, so gpuc computes them the same way.
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
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload
from numba.extending import register_jitable as _register_jitable

LN_SQRT_2PI = 0.918938533204672741780329736406  # log(sqrt(2 pi)), R's M_LN_SQRT_2PI
ARMIJO = 1.0e-4  # R's epsilon in fitDisp
_JITABLE: list = []  # every function registered by :func:`jitable`, for :func:`register_for_cuda`


def jitable(fn):
    """Register ``fn`` (plain Python) so that numba CPU kernels can call it, and list it for numba-cuda's
    (:func:`register_for_cuda`); returns ``fn``.
    """
    _register_jitable(fn)
    _JITABLE.append(fn)
    return fn


def register_for_cuda() -> None:
    """Make every :func:`jitable` function callable from numba-cuda kernels (called once, by
    :mod:`gpuc.deseq._kernels_gpu`). Deferred to the first GPU use: importing numba-cuda costs a CPU-only call
    about 0.4 s.
    """
    if not _JITABLE:
        return
    from numba.cuda.extending import overload

    # on a device the C library is CUDA's, not glibc's: the power is the device's pow itself (the emulation of
    # glibc's rounding would only cost registers)
    device = {pow_m1: _device_pow, pow_m2: _device_pow}
    for fn in _JITABLE:
        overload(fn, target="cuda", strict=False, inline="never")(_returns(device.get(fn, fn)))
    _JITABLE.clear()


def _device_pow(x, m):
    """``pow(x, m)`` on a CUDA device (:func:`register_for_cuda`)."""
    return math.pow(x, m)


def _returns(fn):
    """The overload body handing numba-cuda ``fn`` itself as the implementation, whatever the argument types."""
    return lambda *args: fn


# R's Chebyshev coefficients (``src/nmath``, W. Fullerton's SLATEC series): the first 22 of ``gammafn``'s ``gamcs``
# (gamma on [1, 2)) and the first 5 of ``lgammacor``'s ``algmcs`` (the Stirling remainder above 10), the terms R sums.
GAMCS = np.array([
    +0.8571195590989331421920062399942e-2, +0.4415381324841006757191315771652e-2,
    +0.5685043681599363378632664588789e-1, -0.4219835396418560501012500186624e-2,
    +0.1326808181212460220584006796352e-2, -0.1893024529798880432523947023886e-3,
    +0.3606925327441245256578082217225e-4, -0.6056761904460864218485548290365e-5,
    +0.1055829546302283344731823509093e-5, -0.1811967365542384048291855891166e-6,
    +0.3117724964715322277790254593169e-7, -0.5354219639019687140874081024347e-8,
    +0.9193275519859588946887786825940e-9, -0.1577941280288339761767423273953e-9,
    +0.2707980622934954543266540433089e-10, -0.4646818653825730144081661058933e-11,
    +0.7973350192007419656460767175359e-12, -0.1368078209830916025799499172309e-12,
    +0.2347319486563800657233471771688e-13, -0.4027432614949066932766570534699e-14,
    +0.6910051747372100912138336975257e-15, -0.1185584500221992907052387126192e-15,
])  # fmt: skip
ALGMCS = np.array([
    +0.1666389480451863247205729650822e0, -0.1384948176067563840732986059135e-4,
    +0.9810825646924729426157171547487e-8, -0.1809129475572494194263306266719e-10,
    +0.6221098041892605227126015543416e-13,
])  # fmt: skip
LGAMMACOR_XBIG = 94906265.62425156  # above it R's lgammacor is 1 / (12 x)
SAFE_MIN = 2.2250738585072014e-308  # LAPACK's dlamch('S'): dgetrf2 scales by the pivot's reciprocal above it
DET_EPS = 2.220446049250313e-16  # Armadillo keeps a closed-form determinant of magnitude in (eps, 1 / eps)


@jitable
def r_chebyshev(x, a, n):
    """R's ``chebyshev_eval``: the first ``n`` terms of the series ``a`` at ``x`` in [-1, 1] (Clenshaw)."""
    twox = x * 2.0
    b0 = 0.0
    b1 = 0.0
    b2 = 0.0
    for i in range(1, n + 1):
        b2 = b1
        b1 = b0
        b0 = twox * b1 - b2 + a[n - i]
    return (b0 - b2) * 0.5


@jitable
def r_lgammacor(x):
    """R's ``lgammacor``: lgamma(x) - [(x - 1/2) log x - x + log sqrt(2 pi)] for x >= 10."""
    if x < LGAMMACOR_XBIG:
        tmp = 10.0 / x
        return r_chebyshev(tmp * tmp * 2.0 - 1.0, ALGMCS, 5) / x
    return 1.0 / (x * 12.0)


@jitable
def r_gamma_small(x):
    """R's ``gammafn`` for 0 < x <= 10: the Chebyshev series on [1, 2), then the recurrence down or up."""
    n = int(x)
    y = x - n
    n -= 1
    value = r_chebyshev(y * 2.0 - 1.0, GAMCS, 22) + 0.9375
    if n == 0:
        return value
    if n < 0:
        if y < 2.2474362225598545e-308:
            return math.inf
        for i in range(-n):
            value /= x + i
        return value
    for i in range(1, n + 1):
        value *= y + i
    return value


@jitable
def r_lgamma(x):
    """lgamma(x) for x > 0 as R's ``lgammafn`` computes it (``src/nmath/lgamma.c``), branch for branch: log |gamma|
    from R's ``gammafn`` up to 10, then ``log sqrt(2 pi) + (x - 1/2) log x - x`` plus ``lgammacor`` up to 4934720,
    without it above that, and ``x (log x - 1)`` above 1e17. The line search of ``fitDisp`` compares these values'
    last bits (its Armijo test and stopping rule), so gpuc computes R's, not a more accurate lgamma.
    """
    if x < 1e-306:
        return -math.log(x)
    if x <= 10.0:
        return math.log(abs(r_gamma_small(x)))
    return r_lgamma_log(x, math.log(x))


@jitable
def r_lgamma_log(x, lx):
    """:func:`r_lgamma` for x > 10 given ``lx`` = log(x) (the search keeps it for :func:`r_digamma_log`)."""
    if x > 1e17:
        return x * (lx - 1.0)
    base = LN_SQRT_2PI + (x - 0.5) * lx - x
    if x > 4934720.0:
        return base
    return base + r_lgammacor(x)


# The Bernoulli numbers B_2 .. B_40 of R's ``dpsifn`` (its ``bvalues[2:22]``), for psi's asymptotic series.
BVALUES = np.array([
    1.66666666666666667e-1, -3.33333333333333333e-2, 2.38095238095238095e-2, -3.33333333333333333e-2,
    7.57575757575757576e-2, -2.53113553113553114e-1, 1.16666666666666667, -7.09215686274509804,
    5.49711779448621554e1, -5.29124242424242424e2, 6.19212318840579710e3, -8.65802531135531136e4,
    1.42551716666666667e6, -2.72982310678160920e7, 6.01580873900642368e8, -1.51163157670921569e10,
    4.29614643061166667e11, -1.37116552050883328e13, 4.88332318973593167e14, -1.92965793419400681e16,
])  # fmt: skip
PSI_WDTOL = 1.1102230246251565e-16  # dpsifn's tolerance: DBL_EPSILON / 2
PSI_LRG = 2.2517998136852485e15  # 1 / (2 DBL_EPSILON): above it (x log x) R returns log x


@jitable
def r_digamma(x):
    """psi(x) for x > 0 as R's ``digamma`` computes it (``dpsifn`` with n = 0, Amos 1983): below 9 shifted up to
    9 + frac(x), the asymptotic series with R's Bernoulli numbers and stopping rule there, then the recurrence back
    added term by term. The derivative of the log posterior is a difference of such values, and R's search steps by
    it, so gpuc reproduces R's rounding, not a more accurate psi.
    """
    return r_digamma_log(x, math.log(x))


@jitable
def r_digamma_log(x, lx):
    """:func:`r_digamma` given ``lx`` = log(x)."""
    if x * lx > PSI_LRG:
        return lx
    xdmy = x
    xdmln = lx
    nx = 0
    if x < 9.0:
        nx = 9 - int(x)
        xdmy = x + nx
        xdmln = math.log(xdmy)
    tt = 0.5 / xdmy
    tst = PSI_WDTOL * tt
    rxsq = 1.0 / (xdmy * xdmy)
    t = 0.5 * rxsq
    s = t * BVALUES[0]
    if abs(s) >= tst:
        tk = 2.0
        for k in range(4, 23):
            t = t * ((tk + 1.0) / (tk + 1.0)) * (tk / (tk + 2.0)) * rxsq
            trm = t * BVALUES[k - 3]
            if abs(trm) < tst:
                break
            s += trm
            tk += 2.0
    s = s + tt
    for i in range(1, nx + 1):
        s += 1.0 / (x + (nx - i))
    return -(s - xdmln)


# C library pow(x, -1) and pow(x, -2) without calling pow for most x. glibc's pow is within 0.54 ulp of the exact
# power (its worst case; 0.51 for these small exponents), so where the exact value lies within POW_SAFE ulp of a double,
# pow returns that double: the correctly rounded power, formed here from 1 / x (correctly rounded) and its exact
# error (Dekker's product). Elsewhere, about 1 x in 10, pow itself decides.
SPLIT = 134217729.0  # 2^27 + 1: Veltkamp's splitter (halves of 26 bits)
POW_SAFE = 0.45
POW_RANGE = 1.0e150  # far from overflow of x^2 and of the splitter
ULP_PHI = 2.0**-53 + 2.0**-105


def product_error(a, b, p):
    """``a * b - p`` exactly, for ``p`` the rounded product: Dekker's algorithm as Python (the GPU simulator's
    path); compiled for the CPU, one fused multiply-add (:func:`_product_error_fma`), the same double.
    """
    c = SPLIT * a
    ah = c - (c - a)
    al = a - ah
    c = SPLIT * b
    bh = c - (c - b)
    bl = b - bh
    return ((ah * bh - p) + ah * bl + al * bh) + al * bl


@intrinsic
def _fma(typingctx, a, b, c):  # pragma: no cover - compiled
    """LLVM's fused multiply-add of three doubles (one instruction where the CPU has it, else the C library's)."""
    sig = types.float64(types.float64, types.float64, types.float64)

    def codegen(context, builder, signature, args):
        d = ir.DoubleType()
        fn = builder.module.declare_intrinsic("llvm.fma", [d], ir.FunctionType(d, [d, d, d]))
        return builder.call(fn, args)

    return sig, codegen


@overload(product_error, target="cpu")
def _product_error_fma(a, b, p):  # pragma: no cover - compiled
    """:func:`product_error` in numba's CPU kernels: fma(a, b, -p) is exact (a product's error is a double)."""
    return lambda a, b, p: _fma(a, b, -p)


@jitable
def ulp(r):
    """The unit in the last place of the positive normal double ``r``: the gap to its successor, which ``r + phi r``
    rounds to for phi = 2^-53 + 2^-105 (Rump, Zimmermann, Boldo and Melquiond 2009, "Computing predecessor and
    successor in rounding to nearest"); the subtraction is exact.
    """
    return (r + r * ULP_PHI) - r


@jitable
def reciprocal_error(x, q):
    """``1 - x q`` exactly (q = 1 / x rounded, so x q is within an ulp of 1 and 1 - x q rounds exactly)."""
    p = x * q
    return (1.0 - p) - product_error(x, q, p)


@jitable
def pow_m1(x, m1):
    """The C library's ``pow(x, -1)`` (R's ``pow(1 + mu alpha, -1)`` in the derivative): 1 / x unless the quotient
    is within a hair of halfway between two doubles, where glibc's pow may round the other way and is called. ``m1``
    is -1 formed at run time by the caller (from a value the compiler cannot prove finite; see
    :func:`dlog_posterior`).
    """
    if not (x > 1.0 / POW_RANGE and x < POW_RANGE):
        return math.pow(x, m1)
    q = 1.0 / x
    e = reciprocal_error(x, q)  # 1/x = q + e / x
    if abs(e) <= POW_SAFE * ulp(q) * x:
        return q
    return math.pow(x, m1)


@jitable
def pow_m2(x, m2):
    """The C library's ``pow(x, -2)``: the correctly rounded x^-2 from 1 / x and its exact error (x^-2 =
    q^2 (1 + d)^2, d = e / (x q)), unless it lies too near halfway between two doubles (then pow decides); ``m2``
    is -2 formed at run time (as in :func:`pow_m1`).
    """
    if not (x > 1.0 / POW_RANGE and x < POW_RANGE):
        return math.pow(x, m2)
    q = 1.0 / x
    e = reciprocal_error(x, q)
    d = e / (1.0 - e)
    s = q * q
    t = product_error(q, q, s) + 2.0 * s * d  # x^-2 - s, to about 2^-100 relative (the d^2 term is below it)
    r = s + t
    rest = t - (r - s)  # x^-2 - r (Fast2Sum: |s| >= |t|)
    if abs(rest) <= POW_SAFE * ulp(r):
        return r
    return math.pow(x, m2)


@jitable
def cr_matrices(alpha, mu, off, sj, n, x, p, b, db, want_db, cache, cached):
    """``b = X' W X`` and (``want_db``) ``db = -X' W^2 X`` (flat p x p), W = 1 / (1 / mu + alpha), for the gene whose
    means are ``mu[off + j * sj]``; ``x`` is the n x p design, flat and row-major; ``cache``: empty, or the gene's
    table (:func:`gene_cache`) holding 1 / mu, into which W is kept (or, ``cached``, from which the W of this alpha
    is read).

    R writes W as ``pow(pow(mu, -1) + alpha, -1)`` and W^2 as ``pow(..., -2)``; the C++ compiler turns a power -1
    with a constant exponent into a division (GCC expands integer powers -1 to 2 at every optimisation level) and
    keeps the C library's pow for -2: gpuc does the same (checked against R's derivative on every pasilla gene).
    """
    keep = cache.shape[0] >= cache_size(n)
    cached = cached and keep
    m2 = 0.0 * alpha - 2.0  # the exponent -2, formed at run time (see :func:`dlog_posterior`)
    for k in range(p * p):
        b[k] = 0.0
        if want_db:
            db[k] = 0.0
    for j in range(n):
        # b = X' (X .* w): entry (r, c) sums x_jr (x_jc w_j) over the samples in order
        v = (cache[5 * n + j] if keep else 1.0 / mu[off + j * sj]) + alpha
        if cached:
            w = cache[6 * n + j]
        else:
            w = 1.0 / v
            if keep:
                cache[6 * n + j] = w
        dw = -1.0 * pow_m2(v, m2) if want_db else 0.0
        for r in range(p):
            xr = x[j * p + r]
            if xr == 0.0:
                continue
            for c in range(p):
                xc = x[j * p + c]
                b[r * p + c] += xr * (xc * w)
                if want_db:
                    db[r * p + c] += xr * (xc * dw)


@jitable
def pivot_rows(a, p, k):
    """Step ``k`` of partial pivoting on the p x p ``a`` (flat, row-major): swaps row k with the row at or below it
    holding the first largest magnitude in column k (LAPACK's choice) and returns that row.
    """
    piv = k
    big = abs(a[k * p + k])
    for i in range(k + 1, p):
        if abs(a[i * p + k]) > big:
            big = abs(a[i * p + k])
            piv = i
    if piv != k:
        swap_lines(a, p, k, piv, p, 1)
    return piv


@jitable
def swap_lines(a, m, i, j, line_stride, step):
    """Swaps lines ``i`` and ``j`` of ``m`` entries of the flat ``a``: entry t of line i is a[i * line_stride + t *
    step] (rows of a row-major matrix: stride its width, step 1; columns: stride 1, step its width).
    """
    for t in range(m):
        u = a[i * line_stride + t * step]
        a[i * line_stride + t * step] = a[j * line_stride + t * step]
        a[j * line_stride + t * step] = u


@jitable
def lu_factor(a, p, ipiv):
    """LAPACK ``dgetrf`` of the p x p ``a`` (flat, row-major) in place, as the recursive ``dgetrf2`` computes it:
    partial pivoting (:func:`pivot_rows`), the column below each non-zero pivot scaled by its reciprocal (by the
    pivot itself below LAPACK's safe minimum), the trailing entries updated a_ic + (-u_kc) l_ik in pivot order.
    Records the pivot rows in ``ipiv`` when it has room for them; returns the number of row swaps.
    """
    swaps = 0
    for k in range(p):
        piv = pivot_rows(a, p, k)
        if ipiv.shape[0] >= p:
            ipiv[k] = piv
        if piv != k:
            swaps += 1
        d = a[k * p + k]
        if d != 0.0:
            if abs(d) >= SAFE_MIN:
                rd = 1.0 / d
                for i in range(k + 1, p):
                    a[i * p + k] = a[i * p + k] * rd
            else:
                for i in range(k + 1, p):
                    a[i * p + k] = a[i * p + k] / d
        for i in range(k + 1, p):
            lik = a[i * p + k]
            for c in range(k + 1, p):
                a[i * p + c] = a[i * p + c] + (-a[k * p + c]) * lik
    return swaps


@jitable
def det_lu(a, p):
    """The determinant of the p x p ``a`` (flat, row-major; overwritten) as LAPACK ``dgetrf`` and Armadillo form it:
    :func:`lu_factor`, then the product of U's diagonal from the first entry, negated once per row swap.
    """
    swaps = lu_factor(a, p, a[:0])
    val = a[0]
    for i in range(1, p):
        val *= a[i * p + i]
    return val if swaps % 2 == 0 else -val


@jitable
def det_r(b, p):
    """det(b) of the p x p ``b`` (flat, row-major entry (r, c) at ``b[r * p + c]``; may be overwritten) as
    Armadillo's ``det`` computes it for DESeq2: the closed forms up to 4 x 4 when their magnitude lies in
    (eps, 1 / eps), else the product of the diagonal for a triangular matrix, else LU (:func:`det_lu`).
    """
    if p == 1:
        return b[0]
    if p <= 4:
        if p == 2:
            v = b[0] * b[3] - b[2] * b[1]
        elif p == 3:
            v1 = b[0] * (b[8] * b[4] - b[7] * b[5])
            v2 = b[3] * (b[8] * b[1] - b[7] * b[2])
            v3 = b[6] * (b[5] * b[1] - b[4] * b[2])
            v = v1 - v2 + v3
        else:
            v = det_4x4(b)
        if abs(v) > DET_EPS and abs(v) < 1.0 / DET_EPS:
            return v
    upper = True
    lower = True
    for r in range(p):
        for c in range(p):
            if b[r * p + c] != 0.0:
                if r > c:
                    upper = False
                elif r < c:
                    lower = False
    if upper or lower:
        val = 1.0
        for i in range(p):
            val *= b[i * p + i]
        return val
    return det_lu(b, p)


@jitable
def det_4x4(b):
    """Armadillo's closed-form 4 x 4 determinant (its products and their order); entry (r, c) is ``b[4 r + c]``."""
    p03_12 = b[3] * b[6]
    p02_13 = b[2] * b[7]
    p03_11 = b[3] * b[5]
    p01_13 = b[1] * b[7]
    p02_11 = b[2] * b[5]
    p01_12 = b[1] * b[6]
    p03_10 = b[3] * b[4]
    p00_13 = b[0] * b[7]
    p02_10 = b[2] * b[4]
    p00_12 = b[0] * b[6]
    p01_10 = b[1] * b[4]
    p00_11 = b[0] * b[5]
    p21_30 = b[9] * b[12]
    p22_30 = b[10] * b[12]
    p23_30 = b[11] * b[12]
    p20_31 = b[8] * b[13]
    p22_31 = b[10] * b[13]
    p23_31 = b[11] * b[13]
    p20_32 = b[8] * b[14]
    p21_32 = b[9] * b[14]
    p23_32 = b[11] * b[14]
    p20_33 = b[8] * b[15]
    p21_33 = b[9] * b[15]
    p22_33 = b[10] * b[15]
    v = p03_12 * p21_30 - p02_13 * p21_30 - p03_11 * p22_30 + p01_13 * p22_30
    v = v + p02_11 * p23_30 - p01_12 * p23_30 - p03_12 * p20_31 + p02_13 * p20_31
    v = v + p03_10 * p22_31 - p00_13 * p22_31 - p02_10 * p23_31 + p00_12 * p23_31
    v = v + p03_11 * p20_32 - p01_13 * p20_32 - p03_10 * p21_32 + p00_13 * p21_32
    v = v + p01_10 * p23_32 - p00_11 * p23_32 - p02_11 * p20_33 + p01_12 * p20_33
    v = v + p02_10 * p21_33 - p00_12 * p21_33 - p01_10 * p22_33 + p00_11 * p22_33
    return v


@jitable
def log_det_r(b, p):
    """Log det(b) as R's ``log(det(b))`` gives it (:func:`det_r`): -inf at 0, NaN below."""
    d = det_r(b, p)
    if d > 0.0:
        return math.log(d)
    if d == 0.0:
        return -math.inf
    return math.nan


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
def cache_size(n):
    """Scratch for one gene's search over ``n`` samples (:func:`gene_cache` gives its layout)."""
    return 7 * n + 1


@jitable
def gene_cache(y, mu, off, sj, n, cache):
    """Fill ``cache`` (:func:`cache_size` values) with what the search over one gene can reuse: R takes lgamma and
    digamma of ``y_j + 1/alpha`` sample by sample, and equal counts give equal values, so they are evaluated once
    per distinct count; ``1 / mu_j`` does not depend on alpha. Layout, n values each: [0] log(1 + mu_j alpha)
    per sample, [1] the sample's distinct-count slot, [2] log(y_k + 1/alpha) per distinct count (where above 10),
    [3] the distinct counts, [4] lgamma (or digamma) of y_k + 1/alpha, [5] 1 / mu_j, [6] the Cox-Reid weight W_j
    of the last log posterior; then the number of distinct counts.
    """
    for j in range(n):
        cache[5 * n + j] = 1.0 / mu[off + j * sj]
    kk = 0
    for j in range(n):
        yj = y[off + j * sj]
        slot = -1
        for k in range(kk):
            if cache[3 * n + k] == yj:
                slot = k
                break
        if slot < 0:
            cache[3 * n + kk] = yj
            slot = kk
            kk += 1
        cache[n + j] = slot
    cache[7 * n] = kk


@jitable
def distinct_count_terms(cache, n, r, zero_value, digamma):
    """Into slot [4] of the gene's table (:func:`gene_cache`), per distinct count y_k: lgamma(y_k + r), keeping
    log(y_k + r) in slot [2] where y_k + r > 10, or (``digamma``) digamma(y_k + r) from that kept logarithm;
    ``zero_value`` for a zero count.
    """
    for k in range(int(cache[7 * n])):
        v = cache[3 * n + k]
        xg = v + r
        if v == 0.0:
            t = zero_value
        elif xg > 10.0:
            if digamma:
                t = r_digamma_log(xg, cache[2 * n + k])
            else:
                lx = math.log(xg)
                cache[2 * n + k] = lx
                t = r_lgamma_log(xg, lx)
        else:
            t = r_digamma(xg) if digamma else r_lgamma(xg)
        cache[4 * n + k] = t


@jitable
def log_posterior(la, y, mu, off, sj, n, x, p, pm, pv, use_prior, use_cr, b, cache):
    """R's ``log_posterior`` of one gene (counts ``y[off + j * sj]``, means ``mu[...]``) at log alpha ``la``; ``b``
    is scratch of p * p values. ``cache`` is either empty (every term computed per sample) or holds the gene's
    :func:`gene_cache` table; it then also receives, for :func:`dlog_posterior` at the same point, log(1 + mu
    alpha) per sample and log(y + 1/alpha) per distinct count: the values the derivative would compute afresh.

    Every term is R's expression, operation for operation (R's ``lgammafn``, :func:`r_lgamma`; the Cox-Reid
    determinant as Armadillo forms it, :func:`det_r`): R's search accepts or rejects a step, and stops, on the last
    bits of these values.
    """
    alpha = math.exp(la)
    keep = cache.shape[0] >= cache_size(n)
    r = 1.0 / alpha
    lgr = r_lgamma(r)
    if keep:
        distinct_count_terms(cache, n, r, 0.0, False)  # a zero count's lgamma terms cancel exactly (below)
    ll = 0.0
    for j in range(n):
        yj = y[off + j * sj]
        mj = mu[off + j * sj]
        l1 = math.log(1.0 + mj * alpha)
        if keep:
            cache[j] = l1
        if yj == 0.0:
            # lgamma(0 + r) - lgamma(r) and 0 * log(mu + r) are exactly 0 in R's sum too
            ll += 0.0 - r * l1
        else:
            if keep:
                lg = cache[4 * n + int(cache[n + j])]
            else:
                xg = yj + r
                lg = r_lgamma_log(xg, math.log(xg)) if xg > 10.0 else r_lgamma(xg)
            ll += lg - lgr - yj * math.log(mj + r) - r * l1
    cr = 0.0
    if use_cr:
        cr_matrices(alpha, mu, off, sj, n, x, p, b, b, False, cache, False)
        cr = -0.5 * log_det_r(b, p)
    prior = 0.0
    if use_prior:
        d = la - pm
        prior = -0.5 * (d * d) / pv
    return ll + prior + cr


@jitable
def lapack_inverse(a, p, ipiv, work):
    """Armadillo's ``inv`` of the p x p ``a`` (flat, row-major) where it calls LAPACK, in place: ``dgetrf`` (partial
    pivoting, the first largest entry; the column scaled by the pivot's reciprocal; trailing updates a_ij + (-u_kj)
    l_ik in pivot order, which is what the recursive ``dgetrf2`` computes) then the unblocked ``dgetri``: the
    inverse of U column by column (``dtrti2``: ``dtrmv``, then scaled by -1/u_jj), inv(A) from inv(U) and L
    right to left (``dgemv``), the column interchanges. ``ipiv`` and ``work``: p values of scratch. Returns False
    for an exactly singular ``a``.
    """
    lu_factor(a, p, ipiv)
    for k in range(p):
        if a[k * p + k] == 0.0:
            return False
    for j in range(p):  # dtrti2: inv(U), column j from the inverted columns before it
        a[j * p + j] = 1.0 / a[j * p + j]
        ajj = -a[j * p + j]
        for jj in range(j):  # dtrmv: x = U[:j, :j] x, x = column j above the diagonal
            t = a[jj * p + j]
            if t != 0.0:
                for r in range(jj):
                    a[r * p + j] = a[r * p + j] + t * a[r * p + jj]
                a[jj * p + j] = t * a[jj * p + jj]
        for r in range(j):
            a[r * p + j] = ajj * a[r * p + j]
    for j in range(p - 1, -1, -1):  # inv(A) L = inv(U), right to left
        for r in range(j + 1, p):
            work[r] = a[r * p + j]
            a[r * p + j] = 0.0
        for c in range(j + 1, p):
            t = -work[c]
            for r in range(p):
                a[r * p + j] = a[r * p + j] + t * a[r * p + c]
    for j in range(p - 2, -1, -1):
        jp = int(ipiv[j])
        if jp != j:
            swap_lines(a, p, j, jp, 1, p)
    return True


@jitable
def likely_sympd(a, p):
    """Armadillo's ``guess_sympd`` (four or more rows): a positive diagonal, off-diagonal entries below the largest
    diagonal entry and below the mean of their two diagonal entries, and symmetric within 100 eps. ``a``: flat p x p,
    entry (i, j) at a[i * p + j].
    """
    tol = 100.0 * DET_EPS
    max_diag = 0.0
    for j in range(p):
        ajj = a[j * p + j]
        if ajj <= 0.0:
            return False
        if ajj > max_diag:
            max_diag = ajj
    for j in range(p - 1):
        ajj = a[j * p + j]
        for i in range(j + 1, p):
            aij = a[i * p + j]
            aji = a[j * p + i]
            if abs(aij) >= max_diag:
                return False
            delta = abs(aij - aji)
            if delta > tol and delta > max(abs(aij), abs(aji)) * tol:
                return False
            if abs(aij) + abs(aij) >= a[i * p + i] + ajj:
                return False
    return True


@jitable
def sympd_inverse(a, p):
    """Armadillo's ``inv_sympd`` of the p x p ``a`` (flat; entry (i, j) at a[i * p + j]) in place, from its lower
    triangle as LAPACK 3.11 computes it for p below its block size: ``dpotrf2`` (whose recursion adds the
    products l_ik l_jk in increasing k, takes the square root on the diagonal and scales by its reciprocal below
    it), ``dtrti2`` (the inverse of L, columns right to left with ``dtrmv``), ``dlauu2`` (L^-T L^-1 row by row: a
    ``ddot`` on the diagonal, a ``dgemv`` scaled by the old diagonal entry left of it), then the lower triangle
    copied above. Returns False where the Cholesky factor fails (not positive definite).
    """
    for j in range(p):
        d = a[j * p + j]
        for k in range(j):
            d = d - a[j * p + k] * a[j * p + k]
        if not d > 0.0:
            return False
        ljj = math.sqrt(d)
        a[j * p + j] = ljj
        rl = 1.0 / ljj
        for i in range(j + 1, p):
            v = a[i * p + j]
            for k in range(j):
                v = v - a[j * p + k] * a[i * p + k]
            a[i * p + j] = rl * v
    for j in range(p - 1, -1, -1):  # dtrti2, lower: inv(L)
        a[j * p + j] = 1.0 / a[j * p + j]
        ajj = -a[j * p + j]
        for c in range(p - 1, j, -1):  # dtrmv, lower: x = L[j+1:, j+1:] x, x = column j below the diagonal
            t = a[c * p + j]
            if t != 0.0:
                for r in range(p - 1, c, -1):
                    a[r * p + j] = a[r * p + j] + t * a[r * p + c]
                a[c * p + j] = t * a[c * p + c]
        for r in range(j + 1, p):
            a[r * p + j] = ajj * a[r * p + j]
    for i in range(p):  # dlauu2, lower: inv(L)' inv(L)
        aii = a[i * p + i]
        if i < p - 1:
            t = 0.0
            for k in range(i, p):
                t += a[k * p + i] * a[k * p + i]
            a[i * p + i] = t
            for c in range(i):
                a[i * p + c] = aii * a[i * p + c]
            for c in range(i):
                t = 0.0
                for k in range(i + 1, p):
                    t += a[k * p + c] * a[k * p + i]
                a[i * p + c] = a[i * p + c] + t
        else:
            for c in range(p):
                a[i * p + c] = aii * a[i * p + c]
    for i in range(p):
        for j in range(i + 1, p):
            a[i * p + j] = a[j * p + i]
    return True


@jitable
def inverse_scratch(p):
    """Scratch of :func:`cr_derivative` for :func:`lapack_inverse`: the matrix, its pivots and work."""
    return p * p + 2 * p


@jitable
def trace_of_product(ai, db, p):
    """Armadillo's ``trace(A * B)`` without forming the product: row k of A times column k of B, the products of
    even and odd inner indices added in two accumulators across all k, then summed.
    """
    acc1 = 0.0
    acc2 = 0.0
    for k in range(p):
        j = 1
        while j < p:
            acc1 += ai[k * p + j - 1] * db[(j - 1) * p + k]
            acc2 += ai[k * p + j] * db[j * p + k]
            j += 2
        if j - 1 < p:
            acc1 += ai[k * p + j - 1] * db[(j - 1) * p + k]
    return acc1 + acc2


@jitable
def armadillo_inverse(b, p, ai, ipiv, work):
    """Armadillo 12's ``inv(b)`` of the p x p ``b`` (flat, row-major) into ``ai``, by its rules: the reciprocal for
    1 x 1; the closed form for 2 x 2 when its determinant lies in (eps, 1 / eps); elementwise for a diagonal ``b``;
    Cholesky (:func:`sympd_inverse`) for four or more rows where Armadillo guesses ``b`` positive definite
    (:func:`likely_sympd`); else LU (:func:`lapack_inverse`, with ``ipiv`` and ``work``: p values each). Returns
    False where LAPACK fails (an exactly singular ``b``).
    """
    if p == 1:
        ai[0] = 1.0 / b[0]
        return True
    if p == 2:
        dv = b[0] * b[3] - b[1] * b[2]
        if abs(dv) >= DET_EPS and abs(dv) <= 1.0 / DET_EPS:
            ai[0] = b[3] / dv
            ai[1] = -b[1] / dv
            ai[2] = -b[2] / dv
            ai[3] = b[0] / dv
            return True
    diagonal = True
    for k in range(p * p):
        ai[k] = b[k]
        if k % (p + 1) != 0 and b[k] != 0.0:
            diagonal = False
    if diagonal:
        for k in range(p):
            ai[k * (p + 1)] = 1.0 / b[k * (p + 1)]
        return True
    if p >= 4 and likely_sympd(b, p):
        if sympd_inverse(ai, p):
            return True
        for k in range(p * p):
            ai[k] = b[k]
    return lapack_inverse(ai, p, ipiv, work)


@jitable
def cr_derivative(b, db, p, inv):
    """R's Cox-Reid part of the derivative in alpha, ``-0.5 det(b) trace(b^-1 db) / det(b)``, as Armadillo forms it:
    the inverse (:func:`armadillo_inverse`, in ``inv``: :func:`inverse_scratch` values), the trace of its product
    with ``db`` (:func:`trace_of_product`), the determinant (:func:`det_r`). Without that scratch, or for an exactly
    singular ``b``, the Cholesky factor's solves instead (equal up to rounding). Overwrites ``b`` and ``db``.
    """
    pp = p * p
    if inv.shape[0] >= inverse_scratch(p) and armadillo_inverse(
        b, p, inv[:pp], inv[pp : pp + p], inv[pp + p : pp + 2 * p]
    ):
        tr = trace_of_product(inv, db, p)
        det = det_r(b, p)
        return (-0.5 * (det * tr)) / det
    cholesky_logdet(b, p)
    return -0.5 * chol_trace_solve(b, db, p)


@jitable
def dlog_posterior(la, y, mu, off, sj, n, x, p, pm, pv, use_prior, use_cr, b, db, inv, cache, cached):
    """R's ``dlog_posterior`` (derivative in log alpha) of one gene at log alpha ``la``, term by term as R computes
    it (R's ``digamma``, :func:`r_digamma`; the Cox-Reid part, :func:`cr_derivative`): R's next proposal is the
    current point plus this value, so its rounding moves R's search. With ``cached``, ``cache`` holds the values
    :func:`log_posterior` kept at this point (and its distinct-count table).
    """
    alpha = math.exp(la)
    cached = cached and cache.shape[0] >= cache_size(n)
    cr = 0.0
    if use_cr:
        cr_matrices(alpha, mu, off, sj, n, x, p, b, db, True, cache, cached)
        cr = cr_derivative(b, db, p, inv)
    r = 1.0 / alpha
    r2 = 1.0 / (alpha * alpha)
    dgr = r_digamma(r)
    # here R's compiled code keeps the C library's pow(., -1), which differs from 1 / x in the last bit for about 1
    # value in 1,000 (:func:`pow_m1`); LLVM would rewrite pow(x, -1.0) with a constant exponent into 1 / x, so the
    # exponent is formed at run time.
    m1 = 0.0 * alpha - 1.0
    if cached:
        distinct_count_terms(cache, n, r, dgr, True)
    s = 0.0
    for j in range(n):
        yj = y[off + j * sj]
        mj = mu[off + j * sj]
        ma = mj * alpha
        u = 1.0 + ma
        lu = cache[j] if cached else math.log(u)
        if cached:
            dg = cache[4 * n + int(cache[n + j])]
        elif yj == 0.0:
            dg = dgr
        else:
            dg = r_digamma(yj + r)
        # a zero count's last term is 0 * pow(mu + 1/alpha, -1) = +0 whatever the power (finite, positive)
        s += dgr + lu - ma * pow_m1(u, m1) - dg + (yj * pow_m1(mj + r, m1) if yj != 0.0 else 0.0)
    prior = 0.0
    if use_prior:
        prior = -1.0 * (la - pm) / pv
    return (r2 * s + cr) * alpha + prior


@jitable
def fit_disp_gene(
    a, y, mu, off, sj, n, x, p, pm, pv, use_prior, min_log_alpha, kappa_0, tol, maxit, use_cr, b, db, inv, cache, res
):
    """R's ``fitDisp`` line search for one gene from log alpha ``a``; writes ``res[0:4]`` = (log alpha, proposals
    made, initial log posterior, last log posterior). ``b``, ``db``: p * p values of scratch; ``inv``:
    :func:`inverse_scratch` values (or none: the Cox-Reid derivative then takes the Cholesky factor); ``cache``:
    :func:`cache_size` values of scratch, or none.
    """
    keep = cache.shape[0] >= cache_size(n)
    if keep:
        gene_cache(y, mu, off, sj, n, cache)
    lp = log_posterior(a, y, mu, off, sj, n, x, p, pm, pv, use_prior, use_cr, b, cache)
    dlp = dlog_posterior(a, y, mu, off, sj, n, x, p, pm, pv, use_prior, use_cr, b, db, inv, cache, keep)
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
        theta_kappa = -1.0 * log_posterior(
            a + kappa * dlp, y, mu, off, sj, n, x, p, pm, pv, use_prior, use_cr, b, cache
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
            dlp = dlog_posterior(a, y, mu, off, sj, n, x, p, pm, pv, use_prior, use_cr, b, db, inv, cache, keep)
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
    return G, n, p, y.reshape(-1), mu.reshape(-1), x.reshape(-1), np.empty(p * p)


@njit(cache=True, nogil=True)
def fit_disp_cpu(la0, y, mu, x, pm, pv, use_prior, min_log_alpha, kappa_0, tol, maxit, use_cr, out):  # pragma: no cover
    """:func:`fit_disp_gene` for every gene; ``out`` (4, G) receives log alpha, proposals, initial and last lp."""
    G, n, p, yf, mf, xf, b = block_inputs(y, mu, x)
    db = np.empty(p * p)
    inv = np.empty(inverse_scratch(p))
    cache = np.empty(cache_size(n))
    res = np.empty(4)
    for i in range(G):
        m = pm[i] if use_prior else 0.0
        fit_disp_gene(
            la0[i], yf, mf, i * n, 1, n, xf, p, m, pv, use_prior, min_log_alpha, kappa_0, tol, maxit, use_cr, b, db,
            inv, cache, res,
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
