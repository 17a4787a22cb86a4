"""Speed as users see it: gpuc and its peer side by side in one run, cold and warm, at default threads and at an
equal core count, with the load average (issue 12).

For every case this script runs, each in a **fresh process** that imports its tool and loads the data before the
clock starts (only the tool call is timed, as in ``bench_coldstart.py``; the peer likewise, its interpreter or R
start-up and library loading excluded):

* gpuc at its default threads (``n_jobs=None``: all cores available to the process): the first call (**cold**) and
  ``--warm-calls`` more calls in the same process (**warm**), over ``--repeats`` processes;
* gpuc with ``n_jobs=c`` for every ``c`` of ``--cores`` (default ``1,2``): cold and warm, and the 1 -> 2 thread
  speed-up of the warm call;
* the peer at its defaults (cNMF 1.7.1: one worker, numpy's default BLAS threads; SEACells 0.3.3: defaults;
  PyDESeq2 0.5.4: its default ``n_cpus``; R DESeq2: one process), over ``--peer-repeats`` processes: its first call
  (cold) and ``--peer-warm-calls`` more (warm; a peer's first call can include its own one-time work, e.g. numba
  compilation in its dependencies, which its users meet too);
* the peer at an equal core count: BLAS/OpenMP/numba pinned to ``c`` threads through the environment (PyDESeq2 also
  ``n_cpus=c``) for every ``c`` of ``--cores``; R DESeq2 is single-process, so its default run is its 1-core run.

The headline ratio is peer at defaults / gpuc cold at defaults (the fresh-process, default-threads one). The numba
cache is filled by one untimed gpuc process per case first (a fresh install compiles once; ``bench_coldstart.py``
measures that). Timings are medians; the 1-min load average is recorded before and after each case.

Every call works in place on the loaded AnnData, as each tool's users call it by default (gpuc ``copy=False``, a
rerun replacing the previous outputs; SEACells given the AnnData itself, as in its tutorial); a copy of the data
would add its own first-touch memory cost to the cold call (about 0.1 s for pbmc3k's 40 MB on the AMD VM of
docs/benchmarks.md).

Cases
-----
* ``nmf_small``: ``consensus_nmf`` k=7 x 20 runs + consensus on the 700 x 500 cNMF fixture (integer counts, cNMF's
  recipe: genes divided by their SD, Euclidean, density threshold 0.5). cNMF: prepare + factorize + combine +
  consensus (no figure).
* ``nmf_k7``: the same on the 6,881 x 2,000 CD34-sized matrix (``_nmf_data.cd34_sized``).
* ``metacells_pbmc3k``: ``metacells`` k=35, epsilon 1e-5 on the bundled pbmc3k after the demo preprocessing (2,638
  cells, ``X_pca``); SEACells 0.3.3 with the same settings (tutorial ``fit(min_iter=10, max_iter=50)``).
* ``metacells_cd34like``: k=92, epsilon 1e-5 on 6,881 cells (``bench_metacells.py``'s ``cd34like``).
* ``deseq``: ``deseq`` ``~condition`` B vs A on simulated 100 x 10,000 NB counts (``_deseq_sim.simulate``);
  PyDESeq2 (deseq2 + Wald summary) and R DESeq2 (``bench_deseq.R``: DESeq + results).

Usage (the peers: ``pip install '.[bench]'``; R: ``apt-get install r-base-core r-bioc-deseq2``)
-----
    python benchmarks/bench_honest.py                                  # every case, full sizes
    python benchmarks/bench_honest.py --cases deseq --repeats 5
    python benchmarks/bench_honest.py --quick                          # small sizes: checks the plumbing only
    python benchmarks/bench_honest.py one gpuc deseq --n-jobs 1        # one process (what the driver spawns)

Writes ``honest_cpu.json`` and ``honest_cpu.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CASES = ("nmf_small", "nmf_k7", "metacells_pbmc3k", "metacells_cd34like", "deseq")
PEER = {"nmf_small": "cnmf", "nmf_k7": "cnmf", "metacells_pbmc3k": "seacells", "metacells_cd34like": "seacells"}
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


# ---------------------------------------------------------------------------------------------- the cases' data
def _nmf_matrix(case: str, quick: bool):
    import numpy as np
    import scipy.sparse as sp

    if case == "nmf_small":
        z = np.load(ROOT / "tests" / "data" / "nmf" / "pbmc68k_counts_700x500.npz", allow_pickle=False)
        x = sp.csr_matrix((z["data"].astype(np.float32), z["indices"], z["indptr"]), shape=tuple(z["shape"]))
        return x[:300, :200].tocsr() if quick else x
    sys.path.insert(0, str(HERE))
    from _nmf_data import cd34_sized

    return cd34_sized(600, 300) if quick else cd34_sized()


def _nmf_setup(case: str, quick: bool) -> tuple[int, int]:
    return (5, 4) if quick else (7, 20)


def _metacells_data(case: str, quick: bool):
    sys.path.insert(0, str(HERE))
    from bench_metacells import _data

    if quick:
        return _data("pbmc68k"), 9, 1e-3, 10
    if case == "metacells_pbmc3k":
        return _data("pbmc3k"), 35, 1e-5, 50
    return _data("cd34like"), 92, 1e-5, 50


def _deseq_data(quick: bool):
    sys.path.insert(0, str(HERE))
    from _deseq_sim import simulate

    n, g = (20, 500) if quick else (100, 10_000)
    counts, meta, _ = simulate(n, g, seed=0)
    return counts, meta


# ---------------------------------------------------------------------------------------------- one process
def _prepare(
    who: str, case: str, quick: bool, n_jobs: int | None, threads: int | None, tmp: str
) -> Callable[[], object]:
    """Load the data of ``case`` and import ``who``; return the timed call (in place, each tool's default)."""
    if who == "gpuc":
        import gpuc

        gpuc.settings.progress = False
        if case.startswith("nmf"):
            from anndata import AnnData

            ad = AnnData(_nmf_matrix(case, quick))
            k, n_runs = _nmf_setup(case, quick)
            kw = {"mask_var": None, "preprocessing": "sd", "metric": "euclidean", "density_threshold": 0.5}
            return lambda: gpuc.tl.consensus_nmf(ad, k, n_runs=n_runs, device="cpu", n_jobs=n_jobs, **kw)
        if case.startswith("metacells"):
            ad, k, eps, max_iter = _metacells_data(case, quick)
            return lambda: gpuc.tl.metacells(
                ad, k, convergence_epsilon=eps, max_iter=max_iter, device="cpu", n_jobs=n_jobs
            )
        import anndata as ad_

        counts, meta = _deseq_data(quick)

        def fit() -> None:
            a = ad_.AnnData(counts, obs=meta.copy())
            gpuc.tl.deseq(a, "~condition", contrast=["condition", "B", "A"], alpha=0.1, device="cpu", n_jobs=n_jobs)

        return fit
    if who == "cnmf":
        import numpy as np
        import scanpy as sc
        from cnmf import cNMF

        x = _nmf_matrix(case, quick)
        k, n_runs = _nmf_setup(case, quick)
        counts_fn = str(Path(tmp) / "counts.h5ad")
        sc.AnnData(x.astype(np.float32)).write_h5ad(counts_fn)
        calls = [0]

        def run() -> None:
            calls[0] += 1
            obj = cNMF(output_dir=tmp, name=f"run{calls[0]}")
            obj.prepare(counts_fn=counts_fn, components=[k], n_iter=n_runs, seed=14, num_highvar_genes=x.shape[1])
            obj.factorize(worker_i=0, total_workers=1)
            obj.combine()
            obj.consensus(k, density_threshold=0.5, show_clustering=False, close_clustergram_fig=True)

        return run
    if who == "seacells":
        import numpy as np
        import scanpy as sc
        from anndata import AnnData

        # pynndescent's numba JIT warmed on a throwaway object, so that the timing is SEACells' own work
        sc.pp.neighbors(AnnData(np.random.default_rng(0).normal(size=(200, 10)).astype(np.float32)), use_rep="X")
        import SEACells

        ad, k, eps, max_iter = _metacells_data(case, quick)

        def run() -> None:
            np.random.seed(0)  # noqa: NPY002 - SEACells 0.3.3 draws from the global RNG
            model = SEACells.core.SEACells(
                ad,
                build_kernel_on="X_pca",
                n_SEACells=k,
                n_waypoint_eigs=10,
                convergence_epsilon=eps,
                verbose=False,
            )
            model.construct_kernel_matrix()
            model.initialize_archetypes()
            try:
                model.fit(min_iter=min(10, max_iter), max_iter=max_iter)
            except RuntimeWarning:  # 0.3.3 raises on non-convergence after writing its results
                pass

        return run
    if who == "pydeseq2":
        import pandas as pd
        from pydeseq2.dds import DeseqDataSet
        from pydeseq2.ds import DeseqStats

        counts, meta = _deseq_data(quick)
        df = pd.DataFrame(counts, index=meta.index, columns=[f"g{j + 1}" for j in range(counts.shape[1])])
        kw = {} if threads is None else {"n_cpus": threads}  # None: PyDESeq2's default n_cpus

        def run() -> None:
            dds = DeseqDataSet(counts=df, metadata=meta, design="~condition", quiet=True, **kw)
            dds.deseq2()
            st = DeseqStats(dds, contrast=["condition", "B", "A"], alpha=0.1, quiet=True, **kw)
            st.summary()

        return run
    msg = f"unknown tool {who!r}"
    raise ValueError(msg)


def one(who: str, case: str, quick: bool, n_jobs: int | None, threads: int | None, warm_calls: int) -> dict:
    """Times of the first call and of ``warm_calls`` more calls of ``who`` on ``case`` in this process."""
    with tempfile.TemporaryDirectory() as tmp:
        call = _prepare(who, case, quick, n_jobs, threads, tmp)
        times = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(1 + warm_calls):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
    return {"who": who, "case": case, "first": times[0], "warm": times[1:]}


def _r_deseq(quick: bool, tmp: str) -> dict:
    """R DESeq2 (one process; ``bench_deseq.R`` times DESeq + results, start-up and reading excluded)."""
    import pandas as pd

    counts, meta = _deseq_data(quick)
    counts_csv, meta_csv = f"{tmp}/counts.csv", f"{tmp}/meta.csv"
    pd.DataFrame(counts.T, index=[f"g{j + 1}" for j in range(counts.shape[1])], columns=meta.index).to_csv(counts_csv)
    meta.to_csv(meta_csv)
    cmd = ["Rscript", str(HERE / "bench_deseq.R"), counts_csv, meta_csv, f"{tmp}/r.csv", f"{tmp}/r_timing.csv"]
    subprocess.run(cmd, capture_output=True, text=True, check=True)
    tim = pd.read_csv(f"{tmp}/r_timing.csv")
    return {"who": "r", "case": "deseq", "first": float(tim.loc[tim.stage.isin(["DESeq", "results"]), "seconds"].sum())}


# ---------------------------------------------------------------------------------------------- driver
def _spawn(who: str, case: str, args: argparse.Namespace, *, n_jobs: int | None = None, threads: int | None = None,
           warm_calls: int = 0) -> dict:  # fmt: skip
    env = dict(os.environ)
    # a user's Python caches bytecode; some CI images switch that off, which would recompile every module imported
    # during the call (gpuc's lazily imported engine modules) in every process
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if threads is not None:
        env.update(dict.fromkeys(THREAD_VARS, str(threads)))
    cmd = [sys.executable, __file__, "one", who, case, "--warm-calls", str(warm_calls)]
    cmd += ["--quick"] * args.quick + (["--n-jobs", str(n_jobs)] if n_jobs is not None else [])
    cmd += ["--threads", str(threads)] if threads is not None else []
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=args.timeout)
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-3000:])
        return {"who": who, "case": case, "error": out.stderr[-500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _gpuc_config(case: str, args: argparse.Namespace, n_jobs: int | None) -> dict:
    runs = [_spawn("gpuc", case, args, n_jobs=n_jobs, warm_calls=args.warm_calls) for _ in range(args.repeats)]
    ok = [r for r in runs if "error" not in r]
    return {
        "cold_s": _median([r["first"] for r in ok]),
        "warm_s": _median([t for r in ok for t in r["warm"]]),
        "cold_all": [r["first"] for r in ok],
        "warm_all": [t for r in ok for t in r["warm"]],
    }


def _peer_config(case: str, args: argparse.Namespace, threads: int | None) -> dict:
    peer = PEER.get(case, "pydeseq2")
    runs = [
        _spawn(peer, case, args, threads=threads, warm_calls=args.peer_warm_calls) for _ in range(args.peer_repeats)
    ]
    ok = [r for r in runs if "error" not in r]
    return {
        "peer": peer,
        "s": _median([r["first"] for r in ok]),
        "warm_s": _median([t for r in ok for t in r["warm"]]),
        "all": [r["first"] for r in ok],
    }


def run_case(case: str, args: argparse.Namespace, cores: list[int]) -> dict:
    load0 = os.getloadavg()
    _spawn("gpuc", case, args)  # untimed: fills numba's cache (a fresh install compiles the kernels once)
    row: dict = {"case": case, "gpuc": {"default": _gpuc_config(case, args, None)}}
    for c in cores:
        row["gpuc"][str(c)] = _gpuc_config(case, args, c)
    if not args.skip_peers:
        row["peer"] = {"default": _peer_config(case, args, None)}
        for c in cores:
            row["peer"][str(c)] = _peer_config(case, args, c)
        if case == "deseq" and shutil.which("Rscript"):
            with tempfile.TemporaryDirectory() as tmp:
                r = [_r_deseq(args.quick, tmp)["first"] for _ in range(args.peer_repeats)]
            row["r"] = {"s": _median(r), "all": r}
    row["loadavg_before"], row["loadavg_after"] = load0, os.getloadavg()
    print(json.dumps(row), flush=True)
    return row


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores available, Python {platform.python_version()}"


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in ("gpuc", "numpy", "numba", "cnmf", "seacells", "pydeseq2"):
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    return ", ".join(out)


def markdown(rows: list[dict], cores: list[int], command: str) -> str:
    nan = float("nan")
    lines = [
        f"Machine: {_machine()}; {_versions()}.",
        f"Command: `{command}`. Cold: the first call in a fresh process (after import and data loading); warm: later",
        "calls in the same process (the peer's likewise). Peer: its defaults (cNMF one worker, default BLAS threads; SEACells defaults;",
        "PyDESeq2 default n_cpus; R one process), or pinned to c threads. Ratios: peer time / gpuc time",
        "(cold / cold, warm / warm; the pinned columns cold / cold).",
        "",
    ]
    head = ["case", "load avg before/after", "gpuc cold s", "gpuc warm s", "peer default cold s", "peer default warm s"]
    head += ["**ratio (cold, default)**", "ratio (warm, default)"]
    for c in cores:
        head += [f"gpuc cold {c}t s", f"gpuc warm {c}t s", f"peer {c}t s", f"ratio cold {c}t"]
    if 1 in cores and 2 in cores:
        head += ["gpuc 1->2 threads (warm)"]
    head += ["R s", "ratio vs R (cold, default)"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        g, p = r["gpuc"], r.get("peer", {})
        gd, pd_, pw = g["default"], p.get("default", {}).get("s", nan), p.get("default", {}).get("warm_s", nan)
        cells = [
            f"{r['case']} ({p.get('default', {}).get('peer', '-')})",
            f"{r['loadavg_before'][0]:.2f} / {r['loadavg_after'][0]:.2f}",
            f"{gd['cold_s']:.3f}",
            f"{gd['warm_s']:.3f}",
            f"{pd_:.2f}",
            f"{pw:.2f}",
            f"**{pd_ / gd['cold_s']:.1f}x**",
            f"{pw / gd['warm_s']:.1f}x",
        ]
        for c in cores:
            gc, pc = g[str(c)], p.get(str(c), {}).get("s", nan)
            cells += [f"{gc['cold_s']:.3f}", f"{gc['warm_s']:.3f}", f"{pc:.2f}", f"{pc / gc['cold_s']:.1f}x"]
        if 1 in cores and 2 in cores:
            cells.append(f"{g['1']['warm_s'] / g['2']['warm_s']:.2f}x")
        rs = r.get("r", {}).get("s", nan)
        cells += [f"{rs:.2f}" if rs == rs else "-", f"{rs / gd['cold_s']:.1f}x" if rs == rs else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="all", choices=["all", "one"])
    ap.add_argument("who", nargs="?", help="one: gpuc, cnmf, seacells or pydeseq2")
    ap.add_argument("case", nargs="?", help="one: the case")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--cores", default="1,2", help="equal core counts for gpuc (n_jobs) and the pinned peer")
    ap.add_argument("--repeats", type=int, default=3, help="fresh gpuc processes per configuration")
    ap.add_argument("--warm-calls", type=int, default=2, help="gpuc calls after the first in each process")
    ap.add_argument("--peer-repeats", type=int, default=1, help="fresh peer processes per configuration")
    ap.add_argument("--peer-warm-calls", type=int, default=1, help="peer calls after the first in each process")
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small sizes: checks the plumbing, times mean nothing")
    ap.add_argument("--n-jobs", type=int, default=None, help="one: gpuc's n_jobs (default None)")
    ap.add_argument("--threads", type=int, default=None, help="one: the peer's pinned threads (default: its own)")
    ap.add_argument("--timeout", type=float, default=7200)
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    if args.mode == "one":
        res = one(args.who, args.case, args.quick, args.n_jobs, args.threads, args.warm_calls)
        print(json.dumps(res), flush=True)
        return
    cores = [int(c) for c in args.cores.split(",") if c]
    rows = [run_case(case, args, cores) for case in args.cases.split(",")]
    command = "python " + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    md = markdown(rows, cores, command)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "honest_cpu_quick" if args.quick else "honest_cpu"
    (out / f"{stem}.json").write_text(
        json.dumps({"machine": _machine(), "versions": _versions(), "rows": rows}, indent=1)
    )
    (out / f"{stem}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
