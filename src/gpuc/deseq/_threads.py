"""CPU only: run a per-gene engine function on gene blocks in threads (numpy and scipy.special release the GIL).

Every gene is solved independently, so blocks give the same per-gene results as one call; on the GPU the whole
batch is one call.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpuc._backend import Backend

MIN_GENES_PER_THREAD = 2048


def n_threads() -> int:
    """Threads for the CPU engine: ``GPUC_NUM_THREADS`` or the number of CPUs (at most 8)."""
    env = os.environ.get("GPUC_NUM_THREADS")
    if env:
        return max(1, int(env))
    try:
        return max(1, min(len(os.sched_getaffinity(0)), 8))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, min(os.cpu_count() or 1, 8))


def gene_blocks(bk: Backend, n_genes: int) -> list[slice] | None:
    """Slices of genes for parallel blocks, or None to run in one call (GPU, small problems, one thread)."""
    if bk.is_gpu:
        return None
    k = min(n_threads(), n_genes // MIN_GENES_PER_THREAD)
    if k < 2:
        return None
    edges = [round(i * n_genes / k) for i in range(k + 1)]
    return [slice(edges[i], edges[i + 1]) for i in range(k)]


def map_blocks(blocks: list[slice], fn: Callable[[slice], Any]) -> list[Any]:
    """Run ``fn`` on every block in a thread pool, results in block order."""
    with ThreadPoolExecutor(max_workers=len(blocks)) as pool:
        return list(pool.map(fn, blocks))
