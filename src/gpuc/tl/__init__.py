"""Tools: compute results and write them into the AnnData (Scanpy conventions)."""

from __future__ import annotations

from gpuc.tl._deseq import deseq, pseudobulk, vst
from gpuc.tl._metacells import aggregate_metacells, metacell_quality, metacells
from gpuc.tl._nmf import consensus_nmf, nmf_k_sweep, nmf_refine

__all__: list[str] = [
    "aggregate_metacells",
    "consensus_nmf",
    "deseq",
    "metacell_quality",
    "metacells",
    "nmf_k_sweep",
    "nmf_refine",
    "pseudobulk",
    "vst",
]
