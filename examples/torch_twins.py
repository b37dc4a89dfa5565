"""PyTorch twins of the real-data examples' numbactr models (no numbactr import here).

Each twin has the same embedding sizes, layers and initialization as its HugeCTR-API model:
embeddings U(-0.05, 0.05) (numbactr's hash embeddings), InnerProduct weights N(0, sqrt(2 / (in + out)) /
0.8796) and biases N(0, sqrt(1 / out)) (HugeCTR's default XavierNorm, numbactr.layers.init). One embedding
table per model holds every slot's rows (slot offsets added here), as numbactr's single hash table does.
``train`` runs Adam with the given lr, betas and eps on the mean binary cross entropy of the logits, over
the training rows in file order (the order numbactr's reader feeds them), with no reshuffle between epochs.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

TRUNC_STD_FIX = 0.8796


def linear(n_in: int, n_out: int) -> nn.Linear:
    """nn.Linear initialized like HugeCTR's InnerProduct (default XavierNorm)."""
    lin = nn.Linear(n_in, n_out)
    with torch.no_grad():
        lin.weight.normal_(0.0, math.sqrt(2.0 / (n_in + n_out)) / TRUNC_STD_FIX)
        lin.bias.normal_(0.0, math.sqrt(1.0 / n_out))
    return lin


def mlp(sizes, dropout: float = 0.0) -> nn.Sequential:
    """InnerProduct + ReLU (+ Dropout) per hidden size: sizes = [in, h1, h2, ...]."""
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [linear(a, b), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout else [])
    return nn.Sequential(*layers)


class Embeddings(nn.Module):
    """One table for all slots; forward(ids (B, S) per-slot ids) -> (B, S, dim)."""

    def __init__(self, slot_sizes, dim: int):
        super().__init__()
        sizes = [max(1, int(s)) for s in slot_sizes]
        self.register_buffer("offsets", torch.tensor(np.r_[0, np.cumsum(sizes)[:-1]], dtype=torch.long))
        self.table = nn.Embedding(int(sum(sizes)), dim)
        with torch.no_grad():
            self.table.weight.uniform_(-0.05, 0.05)

    def forward(self, ids):
        return self.table(ids + self.offsets)


class NCF(nn.Module):
    """GMF (elementwise product of user and item vectors), NCF (MLP tower on their concatenation) or
    NeuMF (both, concatenated), then one InnerProduct to the logit (He et al. 2017)."""

    def __init__(self, kind: str, slot_sizes, gmf_dim: int, mlp_dim: int, tower, dropout: float = 0.0):
        super().__init__()
        self.kind = kind
        width = 0
        if kind in ("gmf", "neumf"):
            self.gmf = Embeddings(slot_sizes, gmf_dim)
            width += gmf_dim
        if kind in ("ncf", "neumf"):
            self.mlp_emb = Embeddings(slot_sizes, mlp_dim)
            self.tower = mlp([2 * mlp_dim, *tower], dropout)
            width += tower[-1]
        self.out = linear(width, 1)

    def forward(self, dense, ids):
        parts = []
        if self.kind in ("gmf", "neumf"):
            e = self.gmf(ids)
            parts.append(e[:, 0] * e[:, 1])
        if self.kind in ("ncf", "neumf"):
            parts.append(self.tower(self.mlp_emb(ids).flatten(1)))
        return self.out(torch.cat(parts, 1))


class WideDeep(nn.Module):
    """Deep: dim-wide embeddings of the first slots and the dense features through an MLP; wide: a 1-wide
    embedding of the last ``wide_slots`` slots, summed; logit = deep + wide (HugeCTR's samples/wdl)."""

    def __init__(self, slot_sizes, dense_dim: int, dim: int, hidden, wide_slots: int, dropout: float = 0.0):
        super().__init__()
        self.w = len(slot_sizes) - wide_slots
        self.wide = Embeddings(slot_sizes[self.w :], 1)
        self.deep = Embeddings(slot_sizes[: self.w], dim)
        self.tower = mlp([self.w * dim + dense_dim, *hidden], dropout)
        self.out = linear(hidden[-1], 1)

    def forward(self, dense, ids):
        deep = self.out(self.tower(torch.cat([self.deep(ids[:, : self.w]).flatten(1), dense], 1)))
        return deep + self.wide(ids[:, self.w :]).sum(1)


def train(model, data: dict, epochs: int, batch: int, lr: float, betas=(0.9, 0.999), eps: float = 1e-7):
    """Adam on the mean BCE of the logits, the rows in file order, the last partial batch dropped (as
    numbactr's reader drops it in training: HugeCTR trains on full batches)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=betas, eps=eps)
    loss_fn = nn.BCEWithLogitsLoss()
    y = torch.from_numpy(data["label"]).reshape(-1, 1)
    d = torch.from_numpy(data["dense"])
    x = torch.from_numpy(data["ids"])
    n = (len(y) // batch) * batch
    model.train()
    for _ in range(epochs):
        for a in range(0, n, batch):
            opt.zero_grad()
            loss = loss_fn(model(d[a : a + batch], x[a : a + batch]), y[a : a + batch])
            loss.backward()
            opt.step()
    return model


@torch.no_grad()
def predict(model, data: dict, batch: int = 10000) -> np.ndarray:
    """Sigmoid scores (n,) of every row."""
    model.eval()
    d, x = torch.from_numpy(data["dense"]), torch.from_numpy(data["ids"])
    out = [torch.sigmoid(model(d[a : a + batch], x[a : a + batch])) for a in range(0, len(x), batch)]
    return torch.cat(out).reshape(-1).numpy()


class DLRM(nn.Module):
    """Bottom MLP on the dense values to ``dim``; the dot interaction of it and the slot vectors (the
    bottom output, the strictly lower triangle of the pairwise dots, one zero pad: HugeCTR's Interaction);
    top MLP to the logit."""

    def __init__(self, slot_sizes, dense_dim: int, dim: int, bottom, top):
        super().__init__()
        self.emb = Embeddings(slot_sizes, dim)
        self.bottom = mlp([dense_dim, *bottom, dim])
        n = len(slot_sizes) + 1
        self.register_buffer("pairs", torch.tril_indices(n, n, offset=-1))
        self.top = nn.Sequential(mlp([dim + n * (n - 1) // 2 + 1, *top]), linear(top[-1], 1))

    def forward(self, dense, ids):
        x = self.bottom(dense)
        v = torch.cat([x[:, None], self.emb(ids)], 1)  # (B, n, dim)
        dots = torch.bmm(v, v.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, dots, torch.zeros_like(x[:, :1])], 1))


class DeepFM(nn.Module):
    """One (dim + 1)-wide vector per slot: dim factors and a first-order weight. Logit = MLP(factors) +
    FM second order 0.5 * sum((sum v)^2 - sum v^2) + sum of the weights (HugeCTR's samples/deepfm)."""

    def __init__(self, slot_sizes, dim: int, hidden):
        super().__init__()
        self.dim = dim
        self.emb = Embeddings(slot_sizes, dim + 1)
        self.deep = nn.Sequential(mlp([len(slot_sizes) * dim, *hidden]), linear(hidden[-1], 1))

    def forward(self, dense, ids):
        e = self.emb(ids)
        v, w = e[..., : self.dim], e[..., self.dim]
        fm = 0.5 * (v.sum(1) ** 2 - (v * v).sum(1)).sum(1, keepdim=True)
        return self.deep(v.flatten(1)) + fm + w.sum(1, keepdim=True)
