"""Progress bars: iterations used against the limit (not a bar filling to max_iter), the convergence criterion
against its tolerance, silent at ``verbosity=0``, and never wider than 100 columns."""

from __future__ import annotations

import scanpy as sc

from gpuc._utils import MAX_COLUMNS, iteration_progress, progress


def test_iteration_bar_shows_iterations_against_limit_and_criterion(tty_stderr) -> None:
    terminal = tty_stderr()
    with iteration_progress(1000, "HALS k=7", file=terminal, mininterval=0) as bar:
        bar.update(5)
        bar.criterion(3.2e-4, 1e-6)
        bar.update(32)
        bar.criterion(8e-7, 1e-6)
        bar.refresh()
    last = terminal.lines()[-1]
    assert last.startswith("HALS k=7: 37 it (limit 1000), change 8e-07 (tol 1e-06 reached) [")
    assert "%" not in last and "|" not in last  # no bar filling up to max_iter, no ETA to the limit


def test_bars_are_silent_at_verbosity_zero(tty_stderr) -> None:
    terminal = tty_stderr()
    sc.settings.verbosity = 0  # the fixture restores it
    with iteration_progress(100, "metacells", file=terminal) as bar:
        bar.update(10)
        bar.criterion(1.0, 1e-3)
    with progress(total=3, desc="k sweep", file=terminal) as bar:
        bar.update(3)
    assert terminal.getvalue() == ""


def test_bars_fit_100_columns(tty_stderr) -> None:
    terminal = tty_stderr()
    with progress(total=11, desc="k sweep " + "x" * 150, file=terminal, mininterval=0) as bar:
        bar.update(4)
    with iteration_progress(10**6, "metacells " + "y" * 150, file=terminal, mininterval=0) as bar:
        bar.update(12)
        bar.criterion(0.5, 1e-5)
    lines = terminal.lines()
    assert lines
    assert max(len(line) for line in lines) <= MAX_COLUMNS
