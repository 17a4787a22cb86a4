"""Issue 31, memory checks: the DESeq2 estimate counts the design's width (p x p covariances and IRLS systems per
gene), checked against tracemalloc peaks of the CPU fit; a fit whose wide design does not fit is refused up front."""

from __future__ import annotations

import pytest

import gpuc
from gpuc import InsufficientMemoryError
from gpuc._backend import Backend
from gpuc.tl._deseq import deseq_peak_bytes

# the stated factor: the measured peak lies between LOW and HIGH times the estimate
LOW, HIGH = 0.35, 1.1


@pytest.mark.parametrize(("n", "levels", "n_genes"), [(24, 2, 1500), (60, 25, 600), (84, 41, 500)])
def test_estimate_brackets_the_measured_peak(wide_design, traced_peak, n, levels, n_genes):
    a = wide_design(n, levels, n_genes)
    # one-time set-up (numba compiling or loading every kernel this shape reaches) outside the measurement
    gpuc.tl.deseq(a.copy(), "~f", device="cpu", n_jobs=1)
    peak = traced_peak(gpuc.tl.deseq, a, "~f", device="cpu", n_jobs=1)
    p = len(a.uns["deseq"]["design_columns"])
    assert p == levels
    est = deseq_peak_bytes(n, n_genes, p, block_genes=max(128, 2**16 // n))  # one thread: one gene block
    assert LOW * est <= peak <= HIGH * est, f"peak {peak / 2**20:.1f} MiB vs estimate {est / 2**20:.1f} MiB"
    if p > 20:  # the old, width-blind estimate undercounted these
        assert (14.0 * n + 100.0) * 8.0 * n_genes < 0.7 * peak


def test_wide_design_refused_up_front(monkeypatch, unchanged, wide_design):
    a = wide_design(84, 41, 500)
    narrow, wide = deseq_peak_bytes(84, 500, 2), deseq_peak_bytes(84, 500, 41, block_genes=128)
    monkeypatch.setattr(Backend, "free_memory", lambda self: (narrow + wide) / 2)
    with unchanged(a), pytest.raises(InsufficientMemoryError, match="The design has 41 columns"):
        gpuc.tl.deseq(a, "~f", device="cpu")
    b = wide_design(84, 2, 500)  # the same samples with a narrow design fit
    gpuc.tl.deseq(b, "~f", device="cpu")
