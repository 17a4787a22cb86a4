"""Log fold-change shrinkage: R ``lfcShrink(type="normal")`` and an apeglm-style Cauchy prior, batched over genes."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import scipy.optimize
import scipy.special

from gpuc._backend import Backend
from gpuc.deseq._glm import LN2, fit_nb_glm, gene_rows, nb_loglik_sum, normal_matrix, outer_rows


# --------------------------------------------------------------------------------------------------------------------
# "normal": beta prior on the expanded model matrix (DESeq2 < 1.16 betaPrior=TRUE)
# --------------------------------------------------------------------------------------------------------------------
def weighted_upper_quantile_var(x: np.ndarray, w: np.ndarray, upper: float = 0.05) -> float:
    """R ``matchWeightedUpperQuantileForVariance``: (weighted 1-upper quantile of |x| / z_{1-upper/2})^2.

    The weighted quantile follows Hmisc ``wtd.quantile(type="quantile", normwt=TRUE)``.
    """
    ax = np.abs(x)
    w = w * ax.shape[0] / w.sum()
    ux, inv = np.unique(ax, return_inverse=True)
    sw = np.bincount(inv, weights=w)
    n = sw.sum()
    order = 1 + (n - 1) * (1 - upper)
    low = max(np.floor(order), 1)
    high = min(low + 1, n)
    frac = order % 1
    cs = np.cumsum(sw)

    def step(v: float) -> float:
        j = np.searchsorted(cs, v - 1e-12 * max(1.0, abs(v)), side="left")
        return float(ux[min(j, ux.shape[0] - 1)])

    q = (1 - frac) * step(low) + frac * step(high)
    return float((q / scipy.special.ndtri(1 - upper / 2)) ** 2)


def _term_columns(design: Any) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Standard design columns of each factor (treatment-coded) and of each continuous variable."""
    fac: dict[str, list[int]] = {}
    cont: dict[str, int] = {}
    for j, col in enumerate(design.columns):
        if col == "Intercept":
            continue
        m = re.fullmatch(r"(?:C\()?([A-Za-z_.][A-Za-z0-9_.]*)(?:\))?\[T\.(.+)\]", col)
        if m and m.group(1) in design.factors:
            fac.setdefault(m.group(1), []).append(j)
        elif col in design.variables:
            cont[col] = j
        else:
            msg = f"lfc_shrink='normal' supports designs of main effects (factors and numeric covariates) only, as R; column {col!r} is not one."
            raise ValueError(msg)
    return fac, cont


def _expanded_matrix(design: Any) -> tuple[np.ndarray, list[str]]:
    obs = design.obs
    cols, names = [np.ones(obs.shape[0])], ["Intercept"]
    _, cont = _term_columns(design)
    for v in design.variables:
        if v in design.factors:
            vals = obs[v].astype(str).to_numpy()
            for lvl in design.factors[v]:
                cols.append((vals == lvl).astype(np.float64))
                names.append(f"{v}[{lvl}]")
        elif v in cont:
            cols.append(design.matrix[:, cont[v]])
            names.append(v)
    return np.column_stack(cols), names


def _expanded_contrast(design: Any, c: np.ndarray, names: list[str]) -> np.ndarray:
    fac, _ = _term_columns(design)
    out = np.zeros(len(names))
    for j, w in enumerate(c):
        if w == 0:
            continue
        col = design.columns[j]
        if col == "Intercept":
            msg = "lfc_shrink='normal' needs a contrast without the intercept."
            raise ValueError(msg)
        hit = [f for f, js in fac.items() if j in js]
        if hit:
            f = hit[0]
            lvl = re.fullmatch(r".*\[T\.(.+)\]", col).group(1)  # type: ignore[union-attr]
            out[names.index(f"{f}[{lvl}]")] += w
            out[names.index(f"{f}[{design.factors[f][0]}]")] -= w
        else:
            out[names.index(col)] += w
    return out


def shrink_normal_coef(bk: Backend, fit: Any, j: int, design: Any) -> tuple[np.ndarray, np.ndarray]:
    """R ``lfcShrink(coef=, type="normal")``: zero-centred normal prior on the coefficients of the design's own
    (standard) model matrix, each with the variance matched to the upper 5% weighted quantile of its MLE
    (``estimateBetaPriorVar``; the intercept's 1e6), then a ridge NB GLM fit; returns the shrunken log2 fold change
    of column ``j`` and its SE.
    """
    _term_columns(design)  # main effects only, as R
    nz = ~fit.genes["allZero"]
    mle = fit.beta[nz] / LN2
    with np.errstate(divide="ignore"):
        weights = 1.0 / (1.0 / fit.genes["baseMean"][nz] + fit.genes["dispFit"][nz])
    prior = np.full(mle.shape[1], 1e6)
    for k, col in enumerate(design.columns):
        x = mle[:, k]
        ok = np.isfinite(x) & (np.abs(x) < 10)
        if col != "Intercept" and ok.any():
            prior[k] = weighted_upper_quantile_var(x[ok], weights[ok])
    res = fit_nb_glm(
        bk,
        bk.asarray(fit.counts[nz]),
        bk.asarray(gene_rows(fit.size_factors, nz)),
        bk.asarray(fit.design),
        bk.asarray(fit.genes["dispersion"][nz]),
        lambda_log2=1.0 / prior,
    )
    lfc = np.full(nz.shape[0], np.nan)
    se = np.full(nz.shape[0], np.nan)
    lfc[nz] = np.asarray(bk.to_host(res.beta))[:, j] / LN2
    se[nz] = np.sqrt(np.maximum(np.asarray(bk.to_host(res.cov))[:, j, j], 0)) / LN2
    return lfc, se


def shrink_normal(bk: Backend, fit: Any, c: np.ndarray, design: Any) -> tuple[np.ndarray, np.ndarray]:
    """R ``lfcShrink(contrast=, type="normal")``: zero-centred normal prior on the expanded-model coefficients, variances
    matched to the upper 5% weighted quantile of the MLE fold changes (``estimateBetaPriorVar``), then a ridge
    NB GLM fit; returns shrunken log2 fold changes and their SEs for contrast ``c``.
    """
    fac, cont = _term_columns(design)
    nz = ~fit.genes["allZero"]
    mle = fit.beta[nz] / LN2
    with np.errstate(divide="ignore"):  # a gene whose baseMean is 0 gets weight 1 / inf = 0, as in R
        weights = 1.0 / (1.0 / fit.genes["baseMean"][nz] + fit.genes["dispFit"][nz])

    def pv(x: np.ndarray) -> float:
        ok = np.isfinite(x) & (np.abs(x) < 10)
        return 1e6 if not ok.any() else weighted_upper_quantile_var(x[ok], weights[ok])

    xe, names = _expanded_matrix(design)
    prior = np.full(len(names), 1e6)
    for f, js in fac.items():
        cols = [mle[:, j] for j in js]
        for a in range(len(js)):
            for b in range(a + 1, len(js)):
                cols.append(mle[:, js[b]] - mle[:, js[a]])
        # each level coefficient of the expanded matrix gets the mean of the matched variances of the factor's
        # coefficients and of their differences (R's addAllContrasts + averagePriorsOverLevels: R's
        # priorInfo(res)$betaPriorVar shows these values)
        v = float(np.mean([pv(col) for col in cols]))
        for lvl in design.factors[f]:
            prior[names.index(f"{f}[{lvl}]")] = v
    for v_name, j in cont.items():
        prior[names.index(v_name)] = pv(mle[:, j])
    ce = _expanded_contrast(design, c, names)
    y = bk.asarray(fit.counts[nz])
    sf = bk.asarray(gene_rows(fit.size_factors, nz))
    disp = bk.asarray(fit.genes["dispersion"][nz])
    res = fit_nb_glm(bk, y, sf, bk.asarray(xe), disp, lambda_log2=1.0 / prior)
    beta = np.asarray(bk.to_host(res.beta))
    cov = np.asarray(bk.to_host(res.cov))
    lfc = np.full(nz.shape[0], np.nan)
    se = np.full(nz.shape[0], np.nan)
    lfc[nz] = beta @ ce / LN2
    se[nz] = np.sqrt(np.maximum(np.einsum("i,gij,j->g", ce, cov, ce), 0)) / LN2
    return lfc, se


# --------------------------------------------------------------------------------------------------------------------
# apeglm-style Cauchy prior
# --------------------------------------------------------------------------------------------------------------------
def prior_scale(beta: np.ndarray, se: np.ndarray) -> float:
    """Apeglm ``priorVar`` (natural-log MLE and SE): root of sum w (beta^2 - se^2 - A) with w = 1/(2 (A + se^2)^2);
    the Cauchy scale is min(sqrt(A), 1).
    """
    ok = np.isfinite(beta) & np.isfinite(se)
    b2, s2 = beta[ok] ** 2, se[ok] ** 2

    def f(a: float) -> float:
        w = 1.0 / (2.0 * (a + s2) ** 2)
        return float(np.sum(w * (b2 - s2 - a)))

    lo, hi = 1e-6, 400.0
    if f(lo) < 0:
        a = lo
    elif f(hi) > 0:
        a = hi
    else:
        a = scipy.optimize.brentq(f, lo, hi, xtol=1e-12)
    return float(min(np.sqrt(a), 1.0))


def shrink_apeglm(
    bk: Backend, fit: Any, coef: int, *, scale: float | None = None, no_shrink_scale: float = 15.0, maxit: int = 200
) -> tuple[np.ndarray, np.ndarray, float]:
    """MAP coefficients under a Cauchy(0, S) prior on coefficient ``coef`` and Normal(0, 15^2) on the others, NB
    likelihood with offset log(size factor), solved for all genes by damped Newton steps with step halving.
    SE = sqrt of the ``coef`` diagonal of the inverse Hessian, the prior curvature added on the diagonal.
    Returns log2 fold changes, SEs and the scale S (natural log).
    """
    xp = bk.xp
    if np.ndim(fit.size_factors) == 2:
        msg = "lfc_shrink='apeglm' does not take normalisation factors yet; use lfc_shrink='normal'."
        raise NotImplementedError(msg)
    nz = ~fit.genes["allZero"]
    beta_mle = fit.beta[nz]
    se_mle = np.sqrt(np.maximum(fit.cov[nz][:, coef, coef], 0))
    s = prior_scale(beta_mle[:, coef], se_mle) if scale is None else float(scale)
    x = bk.asarray(fit.design)
    p = fit.design.shape[1]
    xx = outer_rows(x)
    y = bk.asarray(fit.counts[nz])
    sf = bk.asarray(fit.size_factors)
    alpha = bk.asarray(fit.genes["dispersion"][nz])
    shrink = np.zeros(p, dtype=bool)
    shrink[coef] = True
    sh = xp.asarray(shrink)
    ns2 = no_shrink_scale**2

    def objective(b: Any, yy: Any, aa: Any) -> Any:
        # a trial step far out may overflow mu (or make it 0): its objective is then inf or NaN, and the step halving
        # rejects it (isfinite); the zero counts' NaN terms of nb_loglik are replaced in nb_loglik_sum
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            mu = sf[None, :] * xp.exp(b @ x.T)
            prior = xp.where(sh[None, :], xp.log1p((b / s) ** 2), b * b / (2 * ns2)).sum(axis=1)
            return -nb_loglik_sum(bk, yy, mu, aa) + prior

    def grad_hess(b: Any, yy: Any, aa: Any) -> tuple[Any, Any, Any]:
        mu = sf[None, :] * xp.exp(b @ x.T)
        a = aa[:, None]
        g = -((yy - mu) / (1 + a * mu)) @ x
        wobs = mu * (1 + a * yy) / (1 + a * mu) ** 2
        h = normal_matrix(wobs, xx, p)
        gp = xp.where(sh[None, :], 2 * b / (s * s + b * b), b / ns2)
        hp = xp.where(sh[None, :], 2 * (s * s - b * b) / (s * s + b * b) ** 2, 1.0 / ns2)
        return g + gp, h, hp

    beta = bk.asarray(np.where(np.isfinite(beta_mle), beta_mle, 0.0))
    G = beta.shape[0]
    f = objective(beta, y, alpha)
    idx = xp.arange(G)
    eye = xp.eye(p)
    for _ in range(maxit):
        if idx.shape[0] == 0:
            break
        b, ya, aa = beta[idx], y[idx], alpha[idx]
        g, h, hp = grad_hess(b, ya, aa)
        hmod = h + eye[None] * xp.maximum(hp, 0)[:, None, :] + 1e-10 * eye[None]
        step = -bk.solve_batched(hmod, g)
        fa = f[idx]
        scale_ = xp.ones(idx.shape[0])
        newb, fn = b, fa
        acc = xp.zeros(idx.shape[0], dtype=bool)
        for _h in range(40):
            cand = b + scale_[:, None] * step
            fc = objective(cand, ya, aa)
            ok = ~acc & xp.isfinite(fc) & (fc <= fa + 1e-12 * xp.abs(fa))
            newb = xp.where(ok[:, None], cand, newb)
            fn = xp.where(ok, fc, fn)
            acc |= ok
            if bool(acc.all()):
                break
            scale_ = xp.where(acc, scale_, scale_ * 0.5)
        beta[idx], f[idx] = newb, fn
        done = ~acc | (xp.abs(newb - b).max(axis=1) < 1e-10) | (xp.abs(fa - fn) <= 1e-12 * (xp.abs(fa) + 1))
        idx = idx[~done]
    g, h, hp = grad_hess(beta, y, alpha)
    hfull = h + eye[None] * hp[:, None, :]
    cov = xp.linalg.inv(hfull)
    se = xp.sqrt(xp.abs(cov[:, coef, coef]))
    lfc = np.full(nz.shape[0], np.nan)
    sev = np.full(nz.shape[0], np.nan)
    lfc[nz] = np.asarray(bk.to_host(beta[:, coef])) / LN2
    sev[nz] = np.asarray(bk.to_host(se)) / LN2
    return lfc, sev, s


def single_coefficient(c: np.ndarray, design: Any) -> bool:
    """The contrast is one design coefficient other than the intercept (weight 1): R's ``lfcShrink(coef=)``."""
    nzc = np.nonzero(c)[0]
    return nzc.shape[0] == 1 and c[nzc[0]] == 1 and design.columns[nzc[0]] != "Intercept"


def shrink_lfc(bk: Backend, fit: Any, c: np.ndarray, *, method: str, design: Any) -> tuple[np.ndarray, np.ndarray]:
    """Shrunken log2 fold changes and SEs for contrast ``c`` (``method`` "normal" or "apeglm"). With "normal", a
    contrast that is one design coefficient is shrunk as R's ``lfcShrink(coef=)`` (standard model matrix), any other
    as R's ``lfcShrink(contrast=)`` (expanded model matrix): R's two give different values for the same comparison.
    """
    if method == "normal":
        if single_coefficient(c, design):
            return shrink_normal_coef(bk, fit, int(np.nonzero(c)[0][0]), design)  # R's lfcShrink(coef=)
        return shrink_normal(bk, fit, c, design)
    nzc = np.nonzero(c)[0]
    if nzc.shape[0] != 1 or c[nzc[0]] != 1:
        msg = "lfc_shrink='apeglm' shrinks one design coefficient: pass contrast as a column name or [factor, level, reference level] (as apeglm's coef=)."
        raise ValueError(msg)
    lfc, se, _ = shrink_apeglm(bk, fit, int(nzc[0]))
    return lfc, se
