"""The one benchmark harness: gpuc and its peer side by side in one run, cold and warm, with the work counted.

A tool script (``bench_nmf.py``, ``bench_metacells.py``, ``bench_deseq.py``) describes its cases as a :class:`Tool`:
``prepare(who, case, n_jobs, threads, tmp)`` loads the data, imports ``who`` and returns the timed call (a call may
return ``{"flops": ..., "bytes": ...}``, the work it did). :func:`main` gives every script the same command line:

* ``python benchmarks/bench_X.py [--cases a,b] [--cores 1] [--repeats 3] ...`` runs each case side by side (below)
  and writes ``results/cpu_X.json`` and ``results/cpu_X.md``;
* ``python benchmarks/bench_X.py one WHO CASE ...`` is the fresh process the driver spawns (prints one JSON line).

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
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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


def one(tool: Tool, who: str, case: str, n_jobs: int | None, threads: int | None, warm_calls: int) -> dict:
    """In this (fresh) process: the first call and ``warm_calls`` more calls of ``who`` on ``case``, and the work."""
    with tempfile.TemporaryDirectory() as tmp:
        call = tool.prepare(who, case, n_jobs, threads, tmp)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            times, res = time_calls(call, 1 + warm_calls)
    out = {"who": who, "case": case, "first": times[0], "warm": times[1:]}
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


def _config(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    res = {
        "cold_s": median([r["first"] for r in ok]),
        "warm_s": median([t for r in ok for t in r["warm"]]),
        "cold_all": [r["first"] for r in ok],
        "warm_all": [t for r in ok for t in r["warm"]],
    }
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        res["errors"] = errors
    work = [r["work"] for r in ok if "work" in r]
    if work:
        res["work"] = work[-1]
    return res


def side_by_side(tool: Tool, script: str, case: str, args: argparse.Namespace) -> dict:
    """Every configuration of one case (see the module's docstring); one result row."""
    cores_ = [int(c) for c in args.cores.split(",") if c]
    row: dict = {"case": case, "about": tool.cases.get(case, case), "load_before": loadavg()}
    if args.compile:
        with tempfile.TemporaryDirectory() as cache:
            env = thread_env(None) | {"NUMBA_CACHE_DIR": cache}
            row["compile_s"] = spawn(script, "gpuc", case, env=env, timeout=args.timeout).get("first")
    else:  # untimed: fills numba's cache (a fresh install compiles the kernels once)
        spawn(script, "gpuc", case, timeout=args.timeout)
    if not args.skip_peers and tool.peer_fill:  # untimed likewise: the peer's dependencies' numba caches
        spawn(script, tool.peer, case, timeout=args.timeout)
    # the configurations' processes in rounds (gpuc default, peer default, gpuc c, peer c, ...), so that gpuc and the
    # peer meet the same load on a shared machine; a configuration with fewer repeats drops out of the later rounds
    jobs = [("gpuc", "default", {"n_jobs": None, "warm_calls": args.warm_calls}, args.repeats)]
    if not args.skip_peers:
        jobs.append((tool.peer, "default", {"threads": None, "warm_calls": args.peer_warm_calls}, args.peer_repeats))
    for c in cores_:
        jobs.append(("gpuc", str(c), {"n_jobs": c, "warm_calls": args.warm_calls}, args.repeats))
        if not args.skip_peers:
            jobs.append((tool.peer, str(c), {"threads": c, "warm_calls": args.peer_warm_calls}, args.peer_repeats))
    runs: dict[tuple[str, str], list[dict]] = {(who, cfg): [] for who, cfg, _, _ in jobs}
    for i in range(max(n for *_, n in jobs)):
        for who, cfg, kw, n in jobs:
            if i < n:
                runs[who, cfg].append(spawn(script, who, case, timeout=args.timeout, **kw))
    row["gpuc"] = {cfg: _config(r) for (who, cfg), r in runs.items() if who == "gpuc"}
    if not args.skip_peers:
        row["peer"] = {cfg: _config(r) for (who, cfg), r in runs.items() if who != "gpuc"}
        if tool.extra is not None:
            with tempfile.TemporaryDirectory() as tmp:
                row["extra"] = tool.extra(case, tmp)
    row["load_after"] = loadavg()
    if case in tool.targets:
        row["targets"] = tool.targets[case]
    print(json.dumps(row), flush=True)
    return row


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
    args = ap.parse_args(argv)
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
        "hardware": hardware_limits(),
        "cores": [int(c) for c in args.cores.split(",") if c],
        "rows": [],
    }
    for case in args.cases.split(","):
        payload["rows"].append(side_by_side(tool, script, case, args))
        write_result(result_path(tool, args.out), payload)  # after each case, so a long run keeps what it has
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
    for r in res["rows"]:
        g, p = r["gpuc"]["default"], r.get("peer", {}).get("default", {})
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
        rows = [[r["case"], *_from_limit(r["gpuc"]["default"], hw), fmt_s(r["gpuc"]["default"]["warm_s"])]
                for r in res["rows"]]  # fmt: skip
        lines.append(
            f"Work of gpuc's call against this machine's limits, measured in the same run ({hw['gemm_gflops']:.3g} "
            f"GFLOP/s float64 GEMM, {hw['triad_gbps']:.3g} GB/s triad, all cores); 'x from limit' = warm time / "
            f"max(FLOPs / GEMM rate, bytes / triad rate):\n\n"
            + md_table(["case", "work (counted)", "x from limit", "gpuc warm s"], rows)
        )
    return "\n".join(lines)
