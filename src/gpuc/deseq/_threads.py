"""CPU only: run a per-gene engine function on cache-sized gene blocks, in threads (numpy and scipy.special
release the GIL).

Every gene is solved independently, so blocks give the same per-gene results as one call. Blocks of about 2^16
matrix entries keep the many elementwise temporaries of a Newton step in cache (faster and far less memory than
whole-matrix temporaries). On the GPU the whole batch is one call. The number of threads follows ``n_jobs``
(:func:`gpuc._utils.cpu_threads`); results are per gene, so they do not depend on it.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpuc._backend import Backend
from gpuc._utils import current_n_jobs

BLOCK_ENTRIES = 2**16


def n_threads() -> int:
    """Threads for the CPU engine: those of the enclosing ``cpu_threads(n_jobs)`` block, else ``gpuc.settings.n_jobs``."""
    return current_n_jobs()


def gene_blocks(bk: Backend, n_genes: int, n_samples: int) -> list[slice] | None:
    """Slices of about ``BLOCK_ENTRIES / n_samples`` genes, or None to run in one call (GPU, small problems)."""
    if bk.is_gpu:
        return None
    size = max(128, BLOCK_ENTRIES // max(n_samples, 1))
    k = -(-n_genes // size)
    if k < 2:
        return None
    edges = [round(i * n_genes / k) for i in range(k + 1)]
    return [slice(edges[i], edges[i + 1]) for i in range(k)]


_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}


def _pool(workers: int) -> ThreadPoolExecutor:
    """The process's executor with ``workers`` threads, made once per process.

    A fit maps blocks several times, and starting the threads for each map costs milliseconds; idle executor threads
    wait on their queue and use no CPU. The key holds the process id: a forked child (e.g. a Dask worker) inherits
    the parent's executor objects but not their threads, so it makes its own.
    """
    key = (os.getpid(), workers)
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gpuc-deseq")
    return pool


def map_blocks(blocks: list[slice], fn: Callable[[slice], Any]) -> list[Any]:
    """Run ``fn`` on every block (in a thread pool when more than one thread is allowed), results in block order.

    Each block runs in the caller's context (``contextvars``), so the enclosing :func:`gpuc._utils.cpu_threads`
    block is seen inside it.
    """
    workers = min(n_threads(), len(blocks))
    if workers < 2:
        return [fn(b) for b in blocks]
    ctx = contextvars.copy_context()
    return list(_pool(workers).map(lambda b: ctx.copy().run(fn, b), blocks))
