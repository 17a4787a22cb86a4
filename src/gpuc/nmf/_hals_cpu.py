"""Loader of the fused CPU kernels of the HALS engine (:mod:`gpuc.nmf._kernels_cpu`).

``kernels()`` returns that module, whose ``spectra_half`` and ``usage_half`` run one half-iteration each, or ``None``
when numba cannot be imported; :func:`gpuc.nmf._hals.fit_hals_groups` then runs its array code. Replacing ``kernels``
by a function returning ``None`` switches the fused kernels off (the tests compare both paths so).
"""

from __future__ import annotations

from gpuc._utils import numba_kernels

kernels = numba_kernels("gpuc.nmf._kernels_cpu")
