"""GPU kernels for the Frank-Wolfe loops of the metacell fit (numba-cuda).

Why numba-cuda: the Frank-Wolfe inner loops are long chains of tiny dependent steps (an argmin, a gathered row, a
blend) that CuPy can only express as several launches per step and per update, with host reads for the bookkeeping
(about 2,900 launches and over 100 synchronising reads per outer iteration). Written as kernels, one outer iteration
is a few launches per step and no read; written in numba-cuda they are Python that runs under numba-cuda's CUDA
simulator in CPU CI (``NUMBA_ENABLE_CUDASIM=1``), so the same source is tested there against the CPU kernels of
:mod:`gpuc.metacells._kernels_cpu` and compiled for the device on a GPU. They are launched only through
:meth:`gpuc._backend.Backend.launch` (CuPy's stream; one counted operation on the stand-in device).

Every kernel performs the floating-point operations of its CPU twin in the same order, so the picks are the CPU's:

* :func:`fw_a_cells` - the whole A-update (all T steps) for every cell, one thread per cell: the dense row of
  ``K B`` and the start ``Q a`` (from the previous A's stored entries in order, or given), then per step the argmin
  of ``Q a - (K B)^T`` (lowest index on ties) fused with the blend towards the picked row of Q
  (``_kernels_cpu.fw_a_block``).
* :func:`fw_b_rows` - one B-step for every cell, one thread per cell: ``z = K[:, prev] R`` summed over archetypes
  in increasing order (the CPU's order), ``y <- z`` (first step) or ``y + g (z - y)``, and the gradient ``y - S``
  (``_kernels_cpu.fw_b_step``).
* :func:`fw_b_cols` - the B-step's global argmin, one block per archetype column: the column's minimum over all
  cells, lowest row on ties (numpy's first index, as ``merge_argmin``), written to ``picks[t]``; then the block
  swaps its column of the gathered kernel columns ``K[:, picks]`` from the previous pick's row of K to the new one,
  so no gather and no transpose happen between steps.
* :func:`fw_columns` - the Frank-Wolfe iterates from the picks, one thread per column: the distinct picks in
  increasing order and their weights by the reference's recursion ``v <- v + g (e - v)``
  (``_kernels_cpu.frank_wolfe_columns``), optionally scattered into a dense (columns, rows) array.
* :func:`compact_columns` - the iterates' columns as a CSC matrix (indices and data from the columns' offsets).

Layouts are (archetypes, cells) for the per-cell work arrays, so that the threads of a warp (consecutive cells)
touch consecutive addresses. Products are rounded on their own (``dmul_rn``): the device compiler would otherwise
contract ``a + b * c`` into one fused multiply-add, which rounds once where the CPU rounds twice.
"""

from __future__ import annotations

import math

import numba
from numba import cuda, float64, int64

# threads per block: one per CUDA thread is a Python thread in the simulator, so few there; a power of two (the
# column argmin reduces in a tree)
SIMULATED = bool(numba.config.ENABLE_CUDASIM)
THREADS = 16 if SIMULATED else 128
COL_THREADS = 16 if SIMULATED else 256
_SHARED = 256  # static shared memory slots of fw_b_cols (>= COL_THREADS)

if SIMULATED:  # the simulator computes in Python floats: products are rounded on their own already

    def _mul(x: float, y: float) -> float:
        return x * y

else:  # pragma: no cover - compiled for a device
    from numba.cuda.libdevice import dmul_rn as _mul


def blocks_for(n: int, threads: int = THREADS) -> int:
    """Blocks of ``threads`` covering ``n`` threads (at least one)."""
    return max(1, math.ceil(n / threads))


@cuda.jit(cache=True)
def fw_a_cells(q, kb_ip, kb_ix, kb_dx, a_ix, a_dx, a_cnt, qa0, mode, qa, p, picks):  # pragma: no cover - compiled
    """All T Frank-Wolfe steps of the A-update, one thread per cell ``i`` (``qa``, ``p``: (k, n) work arrays).

    ``p[:, i]`` is row ``i`` of the CSR ``K B`` (entries added in stored order into zeros). The start ``Q a``:
    ``mode`` 0 keeps ``qa`` as given (``Q A0`` for a dense start), 1 copies ``qa0`` (uniform start), 2 sums
    ``a_dx[e, i] * q[a_ix[e, i]]`` over the previous A's ``a_cnt[i]`` entries in order from zero.
    """
    i = cuda.grid(1)
    k = q.shape[0]
    n = qa.shape[1]
    if i >= n:
        return
    for m in range(k):
        p[m, i] = 0.0
    for e in range(kb_ip[i], kb_ip[i + 1]):
        p[kb_ix[e], i] += kb_dx[e]
    if mode == 1:
        for m in range(k):
            qa[m, i] = qa0[m]
    elif mode == 2:
        for m in range(k):
            qa[m, i] = 0.0
        for e in range(a_cnt[i]):
            v = a_dx[e, i]
            row = a_ix[e, i]
            for m in range(k):
                qa[m, i] = qa[m, i] + _mul(v, q[row, m])
    n_steps = picks.shape[0]
    best = math.inf
    bi = 0
    for m in range(k):
        g = qa[m, i] - p[m, i]
        if g < best:
            best = g
            bi = m
    for t in range(n_steps):
        picks[t, i] = bi
        if t + 1 == n_steps:
            break
        gam = 2.0 / (t + 2.0)
        best = math.inf
        nb = 0
        for m in range(k):
            if t == 0:  # g = 1 replaces the iterate exactly
                v = q[bi, m]
            else:
                d = q[bi, m] - qa[m, i]
                v = qa[m, i] + _mul(d, gam)
            qa[m, i] = v
            g = v - p[m, i]
            if g < best:
                best = g
                nb = m
        bi = nb


@cuda.jit(cache=True)
def fw_b_rows(kd, r, y, s, g, gam, first):  # pragma: no cover - compiled
    """One B-step for every cell ``i`` (one thread each; (k, n) arrays): ``z = sum_m kd[m, i] R[m]`` over the
    archetypes ``m`` in increasing order (``kd[m, i] = K[prev[m], i]``), then ``y = z`` (``first``) or
    ``y + gam (z - y)``, and the gradient ``g = y - s``. ``g`` holds ``z`` while it is summed.
    """
    i = cuda.grid(1)
    k = r.shape[0]
    n = y.shape[1]
    if i >= n:
        return
    for j in range(k):
        g[j, i] = 0.0
    for m in range(k):
        v = kd[m, i]
        if v != 0.0:
            for j in range(k):
                g[j, i] = g[j, i] + _mul(v, r[m, j])
    for j in range(k):
        z = g[j, i]
        if first:
            yv = z
        else:
            yv = y[j, i] + _mul(z - y[j, i], gam)
        y[j, i] = yv
        g[j, i] = yv - s[j, i]


@cuda.jit(cache=True)
def fw_b_cols(g, picks, t, kd, k_ip, k_ix, k_dx, set_next):  # pragma: no cover - compiled
    """The argmin of each column ``j`` of the B gradient (row ``j`` of the (k, n) array ``g``), one block per column:
    ``picks[t, j]`` is the first cell holding the column's minimum. Then the block replaces its row of ``kd`` (the
    gathered ``K[:, picks[t - 1]]``, transposed) by row ``picks[t, j]`` of K when ``set_next``, else by zeros.
    """
    j = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    n = g.shape[1]
    sv = cuda.shared.array(_SHARED, float64)
    si = cuda.shared.array(_SHARED, int64)
    best = math.inf
    bi = n
    for i in range(tid, n, nt):  # increasing rows: strict < keeps the first
        v = g[j, i]
        if v < best:
            best = v
            bi = i
    sv[tid] = best
    si[tid] = bi
    cuda.syncthreads()
    step = nt // 2
    while step > 0:
        if tid < step:
            v2 = sv[tid + step]
            i2 = si[tid + step]
            if v2 < sv[tid] or (v2 == sv[tid] and i2 < si[tid]):
                sv[tid] = v2
                si[tid] = i2
        cuda.syncthreads()
        step //= 2
    new = si[0]
    if new >= n:  # no value below +inf (cannot happen for finite gradients): numpy's argmin gives 0
        new = 0
    if t > 0:
        old = picks[t - 1, j]
        for e in range(k_ip[old] + tid, k_ip[old + 1], nt):
            kd[j, k_ix[e]] = 0.0
    cuda.syncthreads()
    if tid == 0:
        picks[t, j] = new
    if set_next:
        for e in range(k_ip[new] + tid, k_ip[new + 1], nt):
            kd[j, k_ix[e]] = k_dx[e]


@cuda.jit(cache=True)
def fw_columns(picks, idx, vals, cnt, dense, write_dense):  # pragma: no cover - compiled
    """The Frank-Wolfe iterate of each column ``c`` after visiting ``picks[:, c]`` (one thread per column).

    Writes the column's distinct picks in increasing order to ``idx[:cnt[c], c]`` and their weights to
    ``vals[:cnt[c], c]`` (``v <- v - g v`` on every entry, then ``v_h <- v_h + g (1 - v_h)`` on the hit one, the
    first step setting 1), and, when ``write_dense``, ``dense[c, idx[e, c]] = vals[e, c]`` (``dense`` zeroed).
    """
    c = cuda.grid(1)
    n_steps = picks.shape[0]
    if c >= picks.shape[1]:
        return
    u = 0
    for t in range(n_steps):  # insertion into the sorted distinct list
        v = picks[t, c]
        pos = u
        while pos > 0 and idx[pos - 1, c] > v:
            pos -= 1
        if pos > 0 and idx[pos - 1, c] == v:
            continue
        e = u
        while e > pos:
            idx[e, c] = idx[e - 1, c]
            e -= 1
        idx[pos, c] = v
        u += 1
    cnt[c] = u
    for e in range(u):
        vals[e, c] = 0.0
    for t in range(n_steps):
        v = picks[t, c]
        lo = 0
        hi = u - 1
        while lo < hi:  # position of v among the sorted distinct picks
            mid = (lo + hi) // 2
            if idx[mid, c] < v:
                lo = mid + 1
            else:
                hi = mid
        if t == 0:
            vals[lo, c] = 1.0
            continue
        gam = 2.0 / (t + 2.0)
        vh = vals[lo, c]
        for e in range(u):
            vals[e, c] = vals[e, c] - _mul(vals[e, c], gam)
        vals[lo, c] = vh + _mul(gam, 1.0 - vh)
    if write_dense:
        for e in range(u):
            dense[c, idx[e, c]] = vals[e, c]


@cuda.jit(cache=True)
def compact_columns(idx, vals, indptr, out_ix, out_dx):  # pragma: no cover - compiled
    """Column ``c`` of :func:`fw_columns` written to entries ``indptr[c]:indptr[c + 1]`` of a CSC matrix's indices and
    data (one thread per column).
    """
    c = cuda.grid(1)
    if c >= indptr.shape[0] - 1:
        return
    base = indptr[c]
    for e in range(indptr[c + 1] - base):
        out_ix[base + e] = idx[e, c]
        out_dx[base + e] = vals[e, c]
