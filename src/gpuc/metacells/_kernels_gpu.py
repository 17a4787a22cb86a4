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
* :func:`fw_kb_r`, :func:`fw_s_rows` - ``K B R`` and ``S = K A^T`` (from A's entries, no dense ``A^T``) written
  straight into the (k, n) work arrays, one thread per cell, the sums of ``_kernels_cpu.csr_times_dense``.
* :func:`fw_b_rows` - one B-step for every cell, one thread per cell: ``z = K[:, prev] R`` summed over archetypes
  in increasing order (the CPU's order), ``y <- z`` (first step) or ``y + g (z - y)`` (``_kernels_cpu.fw_b_step``).
  The archetypes whose previous pick neighbours the cell come from its slots (written by ``fw_b_cols``); the
  gradient ``y - S`` is never stored.
* :func:`fw_b_cols` - the B-step's global argmin, one block per archetype column: the column's minimum of
  ``y - S`` over all cells, lowest row on ties (numpy's first index, as ``merge_argmin``), written to ``picks[t]``;
  then the block appends its column and kernel entry to the slots of the cells in the picked row of K, so the next
  step needs no gather, no transpose and no dense ``K[:, picks]``.
* :func:`fw_kba_values` - the products whose sum is ``tr(K B A)`` for the reduced RSS, from A's entries.
* :func:`fw_columns` - the Frank-Wolfe iterates from the picks, one thread per column: the distinct picks in
  increasing order and their weights by the reference's recursion ``v <- v + g (e - v)``
  (``_kernels_cpu.frank_wolfe_columns``), optionally scattered into a dense (columns, rows) array.
* :func:`compact_columns` - the iterates' columns as a CSC matrix (indices and data from the columns' offsets).

Memory: the fit keeps two dense (archetypes, cells) float64 work arrays (the solver's ``_DeviceFit`` reuses them
through the iteration) plus per-cell arrays of T and ``SLOTS`` entries. Layouts are (archetypes, cells) for the
per-cell work arrays, so that the threads of a warp (consecutive cells)
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
# entries of z summed at a time in local memory by a cell of fw_b_rows whose neighbouring picks overflow its slots
JCHUNK = 32
# slots per cell for the archetypes whose previous pick is a kernel neighbour (fw_b_cols appends, fw_b_rows reads):
# about k nnz(K) / n^2 per cell on average; a cell with more takes fw_b_rows' slower exact path
SLOTS = 32

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
def fw_kb_r(kb_ip, kb_ix, kb_dx, r, y):  # pragma: no cover - compiled
    """``y[:, i] = (K B R)[i]`` for every cell ``i`` (one thread each): row ``i`` of the CSR ``K B`` times R, its
    entries added in stored order into zeros (``_kernels_cpu.csr_times_dense``), straight into the (k, n) ``y``.
    """
    i = cuda.grid(1)
    k = r.shape[0]
    if i >= y.shape[1]:
        return
    for j in range(k):
        y[j, i] = 0.0
    for e in range(kb_ip[i], kb_ip[i + 1]):
        v = kb_dx[e]
        m = kb_ix[e]
        for j in range(k):
            y[j, i] = y[j, i] + _mul(v, r[m, j])


@cuda.jit(cache=True)
def fw_s_rows(k_ip, k_ix, k_dx, a_ix, a_dx, a_cnt, s):  # pragma: no cover - compiled
    """``s[:, i] = (K A^T)[i]`` for every cell ``i`` (one thread each) from the sparse iterate A (column ``l``: its
    ``a_cnt[l]`` entries ``a_ix[:, l]``, ``a_dx[:, l]``): the entries of row ``i`` of K in stored order, each adding
    ``K[i, l] A[:, l]`` into zeros, the sums of ``K @ A^T`` with a dense or sparse ``A^T``
    (``_kernels_cpu.csr_times_dense``; the zeros of a dense ``A^T`` add nothing). Nothing dense ``A^T`` is needed.
    """
    i = cuda.grid(1)
    k = s.shape[0]
    if i >= s.shape[1]:
        return
    for j in range(k):
        s[j, i] = 0.0
    for e in range(k_ip[i], k_ip[i + 1]):
        v = k_dx[e]
        col = k_ix[e]
        for u in range(a_cnt[col]):
            j = a_ix[u, col]
            s[j, i] = s[j, i] + _mul(v, a_dx[u, col])


@cuda.jit(cache=True)
def fw_kba_values(kb_ip, kb_ix, kb_dx, a_ix, a_dx, a_cnt, out):  # pragma: no cover - compiled
    """The products ``(K B)[i, m] A[m, i]`` over the entries of A's column ``i`` (increasing ``m``), one thread per
    cell, into ``out[i, :a_cnt[i]]`` (zeros after): their sum is ``tr(K B A)``, the values of
    ``(K B).multiply(A^T)`` (``_kernels_cpu.elementwise_product_values``) with zeros between rows.
    """
    i = cuda.grid(1)
    if i >= out.shape[0]:
        return
    for u in range(out.shape[1]):
        out[i, u] = 0.0
    for u in range(a_cnt[i]):
        m = a_ix[u, i]
        acc = 0.0
        for e in range(kb_ip[i], kb_ip[i + 1]):
            if kb_ix[e] == m:
                acc += kb_dx[e]
        out[i, u] = _mul(acc, a_dx[u, i])


@cuda.jit(cache=True)
def fw_b_rows(slot_m, slot_v, slot_cnt, kt_ip, kt_ix, kt_dx, picks, t, r, y, gam, first):  # pragma: no cover
    """One B-step for every cell ``i`` (one thread each; (k, n) ``y``): ``z = sum_m K[prev[m], i] R[m]`` over the
    archetypes ``m`` in increasing order (``prev = picks[t - 1]``), then ``y = z`` (``first``) or
    ``y + gam (z - y)``; the gradient ``y - S`` is formed where it is read (:func:`fw_b_cols`).

    The archetypes whose previous pick is a kernel neighbour of ``i`` were appended by :func:`fw_b_cols` to the
    cell's slots (``slot_cnt[i]`` of them, in any order, with ``K[prev[m], i]``): they are sorted by ``m`` and each
    entry of ``z`` is summed over them in a register. A cell with more of them than its ``slot_m.shape[0]`` slots
    finds them all by scanning every ``m`` and looking ``prev[m]`` up in its row of ``K^T`` (CSR ``kt``, sorted
    indices: the column of K, whose values are those of the rows of K that the CPU gathers), summing
    ``JCHUNK`` entries of ``z`` at a time in local memory. The count is reset for the next step's appends.
    """
    i = cuda.grid(1)
    k = r.shape[0]
    n = y.shape[1]
    if i >= n:
        return
    cnt = slot_cnt[i]
    cap = slot_m.shape[0]
    if cnt <= cap:
        for u in range(1, cnt):  # insertion sort by archetype (the appends came in any order)
            mu = slot_m[u, i]
            vu = slot_v[u, i]
            w = u
            while w > 0 and slot_m[w - 1, i] > mu:
                slot_m[w, i] = slot_m[w - 1, i]
                slot_v[w, i] = slot_v[w - 1, i]
                w -= 1
            slot_m[w, i] = mu
            slot_v[w, i] = vu
        for j in range(k):
            z = 0.0
            for u in range(cnt):
                z = z + _mul(slot_v[u, i], r[slot_m[u, i], j])
            if first:
                y[j, i] = z
            else:
                y[j, i] = y[j, i] + _mul(z - y[j, i], gam)
    else:
        zc = cuda.local.array(JCHUNK, float64)
        lo0 = kt_ip[i]
        hi0 = kt_ip[i + 1]
        for j0 in range(0, k, JCHUNK):
            nj = min(JCHUNK, k - j0)
            for jj in range(nj):
                zc[jj] = 0.0
            for m in range(k):
                want = picks[t - 1, m]
                lo = lo0
                hi = hi0
                while lo < hi:  # first stored row index >= want
                    mid = (lo + hi) // 2
                    if kt_ix[mid] < want:
                        lo = mid + 1
                    else:
                        hi = mid
                if lo < hi0 and kt_ix[lo] == want:
                    v = kt_dx[lo]
                    for jj in range(nj):
                        zc[jj] = zc[jj] + _mul(v, r[m, j0 + jj])
            for jj in range(nj):
                if first:
                    y[j0 + jj, i] = zc[jj]
                else:
                    y[j0 + jj, i] = y[j0 + jj, i] + _mul(zc[jj] - y[j0 + jj, i], gam)
    slot_cnt[i] = 0


@cuda.jit(cache=True)
def fw_b_cols(y, s, picks, t, slot_m, slot_v, slot_cnt, k_ip, k_ix, k_dx, set_next):  # pragma: no cover - compiled
    """The argmin of each column ``j`` of the B gradient ``y - s`` (row ``j`` of the (k, n) arrays, formed here), one
    block per column: ``picks[t, j]`` is the first cell holding the column's minimum. When ``set_next``, the block
    then appends ``(j, K[picks[t, j], c])`` to the slots of every cell ``c`` in row ``picks[t, j]`` of K (an atomic
    count per cell; appends beyond the slots only count), which :func:`fw_b_rows` reads at the next step.
    """
    j = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    n = y.shape[1]
    sv = cuda.shared.array(_SHARED, float64)
    si = cuda.shared.array(_SHARED, int64)
    best = math.inf
    bi = n
    for i in range(tid, n, nt):  # increasing rows: strict < keeps the first
        v = y[j, i] - s[j, i]
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
    if tid == 0:
        picks[t, j] = new
    if set_next:
        cap = slot_m.shape[0]
        for e in range(k_ip[new] + tid, k_ip[new + 1], nt):
            c = k_ix[e]
            pos = cuda.atomic.add(slot_cnt, c, 1)
            if pos < cap:
                slot_m[pos, c] = j
                slot_v[pos, c] = k_dx[e]


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
