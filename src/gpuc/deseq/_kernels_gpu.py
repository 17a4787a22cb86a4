"""GPU only: numba-cuda kernels of the DESeq2 per-gene solvers, one CUDA thread per gene.

Why numba-cuda: the per-gene problems (R's line search in log alpha, an IRLS on a p x p system) are small loops with
data-dependent branches (step halving, bounds, convergence). As CuPy array code every branch becomes
masks and every iteration dozens of launches plus synchronising reads; written once per gene, a whole solve is one
launch and keeps its state in registers and local memory. numba-cuda compiles the same Python as the CPU kernels
(the dispersion search is one source for both, :mod:`gpuc.deseq._fitdisp`; the IRLS follows
:mod:`gpuc.deseq._kernels_cpu`'s steps, stopping rule and deviance, solving the normal equations where the CPU
reproduces R's QR: equal to rounding), caches the compiled kernels on disk (``cache=True``: a fresh process does not compile them again),
queues them on CuPy's stream (:meth:`gpuc._backend.Backend.launch`) and runs them without a GPU under its CUDA
simulator (``NUMBA_ENABLE_CUDASIM=1``; CPU CI runs them there on the stand-in device of :mod:`gpuc._testing.standin`).
This module imports ``numba.cuda`` only; it needs neither CuPy nor a device to be imported.

Kernels (one thread per gene; counts and means are passed sample-major, ``(n, G)``, so that the threads of a warp
read consecutive addresses):

- :func:`nb_const`: per gene, sum over samples of lgamma(y + r) - lgamma(r) - lgamma(y + 1), r = 1/alpha (the
  mu-free part of the NB log-likelihood, computed once per GLM fit).
- :func:`irls`: the whole IRLS loop of ``_glm._fit_nb_glm`` for a gene (normal equations built and solved in local
  arrays, deviance, divergence and convergence tests), writing the coefficients, iterations, deviance and flags.
- :func:`fit_disp`: R's ``fitDisp`` line search of ``_dispersion._fit_log_alpha`` for a gene
  (:func:`gpuc.deseq._fitdisp.fit_disp_gene`).
- :func:`fit_disp_grid`: R's coarse + fine grid search (``fitDispGrid``) for a gene.

Designs wider than :data:`MAXP` coefficients take the batched CuPy path (the local arrays have a compile-time size).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float64

from gpuc.deseq._fitdisp import fit_disp_gene, fit_disp_grid_gene, pivot_rows, register_for_cuda, swap_lines

register_for_cuda()

MAXP = 16  # widest design the kernels take (local p x p arrays)
MAXPP = MAXP * MAXP
# the line search's scratch (the p x p normal matrix); a module constant, as local arrays need one
LINE_SEARCH_WORK = MAXPP
INVERSE_WORK = MAXPP + 2 * MAXP  # the Cox-Reid derivative's LAPACK-order inverse (_fitdisp.inverse_scratch)
K = 64  # integer counts below this use the recurrences (per-gene tables), as the CPU kernels
LOG_FACT = np.array([math.lgamma(k + 1.0) for k in range(K)])  # lgamma(y + 1) of the small integer counts
THREADS = 128  # threads per block


def blocks_for(n: int) -> int:
    """Blocks of :data:`THREADS` threads covering ``n`` genes."""
    return max(1, -(-n // THREADS))


# --------------------------------------------------------------------------------------------------------------------
# small dense linear algebra in local arrays (flat row-major p x p)
# --------------------------------------------------------------------------------------------------------------------
@cuda.jit(device=True, cache=True)
def solve_pivoted(a, rhs, p, q, want_logdet, want_solve):  # pragma: no cover - device code
    """Gaussian elimination with partial pivoting of the p x p ``a`` (flat, row-major) against ``q`` right-hand sides
    ``rhs`` (flat p x q, row-major), in place, in LAPACK ``getrf``/``getrs`` order; returns log|det a| when
    ``want_logdet``. Only the upper triangle of ``a`` is kept up to date.
    """
    logdet = 0.0
    for c in range(p):
        piv = pivot_rows(a, p, c)
        if piv != c:
            swap_lines(rhs, q, c, piv, q, 1)
        d0 = a[c * p + c]
        if want_logdet:
            logdet += math.log(abs(d0))
        for r_ in range(c + 1, p):
            fct = a[r_ * p + c] / d0
            if fct != 0.0:
                for v in range(c + 1, p):
                    a[r_ * p + v] -= fct * a[c * p + v]
                for k in range(q):
                    rhs[r_ * q + k] -= fct * rhs[c * q + k]
    if want_solve:
        for k in range(q):
            for c in range(p - 1, -1, -1):
                acc = rhs[c * q + k]
                for v in range(c + 1, p):
                    acc -= a[c * p + v] * rhs[v * q + k]
                rhs[c * q + k] = acc / a[c * p + c]
    return logdet


# --------------------------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------------------------
@cuda.jit(cache=True)
def nb_const(y, alpha, out):  # pragma: no cover - device code
    """Per gene (column of the sample-major ``y``): sum of lgamma(y + r) - lgamma(r) - lgamma(y + 1), r = 1/alpha."""
    i = cuda.grid(1)
    n, G = y.shape
    if i >= G:
        return
    t_lg = cuda.local.array(K, float64)
    r = 1.0 / alpha[i]
    lgr = math.lgamma(r)
    t_lg[0] = 0.0
    filled = 0
    lg_acc = 0.0
    prod = 1.0
    s = 0.0
    for j in range(n):
        yj = y[j, i]
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
                x1 = yj + r
                v1 = 1.0 / x1
                z1 = v1 * v1
                x2 = yj + 1.0
                v2 = 1.0 / x2
                z2 = v2 * v2
                l1 = (
                    (x1 - 0.5) * math.log(x1)
                    - x1
                    + v1 * (1.0 / 12.0 - z1 * (1.0 / 360.0 - z1 * (1.0 / 1260.0 - z1 * (1.0 / 1680.0 - z1 / 1188.0))))
                )
                l2 = (
                    (x2 - 0.5) * math.log(x2)
                    - x2
                    + v2 * (1.0 / 12.0 - z2 * (1.0 / 360.0 - z2 * (1.0 / 1260.0 - z2 * (1.0 / 1680.0 - z2 / 1188.0))))
                )
                s += l1 - l2 - lgr
            else:
                s += math.lgamma(yj + r) - lgr - math.lgamma(yj + 1.0)
    out[i] = s


@cuda.jit(device=True, cache=True)
def _irls_pass(b, y, i, sf, x, a, inv_a, loga, min_mu, log_min_mu, mat, rhs):  # pragma: no cover - device code
    """One pass over the samples of gene ``i`` at coefficients ``b``: mu (floored at min_mu), the NB log-likelihood
    sum that enters the deviance (as the CPU kernel's ``acc``) and the weighted normal equations for the next step
    (``mat`` upper triangle and ``rhs``, ridge not added).
    """
    n, p = x.shape
    for u in range(p):
        rhs[u] = 0.0
        for v in range(p):
            mat[u * p + v] = 0.0
    acc = 0.0
    for j in range(n):
        e = 0.0
        for u in range(p):
            e += b[u] * x[j, u]
        m_ = sf[j] * math.exp(e)
        logsf = math.log(sf[j])
        if m_ < min_mu:
            m_ = min_mu
            e = log_min_mu - logsf
        am = a * m_
        u1 = 1.0 + am
        iu = 1.0 / u1
        l1p = math.log(u1) + (am - (u1 - 1.0)) * iu
        yj = y[j, i]
        acc += -l1p * inv_a + yj * (loga + e + logsf - l1p)
        w = m_ * iu
        wz = w * e + (yj - m_) * iu
        for u in range(p):
            xu = x[j, u]
            rhs[u] += wz * xu
            wxu = w * xu
            for v in range(u, p):
                mat[u * p + v] += wxu * x[j, v]
    return acc


@cuda.jit(cache=True)
def irls(y, sf, x, alpha, ll_const, lam, beta, min_mu, maxit, tol, large, iters, converged, failed, dev):
    # pragma: no cover - device code
    """The IRLS loop of ``_glm._fit_nb_glm`` for gene ``i`` (column of the sample-major counts ``y``), in place on
    ``beta`` (G, p), as ``_kernels_cpu.irls``: the same working weights and response, divergence test, deviance and
    stopping rule, the step from the ridge-penalised normal equations (the CPU solves R's QR form, which gives the
    same step up to rounding; a (n + p) x p matrix per thread would not fit a GPU thread's local memory).
    """
    i = cuda.grid(1)
    G = y.shape[1]
    if i >= G:
        return
    p = x.shape[1]
    mat = cuda.local.array(MAXPP, float64)
    rhs = cuda.local.array(MAXP, float64)
    b = cuda.local.array(MAXP, float64)
    a = alpha[i]
    inv_a = 1.0 / a
    loga = math.log(a)
    log_min_mu = math.log(min_mu)
    for u in range(p):
        b[u] = beta[i, u]
    # normal equations at the start; the deviance of the start is not used (the first step never converges)
    _irls_pass(b, y, i, sf, x, a, inv_a, loga, min_mu, log_min_mu, mat, rhs)
    dev_old = 0.0
    conv = False
    bad = False
    it = 0
    for t in range(maxit):
        for u in range(p):
            mat[u * p + u] += lam[u]
            for v in range(u):
                mat[u * p + v] = mat[v * p + u]
        solve_pivoted(mat, rhs, p, 1, False, True)
        for u in range(p):
            b[u] = rhs[u]
        it += 1
        big = False
        for u in range(p):
            if not (abs(b[u]) <= large):
                big = True
        # deviance at the new coefficients and the next step's normal equations, in one pass
        acc = _irls_pass(b, y, i, sf, x, a, inv_a, loga, min_mu, log_min_mu, mat, rhs)
        d = -2.0 * (ll_const[i] + acc)
        ct = abs(d - dev_old) / (abs(d) + 0.1)
        bad = big or not math.isfinite(ct)
        conv = (not bad) and ct < tol and t > 0
        for u in range(p):
            beta[i, u] = b[u]
        dev_old = d
        if conv or bad:
            break
    iters[i] += it
    converged[i] = conv
    failed[i] = bad
    dev[i] = dev_old


# --------------------------------------------------------------------------------------------------------------------
# R's dispersion search (the per-gene code of gpuc.deseq._fitdisp, shared with the CPU kernels). numba-cuda's disk
# cache is keyed on this file: after an edit of _fitdisp.py, clear the cache (or touch this file) before timing.
# --------------------------------------------------------------------------------------------------------------------
@cuda.jit(cache=True)
def fit_disp(la0, y, mu, x, p, pm, pv, use_prior, min_log_alpha, kappa_0, tol, maxit, use_cr, out):  # pragma: no cover
    """R's ``fitDisp`` (:func:`gpuc.deseq._fitdisp.fit_disp_gene`), thread i: gene i. ``y``, ``mu``: sample-major
    (n, G) flattened; ``x``: the n x p design flattened row-major. Writes log alpha, proposals, initial and last log
    posterior into ``out[:, i]``.
    """
    i = cuda.grid(1)
    G = la0.shape[0]
    if i >= G:
        return
    n = y.shape[0] // G
    b = cuda.local.array(LINE_SEARCH_WORK, float64)
    db = cuda.local.array(MAXPP, float64)
    inv = cuda.local.array(INVERSE_WORK, float64)
    res = cuda.local.array(4, float64)
    m = pm[i] if use_prior else 0.0
    # no per-sample cache on the GPU (n is not known at compile time): the derivative takes its logarithms afresh
    fit_disp_gene(
        la0[i], y, mu, i, G, n, x, p, m, pv, use_prior, min_log_alpha, kappa_0, tol, maxit, use_cr, b, db, inv,
        res[:0], res,
    )  # fmt: skip
    for k in range(4):
        out[k, i] = res[k]


@cuda.jit(cache=True)
def fit_disp_grid(y, mu, x, p, pm, pv, use_prior, use_cr, lo, hi, ngrid, out):  # pragma: no cover - device code
    """R's ``fitDispGrid`` (:func:`gpuc.deseq._fitdisp.fit_disp_grid_gene`) of gene i into ``out[i]``; layouts as
    :func:`fit_disp`.
    """
    i = cuda.grid(1)
    G = out.shape[0]
    if i >= G:
        return
    n = y.shape[0] // G
    b = cuda.local.array(LINE_SEARCH_WORK, float64)
    m = pm[i] if use_prior else 0.0
    out[i] = fit_disp_grid_gene(y, mu, i, G, n, x, p, m, pv, use_prior, use_cr, lo, hi, ngrid, b)
