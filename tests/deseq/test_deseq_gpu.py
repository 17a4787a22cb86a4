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
def test_cpu_gpu_parity_pasilla(genes_close, design, kwargs):
    out = {}
    for dev in ("cpu", "gpu"):
        a = gpuc.datasets.pasilla()
        gpuc.tl.deseq(a, design, contrast=["condition", "treated", "untreated"], device=dev, **kwargs)
        out[dev] = a
    rc, rg = gpuc.get.deseq_results(out["cpu"]), gpuc.get.deseq_results(out["gpu"])
    # R's dispersion search on two devices: genes whose decisions hinge on the last bits may differ
    # (assert_genes_close); apeglm and the LRT statistic stop at the optimisers' tolerances (~1e-6 absolute)
    for col in rc.columns:
        genes_close(rg[col], rc[col], 1e-6, atol=1e-6, err_msg=col)
    for f in ("dispGeneEst", "dispFit", "dispMAP", "dispersion"):
        genes_close(out["gpu"].var[f"deseq_{f}"], out["cpu"].var[f"deseq_{f}"], 1e-8, err_msg=f)
    np.testing.assert_array_equal(rc["padj"].isna(), rg["padj"].isna())


@pytest.mark.gpu
def test_gpu_vst_parity():
    a = gpuc.datasets.pasilla()
    b = a.copy()
    gpuc.tl.vst(a, device="cpu")
    gpuc.tl.vst(b, device="gpu")
    assert _rel(b.layers["vst"], a.layers["vst"]) < 1e-6


@pytest.mark.gpu
def test_gpu_parity_local_trend_near_poisson(genes_close):
    """Near-Poisson counts: the parametric trend fails and the local fit takes over; its input (gene-wise estimates
    >= 1e-7, some in the flat region of the likelihood) must come out the same on both devices."""
    from gpuc._testing.simulated import near_poisson_adata

    out = {}
    for dev in ("cpu", "gpu"):
        a = near_poisson_adata(2000, 1, 10)
        gpuc.tl.deseq(a, "~condition", contrast=["condition", "B", "A"], device=dev)
        out[dev] = a
    assert out["gpu"].uns["deseq"]["trend"]["type"] == out["cpu"].uns["deseq"]["trend"]["type"] == "local"
    for f in ("dispFit", "dispMAP", "dispersion"):
        genes_close(out["gpu"].var[f"deseq_{f}"], out["cpu"].var[f"deseq_{f}"], 1e-6, err_msg=f)
    rc, rg = gpuc.get.deseq_results(out["cpu"]), gpuc.get.deseq_results(out["gpu"])
    for col in rc.columns:
        genes_close(rg[col], rc[col], 1e-6, atol=1e-9, err_msg=col)
