"""gpuc on a busy machine: default threads vs ``n_jobs=1`` under background load, with the peers (issue 32).

For each case, under 0 (quiet), 2 and 4 busy processes (each a pure-Python spin loop, one runnable thread), the
script times warm calls of

* gpuc at its default threads (``n_jobs=None``) and at ``n_jobs=1``, alternating call by call so that both meet the
  same background (median of ``--calls`` calls each);
* the peer at its defaults (cNMF 1.7.1, SEACells 0.3.3, PyDESeq2 0.5.x), ``--peer-calls`` calls (``0``: no peers).

Every tool runs in its own long-lived process that loads the data, makes one untimed call at each setting (numba
compilation and caches) and then waits for the driver, which starts and stops the busy processes between the load
levels; only the calls are timed. Each call also records the process's CPU time (all threads) and its context
switches, which show threads spinning (CPU time above the work) or waiting for a core (involuntary switches).

``--variant NAME=PYTHONPATH`` (repeatable) runs the gpuc cases from several source trees side by side, interleaved
within each load level (e.g. the code before and after a change); ``--variant NAME=PYTHONPATH:VAR=VALUE,...`` also
sets environment variables in that variant's processes. Without it, gpuc is the one importable here.
``--also-n-jobs -1`` also times gpuc at every core whatever the load (the JSON only; e.g. to compare the threads'
wait policies on a quiet machine).

The load average and ``uptime`` are recorded before and after each load level: the machine's own load is not
controlled by this script.

Cases
-----
* ``nmf_small``: ``consensus_nmf`` k=7 x 20 runs + consensus on the 700 x 500 cNMF fixture (cNMF's recipe);
  cNMF prepare + factorize + combine + consensus.
* ``metacells_pbmc3k``: ``metacells`` k=35, epsilon 1e-5 on the bundled pbmc3k (2,638 cells); SEACells, same settings.
* ``deseq``: ``deseq`` ``~condition`` B vs A on simulated 100 x 10,000 NB counts; PyDESeq2 deseq2 + Wald summary.

Usage (the peers: ``pip install '.[bench]'``)
-----
    python benchmarks/bench_load.py                              # every case, 0/2/4 busy, peers, ~8 min on 2 cores
    python benchmarks/bench_load.py --peer-calls 0 --busy 0,2    # gpuc only
    python benchmarks/bench_load.py --variant before=/path/a/src --variant after=/path/b/src --peer-calls 0

Writes ``load.json`` and ``load.md`` under ``--out`` (default ``benchmarks/results/load``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = ("nmf_small", "metacells_pbmc3k", "deseq")
PEER = {"nmf_small": "cnmf", "metacells_pbmc3k": "seacells", "deseq": "pydeseq2"}
LABEL = {
    "nmf_small": "consensus NMF k=7 x 20, 700 x 500",
    "metacells_pbmc3k": "metacells pbmc3k k=35",
    "deseq": "DESeq2 100 x 10,000",
}
SPIN = "while True:\n    pass\n"
MARK = "@bench_load "  # the start of the child's answers on its stdout


# ---------------------------------------------------------------------------------------------- one tool's process
def child(who: str, case: str, extra: list[int]) -> None:
    """Serve timed calls: read ``{"n_jobs": ..., "calls": n}`` lines on stdin, answer one JSON line each."""
    # the protocol goes to a copy of stdout; whatever the tools print (cNMF's progress lines) goes to stderr
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    sys.path.insert(0, str(HERE))
    from bench_honest import _prepare

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calls = {}
        settings = (None, 1, *extra) if who == "gpuc" else (None,)
        for n_jobs in settings:
            calls[n_jobs] = _prepare(who, case, False, n_jobs, None, tmp)
            calls[n_jobs]()  # untimed: compilation, caches, the peers' own first-call work
        info = {}
        if who == "gpuc":
            import numba

            import gpuc

            info = {"gpuc": gpuc.__file__, "threading_layer": numba.threading_layer()}
        print(MARK + json.dumps({"ready": True, **info}), file=proto, flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            out = []
            for _ in range(req["calls"]):
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                t0 = time.perf_counter()
                calls[req["n_jobs"]]()
                wall = time.perf_counter() - t0
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                out.append(
                    {
                        "wall": wall,
                        "cpu": (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime),
                        "nivcsw": r1.ru_nivcsw - r0.ru_nivcsw,
                        "nvcsw": r1.ru_nvcsw - r0.ru_nvcsw,
                    }
                )
            print(MARK + json.dumps(out), file=proto, flush=True)


class Worker:
    """A long-lived process of :func:`child` for one (tool, case, variant)."""

    def __init__(
        self, who: str, case: str, pythonpath: str | None, env_extra: dict[str, str], extra: tuple[int, ...] = ()
    ) -> None:
        env = dict(os.environ)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        env.update(env_extra)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "child", who, case, *map(str, extra)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        self.info: dict = {}

    def _reply(self, what: str) -> object:
        """The worker's next marked JSON line (its other output is passed over)."""
        while True:
            line = self.proc.stdout.readline()
            if not line:
                msg = f"worker ended {what}"
                raise RuntimeError(msg)
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])

    def ready(self) -> dict:
        self.info = self._reply("before it was ready")
        return self.info

    def calls(self, n_jobs: int | None, n: int) -> list[dict]:
        self.proc.stdin.write(json.dumps({"n_jobs": n_jobs, "calls": n}) + "\n")
        self.proc.stdin.flush()
        return self._reply("during the calls")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ---------------------------------------------------------------------------------------------- driver
def _loadavg() -> str:
    with open("/proc/loadavg") as fh:
        return fh.read().strip()


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return _loadavg()


def _busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def _summary(times: list[dict]) -> dict:
    return {
        "median": statistics.median(t["wall"] for t in times),
        "times": [t["wall"] for t in times],
        "cpu": statistics.median(t["cpu"] for t in times),
        "nivcsw": statistics.median(t["nivcsw"] for t in times),
        "nvcsw": statistics.median(t["nvcsw"] for t in times),
    }


def _parse_variant(text: str) -> tuple[str, str | None, dict[str, str]]:
    name, _, rest = text.partition("=")
    path, _, envs = rest.partition(":")
    env = dict(kv.split("=", 1) for kv in envs.split(",") if kv)
    return name, path or None, env


def run(args: argparse.Namespace) -> dict:
    variants = [_parse_variant(v) for v in args.variant] or [("gpuc", None, {})]
    busy_levels = [int(b) for b in args.busy.split(",")]
    workers: dict[tuple[str, str, str], Worker] = {}
    for case in args.cases:
        for name, path, env in variants:
            workers[("gpuc", case, name)] = Worker("gpuc", case, path, env, tuple(args.also_n_jobs))
        if args.peer_calls:
            workers[(PEER[case], case, "peer")] = Worker(PEER[case], case, None, {})
    results = {"machine": _machine(), "variants": {}, "levels": []}
    try:
        for key, w in workers.items():
            info = w.ready()
            if key[0] == "gpuc":
                results["variants"][key[2]] = info
        for level in busy_levels:
            spinners = _busy(level)
            try:
                time.sleep(args.settle)
                entry = {"busy": level, "uptime_before": _uptime(), "loadavg_before": _loadavg(), "rows": []}
                for case in args.cases:
                    for name, _, _ in variants:
                        w = workers[("gpuc", case, name)]
                        timed: dict = {n: [] for n in (None, 1, *args.also_n_jobs)}
                        for _ in range(args.calls):  # alternate the settings call by call
                            for n_jobs in timed:
                                timed[n_jobs] += w.calls(n_jobs, 1)
                        entry["rows"].append(
                            {
                                "case": case,
                                "who": "gpuc",
                                "variant": name,
                                "default": _summary(timed[None]),
                                "n_jobs_1": _summary(timed[1]),
                                **{f"n_jobs_{n}": _summary(timed[n]) for n in args.also_n_jobs},
                            }
                        )
                        _progress(entry["rows"][-1], level)
                    if args.peer_calls:
                        w = workers[(PEER[case], case, "peer")]
                        entry["rows"].append(
                            {
                                "case": case,
                                "who": PEER[case],
                                "variant": "peer",
                                "default": _summary(w.calls(None, args.peer_calls)),
                            }
                        )
                        _progress(entry["rows"][-1], level)
                entry["uptime_after"], entry["loadavg_after"] = _uptime(), _loadavg()
            finally:
                _stop(spinners)
            results["levels"].append(entry)
    finally:
        for w in workers.values():
            w.close()
    return results


def _progress(row: dict, level: int) -> None:
    tail = "".join(
        f"  n_jobs={key.removeprefix('n_jobs_')} {val['median']:.3f} s"
        for key, val in row.items()
        if key.startswith("n_jobs_")
    )
    print(f"busy {level}: {row['who']:<9} {row['variant']:<8} {row['case']:<17} default {row['default']['median']:.3f} s"
          f"{tail}", file=sys.stderr, flush=True)  # fmt: skip


def _machine() -> str:
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as fh:
            model = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{model}, {os.cpu_count()} CPUs (affinity {len(os.sched_getaffinity(0))}), Python {platform.python_version()}"
    )


def markdown(res: dict, command: str) -> str:
    levels = res["levels"]
    quiet = next((e for e in levels if e["busy"] == 0), None)
    lines = [f"Machine: {res['machine']}. Command: `{command}`.", ""]
    for e in levels:
        lines.append(f"- busy {e['busy']}: before `{e['uptime_before']}`; after `{e['uptime_after']}`")
    lines.append("")
    head = "| call | variant | quiet default | quiet n_jobs=1 |"
    rule = "| --- | --- | --- | --- |"
    for e in levels:
        if e["busy"]:
            head += f" {e['busy']} busy default | {e['busy']} busy n_jobs=1 | ratio |"
            rule += " --- | --- | --- |"
    two_busy = quiet is not None and any(e["busy"] == 2 for e in levels)
    if two_busy:
        head += " 2 busy / quiet |"
        rule += " --- |"
    lines += [head, rule]
    keys = [(r["case"], r["who"], r["variant"]) for r in levels[0]["rows"]]
    for key in keys:
        case, who, variant = key

        def row(e: dict, key: tuple = key) -> dict | None:
            return next((r for r in e["rows"] if (r["case"], r["who"], r["variant"]) == key), None)

        name = LABEL[case] if who == "gpuc" else f"{who} ({LABEL[case]})"
        cells = [name, variant if who == "gpuc" else "defaults"]
        q = row(quiet) if quiet else None
        cells += [f"{q['default']['median']:.3f} s" if q else "", _fmt(q, "n_jobs_1") if q else ""]
        for e in levels:
            if not e["busy"]:
                continue
            r = row(e)
            cells += [f"{r['default']['median']:.3f} s", _fmt(r, "n_jobs_1")]
            cells.append(f"{r['default']['median'] / r['n_jobs_1']['median']:.2f}x" if "n_jobs_1" in r else "")
        if two_busy:
            two = next((row(e) for e in levels if e["busy"] == 2), None)
            cells.append(f"{two['default']['median'] / q['default']['median']:.2f}x" if two and q else "")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "ratio: default threads / `n_jobs=1` under the same load (goal <= 1.1x); 2 busy / quiet: default threads "
        "(goal <= 3x). Medians of the warm calls; CPU time and context switches per call are in the JSON.",
    ]
    return "\n".join(lines) + "\n"


def _fmt(r: dict, key: str) -> str:
    return f"{r[key]['median']:.3f} s" if key in r else ""


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3], [int(n) for n in sys.argv[4:]])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--cases", type=lambda s: s.split(","), default=list(CASES))
    parser.add_argument("--busy", default="0,2,4", help="busy-process counts (default 0,2,4)")
    parser.add_argument("--calls", type=int, default=3, help="gpuc warm calls per setting and load (default 3)")
    parser.add_argument("--peer-calls", type=int, default=1, help="peer warm calls per load (default 1; 0: none)")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds between starting the load and timing")
    parser.add_argument(
        "--also-n-jobs",
        type=lambda s: [int(n) for n in s.split(",")],
        default=[],
        help="more gpuc settings to time (e.g. -1: all cores whatever the load); in the JSON only",
    )
    parser.add_argument("--variant", action="append", default=[], help="NAME=PYTHONPATH[:VAR=VALUE,...]")
    parser.add_argument("--out", default=str(HERE / "results" / "load"))
    parser.add_argument("--tag", default="load", help="file name stem of the outputs (default: load)")
    args = parser.parse_args()
    command = "python benchmarks/bench_load.py " + " ".join(sys.argv[1:])
    res = run(args)
    res["command"] = command
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res, command)
    (out / f"{args.tag}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
