"""``gpuc demo`` step for consensus NMF: k sweep and consensus at the suggested k on pbmc3k (cNMF style), and on
metacells if present.
"""

from __future__ import annotations

import time
from typing import Any

from gpuc._demo import summary_row

K_RANGE = range(2, 11)


def run(ctx: Any) -> list[dict]:
    """Sweep k=2..10 (10 runs), consensus at the suggested k (20 runs) on raw counts of the HVGs scaled by gene SD;
    save the figures.
    """
    import gpuc

    adata = ctx.adata
    rows: list[dict] = []
    common = {"layer": "counts", "preprocessing": "sd", "device": ctx.device, "random_state": 0}

    t0 = time.perf_counter()
    gpuc.tl.nmf_k_sweep(adata, K_RANGE, n_runs=10, **common)
    table = adata.uns["nmf_k_sweep"]["table"]
    secs = time.perf_counter() - t0
    stab = " ".join(f"{int(r.k)}:{r.stability:.2f}" for r in table.itertuples())
    rows.append(summary_row(f"k sweep {K_RANGE.start}..{K_RANGE.stop - 1} x 10 runs: stability per k", stab, secs))
    K = gpuc.get.nmf_suggest_k(adata)
    rows.append(summary_row("suggested k (gpuc.get.nmf_suggest_k)", K))
    ctx.savefig(gpuc.pl.nmf_k_sweep(adata, show=False), "nmf_k_sweep.png")

    t0 = time.perf_counter()
    gpuc.tl.consensus_nmf(adata, K, n_runs=20, **common)
    u = adata.uns["nmf"]
    secs = time.perf_counter() - t0
    value = f"{u['stability']:.3f} / {u['rel_error']:.4f} / {u['n_dropped']} of {len(u['components'])}"
    rows.append(summary_row(f"consensus k={K} x 20 runs: stability / rel. error / dropped", value, secs))
    top = gpuc.get.nmf_top_genes(adata, 3, wide=True)
    rows.append(summary_row("top 3 genes per programme", "; ".join(f"{p}: {','.join(top[p])}" for p in top.columns)))
    ctx.savefig(gpuc.pl.nmf_usage(adata, basis="umap", show=False), "nmf_usage_umap.png")
    ctx.savefig(gpuc.pl.nmf_programs(adata, n_genes=8, show=False), "nmf_programs.png")
    ctx.shared["nmf"] = {"k": K, "stability": u["stability"]}

    mc = ctx.shared.get("metacells")
    if mc is not None:
        try:
            import numpy as np

            t0 = time.perf_counter()
            mc = mc[:, np.asarray(mc.X.sum(axis=0)).ravel() > 0].copy()  # genes no metacell expresses cannot be scaled
            mask_var = "highly_variable" if "highly_variable" in mc.var else None
            opts = {"mask_var": mask_var, "preprocessing": "sd", "device": ctx.device, "random_state": 0}
            gpuc.tl.consensus_nmf(mc, K, n_runs=20, **opts)
            um = mc.uns["nmf"]
            what = f"metacells ({mc.n_obs}) consensus k={K} (separate fit): stability / rel. error"
            rows.append(summary_row(what, f"{um['stability']:.3f} / {um['rel_error']:.4f}", time.perf_counter() - t0))
            if "X_umap" in mc.obsm:
                ctx.savefig(gpuc.pl.nmf_usage(mc, basis="umap", show=False), "nmf_usage_metacells.png")
        except ValueError as err:  # e.g. too few metacells for k, or an all-zero gene across metacells
            rows.append(summary_row("metacells consensus", f"skipped: {err}"))
    return rows
