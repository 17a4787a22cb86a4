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
    for col in rc.columns:  # apeglm and the LRT statistic stop at the optimisers' tolerances (~1e-6 absolute)
        np.testing.assert_allclose(rg[col], rc[col], rtol=1e-6, atol=1e-6, equal_nan=True, err_msg=col)
    for f in ("dispFit", "dispersion"):
        assert _rel(out["gpu"].var[f"deseq_{f}"].to_numpy(), out["cpu"].var[f"deseq_{f}"].to_numpy()) < 1e-6, f
    ge_g, ge_c = out["gpu"].var["deseq_dispGeneEst"].to_numpy(), out["cpu"].var["deseq_dispGeneEst"].to_numpy()
    flat = ge_c < 1e-4  # flat likelihood near zero: both stop at the optimiser's tolerance, at different points
    assert _rel(ge_g[~flat], ge_c[~flat]) < 1e-6
    assert (ge_g[flat] < 1e-4).all()
    np.testing.assert_array_equal(rc["padj"].isna(), rg["padj"].isna())


@pytest.mark.gpu
def test_gpu_vst_parity():
    a = gpuc.datasets.pasilla()
    b = a.copy()
    gpuc.tl.vst(a, device="cpu")
    gpuc.tl.vst(b, device="gpu")
    assert _rel(b.layers["vst"], a.layers["vst"]) < 1e-6
