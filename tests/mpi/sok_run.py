"""A PyTorch model with every kind of numbactr.sok table, trained on R ranks; rank 0 saves the results.

    mpiexec -n R python tests/mpi/sok_run.py OUT.npz [resume | dump DIR]

Every rank builds the same global batches and takes its contiguous rows of them (batch 12 splits over 1, 2
and 3 ranks). The model: DistributedEmbedding (keyed, mean, keys beyond 2**32), All2AllDenseEmbedding
(unkeyed), a distributed sok.Variable, a DynamicVariable (ragged bags, keys up to 2**40) and a localized
Variable (all rows on rank 0), concatenated under an MLP. Each rank seeds torch differently, so
broadcast_parameters must bring rank 0's dense weights; the loss is each rank's mean; average_gradients
averages the dense gradients; an OptimizerWrapper(Adam) trains the dense part, the layers and the localized
variable, sok.Adam (HugeCTR's global Adam) the other two variables. Saved: each step's embedding outputs,
logits and global loss, the evaluation logits (unseen keys included), every table's keys and rows (gathered,
sorted by key) and the dense weights. tests/test_sok_mpi.py compares R = 2, 3 with R = 1. With `resume`,
every rank saves its model's and optimizers' state_dicts (torch.save) after step 2, builds a fresh model and
optimizers, loads them (torch.load) and trains on: the results must be those of the run without a break.
With `dump DIR`, the trained tables go to DIR in SOK's files (sok.dump, with their optimizers' states), and
every rank loads DIR into a fresh model (sok.load) and checks its own rows and states came back.
"""

import io
import os
import sys

os.environ.setdefault("NUMBACTR_DEVICE", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numbactr  # noqa: E402,F401  (first: under mpiexec it starts MPI and the rank guard)
import numpy as np  # noqa: E402
import torch  # noqa: E402

import numbactr.sok as sok  # noqa: E402
from numbactr.distributed.sharding import rank_rows  # noqa: E402

B, S, D, STEPS = 12, 3, 4, 4


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dist = sok.DistributedEmbedding("mean", 64, D, S, 3, name="dist")
        self.dense = sok.All2AllDenseEmbedding(16, D, 2, 2, use_hashtable=False, name="dense")
        self.var = sok.Variable(shape=(20, D), name="var")
        self.dyn = sok.DynamicVariable(D, name="dyn", max_capacity=64)
        self.loc = sok.Variable(shape=(7, D), mode="localized:0", name="loc")
        width = S * D + 2 * 2 * D + 3 * D
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def embeddings(self, batch):
        var, dyn, loc = sok.lookup_sparse(
            [self.var, self.dyn, self.loc], [batch["var"], batch["dyn"], batch["loc"]], combiners=["sum", "mean", "sum"]
        )
        parts = [self.dist(batch["dist"]), self.dense(batch["dense"]), var, dyn, loc]
        return torch.cat([p.reshape(p.shape[0], -1) for p in parts], 1)

    def forward(self, batch):
        emb = self.embeddings(batch)
        return emb, self.mlp(emb)


def ragged(rng, bags, most, high):
    lens = rng.integers(0, most + 1, bags)
    return rng.integers(0, high, int(lens.sum())), np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


def rows_of(values, offsets, lo, hi):
    """(values, offsets) of bags lo..hi-1."""
    o = offsets[lo : hi + 1]
    return torch.from_numpy(values[o[0] : o[-1]]), torch.from_numpy(o - o[0])


def global_batch(rng, vocab):
    """The global batch as numpy pieces (every rank draws the same)."""
    dist_keys, dist_off = ragged(rng, B * S, 3, vocab)
    dyn_keys, dyn_off = ragged(rng, B, 3, vocab)
    return dict(
        dist=(dist_keys + (dist_keys % S) * (1 << 33), dist_off),
        dense=rng.integers(0, 16, (B, 2, 2)),
        var=rng.integers(0, 20, (B, 2)),
        dyn=(dyn_keys * (1 << 30), dyn_off),
        loc=rng.integers(0, 7, (B, 1)),
        label=(rng.random((B, 1)) < 0.5).astype(np.float32),
    )


def local(batch, r0, r1):
    return dict(
        dist=rows_of(*batch["dist"], r0 * S, r1 * S),
        dense=torch.from_numpy(batch["dense"][r0:r1]),
        var=torch.from_numpy(batch["var"][r0:r1]),
        dyn=rows_of(*batch["dyn"], r0, r1),
        loc=torch.from_numpy(batch["loc"][r0:r1]),
        label=torch.from_numpy(batch["label"][r0:r1]),
    )


def gathered_tables(comm, model) -> dict:
    out = {}
    for name in ("dist", "dense", "var", "dyn", "loc"):
        module = getattr(model, name)
        keys = comm.allgather_rows(np.ascontiguousarray(module.keys().numpy()))
        rows = comm.allgather_rows(np.ascontiguousarray(module.weight.numpy()))
        order = np.argsort(keys, kind="stable")
        out[f"{name}:keys"], out[f"{name}:rows"] = keys[order], rows[order]
    return out


def build(comm):
    """The model and its two optimizers, fresh (sok.init first: the tables' seeds follow creation order)."""
    sok.init(seed=3, set_torch_threads=False)
    torch.manual_seed(100 + comm.rank)  # different dense weights on every rank...
    model = Model()
    sok.broadcast_parameters(model)  # ...until rank 0's reach them all
    variables = [model.var.placeholder, model.dyn.placeholder]
    rest = [p for p in model.parameters() if all(p is not v for v in variables)]
    return model, sok.OptimizerWrapper(torch.optim.Adam(rest, lr=0.05)), sok.Adam(variables, learning_rate=0.05)


def main():
    out_path = sys.argv[1]
    resume = sys.argv[2:] == ["resume"]
    dump_dir = sys.argv[3] if sys.argv[2:3] == ["dump"] else None
    comm = sok.init(seed=3, set_torch_threads=False)
    torch.set_num_threads(1)
    r0, r1 = rank_rows(B, comm.rank, comm.size)
    model, opt, opt_vars = build(comm)
    bce = torch.nn.BCEWithLogitsLoss()
    rng = np.random.default_rng(7)
    saved = {k: [] for k in ("emb", "logits", "loss")}
    for step in range(STEPS):
        if resume and step == 2:  # each rank its own checkpoint, into a fresh model
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "vars": opt_vars.state_dict()}, buf)
            model, opt, opt_vars = build(comm)
            ck = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            opt_vars.load_state_dict(ck["vars"])
        batch = local(global_batch(rng, vocab=10), r0, r1)
        opt.zero_grad()
        opt_vars.zero_grad()
        emb, logits = model(batch)
        loss = bce(logits, batch["label"])
        loss.backward()
        sok.average_gradients(model)
        opt.step()
        opt_vars.step()
        saved["emb"].append(comm.allgather_rows(emb.detach().numpy()))
        saved["logits"].append(comm.allgather_rows(logits.detach().numpy()))
        saved["loss"].append(comm.allreduce_sum(np.array([loss.item() * (r1 - r0) / B])))
    if dump_dir:
        sok.dump(dump_dir, [model.dist, model.dense, model.loc], opt)
        sok.dump(dump_dir, [model.var, model.dyn], opt_vars)
        fresh, fresh_opt, fresh_vars = build(comm)
        sok.load(dump_dir, [fresh.dist, fresh.dense, fresh.loc], fresh_opt)
        sok.load(dump_dir, [fresh.var, fresh.dyn], fresh_vars)
        for name in ("dist", "dense", "var", "dyn", "loc"):
            a, b = getattr(model, name).table, getattr(fresh, name).table
            sa, sb = a.optimizer_state(), b.optimizer_state()
            oa, ob = np.argsort(sa["keys"]), np.argsort(sb["keys"])
            assert np.array_equal(sa["keys"][oa], sb["keys"][ob]), name
            assert np.array_equal(a.state()[1][np.argsort(a.state()[0])], b.state()[1][np.argsort(b.state()[0])]), name
            for k in sa["states"]:
                assert np.array_equal(sa["states"][k][oa], sb["states"][k][ob]), (name, k)
    result = {k: np.stack(v) for k, v in saved.items()}
    result.update(gathered_tables(comm, model))  # the trained tables (an evaluation lookup inserts keys)
    model.eval()
    with torch.no_grad():
        _, logits = model(local(global_batch(rng, vocab=14), r0, r1))  # keys 10..13 were never seen
    result["eval"] = comm.allgather_rows(logits.numpy())
    result.update({f"mlp:{k}": v.numpy() for k, v in model.mlp.state_dict().items()})
    if comm.rank == 0:
        np.savez(out_path, **result)


if __name__ == "__main__":
    main()
