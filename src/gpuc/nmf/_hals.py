"""Batched HALS: many NMF restarts of one matrix fitted side by side.

Orientation: ``V`` is cells x genes (``m x n``); a run's usage ``W`` is ``m x k`` and its spectra ``H`` are ``k x n``.
The factors of all ``R`` runs are stacked component-minor as ``W: (m, R, k)`` and ``Ht: (n, R, k)`` so that one
sparse or dense product serves every run in a half-iteration (``V^T W`` is ``(n, R*k)``, ``V Ht`` is ``(m, R*k)``);
the ``k x k`` Gram matrices are batched ``(R, k, k)`` and the Gauss-Seidel sweep over components runs on all runs at
once. Runs that converge are taken out of the batch at the next check, so the others keep their own schedule and a
run's fit does not depend on which runs it was batched with.

Written once against ``backend.xp`` / ``backend.sparse``; only scalars (the losses and states of the active runs)
leave the device during a fit. The hot loop runs as fused kernels where they are available, chosen in one place
(:func:`_fused_kernels`): numba CPU kernels (:mod:`gpuc.nmf._kernels_cpu`) on the CPU, numba-cuda kernels
(:mod:`gpuc.nmf._kernels_gpu`, a few launches per iteration and one host read per check window) on the GPU.
Hand-written rather than scikit-learn's ``NMF``, which fits one restart at a time on the CPU.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuc._backend import Backend, is_sparse
from gpuc._utils import current_n_jobs, numba_kernels, serial_blas

UPDATE_ORDERS = ("usages", "spectra")
UPDATE_ORDER = "usages"  # default: scikit-learn cd's order (cNMF); see fit_hals
TOL_WINDOW = 10  # iterations over which the loss change is compared with tol
WARMUP = 5  # default plain-HALS iterations before the extrapolation starts; see fit_hals_groups
TOL = 1e-6  # default relative loss change over TOL_WINDOW iterations; see fit_hals_groups
BETA0 = 0.5  # initial extrapolation step (Ang & Gillis 2019)
LANE_MERGE = 2.0  # see _Layout.kernel_args


@dataclass(frozen=True)
class HalsOptions:
    """The HALS schedule the tools expose, passed as one object from :mod:`gpuc.tl` to the engine.

    Attributes
    ----------
    max_iter
        Iteration limit of every restart.
    tol
        A run stops when its loss changed by less than ``tol * max(||V||^2, 1)`` over the last ``TOL_WINDOW``
        iterations (checked every 5).
    extrapolate
        Ang & Gillis extrapolation after ``warmup`` plain iterations (``False``: plain HALS throughout).
    warmup
        Plain HALS iterations before the extrapolation starts.
    update_order
        ``"usages"`` first (scikit-learn's ``cd``, cNMF) or ``"spectra"`` first (bixverse).
    """

    max_iter: int = 500
    tol: float = TOL
    extrapolate: bool = True
    warmup: int = WARMUP
    update_order: str = UPDATE_ORDER

    def checked(self) -> HalsOptions:
        """The options, checked with the tools' messages (a :class:`TypeError` or :class:`ValueError` naming the
        parameter); ``tol`` as a float.
        """
        from gpuc._validate import check_bool, check_choice, check_int, check_number

        check_bool("extrapolate", self.extrapolate)
        check_int("warmup", self.warmup, minimum=0)
        check_choice("update_order", self.update_order, UPDATE_ORDERS)
        check_int("max_iter", self.max_iter, minimum=1)
        tol = check_number("tol", self.tol, low=0, low_open=True)
        return dataclasses.replace(self, tol=float(tol))

    def kwargs(self) -> dict[str, Any]:
        """The options as :func:`fit_hals_groups`'s keywords."""
        return dataclasses.asdict(self)


@dataclass
class HalsResult:
    """Factors and diagnostics of ``R`` restarts at rank ``k``.

    Attributes
    ----------
    usages
        ``(m, R, k)`` on the backend device; each usage column has unit L2 norm.
    spectra_t
        ``(n, R, k)`` on the backend device (the spectra transposed; they carry the magnitudes).
    losses
        ``(R,)`` host float64, ``||V - W H||_F^2`` at the last iteration of each run.
    n_iter
        ``(R,)`` host int, iterations run.
    converged
        ``(R,)`` host bool, whether the relative-change rule stopped the run before ``max_iter``.
    norm2
        ``||V||_F^2`` (float).
    """

    usages: Any
    spectra_t: Any
    losses: np.ndarray
    n_iter: np.ndarray
    converged: np.ndarray
    norm2: float

    @property
    def rel_errors(self) -> np.ndarray:
        """Each run's ``||V - WH||^2 / ||V||^2``."""
        return self.losses / max(self.norm2, 1e-300)

    def spectra(self, run: int) -> Any:
        """Run ``run``'s spectra as ``(k, n)``."""
        return self.spectra_t[:, run, :].T

    def usage(self, run: int) -> Any:
        """Run ``run``'s usages as ``(m, k)``."""
        return self.usages[:, run, :]

    def moved(self, move: Any) -> HalsResult:
        """The same result with ``move`` applied to the factors (e.g. ``to_host`` or ``backend.asarray``)."""
        return HalsResult(move(self.usages), move(self.spectra_t), self.losses, self.n_iter, self.converged, self.norm2)


@dataclass
class Operator:
    """``V`` prepared for a fit on one device: products with ``V`` and ``V^T`` and ``||V||^2``.

    Sparse input is held as CSR of ``V`` and CSR of ``V^T`` (= CSC of ``V``), so both products are row-parallel SpMMs.
    """

    v: Any
    vt: Any
    shape: tuple[int, int]
    norm2: float
    mean: float
    sparse: bool
    dtype: Any

    @classmethod
    def build(cls, backend: Backend, v: Any, dtype: Any = None) -> Operator:
        """Upload ``v`` (host or device, dense or sparse) once and precompute what every fit needs.

        ``dtype`` is the working precision of the data and the factors (default float32 on both devices: the
        products are memory-bound, and losses are accumulated in float64 whatever the dtype).
        """
        xp = backend.xp
        if dtype is None:
            dtype = np.float32
        if is_sparse(v):
            vd = backend.asarray(v, dtype=dtype).tocsr()
            vd.sum_duplicates()
            vt = vd.T.tocsr()
            data = vd.data
            sparse = True
        else:
            vd = xp.ascontiguousarray(backend.asarray(v, dtype=dtype))
            vt = vd.T
            data = vd
            sparse = False
        norm2 = float((data.astype(xp.float64) ** 2).sum())
        mean = float(data.astype(xp.float64).sum()) / (v.shape[0] * v.shape[1])
        return cls(vd, vt, (int(v.shape[0]), int(v.shape[1])), norm2, mean, sparse, np.dtype(dtype))

    def dot(self, x: Any) -> Any:
        """``V @ x`` for dense ``x`` of shape ``(n, c)``."""
        if not self.sparse and isinstance(self.v, np.ndarray):
            return fixed_block_matmul(self.v, x)
        return self.v @ x

    def tdot(self, x: Any) -> Any:
        """``V^T @ x`` for dense ``x`` of shape ``(m, c)``."""
        if not self.sparse and isinstance(self.vt, np.ndarray):
            return fixed_block_matmul(self.vt, x)
        return self.vt @ x

    def transposed(self) -> Operator:
        """The operator of ``V^T`` (no copy)."""
        return Operator(self.vt, self.v, (self.shape[1], self.shape[0]), self.norm2, self.mean, self.sparse, self.dtype)


# rows of dense V per BLAS call in fixed_block_matmul: the blocks, not the thread count, fix the rounding
MATMUL_BLOCK_ROWS = 256


def fixed_block_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` on the host with results that do not depend on the thread count or on concurrent calls.

    A multi-threaded BLAS GEMM splits its work by its thread count and rounds differently for each split (OpenBLAS:
    ~1e-13 relative between one and two threads), and HALS amplifies such differences into other local optima. Here
    the rows of ``a`` are cut into fixed blocks of :data:`MATMUL_BLOCK_ROWS`, each multiplied by one single-threaded
    BLAS call (BLAS held at one thread for the call: :func:`gpuc._utils.serial_blas`), and the blocks are spread over
    the call's ``n_jobs`` threads (numpy releases the GIL inside GEMM).
    """
    m = a.shape[0]
    starts = list(range(0, m, MATMUL_BLOCK_ROWS))
    n = min(current_n_jobs(), len(starts))
    out = np.empty((m, b.shape[1]), dtype=np.result_type(a, b))

    def rows(first: int) -> None:  # every n-th block from `first`
        for s0 in starts[first::n]:
            np.matmul(a[s0 : s0 + MATMUL_BLOCK_ROWS], b, out=out[s0 : s0 + MATMUL_BLOCK_ROWS])

    with serial_blas(force=True):
        if n <= 1:
            rows(0)
        else:
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                list(pool.map(rows, range(n)))
    return out


def gram(xp: Any, x: Any) -> Any:
    """Per-run Gram matrices ``(R, k, k)`` of stacked factors ``x: (rows, R, k)``."""
    xr = xp.ascontiguousarray(x.transpose(1, 0, 2))  # (R, rows, k)
    return xr.transpose(0, 2, 1) @ xr


def sweep(xp: Any, x: Any, q: Any, g: Any, eps: float) -> None:
    """One Gauss-Seidel HALS sweep over the ``k`` components of ``x: (rows, R, k)``, in place.

    Minimises ``||V - W H||^2`` over ``x`` with the other factor fixed through ``q`` (the data product, same shape as
    ``x``) and ``g`` (the other factor's per-run Gram, ``(R, k, k)``): for each component ``r`` in order,
    ``x[:, :, r] <- max(eps, x[:, :, r] + (q[:, :, r] - x g[:, :, r]) / g[:, r, r])``; components whose Gram diagonal
    is not positive are left unchanged.

    On the CPU the same update runs as one compiled loop (numba, a scanpy dependency) when it is importable: the
    vectorised form below makes ~8 passes over the factor per component.
    """
    if xp is np:
        kern = _numba_sweep()
        if kern is not None:
            kern(x, np.ascontiguousarray(q, dtype=x.dtype), np.ascontiguousarray(g, dtype=x.dtype), float(eps))
            return
    k = x.shape[2]
    diag = xp.diagonal(g, axis1=1, axis2=2)  # (R, k)
    ok = diag > 0
    inv = xp.where(ok, 1.0 / xp.where(ok, diag, 1.0), 0.0).astype(x.dtype)
    for r in range(k):
        gr = g[:, :, r]  # (R, k), symmetric Gram: column r == row r
        num = q[:, :, r] - xp.einsum("irk,rk->ir", x, gr)
        new = xp.maximum(x[:, :, r] + num * inv[None, :, r], eps)
        x[:, :, r] = xp.where(ok[None, :, r], new, x[:, :, r])


# the CPU twin of `sweep` compiled with numba, or None when numba is unavailable
_numba_sweep = numba_kernels("gpuc.nmf._kernels_cpu", "sweep")
# several of its sweeps in one pass (the refit of fixed spectra), or None
_numba_sweeps = numba_kernels("gpuc.nmf._kernels_cpu", "sweeps")


def random_init(
    seeds: Sequence[np.random.SeedSequence], m: int, n: int, k: int, mean: float, dtype: Any
) -> tuple[np.ndarray, np.ndarray]:
    """Host random starts: entries ``|N(0, 1)| * sqrt(mean(V) / k)`` (sklearn's ``init='random'``), one generator per run.

    Drawn on the host from each run's own seed so the CPU and GPU paths, and batched and single fits, start from the
    same numbers. Returns ``W0: (m, R, k)`` and ``Ht0: (n, R, k)``.
    """
    scale = np.sqrt(max(mean, 0.0) / k)
    w0 = np.empty((m, len(seeds), k), dtype=dtype)
    h0 = np.empty((n, len(seeds), k), dtype=dtype)
    for i, ss in enumerate(seeds):
        gen = np.random.default_rng(ss)
        h = np.abs(gen.standard_normal((k, n))) * scale
        w = np.abs(gen.standard_normal((m, k))) * scale
        w0[:, i, :] = w
        h0[:, i, :] = h.T
    return w0, h0


def _run_losses(xp: Any, norm2: float, w: Any, c: Any, d: Any) -> Any:
    """Per-run ``||V||^2 - 2 <W, V H^T> + <W^T W, H H^T>`` accumulated in float64 (never forms ``W H``)."""
    cross = (w * c).sum(axis=(0, 2), dtype=xp.float64)
    gw = gram(xp, w).astype(xp.float64)
    quad = (gw * d.astype(xp.float64)).sum(axis=(1, 2))
    return norm2 - 2.0 * cross + quad


def _adapt_step(xp: Any, rise: Any, e: Any, e_prev: Any, beta: Any, beta_bar: Any) -> tuple[Any, Any, Any]:
    """Ang & Gillis (2019) step rule per run: ``beta`` grows by 1.05 (capped by ``beta_bar``, which grows by 1.01 up
    to 1) while the error falls; on a rise it is divided by 1.5, ``beta_bar`` drops to the old ``beta`` and the
    reference error is kept. Returns ``(beta, beta_bar, e_prev)`` in ``beta``'s dtype (errors in theirs).
    """
    dt = beta.dtype
    beta_new = xp.where(rise, beta / 1.5, xp.minimum(beta_bar, beta * 1.05))
    beta_bar = xp.where(rise, beta, xp.minimum(1.0, beta_bar * 1.01)).astype(dt)
    return beta_new.astype(dt), beta_bar, xp.where(rise, e_prev, e)


@dataclass
class _Layout:
    """Column layout of the active runs in the flat ``(rows, C)`` factor arrays.

    Active run ``p`` (position in the active list) has rank ``ks[p]`` and owns columns ``offsets[p]:offsets[p] +
    ks[p]``; consecutive runs of one fit group (same rank) form a block ``(k, r0, nr, c0)`` whose columns, reshaped
    to ``(rows, nr, k)``, are that group's stacked factors.
    """

    ks: np.ndarray
    offsets: np.ndarray
    blocks: list[tuple[int, int, int, int]]
    col_run: np.ndarray  # (C,) active position of each column's run

    @classmethod
    def of(cls, ks: np.ndarray, gids: np.ndarray) -> _Layout:
        offsets = np.concatenate([[0], np.cumsum(ks)[:-1]]).astype(np.int64)
        blocks = []
        p = 0
        while p < len(ks):
            q = p
            while q + 1 < len(ks) and gids[q + 1] == gids[p]:
                q += 1
            blocks.append((int(ks[p]), p, q - p + 1, int(offsets[p])))
            p = q + 1
        return cls(ks, offsets, blocks, np.repeat(np.arange(len(ks)), ks))

    def columns(self, positions: np.ndarray) -> np.ndarray:
        """Flat column indices of the runs at ``positions`` (in order)."""
        if len(positions) == 0:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([self.offsets[p] + np.arange(self.ks[p]) for p in positions])

    @functools.cached_property
    def kernel_args(self) -> tuple[np.ndarray, ...]:
        """``(gk, gr0, gnr, rk, roff)`` int64 arrays for the fused CPU kernels.

        Consecutive blocks are merged into one lane group, zero-padded to its largest rank, while the padded sweep
        work ``kpad^2 * runs`` stays within ``LANE_MERGE`` times the unpadded ``sum k^2 * runs``: the kernels' per-row
        loops run SIMD across the runs of a group, and 10 runs per rank leave most of the vector width idle.
        """
        groups: list[list[int]] = []  # [kpad, r0, nr, unpadded work]
        for k, r0, nr, _ in self.blocks:
            if groups:
                kp, g0, gn, work = groups[-1]
                kpad = max(kp, k)
                if kpad * kpad * (gn + nr) <= LANE_MERGE * (work + k * k * nr):
                    groups[-1] = [kpad, g0, gn + nr, work + k * k * nr]
                    continue
            groups.append([k, r0, nr, k * k * nr])
        g = np.asarray(groups, dtype=np.int64).reshape(-1, 4)
        return g[:, 0].copy(), g[:, 1].copy(), g[:, 2].copy(), self.ks.astype(np.int64), self.offsets.astype(np.int64)


def _block(x: Any, k: int, nr: int, c0: int) -> Any:
    """Columns ``c0:c0 + nr*k`` of a flat ``(rows, C)`` array as ``(rows, nr, k)`` (a view for numpy and CuPy)."""
    return x[:, c0 : c0 + nr * k].reshape(x.shape[0], nr, k)


def _fused_kernels(backend: Backend, op: Operator, kmax: int) -> Any:
    """The fused kernel set of a fit, or ``None`` for the array code (the one place that chooses between them).

    GPU: the numba-cuda kernels of :mod:`gpuc.nmf._kernels_gpu` (a few launches per iteration, dense or sparse ``V``)
    for ranks up to their ``KMAX``. CPU with sparse ``V``: the numba kernels of :mod:`gpuc.nmf._kernels_cpu` (one
    fused pass per half-iteration: product row, sweep, extrapolation and Gram/loss terms together). Both give the
    iterates of the array code up to float rounding; ``gpuc.settings.numba = False`` switches both off.
    """
    if backend.is_gpu:
        kern = _gpu_kernels()
        if kern is not None and kern.usable(backend) and kmax <= kern.KMAX:
            return kern
        return None
    if op.sparse:
        from gpuc.nmf._hals_cpu import kernels

        return kernels()
    return None


def _gpu_kernels() -> Any:
    """:mod:`gpuc.nmf._kernels_gpu`, or ``None`` when numba-cuda is not installed or ``gpuc.settings.numba`` is off."""
    from gpuc._settings import settings

    if not settings.numba:
        return None
    return _import_gpu_kernels()


@functools.cache
def _import_gpu_kernels() -> Any:
    try:
        from gpuc.nmf import _kernels_gpu
    except ImportError:  # pragma: no cover - numba-cuda is in the GPU extras
        return None
    return _kernels_gpu


def _sweep_blocks(xp: Any, x: Any, q: Any, grams: list[Any], layout: _Layout, eps: float, inner_sweeps: int) -> None:
    """:func:`sweep` of every block of the flat ``x`` against its block of the product ``q`` and its Gram, in place."""
    for (k, _, nr, c0), g in zip(layout.blocks, grams, strict=True):
        xb = _block(x, k, nr, c0)
        qb = _block(q, k, nr, c0)
        for _ in range(inner_sweeps):
            sweep(xp, xb, qb, g, eps)
        x[:, c0 : c0 + nr * k] = xb.reshape(x.shape[0], nr * k)  # no-op for a view; writes back if reshape copied


def fit_hals(
    backend: Backend,
    op: Operator,
    k: int,
    seeds: Sequence[np.random.SeedSequence],
    **options: Any,
) -> HalsResult:
    """Fit ``len(seeds)`` random restarts of rank ``k`` to ``op`` at once (:func:`fit_hals_groups` with one group)."""
    return fit_hals_groups(backend, op, [(k, seeds)], **options)[0]


def fit_hals_groups(
    backend: Backend,
    op: Operator,
    groups: Sequence[tuple[int, Sequence[np.random.SeedSequence]]],
    *,
    max_iter: int = 500,
    tol: float = TOL,
    eps: float = 1e-10,
    check_every: int = 5,
    extrapolate: bool = True,
    warmup: int = WARMUP,
    update_order: str = UPDATE_ORDER,
    inner_sweeps: int = 1,
    progress: Any = None,
) -> list[HalsResult]:
    """Fit groups of random restarts, each group ``(k, seeds)`` of one rank, all in the same data products.

    The factors of every run of every group sit side by side in flat ``(rows, C)`` arrays, ``C = sum k * runs``, so
    one product with ``V`` and one with ``V^T`` per iteration serve all of them (a k sweep in one pass over ``V``
    instead of one per k, so the fixed cost of walking ``V``'s non-zeros is paid once). Every sum is per run, so
    each run's iterates are those of a fit of that run alone.

    One outer iteration for all active runs: ``A^T = V^T W`` (one product), per-run Grams ``W^T W``, Gauss-Seidel
    sweep of the spectra; ``C = V H^T`` (one product), Grams ``H H^T``, sweep of the usages (with ``update_order=
    "usages"`` one usage sweep from the random spectra comes first). The default schedule is ``warmup`` plain HALS
    iterations, then extrapolated ones. Every ``check_every`` iterations the per-run loss is evaluated by the Gram
    expansion in float64; a run stops when ``|loss - loss 10 iterations earlier| / max(||V||^2, 1) < tol`` and leaves
    the batch. Usage columns are returned with unit L2 norm (the spectra rows carry the scale).

    Parameters
    ----------
    backend
        Device backend.
    op
        The data, from :meth:`Operator.build`.
    groups
        ``(k, seeds)`` pairs: rank and one :class:`numpy.random.SeedSequence` per restart.
    max_iter, tol, eps, check_every
        Iteration limit, relative-change tolerance (over 10 iterations), floor of every factor entry, iterations
        between loss checks (5: a converged run leaves the batch up to 5 iterations sooner than with checks every 10,
        under the same rule).
    extrapolate
        Ang & Gillis (2019, Neural Computation 31:417) extrapolation with per-run adaptive step and restart: each
        half-iteration starts from ``x + beta (x - x_previous)``; it takes far fewer iterations than plain HALS.
        Usage columns are normalised once at the end rather than every iteration (HALS is invariant to the column
        scaling up to the ``eps`` floor); check iterations are not extrapolated, so the reported losses are those of
        the returned factors. ``False`` gives plain HALS throughout.
    warmup
        Iterations of plain HALS before the extrapolation is switched on (ignored when ``extrapolate`` is False).
        Which local optimum a random start ends in is decided in the first iterations. Plain HALS there, from the
        usages first, follows scikit-learn's ``cd`` (cNMF's solver) into the same optimum far more often than
        extrapolating from the first iteration does, so the restart-to-restart stability is cNMF's (see the
        benchmarks page). Once the basin is chosen the extrapolation converges fast.
    update_order
        ``"usages"``: the usages are updated first, from the random spectra (W, H, W, H, ...; scikit-learn's
        ``solver='cd'``, cNMF's solver); ``"spectra"``: the spectra first (H, W, H, W, ...; bixverse).
    inner_sweeps
        Gauss-Seidel sweeps per data product (Gillis & Glineur 2012: the products cost far more than a sweep, so
        repeating the cheap sweep on the same product can pay off).
    progress
        Optional progress report: an object with ``update(n)`` (``n`` iterations just done) and, optionally,
        ``criterion(value, tol)`` (at each loss check, the largest relative loss change over the last 10
        iterations among the runs still in the batch), such as :func:`gpuc._utils.iteration_progress`'s bar; or a
        callable taking ``n``.

    Returns
    -------
    One :class:`HalsResult` per group, in order.
    """
    _check_schedule(groups, warmup, update_order)
    runs = _Runs.of(groups, TOL_WINDOW, check_every)
    # plain HALS is the extrapolated scheme with the step held at zero for the whole fit
    sched = _Schedule(max_iter, tol, eps, check_every, int(warmup) if extrapolate else max_iter, inner_sweeps)
    out_w, out_h = _random_starts(backend, op, groups)
    layout = _Layout.of(runs.ks, runs.gid)
    w = backend.xp.concatenate([x.reshape(op.shape[0], -1) for x in out_w], axis=1)
    ht = backend.xp.concatenate([x.reshape(op.shape[1], -1) for x in out_h], axis=1)
    if update_order == "usages":  # one usage half-step from the random spectra (sklearn 'cd' order: W first)
        _first_usage_sweep(backend.xp, op, w, ht, layout, eps, inner_sweeps)
    fused = _fused_kernels(backend, op, int(runs.ks.max()))
    loop = _fit_groups_gpu if fused is not None and backend.is_gpu else _fit_groups_host
    loop(_Batch(backend, op, runs, sched, _Report.of(progress, tol), out_w, out_h), fused, layout, w, ht)
    return runs.results(out_w, out_h, op.norm2)


def _check_schedule(groups: Sequence[tuple[int, Sequence[Any]]], warmup: Any, update_order: str) -> None:
    """The checks of :func:`fit_hals_groups`'s arguments (the tools check them with their own messages first)."""
    if update_order not in UPDATE_ORDERS:
        msg = f"update_order={update_order!r} must be one of {UPDATE_ORDERS}."
        raise ValueError(msg)
    if isinstance(warmup, bool) or not isinstance(warmup, int | np.integer) or warmup < 0:
        msg = f"warmup={warmup!r} must be a non-negative integer (iterations of plain HALS before extrapolating)."
        raise ValueError(msg)
    if len(groups) == 0 or any(len(seeds) == 0 for _, seeds in groups):
        msg = "fit_hals_groups needs at least one group and one seed per group."
        raise ValueError(msg)


@dataclass(frozen=True)
class _Schedule:
    """The iteration schedule of a fit (see :func:`fit_hals_groups`); ``n_plain`` iterations run unextrapolated."""

    max_iter: int
    tol: float
    eps: float
    check_every: int
    n_plain: int
    inner_sweeps: int


@dataclass
class _Runs:
    """The runs of a fit, in group order, and what the fit reports per run (host arrays).

    ``ks``, ``gid`` and ``idx``: each run's rank, group and place in its group; ``losses``, ``n_iter`` and
    ``converged`` are filled as runs are checked; ``prev`` holds each run's losses at its last ``lag`` checks,
    oldest first (the stopping rule compares with the loss ``TOL_WINDOW`` iterations earlier).
    """

    ks: np.ndarray
    gid: np.ndarray
    idx: np.ndarray
    losses: np.ndarray
    n_iter: np.ndarray
    converged: np.ndarray
    prev: np.ndarray

    @classmethod
    def of(cls, groups: Sequence[tuple[int, Sequence[Any]]], window: int, check_every: int) -> _Runs:
        ks = np.concatenate([np.full(len(seeds), int(k), dtype=np.int64) for k, seeds in groups])
        gid = np.concatenate([np.full(len(seeds), g, dtype=np.int64) for g, (_, seeds) in enumerate(groups)])
        idx = np.concatenate([np.arange(len(seeds)) for _, seeds in groups])
        n = len(ks)
        lag = max(1, window // check_every)
        return cls(
            ks, gid, idx, np.full(n, np.nan), np.zeros(n, np.int64), np.zeros(n, bool), np.full((n, lag), np.nan)
        )

    def check(self, active: np.ndarray, cur: np.ndarray, it: int, norm2: float, tol: float) -> tuple[Any, Any]:
        """The stopping rule at a check of iteration ``it`` for the runs ``active`` with losses ``cur``: records the
        losses and returns ``(done, criterion)``, the runs that met ``tol`` and the largest relative change among
        the runs that have one (``None`` before the first comparison).
        """
        done = np.zeros(len(active), dtype=bool)
        old = self.prev[active, 0]
        has_prev = ~np.isnan(old)
        change = np.abs(old[has_prev] - cur[has_prev]) / max(norm2, 1.0)
        done[has_prev] = change < tol
        self.prev[active, :-1] = self.prev[active, 1:]
        self.prev[active, -1] = cur
        self.losses[active] = cur
        self.n_iter[active] = it
        self.converged[active[done]] = True
        return done, (float(change.max()) if change.size else None)

    def results(self, out_w: list[Any], out_h: list[Any], norm2: float) -> list[HalsResult]:
        """One :class:`HalsResult` per group from its output factors."""
        out = []
        for g in range(len(out_w)):
            sel = self.gid == g
            out.append(HalsResult(out_w[g], out_h[g], self.losses[sel], self.n_iter[sel], self.converged[sel], norm2))
        return out


@dataclass
class _Report:
    """Where a fit reports its progress: ``update(n)`` per iteration, ``criterion(value, tol)`` at checks."""

    update: Any = None
    criterion: Any = None
    tol: float = TOL

    @classmethod
    def of(cls, progress: Any, tol: float) -> _Report:
        if progress is None:
            return cls()
        if hasattr(progress, "update"):
            return cls(progress.update, getattr(progress, "criterion", None), tol)
        return cls(progress, None, tol)

    def iteration(self) -> None:
        if self.update is not None:
            self.update(1)

    def change(self, value: float | None) -> None:
        if self.criterion is not None and value is not None:
            self.criterion(value, self.tol)


@dataclass
class _Batch:
    """What the two iteration loops of :func:`fit_hals_groups` (host, GPU) share: the device, the data, the runs and
    their schedule, the progress report, and each group's output factors, into which finished runs go.
    """

    backend: Backend
    op: Operator
    runs: _Runs
    sched: _Schedule
    report: _Report
    out_w: list[Any]
    out_h: list[Any]

    def retire(
        self, layout: _Layout, done: np.ndarray, it: int, active: np.ndarray, w: Any, ht: Any
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """:func:`_retire_finished` at iteration ``it`` (after the last iteration, every run stops): the runs still
        active and the active positions they had (``None``, and ``active`` unchanged, when no run stopped).
        """
        final = it == self.sched.max_iter
        keep_pos = _retire_finished(
            self.backend.xp, layout, done, final, active, self.runs, w, ht, self.out_w, self.out_h
        )
        return (active, None) if keep_pos is None else (active[keep_pos], keep_pos)


def _random_starts(backend: Backend, op: Operator, groups: Sequence[tuple[int, Sequence[Any]]]) -> tuple[list, list]:
    """Each group's random starts on the device, ``(rows, R_g, k_g)``; finished runs are later written into them."""
    out_w, out_h = [], []
    for k, seeds in groups:
        w0, h0 = random_init(seeds, op.shape[0], op.shape[1], int(k), op.mean, op.dtype)
        out_w.append(backend.asarray(w0))
        out_h.append(backend.asarray(h0))
    return out_w, out_h


def _first_usage_sweep(xp: Any, op: Operator, w: Any, ht: Any, layout: _Layout, eps: float, inner: int) -> None:
    """The usage half-step from the random spectra that scikit-learn's ``cd`` order starts with, in place."""
    c0 = _product(xp, op.dot, ht, layout, op.sparse)
    d0 = [gram(xp, _block(ht, k, nr, c)) for k, _, nr, c in layout.blocks]
    _sweep_blocks(xp, w, c0, d0, layout, eps, inner)


@dataclass
class _Extrapolated:
    """The fields both loops' states start with: the flat factors ``w`` ``(rows, C)`` and ``ht`` ``(cols, C)``, their
    extrapolated points ``w_hat``, ``h_hat``, and per run the step ``beta``, its cap ``beta_bar`` and the previous
    error ``e_prev``.
    """

    w: Any
    ht: Any
    w_hat: Any
    h_hat: Any
    beta: Any
    beta_bar: Any
    e_prev: Any


def _extrapolation_start(xp: Any, w: Any, ht: Any, n_runs: int, dt: Any) -> tuple[Any, ...]:
    """The values of :class:`_Extrapolated`'s fields both loops start from: ``x_hat = x``, ``beta = BETA0``,
    ``beta_bar = 1`` and no previous error.
    """
    return (
        w,
        ht,
        w.copy(),
        ht.copy(),
        xp.full((n_runs,), BETA0, dtype=dt),
        xp.ones((n_runs,), dtype=dt),
        xp.full((n_runs,), xp.inf, dtype=xp.float64),
    )


@dataclass
class _HostState(_Extrapolated):
    """The iterates of the host loop (flat ``(rows, C)`` factors) and the per-run extrapolation state.

    Ang & Gillis (2019) extrapolation, per run: the next half-iteration starts from ``x_hat = x_new + beta (x_new -
    x_old)``; ``beta`` grows by 1.05 while the error falls (capped by ``beta_bar``, which grows by 1.01 up to 1) and
    is divided by 1.5, with the extrapolation dropped, when the error rises. During the plain iterations (warm-up,
    or ``extrapolate=False``) the step is zero, so ``x_hat = x_new``. ``g_what`` (fused kernels only) is the Gram of
    the current ``w_hat`` (float64, ``(R, kmax, kmax)``); ``col_run`` the active position of each column's run.
    """

    g_what: Any
    col_run: Any

    @classmethod
    def start(cls, xp: Any, w: Any, ht: Any, layout: _Layout, dt: Any, kmax: int, fused: bool) -> _HostState:
        start = _extrapolation_start(xp, w, ht, len(layout.ks), dt)
        w_hat = start[2]
        return cls(*start, _padded_grams(xp, w_hat, layout, kmax) if fused else None, xp.asarray(layout.col_run))

    def keep(self, xp: Any, layout: _Layout, keep_pos: np.ndarray) -> None:
        """Drop the finished runs: keep the runs at active positions ``keep_pos``."""
        (self.w, self.ht, self.w_hat, self.h_hat), (self.beta, self.beta_bar, self.e_prev) = _keep_runs(
            xp, layout, keep_pos, (self.w, self.ht, self.w_hat, self.h_hat), (self.beta, self.beta_bar, self.e_prev)
        )
        if self.g_what is not None:
            self.g_what = np.ascontiguousarray(self.g_what[keep_pos])


def _fit_groups_host(batch: _Batch, fused: Any, layout: _Layout, w: Any, ht: Any) -> None:
    """The iterations of :func:`fit_hals_groups` on the host (fused numba kernels when ``fused`` is given, else the
    array code, which also runs on a GPU without the fused kernels); finished runs go into the batch's outputs.
    """
    backend, op, runs, sched, report = batch.backend, batch.op, batch.runs, batch.sched, batch.report
    xp = backend.xp
    kmax = int(runs.ks.max())
    st = _HostState.start(xp, w, ht, layout, op.dtype, kmax, fused is not None)
    active = np.arange(len(runs.ks))
    for it in range(1, sched.max_iter + 1):
        check = it % sched.check_every == 0 or it == sched.max_iter
        plain = it <= sched.n_plain
        if fused is not None:
            e = _iterate_fused(xp, fused, op, st, layout, plain, check, sched)
        else:
            e = _iterate_array(xp, op, st, layout, plain, check, sched)
        if not check:
            report.iteration()
            continue
        done, change = runs.check(active, np.asarray(backend.to_host(e), dtype=np.float64), it, op.norm2, sched.tol)
        report.change(change)  # shown with the iteration, so a bar's last state says whether tol was reached
        report.iteration()
        active, keep_pos = batch.retire(layout, done, it, active, st.w, st.ht)
        if keep_pos is None:
            continue
        if len(active) == 0:
            break
        st.keep(xp, layout, keep_pos)
        layout = _Layout.of(runs.ks[active], runs.gid[active])
        st.col_run = xp.asarray(layout.col_run)


def _iterate_fused(
    xp: Any, fused: Any, op: Operator, st: _HostState, layout: _Layout, plain: bool, check: bool, sched: _Schedule
) -> Any:
    """One iteration with the fused CPU kernels (sparse ``V``), in place; returns the runs' losses (host)."""
    dt = op.dtype
    vt, v = op.vt, op.v
    b_use = np.zeros(len(layout.ks), dtype=dt) if plain else st.beta
    d64 = fused.spectra_half(vt.indptr, vt.indices, vt.data, st.w_hat, st.g_what.astype(dt), st.ht, st.h_hat, b_use,
                             not (check or plain), sched.eps, *layout.kernel_args, sched.inner_sweeps)  # fmt: skip
    cross, g_new, st.g_what = fused.usage_half(v.indptr, v.indices, v.data, st.h_hat, d64.astype(dt), st.w, st.w_hat,
                                               b_use, sched.eps, *layout.kernel_args, sched.inner_sweeps)  # fmt: skip
    e = op.norm2 - 2.0 * cross + _quad_terms(g_new, d64, layout)
    if plain:
        st.e_prev = e
        return e
    rise = e > st.e_prev
    if rise.any():  # drop the extrapolation of the runs whose error rose
        cols = layout.columns(np.flatnonzero(rise))
        st.w_hat[:, cols] = st.w[:, cols]
        st.h_hat[:, cols] = st.ht[:, cols]
        st.g_what[rise] = g_new[rise]
    st.beta, st.beta_bar, st.e_prev = _adapt_step(xp, rise, e, st.e_prev, st.beta, st.beta_bar)
    return e


def _iterate_array(
    xp: Any, op: Operator, st: _HostState, layout: _Layout, plain: bool, check: bool, sched: _Schedule
) -> Any:
    """One iteration of the array code (any device), in place; returns the runs' losses (on the device)."""
    at = _product(xp, op.tdot, st.w_hat, layout, op.sparse)
    h_new = st.h_hat.copy()
    g_w = [gram(xp, _block(st.w_hat, k, nr, c)) for k, _, nr, c in layout.blocks]
    _sweep_blocks(xp, h_new, at, g_w, layout, sched.eps, sched.inner_sweeps)
    # on check iterations the spectra are not extrapolated, so the loss below is that of (W, H) exactly
    bt = xp.take(st.beta, st.col_run)[None, :]
    st.h_hat = h_new if (check or plain) else h_new + bt * (h_new - st.ht)
    st.ht = h_new
    c = _product(xp, op.dot, st.h_hat, layout, op.sparse)
    d = [gram(xp, _block(st.h_hat, k, nr, c0)) for k, _, nr, c0 in layout.blocks]
    w_new = st.w_hat.copy()
    _sweep_blocks(xp, w_new, c, d, layout, sched.eps, sched.inner_sweeps)
    e = xp.concatenate(
        [
            _run_losses(xp, op.norm2, _block(w_new, k, nr, c0), _block(c, k, nr, c0), db)
            for (k, _, nr, c0), db in zip(layout.blocks, d, strict=True)
        ]
    )
    if plain:
        st.w_hat = w_new
        st.e_prev = e
    else:
        rise = e > st.e_prev
        rc = xp.take(rise, st.col_run)[None, :]
        st.w_hat = xp.where(rc, w_new, w_new + bt * (w_new - st.w))
        st.h_hat = xp.where(rc, st.ht, st.h_hat)
        st.beta, st.beta_bar, st.e_prev = _adapt_step(xp, rise, e, st.e_prev, st.beta, st.beta_bar)
    st.w = w_new
    return e


def _keep_runs(
    xp: Any, layout: _Layout, keep_pos: np.ndarray, factors: tuple[Any, ...], per_run: tuple[Any, ...]
) -> tuple[list[Any], list[Any]]:
    """The batch without its finished runs: the columns of ``keep_pos``'s runs in each flat ``(rows, sum k)`` factor
    and the rows ``keep_pos`` of each per-run array (both C-ordered).
    """
    keep = xp.asarray(layout.columns(keep_pos))
    kp = xp.asarray(keep_pos)
    # fancy indexing along axis 1 returns a column-major result: back to C order (row-wise kernels, sums)
    return [xp.ascontiguousarray(f[:, keep]) for f in factors], [xp.ascontiguousarray(a[kp]) for a in per_run]


def _retire_finished(
    xp: Any,
    layout: _Layout,
    done: np.ndarray,
    final: bool,
    active: np.ndarray,
    runs: _Runs,
    w: Any,
    ht: Any,
    out_w: list[Any],
    out_h: list[Any],
) -> np.ndarray | None:
    """At a check, the runs that stopped (active positions ``done``; every run after the ``final`` iteration): copy
    them from the flat ``w``, ``ht`` into their group's outputs, usage columns scaled to unit norm (no rescaling
    during the iterations; ``W H`` unchanged). Returns the active positions of the runs that go on, or ``None`` when
    no run stopped.
    """
    if final:
        done[:] = True
    if not done.any():
        return None
    for k, r0, nr, c0 in layout.blocks:
        local = np.flatnonzero(done[r0 : r0 + nr])
        if len(local) == 0:
            continue
        g = int(runs.gid[active[r0]])
        sel = xp.asarray(local)
        wd, hd = _block(w, k, nr, c0)[:, sel, :], _block(ht, k, nr, c0)[:, sel, :]
        nrm = xp.sqrt((wd * wd).sum(axis=0))
        nrm = xp.where(nrm > 0, nrm, 1.0)
        dest = xp.asarray(runs.idx[active[r0 + local]])
        out_w[g][:, dest, :] = wd / nrm[None]
        out_h[g][:, dest, :] = hd * nrm[None]
    return np.flatnonzero(~done)


@dataclass
class _GpuBatch:
    """Device arrays of the fused GPU loop that are sized by the active runs (rebuilt when runs leave the batch)."""

    rk: Any
    roff: Any
    ph: Any  # (nch_h, R, kmax, kmax) partial Grams of the spectra
    pw_new: Any  # (nch_w, R, kmax, kmax) partial Grams of the new usages
    pw_hat: Any  # ... and of the extrapolated usages
    pw_cross: Any  # (nch_w, R) partial cross terms
    d64: Any  # (R, kmax, kmax) Gram of h_hat, float64 ...
    d_dt: Any  # ... and in the working precision
    g_new: Any
    g_hat: Any
    g_scratch: Any
    quad: Any  # (R, kmax, kmax) the entries' terms of <W^T W, H H^T> (upper triangle)
    rise: Any  # (R,) int32
    at: Any  # (n, C) V^T W_hat and ...
    c: Any  # ... (m, C) V H_hat^T, written in place each iteration, so that their kernel views are made once a batch
    none4: Any  # empty stand-ins for the arguments a kernel call does not use (never the same array twice in one
    none3: Any  # launch: the CUDA simulator copies each argument back after the kernel, and a second copy of an
    none3b: Any  # array would overwrite what the kernel wrote into the first)
    none2: Any

    @classmethod
    def of(
        cls, xp: Any, layout: _Layout, kmax: int, nch_w: int, nch_h: int, dt: Any, shape: tuple[int, int]
    ) -> _GpuBatch:
        r = len(layout.ks)
        cols = int(layout.ks.sum())
        f8 = np.float64
        return cls(
            xp.asarray(layout.ks.astype(np.int64)),
            xp.asarray(layout.offsets.astype(np.int64)),
            xp.empty((nch_h, r, kmax, kmax), dtype=f8),
            xp.empty((nch_w, r, kmax, kmax), dtype=f8),
            xp.empty((nch_w, r, kmax, kmax), dtype=f8),
            xp.empty((nch_w, r), dtype=f8),
            xp.empty((r, kmax, kmax), dtype=f8),
            xp.empty((r, kmax, kmax), dtype=dt),
            xp.empty((r, kmax, kmax), dtype=f8),
            xp.empty((r, kmax, kmax), dtype=f8),
            xp.empty((r, kmax, kmax), dtype=dt),
            xp.empty((r, kmax, kmax), dtype=f8),
            xp.empty((r,), dtype=np.int32),
            xp.empty((shape[1], cols), dtype=dt),
            xp.empty((shape[0], cols), dtype=dt),
            xp.empty((0, r, kmax, kmax), dtype=f8),
            xp.empty((0, kmax, kmax), dtype=f8),
            xp.empty((0, kmax, kmax), dtype=f8),
            xp.empty((0, r), dtype=f8),
        )


def _fit_groups_gpu(batch: _Batch, kern: Any, layout: _Layout, w: Any, ht: Any) -> None:
    """The iterations of :func:`fit_hals_groups` on a GPU with the fused kernels of :mod:`gpuc.nmf._kernels_gpu`.

    Same schedule and rules as the CPU path (extrapolation, checks every ``check_every`` iterations, stopping rule),
    with the per-run step, losses and stop decisions kept on the device: an iteration is two products and six kernel
    launches (:func:`_gpu_iteration`), and the host reads the run states once per ``TOL_WINDOW`` iterations (or
    ``check_every`` if larger). A run that stops at a check is frozen on the device until that read, then leaves the
    batch. The convergence shown to the report is each run's loss change between two reads.
    """
    backend, op, runs, sched, report = batch.backend, batch.op, batch.runs, batch.sched, batch.report
    xp = backend.xp
    n_runs = len(runs.ks)
    read_every = max(TOL_WINDOW, sched.check_every)
    dev = _GpuState.start(xp, kern, op, layout, w, ht, runs, sched)
    active = np.arange(n_runs)
    last = np.full(n_runs, np.nan)  # each run's loss at the previous read
    with backend.kernel_session() as session:  # kernel views made once per batch layout (cleared when it changes)
        for it in range(1, sched.max_iter + 1):
            _gpu_iteration(backend, kern, op, layout, dev, it, sched)
            if not (it % read_every == 0 or it == sched.max_iter):
                report.iteration()
                continue
            s = np.asarray(backend.to_host(dev.state))  # the one read of the window
            runs.losses[active] = s[:, 3]
            runs.n_iter[active] = s[:, 2].astype(np.int64)
            runs.converged[active] = s[:, 1] != 0
            change = np.abs(s[:, 3] - last[active]) / max(op.norm2, 1.0)
            report.change(float(np.nanmax(change)) if np.isfinite(change).any() else None)
            report.iteration()
            last[active] = s[:, 3]
            done = s[:, 0] == 0
            active, keep_pos = batch.retire(layout, done, it, active, dev.w, dev.ht)
            if keep_pos is None:
                continue
            if len(active) == 0:
                break
            layout = dev.keep(xp, kern, op, layout, keep_pos, runs.ks[active], runs.gid[active])
            session.clear()  # the batch's arrays were replaced: their views go with them


@dataclass
class _GpuState(_Extrapolated):
    """The device state of the fused GPU loop: the flat factors, the per-run step, loss history and run states
    (``state`` rows: live, converged, n_iter, loss), the padded Grams of ``w_hat`` and the per-batch buffers.
    """

    hist: Any  # (R, lag) losses at the last `lag` checks, oldest first
    state: Any
    g_what: Any  # Gram of the current w_hat, float64 ...
    g_what_dt: Any  # ... and in the working precision
    bt: _GpuBatch
    consts: Any
    kmax: int
    nch_w: int
    nch_h: int

    @classmethod
    def start(
        cls, xp: Any, kern: Any, op: Operator, layout: _Layout, w: Any, ht: Any, runs: _Runs, sched: _Schedule
    ) -> _GpuState:
        dt = op.dtype
        n_runs = len(runs.ks)
        kmax = int(runs.ks.max())
        lag = max(1, TOL_WINDOW // sched.check_every)
        nch_w, nch_h = kern.n_chunks(op.shape[0]), kern.n_chunks(op.shape[1])
        start = _extrapolation_start(xp, w, ht, n_runs, dt)
        g_what = _padded_grams(xp, start[2], layout, kmax)
        return cls(
            *start,
            xp.full((n_runs, lag), xp.nan, dtype=xp.float64),
            xp.asarray(np.tile(np.array([1.0, 0.0, 0.0, np.nan]), (n_runs, 1))),
            g_what,
            g_what.astype(dt),
            _GpuBatch.of(xp, layout, kmax, nch_w, nch_h, dt, op.shape),
            kern.step_constants(xp, dt),
            kmax,
            nch_w,
            nch_h,
        )

    def keep(
        self, xp: Any, kern: Any, op: Operator, layout: _Layout, keep_pos: np.ndarray, ks: np.ndarray, gids: np.ndarray
    ) -> _Layout:
        """Drop the finished runs (keep those at active positions ``keep_pos``); returns the new layout."""
        per_run = (self.beta, self.beta_bar, self.e_prev, self.hist, self.state, self.g_what, self.g_what_dt)
        (self.w, self.ht, self.w_hat, self.h_hat), per_run = _keep_runs(
            xp, layout, keep_pos, (self.w, self.ht, self.w_hat, self.h_hat), per_run
        )
        self.beta, self.beta_bar, self.e_prev, self.hist, self.state, self.g_what, self.g_what_dt = per_run
        layout = _Layout.of(ks, gids)
        self.bt = _GpuBatch.of(xp, layout, self.kmax, self.nch_w, self.nch_h, op.dtype, op.shape)
        return layout


def _gpu_iteration(
    backend: Backend, kern: Any, op: Operator, layout: _Layout, s: _GpuState, it: int, sched: _Schedule
) -> None:
    """One iteration of the fused GPU loop: two products and five or six kernel launches, no host read."""
    xp, launch, bt = backend.xp, backend.launch, s.bt
    ra, kmax, nch_w, nch_h = len(layout.ks), s.kmax, s.nch_w, s.nch_h
    check = it % sched.check_every == 0 or it == sched.max_iter
    plain = it <= sched.n_plain
    eps, inner = sched.eps, sched.inner_sweeps
    # spectra: h = sweep(h_hat; V^T w_hat, W^T W), extrapolated unless plain or a check; Gram of the new h_hat
    at = _product(xp, op.tdot, s.w_hat, layout, op.sparse, out=bt.at)
    b, th = kern.grid(nch_h * ra)
    launch(kern.half_step, b, th, at, s.g_what_dt, s.h_hat, s.ht, s.beta, int(not (check or plain)), 0, eps, bt.rk,
           bt.roff, s.state, inner, nch_h, bt.none4, bt.ph, bt.none2)  # fmt: skip
    b, th = ra * kmax * kmax, kern.reduce_threads()  # a block per Gram entry
    launch(kern.gram_finish, b, th, bt.ph, bt.none4, bt.rk, s.state, nch_h, bt.d64, bt.d_dt, bt.none3, bt.none3,
           bt.none3b)  # fmt: skip
    # usages: w = sweep(w_hat; V h_hat^T, H H^T), extrapolated unless plain; Grams of w and w_hat, cross term
    c = _product(xp, op.dot, s.h_hat, layout, op.sparse, out=bt.c)
    b, th = kern.grid(nch_w * ra)
    launch(kern.half_step, b, th, c, bt.d_dt, s.w_hat, s.w, s.beta, int(not plain), 1, eps, bt.rk, bt.roff, s.state,
           inner, nch_w, bt.pw_new, bt.pw_hat, bt.pw_cross)  # fmt: skip
    b, th = ra * kmax * kmax, kern.reduce_threads()
    launch(kern.gram_finish, b, th, bt.pw_new, bt.pw_hat, bt.rk, s.state, nch_w, bt.g_new, bt.g_scratch,
           bt.g_hat, bt.d64, bt.quad)  # fmt: skip
    # loss, step rule, next Gram of w_hat and (on checks) the stopping rule, per run on the device
    launch(kern.step, ra, kern.reduce_threads(), bt.pw_cross, bt.quad, bt.rk, nch_w, float(op.norm2), int(plain), int(check), it,
           sched.max_iter, float(sched.tol), s.consts, s.beta, s.beta_bar, s.e_prev, s.hist, s.state, bt.rise,
           bt.g_new, bt.g_hat, s.g_what, s.g_what_dt)  # fmt: skip
    if not plain:  # runs whose error rose drop their extrapolation
        b, th = kern.grid(max(nch_w, nch_h) * ra)
        launch(kern.restore, b, th, s.w, s.w_hat, s.ht, s.h_hat, bt.rk, bt.roff, bt.rise, nch_w, nch_h)


def _product(xp: Any, dot: Any, x: Any, layout: _Layout, sparse: bool, out: Any = None) -> Any:
    """``dot(x)`` for the flat factor ``x``: one product for sparse ``V`` (each output column is accumulated in the
    same order whatever the width), one per block for dense ``V`` (BLAS may round a column differently depending on
    the matrix width, and a run's iterates must not depend on the other ranks in the batch). With ``out``, the result
    is written there (one device copy, or the concatenation's own output) and ``out`` returned: the fused loop keeps
    one buffer per product, so that the kernels' views of it are made once per batch.
    """
    if sparse or (len(layout.blocks) == 1 and x.flags.c_contiguous):
        if out is None:
            return dot(x)
        out[...] = dot(x)
        return out
    parts = [dot(xp.ascontiguousarray(x[:, c0 : c0 + nr * k])) for k, _, nr, c0 in layout.blocks]
    if out is None:
        return xp.concatenate(parts, axis=1)
    xp.concatenate(parts, axis=1, out=out)
    return out


def _quad_terms(g_new: np.ndarray, d64: np.ndarray, layout: _Layout) -> np.ndarray:
    """Per-run ``<W^T W, H H^T>`` from padded ``(R, kmax, kmax)`` Grams, summed over each run's own ``k x k`` block
    exactly as an unpadded fit of that rank sums it (so the loss, hence every stop and restart decision, is
    bit-identical whatever the batch).
    """
    out = np.empty(len(layout.ks))
    for k, r0, nr, _ in layout.blocks:
        a = np.ascontiguousarray(g_new[r0 : r0 + nr, :k, :k])
        b = np.ascontiguousarray(d64[r0 : r0 + nr, :k, :k])
        out[r0 : r0 + nr] = (a * b).sum(axis=(1, 2))
    return out


def _padded_grams(xp: Any, x: Any, layout: _Layout, kmax: int) -> Any:
    """Per-run Grams of the flat ``x`` as float64 ``(R, kmax, kmax)``, zero-padded past each run's rank."""
    out = xp.zeros((len(layout.ks), kmax, kmax), dtype=xp.float64)
    for k, r0, nr, c0 in layout.blocks:
        out[r0 : r0 + nr, :k, :k] = gram(xp, _block(x, k, nr, c0)).astype(xp.float64)
    return out


def _one_run_sweep(backend: Backend, op: Operator, rows: int, k: int) -> Any:
    """``f(x, q, g, eps)``: :func:`sweep` of one run's ``(rows, 1, k)`` factor, in place; on a GPU one launch of the
    fused :func:`gpuc.nmf._kernels_gpu.half_step` (no extrapolation) instead of ``k`` rounds of array operations.
    """
    xp = backend.xp
    kern = _fused_kernels(backend, op, k) if backend.is_gpu else None
    if kern is None:
        return functools.partial(sweep, xp)
    nch = kern.n_chunks(rows)
    blocks, threads = kern.grid(nch)
    rk, roff = xp.asarray(np.array([k], dtype=np.int64)), xp.asarray(np.array([0], dtype=np.int64))
    state = xp.asarray(np.array([[1.0, 0.0, 0.0, 0.0]]))  # one live run
    beta = xp.zeros((1,), dtype=op.dtype)
    x_new = xp.empty((rows, k), dtype=op.dtype)  # the kernel's copy of the swept factor (unused here)
    part = xp.empty((nch, 1, k, k), dtype=np.float64)  # its partial Grams (unused here)
    none4, none2 = xp.empty((0, 1, k, k), dtype=np.float64), xp.empty((0, 1), dtype=np.float64)

    flat: dict[int, tuple[Any, Any]] = {}  # (rows, k) views of the caller's arrays, made once (their kernel views too)

    def rows_by_k(a: Any) -> Any:
        hit = flat.get(id(a))
        if hit is None or hit[0] is not a:
            hit = flat[id(a)] = (a, a.reshape(rows, k))
        return hit[1]

    def run(x: Any, q: Any, g: Any, eps: float) -> None:
        backend.launch(kern.half_step, blocks, threads, rows_by_k(q), g, rows_by_k(x), x_new, beta, 0, 0, float(eps),
                       rk, roff, state, 1, nch, none4, part, none2)  # fmt: skip

    return run


def nnls_refit(
    backend: Backend,
    op: Operator,
    fixed: Any,
    *,
    max_iter: int = 1000,
    tol: float = 1e-6,
    eps: float = 0.0,
    check_every: int = 10,
    warm_start: bool = True,
) -> tuple[Any, float]:
    """Non-negative least squares of ``V`` against fixed spectra: ``min_{W >= 0} ||V - W H||^2``, ``H = fixed (k, n)``.

    HALS column sweeps of ``W`` with ``H H^T`` and ``V H^T`` computed once (so each sweep is ``O(m k^2)``), stopping
    when the relative loss change between checks falls below ``tol``. ``W`` starts from the unconstrained
    least-squares solution clipped at zero (``warm_start``; cNMF starts from zero): the optimum is the same (unique
    when ``H`` has full row rank) and far fewer sweeps are needed, which matters on the GPU where a sweep is ``k``
    small kernels. Returns ``(W (m, k), loss)``; to refit spectra against fixed usages pass ``op.transposed()`` and
    the usages transposed.
    """
    xp = backend.xp
    m = op.shape[0]
    h = backend.asarray(fixed, dtype=op.dtype)
    k = h.shape[0]
    c = op.dot(xp.ascontiguousarray(h.T)).reshape(m, 1, k)
    d = (h @ h.T)[None]
    if warm_start:
        d64 = d[0].astype(xp.float64)
        ridge = 1e-10 * float(xp.trace(d64)) / k + 1e-300
        ls = xp.linalg.solve(d64 + ridge * xp.eye(k), c[:, 0, :].astype(xp.float64).T).T
        w = xp.maximum(ls, eps).astype(op.dtype).reshape(m, 1, k)
    else:
        w = xp.zeros((m, 1, k), dtype=op.dtype)
    prev = None
    loss = op.norm2
    one_sweep = _one_run_sweep(backend, op, m, k)
    # on the CPU the sweeps between two checks run as one compiled pass (each row swept in cache; bit-identical)
    many = _numba_sweeps() if xp is np else None
    if many is not None:  # what `sweep` hands its kernel (the loss checks keep c and d as they are)
        cw, dw = np.ascontiguousarray(c, dtype=w.dtype), np.ascontiguousarray(d, dtype=w.dtype)
    it = 0
    with backend.kernel_session() if backend.is_gpu else contextlib.nullcontext():  # kernel views made once
        while it < max_iter:
            n = min(check_every - it % check_every, max_iter - it)
            if many is not None:
                many(w, cw, dw, float(eps), n)
            else:
                for _ in range(n):
                    one_sweep(w, c, d, eps)
            it += n
            if it % check_every == 0 or it == max_iter:
                loss = float(backend.to_host(_run_losses(xp, op.norm2, w, c, d))[0])
                if prev is not None and abs(prev - loss) / max(op.norm2, 1.0) < tol:
                    break
                prev = loss
    return w[:, 0, :], loss
