"""GPU path (skipped without a CUDA device): the same solver and pipeline on cupy reproduce the reference."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_gpu_solver_reproduces_reference(mc_ref, mc_ref_kernel):
    from gpuc._backend import get_backend
    from gpuc.metacells import fit

    gpu = get_backend("gpu")
    res = fit(
        gpu,
        gpu.asarray(mc_ref_kernel),
        mc_ref["archetypes"],
        a0=gpu.asarray(mc_ref["A0"]),
        max_iter=50,
        min_iter=10,
        convergence_epsilon=1e-5,
    )
    assert res.n_iter == 33 and res.converged
    np.testing.assert_allclose(res.rss, mc_ref["rss"], rtol=1e-10)
    a = gpu.to_host(res.A).toarray()
    b = gpu.to_host(res.B).toarray()
    np.testing.assert_allclose(a, mc_ref["A"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(b, mc_ref["B"], rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.array([f"SEACell-{j}" for j in a.argmax(0)]), mc_ref["labels"])


def test_gpu_end_to_end_equals_cpu(pbmc68k, mc_ref):
    import gpuc

    gpu_ad = pbmc68k.copy()
    gpuc.tl.metacells(gpu_ad, convergence_epsilon=1e-5, max_iter=50, device="gpu")
    assert gpu_ad.uns["metacell"]["device"] == "gpu"
    np.testing.assert_array_equal(gpu_ad.obs["metacell"].astype(str).to_numpy(), mc_ref["labels"])
    np.testing.assert_allclose(gpu_ad.uns["metacell"]["rss"], mc_ref["rss"], rtol=1e-6)
