"""Issue 31, numbers: numeric arguments accept every real number type (numpy scalars, 0-d arrays, Fraction) with
one message shape for ranges; values that would overflow the working precision are computed in float64 or refused,
never written as NaN/inf; an extreme embedding gives the result of the unscaled one."""

from __future__ import annotations

from fractions import Fraction

import anndata as ad
import numpy as np
import pandas as pd
import pytest

import gpuc
from gpuc._errors import GpucWarning
from gpuc._validate import check_int, check_number

_NMF = {"n_runs": 3, "device": "cpu", "max_iter": 60, "mask_var": None}


@pytest.mark.parametrize("value", [0.5, np.float32(0.5), np.float64(0.5), np.array(0.5), Fraction(1, 2)])
def test_density_threshold_accepts_every_real_type(planted_programs, value):
    a = planted_programs(40, 24)
    ref = a.copy()
    gpuc.tl.consensus_nmf(ref, 3, density_threshold=0.5, **_NMF)
    gpuc.tl.consensus_nmf(a, 3, density_threshold=value, **_NMF)
    np.testing.assert_array_equal(a.obsm["X_nmf"], ref.obsm["X_nmf"])
    assert (
        a.uns["nmf"]["params"]["density_threshold"] == 0.5
        and type(a.uns["nmf"]["params"]["density_threshold"]) is float
    )


def test_numpy_scalars_everywhere(planted_programs):
    a = planted_programs(40, 24)
    gpuc.tl.consensus_nmf(
        a, np.int64(3), n_runs=np.int32(3), neighborhood=np.float32(0.5), tol=np.float32(1e-4), device="cpu",
        max_iter=np.int16(40), mask_var=None,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    b = ad.AnnData(rng.negative_binomial(5, 0.1, (8, 30)).astype(np.int64))
    b.obs["c"] = pd.Categorical(np.repeat(["A", "B"], 4))
    gpuc.tl.deseq(b, "~c", alpha=np.float32(0.1), lfc_threshold=np.int64(0), min_replicates=np.int8(7), device="cpu")
    assert b.uns["deseq"]["params"]["alpha"] == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        (
            {"density_threshold": 3.0},
            ValueError,
            r"density_threshold=3.0 is too large; it must be a number in \[0, 2\]",
        ),
        ({"density_threshold": np.float32(-1)}, ValueError, r"is too small; it must be a number in \[0, 2\]"),
        ({"density_threshold": float("nan")}, ValueError, "is not a number; it must be a number in"),
        ({"density_threshold": True}, TypeError, r"must be a real number in \[0, 2\], got True"),
        ({"density_threshold": "0.5"}, TypeError, "must be a real number"),
        ({"neighborhood": 0}, ValueError, r"neighborhood=0 is too small; it must be a number in \(0, 1\]"),
        ({"tol": np.float64(0)}, ValueError, r"it must be a number in \(0, inf\)"),
        ({"n_runs": 2.0}, TypeError, "n_runs must be an integer"),
        ({"n_runs": np.bool_(True)}, TypeError, "n_runs must be an integer"),
    ],
)
def test_one_message_shape_for_ranges(planted_programs, kwargs, err, match, unchanged):
    a = planted_programs(40, 24)
    with unchanged(a), pytest.raises(err, match=match):
        gpuc.tl.consensus_nmf(a, 3, **{**_NMF, **kwargs})


def test_check_helpers_agree_on_numpy_types():
    assert check_number("x", np.float16(0.25), low=0, high=1) == 0.25
    assert check_int("n", np.uint8(7), minimum=1) == 7
    with pytest.raises(ValueError, match=r"x=1.5 is too large; it must be a number in \[0, 1\)"):
        check_number("x", 1.5, low=0, high=1, high_open=True)


def test_counts_overflowing_float32_are_fitted_in_float64(planted_programs):
    a = planted_programs(40, 24)
    ref = a.copy()
    ref.X = ref.X.astype(np.float64)
    gpuc.tl.consensus_nmf(ref, 3, dtype="float64", **_NMF)
    a.X = a.X * np.float32(1e18)  # float32 holds the values, not their squares
    with pytest.warns(GpucWarning, match="runs in float64"):
        gpuc.tl.consensus_nmf(a, 3, **_NMF)
    u = a.uns["nmf"]
    assert u["dtype"] == "float64"
    assert np.isfinite(a.obsm["X_nmf"]).all() and np.isfinite(a.varm["nmf_spectra"]).all()
    assert np.isfinite(u["run_errors"]).all() and np.isfinite(u["rel_error"])
    assert u["rel_error"] == pytest.approx(ref.uns["nmf"]["rel_error"], rel=1e-3)
    np.testing.assert_allclose(a.varm["nmf_spectra"], ref.varm["nmf_spectra"], rtol=1e-3, atol=1e-6)


def test_overflowing_values_refused_with_explicit_float32_or_beyond_float64(planted_programs, unchanged):
    a = planted_programs(40, 24)
    a.X = a.X * np.float32(1e18)
    with unchanged(a), pytest.raises(ValueError, match="overflow float32; pass dtype='float64'"):
        gpuc.tl.consensus_nmf(a, 3, dtype="float32", **_NMF)
    b = planted_programs(40, 24)
    b.X = b.X.astype(np.float64) * 1e200
    with unchanged(b), pytest.raises(ValueError, match="overflow even float64"):
        gpuc.tl.nmf_k_sweep(b, [2, 3], **_NMF)


def _cells(n: int = 120, seed: int = 0) -> ad.AnnData:
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 5, (3, 4))
    a = ad.AnnData(np.zeros((n, 2), dtype=np.float32), obs=pd.DataFrame(index=[f"c{i}" for i in range(n)]))
    a.obsm["X_pca"] = (centers[np.arange(n) % 3] + rng.normal(0, 1, (n, 4))).astype(np.float32)
    return a


_MC = {"n_metacells": 4, "n_neighbors": 8, "n_waypoint_eigs": 4, "max_iter": 5, "min_iter": 1, "device": "cpu"}


@pytest.mark.parametrize("scale", [2.0**70, 2.0**-70, 1e19])
def test_extreme_embedding_gives_the_unscaled_result(scale):
    ref = _cells()
    gpuc.tl.metacells(ref, **_MC)
    a = _cells()
    a.obsm["X_pca"] = (a.obsm["X_pca"].astype(np.float64) * scale).astype(np.float32)
    gpuc.tl.metacells(a, **_MC)
    np.testing.assert_array_equal(a.obs["metacell"], ref.obs["metacell"])
    assert np.isfinite(a.uns["metacell"]["rss"]).all()
    if scale != 1e19:  # a power of two scales every float exactly: the same numbers
        np.testing.assert_array_equal(a.uns["metacell"]["rss"], ref.uns["metacell"]["rss"])
    q = gpuc.tl.metacell_quality(a, inplace=False, device="cpu")
    assert np.isfinite(q["compactness"]).all()
