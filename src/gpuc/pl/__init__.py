"""Plots of what :mod:`gpuc.tl` wrote."""

from __future__ import annotations

__all__: list[str] = []
