"""Shared test configuration: the ``gpu`` mark skips without a usable CUDA device; ``shared_data`` locates ../shared."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuc._backend import gpu_status

ROOT = Path(__file__).resolve().parents[1]
TEST_DATA = ROOT / "tests" / "data"
SHARED_DATA = ROOT.parent / "shared" / "data"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ok, reason = gpu_status()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"no usable GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def test_data() -> Path:
    """Folder of the small fixtures shipped with the tests."""
    return TEST_DATA


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` next to the checkout; tests using it skip when it is absent (e.g. a bare clone)."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _quiet_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuc._settings import settings

    monkeypatch.setattr(settings, "progress", False)
