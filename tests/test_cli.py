"""The `numbactr` command line: --version, help for every command and option, converters listed under
`data --help`, and errors as one line (the traceback only with --debug)."""

import argparse
import os
import subprocess
import sys

import pytest

import numbactr
from numbactr import cli


def run_main(capsys, *argv):
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # argparse's --help, --version and usage errors
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_version(capsys):
    rc, out, _ = run_main(capsys, "--version")
    assert rc == 0 and out.strip() == f"numbactr {numbactr.__version__}"


def test_top_level_help_lists_every_command(capsys):
    rc, out, _ = run_main(capsys, "--help")
    assert rc == 0
    for cmd in ("demo", "bench", "data", "device", "--version", "--debug"):
        assert cmd in out


def test_data_help_lists_the_converters(capsys):
    rc, out, _ = run_main(capsys, "data", "--help")
    assert rc == 0 and "criteo" in out and "Criteo TSV click logs" in out
    rc, out, _ = run_main(capsys, "data", "criteo", "--help")
    assert rc == 0 and "usage: numbactr data criteo" in out and "--format" in out


@pytest.mark.parametrize(
    "argv,usage",
    [
        (("device", "--help"), "usage: numbactr device"),
        (("demo", "--help"), "usage: numbactr demo"),
        (("bench", "--help"), "usage: numbactr bench"),
        (("bench", "hash", "--help"), "usage: numbactr bench"),
        (("bench", "data", "--help"), "usage: numbactr bench data"),
    ],
)
def test_every_command_has_help(capsys, argv, usage):
    rc, out, _ = run_main(capsys, *argv)
    assert rc == 0 and usage in out


def every_option(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from every_option(sub)
        elif action.option_strings or action.dest not in ("rest",):
            yield parser.prog, action


def test_every_option_of_the_parsers_has_a_description():
    from numbactr.bench import cli as bench
    from numbactr.bench import data as data_bench
    from numbactr.data import criteo

    parsers = [cli.build_parser()]
    for mod, argv in ((bench, ["hash"]), (data_bench, []), (criteo, ["in", "out"])):
        seen = {}

        def capture(self, args=None, namespace=None, _seen=seen):
            _seen["parser"] = self
            raise SystemExit(0)

        orig = argparse.ArgumentParser.parse_args
        argparse.ArgumentParser.parse_args = capture
        try:
            with pytest.raises(SystemExit):
                mod.main(argv)
        finally:
            argparse.ArgumentParser.parse_args = orig
        parsers.append(seen["parser"])
    missing = [
        f"{prog} {a.option_strings or a.dest}"
        for p in parsers
        for prog, a in every_option(p)
        if not a.help and a.help is not argparse.SUPPRESS
    ]
    assert not missing, missing


def test_errors_are_one_line_without_traceback(capsys):
    rc, out, err = run_main(capsys, "data", "criteo", "no/such/file.tsv", "out")
    assert rc == 1 and "Traceback" not in err
    assert err.count("\n") == 1 and "no/such/file.tsv" in err
    rc, _, err = run_main(capsys, "demo", "--batch", "0")
    assert rc == 1 and err.strip() == (
        "numbactr demo: error: --batch must be > 0, got 0 (ValueError; --debug shows the traceback)"
    )
    rc, _, err = run_main(capsys, "demo", "--bogus")
    assert rc == 2 and "numbactr demo: error: unrecognized arguments: --bogus" in err
    with pytest.raises(ValueError, match="--batch must be > 0"):
        cli.main(["--debug", "demo", "--batch", "0"])


def test_missing_gpu_is_one_line_naming_numbas_reason():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBACTR_DEVICE"] = "gpu"
    r = subprocess.run(
        [sys.executable, "-m", "numbactr.cli", "device"], capture_output=True, text=True, env=env, timeout=120
    )
    from numba import cuda

    if not cuda.is_available() or os.environ.get("NUMBA_ENABLE_CUDASIM"):
        assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
        assert "numbactr device: error: NUMBACTR_DEVICE=gpu, but no CUDA GPU is usable here: " in r.stderr
        assert "()" not in r.stderr and "here: ;" not in r.stderr
