"""``gpuc.get.nmf_top_genes`` (the top genes of each consensus NMF programme) and ``gpuc.get.nmf_suggest_k``."""

from __future__ import annotations

from typing import Literal

import numpy as np
import pandas as pd
from anndata import AnnData

from gpuc import _keys
from gpuc._validate import check_adata, check_int, check_key
from gpuc.nmf._consensus import SUGGEST_MIN_GAIN, SUGGEST_TOL, suggest_k


def program_names(k: int) -> list[str]:
    """Names of the programmes as used in tables and plots: ``P1 .. Pk`` (ordered by total usage)."""
    return [f"P{i + 1}" for i in range(k)]


def nmf_top_genes(adata: AnnData, n: int = 20, *, key: str = _keys.NMF, wide: bool = False) -> pd.DataFrame:
    """Top ``n`` genes of every programme written by :func:`gpuc.tl.consensus_nmf`, by consensus spectra weight.

    Parameters
    ----------
    adata
        AnnData after :func:`gpuc.tl.consensus_nmf`.
    n
        Genes per programme.
    key
        The ``key_added`` of the consensus call.
    wide
        Return one column of gene names per programme (rows = rank) instead of the tidy long table.

    Returns
    -------
    Long format (default): columns ``program`` (``P1`` ...), ``rank`` (1 = highest), ``gene``, ``weight`` (the
    spectra entry; rows of the spectra sum to 1 with ``normalization="sum"``). Wide format: index ``rank``, one
    column per programme holding gene names.
    """
    check_adata(adata)
    n = check_int("n", n, minimum=1)
    sk = _keys.nmf_spectra(key)
    check_key(adata.varm, sk, "adata.varm", f"Run gpuc.tl.consensus_nmf(adata, k, key_added={key!r}) first.")
    spectra = np.asarray(adata.varm[sk], dtype=np.float64)  # genes x k
    n = min(n, spectra.shape[0])
    names = program_names(spectra.shape[1])
    genes = np.asarray(adata.var_names)
    order = np.argsort(-spectra, axis=0, kind="stable")[:n]  # (n, k)
    if wide:
        return pd.DataFrame(
            {p: genes[order[:, j]] for j, p in enumerate(names)}, index=pd.RangeIndex(1, n + 1, name="rank")
        )
    rows = {
        "program": np.repeat(names, n),
        "rank": np.tile(np.arange(1, n + 1), len(names)),
        "gene": genes[order.T.ravel()],
        "weight": np.take_along_axis(spectra, order, axis=0).T.ravel(),
    }
    out = pd.DataFrame(rows)
    out["program"] = pd.Categorical(out["program"], categories=names, ordered=True)
    return out


def nmf_suggest_k(
    adata: AnnData,
    *,
    key: str = _keys.NMF_K_SWEEP,
    tol: float = SUGGEST_TOL,
    min_gain: float = SUGGEST_MIN_GAIN,
    error: Literal["median_error", "best_error"] = "median_error",
) -> int:
    """The number of programmes a :func:`gpuc.tl.nmf_k_sweep` points to: a stable k at which the error still falls.

    cNMF and bixverse leave k to reading the stability / error plot; the judgement their documentation describes is
    to take a k whose stability is high while the error is still falling. This makes that judgement a rule: with the
    ks in increasing order, the *gain* of a k is how much lower its error is than that of the previous k of the sweep
    (the first k always counts). A k still lowers the error when its gain is at least ``min_gain`` times the total
    drop over the sweep (first error minus the smallest). Among those ks, the suggestion is the **largest k whose
    stability is within** ``tol`` **of the best stability among them**. ks whose consensus failed (NaN stability)
    are never suggested.

    Why it works: past the number of programmes the data hold, an extra component fits noise, so the error still
    falls, but by a small and nearly constant amount (the ``min_gain`` criterion removes those ks), and the restarts
    split the noise in different ways, so the stability drops; below it, the restarts agree but merge real
    programmes, so the largest stable k is taken. On simulated counts with 3 to 10 planted programmes (3 seeds each,
    benchmarks page) the defaults find the planted number every time. The sweep must reach past the k you expect:
    a sweep that stops below it returns its largest stable k. Look at :func:`gpuc.pl.nmf_k_sweep`, which marks the
    suggestion, before you use it.

    Parameters
    ----------
    adata
        AnnData after :func:`gpuc.tl.nmf_k_sweep`.
    key
        Its ``key_added``.
    tol
        How far below the best stability (mean silhouette) a k may be and still be suggested.
    min_gain
        Smallest error drop from the previous k, as a fraction of the sweep's total drop, for a k to count as still
        lowering the error.
    error
        The error column used: the median over restarts (default) or the best restart.

    Returns
    -------
    The suggested k, an int. With the default options it equals ``adata.uns[key]['suggested_k']``.
    """
    check_adata(adata)
    check_key(adata.uns, key, "adata.uns", f"Run gpuc.tl.nmf_k_sweep(adata, ..., key_added={key!r}) first.")
    for name, value in (("tol", tol), ("min_gain", min_gain)):
        if not (isinstance(value, int | float) and float(value) >= 0):
            msg = f"{name}={value!r} must be a number >= 0."
            raise ValueError(msg)
    if error not in ("median_error", "best_error"):
        msg = f"error={error!r} must be 'median_error' or 'best_error'."
        raise ValueError(msg)
    t = adata.uns[key]["table"]
    return suggest_k(t["k"], t["stability"], t[error], tol=float(tol), min_gain=float(min_gain))
