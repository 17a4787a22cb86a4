"""``gpuc demo`` step for DESeq2: pasilla (bundled), ~type + condition, with shrinkage and the three plots."""

from __future__ import annotations

import time
from typing import Any

from gpuc._demo import summary_row


def run(ctx: Any) -> list[dict]:
    """DESeq2 on pasilla (7 samples x 14,599 genes): Wald test treated vs untreated with normal shrinkage, an LRT
    of condition, and volcano / MA / dispersion figures.
    """
    import gpuc

    rows: list[dict] = []
    pb = gpuc.datasets.pasilla()
    t0 = time.perf_counter()
    gpuc.tl.deseq(
        pb,
        "~type + condition",
        contrast=["condition", "treated", "untreated"],
        alpha=0.1,
        lfc_shrink="normal",
        device=ctx.device,
    )
    secs = time.perf_counter() - t0
    res = gpuc.get.deseq_results(pb)
    trend = pb.uns["deseq"]["trend"]
    what = f"pasilla {pb.n_obs} x {pb.n_vars}, ~type + condition: genes with padj < 0.1 (R DESeq2 1.38.3: 1330)"
    rows.append(summary_row(what, int((res["padj"] < 0.1).sum()), secs))
    trend_value = f"{trend.get('asymptDisp', float('nan')):.4f} + {trend.get('extraPois', float('nan')):.2f}/mean"
    rows.append(
        summary_row("dispersion trend asymptDisp + extraPois / mean (R 1.38.3: 0.0080 + 2.57/mean)", trend_value)
    )
    top = res.sort_values("pvalue").head(3)
    genes = "; ".join(f"{g}: {r.log2FoldChange:.2f} ({r.log2FoldChange_shrunk:.2f})" for g, r in top.iterrows())
    rows.append(summary_row("top 3 genes (log2FC, shrunken)", genes))
    t0 = time.perf_counter()
    gpuc.tl.deseq(
        pb, "~type + condition", test="lrt", reduced="~type", alpha=0.1, device=ctx.device, key_added="deseq_lrt"
    )
    lrt = gpuc.get.deseq_results(pb, key="deseq_lrt")
    what = "LRT ~type + condition vs ~type: genes with padj < 0.1"
    rows.append(summary_row(what, int((lrt["padj"] < 0.1).sum()), time.perf_counter() - t0))
    ctx.savefig(gpuc.pl.volcano(pb, show=False).figure, "deseq_volcano.png")
    ctx.savefig(gpuc.pl.ma(pb, shrunk=True, ylim=4, show=False).figure, "deseq_ma_shrunk.png")
    ctx.savefig(gpuc.pl.dispersion(pb, show=False).figure, "deseq_dispersion.png")
    ctx.shared["deseq"] = {"n_significant": int((res["padj"] < 0.1).sum())}
    return rows
