"""``gpuc demo`` step: SEACells metacells on the preprocessed bundled pbmc3k, plots, and the aggregated metacells."""

from __future__ import annotations

import time
import warnings
from typing import Any

from gpuc._demo import summary_row


def run(ctx: Any) -> list[dict[str, Any]]:
    """Run metacells on ``ctx.adata``; save three figures; leave the metacell AnnData in ``ctx.shared["metacells"]``."""
    import matplotlib.pyplot as plt

    import gpuc
    from gpuc.metacells import MetacellConvergenceWarning

    adata = ctx.adata
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MetacellConvergenceWarning)
        gpuc.tl.metacells(adata, device=ctx.device, random_state=0)
    for w in caught:
        ctx.log(f"  warning: {w.message}")
    secs = time.perf_counter() - t0
    info = adata.uns["metacell"]
    n_metacells = adata.obs["metacell"].cat.categories.size
    rss = f"{info['rss'][0]:.4g} -> {info['rss'][-1]:.4g}"
    ctx.log(f"  {n_metacells} metacells from {adata.n_obs} cells, {info['n_iter']} iterations, RSS {rss}")
    rows = [
        summary_row("metacells (SEACells)", f"{n_metacells} from {adata.n_obs} cells", secs),
        summary_row("iterations / converged", f"{info['n_iter']} / {info['converged']}"),
        summary_row("RSS ||M - MBA|| first -> last", rss),
    ]

    t0 = time.perf_counter()
    ct = "cell_type" if "cell_type" in adata.obs else None
    gpuc.tl.metacell_quality(adata, celltype_key=ct, device=ctx.device)
    q = adata.uns["metacell_quality"]
    secs = time.perf_counter() - t0
    if ct is not None:
        rows.append(summary_row("cell-type purity (median)", f"{q[f'{ct}_purity'].median():.3f}", secs))
    compact = f"{q['compactness'].median():.3g} / {q['separation'].median():.3g}"
    rows.append(summary_row("compactness / separation (median)", compact))

    t0 = time.perf_counter()
    layer = "counts" if "counts" in adata.layers else None
    mc = gpuc.tl.aggregate_metacells(adata, layer=layer, celltype_key=ct)
    what = "aggregated metacells (metacells x genes)"
    rows.append(summary_row(what, f"{mc.n_obs} x {mc.n_vars}", time.perf_counter() - t0))
    ctx.shared["metacells"] = mc

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    gpuc.pl.metacells(adata, "umap", ax=axes[0], show=False)
    if ct is not None:
        gpuc.pl.metacells(adata, "umap", color=ct, ax=axes[1], show=False)
    else:
        axes[1].remove()
    ctx.savefig(fig, "metacells_umap.png")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    gpuc.pl.metacell_convergence(adata, ax=axes[0], show=False)
    gpuc.pl.metacell_sizes(adata, ax=axes[1], show=False)
    fig.tight_layout()
    ctx.savefig(fig, "metacells_convergence_sizes.png")
    ctx.savefig(gpuc.pl.metacell_quality(adata, show=False), "metacells_quality.png")
    return rows
