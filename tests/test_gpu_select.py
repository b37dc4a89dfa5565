"""One GPU per rank and the choice between NCCL and host-staged MPI (numbactr.distributed.placement):
the pure decisions on cpu, the MPI placement under mpiexec, and the NCCL path on GPUs (gpu mark)."""

import os
import subprocess
import sys
import warnings

import pytest

import numbactr as hugectr
from numbactr.runtime import device
from numbactr.config import IgnoredArgumentWarning
from numbactr.distributed import placement as P
from tests.mpi_util import MPIEXEC, needs_mpi

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# -- local rank from the launcher's environment ---------------------------------------------------------
@pytest.mark.parametrize(
    "env, want",
    [
        ({}, None),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, (3, 4, "OMPI_COMM_WORLD_LOCAL_RANK")),
        ({"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, (1, 2, "MPI_LOCALRANKID")),
        ({"PMI_LOCAL_RANK": "0"}, (0, None, "PMI_LOCAL_RANK")),
        ({"SLURM_LOCALID": "5", "SLURM_NTASKS_PER_NODE": "8(x2)"}, (5, 8, "SLURM_LOCALID")),
        # Open MPI's variable wins over Slurm's when both are set (mpirun inside an allocation)
        ({"SLURM_LOCALID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, (2, None, "OMPI_COMM_WORLD_LOCAL_RANK")),
    ],
)
def test_local_from_env(env, want):
    assert P.local_from_env(env) == want


@pytest.mark.parametrize(
    "env, words",
    [
        ({"MPI_LOCALRANKID": "x1"}, "MPI_LOCALRANKID='x1'"),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, "not below"),
    ],
)
def test_local_from_env_rejects(env, words):
    with pytest.raises(P.PlacementError, match=words):
        P.local_from_env(env)


def test_node_of_numbers_nodes_by_first_rank():
    leaders = [0, 0, 2, 2, 4, 4]  # three nodes of two ranks
    assert [P.node_of(leaders, r) for r in range(6)] == [(0, 3), (0, 3), (1, 3), (1, 3), (2, 3), (2, 3)]
    leaders = [0, 1, 0, 1]  # round-robin placement over two nodes
    assert [P.node_of(leaders, r)[0] for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(P.PlacementError, match="rank 4"):
        P.node_of(leaders, 4)


# -- the GPU of a rank ----------------------------------------------------------------------------------
def test_choose_gpu_default_spreads_local_ranks():
    assert [P.choose_gpu(i, 0, 4)[0] for i in range(6)] == [0, 1, 2, 3, 0, 1]
    assert [P.choose_gpu(i, 1, 2, [[0]])[0] for i in range(3)] == [0, 1, 0]  # HugeCTR's default vvgpu
    with pytest.raises(P.PlacementError, match="no visible"):
        P.choose_gpu(0, 0, 0)


def test_choose_gpu_honours_vvgpu():
    vv = [[2, 3], [1, 0, 3]]
    assert [P.choose_gpu(i, 0, 4, vv)[0] for i in range(3)] == [2, 3, 2]
    assert [P.choose_gpu(i, 1, 4, vv)[0] for i in range(4)] == [1, 0, 3, 1]
    assert [P.choose_gpu(i, 5, 4, [[3, 1]])[0] for i in range(2)] == [3, 1]  # one list for every node
    gpu, why = P.choose_gpu(1, 1, 4, vv)
    assert "vvgpu[1][1] = GPU 0" in why


@pytest.mark.parametrize(
    "args, words",
    [
        ((0, 2, 4, [[0], [1]]), "2 nodes but this rank runs on node 2"),
        ((1, 0, 2, [[0, 5]]), "GPU 5, but only 2 GPU"),
        ((0, 0, 2, [[0], []]), "empty node list"),
        ((0, 0, 2, [[-1]]), "negative"),
        ((0, 0, 2, 7), "list of per-node GPU lists"),
    ],
)
def test_choose_gpu_rejects(args, words):
    with pytest.raises(P.PlacementError, match=words):
        P.choose_gpu(*args)


@pytest.mark.parametrize(
    "value, want",
    [
        (None, None),
        ("", None),
        ("3", "3"),
        (" 2 ", "2"),
        ("0,1", None),
        ("1,", "1"),
        ("GPU-8f2c1a52-6d0b-4e49-9d3f-0a1b2c3d4e5f", "GPU-8f2c1a52-6d0b-4e49-9d3f-0a1b2c3d4e5f"),
    ],
)
def test_pinned_device(value, want):
    assert P.pinned_device(value) == want


def test_choose_gpu_launcher_pinned_rank_uses_its_one_gpu():
    """Slurm --gpus-per-task=1 (or a wrapper script) gives each rank CUDA_VISIBLE_DEVICES of one device: a
    HugeCTR script's vvgpu=[[0, 1, 2, 3]] names the node's GPUs, which the launcher has already handed out, so
    local rank 1 runs on its one visible GPU instead of failing to find GPU 1."""
    vv = [[0, 1, 2, 3]]
    for lr in range(4):
        gpu, why = P.choose_gpu(lr, 0, 1, vv, str(lr))
        assert gpu == 0
        assert f"CUDA_VISIBLE_DEVICES={lr}" in why and "launcher assigned" in why and "vvgpu not applied" in why
    gpu, why = P.choose_gpu(3, 1, 1, None, "GPU-8f2c1a52")  # default vvgpu: the same GPU, the reason said
    assert gpu == 0 and "CUDA_VISIBLE_DEVICES=GPU-8f2c1a52" in why and "vvgpu" not in why
    assert P.choose_gpu(1, 5, 1, [[0], [1]], "7")[0] == 0  # node beyond vvgpu's lists: the launcher decides
    # not pinned: vvgpu is checked as before
    with pytest.raises(P.PlacementError, match="GPU 1, but only 1 GPU"):
        P.choose_gpu(1, 0, 1, vv)  # CUDA_VISIBLE_DEVICES unset, one GPU
    with pytest.raises(P.PlacementError, match="GPU 1, but only 1 GPU"):
        P.choose_gpu(1, 0, 1, vv, "0,5")  # two named (one invalid): not a per-rank pin
    assert P.choose_gpu(1, 0, 4, vv, "2")[0] == 1  # a pin must show exactly one GPU
    with pytest.raises(P.PlacementError, match="negative"):
        P.choose_gpu(0, 0, 1, [[-1]], "0")  # a malformed vvgpu is still an error


# -- which GPU a rank has: its PCI address, never the visible index ---------------------------------------
def test_pci_key_round_trip():
    k = P.pci_key(0, 0x3B, 0)
    assert P.pci_text(k) == "0000:3b:00"
    assert P.pci_key_from_text("0000:3b:00.0") == k == P.pci_key_from_text("00000000:3B:00.0")
    assert P.pci_key_from_text("0001:c1:1f.0") == P.pci_key(1, 0xC1, 0x1F)
    big = P.pci_key(0xABCD1234, 0xFF, 0x1F)  # 32-bit domains (some VMs) fit an int64
    assert 0 < big < 2**63 and P.pci_text(big) == "abcd1234:ff:1f"
    with pytest.raises(P.PlacementError, match="not a PCI bus id"):
        P.pci_key_from_text("GPU-8f2c1a52")
    with pytest.raises(P.PlacementError, match="out of range"):
        P.pci_key(0, 256, 0)


def test_own_gpus_compares_pci_addresses_per_node():
    a, b, c, d = (P.pci_key(0, bus, 0) for bus in (0x1B, 0x3B, 0x5E, 0x86))
    # four ranks on one node under per-rank CUDA_VISIBLE_DEVICES: all use visible GPU 0, four physical GPUs
    assert P.own_gpus([(0, a), (0, b), (0, c), (0, d)]) == (True, "")
    # the same bus ids on two nodes are different GPUs
    assert P.own_gpus([(0, a), (0, b), (1, a), (1, b)]) == (True, "")
    own, why = P.own_gpus([(0, a), (0, b), (0, a)])
    assert not own and why == "ranks 0 and 2 share a GPU (PCI 0000:1b:00 on node 0)"
    own, why = P.own_gpus([(0, a), (0, -1)])
    assert not own and "rank 1 has no GPU" in why
    assert P.own_gpus([]) == (True, "")


class _Request:
    def Wait(self):
        pass


class _FakeMPI:
    """One rank of `rows` ranks: Iallgather fills in every rank's row (the others' from `rows`)."""

    def __init__(self, rank, rows):
        self.rank, self.rows = rank, rows

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return len(self.rows)

    def Iallgather(self, mine, every):
        for r, row in enumerate(self.rows):
            every[r] = mine if r == self.rank else row
        return _Request()


@pytest.mark.parametrize("buses, want", [((0x1B, 0x3B), "nccl"), ((0x1B, 0x1B), "mpi")])
def test_transport_tells_gpus_apart_by_pci_address(monkeypatch, buses, want):
    """Comm.transport() on two ranks whose visible GPU index is 0 on both (per-rank CUDA_VISIBLE_DEVICES):
    distinct PCI addresses give NCCL (the old (node, visible index) key said 'share a GPU'), equal ones host
    MPI. Everything but the decision is stubbed: the device, NCCL, and the allgather."""
    from numbactr.distributed import comm as C
    from numbactr.distributed import nccl

    made = []

    class _Nccl:
        def __init__(self, mpi_comm, bcast=None):
            made.append((mpi_comm, bcast))

    keys = [P.pci_key(0, b, 0) for b in buses]
    monkeypatch.setattr(device, "kind", lambda: "gpu")
    monkeypatch.setattr(device, "gpu_index", lambda: 0)
    monkeypatch.setattr(C, "gpu_pci_key", lambda gpu: keys[0] if gpu == 0 else -1)
    monkeypatch.setattr(nccl, "importable", lambda: True)
    monkeypatch.setattr(nccl, "NcclComm", _Nccl)
    monkeypatch.delenv("NUMBACTR_COMM", raising=False)
    fake = _FakeMPI(0, [None, [0, keys[1], 1]])
    c = C.Comm(fake)
    transport, why = c.transport()
    assert transport == want, why
    assert c.calls == 1 and c.transport() == (transport, why)  # decided once
    if want == "nccl":
        assert made == [(fake, c.bcast)]  # the unique id by the guarded bcast
    else:
        assert made == [] and "ranks 0 and 1 share a GPU (PCI 0000:1b:00 on node 0)" in why


def test_gpu_pci_key_reads_numba_identity(monkeypatch):
    """gpu_pci_key packs numba-cuda's Device.get_device_identity(); -1 when no source can read it."""
    from numba import cuda

    from numbactr.distributed import comm as C

    class _Dev:
        def get_device_identity(self):
            return {"pci_domain_id": 0, "pci_bus_id": 0x3B, "pci_device_id": 0}

    class _Gpus:
        def __getitem__(self, i):
            if i != 0:
                raise IndexError(i)
            return _Dev()

    monkeypatch.setattr(cuda, "gpus", _Gpus(), raising=False)
    assert C.gpu_pci_key(0) == P.pci_key(0, 0x3B, 0)
    monkeypatch.setitem(sys.modules, "cupy", None)  # no CuPy to fall back on
    assert C.gpu_pci_key(1) == -1


def test_device_report_pinned_rank_is_no_sharing_warning():
    """numbactr device under a per-rank CUDA_VISIBLE_DEVICES: one visible GPU for 4 local ranks is the
    launcher's assignment, not 4 ranks on one GPU."""
    from numbactr.runtime import device_report as R
    from tests.test_device_report import facts, levels

    four = {
        "rank": 1,
        "size": 4,
        "local_rank": 1,
        "local_size": 4,
        "node": 0,
        "nodes": 1,
        "source": "MPI shared-memory split",
    }
    found = R.diagnose(facts(placement=four, visible_devices="1"))
    assert not any("share" in m for m in levels(found, "warning")), found
    assert any("CUDA_VISIBLE_DEVICES=1 shows this rank one GPU" in m for m in levels(found, "note")), found
    for visible in (None, "0,1"):  # unset, or several named: one GPU for four ranks is shared
        found = R.diagnose(facts(placement=four, visible_devices=visible))
        assert any("4 ranks on this node share 1 GPU" in m for m in levels(found, "warning")), found
    gpu = dict(facts()["gpus"][0], pci="0000:3b:00")
    text = R.report(facts(gpus=[gpu], visible_devices="1"), [])
    assert "PCI 0000:3b:00" in text and "CUDA_VISIBLE_DEVICES: 1" in text


def test_idle_gpus():
    two_per_node = P.Placement(0, 4, 0, 2, 0, 2)
    assert P.idle_gpus(two_per_node, [[0, 1], [0, 1]]) == []
    assert P.idle_gpus(two_per_node, [[0, 1, 2], [0, 1], [4]]) == [(0, 2), (2, 4)]
    assert P.idle_gpus(P.Placement(), [[0, 1]]) == [(0, 1)]


def test_create_solver_warns_only_about_idle_gpus(cpu):
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredArgumentWarning)
        hugectr.CreateSolver(vvgpu=[[1]])  # one process, one GPU listed: used, no warning
    with pytest.warns(IgnoredArgumentWarning, match=r"node 0 GPU 3 stay\(s\) idle.*mpiexec -n 2"):
        hugectr.CreateSolver(vvgpu=[[2, 3]])
    assert device._state["vvgpu"] == ((2, 3),)
    hugectr.CreateSolver(vvgpu=[[0]])
    assert device._state["vvgpu"] == ((0,),)


# -- NCCL or host-staged MPI ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, want",
    [
        ((1, "gpu", True, True), "mpi"),
        ((2, "gpu", True, True), "nccl"),
        ((2, "gpu", False, True), "mpi"),
        ((2, "gpu", True, False), "mpi"),
        ((4, "cpu", True, True), "mpi"),
        ((2, "sim", True, True), "mpi"),
        ((2, "gpu", True, True, "mpi"), "mpi"),
        ((2, "gpu", True, True, "NCCL"), "nccl"),
    ],
)
def test_choose_transport(args, want):
    assert P.choose_transport(*args)[0] == want


def test_choose_transport_says_why_and_rejects():
    assert "share a GPU" in P.choose_transport(2, "gpu", False, True)[1]
    with pytest.raises(P.PlacementError, match="NUMBACTR_COMM=nccl, but the device is cpu"):
        P.choose_transport(2, "cpu", True, True, "nccl")
    with pytest.raises(P.PlacementError, match="expected nccl or mpi"):
        P.choose_transport(2, "gpu", True, True, "gloo")


_PLACE = (
    "import sys; from numbactr.distributed.comm import world; c = world(); p = c.placement; "
    "open(f'{sys.argv[1]}/{c.rank}.txt', 'w').write(repr((p.rank, p.local_rank, p.local_size, p.node, "
    "p.nodes, p.source, c.transport()[0])))"
)


@needs_mpi
def test_placement_and_transport_under_mpiexec(tmp_path):
    """Two ranks on this machine: local ranks 0 and 1 of one node from MPI's shared-memory split, and
    the cpu device's collectives stay on host MPI."""
    env = dict(os.environ, NUMBACTR_DEVICE="cpu", PYTHONPATH=ROOT)
    out = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, "-c", _PLACE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
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
    out = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, os.path.join(HERE, "mpi", "nccl_run.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count(" ok") == 2, out.stdout


def test_gpu_device_turns_off_numbas_array_interface_stream_sync(monkeypatch):
    """Every kernel argument is a CuPy array: numba's default would wait on the host for the producer's stream
    at each launch. Choosing the GPU switches that off, unless the environment says otherwise."""
    from numba.cuda.core import config as cuda_config
    from numbactr.runtime import device

    monkeypatch.setattr(cuda_config, "CUDA_ARRAY_INTERFACE_SYNC", 1)
    monkeypatch.setenv("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "1")
    device._no_interface_sync()
    assert cuda_config.CUDA_ARRAY_INTERFACE_SYNC == 1  # the user's setting stands
    monkeypatch.delenv("NUMBA_CUDA_ARRAY_INTERFACE_SYNC")
    device._no_interface_sync()
    assert cuda_config.CUDA_ARRAY_INTERFACE_SYNC == 0


def test_asking_for_the_simulator_on_a_gpu_skips_the_test(on_device, monkeypatch):
    """conftest's on_device: a test that asks for 'sim' in a process whose numba runs real CUDA (the whole
    suite with NUMBACTR_DEVICE=gpu) is skipped with its reason, not failed by set_device's DeviceError."""
    from numbactr.runtime import device

    monkeypatch.setattr(device, "_numba_simulated", lambda: False)
    with pytest.raises(pytest.skip.Exception, match="Numba's simulator"):
        on_device("sim")
    on_device("cpu")  # the other devices switch as before
    assert device.kind() == "cpu"
