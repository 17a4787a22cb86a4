"""The GPU code path of NMF on the stand-in GPU: the rank-batched HALS sweep's array code (never run by the CPU path,
where numba kernels take over) and the tools on device-resident data, against the CPU path.

The stand-in's arrays refuse implicit host conversion and host arrays in device work (gpuc._testing.standin), so a
hidden host round trip or a numpy-only call on the GPU path fails here.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import gpuc
from gpuc._backend import get_backend, is_cupy_array
from gpuc._testing.standin import DeviceArray, Transfers
from gpuc._utils import derive_seed
from gpuc.nmf._hals import Operator, fit_hals, fit_hals_groups

CPU = get_backend("cpu")
GROUPS = [(4, 3), (2, 3), (3, 3)]


@pytest.mark.slow
@pytest.mark.parametrize("sparse", [True, False])
def test_rank_batched_sweep_on_device_equals_cpu(standin_gpu, cnmf_matrix, sparse, disable_numba):
    # the engines' array code on both sides: the fused kernels' parity is tests/nmf/test_nmf_gpu_kernels.py's (the
    # CUDA simulator runs each of their reduction blocks as Python threads, minutes for a whole sweep)
    disable_numba()
    v = cnmf_matrix[:300, :200]
    v = sp.csr_matrix(v) if sparse else v
    groups = [(k, [derive_seed(5, k, r) for r in range(n)]) for k, n in GROUPS]
    op_d = Operator.build(standin_gpu, standin_gpu.asarray(v), dtype=np.float64)
    assert is_cupy_array(op_d.v)
    Transfers.reset()
    # 60 iterations: under the CUDA simulator every block of the reduction kernels is a Python thread
    dev = fit_hals_groups(standin_gpu, op_d, groups, max_iter=60)
    # during the fit only the per-run losses come back (8 bytes per active run per check)
    assert Transfers.to_host <= 8 * 9 * 60 // 5
    assert all(isinstance(r.usages, DeviceArray) for r in dev)
    cpu = fit_hals_groups(CPU, Operator.build(CPU, v, dtype=np.float64), groups, max_iter=60)
    for (k, seeds), rd, rc in zip(groups, dev, cpu, strict=True):
        np.testing.assert_array_equal(rd.n_iter, rc.n_iter)
        np.testing.assert_allclose(rd.losses, rc.losses, rtol=1e-9)
        np.testing.assert_allclose(rd.usages.get(), rc.usages, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(rd.spectra_t.get(), rc.spectra_t, rtol=1e-5, atol=1e-7)
        # and every rank's runs are bit-identical to that rank fitted alone on the device
        alone = fit_hals(standin_gpu, op_d, k, seeds, max_iter=60)
        np.testing.assert_array_equal(alone.losses, rd.losses)
        np.testing.assert_array_equal(alone.usages.get(), rd.usages.get())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::gpuc.ConvergenceWarning")
@pytest.mark.parametrize("sparse", [True, False])
def test_tools_on_device_resident_data_equal_cpu(on_device, program_factory, sparse, disable_numba):
    disable_numba()  # array code on both sides, as above
    a = program_factory(n_cells=150, n_genes=60, k=3, seed=1, sparse=sparse)
    d = on_device(a)
    assert is_cupy_array(d.X) and is_cupy_array(d.layers["counts"])
    # 60 iterations (a ConvergenceWarning): under the CUDA simulator every reduction block is a Python thread
    kw = {"n_runs": 6, "dtype": "float64", "random_state": 0, "max_iter": 60}
    gpuc.tl.nmf_k_sweep(a, k_range=[2, 3, 4], device="cpu", **kw)
    Transfers.reset()
    gpuc.tl.nmf_k_sweep(d, k_range=[2, 3, 4], layer="counts", **kw)  # auto: the layer is on the GPU
    assert d.uns["nmf_k_sweep"]["device"] == "gpu"
    want, got = a.uns["nmf_k_sweep"]["table"], d.uns["nmf_k_sweep"]["table"]
    pd.testing.assert_frame_equal(got, want, rtol=1e-6, check_exact=False)
    gpuc.tl.consensus_nmf(a, 3, device="cpu", **kw)
    gpuc.tl.consensus_nmf(d, 3, **kw)
    assert isinstance(d.obsm["X_nmf"], np.ndarray) and isinstance(d.varm["nmf_spectra"], np.ndarray)
    np.testing.assert_allclose(d.obsm["X_nmf"], a.obsm["X_nmf"], rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(d.varm["nmf_spectra"], a.varm["nmf_spectra"], rtol=1e-5, atol=1e-10)
    assert abs(d.uns["nmf"]["stability"] - a.uns["nmf"]["stability"]) < 1e-8
    # cNMF's all-gene outputs, computed on the device where X lives, written as host arrays
    for slot, name in (("obsm", "X_nmf_refit"), ("varm", "nmf_spectra_tpm"), ("varm", "nmf_spectra_score")):
        got, want = getattr(d, slot)[name], getattr(a, slot)[name]
        assert isinstance(got, np.ndarray), name
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7 * np.abs(want).max(), err_msg=name)
    assert is_cupy_array(d.X)


def test_default_float32_on_device_agrees_with_cpu(on_device, program_factory):
    a = program_factory(n_cells=150, n_genes=60, k=3, seed=2)
    d = on_device(a)
    gpuc.tl.consensus_nmf(a, 3, n_runs=6, device="cpu")
    gpuc.tl.consensus_nmf(d, 3, n_runs=6)
    assert d.uns["nmf"]["dtype"] == a.uns["nmf"]["dtype"] == "float32"
    cos = (d.varm["nmf_spectra"] * a.varm["nmf_spectra"]).sum(0) / (
        np.linalg.norm(d.varm["nmf_spectra"], axis=0) * np.linalg.norm(a.varm["nmf_spectra"], axis=0)
    )
    assert cos.min() > 0.999
