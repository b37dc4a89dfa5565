"""A PyTorch click model whose embeddings are SOK layers (numbactr.sok), on one rank or several.

    python examples/sok_demo.py                 # one process
    mpiexec -n 2 python examples/sok_demo.py    # the table model-parallel over 2 ranks, the MLP data-parallel

The data: 8 slots of 1-3 keys each from a vocabulary of 1000 per slot; a hidden weight per key, and a
click probability sigmoid(sum of the sample's hidden weights). Every rank draws the same global batches
and trains on its contiguous share of each. The model: sok.DistributedEmbedding (sum per slot, keys
hashed, SOK's default) -> (B, 8, 8) -> an MLP -> a logit. One OptimizerWrapper step trains both: torch's
Adam the MLP, the engine's fused Adam the table's touched rows. Rank 0 prints the global loss.
"""

import numbactr  # noqa: F401  (first: under mpiexec it starts MPI and ends the job if a rank fails)
import numpy as np
import torch

import numbactr.sok as sok
from numbactr.distributed.sharding import rank_rows

SLOTS, VOCAB, DIM, BATCH, STEPS = 8, 1000, 8, 512, 80


def global_batches(seed: int = 0):
    """Endless (keys, offsets, labels) of the global batch: bag b * SLOTS + s = slot s of sample b."""
    rng = np.random.default_rng(seed)
    hidden = rng.normal(0.0, 1.0, SLOTS * VOCAB)  # the planted weight of every key
    while True:
        lens = rng.integers(1, 4, BATCH * SLOTS)
        slot = np.repeat(np.tile(np.arange(SLOTS), BATCH), lens)
        keys = slot * VOCAB + rng.integers(0, VOCAB, lens.sum())
        offsets = np.concatenate([[0], np.cumsum(lens)])
        logit = np.add.reduceat(hidden[keys], offsets[:-1]).reshape(BATCH, SLOTS).sum(1) / 2
        labels = (rng.random(BATCH) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        yield keys, offsets, labels


class ClickModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = sok.DistributedEmbedding(
            "sum", max_vocabulary_size_per_gpu=SLOTS * VOCAB, embedding_vec_size=DIM, slot_num=SLOTS, max_nnz=3
        )
        self.mlp = torch.nn.Sequential(torch.nn.Linear(SLOTS * DIM, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, keys, offsets):
        return self.mlp(self.emb((keys, offsets)).flatten(1)).squeeze(1)  # (B,) logits


def main():
    comm = sok.init()
    r0, r1 = rank_rows(BATCH, comm.rank, comm.size)  # this rank's samples of each global batch
    torch.manual_seed(0)
    model = ClickModel()
    sok.broadcast_parameters(model)
    opt = sok.OptimizerWrapper(torch.optim.Adam(model.parameters(), lr=0.01))
    bce = torch.nn.BCEWithLogitsLoss()
    losses = []
    for step, (keys, offsets, labels) in zip(range(STEPS), global_batches()):
        o = offsets[r0 * SLOTS : r1 * SLOTS + 1]
        mine = torch.from_numpy(keys[o[0] : o[-1]]), torch.from_numpy(o - o[0])
        opt.zero_grad()
        loss = bce(model(*mine), torch.from_numpy(labels[r0:r1]))
        loss.backward()
        sok.average_gradients(model)  # the MLP's gradients, averaged over the ranks
        opt.step()
        losses.append(comm.allreduce_sum(np.array([loss.item() / comm.size]))[0])
        if comm.rank == 0 and step % 20 == 0:
            print(f"step {step:3d}: loss {losses[-1]:.4f}", flush=True)
    if comm.rank == 0:
        print(
            f"{comm.size} rank(s), {len(model.emb.keys())} keys on rank 0: loss {np.mean(losses[:10]):.4f} "
            f"(first 10 steps) -> {np.mean(losses[-10:]):.4f} (last 10)"
        )


if __name__ == "__main__":
    main()
