"""Negative binomial GLM (log link) fitted by IRLS for all genes at once, as R's ``fitBeta``.

Arrays are gene-major: counts ``y`` (G, n), size factors ``sf`` (n,), design ``x`` (n, p), dispersions ``alpha``
(G,). Each IRLS step solves G small p x p ridge-regularised weighted normal equations in one batched call; the
normal matrices are built with a single GEMM ``w @ xx`` where ``xx`` holds the n outer products x_i x_i^T.
Genes that diverge or do not converge within ``maxit`` iterations are refitted as R refits them, by ``optim``'s
L-BFGS-B on the log2-scale posterior (:mod:`gpuc.deseq._optim`); none is dropped.

The IRLS itself runs per gene in compiled loops where it can: on the CPU a numba kernel (``_kernels_cpu.irls``), on
the GPU one numba-cuda launch with a thread per gene (``_kernels_gpu.irls``, the same per-gene code), so that both
devices take the same steps. The batched array form is the fallback (no numba; on the GPU, designs wider than
``_kernels_gpu.MAXP`` columns or no numba-cuda).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuc._backend import Backend
from gpuc.deseq._rlinalg import linear_predictor

LN2 = float(np.log(2.0))
LOG2E = float(np.log2(np.exp(1.0)))  # R's log2(exp(1)), which scales the IRLS coefficients to log2
OPTIM_BOUND = 30.0  # R's bound on the log2 coefficients in the optim refit


def outer_rows(x: Any) -> Any:
    """(n, p*p) matrix of the row outer products of ``x``."""
    n, p = x.shape
    return (x[:, :, None] * x[:, None, :]).reshape(n, p * p)


def normal_matrix(w: Any, xx: Any, p: int) -> Any:
    """Batched X^T diag(w_g) X as (G, p, p) from weights (G, n)."""
    return (w @ xx).reshape(w.shape[0], p, p)


def nb_loglik(bk: Backend, y: Any, mu: Any, alpha: Any) -> Any:
    """Elementwise NB log-likelihood (R ``dnbinom(mu=, size=1/alpha, log=TRUE)``); ``alpha`` broadcasts as (G, 1)."""
    xp, sp = bk.xp, bk.special
    a = alpha if getattr(alpha, "ndim", 0) == mu.ndim else alpha[:, None]
    r = 1.0 / a
    amu = a * mu
    l1p = xp.log1p(amu)
    return sp.gammaln(y + r) - sp.gammaln(r) - sp.gammaln(y + 1.0) - r * l1p + y * (xp.log(amu) - l1p)


def nb_loglik_sum(bk: Backend, y: Any, mu: Any, alpha: Any) -> Any:
    """Per-gene sum of :func:`nb_loglik` over samples; zero counts handled exactly."""
    xp = bk.xp
    ll = nb_loglik(bk, y, mu, alpha)
    return xp.where(y == 0, _ll_zero(bk, mu, alpha), ll).sum(axis=1)


def _ll_zero(bk: Backend, mu: Any, alpha: Any) -> Any:
    xp = bk.xp
    a = alpha if getattr(alpha, "ndim", 0) == mu.ndim else alpha[:, None]
    return -xp.log1p(a * mu) / a


def per_gene(sf: Any) -> Any:
    """Size factors broadcastable against gene-major (G, n) arrays: one per sample (n,) as a row, or normalisation
    factors (R's ``normalizationFactors``, one per gene and sample, (G, n)) as they are.
    """
    return sf[None, :] if sf.ndim == 1 else sf


def gene_rows(sf: Any, rows: Any) -> Any:
    """The size factors of the genes ``rows`` (a slice, index or mask): all of them when they are one per sample."""
    return sf if sf.ndim == 1 else sf[rows]


def init_beta(bk: Backend, y: Any, sf: Any, x: Any) -> Any:
    """DESeq2's starting coefficients (``fitNbinomGLMs``): for a full-rank design, least squares of
    log(normalised counts + 0.1) on it by R's QR (:func:`gpuc.deseq._rlinalg.start_coefficients`); for a
    rank-deficient one (the expanded design of ``lfcShrink``), zeros with log(rowMeans(normalised counts)) on the
    intercept column, or ones without an intercept.
    """
    from gpuc.deseq._rlinalg import householder_qr, r_row_sums, start_coefficients

    xp = bk.xp
    xh = np.asarray(bk.to_host(x), dtype=np.float64)
    norm = y / per_gene(sf)
    if householder_qr(xh)[2] == xh.shape[1]:
        return start_coefficients(bk, xp.log(norm + 0.1), xh)
    intercept = np.nonzero((xh == 1.0).all(axis=0))[0]
    if intercept.shape[0] == 0:
        return xp.ones((y.shape[0], xh.shape[1]))
    beta = xp.zeros((y.shape[0], xh.shape[1]))
    beta[:, int(intercept[0])] = xp.log(r_row_sums(bk, norm, mean=True))
    return beta


@dataclass
class GLMFit:
    """Result of :func:`fit_nb_glm` (natural-log coefficients)."""

    beta: Any  # (G, p)
    cov: Any  # (G, p, p) sandwich covariance (H M H), natural log scale
    hat: Any  # (G, n) hat diagonals
    mu: Any  # (G, n) sf * exp(X beta), not floored
    deviance: Any  # (G,) -2 x R's logLike (unfloored means; floored for genes refitted by optim)
    iters: Any  # (G,)
    converged: Any  # (G,) IRLS reached the tolerance
    refit: Any  # (G,) solved by the fallback


def fit_nb_glm(bk: Backend, y: Any, sf: Any, x: Any, alpha: Any, **kwargs: Any) -> GLMFit:
    """Batched NB GLM fit (see :func:`_fit_nb_glm`); on the CPU large problems run in gene blocks."""
    from gpuc.deseq._threads import in_gene_blocks

    b0 = kwargs.pop("beta_init", None)
    xp = bk.xp

    def fit(s: slice | None) -> GLMFit:
        if s is None:
            return _fit_nb_glm(bk, y, sf, x, alpha, beta_init=b0, **kwargs)
        return _fit_nb_glm(bk, y[s], gene_rows(sf, s), x, alpha[s], beta_init=None if b0 is None else b0[s], **kwargs)

    def join(parts: list[GLMFit]) -> GLMFit:
        fields = ("beta", "cov", "hat", "mu", "deviance", "iters", "converged", "refit")
        return GLMFit(*(xp.concatenate([getattr(q, f) for q in parts]) for f in fields))

    return in_gene_blocks(bk, y.shape, fit, join)


def _fit_nb_glm(
    bk: Backend,
    y: Any,
    sf: Any,
    x: Any,
    alpha: Any,
    *,
    lambda_log2: Any = None,
    beta_init: Any = None,
    min_mu: float = 0.5,
    maxit: int = 100,
    tol: float = 1e-8,
    large: float = 30.0,
    use_fallback: bool = True,
    exact_log_like: bool = False,
) -> GLMFit:
    """Fit the NB GLM for every gene by IRLS (R ``fitBeta`` rules) with a fallback for failing genes.

    ``lambda_log2`` is the prior precision of the log2 coefficients (R's ``lambda``, default 1e-6 each); the IRLS
    takes it as the ridge ``lambda / log(2)^2`` on the natural-log scale. ``large`` bounds |beta| (natural log)
    before a gene counts as diverged. The deviance is -2 x DESeq2's ``logLike``; with ``exact_log_like`` (the
    likelihood-ratio test, a difference of two of them) R's own densities and sums on the CPU
    (:func:`r_log_likelihood`).
    """
    xp = bk.xp
    G = y.shape[0]
    p = x.shape[1]
    lambda_log2 = np.full(p, 1e-6) if lambda_log2 is None else np.asarray(bk.to_host(lambda_log2), dtype=np.float64)
    lam = xp.asarray(lambda_log2 / LN2**2)
    xx = outer_rows(x)
    ridge = xp.diag(lam)
    beta = init_beta(bk, y, sf, x) if beta_init is None else xp.array(beta_init, dtype=xp.float64)
    iters = xp.zeros(G, dtype=xp.int64)
    converged = xp.zeros(G, dtype=bool)
    failed = xp.zeros(G, dtype=bool)
    dev = xp.zeros(G)
    dev_old = xp.zeros(G)
    idx = xp.arange(G)
    logsf = xp.log(per_gene(sf))
    log_min_mu = float(np.log(min_mu))
    # the mu-free part of the log-likelihood, computed once (alpha is fixed during the fit)
    from gpuc.deseq._kernels import gpu_kernels, irls_kernel, nb_const_kernel

    kern = kconst = None
    # the GPU kernel takes one size factor per sample; normalisation factors (one per gene and sample) run the
    # array form there
    gk = gpu_kernels(bk, p, y.shape[0] * y.shape[1]) if sf.ndim == 1 else None
    if not bk.is_gpu:
        kern, kconst = irls_kernel(), nb_const_kernel()
    if gk is not None:
        # GPU: one thread per gene on sample-major counts (coalesced reads), the whole IRLS in one launch
        yt = xp.ascontiguousarray(y.T)
        alpha = xp.ascontiguousarray(alpha, dtype=xp.float64)
        ll_const = xp.empty(G)
        bk.launch(gk.nb_const, gk.blocks_for(G), gk.THREADS, yt, alpha, ll_const)
    elif kconst is not None:
        ll_const = np.empty(G)
        kconst(np.ascontiguousarray(y, dtype=np.float64), np.ascontiguousarray(alpha, dtype=np.float64), ll_const)
    else:
        rr = 1.0 / alpha[:, None]
        ll_const = (bk.special.gammaln(y + rr) - bk.special.gammaln(rr) - bk.special.gammaln(y + 1.0)).sum(axis=1)
    loga = xp.log(alpha)
    # what both compiled IRLS loops take after beta: the limits, and the per-gene outputs they fill
    limits_out = (float(min_mu), int(maxit), float(tol), float(large), iters, converged, failed, dev)
    if kern is not None:
        # R's fitBeta, one compiled pass per gene (CPU)
        beta = np.ascontiguousarray(beta, dtype=np.float64)
        kern(
            np.ascontiguousarray(y, dtype=np.float64),
            np.ascontiguousarray(per_gene(sf), dtype=np.float64),
            np.ascontiguousarray(x, dtype=np.float64),
            np.ascontiguousarray(alpha, dtype=np.float64),
            np.ascontiguousarray(ll_const, dtype=np.float64),
            np.ascontiguousarray(lam, dtype=np.float64),
            beta,
            *limits_out,
        )
        idx = idx[:0]
    elif gk is not None:
        beta = xp.ascontiguousarray(beta, dtype=xp.float64)
        bk.launch(
            gk.irls,
            gk.blocks_for(G),
            gk.THREADS,
            yt,
            xp.ascontiguousarray(sf, dtype=xp.float64),
            xp.ascontiguousarray(x, dtype=xp.float64),
            alpha,
            ll_const,
            lam,
            beta,
            *limits_out,
        )
        idx = idx[:0]
    else:
        # log(mu) with mu floored at min_mu, from the linear predictor (no log of mu needed)
        logmu = xp.maximum(beta @ x.T + logsf, log_min_mu)
        mu = xp.exp(logmu)
    for t in range(maxit):
        if idx.shape[0] == 0:
            break
        ya, mua, aa, lma = y[idx], mu[idx], alpha[idx][:, None], logmu[idx]
        w = mua / (1.0 + aa * mua)
        ls = logsf[idx] if sf.ndim == 2 else logsf
        z = lma - ls + (ya - mua) / mua
        m = normal_matrix(w, xx, p) + ridge
        b = bk.solve_batched(m, (w * z) @ x)
        iters[idx] += 1
        big = (xp.abs(b) > large).any(axis=1) | ~xp.isfinite(b).all(axis=1)
        lmn = xp.maximum(b @ x.T + ls, log_min_mu)
        mun = xp.exp(lmn)
        l1p = xp.log1p(aa * mun)
        d = -2.0 * (ll_const[idx] + (-l1p / aa + ya * (loga[idx][:, None] + lmn - l1p)).sum(axis=1))
        ct = xp.abs(d - dev_old[idx]) / (xp.abs(d) + 0.1)
        bad = big | ~xp.isfinite(ct)
        conv = (~bad) & (ct < tol) & (t > 0)
        beta[idx] = b
        mu[idx] = mun
        logmu[idx] = lmn
        dev[idx] = d
        dev_old[idx] = d
        converged[idx] = conv
        failed[idx] = bad
        idx = idx[~(conv | bad)]
    # R counts a fit stopped by a diverging coefficient or a non-finite deviance change as maxit iterations
    iters = xp.where(failed, maxit, iters)
    # R refits the genes whose IRLS used all its iterations (a diverging one counts so) or left a coefficient not
    # finite; the non-positive variances R also sends there cannot occur with the ridge in the covariance below
    refit = (iters >= maxit) | ~xp.isfinite(beta).all(axis=1)
    ridx = xp.nonzero(refit)[0] if use_fallback else idx[:0]
    if ridx.shape[0]:
        b, b_conv, ll_refit = refit_with_optim(
            bk, y[ridx], gene_rows(sf, ridx), x, alpha[ridx], beta[ridx], lambda_log2=lambda_log2, min_mu=min_mu
        )
        beta[ridx] = b
        converged[ridx] = b_conv
    cov, hat, mu_unfloored = glm_covariance(bk, sf, x, alpha, beta, lam=lam, min_mu=min_mu, xx=xx)
    # the deviance is -2 x DESeq2's logLike: the likelihood at the unfloored means (fitNbinomGLMs), except for a gene
    # refitted by optim, whose logLike fitNbinomGLMsOptim takes at the floored ones
    if exact_log_like and not bk.is_gpu:
        dev = -2.0 * r_log_likelihood(bk, y, sf, x, beta, alpha)
    else:
        # the compiled IRLS (CPU or GPU) returns the deviance at the floored means with beta (the last iteration's):
        # the same wherever no mean is below the floor
        compiled = kern is not None or gk is not None
        redo = xp.nonzero((mu_unfloored < min_mu).any(axis=1))[0] if compiled else xp.arange(G)
        if redo.shape[0]:
            dev[redo] = -2.0 * nb_loglik_sum(bk, y[redo], mu_unfloored[redo], alpha[redo])
    if ridx.shape[0]:
        dev[ridx] = -2.0 * ll_refit
    return GLMFit(beta, cov, hat, mu_unfloored, dev, iters, converged, refit)


def r_log_likelihood(bk: Backend, y: Any, sf: Any, x: Any, beta: Any, alpha: Any) -> Any:
    """DESeq2's ``nbinomLogLike`` at the coefficients ``beta`` (natural log): ``rowSums(dnbinom(counts, mu = nf *
    exp(X beta), size = 1 / alpha, log = TRUE))`` with R's density, R's order of products and R's extended-precision
    row sums, so that a difference of two (the likelihood-ratio statistic) is R's to the bit. CPU arrays.
    """
    from gpuc.deseq._optim import fitted_means, log_density_matrix
    from gpuc.deseq._rlinalg import r_row_sums

    y_h = np.ascontiguousarray(y, dtype=np.float64)
    terms = np.empty(y_h.shape)  # the means, then their log densities in place
    nf = np.broadcast_to(np.asarray(per_gene(sf), dtype=np.float64), y_h.shape)
    fitted_means(nf, np.ascontiguousarray(x, dtype=np.float64), np.ascontiguousarray(beta, dtype=np.float64), terms)
    log_density_matrix(y_h, terms, np.ascontiguousarray(alpha, dtype=np.float64), terms)
    return r_row_sums(bk, terms)


def glm_covariance(
    bk: Backend,
    sf: Any,
    x: Any,
    alpha: Any,
    beta: Any,
    *,
    lam: Any,
    min_mu: float = 0.5,
    xx: Any = None,
) -> tuple[Any, Any, Any]:
    """Sandwich covariance H M H, hat diagonals and the unfloored means at ``beta`` (W from the means floored at
    ``min_mu``).
    """
    xp = bk.xp
    p = x.shape[1]
    xx = outer_rows(x) if xx is None else xx
    mu_raw = per_gene(sf) * xp.exp(linear_predictor(bk, beta, x))
    mu = xp.maximum(mu_raw, min_mu)
    w = mu / (1.0 + alpha[:, None] * mu)
    m = normal_matrix(w, xx, p)
    h = xp.linalg.inv(m + xp.diag(lam))
    cov = h @ m @ h
    hat = w * (h.reshape(h.shape[0], p * p) @ xx.T)
    return cov, hat, mu_raw


def refit_with_optim(
    bk: Backend, y: Any, sf: Any, x: Any, alpha: Any, beta_irls: Any, *, lambda_log2: np.ndarray, min_mu: float = 0.5
) -> tuple[Any, Any, Any]:
    """R's ``fitNbinomGLMsOptim`` for genes the IRLS left unconverged: per gene, ``optim`` L-BFGS-B on the log2
    coefficients within +-30 (:func:`gpuc.deseq._optim.lbfgsb`), started from the IRLS coefficients where all are
    finite and below 30 in log2 units, else from R's QR start. Returns natural-log coefficients, whether each
    search converged (optim's code 0), which R makes the gene's ``betaConv``, and the log-likelihood at the means
    floored at ``min_mu`` (R's ``logLike`` for these genes).

    The searches run on the host one gene at a time (R's order of operations in Python); they are few.
    """
    from gpuc.deseq._optim import NegativeLogPosterior, lbfgsb

    xp = bk.xp
    G, p = y.shape[0], x.shape[1]
    y_h = np.asarray(bk.to_host(y), dtype=np.float64)
    nf_h = np.broadcast_to(np.asarray(bk.to_host(per_gene(sf)), dtype=np.float64), y.shape)
    x_h = np.asarray(bk.to_host(x), dtype=np.float64)
    alpha_h = np.asarray(bk.to_host(alpha), dtype=np.float64)
    log2_beta = LOG2E * np.asarray(bk.to_host(beta_irls), dtype=np.float64)
    usable = np.isfinite(log2_beta).all(axis=1) & (np.abs(log2_beta) < OPTIM_BOUND).all(axis=1)
    start = log2_beta.copy()
    if not usable.all():
        qr_start = np.asarray(bk.to_host(init_beta(bk, y, sf, x)), dtype=np.float64)
        start[~usable] = qr_start[~usable]
    lower, upper = np.full(p, -OPTIM_BOUND), np.full(p, OPTIM_BOUND)
    out = np.empty((G, p))
    converged = np.empty(G, dtype=bool)
    log_like = np.empty(G)
    for g in range(G):
        objective = NegativeLogPosterior(y_h[g], nf_h[g], x_h, alpha_h[g], lambda_log2)
        res = lbfgsb(objective, start[g], lower, upper)
        out[g] = res.par * LN2
        converged[g] = res.convergence == 0
        log_like[g] = objective.log_likelihood(res.par, min_mu)
    return xp.asarray(out), xp.asarray(converged), xp.asarray(log_like)
