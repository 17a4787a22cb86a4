"""Dispersion estimation: initial estimates, genewise MLE with Cox-Reid, trend, prior variance, MAP, outliers.

The genewise and MAP problems are 1-D in log(alpha) per gene and are solved for all genes at once by a safeguarded
Newton method (analytic gradient and Hessian of the NB log-likelihood plus the Cox-Reid term, step halving so that
the objective never decreases, bounds as R), with a batched grid search for genes that do not converge. Unlike
R's line search this reaches the optimum; R can stop a few percent short for high-count genes.

The Newton loop and the grid search run per gene in compiled code where they can (numba on the CPU,
``_kernels_cpu``; one numba-cuda launch with a thread per gene on the GPU, ``_kernels_gpu``); the batched array form
(:func:`_newton`, :func:`_logpost`) is the fallback and computes the same log posterior (the kernels' recurrences
and series for the count terms, which do not cancel at small alpha).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.special

from gpuc._backend import Backend
from gpuc.deseq._glm import fit_nb_glm, nb_loglik_sum, normal_matrix, outer_rows, per_gene


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
    fitted = xp.maximum(_project(bk, norm, x), 1.0)
    rough = xp.maximum((((norm - fitted) ** 2 - fitted) / fitted**2).sum(axis=1) / (n - p), 0.0)
    bm = norm.mean(axis=1)
    bv = norm.var(axis=1, ddof=1)
    if xim is None:
        xim = (1.0 / sf).mean() if sf.ndim == 1 else (1.0 / sf.mean(axis=0)).mean()
    with np.errstate(divide="ignore", invalid="ignore"):
        mom = (bv - xim * bm) / bm**2
    mom = xp.where(xp.isfinite(mom), mom, 0.0)
    return xp.clip(xp.minimum(rough, mom), min_disp, max_disp)


def _project(bk: Backend, v: Any, x: Any) -> Any:
    """Least-squares fitted values of each row of ``v`` (genes x samples) on the design: (v pinv(X)^T) X^T."""
    xh = np.asarray(bk.to_host(x))
    pinv = bk.asarray(np.linalg.pinv(xh))
    return (v @ pinv.T) @ bk.asarray(xh).T


def linear_mu(bk: Backend, y: Any, sf: Any, x: Any) -> Any:
    """Least-squares fit of normalised counts on the design, times size factors (R ``linearModelMuNormalized``)."""
    return _project(bk, y / per_gene(sf), x) * per_gene(sf)


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
K_TABLE = 64  # integer counts below this use the recurrences, as the compiled kernels (_kernels_cpu.K)
HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def _psi(xp: Any, x: Any) -> Any:
    """psi(x) for x > 0 as the kernels' ``psi``: the recurrence up to x >= 10, then the asymptotic series."""
    acc = xp.zeros_like(x)
    for _ in range(10):
        m = x < 10.0
        acc = acc - xp.where(m, 1.0 / x, 0.0)
        x = xp.where(m, x + 1.0, x)
    z = 1.0 / (x * x)
    big = (
        xp.log(x)
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
    return acc + big


def _tri(xp: Any, x: Any) -> Any:
    """psi_1(x) for x > 0 as the kernels' ``tri``: the recurrence up to x >= 10, then the asymptotic series."""
    acc = xp.zeros_like(x)
    for _ in range(10):
        m = x < 10.0
        acc = acc + xp.where(m, 1.0 / (x * x), 0.0)
        x = xp.where(m, x + 1.0, x)
    v = 1.0 / x
    z = v * v
    big = v + z * (
        0.5
        + v
        * (1.0 / 6.0 - z * (1.0 / 30.0 - z * (1.0 / 42.0 - z * (1.0 / 30.0 - z * (5.0 / 66.0 - z * (691.0 / 2730.0))))))
    )
    return acc + big


def _nb_count_terms(bk: Backend, y: Any, r: Any, derivs: bool) -> tuple[Any, Any, Any]:
    """Per entry, lgamma(y + r) - lgamma(r) and (with ``derivs``) psi(y + r) - psi(r), psi_1(y + r) - psi_1(r), for
    counts ``y`` (G, n) and r = 1/alpha (G,), computed as the compiled kernels do (``_kernels_cpu.gene_nb_terms``):
    integer counts below :data:`K_TABLE` from per-gene tables of the exact recurrences (sum of log(r + k), 1/(r + k),
    -1/(r + k)^2 over k < y, free of the cancellation of large lgamma values at small alpha), larger ones by the
    asymptotic series, non-integer ones by lgamma and the kernels' psi and psi_1. Zero counts give 0.
    """
    xp, sp = bk.xp, bk.special
    G = y.shape[0]
    q = r[:, None] + xp.arange(K_TABLE - 1, dtype=xp.float64)[None, :]
    zero = xp.zeros((G, 1))
    # tables indexed by the count: entry k holds the sum over the first k terms
    t_lg = xp.concatenate([zero, xp.cumsum(xp.log(q), axis=1)], axis=1)
    small = (y < K_TABLE) & (y == xp.floor(y))
    k = xp.where(small, y, 0.0).astype(xp.int64)
    d_lg = xp.take_along_axis(t_lg, k, axis=1)
    yr = y + r[:, None]
    big = (~small) & (yr >= K_TABLE)
    other = ~small & ~big
    lgr = sp.gammaln(r)[:, None]
    lx = xp.log(yr)
    v = 1.0 / yr
    z = v * v
    stirling = (
        (yr - 0.5) * lx
        - yr
        + HALF_LOG_2PI
        + v * (1.0 / 12.0 - z * (1.0 / 360.0 - z * (1.0 / 1260.0 - z * (1.0 / 1680.0 - z / 1188.0))))
        - lgr
    )
    d_lg = xp.where(big, stirling, d_lg)
    has_other = bool(other.any())
    if has_other:
        d_lg = xp.where(other, sp.gammaln(yr) - lgr, d_lg)
    if not derivs:
        return d_lg, None, None
    iq = 1.0 / q
    t_dg = xp.concatenate([zero, xp.cumsum(iq, axis=1)], axis=1)
    t_tg = xp.concatenate([zero, xp.cumsum(-(iq * iq), axis=1)], axis=1)
    dgr = _psi(xp, r)[:, None]
    tgr = _tri(xp, r)[:, None]
    d_dg = xp.where(
        big,
        (lx - 0.5 * v - z * (1.0 / 12.0 - z * (1.0 / 120.0 - z * (1.0 / 252.0 - z / 240.0)))) - dgr,
        xp.take_along_axis(t_dg, k, axis=1),
    )
    d_tg = xp.where(
        big,
        (v + z * (0.5 + v * (1.0 / 6.0 - z * (1.0 / 30.0 - z * (1.0 / 42.0 - z / 30.0))))) - tgr,
        xp.take_along_axis(t_tg, k, axis=1),
    )
    if has_other:
        d_dg = xp.where(other, _psi(xp, yr) - dgr, d_dg)
        d_tg = xp.where(other, _tri(xp, yr) - tgr, d_tg)
    return d_lg, d_dg, d_tg


def _logpost(
    bk: Backend,
    la: Any,
    y: Any,
    mu: Any,
    xx: Any,
    p: int,
    *,
    cr: bool,
    prior_mean: Any,
    prior_var: float | None,
    derivs: bool,
) -> tuple[Any, Any, Any]:
    """Log posterior (NB log-likelihood + Cox-Reid [+ log-normal prior]) and its first two derivatives in log alpha.

    The NB part drops the alpha-free constants (sum of y log mu and log y!), so values are relative. Per-gene
    terms (digamma, trigamma and lgamma of 1/alpha) are computed once per gene; only terms in y + 1/alpha and
    alpha * mu are elementwise. On the CPU the per-gene sums come from one compiled pass (``_kernels``), elsewhere
    from array code (:func:`_logpost_sums`); both give the same values, finished here the same way.
    """
    xp = bk.xp
    kern = None
    if not bk.is_gpu:
        from gpuc.deseq._kernels import nb_logpost_kernel

        kern = nb_logpost_kernel()
    if kern is not None:
        la, f, ga, ha, m, a2, a3 = _logpost_sums_compiled(kern, la, y, mu, xx, p, cr=cr, derivs=derivs)
    else:
        f, ga, ha, m, a2, a3 = _logpost_sums(bk, la, y, mu, xx, p, cr=cr, derivs=derivs)
    if cr:
        _, logdet = xp.linalg.slogdet(m)
        f = f - 0.5 * logdet
    if prior_mean is not None:
        f = f - (la - prior_mean) ** 2 / (2.0 * prior_var)
    if not derivs:
        return f, None, None
    if cr:
        minv = xp.linalg.inv(m)
        b = minv @ a2
        ga = ga + 0.5 * xp.trace(b, axis1=1, axis2=2)
        ha = ha + 0.5 * ((b * xp.swapaxes(b, 1, 2)).sum(axis=(1, 2)) - 2.0 * (minv * a3).sum(axis=(1, 2)))
    alpha = xp.exp(la)
    g = alpha * ga
    h = alpha * alpha * ha + g
    if prior_mean is not None:
        g = g - (la - prior_mean) / prior_var
        h = h - 1.0 / prior_var
    return f, g, h


def _logpost_sums(bk: Backend, la: Any, y: Any, mu: Any, xx: Any, p: int, *, cr: bool, derivs: bool) -> tuple:
    """The per-gene parts of :func:`_logpost` in array code (any device): the NB log-likelihood ``f`` and, with
    ``derivs``, its derivatives ``ga``, ``ha`` in alpha; with ``cr`` the matrices X' W X (``m``) and, with ``derivs``,
    X' W^2 X and X' W^3 X (``a2``, ``a3``) of the Cox-Reid term. What is not computed is None.
    """
    xp = bk.xp
    alpha = xp.exp(la)
    r1 = 1.0 / alpha  # per gene
    a = alpha[:, None]
    amu = a * mu
    u1 = 1.0 + amu
    inv_one = 1.0 / u1
    l1p = xp.log(u1) + (amu - (u1 - 1.0)) * inv_one  # log1p(alpha mu) as the compiled kernels compute it
    yr = y + r1[:, None]
    sum_y = y.sum(axis=1)
    d_lg, d_dg, d_tg = _nb_count_terms(bk, y, r1, derivs)
    # NB log-likelihood up to alpha-free constants: sum [lgamma(y+r) - lgamma(r)] + log(alpha) sum y - sum (y+r) l1p
    f = d_lg.sum(axis=1) + la * sum_y - (yr * l1p).sum(axis=1)
    w = mu * inv_one if cr or derivs else None
    m = normal_matrix(w, xx, p) if cr else None
    if not derivs:
        return f, None, None, m, None, None
    ym = (y - mu) * inv_one
    base = -d_dg.sum(axis=1) + l1p.sum(axis=1)
    ga = r1 * r1 * base + r1 * ym.sum(axis=1)
    ha = (
        -2.0 * r1 * r1 * r1 * base
        + r1 * r1 * (w.sum(axis=1) + r1 * r1 * d_tg.sum(axis=1))
        - r1 * r1 * (ym * (2.0 - inv_one)).sum(axis=1)
    )
    a2 = a3 = None
    if cr:
        w2 = w * w
        a2 = normal_matrix(w2, xx, p)
        a3 = normal_matrix(w2 * w, xx, p)
    return f, ga, ha, m, a2, a3


def _logpost_sums_compiled(kern: Any, la: Any, y: Any, mu: Any, xx: Any, p: int, *, cr: bool, derivs: bool) -> tuple:
    """:func:`_logpost_sums` on the CPU from one compiled pass (``_kernels``), same values; returns ``la`` as the
    kernel read it (float64, contiguous) first.
    """
    la = np.ascontiguousarray(la, dtype=np.float64)
    G = la.shape[0]
    y = np.ascontiguousarray(y, dtype=np.float64)
    mu = np.ascontiguousarray(mu, dtype=np.float64)
    xx = np.ascontiguousarray(xx, dtype=np.float64)
    f = np.empty(G)
    ga = np.empty(G if derivs else 0)
    ha = np.empty(G if derivs else 0)
    pp = p * p
    m = np.empty((G, pp) if cr else (0, pp))
    a2 = np.empty((G, pp) if cr and derivs else (0, pp))
    a3 = np.empty((G, pp) if cr and derivs else (0, pp))
    kern(la, y, mu, xx, derivs, cr, f, ga, ha, m, a2, a3)
    m, a2, a3 = (v.reshape(G, p, p) if use else None for v, use in ((m, cr), (a2, cr and derivs), (a3, cr and derivs)))
    return la, f, ga, ha, m, a2, a3


@dataclass
class DispFit:
    """Result of :func:`fit_log_alpha`."""

    alpha: Any
    iters: Any
    converged: Any
    state: tuple | None = None  # (log alpha, f, g, h) of the Newton iterate before R's rules, for warm starts


def fit_log_alpha(bk: Backend, y: Any, mu: Any, x: Any, alpha0: Any, **kwargs: Any) -> DispFit:
    """Batched log-alpha solver (see :func:`_fit_log_alpha`); on the CPU large problems run in gene blocks."""
    from gpuc.deseq._threads import gene_blocks, map_blocks

    blocks = gene_blocks(bk, y.shape[0], y.shape[1])
    if blocks is None:
        return _fit_log_alpha(bk, y, mu, x, alpha0, **kwargs)
    pm = kwargs.pop("prior_mean", None)
    st = kwargs.pop("init_state", None)
    parts = map_blocks(
        blocks,
        lambda s: _fit_log_alpha(
            bk,
            y[s],
            mu[s],
            x,
            alpha0[s],
            prior_mean=None if pm is None else pm[s],
            init_state=None if st is None else tuple(v[s] for v in st),
            **kwargs,
        ),
    )
    xp = bk.xp
    state = tuple(xp.concatenate([q.state[i] for q in parts]) for i in range(4))
    return DispFit(
        xp.concatenate([q.alpha for q in parts]),
        xp.concatenate([q.iters for q in parts]),
        xp.concatenate([q.converged for q in parts]),
        state,
    )


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
    tol: float = 1e-8,
    r_flat_start: bool = False,
    init_state: tuple | None = None,
) -> DispFit:
    """Maximise the (Cox-Reid adjusted, optionally log-normal-prior) NB log posterior in log alpha for all genes.

    Bounds: log(min_disp / 10) .. log(max_disp) as R's line search; the result is clipped to [min_disp, max_disp].
    Genes that do not converge within ``maxit`` Newton steps are refitted on a 20+20-point grid of the same
    objective (keeping the prior).

    ``r_flat_start`` applies R's post-processing of the genewise estimate, emulating its line search where that
    changes results: R stops after the first step when it raises the log posterior by less than 1e-6 (flat start,
    typically at the minimum dispersion); an estimate whose log posterior rose by less than a millionth of its
    start value reverts to the start ("noIncrease"); and genes stopped after one step with an estimate above
    10 * min_disp are refitted on R's 20+20-point grid. Elsewhere the exact optimum is kept.
    """
    xp = bk.xp
    p = x.shape[1]
    xx = outer_rows(x)
    lo, hi = math.log(min_disp / 10.0), math.log(max_disp)
    la = xp.clip(xp.log(alpha0), lo, hi)

    def grid(i: Any) -> Any:
        """R's grid search of the genes ``i`` (same objective, prior included), from the minimum dispersion up."""
        pm = None if prior_mean is None else prior_mean[i]
        return _grid_search(
            bk, y[i], mu[i], xx, p, lo=math.log(min_disp), hi=hi, cr=cr, prior_mean=pm, prior_var=prior_var
        )

    problem = NewtonProblem(
        y, mu, xx, p, cr=cr, prior_mean=prior_mean, prior_var=prior_var, lo=lo, hi=hi, maxit=maxit, tol=tol,
        r_flat_start=r_flat_start, init_state=init_state,
    )  # fmt: skip
    from gpuc.deseq._kernels import gpu_kernels, newton_kernel

    kern = None if bk.is_gpu else newton_kernel()
    gk = gpu_kernels(bk, p, y.shape[0] * y.shape[1])
    if kern is not None:
        la, f, g, h, iters, conv, r_state = _newton_compiled(kern, la, problem)
    elif gk is not None:
        la, f, g, h, iters, conv, r_state = _newton_gpu(bk, gk, la, problem)
    else:
        la, f, g, h, iters, conv, r_state = _newton(bk, la, problem)
    state = (la.copy(), f.copy(), g.copy(), h.copy())
    if bool((~conv).any()):
        bad = xp.nonzero(~conv)[0]
        la[bad] = grid(bad)
    if r_state is not None:
        la0, f0, target, f1, stuck = r_state
        f_opt = f  # the log posterior at the current estimate, kept up to date by the Newton loop
        est = xp.where(stuck, target, la)
        last = xp.where(stuck, f1, f_opt)
        # R: noIncrease <- last_lp < initial_lp + abs(initial_lp) / 1e6 (our log posterior is R's: its likelihood
        # also omits log y! and uses y log(mu + 1/alpha))
        no_increase = last - f0 < xp.abs(f0) / 1e6
        est = xp.where(no_increase, la0, est)
        regrid = stuck & (xp.exp(est) > 10 * min_disp)
        if bool(regrid.any()):
            gi = xp.nonzero(regrid)[0]
            est[gi] = grid(gi)
        la = est
    alpha = xp.clip(xp.exp(la), min_disp, max_disp)
    return DispFit(alpha, iters, conv, state)


@dataclass(frozen=True)
class NewtonProblem:
    """The log-alpha problem of every gene that the three Newton solvers (:func:`_newton_compiled` on the CPU,
    :func:`_newton_gpu`, the array code :func:`_newton`) take besides the starting iterate; each solver unpacks it in
    one place (:meth:`fields`) and passes the scalars on to its kernel.

    Attributes
    ----------
    y, mu
        Genes x samples counts and (floored) means of the negative-binomial likelihood.
    xx
        Outer products of the design rows (:func:`gpuc.deseq._glm.outer_rows`), for the Cox-Reid term.
    p
        Design columns.
    cr
        Add the Cox-Reid adjustment (``-0.5 log det(X' W X)``).
    prior_mean, prior_var
        Per-gene mean and the variance of the log-normal prior on alpha (MAP fit); ``None`` for the genewise MLE.
    lo, hi
        Bounds of log alpha.
    maxit, tol
        Newton iterations at most, and the relative change of the log posterior at which a gene has converged.
    r_flat_start
        Also return R's first line-search step quantities (genewise fit, see :func:`_fit_log_alpha`).
    init_state
        ``(log alpha, f, g, h)`` of an earlier fit to warm-start from (MAP after genewise), or ``None``.
    """

    y: Any
    mu: Any
    xx: Any
    p: int
    cr: bool = True
    prior_mean: Any = None
    prior_var: float | None = None
    lo: float = -math.inf
    hi: float = math.inf
    maxit: int = 100
    tol: float = 1e-8
    r_flat_start: bool = False
    init_state: tuple | None = None

    def fields(self) -> tuple:
        """Every field, in the order of the kernels' arguments after the iterate."""
        return (
            self.y, self.mu, self.xx, self.p, self.cr, self.prior_mean, self.prior_var, self.lo, self.hi, self.maxit,
            self.tol, self.r_flat_start, self.init_state,
        )  # fmt: skip


def _newton_compiled(kern: Any, la: np.ndarray, problem: NewtonProblem) -> tuple:
    """:func:`_newton` on the CPU as one compiled loop over the genes (``_kernels_cpu.newton_log_alpha``)."""
    y, mu, xx, p, cr, prior_mean, prior_var, lo, hi, maxit, tol, r_flat_start, init_state = problem.fields()
    G = y.shape[0]
    c = np.ascontiguousarray
    has_prior = prior_mean is not None
    pm = c(prior_mean, dtype=np.float64) if has_prior else np.empty(0)
    st = tuple(c(v, dtype=np.float64) for v in init_state) if init_state is not None else (np.empty(0),) * 4
    out = np.empty((10 if r_flat_start else 6, G))
    la_start = c(la, dtype=np.float64)
    kern(
        la_start,
        c(y, dtype=np.float64),
        c(mu, dtype=np.float64),
        c(xx, dtype=np.float64),
        p,
        cr,
        has_prior,
        pm,
        0.0 if prior_var is None else float(prior_var),
        lo,
        hi,
        maxit,
        tol,
        init_state is not None,
        *st,
        r_flat_start,
        out,
    )
    r_state = None
    if r_flat_start:
        r_state = (la_start, out[9].copy(), out[6].copy(), out[7].copy(), out[8] > 0)
    return out[0].copy(), out[1].copy(), out[2].copy(), out[3].copy(), out[4].astype(np.int64), out[5] > 0, r_state


def _newton_gpu(bk: Backend, gk: Any, la: Any, problem: NewtonProblem) -> tuple:
    """:func:`_newton` on the GPU as one kernel launch, one thread per gene (``_kernels_gpu.newton_log_alpha``, the
    CPU kernel's loop); returns what :func:`_newton` returns, on the device.
    """
    y, mu, xx, p, cr, prior_mean, prior_var, lo, hi, maxit, tol, r_flat_start, init_state = problem.fields()
    xp = bk.xp
    G = y.shape[0]
    f64 = xp.float64
    has_prior = prior_mean is not None
    none = xp.empty(1)
    pm = xp.ascontiguousarray(prior_mean, dtype=f64) if has_prior else none
    st = tuple(xp.ascontiguousarray(v, dtype=f64) for v in init_state) if init_state is not None else (none,) * 4
    out = xp.empty((10 if r_flat_start else 6, G))
    la_start = xp.ascontiguousarray(la, dtype=f64)
    bk.launch(
        gk.newton_log_alpha,
        gk.blocks_for(G),
        gk.THREADS,
        la_start,
        xp.ascontiguousarray(y.T, dtype=f64),
        xp.ascontiguousarray(mu.T, dtype=f64),
        xp.ascontiguousarray(xx, dtype=f64),
        int(p),
        bool(cr),
        has_prior,
        pm,
        0.0 if prior_var is None else float(prior_var),
        float(lo),
        float(hi),
        int(maxit),
        float(tol),
        init_state is not None,
        *st,
        bool(r_flat_start),
        out,
    )
    r_state = (la_start, out[9], out[6], out[7], out[8] > 0) if r_flat_start else None
    return out[0], out[1], out[2], out[3], out[4].astype(xp.int64), out[5] > 0, r_state


def _newton(bk: Backend, la: Any, problem: NewtonProblem) -> tuple:
    """The safeguarded Newton iterations of :func:`_fit_log_alpha` for all genes at once (array code, any device).

    Returns the iterate, its log posterior, gradient and Hessian, the iterations, convergence, and R's first-step
    quantities ``(start, f0, target, f1, stuck)`` with ``r_flat_start`` (else None).
    """
    y, mu, xx, p, cr, prior_mean, prior_var, lo, hi, maxit, tol, r_flat_start, init_state = problem.fields()
    xp = bk.xp
    G = y.shape[0]
    pm_all = prior_mean
    iters = xp.zeros(G, dtype=xp.int64)
    conv = xp.zeros(G, dtype=bool)
    idx = xp.arange(G)

    def pm(i: Any) -> Any:
        return None if pm_all is None else pm_all[i]

    def logpost_of(i: Any, at: Any, derivs: bool) -> tuple[Any, Any, Any]:
        """:func:`_logpost` of the genes ``i`` at log alpha ``at``."""
        return _logpost(bk, at, y[i], mu[i], xx, p, cr=cr, prior_mean=pm(i), prior_var=prior_var, derivs=derivs)

    if init_state is None:
        f, g, h = _logpost(bk, la, y, mu, xx, p, cr=cr, prior_mean=pm_all, prior_var=prior_var, derivs=True)
    else:
        # warm start (MAP after genewise): reuse the genewise log likelihood and derivatives where the start is the
        # genewise iterate, adding the prior terms; evaluate afresh elsewhere
        la_ref, f, g, h = (xp.array(v, dtype=xp.float64) for v in init_state)
        if pm_all is not None:
            d = la - pm_all
            f = f - d * d / (2.0 * prior_var)
            g = g - d / prior_var
            h = h - 1.0 / prior_var
        redo = xp.nonzero(xp.abs(la - la_ref) > 1e-12)[0]
        if redo.shape[0]:
            f[redo], g[redo], h[redo] = logpost_of(redo, la[redo], derivs=True)
    r_state = None
    if r_flat_start:
        # R's first line-search step (kappa = 1, limited to [-30, 10]) and its log posterior on R's scale
        target = xp.clip(la + g, -30.0, 10.0)
        # the first step's gain is about g^2, so only genes with a small gradient can gain less than 1e-6
        f1 = f + g * g
        cand1 = xp.nonzero(g * g < 1e-3)[0]
        if cand1.shape[0]:
            f1[cand1] = logpost_of(cand1, target[cand1], derivs=False)[0]
        armijo = f1 >= f + 1e-4 * g * (target - la)
        # a first step gaining less than R's tolerance (1e-6) ends R's search at once; with |gradient| < 1e-3 the
        # gain of any step R can take is below it, whatever the rounding noise of the log posterior
        stuck = (armijo & (f1 - f < 1e-6)) | (g * g < 1e-6)
        r_state = (la.copy(), f.copy(), target, f1, stuck)
    for _ in range(maxit):
        if idx.shape[0] == 0:
            break
        lai, fi, gi, hi_ = la[idx], f[idx], g[idx], h[idx]
        ya, mua = y[idx], mu[idx]
        pmi = pm(idx)
        step = xp.where(hi_ < 0, -gi / xp.where(hi_ < 0, hi_, -1.0), xp.sign(gi))
        step = xp.clip(step, -3.0, 3.0)
        # at a bound with the gradient pointing outward there is nothing to do
        at_lo = (lai <= lo + 1e-12) & (gi < 0)
        at_hi = (lai >= hi - 1e-12) & (gi > 0)
        step = xp.where(at_lo | at_hi, 0.0, step)
        # full step first, with derivatives (accepted for most genes)
        cand = xp.clip(lai + step, lo, hi)
        fn, gn, hn = _logpost(bk, cand, ya, mua, xx, p, cr=cr, prior_mean=pmi, prior_var=prior_var, derivs=True)
        ok = (fn >= fi - 1e-12 * (xp.abs(fi) + 1.0)) & xp.isfinite(fn)
        newla = xp.where(ok, cand, lai)
        accepted = ok | (step == 0)
        fn = xp.where(ok, fn, fi)
        gn = xp.where(ok, gn, gi)
        hn = xp.where(ok, hn, hi_)
        if not bool(accepted.all()):
            # step halving on the genes whose full step lowered the objective
            pend = xp.nonzero(~accepted)[0]
            lp_, sp_, fp_ = lai[pend], step[pend], fi[pend]
            yp, mp_ = ya[pend], mua[pend]
            pmp = None if pmi is None else pmi[pend]
            scale = xp.full(pend.shape[0], 0.5)
            acc_p = xp.zeros(pend.shape[0], dtype=bool)
            best = lp_
            fbest = fp_
            for _h in range(24):
                c2 = xp.clip(lp_ + scale * sp_, lo, hi)
                f2, _, _ = _logpost(bk, c2, yp, mp_, xx, p, cr=cr, prior_mean=pmp, prior_var=prior_var, derivs=False)
                ok2 = ~acc_p & (f2 >= fp_ - 1e-12 * (xp.abs(fp_) + 1.0)) & xp.isfinite(f2)
                best = xp.where(ok2, c2, best)
                fbest = xp.where(ok2, f2, fbest)
                acc_p |= ok2
                if bool(acc_p.all()):
                    break
                scale = xp.where(acc_p, scale, scale * 0.5)
            f3, g3, h3 = _logpost(bk, best, yp, mp_, xx, p, cr=cr, prior_mean=pmp, prior_var=prior_var, derivs=True)
            newla[pend], fn[pend], gn[pend], hn[pend] = best, f3, g3, h3
            accepted[pend] = acc_p
        moved = xp.abs(newla - lai)
        iters[idx] += 1
        la[idx] = newla
        atb = ((newla <= lo + 1e-12) & (gn < 0)) | ((newla >= hi - 1e-12) & (gn > 0))
        # converged: the step was tiny, the next Newton step would be (quadratic convergence), or the gradient vanished
        next_small = (hn < 0) & (xp.abs(gn) < 1e-7 * xp.abs(hn))
        # a remaining Newton step below 3e-4 in log alpha is taken without another evaluation (the error left is of
        # the order of its square); f, g, h follow by Taylor expansion so that warm starts stay consistent
        pred = -gn / xp.where(hn < 0, hn, -1.0)
        polish = accepted & (hn < 0) & (xp.abs(pred) < 3e-4) & ~atb & ~next_small
        pred = xp.where(polish, xp.clip(newla + pred, lo, hi) - newla, 0.0)
        la[idx] = newla + pred
        fn = fn + gn * pred + 0.5 * hn * pred * pred
        gn = gn + hn * pred
        next_small = next_small | polish
        f[idx], g[idx], h[idx] = fn, gn, hn
        done = (
            (moved < 1e-8)
            | next_small
            | (xp.abs(gn) < 1e-7)
            | atb
            | ~accepted
            | (xp.abs(fn - fi) < tol * (xp.abs(fi) + 1e-3) * 1e-3)
        )
        conv[idx] = done & accepted
        idx = idx[~done]
    conv[idx] = False
    return la, f, g, h, iters, conv, r_state


def _grid_search(
    bk: Backend,
    y: Any,
    mu: Any,
    xx: Any,
    p: int,
    *,
    lo: float,
    hi: float,
    cr: bool,
    prior_mean: Any,
    prior_var: float | None,
    ngrid: int = 20,
) -> Any:
    """R's ``fitDispGrid``: coarse grid on log alpha then a fine grid around the best point, for all genes at once
    (on the GPU one kernel launch, ``_kernels_gpu.grid_log_alpha``, one thread per gene).
    """
    from gpuc.deseq._kernels import gpu_kernels

    xp = bk.xp
    G = y.shape[0]
    gk = gpu_kernels(bk, p, y.shape[0] * y.shape[1])
    if gk is not None:
        f64 = xp.float64
        out = xp.empty(G)
        bk.launch(
            gk.grid_log_alpha,
            gk.blocks_for(G),
            gk.THREADS,
            xp.arange(G),
            xp.ascontiguousarray(y.T, dtype=f64),
            xp.ascontiguousarray(mu.T, dtype=f64),
            xp.ascontiguousarray(xx, dtype=f64),
            int(p),
            bool(cr),
            prior_mean is not None,
            xp.empty(1) if prior_mean is None else xp.ascontiguousarray(prior_mean, dtype=f64),
            0.0 if prior_var is None else float(prior_var),
            float(lo),
            float(hi),
            int(ngrid),
            out,
        )
        return out

    def values(points: Iterable[Any]) -> Any:
        """The log posterior of every gene at each of ``points`` (per gene log alphas), genes x points."""
        kw = {"cr": cr, "prior_mean": prior_mean, "prior_var": prior_var, "derivs": False}
        return xp.stack([_logpost(bk, la, y, mu, xx, p, **kw)[0] for la in points], axis=1)

    grid = xp.linspace(lo, hi, ngrid)
    best = grid[xp.argmax(values(xp.full(G, float(v)) for v in bk.to_host(grid)), axis=1)]
    delta = float(grid[1] - grid[0])
    fine = best[:, None] + xp.linspace(-delta, delta, ngrid)[None, :]
    return fine[xp.arange(G), xp.argmax(values(fine[:, j] for j in range(ngrid)), axis=1)]


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
        out = np.exp(np.interp(lm, self.grid_logmean, self.grid_logdisp))  # type: ignore[arg-type]
        return np.maximum(out, self.min_disp)

    @classmethod
    def from_dict(cls, d: dict) -> DispersionFunction:
        """The trend described by :meth:`to_dict` (e.g. read back from ``uns``)."""
        return cls(
            d["type"],
            coefs=(float(d["asymptDisp"]), float(d["extraPois"])) if "asymptDisp" in d else None,
            mean=float(d["mean"]) if "mean" in d else None,
            grid_logmean=np.asarray(d["grid_logmean"]) if "grid_logmean" in d else None,
            grid_logdisp=np.asarray(d["grid_logdisp"]) if "grid_logdisp" in d else None,
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
        return d


def _gamma_identity_glm(
    y: np.ndarray, xcol: np.ndarray, start: np.ndarray, *, maxit: int = 25, eps: float = 1e-8
) -> tuple[np.ndarray, bool]:
    """R ``glm(y ~ xcol, family=Gamma("identity"), start=)``: IRLS with weights 1/mu^2 and step halving on invalid mu."""
    xm = np.column_stack([np.ones_like(xcol), xcol])
    coef = start.astype(np.float64)
    eta = xm @ coef
    if np.any(eta <= 0):
        raise TrendFitError("invalid start for the Gamma fit")
    mu = eta

    def dev(mu: np.ndarray) -> float:
        return float(2.0 * np.sum(-np.log(y / mu) + (y - mu) / mu))

    devold = dev(mu)
    conv = False
    for _ in range(maxit):
        wts = 1.0 / mu**2
        sw = np.sqrt(wts)
        new, *_ = np.linalg.lstsq(xm * sw[:, None], y * sw, rcond=None)
        eta = xm @ new
        k = 0
        while np.any(eta <= 0) and k < 30:
            new = (new + coef) / 2.0
            eta = xm @ new
            k += 1
        if np.any(eta <= 0):
            raise TrendFitError("Gamma fit left the valid region")
        coef, mu = new, eta
        d = dev(mu)
        if abs(d - devold) / (abs(d) + 0.1) < eps:
            conv = True
            break
        devold = d
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
        if np.sum(np.log(coefs / old) ** 2) < 1e-6 and conv:
            break
        it += 1
        if it > 10:
            raise TrendFitError("dispersion fit did not converge")
    return float(coefs[0]), float(coefs[1])


def local_trend(means: np.ndarray, disps: np.ndarray, *, min_disp: float, ngrid: int = 200) -> DispersionFunction:
    """Stand-in for R's ``localDispersionFit`` (locfit of log dispersion on log mean, weights = mean).

    A local quadratic regression with tricube weights on the 70% nearest neighbours (locfit's default span and
    degree) evaluated on a grid and interpolated; close to, not identical with, locfit.
    """
    use = disps >= min_disp * 10
    if not use.any():
        return DispersionFunction(
            "local", grid_logmean=np.array([0.0, 1.0]), grid_logdisp=np.log([min_disp, min_disp]), min_disp=min_disp
        )
    xs, ys, ws = np.log(means[use]), np.log(disps[use]), means[use]
    grid = np.linspace(xs.min(), xs.max(), ngrid)
    fit = local_poly(xs, ys, ws, grid, span=0.7, degree=2)
    return DispersionFunction("local", grid_logmean=grid, grid_logdisp=fit, min_disp=min_disp)


def local_poly(x: np.ndarray, y: np.ndarray, w: np.ndarray, at: np.ndarray, *, span: float, degree: int) -> np.ndarray:
    """Weighted local polynomial regression (tricube kernel, nearest-neighbour bandwidth) evaluated at ``at``."""
    n = x.shape[0]
    k = max(int(np.ceil(span * n)), degree + 1)
    out = np.empty(at.shape[0])
    for i, x0 in enumerate(at):  # loop over evaluation points of a 1-D smoother, not over genes
        d = np.abs(x - x0)
        hh = np.partition(d, min(k, n) - 1)[min(k, n) - 1] * (1.0 + 1e-10) + 1e-12
        u = np.clip(d / hh, 0, 1)
        kw = (1 - u**3) ** 3 * w
        sel = kw > 0
        v = np.vander(x[sel] - x0, degree + 1, increasing=True)
        sw = np.sqrt(kw[sel])
        coef, *_ = np.linalg.lstsq(v * sw[:, None], y[sel] * sw, rcond=None)
        out[i] = coef[0]
    return out


def fit_trend(
    means: np.ndarray, genewise: np.ndarray, *, fit_type: str, min_disp: float
) -> tuple[DispersionFunction, str | None]:
    """R's ``estimateDispersionsFit``: returns the dispersion function and a warning message if it fell back."""
    if fit_type == "mean":
        import scipy.stats  # here: the other fit types never need it, and it costs a quarter of a second to load

        use = genewise > 10 * min_disp
        return DispersionFunction(
            "mean", mean=float(scipy.stats.trim_mean(genewise[use], 0.001)), min_disp=min_disp
        ), None
    if fit_type == "local":
        return local_trend(means, genewise, min_disp=min_disp), None
    use = genewise > 100 * min_disp
    if use.sum() == 0:
        msg = "all gene-wise dispersion estimates are within 2 orders of magnitude of the minimum value; the data have no overdispersion to model (consider a different test, e.g. Poisson)."
        raise ValueError(msg)
    try:
        coefs = parametric_trend(means[use], genewise[use])
        return DispersionFunction("parametric", coefs=coefs, min_disp=min_disp), None
    except (TrendFitError, np.linalg.LinAlgError) as err:
        return local_trend(
            means, genewise, min_disp=min_disp
        ), f"the parametric dispersion fit failed ({err}); using fit_type='local' instead, as R DESeq2 does."


# --------------------------------------------------------------------------------------------------------------------
# prior variance
# --------------------------------------------------------------------------------------------------------------------
def log_residual_variance(genewise: np.ndarray, fitted: np.ndarray, *, min_disp: float) -> tuple[float, np.ndarray]:
    """R's varLogDispEsts: squared MAD of log genewise - log trend over genes with genewise >= 100 min_disp."""
    above = genewise >= min_disp * 100
    resid = np.log(genewise[above]) - np.log(fitted[above])
    mad = 1.4826 * np.median(np.abs(resid - np.median(resid)))
    return float(mad**2), resid


def prior_variance(resid: np.ndarray, var_log_disp: float, n: int, p: int, *, seed: int = 2) -> tuple[float, str]:
    """R's ``estimateDispersionsPriorVar``.

    For n - p > 3: max(varLogDispEsts - trigamma((n-p)/2), 0.25). For 1 <= n - p <= 3, R matches the residual
    histogram to simulated log chi-square + normal noise by KL divergence over a variance grid; done here the same
    way with numpy's generator (R's random stream is not reproduced, so values differ slightly).
    """
    df = n - p
    if df <= 0:
        msg = f"no residual degrees of freedom (samples={n}, coefficients={p}): dispersions cannot be estimated. Add replicates or simplify the design."
        raise ValueError(msg)
    if df > 3:
        return float(max(var_log_disp - scipy.special.polygamma(1, df / 2.0), 0.25)), "moments"
    rng = np.random.default_rng(seed)
    brks = np.arange(-20, 21) / 2.0
    obs = resid[(resid > brks[0]) & (resid < brks[-1])]
    obs_d, _ = np.histogram(obs, bins=brks, density=True)
    grid = np.linspace(0, 8, 200)
    kl = np.empty(grid.shape[0])
    for i, v in enumerate(grid):  # 200 simulated variances (a 1-D search, not a gene loop)
        sim = np.log(rng.chisquare(df, 10000)) + rng.normal(0, np.sqrt(v), 10000) - np.log(df)
        sim = sim[(sim > brks[0]) & (sim < brks[-1])]
        sim_d, _ = np.histogram(sim, bins=brks, density=True)
        z = np.concatenate([obs_d, sim_d])
        small = z[z > 0].min()
        kl[i] = np.sum(obs_d * (np.log(obs_d + small) - np.log(sim_d + small)))
    fine = np.linspace(0, 8, 1000)
    smooth = local_poly(grid, kl, np.ones_like(grid), fine, span=0.2, degree=2)
    return float(max(fine[np.argmin(smooth)], 0.25)), "simulation"


# --------------------------------------------------------------------------------------------------------------------
# whole dispersion stage
# --------------------------------------------------------------------------------------------------------------------
def fit_dispersions_map_pipeline(bk: Backend, y: Any, sf: Any, x: Any, *, min_disp: float = 1e-8) -> Any:
    """Genewise -> mean trend -> prior -> MAP, used inside the iterative size-factor estimate."""
    xp = bk.xp
    n, p = x.shape
    max_disp = max(10.0, float(n))
    a0 = rough_moments_init(bk, y, sf, x, min_disp=min_disp, max_disp=max_disp)
    mu = dispersion_mu(bk, y, sf, x, a0)
    gw = fit_log_alpha(bk, y, mu, x, a0, min_disp=min_disp, max_disp=max_disp, r_flat_start=True).alpha
    gwh = np.asarray(bk.to_host(gw))
    means = np.asarray(bk.to_host((y / sf[None, :]).mean(axis=1)))
    fn, _ = fit_trend(means, gwh, fit_type="mean", min_disp=min_disp)
    fitted = fn(means)
    v, resid = log_residual_variance(gwh, fitted, min_disp=min_disp)
    pv, _ = prior_variance(resid, v, n, p)
    start = xp.where(gw > 0.1 * xp.asarray(fitted), gw, xp.asarray(fitted))
    mp = fit_log_alpha(
        bk, y, mu, x, start, min_disp=min_disp, max_disp=max_disp, prior_mean=xp.log(xp.asarray(fitted)), prior_var=pv
    ).alpha
    return xp.where(xp.log(gw) > xp.log(xp.asarray(fitted)) + 2 * math.sqrt(v), gw, mp)


def nb_deviance(bk: Backend, y: Any, mu: Any, alpha: Any) -> Any:
    """-2 log-likelihood per gene."""
    return -2.0 * nb_loglik_sum(bk, y, mu, alpha)
