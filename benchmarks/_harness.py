"""The one benchmark harness: gpuc and its peer side by side in one run, cold and warm, with the work counted; and
the GPU scripts' shared part (``GpuScript``, ``gpu_main``: steps, timing, result files; the cold-run stage; smoke mode
on the stand-in GPU), below under "GPU scripts".

A CPU tool script (``bench_nmf.py``, ``bench_metacells.py``, ``bench_deseq.py``) describes its cases as a :class:`Tool`:
``prepare(who, case, n_jobs, threads, tmp)`` loads the data, imports ``who`` and returns the timed call (a call may
return ``{"flops": ..., "bytes": ...}``, the work it did). :func:`main` gives every script the same command line:

* ``python benchmarks/bench_X.py [--cases a,b] [--cores 1] [--repeats 3] ...`` runs each case side by side (below)
  and writes ``results/cpu_X.json`` and ``results/cpu_X.md``;
* ``python benchmarks/bench_X.py one WHO CASE ...`` is the fresh process the driver spawns (prints one JSON line);
* ``--cores 1,4,16 --skip-peers --no-default`` is gpuc's CPU thread scaling (the GPU check's CPU stages), ``--budget``
  starts no process past that many seconds per case, ``--no-fill`` skips the cache-filling processes, ``--smoke``
  runs the tool's tiny smoke case only.

Per case, every configuration runs in **fresh processes** that import the tool and load the data before the clock
starts (only the tool call is timed):

* gpuc at its default threads (``n_jobs=None``) and at ``n_jobs=c`` for each ``c`` of ``--cores``: the first call
  of a process is **cold**, ``--warm-calls`` more calls are **warm**; ``--repeats`` processes each. One untimed
  process of each tool fills the numba on-disk caches first, as a second run after installation finds them
  (``--compile`` times gpuc's on an empty cache instead). The tool function is looked up before the clock (for
  gpuc that imports the tool's module, as ``from cnmf import cNMF`` does for the peer);
* the peer at its own defaults, and pinned to ``c`` threads (BLAS, OpenMP, numba through the environment; the tool
  may pass ``c`` on as well, e.g. PyDESeq2's ``n_cpus``); ``--peer-repeats`` processes of one cold and
  ``--peer-warm-calls`` warm calls;
* the processes run in rounds (gpuc default, peer default, gpuc at c threads, peer at c threads, ...) so that both
  tools meet the same load on a shared machine; the load average (``os.getloadavg``) before and after each case;
  medians everywhere.

The headline ratio is peer cold / gpuc cold at default threads. The work of gpuc's call (FLOPs and bytes that must
cross memory, as the tool counts them) is set against this machine's limits, measured in the same run: a float64
GEMM (FLOP/s) and a STREAM-like triad (bytes/s) on all available cores; "x from limit" is the warm time divided by
the larger of flops / peak FLOP/s and bytes / peak bytes/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# Smoke mode (``--smoke`` on a script's command line, or GPUC_SMOKE=1): the GPU scripts run end to end on tiny data on
# gpuc's stand-in GPU (gpuc._testing.standin). Its custom kernels would run under numba-cuda's CUDA simulator, one
# Python thread per CUDA thread (a minute for one small DESeq2 fit); without it the tools take their batched array
# path, which is what a smoke run needs to exercise the scripts. GPUC_SMOKE_KERNELS=1 switches the simulator on,
# which must happen before numba is imported, hence here, at the top of the module every script imports first.
SMOKE = os.environ.get("GPUC_SMOKE") == "1" or "--smoke" in sys.argv
if SMOKE:
    os.environ["GPUC_SMOKE"] = "1"  # the fresh processes a script spawns inherit it
    if os.environ.get("GPUC_SMOKE_KERNELS") == "1":
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
VERSIONS = ("gpuc", "numpy", "scipy", "numba", "anndata", "scanpy", "cnmf", "seacells", "pydeseq2")


# ---------------------------------------------------------------------------------------------- machine and load
def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cores() -> int:
    """CPU cores this process may run on (its affinity)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def memory_gb() -> float | None:
    """Total memory in GB (from /proc/meminfo), None where unknown."""
    try:
        with open("/proc/meminfo") as fh:
            return round(int(next(line.split()[1] for line in fh if line.startswith("MemTotal"))) / 1024**2, 1)
    except (OSError, StopIteration):
        return None


def versions(names: tuple[str, ...] = VERSIONS) -> dict[str, str]:
    """Installed versions of ``names`` (those not installed are left out)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def commit() -> str | None:
    """The git commit of the checkout, None outside one."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


def machine() -> dict:
    """What a table needs to say about the machine it was measured on."""
    return {
        "cpu": cpu_name(),
        "cores": cores(),
        "memory_gb": memory_gb(),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "commit": commit(),
        "versions": versions(),
    }


def loadavg() -> list[float]:
    """The 1, 5 and 15-minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def hardware_limits(seconds: float = 1.0) -> dict:
    """Measured peaks of this machine on all available cores: float64 GEMM GFLOP/s and triad GB/s (best of repeats)."""
    import numpy as np

    gen = np.random.default_rng(0)
    a, b = gen.random(10_000_000), gen.random(10_000_000)
    c = np.empty_like(a)

    def triad() -> None:
        np.multiply(b, 1.5, out=c)
        np.add(a, c, out=c)

    g = gen.random((1500, 1500))
    # the best of at least 3 timed calls (after an untimed one: first touch of the pages, BLAS start-up) and as many
    # more as fit in half of ``seconds``: on a shared machine the best is the closest to what the hardware allows
    best = []
    for fn in (triad, lambda: g @ g):
        fn()
        times = []
        t_end = time.perf_counter() + seconds / 2
        while len(times) < 3 or time.perf_counter() < t_end:
            times += time_calls(fn, 1)[0]
        best.append(min(times))
    # the triad's two passes move 5 arrays (read b, write c, read a, read c, write c)
    best_bw, best_gemm = 5 * a.nbytes / best[0], 2 * 1500**3 / best[1]
    return {"gemm_gflops": round(best_gemm / 1e9, 2), "triad_gbps": round(best_bw / 1e9, 2)}


# ---------------------------------------------------------------------------------------------- timing
def median(xs: list[float]) -> float:
    """Median, NaN for no values."""
    return statistics.median(xs) if xs else float("nan")


def time_calls(call: Callable[[], object], n: int, sync: Callable[[], object] | None = None) -> tuple[list, object]:
    """Seconds of ``n`` calls of ``call`` (``sync()`` after each, e.g. a device synchronise) and the last result."""
    times, res = [], None
    for _ in range(n):
        t = time.perf_counter()
        res = call()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - t)
    return times, res


def thread_env(threads: int | None) -> dict[str, str]:
    """This process's environment with BLAS/OpenMP/numba pinned to ``threads`` (unchanged for None)."""
    env = dict(os.environ)
    # a user's Python caches bytecode; some CI images switch that off, which would recompile every module imported
    # during the call in every process
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if threads is not None:
        env.update(dict.fromkeys(THREAD_VARS, str(threads)))
    return env


# ---------------------------------------------------------------------------------------------- a tool's cases
@dataclass
class Tool:
    """One tool's benchmark: its name, peer, cases and the function that prepares a timed call.

    ``prepare(who, case, n_jobs, threads, tmp)`` returns the call; ``who`` is ``"gpuc"`` or ``peer``. ``targets``
    maps a case to the ratios it must reach (``{"cold": 4, "warm": 10}``: peer / gpuc at default threads).
    ``extra(case, tmp)`` may time further references in this process (R) and return ``{name: seconds}``.
    ``peer_fill``: run one untimed peer process first (to fill its dependencies' numba caches).
    """

    name: str
    peer: str
    cases: dict[str, str]
    prepare: Callable[..., Callable[[], object]]
    default_cases: tuple[str, ...] = ()
    targets: dict[str, dict[str, float]] = field(default_factory=dict)
    extra: Callable[[str, str], dict[str, float]] | None = None
    peer_fill: bool = True
    smoke_case: str | None = None  # the tiny case ``--smoke`` runs (gpuc only, one core count)


def one(tool: Tool, who: str, case: str, n_jobs: int | None, threads: int | None, warm_calls: int) -> dict:
    """In this (fresh) process: the first call and ``warm_calls`` more calls of ``who`` on ``case``, and the work."""
    with tempfile.TemporaryDirectory() as tmp:
        call = tool.prepare(who, case, n_jobs, threads, tmp)
        cpu: list[float] = []  # process CPU seconds (user + system, all threads) of each call

        def timed() -> object:
            c = time.process_time()
            r = call()
            cpu.append(time.process_time() - c)
            return r

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            times, res = time_calls(timed, 1 + warm_calls)
    out = {"who": who, "case": case, "first": times[0], "warm": times[1:], "first_cpu": cpu[0], "warm_cpu": cpu[1:]}
    if isinstance(res, dict):
        out["work"] = res
    return out


def spawn(script: str, who: str, case: str, *, n_jobs: int | None = None, threads: int | None = None,
          warm_calls: int = 0, timeout: float = 3600, env: dict | None = None) -> dict:  # fmt: skip
    """Run ``script one who case`` in a fresh interpreter; its JSON line, or ``{"error": ...}``."""
    cmd = [sys.executable, script, "one", who, case, "--warm-calls", str(warm_calls)]
    cmd += ["--n-jobs", str(n_jobs)] if n_jobs is not None else []
    cmd += ["--threads", str(threads)] if threads is not None else []
    try:
        out = subprocess.run(cmd, env=env or thread_env(threads), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"who": who, "case": case, "error": f"timed out after {timeout} s"}
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-3000:])
        return {"who": who, "case": case, "error": out.stderr[-500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _configs(row: dict, runs: dict[tuple[str, str], list[dict]], skip_peers: bool) -> None:
    """The medians of every configuration's processes so far, into ``row``."""
    row["gpuc"] = {cfg: _config(r) for (who, cfg), r in runs.items() if who == "gpuc"}
    if not skip_peers:
        row["peer"] = {cfg: _config(r) for (who, cfg), r in runs.items() if who != "gpuc"}


def _config(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    res = {
        "cold_s": median([r["first"] for r in ok]),
        "warm_s": median([t for r in ok for t in r["warm"]]),
        "cold_all": [r["first"] for r in ok],
        "warm_all": [t for r in ok for t in r["warm"]],
        "cold_cpu_s": median([r["first_cpu"] for r in ok if "first_cpu" in r]),
        "warm_cpu_s": median([t for r in ok for t in r.get("warm_cpu", [])]),
    }
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        res["errors"] = errors
    work = [r["work"] for r in ok if "work" in r]
    if work:
        res["work"] = work[-1]
    return res


def side_by_side(tool: Tool, script: str, case: str, args: argparse.Namespace,
                 progress: Callable[[dict], None] | None = None) -> dict:  # fmt: skip
    """Every configuration of one case (see the module's docstring); one result row. ``progress(row)`` is called
    with the row so far after every process (a run cut off by a time limit keeps what it measured)."""
    cores_ = core_counts(args.cores)
    row: dict = {"case": case, "about": tool.cases.get(case, case), "load_before": loadavg()}
    t_start = time.perf_counter()
    if args.no_fill:  # the caches are filled already (gpu_check.sh's cold stage)
        pass
    elif args.compile:
        with tempfile.TemporaryDirectory() as cache:
            env = thread_env(None) | {"NUMBA_CACHE_DIR": cache}
            row["compile_s"] = spawn(script, "gpuc", case, env=env, timeout=args.timeout).get("first")
    else:  # untimed: fills numba's cache (a fresh install compiles the kernels once)
        spawn(script, "gpuc", case, timeout=args.timeout)
    if not args.skip_peers and tool.peer_fill:  # untimed likewise: the peer's dependencies' numba caches
        spawn(script, tool.peer, case, timeout=args.timeout)
    # the configurations' processes in rounds (gpuc default, peer default, gpuc c, peer c, ...), so that gpuc and the
    # peer meet the same load on a shared machine; a configuration with fewer repeats drops out of the later rounds
    jobs = []
    if not args.no_default:
        jobs.append(("gpuc", "default", {"n_jobs": None, "warm_calls": args.warm_calls}, args.repeats))
        if not args.skip_peers:
            peer = {"threads": None, "warm_calls": args.peer_warm_calls}
            jobs.append((tool.peer, "default", peer, args.peer_repeats))
    for c in cores_:
        jobs.append(("gpuc", str(c), {"n_jobs": c, "warm_calls": args.warm_calls}, args.repeats))
        if not args.skip_peers:
            jobs.append((tool.peer, str(c), {"threads": c, "warm_calls": args.peer_warm_calls}, args.peer_repeats))
    runs: dict[tuple[str, str], list[dict]] = {(who, cfg): [] for who, cfg, _, _ in jobs}
    skipped = []
    for i in range(max(n for *_, n in jobs)):
        for who, cfg, kw, n in jobs:
            if i >= n:
                continue
            if args.budget and time.perf_counter() - t_start > args.budget:  # --budget: no process starts past it
                skipped.append(f"{who} {cfg} #{i + 1}")
                continue
            runs[who, cfg].append(spawn(script, who, case, timeout=args.timeout, **kw))
            _configs(row, runs, args.skip_peers)
            if progress is not None:
                progress(row | {"load_after": loadavg(), "partial": True})
    if skipped:
        row["budget_skipped"] = skipped
    _configs(row, runs, args.skip_peers)
    if not args.skip_peers and tool.extra is not None:
        with tempfile.TemporaryDirectory() as tmp:
            row["extra"] = tool.extra(case, tmp)
    row["load_after"] = loadavg()
    if case in tool.targets:
        row["targets"] = tool.targets[case]
    print(json.dumps(row), flush=True)
    return row


def core_counts(spec: str, available: int | None = None) -> list[int]:
    """The core counts of ``--cores`` that this machine has (those above its available cores are dropped)."""
    available = available or cores()
    wanted = [int(c) for c in spec.split(",") if c]
    dropped = [c for c in wanted if c > available]
    if dropped:
        print(f"--cores {dropped}: more than the {available} cores available, left out", file=sys.stderr)
    return [c for c in wanted if c <= available]


def result_path(tool: Tool, out: str | Path | None = None) -> Path:
    """Where a tool's result JSON goes."""
    return Path(out or RESULTS) / f"cpu_{tool.name}.json"


def write_result(path: Path, payload: dict) -> None:
    """The result JSON and, beside it, its markdown (:func:`render`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=float) + "\n")
    path.with_suffix(".md").write_text(render(payload))


def main(tool: Tool, script: str, argv: list[str] | None = None) -> dict | None:
    """The command line every tool script shares (see the module's docstring)."""
    ap = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("mode", nargs="?", default="all", choices=["all", "one"])
    ap.add_argument("who", nargs="?", help=f"one: gpuc or {tool.peer}")
    ap.add_argument("case", nargs="?", help=f"one: the case ({', '.join(tool.cases)})")
    ap.add_argument("--cases", default=",".join(tool.default_cases or tool.cases))
    ap.add_argument("--cores", default="1", help="equal core counts: gpuc n_jobs=c and the peer pinned to c threads")
    ap.add_argument("--repeats", type=int, default=3, help="fresh gpuc processes per configuration")
    ap.add_argument("--warm-calls", type=int, default=2, help="calls after the first in each gpuc process")
    ap.add_argument("--peer-repeats", type=int, default=1, help="fresh peer processes per configuration")
    ap.add_argument("--peer-warm-calls", type=int, default=1, help="peer calls after the first in each process")
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--compile", action="store_true", help="time the numba-compiling first process (empty cache)")
    ap.add_argument("--n-jobs", type=int, default=None, help="one: gpuc's n_jobs (default None)")
    ap.add_argument("--threads", type=int, default=None, help="one: the peer's pinned threads (default: its own)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per process")
    ap.add_argument("--out", default=str(RESULTS), help="folder of the result files")
    ap.add_argument("--no-fill", action="store_true", help="no untimed cache-filling processes (caches are full)")
    ap.add_argument("--budget", type=float, default=0, help="seconds per case: no process starts after it")
    ap.add_argument("--no-default", action="store_true", help="only the --cores counts, not the default threads")
    ap.add_argument("--smoke", action="store_true", help="the tiny smoke case, gpuc only, 1 repeat (GPUC_SMOKE=1)")
    args = ap.parse_args(argv)
    if SMOKE and args.mode == "all":
        args.cases, args.skip_peers, args.repeats, args.warm_calls = tool.smoke_case or args.cases, True, 1, 1
    if args.mode == "one":
        print(json.dumps(one(tool, args.who, args.case, args.n_jobs, args.threads, args.warm_calls)), flush=True)
        return None
    payload = {
        "kind": "side_by_side",
        "tool": tool.name,
        "peer": tool.peer,
        "command": "python benchmarks/" + " ".join([Path(script).name, *(sys.argv[1:] if argv is None else argv)]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "hardware": hardware_limits(0.2 if SMOKE else 1.0),
        "cores": core_counts(args.cores),
        "smoke": SMOKE,
        "rows": [],
    }
    path = result_path(tool, args.out)
    for case in args.cases.split(","):
        done = list(payload["rows"])
        # after every process and every case, so that a long run cut off keeps what it has
        row = side_by_side(
            tool, script, case, args, lambda r, done=done: write_result(path, payload | {"rows": [*done, r]})
        )
        payload["rows"].append(row)
        write_result(path, payload)
    print(render(payload))
    return payload


# ---------------------------------------------------------------------------------------------- tables
def md_table(head: list[str], rows: list[list[object]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def fmt_s(v: float | None) -> str:
    """Seconds, 3 significant digits; '-' for none."""
    if v is None or v != v:
        return "-"
    return f"{v:.3g}" if v < 100 else f"{v:.0f}"


def fmt_x(num: float | None, den: float | None, target: float | None = None) -> str:
    """The ratio num / den as '12.3x', with '(>= T: met/missed)' when a target is given."""
    if num is None or den is None or num != num or den != den or den == 0:
        return "-"
    r = num / den
    s = f"{r:.1f}x"
    if target is not None:
        s += f" ({'met' if r >= target else 'missed'}: >= {target:g}x)"
    return s


def machine_line(m: dict) -> str:
    """One sentence on the machine and versions."""
    v = ", ".join(f"{k} {x}" for k, x in m.get("versions", {}).items())
    mem = f", {m['memory_gb']} GB" if m.get("memory_gb") else ""
    return f"{m.get('cpu')}, {m.get('cores')} cores available{mem}, Python {m.get('python')}; {v}"


def _from_limit(cfg: dict, hw: dict) -> tuple[str, str]:
    """(work, 'x from limit') of gpuc's warm call."""
    work = cfg.get("work") or {}
    flops, nbytes = work.get("flops"), work.get("bytes")
    if not flops and not nbytes:
        return "-", "-"
    floor = max((flops or 0) / (hw["gemm_gflops"] * 1e9), (nbytes or 0) / (hw["triad_gbps"] * 1e9))
    text = f"{(flops or 0) / 1e9:.3g} GFLOP, {(nbytes or 0) / 1e9:.3g} GB"
    return text, (f"{cfg['warm_s'] / floor:.0f}x" if floor > 0 else "-")


def render(res: dict) -> str:
    """The markdown of one side-by-side result: the headline table, the equal-core table and the work."""
    nan = float("nan")
    hw = res.get("hardware", {})
    command = re.sub(r" --out[ =]\S+", "", res["command"])  # where the files went does not reproduce them
    lines = [
        f"Machine: {machine_line(res['machine'])}. Measured {res.get('date', '')}, commit {res['machine'].get('commit')}.",
        "",
        f"Command: `{command}`. Cold: the first call in a fresh process (after import and data loading); warm:",
        f"later calls in the same process (medians). Peer ({res['peer']}): its own defaults, or pinned to c threads.",
        "Ratios: peer time / gpuc time. Load: 1-minute load average before / after the case.",
        "",
    ]
    head = ["case", "load", "gpuc cold s", "gpuc warm s", "peer cold s", "peer warm s"]
    head += ["**peer / gpuc cold**", "peer / gpuc warm"]
    extra_names = sorted({k for r in res["rows"] for k in r.get("extra", {})})
    head += [f"{n} s" for n in extra_names] + [f"{n} / gpuc cold" for n in extra_names]
    rows = []
    none = {"cold_s": nan, "warm_s": nan}
    for r in res["rows"]:
        g, p = r["gpuc"].get("default", none), r.get("peer", {}).get("default", {})
        t = r.get("targets", {})
        cells = [
            f"{r['case']}: {r['about']}",
            f"{r['load_before'][0]:.2f} / {r['load_after'][0]:.2f}",
            fmt_s(g["cold_s"]),
            fmt_s(g["warm_s"]),
            fmt_s(p.get("cold_s", nan)),
            fmt_s(p.get("warm_s", nan)),
            f"**{fmt_x(p.get('cold_s'), g['cold_s'], t.get('cold'))}**",
            fmt_x(p.get("warm_s"), g["warm_s"], t.get("warm")),
        ]
        cells += [fmt_s(r.get("extra", {}).get(n)) for n in extra_names]
        cells += [fmt_x(r.get("extra", {}).get(n), g["cold_s"]) for n in extra_names]
        rows.append(cells)
    lines.append(f"At default threads (gpuc `n_jobs=None`, the peer's own defaults):\n\n{md_table(head, rows)}")
    cores_ = res.get("cores", [])
    if cores_:
        head = ["case"]
        for c in cores_:
            head += [
                f"gpuc cold {c}t s",
                f"gpuc warm {c}t s",
                f"peer cold {c}t s",
                f"peer warm {c}t s",
                f"ratio cold {c}t",
            ]
        rows = []
        for r in res["rows"]:
            cells = [r["case"]]
            for c in cores_:
                g, p = r["gpuc"].get(str(c), {}), r.get("peer", {}).get(str(c), {})
                cells += [
                    fmt_s(g.get("cold_s")),
                    fmt_s(g.get("warm_s")),
                    fmt_s(p.get("cold_s")),
                    fmt_s(p.get("warm_s")),
                ]
                cells.append(fmt_x(p.get("cold_s"), g.get("cold_s")))
            rows.append(cells)
        lines.append(
            f"At an equal core count (gpuc `n_jobs=c`, the peer pinned to c threads):\n\n{md_table(head, rows)}"
        )
    if hw:
        rows = [[r["case"], *_from_limit(r["gpuc"].get("default", none), hw),
                 fmt_s(r["gpuc"].get("default", none)["warm_s"])] for r in res["rows"]]  # fmt: skip
        lines.append(
            f"Work of gpuc's call against this machine's limits, measured in the same run ({hw['gemm_gflops']:.3g} "
            f"GFLOP/s float64 GEMM, {hw['triad_gbps']:.3g} GB/s triad, all cores); 'x from limit' = warm time / "
            f"max(FLOPs / GEMM rate, bytes / triad rate):\n\n"
            + md_table(["case", "work (counted)", "x from limit", "gpuc warm s"], rows)
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- GPU scripts
# A GPU script (gpu_deseq.py, gpu_nmf.py, gpu_metacells.py, gpu_rsc.py, gpu_dask.py) describes itself as a
# :class:`GpuScript`: its steps (each fills the shared report), how the report renders and when it passes, and, for
# the cold-run mode, the calls that fill the kernel caches and the calls a fresh process times. :func:`gpu_main`
# gives every script the same command line:
#
# * ``python benchmarks/gpu_X.py [--smoke] [options]`` runs the steps, writing ``$OUT/<name>.json`` and ``.md``
#   after each (a stage cut off by its time limit keeps what it has); exit status 1 on an error or a failed check;
# * ``python benchmarks/gpu_X.py fill DEVICE FILE`` / ``measure FILE``: the fresh processes of the cold-run mode,
#   which ``python benchmarks/_harness.py cold`` drives for every tool (see :func:`cold_stage`).
def out_dir() -> Path:
    """Where the GPU scripts write: ``$OUT`` (gpu_check.sh sets it), else ``gpu_results/`` in the checkout."""
    out = Path(os.environ.get("OUT", ROOT / "gpu_results"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def log(*a: object) -> None:
    """Print and flush (a stage's log is read while it runs)."""
    print(*a, flush=True)


def device_context() -> contextlib.AbstractContextManager:
    """The stand-in GPU in smoke mode (``device="gpu"`` resolves to it), else nothing."""
    if SMOKE:
        from gpuc._testing.standin import use_standin

        return use_standin()
    return contextlib.nullcontext()


def device_info(standin: bool = True) -> dict:
    """The GPU's name and CuPy's version (the stand-in in smoke mode; the error where no GPU is usable)."""
    if SMOKE and not standin:
        return {"device": "CPU (smoke mode)", "cupy": "none"}
    if SMOKE:
        return {"device": "stand-in GPU (gpuc._testing.standin, smoke mode)", "cupy": "none"}
    try:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return {"device": name, "cupy": cupy.__version__}
    except Exception as err:  # reported in the result: the script's steps then fail and say why
        return {"device": f"no usable GPU: {type(err).__name__}: {err}"[:300], "cupy": None}


def sync(dev: str = "gpu") -> None:
    """Wait for the device (nothing for the CPU)."""
    if dev != "cpu":
        from gpuc._backend import get_backend

        get_backend("gpu").synchronize()


def timed(fn: Callable[..., object], repeats: int = 3, dev: str = "gpu", long_s: float = float("inf"),
          setup: Callable[[], object] | None = None) -> dict:  # fmt: skip
    """``repeats`` calls of ``fn`` (the device synchronised around each): ``{"s": median, "all": [...], "out": last}``.
    With ``setup``, each call is ``fn(setup())``, ``setup`` outside the clock (e.g. a copy of the input). In smoke
    mode at most 2 calls.

    A first call longer than ``long_s`` is not repeated (a stage has a time limit; such a time is far from any target).
    """
    times: list[float] = []
    out = None
    for _ in range(min(repeats, 2) if SMOKE else repeats):
        if times and times[0] > long_s:
            break
        args = () if setup is None else (setup(),)
        sync(dev)
        t = time.perf_counter()
        out = fn(*args)
        sync(dev)
        times.append(time.perf_counter() - t)
    return {"s": median(times), "all": times, "out": out}


def rel_diff(a: object, b: object) -> float:
    """The largest relative difference of ``a`` from ``b`` where ``b`` is finite and non-zero; inf when the NaN
    patterns differ."""
    import numpy as np

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if not np.array_equal(np.isnan(a), np.isnan(b)):
        return float("inf")
    ok = np.isfinite(b) & (np.abs(b) > 1e-300)
    return float(np.max(np.abs(a[ok] - b[ok]) / np.abs(b[ok]))) if ok.any() else 0.0


def write_gpu_result(path: Path, report: dict, render: Callable[[dict], str]) -> None:
    """A GPU script's result JSON and, beside it, its markdown."""
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    path.with_suffix(".md").write_text(render(report))


@dataclass
class GpuScript:
    """One GPU script: ``name`` (its result file stem, e.g. ``deseq_gpu``), ``steps(report, args)`` in order,
    ``render(report)`` (markdown), ``ok(report)`` (the checks passed), ``options(parser)`` (its own options).

    Cold-run mode: ``fill(dev, call)`` makes every call the later stages make, on tiny data, through
    ``call(name, fn)`` (so that a fresh machine compiles its kernels once, into the on-disk caches); ``cold()``
    returns ``[(name, size, prepare)]``, where ``prepare()`` builds the data and returns the call a fresh process
    times (first call against warm calls).
    """

    name: str
    steps: list[Callable[[dict, argparse.Namespace], None]]
    render: Callable[[dict], str]
    ok: Callable[[dict], bool] = lambda report: True
    options: Callable[[argparse.ArgumentParser], None] | None = None
    fill: Callable[[str, Callable[[str, Callable[[], object]], None]], None] | None = None
    cold: Callable[[], list[tuple[str, str, Callable[[], Callable[[], object]]]]] | None = None
    standin: bool = True  # smoke mode: run the steps on the stand-in GPU


def gpu_main(script: GpuScript, file: str, argv: list[str] | None = None) -> int:
    """The command line every GPU script shares (see above)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fill"]:
        return cold_fill(script, argv[1], Path(argv[2]))
    if argv[:1] == ["measure"]:
        return cold_measure(script, Path(argv[1]))
    ap = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="tiny data on the stand-in GPU (also GPUC_SMOKE=1)")
    if script.options is not None:
        script.options(ap)
    args = ap.parse_args(argv)
    report: dict = {
        "kind": "gpu",
        "script": Path(file).name,
        **device_info(script.standin),
        "smoke": SMOKE,
        "command": " ".join(["python benchmarks/" + Path(file).name, *argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "errors": [],
        "step_seconds": {},
    }
    path = out_dir() / f"{script.name}.json"
    write_gpu_result(path, report, script.render)  # a stage cut off before its first step still leaves its file
    import gpuc

    gpuc.settings.progress = False
    with device_context() if script.standin else contextlib.nullcontext():
        for step in script.steps:
            t0 = time.perf_counter()
            try:
                step(report, args)
            except Exception as err:  # recorded; the next step still runs
                report["errors"].append(f"{step.__name__}: {type(err).__name__}: {err}"[:500])
                traceback.print_exc()
            report["step_seconds"][step.__name__] = round(time.perf_counter() - t0, 3)
            write_gpu_result(path, report, script.render)
    log(script.render(report))
    return 0 if not report["errors"] and script.ok(report) else 1


# ---- the cold-run mode: fill the kernel caches, then time a fresh process's first call against its warm calls
# A fresh device machine has no compiled kernels: CuPy compiles every elementwise/reduction kernel (NVRTC) on first
# use, numba-cuda every ``@cuda.jit`` kernel, numba every CPU kernel. ``cold_stage`` runs every tool's ``fill`` on
# the GPU and on the CPU, each (tool, device) in its own process, all at once (compilation is single-threaded per
# process), so that CuPy's on-disk cache (CUPY_CACHE_DIR) and numba's (NUMBA_CACHE_DIR, which numba-cuda's
# cache=True kernels use too) hold every kernel; then, per tool, a fresh process times each ``cold`` case's first
# call (which should load its kernels from the caches) and two warm calls, and counts the cache files the first call
# added. The target: the first call within 1 s of the warm call. Imports and the CUDA context (a first CuPy
# operation) are timed apart, not charged to a tool.
COLD_TOOLS = ("deseq", "nmf", "metacells")
COLD_TARGET_S = 1.0
CACHE_ROOT = HERE / "_work" / "gpu_cache"  # benchmarks/_work/ is git-ignored


def cache_census() -> dict[str, int]:
    """Files in the two kernel caches: CuPy's (one per compiled kernel) and numba's ``.nbc`` (one per overload)."""
    out = {}
    for name, var, pattern in (("cupy", "CUPY_CACHE_DIR", "*"), ("numba", "NUMBA_CACHE_DIR", "*.nbc")):
        d = Path(os.environ.get(var, CACHE_ROOT / name))
        out[name] = sum(1 for p in d.rglob(pattern) if p.is_file()) if d.is_dir() else 0
    return out


def cold_fill(script: GpuScript, dev: str, out: Path) -> int:
    """One fill process: ``script.fill`` on ``dev``; each call's seconds (or its error) go to the JSON file ``out``."""
    import gpuc

    gpuc.settings.progress = False
    calls: dict = {}

    def call(name: str, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fn()
            sync(dev)
            calls[name] = round(time.perf_counter() - t0, 3)
        except Exception as err:  # recorded; the fill goes on
            calls[name] = f"error after {time.perf_counter() - t0:.1f} s: {type(err).__name__}: {err}"[:300]
            traceback.print_exc()
        log(f"  {name}: {calls[name]}")
        out.write_text(json.dumps(calls))

    t0 = time.perf_counter()
    with device_context():
        try:
            script.fill(dev, call)
        except Exception as err:  # outside a recorded call (data, device set-up)
            calls["set-up"] = f"error: {type(err).__name__}: {err}"[:300]
            traceback.print_exc()
    out.write_text(json.dumps({"seconds": round(time.perf_counter() - t0, 2), "calls": calls}))
    return 0


def cold_measure(script: GpuScript, out: Path, t_start: float | None = None) -> int:
    """The measuring process: each ``script.cold`` case's first call and two warm calls, and what the first compiled."""
    import anndata  # noqa: F401

    import gpuc

    # imports (from this module's, the script's first): not charged to a tool
    res: dict = {"import_s": round(time.perf_counter() - (t_start or _T_IMPORT), 3), "tools": {}}
    gpuc.settings.progress = False
    with device_context():
        t0 = time.perf_counter()
        if not SMOKE:
            import cupy

            cupy.zeros(1).sum().item()  # the CUDA context; cuBLAS, cuSPARSE... are created by the tools themselves
        res["cuda_context_s"] = round(time.perf_counter() - t0, 3)
        for name, size, prepare in script.cold():
            r: dict = {"size": size}
            res["tools"][name] = r
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    t0 = time.perf_counter()
                    call = prepare()
                    r["prepare_s"] = round(time.perf_counter() - t0, 3)
                    before = cache_census()
                    first = timed(call, 1)
                    after = cache_census()
                    warm = timed(call, 2)
                r["first_s"], r["warm_all_s"], r["warm_s"] = first["s"], warm["all"], warm["s"]
                r["compiled_during_first"] = {k: after[k] - before[k] for k in after}
                r["first_minus_warm_s"] = r["first_s"] - r["warm_s"]
                r["within_1s"] = r["first_minus_warm_s"] <= COLD_TARGET_S
            except Exception as err:
                r["error"] = f"{type(err).__name__}: {err}"[:300]
                traceback.print_exc()
            log(name, r)
            out.write_text(json.dumps(res))
    out.write_text(json.dumps(res))
    return 0


_T_IMPORT = time.perf_counter()  # a measuring process's clock starts at this module's import (its first import)


def _wait(p: subprocess.Popen, deadline: float) -> int | str:
    try:
        return p.wait(timeout=max(1.0, deadline - time.perf_counter()))
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return "timed out"


def _limit(var: str, share: float, default: float) -> float:
    """Seconds for one phase: ``var`` when set, else ``share`` of the stage's limit (``GPUC_STAGE_SECONDS``, which
    gpu_check.sh sets), else ``default``."""
    if os.environ.get(var):
        return float(os.environ[var])
    if os.environ.get("GPUC_STAGE_SECONDS"):
        return share * float(os.environ["GPUC_STAGE_SECONDS"])
    return default


def render_cold(rep: dict) -> str:
    """The markdown of the cold stage's ``warmup.json``."""
    fill = rep.get("fill", {})
    fill_rows = [
        [task, t.get("seconds", ""), t.get("rc", ""),
         "; ".join(f"{k}: {v}" for k, v in t.get("calls", {}).items() if isinstance(v, str))[:300]]
        for task, t in fill.get("tasks", {}).items()
    ]  # fmt: skip
    lines = [
        f"Kernel caches and a fresh process's first call ({rep.get('device', '?')}).",
        "",
        f"Fill ({fill.get('mode', '?')}): {fill.get('seconds', float('nan')):.1f} s; caches after it: "
        f"{rep.get('caches_after_fill')}; after the measuring processes: {rep.get('caches_after_measure')}.",
        "",
        md_table(["fill task", "seconds", "exit", "errors"], fill_rows),
    ]
    m = rep.get("measure", {})
    procs = "; ".join(
        f"{t}: imports {p.get('import_s', '?')} s, CUDA context {p.get('cuda_context_s', '?')} s, exit {p.get('rc')}"
        for t, p in m.get("processes", {}).items()
    )
    lines += [f"Measuring processes (one per tool; imports and CUDA context not charged to a tool): {procs}. Target: "
              f"first call within {COLD_TARGET_S:.0f} s of the warm call.", ""]  # fmt: skip
    rows = []
    for name, r in m.get("tools", {}).items():
        if "warm_s" not in r:
            rows.append([name, r.get("size", ""), "", "", "", "", f"error: {r.get('error', 'did not finish')}"])
            continue
        rows.append([name, r["size"], f"{r['first_s']:.3f}", f"{r['warm_s']:.3f}", f"{r['first_minus_warm_s']:+.3f}",
                     "yes" if r["within_1s"] else "NO", r["compiled_during_first"]])  # fmt: skip
    head = ["tool", "size", "first call s", "warm s", "first - warm s", "within 1 s", "compiled during the first call"]
    lines += [md_table(head, rows), f"all within 1 s: {rep.get('all_within_1s')}"]
    return "\n".join(lines) + "\n"


def cold_stage(tools: tuple[str, ...] = COLD_TOOLS) -> int:
    """The cold-run stage (see above): fill every tool's kernels on both devices at once, then one fresh measuring
    process per tool. Writes ``$OUT/warmup.json`` and ``.md``. Limits: ``GPUC_WARMUP_FILL_SECONDS`` (default 62% of
    ``GPUC_STAGE_SECONDS``, else 90) and ``GPUC_WARMUP_MEASURE_SECONDS`` (all measuring processes; 30%, else 60)."""
    out = out_dir()
    for var, sub in (("CUPY_CACHE_DIR", "cupy"), ("NUMBA_CACHE_DIR", "numba")):
        os.environ.setdefault(var, str(CACHE_ROOT / sub))
        Path(os.environ[var]).mkdir(parents=True, exist_ok=True)
    rep: dict = {"kind": "gpu_cold", **device_info(), "smoke": SMOKE, "caches_before": cache_census(),
                 "cache_dirs": {v: os.environ[v] for v in ("CUPY_CACHE_DIR", "NUMBA_CACHE_DIR")},
                 "target": f"a second process's first call within {COLD_TARGET_S:.0f} s of its warm call"}  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="gpuc_cold_"))
    devices = ("gpu",) if SMOKE else ("gpu", "cpu")  # the stand-in's CPU kernels are the CPU's: filled once
    t0 = time.perf_counter()
    deadline = t0 + _limit("GPUC_WARMUP_FILL_SECONDS", 0.62, 90.0)
    procs = []
    for tool in tools:
        for dev in devices:
            task = f"{tool}:{dev}"
            fh = open(tmp / f"{tool}_{dev}.log", "w")  # closed once the process ends
            cmd = [sys.executable, str(HERE / f"gpu_{tool}.py"), "fill", dev, str(tmp / f"{tool}_{dev}.json")]
            procs.append((task, subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT), fh))
    tasks: dict = {}
    for task, p, fh in procs:
        rc = _wait(p, deadline)
        fh.close()
        stem = tmp / task.replace(":", "_")
        got = json.loads(stem.with_suffix(".json").read_text()) if stem.with_suffix(".json").exists() else {}
        tasks[task] = {"calls": got} if "calls" not in got else got
        tasks[task]["rc"] = rc
        log(f"--- fill {task} (exit {rc})\n{stem.with_suffix('.log').read_text()[-3000:]}")
    rep["fill"] = {"mode": "one process per tool and device, concurrently", "seconds": time.perf_counter() - t0,
                   "tasks": tasks}  # fmt: skip
    rep["caches_after_fill"] = cache_census()
    write_gpu_result(out / "warmup.json", rep, render_cold)

    deadline = time.perf_counter() + _limit("GPUC_WARMUP_MEASURE_SECONDS", 0.3, 60.0)
    m: dict = {"processes": {}, "tools": {}}
    rc_all = 0
    for tool in tools:
        f, lg = tmp / f"measure_{tool}.json", tmp / f"measure_{tool}.log"
        t1 = time.perf_counter()
        with open(lg, "w") as fh:
            p = subprocess.Popen([sys.executable, str(HERE / f"gpu_{tool}.py"), "measure", str(f)],
                                 stdout=fh, stderr=subprocess.STDOUT)  # fmt: skip
            rc = _wait(p, deadline)
        got = json.loads(f.read_text()) if f.exists() else {"tools": {}}
        m["tools"].update(got.pop("tools"))
        m["processes"][tool] = {**got, "rc": rc, "seconds": round(time.perf_counter() - t1, 2)}
        rc_all = rc_all or (rc != 0)
        log(f"--- measure {tool} (exit {rc})\n{lg.read_text()[-3000:]}")
    rep["measure"] = m
    rep["caches_after_measure"] = cache_census()
    done = [r for r in m["tools"].values() if "within_1s" in r]
    rep["all_within_1s"] = bool(done) and len(done) == len(m["tools"]) and all(r["within_1s"] for r in done)
    write_gpu_result(out / "warmup.json", rep, render_cold)
    log(render_cold(rep))
    fill_ok = all(t["rc"] == 0 and not any(isinstance(v, str) for v in t["calls"].values()) for t in tasks.values())
    return 0 if fill_ok and not rc_all else 1


GPU_SCRIPTS = ("deseq", "nmf", "metacells", "rsc", "dask")


def smoke_all(scripts: tuple[str, ...] = GPU_SCRIPTS) -> int:
    """Every GPU script's smoke mode in this one process (imports paid once), then each tool's cold-run measurement
    (in this process, not a fresh one: it exercises the code; the fill is left out) and the run's summary
    (``gpu_summary.py``), all under ``$OUT``. Exit status 1 when a script fails. ``GPUC_SMOKE=1 bash
    benchmarks/gpu_check.sh`` runs the whole check instead, stage by stage in fresh processes (a few minutes)."""
    import importlib

    assert SMOKE, "smoke_all runs in smoke mode only (--smoke or GPUC_SMOKE=1)"
    sys.path.insert(0, str(HERE))
    out, rcs = out_dir(), {}
    for name in scripts:
        mod = importlib.import_module(f"gpu_{name}")
        rcs[name] = gpu_main(mod.SCRIPT, mod.__file__, ["--smoke"])
    rep: dict = {"kind": "gpu_cold", **device_info(), "smoke": True, "fill": {"mode": "left out (in-process smoke)"},
                 "measure": {"processes": {}, "tools": {}}}  # fmt: skip
    for name in (t for t in COLD_TOOLS if t in scripts):
        f = out / f"_measure_{name}.json"
        cold_measure(importlib.import_module(f"gpu_{name}").SCRIPT, f, time.perf_counter())
        got = json.loads(f.read_text())
        f.unlink()
        rep["measure"]["tools"].update(got.pop("tools"))
        rep["measure"]["processes"][name] = {**got, "rc": 0}
    done = [r for r in rep["measure"]["tools"].values() if "within_1s" in r]
    rep["all_within_1s"] = bool(done) and all(r["within_1s"] for r in done)
    write_gpu_result(out / "warmup.json", rep, render_cold)
    import gpu_summary

    gpu_summary.OUT = out
    gpu_summary.main()
    log("smoke:", rcs)
    return int(any(rcs.values()))


if __name__ == "__main__":
    # python benchmarks/_harness.py cold [--smoke] [--tools deseq,nmf,metacells]: the cold-run stage
    # python benchmarks/_harness.py smoke [--tools ...]: every GPU script's smoke mode in one process (smoke_all)
    _ap = argparse.ArgumentParser(description="The GPU check's cold-run stage (cold_stage) or smoke run (smoke_all).")
    _ap.add_argument("mode", choices=["cold", "smoke"])
    _ap.add_argument("--tools", default=None, help="cold: deseq,nmf,metacells; smoke: deseq,nmf,metacells,rsc,dask")
    _ap.add_argument("--smoke", action="store_true")
    _args = _ap.parse_args()
    if _args.mode == "smoke":
        sys.exit(smoke_all(tuple((_args.tools or ",".join(GPU_SCRIPTS)).split(","))))
    sys.exit(cold_stage(tuple((_args.tools or ",".join(COLD_TOOLS)).split(","))))
