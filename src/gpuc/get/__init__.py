"""Results as tidy tables, and host <-> device moves of AnnData (each imported on first use)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuc._exports import lazy_exports

if TYPE_CHECKING:
    from gpuc.get._deseq import deseq_results, deseq_summary
    from gpuc.get._nmf import nmf_gene_scores, nmf_gene_spectra, nmf_suggest_k, nmf_top_genes, nmf_usages
    from gpuc.get._transfer import to_cpu, to_gpu

__all__ = [
    "deseq_results",
    "deseq_summary",
    "nmf_gene_scores",
    "nmf_gene_spectra",
    "nmf_suggest_k",
    "nmf_top_genes",
    "nmf_usages",
    "to_cpu",
    "to_gpu",
]
# each public name -> the submodule that defines it
_EXPORTS = {
    "deseq_results": "._deseq",
    "deseq_summary": "._deseq",
    "nmf_gene_scores": "._nmf",
    "nmf_suggest_k": "._nmf",
    "nmf_top_genes": "._nmf",
    "to_cpu": "._transfer",
    "to_gpu": "._transfer",
    "nmf_gene_spectra": "._nmf",
    "nmf_usages": "._nmf",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
