"""Results as tidy tables, and host <-> device moves of AnnData."""

from __future__ import annotations

from gpuc.get._transfer import to_cpu, to_gpu

__all__ = ["to_cpu", "to_gpu"]
