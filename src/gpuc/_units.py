"""Independent units of a tool: the groups of a label column, as (label, positions) pairs.

Tools that fit each group of ``obs[groupby]`` on its own (metacells per sample, DESeq2 per cell type) split their
input here, under one rule (:mod:`gpuc._validate`'s group-key rule): labels are compared as the user gave them, two
labels that would print the same (``1`` and ``"1"``) are an error that names them, and missing labels (NaN, None,
``pd.NA``) belong to no group: left out with a warning that counts them, or an error where every entry needs a group.
A pandas Series goes in, arrays come out; nothing here reads or writes an AnnData.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import numpy as np
import pandas as pd

from gpuc._errors import GpucWarning
from gpuc._validate import check_printable_labels


def split_groups(
    column: pd.Series,
    where: str,
    *,
    missing: Literal["warn", "error"] = "warn",
    what: str = "cell(s)",
    order: Literal["categories", "appearance"] = "categories",
    stacklevel: int = 3,
) -> list[tuple[Any, np.ndarray]]:
    """``[(label, positions)]``: each group of ``column`` with the (sorted) positions of its entries.

    Parameters
    ----------
    column
        The labels, one per entry (e.g. ``adata.obs[groupby]``).
    where
        How messages name the column (``"adata.obs['sample']"``).
    missing
        Entries without a label: ``"warn"`` leaves them out of every group with a :class:`~gpuc.GpucWarning` that
        counts them; ``"error"`` refuses them with a :class:`ValueError`.
    what
        How messages name the entries (``"cell(s)"``, ``"sample(s)"``).
    order
        ``"categories"``: a categorical column's groups in category order, other columns' in order of first
        appearance; ``"appearance"``: every column's groups in order of first appearance.
    stacklevel
        Of the warning; the default points at the caller of the tool that calls this function.

    Returns
    -------
    One pair per group that has entries (unused categories are skipped): the label as it is in ``column`` (a category,
    or the first value seen, with its type) and the positions as an int64 array.
    """
    check_printable_labels(column, where)
    na = np.asarray(column.isna())
    if na.any():
        n_na = int(na.sum())
        if missing == "error":
            msg = (
                f"{where} has {n_na} missing value(s) (NaN/None); every entry needs a group: fill them in, or subset "
                f"to the {what} with a group first."
            )
            raise ValueError(msg)
        warnings.warn(
            f"{n_na} {what} with a missing {where} (NaN/None) belong to no group and were left out.",
            GpucWarning,
            stacklevel=stacklevel,
        )
    if isinstance(column.dtype, pd.CategoricalDtype):
        codes = column.cat.codes.to_numpy().astype(np.int64)
        labels = list(column.cat.categories)
    else:  # hashed as pandas compares them: 1 and 1.0 are one group (they print apart, so they passed the check)
        codes, _ = pd.factorize(column, sort=False, use_na_sentinel=True)
        codes = np.asarray(codes, dtype=np.int64)
        labels = list(pd.unique(column[~na]))  # first appearance, as factorize numbers them; numpy scalars kept
    by_code = np.argsort(codes, kind="stable")  # positions of each group, ascending within it
    counts = np.bincount(codes[codes >= 0], minlength=len(labels))
    bounds = np.concatenate([[0], np.cumsum(counts)]) + int((codes < 0).sum())
    groups = [(labels[c], by_code[bounds[c] : bounds[c + 1]]) for c in range(len(labels)) if counts[c]]
    if order == "appearance":
        groups.sort(key=lambda group: group[1][0])
    return groups
