"""What a fit records to recognise its input again: names in order and a cheap fingerprint of the matrix it read.

A fit stores ``uns[key]["inputs"]`` (:func:`record`): the number of cells (or samples) and a digest of their names
in order, the same for the genes, and for the factorised matrix four sums that change when a value, the order of
the cells or the order of the genes changes (:func:`matrix_fingerprint`). Readers then tell a gene subset (aligned
by name) from a reordered or changed matrix, or from objects joined by ``anndata.concat`` (refused).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np


def names_digest(names: Any) -> str:
    """A short digest of ``names`` in order (SHA-256 of the names joined by a unit separator, 16 hex digits)."""
    joined = "\x1f".join(str(n) for n in np.asarray(names, dtype=object).ravel())
    return hashlib.sha256(joined.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def matrix_fingerprint(x: Any) -> np.ndarray:
    """Four float64 sums of a dense or sparse matrix (numpy/scipy or cupy/cupyx): a few passes over its values.

    ``[sum, sum of squares, sum_i a_i * rowsum_i, sum_j b_j * colsum_j]`` with fixed weights ``a_i = cos(i)`` and
    ``b_j = cos(j)``: a change of any value (a log transform in place), of the order of the cells or of the genes
    changes them. Cheap (two matrix-vector products and two dot products), not a cryptographic hash: it detects
    accidents, not forgeries.
    """
    from gpuc._backend import backend_of, is_sparse

    xp = backend_of(x.data if is_sparse(x) else x).xp
    n, m = x.shape
    a = xp.cos(xp.arange(n, dtype=xp.float64))
    b = xp.cos(xp.arange(m, dtype=xp.float64))
    if is_sparse(x):
        fmt = getattr(x, "format", "csr")
        if xp is np and fmt in ("csr", "csc"):
            # per stored value: its row's and column's weights (repeat along the compressed axis, gather along the
            # other), so nothing of the size of the matrix is converted to float64 but its values
            vals = np.asarray(x.data, dtype=np.float64)
            major, minor = (a, b) if fmt == "csr" else (b, a)
            w_major = np.repeat(major, np.diff(x.indptr))
            w_minor = minor[x.indices]
            w_row, w_col = (w_major, w_minor) if fmt == "csr" else (w_minor, w_major)
            sums = [vals.sum(), vals @ vals, vals @ w_row, vals @ w_col]
        else:
            vals = xp.asarray(x.data, dtype=xp.float64)
            sums = [vals.sum(), vals @ vals, a @ (x @ xp.ones(m, dtype=xp.float64)), (x @ b).sum()]
        return np.array([float(v) for v in sums], dtype=np.float64)
    out = np.zeros(4, dtype=np.float64)
    step = max(1, (1 << 22) // max(m, 1))  # blocks of rows of ~32 MB in float64: no copy of the whole matrix
    for start in range(0, n, step):
        block = xp.asarray(x[start : start + step], dtype=xp.float64)
        part = [block.sum(), (block * block).sum(), a[start : start + step] @ block.sum(axis=1), (block @ b).sum()]
        out += np.array([float(v) for v in part], dtype=np.float64)
    return out


def record(*, obs_names: Any = None, var_names: Any = None, matrix: Any = None) -> dict[str, Any]:
    """``uns[key]["inputs"]``: counts and digests of the names a fit read, and the fingerprint of its matrix."""
    out: dict[str, Any] = {}
    if obs_names is not None:
        out["n_obs"] = len(obs_names)
        out["obs_digest"] = names_digest(obs_names)
    if var_names is not None:
        out["n_vars"] = len(var_names)
        out["var_digest"] = names_digest(var_names)
    if matrix is not None:
        out["fingerprint"] = matrix_fingerprint(matrix)
    return out


def same_fingerprint(a: Any, b: Any) -> bool:
    """Whether two fingerprints agree (to the rounding of sums in another order: 1e-9 relative)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-9, atol=1e-300))


def joined_after_fit(adata: Any, entry: Any) -> str | None:
    """Why ``adata`` cannot hold the fit ``entry`` (a gpuc ``uns`` entry with ``inputs``) as one fit, or None.

    More observations than the fit read (``anndata.concat`` with ``uns_merge="first"`` keeps the first object's
    entry for the joined cells), or ``inputs`` fields dropped (``uns_merge="same"`` keeps only what all objects
    agree on). A subset of the observations is not refused here: its rows are those of the fit.
    """
    inputs = entry.get("inputs") if isinstance(entry, Mapping) else None
    if inputs is None:
        return None  # written before inputs were recorded
    if not isinstance(inputs, Mapping) or "n_obs" not in inputs or "obs_digest" not in inputs:
        return (
            "its record of the observations it read is incomplete (as anndata.concat(..., uns_merge='same') leaves it)"
        )
    n = int(np.asarray(inputs["n_obs"]))
    if adata.n_obs > n:
        return (
            f"the fit read {n} observations but this AnnData has {adata.n_obs} (joined with others by "
            "anndata.concat after the fit?)"
        )
    return None
