"""``gpuc.get.nmf_top_genes``: the top genes of each consensus NMF programme as a DataFrame."""

from __future__ import annotations

import numpy as np
import pandas as pd
from anndata import AnnData

from gpuc import _keys
from gpuc._validate import check_adata, check_int, check_key


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
