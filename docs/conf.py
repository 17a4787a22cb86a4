"""Sphinx configuration for gpuc (myst-nb + numpydoc, API pages from docstrings)."""

from __future__ import annotations

from datetime import date
from importlib.metadata import version as _version

project = "gpuc"
author = "gpuc developers"
copyright = f"{date.today():%Y}, {author}"
try:
    release = _version("gpuc")
except Exception:
    release = "0.0.0"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.intersphinx",
    "sphinx.ext.mathjax",
    "numpydoc",
    "sphinx_autodoc_typehints",
]
autosummary_generate = True
autodoc_member_order = "bysource"
numpydoc_show_class_members = False
myst_enable_extensions = ["dollarmath", "colon_fence"]
nb_execution_mode = "off"  # notebooks in tutorials/ are committed with their outputs
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
html_theme = "sphinx_book_theme"
html_title = "gpuc"
intersphinx_mapping = {
    "python": ("https://docs.python.org/3", None),
    "numpy": ("https://numpy.org/doc/stable/", None),
    "scipy": ("https://docs.scipy.org/doc/scipy/", None),
    "pandas": ("https://pandas.pydata.org/docs/", None),
    "anndata": ("https://anndata.readthedocs.io/en/stable/", None),
    "scanpy": ("https://scanpy.readthedocs.io/en/stable/", None),
}
