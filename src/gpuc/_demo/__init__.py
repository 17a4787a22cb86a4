"""``gpuc demo``: the whole chain on the bundled data, with figures and a summary table.

Each tool contributes one step module (``gpuc._demo.<tool>``) exposing ``run(ctx) -> list[dict]``; a step whose module
is not there yet is reported as missing instead of failing the demo.
"""

from __future__ import annotations

import importlib
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

# (step name, module with run(ctx) -> list of summary rows)
DEMO_STEPS: list[tuple[str, str]] = [
    ("metacells", "gpuc._demo.metacells"),
    ("consensus NMF", "gpuc._demo.nmf"),
    ("DESeq2", "gpuc._demo.deseq"),
]


@dataclass
class DemoContext:
    """What a demo step receives: the preprocessed pbmc3k AnnData, output folder, device, a logger, and a scratch
    dict where a step leaves results for later steps (e.g. the metacell AnnData for NMF).
    """

    adata: Any
    out: Path
    device: str
    log: Callable[[str], None]
    shared: dict[str, Any] = field(default_factory=dict)

    def savefig(self, fig: Any, name: str) -> Path:
        """Save a matplotlib figure as ``out/name`` (PNG) and close it."""
        import matplotlib.pyplot as plt

        path = self.out / name
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        self.log(f"  wrote {path}")
        return path


def summary_row(what: str, value: Any, seconds: float = 0.0) -> dict[str, Any]:
    """One row of a step's summary (:func:`run_demo` adds its step and device): ``seconds`` rounded to 0.01 s, 0.0
    for a row that reads off a result already timed.
    """
    return {"what": what, "value": value, "seconds": round(seconds, 2)}


def pbmc3k_hvg(log: Callable[[str], None] | None = None) -> Any:
    """The bundled pbmc3k after the Seurat tutorial's QC (cells with 200 genes or more that passed its filters),
    normalised to 1e4 counts per cell, log1p, and 2,000 highly variable genes (Scanpy's ``"seurat"`` flavour, its
    default); the raw counts stay in ``layers["counts"]``. ``log`` gets the shape after QC.
    """
    import scanpy as sc

    from gpuc.datasets import pbmc3k

    adata = pbmc3k()
    sc.pp.filter_cells(adata, min_genes=200)
    adata = adata[adata.obs["passed_seurat_qc"].astype(bool)].copy()
    if log is not None:
        log(f"  pbmc3k: {adata.n_obs} cells x {adata.n_vars} genes after QC")
    sc.pp.normalize_total(adata, target_sum=1e4)
    sc.pp.log1p(adata)
    sc.pp.highly_variable_genes(adata, n_top_genes=2000, flavor="seurat")
    return adata


def preprocess_pbmc3k(log: Callable[[str], None]) -> Any:
    """Standard Scanpy preprocessing of the bundled pbmc3k: QC, normalise, log, 2,000 HVGs, PCA, kNN, UMAP."""
    import scanpy as sc

    adata = pbmc3k_hvg(log)
    sc.pp.pca(adata, n_comps=50, mask_var="highly_variable", random_state=0)
    sc.pp.neighbors(adata, n_neighbors=15, random_state=0)
    sc.tl.umap(adata, random_state=0)
    return adata


def fitted(log: Callable[[str], None], width: int | None = None) -> Callable[[str], None]:
    """``log`` with each line of a message wrapped to ``width`` columns (default
    :data:`gpuc._utils.MAX_COLUMNS`); a continued line is indented four more than the line it continues.
    """
    from gpuc._utils import MAX_COLUMNS

    width = MAX_COLUMNS if width is None else width

    def wrapped(message: str) -> None:
        lines = []
        for line in str(message).splitlines() or [""]:
            indent = " " * (len(line) - len(line.lstrip()))
            lines.append(
                textwrap.fill(line, width, subsequent_indent=indent + "    ", break_on_hyphens=False) if line else ""
            )
        log("\n".join(lines))

    return wrapped


def summary_text(summary: pd.DataFrame) -> str:
    """The summary table for the terminal: one line per result under its step (``what: value (seconds)``); the
    full table, with the device column, is ``summary.tsv``.
    """
    lines = []
    for step, rows in summary.groupby("step", sort=False):
        lines.append(f"{step}:")
        for row in rows.itertuples(index=False):
            secs = f" ({row.seconds:.2f} s)" if row.seconds else ""
            lines.append(f"  {row.what}: {row.value}{secs}")
    return "\n".join(lines)


def run_demo(
    out: str | Path = "gpuc_demo",
    device: str = "auto",
    log: Callable[[str], None] = print,
    *,
    overwrite: bool = False,
) -> pd.DataFrame:
    """Run every available step on the bundled data; write figures and ``summary.tsv`` to ``out``.

    Every message goes to ``log`` wrapped to 100 columns. Returns the summary table (one row per result: step, what,
    value, device, seconds). A folder ``out`` that exists and holds files is refused (:class:`FileExistsError`,
    before anything is computed) unless ``overwrite``, so the demo never replaces a user's files.
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        what = "is a file" if not out.is_dir() else "exists and is not empty"
        msg = (
            f"the demo's output folder {str(out)!r} {what}; the demo writes its figures and summary.tsv there and "
            "would replace files of the same names. Pass another folder (--out), or --overwrite to write into it."
        )
        raise FileExistsError(msg)
    log = fitted(log)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import scanpy as sc

    from gpuc._backend import resolve_device

    dev = resolve_device(device)  # raises before anything is written if device='gpu' is unusable
    out.mkdir(parents=True, exist_ok=True)
    log(f"gpuc demo -> {out.resolve()} (device: {dev})")
    rows: list[dict[str, Any]] = []

    log("[preprocessing] Scanpy on bundled pbmc3k")
    t0 = time.perf_counter()
    adata = preprocess_pbmc3k(log)
    size = f"{adata.n_obs} x {adata.n_vars}"
    rows.append(
        {"step": "preprocessing", "device": "cpu", **summary_row("cells x genes", size, time.perf_counter() - t0)}
    )
    fig, ax = plt.subplots(figsize=(5, 4.5))
    sc.pl.umap(adata, color="cell_type", ax=ax, show=False, frameon=False, title="pbmc3k cell types")
    ctx = DemoContext(adata=adata, out=out, device=device, log=log)
    ctx.savefig(fig, "umap_cell_types.png")

    for name, module in DEMO_STEPS:
        try:
            step = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name is not None and module.startswith(err.name):
                log(f"[{name}] not available in this version of gpuc (missing {module}); skipped")
                rows.append({"step": name, "device": "", **summary_row("status", "not implemented yet")})
                continue
            raise
        log(f"[{name}]")
        t0 = time.perf_counter()
        for row in step.run(ctx):
            rows.append({"step": name, "device": dev, **row})
        log(f"  {name} done in {time.perf_counter() - t0:.1f} s")

    summary = pd.DataFrame(rows, columns=["step", "what", "value", "device", "seconds"])
    summary.to_csv(out / "summary.tsv", sep="\t", index=False)
    log(f"wrote {out / 'summary.tsv'}")
    log(summary_text(summary))
    return summary
