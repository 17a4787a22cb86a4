"""One summary of a device run (benchmarks/gpu_check.sh): the issue's H200 targets, where the GPU wins against gpuc's
own CPU path (crossover), the warm-up stage, CPU thread scaling, parity and the stages' exit status.

Reads the stage files under ``$OUT`` (whatever finished; a missing part is reported as such) and writes
``$OUT/summary.md`` and ``$OUT/summary.json``; prints the Markdown.

    OUT=/tmp/out python benchmarks/gpu_summary.py

Sources: ``warmup.json`` (the cold-run stage, ``_harness.py cold``), ``deseq_gpu.json``, ``nmf_gpu.json``,
``metacells_gpu.json``, ``rsc_gpu.json``, ``dask_gpu.json`` (gpu_<tool>.py), ``cpu_metacells.json``, ``cpu_nmf.json``,
``cpu_deseq.json`` (bench_<tool>.py --skip-peers at 1/4/16 threads: the CPU scaling; a recorded run's
``cpu_scaling.json`` from the script they replaced is read as well), ``pytest_gpu.log``, ``stage_status.txt``,
``gpu.txt``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

OUT = Path(os.environ.get("OUT", Path(__file__).resolve().parents[1] / "gpu_results"))
# the goals for gpuc's CPU path: speed-up over one thread at 16 threads
SCALING_GOALS = {"metacells": 6.0, "nmf": 8.0, "deseq": 8.0}
SCALING_LABELS = {"metacells": "metacells", "nmf": "consensus NMF", "deseq": "DESeq2"}

# the targets on an H200 (warm, float64): (key, label, target seconds)
TIME_TARGETS = [
    ("nmf_iter", "NMF: one batched HALS iteration, 6,881 x 2,000, k=7 x 20", 0.5e-3),
    ("nmf_k7", "NMF: k=7 x 20 runs + consensus, 6,881 x 2,000", 0.12),
    ("nmf_sweep", "NMF: k sweep 2..12 x 10 runs, 6,881 x 2,000", 1.0),
    ("mc_pbmc3k", "metacells: tl.metacells on pbmc3k (2,638 cells)", 0.3),
    ("mc_6881", "metacells: 6,881 cells, k=92", 0.5),
    ("mc_50000", "metacells: 50,000 cells", 4.0),
    ("mc_200000", "metacells: 200,000 cells", 15.0),
    ("de_100", "DESeq2: 100 x 10,000", 0.05),
    ("de_500", "DESeq2: 500 x 30,000", 0.15),
    ("vst_pbmc3k", "DESeq2: tl.vst on the pbmc3k pseudobulk", 0.05),
]
MEMORY_TARGET_GB = 12.0  # metacells at 200,000 cells
SPEEDUP_TARGET = 3.0  # against gpuc's own CPU path on 16 cores
SPEEDUP_CASES = [
    ("metacells", "6,881 cells, k=92"),
    ("consensus NMF", "6,881 x 2,000, k=7 x 20"),
    ("DESeq2", "500 x 30,000"),
    ("metacells", "200,000 cells"),
]


def load(name: str) -> Any:
    try:
        return json.loads((OUT / name).read_text())
    except (OSError, ValueError):
        return None


def smoke_run() -> bool:
    """Whether the run's files come from smoke mode (tiny data on the stand-in GPU)."""
    return any(get(load(f), "smoke") for f in PART_FILES.values())


def get(obj: Any, *keys: Any) -> Any:
    for k in keys:
        if isinstance(obj, dict) and k in obj:
            obj = obj[k]
        elif isinstance(obj, list) and isinstance(k, int) and -len(obj) <= k < len(obj):
            obj = obj[k]
        else:
            return None
    return obj


def num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def cpu_scaling(out: Path) -> dict | None:
    """The CPU scaling of a run: gpuc's warm medians per thread count from the bench_<tool>.py files (one case each),
    with the speed-up over one thread and the goal at 16 threads; None when there are none. A recorded run's
    ``cpu_scaling.json`` (the script these replaced) is returned as it is."""
    old = load("cpu_scaling.json")
    if old is not None:
        return old
    cases, counts, machine, smoke = {}, set(), None, False
    for tool, goal in SCALING_GOALS.items():
        res = load(f"cpu_{tool}.json")
        if not res or not res.get("rows"):
            continue
        row, machine, smoke = res["rows"][0], res.get("machine"), smoke or bool(res.get("smoke"))
        threads = {c: cfg for c, cfg in row["gpuc"].items() if c != "default" and num(cfg.get("warm_s")) is not None
                   and cfg["warm_s"] == cfg["warm_s"]}  # fmt: skip
        counts |= {int(c) for c in threads}
        base = num(get(threads, "1", "warm_s"))
        c: dict = {"label": f"{SCALING_LABELS[tool]} {row.get('about', row['case'])}", "threads": {}}
        for t, cfg in sorted(threads.items(), key=lambda kv: int(kv[0])):
            c["threads"][t] = {"median_s": cfg["warm_s"], "all_s": cfg.get("warm_all", []),
                               "cold_s": cfg.get("cold_s"), "speedup": base / cfg["warm_s"] if base else None}  # fmt: skip
        top = get(c, "threads", "16", "speedup")
        c["goal"] = {"speedup": goal, "value": top, "measured": "not measured: fewer than 16 cores" if top is None
                     else f"{top:.2f}x", "met": "" if top is None else ("yes" if top >= goal else "NO")}  # fmt: skip
        if row.get("budget_skipped"):
            c["budget_skipped"] = row["budget_skipped"]
        cases[tool] = c
    if not cases:
        return None
    m = machine or {}
    return {"machine": {"cpu": m.get("cpu"), "available_cores": m.get("cores"), "small": smoke},
            "thread_counts": sorted(counts), "cases": cases}  # fmt: skip


def fmt_s(v: float | None) -> str:
    """Seconds with a unit: ms below 0.1 s."""
    if v is None:
        return "-"
    if v < 0.1:
        return f"{v * 1e3:.2f} ms"
    return f"{v:.3f} s" if v < 10 else f"{v:.1f} s"


def fmt_g(v: Any) -> str:
    """A float to 3 significant digits, anything else as it is."""
    return f"{v:.3g}" if isinstance(v, float) else str(v)


# ---- the stages' numbers ------------------------------------------------------------------------------------------
def metacells_rows(mc: Any) -> dict[int, dict]:
    return {r["n"]: r for r in (get(mc, "timings") or []) if isinstance(r, dict) and "n" in r}


def deseq_rows(de: Any) -> dict[str, dict]:
    """DESeq2 timing rows by size, "100x10000" / "500x30000"."""
    return {str(r.get("size", "")).replace(" ", ""): r for r in (get(de, "timing") or []) if isinstance(r, dict)}


def nmf_value(nmf: Any, key: str) -> tuple[float | None, str | None]:
    """(seconds, dtype) of an NMF result, the float64 one when present (the targets are float64)."""
    v = num(get(nmf, key + "_float64", "seconds"))
    if v is not None:
        return v, "float64"
    v = num(get(nmf, key, "seconds"))
    if v is None:
        return None, None
    return v, get(nmf, key, "dtype") or "float32"


def cpu_scaling_best(cs: Any, case: str) -> tuple[float | None, int | None]:
    """Median seconds at 16 threads (else the most threads measured) of a cpu_scaling case."""
    th = get(cs, "cases", case, "threads") or {}
    if not th:
        return None, None
    t = "16" if "16" in th else max(th, key=int)
    return num(th[t].get("median_s")), int(t)


def rsc_how(r: Any) -> str:
    """How gpu_rsc.py timed a tool: warm medians (with ``gpu_first_s`` beside them) or, in older runs, one call."""
    if isinstance(r, dict) and "gpu_first_s" in r:
        return f"rsc_gpu.json, warm median of {r.get('calls', 3) - 1}"
    return "rsc_gpu.json, one call"


def targets(parts: dict) -> list[dict]:
    nmf, mc, de, rsc = parts["nmf"], metacells_rows(parts["metacells"]), deseq_rows(parts["deseq"]), parts["rsc"]
    vals: dict[str, tuple[float | None, str, str]] = {}  # key -> (seconds, dtype, source)
    v, dt = nmf_value(nmf, "iteration")
    vals["nmf_iter"] = (v, dt or "", "nmf_gpu.json (50 iterations timed, stopping rule off)")
    for key, name in (("nmf_k7", "k7x20_gpu"), ("nmf_sweep", "sweep_2_12x10_gpu")):
        v, dt = nmf_value(nmf, name)
        calls = get(nmf, name + ("_float64" if dt == "float64" else ""), "all") or []
        vals[key] = (v, dt or "", f"nmf_gpu.json, median of {len(calls)}")
    vals["mc_pbmc3k"] = (num(get(rsc, "tools", "metacells", "gpu_s")), "", rsc_how(get(rsc, "tools", "metacells")))
    for n in (6881, 50000, 200000):
        vals[f"mc_{n}"] = (num(get(mc.get(n), "total_s")), "", "metacells_gpu.json, one call (kernel + init + fit)")
    vals["de_100"] = (num(get(de.get("100x10000"), "tl_deseq_gpu_s")), "float64", "deseq_gpu.json, median of 3")
    vals["de_500"] = (num(get(de.get("500x30000"), "tl_deseq_gpu_s")), "float64", "deseq_gpu.json, median of 3")
    vals["vst_pbmc3k"] = (num(get(rsc, "tools", "vst", "gpu_s")), "float64", rsc_how(get(rsc, "tools", "vst")))
    rows = []
    for key, label, target in TIME_TARGETS:
        v, dt, src = vals[key]
        if v is None:
            met = "not measured"
        elif dt == "float32":  # float32 is the faster precision: a miss is a miss, a pass says nothing of float64
            met = "NO" if v > target else "unknown (float32 measured)"
        else:
            met = "yes" if v <= target else "NO"
        rows.append({"case": label, "gpu_s": v, "target_s": target, "dtype": dt, "met": met, "source": src})
    peak = num(get(mc.get(200000), "gpu_pool_peak_gb"))
    rows.append({
        "case": "metacells: 200,000 cells, device memory (CuPy pool, GB)", "gpu_s": None, "value": peak,
        "target_gb": MEMORY_TARGET_GB, "dtype": "",
        "met": "not measured" if peak is None else ("yes" if peak <= MEMORY_TARGET_GB else "NO"),
        "source": "metacells_gpu.json gpu_pool_peak_gb",
    })  # fmt: skip
    return rows


def crossover(parts: dict) -> list[dict]:
    """Per tool and size: gpuc's CPU path against its GPU path, the faster one and the ratio CPU / GPU."""
    nmf, mc, de, rsc, cs = (parts[k] for k in ("nmf", "metacells", "deseq", "rsc", "cpu_scaling"))
    if get(cs, "machine", "small"):  # small or smoke sizes: not those of the GPU stages, not paired with them
        cs = None
    mcr, der = metacells_rows(mc), deseq_rows(de)
    rows: list[dict] = []

    def add(tool: str, size: str, cpu: float | None, gpu: float | None, cpu_src: str, gpu_src: str) -> None:
        if cpu is None and gpu is None:
            return
        ratio = cpu / gpu if cpu is not None and gpu else None
        faster = "" if ratio is None else ("GPU" if ratio > 1 else "CPU")
        rows.append({"tool": tool, "size": size, "cpu_s": cpu, "gpu_s": gpu, "faster": faster, "cpu_over_gpu": ratio,
                     "cpu_source": cpu_src, "gpu_source": gpu_src})  # fmt: skip

    # metacells
    for n, label in ((6881, "6,881 cells, k=92"), (50000, "50,000 cells"), (200000, "200,000 cells")):
        r = mcr.get(n) or {}
        cpu, src = None, "not measured"
        if n == 6881:
            cpu, t = cpu_scaling_best(cs, "metacells")
            src = f"CPU scaling, {t} threads, warm median" if cpu is not None else src
        for key in ("cpu_total_s", "cpu_s"):  # a CPU time the metacells stage may record beside the GPU one
            if cpu is None and num(r.get(key)) is not None:
                cpu, src = num(r.get(key)), f"metacells_gpu.json {key}"
        add("metacells", label, cpu, num(r.get("total_s")), src, "metacells_gpu.json, one call")
    # consensus NMF, at the default dtype (float32) on both, and in float64 where both were timed
    cpu, t = cpu_scaling_best(cs, "nmf")
    src = f"CPU scaling, {t} threads, warm median"
    if cpu is None and num(get(nmf, "k7x20_cpu", "seconds")) is not None:
        cpu, src = (
            num(get(nmf, "k7x20_cpu", "seconds")),
            f"nmf_gpu.json, {get(nmf, 'k7x20_cpu', 'threads')} threads, one call",
        )
    shape = get(nmf, "matrix", "shape") or [6881, 2000]
    size = f"{shape[0]:,} x {shape[1]:,}, k=7 x 20"
    add("consensus NMF", f"{size} (float32)", cpu, num(get(nmf, "k7x20_gpu", "seconds")), src,
        "nmf_gpu.json, median of 3")  # fmt: skip
    add("consensus NMF", f"{size} (float64)", num(get(nmf, "k7x20_cpu_float64", "seconds")),
        num(get(nmf, "k7x20_gpu_float64", "seconds")), "nmf_gpu.json, one call", "nmf_gpu.json, median of 3")  # fmt: skip
    # DESeq2
    for size, label in (("100x10000", "100 x 10,000"), ("500x30000", "500 x 30,000")):
        r = der.get(size) or {}
        cpu, src = num(r.get("tl_deseq_cpu_s")), "deseq_gpu.json, one call, all cores"
        if size == "500x30000":
            c, t = cpu_scaling_best(cs, "deseq")
            if c is not None:
                cpu, src = c, f"CPU scaling, {t} threads, warm median"
        add("DESeq2", label, cpu, num(r.get("tl_deseq_gpu_s")), src, "deseq_gpu.json, median of 3")
    # every tool on pbmc3k as rapids-singlecell leaves it on the device
    for tool, r in (get(rsc, "tools") or {}).items():
        if "error" not in r:
            add(f"{tool} (pbmc3k)", "2,638 cells" if "deseq" not in tool and tool != "vst" else "pseudobulk",
                num(r.get("cpu_s")), num(r.get("gpu_s")), rsc_how(r), rsc_how(r))  # fmt: skip
    return rows


def speedups(cross: list[dict]) -> list[dict]:
    out = []
    for tool, size in SPEEDUP_CASES:
        r = next((c for c in cross if c["tool"] == tool and c["size"].startswith(size)), None)
        ratio = r["cpu_over_gpu"] if r else None
        if ratio is None:
            why = "no GPU time" if not r or r["gpu_s"] is None else "no CPU time"
            met = f"not measured ({why})"
        else:
            met = "yes" if ratio >= SPEEDUP_TARGET else "NO"
        out.append({"case": f"{tool} {size}", "cpu_over_gpu": ratio, "target": SPEEDUP_TARGET, "met": met,
                    "cpu_source": r["cpu_source"] if r else ""})  # fmt: skip
    return out


def parity(parts: dict) -> list[dict]:
    rows: list[dict] = []
    de = parts["deseq"]
    for p in get(de, "parity") or []:
        rows.append(
            {
                "stage": "deseq",
                "check": p.get("case"),
                "ok": p.get("ok"),
                "detail": f"max rel. diff {p.get('max_rel', float('nan')):.2e}",
            }
        )
    nmf = get(parts["nmf"], "parity")
    if nmf:
        d = (f"float64 max |d rel_error| {fmt_g(get(nmf, 'float64', 'max_abs_rel_error_diff'))}, float32 "
             f"{fmt_g(get(nmf, 'float32', 'max_abs_rel_error_diff'))}, tl min cosine "
             f"{fmt_g(get(nmf, 'tl_consensus', 'min_best_cosine'))}")  # fmt: skip
        rows.append(
            {
                "stage": "nmf",
                "check": "engine float64/float32 + tl.consensus_nmf (cNMF 700 x 500)",
                "ok": nmf.get("pass"),
                "detail": d,
            }
        )
    mc = parts["metacells"]
    ref = get(mc, "parity_reference_pbmc68k")
    if ref:
        ok = ref.get("ok", bool(ref.get("labels_equal")) and (num(ref.get("rss_max_rel_diff")) or 0) <= 1e-10)
        rows.append({"stage": "metacells", "check": "GPU vs SEACells 0.3.3 trajectory (pbmc68k)", "ok": ok,
                     "detail": f"labels equal {ref.get('labels_equal')}, RSS rel. diff {fmt_g(ref.get('rss_max_rel_diff'))}"})  # fmt: skip
    cc = get(mc, "parity_cpu_gpu_cd34like")
    if cc:
        agree = num(cc.get("label_agreement"))
        ok = cc.get("ok", agree is not None and agree >= 0.999 and (num(cc.get("rss_max_rel_diff")) or 0) <= 1e-8)
        rows.append({"stage": "metacells", "check": "CPU vs GPU, same 6,881-cell kernel, 8 iterations", "ok": ok,
                     "detail": f"label agreement {fmt_g(agree)}, RSS rel. diff {fmt_g(cc.get('rss_max_rel_diff'))}"})  # fmt: skip
    for tool, r in (get(parts["rsc"], "tools") or {}).items():
        skip = ("cpu_s", "gpu_s", "ok", "traceback")
        detail = r.get("error") or ", ".join(f"{k}={fmt_g(v)}" for k, v in r.items() if k not in skip)
        rows.append({"stage": "rsc", "check": tool, "ok": bool(r.get("ok")), "detail": detail})
    for name, r in (get(parts["dask"], "checks") or {}).items():
        rows.append(
            {
                "stage": "dask_gpu",
                "check": f"{name}: cluster = in process",
                "ok": r.get("identical"),
                "detail": get(parts["dask"], "cluster"),
            }
        )
    for name, c in (get(parts["cpu_scaling"], "cases") or {}).items():
        same = [r.get("same_result") for r in (c.get("threads") or {}).values() if "same_result" in r]
        if same:
            rows.append(
                {
                    "stage": "cpu_scaling",
                    "check": f"{name}: same result at every thread count",
                    "ok": all(same),
                    "detail": "",
                }
            )
    log = OUT / "pytest_gpu.log"
    if log.exists():
        last = [ln for ln in log.read_text().splitlines() if ln.strip()]
        tail = last[-1] if last else ""
        ok = bool(re.search(r"\d+ passed", tail)) and not re.search(r"failed|error", tail)
        rows.append({"stage": "pytest_gpu", "check": "gpu-marked tests", "ok": ok, "detail": tail})
    return rows


def device_line() -> str:
    for name in ("gpu.txt", "env.txt"):
        p = OUT / name
        if p.exists():
            lines = p.read_text().splitlines()
            for i, ln in enumerate(lines):
                if ln.startswith("name, memory.total") and i + 1 < len(lines):
                    return lines[i + 1]
    return ""


# ---- output -------------------------------------------------------------------------------------------------------
def markdown(s: dict) -> str:
    title = f"# GPU check summary ({s['device']})" if s["device"] else "# GPU check summary"
    L = [title, ""]
    if s.get("smoke"):
        L += ["**Smoke run** (tiny data on the stand-in GPU): the numbers say nothing of any device.", ""]
    L += [
        "## Targets (H200, warm, float64)",
        "",
        "| case | GPU | target | met | precision | source |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in s["targets"]:
        if "target_gb" in r:
            v = "-" if r["value"] is None else f"{r['value']:.2f} GB"
            L.append(f"| {r['case']} | {v} | <= {r['target_gb']:.0f} GB | {r['met']} | | {r['source']} |")
        else:
            L.append(
                f"| {r['case']} | {fmt_s(r['gpu_s'])} | <= {fmt_s(r['target_s'])} | {r['met']} | {r['dtype']} | {r['source']} |"
            )
    L += ["", f"Against gpuc's own CPU path on 16 cores (target >= {SPEEDUP_TARGET:.0f}x):", "",
          "| case | CPU / GPU | met | CPU time from |", "| --- | --- | --- | --- |"]  # fmt: skip
    for r in s["speedups"]:
        v = "-" if r["cpu_over_gpu"] is None else f"{r['cpu_over_gpu']:.2f}x"
        L.append(f"| {r['case']} | {v} | {r['met']} | {r['cpu_source']} |")
    L += ["", "## Crossover: gpuc CPU path vs GPU path", "", "| tool | size | CPU s | GPU s | faster | CPU / GPU | CPU time from |",
          "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in s["crossover"]:
        ratio = "-" if r["cpu_over_gpu"] is None else f"{r['cpu_over_gpu']:.2f}x"
        L.append(
            f"| {r['tool']} | {r['size']} | {fmt_s(r['cpu_s'])} | {fmt_s(r['gpu_s'])} | {r['faster'] or '-'} | {ratio} | {r['cpu_source']} |"
        )
    wu = s.get("warmup")
    L += ["", "## Warm-up: a fresh process's first call (target: within 1 s of the warm call)", ""]
    if wu:
        procs = get(wu, "measure", "processes") or {"all tools": get(wu, "measure") or {}}  # older runs: one process
        procs = "; ".join(f"{t}: imports {p.get('import_s')} s, CUDA context {p.get('cuda_context_s')} s"
                          for t, p in procs.items())  # fmt: skip
        L.append(f"Fill: {fmt_s(num(get(wu, 'fill', 'seconds')))} ({get(wu, 'fill', 'mode')}); caches after it: "
                 f"{wu.get('caches_after_fill')}; measuring processes: {procs}; all within 1 s: "
                 f"{wu.get('all_within_1s')}.")  # fmt: skip
        bad = [
            f"{t}: {k}: {v}"
            for t, r in (get(wu, "fill", "tasks") or {}).items()
            for k, v in (r.get("calls") or {}).items()
            if isinstance(v, str)
        ]
        bad += [f"{t}: exit {r.get('rc')}" for t, r in (get(wu, "fill", "tasks") or {}).items() if r.get("rc") != 0]
        if bad:
            L += ["", "Fill problems: " + "; ".join(bad)[:1500]]
        L += [
            "",
            "| tool | size | first call s | warm s | first - warm | within 1 s | compiled in the second process |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, r in (get(wu, "measure", "tools") or {}).items():
            if "warm_s" not in r:
                L.append(f"| {name} | {r.get('size', '')} | | | | | {r.get('error', 'did not finish')} |")
                continue
            L.append(f"| {name} | {r['size']} | {r['first_s']:.3f} | {r['warm_s']:.3f} | {r['first_minus_warm_s']:+.3f} s | "
                     f"{'yes' if r['within_1s'] else 'NO'} | {r.get('compiled_during_first')} |")  # fmt: skip
    else:
        L.append("warmup.json missing (the stage failed or timed out before writing it).")
    cs = s.get("cpu_scaling")
    L += ["", "## CPU scaling (gpuc's CPU path, warm; goals at 16 threads: metacells >= 6x, NMF and DESeq2 >= 8x)", ""]
    if cs:
        m = cs.get("machine", {})
        L.append(
            f"{m.get('cpu', '')}, {m.get('available_cores')} cores available; thread counts {cs.get('thread_counts')}."
        )
        L += ["", "| case | " + " | ".join(f"{t} threads" for t in cs.get("thread_counts", [])) + " | goal | met |",
              "| --- " * (3 + len(cs.get("thread_counts", []))) + "|"]  # fmt: skip
        for c in (cs.get("cases") or {}).values():
            if "error" in c:
                L.append(f"| {c.get('label', '?')} | error: {c['error'][:120]} |")
                continue
            cells = []
            for t in cs.get("thread_counts", []):
                r = get(c, "threads", str(t))
                speedup = "" if not r or r.get("speedup") is None else f" ({r['speedup']:.2f}x)"
                cells.append("-" if not r else f"{r['median_s']:.3f} s{speedup}")
            g = c.get("goal", {})
            L.append(
                f"| {c.get('label', '?')} | "
                + " | ".join(cells)
                + f" | >= {g.get('speedup', 0):.0f}x | {g.get('met') or g.get('measured', '')} |"
            )
    else:
        L.append("cpu_<tool>.json missing (the CPU stages failed, timed out or were skipped).")
    L += ["", "## Parity (GPU = CPU)", "", "| stage | check | ok | detail |", "| --- | --- | --- | --- |"]
    for r in s["parity"]:
        L.append(f"| {r['stage']} | {r['check']} | {'yes' if r['ok'] else 'NO'} | {str(r['detail'])[:160]} |")
    L += ["", "## Parts", "", *(f"- {p}: {st}" for p, st in s["parts"].items())]
    if s.get("stages"):
        L += ["", "Stages (exit status, seconds):", "", "```", s["stages"], "```"]
    return "\n".join(L) + "\n"


PART_FILES = {
    "warmup": "warmup.json",
    "deseq": "deseq_gpu.json",
    "nmf": "nmf_gpu.json",
    "metacells": "metacells_gpu.json",
    "rsc": "rsc_gpu.json",
    "dask": "dask_gpu.json",
}


def summarise() -> dict:
    parts = {k: load(f) for k, f in PART_FILES.items()}
    parts["cpu_scaling"] = cpu_scaling(OUT)
    cross = crossover(parts)
    s = {
        "kind": "gpu_summary",
        "device": device_line(),
        "smoke": smoke_run(),
        "targets": targets(parts),
        "speedups": speedups(cross),
        "crossover": cross,
        "warmup": parts["warmup"],
        "cpu_scaling": parts["cpu_scaling"],
        "parity": parity(parts),
        "parts": {
            f: ("present" if parts[k] is not None else "missing (failed, timed out or skipped)")
            for k, f in {**PART_FILES, "cpu_scaling": "cpu_<tool>.json"}.items()
        },
        "stages": (OUT / "stage_status.txt").read_text().strip() if (OUT / "stage_status.txt").exists() else "",
    }
    return s


def main() -> int:
    s = summarise()
    md = markdown(s)
    (OUT / "summary.md").write_text(md)
    (OUT / "summary.json").write_text(json.dumps(s, indent=1, default=str))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
