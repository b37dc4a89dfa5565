"""A failing rank ends the whole job within seconds and says which rank and why; reader threads stop.

MPI part: each case is its own ``mpiexec`` run of tests/mpi/rank_fault.py with a timeout, so a job that
hangs fails the test instead of hanging the suite. Where the other ranks go on working without any
collective (OTHERS=away, 10 minutes), only an abort at once ends the job before the timeout. The rules
themselves are in numbactr/distributed/comm.py's docstring.

Shutdown part: the readers' prefetch threads stop and are joined at the end of fit (which keeps the
readers' place), when a pass is dropped, and at interpreter exit (a Parquet run ending mid-pass used to
die in pyarrow: "terminate called without an active exception").
"""

import os
import pathlib
import re
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from numbactr.runtime import device
from numbactr.data import make_reader
from numbactr.distributed.comm import launched
from tests.model_util import tiny_data, tiny_dlrm
from tests.test_data_reader import batch_ids, norm_params, ref_order, write_id_files
from tests.mpi_util import MPIEXEC, needs_mpi

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parent
TIMEOUT = 60  # a run takes ~3 s; a job that is not ended at once sleeps 10 minutes
HEAD = "numbactr: rank {r} of {n} failed; aborting the job"


def env():
    e = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    e["NUMBACTR_DEVICE"] = "cpu"
    return e


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_data(str(tmp_path_factory.mktemp("faults")), n_train=240, n_eval=96)


def job(data, fault, rank, step, others, ranks=2, threads="multiple"):
    """Run the job; returns the CompletedProcess (a hang raises TimeoutExpired and fails the test)."""
    cmd = [
        MPIEXEC,
        "-n",
        str(ranks),
        sys.executable,
        str(HERE / "mpi" / "rank_fault.py"),
        *data,
        fault,
        str(rank),
        str(step),
        others,
        threads,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=TIMEOUT, stdin=subprocess.DEVNULL)


def explain(r) -> str:
    return f"rc={r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"


# ---- a failing rank ends the job ---------------------------------------------------------------------
@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("step", [-1, 2], ids=["before_model", "in_training"])
def test_an_exception_aborts_at_once_with_its_traceback(data, step):
    r = job(data, "raise", 1, step, "away")
    assert r.returncode == 1, explain(r)
    assert HEAD.format(r=1, n=2) in r.stderr, explain(r)
    assert "Traceback (most recent call last)" in r.stderr
    assert f"RuntimeError: planted failure on rank 1 at step {step}" in r.stderr, explain(r)


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("fault,code,what", [("exit3", 3, "sys.exit(3)"), ("os_exit4", 4, "os._exit(4)")])
def test_a_non_zero_exit_aborts_at_once_with_its_code(data, fault, code, what):
    r = job(data, fault, 1, 1, "away")
    assert r.returncode == code, explain(r)
    assert (
        f"numbactr: rank 1 of 2 called {what} while the other ranks may still need it; aborting the job" in r.stderr
    ), explain(r)


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("ranks,who,threads", [(2, 1, "multiple"), (3, 1, "multiple"), (2, 0, "funneled")])
def test_a_zero_exit_mid_run_ends_the_ranks_that_need_it(data, ranks, who, threads):
    """Found by the watchdog thread, or (MPI without thread support) while waiting with MPI_Waitany."""
    r = job(data, "exit0", who, 2, "train", ranks=ranks, threads=threads)
    assert r.returncode == 1, explain(r)
    pattern = (
        rf"numbactr: rank {who} of {ranks} has left the job \(sys\.exit\(0\)\) after \d+ collectives, "
        rf"but rank \d waits for it in \w+ \(collective \d+\); aborting the job"
    )
    assert re.search(pattern, r.stderr), explain(r)


@pytest.mark.mpi
@needs_mpi
def test_one_collective_too_many_is_named(data):
    r = job(data, "extra", 1, 99, "train")
    assert r.returncode == 1, explain(r)
    m = re.search(
        r"rank 0 of 2 has left the job \(its script ended\) after (\d+) collectives, but rank 1 "
        r"waits for it in allreduce_sum \(collective (\d+)\)",
        r.stderr,
    )
    assert m and int(m.group(2)) == int(m.group(1)) + 1, explain(r)


@pytest.mark.mpi
@needs_mpi
def test_a_killed_rank_ends_the_job_and_its_pid_names_the_rank(data):
    r = job(data, "sigkill", 1, 2, "train")
    assert r.returncode != 0, explain(r)
    table = re.search(r"numbactr: 2 ranks \(rank: pid@host\) 0: (\d+)@\S+, 1: (\d+)@", r.stdout)
    killed = re.search(r"PID (\d+) RUNNING AT", r.stdout)  # hydra's report
    assert table and killed and "Killed (signal 9)" in r.stdout, explain(r)
    assert killed.group(1) == table.group(2), explain(r)  # the PID hydra names is rank 1's


@pytest.mark.mpi
@needs_mpi
def test_a_normal_end_is_never_aborted(data):
    """Rank 1 ends 3 s after rank 0; every rank catches a sys.exit(5), calls MPI.Finalize() itself, then
    sys.exit(0)."""
    r = job(data, "clean_end", 1, 99, "train")
    assert r.returncode == 0, explain(r)
    assert "rank 0 finished training" in r.stdout and "rank 1 finished training" in r.stdout
    assert r.stderr == "", explain(r)


@pytest.mark.mpi
@needs_mpi
def test_the_traceback_always_arrives_on_a_busy_machine(data):
    """mpiexec exits as soon as it handles an abort, so output its proxy has not forwarded by then is lost.
    On a machine kept busy by three spinning processes, the failing rank raises while the proxy (its parent)
    is stopped for 1 s (the hook numbactr had before, which aborted right after writing, lost the whole
    report in 5 of 21 such runs) or right after flooding its stdout: every run must print the traceback."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        for fault in ("stall_raise", "flood_raise", "stall_raise", "flood_raise"):
            r = job(data, fault, 1, 1, "away")
            assert r.returncode == 1, explain(r)
            assert HEAD.format(r=1, n=2) in r.stderr, explain(r)
            assert "RuntimeError: planted failure on rank 1 at step 1" in r.stderr, explain(r)
    finally:
        for p in busy:
            p.kill()
            p.wait()


# ---- the launch, seen from a plain process --------------------------------------------------------------
def test_the_launch_is_read_from_the_environment(monkeypatch):
    for var in (
        "PMI_SIZE",
        "PMI_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_SIZE",
        "MV2_COMM_WORLD_RANK",
    ):
        monkeypatch.delenv(var, raising=False)
    assert launched() == (1, 0, "")
    monkeypatch.setenv("PMI_SIZE", "1")  # mpiexec -n 1: nothing to guard
    assert launched() == (1, 0, "")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    assert launched() == (4, 3, "OMPI_COMM_WORLD_SIZE")


def test_sys_exit_tells_its_code_only_when_it_ends_the_script():
    """A plain run imports no mpi4py; numbactr's SystemExit records its code when the interpreter drops
    it uncaught, never when the script catches it."""
    code = textwrap.dedent("""
        import atexit, sys, types
        import numbactr
        from numbactr.distributed.comm import _ScriptExit
        print("mpi4py imported:", "mpi4py" in sys.modules)
        guard = types.SimpleNamespace(exit_code=None)
        atexit.register(lambda: print("at exit:", guard.exit_code, flush=True))
        try:
            raise _ScriptExit(guard, 5)
        except SystemExit as e:
            print("caught", e.code)
        print("after the catch:", guard.exit_code)
        raise _ScriptExit(guard, 3)
        """)
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env(), timeout=120, cwd=str(ROOT)
    )
    assert r.returncode == 3, explain(r)
    assert r.stdout.splitlines() == ["mpi4py imported: False", "caught 5", "after the catch: None", "at exit: 3"]


# ---- reader threads ----------------------------------------------------------------------------------
def started_since(before):
    """Reader threads alive now that were not alive in `before` (other tests' readers are not ours)."""
    return [t for t in threading.enumerate() if t.name.startswith("numbactr-reader") and t not in before]


def test_a_paused_pass_joins_its_threads_and_keeps_its_place(tmp_path):
    sizes = [7, 5, 9]
    lst = write_id_files(str(tmp_path), sizes)
    want = ref_order(sizes, 3, 2, True, 12)
    before = set(threading.enumerate())
    p = iter(make_reader(norm_params(lst, 3), lst, 2, 1, 2, [2], None, True, True))
    got = [batch_ids(next(p)) for _ in range(5)]
    threads = started_since(before)
    assert len(threads) == 3
    p.pause()
    assert not any(t.is_alive() for t in threads)
    got += [batch_ids(next(p)) for _ in range(4)]  # the workers resume (new threads)
    assert len(started_since(before)) == 3
    p.pause()
    got += [batch_ids(next(p)) for _ in range(3)]
    assert got == want
    p.close()
    assert not started_since(before)


def test_a_dropped_pass_joins_its_threads_at_once(tmp_path):
    lst = write_id_files(str(tmp_path), [50])
    before = set(threading.enumerate())
    it = iter(make_reader(norm_params(lst, 1), lst, 2, 1, 2, [2], None, True, True))
    next(it)
    threads = started_since(before)
    assert threads
    it = iter(make_reader(norm_params(lst, 1), lst, 2, 1, 2, [2], None, True, True))  # the old one is dropped
    assert not any(t.is_alive() for t in threads)
    del it
    assert not started_since(before)


def test_fit_stops_the_readers_and_training_goes_on_where_it_stopped(tmp_path):
    before_device = device.kind()
    device.set_device("cpu")
    try:
        data = tiny_data(str(tmp_path), n_train=240, n_eval=96)
        a, b = tiny_dlrm(*data, batch=16, lr=0.05), tiny_dlrm(*data, batch=16, lr=0.05)
        before = set(threading.enumerate())
        a.fit(max_iter=4, display=0, eval_interval=2, snapshot=0)
        assert not started_since(before)
        for _ in range(3):
            assert a.train()
        for _ in range(7):  # b: the same 7 steps with no pause
            assert b.train()
        np.testing.assert_array_equal(a.weights, b.weights)
    finally:
        device.set_device(before_device)


def test_no_reader_thread_runs_when_the_interpreter_shuts_down(tmp_path):
    """A Parquet pass still decoding when the script ends: the threads are joined by numbactr's atexit
    handler, before the interpreter finalizes (checked by a handler registered before numbactr's, which
    therefore runs after it), and the process exits cleanly."""
    pytest.importorskip("pyarrow")
    from numbactr.data.parquet import ParquetDatasetWriter

    rng = np.random.default_rng(0)
    w = ParquetDatasetWriter(str(tmp_path), 1, 13, 26, row_group_size=5000, multi_hot={0, 1})
    n = 20000
    for f in range(4):
        slots = [
            (rng.integers(0, 1000, 3 * n), np.full(n, 3)) if k < 2 else rng.integers(0, 1000, n) for k in range(26)
        ]
        w.write_file(f"p{f}.parquet", rng.random((n, 1)) < 0.3, rng.random((n, 13)), slots)
    w.close()
    script = textwrap.dedent(f"""
        import atexit, threading
        def check():
            alive = [t.name for t in threading.enumerate() if t.name.startswith("numbactr-reader")]
            print("reader threads alive after numbactr's exit handler:", alive, flush=True)
        atexit.register(check)
        from numbactr.data.reader import DataReader
        from numbactr.enums import DataReaderType_t as T
        r = DataReader(T.Parquet, {str(tmp_path / "_file_list.txt")!r}, 16384, 1, 13, [26], None, True, True,
                       num_workers=4, local_devices=4, slot_size_array=[1000] * 26)
        p = iter(r)
        for _ in range(8):
            next(p)
        """)
    for _ in range(2):
        r = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env(), timeout=120, cwd=str(ROOT)
        )
        assert r.returncode == 0, explain(r)
        assert "reader threads alive after numbactr's exit handler: []" in r.stdout, explain(r)
        assert "terminate called" not in r.stderr and "Fatal Python error" not in r.stderr, explain(r)
