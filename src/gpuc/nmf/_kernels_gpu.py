"""GPU kernels (numba-cuda) of the batched HALS engine: one extrapolated HALS iteration in a few launches.

:func:`gpuc.nmf._hals.fit_hals_groups` on a GPU backend runs one iteration, for every active run of every rank in
the batch at once, as

1. ``A^T = V^T W_hat``: one cuSPARSE (or cuBLAS) product through CuPy;
2. :func:`half_step` on the spectra: the Gauss-Seidel sweep of every run's rows against ``A^T`` and the Gram of
   ``W_hat``, the extrapolation, and per-chunk partial Grams of the new ``H_hat``;
3. :func:`gram_finish`: the chunk partials added in a fixed block-wide tree, one block per Gram entry (Gram of
   ``H_hat`` in float64 and in the working precision for the next sweep);
4. ``C = V H_hat^T``, :func:`half_step` on the usages (also the partials of ``W_new``'s Gram and of the loss cross
   term ``<W_new, C>``) and :func:`gram_finish`;
5. :func:`step`: each run's loss ``||V||^2 - 2 <W, V H^T> + <W^T W, H H^T>``, the Ang & Gillis step rule (rise, beta,
   beta_bar, reference error), the Gram of the next ``W_hat``, and on check iterations the stopping rule, all kept
   in device arrays (``state``: live flag, converged flag, iterations, last checked loss per run);
6. :func:`restore` (extrapolated iterations only): runs whose loss rose start the next iteration from the
   unextrapolated factors.

That is eight device operations per iteration (two products, six kernel launches; five on plain iterations, which
need no restore) whatever the number of ranks, restarts and rows (on dense ``V``, one product per rank group: BLAS
may round a column differently with the width), and the host reads ``state`` (one small array) once per check window
instead of once per check. Runs that stop are frozen on the device (the kernels skip runs whose live flag is 0)
until the host takes them out of the batch at its next read, so each run stops at exactly the iteration the CPU path
stops it. :func:`gpuc.nmf._hals.nnls_refit` runs each of its sweeps as one :func:`half_step` launch.

Why numba-cuda: the kernels are Python, so CPU CI runs them under numba-cuda's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``) on the stand-in device of :mod:`gpuc._testing.standin` and compares them with the CPU
path; on a GPU they take CuPy arrays directly (``__cuda_array_interface__``) and are queued on CuPy's stream by
:meth:`gpuc._backend.Backend.launch`. The kernels are module-level and compiled with ``cache=True``.

Layout: factors are flat ``(rows, C)`` arrays; run ``r`` owns columns ``roff[r]:roff[r] + rk[r]``. Rows are cut into
``n_chunks`` contiguous chunks (the number depends on the row count only); a thread owns one (chunk, run) pair, so
every sum is per run, in a fixed order (rows in order within a chunk, then the chunks in a fixed tree whose shape
depends on the chunk count and the block size only), and a run's iterates do
not depend on which other runs share the batch. Rows within a chunk are independent for the sweep (each thread
writes only its run's columns of its rows); the ``k`` components of a row are updated in order (Gauss-Seidel). A
row's values sit in a thread-local array of ``KMAX`` (ranks above it use the array code).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float64

KMAX = 128  # largest rank the fused kernels take (the thread-local row array: 1 KB of local memory per thread)
THREADS = 128  # threads per block on a GPU
CHUNKS_GPU = 512  # row chunks per half-iteration on a GPU: with R runs, 512 R threads
CHUNKS_SIMULATOR = 2  # under the CUDA simulator each thread is a Python thread: few, long ones
RED_THREADS_GPU = 128  # threads per block summing chunk partials (gram_finish, step): 512 chunks -> 4 terms each
RED_THREADS_SIMULATOR = 2
RED_SHARED = 2 * RED_THREADS_GPU  # doubles of shared memory per reduction block (a compile-time constant: 2 KB)


def n_chunks(rows: int) -> int:
    """Row chunks of a half-iteration over ``rows`` rows (a function of the row count only, so that every partial sum,
    hence every result, is the same whatever the batch).
    """
    import numba

    return max(1, min(rows, CHUNKS_SIMULATOR if numba.config.ENABLE_CUDASIM else CHUNKS_GPU))


def reduce_threads() -> int:
    """Threads per block of the reductions (:func:`gram_finish`, :func:`step`): a power of two."""
    import numba

    return RED_THREADS_SIMULATOR if numba.config.ENABLE_CUDASIM else RED_THREADS_GPU


def grid(n_threads: int) -> tuple[int, int]:
    """``(blocks, threads)`` covering ``n_threads`` one-dimensional threads."""
    threads = min(THREADS, max(1, n_threads))
    return max(1, math.ceil(n_threads / threads)), threads


@cuda.jit(cache=True)
def half_step(q, g, xhat, xold, beta, extrap, full, eps, rk, roff, state, n_inner, nch, pnew, phat, pcross):
    """One HALS half-iteration on the rows of ``xhat`` for every live run; thread = (row chunk, run).

    For each row: ``x = sweep(xhat_row; q_row, g[r])`` (``n_inner`` Gauss-Seidel passes over the run's ``k``
    components: ``x_c <- max(eps, x_c + (q_c - sum_j x_j g_jc) / g_cc)``, components with ``g_cc <= 0`` unchanged),
    then ``xhat <- x + beta_r (x - xold)`` (``x`` when ``extrap`` is 0) and ``xold <- x``. Partial sums of the chunk
    (float64, upper triangles): ``phat[ch, r]`` the Gram of the new ``xhat``; with ``full``, also ``pnew[ch, r]`` the
    Gram of ``x`` and ``pcross[ch, r] = <x, q>``.
    """
    t = cuda.grid(1)
    n_runs = rk.shape[0]
    if t >= nch * n_runs:
        return
    ch = t // n_runs
    r = t - ch * n_runs
    if state[r, 0] == 0:
        return
    rows = xhat.shape[0]
    k = rk[r]
    o = roff[r]
    b = beta[r]
    # the row being swept; the run's Gram is read where it is (a few hundred bytes, held in L1 for the whole
    # thread), since a thread-local copy would reserve KMAX^2 doubles of local memory for every resident thread
    xl = cuda.local.array(KMAX, float64)
    for a in range(k):
        for c in range(a, k):
            phat[ch, r, a, c] = 0.0
            if full:
                pnew[ch, r, a, c] = 0.0
    s = 0.0
    for i in range(ch * rows // nch, (ch + 1) * rows // nch):
        for c in range(k):
            xl[c] = xhat[i, o + c]
        for _ in range(n_inner):
            for c in range(k):
                d = g[r, c, c]
                if d <= 0:
                    continue
                acc = 0.0
                for j in range(k):
                    acc += xl[j] * g[r, j, c]
                v = xl[c] + (q[i, o + c] - acc) / d
                # stored in the working precision; the next components see the rounded value, as on the CPU
                xhat[i, o + c] = v if v > eps else eps
                xl[c] = xhat[i, o + c]
        for c in range(k):
            xv = xhat[i, o + c]  # x in the working precision
            xh = xv + b * (xv - xold[i, o + c]) if extrap else xv
            xold[i, o + c] = xv
            xhat[i, o + c] = xh
            if full:
                s += float64(xv) * q[i, o + c]
        for a in range(k):
            ha = float64(xhat[i, o + a])
            for c in range(a, k):
                phat[ch, r, a, c] += ha * xhat[i, o + c]
        if full:
            for a in range(k):
                na = float64(xold[i, o + a])
                for c in range(a, k):
                    pnew[ch, r, a, c] += na * xold[i, o + c]
    if full:
        pcross[ch, r] = s


@cuda.jit(cache=True)
def gram_finish(part, part2, rk, state, nch, g64, gdt, g2, other, quad):
    """Chunk partials ``part (nch, R, kmax, kmax)`` (upper triangles) summed into the symmetric Grams ``g64``
    (float64) and ``gdt`` (working precision); one block per Gram entry ``(r, a, c)``, ``c >= a`` (blocks of other
    entries return at once). When ``part2`` has chunks, also ``g2`` from ``part2`` and ``quad[r, a, c]``, entry
    ``(a, c)``'s term of the loss's ``<W^T W, H H^T>`` (``other`` the other factor's Gram; doubled off the diagonal),
    which :func:`step` adds up.

    The sum over chunks is a fixed tree: thread ``t`` of the block adds chunks ``t, t + T, t + 2T...`` in order (4
    terms at 512 chunks and 128 threads), then the block halves the ``T`` partial sums pairwise in shared memory
    (:func:`_tree`). The order depends on the chunk count and the block size only, both functions of the row count,
    so a run's Gram is the same whatever the batch.
    """
    blk = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    kmax = g64.shape[1]
    r = blk // (kmax * kmax)
    e = blk - r * (kmax * kmax)
    a = e // kmax
    c = e - a * kmax
    if r >= rk.shape[0] or state[r, 0] == 0 or c < a or c >= rk[r]:
        return  # the whole block: the condition does not depend on the thread
    both = part2.shape[0] > 0
    buf = cuda.shared.array(RED_SHARED, float64)
    s = 0.0
    s2 = 0.0
    for ch in range(tid, nch, nt):
        s += part[ch, r, a, c]
        if both:
            s2 += part2[ch, r, a, c]
    buf[tid] = s
    buf[nt + tid] = s2
    _tree(buf, tid, nt, both)
    if tid == 0:
        s = buf[0]
        g64[r, a, c] = s
        g64[r, c, a] = s
        gdt[r, a, c] = s
        gdt[r, c, a] = s
        if both:
            quad[r, a, c] = s * other[r, a, c] if c == a else 2.0 * (s * other[r, a, c])
            s2 = buf[nt]
            g2[r, a, c] = s2
            g2[r, c, a] = s2


@cuda.jit(device=True, inline="always")
def _tree(buf, tid, nt, both):
    """Pairwise sums of ``buf[:nt]`` (and, with ``both``, ``buf[nt:2 nt]``) into ``buf[0]`` (``buf[nt]``): ``nt`` a
    power of two, halved each round with a barrier between rounds; every thread of the block calls it.
    """
    cuda.syncthreads()
    w = nt // 2
    while w > 0:
        if tid < w:
            buf[tid] += buf[tid + w]
            if both:
                buf[nt + tid] += buf[nt + tid + w]
        cuda.syncthreads()
        w //= 2


@cuda.jit(cache=True)
def step(
    pcross, quad, rk, nch, norm2, plain, check, it, max_iter, tol, consts, beta, beta_bar, e_prev, hist, state, rise,
    g_new, g_hat, g_what, g_what_dt,
):  # fmt: skip
    """Per run (one block per run): the loss ``e = ||V||^2 - 2 cross + quad``, the Ang & Gillis step rule and the Gram
    of the next ``W_hat`` (``g_new`` after a rise, else ``g_hat``), and on check iterations the stopping rule.

    The cross term's chunk partials are summed by the block in the fixed tree of :func:`gram_finish`; the rest runs on
    the block's first thread. ``quad[r, a, c]`` is summed over ``c`` for each row ``a``, then over the rows, in order.
    Step rule (``plain`` 0): on a rise (``e > e_prev``) ``beta /= 1.5``, ``beta_bar = old beta``, ``e_prev`` kept;
    else ``beta = min(beta_bar, 1.05 beta)``, ``beta_bar = min(1, 1.01 beta_bar)``, ``e_prev = e``; ``consts`` holds
    1.5, 1.05, 1.01, 1 in the working precision. Stopping rule: ``hist[r]`` holds the losses of the last checks,
    oldest first; a run stops when ``|hist[r, 0] - e| / max(||V||^2, 1) < tol`` (``converged``) or at ``max_iter``.
    ``state[r]`` = (live, converged, iterations, loss at the last check).
    """
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    if r >= rk.shape[0]:
        return
    if state[r, 0] == 0:
        if tid == 0:
            rise[r] = 0
        return
    buf = cuda.shared.array(RED_SHARED, float64)
    cs = 0.0
    for ch in range(tid, nch, nt):
        cs += pcross[ch, r]
    buf[tid] = cs
    _tree(buf, tid, nt, False)
    if tid != 0:
        return
    cross = buf[0]
    k = rk[r]
    qd = 0.0
    for a in range(k):
        qa = 0.0
        for c in range(a, k):
            qa += quad[r, a, c]
        qd += qa
    e = norm2 - 2.0 * cross + qd
    up = 0
    if plain:
        e_prev[r] = e
    else:
        if e > e_prev[r]:
            up = 1
            bb = beta[r]
            beta[r] = bb / consts[0]
            beta_bar[r] = bb
        else:
            beta[r] = min(beta_bar[r], beta[r] * consts[1])
            beta_bar[r] = min(consts[3], beta_bar[r] * consts[2])
            e_prev[r] = e
    rise[r] = up
    for a in range(k):
        for c in range(k):
            v = g_new[r, a, c] if up else g_hat[r, a, c]
            g_what[r, a, c] = v
            g_what_dt[r, a, c] = v
    if check:
        lag = hist.shape[1]
        old = hist[r, 0]
        done = (not math.isnan(old)) and abs(old - e) / max(norm2, 1.0) < tol
        for j in range(lag - 1):
            hist[r, j] = hist[r, j + 1]
        hist[r, lag - 1] = e
        state[r, 2] = it
        state[r, 3] = e
        if done:
            state[r, 1] = 1.0
        if done or it >= max_iter:
            state[r, 0] = 0.0


@cuda.jit(cache=True)
def restore(w, w_hat, ht, h_hat, rk, roff, rise, nch_w, nch_h):
    """Runs whose loss rose restart from the unextrapolated factors: ``w_hat <- w`` and ``h_hat <- ht`` on their
    columns; thread = (row chunk, run), ``nch_w`` chunks of the usages' rows, ``nch_h`` of the spectra's.
    """
    t = cuda.grid(1)
    n_runs = rk.shape[0]
    nch = max(nch_w, nch_h)
    if t >= nch * n_runs:
        return
    ch = t // n_runs
    r = t - ch * n_runs
    if rise[r] == 0:
        return
    k = rk[r]
    o = roff[r]
    if ch < nch_w:
        m = w.shape[0]
        for i in range(ch * m // nch_w, (ch + 1) * m // nch_w):
            for c in range(k):
                w_hat[i, o + c] = w[i, o + c]
    if ch < nch_h:
        n = ht.shape[0]
        for i in range(ch * n // nch_h, (ch + 1) * n // nch_h):
            for c in range(k):
                h_hat[i, o + c] = ht[i, o + c]


def step_constants(xp: object, dtype: object) -> object:
    """The step rule's factors (1.5, 1.05, 1.01, 1) as a device array in the working precision."""
    return xp.asarray(np.array([1.5, 1.05, 1.01, 1.0], dtype=dtype))


def usable(backend: object) -> bool:
    """Whether these kernels can run on ``backend``: on a CUDA device, or on a device with its own launcher (the
    stand-in of :mod:`gpuc._testing.standin`) when numba-cuda's simulator is on.
    """
    import numba

    from gpuc._backend import fused_kernels_usable

    return (getattr(backend, "launcher", None) is None or bool(numba.config.ENABLE_CUDASIM)) and fused_kernels_usable()
