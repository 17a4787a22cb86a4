"""Tools: compute results and write them into the AnnData (Scanpy conventions).

Each tool's module (and what it needs: Scanpy, scikit-learn, SciPy's statistics) is imported on the tool's first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuc._exports import lazy_exports

if TYPE_CHECKING:
    from gpuc.tl._deseq import deseq, pseudobulk, vst
    from gpuc.tl._metacells import aggregate_metacells, metacell_assignment_quality, metacell_quality, metacells
    from gpuc.tl._nmf import consensus_nmf, nmf_k_sweep, nmf_refine
    from gpuc.tl._nmf_project import nmf_project
    from gpuc.tl._transforms import normalized_counts, rlog

__all__ = [
    "aggregate_metacells",
    "consensus_nmf",
    "deseq",
    "metacell_assignment_quality",
    "metacell_quality",
    "metacells",
    "nmf_k_sweep",
    "nmf_project",
    "nmf_refine",
    "normalized_counts",
    "pseudobulk",
    "rlog",
    "vst",
]
# each public name -> the submodule that defines it
_EXPORTS = {
    "aggregate_metacells": "._metacells",
    "consensus_nmf": "._nmf",
    "deseq": "._deseq",
    "metacell_assignment_quality": "._metacells",
    "metacell_quality": "._metacells",
    "metacells": "._metacells",
    "nmf_k_sweep": "._nmf",
    "nmf_project": "._nmf_project",
    "nmf_refine": "._nmf",
    "pseudobulk": "._deseq",
    "vst": "._deseq",
    "rlog": "._transforms",
    "normalized_counts": "._transforms",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
