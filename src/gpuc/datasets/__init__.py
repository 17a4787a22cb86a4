"""Bundled real datasets, loaded offline from the package (no network access)."""

from __future__ import annotations

from gpuc.datasets._load import pasilla, pbmc3k

__all__ = ["pasilla", "pbmc3k"]
