"""One DESeq2 analysis: design and contrasts from a sample table, the fit, and a results table per contrast.

:func:`plan_analysis` turns what the user wrote (formula, contrasts, reduced model) into matrices and vectors,
raising :class:`ValueError` for anything R DESeq2 would refuse, before any fit. :func:`run_analysis` fits and tests.
Both take a pandas sample table and arrays, never an AnnData; :func:`gpuc.tl.deseq` calls them once per group.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from gpuc._backend import Backend
from gpuc._utils import serial_blas, threaded
from gpuc.deseq._design import Design, _pretty, build_design, contrast_vector, factor_contrast
from gpuc.deseq._glm import LN2
from gpuc.deseq._pipeline import DeseqFit, contrast_all_zero, results, run_deseq

RESULT_COLUMNS = ("baseMean", "log2FoldChange", "lfcSE", "stat", "pvalue", "padj")
# what results() reports about independent filtering and Cook's outliers that is kept with each table
_FILTER_FIELDS = ("filter_threshold", "filter_theta", "n_cooks_outliers", "theta", "num_rejections", "lowess")


@dataclass
class Contrast:
    """A contrast as R names it, its coefficient vector, and the sample groups it compares (for R's rule that a
    gene with zero counts in both compared groups gets a zero fold change), when it names two factor levels.
    """

    name: str
    vector: np.ndarray
    zero_groups: tuple[np.ndarray, np.ndarray] | None = None


@dataclass
class AnalysisPlan:
    """The design, the reduced design of a likelihood-ratio test and the contrasts of one analysis."""

    design: Design
    contrasts: list[Contrast]
    reduced: Design | None = None


@dataclass
class Analysis:
    """A fitted analysis: the fit, and per contrast name a results table and its filtering summary."""

    plan: AnalysisPlan
    fit: DeseqFit
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    filtering: dict[str, dict[str, Any]] = field(default_factory=dict)


def _is_weights(contrast: Any) -> bool:
    """A Series or dict of numeric weights over design columns: one contrast."""
    if isinstance(contrast, pd.Series):
        return True
    return isinstance(contrast, Mapping) and all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) for v in contrast.values()
    )


def _is_factor_triple(contrast: Any) -> bool:
    if isinstance(contrast, np.ndarray):
        return contrast.ndim == 1 and contrast.shape[0] == 3 and contrast.dtype.kind in "OUS"
    return isinstance(contrast, list | tuple) and len(contrast) == 3 and isinstance(contrast[0], str)


def split_contrasts(contrast: Any) -> list[Any]:
    """One contrast or several -> list.

    One contrast: ``None``, a column name, ``[factor, numerator, reference]`` (a list, tuple or array of 3 starting
    with a string), a numeric vector, or a Series/dict of weights by design column. Several: a list of these, a 2-D
    array (one contrast per row), or a dict ``{name: contrast}`` whose values are not all numbers (the names are
    then the names of the results).
    """
    if contrast is None or isinstance(contrast, str) or _is_weights(contrast) or _is_factor_triple(contrast):
        return [contrast]
    if isinstance(contrast, Mapping):
        return list(contrast.values())
    if isinstance(contrast, np.ndarray):
        return [contrast] if contrast.ndim == 1 else list(contrast)
    if isinstance(contrast, list | tuple):
        if len(contrast) > 0 and all(
            isinstance(c, list | tuple | np.ndarray | str | pd.Series | Mapping) for c in contrast
        ):
            return list(contrast)
        return [contrast]
    return [contrast]


def contrast_names(contrast: Any) -> list[str] | None:
    """The user's names of the contrasts when given as ``{name: contrast}``; None otherwise."""
    if isinstance(contrast, Mapping) and not _is_weights(contrast):
        return [str(k) for k in contrast]
    return None


def plan_analysis(
    obs: pd.DataFrame, design: str | pd.DataFrame, contrast: Any = None, *, reduced: str | pd.DataFrame | None = None
) -> AnalysisPlan:
    """Build and check the design, the reduced design (likelihood-ratio test) and every contrast.

    Raises :class:`ValueError` for a design R would refuse (unknown variables, missing values, single-level
    factors, confounded columns), no residual degrees of freedom, a reduced model not nested in the design, and a
    contrast that cannot be formed from the design.
    """
    obs = obs.assign(
        **{
            c: obs[c].cat.remove_unused_categories()
            for c in obs.columns
            if isinstance(obs[c].dtype, pd.CategoricalDtype)
        }
    )
    dsg = build_design(obs, design)
    n, p = dsg.matrix.shape
    if n <= p:
        msg = (
            f"no residual degrees of freedom ({n} samples, {p} design columns {dsg.columns}); DESeq2 needs replicates."
        )
        raise ValueError(msg)
    red = None
    if reduced is not None:
        red = build_design(obs, reduced)
        coef, *_ = np.linalg.lstsq(dsg.matrix, red.matrix, rcond=None)
        if red.matrix.shape[1] >= p or not np.allclose(dsg.matrix @ coef, red.matrix, atol=1e-8):
            msg = (
                f"reduced={reduced!r} must be nested in design={design!r} with fewer columns "
                f"(columns {red.columns} vs {dsg.columns})."
            )
            raise ValueError(msg)
    contrasts = []
    given = contrast_names(contrast)
    parts = [contrast] if is_name_list(dsg, contrast) else split_contrasts(contrast)
    for i, c in enumerate(parts):
        one = resolve_contrast(dsg, c)
        contrasts.append(one if given is None else Contrast(given[i], one.vector, one.zero_groups))
    names = [c.name for c in contrasts]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        msg = (
            f"two contrasts have the same name {dup}, so one result would replace the other. Drop the repeated "
            "contrast, or name each one: contrast={'name1': ..., 'name2': ...}."
        )
        raise ValueError(msg)
    return AnalysisPlan(dsg, contrasts, red)


def _column_index(design: Design, name: Any) -> int | None:
    """The design column named ``name``: as the design names it (``"group[T.B]:cond[T.trt]"``) or as results name it
    (``"group_B:cond_trt"``); None when no column has that name.
    """
    if not isinstance(name, str):
        return None
    if name in design.columns:
        return design.columns.index(name)
    pretty = [_pretty(c) for c in design.columns]
    return pretty.index(name) if name in pretty else None


def is_name_list(design: Design, contrast: Any) -> bool:
    """``contrast`` is R's list form: one or two lists (or tuples) of design column names, the numerator's and the
    denominator's (R ``results(contrast=list(c("a", "b"), "c"))``), e.g. ``[["group[T.B]:cond[T.trt]"], []]``.

    The inner entries must be lists, so the form never reads as several contrasts, and every name must be a design
    column, so it never reads as a ``[factor, numerator, reference]`` triple (a factor's name is not a column's).
    """
    if not isinstance(contrast, list | tuple) or not 1 <= len(contrast) <= 2:
        return False
    if not all(isinstance(part, list | tuple) for part in contrast):
        return False
    names = [n for part in contrast for n in part]
    return len(names) > 0 and all(_column_index(design, n) is not None for n in names)


def resolve_contrast(design: Design, contrast: Any, *, list_values: tuple[float, float] = (1.0, -1.0)) -> Contrast:
    """One contrast as R's ``results()`` reads it: its vector over the design columns, its name, and the samples of
    R's rule that a gene with no count in the samples a contrast compares gets a zero fold change.

    Accepted: every form of :func:`gpuc.deseq._design.contrast_vector` and R's list form (:func:`is_name_list`, the
    numerator's columns weighted ``list_values[0]``, the denominator's ``list_values[1]``, as R's ``listValues``).
    The zero rule follows R's ``cleanContrast``: for two levels of a factor, the samples at either level
    (``contrastAllZeroCharacter``); for a numeric or list contrast with weights of both signs, the samples whose
    design row has a non-zero entry in a column the contrast weights (``contrastAllZeroNumeric``); none otherwise.
    """
    if isinstance(contrast, str) and contrast not in design.columns and _column_index(design, contrast) is not None:
        contrast = design.columns[_column_index(design, contrast)]  # a column as results name it: "cond_trt"
    if is_name_list(design, contrast):
        num, den = [*list(contrast), []][:2]
        lv1, lv2 = float(list_values[0]), float(list_values[1])
        if not (lv1 > 0 and lv2 < 0):
            msg = f"list_values must be (positive, negative) as R's listValues, got {tuple(list_values)!r}."
            raise ValueError(msg)
        overlap = {design.columns[_column_index(design, n)] for n in num} & {  # type: ignore[index]
            design.columns[_column_index(design, n)]  # type: ignore[index]
            for n in den
        }
        if overlap:
            msg = f"design columns {sorted(overlap)} are in both the numerator and the denominator of the contrast."
            raise ValueError(msg)
        vec = np.zeros(len(design.columns))
        for n in num:
            vec[_column_index(design, n)] = lv1  # type: ignore[index]
        for n in den:
            vec[_column_index(design, n)] = lv2  # type: ignore[index]
        # R's name: "a+b vs c", "a effect", with the weights when they are not 1 / -1
        w1 = "" if round(lv1, 3) == 1 else f"{round(lv1, 3):g} "
        w2 = "" if round(abs(lv2), 3) == 1 else f"{round(abs(lv2), 3):g} "
        pn = "+".join(_pretty(design.columns[_column_index(design, n)]) for n in num)  # type: ignore[index]
        pd_ = "+".join(_pretty(design.columns[_column_index(design, n)]) for n in den)  # type: ignore[index]
        if num and den:
            name = f"{w1}{pn} vs {w2}{pd_}"
        elif num:
            name = f"{w1}{pn} effect"
        else:
            name = f"{round(lv2, 3):g} {pd_} effect"
    else:
        vec, name = contrast_vector(design, contrast)
    fac = factor_contrast(design, contrast) if not is_name_list(design, contrast) else None
    zero = None
    if fac is not None:  # the samples of the two compared levels
        col = design.obs[fac[0]].to_numpy(dtype=object)
        zero = (col == fac[1], col == fac[2])
    elif np.any(vec > 0) and np.any(vec < 0):  # R: only contrasts with weights of both signs
        samples = (design.matrix @ (vec != 0).astype(np.float64)) != 0
        zero = (samples, samples)
    return Contrast(name, np.asarray(vec, dtype=np.float64), zero)


def two_level_design(design: Design) -> bool:
    """The design is a formula of one factor with two levels: the only design where R's Cook's filter spares an
    outlier with 3 or more higher counts (``results()``; a logical column is not a factor there).
    """
    if design.formula is None or len(design.variables) != 1:
        return False
    return len(design.factors.get(design.variables[0], [])) == 2


@dataclass(frozen=True)
class AnalysisOptions:
    """The options of one analysis (:func:`run_analysis`, :func:`gpuc.deseq._blocks.run_analysis_blocked`), with
    their defaults: the fit's (:func:`gpuc.deseq._pipeline.run_deseq`: size factors, trend, Cook's refit, IRLS
    iterations, the seed of R's simulated prior variance) and, for every contrast (:func:`tabulate`), R ``results()``'s
    (``alpha`` of independent filtering, Cook's and independent filtering, the Wald test's threshold and alternative)
    and the ``lfcShrink`` method (None: no shrunken fold changes).
    """

    size_factors: str | np.ndarray = "ratio"
    fit_type: str = "parametric"
    refit_cooks: bool = True
    min_replicates: int = 7
    max_iter: int = 100
    random_state: int = 2
    control_genes: Any = None
    alpha: float = 0.1
    cooks_filter: bool | float = True
    independent_filter: bool = True
    lfc_threshold: float = 0.0
    alt_hypothesis: str = "greaterAbs"
    lfc_shrink: str | None = None

    def for_fit(self) -> dict[str, Any]:
        """The keyword options of :func:`gpuc.deseq._pipeline.run_deseq`."""
        return {k: getattr(self, k) for k in _FIT_OPTIONS}

    def for_results(self) -> dict[str, Any]:
        """The keyword options of :func:`gpuc.deseq._pipeline.results`."""
        return {k: getattr(self, k) for k in _RESULTS_OPTIONS}


_FIT_OPTIONS = (
    "size_factors", "fit_type", "refit_cooks", "min_replicates", "max_iter", "random_state", "control_genes",
)  # fmt: skip
_RESULTS_OPTIONS = ("alpha", "cooks_filter", "independent_filter", "lfc_threshold", "alt_hypothesis")


@threaded
def run_analysis(
    backend: Backend,
    counts: Any,
    plan: AnalysisPlan,
    *,
    gene_names: pd.Index,
    n_jobs: int | None = None,
    **options: Any,
) -> Analysis:
    """Fit DESeq2 on samples x genes ``counts`` and test every contrast of ``plan`` (Wald, or the likelihood-ratio
    test when the plan has a reduced design); with ``lfc_shrink`` the tables also get shrunken fold changes.
    ``options``: those of :class:`AnalysisOptions` (an unknown one raises :class:`TypeError` before the fit).
    ``n_jobs``: CPU threads (gene blocks in parallel, :func:`gpuc._utils.cpu_threads`); per-gene results do not depend
    on it. BLAS runs on one thread: its products here are small, per gene, and the threads go to the gene blocks.
    """
    opts = AnalysisOptions(**options)
    reduced = None if plan.reduced is None else plan.reduced.matrix
    with serial_blas(not backend.is_gpu):
        fit = run_deseq(backend, counts, plan.design.matrix, reduced=reduced, **opts.for_fit())
        return tabulate(backend, fit, plan, gene_names=gene_names, options=opts)


def tabulate(
    backend: Backend,
    fit: DeseqFit,
    plan: AnalysisPlan,
    *,
    gene_names: pd.Index,
    options: AnalysisOptions,
    test: str | None = None,
) -> Analysis:
    """The :class:`Analysis` of a finished fit: per contrast of ``plan`` a results table (R ``results()``: Wald or
    likelihood-ratio p-values, Cook's filter, independent filtering and Benjamini-Hochberg over all genes) and its
    filtering summary; with ``options.lfc_shrink`` the tables also get shrunken fold changes. ``test``: ``"wald"`` or
    ``"lrt"``; None: the likelihood-ratio test when the plan has a reduced design.
    """
    test = test or ("wald" if plan.reduced is None else "lrt")
    out = Analysis(plan, fit)
    for c in plan.contrasts:
        out.tables[c.name], out.filtering[c.name] = results_table(
            backend, fit, plan.design, c, gene_names=gene_names, options=options, test=test
        )
    return out


def results_table(
    backend: Backend,
    fit: DeseqFit,
    design: Design,
    contrast: Contrast,
    *,
    gene_names: pd.Index,
    options: AnalysisOptions,
    test: str = "wald",
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """R ``results()`` of one contrast of a finished fit (and ``lfcShrink`` with ``options.lfc_shrink``): the table
    and its filtering summary. Uses only the fit's coefficients, covariances, Cook's distances, counts and per-gene
    fields, so a fit stored by :func:`gpuc.tl.deseq` answers a new contrast without refitting
    (:func:`fit_from_stored`). A numeric ``options.cooks_filter`` is the Cook's cut-off (R's numeric ``cooksCutoff``).
    """
    ropts = options.for_results()
    cf = ropts["cooks_filter"]
    if not isinstance(cf, bool | np.bool_):
        fit = replace(fit, cooks_cutoff=float(cf))
        ropts["cooks_filter"] = True
    res, info = results(
        fit, contrast.vector, zero_groups=contrast.zero_groups, test=test, two_group=two_level_design(design), **ropts
    )
    table = pd.DataFrame(
        {col: np.asarray(res[col], dtype=np.float64) for col in RESULT_COLUMNS}, index=gene_names.copy()
    )
    if options.lfc_shrink is not None:
        from gpuc.deseq._shrink import shrink_lfc, single_coefficient

        if options.lfc_shrink == "normal" and any(":" in col for col in design.columns):
            msg = "lfc_shrink='normal' is not available for designs with interactions (as R's lfcShrink)."
            raise ValueError(msg)

        table["log2FoldChange_shrunk"], table["lfcSE_shrunk"] = shrink_lfc(
            backend, fit, contrast.vector, method=options.lfc_shrink, design=design
        )
        if options.lfc_shrink == "normal" and not single_coefficient(contrast.vector, design):
            # R's lfcShrink(contrast=) reads results() of the shrunken fit, whose cleanContrast zeroes the fold
            # change of genes without a count in the compared samples
            table.loc[contrast_all_zero(fit, contrast.zero_groups), "log2FoldChange_shrunk"] = 0.0
    filtering = {k: (float(v) if np.isscalar(v) else np.asarray(v)) for k, v in info.items() if k in _FILTER_FIELDS}
    return table, filtering


def fit_from_stored(
    *,
    coef_log2: np.ndarray,
    cov_log2: np.ndarray,
    genes: Mapping[str, np.ndarray],
    counts: np.ndarray,
    size_factors: np.ndarray,
    design: np.ndarray,
    cooks: np.ndarray | None,
    cooks_cutoff: float,
    lrt_stat: np.ndarray | None = None,
    lrt_df: int | None = None,
) -> DeseqFit:
    """A :class:`DeseqFit` with what :func:`results_table` reads, from what :func:`gpuc.tl.deseq` stores: log2
    coefficients (genes x p), their covariances (genes x p x p, log2 scale), the per-gene fields (baseMean, allZero,
    maxCooks, replace, dispFit, dispersion), genes x samples counts and Cook's distances, the size factors and model
    matrix. R's "now zero" genes (outlier replacement left no count) are those replaced whose baseMean is 0, as R's
    ``results()`` finds them. The likelihood-ratio p-values are the chi-square tail of the stored statistic.
    """
    g = {k: np.asarray(v) for k, v in genes.items()}
    g["allZero"] = g["allZero"].astype(bool)
    g["replace"] = g["replace"].astype(bool)
    g["newAllZero"] = g["replace"] & (g["baseMean"] == 0)
    lrt_pvalue = None
    if lrt_stat is not None:
        import scipy.special

        lrt_stat = np.asarray(lrt_stat, dtype=np.float64)
        lrt_pvalue = scipy.special.chdtrc(lrt_df, np.maximum(lrt_stat, 0.0))
    return DeseqFit(
        size_factors=np.asarray(size_factors, dtype=np.float64),
        genes=g,
        beta=np.asarray(coef_log2, dtype=np.float64) * LN2,
        cov=np.asarray(cov_log2, dtype=np.float64) * LN2**2,
        mu=None,
        cooks=None if cooks is None else np.asarray(cooks, dtype=np.float64),
        counts=np.asarray(counts, dtype=np.float64),
        design=np.asarray(design, dtype=np.float64),
        trend=None,
        var_log_disp=float("nan"),
        prior_var=float("nan"),
        prior_var_method="",
        cooks_cutoff=float(cooks_cutoff),
        size_factor_type="stored",
        lrt_stat=lrt_stat,
        lrt_pvalue=lrt_pvalue,
        lrt_df=lrt_df,
    )
