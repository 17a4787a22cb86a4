"""cNMF's outputs over every gene: the TPM spectra, the z-score spectra and the final usages.

cNMF 1.7's ``consensus()`` (Kotliar et al., eLife 2019; ``dylkot/cNMF``, ``src/cnmf/cnmf.py``) factorises the highly
variable genes, then, with the consensus fixed, writes three products over *all* genes of its TPM matrix ``T`` (each
cell's counts scaled to 10⁶ over all genes):

``gene_spectra_tpm``
    the non-negative least-squares refit of ``T`` on the usages normalised to sum 1 per cell ``N``:
    ``min_{S >= 0} ||T - N S||²`` (``refit_spectra(tpm.X, norm_usages)``);
``gene_spectra_score``
    the least-squares coefficients, without intercept, of ``T``'s genes z-scored over the cells (population SD,
    variance floored at 1e-12) on the consensus usages ``U``: ``(UᵀU)⁻¹ Uᵀ Z`` (``efficient_ols_all_cols``);
the final usages (``refit_usage=True``)
    the non-negative refit of the cells on the TPM spectra over the factorised genes, with ``T`` divided by each
    gene's SD (ddof=1, ``sc.pp.scale(zero_center=False)``) and the spectra by its SD (ddof=0, the ``tpm_stats``).

Everything here needs the data only through products of small cell-side matrices with it: ``Aᵀ X`` for
``A = [N s, U s, s]`` (``s`` each cell's scale to 10⁶) and ``(s²)ᵀ (X∘X)`` (k x genes sufficient statistics; one
pass), then ``X_f M`` over the factorised genes ``f`` (a second pass over those columns). They run where the matrix
lives: numpy/scipy or CuPy/cupyx in memory-bounded blocks (rows of a CSR matrix, genes otherwise), a lazily read
(dask) matrix chunk by chunk (:mod:`gpuc._lazy`'s chunked sums). The per-gene and per-cell NNLS problems are small
(``k`` unknowns each) and are solved all at once by projected coordinate descent on the same device.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuc._backend import Backend, backend_of, get_backend, is_sparse, to_host
from gpuc._dask import is_dask_array

TARGET_SUM = 1e6  # cNMF's TPM: scanpy's normalize_total(target_sum=1e6)
VAR_FLOOR = 1e-12  # cNMF's efficient_ols_all_cols floors each gene's variance at 1e-12
BLOCK_BYTES = 256 * 2**20  # the float64 working copies of one block (the block and its square), at most
FREE_FRACTION = 4  # and at most a quarter of the device's free memory
NNLS_MAX_ITER = 2000
NNLS_TOL = 1e-10


@dataclass
class GeneSpectra:
    """cNMF's all-gene outputs (host float64 arrays; programmes in the order of the usages given).

    Attributes
    ----------
    tpm
        ``(k, n_genes)``: cNMF's ``gene_spectra_tpm``.
    score
        ``(k, n_genes)``: cNMF's ``gene_spectra_score``.
    usages
        ``(n_cells, k)``: cNMF's final usages (the ``consensus_usages`` file with ``refit_usage=True``).
    mean, sd
        ``(n_genes,)``: each gene's mean and population SD in the (TPM-scaled) matrix (cNMF's ``tpm_stats``).
    """

    tpm: np.ndarray
    score: np.ndarray
    usages: np.ndarray
    mean: np.ndarray
    sd: np.ndarray


# --------------------------------------------------------------------------------------------------------------------
# projected coordinate descent for many small NNLS problems sharing one Gram matrix
# --------------------------------------------------------------------------------------------------------------------
def nnls_gram(xp: Any, gram: Any, rhs: Any, *, max_iter: int = NNLS_MAX_ITER, tol: float = NNLS_TOL) -> Any:
    """``argmin_{x_j >= 0} ½ x_jᵀ G x_j - c_jᵀ x_j`` for every column ``c_j`` of ``rhs`` (``k x n``), all at once.

    That is the NNLS ``min_{x >= 0} ||y - B x||²`` with ``G = BᵀB`` and ``c = Bᵀy``. Starts from the unconstrained
    solution clipped at zero, then sweeps the ``k`` coordinates exactly (HALS: each coordinate minimised with the
    others fixed, for all columns in one array operation) until the projected gradient of every column is at most
    ``tol`` times that column's largest ``|c|`` (one scalar read every 10 sweeps), or ``max_iter`` sweeps. Runs on
    the device of ``gram`` and ``rhs`` (``xp``).
    """
    k = gram.shape[0]
    g64 = xp.asarray(gram, dtype=xp.float64)
    c = xp.asarray(rhs, dtype=xp.float64)
    ridge = 1e-12 * float(xp.trace(g64)) / k + 1e-300
    x = xp.maximum(xp.linalg.solve(g64 + ridge * xp.eye(k), c), 0.0)
    diag = xp.diagonal(g64).copy()
    inv = 1.0 / xp.where(diag > 0, diag, 1.0)
    scale = xp.abs(c).max(axis=0) + 1e-300
    for it in range(1, max_iter + 1):
        for j in range(k):
            x[j] = xp.maximum(x[j] - (g64[j] @ x - c[j]) * inv[j], 0.0)
        if it % 10 == 0 or it == max_iter:
            grad = g64 @ x - c
            pg = xp.where(x > 0, grad, xp.minimum(grad, 0.0))
            if float((xp.abs(pg).max(axis=0) / scale).max()) <= tol:
                break
    return x


# --------------------------------------------------------------------------------------------------------------------
# passes over the data: in memory (blocks) and lazily read (dask chunks)
# --------------------------------------------------------------------------------------------------------------------
def _as_float64(bk: Backend, x: Any) -> Any:
    if is_sparse(x):
        return x if x.dtype == np.float64 else x.astype(np.float64)
    return bk.xp.asarray(x, dtype=bk.xp.float64)


def _row_blocks(x: Any) -> bool:
    """Whether ``x`` is walked by rows (a CSR matrix, whose row slices are cheap) rather than by genes."""
    return is_sparse(x) and x.format == "csr"


def _blocks(x: Any, block_bytes: int) -> Iterator[slice]:
    """Slices of rows (CSR) or genes (dense, CSC) whose float64 working copies fit ``block_bytes``."""
    m, n = x.shape
    if is_sparse(x):
        per_entry = 2 * 16  # float64 data + int index, for the block and its square
        total = int(x.nnz) * per_entry
    else:
        per_entry = 2 * 8
        total = m * n * per_entry
    along = m if _row_blocks(x) else n
    step = max(1, int(along * block_bytes // max(total, 1)))
    for start in range(0, along, step):
        yield slice(start, min(start + step, along))


def row_totals(x: Any) -> np.ndarray:
    """Each cell's total over all genes (host float64); a lazily read (dask) matrix is summed chunk by chunk."""
    if is_dask_array(x):
        per_chunk = x.map_blocks(_chunk_row_totals, chunks=(x.chunks[0], (1,) * len(x.chunks[1])), dtype=np.float64)
        return np.asarray(per_chunk.sum(axis=1).compute()).ravel()
    return _chunk_row_totals(x).ravel()


def _chunk_row_totals(block: Any) -> np.ndarray:
    return np.asarray(to_host(block.sum(axis=1)), dtype=np.float64).reshape(-1, 1)


def _moments_in_memory(bk: Backend, x: Any, a: np.ndarray, s2: np.ndarray, block_bytes: int) -> tuple[Any, Any, bool]:
    """``(Aᵀ X, (s²)ᵀ (X∘X), any value < 0)`` for an in-memory ``x``, block by block on its device."""
    xp = bk.xp
    n = x.shape[1]
    a_d, s2_d = bk.asarray(a), bk.asarray(s2)
    p = xp.zeros((a.shape[1], n), dtype=xp.float64)
    q = xp.zeros(n, dtype=xp.float64)
    negative = xp.zeros((), dtype=bool)
    by_rows = _row_blocks(x)
    if is_sparse(x) and not by_rows:
        x = x.tocsc()
    for blk in _blocks(x, block_bytes):
        rows, cols = (blk, slice(None)) if by_rows else (slice(None), blk)
        xb = _as_float64(bk, x[rows, cols])
        data = xb.data if is_sparse(xb) else xb
        if data.size:
            negative = negative | (data.min() < 0)
        if is_sparse(xb):
            p[:, cols] += (xb.T @ a_d[rows]).T
            q[cols] += xb.multiply(xb).T @ s2_d[rows]
        else:
            p[:, cols] += a_d[rows].T @ xb
            q[cols] += s2_d[rows] @ (xb * xb)
    return p, q, bool(negative)


def _times_in_memory(bk: Backend, x: Any, cols: np.ndarray, mat: np.ndarray, block_bytes: int) -> Any:
    """``X[:, cols] @ mat`` (cells x k) for an in-memory ``x``, block by block on its device."""
    xp = bk.xp
    m_d = bk.asarray(mat)
    out = xp.zeros((x.shape[0], mat.shape[1]), dtype=xp.float64)
    if _row_blocks(x):
        for rows in _blocks(x, block_bytes):
            out[rows] += _as_float64(bk, x[rows][:, cols]) @ m_d
        return out
    if is_sparse(x):
        x = x.tocsc()
    n_cols = len(cols)
    step = max(1, int(n_cols * block_bytes // max(2 * 8 * x.shape[0] * n_cols, 1)))
    for start in range(0, n_cols, step):
        part = cols[start : start + step]
        out += _as_float64(bk, x[:, part]) @ m_d[start : start + step]
    return out


def _square(block: Any) -> Any:
    """A chunk squared, in float64 (module level: dask workers import it)."""
    if is_sparse(block):
        b = block.astype(np.float64)
        return b.multiply(b)
    xp = backend_of(block).xp
    b = xp.asarray(block, dtype=xp.float64)
    return b * b


def _chunk_times(block: Any, mat: np.ndarray) -> np.ndarray:
    """One chunk's ``block @ mat`` (rows x k), computed on the chunk's device; float64 on the host."""
    bk = backend_of(block)
    out = _as_float64(bk, block) @ bk.asarray(mat)
    return np.asarray(to_host(out), dtype=np.float64)


def _sum_parts(*parts: np.ndarray) -> np.ndarray:
    return np.sum(parts, axis=0)


def _moments_lazy(x: Any, a: np.ndarray, s2: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """:func:`_moments_in_memory` for a dask array: chunked sums (:mod:`gpuc._lazy`), one ``dask.compute``."""
    import dask

    from gpuc._lazy import CountFlags, _count_flags_graph, _grouped_sum_graph

    p, q, code = dask.compute(
        _grouped_sum_graph(a.T, x, None),
        _grouped_sum_graph(s2[None, :], x.map_blocks(_square, dtype=np.float64), None),
        _count_flags_graph(x, None),
    )
    return np.asarray(p), np.asarray(q).ravel(), CountFlags.from_code(int(code)).negative


def _times_lazy(x: Any, cols: np.ndarray, mat: np.ndarray) -> np.ndarray:
    """:func:`_times_in_memory` for a dask array: the selected genes are read chunk by chunk, never all at once."""
    import dask

    xs = x[:, cols]
    bounds = np.r_[0, np.cumsum(xs.chunks[1])].astype(np.int64)
    blocks = xs.to_delayed()
    times = dask.delayed(_chunk_times, pure=True)
    add = dask.delayed(_sum_parts, pure=True)
    rows = [
        add(*[times(blocks[r, g], mat[bounds[g] : bounds[g + 1]]) for g in range(blocks.shape[1])])
        for r in range(blocks.shape[0])
    ]
    return np.vstack(dask.compute(*rows))


# --------------------------------------------------------------------------------------------------------------------
# the engine
# --------------------------------------------------------------------------------------------------------------------
def _cell_scale(x: Any, normalize: bool, target_sum: float) -> np.ndarray:
    """Each cell's factor to ``target_sum`` over all genes of ``x`` (cNMF's TPM), or ones."""
    if not normalize:
        return np.ones(x.shape[0])
    totals = row_totals(x)
    ok = np.isfinite(totals) & (totals > 0)
    if not ok.all():
        msg = (
            f"{int((~ok).sum())} cell(s) have no counts (or non-finite ones) over the {x.shape[1]} genes, so they "
            f"cannot be scaled to {target_sum:g} (cNMF's TPM); remove them first, or pass the raw counts layer."
        )
        raise ValueError(msg)
    return target_sum / totals


def block_budget(bk: Backend, block_bytes: int | None) -> int:
    """Bytes one block's working copies may take: ``block_bytes``, or :data:`BLOCK_BYTES` and a quarter of the
    device's free memory, whichever is smaller (``None``).
    """
    if block_bytes is not None:
        return int(block_bytes)
    free = bk.free_memory()
    return BLOCK_BYTES if free is None else max(2**20, min(BLOCK_BYTES, free // FREE_FRACTION))


def _moments(x: Any, a: np.ndarray, s2: np.ndarray, block_bytes: int | None) -> tuple[Backend, Any, Any]:
    """The backend of ``x`` (the CPU for a dask array), ``Aᵀ X`` and ``(s²)ᵀ (X∘X)`` on it, after checking that
    ``x`` is non-negative and finite.
    """
    if is_dask_array(x):
        bk = get_backend("cpu")
        p, q, negative = _moments_lazy(x, a, s2)
    else:
        bk = backend_of(x)
        p, q, negative = _moments_in_memory(bk, x, a, s2, block_budget(bk, block_bytes))
    if negative:
        msg = (
            "the matrix of cNMF's all-gene outputs has negative values; it must hold counts (or a non-negative "
            "normalised expression), never scaled data."
        )
        raise ValueError(msg)
    xp = bk.xp
    if not (bool(xp.isfinite(p).all()) and bool(xp.isfinite(q).all())):
        msg = "the matrix of cNMF's all-gene outputs has NaN or infinite values."
        raise ValueError(msg)
    return bk, bk.asarray(p), bk.asarray(q)


def _mean_sd(xp: Any, colsum: Any, sqsum: Any, m: int) -> tuple[Any, Any]:
    """Each gene's mean and population SD (variance floored at :data:`VAR_FLOOR`, as cNMF's z-scores)."""
    mean = colsum / m
    return mean, xp.sqrt(xp.maximum(sqsum / m - mean * mean, VAR_FLOOR))


def _ols_scores(bk: Backend, utx: Any, u: np.ndarray, mean: Any, sd: Any) -> np.ndarray:
    """``(UᵀU)⁻¹ Uᵀ Z`` with ``Uᵀ Z = (Uᵀ X - (Uᵀ 1) meanᵀ) / sd`` (cNMF's ``efficient_ols_all_cols``, ``lstsq``)."""
    utz = (utx - bk.asarray(u.sum(axis=0))[:, None] * mean[None, :]) / sd[None, :]
    return np.linalg.lstsq(u.T @ u, np.asarray(to_host(utz), dtype=np.float64), rcond=None)[0]


def score_spectra(
    x: Any, usages: np.ndarray, scale: np.ndarray | None = None, *, block_bytes: int | None = None
) -> np.ndarray:
    """The ``gene_spectra_score`` of cNMF alone: ``(k, genes)`` least-squares coefficients of each z-scored column of
    ``x`` (each row first multiplied by ``scale``, e.g. ``1e6 / totals``) on ``usages`` (no intercept).

    The z-scoring is folded into the normal equations, so only ``Uᵀ X`` and the column moments are computed, where
    ``x`` lives (as in :func:`gene_spectra`); ``x`` is never densified.
    """
    u = np.asarray(usages, dtype=np.float64)
    m = x.shape[0]
    s = np.ones(m) if scale is None else np.asarray(scale, dtype=np.float64).ravel()
    a = np.hstack([u * s[:, None], s[:, None]])
    bk, p, q = _moments(x, a, s * s, block_bytes)
    k = u.shape[1]
    mean, sd = _mean_sd(bk.xp, p[k], q, m)
    return _ols_scores(bk, p[:k], u, mean, sd)


def gene_spectra(
    x: Any,
    usages: np.ndarray,
    factorised: np.ndarray,
    *,
    normalize: bool = True,
    target_sum: float = TARGET_SUM,
    block_bytes: int | None = None,
    max_iter: int = NNLS_MAX_ITER,
    tol: float = NNLS_TOL,
) -> GeneSpectra:
    """The ``gene_spectra_tpm``, ``gene_spectra_score`` and final (``refit_usage``) usages of cNMF, every gene of ``x``.

    Parameters
    ----------
    x
        Cells x genes, all genes (raw counts for cNMF's outputs): numpy, scipy.sparse, CuPy/cupyx, or a 2-D
        :class:`dask.array.Array` of those. Never densified whole; never moved off its device.
    usages
        ``(n_cells, k)`` consensus usages (the refit on the factorised matrix with the consensus spectra fixed).
    factorised
        Indices into ``x``'s genes of the factorised genes (cNMF's ``nmf_genes_list``), for the final usage refit.
    normalize
        Scale each cell to ``target_sum`` over all genes first (cNMF's TPM); ``False`` uses ``x`` as it is.
    target_sum
        The total each cell is scaled to.
    block_bytes
        Bound on the float64 working copies of one block of an in-memory ``x`` (``None``: :data:`BLOCK_BYTES` or a
        quarter of the device's free memory, whichever is smaller).
    max_iter, tol
        Of the NNLS solves (:func:`nnls_gram`).

    Returns
    -------
    :class:`GeneSpectra` on the host, programmes in the order of ``usages``' columns.

    Raises
    ------
    ValueError
        When ``x`` has negative or non-finite values, or (``normalize``) a cell without counts.
    """
    lazy = is_dask_array(x)
    m = x.shape[0]
    u = np.asarray(usages, dtype=np.float64)
    if u.shape[0] != m:
        msg = f"usages have {u.shape[0]} rows but the matrix has {m} cells."
        raise ValueError(msg)
    k = u.shape[1]
    f = np.asarray(factorised, dtype=np.int64)
    s = _cell_scale(x, normalize, target_sum)
    rs = u.sum(axis=1, keepdims=True)
    norm_u = u / np.where(rs > 0, rs, 1.0)  # cNMF's norm_usages (its division by zero would give NaN)
    a = np.hstack([norm_u * s[:, None], u * s[:, None], s[:, None]])  # m x (2k + 1)
    bk, p, q = _moments(x, a, s * s, block_bytes)
    xp = bk.xp
    mean, sd = _mean_sd(xp, p[2 * k], q, m)
    # gene_spectra_tpm: NNLS of every gene's TPM on the normalised usages
    tpm = nnls_gram(xp, bk.asarray(norm_u.T @ norm_u), p[:k], max_iter=max_iter, tol=tol)
    # gene_spectra_score: OLS of the z-scored TPM on the usages
    score = _ols_scores(bk, p[k : 2 * k], u, mean, sd)
    # the final usages: NNLS of the TPM of the factorised genes / SD (ddof=1) on the TPM spectra / SD (ddof=0)
    sd_f = np.asarray(to_host(sd[f]), dtype=np.float64)
    sd1_f = sd_f * np.sqrt(m / (m - 1)) if m > 1 else sd_f
    spec = np.asarray(to_host(tpm[:, f]), dtype=np.float64) / sd_f[None, :]  # k x |f|
    mat = (spec / sd1_f[None, :]).T  # |f| x k: T_f / sd1 @ specᵀ = X_f @ (spec / sd1)ᵀ, times s
    xm = _times_lazy(x, f, mat) if lazy else _times_in_memory(bk, x, f, mat, block_budget(bk, block_bytes))
    rhs = bk.asarray(s)[:, None] * bk.asarray(xm)
    final = nnls_gram(xp, bk.asarray(spec @ spec.T), rhs.T, max_iter=max_iter, tol=tol).T
    return GeneSpectra(
        tpm=np.asarray(to_host(tpm), dtype=np.float64),
        score=np.asarray(score, dtype=np.float64),
        usages=np.asarray(to_host(final), dtype=np.float64),
        mean=np.asarray(to_host(mean), dtype=np.float64),
        sd=np.asarray(to_host(sd), dtype=np.float64),
    )
