"""DESeq2 fitted as gene blocks (:func:`gpuc.deseq._blocks.run_analysis_blocked`) against one in-process fit.

Exactness: with one block the blocked run makes the same calls on the same arrays as :func:`run_analysis`, so every
field is bit-identical. With several blocks the global steps see the same vectors in the same order, and the counts,
size factors and every discrete field (masks, convergence flags, iteration counts, outlier and replacement flags,
filter thresholds) stay exactly equal; floating-point fields agree to ``RTOL`` = 1e-12 relative. They are not always
bit-identical because OpenBLAS computes a row of a matrix product with another micro-kernel when it is a batch's
trailing odd row (and numpy calls gemv for a one-row product): the same gene gets its last bit from a different
kernel when it sits at the end of a block, or alone in a block's fallback or refit subset, and IRLS / Newton stopping
carries that to ~1e-14 (observed: at most 2e-13, in the likelihood-ratio statistic, a difference of deviances).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import gpuc
from gpuc._backend import get_backend
from gpuc._dask import DaskTaskError
from gpuc.deseq._analysis import plan_analysis, run_analysis
from gpuc.deseq._blocks import default_block_genes, gene_spans, run_analysis_blocked

RTOL = 1e-12
CPU = get_backend("cpu")


def _outlier_data() -> tuple[np.ndarray, pd.DataFrame]:
    """16 samples (8 per condition, so R's min_replicates=7 allows replacement) x 700 NB genes with 40 planted
    outlier counts, an all-zero block (genes 200-299) and a gene whose only count is an outlier (becomes all zero).
    """
    rng = np.random.default_rng(1)
    n_per, n_genes = 8, 700
    n = 2 * n_per
    mean = 2 ** rng.normal(5, 2, n_genes)
    lfc = np.where(rng.random(n_genes) < 0.2, rng.normal(0, 2, n_genes), 0.0)
    cond = np.repeat(["A", "B"], n_per)
    sf = np.exp(rng.normal(0, 0.2, n))
    mu = sf[:, None] * mean[None, :] * 2 ** np.outer(cond == "B", lfc)
    disp = 0.05 + 2 / mean
    y = rng.negative_binomial(1 / disp, 1 / (1 + mu * disp))
    planted = rng.choice(n_genes, 40, replace=False)
    y[rng.integers(0, n, 40), planted] *= 30
    y[:, 200:300] = 0
    y[:, 20] = 0
    y[3, 20] = 500
    obs = pd.DataFrame({"condition": pd.Categorical(cond)}, index=[f"s{i}" for i in range(n)])
    return y.astype(np.int64), obs


def _cases() -> dict:
    pb = gpuc.datasets.pasilla()
    x, obs, names = np.asarray(pb.X), pb.obs, pb.var_names
    y, sim_obs = _outlier_data()
    sim_names = pd.Index([f"g{j}" for j in range(y.shape[1])])
    con = ["condition", "treated", "untreated"]
    return {
        "pasilla ~condition": (x, plan_analysis(obs, "~condition", con), names),
        "pasilla ~type + condition": (x, plan_analysis(obs, "~type + condition", con), names),
        "pasilla LRT": (x, plan_analysis(obs, "~type + condition", con, reduced="~type"), names),
        "outliers": (y, plan_analysis(sim_obs, "~condition", ["condition", "B", "A"]), sim_names),
    }


@pytest.fixture(scope="module")
def cases() -> dict:
    """Per case: counts, plan, gene names and the in-process :func:`run_analysis` result."""
    out = {}
    for name, (x, plan, names) in _cases().items():
        out[name] = (x, plan, names, run_analysis(CPU, x, plan, gene_names=names, n_jobs=1))
    return out


def _equal(a, b, what: str, *, exact: bool) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, what
    if exact or a.dtype.kind in "biuO":
        np.testing.assert_array_equal(a, b, err_msg=what)  # NaN-aware: NaN equals NaN
    else:
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=0.0, err_msg=what)  # see the module docstring


def assert_same_analysis(got, ref, *, exact: bool) -> None:
    """Every fit field, table and filtering summary of ``got`` equals ``ref`` (bit for bit with ``exact``)."""
    f, g = ref.fit, got.fit
    assert g.genes.keys() == f.genes.keys()
    for k in f.genes:
        _equal(g.genes[k], f.genes[k], k, exact=exact)
    # by construction: the counts and the size factors come from the same values in the same order
    for k in ("counts", "size_factors", "design"):
        _equal(getattr(g, k), getattr(f, k), k, exact=True)
    for k in ("beta", "cov", "mu", "cooks"):
        _equal(getattr(g, k), getattr(f, k), k, exact=exact)
    for k in ("lrt_stat", "lrt_pvalue"):
        assert (getattr(g, k) is None) == (getattr(f, k) is None), k
        if getattr(f, k) is not None:
            _equal(getattr(g, k), getattr(f, k), k, exact=exact)
    assert g.trend.kind == f.trend.kind
    td, fd = g.trend.to_dict(), f.trend.to_dict()
    assert td.keys() == fd.keys()
    for k in fd:
        if k != "type":
            _equal(td[k], fd[k], f"trend {k}", exact=exact)
    _equal(g.var_log_disp, f.var_log_disp, "var_log_disp", exact=exact)
    _equal(g.prior_var, f.prior_var, "prior_var", exact=exact)
    for k in ("prior_var_method", "cooks_cutoff", "size_factor_type", "lrt_df", "messages"):
        assert getattr(g, k) == getattr(f, k), k
    assert got.tables.keys() == ref.tables.keys()
    for c, table in ref.tables.items():
        assert list(got.tables[c].columns) == list(table.columns)
        assert got.tables[c].index.equals(table.index)
        for col in table:
            _equal(got.tables[c][col].to_numpy(), table[col].to_numpy(), f"{c} {col}", exact=exact)
        assert got.filtering[c].keys() == ref.filtering[c].keys()
        for k, v in ref.filtering[c].items():
            # thresholds, theta and rejection counts are discrete choices: equal; the lowess curve is a float fit
            _equal(got.filtering[c][k], v, f"{c} {k}", exact=exact or k != "lowess")


def _blocked(case, block_genes: int, **kw):
    x, plan, names, _ = case
    return run_analysis_blocked(CPU, x, plan, gene_names=names, block_genes=block_genes, n_jobs=1, **kw)


# one block; 7 blocks (uneven last block); smaller uneven blocks
@pytest.mark.parametrize(
    ("name", "blocks"),
    [
        ("pasilla ~condition", [None, 7, 3000]),
        ("pasilla ~type + condition", [None, 7]),
        ("pasilla LRT", [None, 3000]),
        ("outliers", [None, 7, 100, 97]),  # 100: genes 200-299 form a block without any count
    ],
)
def test_blocks_match_in_process(cases, name: str, blocks: list) -> None:
    case = cases[name]
    n_genes = case[0].shape[1]
    for b in blocks:
        block_genes = n_genes if b is None else (-(-n_genes // b) if b == 7 else b)
        got = _blocked(case, block_genes)
        assert_same_analysis(got, case[3], exact=b is None)
    if name == "outliers":  # the case does exercise the outlier replacement and refit
        fit = case[3].fit
        assert fit.genes["refitted"].sum() > 10 and fit.genes["newAllZero"].sum() == 1


def test_size_factor_variants(cases) -> None:
    """ratio -> poscounts fallback (every gene has a zero), poscounts, iterative, given: same size factors, notes."""
    x, plan, names, _ = cases["outliers"]
    x = x[:, :300].copy()
    x[np.arange(300) % x.shape[0], np.arange(300)] = 0  # a zero in every gene
    names = names[:300]
    kinds = []
    for sf in ("ratio", "poscounts", "iterative", np.linspace(0.8, 1.2, x.shape[0])):
        ref = run_analysis(CPU, x, plan, gene_names=names, size_factors=sf, n_jobs=1)
        got = run_analysis_blocked(CPU, x, plan, gene_names=names, size_factors=sf, block_genes=70, n_jobs=1)
        np.testing.assert_array_equal(got.fit.size_factors, ref.fit.size_factors)
        assert got.fit.size_factor_type == ref.fit.size_factor_type
        assert got.fit.messages == ref.fit.messages
        assert_same_analysis(got, ref, exact=False)
        kinds.append((ref.fit.size_factor_type, len(ref.fit.messages)))
    assert kinds == [("poscounts", 1), ("poscounts", 0), ("iterative", 0), ("given", 0)]


@pytest.mark.parametrize("method", ["normal", "apeglm"])
def test_lfc_shrink(cases, method: str) -> None:
    """Shrinkage runs on the assembled fit, so the shrunken columns follow the fit's tolerance."""
    x, plan, names, _ = cases["outliers"]
    ref = run_analysis(CPU, x, plan, gene_names=names, lfc_shrink=method, n_jobs=1)
    got = run_analysis_blocked(CPU, x, plan, gene_names=names, lfc_shrink=method, block_genes=97, n_jobs=1)
    assert "log2FoldChange_shrunk" in got.tables[plan.contrasts[0].name]
    assert_same_analysis(got, ref, exact=False)


def test_block_helpers() -> None:
    # ~256 MB of working memory per block: (14 n + 100) * 8 bytes per gene
    assert default_block_genes(1000) == 2**28 // (14100 * 8)
    assert 255e6 < default_block_genes(1000) * (14 * 1000 + 100) * 8 <= 2**28
    assert gene_spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert gene_spans(8, 8) == [(0, 8)]


def test_bad_block_in_process(cases) -> None:
    x, plan, names, _ = cases["outliers"]
    x = x.copy()
    x[2, 150] = -1
    with pytest.raises(ValueError, match=r"genes \[150\]"):
        run_analysis_blocked(CPU, x, plan, gene_names=names, block_genes=100, size_factors=np.ones(x.shape[0]))
    with pytest.raises(ValueError, match="block_genes"):
        run_analysis_blocked(CPU, x, plan, gene_names=names, block_genes=0)


# --------------------------------------------------------------------------------------------------------------------
# a real cluster: two worker processes, one thread each
# --------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dask_client():
    distributed = pytest.importorskip("distributed")
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, silence_logs=40
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        yield client


def test_cluster_matches_in_process(cases, dask_client) -> None:
    for name, b in (("pasilla LRT", 4000), ("outliers", 100)):
        case = cases[name]
        local = _blocked(case, b)
        got = _blocked(case, b, client=dask_client)
        # the same units with the same inputs on one thread each: bit for bit
        assert_same_analysis(got, local, exact=True)
        assert_same_analysis(got, case[3], exact=False)


def test_cluster_failing_block_names_it(cases, dask_client) -> None:
    x, plan, names, _ = cases["outliers"]
    x = x.copy()
    x[5, 150] = -3
    with pytest.raises(DaskTaskError, match=r"deseq failed on genes 100-199: ValueError: .*genes \[150\]"):
        run_analysis_blocked(
            CPU, x, plan, gene_names=names, block_genes=100, size_factors=np.ones(x.shape[0]), client=dask_client
        )
