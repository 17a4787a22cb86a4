"""``gpuc.get.deseq_results``: the results table written by :func:`gpuc.tl.deseq`."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from anndata import AnnData

from gpuc import _keys
from gpuc._validate import check_adata
from gpuc.get._checks import deseq_entry


def _contrast_name(entry: dict, contrast: Any) -> str:
    """The stored (percent-encoded) results key of ``contrast``."""
    stored = list(entry["results"])
    names = [_keys.decode_name(n) for n in stored]
    if contrast is None:
        return stored[0]
    if isinstance(contrast, str):
        if contrast in names:
            return _keys.encode_name(contrast)
        msg = f"no results named {contrast!r}; available: {names}."
        raise KeyError(msg)
    if isinstance(contrast, (list, tuple)) and len(contrast) == 3 and all(isinstance(c, str) for c in contrast):
        name = f"{contrast[0]}_{contrast[1]}_vs_{contrast[2]}"
        if name in names:
            return _keys.encode_name(name)
        msg = (
            f"contrast {list(contrast)} was not computed; available: {names}. Pass it to gpuc.tl.deseq(contrast=[...])."
        )
        raise KeyError(msg)
    vec = np.asarray(contrast, dtype=np.float64)
    for name, v in entry["contrasts"].items():
        if np.asarray(v).shape == vec.shape and np.allclose(np.asarray(v), vec):
            return name
    msg = f"contrast {contrast!r} was not computed; available: {names}."
    raise KeyError(msg)


def deseq_results(
    adata: AnnData, contrast: Any = None, *, key: str = _keys.DESEQ, group: str | None = None
) -> pd.DataFrame:
    """DESeq2 results for one contrast as a DataFrame (genes x baseMean, log2FoldChange, lfcSE, stat, pvalue, padj).

    Parameters
    ----------
    adata
        AnnData on which :func:`gpuc.tl.deseq` ran.
    contrast
        ``None`` (the first contrast computed), a results name (e.g. ``"condition_treated_vs_untreated"``),
        ``[factor, numerator, reference]`` or a contrast vector that was computed.
    key
        ``key_added`` used by :func:`gpuc.tl.deseq`.
    group
        The group, when :func:`gpuc.tl.deseq` ran with ``groupby``.

    Returns
    -------
    A copy of the stored table, with shrunken columns when ``lfc_shrink`` was used.
    """
    check_adata(adata)
    entry = deseq_entry(adata, key, group)
    return entry["results"][_contrast_name(entry, contrast)].copy()
