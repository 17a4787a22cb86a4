"""No code from data: a design formula is parsed against a documented grammar, typed or replayed from a file, and
nothing read from a file is evaluated, imported or unpickled (issue 41)."""

from __future__ import annotations

import re
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest

import gpuc
from gpuc.deseq._formula import parse_formula


def _bulk():
    rng = np.random.default_rng(0)
    a = ad.AnnData(rng.negative_binomial(5, 0.2, (8, 20)).astype(np.int64))
    a.obs["condition"] = pd.Categorical(["u", "t"] * 4)
    a.obs["batch"] = pd.Categorical(["x"] * 4 + ["y"] * 4)
    a.obs["depth"] = np.linspace(1.0, 2.0, 8)
    return a


@pytest.mark.parametrize("where", ["design", "reduced"])
def test_a_design_edited_in_a_shared_file_runs_nothing(tmp_path, where, unchanged):
    target = tmp_path / "pwned.npy"
    a = _bulk()
    if where == "design":
        gpuc.tl.deseq(a, "~condition", fit_type="mean")
    else:
        gpuc.tl.deseq(a, "~batch + condition", test="lrt", reduced="~batch", fit_type="mean")
    a.uns["deseq"]["params"][where] = f"~condition + np.save({str(target)!r}, 0)"
    a.write_h5ad(tmp_path / "shared.h5ad")
    b = ad.read_h5ad(tmp_path / "shared.h5ad")
    params = b.uns["deseq"]["params"]
    with unchanged(b), pytest.raises(ValueError, match=re.escape('the term "np.save(')):
        gpuc.tl.deseq(b, **params)
    assert not target.exists()


@pytest.mark.parametrize(
    "design",
    [
        "~condition + np.save('x.npy', 0)",
        "~__import__('os').system('true')",
        "~condition + I(open('x', 'w'))",
        "~C(condition, contr.treatment(base=exec('1')))",
        "~C(condition, levels=[print(1)])",
        "~condition + x.__class__",
        "~condition + {}",
        "~condition + [1][0]",
        "~condition + lambda: 0",
        "~condition; import os",
        "~np.log(depth + 1)",
        "~condition + (depth)",
        "~condition + depth ** 2",
        "~scale(depth)",
    ],
)
def test_terms_outside_the_grammar_are_refused_by_name(design):
    with pytest.raises(ValueError, match=r"the term .* is not allowed"):
        parse_formula(design)


@pytest.mark.parametrize(
    ("design", "columns"),
    [
        ("~condition", ["Intercept", "condition[T.u]"]),
        ("~batch + condition", ["Intercept", "batch[T.y]", "condition[T.u]"]),
        ("~batch * condition", ["Intercept", "batch[T.y]", "condition[T.u]", "batch[T.y]:condition[T.u]"]),
        ("~batch + batch:condition", None),
        ("~C(condition, contr.treatment(base='u'))", None),
        ("~C(condition, Treatment('u'))", None),
        ("~C(condition, levels=['u', 't'])", None),
        ("~np.log(depth) + condition", None),
        ("~np.sqrt(depth) + condition", None),
        ("~np.log1p(depth) + log2(depth)", None),
        ("~0 + condition", ["condition[t]", "condition[u]"]),
        ("~condition - 1", ["condition[t]", "condition[u]"]),
    ],
)
def test_the_documented_grammar_builds_the_design(design, columns):
    from gpuc.deseq._design import build_design

    d = build_design(_bulk().obs, design)
    if columns is not None:
        assert d.columns == columns
    assert d.matrix.shape[0] == 8


def test_backticks_name_any_column():
    a = _bulk()
    a.obs["my col.1"] = a.obs["condition"]
    gpuc.tl.deseq(a, "~`my col.1`", fit_type="mean")
    assert "results" in a.uns["deseq"]


def test_no_reader_evaluates_imports_or_unpickles():
    """A static check of the package: no eval/exec, no pickle or marshal loads, no import of a name from data."""
    root = Path(gpuc.__file__).parent
    bad = re.compile(r"\b(eval|exec)\(|pickle\.loads?\(|marshal\.loads?\(|__import__\(|np\.load\(.*allow_pickle=True")
    hits = []
    for path in root.rglob("*.py"):
        if "_testing" in path.parts:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if bad.search(code):
                hits.append(f"{path.relative_to(root)}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)
