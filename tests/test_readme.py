"""Every code block of README.md runs, in order, as a new user would run it after the first command.

The blocks run in one scratch folder that holds the repository's tutorials/ and datasets/ (so outputs
such as runs/, criteo_out/ and dcn_data/ land there, not in the checkout), in the activated venv
(tests/doc_util.py). A ```python block is saved under the file name the text before it gives ("as
`train.py`"), so the bash blocks after it can run it. Each command must exit 0 and print no warning
and no traceback.

Two commands are not run here: the install steps of the "two commands" (this test runs inside the
environment they create; their extras must exist in pyproject.toml, and CI runs the test command
verbatim from .ci/run) and the test command itself. The commands that take minutes at their default
sizes run with smaller sizes through their own documented options (SHRINK); everything else runs
exactly as written.
"""
import os
import pathlib
import re

import pytest

from tests.doc_util import assert_clean, commands, fenced_blocks, run_command

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
INSTALL = re.compile(r"^python3 -m venv \.venv && \.venv/bin/pip install -q -e \"\.(\[(?P<extras>[\w,]+)\])?\" && (?P<rest>.+)$")
TEST_COMMAND = ".venv/bin/python -m pytest -q"
#: command prefix -> options appended (all listed in the command's --help), for a test-sized run
SHRINK = {
    "numbactr demo": "--train-samples 24000 --eval-samples 4000 --rows 20000",
    "numbactr bench data": "--samples 20000 --batch-size 2048 --repeats 1",
    "numbactr bench": "--quick --min-time 0",
}


def shrink(cmd: str) -> str:
    """cmd with SHRINK's options for its command, put before a trailing `# comment`."""
    code = cmd.partition(" # ")[0]
    for prefix, extra in SHRINK.items():
        if re.search(rf"(^|[\s/]){re.escape(prefix)}(\s|$)", code):
            return f"{code.rstrip()} {extra}"
    return cmd


def test_shrink_puts_options_before_a_comment():
    assert shrink("numbactr bench all      # a table") == "numbactr bench all --quick --min-time 0"
    assert shrink("NUMBACTR_THREADS=2 numbactr demo") == ("NUMBACTR_THREADS=2 numbactr demo " + SHRINK["numbactr demo"])
    assert shrink("numbactr bench data") == "numbactr bench data " + SHRINK["numbactr bench data"]
    assert shrink("python train.py   # trains") == "python train.py   # trains"


def readme_steps():
    """[(kind, payload)] in README order: ("file", (name, code)) or ("run", command)."""
    steps = []
    for block in fenced_blocks(README):
        if block.lang == "python":
            m = re.search(r"as `([\w./-]+\.py)`", block.before)
            assert m, f"README line {block.line}: say which file the python block is saved as (as `x.py`)"
            steps.append(("file", (m.group(1), block.code)))
        elif block.lang == "bash":
            steps.extend(("run", c) for c in commands(block.code))
    return steps


def test_readme_has_the_two_commands_first():
    tomllib = pytest.importorskip("tomllib")          # Python >= 3.11
    cmds = [c for kind, c in readme_steps() if kind == "run"]
    first, second = cmds[0], cmds[1]
    assert INSTALL.match(first) and first.endswith(".venv/bin/numbactr demo"), first
    assert INSTALL.match(second) and second.endswith(TEST_COMMAND), second
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for cmd in (first, second):
        for extra in (INSTALL.match(cmd)["extras"] or "").split(","):
            assert not extra or extra in extras, f"{cmd!r}: no extra [{extra}] in pyproject.toml"
    assert second in (ROOT / ".ci" / "run").read_text(), "CI must run the README's test command verbatim"
    # what the README's commands import is installed by the first command
    deps = " ".join(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    deps += " " + " ".join(extras[INSTALL.match(first)["extras"] or "mpi"])
    for pkg in ("numba", "pandas", "pyarrow", "matplotlib", "tqdm", "threadpoolctl", "mpi4py", "mpich"):
        assert pkg in deps, f"the first command does not install {pkg}"


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path):
    for name in ("tutorials", "datasets"):
        os.symlink(ROOT / name, tmp_path / name)
    ran = []
    for kind, payload in readme_steps():
        if kind == "file":
            name, code = payload
            (tmp_path / name).write_text(code)
            continue
        cmd = payload
        m = INSTALL.match(cmd)
        if m:
            if m["rest"] == TEST_COMMAND:
                continue                          # the test suite itself: CI runs it
            cmd = m["rest"]                       # already installed: this test runs in that venv
        cmd = shrink(cmd)
        stdin = "c\n" * 20 if "STEP=1" in cmd else ""
        r = run_command(cmd, tmp_path, timeout=600, stdin=stdin)
        assert_clean(r, cmd)
        ran.append(cmd)
        if "numbactr demo" in cmd:
            assert re.search(r"final eval AUC [\d.]+\s+Bayes-optimal AUC [\d.]+\s+gap closed", r.stdout), r.stdout[-2000:]
            assert (tmp_path / "runs" / "demo" / "learning_curve.png").exists()
            assert (tmp_path / "runs" / "demo" / "learning_curve.csv").exists()
        if "train.py" in cmd:
            aucs = [float(a) for a in re.findall(r"Evaluation, AUC: ([\d.]+)", r.stdout)]
            assert aucs and aucs[-1] > 0.65, f"{cmd}: eval AUC {aucs} (planted signal should be learned)"
    assert any("train.py" in c for c in ran) and any("numbactr demo" in c for c in ran)
