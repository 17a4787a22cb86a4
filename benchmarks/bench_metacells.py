"""Metacells on the CPU: gpuc.tl.metacells vs SEACells 0.3.3, side by side in one run (``_harness.py``).

Cases (both tools: kernel on ``X_pca``, SEACells' waypoint initialisation, ``convergence_epsilon`` 1e-5, SEACells'
tutorial ``fit(min_iter=10, max_iter=50)``; SEACells draws from numpy's global RNG, seeded 0):

* ``pbmc68k``: scanpy's pbmc68k_reduced, 700 cells, k=9.
* ``pbmc3k``: the bundled pbmc3k after the demo preprocessing, 2,638 cells, k=35.
* ``cd34like``: 6,881 cells resampled from pbmc68k's PCs with jitter (the size of SEACells' CD34 tutorial), k=92.
* ``manifoldN``: N cells interpolated on pbmc68k's PC manifold, k=N/75, epsilon 1e-3 and max_iter 100 (SEACells'
  defaults; gpuc's scaling, with ``--skip-peers``).

gpuc's call counts its work per outer iteration (A-update + B-update + error, T = 50 Frank-Wolfe steps each):
4 T n k + 2 nnz(A) k FLOPs for the A-update, T (2 nnz(K) k / n k-columns picked + 4 n k) for the B-update and
2 nnz(K) k for K A^T; bytes, a lower bound: the kernel matrix (12 bytes per stored entry) and six n x k float32
blocks (A and B read and written) once per outer iteration.

    python benchmarks/bench_metacells.py                                # pbmc68k (about 1 minute on 2 busy cores)
    python benchmarks/bench_metacells.py --cases pbmc3k,cd34like
    python benchmarks/bench_metacells.py --cases manifold20000,manifold100000 --skip-peers --repeats 1
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness

CASES = {"pbmc68k": "700 cells, k=9", "pbmc3k": "2,638 cells, k=35", "cd34like": "6,881 cells, k=92"}
MIN_ITER, FW_STEPS = 10, 50


def settings(case: str) -> tuple[float, int]:
    """(convergence_epsilon, max_iter) of the case: SEACells' tutorial for the named cases, its defaults for scaling."""
    return (1e-3, 100) if case.startswith("manifold") else (1e-5, 50)


def data(name: str):
    """The case's AnnData with ``X_pca``."""
    import numpy as np
    from anndata import AnnData

    if name == "pbmc68k":
        import scanpy as sc

        return sc.datasets.pbmc68k_reduced()
    if name == "pbmc3k":
        from gpuc._demo import preprocess_pbmc3k

        return preprocess_pbmc3k(lambda *_: None)
    from _metacells_data import jittered_pcs, manifold_pcs

    x = jittered_pcs(6881) if name == "cd34like" else manifold_pcs(int(name.removeprefix("manifold")))
    ad = AnnData(np.zeros((x.shape[0], 1), dtype=np.float32), obsm={"X_pca": x})
    ad.obs_names = [f"c{i}" for i in range(x.shape[0])]
    return ad


def n_metacells(case: str, n_obs: int) -> int:
    """k of the case (n / 75 for the scaling cases)."""
    return {"pbmc68k": 9, "pbmc3k": 35, "cd34like": 92}.get(case, round(n_obs / 75))


def work(n: int, k: int, kernel_nnz: int, n_iter: int) -> dict:
    """FLOPs and bytes of ``n_iter`` outer iterations (see the module docstring; A taken as k-sparse per cell)."""
    a_update = 4 * FW_STEPS * n * k + 2 * n * k
    b_update = FW_STEPS * (2 * kernel_nnz * k / max(n, 1) * k + 4 * n * k)
    flops = n_iter * (a_update + b_update + 2 * kernel_nnz * k)
    nbytes = n_iter * (12 * kernel_nnz + 6 * 4 * n * k)
    return {"flops": float(flops), "bytes": float(nbytes)}


def prepare(who: str, case: str, n_jobs: int | None, threads: int | None, tmp: str):
    """The timed call of ``who`` on ``case`` (data loaded, tool imported); each call works in place."""
    ad = data(case)
    k = n_metacells(case, ad.n_obs)
    eps, max_iter = settings(case)
    if who == "gpuc":
        import gpuc

        gpuc.settings.progress = False
        metacells = gpuc.tl.metacells  # imports the tool's module (as the peer's import), before the clock

        def call() -> dict:
            metacells(ad, k, convergence_epsilon=eps, min_iter=MIN_ITER, max_iter=max_iter, device="cpu",
                              n_jobs=n_jobs)  # fmt: skip
            info = ad.uns["metacell"]
            kernel = ad.obsp.get("metacell_kernel")
            nnz = kernel.nnz if kernel is not None and hasattr(kernel, "nnz") else ad.n_obs * 15
            return work(ad.n_obs, k, nnz, int(info["n_iter"]))

        return call
    import numpy as np
    import scanpy as sc
    from anndata import AnnData

    # pynndescent's numba JIT warmed on a throwaway object, so that the timing is SEACells' own work
    sc.pp.neighbors(AnnData(np.random.default_rng(0).normal(size=(200, 10)).astype(np.float32)), use_rep="X")
    import SEACells

    def run() -> None:
        np.random.seed(0)  # noqa: NPY002 - SEACells 0.3.3 draws from the global RNG
        model = SEACells.core.SEACells(ad, build_kernel_on="X_pca", n_SEACells=k, n_waypoint_eigs=10,
                                       convergence_epsilon=eps, verbose=False)  # fmt: skip
        model.construct_kernel_matrix()
        model.initialize_archetypes()
        try:
            model.fit(min_iter=MIN_ITER, max_iter=max_iter)
        except RuntimeWarning:  # 0.3.3 raises on non-convergence after writing its results
            pass

    return run


TOOL = _harness.Tool(
    name="metacells",
    peer="seacells",
    cases=CASES,
    prepare=prepare,
    default_cases=("pbmc68k",),
    smoke_case="manifold300",
)

if __name__ == "__main__":
    _harness.main(TOOL, __file__)
