"""Public names of a package that are imported from their submodule on first use (PEP 562).

``import gpuc`` then costs milliseconds: Scanpy, matplotlib, scikit-learn, SciPy's statistics, dask and the numba
kernels are imported by the tool, plot or getter that needs them, when it is first looked up (``gpuc.tl.deseq``,
``from gpuc.pl import volcano``), not when the package is imported.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package`` for the names in ``exports``.

    Parameters
    ----------
    package
        Dotted name of the package (its ``__name__``).
    exports
        Public name -> the submodule that defines it, relative to ``package`` (``"._deseq"``).

    Returns
    -------
    ``(__getattr__, __dir__)``: the first imports the submodule of a public name on its first lookup and stores the
    value in the package, so later lookups are plain attribute reads; the second lists the public names beside the
    ones already set.
    """

    def __getattr__(name: str) -> Any:
        try:
            module = exports[name]
        except KeyError:
            msg = f"module {package!r} has no attribute {name!r}"
            raise AttributeError(msg) from None
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
