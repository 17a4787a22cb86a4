"""Usages of new cells on fixed programmes: the non-negative least squares of cNMF's ``refit_usage`` and starCAT's
``fit_transform``, in row blocks.

The query matrix ``X`` (cells x the reference's genes, in the reference's order) is scaled per gene, ``X D`` with
``D = diag(factor)``, exactly as the reference's own matrix was before it was factorised (cNMF divides each gene by
its standard deviation, bixverse may not scale at all), and each cell's usage is
``argmin_{u >= 0} ||x D - u S||^2`` for the fixed spectra ``S`` (k x genes). Cells are independent, so the rows are
cut into blocks of ``block_rows`` and each block is one call of :func:`gpuc.nmf._hals.nnls_refit` (HALS sweeps with
``S S^T`` and ``X D S^T`` computed once per block, warm-started from the clipped least-squares solution) on the
block's device: only one block of the query is ever in memory in a unit, whatever the number of cells. The factors
``D`` come from per-gene moments that are themselves summed block by block (:func:`gene_moments`).

The blocks are the units of the Dask path (``client=``): the spectra and factors are scattered once, each block is
one task (a lazily read matrix is read chunk by chunk on the workers, never gathered), and the usages come back.
Without a client the same unit function runs here block after block, so both paths give bit-identical results for
the same ``block_rows``. Pure array code: no AnnData (:mod:`gpuc.tl._nmf_project` is the adapter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuc._backend import get_backend, is_sparse, to_host
from gpuc._dask import _worker_threads, aligned, is_dask_array, map_units
from gpuc._utils import cpu_threads, numba_kernels, resolve_n_jobs
from gpuc.nmf._hals import Operator, nnls_refit

# the fused CPU kernels of host CSR blocks (None without numba or with gpuc.settings.numba off: array code instead)
_cpu_kernels = numba_kernels("gpuc.nmf._kernels_project_cpu")

PREPROCESSING = ("none", "sd", "sqrt_sd")
# sweeps between the loss checks of a block's refit: most blocks meet tol within 10 sweeps of the warm start, and a
# check costs a small fraction of a sweep (the loss comes from the k x k Gram and the stored product)
CHECK_EVERY = 5
BLOCK_ROWS = 10_000  # default rows per block: 10,000 x 2,000 genes is 80 MB dense float32, a few MB sparse


@dataclass(frozen=True)
class GeneMoments:
    """Per-gene sums over cells, accumulated block by block in float64 (host).

    Attributes
    ----------
    n
        Cells summed.
    total
        ``(genes,)`` sum of the values.
    total_sq
        ``(genes,)`` sum of the squared values.
    """

    n: int
    total: np.ndarray
    total_sq: np.ndarray

    def __add__(self, other: GeneMoments) -> GeneMoments:
        return GeneMoments(self.n + other.n, self.total + other.total, self.total_sq + other.total_sq)

    @staticmethod
    def summed(parts: list[GeneMoments]) -> GeneMoments:
        """The moments of row blocks ``parts`` (at least one) added in block order."""
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out

    def sd(self, ddof: int = 1) -> np.ndarray:
        """Per-gene standard deviation (``ddof=1`` as :func:`gpuc.nmf._prepare.prepare_matrix` and cNMF use)."""
        mean = self.total / max(self.n, 1)
        var = np.maximum(self.total_sq / max(self.n, 1) - mean * mean, 0.0) * self.n / max(self.n - ddof, 1)
        return np.sqrt(var)


@dataclass(frozen=True)
class ProjectOptions:
    """How each block is solved (passed whole to every unit).

    Attributes
    ----------
    device
        ``"cpu"`` or ``"gpu"`` (already resolved).
    dtype
        Working precision of the block and the usages (``None``: float32).
    max_iter
        HALS sweeps at most per block.
    tol
        A block stops when its loss changed by less than ``tol * max(||X D||^2, 1)`` between two checks (every 10
        sweeps), as in :func:`gpuc.nmf._hals.nnls_refit`.
    """

    device: str = "cpu"
    dtype: Any = None
    max_iter: int = 1000
    tol: float = 1e-6


@dataclass
class BlockResult:
    """One block's usages (host float64, ``rows x k``), loss ``||X D - U S||^2`` and ``||X D||^2``."""

    usages: np.ndarray
    loss: float
    norm2: float


@dataclass
class ProjectionResult:
    """Usages of every cell and the fit's summary.

    Attributes
    ----------
    usages
        ``(cells, k)`` host float64.
    loss
        ``||X D - U S||_F^2`` summed over the blocks.
    norm2
        ``||X D||_F^2``.
    n_blocks
        Row blocks solved.
    """

    usages: np.ndarray
    loss: float
    norm2: float
    n_blocks: int

    @property
    def rel_error(self) -> float:
        """``||X D - U S||^2 / ||X D||^2``."""
        return self.loss / max(self.norm2, 1e-300)


# --------------------------------------------------------------------------------------------------------------------
# per-gene moments and factors
# --------------------------------------------------------------------------------------------------------------------
def _columns(block: Any, genes: np.ndarray | None) -> Any:
    """``block[:, genes]`` (all columns when ``genes`` is None), as CSR for sparse blocks."""
    if genes is not None:
        block = block[:, genes]
    return block.tocsr() if is_sparse(block) and block.format != "csr" else block


def _host_csr(block: Any) -> bool:
    """Whether ``block`` is a scipy sparse matrix (the blocks the fused CPU kernels take)."""
    import scipy.sparse

    return scipy.sparse.issparse(block)


def _positions(n_cols: int, genes: np.ndarray | None) -> tuple[np.ndarray, int]:
    """Each column's position among ``genes`` (-1 when not selected), and the number of selected genes."""
    if genes is None:
        return np.arange(n_cols, dtype=np.int64), n_cols
    pos = np.full(n_cols, -1, dtype=np.int64)
    pos[genes] = np.arange(len(genes), dtype=np.int64)
    return pos, len(genes)


@dataclass
class _FusedProduct(Operator):
    """``X[:, genes] D`` of a host CSR block, never formed: its one product with the fixed spectra, ``X D S^T``, and
    ``||X D||^2`` come from one pass of :func:`gpuc.nmf._kernels_project_cpu.selected_product`. :meth:`dot` returns
    that product (what :func:`gpuc.nmf._hals.nnls_refit` asks for) and refuses any other.
    """

    spectra_t: Any = None
    product: Any = None

    def dot(self, x: Any) -> Any:
        if x.shape != self.spectra_t.shape or not np.array_equal(x, self.spectra_t):
            msg = "this operator only multiplies by the spectra it was built with"
            raise ValueError(msg)
        return self.product


def _fused_operator(kern: Any, block: Any, genes: Any, spectra: np.ndarray, factor: np.ndarray, dtype: Any) -> Any:
    """The :class:`_FusedProduct` of a host CSR block (checked: finite, non-negative on the selected genes)."""
    block = block.tocsr()
    rows = int(block.shape[0])
    pos, n_sel = _positions(block.shape[1], genes)
    spectra_t = np.ascontiguousarray(spectra.T, dtype=dtype)  # (genes, k), as nnls_refit will pass it
    w = np.ascontiguousarray(spectra_t * factor.astype(dtype)[:, None])
    product = np.empty((rows, spectra_t.shape[1]), dtype=dtype)
    row_norm2, row_min = np.empty(rows), np.empty(rows)
    kern.selected_product(block.indptr, block.indices, block.data, pos, w, factor, product, row_norm2, row_min)
    _check_values(np, row_norm2, row_min)
    norm2 = float(row_norm2.sum())
    return _FusedProduct(None, None, (rows, n_sel), norm2, 0.0, True, np.dtype(dtype), spectra_t, product)


def _check_values(xp: Any, values: Any, minimum: Any) -> None:
    """Raise the projection's :class:`ValueError` when ``values`` are not finite or ``minimum`` is below zero."""
    if values.size and not bool(xp.isfinite(values).all()):
        msg = "the query matrix has NaN or infinite values on the reference's genes; NMF usages need finite input."
        raise ValueError(msg)
    if minimum.size and float(minimum.min()) < 0:
        msg = (
            f"the query matrix has negative values on the reference's genes (min {float(minimum.min()):.4g}); project "
            "the same kind of values the reference was fitted on (raw counts for cNMF/starCAT), never scaled data."
        )
        raise ValueError(msg)


def select_genes(
    x: Any, genes: np.ndarray | None, *, block_rows: int = BLOCK_ROWS, n_jobs: int | None = None
) -> tuple[Any, np.ndarray | None, GeneMoments | None]:
    """``(x[:, genes], None, moments)`` for an in-memory host CSR matrix, copied out by one compiled pass
    (:func:`gpuc.nmf._kernels_project_cpu.compact_selected`, after a count pass over the column indices) that also
    sums the selected genes' :class:`GeneMoments`; ``(x, genes, None)`` for anything else (dask, dense, device
    arrays, other sparse formats, or without numba).

    The moments equal ``gene_moments(x, genes, block_rows=block_rows)`` bit for bit (each block summed in the same
    chunks, the blocks added in order), and the product with the spectra then reads only the reference genes' values
    (each row keeps its values in their stored order, so it adds the same numbers in the same order): one pass over
    every stored value instead of two, each looking up every value's gene. The copy holds the selected genes' values
    only (a fifth of ``x`` for 2,000 of 14,000 genes of a typical query).
    """
    import scipy.sparse

    if genes is None or not (scipy.sparse.issparse(x) and x.format == "csr"):
        return x, genes, None
    kern = _cpu_kernels()
    if kern is None:
        return x, genes, None
    pos, n_sel = _positions(x.shape[1], genes)
    rows = int(x.shape[0])
    # the lookup table of every stored value's gene in its smallest type (27 KB for 14,000 genes: it stays in L1)
    pos = pos.astype(np.int16 if n_sel < np.iinfo(np.int16).max else np.int32)
    with cpu_threads(n_jobs):
        indptr, indices, data, m = kern.compact_selected(
            x.indptr, x.indices, x.data, pos, n_sel, max(int(block_rows), 1)
        )
    if indptr[-1] <= np.iinfo(np.int32).max:
        indptr = indptr.astype(np.int32)
    out = scipy.sparse.csr_matrix((data, indices, indptr), shape=(rows, n_sel), copy=False)
    parts = [GeneMoments(min(block_rows, rows - a), m[b, 0], m[b, 1]) for b, a in enumerate(range(0, rows, block_rows))]
    return out, None, GeneMoments.summed(parts or [GeneMoments(0, m[0, 0], m[0, 1])])


def block_moments(block: Any, genes: np.ndarray | None = None, *, n_jobs: int | None = None) -> GeneMoments:
    """:class:`GeneMoments` of one row block (``genes`` selects and orders its columns), summed on its device.

    A host CSR block is summed by one compiled pass that reads only the selected genes' values (no copy of them).
    """
    kern = _cpu_kernels() if _host_csr(block) else None
    if kern is not None:
        block = block.tocsr()
        pos, n_sel = _positions(block.shape[1], genes)
        with cpu_threads(n_jobs):
            m = kern.selected_moments(block.indptr, block.indices, block.data, pos, n_sel)
        return GeneMoments(int(block.shape[0]), m[0], m[1])
    block = _columns(block, genes)
    sq = block.multiply(block) if is_sparse(block) else block * block
    total = np.asarray(to_host(block.sum(axis=0, dtype=np.float64))).ravel()
    total_sq = np.asarray(to_host(sq.sum(axis=0, dtype=np.float64))).ravel()
    return GeneMoments(int(block.shape[0]), total, total_sq)


def gene_moments(
    x: Any, genes: np.ndarray | None = None, *, block_rows: int = BLOCK_ROWS, client: Any = None
) -> GeneMoments:
    """:class:`GeneMoments` of ``x`` (in memory or a dask array) over ``genes``, one row block at a time.

    A dask array is summed chunk by chunk by Dask (on ``client`` when given, else in this process), so it is never
    loaded whole; an in-memory matrix is summed block by block here.
    """
    if is_dask_array(x):
        parts = _dask_map(block_moments, _dask_blocks(x, block_rows), {"genes": genes}, client)
    else:
        parts = [block_moments(_rows(x, a, a + block_rows), genes) for a in range(0, x.shape[0], block_rows)]
    return GeneMoments.summed(parts)


def gene_factors(moments: GeneMoments, preprocessing: str) -> np.ndarray:
    """The per-gene multipliers ``D`` of a preprocessing: ``1/sd`` (``"sd"``), ``1/sqrt(sd)`` (``"sqrt_sd"``) or 1.

    Genes without variance (e.g. zero in every query cell) get 1, as scikit-learn's ``scale`` (used by starCAT)
    gives them: their values, all equal, are left as they are.
    """
    if preprocessing not in PREPROCESSING:
        msg = f"preprocessing={preprocessing!r} is not valid; use one of {PREPROCESSING}."
        raise ValueError(msg)
    sd = moments.sd(ddof=1)
    if preprocessing == "none":
        return np.ones_like(sd)
    ok = sd > 1e-12 * np.maximum(moments.total / max(moments.n, 1), 1.0)
    base = sd if preprocessing == "sd" else np.sqrt(sd)
    return np.where(ok, 1.0 / np.where(ok, base, 1.0), 1.0)


# --------------------------------------------------------------------------------------------------------------------
# one block
# --------------------------------------------------------------------------------------------------------------------
def project_block(
    block: Any,
    *,
    genes: np.ndarray | None,
    spectra: np.ndarray,
    factor: np.ndarray,
    options: ProjectOptions,
    n_jobs: int | None = None,
) -> BlockResult:
    """Usages of one row block: ``argmin_{U >= 0} ||block[:, genes] D - U S||^2`` on ``options.device``.

    ``block`` may be host or device, dense or sparse; it is checked (finite, non-negative), moved to the device,
    its columns scaled by ``factor`` and solved by :func:`gpuc.nmf._hals.nnls_refit`. ``spectra`` is ``(k, genes)``.
    """
    backend = get_backend(options.device, block)
    xp = backend.xp
    dtype = np.dtype(np.float32 if options.dtype is None else options.dtype)
    kern = _cpu_kernels() if not backend.is_gpu and _host_csr(block) else None
    if kern is not None:  # one compiled pass over the block, no copy of its selected genes
        with cpu_threads(n_jobs):
            op = _fused_operator(kern, block, genes, spectra, factor, dtype)
            usages, loss = nnls_refit(
                backend,
                op,
                spectra,
                max_iter=options.max_iter,
                tol=options.tol,
                check_every=CHECK_EVERY,
            )
        return BlockResult(np.asarray(usages, dtype=np.float64), float(loss), op.norm2)
    block = backend.asarray(_columns(block, genes), dtype=dtype)
    data = block.data if is_sparse(block) else block
    _check_values(xp, data, data)
    d = backend.asarray(factor, dtype=dtype)
    if is_sparse(block):
        v = (block @ backend.sparse.diags(d)).tocsr()
        vals = v.data
    else:
        v = xp.ascontiguousarray(block * d[None, :])
        vals = v
    norm2 = float((vals.astype(xp.float64) ** 2).sum())
    mean = float(vals.astype(xp.float64).sum()) / max(v.shape[0] * v.shape[1], 1)
    # only V @ x is used by the refit: no transposed copy of the block is made
    op = Operator(v, None, (int(v.shape[0]), int(v.shape[1])), norm2, mean, is_sparse(v), dtype)
    with cpu_threads(n_jobs):
        h = backend.asarray(spectra, dtype=dtype)
        usages, loss = nnls_refit(backend, op, h, max_iter=options.max_iter, tol=options.tol, check_every=CHECK_EVERY)
    return BlockResult(np.asarray(to_host(usages), dtype=np.float64), float(loss), norm2)


# --------------------------------------------------------------------------------------------------------------------
# all blocks
# --------------------------------------------------------------------------------------------------------------------
def _dask_blocks(x: Any, block_rows: int) -> list[Any]:
    """The row blocks of a dask array as delayed objects, rows cut every ``block_rows``, all columns: the unit
    selects the genes itself (on a host CSR block the fused kernel reads them in place instead of copying them out).
    """
    return list(x.rechunk({0: block_rows, 1: -1}).to_delayed().ravel())


def _dask_map(fn: Any, blocks: list[Any], shared: dict[str, Any], client: Any) -> list[Any]:
    """``[fn(block, **shared) for block in blocks]`` over the delayed blocks of a dask array: on ``client`` (the
    shared values scattered once to every worker, every block read and processed on a worker, only the results
    gathered), or here one block at a time (each read, processed and dropped before the next).
    """
    import dask

    if client is None:
        return [fn(dask.compute(b, scheduler="sync")[0], **shared) for b in blocks]
    futures = {k: client.scatter([v], broadcast=True, hash=False)[0] for k, v in shared.items()}
    try:
        tasks = [dask.delayed(_on_worker, pure=True)(fn, b, **futures) for b in blocks]
        handles = client.compute(tasks)
        try:
            return client.gather(handles)
        finally:
            client.cancel(handles)
    finally:
        client.cancel(list(futures.values()))


def _on_worker(fn: Any, block: Any, **shared: Any) -> Any:
    """``fn(block, **shared)`` in a Dask task: on the worker's threads at most, on aligned copies of its arrays (see
    :func:`gpuc._dask.aligned`: a misaligned array would round differently from this process).
    """
    threads = _worker_threads()
    n = resolve_n_jobs(None) if threads is None else min(resolve_n_jobs(None), threads)
    block, shared = aligned(block), aligned(shared)
    return fn(block, **shared, n_jobs=n)


def _rows(x: Any, a: int, b: int) -> Any:
    """Rows ``a:b`` of an in-memory matrix; of a scipy CSR matrix as a view of its values (no copy of the block)."""
    import scipy.sparse

    if scipy.sparse.issparse(x) and x.format == "csr":
        lo, hi = int(x.indptr[a]), int(x.indptr[min(b, x.shape[0])])
        indptr = x.indptr[a : b + 1] - x.indptr[a]
        return scipy.sparse.csr_matrix(
            (x.data[lo:hi], x.indices[lo:hi], indptr), shape=(len(indptr) - 1, x.shape[1]), copy=False
        )
    return x[a:b]


def _block_unit(block: Any, **kwargs: Any) -> BlockResult:
    """The unit of :func:`map_units`: one in-memory block (``n_jobs`` comes from the unit runner)."""
    return project_block(block, **kwargs)


def project(
    x: Any,
    spectra: np.ndarray,
    factor: np.ndarray,
    *,
    genes: np.ndarray | None = None,
    block_rows: int = BLOCK_ROWS,
    options: ProjectOptions | None = None,
    client: Any = None,
    n_jobs: int | None = None,
) -> ProjectionResult:
    """Usages of every row of ``x`` on the fixed ``spectra`` (``(k, genes)``), in row blocks.

    Parameters
    ----------
    x
        Cells x genes: numpy, scipy.sparse, cupy / cupyx, or a :class:`dask.array.Array` of such chunks.
    spectra
        ``(k, len(genes))`` non-negative programmes, in the order of ``genes``.
    factor
        ``(len(genes),)`` per-gene multipliers (:func:`gene_factors`).
    genes
        Column indices of ``x`` matching the spectra's genes (``None``: all columns, in order).
    block_rows
        Rows per block; results depend on it only through each block's stopping rule (below ``tol``).
    options
        :class:`ProjectOptions`.
    client
        A ``distributed.Client`` (one task per block) or ``None`` (blocks one after the other here).
    n_jobs
        CPU threads of each block.

    Returns
    -------
    :class:`ProjectionResult`; the usages are identical with and without a client.
    """
    options = options or ProjectOptions()
    spectra = np.ascontiguousarray(spectra, dtype=np.float64)
    factor = np.ascontiguousarray(factor, dtype=np.float64)
    shared = {"genes": genes, "spectra": spectra, "factor": factor, "options": options}
    m = int(x.shape[0])
    starts = list(range(0, m, block_rows))
    if is_dask_array(x):
        blocks = _dask_blocks(x, block_rows)
        results = _dask_map(project_block, blocks, shared, client)
    elif client is None:
        n = resolve_n_jobs(n_jobs)
        results = [project_block(_rows(x, a, a + block_rows), **shared, n_jobs=n) for a in starts]
    else:
        units = [(f"rows {a}-{min(a + block_rows, m) - 1}", (_rows(x, a, a + block_rows),)) for a in starts]
        results = map_units(_block_unit, units, client=client, shared=shared, n_jobs=n_jobs, what="nmf_project",
                            scatter_args=True)  # fmt: skip
    k = spectra.shape[0]
    usages = np.concatenate([r.usages for r in results]) if results else np.zeros((0, k))
    return ProjectionResult(
        usages, float(sum(r.loss for r in results)), float(sum(r.norm2 for r in results)), len(results)
    )
