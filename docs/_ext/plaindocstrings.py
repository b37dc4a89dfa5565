"""Docstrings that are not valid reStructuredText are shown as written, in a preformatted block.

numbactr's docstrings are written to be read in the source and in ``help()``: plain text, indented examples,
formulas such as ``|w|`` or ``x * y``. Most are also valid reStructuredText, and those render as such. A docstring
that docutils would warn about (unexpected indentation, an unmatched ``*``, a ``|substitution|``) is instead
rendered verbatim, as a literal block: the reader sees exactly what the author wrote, and the build stays free of
warnings without any being silenced. The check runs before napoleon, on the raw docstring.
"""

from __future__ import annotations

import re

import docutils.core
import docutils.utils
from docutils import nodes

#: messages that only mean "a Sphinx role or directive", which plain docutils does not know
SPHINX_ONLY = ("Unknown interpreted text role", "No role entry", "Unknown directive type", "No directive entry")


def _is_clean_rst(text: str) -> bool:
    text = re.sub(r":[\w:+-]+:(?=`)", "", text)  # Sphinx roles (:func:`x`), unknown to plain docutils
    settings = {"report_level": 2, "halt_level": 5, "warning_stream": False, "file_insertion_enabled": False}
    try:
        doctree = docutils.core.publish_doctree(text, settings_overrides=settings)
    except Exception:  # noqa: BLE001 (anything docutils cannot parse is shown verbatim)
        return False
    if any(True for _ in doctree.findall(nodes.problematic)):  # e.g. an undefined |substitution|
        return False
    for msg in doctree.findall(nodes.system_message):
        if msg["level"] >= 2 and not any(s in msg.astext() for s in SPHINX_ONLY):
            return False
    return True


def process(app, what, name, obj, options, lines):
    text = "\n".join(lines)
    if not text.strip() or _is_clean_rst(text):
        return
    body = [line.rstrip() for line in lines]
    lines[:] = ["::", ""] + ["    " + line if line else "" for line in body] + [""]


def setup(app):
    app.connect("autodoc-process-docstring", process, priority=400)  # before napoleon (500)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
