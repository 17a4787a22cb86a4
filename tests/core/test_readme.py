"""README.md's quickstart runs as written, and the install instructions do not point at PyPI (gpuc is not there)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def _quickstart() -> str:
    text = README.read_text()
    section = text[text.index("## Quickstart") :]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "README.md has no python block under '## Quickstart'"
    return blocks[0]


def test_no_pypi_install_instructions() -> None:
    for path in (README, ROOT / "docs" / "installation.md"):
        text = path.read_text()
        assert not re.search(r"pip install ['\"]?gpuc(\[[^\]]*\])?['\"]?(?!\s*@)(\s|$)", text), (
            f"{path.name} tells users to install gpuc from PyPI, where it is not published"
        )
        assert "not on PyPI" in text


def test_readme_quickstart_runs_verbatim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(_quickstart(), str(README), "exec"), ns)
    plt.close("all")
    adata, mc, pb, k = ns["adata"], ns["mc"], ns["pb"], ns["k"]
    # QC applied: no cell without a cell type; UMAP computed and carried to the metacells
    assert adata.n_obs == 2638 and adata.obs["cell_type"].notna().all()
    assert "X_umap" in mc.obsm and mc.obsm["X_umap"].shape == (mc.n_obs, 2)
    # k comes from the sweep's suggestion, and the consensus used it
    assert isinstance(k, int) and k == mc.uns["nmf_k_sweep"]["suggested_k"]
    assert mc.obsm["X_nmf"].shape == (mc.n_obs, k)
    import gpuc

    assert (gpuc.get.deseq_results(pb)["padj"] < 0.1).sum() > 100
    for name in ("metacells.png", "nmf_k_sweep.png", "nmf_usage.png", "volcano.png"):
        assert (tmp_path / name).is_file(), f"the quickstart did not write {name}"
