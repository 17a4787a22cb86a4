"""Results as tidy tables, and host <-> device moves of AnnData."""

from __future__ import annotations

from gpuc.get._deseq import deseq_results
from gpuc.get._nmf import nmf_gene_scores, nmf_suggest_k, nmf_top_genes
from gpuc.get._transfer import to_cpu, to_gpu

__all__ = ["deseq_results", "nmf_gene_scores", "nmf_suggest_k", "nmf_top_genes", "to_cpu", "to_gpu"]
