"""Read a tutorial (a jupytext percent-format script) as a Python 3 notebook, for myst-nb.

jupytext leaves a script's notebook without a kernel, so myst-nb would not know the cells' language before they
run; the tutorials are Python and run in the ``python3`` kernel of the interpreter that builds the docs.
"""

import jupytext


def reads(text: str):
    nb = jupytext.reads(text, fmt="py:percent")
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb
