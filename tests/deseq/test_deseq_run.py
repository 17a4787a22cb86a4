"""The engine below ``tl.deseq``/``tl.vst`` (``gpuc.deseq._run``): the plan and run usable on arrays alone, the memory
models of the VST and of the gene-block fit against measured peaks, gene blocks that name themselves when they fail
in process and that survive a killed worker, and a quiet fit at ``verbosity=0``."""

from __future__ import annotations

import io
import sys
import warnings

import numpy as np
import pandas as pd
import pytest

import gpuc
from gpuc._backend import get_backend
from gpuc._dask import map_units
from gpuc.deseq._analysis import plan_analysis
from gpuc.deseq._blocks import run_analysis_blocked
from gpuc.deseq._run import blocked_peak_bytes, plan_deseq, run_deseq_plan, vst_peak_bytes

CPU = get_backend("cpu")
# the stated factor: the measured peak lies between LOW and HIGH times the estimate
LOW, HIGH = 0.35, 1.1


# --------------------------------------------------------------------------------------------------------------------
# the engine on arrays
# --------------------------------------------------------------------------------------------------------------------
def test_plan_and_run_on_arrays_give_what_tl_writes(sim_bulk):
    a = sim_bulk(n_per=4, n_genes=120)
    a.obs["cell_type"] = np.tile(["T", "B"], a.n_obs // 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # R's simulated prior variance, noted per group
        gpuc.tl.deseq(a, "~condition", groupby="cell_type", device="cpu")
    options = {"fit_type": "parametric", "refit_cooks": True, "min_replicates": 7, "max_iter": 100, "alpha": 0.05}
    options |= {"cooks_filter": True, "independent_filter": True, "lfc_threshold": 0.0, "alt_hypothesis": "greaterAbs"}
    options |= {"lfc_shrink": None, "random_state": 2}
    plan = plan_deseq(
        a.obs, a.X, "~condition", None, reduced=None, group_of=a.obs["cell_type"].to_numpy(dtype=object),
        groupby="cell_type", size_factors="ratio", options=options, where="X",
    )  # fmt: skip
    assert [u.group for u in plan.units] == ["T", "B"] and plan.grouped and plan.width == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run_deseq_plan(CPU, a.X, plan, gene_names=a.var_names, client=None, n_jobs=1, run_units=map_units)
    for r in got:
        want = a.uns["deseq"]["groups"][r.group]
        name = next(iter(r.analysis.tables))
        pd.testing.assert_frame_equal(r.analysis.tables[name], want["results"][name])
        np.testing.assert_array_equal(r.analysis.fit.size_factors, a.obs["deseq_size_factors"].to_numpy()[r.mask])


def test_plan_refuses_when_no_group_can_be_tested(sim_bulk):
    a = sim_bulk(n_per=4, n_genes=40)
    a.obs["g"] = [f"only{i}" for i in range(a.n_obs)]  # one sample per group: no residual degrees of freedom
    with pytest.raises(ValueError, match="no group of 'g' could be tested"):
        plan_deseq(
            a.obs, a.X, "~condition", None, reduced=None, group_of=a.obs["g"].to_numpy(dtype=object), groupby="g",
            size_factors="ratio", options={}, where="X",
        )  # fmt: skip


# --------------------------------------------------------------------------------------------------------------------
# memory models against measured peaks (issue 31)
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "levels", "n_genes"), [(24, 2, 1500), (84, 41, 500)])
@pytest.mark.parametrize("blind", [True, False])
def test_vst_estimate_brackets_the_measured_peak(wide_design, traced_peak, n, levels, n_genes, blind):
    gpuc.tl.vst(wide_design(12, 2, 50), device="cpu", n_jobs=1)  # one-time set-up outside the measurement
    a = wide_design(n, levels, n_genes)
    if not blind:
        gpuc.tl.deseq(a, "~f", device="cpu", n_jobs=1)
    peak = traced_peak(gpuc.tl.vst, a, blind=blind, device="cpu", n_jobs=1)
    est = vst_peak_bytes(n, n_genes)
    assert LOW * est <= peak <= HIGH * est, f"peak {peak / 2**20:.2f} MiB vs estimate {est / 2**20:.2f} MiB"


@pytest.mark.parametrize(("n", "levels", "n_genes"), [(24, 2, 1500), (84, 41, 500)])
@pytest.mark.parametrize("n_blocks", [1, 4])
def test_blocked_estimate_brackets_the_measured_peak(wide_design, traced_peak, n, levels, n_genes, n_blocks):
    a = wide_design(n, levels, n_genes)
    plan = plan_analysis(a.obs, "~f", None)
    block = n_genes // n_blocks

    def fit(b: int) -> None:
        run_analysis_blocked(CPU, a.X, plan, gene_names=a.var_names, block_genes=b, n_jobs=1)

    fit(n_genes)  # one-time set-up (kernels loaded) outside the measurement
    peak = traced_peak(fit, block)
    est = blocked_peak_bytes(n, n_genes, levels, block_genes=block, solved=max(128, 2**16 // n))
    assert LOW * est <= peak <= HIGH * est, f"peak {peak / 2**20:.2f} MiB vs estimate {est / 2**20:.2f} MiB"
    if levels > 20 and n_blocks > 1:  # the old estimate (no covariances on the client) undercounted this
        old = 4.0 * 8.0 * n * n_genes + (est - 8.0 * n_genes * (4.0 * n + 2.0 * levels**2 + 100.0))
        assert old < peak


# --------------------------------------------------------------------------------------------------------------------
# gene blocks: failures named in process, killed workers rerun (issue 31)
# --------------------------------------------------------------------------------------------------------------------
def test_in_process_block_failure_names_the_block(sim_bulk):
    a = sim_bulk(n_per=4, n_genes=200)
    x = a.X.astype(np.float64)
    x[2, 150] = -1
    plan = plan_analysis(a.obs, "~condition", None)
    with pytest.raises(ValueError, match=r"genes \[150\]") as info:
        run_analysis_blocked(CPU, x, plan, gene_names=a.var_names, block_genes=100, size_factors=np.ones(a.n_obs))
    assert "deseq failed on genes 100-199." in getattr(info.value, "__notes__", [])


def test_gene_blocks_lost_with_the_only_worker_are_resubmitted(sim_bulk, local_cluster, kill_busy_worker):
    """SIGKILL the single worker process while it fits a block: the block's counts, scattered to it, are gone; the
    units are resubmitted from the client with their counts (a warning says so) and the result is the in-process
    one."""
    a = sim_bulk(n_per=6, n_genes=2000)
    plan = plan_analysis(a.obs, "~condition", None)
    kw = {"gene_names": a.var_names, "block_genes": 100, "n_jobs": 1}
    want = run_analysis_blocked(CPU, a.X, plan, **kw)
    with local_cluster(1, dashboard_address=None, silence_logs=50) as client:
        with kill_busy_worker(client, poll=0.02), pytest.warns(gpuc.GpucWarning, match="lost .* resubmitted"):
            got = run_analysis_blocked(CPU, a.X, plan, client=client, **kw)
        for name, table in want.tables.items():
            pd.testing.assert_frame_equal(got.tables[name], table)


# --------------------------------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------------------------------
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_deseq_is_silent_at_verbosity_zero(sim_bulk, monkeypatch):
    """No bar and no log line at ``verbosity=0``, even with bars switched on and a terminal watching; the same run at
    ``verbosity=3`` logs (so the capture works)."""
    import scanpy as sc

    from gpuc._settings import settings

    terminal = _Terminal()
    monkeypatch.setattr(settings, "progress", True)
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(sys, "stdout", terminal)
    a = sim_bulk(n_per=4, n_genes=60)
    a.obs["cell_type"] = np.tile(["T", "B"], a.n_obs // 2)
    verbosity, logfile = sc.settings.verbosity, sc.settings.logfile
    sc.settings.logfile = terminal  # Scanpy's log lines go to its own handle of stderr
    written = {}
    try:
        for level in (0, 3):
            sc.settings.verbosity = level
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                gpuc.tl.deseq(a, "~condition", device="cpu")
                gpuc.tl.deseq(a, "~condition", groupby="cell_type", device="cpu", key_added="by_type")
                gpuc.tl.vst(a, device="cpu")
            written[level] = terminal.getvalue()
            terminal.seek(0)
            terminal.truncate()
    finally:
        sc.settings.verbosity, sc.settings.logfile = verbosity, logfile
    assert written[0] == ""
    assert "DESeq2: 8 samples x 60 genes" in written[3]
