"""CPU only: run per-gene engine work on gene blocks, in threads (numpy and scipy.special release the GIL).

Every gene is solved independently, so blocks give the same per-gene results as one call. Two levels:

- :func:`stage_blocks`: the per-gene stages of a fit (dispersion start and genewise fit; MAP, GLM, Cook's and refit)
  run on spans of about ``STAGE_ENTRIES`` matrix entries, in parallel, so that everything between the solvers
  (moments, mu, Cook's distances, outlier replacement) is parallel too. The spans have a fixed size whatever the
  thread count, so results never depend on ``n_jobs``.
- :func:`gene_blocks`: inside a stage, the solvers work on cache-sized blocks of about ``BLOCK_ENTRIES`` entries,
  which keep the many elementwise temporaries of a Newton step in cache (faster and far less memory than
  whole-matrix temporaries); inside a stage block they run one after the other on the block's thread.

On the GPU the whole batch is one call. The number of threads follows ``n_jobs`` (:func:`gpuc._utils.cpu_threads`).
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
STAGE_ENTRIES = 2**17
STAGE_MIN_GENES = 512

# set inside a block's task: nested maps run on that thread (queueing them on the same executor could deadlock)
_IN_BLOCK: contextvars.ContextVar[bool] = contextvars.ContextVar("gpuc_deseq_in_block", default=False)


def n_threads() -> int:
    """Threads for the CPU engine: those of the enclosing ``cpu_threads(n_jobs)`` block, else ``gpuc.settings.n_jobs``."""
    return current_n_jobs()


def _even_slices(n_genes: int, size: int) -> list[slice] | None:
    # ceil(n_genes / size) slices of nearly equal length, or None when one holds every gene
    k = -(-n_genes // size)
    if k < 2:
        return None
    edges = [round(i * n_genes / k) for i in range(k + 1)]
    return [slice(edges[i], edges[i + 1]) for i in range(k)]


def gene_blocks(bk: Backend, n_genes: int, n_samples: int) -> list[slice] | None:
    """Slices of about ``BLOCK_ENTRIES / n_samples`` genes, or None to run in one call (GPU, small problems)."""
    if bk.is_gpu:
        return None
    return _even_slices(n_genes, max(128, BLOCK_ENTRIES // max(n_samples, 1)))


def in_gene_blocks(bk: Backend, shape: tuple[int, int], fit: Callable[[slice | None], Any], join: Callable) -> Any:
    """A per-gene fit of a genes x samples problem of ``shape``: ``fit(None)`` on every gene in one call when
    :func:`gene_blocks` keeps them together, else ``join`` of ``fit(block)`` over the blocks (:func:`map_blocks`).
    """
    blocks = gene_blocks(bk, shape[0], shape[1])
    return fit(None) if blocks is None else join(map_blocks(blocks, fit))


def stage_blocks(bk: Backend, n_genes: int, n_samples: int) -> list[slice] | None:
    """Slices of about ``STAGE_ENTRIES / n_samples`` genes for a whole per-gene stage, or None to run it in one call
    (GPU, small problems, or already inside a block). Independent of the thread count.
    """
    if bk.is_gpu or _IN_BLOCK.get():
        return None
    return _even_slices(n_genes, max(STAGE_MIN_GENES, STAGE_ENTRIES // max(n_samples, 1)))


def over_gene_spans(bk: Backend, n_genes: int, n_samples: int, fn: Callable[[slice], None]) -> None:
    """Run ``fn`` (which writes the rows of its slice of genes into preallocated outputs) on the stage spans of
    :func:`stage_blocks` in parallel, or once on all genes where there are none (GPU, small problems, inside a
    block). For per-gene work, whose values do not depend on the split.
    """
    map_blocks(stage_blocks(bk, n_genes, n_samples) or [slice(None)], fn)


def column_blocks(bk: Backend, n_cols: int, n_rows: int) -> list[slice] | None:
    """Slices of the columns (e.g. samples) of an ``n_rows x n_cols`` matrix, about ``STAGE_ENTRIES`` entries each,
    for column-wise work (one result per column, so any split gives the same values); None on the GPU, inside a
    block, or when one slice holds every column. Independent of the thread count.
    """
    if bk.is_gpu or _IN_BLOCK.get():
        return None
    return _even_slices(n_cols, max(1, STAGE_ENTRIES // max(n_rows, 1)))


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

    Each block runs in a copy of the caller's context (``contextvars``), so the enclosing
    :func:`gpuc._utils.cpu_threads` block is seen inside it; maps nested inside a block run serially on its thread,
    with any thread count (so block boundaries, hence results, never depend on it).
    """
    if _IN_BLOCK.get():
        return [fn(b) for b in blocks]
    ctx = contextvars.copy_context()

    def task(b: slice) -> Any:
        _IN_BLOCK.set(True)  # in the task's copy of the context only
        return fn(b)

    workers = min(n_threads(), len(blocks))
    if workers < 2:
        return [ctx.copy().run(task, b) for b in blocks]
    return list(_pool(workers).map(lambda b: ctx.copy().run(task, b), blocks))
