"""Loaders for the R reference fixtures in tests/data/deseq (copied from ../shared/data/deseq_refs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

REFS = Path(__file__).resolve().parents[1] / "data" / "deseq"

DESIGNS = {
    "single_factor": "~condition",
    "single_factor_meanfit": "~condition",
    "multi_factor": "~group + condition",
    "continuous": "~group + condition + measurement",
    "wide": "~group + condition",
    "large_counts": "~condition",
}


def counts_and_metadata(case: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Samples x genes counts and sample metadata of a PyDESeq2 reference case."""
    r = REFS / "refs"
    if case in ("single_factor", "single_factor_meanfit", "multi_factor"):
        c = pd.read_csv(r / "synthetic" / "test_counts.csv.gz", index_col=0).T
        m = pd.read_csv(r / "synthetic" / "test_metadata.csv.gz", index_col=0)
    elif case == "large_counts":
        c = pd.read_csv(r / "large_counts" / "test_counts_from_inline_test.csv.gz", index_col=0)
        m = pd.read_csv(r / "large_counts" / "test_metadata_from_inline_test.csv.gz", index_col=0)
        if c.shape[0] != m.shape[0]:
            c = c.T
    else:
        c = pd.read_csv(r / case / "test_counts.csv.gz", index_col=0).T
        m = pd.read_csv(r / case / "test_metadata.csv.gz", index_col=0)
    return c, m


def r_file(case: str, name: str) -> pd.DataFrame:
    """An R DESeq2 1.34 output shipped with PyDESeq2 (tests/data/<case>/<name>.csv)."""
    return pd.read_csv(REFS / "refs" / case / f"{name}.csv.gz", index_col=0)


def r_stage(case: str, what: str) -> pd.DataFrame:
    """An R DESeq2 1.38.3 intermediate (<case>_<what>.csv)."""
    return pd.read_csv(REFS / "refs" / "r_1.38.3" / f"{case}_{what}.csv.gz", index_col=0)


def r_globals(case: str) -> dict:
    g = pd.read_csv(REFS / "refs" / "r_1.38.3" / f"{case}_globals.csv.gz")
    return dict(zip(g["key"], g["value"], strict=True))


def max_rel(a: np.ndarray, b: np.ndarray) -> float:
    """Max relative error over entries where the reference is finite and non-zero."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    ok = np.isfinite(b) & (b != 0)
    return float(np.max(np.abs(a[ok] - b[ok]) / np.abs(b[ok])))


def assert_res_close(
    res: pd.DataFrame,
    ref: pd.DataFrame,
    tol: float,
    cols: tuple[str, ...] = ("log2FoldChange", "lfcSE", "pvalue", "padj"),
) -> None:
    """Same NaN pattern for pvalue and padj, then max relative error below tol for each column."""
    for c in ("pvalue", "padj"):
        np.testing.assert_array_equal(
            np.isnan(res[c].to_numpy()), ref[c].isna().to_numpy(), err_msg=f"NaN pattern of {c}"
        )
    for c in cols:
        err = max_rel(res[c].to_numpy(), ref[c].to_numpy())
        assert err < tol, f"{c}: max relative error {err:.3g} >= {tol}"
