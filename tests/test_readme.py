"""Every code block of README.md runs, in order, as a new user would run it after the first command.

The blocks run in one scratch folder that holds the repository's tutorials/ and datasets/ (so outputs
such as runs/, criteo_out/ and dcn_data/ land there, not in the checkout), in the activated venv
(tests/doc_util.py). A ```python block is saved under the file name the text before it gives ("as
`train.py`"), so the bash blocks after it can run it. Each command must exit 0 and print no warning
and no traceback.

Commands not run here: the install steps of the "two commands" (this test runs inside the environment
they create; their extras must exist in pyproject.toml, and CI runs the test command verbatim from
.ci/run), the test command itself and the documentation build (CI runs it verbatim too).
tests/test_docs.py runs the pages of docs/ the same way, with these functions. The commands that take minutes at their default
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
#: the command that builds the documentation site: CI runs it verbatim (.ci/run), this test does not
DOCS_BUILD = ".venv/bin/sphinx-build -W --keep-going -b html docs docs/_build/html"


def doc_steps(text: str, where: str) -> list:
    """[(kind, payload)] in page order: ("file", (name, code)), ("run", command), or ("peer", (extras,
    [commands])) for a bash block that installs a peer first (run by the *_with_a_peer tests).

    A ```python block is saved under the name the text before it gives ("as `x.py`"); one without a name is
    saved under a name of its own and run. A block marked `<!-- not run: REASON -->` is skipped; a block in any
    other language must be marked so (or be a MyST directive such as {toctree})."""
    steps = []
    for block in fenced_blocks(text):
        if block.directive or block.not_run:
            continue
        if block.lang == "python":
            m = re.search(r"as `([\w./-]+\.py)`", block.before)
            name = m.group(1) if m else f"_{pathlib.Path(where).stem}_line{block.line}.py"
            steps.append(("file", (name, block.code)))
            if not m:
                steps.append(("run", f"python {name}"))
        elif block.lang == "bash":
            cmds = commands(block.code)
            m = PEER_INSTALL.match(cmds[0].partition(" # ")[0].strip()) if cmds else None
            if m:
                steps.append(("peer", (m["extras"].split(","), cmds[1:])))
            else:
                steps.extend(("run", c) for c in cmds)
        else:
            raise AssertionError(
                f"{where} line {block.line}: a ```{block.lang} block is neither run (bash, python) nor marked "
                "<!-- not run: REASON --> on the line before it"
            )
    return steps


def readme_steps():
    return doc_steps(README, "README.md")


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


def run_steps(steps, folder, where: str) -> list:
    """Run a page's steps (not its peer blocks) in folder; the commands that ran."""
    ran = []
    for kind, payload in steps:
        if kind == "peer":
            continue  # run_peer_blocks
        if kind == "file":
            name, code = payload
            (folder / name).write_text(code)
            continue
        cmd = payload
        m = INSTALL.match(cmd)
        if m:
            if m["rest"] in (TEST_COMMAND, DOCS_BUILD):
                continue  # the test suite and the docs build themselves: CI runs them verbatim
            cmd = m["rest"]  # already installed: this test runs in that venv
        cmd = shrink(cmd)
        stdin = "c\n" * 20 if "STEP=1" in cmd else ""
        r = run_command(cmd, folder, timeout=600, stdin=stdin)
        assert_clean(r, f"{where}: {cmd}")
        ran.append(cmd)
        if "numbactr demo" in cmd:
            assert re.search(r"final eval AUC [\d.]+\s+Bayes-optimal AUC [\d.]+\s+gap closed", r.stdout), r.stdout[
                -2000:
            ]
            assert (folder / "runs" / "demo" / "learning_curve.png").exists()
            assert (folder / "runs" / "demo" / "learning_curve.csv").exists()
        if re.match(r"python train\.py", cmd):
            aucs = [float(a) for a in re.findall(r"Evaluation, AUC: ([\d.]+)", r.stdout)]
            assert aucs and aucs[-1] > 0.65, f"{where}: {cmd}: eval AUC {aucs} (planted signal should be learned)"
    return ran


def run_peer_blocks(steps, folder, where: str) -> int:
    """Run the blocks of a page that install an optional peer first (PyTorch), where that peer is installed: each
    in a scratch folder of its own holding the page's files, its install line checked against pyproject.toml
    instead of run. The number of blocks run; skips when a peer is missing."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    blocks = [payload for kind, payload in steps if kind == "peer"]
    files = [payload for kind, payload in steps if kind == "file"]
    missing = set()
    for names, _ in blocks:
        for name in names:
            assert name in extras, f"{where}: pip install .[{name}]: no such extra in pyproject.toml"
            missing.update(m for m in PEER_MODULES.get(name, ()) if importlib.util.find_spec(m) is None)
    if missing:
        pytest.skip(f"{where}'s PyTorch blocks need {sorted(missing)} (pip install -e '.[fbgemm]')")
    for i, (names, cmds) in enumerate(blocks):
        sub = folder / f"block{i}"
        sub.mkdir()
        scratch(sub)
        for name, code in files:
            (sub / name).write_text(code)
        for cmd in cmds:
            cmd = shrink(cmd)
            assert_clean(run_command(cmd, sub, timeout=600), f"{where}: {cmd}")
    return len(blocks)


def test_readme_builds_the_docs_as_ci_does():
    cmds = [c for kind, c in readme_steps() if kind == "run"]
    build = [c for c in cmds if INSTALL.match(c) and INSTALL.match(c)["rest"] == DOCS_BUILD]
    assert build, f"the README shows how to build the documentation site ({DOCS_BUILD})"
    assert build[0] in (ROOT / ".ci" / "run").read_text(), "CI must build the docs with the README's command verbatim"


def test_readme_is_short():
    assert README.count("\n") <= 200, "the README is at most 200 lines: the rest belongs in docs/"


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path):
    scratch(tmp_path)
    ran = run_steps(readme_steps(), tmp_path, "README.md")
    assert any("train.py" in c for c in ran) and any("numbactr demo" in c for c in ran)


@pytest.mark.slow
def test_readme_blocks_with_a_peer(tmp_path):
    assert run_peer_blocks(readme_steps(), tmp_path, "README.md"), "the README shows numbactr's embeddings from PyTorch"
