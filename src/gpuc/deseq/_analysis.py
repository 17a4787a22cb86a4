"""One DESeq2 analysis: design and contrasts from a sample table, the fit, and a results table per contrast.

:func:`plan_analysis` turns what the user wrote (formula, contrasts, reduced model) into matrices and vectors,
raising :class:`ValueError` for anything R DESeq2 would refuse, before any fit. :func:`run_analysis` fits and tests.
Both take a pandas sample table and arrays, never an AnnData; :func:`gpuc.tl.deseq` calls them once per group.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from gpuc._backend import Backend
from gpuc._utils import serial_blas, threaded
from gpuc.deseq._design import Design, build_design, contrast_vector, factor_contrast
from gpuc.deseq._pipeline import DeseqFit, results, run_deseq

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
    for i, c in enumerate(split_contrasts(contrast)):
        vec, name = contrast_vector(dsg, c)
        fac = factor_contrast(dsg, c)
        zero = None
        if fac is not None:  # the samples of the two compared levels, for R's all-zero rule
            col = obs[fac[0]].to_numpy(dtype=object)
            zero = (col == fac[1], col == fac[2])
        contrasts.append(Contrast(name if given is None else given[i], vec, zero))
    names = [c.name for c in contrasts]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        msg = (
            f"two contrasts have the same name {dup}, so one result would replace the other. Drop the repeated "
            "contrast, or name each one: contrast={'name1': ..., 'name2': ...}."
        )
        raise ValueError(msg)
    return AnalysisPlan(dsg, contrasts, red)


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
    alpha: float = 0.05
    cooks_filter: bool = True
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


_FIT_OPTIONS = ("size_factors", "fit_type", "refit_cooks", "min_replicates", "max_iter", "random_state")
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
    backend: Backend, fit: DeseqFit, plan: AnalysisPlan, *, gene_names: pd.Index, options: AnalysisOptions
) -> Analysis:
    """The :class:`Analysis` of a finished fit: per contrast of ``plan`` a results table (R ``results()``: Wald or
    likelihood-ratio p-values, Cook's filter, independent filtering and Benjamini-Hochberg over all genes) and its
    filtering summary; with ``options.lfc_shrink`` the tables also get shrunken fold changes.
    """
    test = "wald" if plan.reduced is None else "lrt"
    out = Analysis(plan, fit)
    for c in plan.contrasts:
        res, info = results(fit, c.vector, zero_groups=c.zero_groups, test=test, **options.for_results())
        table = pd.DataFrame(
            {col: np.asarray(res[col], dtype=np.float64) for col in RESULT_COLUMNS}, index=gene_names.copy()
        )
        if options.lfc_shrink is not None:
            from gpuc.deseq._shrink import shrink_lfc

            table["log2FoldChange_shrunk"], table["lfcSE_shrunk"] = shrink_lfc(
                backend, fit, c.vector, method=options.lfc_shrink, design=plan.design
            )
        out.tables[c.name] = table
        out.filtering[c.name] = {
            k: (float(v) if np.isscalar(v) else np.asarray(v)) for k, v in info.items() if k in _FILTER_FIELDS
        }
    return out
