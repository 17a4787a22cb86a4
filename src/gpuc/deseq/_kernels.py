"""Loaders of the compiled per-gene loops of the dispersion solver and the IRLS: the numba CPU kernels
(:mod:`gpuc.deseq._kernels_cpu`) and the numba-cuda GPU kernels (:mod:`gpuc.deseq._kernels_gpu`).

Each CPU loader returns its kernel, or ``None`` when numba cannot be imported; the callers then use the vectorised
form. :func:`gpu_kernels` returns the GPU kernel module for a backend that can launch it, or ``None`` (the callers
then use the batched CuPy form). ``gpuc.settings.numba = False`` switches both off, and replacing a loader by a
function returning ``None`` switches that kernel off (the tests compare both paths so).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from gpuc._utils import numba_kernels

# the per-gene IRLS loop of _glm._fit_nb_glm
irls_kernel = numba_kernels("gpuc.deseq._kernels_cpu", "irls")
# the per-gene mu-free part of the NB log-likelihood, sum lgamma(y + r) - lgamma(r) - lgamma(y + 1), r = 1/alpha
nb_const_kernel = numba_kernels("gpuc.deseq._kernels_cpu", "nb_const")
# R's per-gene dispersion line search and grid (fitDisp, fitDispGrid) of _dispersion._fit_log_alpha; compiled from
# the source the GPU kernels share (_fitdisp), in that module so that numba's disk cache follows its edits
fitdisp_kernel = numba_kernels("gpuc.deseq._fitdisp", "fit_disp_cpu")
fitdisp_grid_kernel = numba_kernels("gpuc.deseq._fitdisp", "fit_disp_grid_cpu")


@functools.cache
def _import_gpu(simulated: bool) -> ModuleType | None:
    # numba-cuda is a GPU extra: without it the GPU path keeps its CuPy array code
    try:
        from numba import config

        if bool(config.ENABLE_CUDASIM) != simulated:
            return None
        from gpuc.deseq import _kernels_gpu
    except ImportError:
        return None
    return _kernels_gpu


# Under numba-cuda's CUDA simulator (the stand-in device of CPU CI) every CUDA thread is a Python thread that
# interprets the kernel: a gene costs milliseconds instead of nanoseconds. Stand-in problems above this many matrix
# entries (genes x samples) take the batched array path, so that pipeline-size CPU-CI runs (pasilla: ~70,000 entries)
# stay fast; the kernels' tests use smaller sets. A real GPU always takes the kernels.
SIMULATED_MAX_ENTRIES = 25_000


def gpu_kernels(bk: Any, p: int, entries: int = 0) -> ModuleType | None:
    """The numba-cuda kernels (:mod:`gpuc.deseq._kernels_gpu`) for a design of ``p`` coefficients on ``bk``, or
    ``None`` (the caller then runs its batched array code).

    ``None`` on the CPU, with ``gpuc.settings.numba`` off, without numba-cuda, for designs wider than
    ``_kernels_gpu.MAXP`` (the kernels' local arrays have a compile-time size), or where ``bk`` cannot launch them. A
    CUDA device launches them through CuPy's stream; the stand-in device of :mod:`gpuc._testing.standin` runs them
    under numba-cuda's CUDA simulator, which must then be on, for problems of at most :data:`SIMULATED_MAX_ENTRIES`
    matrix entries (``entries``: genes x samples of the call).
    """
    from gpuc._backend import fused_kernels_usable
    from gpuc._settings import settings

    if not bk.is_gpu or not settings.numba or not fused_kernels_usable():
        return None
    simulated = bk.launcher is not None
    kern = _import_gpu(simulated)
    if kern is None or p > kern.MAXP or (simulated and entries > SIMULATED_MAX_ENTRIES):
        return None
    return kern
