"""DESeq2 on the CPU: gpuc.tl.deseq vs PyDESeq2 0.5.4 and R DESeq2, side by side in one run (``_harness.py``).

Cases: ``NxG`` (e.g. ``100x10000``): ``~condition``, B vs A, alpha 0.1, on N samples x G genes of simulated
negative-binomial counts (``_deseq_sim.simulate``, seed 0). PyDESeq2: ``DeseqDataSet.deseq2`` + ``DeseqStats.summary``
(its default ``n_cpus``, or ``n_cpus=c`` when pinned); R DESeq2 (``bench_deseq.R``, when ``Rscript`` is on the PATH):
``DESeq`` + ``results`` in one R process, start-up and reading excluded, timed once by the driver.

gpuc's work is an estimate, stated as such: each gene's dispersion is fitted twice (gene-wise and MAP) with about 20
evaluations of the negative-binomial log-likelihood over N samples (about 50 FLOPs per sample: lgamma and log
terms), plus the IRLS fit (p^2 N per iteration, 20 iterations, p design columns); bytes: six passes over the
float64 counts.

    python benchmarks/bench_deseq.py                      # 100 x 10,000 (about 1.5 minutes on 2 busy cores)
    python benchmarks/bench_deseq.py --cases 100x10000,200x20000
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness

CASES = {
    "100x10000": "100 samples x 10,000 genes",
    "200x20000": "200 samples x 20,000 genes",
    "500x30000": "500 samples x 30,000 genes (the GPU check's CPU scaling)",
}


def data(case: str):
    """Counts (samples x genes) and metadata of an ``NxG`` case."""
    from _deseq_sim import simulate

    n, g = (int(v) for v in case.split("x"))
    counts, meta, _ = simulate(n, g, seed=0)
    return counts, meta


def work(n: int, g: int, p: int = 2) -> dict:
    """The estimated FLOPs and bytes of one fit (see the module docstring)."""
    return {"flops": float(g * (2 * 20 * 50 * n + 20 * p * p * n)), "bytes": float(6 * n * g * 8)}


def prepare(who: str, case: str, n_jobs: int | None, threads: int | None, tmp: str):
    """The timed call of ``who`` on ``case`` (data loaded, tool imported)."""
    counts, meta = data(case)
    if who == "gpuc":
        import anndata

        import gpuc

        gpuc.settings.progress = False
        deseq = gpuc.tl.deseq  # imports the tool's module (as the peer's import), before the clock

        def call() -> dict:
            a = anndata.AnnData(counts, obs=meta.copy())
            deseq(a, "~condition", contrast=["condition", "B", "A"], alpha=0.1, device="cpu", n_jobs=n_jobs)
            return work(*counts.shape)

        return call
    import pandas as pd
    from pydeseq2.dds import DeseqDataSet
    from pydeseq2.ds import DeseqStats

    df = pd.DataFrame(counts, index=meta.index, columns=[f"g{j + 1}" for j in range(counts.shape[1])])
    kw = {} if threads is None else {"n_cpus": threads}  # None: PyDESeq2's default n_cpus

    def run() -> None:
        dds = DeseqDataSet(counts=df, metadata=meta, design="~condition", quiet=True, **kw)
        dds.deseq2()
        st = DeseqStats(dds, contrast=["condition", "B", "A"], alpha=0.1, quiet=True, **kw)
        st.summary()

    return run


def r_deseq(case: str, tmp: str) -> dict[str, float]:
    """R DESeq2's DESeq + results seconds (``bench_deseq.R``): wall and CPU (user + system), ``{}`` without Rscript or
    DESeq2."""
    if not shutil.which("Rscript"):
        return {}
    import pandas as pd

    counts, meta = data(case)
    counts_csv, meta_csv = f"{tmp}/counts.csv", f"{tmp}/meta.csv"
    pd.DataFrame(counts.T, index=[f"g{j + 1}" for j in range(counts.shape[1])], columns=meta.index).to_csv(counts_csv)
    meta.to_csv(meta_csv)
    cmd = ["Rscript", str(_harness.HERE / "bench_deseq.R"), counts_csv, meta_csv, f"{tmp}/r.csv", f"{tmp}/r_time.csv"]
    if subprocess.run(cmd, capture_output=True, text=True, check=False).returncode != 0:
        return {}
    tim = pd.read_csv(f"{tmp}/r_time.csv")
    fit = tim.stage.isin(["DESeq", "results"])
    out = {"R DESeq2": float(tim.loc[fit, "seconds"].sum())}
    if "cpu_seconds" in tim:  # R's user + system seconds of the same stages (proc.time)
        out["R DESeq2 CPU"] = float(tim.loc[fit, "cpu_seconds"].sum())
    return out


TOOL = _harness.Tool(
    name="deseq",
    peer="pydeseq2",
    cases=CASES,
    prepare=prepare,
    default_cases=("100x10000",),
    extra=r_deseq,
    peer_fill=False,  # PyDESeq2 compiles nothing: no cache to fill
    smoke_case="12x300",
)

if __name__ == "__main__":
    _harness.main(TOOL, __file__)
