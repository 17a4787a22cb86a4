from __future__ import annotations

import pytest

from gpuc import _backend
from gpuc._utils import MAX_COLUMNS
from gpuc.cli import main


def test_info_prints_versions_and_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gpuc ")
    assert "anndata" in out and "device used:" in out
    assert max(len(line) for line in out.splitlines()) <= MAX_COLUMNS


def test_info_wraps_a_long_reason(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    reason = "cupy is not installed or failed to import (ImportError: " + "libcuda.so.1: cannot open " * 8 + ")"
    monkeypatch.setattr(_backend, "gpu_status", lambda: (False, reason))
    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= MAX_COLUMNS
    assert " ".join(line.strip() for line in lines).count("libcuda.so.1: cannot open") == 8


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"]])
def test_help_fits_100_columns(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal
    with pytest.raises(SystemExit):
        main(argv)
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= MAX_COLUMNS


def test_demo_refuses_unusable_gpu(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_backend, "gpu_status", lambda: (False, "cupy is not installed"))
    assert main(["demo", "--out", str(tmp_path / "d"), "--device", "gpu"]) == 1
    assert "no usable GPU" in capsys.readouterr().err
    assert not (tmp_path / "d" / "summary.tsv").exists()


def test_bad_subcommand_exits() -> None:
    with pytest.raises(SystemExit):
        main(["frobnicate"])


def test_info_reports_the_cores_and_how_they_were_derived(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import gpuc._utils as utils
    from gpuc._settings import settings

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"CPU cores available: {utils.available_cores()} (n_jobs=-1)" in out
    assert "n_jobs=None" in out
    report = {"online": 64, "affinity": 64, "quota": 2, "available": 2, "others_running": 5, "share": 1}
    monkeypatch.setattr(utils, "cores_report", lambda: report)
    assert main(["info"]) == 0
    out = " ".join(line.strip() for line in capsys.readouterr().out.splitlines())
    assert "CPU cores available: 2 (n_jobs=-1) = min(CPU affinity 64 of 64 online, cgroup CPU quota 2)" in out
    assert "n_jobs=None now: 1 thread = 2 available less the cores busy with 5 threads of other processes" in out
    monkeypatch.setattr(utils, "cores_report", lambda: {**report, "quota": None, "others_running": None, "share": 2})
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "no cgroup CPU quota" in out and "n_jobs=None: 2 threads (the machine's load is not readable here)" in out
    monkeypatch.setattr(settings, "n_jobs", 3)
    assert main(["info"]) == 0
    assert "n_jobs=None: 3 threads (settings.n_jobs = 3)" in capsys.readouterr().out
