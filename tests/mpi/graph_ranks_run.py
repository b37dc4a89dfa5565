"""CUDA graphs of a training step on several ranks, as far as the simulator can show them:

    NUMBACTR_DEVICE=sim NUMBACTR_CUDA_GRAPHS=1 mpiexec -n 2 python tests/mpi/graph_ranks_run.py OUT.json

Each rank trains the MLPerf-shaped DLRM (numbactr.bench.mlperf) with a slot-owned table
(LocalizedSlotSparseEmbeddingHash, one key per bag; GRAPH_TABLE=distributed: a key-owned
DistributedSlotSparseEmbeddingHash, whose steps take the gathered exchange) whose exchanges take the device path
(numbactr.embedding.sharded.exchange_on_device forced, as tests/mpi/step_counts_run.py does). The
simulator stands in for the GPU where cuda_graphs asks for one, and a "capture" runs the step while
recording its host halves, a "launch" runs nothing (as tests/test_cuda_graphs.py's _SimGraphs): both ranks
must agree, step by step, on whether the step is a graph, capture together and replay together.

Per step each rank records: the agreed reason the step is not a graph (None: it is), the StepGraphs counters,
the input_dist count exchanges and plan reuses of its table, the kernel launches (name, grid, block, scalar
arguments: a graph replays them as captured, so the steps it stands for must launch the same), the
collectives it entered (name and row counts: the NCCL transfers a graph replays) and its host reads.
Then rank 1 alone refuses graphs for one step (StepGraphs.disabled, as after a failed capture: every rank
must then run that step eagerly), and NUMBACTR_CUDA_GRAPHS is turned off for one step (the graphs dropped
on both ranks) and on again. Rank 0 writes OUT.json with every rank's records.

``gpu`` (one GPU per rank, NCCL; NUMBACTR_CUDA_GRAPHS as the caller sets it): no stand-ins; each rank
trains 8 steps and OUT.json holds every rank's reported losses, graph counters, dense weights and
embedding rows (key order), for tests/test_step_counts.py to compare graph steps with eager ones."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import numpy as np  # noqa: E402

import numbactr as hugectr  # noqa: E402  (first: starts MPI)
from numbactr.train import cuda_graphs  # noqa: E402
from numbactr.train import step as train_step  # noqa: E402
from numbactr.runtime import device, step_values  # noqa: E402
from numbactr.bench.mlperf import DENSE, SLOTS, build_mlperf_dlrm  # noqa: E402
from numbactr.distributed.comm import world  # noqa: E402
from numbactr.embedding import sharded  # noqa: E402
from numbactr.kernels import launch  # noqa: E402
from tests.model_util import tiny_data  # noqa: E402

out_path = sys.argv[1]
on_gpu = len(sys.argv) > 2 and sys.argv[2] == "gpu"
if not on_gpu:
    sharded.exchange_on_device = lambda comm: comm.size > 1


class _GPU:
    """cuda_graphs' view of the device: a GPU (the simulator's kernels stand in for it)."""

    def __getattr__(self, name):
        return getattr(device, name)

    @staticmethod
    def kind():
        return "gpu"


if not on_gpu:
    cuda_graphs.device = _GPU()


class SimGraphs(cuda_graphs.StepGraphs):
    def _capture(self, batch, body):
        rec = step_values.Recording(defer=True)
        with step_values.recording(rec):
            body(batch)
        return cuda_graphs._Graph(None, None, rec, None)

    def _launch(self, g):
        pass


if not on_gpu:
    cuda_graphs.StepGraphs = SimGraphs

comm = world()
folder = os.path.join(os.path.dirname(out_path), "data")
files = (
    tiny_data(folder, n_train=96, n_eval=8, slots=SLOTS, dense=DENSE, keys_per_slot=3, files=1)
    if comm.rank == 0
    else None
)
train, evl = comm.bcast(files)
if not on_gpu:  # device arrays that record implicit host reads (bool(), int(), ...)
    from numbactr.runtime import sim_strict  # noqa: E402

    STRICT = sim_strict.strict()  # (held: a dropped context manager would close at once)
    STRICT.__enter__()
#: the table: slot-owned (an exchange plan) or key-owned (the gathered exchange), GRAPH_TABLE=distributed
key_owned = os.environ.get("GRAPH_TABLE", "localized") == "distributed"
model = build_mlperf_dlrm(
    hugectr,
    train,
    evl,
    batch=8,
    dim=4,
    optimizer="adam",
    workspace_mb=1,
    bottom=(8,),
    top=(16, 8, 1),
    embedding_type="DistributedSlotSparseEmbeddingHash" if key_owned else "LocalizedSlotSparseEmbeddingHash",
)
emb = model.embeddings[0]
assert on_gpu or isinstance(emb.engine.weights, sim_strict.DeviceArray)  # strict arrays
table = emb._sharded
assert table is not None and emb.by_slot != key_owned


def gathered(obj):
    """Every rank's JSON-able obj, in rank order (on every rank)."""
    mine = json.dumps(obj).encode()
    sizes = comm.allgather_rows(np.array([[len(mine)]]))[:, 0]
    rows = comm.allgather_rows(np.frombuffer(mine.ljust(int(sizes.max())), np.uint8).reshape(1, -1))
    return [json.loads(bytes(rows[r, : sizes[r]]).decode()) for r in range(comm.size)]


def run_gpu():
    """The gpu mode (module docstring)."""
    assert sharded.exchange_on_device(comm), "the gpu mode needs one GPU per rank and NCCL"
    losses = []
    for _ in range(8):
        assert model.train()
        losses.append(model.get_current_loss())
    model.check_deferred()
    keys, vecs = emb.dump()
    order = np.argsort(keys, kind="stable")
    g = model._graphs
    every = gathered(
        dict(
            losses=losses,
            dense=device.to_host(model.weights).tolist(),
            keys=keys[order].tolist(),
            rows=np.asarray(vecs)[order].tolist(),
            graphs=None if g is None else [g.captures, g.replays, g.disabled],
            exchanges=comm.count_exchanges,
            hits=table.plan_hits,
        )
    )
    if comm.rank == 0:
        with open(out_path, "w") as fh:
            json.dump(dict(ranks=comm.size, every=every), fh)


def run_sim():
    """Records of each step on the simulator (module docstring)."""
    agreed = []
    agree = train_step.agree_on_step

    def recording_agree(m, batch, why):
        got = agree(m, batch, why)
        agreed.append(got)
        return got

    train_step.agree_on_step = recording_agree

    collectives = []
    for name in ("alltoallv", "allreduce_sum", "allgather_rows", "allgather", "reduce_scatter_sum"):
        real = getattr(comm, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            a = args[0]
            rows = [int(p.shape[0]) for p in a] if isinstance(a, list) else [int(np.asarray(a).size)]
            collectives.append([_name, rows])
            return _real(*args, **kwargs)

        setattr(comm, name, wrapped)

    from numba.cuda.simulator import kernel  # noqa: E402

    launches = []
    call = kernel.FakeCUDAKernel.__call__

    def _scalar(a):
        return a if isinstance(a, (int, float, bool, np.integer, np.floating)) else type(a).__name__

    def recorded_call(self, *args):
        if not (self._device or kernel._kernel_context):
            launches.append(
                [self.fn.__name__, list(self.grid_dim), list(self.block_dim), [repr(_scalar(a)) for a in args]]
            )
        return call(self, *args)

    kernel.FakeCUDAKernel.__call__ = recorded_call

    steps = []

    def one_step():
        agreed.clear()
        launches.clear()
        launch.reset_counts()
        sim_strict.reads()
        exchanges, hits, calls = comm.count_exchanges, table.plan_hits, comm.calls
        assert model.train()
        implicit = sim_strict.reads()
        collected = list(collectives)
        collectives.clear()
        g = model._graphs
        steps.append(
            dict(
                agreed=agreed[0] if agreed else "no agreement",
                host_reads=launch.reset_counts()["host_reads"] + len(implicit),
                implicit=implicit,
                count_exchanges=comm.count_exchanges - exchanges,
                plan_hits=table.plan_hits - hits,
                calls=comm.calls - calls,
                launches=list(launches),
                collectives=collected,
                graphs=None
                if g is None
                else dict(
                    eager=g.eager, captures=g.captures, replays=g.replays, disabled=g.disabled, kept=len(g.graphs)
                ),
            )
        )

    for _ in range(7):
        one_step()
    if comm.rank == 1:  # this rank alone cannot make the next step a graph
        model._graphs.disabled = "rank 1 says no"
    one_step()
    if comm.rank == 1:
        model._graphs.disabled = None
    os.environ[cuda_graphs.ENV] = "0"
    one_step()
    os.environ[cuda_graphs.ENV] = "1"
    one_step()
    model.check_deferred()
    loss = model.get_current_loss()
    every = gathered(dict(steps=steps, loss=loss))
    if comm.rank == 0:
        with open(out_path, "w") as fh:
            json.dump(dict(ranks=comm.size, every=every), fh)


if on_gpu:
    run_gpu()
else:
    run_sim()
