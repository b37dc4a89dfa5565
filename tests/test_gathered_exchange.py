"""The gathered exchange of a key-owned (Distributed) sharded table (numbactr.embedding.sharded): allgather of
the keys, lookup of the owned ones (the engine's ``skip``), reduce-scatter of the vectors, the gradients
allgathered. Fixed in size whatever the keys, so a CUDA graph of a step on several ranks can hold it.

* the engine's ``skip``: skipped occurrences read zeros, are not inserted, are not updated (cpu and sim);
* Comm.allgather / reduce_scatter_sum on one rank; NcclComm's allGather / reduceScatter calls against a
  stand-in with CuPy's signatures;
* step_key / ready: which fixed keys the tables make from every rank's part;
* under mpiexec (2 and 3 ranks on cpu, 2 on sim): training and evaluation equal the one-rank run bit for bit,
  every training lookup having taken the gathered exchange.
"""

import os
import pathlib
import re
import subprocess
import sys
import types

import numpy as np
import pytest

from numbactr.runtime import device
from numbactr.distributed.comm import Comm
from numbactr.embedding import sharded
from numbactr.embedding.engine import BoundsCheck, Optim, OptimizerSpec, Pooling, TableBatchedEmbedding, TableSpec
from tests.mpi_util import MPIEXEC, needs_mpi
from tests.test_sharded_exchange import _same

HERE = pathlib.Path(__file__).parent
ROOT = str(HERE.parent)


@pytest.mark.parametrize("dev", ["cpu", "sim"])
def test_engine_skip_reads_inserts_and_updates_nothing(on_device, dev):
    on_device(dev)
    if dev == "sim" and not device._numba_simulated():
        pytest.skip("needs the simulator")

    def engine():
        e = TableBatchedEmbedding(
            [TableSpec(100, 4, keyed=True)],
            [0],
            pooling=Pooling.NONE,
            optimizer=OptimizerSpec(Optim.EXACT_SGD, learning_rate=0.5),
            bounds_check=BoundsCheck.FATAL,
        )
        e.defer_checks = e.impl == "kernels"
        return e

    keys = np.array([7, 3, 7, 11, 3, 5], np.uint64)
    offsets = np.array([0, 6])
    skip = np.array([False, True, False, True, True, False])
    e, plain = engine(), engine()
    out, ctx = e.forward(keys, offsets, skip=device.xp().asarray(skip))
    want, _ = plain.forward(keys[~skip], np.array([0, 3]))
    out, want = device.to_host(out), device.to_host(want)
    np.testing.assert_array_equal(out[skip], 0)
    np.testing.assert_array_equal(out[~skip], want)
    assert (device.to_host(ctx.rows)[skip] == -1).all()
    e.check_deferred()
    table = e.hash_tables[0]
    assert int(table.size) == 2  # 7 and 5: 3 and 11 were never inserted
    assert int(device.to_host(table.find(device.xp().asarray(np.array([3, 11], np.uint64)))).max()) == -1
    before = device.to_host(e.weights).copy()
    e.backward(ctx, device.xp().asarray(np.ones((6, 4), np.float32)))
    after = device.to_host(e.weights)
    rows = device.to_host(ctx.rows)
    changed = np.flatnonzero((after != before).reshape(-1, after.size // 100).any(axis=1))
    assert set(changed) == set(rows[~skip].tolist())  # only the rows of 7 and 5 moved
    with pytest.raises(ValueError, match="skip must be bool"):
        e.forward(keys, offsets, skip=device.xp().asarray(skip.astype(np.int64)))


def test_one_rank_collectives_are_the_identity():
    comm = Comm.__new__(Comm)
    comm.size, comm.rank = 1, 0
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    assert comm.allgather(x) is x and comm.reduce_scatter_sum(x) is x


def test_nccl_allgather_and_reduce_scatter_calls():
    """NcclComm.allgather / reduce_scatter_sum against a stand-in with CuPy's signatures
    (cupy_backends/cuda/libs/nccl.pyx: allGather(sendbuf, recvbuf, count, datatype, stream),
    reduceScatter(sendbuf, recvbuf, recvcount, datatype, op, stream)), on one rank: counts in elements."""
    from numbactr.distributed import nccl as N

    calls = []

    class Buf(np.ndarray):
        @property
        def data(self):
            return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

    def arr(a):
        return np.ascontiguousarray(a).view(Buf)

    fake_cp = types.SimpleNamespace(
        ascontiguousarray=arr,
        empty=lambda shape, dtype: arr(np.empty(shape, dtype)),
        cuda=types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=0)),
    )

    class Communicator:
        def allGather(self, sendbuf, recvbuf, count, datatype, stream):
            calls.append(("allGather", count, datatype))

        def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
            calls.append(("reduceScatter", recvcount, datatype, op))

    comm = N.NcclComm.__new__(N.NcclComm)
    comm._cupy, comm._c, comm.size, comm.rank = fake_cp, Communicator(), 2, 0
    comm._nccl = types.SimpleNamespace(NCCL_SUM=0)
    comm._types = {np.dtype(np.float32): 7, np.dtype(np.uint64): 5}
    got = comm.allgather(arr(np.zeros((6,), np.uint64)))
    assert got.shape == (12,) and calls[-1] == ("allGather", 6, 5)
    got = comm.reduce_scatter_sum(arr(np.zeros((8, 4), np.float32)))
    assert got.shape == (4, 4) and calls[-1] == ("reduceScatter", 16, 7, 0)
    with pytest.raises(ValueError, match="do not split over 2 ranks"):
        comm.reduce_scatter_sum(arr(np.zeros((7, 4), np.float32)))


def test_step_keys():
    """Slot-owned tables plan their counts; key-owned ones gather, with every rank's N alike."""
    comm = types.SimpleNamespace(size=2, rank=0)
    local = sharded.ShardedTable(comm, 4, 3, Pooling.SUM, None)
    dist = sharded.ShardedTable(comm, 4, 3, Pooling.SUM, None, owner_of_keys=lambda k: k % 2)
    assert local.step_key([6, 4]) == ("one key per bag", 6, 4) and not local.ready(("one key per bag", 6, 4))
    assert dist.step_key([6, 6]) == ("gathered", 6) and dist.ready(("gathered", 6))
    assert dist.step_key([6, 4]) is None and not dist.ready(None)  # allgather needs equal sizes
    assert dist.step_key([6, -1]) is None and local.step_key([-1, 6]) is None
    dist.fixed_key = ("gathered", 6)
    assert dist.gathers() and not local.gathers()
    with pytest.raises(RuntimeError, match="needs owner_of_keys"):
        local._lookup_gathered(np.zeros(6, np.uint64), np.arange(7), True, None, Pooling.SUM, 6)


def _run(ranks, dev, out, mode, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(NUMBACTR_DEVICE=dev, PYTHONPATH=ROOT)
    cmd = [sys.executable, str(HERE / "mpi" / "gathered_run.py"), str(out), mode]
    if ranks > 1:
        cmd = [MPIEXEC, "-n", str(ranks)] + cmd
    r = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL, cwd=ROOT
    )
    assert r.returncode == 0, f"{ranks} ranks, {dev}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    counts = [int(c) for c in re.search(r"gathered lookups per rank: \[([\d, ]+)\]", r.stdout).group(1).split(",")]
    return dict(np.load(out)), counts


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    got, counts = _run(1, "cpu", tmp_path_factory.mktemp("one") / "one.npz", "alltoall")
    assert counts == [0]
    return got


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_gathered_exchange_equals_one_rank_bit_for_bit(tmp_path, one_rank, ranks):
    got, counts = _run(ranks, "cpu", tmp_path / "g.npz", "gathered")
    assert counts == [20] * ranks  # 5 tables x 4 training steps, on every rank
    _same(got, one_rank, f"{ranks} ranks, gathered")


@pytest.mark.mpi
@pytest.mark.slow
@needs_mpi
def test_gathered_exchange_on_the_simulators_kernels(tmp_path, one_rank):
    """The deferred keyed lookup (kernels: the hash insert skips the other ranks' keys on the device)."""
    got, counts = _run(2, "sim", tmp_path / "g.npz", "gathered")
    assert counts == [20, 20]
    _same(got, one_rank, "2 ranks on sim, gathered")
