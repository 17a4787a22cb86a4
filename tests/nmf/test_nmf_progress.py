"""The NMF tools' progress: iterations used against the limit and the loss change against ``tol`` (not a bar
filling up to ``max_iter``), and nothing at all at ``verbosity=0``."""

from __future__ import annotations

import functools
import re

import pytest
import scanpy as sc

import gpuc
from gpuc._utils import iteration_progress


@pytest.fixture
def terminal(tty_stderr, monkeypatch: pytest.MonkeyPatch):
    """``tty_stderr``, with every state of the bar drawn (by default tqdm draws at most every 0.1 s)."""
    monkeypatch.setattr("gpuc.tl._nmf.iteration_progress", functools.partial(iteration_progress, mininterval=0))
    return tty_stderr


# a bar's last state before it closes: "HALS k=3: 45 it (limit 500), change 4.1e-07 (tol 1e-06 reached) [00:00]"
_CONVERGED = re.compile(r"^HALS k=(\S+): (\d+) it \(limit 500\), change \S+ \(tol 1e-06 reached\) \[")


@pytest.mark.parametrize("tool", ["consensus_nmf", "nmf_k_sweep"])
def test_nmf_bar_shows_iterations_and_convergence(programs, terminal, tool):
    out = terminal()
    opts = {"n_runs": 3, "layer": "counts", "device": "cpu", "random_state": 0}
    if tool == "consensus_nmf":
        gpuc.tl.consensus_nmf(programs, 3, **opts)
    else:
        gpuc.tl.nmf_k_sweep(programs, [2, 3], **opts)
    lines = out.lines()
    assert lines, "no progress shown"
    assert all("%" not in line and "|" not in line for line in lines)  # no bar filling up to max_iter
    reached = [m for m in map(_CONVERGED.match, lines) if m]
    assert reached, lines[-3:]
    assert reached[-1][1] == ("3" if tool == "consensus_nmf" else "2..3")
    assert 0 < int(reached[-1][2]) < 500
    assert max(len(line) for line in lines) <= 100


def test_nmf_is_silent_at_verbosity_zero(programs, terminal):
    out = terminal()
    sc.settings.verbosity = 0  # the fixture restores it
    gpuc.tl.consensus_nmf(programs, 3, n_runs=3, layer="counts", device="cpu", random_state=0)
    gpuc.tl.nmf_k_sweep(programs, [2, 3], n_runs=3, layer="counts", device="cpu", random_state=0)
    assert out.getvalue() == ""
