"""What :func:`gpuc.tl.deseq`, :func:`gpuc.tl.vst` and :func:`gpuc.tl.pseudobulk` run below the adapter: the per-group
analyses, the memory model, the choice between in-process groups and Dask gene blocks, the summary warnings, the VST
entry point and the pseudobulk sums.

Everything here takes arrays and pandas sample tables, never an AnnData. The adapter validates the call, builds a
:class:`DeseqPlan` with :func:`plan_deseq` (every group's design and contrasts checked before any fit), checks memory
with :func:`check_deseq_memory`, runs :func:`run_deseq_plan` once and writes what it returns.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from gpuc._backend import Backend, backend_of, is_sparse, to_host
from gpuc._dask import is_dask_array, map_units
from gpuc._errors import ConvergenceWarning, GpucWarning
from gpuc._lazy import CountFlags, count_checks, grouped_sum_and_count_checks
from gpuc._validate import check_memory
from gpuc.deseq._analysis import Analysis, AnalysisPlan, plan_analysis, run_analysis
from gpuc.deseq._blocks import default_block_genes, run_analysis_blocked

# a samples x genes matrix with this many rows and a median total count below SC_MEDIAN_TOTAL looks like single cells
SC_MIN_SAMPLES = 200
SC_MEDIAN_TOTAL = 10_000


# --------------------------------------------------------------------------------------------------------------------
# counts
# --------------------------------------------------------------------------------------------------------------------
def check_counts(x: Any, what: str) -> None:
    """Raise unless ``x`` holds finite, non-negative whole numbers and every sample has a positive total."""
    data = x.data if is_sparse(x) else x
    xp = backend_of(data).xp
    data = xp.asarray(data)
    if data.dtype.kind not in "iufb":
        msg = f"{what} must be numeric counts, got dtype {data.dtype}."
        raise TypeError(msg)
    if data.dtype.kind == "f":
        if not bool(xp.isfinite(data).all()):
            msg = f"{what} contains NaN or infinite values; DESeq2 needs raw integer counts."
            raise ValueError(msg)
        if bool((data != xp.round(data)).any()):
            msg = f"{what} contains non-integer values; DESeq2 needs raw integer counts (not normalised or log values). Pass layer= naming the raw counts."
            raise ValueError(msg)
    if bool((data < 0).any()):
        msg = f"{what} contains negative values; DESeq2 needs raw non-negative counts."
        raise ValueError(msg)
    totals = np.asarray(to_host(x.sum(axis=1))).ravel()
    if (totals == 0).any():
        idx = np.nonzero(totals == 0)[0][:10].tolist()
        msg = f"{what}: {int((totals == 0).sum())} sample(s) have zero total count (rows {idx}); remove them before running DESeq2."
        raise ValueError(msg)


def hint_single_cells(counts: Any, n_obs: int, stacklevel: int = 2) -> None:
    """Warn when the samples look like single cells (many rows, small totals): DESeq2 on cells takes every cell as a
    replicate, so p-values are far too small; the counts should be summed per sample first.
    """
    if n_obs < SC_MIN_SAMPLES:
        return
    totals = np.asarray(to_host(counts.sum(axis=1)), dtype=np.float64).ravel()
    median = float(np.median(totals))
    if median < SC_MEDIAN_TOTAL:
        msg = (
            f"the {n_obs} samples look like single cells (median total count {median:.0f}); DESeq2 takes every row "
            "as an independent replicate, so on cells its p-values are far too small. Sum the cells of each "
            "biological sample first: pb = gpuc.tl.pseudobulk(adata, sample_key=..., groupby=...), then "
            "gpuc.tl.deseq(pb, ...)."
        )
        warnings.warn(msg, GpucWarning, stacklevel=stacklevel + 1)


# --------------------------------------------------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class GroupUnit:
    """One analysis of a :class:`DeseqPlan`: its group (``None`` for the one design), its samples and its plan."""

    group: Any
    mask: np.ndarray
    plan: AnalysisPlan


@dataclass
class DeseqPlan:
    """Everything :func:`run_deseq_plan` runs, decided and checked before any fit.

    Attributes
    ----------
    units
        The analyses: one per group with ``groupby``, else one over every sample.
    skipped
        Groups whose design cannot be fitted (name -> reason); reported with a warning after the fit.
    size_factors
        ``"ratio"``, ``"poscounts"``, ``"iterative"`` or one given factor per sample (all samples).
    options
        Keyword options of every analysis (:func:`gpuc.deseq._analysis.run_analysis`: fit type, Cook's refit,
        testing, filtering, shrinkage, ``max_iter``, and ``random_state``, the seed R's simulation uses).
    grouped
        Whether the units are groups (``groupby``).
    """

    units: list[GroupUnit]
    skipped: dict[Any, str] = field(default_factory=dict)
    size_factors: str | np.ndarray = "ratio"
    options: dict[str, Any] = field(default_factory=dict)
    grouped: bool = False

    @property
    def width(self) -> int:
        """The widest design (columns)."""
        return max((u.plan.design.matrix.shape[1] for u in self.units), default=1)

    @property
    def first(self) -> AnalysisPlan | None:
        """The first unit's plan (the contrast names a replay of the call uses), ``None`` without units."""
        return self.units[0].plan if self.units else None


def plan_deseq(
    obs: pd.DataFrame,
    counts: Any,
    design: str | pd.DataFrame,
    contrast: Any,
    *,
    reduced: str | pd.DataFrame | None,
    group_of: np.ndarray | None,
    groupby: str | None,
    size_factors: str | np.ndarray,
    options: dict[str, Any],
    where: str,
) -> DeseqPlan:
    """Plan the analyses of samples x genes ``counts`` with sample table ``obs``: one, or one per group of
    ``group_of`` (labels per sample, ``None`` for samples in no group). Each group's design, contrasts and counts are
    checked here; a group that cannot be fitted is skipped (with its reason), and when none can, or the one design
    cannot, the :class:`ValueError` says why. Warns when the samples look like single cells.
    """
    hint_single_cells(counts, obs.shape[0], stacklevel=3)
    groups = [None] if group_of is None else [g for g in pd.unique(group_of) if g is not None]
    units: list[GroupUnit] = []
    skipped: dict[Any, str] = {}
    for g in groups:
        mask = np.ones(obs.shape[0], dtype=bool) if g is None else (group_of == g)
        try:
            plan = plan_analysis(
                obs.loc[mask],
                design if not isinstance(design, pd.DataFrame) else design.loc[mask],
                contrast,
                reduced=reduced if not isinstance(reduced, pd.DataFrame) else reduced.loc[mask],
            )
            if g is not None:
                check_counts(counts[np.flatnonzero(mask)], f"{where} (group {g!r})")
        except ValueError as err:
            if g is None:
                raise
            skipped[g] = str(err)
            continue
        units.append(GroupUnit(g, mask, plan))
    if not units:
        msg = f"no group of {groupby!r} could be tested: " + "; ".join(skipped.values())
        raise ValueError(msg)
    return DeseqPlan(units, skipped, size_factors, options, grouped=group_of is not None)


# --------------------------------------------------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------------------------------------------------
def deseq_peak_bytes(n_samples: int, n_genes: int, n_coefs: int = 2, *, block_genes: int | None = None) -> float:
    """Estimated peak memory of one DESeq2 fit with ``n_coefs`` design columns, beyond the input counts.

    Per gene: about 14 float64 samples-long arrays (counts, normalised counts, means, IRLS weights and work arrays,
    Cook's distances), 1.5 p x p arrays on average (the IRLS systems, the coefficient covariances and their log2 copy
    written to ``varm`` are not all alive at once) and ~100 values (per-gene fields). Per gene being solved at once:
    two samples x p arrays (the weighted design of the IRLS step and its product); ``block_genes`` genes are solved
    at once (the CPU engine's gene blocks, all threads together), every gene on a GPU (``None``).

    Checked against tracemalloc peaks of the CPU fit (tests/core/test_inputs_memory.py): the peak lies between
    0.35 and 1.1 times this estimate for 2 to 55 design columns (about 0.5-0.75 at 41 columns, where the estimate
    without the design's width was a quarter to a half of the peak).
    """
    solved = n_genes if block_genes is None else min(n_genes, block_genes)
    per_gene = 14.0 * n_samples + 1.5 * n_coefs * n_coefs + 100.0
    return 8.0 * n_genes * per_gene + 16.0 * n_samples * n_coefs * solved


def solved_at_once(backend: Backend, n_samples: int, n_jobs: int | None) -> int | None:
    """Genes whose IRLS systems are alive at once: every gene on a GPU; on the CPU one gene block (about 2**16
    entries, at least 128 genes, as :func:`gpuc.deseq._threads.gene_blocks`) per thread.
    """
    if backend.is_gpu:
        return None
    from gpuc._utils import resolve_n_jobs
    from gpuc.deseq._threads import BLOCK_ENTRIES

    return resolve_n_jobs(n_jobs) * max(128, BLOCK_ENTRIES // max(n_samples, 1))


def blocked_peak_bytes(
    n_samples: int, n_genes: int, n_coefs: int = 2, *, block_genes: int, solved: int | None = None
) -> float:
    """Estimated peak memory of one design fitted as gene blocks (:func:`gpuc.deseq._blocks.run_analysis_blocked`),
    on a machine that both holds the whole fit and runs a block (in process, or a local cluster's worker beside it).

    The whole fit: the genes x samples counts, the size factors' log-ratios and the gathered mu and Cook's distances
    (4 float64 genes x samples arrays), per gene the coefficient covariances and their log2 copy (2 p x p arrays) and
    ~100 values; one block: :func:`deseq_peak_bytes` of ``block_genes`` genes (``solved`` of them solved at once).

    Checked against tracemalloc peaks of the in-process blocked fit (tests/deseq/test_deseq_run.py): the peak lies
    between 0.35 and 1.1 times this estimate for 2 to 41 design columns, one or several blocks (the estimate without
    the covariances was exceeded by a third at 41 columns in 4 blocks).
    """
    whole = 8.0 * n_genes * (4.0 * n_samples + 2.0 * n_coefs * n_coefs + 100.0)
    return whole + deseq_peak_bytes(n_samples, min(block_genes, n_genes), n_coefs, block_genes=solved)


def vst_peak_bytes(n_samples: int, n_genes: int) -> float:
    """Estimated peak memory of :func:`gpuc.tl.vst`: the dense float64 counts, their transpose, the genewise
    dispersion fit's work arrays and the output (about 8 genes x samples arrays), plus per-gene values. The design
    does not enter: a blind fit is intercept-only, and ``blind=False`` uses a stored trend.

    Checked against tracemalloc peaks of the CPU transformation (tests/deseq/test_deseq_run.py): the peak lies
    between 0.35 and 1.1 times this estimate (about 0.5-0.75), blind or not.
    """
    return (8.0 * n_samples + 50.0) * 8.0 * n_genes


def runs_as_gene_blocks(plan: DeseqPlan, client: Any) -> bool:
    """Whether :func:`run_deseq_plan` fits ``plan`` as gene blocks: one design (no groups) on a Dask cluster."""
    return client is not None and not plan.grouped


def check_deseq_memory(
    backend: Backend, plan: DeseqPlan, n_samples: int, n_genes: int, *, client: Any, n_jobs: int | None
) -> None:
    """Refuse, before any fit, a plan whose estimated peak exceeds the device's free memory
    (:class:`~gpuc.InsufficientMemoryError`, saying how to reduce it). The estimate counts the design's width: per
    gene p x p covariances and IRLS systems next to the samples-wide arrays. With gene blocks on a cluster
    (:func:`runs_as_gene_blocks`) this process keeps the whole fit's arrays next to one block's fit
    (:func:`blocked_peak_bytes`).
    """
    blocked = runs_as_gene_blocks(plan, client)
    width = plan.width
    n_fit = max(int(u.mask.sum()) for u in plan.units)
    at_once = solved_at_once(backend, n_fit, n_jobs)
    if blocked:
        block = default_block_genes(n_samples)
        need = blocked_peak_bytes(n_samples, n_genes, width, block_genes=block, solved=at_once)
    else:
        need = deseq_peak_bytes(n_fit, n_genes, width, block_genes=at_once)
    check_memory(
        backend,
        need,
        f"DESeq2 on {n_fit} samples x {n_genes} genes",
        f"The design has {width} columns (each gene keeps {width} x {width} covariances and IRLS systems). "
        + (
            "Drop genes with low counts first (e.g. keep genes with >= 10 counts in the smallest group), or fit it as "
            "gene blocks on a Dask cluster (client=..., see the 'Beyond one machine' docs)."
            if not blocked and not plan.grouped
            else "Drop genes with low counts first (e.g. keep genes with >= 10 counts in the smallest group)."
        ),
    )


# --------------------------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class GroupResult:
    """A fitted unit: its group, its samples and the :class:`Analysis`."""

    group: Any
    mask: np.ndarray
    analysis: Analysis


def fit_unit(
    backend: Backend, counts: Any, plan: AnalysisPlan, size_factors: Any, *, options: dict, n_jobs: int | None
) -> Analysis:
    """One DESeq2 analysis (a unit of :func:`gpuc._dask.map_units`: in this process or a Dask task)."""
    return run_analysis(backend, counts, plan, size_factors=size_factors, **options, n_jobs=n_jobs)


def run_deseq_plan(
    backend: Backend,
    counts: Any,
    plan: DeseqPlan,
    *,
    gene_names: pd.Index,
    client: Any,
    n_jobs: int | None,
    run_units: Callable[..., list] = map_units,
) -> list[GroupResult]:
    """Fit and test every unit of ``plan`` on samples x genes ``counts``.

    The groups are independent units run by ``run_units`` (:func:`gpuc._dask.map_units`, which the adapter passes
    as its own reference: here one after the other, or as Dask tasks on ``client``). One design on a cluster runs as gene blocks
    (:func:`gpuc.deseq._blocks.run_analysis_blocked`: the per-gene steps as tasks, the global steps here). Afterwards
    R's notes of each fit (fallbacks, simulated prior variance), the skipped groups and the genes whose GLM did not
    converge are reported as warnings, each group named.
    """
    options = {"gene_names": gene_names, **plan.options}
    if runs_as_gene_blocks(plan, client):
        fit = run_analysis_blocked(
            backend, counts, plan.units[0].plan, client=client, size_factors=plan.size_factors, **options, n_jobs=n_jobs
        )
        fitted = [fit]
    else:
        sf = plan.size_factors
        units = [
            (
                "" if u.group is None else f"group {u.group!r}",
                (
                    backend,
                    counts if u.group is None else counts[np.flatnonzero(u.mask)],
                    u.plan,
                    sf if isinstance(sf, str) else np.asarray(sf)[u.mask],
                ),
            )
            for u in plan.units
        ]
        fitted = run_units(
            fit_unit, units, client=client, shared={"options": options}, n_jobs=n_jobs, what="deseq", stacklevel=3
        )
    out = [GroupResult(u.group, u.mask, res) for u, res in zip(plan.units, fitted, strict=True)]
    for r in out:
        for m in r.analysis.fit.messages:
            warnings.warn(m if r.group is None else f"group {r.group!r}: {m}", GpucWarning, stacklevel=3)
    for g, why in plan.skipped.items():
        warnings.warn(f"group {g!r} skipped: {why}", GpucWarning, stacklevel=3)
    _warn_not_converged(out, int(plan.options["max_iter"]))
    return out


def _warn_not_converged(results: list[GroupResult], max_iter: int) -> None:
    """One :class:`ConvergenceWarning` for the genes whose GLM did not converge (all groups together)."""
    parts = []
    for r in results:
        genes = r.analysis.fit.genes
        n_bad = int((~np.asarray(genes["betaConv"], dtype=bool) & ~np.asarray(genes["allZero"], dtype=bool)).sum())
        if n_bad:
            parts.append(f"{n_bad}" + ("" if r.group is None else f" in group {r.group!r}"))
    if parts:
        msg = (
            f"{', '.join(parts)} gene(s) did not converge in beta (IRLS with max_iter={max_iter}, then the bounded "
            "refit; flagged False in betaConv). Their fold changes may be unreliable: pass a larger max_iter, and "
            "check the counts are raw integers, not scaled or normalised values."
        )
        warnings.warn(msg, ConvergenceWarning, stacklevel=4)


# --------------------------------------------------------------------------------------------------------------------
# VST
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class VstPlan:
    """What :func:`run_vst` needs besides the counts: a blind fit (``fit_type`` of its trend), or the size factors
    and the stored trend (``DispersionFunction.to_dict``, as :func:`gpuc.tl.deseq` writes it to ``uns``) of an
    earlier fit.
    """

    fit_type: str = "parametric"
    size_factors: np.ndarray | None = None
    trend: dict | None = None

    @property
    def blind(self) -> bool:
        """Whether the size factors and trend are fitted here (intercept-only design)."""
        return self.trend is None


def run_vst(backend: Backend, counts: Any, plan: VstPlan, *, n_jobs: int | None) -> tuple[np.ndarray, dict, str | None]:
    """R's ``varianceStabilizingTransformation`` of samples x genes ``counts`` under ``plan``: the transformed values
    (samples x genes, host numpy), the trend used (as a dict) and a note when a blind trend fit fell back to another
    type.
    """
    from gpuc.deseq._dispersion import DispersionFunction
    from gpuc.deseq._vst import variance_stabilize

    trend = None if plan.blind else DispersionFunction.from_dict(plan.trend)
    sf = None if plan.size_factors is None else np.asarray(plan.size_factors, dtype=np.float64)
    out, trend, note = variance_stabilize(
        backend, counts, size_factors=sf, trend=trend, fit_type=plan.fit_type, n_jobs=n_jobs
    )
    return out, trend.to_dict(), note


# --------------------------------------------------------------------------------------------------------------------
# pseudobulk sums
# --------------------------------------------------------------------------------------------------------------------
def check_raw_counts(x: Any, what: str, flags: CountFlags | None = None) -> None:
    """Raise unless ``x`` holds finite, non-negative whole numbers (the counts :func:`gpuc.tl.pseudobulk` sums).

    A dask array is checked chunk by chunk (:func:`gpuc._lazy.count_checks`) unless its ``flags`` are given, e.g.
    from the pass that also computed the sums.
    """
    if flags is None and is_dask_array(x):
        flags = count_checks(x)
    if flags is not None:
        if flags.non_integer:
            msg = f"{what} must hold raw integer counts (found non-integer or non-finite values); pass layer= naming the raw counts."
            raise ValueError(msg)
        if flags.negative:
            msg = f"{what} contains negative values; pseudobulk needs raw counts."
            raise ValueError(msg)
        return
    data = x.data if is_sparse(x) else x
    xp = backend_of(data).xp
    data = xp.asarray(data)  # on the device where the counts live; only the verdicts come back
    if data.dtype.kind == "f" and (not bool(xp.isfinite(data).all()) or bool((data != xp.round(data)).any())):
        msg = f"{what} must hold raw integer counts (found non-integer or non-finite values); pass layer= naming the raw counts."
        raise ValueError(msg)
    if bool((data < 0).any()):
        msg = f"{what} contains negative values; pseudobulk needs raw counts."
        raise ValueError(msg)


# --------------------------------------------------------------------------------------------------------------------
def _nonzero(x: Any) -> Any:
    """1.0 where the counts ``x`` (dense or sparse, CPU or GPU) are non-zero, 0.0 elsewhere, in ``x``'s format."""
    if is_sparse(x):
        nz = x.astype(np.float64)  # a copy with the same sparsity structure; explicit zeros become 0.0
        nz.data = (nz.data != 0).astype(np.float64)
        return nz
    return (x != 0).astype(np.float64)


def _with_nonzero(block: Any) -> Any:
    """A chunk of counts with its :func:`_nonzero` indicator beside it (genes ``[block | nonzero(block)]``), so one
    grouped sum over the chunk gives both the count sums and the numbers of expressing cells.
    """
    if is_sparse(block):
        return backend_of(block).sparse.hstack([block.astype(np.float64), _nonzero(block)], format="csr")
    return backend_of(block).xp.concatenate([block.astype(np.float64), _nonzero(block)], axis=1)


def profile_sums(x: Any, codes: np.ndarray, cells: np.ndarray, n_profiles: int) -> tuple[np.ndarray, np.ndarray, Any]:
    """Per profile the sums of the counts ``x`` (cells x genes) of its ``cells`` (profile ``codes[i]`` for cell
    ``cells[i]``) and the numbers of those cells with a non-zero count of each gene.

    Both are a sparse indicator matrix times the counts (times their non-zero indicator), as
    :func:`scanpy.get.aggregate` sums, in float64 (exact for counts up to 2**53), where the counts are (CPU or GPU);
    only the profiles x genes results come to the host. A dask array is checked and summed chunk by chunk in one pass
    (:func:`gpuc._lazy.grouped_sum_and_count_checks` over each chunk with its non-zero indicator beside it, so each
    chunk is read once); its count flags are returned (``None`` for an in-memory matrix, checked beforehand).
    """
    ind = sp.csr_matrix((np.ones(cells.size), (codes, cells)), shape=(n_profiles, x.shape[0]))
    if is_dask_array(x):
        widths = np.asarray(x.chunks[1], dtype=np.int64)
        wide = x.map_blocks(_with_nonzero, chunks=(x.chunks[0], tuple(int(2 * w) for w in widths)), dtype=np.float64)
        both, flags = grouped_sum_and_count_checks(ind, wide)  # the indicator's 0/1 leave the count flags unchanged
        starts = np.r_[0, np.cumsum(2 * widths)][:-1]
        sums = np.concatenate([both[:, s : s + w] for s, w in zip(starts, widths, strict=True)], axis=1)
        nnz = np.concatenate([both[:, s + w : s + 2 * w] for s, w in zip(starts, widths, strict=True)], axis=1)
        return sums, nnz, flags
    ind_d = backend_of(x).asarray(ind)

    def dense(m: Any) -> np.ndarray:
        m = to_host(m)
        return m.toarray() if sp.issparse(m) else np.asarray(m)

    summed = dense(ind_d @ (x if x.dtype == np.float64 else x.astype(np.float64)))
    return summed, dense(ind_d @ _nonzero(x)), None
