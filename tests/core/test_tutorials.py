"""The tutorials run top to bottom (executed with nbclient in a scratch copy; the committed outputs are not touched).

A notebook that imports a package which is not installed (``dask.distributed`` comes with the ``dask`` extra) is
skipped, naming the package.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "tutorials").glob("*.ipynb"))
IMPORT = re.compile(r"^\s*(?:import|from)\s+([A-Za-z_][\w.]*)", re.M)


def _imported_modules(path: Path) -> list[str]:
    """The modules a notebook's code cells import (``import x.y`` and ``from x.y import z`` give ``x.y``)."""
    cells = json.loads(path.read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return sorted(set(IMPORT.findall(code)))


def test_imported_modules_are_found() -> None:
    found = _imported_modules(ROOT / "tutorials" / "atlas_dask.ipynb")
    assert {"dask.distributed", "gpuc", "anndata"} <= set(found)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_tutorial_runs(path: Path, tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    for module in _imported_modules(path):
        pytest.importorskip(module, reason=f"{path.name} imports {module}, which is not installed")
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
