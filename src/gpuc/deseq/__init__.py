"""DESeq2 engine: pure array code (numpy or cupy through a :class:`gpuc._backend.Backend`), genes batched.

The AnnData adapters are :func:`gpuc.tl.deseq` and :func:`gpuc.tl.pseudobulk`.
"""

from __future__ import annotations

from gpuc.deseq._design import Design, build_design, contrast_vector
from gpuc.deseq._pipeline import DeseqFit, results, run_deseq

__all__ = ["DeseqFit", "Design", "build_design", "contrast_vector", "results", "run_deseq"]
