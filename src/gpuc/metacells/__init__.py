"""SEACells metacells engine: pure array code (numpy/scipy or cupy/cupyx through a :class:`gpuc._backend.Backend`).

Kernel (:func:`build_kernel`), archetype initialisation (:func:`initial_archetypes`), the alternating Frank-Wolfe
solver (:func:`fit`) with the reduced-form error (:func:`rss_reduced`), the end-to-end :func:`run_metacells`, and the
quality metrics. :func:`gpuc.tl.metacells` is the AnnData adapter.
"""

from __future__ import annotations

from gpuc.metacells._init import greedy_centers, initial_archetypes, waypoint_centers
from gpuc.metacells._kernel import build_kernel, compute_knn, knn_from_graph
from gpuc.metacells._pipeline import MetacellResult, run_metacells
from gpuc.metacells._solver import (
    FitResult,
    MetacellConvergenceWarning,
    fit,
    fw_weights,
    rss_reduced,
    update_a,
    update_b,
)

__all__ = [
    "FitResult",
    "MetacellConvergenceWarning",
    "MetacellResult",
    "build_kernel",
    "compute_knn",
    "fit",
    "fw_weights",
    "greedy_centers",
    "initial_archetypes",
    "knn_from_graph",
    "rss_reduced",
    "run_metacells",
    "update_a",
    "update_b",
    "waypoint_centers",
]
