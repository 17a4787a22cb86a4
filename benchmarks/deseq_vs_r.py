"""Gene-by-gene agreement of ``gpuc.tl.deseq`` with R DESeq2's own per-gene output.

For every reference set it prints, per column, how many genes differ from R by more than ``--rtol`` (relative, 1e-6
by default; NaN patterns that differ count as off), the largest relative difference, and the differences between
the padj < 0.1 sets. Reference sets (all R DESeq2 1.38.3 unless said otherwise):

- ``pasilla_condition``, ``pasilla_type_condition``: the bundled pasilla counts, R per-gene output in
  ``tests/data/deseq/pasilla_*_R.csv.gz`` (rounded to 7 digits, so 1e-6 is the floor there) or, with ``--shared``,
  the full-precision ``gene_fit_*.csv.gz`` beside the shared copy;
- ``single_factor``, ``single_factor_meanfit``, ``multi_factor``, ``continuous``, ``wide``, ``large_counts``:
  PyDESeq2's test sets with the R 1.38.3 intermediates (``tests/data/deseq/refs/r_1.38.3``);
- ``airway_dex``, ``airway_cell_dex`` (with ``--shared`` only): airway, R's per-gene output in the shared folder;
- every ``tests/data/deseq/r_sets/<name>/`` made by its ``make_reference.R`` (2 vs 2, local trend, mean trend,
  outlier replacement, continuous covariate, interaction).

Run: ``PYTHONPATH=src python benchmarks/deseq_vs_r.py [--shared ../shared/data] [--sets a,b] [--rtol 1e-6]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd

from gpuc._testing.deseq_refs import (
    AIRWAY_DESIGNS,
    DISPERSION_COLUMNS,
    PYDESEQ2_DESIGNS,
    airway,
    airway_reference,
    pydeseq2_case,
    pydeseq2_contrast,
    r_set,
)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "deseq"
COLS = ("dispGeneEst", "dispFit", "dispMAP", "dispersion", "log2FoldChange", "lfcSE", "stat", "pvalue", "padj")


def rel_off(a: np.ndarray, b: np.ndarray, rtol: float) -> tuple[int, float]:
    """Genes off by more than ``rtol`` relative (a NaN on one side only counts as off) and the largest relative gap."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    na, nb = np.isnan(a), np.isnan(b)
    both = ~na & ~nb
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.abs(a[both] - b[both]) / np.maximum(np.abs(b[both]), 1e-300)
    r = np.where(a[both] == b[both], 0.0, r)
    return int((r > rtol).sum() + (na != nb).sum()), float(r.max()) if r.size else 0.0


def _pasilla(tag: str, shared: Path | None) -> tuple[ad.AnnData, str, object, pd.DataFrame]:
    import gpuc

    a = gpuc.datasets.pasilla()
    # R's factor levels: alphabetical, so paired-end is the reference of type (the ridge penalty and the IRLS path
    # depend, slightly, on the parametrisation)
    a.obs["type"] = a.obs["type"].cat.reorder_categories(["paired-end", "single-read"])
    design = {"condition": "~condition", "type_condition": "~type + condition"}[tag]
    if shared is not None:
        d = shared / "bulk" / "pasilla" / "deseq2_R_reference"
        g = pd.read_csv(d / f"gene_fit_{tag}.csv.gz", index_col=0)
        r = pd.read_csv(d / f"results_{tag}.csv", index_col=0)
        ref = g[["dispGeneEst", "dispFit", "dispMAP", "dispersion"]].join(r)
    else:
        ref = pd.read_csv(DATA / f"pasilla_{tag}_R.csv.gz", index_col=0)
    return a, design, ["condition", "treated", "untreated"], ref


def _pydeseq2_case(case: str) -> tuple[ad.AnnData, str, object, pd.DataFrame, dict]:
    a = pydeseq2_case(DATA / "refs", case)
    st = DATA / "refs" / "r_1.38.3"
    g = pd.read_csv(st / f"{case}_gene_params.csv.gz", index_col=0)
    res = pd.read_csv(st / f"{case}_res.csv.gz", index_col=0)
    ref = g[DISPERSION_COLUMNS].join(res[[c for c in res.columns if c != "baseMean"]])
    ref.insert(0, "baseMean", g["baseMean"])
    kw = {"fit_type": "mean"} if case.endswith("meanfit") else {}
    return a, PYDESEQ2_DESIGNS[case], pydeseq2_contrast(case), ref, kw


def _r_set(d: Path) -> tuple[ad.AnnData, str, object, pd.DataFrame, dict]:
    a, spec, ref = r_set(d)
    return a, spec["design"], spec["contrast"], ref, spec.get("kwargs", {})


def _airway(tag: str, shared: Path) -> tuple[ad.AnnData, str, object, pd.DataFrame]:
    return airway(shared), AIRWAY_DESIGNS[tag], ["dex", "trt", "untrt"], airway_reference(shared, tag)


def run_set(name: str, shared: Path | None, rtol: float) -> dict:
    import gpuc

    kw: dict = {}
    if name.startswith("airway_"):
        if shared is None:
            raise SystemExit("airway needs --shared")
        a, design, contrast, ref = _airway(name.removeprefix("airway_"), shared)
    elif name.startswith("pasilla_"):
        a, design, contrast, ref = _pasilla(name.removeprefix("pasilla_"), shared)
    elif name in PYDESEQ2_DESIGNS:
        a, design, contrast, ref, kw = _pydeseq2_case(name)
    else:
        a, design, contrast, ref, kw = _r_set(DATA / "r_sets" / name)
    gpuc.tl.deseq(a, design, contrast=contrast, alpha=0.1, device="cpu", **kw)
    res = gpuc.get.deseq_results(a)
    out: dict = {"set": name, "genes": int(a.n_vars)}
    for col in COLS:
        if col not in ref.columns:
            continue
        mine = a.var[f"deseq_{col}"].to_numpy() if col.startswith("disp") else res[col].to_numpy()
        n_off, worst = rel_off(mine, ref[col].to_numpy(), rtol)
        out[col] = (n_off, worst)
    sa = set(np.nonzero(res["padj"].to_numpy() < 0.1)[0])
    sb = set(np.nonzero(ref["padj"].to_numpy() < 0.1)[0])
    out["padj<0.1"] = (len(sb), len(sa), len(sb - sa), len(sa - sb))
    tr = a.uns["deseq"]["trend"]
    out["trend"] = {k: tr[k] for k in ("type", "asymptDisp", "extraPois", "mean") if k in tr}
    return out


def all_sets(shared: Path | None = None) -> list[str]:
    sets = ["pasilla_condition", "pasilla_type_condition", *PYDESEQ2_DESIGNS]
    if shared is not None and (shared / "bulk" / "airway").is_dir():
        sets += ["airway_dex", "airway_cell_dex"]
    rs = DATA / "r_sets"
    if rs.is_dir():
        sets += sorted(p.name for p in rs.iterdir() if (p / "spec.json").exists())
    return sets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", type=Path, default=None, help="the shared data folder (full-precision pasilla refs)")
    ap.add_argument("--sets", default=None, help="comma-separated subset of: " + ", ".join(all_sets()))
    ap.add_argument("--rtol", type=float, default=1e-6)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    sets = args.sets.split(",") if args.sets else all_sets(args.shared)
    rows = []
    hdr = f"{'set':28s} {'genes':>6s} " + " ".join(f"{c[:12]:>12s}" for c in COLS) + "  padj<0.1 R/gpuc/-/+"
    print(f"genes off by > {args.rtol:g} relative (NaN pattern differences count)")
    print(hdr)
    for s in sets:
        row = run_set(s, args.shared, args.rtol)
        rows.append(row)
        cells = " ".join(f"{row[c][0]:>12d}" if c in row else f"{'-':>12s}" for c in COLS)
        pa = row["padj<0.1"]
        print(f"{s:28s} {row['genes']:>6d} {cells}  {pa[0]}/{pa[1]}/{pa[2]}/{pa[3]}  {row['trend']}", flush=True)
    print("largest relative differences:")
    for row in rows:
        print(f"{row['set']:28s} " + " ".join(f"{c}={row[c][1]:.2g}" for c in COLS if c in row))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
