"""Kernel archetypal analysis by alternating Frank-Wolfe, exactly as SEACells 0.3.3 (Persad et al. 2023).

A (k x n) and B (n x k) are kept sparse: after T Frank-Wolfe steps with step 2/(t+2) every column is
``sum_t w_t e_{i_t}`` with ``w_t = 2(t+1) / (T(T+1))``, so it has at most T non-zeros and is built directly from the
T argmin vectors. The updates are incremental:

* A-update: cells are independent, so they are processed in blocks; ``Q A`` (Q = B^T K B) is updated by gathering
  columns of Q (``Q (A + g(E - A)) = (1-g) Q A + g Q[:, i_t]``), never recomputed.
* B-update: ``K B R`` (R = A A^T) is updated by ``(1-g) K B R + g K[:, i_t] R`` where ``K[:, i_t]`` are the k
  gathered kernel columns, so each inner step costs O(nnz(K[:, i_t]) k + n k) instead of a full sparse product.
  On the CPU it is tracked only on the sparsity pattern of ``K A^T`` (off it the gradient is ``K B R >= 0`` and
  cannot hold a negative minimum), so for large n nothing dense n x k is kept: memory O(nnz(K A^T)).
* RSS is computed in reduced form ``||M||^2 - 2 tr(K B A) + tr(B^T K B A A^T)`` (K = M^T M): nothing n x n.

All of it is written once against ``backend.xp`` / ``backend.sparse``; only scalars (the RSS) leave the device per
iteration. On the CPU the inner loops run in fused numba kernels (:mod:`gpuc.metacells._kernels_cpu`) that perform
the same floating-point operations, so CPU and array code give identical picks (tests check both). On the GPU they
run in numba-cuda kernels (:mod:`gpuc.metacells._kernels_gpu`, driven by :class:`_DeviceFit`) with the same
operations again: a few launches per Frank-Wolfe step and two reads (B's size, the RSS) per outer iteration; the
large products stay with CuPy; the fit holds two dense (k, n) work arrays (:class:`_DeviceFit`). Without numba-cuda,
or where it cannot compile (:func:`gpuc._backend.fused_kernels_usable`), the GPU runs the array code.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuc._backend import Backend, fused_kernels_usable
from gpuc._errors import ConvergenceWarning
from gpuc._utils import numba_kernels, serial_blas


class MetacellConvergenceWarning(ConvergenceWarning):
    """The alternating fit stopped at ``max_iter`` before the RSS change fell below the threshold."""


@dataclass
class FitResult:
    """What :func:`fit` returns; arrays stay on the backend's device."""

    A: Any  # (k, n) sparse CSC, columns on the simplex
    B: Any  # (n, k) sparse CSC, columns on the simplex
    rss: list[float]  # unsquared Frobenius norm ||M - M B A||, RSS0 first
    n_iter: int
    converged: bool
    convergence_threshold: float
    archetypes: np.ndarray
    seconds_per_iter: list[float] = field(default_factory=list)


# n x k above which the CPU B-update keeps nothing dense n x k (gradient="restricted"): K A^T fills a shrinking
# share of n x k as n grows, so above this the pattern-restricted update is smaller and faster than the dense one
# (docs/benchmarks.md, metacells "Memory"). 1e7 is ~27k cells at one metacell per 75.
DENSE_GRADIENT_MAX = 10_000_000

# CPU products K X with at most this many n x k entries are written in one pass into k slots per row (16 bytes each,
# 32 MB at most); larger ones count each row's columns in a first pass (``_kernels_cpu.csr_matmat``)
DIRECT_SLOTS_MAX = 1 << 21


def fw_weights(n_steps: int) -> np.ndarray:
    """Weight of the t-th Frank-Wolfe vertex after ``n_steps`` steps with step size 2/(t+2) from any start."""
    t = np.arange(n_steps, dtype=np.float64)
    return 2.0 * (t + 1.0) / (n_steps * (n_steps + 1.0))


def _from_argmins(backend: Backend, picks: Any, shape: tuple[int, int]) -> Any:
    """Sparse CSC matrix whose column ``c`` is the Frank-Wolfe iterate after visiting ``picks[:, c]``.

    The values are replayed with the reference's floating-point recursion ``v <- v + g_t (e_t - v)`` on the
    non-zeros only (at most T per column), so they equal SEACells' dense accumulation bit for bit (hence the same
    argmax ties); mathematically they are ``sum_t w_t`` over the steps that hit the entry (see :func:`fw_weights`).
    The first step has g = 1, which makes the start irrelevant: hit entries become exactly 1, the rest exactly 0.
    """
    xp, sparse = backend.xp, backend.sparse
    fused = _fused(backend)
    if fused is not None:  # the same operations in one compiled pass
        return sparse.csc_matrix(fused.frank_wolfe_columns(picks, shape[0])[::-1], shape=shape)
    n_steps, n_cols = picks.shape
    # per column, sort its T picks (stable) and number the distinct ones: entry ids come out in CSC order
    pt = xp.ascontiguousarray(picks.T)  # (n_cols, T)
    order = xp.argsort(pt, axis=1, kind="stable")
    srt = xp.take_along_axis(pt, order, axis=1)
    new = xp.ones(srt.shape, dtype=bool)
    new[:, 1:] = srt[:, 1:] != srt[:, :-1]
    ids = (xp.cumsum(new.ravel()) - 1).reshape(srt.shape)
    inv_t = xp.empty_like(ids)
    inv_t[xp.arange(n_cols)[:, None], order] = ids
    inv = xp.ascontiguousarray(inv_t.T)  # (T, n_cols): entry hit by column c at step t
    rows = srt[new]
    indptr = xp.concatenate([xp.zeros(1, dtype=ids.dtype), xp.cumsum(new.sum(axis=1))])
    vals = xp.zeros(rows.shape[0], dtype=xp.float64)
    vals[inv[0]] = 1.0
    buf = xp.empty_like(vals)
    for t in range(1, n_steps):
        gam = 2.0 / (t + 2.0)
        hit = inv[t]
        vh = vals[hit]
        xp.multiply(vals, gam, out=buf)  # v + g (0 - v) == v - g v exactly
        vals -= buf
        vals[hit] = vh + gam * (1.0 - vh)
    return sparse.csc_matrix((vals, rows, indptr), shape=shape)


def _dense(x: Any, xp: Any) -> Any:
    return xp.ascontiguousarray(xp.asarray(x.toarray() if hasattr(x, "toarray") else x))


# the compiled Frank-Wolfe kernels (module gpuc.metacells._kernels_cpu), or None when numba is unavailable
_kernels = numba_kernels("gpuc.metacells._kernels_cpu")


def _fused(backend: Backend) -> Any:
    """The numba kernels when they are used (CPU, numba available, ``gpuc.settings.numba``), else None."""
    return None if backend.is_gpu else _kernels()


@functools.cache
def _import_gpu_kernels() -> Any:
    """:mod:`gpuc.metacells._kernels_gpu`, or None without numba-cuda or without a device (real or simulated)."""
    try:
        import numba
        from numba import cuda
    except ImportError:  # pragma: no cover - numba-cuda comes with the GPU extras
        return None
    if not numba.config.ENABLE_CUDASIM and not cuda.is_available():  # pragma: no cover - needs a device
        return None
    return importlib.import_module("gpuc.metacells._kernels_gpu")


# Under numba-cuda's CUDA simulator every CUDA thread is a Python thread: fits with more than this many
# cell x archetype x step units run the array code there instead (same picks), so that the stand-in device's
# end-to-end runs stay fast; the kernels are tested on small fits
SIMULATOR_MAX_WORK = 50_000

# cells x archetypes per block of the GPU's product Q A0 for a sparse start (a (block, k) temporary)
START_BLOCK = 1 << 22


def _gpu_kernels(backend: Backend, work: int = 0) -> Any:
    """The numba-cuda kernels when the GPU path uses them (a GPU backend, numba-cuda able to compile kernels in this
    process, :func:`gpuc._backend.fused_kernels_usable`; on a device other
    than CuPy's, such as the stand-in of :mod:`gpuc._testing.standin`, only under the CUDA simulator and for at most
    :data:`SIMULATOR_MAX_WORK` units of ``work``), else None: the GPU path then runs its array code.
    """
    if not backend.is_gpu or not fused_kernels_usable():  # no GPU, or numba-cuda cannot compile here
        return None
    kern = _import_gpu_kernels()
    if kern is None or (backend.launcher is not None and not kern.SIMULATED):
        return None
    if kern.SIMULATED and work > SIMULATOR_MAX_WORK:
        return None
    return kern


def kernel_times(backend: Backend, kmat: Any, x: Any) -> Any:
    """``K @ X`` (sparse CSR) for the CSR kernel K and a sparse X; on the CPU with numba one compiled pass equal to
    scipy's product array for array (same sums, same index order), rows in parallel.
    """
    fused = _fused(backend)
    if fused is None:
        return backend.sparse.csr_matrix(kmat @ x)
    y = backend.sparse.csr_matrix(x)
    parts = fused.csr_matmat(
        kmat.indptr, kmat.indices, kmat.data, y.indptr, y.indices, y.data, y.shape[1], DIRECT_SLOTS_MAX
    )
    return backend.sparse.csr_matrix(parts[::-1], shape=(kmat.shape[0], y.shape[1]))


def gram(backend: Backend, a: Any) -> Any:
    """``R = A A^T`` (dense k x k): from a sparse kernel, O(n T^2), when cells use few archetypes relative to k."""
    xp = backend.xp
    k, n = a.shape
    fused = _fused(backend)
    if fused is not None and k > 4 * a.nnz / max(n, 1):
        ac = backend.sparse.csc_matrix(a)
        return fused.gram_of_columns(ac.indptr, ac.indices, ac.data, k)
    at = _dense(a.T, xp)  # (n, k)
    return xp.ascontiguousarray(at.T @ at)


def gram_and_s(backend: Backend, kmat: Any, a: Any) -> tuple[Any, Any]:
    """``R = A A^T`` (dense k x k) and ``S = K A^T`` (dense n x k) for the dense-gradient B-update.

    With few archetypes per cell relative to k (large k, CPU) both come from sparse kernels, O(n T^2) and
    O(nnz(K) T); otherwise from a dense A^T (BLAS for R, one sparse x dense product for S, which is also how
    SEACells computes S).
    """
    xp = backend.xp
    k, n = a.shape
    fused = _fused(backend)
    if fused is not None and k > 4 * a.nnz / max(n, 1):
        at = backend.sparse.csr_matrix(a.T)
        at.sort_indices()
        s_mat = fused.csr_times_csr_dense(kmat.indptr, kmat.indices, kmat.data, at.indptr, at.indices, at.data, k)
        return gram(backend, a), s_mat
    at = _dense(a.T, xp)  # (n, k), shared by R and S
    if fused is not None:  # scipy's sums, rows in parallel
        return xp.ascontiguousarray(at.T @ at), fused.csr_times_dense(kmat.indptr, kmat.indices, kmat.data, at)
    return xp.ascontiguousarray(at.T @ at), xp.ascontiguousarray(xp.asarray(kmat @ at))


def kernel_gram(backend: Backend, b: Any, kb: Any) -> Any:
    """``Q = B^T K B`` (dense k x k, symmetric) from ``kb = K B``: the A-update's quadratic term and the RSS's."""
    return _dense(b.T @ kb, backend.xp)


def update_a(
    backend: Backend,
    kmat: Any,
    b: Any,
    a_prev: Any,
    n_steps: int,
    *,
    block: int = 2048,
    kb: Any = None,
    q: Any = None,
) -> Any:
    """SEACells ``_updateA``: T Frank-Wolfe steps on every column of A with B fixed.

    ``a_prev`` is a sparse (k, n) matrix, a dense (k, n) array, or ``"uniform"`` (every entry 1/k). Cells are
    independent, so they are processed in blocks of ``block`` with a (block, k) gradient buffer; the gradient
    ``Q A - P`` (Q = B^T K B, P = (K B)^T) is kept up to date by gathering rows of the symmetric Q. On the CPU the
    inner loop runs in a fused numba kernel (same operations) unless ``gpuc.settings.numba`` is False; on the GPU
    all steps of all cells run in one numba-cuda kernel (:func:`gpuc.metacells._kernels_gpu.fw_a_cells`).
    ``kb = K B`` (sparse) and ``q`` (:func:`kernel_gram`) may be passed when already computed.
    """
    xp, sparse = backend.xp, backend.sparse
    fused = _fused(backend)
    n, k = b.shape
    if kb is None:
        kb = kernel_times(backend, kmat, b)
    if q is None:
        q = kernel_gram(backend, b, kb)
    gk = _gpu_kernels(backend, n * k * n_steps)
    if gk is not None:  # all steps of all cells in one launch
        with backend.kernel_session():
            dev = _DeviceFit(backend, gk, sparse.csr_matrix(kmat), 0.0, k, n_steps)
            dev.update_a(q, kb, a_prev)
            return dev.a_result()
    picks = xp.empty((n_steps, n), dtype=xp.int64)
    a_sparse_t = None
    if not isinstance(a_prev, str) and sparse.issparse(a_prev):
        a_sparse_t = sparse.csr_matrix(a_prev.T)
    for s in range(0, n, block):
        e = min(n, s + block)
        if fused is not None:  # the rows of the block as scipy's slice and product give them, rows in parallel
            p = fused.csr_rows_dense(kb.indptr[s : e + 1], kb.indices, kb.data, k)
        else:
            p = _dense(kb[s:e], xp)  # (c, k)
        if isinstance(a_prev, str):  # uniform start: Q A0 is the same for every cell
            qa = xp.repeat((q.sum(axis=1) / k)[None, :], e - s, axis=0)
        elif a_sparse_t is not None and fused is not None:
            qa = fused.csr_times_dense(a_sparse_t.indptr[s : e + 1], a_sparse_t.indices, a_sparse_t.data, q)
        elif a_sparse_t is not None:
            qa = xp.ascontiguousarray(xp.asarray(a_sparse_t[s:e] @ q))
        else:
            qa = xp.ascontiguousarray((q @ a_prev[:, s:e]).T)
        if fused is not None:
            fused.fw_a_block(q, p, qa, picks, s)
            continue
        g = xp.empty_like(qa)
        for t in range(n_steps):
            xp.subtract(qa, p, out=g)
            amin = xp.argmin(g, axis=1)
            picks[t, s:e] = amin
            if t + 1 < n_steps:
                diff = q[amin]
                if t == 0:  # g = 1 replaces the iterate exactly (A becomes E exactly in the reference)
                    qa = diff
                    continue
                # same form as A += g (E - A): an exact row of Q stays exact (structural ties stay ties)
                diff -= qa
                diff *= 2.0 / (t + 2.0)
                qa += diff
    return _from_argmins(backend, picks, (k, n))


def _picked_kernel_columns(backend: Backend, kmat: Any, picked: Any) -> Any:
    """``K[:, picked]`` as an (n, k) CSR matrix with sorted rows (K symmetric: the picked rows, transposed)."""
    fused = _fused(backend)
    if fused is not None:
        parts = fused.picked_columns(kmat.indptr, kmat.indices, kmat.data, picked, kmat.shape[0])
        return backend.sparse.csr_matrix(parts[::-1], shape=(kmat.shape[0], len(picked)))
    ka = backend.sparse.csr_matrix(kmat[picked].T)
    ka.sort_indices()
    return ka


def _update_b_restricted(
    backend: Backend, fused: Any, kmat: Any, b_prev: Any, n_steps: int, r: Any, s_csr: Any, kb: Any = None
) -> Any:
    """The ``gradient="restricted"`` B-update of :func:`update_b` (CPU, numba kernels); ``s_csr`` is K A^T."""
    n, k = s_csr.shape
    if kb is None:
        kb = kernel_times(backend, kmat, b_prev)
    y = np.empty(s_csr.nnz)
    picks = np.empty((n_steps, k), dtype=np.int64)
    dead = ~np.asarray(r != 0).any(axis=0)  # archetypes no cell uses: K B R = 0 = K A^T in that column, argmin 0
    promoted = np.empty(0, dtype=np.int64)
    ycols = np.empty((n, 0))
    scols = np.empty((n, 0))
    s_csc = None
    for t in range(n_steps):
        x = kb if t == 0 else _picked_kernel_columns(backend, kmat, picks[t - 1])
        gam = 2.0 / (t + 1.0)
        # t = 0: y = K B_prev R; t = 1: y = K E R exactly (the first step has g = 1); then y += g (z - y)
        best, idx = fused.fw_b_step_restricted(
            y, s_csr.indptr, s_csr.indices, s_csr.data, x.indptr, x.indices, x.data, r, gam, t <= 1, k
        )
        if promoted.size:
            fused.dense_columns_step(ycols, promoted, x.indptr, x.indices, x.data, r, gam, t <= 1)
        new = np.flatnonzero((best >= 0) & ~dead)
        new = new[~np.isin(new, promoted)]
        if new.size:  # replay these columns densely from the start of the update, then keep them dense
            cols = np.empty((n, new.size))
            fused.dense_columns_step(cols, new, kb.indptr, kb.indices, kb.data, r, 0.0, True)
            for u in range(1, t + 1):
                xu = _picked_kernel_columns(backend, kmat, picks[u - 1])
                fused.dense_columns_step(cols, new, xu.indptr, xu.indices, xu.data, r, 2.0 / (u + 1.0), u == 1)
            if s_csc is None:
                s_csc = s_csr.tocsc()
            promoted = np.concatenate([promoted, new])
            ycols = np.concatenate([ycols, cols], axis=1)
            scols = np.concatenate([scols, s_csc[:, new].toarray()], axis=1)
        idx[dead] = 0
        if promoted.size:
            idx[promoted] = np.argmin(ycols - scols, axis=0)
        picks[t] = idx
    return _from_argmins(backend, picks, (n, k))


def kernel_buckets(backend: Backend, kmat: Any) -> Any:
    """K's entries grouped by the compiled B-update's row chunks (``_kernels_cpu.chunk_buckets``), or ``None`` where
    the compiled kernels are not used. A copy of K (12 bytes per stored entry) plus ``n x (N_CHUNKS + 1)`` offsets; computed
    once per fit, it serves every B-step's gather of ``K[:, picks]``.
    """
    fused = _fused(backend)
    return None if fused is None else fused.chunk_buckets(kmat.indptr, kmat.indices, kmat.data)


def _restricted_gradient(gradient: str, fused: Any, n: int, k: int) -> bool:
    """Whether the B-update uses the restricted gradient (see :func:`update_b`'s ``gradient``)."""
    return gradient == "restricted" or (gradient == "auto" and fused is not None and n * k > DENSE_GRADIENT_MAX)


def update_b(
    backend: Backend,
    kmat: Any,
    a: Any,
    b_prev: Any,
    n_steps: int,
    *,
    block: int = 1024,
    gradient: str = "auto",
    r: Any = None,
    s_mat: Any = None,
    kb: Any = None,
    kbuckets: Any = None,
) -> Any:
    """SEACells ``_updateB``: T Frank-Wolfe steps on every column of B with A fixed (``kmat`` symmetric CSR).

    The gradient is ``K B R - K A^T`` (R = A A^T). Two exact ways to find its column argmins:

    * ``gradient="restricted"`` (CPU with numba): ``K B R`` is tracked only on the stored entries of the sparse
      ``S = K A^T``. Off that pattern the gradient equals ``K B R >= 0`` (K, B, R are non-negative), so a
      negative minimum over the pattern is the column's minimum; the rare columns whose pattern minimum is
      ``>= 0`` are promoted to a dense column, replayed from the start of the update with the same operations.
      Memory O(nnz(S) + n) instead of three dense (n, k) arrays; same picks as the dense path.
    * ``gradient="dense"``: ``K B R`` is kept as a dense (n, k) array and updated with the k gathered kernel
      columns of the cells picked at each step, O(nnz(K[:, picks]) k + n k) per step, fused with the column
      argmin in one pass over row blocks of ``block`` cells; on the CPU in one numba kernel unless
      ``gpuc.settings.numba`` is False. This is the GPU code: there two numba-cuda kernels per step (every cell's
      ``K B R``, then every column's argmin of the gradient over all cells, see :mod:`gpuc.metacells._kernels_gpu`).

    ``"auto"`` picks "restricted" when the numba kernels are used and n k > ``DENSE_GRADIENT_MAX`` (large n: k
    grows with n while the kernel neighbourhoods, hence S's rows, do not), else "dense". ``r`` (and ``s_mat`` for the
    dense path) and ``kb = K B_prev`` (sparse) may be passed when already computed, and so may ``kbuckets``
    (:func:`kernel_buckets` of ``kmat``, used by the compiled dense path).
    """
    xp, sparse = backend.xp, backend.sparse
    fused = _fused(backend)
    k, n = a.shape
    if gradient not in ("auto", "dense", "restricted"):
        msg = f"gradient={gradient!r} is not valid; use 'auto', 'dense' or 'restricted'."
        raise ValueError(msg)
    if gradient == "restricted" and fused is None:
        msg = "gradient='restricted' needs the numba CPU kernels (CPU backend, gpuc.settings.numba True)."
        raise ValueError(msg)
    if _restricted_gradient(gradient, fused, n, k):
        if r is None:
            r = gram(backend, a)
        s_csr = kernel_times(backend, kmat, sparse.csr_matrix(a.T))  # K A^T on its pattern; same sums as the dense S
        return _update_b_restricted(backend, fused, kmat, b_prev, n_steps, r, s_csr, kb)
    gk = _gpu_kernels(backend, n * k * n_steps)
    if gk is not None:  # two launches per step, no read
        with backend.kernel_session():  # each array's kernel view made once, not once per step
            dev = _DeviceFit(backend, gk, sparse.csr_matrix(kmat), 0.0, k, n_steps)
            if r is None or s_mat is None:
                r = dev.set_a(a)
            else:
                dev.w2[...] = s_mat.T
            dev.update_b(kernel_times(backend, kmat, b_prev) if kb is None else kb, r)
            return dev.b_result()
    if r is None or s_mat is None:
        r, s_mat = gram_and_s(backend, kmat, a)  # A A^T (k, k) and K A^T (n, k)
    if kb is None:
        kb = kernel_times(backend, kmat, b_prev)
    picks = xp.empty((n_steps, k), dtype=xp.int64)
    if fused is not None:
        y = fused.csr_times_dense(kb.indptr, kb.indices, kb.data, r)  # K B R: (K B) is sparse, O(nnz k)
        picks[0] = fused.col_argmin_diff(y, s_mat)
        bounds, bx, bd = kernel_buckets(backend, kmat) if kbuckets is None else kbuckets
        fused.fw_b_update(y, s_mat, bounds, bx, bd, r, picks)
        return _from_argmins(backend, picks, (n, k))
    y = xp.ascontiguousarray(xp.asarray(kb @ r))  # K B R: (K B) is sparse, O(nnz k)
    cols = xp.arange(k)
    picks[0] = xp.argmin(y - s_mat, axis=0)
    gbuf = xp.empty((min(block, n), k), dtype=y.dtype)
    for t in range(1, n_steps):
        # K[:, picks] as an (n, k) CSR (K symmetric: the picked rows, transposed); multiplied by R block by block
        ka = _picked_kernel_columns(backend, kmat, picks[t - 1])
        gam = 2.0 / (t + 1.0)  # step size of step t - 1
        best_val = xp.full(k, xp.inf, dtype=y.dtype)
        best_idx = xp.zeros(k, dtype=xp.int64)
        for s0 in range(0, n, block):
            e0 = min(n, s0 + block)
            yb = y[s0:e0]
            zb = xp.asarray(ka[s0:e0] @ r)
            if t == 1:  # the first step has g = 1: B becomes E exactly, so K B R becomes K E R exactly
                yb[...] = zb
            else:  # y += g (z - y), in the reference's operation order
                zb -= yb
                zb *= gam
                yb += zb
            gb = gbuf[: e0 - s0]
            xp.subtract(yb, s_mat[s0:e0], out=gb)
            arg = xp.argmin(gb, axis=0)
            val = gb[arg, cols]
            better = val < best_val  # strict: the earlier block keeps ties (numpy's first-index rule)
            best_val = xp.where(better, val, best_val)
            best_idx = xp.where(better, arg + s0, best_idx)
        picks[t] = best_idx
    return _from_argmins(backend, picks, (n, k))


def rss_reduced(
    backend: Backend,
    kmat: Any,
    m_sq: float,
    a: Any,
    b: Any,
    *,
    squared: bool = False,
    kb: Any = None,
    r: Any = None,
    q: Any = None,
) -> float:
    """``||M - M B A||_F`` from ``||M||^2 - 2 tr(K B A) + tr(B^T K B A A^T)``; never forms anything n x n.
    ``kb = K B``, ``r = A A^T`` and ``q = B^T K B`` may be passed when already computed.
    """
    xp = backend.xp
    if kb is None:
        kb = kernel_times(backend, kmat, b)
    fused = _fused(backend)
    if fused is None:
        tr_kba = float(kb.multiply(a.T).sum())
    else:  # the same product values in the same order, summed by numpy as scipy's sum does (0.0 when empty)
        at = backend.sparse.csr_matrix(a.T)
        vals = fused.elementwise_product_values(
            kb.indptr, kb.indices, kb.data, at.indptr, at.indices, at.data, b.shape[1]
        )
        tr_kba = float(vals.sum())
    q = kernel_gram(backend, b, kb) if q is None else q
    r = _dense(a @ a.T, xp) if r is None else r
    quad = float((q * r).sum())
    val = max(m_sq - 2.0 * tr_kba + quad, 0.0)
    return val if squared else math.sqrt(val)


def one_hot_b(backend: Backend, archetypes: np.ndarray, n: int, k: int) -> Any:
    """B0: column j has a single 1 at row ``archetypes[j]`` (empty columns when fewer archetypes than k)."""
    xp = backend.xp
    m = len(archetypes)
    return backend.sparse.csc_matrix((xp.ones(m), (xp.asarray(archetypes, dtype=xp.int64), xp.arange(m))), shape=(n, k))


def _canonical(mat: Any) -> Any:
    """``mat`` marked as canonical (rows sorted within each column, none repeated), which the kernels guarantee, so
    that CuPy's sparse products skip their sorting and duplicate-summing pass; a no-op where the flag is read-only.
    """
    with contextlib.suppress(AttributeError):
        mat.has_canonical_format = True
    return mat


class _DeviceFit:
    """The alternating fit on a GPU with the kernels of :mod:`gpuc.metacells._kernels_gpu`: two scalars are read
    back to the host per outer iteration, B's number of entries (to size its arrays, just before CuPy's sparse
    product with it, which waits for the device anyway) and the RSS.

    Per outer iteration: one launch for the A-update's T steps of all cells, two for the iterate A (its entries and a
    dense ``A^T`` for ``R = A A^T``), one for ``S = K A^T`` from A's entries, one for ``K B R``, two per B-step (every
    cell's ``K B R``, then every column's argmin of the gradient over all cells, which also hands the next step the
    kernel entries of its picks), a few for the sparse B, two for ``tr(K B A)``, and the large products with CuPy
    (``K B``, ``B^T K B``, ``A A^T``). The iterates' picks, distinct rows and weights stay on the device; A becomes a
    sparse matrix once, at the end. The picks are those of the CPU kernels (same operations in the same order, ties to
    the lowest index).

    Memory: two dense (k, n) float64 work arrays, whose roles change through the iteration (the A-update's ``Q a`` and
    ``K B`` rows; then dense ``A^T`` and ``S^T``; then ``K B R`` and ``S^T``), plus per-cell arrays of T or
    ``SLOTS`` entries and a sorted copy of K's transpose; no product makes a dense (n, k) temporary
    (:func:`gpuc.metacells.metacells_peak_bytes` counts it).
    """

    def __init__(self, backend: Backend, kern: Any, kmat: Any, m_sq: float, k: int, n_steps: int) -> None:
        xp = backend.xp
        self.backend, self.kern, self.kmat, self.m_sq = backend, kern, kmat, m_sq
        n = kmat.shape[0]
        self.n, self.k, self.n_steps = n, k, n_steps
        # the two dense work arrays, (k, n) each (see the class docstring for their roles)
        self.w1 = xp.empty((k, n))
        self.w2 = xp.empty((k, n))
        self.a_picks = xp.empty((n_steps, n), dtype=xp.int64)
        self.a_idx = xp.empty((n_steps, n), dtype=xp.int64)
        self.a_vals = xp.empty((n_steps, n))
        self.a_cnt = xp.zeros(n, dtype=xp.int64)
        self.b_picks = xp.empty((n_steps, k), dtype=xp.int64)
        self.b_idx = xp.empty((n_steps, k), dtype=xp.int64)
        self.b_vals = xp.empty((n_steps, k))
        self.b_cnt = xp.zeros(k, dtype=xp.int64)
        # per cell, the archetypes whose last B-pick is a kernel neighbour, with that kernel entry (fw_b_cols appends,
        # fw_b_rows reads and resets the count); a cell with more than SLOTS looks them up in K^T instead
        self.slot_m = xp.empty((kern.SLOTS, n), dtype=xp.int32)
        self.slot_v = xp.empty((kern.SLOTS, n))
        self.slot_cnt = xp.zeros(n, dtype=xp.int32)
        self._kt: Any = None
        self.no_dense = xp.empty((1, 1))
        self.no_start = self.no_dense[0]  # the A-update's unused uniform start (one array object: one kernel view)
        self._at = self.w1.reshape(n, k)

    def _launch(self, kernel: Any, n_threads: int, *args: Any) -> None:
        self.backend.launch(kernel, self.kern.blocks_for(n_threads), self.kern.THREADS, *args)

    def _kernel_t(self) -> Any:
        """K^T as CSR with sorted indices (its rows are K's columns), built on first use."""
        if self._kt is None:
            kt = self.backend.sparse.csr_matrix(self.kmat.T)
            kt.sort_indices()
            self._kt = kt
        return self._kt

    @property
    def at(self) -> Any:
        """Dense ``A^T`` (n, k): the first work array, written by :meth:`update_a`, valid until :meth:`gram`."""
        return self._at

    def update_a(self, q: Any, kb: Any, start: Any) -> None:
        """All T steps of the A-update (``start``: ``"uniform"``, a dense (k, n) A0, a sparse (k, n) A0, or None for
        the previous A), then the iterate A: its entries and the dense ``A^T``.
        """
        xp, sparse, kern = self.backend.xp, self.backend.sparse, self.kern
        qa, p = self.w1, self.w2
        mode, qa0 = 2, self.no_start
        if isinstance(start, str):  # uniform: Q A0 is the same for every cell
            mode, qa0 = 1, q.sum(axis=1) / self.k
        elif start is not None:
            mode = 0
            if sparse.issparse(start):  # Q A0 in the order of A0's stored entries per cell, in blocks of cells
                st = sparse.csr_matrix(start.T)
                step = max(1, START_BLOCK // max(self.k, 1))
                for s0 in range(0, self.n, step):
                    qa[:, s0 : s0 + step] = (st[s0 : s0 + step] @ q).T
            else:
                xp.matmul(q, start, out=qa)
        self._launch(
            kern.fw_a_cells, self.n, q, kb.indptr, kb.indices, kb.data, self.a_idx, self.a_vals, self.a_cnt, qa0, mode,
            qa, p, self.a_picks,
        )  # fmt: skip
        at = self.at  # Q a and the K B rows are spent: the first work array takes the dense A^T
        at.fill(0.0)
        self._launch(kern.fw_columns, self.n, self.a_picks, self.a_idx, self.a_vals, self.a_cnt, at, True)

    def gram(self, *, with_s: bool = True) -> Any:
        """``R = A A^T`` (dense k x k) from the dense ``A^T`` and, ``with_s``, ``S^T = (K A^T)^T`` into the second work
        array from A's entries (the products of the CPU's dense-gradient path).
        """
        r = self.backend.xp.ascontiguousarray(self.at.T @ self.at)
        if with_s:
            kmat = self.kmat
            args = (kmat.indptr, kmat.indices, kmat.data, self.a_idx, self.a_vals, self.a_cnt, self.w2)
            self._launch(self.kern.fw_s_rows, self.n, *args)
        return r

    def set_a(self, a: Any) -> Any:
        """Take a given sparse A (k, n) for a B-update on its own (:func:`update_b`): dense ``A^T``, ``S^T`` and R."""
        xp = self.backend.xp
        self.at[...] = _dense(a.T, xp)
        r = self.backend.xp.ascontiguousarray(self.at.T @ self.at)
        self.w2[...] = (self.kmat @ self.at).T
        return r

    def update_b(self, kb: Any, r: Any) -> Any:
        """All T steps of the B-update from ``kb = K B_prev``; returns B as a CSC matrix. ``S^T`` is in the second work
        array; the first (dense ``A^T`` until now) takes ``K B R``.
        """
        kern, kmat = self.kern, self.kmat
        y, s_t = self.w1, self.w2
        self._launch(kern.fw_kb_r, self.n, kb.indptr, kb.indices, kb.data, r, y)  # K B_prev R
        kt = self._kernel_t()
        k_args = (kmat.indptr, kmat.indices, kmat.data)
        slots = (self.slot_m, self.slot_v, self.slot_cnt)
        cols = (self.k, kern.COL_THREADS)
        last = self.n_steps - 1
        self.backend.launch(kern.fw_b_cols, *cols, y, s_t, self.b_picks, 0, *slots, *k_args, last > 0)
        for t in range(1, self.n_steps):
            # t = 1: K B R becomes K E R exactly (the first step has g = 1); then y += g (z - y), g = 2 / (t + 1)
            kt_args = (kt.indptr, kt.indices, kt.data)
            self._launch(kern.fw_b_rows, self.n, *slots, *kt_args, self.b_picks, t, r, y, 2.0 / (t + 1.0), t == 1)
            self.backend.launch(kern.fw_b_cols, *cols, y, s_t, self.b_picks, t, *slots, *k_args, t < last)
        return self._b_matrix()

    def _b_matrix(self) -> Any:
        self._launch(
            self.kern.fw_columns, self.k, self.b_picks, self.b_idx, self.b_vals, self.b_cnt, self.no_dense, False
        )
        return self._compact(self.b_idx, self.b_vals, self.b_cnt, (self.n, self.k))

    def rss(self, kb: Any, q: Any, r: Any) -> float:
        """The reduced RSS from ``kb = K B``, ``q = B^T K B``, ``r = A A^T`` and A's entries: one synchronising read."""
        xp = self.backend.xp
        vals = xp.empty((self.n, self.n_steps))
        self._launch(self.kern.fw_kba_values, self.n, kb.indptr, kb.indices, kb.data, *self._a_entries(), vals)
        val = self.m_sq - 2.0 * vals.sum() + (q * r).sum()
        return math.sqrt(max(float(val), 0.0))

    def _a_entries(self) -> tuple[Any, Any, Any]:
        return self.a_idx, self.a_vals, self.a_cnt

    def _compact(self, idx: Any, vals: Any, cnt: Any, shape: tuple[int, int]) -> Any:
        """The columns of :func:`~gpuc.metacells._kernels_gpu.fw_columns` as a CSC matrix: one read (its size)."""
        xp = self.backend.xp
        indptr = xp.zeros(cnt.shape[0] + 1, dtype=xp.int32)
        xp.cumsum(cnt, out=indptr[1:])
        nnz = int(indptr[-1])
        ix, dx = xp.empty(nnz, dtype=xp.int32), xp.empty(nnz)
        self._launch(self.kern.compact_columns, cnt.shape[0], idx, vals, indptr, ix, dx)
        return _canonical(self.backend.sparse.csc_matrix((dx, ix, indptr), shape=shape))

    def a_result(self) -> Any:
        """A (k, n) as a CSC matrix."""
        return self._compact(self.a_idx, self.a_vals, self.a_cnt, (self.k, self.n))

    def b_result(self) -> Any:
        """B (n, k) of the last B-update as a CSC matrix."""
        return self._compact(self.b_idx, self.b_vals, self.b_cnt, (self.n, self.k))


def fit(
    backend: Backend,
    mmat: Any,
    archetypes: np.ndarray,
    *,
    k: int | None = None,
    a0: Any = "uniform",
    kmat: Any = None,
    max_iter: int = 100,
    min_iter: int = 10,
    convergence_epsilon: float = 1e-3,
    fw_iters: int = 50,
    block: int | None = None,
    gradient: str = "auto",
    callback: Callable[[int, float], None] | None = None,
) -> FitResult:
    """Alternating Frank-Wolfe fit of SEACells from initial archetypes.

    Parameters
    ----------
    backend
        Device backend.
    mmat
        Kernel M, (n, n) sparse symmetric, on the backend's device.
    archetypes
        Initial archetype cell positions (B0).
    k
        Number of archetypes (default ``len(archetypes)``).
    a0
        Initial assignments fed to the first A-update: dense (k, n) array (SEACells: uniform random, column
        normalised), sparse (k, n), or ``"uniform"``.
    kmat
        ``K = M M^T`` if already computed.
    max_iter, min_iter, convergence_epsilon, fw_iters
        SEACells' loop controls: stop when ``|RSS_{t-1} - RSS_t| < convergence_epsilon * RSS_0`` (after min_iter).
    block
        Cells per block in the A- and B-updates of the array code; default: cache-sized on the CPU, large on the
        GPU (the GPU kernels take every cell at once).
    gradient
        How the B-update tracks its gradient (see :func:`update_b`): "restricted" (CPU; memory O(nnz(K A^T)),
        nothing dense n x k), "dense" (the GPU code) or "auto" (restricted on the CPU above 1e7 n x k entries).
        Both give the same picks.
    callback
        Called as ``callback(iteration, rss)`` after each outer iteration.

    Returns
    -------
    :class:`FitResult`; emits :class:`MetacellConvergenceWarning` when max_iter is reached without convergence.
    """
    n = mmat.shape[0]
    k = len(archetypes) if k is None else k
    if max_iter < min_iter:
        msg = f"max_iter={max_iter} is lower than min_iter={min_iter}."
        raise ValueError(msg)
    # the BLAS products of the loop are k x k and n x k: one BLAS thread, the cores go to the compiled kernels
    # on a GPU, one kernel session for the fit: the kernels' views of the fit's arrays are made once (those of each
    # outer iteration's new products, K B, B^T K B, A A^T, once per iteration), none per Frank-Wolfe step
    with backend.kernel_session() if backend.is_gpu else serial_blas():
        if kmat is None:
            kmat = kernel_times(backend, mmat, mmat.T)
        m_sq = float((mmat.data * mmat.data).sum())
        # on the GPU few big blocks (kernel-launch bound), on the CPU cache-sized ones
        if block is not None:
            block_a = block_b = block
        elif backend.is_gpu:  # few big blocks: kernel-launch bound
            block_a = block_b = max(1, min(n, (1 << 27) // max(k, 1)))
        else:  # cache-sized blocks (~1.5 MB and ~0.8 MB of float64)
            block_a, block_b = max(32, 180_000 // max(k, 1)), max(32, 100_000 // max(k, 1))
        b = one_hot_b(backend, archetypes, n, k)
        # K B (sparse) serves the A-update, the B-update and the RSS of the same B, and B^T K B the A-update and the
        # RSS: each computed once per B
        kb = kernel_times(backend, kmat, b)
        q = kernel_gram(backend, b, kb)
        gk = _gpu_kernels(backend, n * k * fw_iters)
        if gk is not None:  # the GPU kernels: two reads (B's size, the RSS) per iteration
            dev = _DeviceFit(backend, gk, backend.sparse.csr_matrix(kmat), m_sq, k, fw_iters)
            dev.update_a(q, kb, a0)
            rss = [dev.rss(kb, q, dev.gram(with_s=False))]

            def iterate() -> float:
                nonlocal kb, q
                dev.update_a(q, kb, None)
                r = dev.gram()
                b_new = dev.update_b(kb, r)
                kb = kernel_times(backend, kmat, b_new)
                q = kernel_gram(backend, b_new, kb)
                return dev.rss(kb, q, r)

        else:
            restricted = _restricted_gradient(gradient, _fused(backend), n, k)
            kbuckets = None if restricted else kernel_buckets(backend, kmat)
            a = update_a(backend, kmat, b, a0, fw_iters, block=block_a, kb=kb, q=q)
            rss = [rss_reduced(backend, kmat, m_sq, a, b, kb=kb, q=q)]

            def iterate() -> float:
                nonlocal a, b, kb, q
                a = update_a(backend, kmat, b, a, fw_iters, block=block_a, kb=kb, q=q)
                if restricted:
                    r, s_mat = gram(backend, a), None  # the B-update builds the sparse K A^T itself
                else:
                    r, s_mat = gram_and_s(backend, kmat, a)
                b = update_b(
                    backend,
                    kmat,
                    a,
                    b,
                    fw_iters,
                    block=block_b,
                    gradient=gradient,
                    r=r,
                    s_mat=s_mat,
                    kb=kb,
                    kbuckets=kbuckets,
                )
                del s_mat
                kb = kernel_times(backend, kmat, b)
                q = kernel_gram(backend, b, kb)
                return rss_reduced(backend, kmat, m_sq, a, b, r=r, kb=kb, q=q)

        threshold = convergence_epsilon * rss[0]
        converged = False
        n_iter = 0
        secs: list[float] = []
        while (not converged and n_iter < max_iter) or n_iter < min_iter:
            t0 = time.perf_counter()
            n_iter += 1
            rss.append(iterate())
            secs.append(time.perf_counter() - t0)
            if callback is not None:
                callback(n_iter, rss[-1])
            if abs(rss[-2] - rss[-1]) < threshold:
                converged = True
        if gk is not None:
            a, b = dev.a_result(), dev.b_result()
        if not converged:
            warnings.warn(
                f"Metacells did not converge in {max_iter} iterations (last RSS change {abs(rss[-2] - rss[-1]):.3g} >= threshold {threshold:.3g}); "
                "the result is kept. Increase max_iter or convergence_epsilon.",
                MetacellConvergenceWarning,
                stacklevel=2,
            )
        return FitResult(a, b, rss, n_iter, converged, threshold, np.asarray(archetypes), secs)
