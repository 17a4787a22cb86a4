"""The tutorials run top to bottom (executed with nbclient in a scratch copy; the committed outputs are not touched)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "tutorials").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_tutorial_runs(path: Path, tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    # the notebooks read ../tests/data relative to tutorials/: run them from a copy at the same depth
    work = tmp_path / "tutorials"
    work.mkdir()
    shutil.copy(path, work / path.name)
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    nb = nbformat.read(work / path.name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": work}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
