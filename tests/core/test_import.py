"""``import gpuc`` is light (no GPU library, nothing heavy until a tool is used) and the package's imports form no
circle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
# imported by the tools, plots and getters that need them, never by `import gpuc`
HEAVY = {"scanpy", "matplotlib", "sklearn", "dask", "distributed", "numba", "faiss", "formulaic", "seaborn"}
GPU = {"cupy", "cupyx", "cuml", "faiss"}


def _loaded_after(code: str, *, top: bool = True) -> set[str]:
    """Top-level packages (``top=False``: every module) in ``sys.modules`` after running ``code`` in a fresh
    interpreter."""
    code += "\nimport sys\nprint(','.join(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    modules = set(out.stdout.strip().split(","))
    return {m.split(".")[0] for m in modules} if top else modules


def test_import_gpuc_does_not_import_gpu_libraries() -> None:
    loaded = _loaded_after("import gpuc, gpuc.tl, gpuc.pl, gpuc.get, gpuc.datasets\ngpuc.tl.metacells, gpuc.pl.volcano")
    assert not loaded & GPU


def test_import_gpuc_imports_nothing_heavy() -> None:
    loaded = _loaded_after("import gpuc\ngpuc.settings.device = 'cpu'\ndir(gpuc.tl), dir(gpuc.pl), gpuc.__version__")
    assert not loaded & HEAVY, f"`import gpuc` imported {sorted(loaded & HEAVY)}"
    assert "scipy.stats" not in _loaded_after("import gpuc", top=False)


def test_loading_the_tools_imports_only_what_their_calls_need() -> None:
    # Loading a tool must not pay for Scanpy (~2 s; logging goes through gpuc._log), scipy.stats (~0.3 s; DESeq2's
    # p-values use scipy.special) or formulaic (~0.2 s; loaded by the first design). The NMF tools load scikit-learn's
    # KMeans and silhouette with them (every consensus calls both), the others never.
    def heavy_after(code: str) -> set[str]:
        loaded = _loaded_after("import gpuc\n" + code, top=False)
        heavy = {"scanpy", "sklearn", "matplotlib", "numba", "formulaic"}
        return {m.split(".")[0] for m in loaded if m.split(".")[0] in heavy} | ({"scipy.stats"} & loaded)

    assert not heavy_after("gpuc.tl.metacells, gpuc.tl.deseq, gpuc.tl.vst, gpuc.get.deseq_results")
    assert heavy_after("gpuc.tl.consensus_nmf, gpuc.tl.nmf_k_sweep") == {
        "sklearn",
        "scipy.stats",
    }  # sklearn loads stats


def test_log_forwards_to_scanpy_only_when_loaded() -> None:
    code = (
        "import sys, gpuc._log as log\n"
        "log.info('hidden'); assert 'scanpy' not in sys.modules and log.verbosity() == 1\n"
        "import scanpy as sc\nsc.settings.verbosity = 3\nlog.info('shown-info', deep='detail')\n"
        "assert log.verbosity() == 3\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    assert "shown-info" in text and "hidden" not in text


def test_public_names_resolve_on_first_use() -> None:
    import gpuc

    for package in (gpuc.tl, gpuc.pl, gpuc.get, gpuc.datasets):
        assert sorted(package._EXPORTS) == package.__all__, f"{package.__name__}: __all__ and _EXPORTS differ"
        assert set(package.__all__) <= set(dir(package))
        for name in package.__all__:
            assert callable(getattr(package, name)), f"{package.__name__}.{name}"
    from gpuc.tl import deseq  # the `from` form goes through the same lookup

    assert deseq is gpuc.tl.deseq
    with pytest.raises(AttributeError, match="no attribute 'frobnicate'"):
        gpuc.tl.frobnicate  # noqa: B018


def _gpuc_modules() -> dict[str, Path]:
    modules = {}
    for path in (SRC / "gpuc").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The gpuc modules that ``name`` imports anywhere (in functions too, not only at its top)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
    return (found & set(modules)) - {name}


def test_no_import_circle() -> None:
    """Data flows one way: no module imports, directly or through others, one that imports it back (imports inside
    functions count too)."""
    modules = _gpuc_modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                circle = [*path[path.index(dep) :], dep]
                pytest.fail(f"import circle: {' -> '.join(circle)}")
            if dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert {"gpuc._backend", "gpuc._settings", "gpuc._utils"} <= set(graph)
