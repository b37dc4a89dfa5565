"""One GPU per rank and the choice between NCCL and host-staged MPI (numbactr.distributed.placement):
the pure decisions on cpu, the MPI placement under mpiexec, and the NCCL path on GPUs (gpu mark)."""
import os
import subprocess
import sys
import warnings

import pytest

import numbactr as hugectr
from numbactr import device
from numbactr.config import IgnoredArgumentWarning
from numbactr.distributed import placement as P
from tests.mpi_util import MPIEXEC, needs_mpi

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# -- local rank from the launcher's environment ---------------------------------------------------------
@pytest.mark.parametrize("env, want", [
    ({}, None),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, (3, 4, "OMPI_COMM_WORLD_LOCAL_RANK")),
    ({"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, (1, 2, "MPI_LOCALRANKID")),
    ({"PMI_LOCAL_RANK": "0"}, (0, None, "PMI_LOCAL_RANK")),
    ({"SLURM_LOCALID": "5", "SLURM_NTASKS_PER_NODE": "8(x2)"}, (5, 8, "SLURM_LOCALID")),
    # Open MPI's variable wins over Slurm's when both are set (mpirun inside an allocation)
    ({"SLURM_LOCALID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, (2, None, "OMPI_COMM_WORLD_LOCAL_RANK")),
])
def test_local_from_env(env, want):
    assert P.local_from_env(env) == want


@pytest.mark.parametrize("env, words", [
    ({"MPI_LOCALRANKID": "x1"}, "MPI_LOCALRANKID='x1'"),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, "not below"),
])
def test_local_from_env_rejects(env, words):
    with pytest.raises(P.PlacementError, match=words):
        P.local_from_env(env)


def test_node_of_numbers_nodes_by_first_rank():
    leaders = [0, 0, 2, 2, 4, 4]          # three nodes of two ranks
    assert [P.node_of(leaders, r) for r in range(6)] == [(0, 3), (0, 3), (1, 3), (1, 3), (2, 3), (2, 3)]
    leaders = [0, 1, 0, 1]                # round-robin placement over two nodes
    assert [P.node_of(leaders, r)[0] for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(P.PlacementError, match="rank 4"):
        P.node_of(leaders, 4)


# -- the GPU of a rank ----------------------------------------------------------------------------------
def test_choose_gpu_default_spreads_local_ranks():
    assert [P.choose_gpu(i, 0, 4)[0] for i in range(6)] == [0, 1, 2, 3, 0, 1]
    assert [P.choose_gpu(i, 1, 2, [[0]])[0] for i in range(3)] == [0, 1, 0]      # HugeCTR's default vvgpu
    with pytest.raises(P.PlacementError, match="no visible"):
        P.choose_gpu(0, 0, 0)


def test_choose_gpu_honours_vvgpu():
    vv = [[2, 3], [1, 0, 3]]
    assert [P.choose_gpu(i, 0, 4, vv)[0] for i in range(3)] == [2, 3, 2]
    assert [P.choose_gpu(i, 1, 4, vv)[0] for i in range(4)] == [1, 0, 3, 1]
    assert [P.choose_gpu(i, 5, 4, [[3, 1]])[0] for i in range(2)] == [3, 1]       # one list for every node
    gpu, why = P.choose_gpu(1, 1, 4, vv)
    assert "vvgpu[1][1] = GPU 0" in why


@pytest.mark.parametrize("args, words", [
    ((0, 2, 4, [[0], [1]]), "2 nodes but this rank runs on node 2"),
    ((1, 0, 2, [[0, 5]]), "GPU 5, but only 2 GPU"),
    ((0, 0, 2, [[0], []]), "empty node list"),
    ((0, 0, 2, [[-1]]), "negative"),
    ((0, 0, 2, 7), "list of per-node GPU lists"),
])
def test_choose_gpu_rejects(args, words):
    with pytest.raises(P.PlacementError, match=words):
        P.choose_gpu(*args)


def test_idle_gpus():
    two_per_node = P.Placement(0, 4, 0, 2, 0, 2)
    assert P.idle_gpus(two_per_node, [[0, 1], [0, 1]]) == []
    assert P.idle_gpus(two_per_node, [[0, 1, 2], [0, 1], [4]]) == [(0, 2), (2, 4)]
    assert P.idle_gpus(P.Placement(), [[0, 1]]) == [(0, 1)]


def test_create_solver_warns_only_about_idle_gpus(cpu):
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredArgumentWarning)
        hugectr.CreateSolver(vvgpu=[[1]])            # one process, one GPU listed: used, no warning
    with pytest.warns(IgnoredArgumentWarning, match=r"node 0 GPU 3 stay\(s\) idle.*mpiexec -n 2"):
        hugectr.CreateSolver(vvgpu=[[2, 3]])
    assert device._state["vvgpu"] == ((2, 3),)
    hugectr.CreateSolver(vvgpu=[[0]])
    assert device._state["vvgpu"] == ((0,),)


# -- NCCL or host-staged MPI ------------------------------------------------------------------------------
@pytest.mark.parametrize("args, want", [
    ((1, "gpu", True, True), "mpi"),
    ((2, "gpu", True, True), "nccl"),
    ((2, "gpu", False, True), "mpi"),
    ((2, "gpu", True, False), "mpi"),
    ((4, "cpu", True, True), "mpi"),
    ((2, "sim", True, True), "mpi"),
    ((2, "gpu", True, True, "mpi"), "mpi"),
    ((2, "gpu", True, True, "NCCL"), "nccl"),
])
def test_choose_transport(args, want):
    assert P.choose_transport(*args)[0] == want


def test_choose_transport_says_why_and_rejects():
    assert "share a GPU" in P.choose_transport(2, "gpu", False, True)[1]
    with pytest.raises(P.PlacementError, match="NUMBACTR_COMM=nccl, but the device is cpu"):
        P.choose_transport(2, "cpu", True, True, "nccl")
    with pytest.raises(P.PlacementError, match="expected nccl or mpi"):
        P.choose_transport(2, "gpu", True, True, "gloo")


_PLACE = ("import sys; from numbactr.distributed.comm import world; c = world(); p = c.placement; "
          "open(f'{sys.argv[1]}/{c.rank}.txt', 'w').write(repr((p.rank, p.local_rank, p.local_size, p.node, "
          "p.nodes, p.source, c.transport()[0])))")


@needs_mpi
def test_placement_and_transport_under_mpiexec(tmp_path):
    """Two ranks on this machine: local ranks 0 and 1 of one node from MPI's shared-memory split, and
    the cpu device's collectives stay on host MPI."""
    env = dict(os.environ, NUMBACTR_DEVICE="cpu", PYTHONPATH=ROOT)
    out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", _PLACE, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [eval((tmp_path / f"{r}.txt").read_text()) for r in range(2)]
    split = "MPI shared-memory split"
    assert rows == [(0, 0, 2, 0, 1, split, "mpi"), (1, 1, 2, 0, 1, split, "mpi")]


@pytest.mark.gpu
@needs_mpi
def test_device_collectives_on_gpus():
    """NCCL with one GPU per rank (two GPUs or more), host-staged MPI when the ranks share one GPU: the
    same sums and exchanges either way (tests/mpi/nccl_run.py)."""
    env = dict(os.environ, NUMBACTR_DEVICE="gpu", PYTHONPATH=ROOT)
    out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, os.path.join(HERE, "mpi", "nccl_run.py")],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count(" ok") == 2, out.stdout


def test_gpu_device_turns_off_numbas_array_interface_stream_sync(monkeypatch):
    """Every kernel argument is a CuPy array: numba's default would wait on the host for the producer's stream
    at each launch. Choosing the GPU switches that off, unless the environment says otherwise."""
    from numba.cuda.core import config as cuda_config
    from numbactr import device
    monkeypatch.setattr(cuda_config, "CUDA_ARRAY_INTERFACE_SYNC", 1)
    monkeypatch.setenv("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "1")
    device._no_interface_sync()
    assert cuda_config.CUDA_ARRAY_INTERFACE_SYNC == 1                  # the user's setting stands
    monkeypatch.delenv("NUMBA_CUDA_ARRAY_INTERFACE_SYNC")
    device._no_interface_sync()
    assert cuda_config.CUDA_ARRAY_INTERFACE_SYNC == 0
