"""Design matrices (formulaic, treatment coding like R) and contrast vectors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from formulaic import Formula
from formulaic_contrasts import FormulaicContrasts


@dataclass
class Design:
    """A model matrix with its column names and the formulaic helper used to build contrasts."""

    matrix: np.ndarray
    columns: list[str]
    formula: str | None = None
    contrasts_helper: Any = field(default=None, repr=False)
    factors: dict[str, list[str]] = field(default_factory=dict)
    variables: list[str] = field(default_factory=list)
    obs: Any = field(default=None, repr=False)


def build_design(obs: pd.DataFrame, design: str | pd.DataFrame) -> Design:
    """Build the model matrix for ``design`` (a formula such as ``"~type + condition"`` or a ready DataFrame).

    Factor levels follow R: the reference is the first category of a pandas Categorical, else the first level in
    sorted order. Raises a :class:`ValueError` for unknown variables, missing values, or a rank-deficient design
    (naming the confounded columns).
    """
    if isinstance(design, pd.DataFrame):
        mat = np.asarray(design.to_numpy(), dtype=np.float64)
        if mat.shape[0] != obs.shape[0]:
            msg = f"design DataFrame has {mat.shape[0]} rows but there are {obs.shape[0]} samples."
            raise ValueError(msg)
        d = Design(mat, [str(c) for c in design.columns])
        check_full_rank(d)
        return d
    if not isinstance(design, str) or not design.strip().startswith("~"):
        msg = f"design must be a formula string starting with '~' (e.g. '~condition') or a DataFrame, got {design!r}."
        raise ValueError(msg)
    variables = _formula_variables(design, obs)
    for v in variables:
        if obs[v].isna().any():
            msg = f"obs[{v!r}] has missing values; the design variables must be complete."
            raise ValueError(msg)
    try:
        fc = FormulaicContrasts(obs, design)
    except Exception as err:  # formulaic raises many types
        msg = f"could not build the design matrix for {design!r}: {err}"
        raise ValueError(msg) from err
    dm = fc.design_matrix
    mat = np.asarray(dm.to_numpy(), dtype=np.float64)
    factors = {}
    for v in variables:
        col = obs[v]
        if not pd.api.types.is_numeric_dtype(col) or isinstance(col.dtype, pd.CategoricalDtype) or col.dtype == bool:
            if isinstance(col.dtype, pd.CategoricalDtype):
                levels = [str(x) for x in col.cat.categories if (col == x).any()]
            else:
                levels = sorted(map(str, pd.unique(col)))
            factors[v] = levels
    single = {v: lv for v, lv in factors.items() if len(lv) < 2}
    if single:
        names = ", ".join(f"{v!r} (only {lv[0]!r})" for v, lv in single.items())
        msg = (
            f"design {design!r}: factor {names} has a single level in these samples, so it cannot be estimated and "
            "the test would silently be of another coefficient. A factor needs at least 2 levels (R: 'contrasts can "
            "be applied only to factors with 2 or more levels'); remove it from the design."
        )
        raise ValueError(msg)
    d = Design(mat, [str(c) for c in dm.columns], design, fc, factors, variables, obs)
    check_full_rank(d)
    return d


def _formula_variables(formula: str, obs: pd.DataFrame) -> list[str]:
    """The columns of ``obs`` that ``formula`` reads (formulaic's ``required_variables``), in ``obs`` order.

    Raises a :class:`ValueError` naming the variables that are not columns of ``obs``.
    """
    try:
        names = {str(v) for v in Formula(formula).required_variables}
    except Exception as err:  # formulaic raises many types
        msg = f"could not build the design matrix for {formula!r}: {err}"
        raise ValueError(msg) from err
    unknown = sorted(names - {str(c) for c in obs.columns})
    if unknown:
        msg = f"design {formula!r} names {unknown} which are not columns of adata.obs (available: {list(obs.columns)})."
        raise ValueError(msg)
    return [c for c in obs.columns if str(c) in names]


def check_full_rank(design: Design) -> None:
    """Raise a :class:`ValueError` naming the confounded columns when the model matrix is rank deficient."""
    x = design.matrix
    p = x.shape[1]
    if not np.all(np.isfinite(x)):
        msg = "the design matrix contains NaN or infinite values."
        raise ValueError(msg)
    if np.linalg.matrix_rank(x) == p:
        return
    basis: list[int] = []
    problems = []
    for j in range(p):
        col = x[:, j]
        if basis:
            coef, *_ = np.linalg.lstsq(x[:, basis], col, rcond=None)
            resid = col - x[:, basis] @ coef
        else:
            coef, resid = np.zeros(0), col
        if np.linalg.norm(resid) <= 1e-8 * max(np.linalg.norm(col), 1.0):
            deps = [design.columns[b] for b, c in zip(basis, coef, strict=True) if abs(c) > 1e-8]
            problems.append(
                f"{design.columns[j]!r} = linear combination of {deps}"
                if deps
                else f"{design.columns[j]!r} is all zero"
            )
        else:
            basis.append(j)
    msg = (
        "the design matrix is not full rank (confounded columns): "
        + "; ".join(problems)
        + ". Remove or merge these variables, or drop levels with no samples."
    )
    raise ValueError(msg)


def contrast_vector(design: Design, contrast: Any) -> tuple[np.ndarray, str]:
    """Turn ``contrast`` into a coefficient vector and an R-style name.

    Accepted: ``None`` (last column), a column name, ``[factor, numerator, reference]``, or a numeric vector of length p.
    """
    p = len(design.columns)
    if contrast is None:
        if p == 1:
            msg = (
                f"the design has only the column {design.columns[0]!r}, so there is no effect to test; add the "
                "variable to compare to the design (e.g. '~condition') and name it in contrast=."
            )
            raise ValueError(msg)
        v = np.zeros(p)
        v[-1] = 1.0
        return v, _pretty(design.columns[-1])
    if isinstance(contrast, str):
        if contrast not in design.columns:
            msg = f"contrast {contrast!r} is not a design column; columns are {design.columns}."
            raise ValueError(msg)
        v = np.zeros(p)
        v[design.columns.index(contrast)] = 1.0
        return v, _pretty(contrast)
    if isinstance(contrast, (list, tuple)) and len(contrast) == 3 and all(isinstance(c, str) for c in contrast):
        factor, num, ref = contrast
        if factor not in design.factors:
            msg = f"contrast factor {factor!r} is not a categorical variable of the design (factors: {list(design.factors)})."
            raise ValueError(msg)
        levels = design.factors[factor]
        for lvl in (num, ref):
            if lvl not in levels:
                msg = f"contrast level {lvl!r} is not a level of {factor!r} (levels: {levels})."
                raise ValueError(msg)
        if num == ref:
            msg = f"contrast numerator and reference are both {num!r}."
            raise ValueError(msg)
        fc = design.contrasts_helper
        v = np.asarray(fc.contrast(factor, ref, num), dtype=np.float64)
        return v, f"{factor}_{num}_vs_{ref}"
    arr = np.asarray(contrast, dtype=np.float64) if not isinstance(contrast, str) else None
    if arr is None or arr.ndim != 1 or arr.shape[0] != p or not np.all(np.isfinite(arr)):
        msg = f"contrast must be None, a design column name, [factor, numerator, reference] or a numeric vector of length {p} (columns {design.columns}); got {contrast!r}."
        raise ValueError(msg)
    if not np.any(arr):
        msg = "contrast vector is all zero."
        raise ValueError(msg)
    name = "+".join(f"{c:g}*{_pretty(col)}" for c, col in zip(arr, design.columns, strict=True) if c != 0)
    return arr, name


def _pretty(col: str) -> str:
    import re

    parts = []
    for part in col.split(":"):
        m = re.fullmatch(r"(.+)\[T\.(.+)\]", part)
        parts.append(f"{m.group(1)}_{m.group(2)}" if m else part)
    return ":".join(parts)


def cells_of(x: np.ndarray) -> np.ndarray:
    """Index of each sample's distinct design row (its "cell"), numbered in order of first appearance."""
    _, first, inv = np.unique(x, axis=0, return_index=True, return_inverse=True)
    order = np.argsort(np.argsort(first))
    return order[inv.ravel()]


def n_or_more_in_cell(x: np.ndarray, n: int) -> np.ndarray:
    """Boolean per sample: its design cell holds at least ``n`` samples (R's ``nOrMoreInCell``)."""
    cells = cells_of(x)
    counts = np.bincount(cells)
    return counts[cells] >= n
