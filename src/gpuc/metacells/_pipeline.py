"""End-to-end SEACells on an embedding: kNN -> kernel -> archetypes -> A0 -> fit (no AnnData)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuc._backend import Backend
from gpuc._utils import threaded
from gpuc.metacells._init import initial_archetypes
from gpuc.metacells._kernel import KnnResult, build_kernel, compute_knn
from gpuc.metacells._solver import DENSE_GRADIENT_MAX, DIRECT_SLOTS_MAX, FitResult, fit, kernel_times

KNN_DIFFUSION = 30  # neighbours of Palantir's diffusion map (SEACells' waypoints), self included

# above this many (k x n) entries the dense random A0 of SEACells is replaced by the uniform start
DENSE_A0_MAX = 10_000_000  # 80 MB of float64; ~27k cells at k = n / 75


@dataclass
class MetacellResult:
    """Kernel, fit and timings of one SEACells run (arrays on the backend's device)."""

    kernel: Any
    fit: FitResult
    archetypes: np.ndarray
    a0: str
    timings: dict[str, float] = field(default_factory=dict)


def metacells_peak_bytes(n: int, k: int, *, n_neighbors: int = 15, fw_iters: int = 50, gpu: bool = False) -> float:
    """Estimated peak memory of :func:`run_metacells` on ``n`` cells and ``k`` metacells.

    Dense parts: the random A0 (k x n float64, when used); on the GPU the fused kernels' two (k, n) float64 work
    arrays (16 bytes per cell x metacell), the iterates' picks, rows and weights and the RSS's products (32 bytes per
    cell and Frank-Wolfe step), each cell's slots for the B-steps (388 bytes) and four k x k products; on the CPU the
    dense B-update's gradient, kernel products and work array (three n x k float64 arrays while n k <=
    ``DENSE_GRADIENT_MAX``). Sparse parts (12 bytes per stored entry): the kernel and its square (~``4 *
    n_neighbors`` entries per cell after the union symmetrisation), A and B (at most ``fw_iters`` entries per
    column) and the restricted gradient's pattern ``K A^T`` (at most ``min(k, 2 * n_neighbors * fw_iters)`` entries
    per cell); on the GPU the kernel (``2 * n_neighbors`` entries per cell), its square and a sorted copy of it
    (``12 * n_neighbors`` each: 6-9 times ``n_neighbors`` measured at 300-700 cells, growing with n) and ``K B``
    (``2 * n_neighbors``); on the CPU's dense-gradient path, a chunk-bucketed copy of the kernel's square; on the CPU, the slots of
    the compiled ``K B`` and ``K = M M^T`` (16 bytes per n x k, resp. n x n, entry while they fit
    ``DIRECT_SLOTS_MAX``) and K at ``12 * n_neighbors`` entries per cell. 200,000 cells x 2,667
    metacells on the GPU: about 10.4 GB (8.5 GB of it the two work arrays). The kNN and kernel-building stages
    before the fit hold blocks of at most 256 MB (three at a time on the GPU) besides ``M``: below the fit's
    footprint at large n, above it at a few hundred cells.
    """
    nk = float(n) * float(k)
    dense_gradient = gpu or nk <= DENSE_GRADIENT_MAX
    dense = 8.0 * nk if nk <= DENSE_A0_MAX else 0.0
    if gpu:  # the GPU kernels' two (k, n) work arrays, per-cell iterates, slots and RSS products, k x k products
        dense += 16.0 * nk + (32.0 * fw_iters + 388.0) * n + 24.0 * fw_iters * k + 32.0 * float(k) * k
    else:
        dense += (24.0 * nk if dense_gradient else 0.0) + (0.0 if nk > DIRECT_SLOTS_MAX else 16.0 * nk)
        # the compiled K = M M^T accumulates each row in n direct slots while n^2 fits DIRECT_SLOTS_MAX (n <= 1448)
        dense += 0.0 if float(n) * n > DIRECT_SLOTS_MAX else 16.0 * float(n) * n
    if gpu:  # M, K = M M^T and its sorted transpose (K's rows hold ~6-12 n_neighbors entries), K B, A and B
        per_cell = 28 * n_neighbors + 2 * min(fw_iters, k)
    else:
        # K = M M^T: 50 (600 cells) to 173 (4,000 cells) entries per row measured at n_neighbors=15, as on the GPU
        per_cell = 12 * n_neighbors + 2 * min(fw_iters, k) + min(k, 2 * n_neighbors * fw_iters)
        per_cell += 2 * n_neighbors if dense_gradient else 0
    return dense + 12.0 * n * per_cell


@threaded
def run_metacells(
    backend: Backend,
    x: Any,
    n_metacells: int,
    *,
    n_neighbors: int = 15,
    n_waypoint_eigs: int = 10,
    graph: str = "union",
    max_iter: int = 100,
    min_iter: int = 10,
    convergence_epsilon: float = 1e-3,
    fw_iters: int = 50,
    random_state: int = 0,
    init: str = "waypoint",
    initial_archetypes_: np.ndarray | None = None,
    a0: str = "auto",
    knn_method: str = "auto",
    knn: KnnResult | None = None,
    callback: Any = None,
    n_jobs: int | None = None,
) -> MetacellResult:
    """SEACells 0.3.3 on the rows of ``x`` (see :func:`gpuc.tl.metacells` for the parameters).

    ``np.random.RandomState(random_state)`` is consumed like SEACells consumes the global RNG after
    ``np.random.seed(random_state)`` (waypoint permutation, then the dense random A0), so the defaults reproduce a
    SEACells run seeded that way, given the same kNN. ``knn`` (e.g. from :func:`knn_from_graph`) replaces the exact
    kNN; it needs ``n_neighbors`` columns, 30 with ``init="waypoint"`` (Palantir's diffusion map). ``n_jobs``: CPU threads of the kNN (FAISS), the compiled
    Frank-Wolfe kernels (cells of the A-update, row chunks of the B-update) and BLAS; the picks do not depend on it.
    """
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    x = backend.asarray(x)
    n = x.shape[0]
    need = max(n_neighbors, KNN_DIFFUSION) if init == "waypoint" and initial_archetypes_ is None else n_neighbors
    if knn is None:
        knn = compute_knn(backend, x, need, method=knn_method)
    elif knn.indices.shape[1] < min(need, n):
        msg = f"the given kNN has {knn.indices.shape[1]} neighbours per cell (self included); {need} are needed."
        raise ValueError(msg)
    mmat, sigma = build_kernel(backend, x, n_neighbors=n_neighbors, graph=graph, knn=knn)
    n_zero = int((sigma <= 0).sum())
    if n_zero:
        msg = (
            f"{n_zero} cell(s) have zero kernel bandwidth: fewer than n_neighbors // 2 = {n_neighbors // 2} neighbours at a "
            "non-zero distance, i.e. duplicate cells in the embedding. Remove duplicated rows (or add tiny noise) first."
        )
        raise ValueError(msg)
    kmat = kernel_times(backend, mmat, mmat.T)  # K = M M^T, scipy's product (compiled and parallel on the CPU)
    backend.synchronize()
    timings["kernel"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    rs = np.random.RandomState(random_state)
    if initial_archetypes_ is not None:
        arche = np.asarray(initial_archetypes_, dtype=np.int64)
    else:
        arche = initial_archetypes(
            backend, kmat, knn, n_metacells, rs, n_components=n_neighbors, n_waypoint_eigs=n_waypoint_eigs, method=init
        )
    if a0 == "auto":
        a0 = "random" if n_metacells * n <= DENSE_A0_MAX else "uniform"
    if a0 == "random":
        a_init: Any = rs.random((n_metacells, n))
        a_init /= a_init.sum(0)
        a_init = backend.asarray(a_init)
    elif a0 == "uniform":
        a_init = "uniform"
    else:
        msg = f"a0={a0!r} is not valid; use 'auto', 'random' or 'uniform'."
        raise ValueError(msg)
    backend.synchronize()
    timings["init"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = fit(
        backend,
        mmat,
        arche,
        k=n_metacells,
        a0=a_init,
        kmat=kmat,
        max_iter=max_iter,
        min_iter=min_iter,
        convergence_epsilon=convergence_epsilon,
        fw_iters=fw_iters,
        callback=callback,
    )
    backend.synchronize()
    timings["fit"] = time.perf_counter() - t0
    return MetacellResult(mmat, res, arche, a0, timings)
