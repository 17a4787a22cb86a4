"""DESeq2's optim refit (``fitNbinomGLMsOptim``: L-BFGS-B on the log2 posterior) against R 4.2.2 / DESeq2 1.38.3.

R refits every gene whose IRLS uses all its 100 iterations with ``optim(method = "L-BFGS-B")``; its answer is where
that search stops, so gpuc runs the same search in R's order of operations (``gpuc.deseq._optim``). The references
(``tests/data/deseq/rmath/make_optim_reference.R``) are C99 hex floats, compared exactly: R's ``dnbinom``, ``sum``,
an ``optim`` run on the Rosenbrock function, and the refit of 150 random pasilla genes (forced through optim, as
``forceOptim = TRUE``) and of 66 genes whose IRLS does not converge.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from gpuc._backend import get_backend
from gpuc._testing.standin import standin_backend
from gpuc.deseq._glm import LN2, fit_nb_glm, refit_with_optim
from gpuc.deseq._optim import NegativeLogPosterior, lbfgsb, log_nbinom_mu
from gpuc.deseq._rlinalg import r_sum

DATA = Path(__file__).parents[1] / "data" / "deseq" / "rmath"


def _hex(values) -> np.ndarray:
    return np.array([float.fromhex(v) for v in values])


def _pasilla_design() -> np.ndarray:
    """~type + condition with type's reference level paired-end (single-read: samples 1, 2 and 5)."""
    return np.c_[np.ones(7), [1, 1, 0, 0, 1, 0, 0.0], [0, 0, 0, 0, 1, 1, 1.0]]


@pytest.fixture(scope="module")
def pieces() -> pd.DataFrame:
    return pd.read_csv(DATA / "optim_pieces.csv", keep_default_na=False)


@pytest.fixture(scope="module")
def genes() -> dict:
    t = pd.read_csv(DATA / "optim_type_condition.csv")
    col = lambda stem, k: np.column_stack([_hex(t[f"{stem}{j}"]) for j in range(1, k + 1)])  # noqa: E731
    return {
        "set": t["set"].to_numpy(),
        "y": t[[f"y{j}" for j in range(1, 8)]].to_numpy(float),
        "sf": _hex(t.loc[0, [f"sf{j}" for j in range(1, 8)]]),
        "alpha": _hex(t["alpha"]),
        "b0": col("b0_", 3),
        "beta": col("beta_", 3),
        "iter": t["iter"].to_numpy(),
        "lfc": col("lfc_", 3),
        "se": col("se_", 3),
        "conv": t["conv"].to_numpy().astype(bool),
        "loglike": _hex(t["loglike"]),
    }


def test_dnbinom_is_r_bit_for_bit(pieces):
    """R's dnbinom(mu =, log = TRUE): dbinom_raw with Loader's stirlerr and bd0, zero counts, sizes up to 1e8."""
    t = pieces[pieces["what"] == "dnbinom"]
    got = [log_nbinom_mu(k, s, m) for k, m, s in zip(_hex(t["a"]), _hex(t["b"]), _hex(t["c"]), strict=True)]
    np.testing.assert_array_equal(got, _hex(t["value"]))


def test_sum_accumulates_as_r(pieces):
    """R's sum() adds in x87 extended precision before rounding once; a plain double sum differs on some rows."""
    t = pieces[pieces["what"] == "sum"]
    terms = [_hex(v.split(";")) for v in t["a"]]
    want = _hex(t["value"])
    np.testing.assert_array_equal([r_sum(v) for v in terms], want)
    assert any(math.fsum(v) != w or sum(v) != w for v, w in zip(terms, want, strict=True))


def test_lbfgsb_follows_r_on_rosenbrock(pieces):
    """A bounded Rosenbrock problem with an active bound: the same point, value, evaluations and code as R."""
    row = pieces[pieces["what"] == "rosenbrock"].iloc[0]

    def rosenbrock(x):
        a, b = x[1] - x[0] * x[0], 1 - x[0]
        return 100 * (a * a) + b * b

    res = lbfgsb(rosenbrock, np.array([-1.2, 1.0]), np.array([-2.0, -2.0]), np.array([2.0, 0.8]))
    np.testing.assert_array_equal(res.par, _hex(row["a"].split(";")))
    assert res.value == float.fromhex(row["value"])
    assert res.evaluations == int(row["b"])
    assert res.convergence == int(row["c"]) == 0


def test_optim_refit_is_r_bit_for_bit(genes):
    """Every gene through R's optim path from R's start (the IRLS coefficients where finite and |log2| < 30, else
    R's QR start): the log2 coefficients equal R's betaMatrix exactly, the unconverged genes' betaConv is optim's,
    and the log-likelihood R records (at the means floored at 0.5) is R's logLike."""
    x = _pasilla_design()
    log2e = math.log2(math.exp(1))
    for g in range(genes["y"].shape[0]):
        b = log2e * genes["beta"][g]
        start = b if np.isfinite(b).all() and (np.abs(b) < 30).all() else genes["b0"][g]
        objective = NegativeLogPosterior(genes["y"][g], genes["sf"], x, genes["alpha"][g], np.full(3, 1e-6))
        res = lbfgsb(objective, start, np.full(3, -30.0), np.full(3, 30.0))
        np.testing.assert_array_equal(res.par, genes["lfc"][g], err_msg=f"gene {g} ({genes['set'][g]})")
        assert objective.log_likelihood(res.par, 0.5) == genes["loglike"][g]
        if genes["iter"][g] == 100:
            assert (res.convergence == 0) == genes["conv"][g]


@pytest.mark.parametrize("device", ["cpu", "stand-in"])
def test_fit_nb_glm_refits_unconverged_genes_as_r(genes, device):
    """fit_nb_glm on the genes whose IRLS reaches 100 iterations (5 of them are the genes DESeq() refits on pasilla
    ~type + condition): coefficients, standard errors and betaConv as R's fitNbinomGLMs."""
    hard = genes["iter"] == 100
    assert hard.sum() == 66
    bk = get_backend("cpu") if device == "cpu" else standin_backend()
    y, alpha = bk.asarray(genes["y"][hard]), bk.asarray(genes["alpha"][hard])
    fit = fit_nb_glm(bk, y, bk.asarray(genes["sf"]), bk.asarray(_pasilla_design()), alpha)
    # on the CPU the IRLS is R's (QR) step for step, so optim starts where R's does and ends on R's doubles; the GPU
    # IRLS solves the normal equations, and optim's stopping rule turns that start's rounding into ~1e-7
    tol = 4e-16 if device == "cpu" else 1e-6
    lfc = np.asarray(bk.to_host(fit.beta)) / LN2
    np.testing.assert_allclose(lfc, genes["lfc"][hard], rtol=tol, atol=0)
    se = np.sqrt(np.einsum("gii->gi", np.asarray(bk.to_host(fit.cov)))) / LN2
    np.testing.assert_allclose(se, genes["se"][hard], rtol=max(tol, 1e-12), atol=0)
    np.testing.assert_array_equal(np.asarray(bk.to_host(fit.converged)), genes["conv"][hard])
    np.testing.assert_allclose(np.asarray(bk.to_host(fit.deviance)), -2 * genes["loglike"][hard], rtol=tol, atol=0)
    np.testing.assert_array_equal(np.asarray(bk.to_host(fit.iters)), 100)


def test_refit_starts_where_r_does(genes):
    """A gene whose IRLS coefficients are not finite (or reach 30 in log2 units) starts from R's QR start: feeding
    refit_with_optim non-finite IRLS coefficients gives the same answer as starting optim there by hand."""
    bk = get_backend("cpu")
    g = int(np.nonzero(genes["set"] == "unconverged_R")[0][0])
    x = _pasilla_design()
    y, alpha = genes["y"][g : g + 1], genes["alpha"][g : g + 1]
    b, conv, log_like = refit_with_optim(
        bk, y, genes["sf"], x, alpha, np.full((1, 3), np.nan), lambda_log2=np.full(3, 1e-6)
    )
    objective = NegativeLogPosterior(y[0], genes["sf"], x, alpha[0], np.full(3, 1e-6))
    res = lbfgsb(objective, genes["b0"][g], np.full(3, -30.0), np.full(3, 30.0))
    np.testing.assert_array_equal(b[0], res.par * LN2)
    assert bool(conv[0]) == (res.convergence == 0)
    assert log_like[0] == objective.log_likelihood(res.par, 0.5)
