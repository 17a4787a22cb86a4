"""Plots of what :mod:`gpuc.tl` wrote."""

from __future__ import annotations

from gpuc.pl._deseq import dispersion, ma, volcano
from gpuc.pl._metacells import metacell_convergence, metacell_quality, metacell_sizes, metacells
from gpuc.pl._nmf import nmf_clustergram, nmf_density, nmf_k_sweep, nmf_programs, nmf_usage

__all__: list[str] = [
    "dispersion",
    "ma",
    "metacell_convergence",
    "metacell_quality",
    "metacell_sizes",
    "metacells",
    "nmf_clustergram",
    "nmf_density",
    "nmf_k_sweep",
    "nmf_programs",
    "nmf_usage",
    "volcano",
]
