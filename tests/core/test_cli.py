from __future__ import annotations

import pytest

from gpuc import _backend
from gpuc.cli import main


def test_info_prints_versions_and_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gpuc ")
    assert "anndata" in out and "device used:" in out


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
