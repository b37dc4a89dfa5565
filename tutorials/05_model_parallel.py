# %% [markdown]
# # Tutorial 05: model parallelism with `mpiexec -n 2` — who owns which key, what crosses the wire,
# and how the gradients come back.
#
# Run:
# ```bash
# python tutorials/05_model_parallel.py              # re-launches itself under mpiexec -n 2
# mpiexec -n 2 python tutorials/05_model_parallel.py # the same, by hand
# ```
#
# Dense layers are data parallel: every rank holds all dense weights, sees its own rows of the global
# batch, and the dense gradients are summed over ranks. Embeddings are model parallel: every key lives
# on exactly one rank. numbactr does the embedding step as TorchRec names it:
#     input_dist  -> every key occurrence travels to the rank that owns the key
#     lookup      -> the owner inserts/finds the key and sends back one vector per occurrence
#     output_dist -> the sender pools the returned vectors into its own bags
# and backward walks the same wires in reverse: each key occurrence's gradient goes to the key's owner,
# whose embedding engine sums every row's gradients and updates the row in one fused pass. We spy on the
# collectives to print what crosses them. Everything runs on the cpu device, so no GPU is needed.

# %%
import os
import shutil
import subprocess
import sys

os.environ.setdefault("NUMBACTR_DEVICE", "cpu")
# this file: from __file__ when run as a script, from the working directory (tutorials/) in a notebook
THIS = os.path.abspath(__file__ if "__file__" in globals() else "05_model_parallel.py")
ROOT = os.path.dirname(os.path.dirname(THIS))
sys.path.insert(0, ROOT)


# %% [markdown]
# A plain `python` run (or a notebook) is one process, so one rank. This cell starts two ranks of this
# same file under `mpiexec -n 2` and relays what they print; `mpiexec` comes with the `mpi` extra
# (`pip install -e ".[mpi]"`, which the README's first command installs) next to the Python it runs.

# %%
def relaunch_under_mpiexec() -> int:
    """A plain `python` run has one rank: start two ranks of this same file and relay their output."""
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    if mpiexec is None:
        print("mpiexec not found: pip install 'numbactr[mpi]'")
        return 1
    env = dict(os.environ, NUMBACTR_TUTORIAL05_CHILD="1")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    r = subprocess.run([mpiexec, "-n", "2", sys.executable, THIS], env=env,
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    print(r.stdout, end="")
    print(r.stderr, end="", file=sys.stderr)
    return r.returncode


# %% [markdown]
# What each rank does: build the same embedding, take its share of a global batch, and run one forward
# and backward with spies on the collectives.

# %%
def main() -> None:
    import numpy as np

    import numbactr as hugectr
    from numbactr.autograd import Tape
    from numbactr.distributed.comm import world
    from numbactr.distributed.sharding import key_owner, split_batch
    from numbactr.data.batch import Batch
    from numbactr.embedding.sparse_embedding import HashEmbedding

    comm = world()
    rank, R = comm.rank, comm.size
    np.set_printoptions(precision=3, suppress=True)

    def say(msg):
        # ranks print in turn so the lines do not interleave
        for r in range(R):
            comm.barrier()
            if r == rank:
                print(f"[rank {rank}] {msg}", flush=True)
        comm.barrier()

    # 1. A global batch of 4 samples x 2 slots, one or two keys per slot (CSR: bag = sample*2 + slot).
    keys = np.array([10, 3, 7, 4, 10, 11, 3, 6, 5, 10], dtype=np.int64)
    nnz = np.array([1, 1, 2, 1, 1, 1, 1, 2])              # 8 bags
    offsets = np.concatenate([[0], np.cumsum(nnz)]).astype(np.int64)
    batch = Batch(np.zeros((4, 1), np.float32), np.zeros((4, 0), np.float32), [(keys, offsets)])
    mine = split_batch(batch, rank, R)                       # rows [2r, 2r+2): data parallel split
    k, o = mine.sparse[0]
    bag = np.repeat(np.arange(len(o) - 1), np.diff(o))
    owner = key_owner(k, bag % 2, R, by_slot=False)
    say(f"my samples {2 * rank}..{2 * rank + 1}: keys {k.tolist()} -> owners (key % {R}) {owner.tolist()}")

    # 2. The embedding, with a spy on the collectives.
    cfg = hugectr.SparseEmbedding(hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash, 1, 3, "sum",
                                  "emb", "data")
    emb = HashEmbedding(cfg, hugectr.DataReaderSparseParam("data", 2, False, 2),
                        hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.SGD), seed=0, comm=comm)
    wire = []
    real = comm.alltoallv

    def spy(parts, recv_rows=None):      # recv_rows: the counts, when the receiver already knows them
        got = real(parts, recv_rows)
        wire.append(([p.shape for p in parts], [g.shape for g in got], parts[0].dtype))
        return got

    comm.alltoallv = spy
    tape = Tape()
    out = emb.forward(tape, k, o, batch=2, training=True)           # (2, 2, 3) pooled, my rows only
    names = ["input_dist: keys", "output_dist: vectors"]
    for name, (sent, got, dt) in zip(names, wire):
        say(f"{name:<28} sent {[s[0] for s in sent]} rows per rank, received {[g[0] for g in got]} ({dt})")
    say(f"my table holds keys {np.sort(emb.table.keys_by_row()).tolist()} (each key on one rank only)")
    say(f"pooled output for my 2 samples (B, S, D):\n{out.data}")

    # 3. Check against the one-rank truth: every key's vector is a function of (seed, key).
    from numbactr.kernels.embedding_init import row_values_ref
    table = {int(x): row_values_ref(np.array([x], np.uint64), 3, 0, -0.05, 0.05)[0] for x in keys}
    want = np.stack([sum(table[int(x)] for x in k[o[j]:o[j + 1]]) for j in range(len(o) - 1)]).reshape(2, 2, 3)
    assert np.allclose(out.data, want, atol=1e-7)
    say("pooled output == one-rank pooling of the same keys")

    # 4. Backward: dY of every bag becomes one gradient per key occurrence, sent to the key's owner. The
    #    owner's update (Model.train calls it after the step's checks) is the engine's fused backward +
    #    optimizer: every owned row sums its gradients and takes its SGD step, here with lr = 1.
    wire.clear()
    dy = np.ones_like(out.data)
    mine_keys = emb.table.keys_by_row().tolist()
    before = emb.weight.data[:len(mine_keys), 0].copy()
    tape.backward({id(out): (out, dy)})
    sent, got, _ = wire[0]
    say(f"backward: sent {[s[0] for s in sent]} per-key gradients per rank, received {[g[0] for g in got]}")
    emb.update(lr=1.0, scaler=1.0)
    moved = dict(zip(mine_keys, (before - emb.weight.data[:len(mine_keys), 0]).tolist()))
    say(f"SGD step of each owned key (lr = 1): { {k: round(v, 5) for k, v in moved.items()} } "
        "(= number of times the key occurs in the GLOBAL batch, for dY = 1)")
    assert all(abs(v - int((keys == k).sum())) < 1e-6 for k, v in moved.items())
    comm.alltoallv = real
    if rank == 0:
        print("tutorial 05 OK", flush=True)


# %%
if __name__ == "__main__":
    if os.environ.get("NUMBACTR_TUTORIAL05_CHILD") or "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        main()
    elif relaunch_under_mpiexec():
        sys.exit(1)             # the ranks' errors are printed above (a notebook cell stops here too)
