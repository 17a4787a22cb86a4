"""The GPU check's scripts run end to end in smoke mode (tiny data on gpuc's stand-in GPU), without a GPU.

Runs ``benchmarks/_harness.py smoke`` (every ``gpu_<tool>.py`` script's steps, each tool's cold-run measurement and
the run's summary, in one fresh process) and checks the structure of what it writes, then renders the results as
``benchmarks/report.py`` does for docs/benchmarks.md. The numbers are not checked: a smoke run times nothing real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"

pytestmark = pytest.mark.slow


def _smoke(out: Path, script: str, *args: str) -> None:
    """Run ``benchmarks/<script> <args>`` in smoke mode on the stand-in (no simulator), writing into ``out``."""
    env = {**os.environ, "OUT": str(out), "GPUC_SMOKE": "1", "MPLBACKEND": "Agg"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu_smoke")
    _smoke(out, "_harness.py", "smoke")
    return out


def _load(out: Path, name: str) -> dict:
    res = json.loads((out / f"{name}.json").read_text())
    assert (out / f"{name}.md").read_text().strip()
    return res


@pytest.mark.parametrize("tool", ["deseq", "nmf", "metacells", "rsc", "dask"])
def test_script_result(run, tool):
    res = _load(run, f"{tool}_gpu")
    assert res["kind"] == "gpu" and res["script"] == f"gpu_{tool}.py" and res["smoke"] is True
    assert res["errors"] == []
    assert set(res["step_seconds"]) and all(v >= 0 for v in res["step_seconds"].values())
    if tool != "dask":  # the Dask stage's smoke run stays on the CPU (the stand-in does not pickle)
        assert "stand-in" in res["device"]


def test_deseq_structure(run):
    res = _load(run, "deseq_gpu")
    assert len(res["parity"]) == 6 and all(p["ok"] for p in res["parity"])
    (row,) = res["timing"]
    assert {"size", "engine_gpu_input_on_device_s", "tl_deseq_gpu_s", "tl_deseq_cpu_s", "cpu_over_gpu"} <= set(row)
    assert set(res["stages_100x10k"]) == {"kernels", "batched CuPy"}


def test_nmf_structure(run):
    res = _load(run, "nmf_gpu")
    assert res["parity"]["pass"] is True
    for key in ("k7x20_gpu", "k7x20_gpu_float64", "iteration", "sweep_2_12x10_gpu", "k7x20_cpu", "rank200"):
        assert res[key]["seconds"] > 0, key
    assert res["rank200"]["finite"] is True


def test_metacells_structure(run):
    res = _load(run, "metacells_gpu")
    for key in ("parity_reference_pbmc68k", "parity_cpu_gpu_cd34like", "parity_cpu_gpu_identical_inputs"):
        assert res[key]["ok"] is True, key
    (row,) = res["timings"]
    assert {"n", "k", "total_s", "kernel_s", "fit_s", "n_iter"} <= set(row)


def test_rsc_and_dask_structure(run):
    rsc = _load(run, "rsc_gpu")
    assert set(rsc["tools"]) == {"metacells", "aggregate_metacells", "metacell_quality", "nmf_k_sweep",
                                 "consensus_nmf", "pseudobulk", "deseq", "vst"}  # fmt: skip
    assert all(t["ok"] for t in rsc["tools"].values()) and rsc["inputs_still_on_device"] is True
    dask = _load(run, "dask_gpu")
    assert set(dask["checks"]) == {"metacells_groupby", "deseq_groupby", "nmf_k_sweep"}
    assert dask["all_identical"] is True


def test_cold_run_measure(run):
    res = _load(run, "warmup")
    assert res["kind"] == "gpu_cold"
    assert set(res["measure"]["processes"]) == {"deseq", "nmf", "metacells"}
    tools = res["measure"]["tools"]
    assert set(tools) == {"tl.deseq", "tl.vst", "tl.consensus_nmf", "tl.nmf_k_sweep", "tl.metacells"}
    for r in tools.values():
        assert {"first_s", "warm_s", "first_minus_warm_s", "within_1s", "compiled_during_first"} <= set(r)


def test_summary(run):
    s = json.loads((run / "summary.json").read_text())
    assert s["kind"] == "gpu_summary" and s["smoke"] is True
    assert {r["stage"] for r in s["parity"]} >= {"deseq", "nmf", "metacells", "rsc", "dask_gpu"}
    assert all(r["ok"] for r in s["parity"])
    assert s["crossover"] and s["targets"]
    md = (run / "summary.md").read_text()
    for section in ("## Targets", "## Crossover", "## Warm-up", "## CPU scaling", "## Parity", "**Smoke run**"):
        assert section in md


def test_report_renders_gpu_blocks(run, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    doc = tmp_path / "doc.md"
    names = ["deseq_gpu", "nmf_gpu", "metacells_gpu", "rsc_gpu", "dask_gpu", "warmup", "summary"]
    doc.write_text("".join(f"<!-- generated: {n} -->\nold\n<!-- /generated: {n} -->\n" for n in names))
    cmd = [sys.executable, str(BENCH / "report.py"), "--doc", str(doc), "--results", str(run)]
    assert subprocess.run(cmd, env=env, capture_output=True, text=True).returncode == 0
    new = doc.read_text()
    assert "old" not in new
    # each block is what the script wrote beside its JSON (the same render)
    for n in names:
        assert (run / f"{n}.md").read_text().rstrip("\n") in new, n


def test_kernels_script_smoke(tmp_path):
    """benchmarks/gpu_kernels.py (issue 40) end to end on the stand-in: the fused status, the launch step, the
    products, one HALS iteration per dtype beside the CPU path, the metacells and DESeq2 steps (kernel times only
    where the simulator runs the kernels; here the array code runs)."""
    _smoke(tmp_path, "gpu_kernels.py", "--smoke")
    res = _load(tmp_path, "kernels_gpu")
    assert res["smoke"] is True and res["errors"] == []
    assert set(res["fused"]) == {"on", "why"}
    assert [r["dtype"] for r in res["hals"]] == ["float32", "float64"]
    assert all(r["cpu_ms_per_iteration"] > 0 for r in res["hals"])
    assert {"spmm_vt_w_ms", "gemm_vt_w_ms", "spmm_v_h_ms", "gemm_v_h_ms"} <= set(res["products"])
    assert res["metacells"]["cpu_wall_s"] > 0 and res["deseq"]["cpu_wall_s"] > 0
