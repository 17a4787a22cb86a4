"""README.md's quickstart runs as written, its install instructions work as written (no PyPI, where gpuc is not; no
placeholder URL), and its install-and-test block, which CI runs verbatim, is found and says how long it takes."""

from __future__ import annotations

import re
import subprocess
import sys
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


def test_no_placeholder_install_lines() -> None:
    for path in (README, ROOT / "docs" / "installation.md"):
        assert not re.search(r"<[^>]*(URL|url)[^>]*>", path.read_text()), f"{path.name} has a placeholder URL"


def test_ci_block_is_the_install_and_test_commands() -> None:
    """.ci/run runs what .ci/readme_block prints: README's '.[test]' install and the tests not marked slow, each line
    saying how long it takes."""
    out = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "readme_block")], capture_output=True, text=True, check=True
    ).stdout
    lines = out.strip().splitlines()
    assert lines[0].startswith("python3 -m venv .venv")
    install = [line for line in lines if line.startswith("pip install")]
    test = [line for line in lines if line.startswith("python -m pytest")]
    assert len(install) == 1 and "'.[test]'" in install[0]
    assert len(test) == 1 and '-m "not slow"' in test[0] and test[0].split("#")[0].rstrip().endswith(" tests")
    for line in install + test:
        assert re.search(r"# about \d+(-\d+)? min", line), f"README does not say how long this takes: {line}"


@pytest.mark.slow  # the whole quickstart: Scanpy preprocessing, UMAP, metacells, a k sweep, DESeq2 (~15 s)
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
