"""Sphinx configuration of numbactr's documentation (MyST Markdown pages, tutorials executed as notebooks).

Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html`` (the ``docs`` extra installs what it needs).
"""

import os
import sys
from importlib.metadata import version as _version

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))
os.environ.setdefault("NUMBACTR_PROGRESS", "0")  # no progress bars in executed outputs
os.environ.setdefault("MPLBACKEND", "Agg")

project = "numbactr"
author = "the numbactr developers"
copyright = "2026, the numbactr developers"
release = _version("numbactr")

extensions = [
    "myst_nb",  # MyST Markdown pages and jupytext notebooks (the tutorials), executed at build time
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
    "benchplots",  # docs/_ext/benchplots.py: plots and tables from docs/benchmarks/results/*.json
    "cliref",  # docs/_ext/cliref.py: the command line's --help pages
    "plaindocstrings",  # docs/_ext/plaindocstrings.py: a docstring that is not valid RST is shown verbatim
]

# every .md is MyST; every tutorial (tutorials/NN_*.py, linked as docs/tutorials) is a jupytext notebook
nb_custom_formats = {".py": "tutorialnb.reads"}  # docs/_ext/tutorialnb.py
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".py": "myst-nb"}
exclude_patterns = [
    "_build",
    "_ext",
    "_generated",
    "conf.py",
    "benchmarks/**",
    "tutorials/*.md",
    "**/__pycache__",
    "**/*.png",
]
myst_enable_extensions = ["colon_fence", "deflist", "fieldlist"]
myst_heading_anchors = 3

# the tutorials are executed on every build, so their outputs are never stale (NUMBACTR_DOCS_EXECUTE=off
# skips that while editing pages)
nb_execution_mode = os.environ.get("NUMBACTR_DOCS_EXECUTE", "force")
nb_execution_timeout = 600
nb_execution_raise_on_error = True  # a tutorial that fails fails the build
nb_execution_show_tb = True
nb_merge_streams = True

autosummary_generate = True
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True, "ignore-module-all": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Short names that several classes define as fields (keys, values, type: the evicting table's Arrays, a
# conversion's result, the parameter server's database params) make autodoc's implicit references to them
# ambiguous. Those are the only Python reference warnings here (nitpicky is off: an unresolved reference never
# warns), so they are silenced rather than each docstring reworded around its neighbours' field names.
suppress_warnings = ["ref.python"]
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = True

html_theme = "furo"
html_title = f"numbactr {release}"
html_static_path = []
