"""GPU only: numba-cuda kernels of the DESeq2 per-gene solvers, one CUDA thread per gene.

Why numba-cuda: the per-gene problems (a 1-D safeguarded Newton in log alpha, an IRLS on a p x p system) are small
loops with data-dependent branches (step halving, bounds, convergence). As CuPy array code every branch becomes
masks and every iteration dozens of launches plus synchronising reads; written once per gene, a whole solve is one
launch and keeps its state in registers and local memory. numba-cuda compiles the same Python as the CPU kernels
(:mod:`gpuc.deseq._kernels_cpu`, whose per-gene code these kernels follow line by line, so that the GPU gives the
CPU's answers), caches the compiled kernels on disk (``cache=True``: a fresh process does not compile them again),
queues them on CuPy's stream (:meth:`gpuc._backend.Backend.launch`) and runs them without a GPU under its CUDA
simulator (``NUMBA_ENABLE_CUDASIM=1``; CPU CI runs them there on the stand-in device of :mod:`gpuc._testing.standin`).
This module imports ``numba.cuda`` only; it needs neither CuPy nor a device to be imported.

Kernels (one thread per gene; counts and means are passed sample-major, ``(n, G)``, so that the threads of a warp
read consecutive addresses):

- :func:`nb_const`: per gene, sum over samples of lgamma(y + r) - lgamma(r) - lgamma(y + 1), r = 1/alpha (the
  mu-free part of the NB log-likelihood, computed once per GLM fit).
- :func:`irls`: the whole IRLS loop of ``_glm._fit_nb_glm`` for a gene (normal equations built and solved in local
  arrays, deviance, divergence and convergence tests), writing the coefficients, iterations, deviance and flags.
- :func:`newton_log_alpha`: the whole safeguarded Newton loop of ``_dispersion._fit_log_alpha`` for a gene (R's
  first-step quantities, warm start, step halving, polishing, stopping rules), with the NB log posterior, its
  derivatives in log alpha and the Cox-Reid term computed in one pass over the samples.
- :func:`grid_log_alpha`: R's coarse + fine grid search (``_dispersion._grid_search``) for a list of genes.

Designs wider than :data:`MAXP` coefficients take the batched CuPy path (the local arrays have a compile-time size).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float64

from gpuc.deseq._fitdisp import fit_disp_gene, fit_disp_grid_gene

MAXP = 16  # widest design the kernels take (local p x p arrays)
MAXPP = MAXP * MAXP
K = 64  # integer counts below this use the recurrences (per-gene tables), as the CPU kernels
HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
LOG_FACT = np.array([math.lgamma(k + 1.0) for k in range(K)])  # lgamma(y + 1) of the small integer counts
THREADS = 128  # threads per block


def blocks_for(n: int) -> int:
    """Blocks of :data:`THREADS` threads covering ``n`` genes."""
    return max(1, -(-n // THREADS))


# --------------------------------------------------------------------------------------------------------------------
# special functions (as _kernels_cpu)
# --------------------------------------------------------------------------------------------------------------------
@cuda.jit(device=True, cache=True)
def psi_big(x):  # pragma: no cover - device code; x >= 10
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


@cuda.jit(device=True, cache=True)
def tri_big(x):  # pragma: no cover - device code; x >= 10
    v = 1.0 / x
    z = v * v
    return v + z * (
        0.5
        + v
        * (1.0 / 6.0 - z * (1.0 / 30.0 - z * (1.0 / 42.0 - z * (1.0 / 30.0 - z * (5.0 / 66.0 - z * (691.0 / 2730.0))))))
    )


@cuda.jit(device=True, cache=True)
def psi(x):  # pragma: no cover - device code; x > 0
    acc = 0.0
    while x < 10.0:
        acc -= 1.0 / x
        x += 1.0
    return acc + psi_big(x)


@cuda.jit(device=True, cache=True)
def tri(x):  # pragma: no cover - device code; x > 0
    acc = 0.0
    while x < 10.0:
        acc += 1.0 / (x * x)
        x += 1.0
    return acc + tri_big(x)


@cuda.jit(device=True, cache=True)
def clip(v, lo, hi):  # pragma: no cover - device code
    return lo if v < lo else (hi if v > hi else v)


# --------------------------------------------------------------------------------------------------------------------
# small dense linear algebra in local arrays (flat row-major p x p)
# --------------------------------------------------------------------------------------------------------------------
@cuda.jit(device=True, cache=True)
def solve_pivoted(a, rhs, p, q, want_logdet, want_solve):  # pragma: no cover - device code
    """Gaussian elimination with partial pivoting of the p x p ``a`` (flat, row-major) against ``q`` right-hand sides
    ``rhs`` (flat p x q, row-major), in place, as ``_kernels_cpu.solve_pivoted``; returns log|det a| when
    ``want_logdet``. Only the upper triangle of ``a`` is kept up to date.
    """
    logdet = 0.0
    for c in range(p):
        piv = c
        best = abs(a[c * p + c])
        for r_ in range(c + 1, p):
            if abs(a[r_ * p + c]) > best:
                best = abs(a[r_ * p + c])
                piv = r_
        if piv != c:
            for v in range(p):
                tmp = a[c * p + v]
                a[c * p + v] = a[piv * p + v]
                a[piv * p + v] = tmp
            for k in range(q):
                tmp = rhs[c * q + k]
                rhs[c * q + k] = rhs[piv * q + k]
                rhs[piv * q + k] = tmp
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
# the NB log posterior in log alpha for one gene (as _kernels_cpu.gene_nb_terms / gene_logpost)
# --------------------------------------------------------------------------------------------------------------------
@cuda.jit(device=True, cache=True)
def gene_nb_terms(la, y, mu, i, xx, derivs, cr, t_lg, t_dg, t_tg, m, a2, a3):  # pragma: no cover - device code
    """NB terms of gene ``i`` (column of the sample-major ``y``, ``mu``) at log alpha ``la``: returns ``(f, ga, ha)``
    and accumulates X^T diag(w^k) X (k = 1, and 2, 3 with ``derivs``) into ``m, a2, a3`` when ``cr``.
    """
    n = y.shape[0]
    pp = xx.shape[1]
    alpha = math.exp(la)
    r = 1.0 / alpha
    lgr = math.lgamma(r)
    dgr = 0.0
    tgr = 0.0
    if derivs:
        dgr = psi(r)
        tgr = tri(r)
    if cr:
        for u in range(pp):
            m[u] = 0.0
            if derivs:
                a2[u] = 0.0
                a3[u] = 0.0
    t_lg[0] = 0.0
    t_dg[0] = 0.0
    t_tg[0] = 0.0
    filled = 0
    lg_acc = 0.0
    prod = 1.0
    s_lg = 0.0
    s_dg = 0.0
    s_tg = 0.0
    s_y = 0.0
    s_yrl = 0.0
    s_l1p = 0.0
    s_w = 0.0
    s_ym = 0.0
    s_ym2 = 0.0
    for j in range(n):
        yj = y[j, i]
        mj = mu[j, i]
        amu = alpha * mj
        u1 = 1.0 + amu
        inv_one = 1.0 / u1
        l1p = math.log(u1) + (amu - (u1 - 1.0)) * inv_one
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
                    s_dg += (lx - 0.5 * v - z * (1.0 / 12.0 - z * (1.0 / 120.0 - z * (1.0 / 252.0 - z / 240.0)))) - dgr
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
            if cr:
                # the same per-entry sums over the samples, in sample order, as the CPU kernel's
                if derivs:
                    w2 = w * w
                    w3 = w2 * w
                    for u in range(pp):
                        xv = xx[j, u]
                        m[u] += w * xv
                        a2[u] += w2 * xv
                        a3[u] += w3 * xv
                else:
                    for u in range(pp):
                        m[u] += w * xx[j, u]
    f = s_lg + la * s_y - s_yrl
    ga = 0.0
    ha = 0.0
    if derivs:
        base = -s_dg + s_l1p
        ga = r * r * base + r * s_ym
        ha = -2.0 * r * r * r * base + r * r * (s_w + r * r * s_tg) - r * r * s_ym2
    return f, ga, ha


@cuda.jit(device=True, cache=True)
def gene_logpost(la, y, mu, i, xx, p, derivs, cr, has_prior, pm, pv, t_lg, t_dg, t_tg, m, a2, a3, minv):
    # pragma: no cover - device code
    """Log posterior of gene ``i`` and its derivatives in log alpha (NB terms, Cox-Reid term, prior), as
    ``_kernels_cpu.gene_logpost``; the other arguments are local scratch arrays (``m`` ends factorised).
    """
    f, ga, ha = gene_nb_terms(la, y, mu, i, xx, derivs, cr, t_lg, t_dg, t_tg, m, a2, a3)
    if cr:
        # M is factorised in place (gene_nb_terms rebuilds it at every evaluation), against the identity for M^-1
        for u in range(p):
            for v in range(p):
                minv[u * p + v] = 1.0 if u == v else 0.0
        f -= 0.5 * solve_pivoted(m, minv, p, p, True, derivs)
    if has_prior:
        f -= (la - pm) ** 2 / (2.0 * pv)
    if not derivs:
        return f, 0.0, 0.0
    if cr:
        tr = 0.0
        sbb = 0.0
        sma = 0.0
        for u in range(p):
            for v in range(p):
                buv = 0.0
                bvu = 0.0
                for w in range(p):
                    buv += minv[u * p + w] * a2[w * p + v]
                    bvu += minv[v * p + w] * a2[w * p + u]
                sbb += buv * bvu
                sma += minv[u * p + v] * a3[u * p + v]
                if u == v:
                    tr += buv
        ga += 0.5 * tr
        ha += 0.5 * (sbb - 2.0 * sma)
    alpha = math.exp(la)
    g = alpha * ga
    h = alpha * alpha * ha + g
    if has_prior:
        g -= (la - pm) / pv
        h -= 1.0 / pv
    return f, g, h


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
    ``beta`` (G, p), as ``_kernels_cpu.irls``: same normal equations, solve, divergence test, deviance and stopping
    rule.
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


@cuda.jit(cache=True)
def newton_log_alpha(la_in, y, mu, xx, p, cr, has_prior, pm, pv, lo, hi, maxit, tol, has_init, st_la, st_f, st_g, st_h,
                     r_flat, out):  # fmt: skip  # pragma: no cover - device code
    """The safeguarded Newton loop of ``_dispersion._fit_log_alpha`` for gene ``i`` (column of the sample-major
    ``y``, ``mu``), as ``_kernels_cpu.newton_log_alpha``: ``out`` (rows x G) receives the iterate, its log posterior,
    gradient and Hessian (rows 0-3), the iterations (4), convergence (5) and, with ``r_flat``, R's first-step target,
    its log posterior, the "stuck" flag and the start's log posterior (6-9).
    """
    i = cuda.grid(1)
    G = y.shape[1]
    if i >= G:
        return
    t_lg = cuda.local.array(K, float64)
    t_dg = cuda.local.array(K, float64)
    t_tg = cuda.local.array(K, float64)
    m = cuda.local.array(MAXPP, float64)
    a2 = cuda.local.array(MAXPP, float64)
    a3 = cuda.local.array(MAXPP, float64)
    minv = cuda.local.array(MAXPP, float64)
    la = la_in[i]
    pmi = pm[i] if has_prior else 0.0
    if has_init and abs(la - st_la[i]) <= 1e-12:
        f = st_f[i]
        g = st_g[i]
        h = st_h[i]
        if has_prior:
            d = la - pmi
            f = f - d * d / (2.0 * pv)
            g = g - d / pv
            h = h - 1.0 / pv
    else:
        f, g, h = gene_logpost(la, y, mu, i, xx, p, True, cr, has_prior, pmi, pv, t_lg, t_dg, t_tg, m, a2, a3, minv)
    if r_flat:
        target = clip(la + g, -30.0, 10.0)
        f1 = f + g * g
        if g * g < 1e-3:
            f1 = gene_logpost(
                target, y, mu, i, xx, p, False, cr, has_prior, pmi, pv, t_lg, t_dg, t_tg, m, a2, a3, minv
            )[0]
        armijo = f1 >= f + 1e-4 * g * (target - la)
        out[6, i] = target
        out[7, i] = f1
        out[8, i] = 1.0 if (armijo and f1 - f < 1e-6) or g * g < 1e-6 else 0.0
        out[9, i] = f
    iters = 0
    conv = False
    for _ in range(maxit):
        fi = f
        if h < 0:
            step = -g / h
        else:
            step = 1.0 if g > 0 else (-1.0 if g < 0 else 0.0)
        step = clip(step, -3.0, 3.0)
        if (la <= lo + 1e-12 and g < 0) or (la >= hi - 1e-12 and g > 0):
            step = 0.0
        floor = fi - 1e-12 * (abs(fi) + 1.0)
        cand = clip(la + step, lo, hi)
        fn, gn, hn = gene_logpost(
            cand, y, mu, i, xx, p, True, cr, has_prior, pmi, pv, t_lg, t_dg, t_tg, m, a2, a3, minv
        )
        ok = fn >= floor and math.isfinite(fn)
        accepted = ok or step == 0.0
        if ok:
            newla = cand
        else:
            newla = la
            fn = f
            gn = g
            hn = h
        if not accepted:  # step halving until the objective does not decrease
            scale = 0.5
            best = la
            for _h in range(24):
                c2 = clip(la + scale * step, lo, hi)
                f2 = gene_logpost(
                    c2, y, mu, i, xx, p, False, cr, has_prior, pmi, pv, t_lg, t_dg, t_tg, m, a2, a3, minv
                )[0]
                if f2 >= floor and math.isfinite(f2):
                    best = c2
                    accepted = True
                    break
                scale *= 0.5
            fn, gn, hn = gene_logpost(
                best, y, mu, i, xx, p, True, cr, has_prior, pmi, pv, t_lg, t_dg, t_tg, m, a2, a3, minv
            )
            newla = best
        moved = abs(newla - la)
        iters += 1
        atb = (newla <= lo + 1e-12 and gn < 0) or (newla >= hi - 1e-12 and gn > 0)
        next_small = hn < 0 and abs(gn) < 1e-7 * abs(hn)
        pred = -gn / (hn if hn < 0 else -1.0)
        polish = accepted and hn < 0 and abs(pred) < 3e-4 and not atb and not next_small
        pred = clip(newla + pred, lo, hi) - newla if polish else 0.0
        la = newla + pred
        fn = fn + gn * pred + 0.5 * hn * pred * pred
        gn = gn + hn * pred
        f = fn
        g = gn
        h = hn
        if (
            moved < 1e-8
            or next_small
            or polish
            or abs(gn) < 1e-7
            or atb
            or not accepted
            or abs(fn - fi) < tol * (abs(fi) + 1e-3) * 1e-3
        ):
            conv = accepted
            break
    out[0, i] = la
    out[1, i] = f
    out[2, i] = g
    out[3, i] = h
    out[4, i] = iters
    out[5, i] = 1.0 if conv else 0.0


@cuda.jit(cache=True)
def grid_log_alpha(genes, y, mu, xx, p, cr, has_prior, pm, pv, lo, hi, ngrid, out):  # pragma: no cover - device code
    """R's ``fitDispGrid`` for the genes listed in ``genes`` (thread k: gene ``genes[k]``; ``pm`` is indexed by k), as
    ``_dispersion._grid_search``: the best of ``ngrid`` points from ``lo`` to ``hi`` (numpy's ``linspace``), then the
    best of ``ngrid`` points within one coarse step of it; the first maximum wins. Writes log alpha into ``out[k]``.
    """
    k = cuda.grid(1)
    if k >= genes.shape[0]:
        return
    i = genes[k]
    t_lg = cuda.local.array(K, float64)
    t_dg = cuda.local.array(K, float64)
    t_tg = cuda.local.array(K, float64)
    m = cuda.local.array(MAXPP, float64)
    a2 = cuda.local.array(MAXPP, float64)
    a3 = cuda.local.array(MAXPP, float64)
    minv = cuda.local.array(MAXPP, float64)
    pmk = pm[k] if has_prior else 0.0
    step = (hi - lo) / (ngrid - 1)
    best = lo
    fbest = -math.inf
    for q in range(ngrid):
        v = q * step + lo if q < ngrid - 1 else hi
        fv = gene_logpost(v, y, mu, i, xx, p, False, cr, has_prior, pmk, pv, t_lg, t_dg, t_tg, m, a2, a3, minv)[0]
        if fv > fbest or q == 0:
            fbest = fv
            best = v
    delta = (step + lo) - lo
    fstep = (delta - (-delta)) / (ngrid - 1)
    center = best
    fbest = -math.inf
    for q in range(ngrid):
        off = q * fstep + (-delta) if q < ngrid - 1 else delta
        v = center + off
        fv = gene_logpost(v, y, mu, i, xx, p, False, cr, has_prior, pmk, pv, t_lg, t_dg, t_tg, m, a2, a3, minv)[0]
        if fv > fbest or q == 0:
            fbest = fv
            best = v
    out[k] = best


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
    b = cuda.local.array(MAXPP, float64)
    db = cuda.local.array(MAXPP, float64)
    res = cuda.local.array(4, float64)
    m = pm[i] if use_prior else 0.0
    fit_disp_gene(
        la0[i], y, mu, i, G, n, x, p, m, pv, use_prior, min_log_alpha, kappa_0, tol, maxit, use_cr, b, db, res
    )
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
    b = cuda.local.array(MAXPP, float64)
    m = pm[i] if use_prior else 0.0
    out[i] = fit_disp_grid_gene(y, mu, i, G, n, x, p, m, pv, use_prior, use_cr, lo, hi, ngrid, b)
