"""Conventions every public tool and plot follows (in the spirit of scanpy's tests/test_package_structure.py)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest

import gpuc

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
    for arg in ("ax", "show"):
        assert arg in params, f"{name} needs `{arg}=`"
        assert params[arg].kind is inspect.Parameter.KEYWORD_ONLY and params[arg].default is None
    ret = str(inspect.signature(func).return_annotation)
    assert "Axes" in ret or "Figure" in ret, f"{name} must be annotated to return Axes or Figure, got {ret}"


@pytest.mark.parametrize(("name", "func"), ALL, ids=_ids(ALL))
def test_numpydoc_with_returns(name: str, func: Callable) -> None:
    doc = inspect.getdoc(func) or ""
    assert "Parameters\n----------" in doc, f"{name}: numpydoc Parameters section missing"
    assert "Returns\n-------" in doc, f"{name}: numpydoc Returns section missing"
