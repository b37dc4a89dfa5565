"""Run the commands that documentation shows (README.md, the tutorials' instructions) as a user would.

    blocks = fenced_blocks(text)          # [Block(lang, code, line, before)] of ``` fenced blocks
    commands(block.code)                  # the shell commands of a bash block, one per (joined) line
    run_command(cmd, cwd)                 # bash -c in an "activated" venv: this interpreter's bin/ first

A command runs with this interpreter's bin/ at the front of PATH (what `. .venv/bin/activate` does), so
`python`, `numbactr` and `mpiexec` are the installed ones; `.venv/bin/` prefixes are mapped there too.
The test process's own device choice (NUMBA_ENABLE_CUDASIM set by conftest, NUMBACTR_DEVICE) is removed:
the commands run in the environment a user has.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

BIN = os.path.dirname(sys.executable)
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\{[\w-]+\}.*|[\w+-]*)\s*$")
#: the comment that marks a docs block as not run by the tests, with the reason: <!-- not run: REASON -->
NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<why>\S.*?)\s*-->\s*$")


@dataclass
class Block:
    lang: str  # "bash", "python", "text", ... or a MyST directive such as "{toctree}"
    code: str
    line: int  # 1-based line of the opening fence
    before: str  # the text between the previous block and this one

    @property
    def not_run(self):
        """The reason given in a `<!-- not run: REASON -->` line right before the fence, else None."""
        last = self.before.rstrip("\n").rsplit("\n", 1)[-1]
        m = NOT_RUN.search(last)
        return m["why"] if m else None

    @property
    def directive(self) -> bool:
        return self.lang.startswith("{")


def fenced_blocks(text: str) -> list:
    """The ``` blocks of markdown text, in order."""
    lines = text.splitlines()
    out, i, last = [], 0, 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        if j == len(lines):
            raise ValueError(f"unclosed ``` block at line {i + 1}")
        out.append(Block(m["lang"], "\n".join(lines[i + 1 : j]) + "\n", i + 1, "\n".join(lines[last:i])))
        i = last = j + 1
    return out


def commands(code: str) -> list:
    """The commands of a bash block: one per line (backslash continuations joined), comments and blank
    lines skipped."""
    out, cur = [], ""
    for ln in code.splitlines():
        if ln.rstrip().endswith("\\"):
            cur += ln.rstrip()[:-1] + " "
            continue
        ln = cur + ln
        cur = ""
        if ln.strip() and not ln.lstrip().startswith("#"):
            out.append(ln.strip())
    return out


def user_env(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NUMBA_ENABLE_CUDASIM", "NUMBACTR_DEVICE", "PYTHONBREAKPOINT", "STEP")
    }
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env["VIRTUAL_ENV"] = os.path.dirname(BIN)
    env.update(extra)
    return env


def run_command(cmd: str, cwd, timeout: int = 300, stdin: str = "", **env) -> subprocess.CompletedProcess:
    """bash -c cmd in cwd, in the activated venv; stdout and stderr together in .stdout."""
    cmd = re.sub(r"(?<![\w/.])\.venv/bin/", BIN + "/", cmd)
    return subprocess.run(
        ["bash", "-c", cmd],
        cwd=cwd,
        env=user_env(**env),
        input=stdin,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout,
    )


def assert_clean(r: subprocess.CompletedProcess, cmd: str) -> None:
    """Exit status 0, no traceback and no warning in the output."""
    tail = r.stdout[-4000:]
    assert r.returncode == 0, f"{cmd!r} exited {r.returncode}:\n{tail}"
    assert "Traceback" not in r.stdout, f"{cmd!r} printed a traceback:\n{tail}"
    bad = [ln for ln in r.stdout.splitlines() if re.search(r"warning", ln, re.IGNORECASE)]
    assert not bad, f"{cmd!r} printed warnings:\n" + "\n".join(bad[:10])
