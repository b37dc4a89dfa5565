"""Kernel launches and device-to-host reads per training step of the demo DLRM (numbactr.demo.build_dlrm)
on the sim device (or the GPU): a launch or a host synchronization added to the step fails this test
without a GPU. The budgets are today's counts; lower counts pass (then lower the budget here).

Launches: numbactr.kernels.launch.COUNTS["launches"] counts every GPU operation of the kernel modules (the
launch helpers, the scan's phases, the embedding engine's CuPy sort); on the simulator the test also hooks
Numba's simulated kernel calls and checks that every numba launch is in that count. Host reads:
COUNTS["host_reads"] (numbactr.runtime.device.to_host and the hash table's reads), plus numba device-array
copy_to_host calls seen on the simulator, plus the implicit reads that only a GPU would pay for: on the
simulator every test here runs inside numbactr.runtime.sim_strict.strict(), whose device arrays record ``bool()``,
``int()``, ``float()``, ``.item()``, ``.tolist()`` and iteration (each a host synchronization on a CuPy
array). The simulator runs each launch as Python threads, so the model is the demo's with 2 slots of width
4 and a batch of 4 (the step's structure does not depend on those)."""

import json
import sys

import numpy as np
import pytest
from numba import config

import numbactr as hugectr
from numbactr.runtime import device, sim_strict
from numbactr.bench.mlperf import DENSE, SLOTS, build_mlperf_dlrm
from numbactr.demo import build_dlrm
from numbactr.kernels import launch
from numbactr.train import overflow
from tests.model_util import tiny_data

#: measured 2026-11-24 on the sim device (launches: 39 numba kernels + the engine's sort; each InnerProduct
#: followed by a ReLU runs one fused bias+ReLU kernel each way, Model._fuse_bias_relu). No host read is
#: left in the step: the bounds-check status, the hash tables' row counters and errors stay on the device
#: (TableBatchedEmbedding.defer_checks, read by Model.check_deferred at display, evaluation, snapshots and
#: every NONFINITE_CHECK_EVERY steps), new keys take their initial values on the device, and the loss is
#: kept on the device and read at display (Model.current_loss). Before: 48 launches, 7 reads cold, 4 warm;
#: with the deferred checks and before the bias+ReLU fusion: 50 launches, 0 reads.
BUDGET = {
    # first step: every key is new (the hash table inserts them)
    "cold": {"launches": 40, "host_reads": 0},
    # a step whose keys are all in the table already
    "warm": {"launches": 40, "host_reads": 0},
}
NUMBA_LAUNCHES = 39


@pytest.fixture(autouse=True)
def kernel_device():
    """The kernels' device: sim in a simulator session (an earlier test module may have left the session on
    cpu), the GPU where there is one; cpu skips (no launches to count)."""
    if config.ENABLE_CUDASIM:
        device.set_device("sim")  # (conftest's autouse fixture switches back)
    elif device.kind() == "cpu":
        pytest.skip("counts kernel launches: needs the sim or gpu device")


@pytest.fixture(autouse=True)
def strict_sim():
    """On the simulator: the model and its steps with device arrays that record implicit host reads."""
    if not config.ENABLE_CUDASIM:
        yield
        return
    sim_strict.reads()
    with sim_strict.strict():
        yield
    sim_strict.reads()


@pytest.fixture
def sim_hooks(monkeypatch):
    """Numba launches and copy_to_host calls on the simulator (zeros on a GPU, where the hook is absent)."""
    seen = {"numba_launches": 0, "copy_to_host": 0, "record": None}
    if not config.ENABLE_CUDASIM:
        return seen
    from numba.cuda.simulator import cudadrv, kernel

    call = kernel.FakeCUDAKernel.__call__

    def counted_call(self, *args):
        if not (self._device or kernel._kernel_context):  # a launch, not a device function
            seen["numba_launches"] += 1
            if seen["record"] is not None:  # (kernel, grid, block, non-array arguments)
                seen["record"].append(
                    (self.fn.__name__, tuple(self.grid_dim), tuple(self.block_dim), tuple(_scalar(a) for a in args))
                )
        return call(self, *args)

    monkeypatch.setattr(kernel.FakeCUDAKernel, "__call__", counted_call)
    array = cudadrv.devicearray.FakeCUDAArray
    copy = array.copy_to_host

    def counted_copy(self, *args, **kwargs):
        # the simulator copies the host arrays it was handed back after each launch (no GPU does that: the
        # kernels get CuPy arrays there); only numbactr's own calls are reads
        if not sys._getframe(1).f_globals.get("__name__", "").startswith("numba"):
            seen["copy_to_host"] += 1
        return copy(self, *args, **kwargs)

    monkeypatch.setattr(array, "copy_to_host", counted_copy)
    return seen


@pytest.mark.slow
def test_demo_dlrm_step_counts(tmp_path, sim_hooks):
    train, evl = tiny_data(str(tmp_path), n_train=16, n_eval=8, slots=2, dense=13, keys_per_slot=1, files=1)
    model = build_dlrm(
        hugectr, train, evl, batch=4, batch_eval=4, eval_batches=1, lr=0.01, workspace_mb=1, slots=2, vec=4
    )
    got = _count_steps(model, sim_hooks)
    for step in got:
        # every numba launch of the step went through the central count (which also counts the sort)
        assert got[step]["numba_launches"] <= NUMBA_LAUNCHES, (step, got)
    _check(got, BUDGET, "")


#: the MLPerf (HugeCTR-sized) DLRM's structure (numbactr.bench.mlperf: 13 dense, 26 slots, a bottom MLP, the
#: dot interaction, a top MLP of five layers, Update_t.Global) with narrow layers and a batch of 4: measured
#: 2026-11-24 on sim (53 and 54 before the bias+ReLU fusion). Adam's global pass adds its kernel; no host
#: read in either.
MLPERF_BUDGET = {
    opt: {step: {"launches": n, "host_reads": 0} for step in ("cold", "warm")} for opt, n in (("sgd", 41), ("adam", 42))
}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mlperf_dlrm_step_counts(tmp_path, sim_hooks, optimizer):
    train, evl = tiny_data(str(tmp_path), n_train=16, n_eval=8, slots=SLOTS, dense=DENSE, keys_per_slot=2, files=1)
    model = build_mlperf_dlrm(
        hugectr, train, evl, batch=4, dim=4, optimizer=optimizer, workspace_mb=1, bottom=(8,), top=(16, 8, 8, 4, 1)
    )
    _check(_count_steps(model, sim_hooks), MLPERF_BUDGET[optimizer], f"{optimizer} ")


#: mixed precision (fp16; HugeCTR's MLPerf DLRM recipe is SGD): the overflow skip is a gate the update
#: kernels read, decided on the device, so the step reads nothing back; one-thread kernels put the gate
#: into the embedding's scalars (and, for Adam, compute t's values from the device's count of updating
#: steps: the embedding's two passes and the dense alpha_t). Launch budgets measured 2026-11-24 on sim.
AMP_BUDGET = {
    opt: {step: {"launches": n, "host_reads": 0} for step in ("cold", "warm")} for opt, n in (("sgd", 42), ("adam", 45))
}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mixed_precision_step_counts(tmp_path, sim_hooks, optimizer):
    train, evl = tiny_data(str(tmp_path), n_train=16, n_eval=8, slots=SLOTS, dense=DENSE, keys_per_slot=2, files=1)
    model = build_mlperf_dlrm(
        hugectr,
        train,
        evl,
        batch=4,
        dim=4,
        optimizer=optimizer,
        workspace_mb=1,
        bottom=(8,),
        top=(16, 8, 8, 4, 1),
        amp=True,
    )
    assert overflow.overflow_on_device(model)
    got = _count_steps(model, sim_hooks)
    _check(got, AMP_BUDGET[optimizer], f"mixed precision {optimizer} ")


def _scalar(a):
    """A launch argument as a CUDA graph would freeze it: a scalar's value; arrays stand for themselves."""
    if hasattr(a, "__cuda_array_interface__") or hasattr(a, "__array_interface__") and getattr(a, "ndim", 0) > 0:
        return "array"
    return repr(a)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("optimizer,amp", [("sgd", False), ("adam", False), ("adam", True)])
def test_launch_arguments_are_the_same_every_step(tmp_path, sim_hooks, optimizer, amp):
    """What a CUDA graph of the step replays: every launch with the same grid, block and scalar arguments
    every step, while the learning rate changes (a schedule), Adam's t advances (its bias corrections) and
    the embedding's stochastic-rounding salt and the dropout mask's step change: those are read from device
    memory (numbactr.runtime.step_values), not passed by value. The MLPerf-shaped DLRM (embedding Global update,
    dense optimizer, fused bias+ReLU, interaction) with a Dropout after each ReLU of its top MLP; and in
    mixed precision, whose overflow gate and Adam's t on the device are arrays too."""
    if not config.ENABLE_CUDASIM:
        pytest.skip("records the simulator's launches")
    train, evl = tiny_data(str(tmp_path), n_train=16, n_eval=8, slots=SLOTS, dense=DENSE, keys_per_slot=2, files=1)
    model = build_mlperf_dlrm(
        hugectr,
        train,
        evl,
        batch=4,
        dim=4,
        optimizer=optimizer,
        workspace_mb=1,
        bottom=(8,),
        top=(16, 8, 4, 1),
        dropout=0.25,
        amp=amp,
    )
    steps = []
    for lr in (0.01, 0.02, 0.005):
        model.lr = lr
        sim_hooks["record"] = []
        model.train()
        steps.append(sim_hooks["record"])
    sim_hooks["record"] = None
    assert len(steps[0]) > 30
    names = {r[0] for r in steps[0]}
    assert "dropout_kernel" in names and any(n.startswith("update_kernel") for n in names), names
    for k in (1, 2):
        assert len(steps[k]) == len(steps[0])
        for a, b in zip(steps[0], steps[k]):
            assert a == b, f"step {k + 1} launches {b} where step 1 launched {a}"


def _count_steps(model, sim_hooks) -> dict:
    """Launches and host reads of a cold step (every key new) and a warm one; on the simulator also the
    numba launches it saw, each of which must have gone through the central count."""
    got = {}
    for step in ("cold", "warm"):
        launch.reset_counts()
        sim_hooks.update(numba_launches=0, copy_to_host=0)
        sim_strict.reads()
        model.train()
        counts = launch.reset_counts()
        implicit = sim_strict.reads()
        got[step] = {
            "launches": counts["launches"],
            "host_reads": counts["host_reads"] + sim_hooks["copy_to_host"] + len(implicit),
            "numba_launches": sim_hooks["numba_launches"],
            "implicit_reads": implicit,
        }
        if config.ENABLE_CUDASIM:
            assert sim_hooks["numba_launches"] <= counts["launches"], (step, got[step])
    return got


def _check(got: dict, budget: dict, what: str) -> None:
    for step, counts in got.items():
        for name in ("launches", "host_reads"):
            assert counts[name] <= budget[step][name], (
                f"{what}{step} step: {counts[name]} {name}, budget {budget[step][name]} (a regression; all counts: "
                f"{got})"
            )


# ---- several ranks ----------------------------------------------------------------------------------
#: the MLPerf-shaped DLRM (Adam) on 2 ranks, its sharded embedding exchanging on the device path (as NCCL
#: between GPUs does): measured 2026-11-28 on sim, 55 launches (the one-rank step's plus the loss's sum
#: over the ranks and the poolers' deferred bounds records) and no host read; before, 53 launches and 10
#: reads a warm step (the loss and its allreduce, the dense gradients staged through the host on sim, the
#: bounds checks' and hash tables' reads, and the pooler's row count of the embedding gradients)
RANKS_BUDGET = {"launches": 55, "host_reads": 0}


def _run_ranks(tmp_path, *extra, **env_extra):
    import os
    import subprocess

    from tests.mpi_util import MPIEXEC

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    root = str(__import__("pathlib").Path(__file__).parent.parent)
    env.update(NUMBACTR_DEVICE="sim", PYTHONPATH=root, **env_extra)
    out = tmp_path / "counts.json"
    r = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, f"{root}/tests/mpi/step_counts_run.py", str(out), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        stdin=subprocess.DEVNULL,
        cwd=root,
    )
    return r, out


@pytest.mark.mpi
@pytest.mark.slow
def test_several_ranks_step_reads_nothing_back(tmp_path):
    """A step on 2 ranks whose exchanges take the device path reads nothing back to the host: the loss is
    summed over the ranks on the device and read at display (get_current_loss: the mean of the ranks' own
    losses, as before), the dense gradients are reduced in place, the embeddings' checks are deferred on
    every rank (owner engines and the poolers of the returned vectors), and the embedding gradients' row
    count is known without a read. The batches are staged on the device, and the routing reads their host
    mirrors; staged training equals unstaged training bit for bit."""
    import json

    from tests.mpi_util import HAVE_MPI

    if not HAVE_MPI:
        pytest.skip("needs mpiexec and mpi4py")
    r, out = _run_ranks(tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["ranks"] == 2 and len(got["steps"]) == 3
    for i, step in enumerate(got["steps"]):
        # staged, with host mirrors: the routing read the batch's host copies, never the device
        assert step["staged"] and step["mirrored_reads"] > 0 and step["batch_reads"] == 0, step
        for name in ("launches", "host_reads"):
            assert step[name] <= RANKS_BUDGET[name], f"step {i + 1}: {step} (budget {RANKS_BUDGET})"
        own = step["own"]
        assert len(own) == 2
        assert step["reported"] == (own[0] + own[1]) / 2, step  # float64 sum of the float32 losses
    assert len({s["reported"] for s in got["steps"]}) == 3  # a new value each step
    # the same steps unstaged (each rank's batch straight from its reader, host arrays): the same losses,
    # dense weights and embedding rows, bit for bit
    r, out = _run_ranks(tmp_path / "unstaged", NUMBACTR_STAGE_INPUTS="0")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    plain = json.loads(out.read_text())
    assert not any(s["staged"] for s in plain["steps"])
    assert [s["reported"] for s in plain["steps"]] == [s["reported"] for s in got["steps"]]
    assert plain["trained"] == got["trained"] and len(got["trained"]) == 2


#: the same on 2 ranks in mixed precision (fp16, Adam; top MLP 16-8-1): measured 2026-11-28 on sim, 56
#: launches (the overflow gate's sum over the ranks on the device is not a kernel launch on sim) and no host
#: read; before, the ranks agreed on a skip by reading each rank's flag to the host every step
RANKS_AMP_BUDGET = {"launches": 56, "host_reads": 0}


@pytest.mark.mpi
@pytest.mark.slow
def test_several_ranks_mixed_precision_skip_together_without_a_read(tmp_path):
    """Mixed precision on 2 ranks: the overflow skip is decided on the device and the ranks agree on it by a
    device collective, so a step reads nothing back. When one rank alone sees an overflow, every rank skips
    the step: dense weights, embedding rows and optimizer states unchanged on both, one skipped step (and one
    warning) on each at the check point; the next step updates everything again and the dense weights stay
    equal across the ranks."""
    import json

    from tests.mpi_util import HAVE_MPI

    if not HAVE_MPI:
        pytest.skip("needs mpiexec and mpi4py")
    r, out = _run_ranks(tmp_path, "amp")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    for i, step in enumerate(got["steps"]):
        for name in ("launches", "host_reads"):
            assert step[name] <= RANKS_AMP_BUDGET[name], f"step {i + 1}: {step} (budget {RANKS_AMP_BUDGET})"
    skip = got["skip"]
    assert skip["host_reads"] == 0, skip
    assert skip["changed_by_skip"] == [[False, False, False]] * 2, skip  # rank 0 skipped rank 1's overflow
    assert skip["changed_by_next"] == [[True, True, True]] * 2, skip
    assert skip["skipped"] == [1, 1] and skip["warned"] == [1, 1], skip
    assert skip["same_dense"], skip


@pytest.mark.mpi
@pytest.mark.slow
def test_several_ranks_raise_a_full_table_at_the_check_point(tmp_path):
    """A hash table that fills up in a step of a 2-rank job: the step goes on (its new keys are looked up as
    nothing), and the model's next check point raises the cpu device's error on the ranks that own the
    table's rows, naming the rank; the job stops."""
    from tests.mpi_util import HAVE_MPI

    if not HAVE_MPI:
        pytest.skip("needs mpiexec and mpi4py")
    r, _ = _run_ranks(tmp_path, "full")
    assert r.returncode != 0, r.stdout[-2000:]
    assert "HashTableFullError: embedding table full" in r.stderr, r.stderr[-3000:]
    assert "on rank " in r.stderr and "workspace_size_per_gpu_in_mb" in r.stderr
    assert "failed; aborting the job" in r.stderr


@pytest.mark.mpi
@pytest.mark.slow
def _graph_ranks_on_sim(tmp_path, table: str) -> dict:
    """tests/mpi/graph_ranks_run.py on 2 simulated ranks with NUMBACTR_CUDA_GRAPHS=1 and GRAPH_TABLE=table:
    its JSON."""
    import os
    import subprocess

    from tests.mpi_util import HAVE_MPI, MPIEXEC

    if not HAVE_MPI:
        pytest.skip("needs mpiexec and mpi4py")
    if not config.ENABLE_CUDASIM:
        pytest.skip("records the simulator's launches")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    root = str(__import__("pathlib").Path(__file__).parent.parent)
    env.update(NUMBACTR_DEVICE="sim", NUMBACTR_CUDA_GRAPHS="1", PYTHONPATH=root, GRAPH_TABLE=table)
    out = tmp_path / "graphs.json"
    r = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, f"{root}/tests/mpi/graph_ranks_run.py", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        stdin=subprocess.DEVNULL,
        cwd=root,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


def test_several_ranks_capture_and_replay_together(tmp_path):
    """CUDA graphs on 2 ranks (tests/mpi/graph_ranks_run.py: a slot-owned table exchanging on the device
    path; the simulator stands in for the GPU, a capture records the step, a launch runs nothing). The ranks
    agree on every step: the first makes the table's exchange plan (its one count exchange), the next two
    warm up eagerly under it, the next two capture (one per stager buffer set), then replays. Every step
    that a graph stands for launches the same kernels with the same scalar arguments and enters the same
    collectives with the same row counts, with no count exchange and no host read; a replay advances the
    job's collective count as the captured step did. One rank refusing a step makes every rank run it
    eagerly; NUMBACTR_CUDA_GRAPHS=0 for one step drops the graphs on both."""
    got = _graph_ranks_on_sim(tmp_path, "localized")
    assert got["ranks"] == 2
    ranks = got["every"]
    assert ranks[0]["loss"] == ranks[1]["loss"]  # the mean of the ranks' losses on both
    zero, one = ranks[0]["steps"], ranks[1]["steps"]
    assert len(zero) == len(one) == 10
    for i, (a, b) in enumerate(zip(zero, one)):
        # the same decision on both ranks, every step (a graph replays NCCL calls: both or neither)
        assert (a["agreed"] is None) == (b["agreed"] is None), (i + 1, a["agreed"], b["agreed"])
        same = [s["graphs"] and {k: v for k, v in s["graphs"].items() if k != "disabled"} for s in (a, b)]
        assert same[0] == same[1] and a["calls"] == b["calls"], (i + 1, a["graphs"], b["graphs"])
    for steps in (zero, one):
        first, rest = steps[0], steps[1:]
        assert "plan is made in this step" in first["agreed"] and first["count_exchanges"] == 1
        assert [s["agreed"] is None for s in steps] == [False] + [True] * 6 + [False, False, True]
        assert steps[7]["agreed"] in ("rank 1 says no", "another rank's step cannot be a graph")
        assert steps[8]["agreed"] == "NUMBACTR_CUDA_GRAPHS=0"
        counters = [
            (s["graphs"]["eager"], s["graphs"]["captures"], s["graphs"]["replays"], s["graphs"]["kept"])
            for s in steps[1:7]
        ]
        assert counters == [(1, 0, 0, 0), (2, 0, 0, 0), (2, 1, 0, 1), (2, 2, 0, 2), (2, 2, 1, 2), (2, 2, 2, 2)]
        assert steps[7]["graphs"]["kept"] == 0 and steps[8]["graphs"]["kept"] == 0  # dropped by eager steps
        assert steps[9]["graphs"]["eager"] == 1  # warming up again
        for s in rest:
            assert s["count_exchanges"] == 0 and s["host_reads"] == 0, s
        ran = [s for s in rest if s["launches"]]  # every step but the two replays
        assert len(ran) == 7 and [s for s in rest if not s["launches"]] == rest[4:6]
        for s in ran:
            assert s["plan_hits"] == 1
            assert s["launches"] == steps[1]["launches"], "a step's launches changed under a fixed plan"
            assert s["collectives"] == steps[1]["collectives"]
        # one agreement, 3 exchanges of the table (in, out, gradients) and the sums of the gradients and loss
        names = [c[0] for c in steps[1]["collectives"]]
        assert names == ["allgather_rows", "alltoallv", "alltoallv", "alltoallv", "allreduce_sum", "allreduce_sum"]
        # a replay enters only the agreement, and the job's collective count moves as in a captured step
        for s in rest[4:6]:
            assert [c[0] for c in s["collectives"]] == ["allgather_rows"] and s["calls"] == steps[1]["calls"]


def test_several_ranks_capture_a_key_owned_table_by_its_gathered_exchange(tmp_path):
    """tests/mpi/graph_ranks_run.py with a key-owned table (DistributedSlotSparseEmbeddingHash, one key per
    bag): its steps take the gathered exchange (allgather of the keys, reduce-scatter of the vectors, the
    gradients allgathered), fixed in size from the first step, so there is no plan to make: the ranks agree on
    a graph from step 1 (2 warm-ups, 2 captures, then replays), and every step it stands for launches the same
    kernels and enters the same collectives with the same sizes, with no count exchange and no host read."""
    got = _graph_ranks_on_sim(tmp_path, "distributed")
    ranks = got["every"]
    assert ranks[0]["loss"] == ranks[1]["loss"]
    zero, one = ranks[0]["steps"], ranks[1]["steps"]
    for i, (a, b) in enumerate(zip(zero, one)):
        assert (a["agreed"] is None) == (b["agreed"] is None), (i + 1, a["agreed"], b["agreed"])
        if i not in (7, 8):  # (steps 8 and 9, not graphs: the alltoall exchange, sized by each rank's keys)
            assert a["calls"] == b["calls"] and a["collectives"] == b["collectives"], i + 1
    for steps in (zero, one):
        assert [s["agreed"] is None for s in steps] == [True] * 7 + [False, False, True]
        for s in steps[7:9]:  # a step that is no graph (one rank said no; graphs off) keeps the alltoall
            assert "alltoallv" in [c[0] for c in s["collectives"]] and s["count_exchanges"] == 1
        counters = [
            (s["graphs"]["eager"], s["graphs"]["captures"], s["graphs"]["replays"], s["graphs"]["kept"])
            for s in steps[:7]
        ]
        assert counters == [
            (1, 0, 0, 0),
            (2, 0, 0, 0),
            (2, 1, 0, 1),
            (2, 2, 0, 2),
            (2, 2, 1, 2),
            (2, 2, 2, 2),
            (2, 2, 3, 2),
        ]
        for s in steps[:7] + steps[9:]:
            assert s["count_exchanges"] == 0 and s["host_reads"] == 0 and s["plan_hits"] == 0, s
        ran = [s for s in steps[:7] if s["launches"]]  # the two warm-ups and the two captures
        assert len(ran) == 4 and not any(s["launches"] for s in steps[4:7])
        for s in ran:
            assert s["launches"] == steps[0]["launches"], "a step's launches changed under the gathered exchange"
            assert s["collectives"] == steps[0]["collectives"]
        names = [c[0] for c in steps[0]["collectives"]]
        assert names == [
            "allgather_rows",
            "allgather",
            "reduce_scatter_sum",
            "allgather",
            "allreduce_sum",
            "allreduce_sum",
        ]
        for s in steps[4:7]:  # a replay enters only the agreement
            assert [c[0] for c in s["collectives"]] == ["allgather_rows"] and s["calls"] == steps[0]["calls"]


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("table", ["localized", "distributed"])
def test_several_ranks_graph_steps_train_like_eager_steps_on_gpus(tmp_path, table):
    """Two ranks with a GPU each and NCCL (tests/mpi/graph_ranks_run.py gpu): 8 steps of the DLRM with a
    slot-owned table (its exchange plan) or a key-owned one (the gathered exchange) with CUDA graphs (captured
    after the plan and warm-up steps, then replayed, NCCL inside the graph) report the same losses and train
    the same dense weights and embedding rows as 8 eager steps."""
    import os
    import subprocess

    from numba import cuda

    from tests.mpi_util import HAVE_MPI, MPIEXEC

    if not HAVE_MPI:
        pytest.skip("needs mpiexec and mpi4py")
    if config.ENABLE_CUDASIM or len(cuda.gpus) < 2:
        pytest.skip("needs two GPUs (one per rank) for NCCL")
    root = str(__import__("pathlib").Path(__file__).parent.parent)
    runs = {}
    for flag in ("0", "1"):
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
        env.update(NUMBACTR_DEVICE="gpu", NUMBACTR_CUDA_GRAPHS=flag, PYTHONPATH=root, GRAPH_TABLE=table)
        out = tmp_path / f"graphs{flag}.json"
        r = subprocess.run(
            [MPIEXEC, "-n", "2", sys.executable, f"{root}/tests/mpi/graph_ranks_run.py", str(out), "gpu"],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            stdin=subprocess.DEVNULL,
            cwd=root,
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        runs[flag] = json.loads(out.read_text())["every"]
    for rank, (eager, graphs) in enumerate(zip(runs["0"], runs["1"])):
        captures, replays, disabled = graphs["graphs"]
        # localized: a plan step, 2 warm-ups, 2 captures, 3 replays; distributed: no plan step, 4 replays
        assert disabled is None and captures == 2 and replays == (3 if table == "localized" else 4), (
            rank,
            graphs["graphs"],
        )
        if table == "localized":  # one count exchange: the plan's
            assert graphs["exchanges"] == 1 and eager["exchanges"] == 1
        else:  # gathered (fixed sizes) under graphs, alltoall counts eagerly
            assert graphs["exchanges"] == 0 and eager["exchanges"] == 8
        np.testing.assert_allclose(graphs["losses"], eager["losses"], rtol=1e-6, err_msg=f"rank {rank}")
        np.testing.assert_allclose(graphs["dense"], eager["dense"], rtol=1e-5, atol=1e-7)
        assert graphs["keys"] == eager["keys"]
        np.testing.assert_allclose(graphs["rows"], eager["rows"], rtol=1e-5, atol=1e-7)
