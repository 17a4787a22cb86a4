"""The device names every tool accepts (``device=``) and :attr:`gpuc.settings.device` holds.

A module of its own, importing nothing of gpuc, so that :mod:`gpuc._settings` and :mod:`gpuc._backend` can both use
the names without importing each other.
"""

from __future__ import annotations

from typing import Literal

Device = Literal["auto", "cpu", "gpu"]
DEVICES: tuple[Device, ...] = ("auto", "cpu", "gpu")
