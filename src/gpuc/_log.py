"""Scanpy-style log messages without importing Scanpy.

The tools report what they compute through Scanpy's logger (``sc.settings.verbosity`` decides what shows, and
``logg.info(..., time=start)`` appends the elapsed time), as Scanpy's own tools do. Importing Scanpy costs about
2 s, so this module only forwards to it when the user's process has already imported it. Without Scanpy in the
process nobody can have raised its verbosity above the default (warning), under which info and debug messages are
not shown, so nothing is lost by staying silent.
"""

from __future__ import annotations

import sys
from datetime import datetime
from typing import Any

DEFAULT_VERBOSITY = 1  # scanpy's default: warnings and errors only


def _scanpy_logging() -> Any | None:
    """``scanpy.logging`` when Scanpy is already imported in this process, else None (never imports it)."""
    if "scanpy" not in sys.modules:
        return None
    from scanpy import logging as logg

    return logg


def verbosity() -> int:
    """Scanpy's verbosity level when Scanpy is loaded, else its default (1, warnings)."""
    if "scanpy" not in sys.modules:
        return DEFAULT_VERBOSITY
    return int(sys.modules["scanpy"].settings.verbosity)


def info(msg: str, *, time: datetime | None = None, deep: str | None = None) -> datetime:
    """Log ``msg`` at info level, with the time since ``time`` and the ``deep`` detail (shown at hint level) if
    given; returns now, to pass on as ``time``.
    """
    logg = _scanpy_logging()
    if logg is None:
        return datetime.now()
    return logg.info(msg, time=time, deep=deep)


def debug(msg: str, *, time: datetime | None = None, deep: str | None = None) -> datetime:
    """Log ``msg`` at debug level (as :func:`info`); returns now."""
    logg = _scanpy_logging()
    if logg is None:
        return datetime.now()
    return logg.debug(msg, time=time, deep=deep)
