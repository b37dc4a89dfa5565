"""Host reads and launches of a training step on several ranks, as a GPU job with NCCL runs it: the sharded
embeddings' exchanges on the device path (numbactr.embedding.sharded.exchange_on_device forced, as
tests/mpi/sharded_device_run.py does), the kernels in the simulator:

    NUMBACTR_DEVICE=sim mpiexec -n R python tests/mpi/step_counts_run.py OUT.json [full]

Each rank trains the MLPerf-shaped DLRM (numbactr.bench.mlperf) for a few steps and counts, per step, the
kernel launches and the device-to-host reads (numbactr.kernels.launch.COUNTS). The batches are staged on the
device (numbactr.data.staging) with host mirrors, which the sharded lookup routes from without a device read
(mirrored_reads counts those). Without staging (NUMBACTR_STAGE_INPUTS=0) a rank's batch is host memory on a
GPU; on the simulator every array is host memory, so to_host counts those reads: batch_reads, subtracted.
After each step every rank also records its reported loss and its own loss tensor, so the test can check the
reported loss against the mean of the ranks' losses. Rank 0 writes OUT.json.

``amp``: the same in mixed precision (fp16): the overflow skip is decided on the device on every rank, the
ranks agreeing on it through a device collective, so a step still reads nothing back. After the counted
steps, rank 1 alone reports an overflow in one step (its finite flag forced to 0): every rank must skip that
step (dense weights and its embedding rows unchanged, one skipped step on each rank), and the next step
updates again. The states before and after are in OUT.json.

``full``: the hash table is shrunk so that the second step's keys do not fit; the step must go on (nothing
read), and Model.check_deferred must then raise the table's error on the rank that owns it, which stops the
job (its message on stderr)."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import numpy as np  # noqa: E402

import numbactr as hugectr  # noqa: E402  (first: starts MPI)
from numbactr.runtime import device  # noqa: E402
from numbactr.bench.mlperf import DENSE, SLOTS, build_mlperf_dlrm  # noqa: E402
from numbactr.distributed.comm import world  # noqa: E402
from numbactr.embedding import sharded  # noqa: E402
from numbactr.kernels import launch  # noqa: E402
from numbactr.train import overflow, step as train_step  # noqa: E402
from tests.model_util import tiny_data  # noqa: E402

out_path = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else ""
full, amp = mode == "full", mode == "amp"
sharded.exchange_on_device = lambda comm: comm.size > 1
comm = world()
folder = os.path.join(os.path.dirname(out_path), "data")
files = (
    tiny_data(folder, n_train=64, n_eval=8, slots=SLOTS, dense=DENSE, keys_per_slot=3, files=1)
    if comm.rank == 0
    else None
)
train, evl = comm.bcast(files)
if device.kind() == "sim":  # device arrays that record implicit host reads (bool(), int(), ...)
    from numbactr.runtime import sim_strict  # noqa: E402

    STRICT = sim_strict.strict()  # (held: a dropped context manager would close at once)
    STRICT.__enter__()
else:
    sim_strict = None
model = build_mlperf_dlrm(
    hugectr,
    train,
    evl,
    batch=8,
    dim=4,
    optimizer="adam",
    workspace_mb=1,
    bottom=(8,),
    top=(16, 8, 1) if amp else (16, 8, 4, 1),
    amp=amp,
)
# (amp checks that the step after a skip updates the embedding: with top (16, 8, 4, 1) at this seed the
# width-4 layer's ReLU is dead, so no gradient reaches the embedding and only the last bias changes)
emb = model.embeddings[0]
assert sim_strict is None or isinstance(emb.engine.weights, sim_strict.DeviceArray)  # strict arrays
assert emb.engine.defer_checks and emb._sharded is not None and emb._sharded.defer_checks
assert not amp or overflow.overflow_on_device(model)

batch_arrays = set()
forward_backward = train_step.forward_backward  # (a general or planned step: numbactr.train.plan)


def recording_forward_backward(m, batch, tape):
    batch_arrays.clear()
    for a in (batch.label, batch.dense, *(x for kv in batch.sparse for x in kv)):
        batch_arrays.add(id(a))
    return forward_backward(m, batch, tape)


train_step.forward_backward = recording_forward_backward
to_host = device.to_host
batch_reads = [0]
mirrored_reads = [0]


def counting_to_host(a):
    if device.host_mirror(a) is not None:  # a staged batch's host copy: no device read (not counted)
        mirrored_reads[0] += 1
    elif id(a) in batch_arrays:
        batch_reads[0] += 1
    return to_host(a)


device.to_host = counting_to_host
loss_name = model.losses[0][0].cfg.top_names[0]
steps = []
for i in range(3):
    if full and i == 1:
        emb.table._max_rows = emb.table.size  # no room for the next step's new keys
    launch.reset_counts()
    batch_reads[0] = mirrored_reads[0] = 0
    if sim_strict:
        sim_strict.reads()
    assert model.train()
    counts = launch.reset_counts()
    implicit = sim_strict.reads() if sim_strict else []
    counts["host_reads"] += len(implicit)
    own = float(np.asarray(device.to_host(model._last_tensors[True][loss_name].data)).reshape(-1)[0])
    reported = model.get_current_loss()
    steps.append(
        dict(
            launches=counts["launches"],
            host_reads=counts["host_reads"] - batch_reads[0],
            batch_reads=batch_reads[0],
            mirrored_reads=mirrored_reads[0],
            reported=reported,
            implicit=implicit,
            staged=model._stager is not None,
            own=comm.allgather_rows(np.array([own])).tolist(),
        )
    )
if full:
    model.check_deferred()  # the owner of the full table raises here
    print(f"rank {comm.rank}: no error was raised", flush=True)
    sys.exit(3)
result = dict(ranks=comm.size, steps=steps)
if not amp:
    # what the steps trained, bit for bit (tests compare staged with unstaged runs): the dense weights and this
    # rank's embedding rows in key order, hashed on each rank
    import hashlib

    keys, vecs = emb.dump()
    order = np.argsort(keys, kind="stable")
    digest = hashlib.sha256(np.ascontiguousarray(device.to_host(model.weights)).tobytes())
    digest.update(np.ascontiguousarray(keys[order]).tobytes())
    digest.update(np.ascontiguousarray(vecs[order]).tobytes())
    result["trained"] = comm.allgather_rows(np.frombuffer(digest.digest(), np.uint8).reshape(1, -1)).tolist()
if amp:
    from numbactr.autograd import tape as tape_mod

    def state():
        """(dense weights, this rank's keys, their rows, the optimizer states' rows) on the host, in row order
        (a step appends its new keys' rows: a skipped step inserts them too, as the cpu device's skip does)."""
        keys, vecs = emb.dump()
        return device.to_host(model.weights).copy(), keys, vecs, emb.dump_states()

    def changed(a, b) -> list:
        """[dense weights, rows, optimizer states] of a's keys changed from a to b?"""
        n = a[1].shape[0]
        assert np.array_equal(b[1][:n], a[1]), "rows moved"
        return [
            not np.array_equal(a[0], b[0]),
            not np.array_equal(a[2], b[2][:n]),
            not all(np.array_equal(x[:n], y[:n]) for x, y in zip(a[3], b[3])),
        ]

    finite_flag = tape_mod.Tape.finite_flag
    if comm.rank == 1:  # this rank alone says its gradients overflowed
        tape_mod.Tape.finite_flag = lambda self: device.xp().zeros((), bool)
    before = state()
    launch.reset_counts()
    batch_reads[0] = 0
    assert model.train()
    forced = launch.reset_counts()
    forced_reads = forced["host_reads"] - batch_reads[0]
    tape_mod.Tape.finite_flag = finite_flag
    after_skip = state()
    assert model.train()
    after_next = state()
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        skipped = model.skipped_steps  # the check point's one read
    weights = comm.allgather_rows(after_next[0].reshape(1, -1))
    result.update(
        skip=dict(
            host_reads=forced_reads,
            changed_by_skip=comm.allgather_rows(np.array([changed(before, after_skip)])).tolist(),
            changed_by_next=comm.allgather_rows(np.array([changed(after_skip, after_next)])).tolist(),
            skipped=comm.allgather_rows(np.array([skipped])).tolist(),
            warned=comm.allgather_rows(np.array([len(caught)])).tolist(),
            same_dense=bool((weights == weights[0]).all()),
        )
    )
if comm.rank == 0:
    with open(out_path, "w") as fh:
        json.dump(result, fh)
