"""Plots of what :mod:`gpuc.tl` wrote.

matplotlib is imported with the first plot function looked up, not with :mod:`gpuc`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuc._exports import lazy_exports

if TYPE_CHECKING:
    from gpuc.pl._deseq import counts, dispersion, ma, pca, volcano
    from gpuc.pl._metacells import (
        metacell_assignment_quality,
        metacell_convergence,
        metacell_initialization,
        metacell_quality,
        metacell_sizes,
        metacells,
    )
    from gpuc.pl._nmf import nmf_clustergram, nmf_density, nmf_k_sweep, nmf_programs, nmf_usage

__all__ = [
    "counts",
    "dispersion",
    "ma",
    "metacell_assignment_quality",
    "metacell_convergence",
    "metacell_initialization",
    "metacell_quality",
    "metacell_sizes",
    "metacells",
    "nmf_clustergram",
    "nmf_density",
    "nmf_k_sweep",
    "nmf_programs",
    "nmf_usage",
    "pca",
    "volcano",
]
# each public name -> the submodule that defines it
_EXPORTS = {
    "counts": "._deseq",
    "dispersion": "._deseq",
    "ma": "._deseq",
    "metacell_assignment_quality": "._metacells",
    "metacell_convergence": "._metacells",
    "metacell_initialization": "._metacells",
    "metacell_quality": "._metacells",
    "metacell_sizes": "._metacells",
    "metacells": "._metacells",
    "nmf_clustergram": "._nmf",
    "nmf_density": "._nmf",
    "nmf_k_sweep": "._nmf",
    "nmf_programs": "._nmf",
    "nmf_usage": "._nmf",
    "pca": "._deseq",
    "volcano": "._deseq",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
