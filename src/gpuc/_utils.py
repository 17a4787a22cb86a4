"""Small helpers shared by the tools: seeds, progress bars, copy handling."""

from __future__ import annotations

from typing import Any

import numpy as np
from tqdm.auto import tqdm

from gpuc._settings import settings


def derive_seed(random_state: int, *unit: int) -> np.random.SeedSequence:
    """A seed for one independent unit (e.g. a k and a run), fixed by ``(random_state, *unit)`` alone.

    A k's result in a sweep therefore never depends on which other k's are in the sweep.
    """
    return np.random.SeedSequence([int(random_state), *map(int, unit)])


def progress(iterable: Any = None, **kwargs: Any) -> tqdm:
    """A tqdm bar, hidden when ``gpuc.settings.progress`` is False."""
    kwargs.setdefault("disable", not settings.progress)
    kwargs.setdefault("leave", False)
    return tqdm(iterable, **kwargs)
