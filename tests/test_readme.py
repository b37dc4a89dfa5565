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

import importlib.util
import os
import pathlib
import re

import pytest

from tests.doc_util import assert_clean, commands, fenced_blocks, run_command

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
INSTALL = re.compile(
    r"^python3 -m venv \.venv && \.venv/bin/pip install -q -e \"\.(\[(?P<extras>[\w,]+)\])?\" && (?P<rest>.+)$"
)
TEST_COMMAND = ".venv/bin/python -m pytest -q -n 2 --dist loadfile"
#: command prefix -> options appended (all listed in the command's --help), for a test-sized run
SHRINK = {
    "numbactr demo": "--train-samples 24000 --eval-samples 4000 --rows 20000",
    "numbactr bench data": "--samples 20000 --batch-size 2048 --repeats 1",
    "numbactr bench": "--quick --min-time 0",
    # the suite's own background warm-up compiled the one-thread kernels; the two-thread twins would take minutes
    "numbactr.tools.warm_cache": "--threads 1",
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


#: a bash block that starts by installing an optional peer (PyTorch): `pip install -q -e ".[extra]"`
PEER_INSTALL = re.compile(r'^pip install -q -e "\.\[(?P<extras>[\w,]+)\]"$')
#: what each peer extra brings, by import name
PEER_MODULES = {"fbgemm": ("torch", "fbgemm_gpu")}


def readme_steps():
    """[(kind, payload)] in README order: ("file", (name, code)), ("run", command), or ("peer", (extras,
    [commands])) for a bash block that installs a peer first (run by test_readme_blocks_with_a_peer)."""
    steps = []
    for block in fenced_blocks(README):
        if block.lang == "python":
            m = re.search(r"as `([\w./-]+\.py)`", block.before)
            assert m, f"README line {block.line}: say which file the python block is saved as (as `x.py`)"
            steps.append(("file", (m.group(1), block.code)))
        elif block.lang == "bash":
            cmds = commands(block.code)
            m = PEER_INSTALL.match(cmds[0].partition(" # ")[0].strip()) if cmds else None
            if m:
                steps.append(("peer", (m["extras"].split(","), cmds[1:])))
            else:
                steps.extend(("run", c) for c in cmds)
    return steps


def scratch(tmp_path):
    """tmp_path with the repository's tutorials/, datasets/ and examples/ in it, as a clone has them."""
    for name in ("tutorials", "datasets", "examples"):
        os.symlink(ROOT / name, tmp_path / name)
    return tmp_path


def test_readme_has_the_two_commands_first():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
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
    for extra in (INSTALL.match(first)["extras"] or "").split(","):
        deps += " " + " ".join(extras.get(extra, []))
    for pkg in (
        "numba",
        "pandas",
        "pyarrow",
        "matplotlib",
        "tqdm",
        "threadpoolctl",
        "mpi4py",
        "mpich",
        "rocksdict",
        "onnxruntime",
    ):
        assert pkg in deps, f"the first command does not install {pkg}"


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path):
    scratch(tmp_path)
    ran = []
    for kind, payload in readme_steps():
        if kind == "peer":
            continue  # test_readme_blocks_with_a_peer
        if kind == "file":
            name, code = payload
            (tmp_path / name).write_text(code)
            continue
        cmd = payload
        m = INSTALL.match(cmd)
        if m:
            if m["rest"] == TEST_COMMAND:
                continue  # the test suite itself: CI runs it
            cmd = m["rest"]  # already installed: this test runs in that venv
        cmd = shrink(cmd)
        stdin = "c\n" * 20 if "STEP=1" in cmd else ""
        r = run_command(cmd, tmp_path, timeout=600, stdin=stdin)
        assert_clean(r, cmd)
        ran.append(cmd)
        if "numbactr demo" in cmd:
            assert re.search(r"final eval AUC [\d.]+\s+Bayes-optimal AUC [\d.]+\s+gap closed", r.stdout), r.stdout[
                -2000:
            ]
            assert (tmp_path / "runs" / "demo" / "learning_curve.png").exists()
            assert (tmp_path / "runs" / "demo" / "learning_curve.csv").exists()
        if "train.py" in cmd:
            aucs = [float(a) for a in re.findall(r"Evaluation, AUC: ([\d.]+)", r.stdout)]
            assert aucs and aucs[-1] > 0.65, f"{cmd}: eval AUC {aucs} (planted signal should be learned)"
    assert any("train.py" in c for c in ran) and any("numbactr demo" in c for c in ran)


@pytest.mark.slow
def test_readme_blocks_with_a_peer(tmp_path):
    """The blocks that install an optional peer first (PyTorch) run where that peer is installed: each in a
    scratch folder of its own, its install line checked against pyproject.toml instead of run."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    blocks = [payload for kind, payload in readme_steps() if kind == "peer"]
    assert blocks, "the README shows how to use numbactr's embeddings from PyTorch"
    missing = set()
    for names, cmds in blocks:
        for name in names:
            assert name in extras, f"README: pip install .[{name}]: no such extra in pyproject.toml"
            missing.update(m for m in PEER_MODULES.get(name, ()) if importlib.util.find_spec(m) is None)
    if missing:
        pytest.skip(f"the README's PyTorch blocks need {sorted(missing)} (pip install -e '.[fbgemm]')")
    for i, (names, cmds) in enumerate(blocks):
        folder = tmp_path / f"block{i}"
        folder.mkdir()
        scratch(folder)
        for cmd in cmds:
            cmd = shrink(cmd)
            assert_clean(run_command(cmd, folder, timeout=600), cmd)
