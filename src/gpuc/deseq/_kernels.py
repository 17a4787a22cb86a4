"""Loaders of the compiled CPU loops of the dispersion solver and the IRLS (:mod:`gpuc.deseq._kernels_numba`).

Each loader returns its kernel, or ``None`` when numba cannot be imported; the callers then use the vectorised form
(the code the GPU runs). Replacing a loader by a function returning ``None`` switches that kernel off (the tests
compare both paths so).
"""

from __future__ import annotations

from gpuc._utils import numba_kernels

# the per-gene NB terms of _dispersion._logpost
nb_logpost_kernel = numba_kernels("gpuc.deseq._kernels_numba", "nb_logpost")
# the per-gene IRLS loop of _glm._fit_nb_glm
irls_kernel = numba_kernels("gpuc.deseq._kernels_numba", "irls")
# the per-gene mu-free part of the NB log-likelihood, sum lgamma(y + r) - lgamma(r) - lgamma(y + 1), r = 1/alpha
nb_const_kernel = numba_kernels("gpuc.deseq._kernels_numba", "nb_const")
# the per-gene safeguarded Newton loop of _dispersion._fit_log_alpha
newton_kernel = numba_kernels("gpuc.deseq._kernels_numba", "newton_log_alpha")
