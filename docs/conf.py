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

# No intersphinx: CI reaches package registries only, so other projects' inventories are unreachable (and -W fails).
extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
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
# jupyter_execute/ is where myst-nb writes notebook outputs when the build directory is docs/_build
exclude_patterns = ["_build", "jupyter_execute", "**.ipynb_checkpoints"]
html_theme = "sphinx_book_theme"
html_title = "gpuc"
