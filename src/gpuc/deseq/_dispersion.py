"""Dispersion estimation as R DESeq2 1.38 computes it: starting values, gene-wise estimates, trend, prior variance,
MAP estimates, dispersion outliers.

Gene-wise and MAP estimates run R's own search (``fitDisp`` in DESeq2's C++: steepest ascent on log alpha with
Armijo backtracking, the Cox-Reid term and, for MAP, the log-normal prior; :mod:`gpuc.deseq._fitdisp`) from R's
starting values, with R's rules after it (``estimateDispersionsGeneEst``: the log posterior must rise by a millionth
or the start is kept; genes stopped after one step or at 100 proposals go to R's 20 + 20-point grid, ``fitDispGrid``;
``estimateDispersionsMAP``: genes at 100 proposals go to the grid with the prior). R's search can stop short of the
maximum of the log posterior (by up to a few percent for high counts); gpuc returns R's estimate all the same, not the
optimum. Where one of R's decisions hinges on the last bits of a log posterior value (a step that raises it by one
or two units in the last place), gpuc's arithmetic, which is R's up to the rounding of its inputs, can decide the
other way for that gene: 0 to 3 genes in 12,000 on pasilla.

The search runs per gene in compiled code (numba on the CPU; one numba-cuda launch, a thread per gene, on the GPU),
from one source; the batched array form (:func:`_fitdisp_array`) is the fallback and follows the same arithmetic.
The trend (:func:`parametric_trend`, :func:`local_trend`: locfit's adaptive tree; or the trimmed mean) and the prior
variance are host computations on a few thousand numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from gpuc._backend import Backend
from gpuc.deseq._glm import fit_nb_glm, per_gene
from gpuc.deseq._rlinalg import (
    least_squares_coef,
    linear_model_fit,
    ordered_matmul,
    r_col_means,
    r_mean,
    r_median,
    r_row_sums,
    r_row_vars,
    r_sum,
)


# --------------------------------------------------------------------------------------------------------------------
# initial estimates and mu
# --------------------------------------------------------------------------------------------------------------------
def rough_moments_init(
    bk: Backend, y: Any, sf: Any, x: Any, *, min_disp: float, max_disp: float, xim: float | None = None
) -> Any:
    """R: min(rough (linear-model) estimate, moments estimate), clipped to [min_disp, max_disp].

    ``xim``: R's mean of 1 / size factors; with normalisation factors ((G, n) ``sf``) R's
    ``mean(1 / colMeans(normalizationFactors))`` over all genes with a count, which the caller passes (a block of
    genes cannot form it).
    """
    xp = bk.xp
    n, p = x.shape
    norm = y / per_gene(sf)
    # R's roughDispEstimate: rowSums(((y - mu)^2 - mu) / mu^2) / (m - p) around the linear-model means (at least 1)
    fitted = xp.maximum(linear_model_fit(bk, norm, x), 1.0)
    rough = xp.maximum(r_row_sums(bk, ((norm - fitted) ** 2 - fitted) / fitted**2) / (n - p), 0.0)
    # R's momentsDispEstimate: (baseVar - xim baseMean) / baseMean^2, baseMean by rowMeans, baseVar by rowVars
    bm = r_row_sums(bk, norm, mean=True)
    bv = r_row_vars(xp, norm)
    if xim is None:
        xim = r_mean(bk, 1.0 / sf) if sf.ndim == 1 else r_mean(bk, 1.0 / r_col_means(bk, sf))
    with np.errstate(divide="ignore", invalid="ignore"):
        mom = (bv - xim * bm) / bm**2
    mom = xp.where(xp.isfinite(mom), mom, 0.0)
    return xp.clip(xp.minimum(rough, mom), min_disp, max_disp)


def linear_mu(bk: Backend, y: Any, sf: Any, x: Any) -> Any:
    """Least-squares fit of normalised counts on the design, times size factors (R ``linearModelMuNormalized``)."""
    return linear_model_fit(bk, y / per_gene(sf), x) * per_gene(sf)


def uses_linear_mu(x: np.ndarray) -> bool:
    """R uses the linear-model mu when the number of distinct design rows equals the number of columns."""
    return np.unique(np.asarray(x), axis=0).shape[0] == x.shape[1]


def dispersion_mu(bk: Backend, y: Any, sf: Any, x: Any, alpha0: Any, *, min_mu: float = 0.5) -> Any:
    """The mu used for dispersion fitting, floored at min_mu on both paths (as R)."""
    xp = bk.xp
    if uses_linear_mu(np.asarray(bk.to_host(x))):
        mu = linear_mu(bk, y, sf, x)
    else:
        mu = fit_nb_glm(bk, y, sf, x, alpha0, min_mu=min_mu).mu
    return xp.maximum(mu, min_mu)


# --------------------------------------------------------------------------------------------------------------------
# the 1-D log-posterior in log(alpha)
# --------------------------------------------------------------------------------------------------------------------


def _chebyshev(xp: Any, t: Any, coefs: np.ndarray, n: int) -> Any:
    """R's ``chebyshev_eval`` elementwise (as :func:`gpuc.deseq._fitdisp.r_chebyshev`)."""
    twox = t * 2.0
    b0 = xp.zeros_like(t)
    b1 = b0
    b2 = b0
    for i in range(1, n + 1):
        b2 = b1
        b1 = b0
        b0 = twox * b1 - b2 + float(coefs[n - i])
    return (b0 - b2) * 0.5


def _psi(xp: Any, x: Any) -> Any:
    """R's ``digamma`` for x > 0 elementwise, step for step as :func:`gpuc.deseq._fitdisp.r_digamma_log`."""
    from gpuc.deseq._fitdisp import BVALUES, PSI_LRG, PSI_WDTOL

    lx = xp.log(x)
    nx = xp.where(x < 9.0, 9.0 - xp.floor(x), 0.0)
    xd = x + nx
    xdl = xp.where(nx > 0, xp.log(xd), lx)
    tt = 0.5 / xd
    tst = PSI_WDTOL * tt
    rxsq = 1.0 / (xd * xd)
    t = 0.5 * rxsq
    s = t * float(BVALUES[0])
    active = xp.abs(s) >= tst
    tk = 2.0
    for k in range(4, 23):
        t = xp.where(active, t * ((tk + 1.0) / (tk + 1.0)) * (tk / (tk + 2.0)) * rxsq, t)
        trm = t * float(BVALUES[k - 3])
        active = active & ~(xp.abs(trm) < tst)
        s = xp.where(active, s + trm, s)
        tk += 2.0
    s = s + tt
    for i in range(1, 10):
        on = nx >= i
        s = xp.where(on, s + 1.0 / xp.where(on, x + (nx - i), 1.0), s)
    return xp.where(x * lx > PSI_LRG, lx, -(s - xdl))


@dataclass
class DispFit:
    """Result of :func:`fit_log_alpha`."""

    alpha: Any
    iters: Any
    converged: Any
    state: tuple | None = None  # (log alpha, proposals, initial lp, last lp) of R's line search, before R's rules


def fit_log_alpha(bk: Backend, y: Any, mu: Any, x: Any, alpha0: Any, **kwargs: Any) -> DispFit:
    """R's dispersion search (see :func:`_fit_log_alpha`); on the CPU large problems run in gene blocks."""
    from gpuc.deseq._threads import in_gene_blocks

    kwargs.pop("init_state", None)  # accepted for callers of the former Newton solver; R starts from alpha0 only
    pm = kwargs.pop("prior_mean", None)
    xp = bk.xp

    def fit(s: slice | None) -> DispFit:
        if s is None:
            return _fit_log_alpha(bk, y, mu, x, alpha0, prior_mean=pm, **kwargs)
        return _fit_log_alpha(bk, y[s], mu[s], x, alpha0[s], prior_mean=None if pm is None else pm[s], **kwargs)

    def join(parts: list[DispFit]) -> DispFit:
        state = tuple(xp.concatenate([q.state[i] for q in parts]) for i in range(4))
        cat = [xp.concatenate([getattr(q, f) for q in parts]) for f in ("alpha", "iters", "converged")]
        return DispFit(*cat, state)

    return in_gene_blocks(bk, y.shape, fit, join)


def _fit_log_alpha(
    bk: Backend,
    y: Any,
    mu: Any,
    x: Any,
    alpha0: Any,
    *,
    min_disp: float,
    max_disp: float,
    prior_mean: Any = None,
    prior_var: float | None = None,
    cr: bool = True,
    maxit: int = 100,
    tol: float = 1e-6,
    kappa_0: float = 1.0,
    r_flat_start: bool = True,
) -> DispFit:
    """R DESeq2's dispersion estimate for all genes: ``fitDisp`` from ``alpha0`` then R's rules.

    Without a prior this is ``estimateDispersionsGeneEst`` after its starting values (``niter = 1``): the line
    search (:mod:`gpuc.deseq._fitdisp`) bounded below by log(min_disp / 10); its estimate capped at ``max_disp``;
    genes whose log posterior rose by less than a millionth of its start value keep ``alpha0`` ("noIncrease"); genes
    that made ``maxit`` proposals or stopped after one, with an estimate above 10 ``min_disp``, take R's grid search
    (``fitDispGrid``, no prior) instead; finally clipped to [min_disp, max_disp]. With ``prior_mean`` (log trend
    values) and ``prior_var`` it is ``estimateDispersionsMAP``'s fit: the same search with the log-normal prior,
    genes that made ``maxit`` proposals take the grid search with the prior, clipped to [min_disp, max_disp].

    R's search can stop short of the optimum (its tolerance is on the log posterior, 1e-6, and a search that makes
    little progress in its first step stops there); gpuc returns R's estimate, not the optimum. ``r_flat_start`` is
    accepted for compatibility and has no effect (R's rules always apply).
    """
    from gpuc.deseq._fitdisp import grid_bounds

    del r_flat_start
    xp = bk.xp
    n = y.shape[1]
    use_prior = prior_mean is not None
    la0 = xp.log(alpha0)
    pv = float(prior_var) if use_prior else 1.0
    pm = prior_mean
    search = FitDispArgs(pv, use_prior, math.log(min_disp / 10.0), float(kappa_0), float(tol), int(maxit), bool(cr))
    la, it, lp0, lp1 = _fitdisp(bk, la0, y, mu, x, pm, search)
    if use_prior:
        est = xp.exp(la)
        conv = it < maxit
        refit = ~conv
    else:
        est = xp.minimum(xp.exp(la), max_disp)
        no_increase = lp1 < lp0 + xp.abs(lp0) / 1e6
        est = xp.where(no_increase, alpha0, est)
        conv = (it < maxit) & (it != 1)
        refit = ~conv & (est > min_disp * 10.0)
    if bool(refit.any()):
        gi = xp.nonzero(refit)[0]
        lo, hi = grid_bounds(n)
        est[gi] = xp.exp(
            _fitdisp_grid(bk, y[gi], mu[gi], x, None if pm is None else pm[gi], pv, use_prior, cr, lo, hi, 20)
        )
    alpha = xp.clip(est, min_disp, max_disp)
    return DispFit(alpha, it, conv, (la, it.astype(xp.float64), lp0, lp1))


class FitDispArgs(NamedTuple):
    """The settings of R's ``fitDisp`` shared by every gene, in the order the kernels take them after the prior means
    (:func:`gpuc.deseq._fitdisp.fit_disp_cpu`, ``gpuc.deseq._kernels_gpu.fit_disp``).
    """

    pv: float  # prior variance (1.0 without a prior)
    use_prior: bool
    min_log_alpha: float  # the search stops after an accepted step below it
    kappa_0: float
    tol: float
    maxit: int
    cr: bool  # the Cox-Reid term


def _fitdisp(bk: Backend, la0: Any, y: Any, mu: Any, x: Any, pm: Any, s: FitDispArgs) -> tuple[Any, Any, Any, Any]:
    """R's ``fitDisp`` for every gene: (log alpha, proposals made, initial and last log posterior). On the CPU the
    compiled loop (:func:`gpuc.deseq._fitdisp.fit_disp_cpu`), on the GPU one kernel launch, else array code.
    """
    from gpuc.deseq._kernels import fitdisp_kernel, gpu_kernels

    xp = bk.xp
    G = y.shape[0]
    f64 = xp.float64
    pm_arr = xp.ascontiguousarray(pm, dtype=f64) if s.use_prior else xp.zeros(1)
    kern = None if bk.is_gpu else fitdisp_kernel()
    if kern is not None:
        out = np.empty((4, G))
        kern(
            np.ascontiguousarray(la0, dtype=f64), np.ascontiguousarray(y, dtype=f64),
            np.ascontiguousarray(mu, dtype=f64), np.ascontiguousarray(x, dtype=f64), pm_arr, *s, out,
        )  # fmt: skip
        return out[0], out[1].astype(np.int64), out[2], out[3]
    gk = gpu_kernels(bk, x.shape[1], y.shape[0] * y.shape[1])
    if gk is not None:
        out = xp.empty((4, G))
        bk.launch(
            gk.fit_disp,
            gk.blocks_for(G),
            gk.THREADS,
            xp.ascontiguousarray(la0, dtype=f64),
            xp.ascontiguousarray(y.T, dtype=f64).reshape(-1),
            xp.ascontiguousarray(mu.T, dtype=f64).reshape(-1),
            xp.ascontiguousarray(x, dtype=f64).reshape(-1),
            int(x.shape[1]),
            pm_arr,
            *s,
            out,
        )
        return out[0], out[1].astype(xp.int64), out[2], out[3]
    return _fitdisp_array(bk, la0, y, mu, x, pm, s)


def _fitdisp_grid(
    bk: Backend,
    y: Any,
    mu: Any,
    x: Any,
    pm: Any,
    pv: float,
    use_prior: bool,
    cr: bool,
    lo: float,
    hi: float,
    ngrid: int,
) -> Any:
    """R's ``fitDispGrid`` for every gene (log alpha); compiled on the CPU, one launch on the GPU, else array code."""
    from gpuc.deseq._kernels import fitdisp_grid_kernel, gpu_kernels

    xp = bk.xp
    G = y.shape[0]
    f64 = xp.float64
    pm_arr = xp.ascontiguousarray(pm, dtype=f64) if use_prior else xp.zeros(1)
    kern = None if bk.is_gpu else fitdisp_grid_kernel()
    if kern is not None:
        out = np.empty(G)
        kern(
            np.ascontiguousarray(y, dtype=f64), np.ascontiguousarray(mu, dtype=f64),
            np.ascontiguousarray(x, dtype=f64), pm_arr, pv, use_prior, cr, lo, hi, ngrid, out,
        )  # fmt: skip
        return out
    gk = gpu_kernels(bk, x.shape[1], y.shape[0] * y.shape[1])
    if gk is not None:
        out = xp.empty(G)
        bk.launch(
            gk.fit_disp_grid,
            gk.blocks_for(G),
            gk.THREADS,
            xp.ascontiguousarray(y.T, dtype=f64).reshape(-1),
            xp.ascontiguousarray(mu.T, dtype=f64).reshape(-1),
            xp.ascontiguousarray(x, dtype=f64).reshape(-1),
            int(x.shape[1]),
            pm_arr,
            float(pv),
            bool(use_prior),
            bool(cr),
            float(lo),
            float(hi),
            int(ngrid),
            out,
        )
        return out
    xh = np.asarray(bk.to_host(x), dtype=np.float64)
    kw = {"pm": pm, "pv": pv, "use_prior": use_prior, "cr": cr}
    delta = (hi - lo) / (ngrid - 1)
    pts = [lo] + [lo + t * delta for t in range(1, ngrid - 1)] + [hi]
    vals = xp.stack([_r_logpost(bk, xp.full(G, g), y, mu, xh, **kw) for g in pts], axis=1)
    a_hat = xp.asarray(np.asarray(pts))[_first_argmax(xp, vals)]
    d1 = (lo + delta) - lo
    start, end = a_hat - d1, a_hat + d1
    step = (end - start) / (ngrid - 1)
    fine = [start + t * step for t in range(ngrid - 1)] + [end]
    vals = xp.stack([_r_logpost(bk, g, y, mu, xh, **kw) for g in fine], axis=1)
    return xp.stack(fine, axis=1)[xp.arange(G), _first_argmax(xp, vals)]


def _first_argmax(xp: Any, v: Any) -> Any:
    """Index of the first maximum per row, NaN never winning (R's grid keeps the first best value)."""
    return xp.argmax(xp.where(xp.isnan(v), -xp.inf, v), axis=1)


def _r_lgamma(bk: Backend, x: Any) -> Any:
    """R's ``lgammafn`` for x > 0 elementwise, branch for branch as :func:`gpuc.deseq._fitdisp.r_lgamma`."""
    from gpuc.deseq._fitdisp import ALGMCS, GAMCS, LGAMMACOR_XBIG, LN_SQRT_2PI

    xp = bk.xp
    xs = xp.where(x > 10.0, x, 11.0)
    lx = xp.log(xs)
    base = LN_SQRT_2PI + (xs - 0.5) * lx - xs
    tmp = 10.0 / xs
    corr = xp.where(xs < LGAMMACOR_XBIG, _chebyshev(xp, tmp * tmp * 2.0 - 1.0, ALGMCS, 5) / xs, 1.0 / (xs * 12.0))
    out = xp.where(xs > 4934720.0, base, base + corr)
    out = xp.where(xs > 1e17, xs * (lx - 1.0), out)
    small = x <= 10.0
    if bool(small.any()):
        xv = xp.where(small, x, 1.5)
        n = xp.floor(xv)
        y = xv - n
        value = _chebyshev(xp, y * 2.0 - 1.0, GAMCS, 22) + 0.9375
        value = xp.where(n < 1.0, value / xv, value)
        for i in range(1, 10):
            value = xp.where(n - 1.0 >= i, value * (y + i), value)
        lg = xp.where(xv < 1e-306, -xp.log(xv), xp.log(xp.abs(value)))
        out = xp.where(small, lg, out)
    return out


def _cr_matrix(xp: Any, wts: Any, x: np.ndarray) -> Any:
    """R's ``x' (x .* w)`` per gene ((G, p, p) from the (G, n) weights): entry (r, c) sums x_jr (x_jc w_j) over the
    samples in order (as :func:`gpuc.deseq._fitdisp.cr_matrices`).
    """
    n, p = x.shape
    b = xp.zeros((wts.shape[0], p, p))
    for j in range(n):
        xj = xp.asarray(x[j])
        b = b + xj[None, :, None] * (xj[None, None, :] * wts[:, j, None, None])
    return b


def _det_lu(xp: Any, a: Any) -> Any:
    """:func:`gpuc.deseq._fitdisp.det_lu` for a stack of matrices (G, p, p)."""
    a = a.copy()
    G, p, _ = a.shape
    rows = xp.arange(G)
    sign = xp.ones(G)
    for k in range(p):
        piv = k + xp.argmax(xp.abs(a[:, k:, k]), axis=1)
        swap = piv != k
        sign = xp.where(swap, -sign, sign)
        rk = a[rows, k].copy()
        a[rows, k] = a[rows, piv]
        a[rows, piv] = rk
        d = a[:, k, k]
        nz = d != 0.0
        rd = 1.0 / xp.where(nz, d, 1.0)
        big = (xp.abs(d) >= 2.2250738585072014e-308)[:, None]
        col = a[:, k + 1 :, k]
        scaled = xp.where(big, col * rd[:, None], col / xp.where(nz, d, 1.0)[:, None])
        a[:, k + 1 :, k] = xp.where(nz[:, None], scaled, col)
        a[:, k + 1 :, k + 1 :] = a[:, k + 1 :, k + 1 :] + (-a[:, k, None, k + 1 :]) * a[:, k + 1 :, k, None]
    val = a[:, 0, 0]
    for i in range(1, p):
        val = val * a[:, i, i]
    return xp.where(sign > 0, val, -val)


def _det_r(xp: Any, b: Any) -> Any:
    """Armadillo's ``det`` for a stack of matrices (G, p, p), as :func:`gpuc.deseq._fitdisp.det_r`."""
    from gpuc.deseq._fitdisp import DET_EPS

    p = b.shape[1]
    if p == 1:
        return b[:, 0, 0]
    if p > 4:
        return _det_lu(xp, b)
    e = b.reshape(b.shape[0], p * p)
    if p == 2:
        v = e[:, 0] * e[:, 3] - e[:, 2] * e[:, 1]
    elif p == 3:
        v = (
            e[:, 0] * (e[:, 8] * e[:, 4] - e[:, 7] * e[:, 5])
            - e[:, 3] * (e[:, 8] * e[:, 1] - e[:, 7] * e[:, 2])
            + e[:, 6] * (e[:, 5] * e[:, 1] - e[:, 4] * e[:, 2])
        )
    else:
        v = _det_4x4(e)
    ok = (xp.abs(v) > DET_EPS) & (xp.abs(v) < 1.0 / DET_EPS)
    if bool(ok.all()):
        return v
    tri_upper = xp.all(xp.tril(b, -1).reshape(b.shape[0], -1) == 0.0, axis=1)
    tri_lower = xp.all(xp.triu(b, 1).reshape(b.shape[0], -1) == 0.0, axis=1)
    diag = b[:, 0, 0]
    for i in range(1, p):
        diag = diag * b[:, i, i]
    other = xp.where(tri_upper | tri_lower, diag, _det_lu(xp, b))
    return xp.where(ok, v, other)


def _det_4x4(e: Any) -> Any:
    """:func:`gpuc.deseq._fitdisp.det_4x4` on the rows of ``e`` (G, 16)."""
    from gpuc.deseq._fitdisp import det_4x4

    return det_4x4([e[:, k] for k in range(16)])


def _c_pow(xp: Any, v: Any, e: float) -> Any:
    """``v ** e`` from the C library's ``pow``, as R's ``pow(v, -1)`` (NumPy and LLVM replace a scalar exponent of
    -1 by a division, which differs in the last bit for about 1 value in 1,000; an array of exponents they leave).
    """
    return xp.power(v, xp.full_like(v, e))


def _r_logpost(
    bk: Backend, la: Any, y: Any, mu: Any, x: np.ndarray, *, pm: Any, pv: float, use_prior: bool, cr: bool
) -> Any:
    """R's ``log_posterior`` for every gene at log alphas ``la`` (array code, as :mod:`gpuc.deseq._fitdisp`)."""
    xp = bk.xp
    alpha = xp.exp(la)
    a = alpha[:, None]
    crt = 0.0
    if cr:
        det = _det_r(xp, _cr_matrix(xp, 1.0 / (1.0 / mu + a), x))  # the compiler's 1/x for R's pow(x, -1) here
        crt = -0.5 * xp.where(det > 0, xp.log(xp.where(det > 0, det, 1.0)), xp.where(det == 0, -xp.inf, xp.nan))
    r = 1.0 / alpha
    rc = r[:, None]
    lgr = _r_lgamma(bk, r)[:, None]
    terms = _r_lgamma(bk, y + rc) - lgr - y * xp.log(mu + rc) - rc * xp.log(1.0 + mu * a)
    ll = xp.zeros(y.shape[0])
    for j in range(y.shape[1]):  # R's sum: in sample order
        ll = ll + terms[:, j]
    prior = 0.0
    if use_prior:
        d = la - pm
        prior = -0.5 * (d * d) / pv
    return ll + prior + crt


def _cr_derivative(xp: Any, b: Any, db: Any) -> Any:
    """:func:`gpuc.deseq._fitdisp.cr_derivative` for stacks of matrices (G, p, p)."""
    from gpuc.deseq._fitdisp import DET_EPS

    p = b.shape[1]
    if p == 1:
        det = b[:, 0, 0]
        return (-0.5 * (det * ((1.0 / det) * db[:, 0, 0] + 0.0))) / det

    def fallback() -> Any:  # the solve, for designs and matrices Armadillo hands to LAPACK
        return -0.5 * xp.trace(xp.linalg.solve(b, db), axis1=1, axis2=2)

    if p != 2:
        return fallback()
    a00, a01, a10, a11 = b[:, 0, 0], b[:, 0, 1], b[:, 1, 0], b[:, 1, 1]
    dv = a00 * a11 - a01 * a10
    ok = (xp.abs(dv) >= DET_EPS) & (xp.abs(dv) <= 1.0 / DET_EPS)
    acc1 = 0.0 + (a11 / dv) * db[:, 0, 0]
    acc2 = 0.0 + (-a01 / dv) * db[:, 1, 0]
    acc1 = acc1 + (-a10 / dv) * db[:, 0, 1]
    acc2 = acc2 + (a00 / dv) * db[:, 1, 1]
    det = _det_r(xp, b)
    closed = (-0.5 * (det * (acc1 + acc2))) / det
    return closed if bool(ok.all()) else xp.where(ok, closed, fallback())


def _r_dlogpost(
    bk: Backend, la: Any, y: Any, mu: Any, x: np.ndarray, *, pm: Any, pv: float, use_prior: bool, cr: bool
) -> Any:
    """R's ``dlog_posterior`` for every gene at log alphas ``la`` (array code, as :mod:`gpuc.deseq._fitdisp`)."""
    xp = bk.xp
    alpha = xp.exp(la)
    a = alpha[:, None]
    crt = 0.0
    if cr:
        v = 1.0 / mu + a
        b = _cr_matrix(xp, 1.0 / v, x)
        db = _cr_matrix(xp, -1.0 * _c_pow(xp, v, -2.0), x)
        crt = _cr_derivative(xp, b, db)
    r = 1.0 / alpha
    r2 = 1.0 / (alpha * alpha)
    rc = r[:, None]
    ma = mu * a
    u = 1.0 + ma
    terms = (
        _psi(xp, r)[:, None] + xp.log(u) - ma * _c_pow(xp, u, -1.0) - _psi(xp, y + rc) + y * _c_pow(xp, mu + rc, -1.0)
    )
    s = xp.zeros(y.shape[0])
    for j in range(y.shape[1]):
        s = s + terms[:, j]
    prior = 0.0
    if use_prior:
        prior = -1.0 * (la - pm) / pv
    return (r2 * s + crt) * alpha + prior


def _fitdisp_array(
    bk: Backend, la0: Any, y: Any, mu: Any, x: Any, pm: Any, s: FitDispArgs
) -> tuple[Any, Any, Any, Any]:
    """:func:`_fitdisp` in array code: R's line search for all genes at once, a step of every active gene per pass."""
    from gpuc.deseq._fitdisp import ARMIJO

    pv, use_prior, min_log_alpha, kappa_0, tol, maxit, cr = s
    xp = bk.xp
    G = y.shape[0]
    xh = np.asarray(bk.to_host(x), dtype=np.float64)

    def kw(i: Any) -> dict:
        return {"pm": None if not use_prior else pm[i], "pv": pv, "use_prior": use_prior, "cr": cr}

    a = xp.array(la0, dtype=xp.float64)
    lp = _r_logpost(bk, a, y, mu, xh, **kw(slice(None)))
    dlp = _r_dlogpost(bk, a, y, mu, xh, **kw(slice(None)))
    lp0 = lp.copy()
    kappa = xp.full(G, float(kappa_0))
    it = xp.zeros(G, dtype=xp.int64)
    acc = xp.zeros(G, dtype=xp.int64)
    idx = xp.arange(G)
    for _ in range(maxit):
        if idx.shape[0] == 0:
            break
        it[idx] += 1
        ai, di, ki, lpi = a[idx], dlp[idx], kappa[idx], lp[idx]
        prop = ai + ki * di
        ki = xp.where(prop < -30.0, (-30.0 - ai) / di, ki)
        ki = xp.where(prop > 10.0, (10.0 - ai) / di, ki)
        cand = ai + ki * di
        theta = -1.0 * _r_logpost(bk, cand, y[idx], mu[idx], xh, **kw(idx))
        ok = theta <= -1.0 * lpi - ki * ARMIJO * (di * di)
        lpnew = -theta
        change = lpnew - lpi
        stop_tol = ok & (change < tol)
        stop_low = ok & ~stop_tol & (cand < min_log_alpha)
        cont = ok & ~stop_tol & ~stop_low
        a[idx] = xp.where(ok, cand, ai)
        lp[idx] = xp.where(stop_tol | cont, lpnew, lpi)
        acc_i = acc[idx] + ok
        acc[idx] = acc_i
        kn = xp.where(ok, xp.minimum(ki * 1.1, kappa_0), ki / 2.0)
        kn = xp.where(cont & (acc_i % 5 == 0), kn / 2.0, kn)
        kappa[idx] = kn
        ci = idx[cont]
        if ci.shape[0]:
            dlp[ci] = _r_dlogpost(bk, a[ci], y[ci], mu[ci], xh, **kw(ci))
        idx = idx[~(stop_tol | stop_low)]
    return a, it, lp0, lp


# --------------------------------------------------------------------------------------------------------------------
# trend (host: a 2-parameter problem)
# --------------------------------------------------------------------------------------------------------------------
class TrendFitError(RuntimeError):
    """The parametric dispersion trend did not converge or gave a non-positive coefficient."""


@dataclass
class DispersionFunction:
    """The fitted dispersion trend as a function of the mean of normalised counts."""

    kind: str  # "parametric" | "local" | "mean"
    coefs: tuple[float, float] | None = None
    mean: float | None = None
    grid_logmean: np.ndarray | None = None
    grid_logdisp: np.ndarray | None = None
    min_disp: float = 1e-8
    grid_slope: np.ndarray | None = None  # local: locfit's derivative at each vertex (cubic Hermite interpolation)
    grid_curvature: float = 0.0  # local: locfit's parametric component's quadratic coefficient (extrapolation)

    def __call__(self, means: np.ndarray) -> np.ndarray:
        """Evaluate the trend at ``means`` (host numpy)."""
        means = np.asarray(means, dtype=np.float64)
        if self.kind == "parametric":
            a0, a1 = self.coefs  # type: ignore[misc]
            with np.errstate(divide="ignore"):
                return a0 + a1 / means
        if self.kind == "mean":
            return np.full(means.shape, float(self.mean))  # type: ignore[arg-type]
        with np.errstate(divide="ignore"):
            lm = np.log(means)
        if self.grid_slope is None:  # a constant (no gene-wise estimate above 10 min_disp: R's minDisp)
            return np.exp(np.interp(lm, self.grid_logmean, self.grid_logdisp))  # type: ignore[arg-type]
        return np.exp(locfit_predict(self.grid_logmean, self.grid_logdisp, self.grid_slope, lm, self.grid_curvature))

    @classmethod
    def from_dict(cls, d: dict) -> DispersionFunction:
        """The trend described by :meth:`to_dict` (e.g. read back from ``uns``)."""
        return cls(
            d["type"],
            coefs=(float(d["asymptDisp"]), float(d["extraPois"])) if "asymptDisp" in d else None,
            mean=float(d["mean"]) if "mean" in d else None,
            grid_logmean=np.asarray(d["grid_logmean"]) if "grid_logmean" in d else None,
            grid_logdisp=np.asarray(d["grid_logdisp"]) if "grid_logdisp" in d else None,
            grid_slope=np.asarray(d["grid_slope"]) if "grid_slope" in d else None,
            grid_curvature=float(d.get("grid_curvature", 0.0)),
        )

    def to_dict(self) -> dict:
        """Plain-Python description for ``uns``."""
        d: dict = {"type": self.kind}
        if self.coefs is not None:
            d["asymptDisp"], d["extraPois"] = float(self.coefs[0]), float(self.coefs[1])
        if self.mean is not None:
            d["mean"] = float(self.mean)
        if self.grid_logmean is not None:
            d["grid_logmean"] = np.asarray(self.grid_logmean)
            d["grid_logdisp"] = np.asarray(self.grid_logdisp)
        if self.grid_slope is not None:
            d["grid_slope"] = np.asarray(self.grid_slope)
            d["grid_curvature"] = float(self.grid_curvature)
        return d


def _gamma_identity_glm(
    y: np.ndarray, xcol: np.ndarray, start: np.ndarray, *, maxit: int = 25, eps: float = 1e-8
) -> tuple[np.ndarray, bool]:
    """R's ``glm(y ~ xcol, family = Gamma("identity"), start = start)`` (``glm.fit``), operation for operation.

    Each IRLS step: working response ``z = eta + (y - mu)``, weights ``w = sqrt(1 / mu^2)``, the least-squares
    coefficients of ``z w`` on ``X w`` by LINPACK (:func:`gpuc.deseq._rlinalg.least_squares_coef`, tolerance 1e-11),
    ``eta = X b`` as reference BLAS ``dgemv`` forms it, the deviance ``sum(-2 (log(y / mu) - (y - mu) / mu))`` as
    R's ``sum``; a step that leaves mu > 0 is halved towards the previous coefficients; convergence when the
    deviance changes by less than ``eps`` relative (``abs(dev - devold) / (abs(dev) + 0.1)``).
    """
    x1 = np.ones_like(xcol)
    design_t = np.vstack([x1, xcol])

    def linear_predictor(b: np.ndarray) -> np.ndarray:
        return ordered_matmul(np, b[None, :], design_t)[0]  # dgemv: y = 0, then y += b_j x_j column by column

    def deviance(mu: np.ndarray) -> float:
        return r_sum(-2.0 * (np.log(y / mu) - (y - mu) / mu))

    coef = np.asarray(start, dtype=np.float64).copy()
    eta = linear_predictor(coef)
    if not (np.all(np.isfinite(eta)) and np.all(eta > 0)):
        raise TrendFitError("invalid start for the Gamma fit")
    mu = eta
    devold = deviance(mu)
    coefold = coef
    conv = False
    for _ in range(maxit):
        z = eta + (y - mu)
        w = np.sqrt(1.0 / (mu * mu))
        new = least_squares_coef(np.column_stack([x1 * w, xcol * w]), z * w, min(1e-7, eps / 1000.0))
        eta = linear_predictor(new)
        mu = eta
        halvings = 0
        while not (np.all(np.isfinite(mu)) and np.all(mu > 0)):
            if halvings >= maxit:
                raise TrendFitError("Gamma fit left the valid region")
            halvings += 1
            new = (new + coefold) / 2.0
            eta = linear_predictor(new)
            mu = eta
        dev = deviance(mu)
        if abs(dev - devold) / (abs(dev) + 0.1) < eps:
            conv = True
            coef = new
            break
        devold = dev
        coef = coefold = new
    return coef, conv


def parametric_trend(means: np.ndarray, disps: np.ndarray) -> tuple[float, float]:
    """R's ``parametricDispersionFit``: asymptDisp + extraPois / mean by an iterated Gamma-identity GLM."""
    coefs = np.array([0.1, 1.0])
    it = 0
    while True:
        resid = disps / (coefs[0] + coefs[1] / means)
        good = (resid > 1e-4) & (resid < 15)
        if good.sum() < 3:
            raise TrendFitError("too few genes for the parametric dispersion fit")
        new, conv = _gamma_identity_glm(disps[good], 1.0 / means[good], coefs)
        old = coefs
        coefs = new
        if not np.all(coefs > 0):
            raise TrendFitError("parametric dispersion fit failed (non-positive coefficient)")
        if r_sum(np.log(coefs / old) ** 2) < 1e-6 and conv:
            break
        it += 1
        if it > 10:
            raise TrendFitError("dispersion fit did not converge")
    return float(coefs[0]), float(coefs[1])


def local_trend(means: np.ndarray, disps: np.ndarray, *, min_disp: float) -> DispersionFunction:
    """R's ``localDispersionFit``: ``locfit(log(disp) ~ log(mean), weights = mean)`` over the genes with a dispersion
    of at least 10 ``min_disp``, evaluated as locfit evaluates it (:func:`locfit_tree`, :func:`locfit_predict`);
    the trend is ``exp`` of it. Without such genes R's trend is ``min_disp`` everywhere.
    """
    use = disps >= min_disp * 10
    if not use.any():
        return DispersionFunction(
            "local", grid_logmean=np.array([0.0, 1.0]), grid_logdisp=np.log([min_disp, min_disp]), min_disp=min_disp
        )
    x, y, w = np.log(means[use]), np.log(disps[use]), means[use]
    vx, vf, vd = locfit_tree(x, y, w)
    return DispersionFunction(
        "local", grid_logmean=vx, grid_logdisp=vf, grid_slope=vd, grid_curvature=_global_curvature(x, y, w),
        min_disp=min_disp,
    )  # fmt: skip


def _global_curvature(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    """The quadratic coefficient of the weighted least-squares quadratic of ``y`` on ``x``: locfit's "parametric
    component" (a global fit of the local model's degree, which locfit subtracts before interpolating and adds back
    after; inside the data's range it cancels, beyond it the extrapolation bends by it).
    """
    if x.shape[0] < 3:
        return 0.0
    dx = x - np.sum(w * x) / np.sum(w)
    sw = np.sqrt(w)
    coef, *_ = np.linalg.lstsq(np.column_stack([np.ones_like(dx), dx, dx * dx]) * sw[:, None], y * sw, rcond=None)
    return float(coef[2])


def _locfit_vertex(x: np.ndarray, y: np.ndarray, w: np.ndarray, x0: float, k: int) -> tuple[float, float, float]:
    """Locfit's local quadratic fit at ``x0``: the nearest-neighbour bandwidth h (distance to the k-th nearest point),
    tricube weights ``(1 - (|x - x0| / h)^3)^3`` times the prior weights, weighted least squares; returns the fitted
    value, its slope and h.
    """
    d = np.abs(x - x0)
    h = float(np.partition(d, k - 1)[k - 1])
    u = d / h
    kw = np.where(u < 1.0, (1.0 - u**3) ** 3, 0.0) * w
    sel = kw > 0
    dx = x[sel] - x0
    v = np.column_stack([np.ones(dx.shape[0]), dx, dx * dx])
    sw = np.sqrt(kw[sel])
    coef, *_ = np.linalg.lstsq(v * sw[:, None], y[sel] * sw, rcond=None)
    return float(coef[0]), float(coef[1]), h


def locfit_tree(
    x: np.ndarray, y: np.ndarray, w: np.ndarray, *, nn: float = 0.7, cut: float = 0.8
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The vertices of locfit's default fit in one dimension (``locfit(y ~ x, weights = w)``: ``lp`` with nearest
    neighbour fraction 0.7, degree 2, tricube kernel, evaluation structure ``rbox`` tree with ``cut = 0.8``).

    Following the algorithm of locfit (Loader 1999, *Local Regression and Likelihood*, ch. 12; C. Loader's ``locfit``
    R package): the local fit is computed at both ends of the data's range; a cell is halved while its width exceeds
    ``cut`` times the smaller bandwidth of its two ends, and its midpoint is fitted in turn. Returns the sorted
    vertices with the fitted values and slopes there, for :func:`locfit_predict`.
    """
    x = np.asarray(x, dtype=np.float64)
    k = max(1, int(x.shape[0] * nn + 1e-12))
    lo, hi = float(x.min()), float(x.max())
    verts: dict[float, tuple[float, float, float]] = {}
    for v in (lo, hi):
        verts[v] = _locfit_vertex(x, y, w, v, k)

    stack = [(lo, hi)]
    while stack:  # the cells still to examine (a 1-D tree of at most a few dozen cells)
        a, b = stack.pop()
        ha, hb = verts[a][2], verts[b][2]
        hs = [h for h in (ha, hb) if h > 0]
        hmin = min(hs) if hs else 0.0
        score = 2.0 if hmin == 0 else (b - a) / hmin
        if not cut < score:
            continue
        m = (b + a) / 2.0
        if m not in verts:
            verts[m] = _locfit_vertex(x, y, w, m, k)
        stack += [(m, b), (a, m)]
    vx = np.array(sorted(verts))
    return vx, np.array([verts[v][0] for v in vx]), np.array([verts[v][1] for v in vx])


def locfit_predict(
    vx: np.ndarray, vf: np.ndarray, vd: np.ndarray, at: np.ndarray, curvature: float = 0.0
) -> np.ndarray:
    """Locfit's interpolation between the tree's vertices (``predict.locfit``): cubic Hermite from the values and
    slopes at a cell's two ends; beyond the data's range, linear with the end slope plus ``curvature`` times the
    squared distance from the end (locfit extrapolates the vertex values less its parametric component linearly,
    then adds that quadratic back; see :func:`_global_curvature`).
    """
    at = np.asarray(at, dtype=np.float64)
    i = np.clip(np.searchsorted(vx, at, side="right") - 1, 0, vx.shape[0] - 2)
    ll, ur = vx[i], vx[i + 1]
    width = ur - ll
    t = (at - ll) / width
    p1 = t * t * (3.0 - 2.0 * t)
    p0 = 1.0 - p1
    p2 = t * (1.0 - t) * (1.0 - t)
    p3 = t * t * (t - 1.0)
    below, above = t < 0, t > 1
    p0, p1 = np.where(below, 1.0, np.where(above, 0.0, p0)), np.where(below, 0.0, np.where(above, 1.0, p1))
    p2, p3 = np.where(below, t, np.where(above, 0.0, p2)), np.where(below, 0.0, np.where(above, t - 1.0, p3))
    p2, p3 = p2 * width, p3 * width
    out = p0 * vf[i] + p1 * vf[i + 1] + p2 * vd[i] + p3 * vd[i + 1]
    beyond = np.where(below, at - ll, np.where(above, at - ur, 0.0))
    out = out + curvature * (beyond * beyond)
    return np.where(np.isfinite(at), out, np.nan)


def _trimmed_mean(v: np.ndarray, trim: float) -> float:
    """R's ``mean(v, trim = trim)``: the ``floor(n trim)`` smallest and largest values dropped, then R's ``mean``."""
    from gpuc._backend import get_backend

    n = v.shape[0]
    lo = math.floor(n * trim)
    kept = np.sort(v)[lo : n - lo]
    return r_mean(get_backend("cpu"), kept)


def fit_trend(
    means: np.ndarray, genewise: np.ndarray, *, fit_type: str, min_disp: float
) -> tuple[DispersionFunction, str | None]:
    """R's ``estimateDispersionsFit``: returns the dispersion function and a warning message if it fell back."""
    if fit_type == "mean":
        trimmed = _trimmed_mean(genewise[genewise > 10 * min_disp], 0.001)
        return DispersionFunction("mean", mean=trimmed, min_disp=min_disp), None
    # R fits the parametric and the local trend to the genes with an estimate above 100 minDisp (the local fit then
    # keeps those of at least 10 minDisp, all of them)
    use = genewise > 100 * min_disp
    if fit_type == "local":
        return local_trend(means[use], genewise[use], min_disp=min_disp), None
    if use.sum() == 0:
        msg = "all gene-wise dispersion estimates are within 2 orders of magnitude of the minimum value; the data have no overdispersion to model (consider a different test, e.g. Poisson)."
        raise ValueError(msg)
    try:
        coefs = parametric_trend(means[use], genewise[use])
        return DispersionFunction("parametric", coefs=coefs, min_disp=min_disp), None
    except (TrendFitError, np.linalg.LinAlgError) as err:
        return local_trend(
            means[use], genewise[use], min_disp=min_disp
        ), f"the parametric dispersion fit failed ({err}); using fit_type='local' instead, as R DESeq2 does."


# --------------------------------------------------------------------------------------------------------------------
# prior variance
# --------------------------------------------------------------------------------------------------------------------
def log_residual_variance(genewise: np.ndarray, fitted: np.ndarray, *, min_disp: float) -> tuple[float, np.ndarray]:
    """R's varLogDispEsts: squared MAD of log genewise - log trend over genes with genewise >= 100 min_disp."""
    above = genewise >= min_disp * 100
    resid = np.log(genewise[above]) - np.log(fitted[above])
    mad = 1.4826 * r_median(np.abs(resid - r_median(resid)))  # R's mad
    return float(mad**2), resid


def r_trigamma(x: float) -> float:
    """R's ``trigamma`` for x > 0, step for step (``dpsifn`` with n = 1; Amos 1983, ACM TOMS 9, 494-502): for
    small x with few terms, the direct sum of (x + i)^-2; else the asymptotic series at x shifted above ``xmin``
    (R's Bernoulli numbers and stopping rule), times exp(-log(x)), plus the shifted-off terms pow(x + i, -2) added
    in R's order. The prior variance subtracts it from the residual MAD^2, so its last bits reach every MAP
    estimate (SciPy's polygamma differs in them).
    """
    from gpuc.deseq._fitdisp import BVALUES, PSI_WDTOL

    if not x > 0.0:
        msg = f"trigamma needs a positive argument, got {x}."
        raise ValueError(msg)
    eps = float(np.finfo(np.float64).eps)
    xln = math.log(x)
    if x > 1.0 / (2.0 * eps):
        return math.exp(-xln)
    log10_2 = math.log10(2.0)
    elim = 2.302 * (1021 * log10_2 - 3.0)
    rln = min(log10_2 * 53, 18.06)
    fln = max(rln, 3.0) - 3.0
    yint = 3.50 + 0.40 * fln
    slope = 0.21 + fln * (0.0006038 * fln + 0.008677)
    if abs(2.0 * xln) > elim and xln <= 0.0:
        msg = f"trigamma underflows at {x}."
        raise ValueError(msg)
    if x < PSI_WDTOL:
        return 1.0 / (x * x)
    xmin = float(int(yint + slope) + 1)
    arg = min(0.0, -2.302 * rln - min(0.0, xln))
    e_arg = math.exp(arg)
    nterms = x * (-arg if abs(arg) < 1.0e-3 else 1.0 - e_arg) / e_arg
    if xmin - x > 7.0 and nterms < 15.0:  # few terms: the sum itself
        s = math.exp(-2.0 * xln)
        den = x
        for _ in range(int(nterms) + 1):
            den += 1.0
            s += math.pow(den, -2.0)
        return s
    xdmy, xdmln, xinc = x, xln, 0.0
    if x < xmin:
        xinc = xmin - int(x)
        xdmy = x + xinc
        xdmln = math.log(xdmy)
    tss = math.exp(-xdmln)
    tt = 0.5 / xdmy
    t1 = tt + 1.0
    tst = PSI_WDTOL * tt
    rxsq = 1.0 / (xdmy * xdmy)
    t = 2.0 * (0.5 * rxsq)
    s = t * BVALUES[0]
    if abs(s) >= tst:
        tk = 2.0
        for k in range(4, 23):
            t = t * ((tk + 2.0) / (tk + 1.0)) * ((tk + 1.0) / (tk + 2.0)) * rxsq
            trm = t * BVALUES[k - 3]
            if abs(trm) < tst:
                break
            s += trm
            tk += 2.0
    s = (s + t1) * tss
    if xinc != 0.0:
        xm = xinc - 1.0
        fx = x + xm
        for _ in range(int(xinc)):
            s += math.pow(fx, -2.0)
            xm -= 1.0
            fx = x + xm
    return s


def prior_variance(resid: np.ndarray, var_log_disp: float, n: int, p: int, *, seed: int = 2) -> tuple[float, str]:
    """R's ``estimateDispersionsPriorVar``.

    For n - p > 3: max(varLogDispEsts - trigamma((n-p)/2), 0.25). For 1 <= n - p <= 3, R matches the residual
    histogram to simulated log chi-square + normal noise by KL divergence over a variance grid, after
    ``set.seed(2)``, and takes the minimum of the ``loess``-smoothed curve; done here with R's own random stream,
    histogram, ``sum`` and ``loess`` (:func:`gpuc.deseq._rrandom.simulated_prior_variance`), so the value is R's.
    """
    df = n - p
    if df <= 0:
        msg = f"no residual degrees of freedom (samples={n}, coefficients={p}): dispersions cannot be estimated. Add replicates or simplify the design."
        raise ValueError(msg)
    if df > 3:
        return float(max(var_log_disp - r_trigamma(df / 2.0), 0.25)), "moments"
    from gpuc.deseq._rrandom import simulated_prior_variance  # here: numba compiles it on first use

    return simulated_prior_variance(resid, df, seed=seed), "simulation"
