"""Design matrices (formulaic, treatment coding like R) and contrast vectors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from gpuc.deseq._formula import ParsedFormula, parse_formula

# what formulaic and formulaic_contrasts raise for a design they cannot build (with formulaic's own FormulaicError,
# see _design_error); anything else (a user's timer exception, a KeyboardInterrupt) is not a design error
FORMULAIC_ERRORS = (ValueError, TypeError, LookupError, AttributeError, NameError, ArithmeticError, RuntimeError)


def _design_error(err: BaseException) -> BaseException | None:
    """The user's own exception when ``err`` (or what formulaic wrapped in it) is not a design error, else None."""
    from formulaic.errors import FormulaicError

    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if not isinstance(e, (*FORMULAIC_ERRORS, FormulaicError)):
            return e
        e = e.__cause__ or e.__context__
    return None


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
    # every variable a [factor, numerator, reference] contrast may name, with its levels as they are in obs (the
    # factors above, whose levels are printed, plus boolean columns, which the matrix codes 0/1 as R codes logicals)
    levels: dict[str, list[Any]] = field(default_factory=dict)


def build_design(obs: pd.DataFrame, design: str | pd.DataFrame) -> Design:
    """Build the model matrix for ``design`` (a formula such as ``"~type + condition"`` or a ready DataFrame).

    Factor levels follow R: the reference is the first category of a pandas Categorical, else the first level in
    sorted order. Raises a :class:`ValueError` for unknown variables, missing values, or a rank-deficient design
    (naming the confounded columns).
    """
    if isinstance(design, pd.DataFrame):
        return _design_from_frame(obs, design)
    if not isinstance(design, str) or not design.strip().startswith("~"):
        msg = f"design must be a formula string starting with '~' (e.g. '~condition') or a DataFrame, got {design!r}."
        raise ValueError(msg)
    parsed = parse_formula(design)  # only the documented grammar reaches formulaic, which evaluates factors as code
    variables = _formula_variables(parsed, design, obs)
    for v in variables:
        if obs[v].isna().any():
            msg = f"obs[{v!r}] has missing values; the design variables must be complete."
            raise ValueError(msg)
        if not pd.api.types.is_numeric_dtype(obs[v]) or isinstance(obs[v].dtype, pd.CategoricalDtype):
            from gpuc._validate import check_printable_labels

            check_printable_labels(obs[v], f"obs[{v!r}]")  # 1 and "1" would be two levels with one column name
    from formulaic_contrasts import FormulaicContrasts  # here: loading formulaic takes ~0.2 s

    try:
        fc = FormulaicContrasts(obs, parsed.formula)
    except Exception as err:
        user = _design_error(err)  # a user's exception (a timer's), also one formulaic wrapped: passed on unchanged
        if user is not None:
            raise user from None
        msg = f"could not build the design matrix for {design!r}: {err}"
        raise ValueError(msg) from err
    dm = fc.design_matrix
    mat = np.asarray(dm.to_numpy(), dtype=np.float64)
    levels = {v: lv for v in variables if (lv := _variable_levels(fc, obs[v], v)) is not None}
    factors = {v: [str(x) for x in lv] for v, lv in levels.items() if not _is_boolean(obs[v])}
    _warn_case_order(obs, levels)
    single = {v: [str(x) for x in lv] for v, lv in levels.items() if len(lv) < 2}
    if single:
        names = ", ".join(f"{v!r} (only {lv[0]!r})" for v, lv in single.items())
        msg = (
            f"design {design!r}: factor {names} has a single level in these samples, so it cannot be estimated and "
            "the test would silently be of another coefficient. A factor needs at least 2 levels (R: 'contrasts can "
            "be applied only to factors with 2 or more levels'); remove it from the design."
        )
        raise ValueError(msg)
    d = Design(mat, [str(c) for c in dm.columns], design, fc, factors, variables, obs, levels)
    check_full_rank(d)
    return d


def _design_from_frame(obs: pd.DataFrame, design: pd.DataFrame) -> Design:
    """A ready design matrix (rows already matched to the samples by the caller): numeric or boolean columns."""
    if design.shape[0] != obs.shape[0]:
        msg = f"design DataFrame has {design.shape[0]} rows but there are {obs.shape[0]} samples."
        raise ValueError(msg)
    columns = [str(c) for c in design.columns]
    if len(set(columns)) != len(columns):
        dup = sorted({c for c in columns if columns.count(c) > 1})
        msg = f"design DataFrame has duplicated column names {dup}; every coefficient needs its own name."
        raise ValueError(msg)
    bad = [str(c) for c in design.columns if not (_is_boolean(design[c]) or pd.api.types.is_numeric_dtype(design[c]))]
    if bad:
        msg = (
            f"design DataFrame columns {bad} are not numeric; a ready design is a model matrix (numbers, e.g. from "
            "formulaic.model_matrix). Pass a formula such as '~condition' to code factors."
        )
        raise TypeError(msg)
    if design.isna().to_numpy().any():
        msg = "the design matrix contains missing values (NaN/NA)."
        raise ValueError(msg)
    d = Design(np.asarray(design.to_numpy(dtype=np.float64), dtype=np.float64), columns)
    check_full_rank(d)
    return d


def _is_boolean(col: pd.Series) -> bool:
    return pd.api.types.is_bool_dtype(col.dtype) and not isinstance(col.dtype, pd.CategoricalDtype)


def _variable_levels(fc: Any, col: pd.Series, name: str) -> list[Any] | None:
    """The levels of a design variable that is a factor (formulaic's categorical coding, including ``C(x)`` of a
    numeric column), or of a boolean column (coded 0/1, False the reference, as R codes a logical); None when the
    variable is continuous. Levels are the values as they are in ``obs`` (ints stay ints).
    """
    if _is_boolean(col):
        return [v for v in (False, True) if (col == v).any()]
    try:
        from formulaic_contrasts._factor_metadata import resolve_ambiguous

        meta = fc._get_factor_metadata_for_variable(name)
        kind = str(getattr(resolve_ambiguous(meta, "kind"), "value", ""))
        cats, base = resolve_ambiguous(meta, "categories"), resolve_ambiguous(meta, "base")
    except FORMULAIC_ERRORS:  # metadata not recorded (another formulaic version): fall back on the column's dtype
        kind, cats, base = "", None, None
    if isinstance(col.dtype, pd.CategoricalDtype):
        levels = [x for x in col.cat.categories if (col == x).any()]  # the Categorical's order, reference first
    elif kind == "categorical" and cats is not None:
        levels = list(cats)
    elif not pd.api.types.is_numeric_dtype(col):
        levels = sorted(pd.unique(col), key=str)
    else:
        return None
    if base is not None and any(_same_level(x, base) for x in levels):  # e.g. C(x, contr.treatment(base=2))
        levels = [x for x in levels if _same_level(x, base)] + [x for x in levels if not _same_level(x, base)]
    return levels


def _warn_case_order(obs: pd.DataFrame, levels: dict[str, list[Any]]) -> None:
    """Warn when a string factor's reference level depends on letter case.

    A string column is ordered by character code (as R in the C locale: uppercase before lowercase); R in a UTF-8
    locale sorts case-insensitively, so R users may expect another reference level. gpuc keeps the code order
    (independent of the machine's locale) and says so, pointing to a Categorical to choose the reference.
    """
    import warnings

    from gpuc._errors import GpucWarning

    for v, lv in levels.items():
        col = obs[v]
        if isinstance(col.dtype, pd.CategoricalDtype) or len(lv) < 2 or not all(isinstance(x, str) for x in lv):
            continue
        r_order = sorted(lv, key=lambda x: (x.casefold(), x.swapcase()))
        if r_order[0] != lv[0]:
            msg = (
                f"the reference level of {v!r} is {lv[0]!r}: levels of a string column are sorted by character code "
                f"(uppercase first, as R in the C locale), while R in a UTF-8 locale sorts case-insensitively and "
                f"would take {r_order[0]!r}. To choose the reference, make the column a pandas Categorical with it "
                f"first, e.g. adata.obs[{v!r}] = pd.Categorical(adata.obs[{v!r}], categories={r_order!r})."
            )
            warnings.warn(msg, GpucWarning, stacklevel=5)


def _formula_variables(parsed: ParsedFormula, formula: str, obs: pd.DataFrame) -> list[str]:
    """The columns of ``obs`` that ``formula`` reads (the variables of its parsed terms), in ``obs`` order.

    Raises a :class:`ValueError` naming the variables that are not columns of ``obs``.
    """
    names = set(parsed.variables)
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


def factor_contrast(design: Design, contrast: Any) -> tuple[str, Any, Any] | None:
    """``(factor, numerator, reference)`` with the levels as they are in ``obs``, when ``contrast`` names two levels
    of a design factor (``[factor, numerator, reference]``, a list, tuple or 1-D array of 3 whose first entry is a
    string); None for other contrast forms. Raises :class:`ValueError` for an unknown factor or level.

    Levels are matched as given (``1`` is the integer level 1, ``True`` the boolean level); a level that matches no
    level as given but prints as exactly one of them (``"1"`` for an integer level 1, as a contrast read back from
    h5ad) is that level: two levels never print the same (the design refuses such factors).
    """
    if isinstance(contrast, np.ndarray) and contrast.dtype.kind in "OUS" and contrast.ndim == 1:
        contrast = list(contrast)
    if not (isinstance(contrast, list | tuple) and len(contrast) == 3 and isinstance(contrast[0], str)):
        return None
    factor, num, ref = contrast
    if factor not in design.levels:
        if factor in design.variables:
            msg = (
                f"contrast factor {factor!r} is a numeric (continuous) variable of the design, so it has no levels to "
                f"compare. To treat it as a factor, write C({factor}) in the formula or make the column a pandas "
                f"Categorical; to test its slope, pass contrast={factor!r}."
            )
        else:
            msg = f"contrast factor {factor!r} is not a categorical variable of the design (factors: {list(design.levels)})."
        raise ValueError(msg)
    levels = design.levels[factor]
    resolved = []
    for lvl in (num, ref):
        hit = [x for x in levels if _same_level(x, lvl)] or [x for x in levels if str(x) == str(lvl)]
        if len(hit) != 1:
            msg = f"contrast level {lvl!r} is not a level of {factor!r} (levels: {levels})."
            raise ValueError(msg)
        resolved.append(hit[0])
    if str(resolved[0]) == str(resolved[1]):
        msg = f"contrast numerator and reference are both {num!r}."
        raise ValueError(msg)
    return factor, resolved[0], resolved[1]


def _level_difference(design: Design, factor: str, num: Any, ref: Any) -> np.ndarray:
    """Model row of a sample at level ``num`` minus one at ``ref``, the other variables at their reference level
    (or 0), as formulaic_contrasts' ``contrast`` builds it, but with the two rows keeping the columns' dtypes, so an
    integer-coded Categorical or a boolean column is coded as in the design (not re-read as a number).
    """
    fc = design.contrasts_helper
    rows = design.obs[design.variables].iloc[[0, 0]].copy()
    for v in design.variables:
        if v == factor:
            values = [num, ref]
        elif v in design.levels:
            try:
                base = fc._get_default_value(v)
            except FORMULAIC_ERRORS:
                base = None
            values = [base if base is not None and base != "\0" else design.levels[v][0]] * 2
        else:
            values = [0, 0]
        dtype = rows[v].dtype
        rows[v] = pd.Series(values, index=rows.index, dtype=object).astype(dtype)
    mat = np.asarray(fc.design_matrix.model_spec.get_model_matrix(rows).to_numpy(), dtype=np.float64)
    return mat[0] - mat[1]


def _same_level(level: Any, given: Any) -> bool:
    """``given`` is ``level`` as the user gave it: equal, and both strings or both non-strings."""
    if isinstance(level, str) != isinstance(given, str):
        return False
    try:
        return bool(level == given)
    except (TypeError, ValueError):
        return False


def contrast_vector(design: Design, contrast: Any) -> tuple[np.ndarray, str]:
    """Turn ``contrast`` into a coefficient vector and an R-style name.

    Accepted: ``None`` (last column), a column name, ``[factor, numerator, reference]`` (levels as in ``obs``: strings,
    integers of an integer-coded factor, True/False of a boolean column), a numeric vector of length p, or a pandas
    Series or dict of weights labelled by design column (matched by name, never by position).
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
    fac = factor_contrast(design, contrast)
    if fac is not None:
        factor, num, ref = fac
        if design.contrasts_helper is None:
            msg = "a [factor, numerator, reference] contrast needs a formula design; pass a numeric vector instead."
            raise ValueError(msg)
        return _level_difference(design, factor, num, ref), f"{factor}_{num}_vs_{ref}"
    if isinstance(contrast, pd.Series | dict):
        from gpuc._validate import align_labels

        labelled = align_labels(contrast, pd.Index(design.columns), "contrast", "the design columns")
        contrast = pd.to_numeric(labelled, errors="coerce").to_numpy(dtype=np.float64)
    try:
        arr = np.asarray(contrast, dtype=np.float64)
    except (TypeError, ValueError):
        arr = None
    if arr is None or arr.ndim != 1 or arr.shape[0] != p or not np.all(np.isfinite(arr)):
        msg = (
            f"contrast must be None, a design column name, [factor, numerator, reference], a numeric vector of "
            f"length {p} or a Series/dict of weights labelled by design column (columns {design.columns}); got "
            f"{contrast!r}."
        )
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
