"""Property-based tests (Hypothesis) over AnnData shapes, dtypes, sparse formats, names and labels, for each tool
(issue 41): no internal error (a call either returns or raises an error that gpuc itself raises, with a message), no
partial write (the AnnData is unchanged after an error, and holds every output after a success), and the same answer
under a permutation of samples or genes where the algorithm defines one (pseudobulk, DESeq2; NMF and metacells draw
random initial values per position, so there the properties are the first two)."""

from __future__ import annotations

import warnings
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import gpuc

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

GPUC = Path(gpuc.__file__).parent
# fixed examples (derandomize: no database, the same examples in every run), no time limit per example
SETTINGS = settings(
    deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck), print_blob=True
)

# labels anndata can hold (every printable or not character but NUL and lone surrogates, which h5py cannot encode)
LABEL = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=4)
NAME = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), min_size=1, max_size=6)


def _raised_by_gpuc(err: BaseException) -> bool:
    """Whether ``err`` was raised by a ``raise`` in gpuc's own code (a checked, worded error), not deep in a library."""
    tb = err.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and Path(last).is_relative_to(GPUC)


def _call(adata, fn, assert_same):
    """Run ``fn(adata)``: return its result, or the error after checking it is a clear one and nothing was written."""
    before = adata.copy()
    error = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(adata), None
    except (TypeError, ValueError, KeyError, MemoryError) as err:
        error = err
    assert _raised_by_gpuc(error), f"internal error: {error!r}"
    assert str(error), "an error without a message"
    assert_same(adata, before)
    return None, error


@st.composite
def matrices(draw, n_obs, n_vars, *, integers=False):
    """A counts matrix in one of the dtypes and formats AnnData holds."""
    dtype = draw(
        st.sampled_from([np.int64, np.int32, np.float32, np.float64] if integers else [np.float32, np.float64])
    )
    fmt = draw(st.sampled_from(["dense", "csr", "csc"]))
    seed = draw(st.integers(0, 2**16))
    x = np.random.default_rng(seed).poisson(draw(st.sampled_from([0.3, 3.0, 30.0])), (n_obs, n_vars)).astype(dtype)
    return x if fmt == "dense" else getattr(sp, f"{fmt}_matrix")(x)


@st.composite
def unique_names(draw, n):
    return draw(st.lists(NAME, min_size=n, max_size=n, unique=True))


@st.composite
def cells(draw):
    n_obs, n_vars = draw(st.integers(4, 30)), draw(st.integers(1, 8))
    a = ad.AnnData(draw(matrices(n_obs, n_vars, integers=True)))
    a.obs_names = draw(unique_names(n_obs))
    a.var_names = draw(unique_names(n_vars))
    a.obs["sample"] = draw(st.lists(LABEL, min_size=n_obs, max_size=n_obs))
    a.obs["group"] = draw(st.lists(st.sampled_from(["T", "B", "", "."]), min_size=n_obs, max_size=n_obs))
    return a


def _sorted_frame(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_index(axis=0).sort_index(axis=1)


@settings(SETTINGS, max_examples=25)
@given(a=cells(), perm_seed=st.integers(0, 2**16), min_cells=st.integers(1, 3))
def test_pseudobulk(same, a, perm_seed, min_cells):
    fn = lambda x: gpuc.tl.pseudobulk(x, "sample", groupby="group", min_cells=min_cells)  # noqa: E731
    pb, err = _call(a, fn, same)
    if err is not None:
        return
    rng = np.random.default_rng(perm_seed)
    b = a[rng.permutation(a.n_obs), rng.permutation(a.n_vars)].copy()
    pb2, err2 = _call(b, fn, same)
    assert err2 is None
    x1 = pd.DataFrame(np.asarray(pb.X), index=pb.obs_names, columns=pb.var_names)
    x2 = pd.DataFrame(np.asarray(pb2.X), index=pb2.obs_names, columns=pb2.var_names)
    pd.testing.assert_frame_equal(_sorted_frame(x1), _sorted_frame(x2))


@st.composite
def bulks(draw):
    n_per, n_vars = draw(st.integers(2, 4)), draw(st.integers(3, 10))
    n = 2 * n_per
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    counts = rng.negative_binomial(5, 0.1, (n, n_vars)).astype(draw(st.sampled_from([np.int64, np.float64])))
    fmt = draw(st.sampled_from(["dense", "csr"]))
    a = ad.AnnData(counts if fmt == "dense" else sp.csr_matrix(counts))
    a.obs_names = draw(unique_names(n))
    a.var_names = draw(unique_names(n_vars))
    levels = draw(st.lists(LABEL, min_size=2, max_size=2, unique=True))
    a.obs["condition"] = pd.Categorical(np.repeat(levels, n_per))
    return a


@pytest.mark.slow
@settings(SETTINGS, max_examples=6)
@given(a=bulks(), perm_seed=st.integers(0, 2**16))
def test_deseq(same, a, perm_seed):
    fn = lambda x: gpuc.tl.deseq(x, "~condition", fit_type="mean", device="cpu")  # noqa: E731
    rng = np.random.default_rng(perm_seed)
    b = a[rng.permutation(a.n_obs), rng.permutation(a.n_vars)].copy()
    _, err = _call(a, fn, same)
    if err is not None:
        return
    assert "results" in a.uns["deseq"] and "deseq_size_factors" in a.obs  # every output, not some
    _, err = _call(b, fn, same)
    assert err is None
    r1, r2 = gpuc.get.deseq_results(a), gpuc.get.deseq_results(b).loc[a.var_names]
    pd.testing.assert_frame_equal(r1, r2, rtol=1e-6, atol=1e-10)


@pytest.mark.slow
@settings(SETTINGS, max_examples=6)
@given(data=st.data())
def test_consensus_nmf(same, data):
    n_obs, n_vars = data.draw(st.integers(4, 30)), data.draw(st.integers(3, 12))
    a = ad.AnnData(data.draw(matrices(n_obs, n_vars)))
    a.var_names = data.draw(unique_names(n_vars))
    k = data.draw(st.integers(2, 4))
    _, err = _call(a, lambda x: gpuc.tl.consensus_nmf(x, k, n_runs=3, mask_var=None, max_iter=30), same)
    if err is None:
        assert {"X_nmf"} <= set(a.obsm) and "nmf_spectra" in a.varm and "nmf" in a.uns


@pytest.mark.slow
@settings(SETTINGS, max_examples=5)
@given(data=st.data())
def test_metacells(same, data):
    n_obs = data.draw(st.integers(3, 40))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    a = ad.AnnData(np.ones((n_obs, 2), dtype=np.float32))
    a.obs_names = data.draw(unique_names(n_obs))
    scale = data.draw(st.sampled_from([1.0, 1e-3, 1e6]))
    a.obsm["X_pca"] = rng.normal(size=(n_obs, data.draw(st.integers(1, 5)))).astype(np.float32) * scale
    k = data.draw(st.integers(1, 5))
    _, err = _call(a, lambda x: gpuc.tl.metacells(x, k, n_neighbors=3, n_waypoint_eigs=2, max_iter=3, min_iter=1), same)
    if err is None:
        assert "metacell" in a.obs and "metacell_weights" in a.obsm and "metacell" in a.uns
