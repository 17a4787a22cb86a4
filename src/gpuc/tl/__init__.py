"""Tools: compute results and write them into the AnnData (Scanpy conventions)."""

from __future__ import annotations

__all__: list[str] = []
