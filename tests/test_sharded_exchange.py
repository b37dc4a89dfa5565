"""Sharded embeddings' exchanges on the device (numbactr.embedding.sharded.exchange_on_device): which path
a job takes, and the device path equal to the one-rank run bit for bit (on the cpu device under mpiexec,
with NumPy arrays standing in for CuPy's; on GPUs with NCCL in the gpu-marked test)."""

import os
import re
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from numbactr.embedding import sharded
from tests.mpi_util import MPIEXEC, needs_mpi

HERE = pathlib.Path(__file__).parent
ROOT = str(HERE.parent)


class FakeComm:
    def __init__(self, size, transport):
        self.size, self._transport, self.asked = size, transport, 0

    def transport(self):
        self.asked += 1
        return (self._transport, "why")


@pytest.mark.parametrize(
    "kind,size,transport,want,asked",
    [
        ("gpu", 2, "nccl", True, 1),  # one GPU per rank, NCCL usable: device arrays to Comm
        ("gpu", 2, "mpi", False, 1),  # ranks share a GPU, no NCCL or NUMBACTR_COMM=mpi: host path
        ("gpu", 1, "nccl", False, 0),  # one rank: nothing is exchanged
        ("cpu", 2, "nccl", False, 0),  # cpu and sim: host path, without the transport collective
        ("sim", 3, "nccl", False, 0),
    ],
)
def test_exchange_path_choice(monkeypatch, kind, size, transport, want, asked):
    monkeypatch.setattr(sharded.device, "kind", lambda: kind)
    comm = FakeComm(size, transport)
    assert sharded.exchange_on_device(comm) is want
    assert comm.asked == asked


def test_split_cuts_rows_at_host_integers():
    a = np.arange(10).reshape(5, 2)
    parts = sharded._split(a, np.array([0, 2, 2]))
    assert [p.shape[0] for p in parts] == [0, 2, 0, 3]
    np.testing.assert_array_equal(np.concatenate(parts), a)
    assert [p.shape[0] for p in sharded._split(a, [])] == [5]


def _run(script, out, ranks, device, *extra, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(NUMBACTR_DEVICE=device, PYTHONPATH=ROOT)
    r = subprocess.run(
        [MPIEXEC, "-n", str(ranks), sys.executable, str(HERE / "mpi" / script), str(out), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
    )
    assert r.returncode == 0, f"mpiexec -n {ranks} {script} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout, dict(np.load(out))


def _same(got, want, what):
    assert got.keys() == want.keys()
    for name, w in want.items():
        np.testing.assert_array_equal(got[name], w, err_msg=f"{what}: {name}")


@pytest.mark.mpi
@needs_mpi
def test_device_path_equals_one_rank_bit_for_bit(tmp_path):
    """The device path's steps (gathers by owner, row splits, the scatter back, the gradients' return) with
    NumPy arrays on 2 ranks: every embedding type's outputs, evaluation and table equal one rank's."""
    _, one = _run("embedding_sharded_run.py", tmp_path / "one.npz", 1, "cpu")
    out, two = _run("sharded_device_run.py", tmp_path / "two.npz", 2, "cpu", "force")
    # the ranks' lines can arrive interleaved on one line (two processes, one pipe): match the report itself
    lookups = {int(rank): int(n) for rank, n in re.findall(r"rank (\d+): device-path lookups (\d+)", out)}
    assert sorted(lookups) == [0, 1] and min(lookups.values()) > 0, out  # the device path ran on both ranks
    _same(two, one, "2 ranks, device path")


@pytest.mark.mpi
@pytest.mark.slow
@needs_mpi
def test_device_path_with_simulated_kernels_equals_one_rank(tmp_path):
    """The same on the sim device (the owners' engines run their kernels in the simulator; ~2 minutes)."""
    _, one = _run("embedding_sharded_run.py", tmp_path / "one.npz", 1, "cpu")
    out, two = _run("sharded_device_run.py", tmp_path / "two.npz", 2, "sim", "force", timeout=600)
    assert out.count("device-path lookups 20") == 2, out
    _same(two, one, "2 ranks on sim, device path")


@pytest.mark.gpu
@needs_mpi
def test_device_path_by_nccl_on_gpus(tmp_path):
    """Two ranks with a GPU each: the exchanges take the device path (NCCL) and equal the one-rank run."""
    from numba import cuda

    if len(cuda.gpus) < 2:
        pytest.skip("needs two GPUs (one per rank) for NCCL")
    _, one = _run("embedding_sharded_run.py", tmp_path / "one.npz", 1, "gpu")
    out, two = _run("sharded_device_run.py", tmp_path / "two.npz", 2, "gpu", "auto")
    assert out.count("transport nccl") == 2, out
    assert all(int(line.split("lookups ")[1].split()[0]) > 0 for line in out.splitlines() if "device-path" in line)
    _same(two, one, "2 ranks on GPUs, NCCL")


def test_a_fixed_exchange_plan_holds_only_for_the_owners_it_was_made_for():
    """A plan (numbactr.embedding.sharded: the grouping and receive counts kept under a fixed key) is reused
    only for the owners it was made with; other owners under the same key are an error, not rows sent where
    no rank expects them."""
    table = sharded.ShardedTable(FakeComm(2, "mpi"), 4, 2, sharded.Pooling.SUM, None)
    owner = np.array([0, 1, 0, 1, 0, 0])
    order, cuts = sharded._group(owner, 2)
    assert order.tolist() == [0, 2, 4, 5, 1, 3] and cuts.tolist() == [4]
    assert sharded._sent(cuts, 6) == [4, 2]
    key = ("one key per bag", 6, 6)
    table.plans[key] = sharded.ExchangePlan(owner.copy(), order, cuts, None, (4, 3))
    assert table._plan(None, owner, None) is None and table.plan_hits == 0  # no key: counts exchanged
    assert table._plan(("one key per bag", 6, 4), owner, None) is None  # a key not planned yet
    assert table._plan(key, owner, None) is table.plans[key] and table.plan_hits == 1
    with pytest.raises(RuntimeError, match="made for other owners"):
        table._plan(key, np.array([1, 1, 0, 1, 0, 0]), None)
    table.plans[key].payload_host = np.arange(6)
    with pytest.raises(RuntimeError, match="made for other owners"):
        table._plan(key, owner, np.arange(6)[::-1])


def test_exchange_key_parts():
    """HashEmbedding.exchange_key_part: a slot-owned table's occurrence count when its bags hold one key each,
    offsets known on the host (its owners follow from it), else -1; a key-owned table's occurrence count
    whatever the bags (its gathered exchange is fixed by it alone)."""
    from numbactr.embedding.sparse_embedding import HashEmbedding

    emb = object.__new__(HashEmbedding)
    emb._sharded, emb.by_slot = object(), True
    keys = np.arange(6, dtype=np.int64)
    assert emb.exchange_key_part(keys, np.arange(7)) == 6
    assert emb.exchange_key_part(keys, np.array([0, 2, 3, 4, 5, 6, 6])) == -1  # a multi-hot bag
    assert emb.exchange_key_part(keys[:5], np.arange(7)) == -1
    emb.by_slot = False  # Distributed: key-owned
    assert emb.exchange_key_part(keys, np.arange(7)) == 6
    assert emb.exchange_key_part(keys, np.array([0, 2, 3, 4, 5, 6, 6])) == 6  # multi-hot too
    emb.by_slot, emb._sharded = True, None  # one rank: no exchange
    assert emb.exchange_key_part(keys, np.arange(7)) == -1
