"""Every tutorial runs the way its instructions say, and opens as a notebook (link 4 of the chain of trust).

Each tutorials/NN_name.py is a jupytext percent-format script (`# %%` cells). Its first cell is markdown
with a ```bash block of the commands that run it; each command runs here as a user would type it (in
the activated venv, from the repository root, in its own process: the simulator is fixed per process),
must exit 0 without a warning or a traceback and print "tutorial NN OK" (proof it reached its end).
A `STEP=1` command stops in pdb: it gets `c` (continue) on stdin, as a user would type. Each tutorial
also runs as a notebook would run it: its code cells executed in order in one namespace, from
tutorials/, with no `__file__`.
"""

import pathlib
import re

import pytest

from tests.doc_util import assert_clean, commands, fenced_blocks, run_command

jupytext = pytest.importorskip("jupytext")

ROOT = pathlib.Path(__file__).resolve().parent.parent
TUTORIALS = sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py"))
TIMEOUT_S = 180
# a tutorial that asks for the simulator only for some commands is also run once in it
SIM_TOO = {"05_model_parallel.py"}


def instructions(path):
    nb = jupytext.read(path)
    first = nb.cells[0]
    assert first.cell_type == "markdown", f"{path.name}: the first cell should be markdown (title, Run:)"
    blocks = [b for b in fenced_blocks(first.source) if b.lang == "bash"]
    assert blocks, f"{path.name}: no ```bash block of commands in the first cell"
    return [c for b in blocks for c in commands(b.code)]


def expect_ok(path, r, cmd):
    assert_clean(r, cmd)
    want = f"tutorial {path.name[:2]} OK"
    assert want in r.stdout, f"{cmd!r} did not print {want!r}:\n{r.stdout[-3000:]}"


def test_tutorials_exist():
    assert len(TUTORIALS) >= 6, "tutorials/NN_*.py missing"


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.name for p in TUTORIALS])
def test_tutorial_is_a_notebook_of_cells(path):
    nb = jupytext.read(path)
    kinds = [c.cell_type for c in nb.cells]
    assert kinds.count("code") >= 2 and "markdown" in kinds, kinds
    assert re.match(r"# Tutorial \d\d: ", nb.cells[0].source)
    cmds = instructions(path)
    assert any(f"tutorials/{path.name}" in c for c in cmds), cmds


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.name for p in TUTORIALS])
def test_tutorial_instructions_run(path):
    for cmd in instructions(path):
        stdin = "c\n" * 20 if "STEP=1" in cmd else ""
        r = run_command(cmd, ROOT, timeout=TIMEOUT_S, stdin=stdin)
        expect_ok(path, r, cmd)
        if "STEP=1" in cmd:
            assert "(Pdb)" in r.stdout, "STEP=1 did not stop in pdb"


@pytest.mark.parametrize("path", [p for p in TUTORIALS if p.name in SIM_TOO], ids=sorted(SIM_TOO))
def test_tutorial_runs_in_the_simulator(path):
    cmd = f"NUMBACTR_DEVICE=sim python tutorials/{path.name}"
    expect_ok(path, run_command(cmd, ROOT, timeout=TIMEOUT_S), cmd)


NOTEBOOK_RUNNER = """
import sys, jupytext
nb = jupytext.read(sys.argv[1])
scope = {"__name__": "__main__"}
for cell in nb.cells:
    if cell.cell_type == "code":
        exec(compile(cell.source, "<cell>", "exec"), scope)
"""


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.name for p in TUTORIALS])
def test_tutorial_runs_as_a_notebook(path):
    cmd = f"python -c '{NOTEBOOK_RUNNER}' {path.name}"
    expect_ok(path, run_command(cmd, ROOT / "tutorials", timeout=TIMEOUT_S), f"notebook {path.name}")
