"""R's arithmetic where DESeq2's answers turn on it: least-squares fitted values (``linearModelMu``) and the row
sums, means and variances of R and matrixStats, operation for operation.

DESeq2 computes the linear-model means of the normalised counts as ``(y %*% Q) %*% t(x %*% solve(R))`` from R's
``qr(x)``: LINPACK's Householder QR (R's ``dqrdc2``), ``qr.Q`` by applying the reflections to the identity
(LINPACK ``dqrsl``), ``solve`` of the triangular factor by LU (LAPACK ``dgesv``, which on an upper-triangular matrix
with a non-zero diagonal leaves it unchanged and back-substitutes column by column) and reference-BLAS matrix
products (each entry summed in index order, no fused multiply-add). The fitted values are therefore not the
rounding of the exact projection but R's own, and the gene-wise dispersion search that starts from them turns on
their last bits (Businger & Golub 1965, "Linear least squares solutions by Householder transformations"; Dongarra
et al. 1979, LINPACK Users' Guide, ch. 9).

Everything here follows those routines' order of operations; the vector norm is the square root of the sum of
squares in index order, which is what reference BLAS 3.10+ ``dnrm2`` computes for entries between 1.5e-154 and
1.3e154 (a design matrix outside that range is refused up front by ``check_design``).

R's ``sum``, ``mean``, ``rowSums`` and ``rowMeans`` accumulate in ``long double`` (x87's 64-bit mantissa on x86)
and round once; ``mean`` adds a second pass of residuals. matrixStats' ``rowVars`` (0.63, which DESeq2's
``baseVar`` and moments estimate call) sums in double, in index order, around the double mean. The size factors,
the moments starting value of the dispersion search and ``baseMean`` come from these.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gpuc._backend import Backend

# R's qr() default tolerance for a negligible column
QR_TOL = 1e-7


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """Reference BLAS ``ddot``: the products added in index order (a cumulative sum adds in order; a plain sum would
    pair them).
    """
    if a.shape[0] == 0:
        return 0.0
    return float(np.cumsum(a * b)[-1])


def _norm(v: np.ndarray) -> float:
    """Reference BLAS (3.10+) ``dnrm2`` for entries of moderate size: the square root of the ordered sum of squares."""
    return float(np.sqrt(_dot(v, v)))


def householder_qr(x: np.ndarray, tol: float = QR_TOL) -> tuple[np.ndarray, np.ndarray, int]:
    """LINPACK's Householder QR as R's ``qr()`` runs it (``dqrdc2``, limited column pivoting).

    Returns the compact factor (R above and on the diagonal, the reflections below it), ``qraux`` and the rank.
    Columns whose remaining norm falls below ``tol`` times their original norm move to the end, as in R; callers
    here use full-rank designs only and raise otherwise.
    """
    a = np.array(x, dtype=np.float64, order="F", copy=True)
    n, p = a.shape
    qraux = np.array([_norm(a[:, j]) for j in range(p)])
    work1 = qraux.copy()
    work2 = np.where(qraux == 0.0, 1.0, qraux)
    k = p + 1
    for col in range(min(n, p)):
        while col + 1 < k and qraux[col] < work2[col] * tol:
            # a negligible column: rotate it to the end, as dqrdc2 does
            a[:, col:] = np.roll(a[:, col:], -1, axis=1)
            for arr in (qraux, work1, work2):
                arr[col:] = np.roll(arr[col:], -1)
            k -= 1
        if col == n - 1:
            continue
        nrm = _norm(a[col:, col])
        if nrm == 0.0:
            continue
        if a[col, col] != 0.0:
            nrm = abs(nrm) if a[col, col] >= 0 else -abs(nrm)
        a[col:, col] = (1.0 / nrm) * a[col:, col]
        a[col, col] = 1.0 + a[col, col]
        for j in range(col + 1, p):
            t = -_dot(a[col:, col], a[col:, j]) / a[col, col]
            a[col:, j] = a[col:, j] + t * a[col:, col]
            if qraux[j] == 0.0:
                continue
            tt = max(1.0 - (abs(a[col, j]) / qraux[j]) ** 2, 0.0)
            if abs(tt) < 1e-6:
                qraux[j] = _norm(a[col + 1 :, j])
                work1[j] = qraux[j]
            else:
                qraux[j] = qraux[j] * np.sqrt(tt)
        qraux[col] = a[col, col]
        a[col, col] = -nrm
    return a, qraux, min(k - 1, n)


def _apply_q(qr: np.ndarray, qraux: np.ndarray, rank: int, y: np.ndarray, *, transpose: bool = False) -> np.ndarray:
    """Q (or, ``transpose``, Q') times the vector ``y`` from the compact factor (LINPACK ``dqrsl``, job ``qy`` or
    ``qty``: the reflections applied last to first, or first to last).
    """
    n = qr.shape[0]
    out = np.array(y, dtype=np.float64, copy=True)
    steps = range(min(rank, n - 1))
    for j in steps if transpose else reversed(steps):
        if qraux[j] == 0.0:
            continue
        h = qr[j:, j].copy()
        h[0] = qraux[j]
        t = -_dot(h, out[j:]) / h[0]
        out[j:] = out[j:] + t * h
    return out


def least_squares_coef(x: np.ndarray, y: np.ndarray, tol: float) -> np.ndarray:
    """R's ``.Call(C_Cdqrls, x, y, tol)$coefficients`` for a full-rank ``x``: LINPACK ``dqrls`` (``dqrdc2``, then
    ``dqrsl`` forming Q'y and back-substituting ``R b = (Q'y)[:p]``), as ``glm.fit`` solves each IRLS step.
    """
    qr, qraux, rank = householder_qr(x, tol)
    p = qr.shape[1]
    if rank < p:
        msg = f"the least-squares problem has rank {rank} < {p}."
        raise np.linalg.LinAlgError(msg)
    b = _apply_q(qr, qraux, rank, y, transpose=True)[:rank]
    return back_substitute(qr[:rank, :rank], b[None, :])[0]


def back_substitute(r: Any, b: Any) -> Any:
    """Solves ``R x = b`` for the upper-triangular ``r`` (p x p, host; only its upper triangle is read) and each row
    of ``b`` (right-hand sides as rows, p columns; overwritten and returned), in the order of LINPACK ``dqrsl`` and
    reference LAPACK's ``dtrsm``: from the last unknown to the first, x_k = b_k / r_kk, then b_i - x_k r_ik for i < k.
    """
    for k in reversed(range(r.shape[0])):
        b[:, k] = b[:, k] / float(r[k, k])
        for i in range(k):
            b[:, i] = b[:, i] - b[:, k] * float(r[i, k])
    return b


def ordered_matmul(xp: Any, a: Any, b: Any) -> Any:
    """``a @ b`` as reference BLAS ``dgemm`` / ``dgemv`` form each entry: the products a_ik b_kj added in order of k,
    from zero (NumPy's and CuPy's products pair them, or fuse multiply and add). ``a``, ``b``: arrays of ``xp``.
    """
    c = xp.zeros((a.shape[0], b.shape[1]))
    for k in range(a.shape[1]):
        c = c + a[:, k : k + 1] * b[k : k + 1, :]
    return c


def qr_factors(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """R's ``qr.Q(qr(x))`` and ``qr.R(qr(x))`` of a full-rank design (``qr.Q`` applies the reflections to the
    identity's first p columns).
    """
    x = np.asarray(x, dtype=np.float64)
    n, p = x.shape
    qr, qraux, rank = householder_qr(x)
    if rank < p:
        msg = f"the design matrix has rank {rank} < {p} columns; drop or combine the confounded terms."
        raise ValueError(msg)
    eye = np.zeros((n, p))
    eye[np.arange(p), np.arange(p)] = 1.0
    q = np.column_stack([_apply_q(qr, qraux, rank, eye[:, c]) for c in range(p)])
    return q, np.triu(qr[:p, :p])


def hat_factors(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``Q`` and ``x %*% solve(R)`` of R's ``qr(x)``: the fitted values of ``v`` are ``(v Q) (x R^-1)^T``."""
    q, r = qr_factors(x)
    # solve(R) as LAPACK dgesv forms it: LU leaves an upper-triangular R as it is, then dtrsm on the identity
    r_inv = back_substitute(r, np.eye(r.shape[0])).T
    return q, ordered_matmul(np, np.asarray(x, dtype=np.float64), r_inv)


def start_coefficients(bk: Backend, v: Any, x: np.ndarray) -> Any:
    """DESeq2's starting coefficients of the GLM fit, ``t(solve(R, t(Q) %*% t(v)))`` from ``qr(x)``, for each row
    of ``v`` (genes x samples; DESeq2 passes log(normalised counts + 0.1)): Q'v summed over the samples in order
    (``dgemm``), then back substitution as LAPACK ``dgesv`` does on the upper-triangular R (``dtrsm``).
    """
    q, r = qr_factors(np.asarray(bk.to_host(x)))
    # one product on a GPU (a launch per sample would grow with the samples); equal up to rounding
    b = v @ bk.asarray(q) if bk.is_gpu else ordered_matmul(bk.xp, v, bk.asarray(q))
    return back_substitute(r, b)


def linear_predictor(bk: Backend, beta: Any, x: Any) -> Any:
    """``X beta`` for each gene's coefficients (rows of ``beta``), summed over the coefficients in order from zero,
    as reference BLAS ``dgemv``/``dgemm`` form DESeq2's ``x * beta_hat`` and ``modelMatrix %*% t(betaMatrix)``.
    """
    return ordered_matmul(bk.xp, beta, bk.asarray(x).T)


def linear_model_fit(bk: Backend, v: Any, x: np.ndarray) -> Any:
    """R's ``linearModelMu(v, x)``: least-squares fitted values of each row of ``v`` (genes x samples) on the design,
    with each entry summed in R's order (samples, then design columns), one pass over ``v`` per sample.
    """
    q, xr = hat_factors(np.asarray(bk.to_host(x)))
    return ordered_matmul(bk.xp, ordered_matmul(bk.xp, v, bk.asarray(q)), bk.asarray(xr.T))


def _extended() -> bool:
    """Whether R's ``long double`` sums can be reproduced: where NumPy's longdouble is x87's 64-bit mantissa."""
    return np.finfo(np.longdouble).nmant >= 63


def r_row_sums(bk: Backend, v: Any, *, mean: bool = False) -> Any:
    """R's ``rowSums`` (or, ``mean``, ``rowMeans``) and ``sum`` over each row: the columns added in order in
    extended precision (R accumulates in ``long double``), divided by the column count there for a mean, rounded
    once to double. A GPU's values are summed on the host (one copy of genes x samples doubles, so that the size
    factors, on which every later step depends, are the CPU's to the bit); without x87 precision (a platform whose
    long double is double) the double sum or mean.
    """
    if not _extended():
        return v.mean(axis=1) if mean else v.sum(axis=1)
    host = np.asarray(bk.to_host(v))
    acc = np.zeros(host.shape[0], dtype=np.longdouble)
    for j in range(host.shape[1]):
        acc += host[:, j]
    return bk.asarray((acc / host.shape[1] if mean else acc).astype(np.float64))


def r_col_means(bk: Backend, v: Any, *, rows: int = 4096) -> Any:
    """R's ``colMeans``: each column summed over the rows in order in extended precision, over the row count, rounded
    once (on the host, ``rows`` rows at a time; without x87 precision the double mean).
    """
    host = np.asarray(bk.to_host(v))
    if not _extended():
        return bk.asarray(host.mean(axis=0))
    acc = np.zeros(host.shape[1], dtype=np.longdouble)
    for lo in range(0, host.shape[0], rows):
        # a reduction over the leading axis adds the rows one after another, starting here from the running sums
        acc = np.add.reduce(np.vstack([acc[None, :], host[lo : lo + rows].astype(np.longdouble)]), axis=0)
    return bk.asarray((acc / host.shape[0]).astype(np.float64))


def _ordered_sum(v: np.ndarray, dtype: Any) -> Any:
    """The values added one after another from 0 in ``dtype`` (a cumulative sum adds in order; a plain sum pairs)."""
    return np.cumsum(v, dtype=dtype)[-1] if v.shape[0] else dtype(0.0)


def r_sum(v: np.ndarray) -> float:
    """R's ``sum`` of a host double vector: added in order in extended precision, rounded once."""
    return float(_ordered_sum(v, np.longdouble if _extended() else np.float64))


def r_median(v: np.ndarray) -> float:
    """R's ``median``: the middle value, or R's ``mean`` of the two middle values."""
    s = np.sort(np.asarray(v, dtype=np.float64))
    n = s.shape[0]
    half = (n + 1) // 2
    if n % 2 == 1:
        return float(s[half - 1])
    from gpuc._backend import get_backend

    return r_mean(get_backend("cpu"), s[half - 1 : half + 1])


def r_mean(bk: Backend, v: Any) -> float:
    """R's ``mean`` of a double vector: the extended-precision sum over n, then that mean corrected by the mean
    residual (R's second pass), rounded once to double.
    """
    if not _extended():
        return float(v.mean())
    x = np.asarray(bk.to_host(v), dtype=np.longdouble)
    with np.errstate(invalid="ignore"):  # an empty vector's mean is NaN, as R's
        m = _ordered_sum(x, np.longdouble) / np.longdouble(len(x))
    if np.isfinite(np.float64(m)):
        m += _ordered_sum(x - m, np.longdouble) / np.longdouble(len(x))
    return float(np.float64(m))


def r_quantile(v: np.ndarray, prob: float) -> float:
    """R's ``quantile(v, prob)`` (type 7): the order statistics at floor and ceiling of 1 + (n - 1) prob, mixed as
    ``(1 - h) * lo + h * hi`` where they differ.
    """
    x = np.sort(np.asarray(v, dtype=np.float64))
    index = 1 + max(x.shape[0] - 1, 0) * prob
    lo, hi = math.floor(index), math.ceil(index)
    q = x[lo - 1]
    if index > lo and x[hi - 1] != q:
        h = index - lo
        q = (1 - h) * q + h * x[hi - 1]
    return float(q)


def r_row_vars(xp: Any, v: Any) -> Any:
    """The ``rowVars`` of matrixStats 0.63: per row the double sum of the columns in order over n, then the double sum
    of squared deviations from it in order over n - 1.
    """
    n = v.shape[1]
    mu = xp.zeros(v.shape[0])
    for j in range(n):
        mu = mu + v[:, j]
    mu = mu / float(n)
    s2 = xp.zeros(v.shape[0])
    for j in range(n):
        d = v[:, j] - mu
        s2 = s2 + d * d
    return s2 / float(n - 1)
