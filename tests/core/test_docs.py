"""The shared docstring fragments fill every placeholder of the tools' docstrings."""

import inspect

import pytest

import gpuc
from gpuc._docs import doc_params


def test_doc_params_fills_fragments_at_parameter_indentation():
    @doc_params(extra="extra\n    Something only two tools take.")
    def tool(device=None, extra=None):
        """Do it.

        Parameters
        ----------
        {device}
        {extra}
        """

    doc = inspect.cleandoc(tool.__doc__)
    assert '\ndevice\n    ``"auto"``' in doc
    assert "\nextra\n    Something only two tools take." in doc
    assert "{" not in doc


def test_doc_params_names_a_missing_fragment():
    with pytest.raises(KeyError, match="nonexistent"):

        @doc_params()
        def tool():
            """{nonexistent}"""


@pytest.mark.parametrize("module", ["tl", "get", "pl"])
def test_no_placeholder_left_in_public_docstrings(module):
    namespace = getattr(gpuc, module)
    for name in namespace.__all__:
        doc = getattr(namespace, name).__doc__ or ""
        for fragment in ("{device}", "{n_jobs}", "{copy}", "{random_state}"):
            assert fragment not in doc, (module, name, fragment)
