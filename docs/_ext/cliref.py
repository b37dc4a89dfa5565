"""The ``cli-help`` directive: the output of ``numbactr ... --help``, run when the documentation builds.

    ```{cli-help} numbactr data criteo
    ```

The command runs in this interpreter (``python -m numbactr.cli ARGS --help``), so the page always shows what the
installed command prints; a command that fails fails the build.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from docutils import nodes
from sphinx.util.docutils import SphinxDirective


class CliHelp(SphinxDirective):
    required_arguments = 1
    final_argument_whitespace = True

    def run(self):
        argv = shlex.split(self.arguments[0])
        if argv[0] != "numbactr":
            raise self.error(f"cli-help: the command must start with 'numbactr', got {self.arguments[0]!r}")
        env = dict(os.environ, COLUMNS="100", NUMBACTR_PROGRESS="0")
        r = subprocess.run(
            [sys.executable, "-m", "numbactr.cli", *argv[1:], "--help"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        if r.returncode != 0:
            raise self.error(f"cli-help: {self.arguments[0]} --help exited {r.returncode}: {r.stderr[-500:]}")
        text = f"$ {self.arguments[0]} --help\n" + r.stdout.rstrip()
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


def setup(app):
    app.add_directive("cli-help", CliHelp)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
