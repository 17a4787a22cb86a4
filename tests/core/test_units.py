"""gpuc._units.split_groups: a label column in, (label as given, positions) out, under the group-key rule."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from gpuc._errors import GpucWarning
from gpuc._units import split_groups


def _as_dict(groups):
    return {g: pos.tolist() for g, pos in groups}


def test_categories_in_category_order_unused_ones_skipped():
    col = pd.Series(pd.Categorical(["b", "a", "b", "c", "a"], categories=["c", "b", "z", "a"]))
    groups = split_groups(col, "obs['g']")
    assert [g for g, _ in groups] == ["c", "b", "a"]  # "z" has no entries
    assert _as_dict(groups) == {"c": [3], "b": [0, 2], "a": [1, 4]}
    appearance = split_groups(col, "obs['g']", order="appearance")
    assert [g for g, _ in appearance] == ["b", "a", "c"]


@pytest.mark.parametrize("seed", range(5))
def test_positions_equal_a_comparison_per_label(seed):
    rng = np.random.default_rng(seed)
    values = rng.choice(np.array([3, 1, 7, 2], dtype=np.int64), size=200)
    groups = split_groups(pd.Series(values), "obs['g']")
    assert [g for g, _ in groups] == list(pd.unique(values))  # first appearance, numpy scalars kept
    assert all(isinstance(g, np.integer) for g, _ in groups)
    for g, pos in groups:
        np.testing.assert_array_equal(pos, np.flatnonzero(values == g))
        assert pos.dtype == np.int64
    assert sum(pos.size for _, pos in groups) == 200


def test_labels_kept_as_given():
    col = pd.Series(np.asarray([1, "a", 1, 2.5, "a"], dtype=object))
    groups = split_groups(col, "obs['g']")
    assert [(type(g), g) for g, _ in groups] == [(int, 1), (str, "a"), (float, 2.5)]
    assert _as_dict(groups) == {1: [0, 2], "a": [1, 4], 2.5: [3]}


@pytest.mark.parametrize(("g1", "g2"), [(1, "1"), (np.nan, "nan"), (True, "True"), (None, "None")])
def test_labels_printing_the_same_are_refused(g1, g2):
    col = pd.Series(np.asarray([g1, g2, "x"], dtype=object))
    with pytest.raises(ValueError, match="would print the same"):
        split_groups(col, "obs['g']")


@pytest.mark.parametrize("missing_value", [np.nan, None, pd.NA])
def test_missing_labels_left_out_with_a_count_or_refused(missing_value):
    col = pd.Series(["a", missing_value, "b", "a", missing_value], dtype="string" if missing_value is pd.NA else object)
    with pytest.warns(GpucWarning, match=r"2 sample\(s\) with a missing obs\['g'\]"):
        groups = split_groups(col, "obs['g']", what="sample(s)")
    assert _as_dict(groups) == {"a": [0, 3], "b": [2]}
    with pytest.warns(GpucWarning, match=r"2 cell\(s\) with a missing"):
        categorical = split_groups(pd.Series(pd.Categorical(col)), "obs['g']")
    assert _as_dict(categorical) == {"a": [0, 3], "b": [2]}
    with pytest.raises(ValueError, match="2 missing value"):
        split_groups(col, "obs['g']", missing="error")
