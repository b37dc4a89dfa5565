"""numbactr.runtime.threads: compute threads and reader workers are split so they never exceed the cores,
the user's settings win, the plan is really applied (threadpoolctl, numba) and stated at start-up."""

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from numbactr.runtime import threads


@pytest.fixture
def clean_env(monkeypatch):
    for k in (
        threads.ENV_COMPUTE,
        threads.ENV_READERS,
        "NUMBA_NUM_THREADS",
        *threads.BLAS_ENV,
        *threads.LOCAL_RANKS_ENV,
    ):
        monkeypatch.delenv(k, raising=False)
    yield monkeypatch
    monkeypatch.undo()
    threads.configure()  # leave the process with the default plan


@pytest.mark.parametrize("cores,compute,readers", [(1, 1, 1), (2, 1, 1), (4, 3, 1), (8, 6, 2), (16, 12, 4)])
def test_default_split_never_oversubscribes(clean_env, cores, compute, readers):
    p = threads.decide(cores=cores)
    assert (p.compute, p.reader_workers) == (compute, readers)
    assert p.compute + p.reader_workers <= max(cores, 2)


def test_environment_and_arguments_override(clean_env):
    clean_env.setenv(threads.ENV_COMPUTE, "3")
    clean_env.setenv(threads.ENV_READERS, "2")
    p = threads.decide(cores=2)
    assert (p.compute, p.reader_workers) == (3, 2)
    assert threads.decide(compute=5, reader_workers=1, cores=2).compute == 5


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_bad_environment_value_is_a_clear_error(clean_env, value):
    clean_env.setenv(threads.ENV_COMPUTE, value)
    with pytest.raises(ValueError, match=rf"NUMBACTR_THREADS={value!r}.*positive whole number"):
        threads.decide()


def test_mpi_ranks_on_one_host_share_the_cores(clean_env):
    total = threads.available_cores()
    clean_env.setenv("MPI_LOCALNRANKS", "2")
    assert threads.available_cores() == max(1, total // 2)


def test_configure_applies_blas_and_numba_limits(clean_env):
    import numba
    from threadpoolctl import threadpool_info

    p = threads.configure(compute=1, reader_workers=1)
    blas = [i for i in threadpool_info() if i["user_api"] == "blas"]
    assert blas and all(i["num_threads"] == 1 for i in blas)
    assert numba.get_num_threads() == 1
    assert "openblas 1" in p.blas and p.numba == "1"
    assert "compute 1" in p.describe() and "reader workers 1" in p.describe()


def test_users_blas_variable_is_respected(clean_env):
    clean_env.setenv("OMP_NUM_THREADS", "1")
    p = threads.configure()
    assert p.blas == "as set by OMP_NUM_THREADS=1"


def test_default_reader_workers_never_warn(clean_env, tmp_path):
    """No num_workers in the script: fewer files than workers is sized silently (no UserWarning)."""
    from numbactr.data.norm import write_norm_file
    from numbactr.data.file_list import write_file_list
    from numbactr.data.reader import DataReader
    from numbactr.enums import Check_t, DataReaderType_t

    path = str(tmp_path / "a.data")
    write_norm_file(
        path, np.zeros((4, 1)), np.zeros((4, 1), np.float32), np.zeros((4, 1), np.int64), Check_t.Sum, np.int64
    )
    lst = str(tmp_path / "list.txt")
    write_file_list(lst, [path])
    threads.configure(compute=1, reader_workers=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = DataReader(DataReaderType_t.Norm, lst, 2, 1, 1, [1], None, True, False)
    assert r.num_workers == 1 and not r.num_workers_chosen
    assert sum(b.size for b in r) == 4
    with pytest.warns(UserWarning, match="num_workers is 3"):  # the user's own choice still warns
        DataReader(DataReaderType_t.Norm, lst, 2, 1, 1, [1], None, True, False, num_workers=3)


def test_startup_line_states_device_reason_and_threads():
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", threads.ENV_COMPUTE)}
    env["NUMBACTR_DEVICE"] = "cpu"
    r = subprocess.run(
        [sys.executable, "-m", "numbactr.cli", "device"], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "numbactr: device=cpu (NUMBACTR_DEVICE=cpu: compiled CPU ops); threads: compute " in r.stdout
    assert "reader workers" in r.stdout and r.stderr == ""
