"""Snapshot runs for the tests (one rank, or any rank count under mpiexec), and the tiny model they use.

    python snapshot_run.py kill DIR TRAIN EVAL KILL_AT KILL_RANK HOOK
        train, save DIR/ck@1 (reference DIR/S1.npz), train, then with the hook armed save DIR/ck@2 and
        save DIR/ck@1 again (overwrite; reference DIR/S2.npz). Rank KILL_RANK SIGKILLs itself at the
        KILL_AT-th boundary of those two saves (0: never; prints "BOUNDARIES n1 n", the count after
        the first save and after both). HOOK "files": the
        boundaries are the snapshot writer's file writes (half the bytes, then the kill), os.replace and
        shutil.rmtree calls; "comm": the collectives the save makes on that rank.
    python snapshot_run.py kill_each DIR TRAIN EVAL N
        kill DIR/k<k> ... k 0 files, for k = 1..N, each in a forked child; prints each child's exit code.
    mpiexec -n R python snapshot_run.py save DIR TRAIN EVAL
        per embedding type (no BatchNorm: R ranks then train exactly as one): train, save DIR/{emb}_R{R}/ck@3, write the state and eval AUC (ref.npz), then
        restart the optimizers' step counters and the reader (as a reload does), train 2 steps and write
        the state again (continued).
    mpiexec -n R python snapshot_run.py fail DIR TRAIN EVAL
        save into a folder that does not exist: every rank prints what it raised.
    mpiexec -n R' python snapshot_run.py load DIR TRAIN EVAL R...
        per embedding type and saving rank count R: load DIR/{emb}_R{R}/ck@3 on R' ranks and write the state,
        the eval AUC and the state after 2 more steps (load_R{R'}.npz).

The hooks live here, in the child, never in numbactr.
"""

import os
import shutil
import signal
import sys
import traceback

os.environ.setdefault("NUMBACTR_DEVICE", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402

import numbactr as hugectr  # noqa: E402
from numbactr.files import checkpoint, snapshot
from numbactr.runtime import device  # noqa: E402
from numbactr.distributed import comm as comm_module  # noqa: E402
from tests.model_util import one_hot_lists  # noqa: E402

#: embedding type -> (optimizer, update) used with it in the rank tests
OPTIMIZERS = {
    "DistributedSlotSparseEmbeddingHash": ("Adam", "Global"),
    "LocalizedSlotSparseEmbeddingHash": ("Adam", "Local"),
    "LocalizedSlotSparseEmbeddingOneHot": ("AdaGrad", "Local"),
}


def build(
    train,
    evl,
    emb="LocalizedSlotSparseEmbeddingHash",
    opt="Adam",
    update="Global",
    seed=0,
    batch=12,
    slots=3,
    dense=2,
    vec=4,
    bn=True,
    sizes=None,
):
    """A tiny DLRM over tests.model_util.tiny_data, with a BatchNorm (so snapshots carry a .ntp.json)
    unless bn=False: BatchNorm statistics are per rank, so only without it do R ranks train exactly as
    one. ``sizes``: the embedding's slot_size_array (default: 6 per slot for OneHot, none otherwise)."""
    train, evl = one_hot_lists(hugectr.Embedding_t[emb], train, evl)  # one-hot: per-slot keys
    solver = hugectr.CreateSolver(
        batchsize=batch, batchsize_eval=batch, max_eval_batches=4, lr=0.05, vvgpu=[[0]], i64_input_key=True, seed=seed
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[train], eval_source=evl, check_type=hugectr.Check_t.Sum
    )
    optimizer = hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t[opt], update_type=hugectr.Update_t[update])
    model = hugectr.Model(solver, reader, optimizer)
    model.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=dense,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, slots)],
        )
    )
    model.add(
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t[emb],
            workspace_size_per_gpu_in_mb=1,
            embedding_vec_size=vec,
            combiner="sum",
            sparse_embedding_name="emb",
            bottom_name="data1",
            slot_size_array=sizes or ([6] * slots if "OneHot" in emb else []),
        )
    )
    L = hugectr.Layer_t
    model.add(hugectr.DenseLayer(L.InnerProduct, ["dense"], ["fc1"], num_output=vec))
    if bn:
        model.add(hugectr.DenseLayer(L.BatchNorm, ["fc1"], ["bn1"], factor=0.5))
    model.add(hugectr.DenseLayer(L.ReLU, ["bn1" if bn else "fc1"], ["relu1"]))
    model.add(hugectr.DenseLayer(L.Interaction, ["relu1", "emb"], ["inter"]))
    model.add(hugectr.DenseLayer(L.InnerProduct, ["inter"], ["fc2"], num_output=8))
    model.add(hugectr.DenseLayer(L.ReLU, ["fc2"], ["relu2"]))
    model.add(hugectr.DenseLayer(L.Reshape, ["emb"], ["flat"], leading_dim=slots * vec))
    model.add(hugectr.DenseLayer(L.Concat, ["relu2", "flat"], ["cat"]))
    model.add(hugectr.DenseLayer(L.InnerProduct, ["cat"], ["fc3"], num_output=1))
    model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc3", "label"], ["loss"]))
    model.compile()
    return model


def load_all(model, prefix: str, it: int) -> None:
    """The four HugeCTR load calls for a snapshot written by save_params_to_files(prefix, it)."""
    model.load_dense_weights(f"{prefix}_dense_{it}.model")
    model.load_dense_optimizer_states(f"{prefix}_opt_dense_{it}.model")
    model.load_sparse_weights([f"{prefix}0_sparse_{it}.model"])
    model.load_sparse_optimizer_states([f"{prefix}0_opt_sparse_{it}.model"])


def state(model) -> dict:
    """Everything a snapshot holds, rank-independent: dense weights and states, BatchNorm statistics, and
    per key (sorted) its vector, slot and sparse optimizer states, gathered from every rank."""
    comm, e = model.comm, model.embeddings[0]
    keys, vecs = e.dump()
    slots = e.dump_slots()
    states = [s[: keys.shape[0]] for s in e.dump_states()]  # row j = the state of key j
    keys = comm.allgather_rows(keys)
    order = np.argsort(keys)
    out = {
        "weights": np.array(device.to_host(model.weights)),
        "keys": keys[order],
        "vecs": comm.allgather_rows(vecs)[order],
    }
    if slots is not None:
        out["slots"] = comm.allgather_rows(slots)[order]
    for k, s in enumerate(model.dense_optimizer.states):
        out[f"dense_state{k}"] = np.array(device.to_host(s))
    for k, s in enumerate(states):
        out[f"sparse_state{k}"] = comm.allgather_rows(s)[order]
    for j, b in enumerate(checkpoint.norm_layers(model)):
        out[f"bn{j}_mean"], out[f"bn{j}_var"] = (
            np.array(device.to_host(b.running_mean)),
            np.array(device.to_host(b.running_var)),
        )
    return out


def arm(kill_at: int, kill_rank: int, hook: str) -> list:
    """Count the boundaries of what follows on this rank; SIGKILL this process at the kill_at-th."""
    count = [0]
    if kill_rank != comm_module.world().rank:
        return count

    def boundary():
        count[0] += 1
        return count[0] == kill_at

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if hook == "files":
        real_write, real_replace, real_rmtree = snapshot._write_durable, os.replace, shutil.rmtree

        def write(path, data):
            if boundary():
                with open(path, "wb") as f:  # a torn write: half the bytes, then the kill
                    f.write(memoryview(data)[: memoryview(data).nbytes // 2])
                die()
            real_write(path, data)

        def replace(src, dst):
            if boundary():
                die()
            real_replace(src, dst)

        def rmtree(path, *a, **k):
            if boundary():
                die()
            real_rmtree(path, *a, **k)

        snapshot._write_durable, os.replace, shutil.rmtree = write, replace, rmtree
    else:
        cls = comm_module.Comm
        for name in ("gather_rows", "bcast"):
            real = getattr(cls, name)

            def wrapped(self, *a, _real=real, **k):
                if boundary():
                    die()
                return _real(self, *a, **k)

            setattr(cls, name, wrapped)
    return count


def kill(folder, train, evl, kill_at, kill_rank, hook):
    comm = comm_module.world()
    model = build(train, evl)
    for _ in range(2):
        model.train()
    prefix = os.path.join(folder, "ck")
    model.save_params_to_files(prefix, 1)
    s1 = state(model)
    for _ in range(2):
        model.train()
    s2 = state(model)
    if comm.rank == 0:
        np.savez(os.path.join(folder, "S1.npz"), **s1)
        np.savez(os.path.join(folder, "S2.npz"), **s2)
    comm.barrier()
    count = arm(int(kill_at), int(kill_rank), hook)
    model.save_params_to_files(prefix, 2)
    first = count[0]
    model.save_params_to_files(prefix, 1)
    if comm.rank == int(kill_rank):
        print(f"BOUNDARIES {first} {count[0]}", flush=True)


def kill_each(folder, train, evl, count):
    """``kill`` with the file hook at k = 1..count, each in its own forked child (the imports are paid
    once; no thread or MPI exists yet when forking); prints "k<k> <exit code>" per child."""
    # A kill -9 ends the process, not the machine: what the other processes see does not depend on
    # fsync, which only orders writes for a power loss (test_snapshot_kill checks that order apart).
    # Skipping it keeps the many saves here fast.
    os.fsync = lambda fd: None
    for k in range(1, int(count) + 1):
        sub = os.path.join(folder, f"k{k}")
        os.makedirs(sub)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                kill(sub, train, evl, k, 0, "files")
            except BaseException:  # noqa: BLE001 (the child reports, the parent judges)
                traceback.print_exc()
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(f"k{k} {os.waitstatus_to_exitcode(status)}", flush=True)


def save(folder, train, evl):
    comm = comm_module.world()
    for emb, (opt, update) in OPTIMIZERS.items():
        model = build(train, evl, emb, opt, update, bn=False)
        for _ in range(3):
            model.train()
        out = os.path.join(folder, f"{emb}_R{comm.size}")
        os.makedirs(out, exist_ok=True)
        model.save_params_to_files(os.path.join(out, "ck"), 3)
        # every rank returns only once the whole snapshot exists
        assert os.path.exists(os.path.join(out, "ck_3.manifest.json")), f"rank {comm.rank} returned early"
        ref = state(model)
        auc = dict(model.eval_whole_source())["AUC"]
        # what a reload restarts: the step counters (HugeCTR stores none) and the reader
        model.dense_optimizer.t = model.embeddings[0].engine.step = 0
        model._train_reader = None
        for _ in range(2):
            model.train()
        cont = state(model)
        if comm.rank == 0:
            np.savez(os.path.join(out, "ref.npz"), auc=auc, **ref, **{"cont_" + k: v for k, v in cont.items()})


def load(folder, train, evl, *saved_ranks):
    comm = comm_module.world()
    for emb, (opt, update) in OPTIMIZERS.items():
        for r in saved_ranks:
            out = os.path.join(folder, f"{emb}_R{r}")
            model = build(train, evl, emb, opt, update, seed=11, bn=False)  # other initial weights
            load_all(model, os.path.join(out, "ck"), 3)
            got = state(model)
            auc = dict(model.eval_whole_source())["AUC"]
            for _ in range(2):
                model.train()
            cont = state(model)
            if comm.rank == 0:
                np.savez(
                    os.path.join(out, f"load_R{comm.size}.npz"),
                    auc=auc,
                    **got,
                    **{"cont_" + k: v for k, v in cont.items()},
                )


def fail(folder, train, evl):
    """A save rank 0 cannot write (its folder does not exist): every rank raises, none hangs."""
    comm = comm_module.world()
    model = build(train, evl)
    try:
        model.save_params_to_files(os.path.join(folder, "missing", "ck"), 1)
    except Exception as e:  # noqa: BLE001 (what each rank raises is the test)
        print(f"rank {comm.rank} raised {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    {"kill": kill, "kill_each": kill_each, "save": save, "load": load, "fail": fail}[sys.argv[1]](*sys.argv[2:])
