"""Bundled real datasets, loaded offline from the package (no network access)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuc._exports import lazy_exports

if TYPE_CHECKING:
    from gpuc.datasets._load import pasilla, pbmc3k

__all__ = [
    "pasilla",
    "pbmc3k",
]
# each public name -> the submodule that defines it
_EXPORTS = {"pasilla": "._load", "pbmc3k": "._load"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
