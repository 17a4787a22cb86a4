"""Archetype initialisation as SEACells 0.3.3 does it (Persad et al. 2023, Nat. Biotechnol. 41:1746).

Waypoints: Palantir diffusion map (adaptive exponential kernel on a 30-NN graph, top eigenvectors of the Markov
matrix), multiscale scaling, per-component max-min sampling; then greedy column-subset selection on K (Farahat et
al. 2013, with the reference's sign of the g update) fills the rest. Everything runs on the backend's device; the
only host work is the eigensolver call on the CPU backend.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from gpuc._backend import Backend
from gpuc.metacells._kernel import KnnResult, non_self


def diffusion_components(
    backend: Backend, knn: KnnResult, *, n_components: int = 15, knn_dm: int = 30, seed: int = 0
) -> tuple[Any, Any]:
    """Palantir's ``run_diffusion_maps`` on a precomputed kNN (self included, at least ``knn_dm`` columns).

    Returns ``(eigenvalues, eigenvectors)`` sorted by decreasing eigenvalue, each eigenvector of the Markov matrix
    scaled to unit L2 norm.
    """
    xp, sparse = backend.xp, backend.sparse
    dist, idx = non_self(backend, knn, knn_dm)
    n = dist.shape[0]
    adaptive_k = int(np.floor(knn_dm / 3))
    sd = xp.sort(dist, axis=1)
    std = sd[:, min(adaptive_k, sd.shape[1]) - 1].astype(xp.float64)
    rows = xp.repeat(xp.arange(n), idx.shape[1])
    d = dist.ravel().astype(xp.float64)
    keep = d > 0  # scanpy stores no zero distances
    w = xp.exp(-d[keep] / std[rows[keep]])
    wm = sparse.csr_matrix((w, (rows[keep], idx.ravel()[keep])), shape=(n, n))
    kern = sparse.csr_matrix(wm + wm.T)
    deg = xp.asarray(kern.sum(axis=1)).ravel()
    dinv_sqrt = xp.where(deg > 0, 1.0 / xp.sqrt(xp.where(deg > 0, deg, 1.0)), 0.0)
    dm = sparse.diags(dinv_sqrt)
    sym = sparse.csr_matrix(dm @ kern @ dm)  # same spectrum as T = D^-1 W; eigenvectors of T are D^-1/2 u
    n_comp = min(n_components, n - 2)
    vals, vecs = _eigsh(backend, sym, n_comp, seed)
    order = xp.argsort(vals)[::-1]
    vals = vals[order]
    vecs = dinv_sqrt[:, None] * vecs[:, order]
    vecs = vecs / xp.linalg.norm(vecs, axis=0)[None, :]
    return vals, vecs


def _eigsh(backend: Backend, sym: Any, k: int, seed: int) -> tuple[Any, Any]:
    """Top ``k`` eigenpairs by Lanczos (scipy's ARPACK or cupyx's), from the same seeded start vector."""
    v0 = backend.asarray(np.random.default_rng(seed).random(sym.shape[0]))
    return backend.sparse_linalg.eigsh(sym, k=k, which="LA", tol=1e-4, maxiter=max(1000, 10 * sym.shape[0]), v0=v0)


def multiscale_space(vals: Any, vecs: Any, n_eigs: int = 10) -> Any:
    """Palantir's ``determine_multiscale_space``: components 1..n_eigs-1, each scaled by lambda / (1 - lambda)."""
    use = slice(1, n_eigs)
    lam = vals[use]
    # an eigenvalue of 1 (a second connected component of the kernel graph) scales its component to inf, as in
    # Palantir; max_min_sampling then picks among those cells as SEACells does
    with np.errstate(divide="ignore", invalid="ignore"):
        return vecs[:, use] * (lam / (1 - lam))[None, :]


def max_min_sampling(backend: Backend, dc: Any, n_waypoints: int, *, seed: int = 20) -> np.ndarray:
    """Palantir's ``_max_min_sampling``: per component, a random start then farthest-point picks in 1-D.

    Returns unique cell positions (host int array) in order of first appearance.
    """
    xp = backend.xp
    n, n_cols = dc.shape
    if n_cols == 0:  # too few cells for a diffusion component beyond the first: no waypoint, greedy picks them all
        return np.zeros(0, dtype=np.int64)
    n_waypoints = max(n_waypoints, max(3, n_cols))
    per_col = int(n_waypoints / n_cols)
    rng = np.random.default_rng(seed)
    picks: list[Any] = []
    for i in range(n_cols):
        vec = dc[:, i]
        cur = int(rng.integers(n))
        picks.append(cur)
        mind = xp.abs(vec - vec[cur])
        chosen = []
        for _ in range(1, per_col):
            chosen.append(xp.argmax(mind))
            mind = xp.minimum(mind, xp.abs(vec - vec[chosen[-1]]))
        if chosen:
            picks.extend(int(v) for v in backend.to_host(xp.stack(chosen)))
    out = np.asarray(picks, dtype=np.int64)
    _, first = np.unique(out, return_index=True)
    return out[np.sort(first)]


def greedy_centers(backend: Backend, kmat: Any, n_centers: int) -> np.ndarray:
    """Greedy adaptive column-subset selection on ``K`` (the reference's variant, g grows by omega**2).

    ``kmat`` is the symmetric CSR kernel ``K = M M^T`` (as :func:`gpuc.metacells.run_metacells` builds it, exactly
    symmetric), so the column of each pick is read as its row: no CSC copy of K.
    """
    xp = backend.xp
    n = kmat.shape[0]
    n_centers = min(n_centers, n)
    # column sums of K * K (elementwise), squaring the stored values in place of a sparse-sparse product
    squares = kmat.copy()
    squares.data *= kmat.data
    f = xp.asarray(squares.sum(axis=0)).ravel().astype(xp.float64)
    g = xp.asarray(kmat.diagonal()).ravel().astype(xp.float64)
    omega = xp.zeros((n_centers, n), dtype=xp.float64)
    centers = np.zeros(n_centers, dtype=np.int64)
    for j in range(n_centers):
        p = int(xp.argmax(f / g))
        col = xp.asarray(kmat[p].toarray()).ravel()  # K[:, p] == K[p, :] (K symmetric)
        delta = col - omega[:j, p] @ omega[:j] if j else col
        delta[p] = xp.maximum(delta[p], 0.0)
        o = delta / xp.maximum(xp.sqrt(delta[p]), 1e-6)
        o2 = o * o
        pl = (omega[:j] @ o) @ omega[:j] if j else xp.zeros(n)
        ko = kmat @ o
        f += -2.0 * (o * (ko - pl)) + (o2.sum()) * o2
        g += o2
        omega[j] = o
        centers[j] = p
    return centers


def waypoint_centers(
    backend: Backend, knn: KnnResult, n_waypoints: int, *, n_components: int = 15, n_waypoint_eigs: int = 10
) -> np.ndarray:
    """Diffusion-map waypoints (SEACells ``_get_waypoint_centers``)."""
    vals, vecs = diffusion_components(backend, knn, n_components=n_components)
    dc = multiscale_space(vals, vecs, n_waypoint_eigs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return max_min_sampling(backend, dc, n_waypoints)


def initial_archetypes(
    backend: Backend,
    kmat: Any,
    knn: KnnResult,
    k: int,
    rs: np.random.RandomState,
    *,
    n_components: int = 15,
    n_waypoint_eigs: int = 10,
    method: str = "waypoint",
) -> np.ndarray:
    """Archetype cell positions: permuted waypoints, then greedy picks, first occurrences, first ``k``.

    ``rs`` is consumed exactly as SEACells consumes the global NumPy RNG (one permutation of the waypoints), so
    ``np.random.RandomState(seed)`` here matches ``np.random.seed(seed)`` before a SEACells run.
    ``method="greedy"`` skips the waypoints; ``"random"`` picks ``k`` distinct cells at random (for very large n).
    """
    n = kmat.shape[0]
    if method == "random":
        return np.sort(rs.choice(n, k, replace=False))
    if method == "waypoint":
        wp = waypoint_centers(backend, knn, k, n_components=n_components, n_waypoint_eigs=n_waypoint_eigs)
        wp = rs.choice(wp, len(wp), replace=False)
    elif method == "greedy":
        wp = np.zeros(0, dtype=np.int64)
    else:
        msg = f"init={method!r} is not valid; use 'waypoint', 'greedy' or 'random'."
        raise ValueError(msg)
    greedy = greedy_centers(backend, kmat, k - len(wp) + 10)
    allix = np.concatenate([wp, greedy])
    _, first = np.unique(allix, return_index=True)
    return allix[np.sort(first)][:k]
