"""CPU and GPU paths agree to 1e-6 relative (skipped without a usable GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import gpuc


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    ok = np.isfinite(b) & (np.abs(b) > 1e-12)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    return float(np.max(np.abs(a[ok] - b[ok]) / np.abs(b[ok]))) if ok.any() else 0.0


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("design", "kwargs"),
    [
        ("~condition", {"lfc_shrink": "normal"}),
        ("~type + condition", {"lfc_shrink": "apeglm"}),
        ("~type + condition", {"test": "lrt", "reduced": "~type"}),
    ],
)
def test_cpu_gpu_parity_pasilla(design, kwargs):
    out = {}
    for dev in ("cpu", "gpu"):
        a = gpuc.datasets.pasilla()
        gpuc.tl.deseq(a, design, contrast=["condition", "treated", "untreated"], device=dev, **kwargs)
        out[dev] = a
    rc, rg = gpuc.get.deseq_results(out["cpu"]), gpuc.get.deseq_results(out["gpu"])
    for col in rc.columns:
        if col in ("padj",):
            continue
        assert _rel(rg[col].to_numpy(), rc[col].to_numpy()) < 1e-6, col
    for f in ("dispGeneEst", "dispFit", "dispersion"):
        assert _rel(out["gpu"].var[f"deseq_{f}"].to_numpy(), out["cpu"].var[f"deseq_{f}"].to_numpy()) < 1e-6, f
    np.testing.assert_array_equal(rc["padj"].isna(), rg["padj"].isna())


@pytest.mark.gpu
def test_gpu_vst_parity():
    a = gpuc.datasets.pasilla()
    b = a.copy()
    gpuc.tl.vst(a, device="cpu")
    gpuc.tl.vst(b, device="gpu")
    assert _rel(b.layers["vst"], a.layers["vst"]) < 1e-6
