"""``gpuc demo`` step for DESeq2: pasilla (bundled), ~type + condition, with shrinkage and the three plots."""

from __future__ import annotations

import time
from typing import Any


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
    secs = round(time.perf_counter() - t0, 2)
    res = gpuc.get.deseq_results(pb)
    trend = pb.uns["deseq"]["trend"]
    rows.append(
        {
            "what": f"pasilla {pb.n_obs} x {pb.n_vars}, ~type + condition: genes with padj < 0.1 (R DESeq2 1.38.3: 1330)",
            "value": int((res["padj"] < 0.1).sum()),
            "seconds": secs,
        }
    )
    rows.append(
        {
            "what": "dispersion trend asymptDisp + extraPois / mean (R 1.38.3: 0.0080 + 2.57/mean)",
            "value": f"{trend.get('asymptDisp', float('nan')):.4f} + {trend.get('extraPois', float('nan')):.2f}/mean",
            "seconds": 0.0,
        }
    )
    top = res.sort_values("pvalue").head(3)
    rows.append(
        {
            "what": "top 3 genes (log2FC, shrunken)",
            "value": "; ".join(
                f"{g}: {r.log2FoldChange:.2f} ({r.log2FoldChange_shrunk:.2f})" for g, r in top.iterrows()
            ),
            "seconds": 0.0,
        }
    )
    t0 = time.perf_counter()
    gpuc.tl.deseq(
        pb, "~type + condition", test="lrt", reduced="~type", alpha=0.1, device=ctx.device, key_added="deseq_lrt"
    )
    lrt = gpuc.get.deseq_results(pb, key="deseq_lrt")
    rows.append(
        {
            "what": "LRT ~type + condition vs ~type: genes with padj < 0.1",
            "value": int((lrt["padj"] < 0.1).sum()),
            "seconds": round(time.perf_counter() - t0, 2),
        }
    )
    ctx.savefig(gpuc.pl.volcano(pb, show=False).figure, "deseq_volcano.png")
    ctx.savefig(gpuc.pl.ma(pb, shrunk=True, ylim=4, show=False).figure, "deseq_ma_shrunk.png")
    ctx.savefig(gpuc.pl.dispersion(pb, show=False).figure, "deseq_dispersion.png")
    ctx.shared["deseq"] = {"n_significant": int((res["padj"] < 0.1).sum())}
    return rows
