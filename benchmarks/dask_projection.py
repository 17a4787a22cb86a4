"""Project the Dask runs of ``bench_dask.py`` to 8, 64 and 512 workers from what the 1-worker run measured.

Inputs (``benchmarks/results/dask_{pipeline,metacells,nmf}.json``): every task's compute time from the task stream
of the 1-worker run, the bytes of each unit's arguments and result and of the shared (scattered) arguments, and
the wall time, whose part not covered by any task is the serial work of the driver (planning, graph building,
assembling and writing the results). The model, per step:

    T(W) = serial + makespan(tasks, W) + scheduler + transfers

* ``makespan``: the tasks placed longest first on the least loaded of W workers (LPT); a tree reduction runs level
  by level, each level's combine tasks spread over the workers, each combine fetching ``split_every - 1`` partials.
* ``scheduler``: 1 ms per task, spent one after the other in the scheduler (distributed's documented overhead).
* ``transfers`` at ``--gbps`` (default 10 Gb/s = 1.25 GB/s per link): every unit's arguments leave the driver and
  every result comes back to it, through its one link; a shared argument is broadcast with the scheduler's
  ``replicate`` (each holder serves 2 new workers per round: 1 + ceil(log3 W) rounds of the object's size).

Task times are those of a worker with one thread on the shared 2-core VM (contention included); the projection
assumes workers as fast. ``--check`` compares the 2-worker prediction with the measured 2-worker wall.

    python benchmarks/dask_projection.py --nmf-cells 50000 --metacells-samples 200
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
SCHED_S = 1e-3
WORKERS = (1, 2, 8, 64, 512)


def lpt(times: list[float], w: int) -> float:
    """Makespan of independent tasks on ``w`` workers, longest first onto the least loaded."""
    loads = [0.0] * min(w, max(1, len(times)))
    heapq.heapify(loads)
    for t in sorted(times, reverse=True):
        heapq.heappush(loads, heapq.heappop(loads) + t)
    return max(loads) if times else 0.0


def broadcast_s(nbytes: float, w: int, bw: float) -> float:
    return (1 + (math.ceil(math.log(w, 3)) if w > 1 else 0)) * nbytes / bw


def load(case: str, tag: str = "") -> dict:
    return json.loads((RESULTS / f"dask_{case}{tag}.json").read_text())


def _rep(res: dict, cfg: str) -> dict:
    return res[cfg]["repeats"][0]


def _wall(rep: dict, steps: list[str]) -> float:
    return sum(rep["steps"][s]["wall_s"] for s in steps)


def project_pipeline(res: dict, bw: float) -> dict:
    r1 = _rep(res, "1 worker")
    tasks = r1["tasks"]["by_prefix"]
    if "_partial_rows" in tasks:  # partials over the groups present in a chunk, a tree of fan-in 8
        part, comb, final, split = "_partial_rows", ["_add_partials"], "_place_partials", 8
    else:  # bench v0: dense groups x genes partial per chunk, dask's sum tree (split_every 4)
        part, comb, final, split = "sum", ["sum-partial", "sum-aggregate-finalize-hlgfinalizecomput"], "sum", 4
    pb_prefixes = [p for p in tasks if p != "gpuc-deseq"]
    pb_compute = sum(tasks[p]["compute_s_total"] for p in pb_prefixes)
    n_pb_tasks = sum(tasks[p]["n_tasks"] for p in pb_prefixes)
    n_chunks = tasks["make_dask_chunk"]["n_tasks"]
    chunk_s = sum(tasks[p]["compute_s_total"] for p in ("make_dask_chunk", part, "gpuc-count-checks") if p in tasks)
    chunk_s /= n_chunks
    n_comb = sum(tasks[p]["n_tasks"] for p in comb if p in tasks)
    comb_total = sum(tasks[p]["compute_s_total"] for p in comb if p in tasks)
    comb_s = comb_total / n_comb
    comb_max = max(tasks[p]["compute_s_max"] for p in comb if p in tasks)
    partial_b = tasks[part]["result_MB_median"] * 1e6  # what one chunk task hands on
    node_b = tasks[comb[0]]["result_MB_median"] * 1e6  # what an inner node hands on
    final_b = tasks[final]["result_MB_median"] * 1e6  # the groups x genes result, to the driver
    depth = math.ceil(math.log(n_chunks, split))
    pb_serial = r1["steps"]["pseudobulk"]["wall_s"] - pb_compute
    units = _unit_times(r1, "gpuc-deseq")
    de = r1["units"][0]
    de_bytes = (de["unit_arg_MB_total"] + de["unit_result_MB_total"]) * 1e6
    de_serial = r1["steps"]["deseq"]["wall_s"] - sum(units)
    out = {}
    for w in WORKERS:
        chunks = math.ceil(n_chunks / w) * chunk_s
        # the tree, level by level: each level's nodes spread over the workers, each fetching split - 1 inputs
        # (first level: chunk partials; above: inner nodes); the root, the largest node, at its measured max time
        tree, n_l, level = final_b / bw + (comb_max - comb_s), n_chunks, 0
        while n_l > 1:
            n_l = math.ceil(n_l / split)
            fetch = (split - 1) * (partial_b if level == 0 else node_b) / bw if w > 1 else 0.0
            tree += math.ceil(n_l / w) * (comb_s + fetch)
            level += 1
        t_pb = pb_serial + chunks + tree + n_pb_tasks * SCHED_S
        t_de = de_serial + lpt(units, w) + len(units) * SCHED_S + de_bytes / bw
        out[w] = {"pseudobulk": t_pb, "deseq": t_de, "total": t_pb + t_de,
                  "parts": {"pb_serial": pb_serial, "pb_chunks": chunks, "pb_tree": tree,
                            "de_serial": de_serial, "de_tasks": lpt(units, w), "de_transfer": de_bytes / bw}}  # fmt: skip
    meas = {c: _wall(_rep(res, c), ["pseudobulk", "deseq"]) for c in res if not c.startswith("_")}
    info = {"n_chunks": n_chunks, "chunk_task_s": chunk_s, "combine_s_mean": comb_s, "combine_s_max": comb_max,
            "chunk_partial_MB": partial_b / 1e6, "node_MB": node_b / 1e6, "result_MB": final_b / 1e6,
            "tree_fan_in": split, "tree_depth": depth, "pb_serial_s": pb_serial, "deseq_units_s": units,
            "deseq_serial_s": de_serial, "deseq_MB_through_driver": de_bytes / 1e6}  # fmt: skip
    return {"projection": out, "measured": meas, "model_inputs": info}


def _unit_times(rep: dict, prefix: str) -> list[float]:
    """Each unit's compute seconds; from older result files (only total / max per prefix): the max and the mean of
    the rest."""
    if "units" in rep["tasks"]:
        return [u["compute_s"] for u in rep["tasks"]["units"]]
    d = rep["tasks"]["by_prefix"][prefix]
    rest = (d["compute_s_total"] - d["compute_s_max"]) / max(1, d["n_tasks"] - 1)
    return [d["compute_s_max"]] + [rest] * (d["n_tasks"] - 1)


def project_metacells(res: dict, bw: float, n_samples: int, full: dict | None, loop_s: float) -> dict:
    """``full``: a run of all ``n_samples`` samples (its wall less its task span is the driver's serial part as the
    code stands); ``loop_s``: the part of the measured run's serial time spent in the per-label ``set(labels)`` of
    ``gpuc.tl.metacells`` (rebuilt for every metacell label: quadratic), removed in the "fixed" projection."""
    r1 = _rep(res, "1 worker")
    units = _unit_times(r1, "gpuc-metacells")
    n_meas = len(units)
    u = r1["units"][0]
    serial_meas = r1["steps"]["metacells"]["wall_s"] - sum(units)
    scale = n_samples / n_meas
    serial_fixed = max(0.0, serial_meas - loop_s) * scale  # the rest of the driver's work grows with the cells
    serial_as_is = serial_fixed
    if full is not None:
        rf = next(v["repeats"][0] for k, v in full.items() if not k.startswith("_"))
        serial_as_is = rf["steps"]["metacells"]["wall_s"] - rf["tasks"]["first_start_to_last_stop_s"]
    # the 200 fits: the measured ones repeated (same size, same distribution)
    times = [units[i % n_meas] for i in range(n_samples)]
    per_unit_b = (u["unit_arg_MB_total"] + u["unit_result_MB_total"]) * 1e6 / n_meas
    out = {}
    for w in WORKERS:
        mk = lpt(times, w)
        tr = n_samples * per_unit_b / bw
        rest = mk + n_samples * SCHED_S + tr
        out[w] = {"total": serial_fixed + rest, "total_as_is": serial_as_is + rest,
                  "parts": {"serial": serial_fixed, "serial_as_is": serial_as_is, "tasks": mk, "transfer": tr,
                            "scheduler": n_samples * SCHED_S}}  # fmt: skip
    check = {w: serial_meas + lpt(units, w) + n_meas * SCHED_S + n_meas * per_unit_b / bw for w in (1, 2)}
    meas = {c: _wall(_rep(res, c), ["metacells"]) for c in res if not c.startswith("_")}
    info = {"n_units_measured": n_meas, "unit_s_median": float(np.median(units)), "unit_s_max": max(units),
            "serial_s_measured": serial_meas, "set_labels_loop_s": loop_s, "serial_s_200_as_is": serial_as_is,
            "unit_MB_arg_plus_result": per_unit_b / 1e6, "n_samples_projected": n_samples}  # fmt: skip
    return {"projection": out, "check_same_size": check, "measured": meas, "model_inputs": info}


def _nmf_units(units: list[dict]) -> tuple[dict[int, float], dict[int, float]]:
    """Stage 1 (restarts: label 'k=K runs a-b') and stage 2 (sweep rows: label 'k=K') times per rank."""
    fit, row = {}, {}
    for u in units:
        lab = u["key"]
        k = int(lab.split("=")[1].split()[0])
        if "runs" in lab:
            fit[k] = fit.get(k, 0.0) + u["compute_s"]
        else:
            row[k] = u["compute_s"]
    return fit, row


def _restart_plan(ks: list[int], n_runs: int, w: int) -> list[list[tuple[int, int, bool]]]:
    """Units as ``gpuc.nmf._run.plan_units`` deals a sparse sweep to ``w`` workers (one per worker, ranks dealt
    costliest first, a rank split only to balance): per unit ``(k, runs, whole)``; ``whole``: the unit holds all of
    the rank's restarts, so its consensus runs there."""
    from types import SimpleNamespace

    from gpuc.nmf._run import plan_units

    units = plan_units(SimpleNamespace(sparse=True), ks, n_runs, w)
    return [[(k, len(r), len(r) == n_runs) for k, r in u] for u in units]


def project_nmf(res: dict, bw: float, cells_to: int, n_runs: int = 20) -> dict:
    """A unit's time is the sum of its groups' restart times (measured one rank per task, so an upper bound: a unit
    fits its ranks in the same passes over the data) plus the rows of the ranks it holds whole; the rows of split
    ranks run after the units, one task each, their restarts through the driver."""
    r1 = _rep(res, "1 worker")
    cells_meas = res["_meta"]["shape"][0]
    f = cells_to / cells_meas  # HALS (and the usages shipped) scale with the cells (nnz) at fixed genes and ranks
    fit, row = _nmf_units(r1["tasks"]["units"])
    st1 = r1["units"][0]
    shared_b = st1["shared_MB"] * 1e6 * f
    res_b = st1["unit_result_MB_total"] * 1e6 * f  # every rank's restarts (the measured run sent them all back)
    wall = r1["steps"]["nmf_k_sweep"]["wall_s"]
    serial = wall - sum(fit.values()) - sum(row.values())
    ks = sorted(fit)
    k_weight = sum(k for k in ks)

    def model(w: int, scale: float, shared: float, results: float) -> dict:
        plan = _restart_plan(ks, n_runs, w)
        # the consensus clusters k x n_runs spectra over the genes: not scaled
        t1 = [sum(fit[k] * scale * n / n_runs + (row[k] if whole else 0.0) for k, n, whole in u) for u in plan]
        split = sorted({k for u in plan for k, _, whole in u if not whole})
        mk1 = max(t1)
        mk2 = lpt([row[k] for k in split], w)
        tr = broadcast_s(shared, w, bw) + 2 * results * sum(split) / k_weight / bw
        n_tasks = len(plan) + len(split)
        return {"total": serial * scale + mk1 + mk2 + n_tasks * SCHED_S + tr,
                "parts": {"serial": serial * scale, "restarts": mk1, "rows": mk2, "transfer": tr,
                          "n_units": n_tasks, "split_ranks": len(split)}}  # fmt: skip

    out = {w: model(w, f, shared_b, res_b) for w in WORKERS}
    check = {w: model(w, 1.0, st1["shared_MB"] * 1e6, st1["unit_result_MB_total"] * 1e6)["total"] for w in (1, 2)}
    meas = {c: _wall(_rep(res, c), ["nmf_k_sweep"]) for c in res if not c.startswith("_")}
    info = {"cells_measured": cells_meas, "cells_projected": cells_to, "restart_s_per_k": fit,
            "row_s_per_k": row, "serial_s": serial, "shared_MB_projected": shared_b / 1e6,
            "restart_results_MB_projected": res_b / 1e6}  # fmt: skip
    return {"projection": out, "check_same_size": check, "measured": meas, "model_inputs": info}


def _fmt_table(name: str, proj: dict, keys: list[str]) -> list[str]:
    lines = [f"| {name}: workers | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for w, v in proj.items():
        vals = [v[k] if k in v else v["parts"][k] for k in keys]
        lines.append(f"| {w} | " + " | ".join(f"{x:.1f}" if isinstance(x, float) else str(x) for x in vals) + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gbps", type=float, default=10.0, help="link bandwidth in Gb/s")
    p.add_argument("--nmf-cells", type=int, default=50_000)
    p.add_argument("--metacells-samples", type=int, default=200)
    p.add_argument(
        "--metacells-loop-s",
        type=float,
        default=4.3,
        help="seconds of the 1-worker metacells run spent in the per-label set(labels) (measured apart)",
    )
    p.add_argument("--tag", default="")
    a = p.parse_args()
    bw = a.gbps / 8 * 1e9
    full_path = RESULTS / "dask_metacells_full200.json"
    full = json.loads(full_path.read_text()) if full_path.exists() else None
    out, md = {}, ["# Dask scaling projection (benchmarks/dask_projection.py)", ""]
    for case, fn, keys in (
        ("pipeline", lambda r: project_pipeline(r, bw), ["pb_serial", "pb_chunks", "pb_tree", "pseudobulk",
                                                         "de_tasks", "de_transfer", "deseq", "total"]),
        ("metacells", lambda r: project_metacells(r, bw, a.metacells_samples, full, a.metacells_loop_s),
         ["serial", "serial_as_is", "tasks", "transfer", "scheduler", "total", "total_as_is"]),
        ("nmf", lambda r: project_nmf(r, bw, a.nmf_cells), ["n_units", "split_ranks", "serial", "restarts",
                                                            "rows", "transfer", "total"]),
    ):  # fmt: skip
        try:
            res = load(case, a.tag)
        except FileNotFoundError:
            continue
        pr = fn(res)
        out[case] = pr
        md += _fmt_table(case, pr["projection"], keys)
        md += ["", f"measured wall (s): {json.dumps({k: round(v, 2) for k, v in pr['measured'].items()})}"]
        if "check_same_size" in pr:
            md += [
                f"model at the measured size (s): {json.dumps({k: round(v, 2) for k, v in pr['check_same_size'].items()})}"
            ]
        md += [f"inputs: {json.dumps(pr['model_inputs'], default=lambda x: round(x, 4))}", ""]
    (RESULTS / f"dask_projection{a.tag}.json").write_text(json.dumps(out, indent=1, default=float))
    (RESULTS / f"dask_projection{a.tag}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
