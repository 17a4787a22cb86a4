"""Consensus NMF on the CPU: gpuc.tl.consensus_nmf vs cNMF 1.7.1, side by side in one run (``_harness.py``).

Cases (cNMF's matrix recipe for both: raw counts divided by the gene SD, no centring; Euclidean consensus, density
threshold 0.5):

* ``small``: k=7 x 20 runs on the 700 x 500 cNMF fixture (``tests/data/nmf``, integer counts). Issue 32's target:
  gpuc >= 10x cNMF warm and >= 4x cold, at cNMF's default threads.
* ``k7``: k=7 x 20 runs on a 6,881 x 2,000 CD34-sized matrix built from pbmc3k cells (``_nmf_data.cd34_sized``);
  ``cd34_MxG``: the same recipe at M x G (``--smoke`` runs ``cd34_300x200``).

cNMF: prepare + factorize (one worker, its default BLAS threads) + combine + consensus (no figure). gpuc's call
counts its work from the iterations each restart used: per restart and iteration, the two sparse products
(4 nnz k FLOPs), the Gram matrices and coordinate sweeps ((2m + n) k (k + 1) + 2 (m + n) k (k + 1)) and the
extrapolation; bytes: the CSR matrix and its transpose (8 bytes per stored entry each) and five factor-sized
float32 blocks per batched iteration.

    python benchmarks/bench_nmf.py                        # the small case (about 2 minutes on 2 busy cores)
    python benchmarks/bench_nmf.py --cases small,k7 --cores 1,2
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness

CASES = {"small": "700 x 500, k=7 x 20", "k7": "6,881 x 2,000, k=7 x 20"}


def matrix(case: str):
    """The case's cells x genes counts (CSR float32)."""
    import numpy as np
    import scipy.sparse as sp

    if case == "small":
        z = np.load(_harness.ROOT / "tests" / "data" / "nmf" / "pbmc68k_counts_700x500.npz", allow_pickle=False)
        return sp.csr_matrix((z["data"].astype(np.float32), z["indices"], z["indptr"]), shape=tuple(z["shape"]))
    from _nmf_data import cd34_sized

    if case.startswith("cd34_"):  # cd34_MxG: an M x G CD34-like matrix (smoke: cd34_300x200)
        return cd34_sized(*(int(v) for v in case.removeprefix("cd34_").split("x")))
    return cd34_sized()


def work(x, k: int, run_n_iter) -> dict:
    """FLOPs and bytes of the HALS fits from each restart's iteration count (see the module docstring)."""
    m, n = x.shape
    per_iter = 4 * x.nnz * k + (2 * m + n) * k * (k + 1) + 2 * (m + n) * k * (k + 1) + 5 * (m + n) * k + 2 * m * k
    batched_iters = int(max(run_n_iter))  # the restarts run as one batch until the slowest converges
    nbytes = batched_iters * (2 * x.nnz * 8 + 5 * (m + n) * k * len(run_n_iter) * 4)
    return {"flops": float(per_iter * sum(int(i) for i in run_n_iter)), "bytes": float(nbytes)}


def prepare(who: str, case: str, n_jobs: int | None, threads: int | None, tmp: str):
    """The timed call of ``who`` on ``case`` (data loaded, tool imported)."""
    x = matrix(case)
    k, n_runs = 7, 20
    if who == "gpuc":
        from anndata import AnnData

        import gpuc

        gpuc.settings.progress = False
        ad = AnnData(x)
        consensus_nmf = gpuc.tl.consensus_nmf  # imports the tool's module (as the peer's import), before the clock
        kw = {"mask_var": None, "preprocessing": "sd", "metric": "euclidean", "density_threshold": 0.5}

        def call() -> dict:
            consensus_nmf(ad, k, n_runs=n_runs, device="cpu", n_jobs=n_jobs, **kw)
            return work(x, k, ad.uns["nmf"]["run_n_iter"])

        return call
    import numpy as np
    import scanpy as sc
    from cnmf import cNMF

    counts_fn = str(Path(tmp) / "counts.h5ad")
    sc.AnnData(x.astype(np.float32)).write_h5ad(counts_fn)
    calls = [0]

    def run() -> None:
        calls[0] += 1
        obj = cNMF(output_dir=tmp, name=f"run{calls[0]}")
        obj.prepare(counts_fn=counts_fn, components=[k], n_iter=n_runs, seed=14, num_highvar_genes=x.shape[1])
        obj.factorize(worker_i=0, total_workers=1)
        obj.combine()
        obj.consensus(k, density_threshold=0.5, show_clustering=False, close_clustergram_fig=True)

    return run


TOOL = _harness.Tool(
    name="nmf",
    peer="cnmf",
    cases=CASES,
    prepare=prepare,
    default_cases=("small",),
    targets={"small": {"cold": 4, "warm": 10}},
    smoke_case="cd34_300x200",
)

if __name__ == "__main__":
    _harness.main(TOOL, __file__)
