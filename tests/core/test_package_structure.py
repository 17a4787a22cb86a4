"""Conventions every public tool and plot follows (in the spirit of scanpy's tests/test_package_structure.py)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest

import gpuc

# tl functions whose independent units (groups, ranks, restarts, gene blocks) can run as Dask tasks
TOOLS_WITH_UNITS = {"metacells", "deseq", "nmf_k_sweep", "consensus_nmf"}
# tl functions that return a new AnnData instead of writing into their input
RETURNS_NEW_ANNDATA = {"aggregate_metacells", "pseudobulk"}


def _public(module: object) -> list[tuple[str, Callable]]:
    return [(name, getattr(module, name)) for name in module.__all__ if callable(getattr(module, name))]


TL = _public(gpuc.tl)
PL = _public(gpuc.pl)
ALL = (
    [(f"tl.{n}", f) for n, f in TL] + [(f"pl.{n}", f) for n, f in PL] + [(f"get.{n}", f) for n, f in _public(gpuc.get)]
)


def _ids(items: list[tuple[str, Callable]]) -> list[str]:
    return [n for n, _ in items]


def _positional(sig: inspect.Signature) -> list[inspect.Parameter]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p for p in sig.parameters.values() if p.kind in kinds]


@pytest.mark.parametrize(("name", "func"), TL + PL, ids=_ids(TL + PL))
def test_adata_first_and_at_most_three_positionals(name: str, func: Callable) -> None:
    params = _positional(inspect.signature(func))
    assert params, f"{name} takes no positional arguments"
    assert params[0].name == "adata", f"{name}: first argument must be `adata`"
    assert len(params) <= 3, f"{name}: at most adata + 2 positionals, got {[p.name for p in params]}"


@pytest.mark.parametrize(("name", "func"), TL + PL, ids=_ids(TL + PL))
def test_booleans_are_keyword_only(name: str, func: Callable) -> None:
    for p in _positional(inspect.signature(func)):
        assert not isinstance(p.default, bool), f"{name}: boolean `{p.name}` must be keyword-only"


@pytest.mark.parametrize(("name", "func"), TL, ids=_ids(TL))
def test_tools_writing_results_have_copy_and_key_added(name: str, func: Callable) -> None:
    params = inspect.signature(func).parameters
    if name in RETURNS_NEW_ANNDATA:
        assert "copy" not in params, f"{name} returns a new AnnData; `copy` would be meaningless"
        return
    assert "copy" in params, f"{name} writes into adata and needs `copy`"
    copy = params["copy"]
    assert copy.kind is inspect.Parameter.KEYWORD_ONLY and copy.default is False, (
        f"{name}: copy must be keyword-only, default False"
    )
    assert "key_added" in params, f"{name} writes results and needs `key_added`"
    assert params["key_added"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize(("name", "func"), PL, ids=_ids(PL))
def test_plots_take_ax_and_show_and_return_axes_or_figure(name: str, func: Callable) -> None:
    params = inspect.signature(func).parameters
    for arg in ("ax", "show", "save"):
        assert arg in params, f"{name} needs `{arg}=`"
        assert params[arg].kind is inspect.Parameter.KEYWORD_ONLY and params[arg].default is None
    ret = str(inspect.signature(func).return_annotation)
    assert "Axes" in ret or "Figure" in ret, f"{name} must be annotated to return Axes or Figure, got {ret}"


@pytest.mark.parametrize(("name", "func"), ALL, ids=_ids(ALL))
def test_numpydoc_with_returns(name: str, func: Callable) -> None:
    doc = inspect.getdoc(func) or ""
    assert "Parameters\n----------" in doc, f"{name}: numpydoc Parameters section missing"
    assert "Returns\n-------" in doc, f"{name}: numpydoc Returns section missing"


# ---- one convention for every public function (parameter names and defaults as in Scanpy) -------------------------
RENAMED = {"use_highly_variable": "mask_var", "deseq_key": "key"}
# parameters that name obs columns or a second table, not the results a tool reads
OBS_COLUMN_KEYS = {"sample_key", "celltype_key", "quality_key"}
# what gpuc reads from other tools' runs keeps Scanpy's name for it (sc.tl.umap / leiden: neighbors_key)
SCANPY_KEYS = {"neighbors_key"}


@pytest.mark.parametrize(("name", "func"), ALL, ids=_ids(ALL))
def test_shared_parameter_names_and_defaults(name: str, func: Callable) -> None:
    params = inspect.signature(func).parameters
    for old, new in RENAMED.items():
        assert old not in params, f"{name}: `{old}` is spelled `{new}` in gpuc (as in Scanpy)"
    if "layer" in params:
        assert params["layer"].default is None, f"{name}: layer defaults to None (adata.X), as in Scanpy"
    if "device" in params:
        p = params["device"]
        assert p.default is None, f"{name}: device=None means gpuc.settings.device"
        assert "None" in str(p.annotation), f"{name}: device is annotated `Device | None`"
        assert "n_jobs" in params, f"{name}: every tool with a device also takes n_jobs (CPU threads)"
    if "n_jobs" in params:
        p = params["n_jobs"]
        assert p.default is None, f"{name}: n_jobs=None means gpuc.settings.n_jobs"
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and "None" in str(p.annotation), name
    if "client" in params:
        p = params["client"]
        assert p.default is None and p.kind is inspect.Parameter.KEYWORD_ONLY, f"{name}: client=None (settings.client)"
    if name in {f"tl.{t}" for t in TOOLS_WITH_UNITS}:
        assert "client" in params, f"{name} has independent units and takes client= (Dask)"
    if "random_state" in params:
        assert params["random_state"].default == 0 and "SeedLike" in str(params["random_state"].annotation), name
    if "mask_var" in params:
        assert params["mask_var"].default == "highly_variable", name
    for flag in ("inplace", "copy"):
        if flag in params:
            assert params[flag].kind is inspect.Parameter.KEYWORD_ONLY, f"{name}: `{flag}` is keyword-only"
    if "inplace" in params:
        assert params["inplace"].default is True, name
    if "key_added" in params:
        assert params["key_added"].kind is inspect.Parameter.KEYWORD_ONLY, name
    read_keys = [p for p in params if p == "key" or (p.endswith("_key") and p not in OBS_COLUMN_KEYS | SCANPY_KEYS)]
    assert read_keys in ([], ["key"]), f"{name}: what a tool reads is named `key`, got {read_keys}"
