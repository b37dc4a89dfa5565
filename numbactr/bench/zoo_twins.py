"""The PyTorch twins of ``numbactr bench zoo``'s models (numbactr/bench/zoo_models.py), one class per graph.

A twin has the same layers and widths as its HugeCTR graph and HugeCTR's initial distributions: embedding
rows U(-0.05, 0.05) (numbactr's hash embeddings), InnerProduct weights N(0, sqrt(2 / (in + out)) / 0.8796)
and biases N(0, sqrt(1 / out)) (XavierNorm, numbactr.layers.init), MultiCross as numbactr.layers.dense
says. Each embedding is one nn.Embedding indexed by the global key (slot offsets already in the keys, as
in numbactr's one hash table per embedding). ``hugectr_params()`` lists the parameters in the order of
numbactr's ``model.layers`` params, as (tensor, transposed?) pairs: an InnerProduct's W is (K, N) where
nn.Linear's weight is (N, K). ``optimizer`` and ``loss`` are what numbactr trains with: Adam (beta1 0.9,
beta2 0.999, eps 1e-7) over every parameter (the whole table each step: HugeCTR's Update_t.Global), the
mean binary cross entropy of the logits.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from numbactr.bench.zoo_models import Spec

TRUNC_STD_FIX = 0.8796  # numbactr.layers.init's XavierNorm correction (a truncated normal's std)


def linear(n_in: int, n_out: int) -> nn.Linear:
    """nn.Linear initialized like HugeCTR's InnerProduct (default XavierNorm)."""
    lin = nn.Linear(n_in, n_out)
    with torch.no_grad():
        lin.weight.normal_(0.0, math.sqrt(2.0 / (n_in + n_out)) / TRUNC_STD_FIX)
        lin.bias.normal_(0.0, math.sqrt(1.0 / n_out))
    return lin


def mlp(sizes) -> nn.Sequential:
    """InnerProduct + ReLU per width: sizes = [in, h1, h2, ...]."""
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers)


def table(rows: int, dim: int) -> nn.Embedding:
    emb = nn.Embedding(rows, dim)
    with torch.no_grad():
        emb.weight.uniform_(-0.05, 0.05)
    return emb


class Twin(nn.Module):
    """What every twin shares: its embeddings by numbactr's names, and hugectr_params()."""

    def __init__(self, spec: Spec):
        super().__init__()
        self.spec = spec
        self.emb = nn.ModuleDict({n: table(sum(spec.slots(b)), d) for n, b, d in spec.embeddings})
        self.ordered = []  # the nn.Linear / raw parameters in numbactr's layer order (subclasses fill it)

    def embed(self, name: str, ids: dict) -> torch.Tensor:
        """(B, S, D) vectors of embedding ``name`` for ids {input: (B, S) keys}."""
        bottom = next(b for n, b, _ in self.spec.embeddings if n == name)
        return self.emb[name](ids[bottom])

    def hugectr_params(self) -> list:
        out = []
        for m in self.ordered:
            if isinstance(m, nn.Linear):
                out += [(m.weight, True), (m.bias, False)]
            else:
                out.append((m, False))
        return out

    def linears(self, *seqs):
        return [m for s in seqs for m in (s if isinstance(s, nn.Sequential) else [s]) if isinstance(m, nn.Linear)]


class WideDeep(Twin):
    def __init__(self, spec):
        super().__init__(spec)
        k = spec.kw
        self.deep = mlp([len(spec.slots("deep")) * k["D"] + spec.dense, *k["hidden"]])
        self.out = linear(k["hidden"][-1], 1)
        self.ordered = self.linears(self.deep, self.out)

    def forward(self, dense, ids):
        wide = self.embed("wide_emb", ids).sum((1, 2))[:, None]  # (B, 1)
        x = torch.cat([self.embed("deep_emb", ids).flatten(1), dense], 1)
        return self.out(self.deep(x)) + wide


class DCN(Twin):
    """MultiCross v1: x_{l+1} = x0 * (x_l . w_l) + x_l + b_l; v2: x_{l+1} = x0 * (x_l U_l V_l + b_l) + x_l."""

    def __init__(self, spec):
        super().__init__(spec)
        k = spec.kw
        d = len(spec.slots("data")) * k["D"] + spec.dense
        p = k["proj"]
        cross = []
        for _ in range(k["cross"]):
            if p == 0:
                w = torch.randn(1, d) * math.sqrt(1.0 / d)
                cross += [nn.Parameter(w), nn.Parameter(torch.zeros(1, d))]
            else:
                std = math.sqrt(2.0 / (d + p))
                cross += [
                    nn.Parameter(torch.randn(d, p) * std),
                    nn.Parameter(torch.randn(p, d) * std),
                    nn.Parameter(torch.zeros(1, d)),
                ]
        self.cross = nn.ParameterList(cross)
        self.deep = mlp([d, *k["hidden"]])
        self.out = linear(d + k["hidden"][-1], 1)
        self.ordered = list(self.cross) + self.linears(self.deep, self.out)

    def forward(self, dense, ids):
        x0 = torch.cat([self.embed("emb", ids).flatten(1), dense], 1)  # (B, d)
        x, c = x0, list(self.cross)
        if self.spec.kw["proj"] == 0:
            for w, b in zip(c[0::2], c[1::2]):
                x = x0 * (x * w).sum(1, keepdim=True) + x + b
        else:
            for u, v, b in zip(c[0::3], c[1::3], c[2::3]):
                x = x0 * (x @ u @ v + b) + x
        return self.out(torch.cat([x, self.deep(x0)], 1))


class DeepFM(Twin):
    def __init__(self, spec):
        super().__init__(spec)
        k = spec.kw
        self.deep = mlp([len(spec.slots("data")) * k["D"], *k["hidden"]])
        self.out = linear(k["hidden"][-1], 1)
        self.ordered = self.linears(self.deep, self.out)

    def forward(self, dense, ids):
        e = self.embed("emb", ids)  # (B, S, D + 1)
        d = self.spec.kw["D"]
        v, w = e[..., :d], e[..., d]
        fm = 0.5 * (v.sum(1) ** 2 - (v * v).sum(1)).sum(1, keepdim=True)
        return self.out(self.deep(v.flatten(1))) + fm + w.sum(1, keepdim=True)


class DLRM(Twin):
    """HugeCTR's Interaction output: [bottom | strictly lower triangle of the dots, row-major | one 0 pad]."""

    def __init__(self, spec):
        super().__init__(spec)
        k = spec.kw
        n = len(spec.slots("data")) + 1
        self.bottom = mlp([spec.dense, *k["bottom"]])
        self.top = mlp([k["D"] + n * (n - 1) // 2 + 1, *k["top"]])
        self.out = linear(k["top"][-1], 1)
        self.register_buffer("pairs", torch.tril_indices(n, n, offset=-1))
        self.ordered = self.linears(self.bottom, self.top, self.out)

    def forward(self, dense, ids):
        x = self.bottom(dense)  # (B, D)
        v = torch.cat([x[:, None], self.embed("emb", ids)], 1)  # (B, n, D)
        dots = torch.bmm(v, v.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.out(self.top(torch.cat([x, dots, torch.zeros_like(x[:, :1])], 1)))


class NCF(Twin):
    """GMF, NCF or NeuMF: per user and item one [mlp | gmf] vector, as numbactr's graph slices it."""

    def __init__(self, spec):
        super().__init__(spec)
        k = spec.kw
        self.tower = mlp([2 * k["mlp"], *k["tower"]]) if k["mlp"] else nn.Sequential()
        width = k["gmf"] + (k["tower"][-1] if k["mlp"] else 0)
        self.out = linear(width, 1)
        self.ordered = self.linears(self.tower, self.out)

    def forward(self, dense, ids):
        e = self.embed("emb", ids)  # (B, 2, mlp + gmf)
        m = self.spec.kw["mlp"]
        parts = []
        if self.spec.kw["gmf"]:
            parts.append(e[:, 0, m:] * e[:, 1, m:])
        if m:
            parts.append(self.tower(e[:, :, :m].flatten(1)))
        return self.out(torch.cat(parts, 1))


class MMoE(Twin):
    """Experts on [embeddings | dense]; per task a softmax gate mixing them, a tower and a logit: (B, tasks)."""

    def __init__(self, spec):
        super().__init__(spec)
        k = spec.kw
        d = len(spec.slots("data")) * k["D"] + spec.dense
        self.experts = nn.ModuleList(mlp([d, k["expert"]]) for _ in range(k["experts"]))
        self.gates = nn.ModuleList(linear(d, k["experts"]) for _ in spec.heads)
        self.towers = nn.ModuleList(mlp([k["expert"], *k["tower"]]) for _ in spec.heads)
        self.outs = nn.ModuleList(linear(k["tower"][-1], 1) for _ in spec.heads)
        self.ordered = self.linears(*self.experts)
        for gate, tower, out in zip(self.gates, self.towers, self.outs):
            self.ordered += self.linears(gate, tower, out)

    def forward(self, dense, ids):
        x = torch.cat([self.embed("emb", ids).flatten(1), dense], 1)
        experts = torch.stack([e(x) for e in self.experts], 1)  # (B, E, H)
        logits = []
        for gate, tower, out in zip(self.gates, self.towers, self.outs):
            g = torch.softmax(gate(x), 1)  # (B, E)
            logits.append(out(tower((g[:, :, None] * experts).sum(1))))
        return torch.cat(logits, 1)


def dice(x: torch.Tensor, alpha: float, eps: float = 1e-8) -> torch.Tensor:
    """PReLU_Dice: x (alpha + (1 - alpha) p), p = sigmoid of x standardized per feature over the batch."""
    mean = x.mean(0)
    p = torch.sigmoid((x - mean) / torch.sqrt(((x - mean) ** 2).mean(0) + eps))
    return x * (alpha + (1 - alpha) * p)


class DIN(Twin):
    """History and target rows are [good | category] vectors; attention over the history as HugeCTR's din."""

    def __init__(self, spec):
        super().__init__(spec)
        k = spec.kw
        e = 2 * k["D"]
        self.att1, self.att2 = linear(4 * e, k["att"]), linear(k["att"], 1)
        widths = [k["D"] + 2 * e + 1, *k["hidden"]]
        self.fcs = nn.ModuleList(linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.out = linear(widths[-1], 1)
        self.ordered = [self.att1, self.att2, *self.fcs, self.out]

    def forward(self, dense, ids):
        rows = torch.cat([self.embed("good_emb", ids), self.embed("cate_emb", ids)], 2)  # (B, T + 1, E)
        his, item = rows[:, :-1], rows[:, -1]
        rep = item[:, None].expand_as(his)
        score = self.att2(self.att1(torch.cat([rep, his, rep - his, rep * his], 2)))[..., 0]  # (B, T)
        weighted = (torch.softmax(score, 1)[..., None] * his).flatten(1).sum(1, keepdim=True)  # (B, 1)
        x = torch.cat([self.embed("user_emb", ids)[:, 0], his.mean(1), weighted, item], 1)
        for fc in self.fcs:
            x = dice(fc(x), self.spec.kw["alpha"])
        return self.out(x)


class BST(Twin):
    """Masked multi-head self-attention over the history, residual, LayerNorm, mean pooling, user, MLP."""

    def __init__(self, spec):
        super().__init__(spec)
        k = spec.kw
        self.q, self.k, self.v, self.res = (linear(k["D"], k["width"]) for _ in range(4))
        self.ln = nn.LayerNorm(k["width"], eps=1e-5)
        self.top = mlp([k["width"] + k["D"], *k["hidden"]])
        self.out = linear(k["hidden"][-1], 1)
        self.ordered = [
            self.q,
            self.k,
            self.v,
            self.res,
            self.ln.weight,
            self.ln.bias,
            *self.linears(self.top, self.out),
        ]

    def forward(self, dense, ids):
        h = self.spec.kw["heads"]
        x = self.embed("hist_emb", ids)  # (B, T, D)
        b, t, _ = x.shape

        def split(y):  # (B, T, H*d) -> (B, H, T, d)
            return y.reshape(b, t, h, -1).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        keep = (torch.arange(t)[None, :] < dense.trunc()).float()[:, None, None, :]  # (B, 1, 1, T)
        z = q @ k.transpose(2, 3) / math.sqrt(q.shape[-1]) - (1 - keep) * 10000.0
        e = torch.exp(z - z.max(-1, keepdim=True).values.detach())
        probs = e / (e.sum(-1, keepdim=True) + 1e-6)  # numbactr's masked Softmax (+1e-6 in the sum)
        att = (probs @ v).transpose(1, 2).reshape(b, t, -1)
        pooled = self.ln(att + self.res(x)).mean(1)
        return self.out(self.top(torch.cat([pooled, self.embed("user_emb", ids)[:, 0]], 1)))


TWINS = {"W&D": WideDeep, "DCN": DCN, "DCNv2": DCN, "DeepFM": DeepFM, "DLRM": DLRM}
TWINS.update({n: NCF for n in ("NeuMF", "GMF", "NCF")}, MMoE=MMoE, DIN=DIN, BST=BST)


def make_twin(spec: Spec, seed: int = 0) -> Twin:
    torch.manual_seed(seed)
    return TWINS[spec.name](spec)


def copy_from(twin: Twin, dense_params: list) -> None:
    """Set the twin's parameters to numbactr's dense ones (zoo_models.dense_params, layer order)."""
    mine = twin.hugectr_params()
    if len(mine) != len(dense_params):
        raise ValueError(f"{twin.spec.name} twin: {len(mine)} parameters, numbactr has {len(dense_params)}")
    with torch.no_grad():
        for (p, transposed), a in zip(mine, dense_params):
            src = torch.from_numpy(np.ascontiguousarray(a, np.float32))
            src = src.T if transposed else src
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"{twin.spec.name} twin: parameter {tuple(p.shape)} <- numbactr {tuple(a.shape)}")
            p.copy_(src)


def optimizer(twin: Twin, lr: float = 1e-3):
    return torch.optim.Adam(twin.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-7)


def tensors(spec: Spec, batch) -> tuple:
    """(dense, ids {input: (B, S) long}, label) tensors of a numbactr Batch."""
    from numbactr.bench.zoo_models import ids_of

    ids = {k: torch.from_numpy(np.ascontiguousarray(v, np.int64)) for k, v in ids_of(spec, batch).items()}
    return torch.from_numpy(batch.dense), ids, torch.from_numpy(batch.label)


def stepper(twin: Twin, spec: Spec, batches: list, lr: float = 1e-3):
    """A function running one training step of the twin on the next batch (cycled); returns the loss tensor:
    per head (a logit column and its label column) the mean BCE, summed with the spec's loss weights as
    numbactr's compile(loss_names, loss_weights) weighs its losses."""
    prepared = [tensors(spec, b) for b in batches]
    opt = optimizer(twin, lr)
    loss_fn = nn.BCEWithLogitsLoss()
    weights = [w for _, _, w in spec.heads]
    state = {"i": 0}

    def step():
        dense, ids, label = prepared[state["i"] % len(prepared)]
        state["i"] += 1
        opt.zero_grad(set_to_none=True)
        logits = twin(dense, ids)  # (B, heads)
        loss = sum(w * loss_fn(logits[:, i], label[:, i]) for i, w in enumerate(weights))
        loss.backward()
        opt.step()
        return loss

    return step
