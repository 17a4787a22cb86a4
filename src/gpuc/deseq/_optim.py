"""R's ``optim(method = "L-BFGS-B")`` refit of the genes whose IRLS does not converge, as DESeq2 1.38 runs it.

DESeq2's ``fitNbinomGLMsOptim`` hands every gene that the IRLS leaves unconverged (``betaIter`` = ``maxit``, a
diverging coefficient or a non-positive variance) to R's ``optim`` with method L-BFGS-B: the negative log posterior
of the coefficients on the log2 scale, ``mu = nf * 2^(X p)`` with R's ``dnbinom`` and a normal prior of precision
``lambda``, bounds of +-30, optim's default controls (``lmm`` 5, ``factr`` 1e7, ``pgtol`` 0, ``maxit`` 100) and its
central-difference gradient (``ndeps`` 1e-3, differences cut at the bounds). Its answer is where that search stops,
not the exact optimum, so matching R gene by gene needs the same search, step for step.

This module is that search: the limited-memory BFGS method for bound constraints of Byrd, Lu, Nocedal and Zhu (1995)
in the version 2.3 that R ships (generalised Cauchy point, direct primal subspace minimisation, the More-Thuente line
search of Moré and Thuente (1994) with ``ftol`` 1e-3, ``gtol`` 0.9, ``xtol`` 0.1), evaluated in R's order of
floating-point operations (LINPACK's Cholesky with R's 1e-14 tolerance, reference BLAS dot products), and the
objective as R computes it: ``dnbinom_mu`` through ``dbinom_raw`` with Loader's saddle-point terms (``stirlerr``,
``bd0``), ``dnorm``, and ``sum`` accumulated in x87 extended precision (NumPy's ``longdouble``). Every refitted gene
runs the search on its own (a handful per data set; the cost is Python's).

References: R. H. Byrd, P. Lu, J. Nocedal, C. Zhu, "A limited memory algorithm for bound constrained optimization",
SIAM J. Sci. Comput. 16 (1995); J. J. Moré, D. J. Thuente, "Line search algorithms with guaranteed sufficient
decrease", ACM TOMS 20 (1994); C. Loader, "Fast and accurate computation of binomial probabilities" (2000).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit
from numba.extending import register_jitable

from gpuc.deseq._fitdisp import r_lgamma
from gpuc.deseq._rlinalg import r_sum

LN_2PI = 1.837877066409345483560659472811  # log(2 pi)
LN_SQRT_2PI = 0.918938533204672741780329736406  # log(sqrt(2 pi))
DBL_EPSILON = 2.220446049250313e-16
DBL_MIN = 2.2250738585072014e-308

# Stirling's error log(n!) - log(sqrt(2 pi n) (n/e)^n) at n = 0, 0.5, ..., 15 (Loader 2000; n = 0 unused)
STIRLING_ERROR_HALVES = np.array(
    [
        0.0,
        0.1534264097200273452913848,
        0.0810614667953272582196702,
        0.0548141210519176538961390,
        0.0413406959554092940938221,
        0.03316287351993628748511048,
        0.02767792568499833914878929,
        0.02374616365629749597132920,
        0.02079067210376509311152277,
        0.01848845053267318523077934,
        0.01664469118982119216319487,
        0.01513497322191737887351255,
        0.01387612882307074799874573,
        0.01281046524292022692424986,
        0.01189670994589177009505572,
        0.01110455975820691732662991,
        0.010411265261972096497478567,
        0.009799416126158803298389475,
        0.009255462182712732917728637,
        0.008768700134139385462952823,
        0.008330563433362871256469318,
        0.007934114564314020547248100,
        0.007573675487951840794972024,
        0.007244554301320383179543912,
        0.006942840107209529865664152,
        0.006665247032707682442354394,
        0.006408994188004207068439631,
        0.006171712263039457647532867,
        0.005951370112758847735624416,
        0.005746216513010115682023589,
        0.005554733551962801371038690,
    ]
)
S0, S1, S2, S3, S4 = (
    0.083333333333333333333,
    0.00277777777777777777778,
    0.00079365079365079365079365,
    0.000595238095238095238095238,
    0.0008417508417508417508417508,
)


# ----------------------------------------------------------------------------------------------------------------
# the objective: R's dnbinom(mu =, log = TRUE), dnorm(log = TRUE) and sum()
# ----------------------------------------------------------------------------------------------------------------


@register_jitable
def stirling_error(n: float) -> float:
    """Loader's ``stirlerr(n)``: the table at half-integers up to 15, else lgamma or the asymptotic series."""
    if n <= 15.0:
        nn = n + n
        if nn == int(nn):
            return STIRLING_ERROR_HALVES[int(nn)]
        return r_lgamma(n + 1.0) - (n + 0.5) * math.log(n) + n - LN_SQRT_2PI
    nn = n * n
    if n > 500:
        return (S0 - S1 / nn) / n
    if n > 80:
        return (S0 - (S1 - S2 / nn) / nn) / n
    if n > 35:
        return (S0 - (S1 - (S2 - S3 / nn) / nn) / nn) / n
    return (S0 - (S1 - (S2 - (S3 - S4 / nn) / nn) / nn) / nn) / n


@register_jitable
def deviance_term(x: float, np_: float) -> float:
    """Loader's ``bd0(x, np) = x log(x/np) + np - x``, by its Taylor series where x is near np."""
    if not (math.isfinite(x) and math.isfinite(np_)) or np_ == 0.0:
        return math.nan
    if abs(x - np_) < 0.1 * (x + np_):
        v = (x - np_) / (x + np_)
        s = (x - np_) * v
        if abs(s) < DBL_MIN:
            return s
        ej = 2 * x * v
        v = v * v
        for j in range(1, 1000):
            ej *= v
            s_prev = s
            s += ej / ((j << 1) + 1)
            if s == s_prev:
                return s
    return x * math.log(x / np_) + np_ - x


@register_jitable
def log_binomial_raw(x: float, n: float, p: float, q: float) -> float:
    """R's ``dbinom_raw(x, n, p, q, log = TRUE)`` (Loader's saddle-point form)."""
    if p == 0:
        return 0.0 if x == 0 else -math.inf
    if q == 0:
        return 0.0 if x == n else -math.inf
    if x == 0:
        if n == 0:
            return 0.0
        return -deviance_term(n, n * q) - n * p if p < 0.1 else n * math.log(q)
    if x == n:
        return -deviance_term(n, n * p) - n * q if q < 0.1 else n * math.log(p)
    if x < 0 or x > n:
        return -math.inf
    lc = (
        stirling_error(n)
        - stirling_error(x)
        - stirling_error(n - x)
        - deviance_term(x, n * p)
        - deviance_term(n - x, n * q)
    )
    lf = LN_2PI + math.log(x) + math.log1p(-x / n)
    return lc - 0.5 * lf


@register_jitable
def log_nbinom_mu(x: float, size: float, mu: float) -> float:
    """R's ``dnbinom(x, size = size, mu = mu, log = TRUE)`` for a count ``x`` >= 0."""
    if math.isnan(x) or math.isnan(size) or math.isnan(mu):
        return x + size + mu
    if mu < 0 or size < 0:
        return math.nan
    if x < 0 or not math.isfinite(x):
        return -math.inf
    if x == 0 and size == 0:
        return 0.0
    # (R rounds x to the nearest integer here; DESeq2's counts are integers already)
    if not math.isfinite(size):
        raise ValueError("dnbinom with an infinite size (zero dispersion) is not reached by DESeq2's refit")
    if x == 0:
        return size * (math.log(size / (size + mu)) if size < mu else math.log1p(-mu / (size + mu)))
    if x < 1e-10 * size:
        # R's lgamma1p(x) is lgammafn(x + 1) for |x| >= 0.5, so for every positive count
        p = math.log(size / (1 + size / mu)) if size < mu else math.log(mu / (1 + mu / size))
        return x * p - mu - r_lgamma(x + 1.0) + math.log1p(x * (x - 1) / (2 * size))
    p = math.log1p(-x / (size + x)) if x < size else math.log(size / (size + x))
    return p + log_binomial_raw(size, x + size, size / (size + mu), mu / (size + mu))


@njit(cache=True, nogil=True)
def log_likelihood_terms(counts, nf, x, par, size, base, min_mu, out):  # pragma: no cover - compiled
    """R's ``dnbinom(counts, mu = pmax(nf * base^(x %*% par), min_mu), size = size, log = TRUE)`` into ``out``;
    ``x %*% par`` in reference ``dgemv`` order, the power the C library's (``base`` is 2, passed at run time so that
    the compiler cannot turn ``pow(2, .)`` into ``exp2``).
    """
    n, p = x.shape
    for i in range(n):
        eta = 0.0
        for j in range(p):
            eta = eta + par[j] * x[i, j]
        mu = nf[i] * math.pow(base, eta)
        out[i] = log_nbinom_mu(counts[i], size, min_mu if mu < min_mu else mu)


@njit(cache=True, nogil=True)
def fitted_means(nf, x, beta, out):  # pragma: no cover - compiled
    """DESeq2's fitted means ``nf * t(exp(x %*% t(beta)))`` for every gene (rows of ``beta``) into ``out``: the
    products in reference ``dgemm`` order and the C library's ``exp``.
    """
    G, n = out.shape
    p = x.shape[1]
    for g in range(G):
        for s in range(n):
            eta = 0.0
            for k in range(p):
                eta = eta + beta[g, k] * x[s, k]
            out[g, s] = nf[g, s] * math.exp(eta)


@njit(cache=True, nogil=True)
def log_density_matrix(y, mu, alpha, out):  # pragma: no cover - compiled
    """R's ``dnbinom(y, mu = mu, size = 1 / alpha, log = TRUE)`` elementwise, one dispersion per gene (row); ``out``
    may be ``mu`` itself.
    """
    G, n = y.shape
    for g in range(G):
        size = 1.0 / alpha[g]
        for s in range(n):
            out[g, s] = log_nbinom_mu(y[g, s], size, mu[g, s])


@dataclass
class NegativeLogPosterior:
    """DESeq2's optim objective for one gene: -(sum dnbinom(k, mu = nf 2^(X p), size = 1/alpha, log = TRUE)
    + sum dnorm(p, 0, sqrt(1/lambda), log = TRUE)), 1e300 where that is not finite.

    ``x`` is the (n, p) design, ``nf`` the gene's normalisation factors, ``lambda_log2`` the prior precisions on
    the log2 scale (R's ``lambda``, 1e-6 without a beta prior).
    """

    counts: np.ndarray
    nf: np.ndarray
    x: np.ndarray
    alpha: float
    lambda_log2: np.ndarray

    def __post_init__(self) -> None:
        self.counts = np.ascontiguousarray(self.counts, dtype=np.float64)
        self.nf = np.ascontiguousarray(self.nf, dtype=np.float64)
        self.x = np.ascontiguousarray(self.x, dtype=np.float64)
        self.size = 1.0 / float(self.alpha)
        self.sigma = [math.sqrt(1.0 / float(v)) for v in self.lambda_log2]
        self._terms = np.empty(self.counts.shape[0])

    def __call__(self, par: np.ndarray) -> float:
        log_like = self.log_likelihood(par, 0.0)
        prior = []
        for bv, sigma in zip(par, self.sigma, strict=True):
            z = abs(float(bv) / sigma)
            prior.append(-(LN_SQRT_2PI + 0.5 * z * z + math.log(sigma)))
        value = -1.0 * (log_like + r_sum(np.array(prior)))
        return value if math.isfinite(value) else 1e300

    def log_likelihood(self, par: np.ndarray, min_mu: float) -> float:
        """The gene's log-likelihood at ``par`` with the means floored at ``min_mu``, as DESeq2 records it for a
        refitted gene (``logLike``, hence the deviance and the likelihood-ratio statistic).
        """
        terms = self._terms
        log_likelihood_terms(
            self.counts, self.nf, self.x, np.asarray(par, dtype=np.float64), self.size, 2.0, min_mu, terms
        )
        return r_sum(terms)


def central_gradient(fn, par: np.ndarray, lower: np.ndarray, upper: np.ndarray, step: float = 1e-3) -> np.ndarray:
    """The finite-difference gradient of optim with bounds: central differences of width ``step``, cut at the bounds."""
    n = par.shape[0]
    g = np.empty(n)
    probe = par.copy()
    for i in range(n):
        eps_up = eps_down = step
        hi = par[i] + step
        if hi > upper[i]:
            hi = upper[i]
            eps_up = hi - par[i]
        probe[i] = hi
        f_hi = fn(probe)
        lo = par[i] - step
        if lo < lower[i]:
            lo = lower[i]
            eps_down = par[i] - lo
        probe[i] = lo
        f_lo = fn(probe)
        g[i] = (f_hi - f_lo) / (eps_up + eps_down)
        if not math.isfinite(g[i]):
            raise FloatingPointError(f"non-finite finite-difference value [{i + 1}]")
        probe[i] = par[i]
    return g


# ----------------------------------------------------------------------------------------------------------------
# reference BLAS / LINPACK pieces in their order of operations
# ----------------------------------------------------------------------------------------------------------------


def dot(a, b, n: int) -> float:
    """Reference ``ddot``: a left-to-right sum of products (its unrolling keeps that order)."""
    s = 0.0
    for i in range(n):
        s = s + a[i] * b[i]
    return s


def cholesky_upper(a: np.ndarray, n: int) -> int:
    """LINPACK ``dpofa`` on the leading n x n upper triangle of ``a`` in place, with R's tolerance: a pivot
    ``s <= 1e-14 |a_jj|`` fails. Returns 0, or the 1-based column that failed.
    """
    for j in range(n):
        s = 0.0
        for k in range(j):
            t = a[k, j] - dot(a[:k, k], a[:k, j], k)
            t = t / a[k, k]
            a[k, j] = t
            s = s + t * t
        s = a[j, j] - s
        if s <= 1e-14 * abs(a[j, j]):
            return j + 1
        a[j, j] = math.sqrt(s)
    return 0


def triangular_solve(t: np.ndarray, n: int, b: np.ndarray, transpose: bool) -> int:
    """LINPACK ``dtrsl`` for an upper triangular ``t``: T' x = b (``transpose``, job 11) or T x = b (job 01), in
    place in ``b``. Returns 0, or the 1-based index of a zero diagonal (``b`` untouched).
    """
    for i in range(n):
        if t[i, i] == 0.0:
            return i + 1
    if transpose:
        b[0] = b[0] / t[0, 0]
        for j in range(1, n):
            b[j] = b[j] - dot(t[:j, j], b, j)
            b[j] = b[j] / t[j, j]
    else:
        b[n - 1] = b[n - 1] / t[n - 1, n - 1]
        for j in range(n - 2, -1, -1):
            temp = -b[j + 1]
            if temp != 0.0:  # daxpy returns at once for a zero multiplier
                for i in range(j + 1):
                    b[i] = b[i] + temp * t[i, j + 1]
            b[j] = b[j] / t[j, j]
    return 0


# ----------------------------------------------------------------------------------------------------------------
# L-BFGS-B 2.3
# ----------------------------------------------------------------------------------------------------------------

FREE_UNBOUNDED = -1  # iwhere: never bounded
FREE = 0  # free at the Cauchy point
AT_LOWER = 1
AT_UPPER = 2
FIXED = 3  # lower == upper
ZERO_GRADIENT = -3  # free with a zero gradient component


@dataclass
class LBFGSBResult:
    """Where the search stopped: ``par``, ``value``, ``convergence`` (optim's code: 0 converged, 1 ``maxit``
    reached, 51 a line-search warning, 52 an error), ``message`` and the number of function-and-gradient calls.
    """

    par: np.ndarray
    value: float
    convergence: int
    message: str
    evaluations: int


class _LineSearch:
    """The More-Thuente line search (``dcsrch``/``dcstep``) with its state between trial steps."""

    ftol, gtol, xtol = 1e-3, 0.9, 0.1

    def __init__(self) -> None:
        self.brackt = False
        self.stage = 1
        self.ginit = self.gtest = self.gx = self.gy = self.finit = self.fx = self.fy = 0.0
        self.stx = self.sty = self.stmin = self.stmax = self.width = self.width1 = 0.0
        self.task = "START"

    def step(self, f: float, g: float, stp: float, stpmin: float, stpmax: float) -> float:
        """One call of ``dcsrch``: returns the next trial step; ``self.task`` says FG, CONVERGENCE or WARNING."""
        if self.task.startswith("START"):
            err = None
            if stp < stpmin:
                err = "ERROR: STP .LT. STPMIN"
            if stp > stpmax:
                err = "ERROR: STP .GT. STPMAX"
            if g >= 0.0:
                err = "ERROR: INITIAL G .GE. ZERO"
            if stpmax < stpmin:
                err = "ERROR: STPMAX .LT. STPMIN"
            if err is not None:
                self.task = err
                return stp
            self.brackt = False
            self.stage = 1
            self.finit = f
            self.ginit = g
            self.gtest = self.ftol * self.ginit
            self.width = stpmax - stpmin
            self.width1 = self.width / 0.5
            self.stx, self.fx, self.gx = 0.0, self.finit, self.ginit
            self.sty, self.fy, self.gy = 0.0, self.finit, self.ginit
            self.stmin = 0.0
            self.stmax = stp + stp * 4.0
            self.task = "FG"
            return stp
        ftest = self.finit + stp * self.gtest
        if self.stage == 1 and f <= ftest and g >= 0.0:
            self.stage = 2
        task = self.task
        if self.brackt and (stp <= self.stmin or stp >= self.stmax):
            task = "WARNING: ROUNDING ERRORS PREVENT PROGRESS"
        if self.brackt and self.stmax - self.stmin <= self.xtol * self.stmax:
            task = "WARNING: XTOL TEST SATISFIED"
        if stp == stpmax and f <= ftest and g <= self.gtest:
            task = "WARNING: STP = STPMAX"
        if stp == stpmin and (f > ftest or g >= self.gtest):
            task = "WARNING: STP = STPMIN"
        if f <= ftest and abs(g) <= self.gtol * (-self.ginit):
            task = "CONVERGENCE"
        self.task = task
        if task.startswith("WARN") or task.startswith("CONV"):
            return stp
        if self.stage == 1 and f <= self.fx and f > ftest:
            # the modified function psi(stp) = f(stp) - f(0) - ftol stp f'(0) while no step has sufficient decrease
            fm = f - stp * self.gtest
            fxm = self.fx - self.stx * self.gtest
            fym = self.fy - self.sty * self.gtest
            gm = g - self.gtest
            gxm = self.gx - self.gtest
            gym = self.gy - self.gtest
            stx, fxm, gxm, sty, fym, gym, stp = self._safeguarded_step(
                self.stx, fxm, gxm, self.sty, fym, gym, stp, fm, gm, self.stmin, self.stmax
            )
            self.stx, self.sty = stx, sty
            self.fx = fxm + stx * self.gtest
            self.fy = fym + sty * self.gtest
            self.gx = gxm + self.gtest
            self.gy = gym + self.gtest
        else:
            (self.stx, self.fx, self.gx, self.sty, self.fy, self.gy, stp) = self._safeguarded_step(
                self.stx, self.fx, self.gx, self.sty, self.fy, self.gy, stp, f, g, self.stmin, self.stmax
            )
        if self.brackt:
            if abs(self.sty - self.stx) >= self.width1 * 0.66:
                stp = self.stx + (self.sty - self.stx) * 0.5
            self.width1 = self.width
            self.width = abs(self.sty - self.stx)
            self.stmin = self.sty if self.stx > self.sty else self.stx
            self.stmax = self.sty if self.stx < self.sty else self.stx
        else:
            self.stmin = stp + (stp - self.stx) * 1.1
            self.stmax = stp + (stp - self.stx) * 4.0
        if stp < stpmin:
            stp = stpmin
        if stp > stpmax:
            stp = stpmax
        if (self.brackt and (stp <= self.stmin or stp >= self.stmax)) or (
            self.brackt and self.stmax - self.stmin <= self.xtol * self.stmax
        ):
            stp = self.stx
        self.task = "FG"
        return stp

    def _safeguarded_step(self, stx, fx, dx, sty, fy, dy, stp, fp, dp, stpmin, stpmax):
        """``dcstep``: the cubic/quadratic safeguarded step of More and Thuente; updates the bracket."""
        sgnd = dp * (dx / abs(dx))
        if fp > fx:
            theta, s, rad = _cubic_terms(fx, fp, stx, stp, dx, dp)
            gamm = s * _sqrt(rad)
            if stp < stx:
                gamm = -gamm
            p = gamm - dx + theta
            q = gamm - dx + gamm + dp
            r = p / q
            stpc = stx + r * (stp - stx)
            stpq = stx + dx / ((fx - fp) / (stp - stx) + dx) / 2.0 * (stp - stx)
            stpf = stpc if abs(stpc - stx) < abs(stpq - stx) else stpc + (stpq - stpc) / 2.0
            self.brackt = True
        elif sgnd < 0.0:
            stpc = _cubic_step(stp, fp, dp, stx, fx, dx)
            stpq = stp + dp / (dp - dx) * (stx - stp)
            stpf = stpc if abs(stpc - stp) > abs(stpq - stp) else stpq
            self.brackt = True
        elif abs(dp) < abs(dx):
            # the cubic may not tend to infinity in the step's direction: its minimiser may lie beyond
            theta, s, rad = _cubic_terms(fx, fp, stx, stp, dx, dp)
            gamm = 0.0 if rad < 0 else s * math.sqrt(rad)
            if stp > stx:
                gamm = -gamm
            p = gamm - dp + theta
            q = gamm + (dx - dp) + gamm
            r = p / q
            if r < 0.0 and gamm != 0.0:
                stpc = stp + r * (stx - stp)
            elif stp > stx:
                stpc = stpmax
            else:
                stpc = stpmin
            stpq = stp + dp / (dp - dx) * (stx - stp)
            if self.brackt:
                stpf = stpc if abs(stpc - stp) < abs(stpq - stp) else stpq
                d1 = stp + (sty - stp) * 0.66
                if stp > stx:
                    stpf = stpf if d1 > stpf else d1
                else:
                    stpf = stpf if d1 < stpf else d1
            else:
                stpf = stpc if abs(stpc - stp) > abs(stpq - stp) else stpq
                stpf = stpf if stpmax > stpf else stpmax
                stpf = stpf if stpmin < stpf else stpmin
        else:
            if self.brackt:
                # (fp - fy) 3 / (sty - stp) in R's code: the same double as (fy - fp) 3 / (stp - sty)
                stpf = _cubic_step(stp, fp, dp, sty, fy, dy)
            elif stp > stx:
                stpf = stpmax
            else:
                stpf = stpmin
        if fp > fx:
            sty, fy, dy = stp, fp, dp
        else:
            if sgnd < 0.0:
                sty, fy, dy = stx, fx, dx
            stx, fx, dx = stp, fp, dp
        return stx, fx, dx, sty, fy, dy, stpf


def _column_dot(a: np.ndarray, i: int, b: np.ndarray, j: int, rows: np.ndarray) -> float:
    """Sum over ``rows`` of a[r, i] * b[r, j], in order from zero (``formk``'s partial inner products)."""
    s = 0.0
    for r in rows:
        s += a[r, i] * b[r, j]
    return s


def _cubic_terms(f_a, f_b, st_a, st_b, d_a, d_b) -> tuple[float, float, float]:
    """The cubic interpolating two points' values and slopes (``dcstep``): theta, the scale s and the radicand of
    gamma = s sqrt(rad), in the search's order of operations.
    """
    theta = (f_a - f_b) * 3.0 / (st_b - st_a) + d_a + d_b
    s = _max3(theta, d_a, d_b)
    t = theta / s
    return theta, s, t * t - d_a / s * (d_b / s)


def _cubic_step(stp, fp, dp, st_o, f_o, d_o) -> float:
    """The minimiser of the cubic through the trial step (stp, fp, dp) and the end point (st_o, f_o, d_o), from the
    trial step (``dcstep``'s cases of a sign change of the slope and of a bracketed slow decrease).
    """
    theta, s, rad = _cubic_terms(f_o, fp, st_o, stp, d_o, dp)
    gamm = s * _sqrt(rad)
    if stp > st_o:
        gamm = -gamm
    p = gamm - dp + theta
    q = gamm - dp + gamm + d_o
    return stp + p / q * (st_o - stp)


def _sqrt(v: float) -> float:
    """C's sqrt: NaN below zero."""
    return math.sqrt(v) if v >= 0 else math.nan


def _max3(a: float, b: float, c: float) -> float:
    """max(|a|, |b|, |c|) as the C macros compare (the first of equal values)."""
    m = abs(a)
    m = abs(b) if m < abs(b) else m
    return abs(c) if m < abs(c) else m


class _BoundedBFGS:
    """The state of one L-BFGS-B minimisation (limited-memory matrices in circular storage, the active set)."""

    def __init__(self, x0: np.ndarray, lower: np.ndarray, upper: np.ndarray, m: int, factr: float) -> None:
        n = x0.shape[0]
        self.n, self.m = n, m
        self.x = np.array(x0, dtype=np.float64)
        self.lower = np.asarray(lower, dtype=np.float64)
        self.upper = np.asarray(upper, dtype=np.float64)
        lo_ok, hi_ok = np.isfinite(self.lower), np.isfinite(self.upper)
        # nbd: 0 unbounded, 1 lower only, 2 both, 3 upper only
        self.nbd = np.where(lo_ok, np.where(hi_ok, 2, 1), np.where(hi_ok, 3, 0)).astype(np.int64)
        if np.any((self.nbd == 2) & (self.lower > self.upper)):
            raise ValueError("L-BFGS-B: a lower bound exceeds its upper bound")
        self.ws = np.zeros((n, m))  # corrections s (columns, circular from `head`)
        self.wy = np.zeros((n, m))  # corrections y
        self.sy = np.zeros((m, m))  # S'Y
        self.ss = np.zeros((m, m))  # S'S
        self.wt = np.zeros((m, m))  # Cholesky factor of theta S'S + L D^-1 L'
        self.wn = np.zeros((2 * m, 2 * m))  # factor of the middle matrix of the reduced problem
        self.snd = np.zeros((2 * m, 2 * m))  # its unfactored blocks, updated in place
        self.z = np.zeros(n)  # Cauchy point, then the subspace minimiser
        self.r = np.zeros(n)  # reduced gradient; the previous gradient during a line search
        self.d = np.zeros(n)  # search direction
        self.t = np.zeros(n)  # breakpoints; the previous iterate during a line search
        self.wa = np.zeros(8 * m)  # p, c, wbp, v of the Cauchy search (c is read again by cmprlb)
        self.indx = np.zeros(n, dtype=np.int64)  # free variables first, then the active ones
        self.iwhere = np.zeros(n, dtype=np.int64)
        self.indx2 = np.zeros(n, dtype=np.int64)  # entering variables first, leaving ones last
        self.theta = 1.0
        self.col = 0
        self.head = 0
        self.itail = 0
        self.iupdat = 0
        self.updatd = False
        self.nfree = n
        self.nenter = 0
        self.ileave = n
        self.tol = factr * DBL_EPSILON
        self.project_start()

    def reset_memory(self) -> None:
        """Forget the BFGS corrections (R: 'refresh the lbfgs memory and restart the iteration')."""
        self.col = 0
        self.head = 0
        self.theta = 1.0
        self.iupdat = 0
        self.updatd = False

    def project_start(self) -> None:
        """``active``: project the start into the box and classify the variables."""
        x, lo, hi, nbd = self.x, self.lower, self.upper, self.nbd
        for i in range(self.n):
            if nbd[i] > 0:
                if nbd[i] <= 2 and x[i] <= lo[i]:
                    if x[i] < lo[i]:
                        x[i] = lo[i]
                elif nbd[i] >= 2 and x[i] >= hi[i]:
                    if x[i] > hi[i]:
                        x[i] = hi[i]
        self.boxed = bool(np.all(nbd == 2))
        self.constrained = bool(np.any(nbd != 0))
        for i in range(self.n):
            if nbd[i] == 0:
                self.iwhere[i] = FREE_UNBOUNDED
            elif nbd[i] == 2 and hi[i] - lo[i] <= 0.0:
                self.iwhere[i] = FIXED
            else:
                self.iwhere[i] = FREE

    def projected_gradient_norm(self, g: np.ndarray) -> float:
        """``projgr``: the infinity norm of the projected gradient."""
        norm = 0.0
        for i in range(self.n):
            gi = g[i]
            if self.nbd[i] != 0:
                if gi < 0.0:
                    if self.nbd[i] >= 2:
                        bound = self.x[i] - self.upper[i]
                        if gi < bound:
                            gi = bound
                elif self.nbd[i] <= 2:
                    bound = self.x[i] - self.lower[i]
                    if gi > bound:
                        gi = bound
            if norm < abs(gi):
                norm = abs(gi)
        return norm

    def middle_product(self, v: np.ndarray, out: np.ndarray) -> int:
        """``bmv``: out = M v for the 2col x 2col middle matrix of the compact L-BFGS form. Returns info."""
        col, sy = self.col, self.sy
        if col == 0:
            return 0
        out[col] = v[col]
        for i in range(1, col):
            s = 0.0
            for k in range(i):
                s += sy[i, k] * v[k] / sy[k, k]
            out[col + i] = v[col + i] + s
        tail = out[col : 2 * col]
        info = triangular_solve(self.wt, col, tail, transpose=True)
        if info != 0:
            return info
        for i in range(col):
            out[i] = v[i] / math.sqrt(sy[i, i])
        info = triangular_solve(self.wt, col, tail, transpose=False)
        if info != 0:
            return info
        for i in range(col):
            out[i] = -out[i] / math.sqrt(sy[i, i])
        for i in range(col):
            s = 0.0
            for k in range(i + 1, col):
                s += sy[k, i] * out[col + k] / sy[i, i]
            out[i] += s
        return 0

    def cauchy_point(self, g: np.ndarray, sbgnrm: float) -> int:
        """``cauchy``: the generalised Cauchy point along the projected steepest descent path into ``self.z``.

        Breakpoints are visited in increasing order through a heap; ``self.wa`` keeps p, c, wbp and v.
        Returns info (non-zero: a singular triangular system).
        """
        n, m, col = self.n, self.m, self.col
        x, lo, hi, nbd, iwhere, d, t, xcp = (
            self.x,
            self.lower,
            self.upper,
            self.nbd,
            self.iwhere,
            self.d,
            self.t,
            self.z,
        )
        wa = self.wa
        p, c, wbp, v = wa[0 : 2 * m], wa[2 * m : 4 * m], wa[4 * m : 6 * m], wa[6 * m : 8 * m]
        iorder = self.indx2
        theta = self.theta
        if sbgnrm <= 0.0:
            xcp[:] = x
            return 0
        bnded = True
        nfree = n
        nbreak = 0
        ibkmin = 0
        bkmin = 0.0
        col2 = 2 * col
        f1 = 0.0
        tl = tu = 0.0
        p[:col2] = 0.0
        for i in range(n):
            neggi = -g[i]
            if iwhere[i] != FIXED and iwhere[i] != FREE_UNBOUNDED:
                if nbd[i] <= 2:
                    tl = x[i] - lo[i]
                if nbd[i] >= 2:
                    tu = hi[i] - x[i]
                xlower = nbd[i] <= 2 and tl <= 0.0
                xupper = nbd[i] >= 2 and tu <= 0.0
                iwhere[i] = FREE
                if xlower:
                    if neggi <= 0.0:
                        iwhere[i] = AT_LOWER
                elif xupper:
                    if neggi >= 0.0:
                        iwhere[i] = AT_UPPER
                elif abs(neggi) <= 0.0:
                    iwhere[i] = ZERO_GRADIENT
            pointr = self.head
            if iwhere[i] != FREE and iwhere[i] != FREE_UNBOUNDED:
                d[i] = 0.0
            else:
                d[i] = neggi
                f1 -= neggi * neggi
                for j in range(col):
                    p[j] += self.wy[i, pointr] * neggi
                    p[col + j] += self.ws[i, pointr] * neggi
                    pointr = (pointr + 1) % m
                if nbd[i] <= 2 and nbd[i] != 0 and neggi < 0.0:
                    t[nbreak] = tl / (-neggi)
                    iorder[nbreak] = i
                    if nbreak == 0 or t[nbreak] < bkmin:
                        bkmin = t[nbreak]
                        ibkmin = nbreak
                    nbreak += 1
                elif nbd[i] >= 2 and neggi > 0.0:
                    t[nbreak] = tu / neggi
                    iorder[nbreak] = i
                    if nbreak == 0 or t[nbreak] < bkmin:
                        bkmin = t[nbreak]
                        ibkmin = nbreak
                    nbreak += 1
                else:
                    nfree -= 1
                    iorder[nfree] = i
                    if abs(neggi) > 0.0:
                        bnded = False
        if theta != 1.0:
            for j in range(col):
                p[col + j] = theta * p[col + j]
        xcp[:] = x
        if nbreak == 0 and nfree == n:
            return 0
        c[:col2] = 0.0
        f2 = -theta * f1
        f2_org = f2
        if col > 0:
            info = self.middle_product(p, v)
            if info != 0:
                return info
            f2 -= dot(v, p, col2)
        dtm = -f1 / f2
        tsum = 0.0
        if nbreak > 0:
            nleft = nbreak
            it = 1
            tj = 0.0
            while True:
                tj0 = tj
                if it == 1:
                    tj = bkmin
                    ibp = iorder[ibkmin]
                else:
                    if it == 2 and ibkmin != nbreak - 1:
                        # the smallest breakpoint has been used: move the last one into its place
                        t[ibkmin] = t[nbreak - 1]
                        iorder[ibkmin] = iorder[nbreak - 1]
                    _heap_pop_min(nleft, t, iorder, it - 2)
                    tj = t[nleft - 1]
                    ibp = iorder[nleft - 1]
                dt = tj - tj0
                if dtm < dt:
                    break
                tsum += dt
                nleft -= 1
                it += 1
                dibp = d[ibp]
                d[ibp] = 0.0
                if dibp > 0.0:
                    zibp = hi[ibp] - x[ibp]
                    xcp[ibp] = hi[ibp]
                    iwhere[ibp] = AT_UPPER
                else:
                    zibp = lo[ibp] - x[ibp]
                    xcp[ibp] = lo[ibp]
                    iwhere[ibp] = AT_LOWER
                if nleft == 0 and nbreak == n:
                    # every variable is at a bound: the Cauchy point is the last breakpoint
                    dtm = dt
                    if col > 0:
                        for j in range(col2):
                            c[j] = c[j] + dtm * p[j]
                    return 0
                dibp2 = dibp * dibp
                f1 += dt * f2 + dibp2 - theta * dibp * zibp
                f2 -= theta * dibp2
                if col > 0:
                    if dt != 0.0:
                        for j in range(col2):
                            c[j] = c[j] + dt * p[j]
                    pointr = self.head
                    for j in range(col):
                        wbp[j] = self.wy[ibp, pointr]
                        wbp[col + j] = theta * self.ws[ibp, pointr]
                        pointr = (pointr + 1) % m
                    info = self.middle_product(wbp, v)
                    if info != 0:
                        return info
                    wmc = dot(c, v, col2)
                    wmp = dot(p, v, col2)
                    wmw = dot(wbp, v, col2)
                    if dibp != 0.0:
                        for j in range(col2):
                            p[j] = p[j] + (-dibp) * wbp[j]
                    f1 += dibp * wmc
                    f2 += 2.0 * dibp * wmp - dibp2 * wmw
                floor = DBL_EPSILON * f2_org
                if f2 < floor:
                    f2 = floor
                if nleft > 0:
                    dtm = -f1 / f2
                    continue
                if bnded:
                    f1 = 0.0
                    f2 = 0.0
                    dtm = 0.0
                else:
                    dtm = -f1 / f2
                break
        if dtm <= 0.0:
            dtm = 0.0
        tsum += dtm
        if tsum != 0.0:
            for i in range(n):
                xcp[i] = xcp[i] + tsum * d[i]
        if col > 0 and dtm != 0.0:
            for j in range(col2):
                c[j] = c[j] + dtm * p[j]
        return 0

    def update_free_set(self, iteration: int) -> bool:
        """``freev``: the variables entering and leaving the free set at the Cauchy point, and the new free set
        (``indx``: free ones first). Returns whether the reduced matrix must be formed again.
        """
        n, indx, indx2, iwhere = self.n, self.indx, self.indx2, self.iwhere
        self.nenter = 0
        self.ileave = n
        if iteration > 0 and self.constrained:
            for i in range(self.nfree):
                k = indx[i]
                if iwhere[k] > 0:
                    self.ileave -= 1
                    indx2[self.ileave] = k
            for i in range(self.nfree, n):
                k = indx[i]
                if iwhere[k] <= 0:
                    indx2[self.nenter] = k
                    self.nenter += 1
        rebuild = self.ileave < n or self.nenter > 0 or self.updatd
        self.nfree = 0
        iact = n
        for i in range(n):
            if iwhere[i] <= 0:
                indx[self.nfree] = i
                self.nfree += 1
            else:
                iact -= 1
                indx[iact] = i
        return rebuild

    def form_reduced_matrix(self) -> int:
        """``formk``: the LEL' factorisation of the middle matrix of the subspace problem on the free variables,
        updating the blocks Y'ZZ'Y, S'AA'S and S'ZZ'Y of ``snd`` for the variables that changed sets.
        """
        n, m, col, head = self.n, self.m, self.col, self.head
        wn, wn1, ws, wy = self.wn, self.snd, self.ws, self.wy
        free, active = self.indx[: self.nfree], self.indx[self.nfree : n]
        entering, leaving = self.indx2[: self.nenter], self.indx2[self.ileave : n]
        if self.updatd:
            if self.iupdat > m:
                # the oldest correction dropped out: shift the old blocks up and left
                for jy in range(m - 1):
                    js = m + jy
                    wn1[jy : m - 1, jy] = wn1[jy + 1 : m, jy + 1].copy()
                    wn1[js : 2 * m - 1, js] = wn1[js + 1 : 2 * m, js + 1].copy()
                    wn1[m : 2 * m - 1, jy] = wn1[m + 1 : 2 * m, jy + 1].copy()
            # the rows of the newest correction in Y'ZZ'Y, S'AA'S and S'AA'Y, and its column of S'ZZ'Y, afresh
            iy = col - 1
            is_ = m + col - 1
            newest = (head + col - 1) % m
            jpntr = head
            for jy in range(col):
                wn1[iy, jy] = _column_dot(wy, newest, wy, jpntr, free)
                wn1[is_, m + jy] = _column_dot(ws, newest, ws, jpntr, active)
                wn1[is_, jy] = _column_dot(ws, newest, wy, jpntr, active)
                jpntr = (jpntr + 1) % m
            ipntr = head
            for i in range(col):
                wn1[m + i, col - 1] = _column_dot(ws, ipntr, wy, newest, free)
                ipntr = (ipntr + 1) % m
            upcl = col - 1
        else:
            upcl = col
        # the other entries change by the variables that entered (+) or left (-) the free set
        ipntr = head
        for iy in range(upcl):
            is_ = m + iy
            jpntr = head
            for jy in range(iy + 1):
                js = m + jy
                temp1 = _column_dot(wy, ipntr, wy, jpntr, entering)
                temp2 = _column_dot(ws, ipntr, ws, jpntr, entering)
                temp3 = _column_dot(wy, ipntr, wy, jpntr, leaving)
                temp4 = _column_dot(ws, ipntr, ws, jpntr, leaving)
                wn1[iy, jy] = wn1[iy, jy] + temp1 - temp3
                wn1[is_, js] = wn1[is_, js] - temp2 + temp4
                jpntr = (jpntr + 1) % m
            ipntr = (ipntr + 1) % m
        ipntr = head
        for is_ in range(m, m + upcl):
            jpntr = head
            for jy in range(upcl):
                temp1 = _column_dot(ws, ipntr, wy, jpntr, entering)
                temp3 = _column_dot(ws, ipntr, wy, jpntr, leaving)
                if is_ <= jy + m:
                    wn1[is_, jy] += temp1 - temp3
                else:
                    wn1[is_, jy] += -temp1 + temp3
                jpntr = (jpntr + 1) % m
            ipntr = (ipntr + 1) % m
        # the upper triangle of [[Y'ZZ'Y/theta + L_a'R_z^-1 ..., ...]] in wn
        theta = self.theta
        for iy in range(col):
            is_ = col + iy
            is1 = m + iy
            for jy in range(iy + 1):
                js = col + jy
                js1 = m + jy
                wn[jy, iy] = wn1[iy, jy] / theta
                wn[js, is_] = wn1[is1, js1] * theta
            for jy in range(iy):
                wn[jy, is_] = -wn1[is1, jy]
            for jy in range(iy, col):
                wn[jy, is_] = wn1[is1, jy]
            wn[iy, iy] += self.sy[iy, iy]
        if cholesky_upper(wn, col) != 0:
            return -1
        col2 = 2 * col
        for js in range(col, col2):
            column = wn[:col, js]
            triangular_solve(wn, col, column, transpose=True)
        for is_ in range(col, col2):
            for js in range(is_, col2):
                wn[is_, js] += dot(wn[:col, is_], wn[:col, js], col)
        lower_block = wn[col:, col:]
        if cholesky_upper(lower_block, col) != 0:
            return -2
        return 0

    def reduced_gradient(self, g: np.ndarray) -> int:
        """``cmprlb``: r = -Z'(B(xcp - x) + g) on the free variables (into ``self.r``). Returns info."""
        n, m, col, theta = self.n, self.m, self.col, self.theta
        r, x, z, indx, wa = self.r, self.x, self.z, self.indx, self.wa
        if not self.constrained and col > 0:
            for i in range(n):
                r[i] = -g[i]
            return 0
        for i in range(self.nfree):
            k = indx[i]
            r[i] = -theta * (z[k] - x[k]) - g[k]
        info = self.middle_product(wa[2 * m : 4 * m], wa[0 : 2 * m])
        if info != 0:
            return -8
        pointr = self.head
        for j in range(col):
            a1 = wa[j]
            a2 = theta * wa[col + j]
            for i in range(self.nfree):
                k = indx[i]
                r[i] += self.wy[k, pointr] * a1 + self.ws[k, pointr] * a2
            pointr = (pointr + 1) % m
        return 0

    def subspace_minimum(self) -> int:
        """``subsm``: the Newton direction in the free variables from the Cauchy point, backtracked into the box
        (``self.z`` becomes the subspace minimiser). Returns info.
        """
        m, col, theta = self.m, self.col, self.theta
        ns = self.nfree
        ind, d, x, wv, lo, hi, nbd = self.indx, self.r, self.z, self.wa[0 : 2 * m], self.lower, self.upper, self.nbd
        if ns <= 0:
            return 0
        pointr = self.head
        for i in range(col):
            temp1 = temp2 = 0.0
            for j in range(ns):
                k = ind[j]
                temp1 += self.wy[k, pointr] * d[j]
                temp2 += self.ws[k, pointr] * d[j]
            wv[i] = temp1
            wv[col + i] = theta * temp2
            pointr = (pointr + 1) % m
        col2 = 2 * col
        info = triangular_solve(self.wn, col2, wv, transpose=True)
        if info != 0:
            return info
        for i in range(col):
            wv[i] = -wv[i]
        info = triangular_solve(self.wn, col2, wv, transpose=False)
        if info != 0:
            return info
        pointr = self.head
        for jy in range(col):
            js = col + jy
            for i in range(ns):
                k = ind[i]
                d[i] += self.wy[k, pointr] * wv[jy] / theta + self.ws[k, pointr] * wv[js]
            pointr = (pointr + 1) % m
        for i in range(ns):
            d[i] /= theta
        alpha = 1.0
        temp1 = alpha
        ibd = 0
        for i in range(ns):
            k = ind[i]
            dk = d[i]
            if nbd[k] != 0:
                if dk < 0.0 and nbd[k] <= 2:
                    temp2 = lo[k] - x[k]
                    if temp2 >= 0.0:
                        temp1 = 0.0
                    elif dk * alpha < temp2:
                        temp1 = temp2 / dk
                elif dk > 0.0 and nbd[k] >= 2:
                    temp2 = hi[k] - x[k]
                    if temp2 <= 0.0:
                        temp1 = 0.0
                    elif dk * alpha > temp2:
                        temp1 = temp2 / dk
                if temp1 < alpha:
                    alpha = temp1
                    ibd = i
        if alpha < 1.0:
            dk = d[ibd]
            k = ind[ibd]
            if dk > 0.0:
                x[k] = hi[k]
                d[ibd] = 0.0
            elif dk < 0.0:
                x[k] = lo[k]
                d[ibd] = 0.0
        for i in range(ns):
            x[ind[i]] += alpha * d[i]
        return 0

    def store_correction(self, rr: float, dr: float, stp: float, dtd: float) -> None:
        """``matupd``: append the correction pair (s, y) = (``d``, ``r``) and update S'Y, S'S and theta."""
        n, m = self.n, self.m
        ws, wy, sy, ss, d = self.ws, self.wy, self.sy, self.ss, self.d
        if self.iupdat <= m:
            self.col = self.iupdat
            self.itail = (self.head + self.iupdat - 1) % m
        else:
            self.itail = (self.itail + 1) % m
            self.head = (self.head + 1) % m
        col = self.col
        ws[:, self.itail] = d
        wy[:, self.itail] = self.r
        self.theta = rr / dr
        if self.iupdat > m:
            # drop the oldest pair: move the old information up and left
            for j in range(col - 1):
                ss[0 : j + 1, j] = ss[1 : j + 2, j + 1].copy()
                sy[j : col - 1, j] = sy[j + 1 : col, j + 1].copy()
        pointr = self.head
        for j in range(col - 1):
            sy[col - 1, j] = dot(d, wy[:, pointr], n)
            ss[j, col - 1] = dot(ws[:, pointr], d, n)
            pointr = (pointr + 1) % m
        ss[col - 1, col - 1] = dtd if stp == 1.0 else stp * stp * dtd
        sy[col - 1, col - 1] = dr

    def factor_middle(self) -> int:
        """``formt``: the Cholesky factor of theta S'S + L D^-1 L' into ``wt``. Returns info."""
        col, theta, sy, ss, wt = self.col, self.theta, self.sy, self.ss, self.wt
        for j in range(col):
            wt[0, j] = theta * ss[0, j]
        for i in range(1, col):
            for j in range(i, col):
                ddum = 0.0
                for k in range(i):
                    ddum += sy[i, k] * sy[j, k] / sy[k, k]
                wt[i, j] = ddum + theta * ss[i, j]
        return -3 if cholesky_upper(wt, col) != 0 else 0


def _heap_pop_min(n: int, t: np.ndarray, iorder: np.ndarray, iheap: int) -> None:
    """``hpsolb``: keep t[0:n] a min-heap (built first when ``iheap`` is 0) and move its least element to
    t[n-1] (with its variable in ``iorder``).
    """
    if iheap == 0:
        for k in range(2, n + 1):
            ddum = t[k - 1]
            indxin = iorder[k - 1]
            i = k
            while i > 1:
                j = i // 2
                if ddum < t[j - 1]:
                    t[i - 1] = t[j - 1]
                    iorder[i - 1] = iorder[j - 1]
                    i = j
                else:
                    break
            t[i - 1] = ddum
            iorder[i - 1] = indxin
    if n > 1:
        i = 1
        out = t[0]
        indxou = iorder[0]
        ddum = t[n - 1]
        indxin = iorder[n - 1]
        while True:
            j = i + i
            if j <= n - 1:
                if t[j] < t[j - 1]:
                    j += 1
                if t[j - 1] < ddum:
                    t[i - 1] = t[j - 1]
                    iorder[i - 1] = iorder[j - 1]
                    i = j
                    continue
            break
        t[i - 1] = ddum
        iorder[i - 1] = indxin
        t[n - 1] = out
        iorder[n - 1] = indxou


def lbfgsb(
    fn,
    x0: np.ndarray,
    lower: np.ndarray,
    upper: np.ndarray,
    *,
    m: int = 5,
    factr: float = 1e7,
    pgtol: float = 0.0,
    maxit: int = 100,
    ndeps: float = 1e-3,
) -> LBFGSBResult:
    """Minimise ``fn`` over the box [lower, upper] as R's ``optim(par, fn, method = "L-BFGS-B", lower, upper)``
    does with its default controls and no gradient function (optim's central differences are the gradient).

    The stopping rules are R's: the projected gradient's infinity norm <= ``pgtol``, a relative reduction of f
    below ``factr`` times the machine epsilon, more than ``maxit`` iterations (code 1), a line search that cannot
    progress after resetting the BFGS memory (code 52) or ends on a warning (code 51).
    """
    state = _BoundedBFGS(np.asarray(x0, dtype=np.float64), lower, upper, m, factr)
    n = state.n
    x = state.x
    lo, hi = state.lower, state.upper
    evaluations = 0

    def evaluate() -> tuple[float, np.ndarray]:
        nonlocal evaluations
        evaluations += 1
        value = fn(x)
        if not math.isfinite(value):
            raise FloatingPointError("L-BFGS-B needs finite values of 'fn'")
        return value, central_gradient(fn, x, lo, hi, ndeps)

    f, g = evaluate()
    sbgnrm = state.projected_gradient_norm(g)
    if sbgnrm <= pgtol:
        return LBFGSBResult(x.copy(), f, 0, "CONVERGENCE: NORM OF PROJECTED GRADIENT <= PGTOL", evaluations)
    search = _LineSearch()
    iteration = 0  # L-BFGS-B's iterations: optim counts the same accepted points against maxit
    fold = gd = gdold = stp = dtd = 0.0
    d, r, t, z = state.d, state.r, state.t, state.z
    while True:
        # ---- the search direction: Cauchy point, then the subspace minimum over the free variables
        if not state.constrained and state.col > 0:
            z[:] = x
            rebuild = state.updatd
        else:
            if state.cauchy_point(g, sbgnrm) != 0:
                state.reset_memory()
                continue
            rebuild = state.update_free_set(iteration)
        if state.nfree != 0 and state.col != 0:
            if rebuild and state.form_reduced_matrix() != 0:
                state.reset_memory()
                continue
            info = state.reduced_gradient(g)
            if info == 0:
                info = state.subspace_minimum()
            if info != 0:
                state.reset_memory()
                continue
        for i in range(n):
            d[i] = z[i] - x[i]
        # ---- the line search (lnsrlb)
        dtd = dot(d, d, n)
        dnorm = math.sqrt(dtd)
        stpmx = 1e10
        if state.constrained:
            if iteration == 0:
                stpmx = 1.0
            else:
                for i in range(n):
                    a1 = d[i]
                    if state.nbd[i] != 0:
                        if a1 < 0.0 and state.nbd[i] <= 2:
                            a2 = lo[i] - x[i]
                            if a2 >= 0.0:
                                stpmx = 0.0
                            elif a1 * stpmx < a2:
                                stpmx = a2 / a1
                        elif a1 > 0.0 and state.nbd[i] >= 2:
                            a2 = hi[i] - x[i]
                            if a2 <= 0.0:
                                stpmx = 0.0
                            elif a1 * stpmx > a2:
                                stpmx = a2 / a1
        if iteration == 0 and not state.boxed:
            d1 = 1.0 / dnorm
            stp = stpmx if d1 > stpmx else d1
        else:
            stp = 1.0
        t[:] = x
        r[:] = g
        fold = f
        ifun = 0
        iback = 0
        search.task = "START"
        failed = False
        while True:
            gd = dot(g, d, n)
            if ifun == 0:
                gdold = gd
                if gd >= 0.0:
                    # not a descent direction
                    failed = True
                    break
            stp = search.step(f, gd, stp, 0.0, stpmx)
            if search.task.startswith("CONV") or search.task.startswith("WARN"):
                break
            ifun += 1
            iback = ifun - 1
            if iback >= 20:
                failed = True
                break
            if stp == 1.0:
                x[:] = z
            else:
                for i in range(n):
                    x[i] = stp * d[i] + t[i]
            f, g = evaluate()
        if failed:
            x[:] = t
            g = r.copy()
            f = fold
            if state.col == 0:
                return LBFGSBResult(x.copy(), f, 52, "ERROR: ABNORMAL_TERMINATION_IN_LNSRCH", evaluations)
            state.reset_memory()
            continue
        iteration += 1
        sbgnrm = state.projected_gradient_norm(g)
        if iteration > maxit:
            return LBFGSBResult(x.copy(), f, 1, "NEW_X", evaluations)
        # ---- convergence tests (R: task NEW_X, then back in mainlb)
        if sbgnrm <= pgtol:
            return LBFGSBResult(x.copy(), f, 0, "CONVERGENCE: NORM OF PROJECTED GRADIENT <= PGTOL", evaluations)
        ddum = max(abs(fold), abs(f), 1.0)
        if fold - f <= state.tol * ddum:
            return LBFGSBResult(x.copy(), f, 0, "CONVERGENCE: REL_REDUCTION_OF_F <= FACTR*EPSMCH", evaluations)
        # ---- the BFGS update with the pair s = x - x_old (= stp d), y = g - g_old
        for i in range(n):
            r[i] = g[i] - r[i]
        rr = dot(r, r, n)
        if stp == 1.0:
            dr = gd - gdold
            ddum = -gdold
        else:
            dr = (gd - gdold) * stp
            for i in range(n):
                d[i] = stp * d[i]
            ddum = -gdold * stp
        if dr <= DBL_EPSILON * ddum:
            # skip the update: the curvature condition fails
            state.updatd = False
            continue
        state.updatd = True
        state.iupdat += 1
        state.store_correction(rr, dr, stp, dtd)
        if state.factor_middle() != 0:
            state.reset_memory()
            continue
