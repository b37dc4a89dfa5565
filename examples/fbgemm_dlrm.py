"""A small DLRM in plain PyTorch whose sparse features go through FBGEMM's Table Batched Embedding.

It is written as one writes it for fbgemm_gpu; the one numbactr line is the import below, which for
FBGEMM reads `from fbgemm_gpu.split_table_batched_embeddings_ops_training import (...)`. The tables
train inside loss.backward() (FBGEMM's fused backward + optimizer); the MLPs train with torch.optim.Adam.

    python examples/fbgemm_dlrm.py                   # numbactr's engine (cpu, or cuda on a GPU)
    python examples/fbgemm_dlrm.py --steps 400 --batch 512

Data: 13 dense features and 8 multi-hot sparse features (1-3 ids per bag, Zipf-like ids), labels drawn
from a hidden logistic model of the dense features and per-id effects, so the embeddings must learn.
Shapes: B batch, T tables (one feature each), D embedding width.
"""

import argparse

import numpy as np
import torch
from torch import nn

from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # the one changed line
    ComputeDevice,
    EmbeddingLocation,
    OptimType,
    PoolingMode,
    SplitTableBatchedEmbeddingBagsCodegen,
)


def mlp(sizes, last_relu=True):
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """bottom MLP on dense features, TBE on sparse features, pairwise dot interaction, top MLP -> logit."""

    def __init__(self, dense_in, table_rows, dim, device, embedding_lr=0.1):
        super().__init__()
        on_gpu = device.type == "cuda"
        location = EmbeddingLocation.DEVICE if on_gpu else EmbeddingLocation.HOST
        compute = ComputeDevice.CUDA if on_gpu else ComputeDevice.CPU
        self.emb = SplitTableBatchedEmbeddingBagsCodegen(
            [(rows, dim, location, compute) for rows in table_rows],
            optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=embedding_lr,
            pooling_mode=PoolingMode.SUM,
            device=device,
        )
        self.emb.init_embedding_weights_uniform(-0.05, 0.05)
        self.n_tables, self.dim = len(table_rows), dim
        n = self.n_tables + 1
        self.bottom = mlp([dense_in, 64, dim])
        self.top = mlp([dim + n * (n - 1) // 2, 64, 1], last_relu=False)
        self.register_buffer("pairs", torch.tril_indices(n, n, offset=-1))

    def forward(self, dense, indices, offsets):
        x = self.bottom(dense)  # (B, D)
        e = self.emb(indices, offsets).view(-1, self.n_tables, self.dim)  # (B, T, D)
        z = torch.cat([x.unsqueeze(1), e], dim=1)  # (B, T + 1, D)
        dots = torch.bmm(z, z.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]  # (B, (T+1)T/2)
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)  # (B,) logits


class Data:
    """Batches from a fixed hidden model: dense (B, 13), TBE input (indices, offsets), labels (B,)."""

    def __init__(self, table_rows, dense_in=13, seed=0):
        self.rng = np.random.default_rng(seed)
        self.rows = np.asarray(table_rows)
        self.w_dense = self.rng.normal(0, 0.5, dense_in)
        self.effects = [self.rng.normal(0, 1.0, r) for r in table_rows]  # per-id log-odds
        self.dense_in = dense_in

    def batch(self, b):
        rng, t = self.rng, len(self.rows)
        dense = rng.normal(size=(b, self.dense_in)).astype(np.float32)
        lens = rng.integers(1, 4, size=(t, b))  # (T, B) ids per bag
        ids = [np.minimum(rng.zipf(1.3, lens[i].sum()) - 1, self.rows[i] - 1) for i in range(t)]
        logit = dense @ self.w_dense
        for i in range(t):  # mean effect per bag
            bag = np.repeat(np.arange(b), lens[i])
            logit += np.bincount(bag, self.effects[i][ids[i]], b) / lens[i]
        label = (rng.random(b) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        offsets = np.concatenate([[0], np.cumsum(lens.reshape(-1))])  # feature-major bags
        return (
            torch.from_numpy(dense),
            torch.from_numpy(np.concatenate(ids).astype(np.int64)),
            torch.from_numpy(offsets.astype(np.int64)),
            torch.from_numpy(label),
        )


def auc(labels, scores):
    """Area under the ROC curve: P(score of a positive > score of a negative), ties counting 1/2."""
    pos, neg = scores[labels == 1][:, None], scores[labels == 0][None, :]
    return float(((pos > neg).sum() + 0.5 * (pos == neg).sum()) / max(pos.size * neg.size, 1))


def main(
    steps=200,
    batch=256,
    table_rows=(1000, 500, 2000, 100, 800, 50, 300, 1500),
    dim=16,
    seed=0,
    log_every=50,
    device=None,
):
    """Train; returns (losses per step, eval AUC)."""
    torch.manual_seed(seed)
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = Data(table_rows, seed=seed)
    model = DLRM(data.dense_in, table_rows, dim, device).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.BCEWithLogitsLoss()
    losses = []
    for step in range(steps):
        dense, indices, offsets, label = (t.to(device) for t in data.batch(batch))
        loss = loss_fn(model(dense, indices, offsets), label)
        opt.zero_grad()
        loss.backward()  # also updates the embedding tables (fused optimizer)
        opt.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"step {step + 1}: loss {np.mean(losses[-log_every:]):.4f}", flush=True)
    model.eval()
    with torch.no_grad():
        dense, indices, offsets, label = (t.to(device) for t in data.batch(4096))
        score = torch.sigmoid(model(dense, indices, offsets)).cpu().numpy()
    result = auc(label.cpu().numpy(), score)
    print(f"eval AUC {result:.4f}", flush=True)
    return losses, result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    main(steps=a.steps, batch=a.batch, seed=a.seed)
