"""The sequential recommender: item embeddings in the embedding engine, learned positions, stacked HSTU layers
or SASRec blocks, L2-normalised outputs, trained with a sampled softmax.

generative-recommenders' research setup (configs/ml-1m/hstu-sampled-softmax-n128-final.gin and
sasrec-sampled-softmax-n128-final.gin; arXiv 2402.17152 section 4.1.1)::

    x_t   = sqrt(D) E[id_t] + P[t]            dropout, then the layers   (LearnablePositionalEmbedding...)
    out_t = layers(x)_t / |layers(x)_t|                                  (L2NormEmbeddingPostprocessor)
    loss  = sampled softmax of out_t against E[label_t] / |.| and R uniform negatives E[n] / |.|, temperature
            0.05 (SampledSoftmaxLoss with the "local" sampler, item_l2_norm)

E (I + 1, D), row 0 the padding id, initialised N(0, 0.02) truncated at 2 std; P (N, D) truncated N(0, 1/D).

The item table lives in the embedding engine (numbactr.embedding.engine.TableBatchedEmbedding, pooling NONE:
one row per index) with its fused ADAM: one lookup per step reads the batch's distinct items (inputs, labels and
negatives together), and the engine's backward sums each row's gradients and updates the rows touched,
with decoupled weight decay (AdamW). That is a lazy Adam: rows not read in a step keep their moments, where
torch's dense AdamW decays every row's moments each step; with 128 negatives per token nearly every item of
MovieLens is read in every batch. The dense weights (positions, layers) are updated by numbactr.hstu.train.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from numbactr.autograd import Context, Function, Tape, Tensor
from numbactr.embedding.engine import Optim, OptimizerSpec, Pooling, TableBatchedEmbedding
from numbactr.hstu.data import JaggedBatch
from numbactr.hstu.layer import HstuLayer, SasRecBlock, Steps, param
from numbactr.ops.elementwise import AddFn
from numbactr.ops.hstu import GatherRowsFn, L2NormFn, SampledSoftmaxFn, ScaleByFn
from numbactr.runtime import device

INPUT_DROPOUT_ID = 100_000  # the dropout stream of the input embeddings (layers use their own ids)


@dataclass
class RecommenderConfig:
    """One model's settings; the defaults are generative-recommenders' ML-1M configs except max_len."""

    kind: str = "hstu"  # "hstu" or "sasrec"
    dim: int = 50  # D, the item embedding width
    layers: int = 2
    heads: int = 1
    dqk: int = 50  # HSTU's attention head dim
    dv: int = 50  # HSTU's value head dim
    max_len: int = 200  # inputs kept per sequence (the latest); padded length N = max_len + 1
    dropout: float = 0.2
    negatives: int = 128
    temperature: float = 0.05
    learning_rate: float = 1e-3
    weight_decay: float = 0.0  # AdamW's decoupled decay (0 in the ML-1M configs)
    seed: int = 0

    def check(self) -> None:
        if self.kind not in ("hstu", "sasrec"):
            raise ValueError(f"RecommenderConfig.kind must be 'hstu' or 'sasrec', got {self.kind!r}")
        for name in ("dim", "layers", "heads", "dqk", "dv", "max_len", "negatives"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"RecommenderConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.dropout < 1 or self.temperature <= 0:
            raise ValueError(
                f"RecommenderConfig: dropout must be in [0, 1) and temperature > 0, got "
                f"{self.dropout}, {self.temperature}"
            )


def truncated_normal(rng, std: float, shape) -> np.ndarray:
    """N(0, std) redrawn outside +-2 std (generative-recommenders' truncated_normal)."""
    x = rng.normal(0, 1, shape)
    bad = np.abs(x) > 2
    while bad.any():
        x[bad] = rng.normal(0, 1, int(bad.sum()))
        bad = np.abs(x) > 2
    return x * std


def distinct(ids, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct ids ascending, each id's index among them) for ids in [0, n): np.unique's answer in
    O(len + n) (no sort)."""
    present = np.zeros(n, bool)
    present[ids] = True
    uniq = np.flatnonzero(present)
    where = np.zeros(n, np.int64)
    where[uniq] = np.arange(uniq.size)
    return uniq, where[ids]


class ItemRowsFn(Function):
    """The engine's lookup on the tape: ``indices`` (M,) -> rows (M, D). The backward gives the anchor no
    gradient: it keeps dY for the model's update (the engine applies its fused optimizer there)."""

    @staticmethod
    def forward(ctx: Context, anchor, model=None, indices=None, training: bool = True):
        xp = device.xp()
        idx = xp.asarray(np.ascontiguousarray(indices, np.int64))
        out, ctx.lookup = model.items.forward(idx, xp.asarray(np.array([0, idx.size], np.int64)), training=training)
        ctx.model = model
        return out

    @staticmethod
    def backward(ctx: Context, dy):
        ctx.model.held.append((ctx.lookup, dy))
        return None


class SequentialRecommender:
    """HSTU or SASRec over ``num_items`` items (ids 1..num_items, 0 padding); see the module docstring."""

    def __init__(self, cfg: RecommenderConfig, num_items: int):
        cfg.check()
        self.cfg, self.num_items, self.n_pad = cfg, int(num_items), cfg.max_len + 1
        rng = np.random.default_rng(cfg.seed)
        opt = OptimizerSpec(Optim.ADAM, learning_rate=cfg.learning_rate, eps=1e-8, weight_decay=cfg.weight_decay)
        self.items = TableBatchedEmbedding(
            [(num_items + 1, cfg.dim)], pooling=Pooling.NONE, optimizer=opt, seed=cfg.seed
        )
        table = self.items.split_weights()[0]
        table[...] = device.xp().asarray(truncated_normal(rng, 0.02, table.shape).astype(np.float32))
        self.positions = param(truncated_normal(rng, math.sqrt(1.0 / cfg.dim), (self.n_pad, cfg.dim)), "positions")
        if cfg.kind == "hstu":
            self.layers = [
                HstuLayer(cfg.dim, cfg.heads, cfg.dqk, cfg.dv, self.n_pad, cfg.dropout, rng, i)
                for i in range(cfg.layers)
            ]
        else:
            self.layers = [SasRecBlock(cfg.dim, cfg.heads, cfg.dropout, rng, i) for i in range(cfg.layers)]
        self.anchor = Tensor(device.xp().zeros(1, np.float32), "item table", requires_grad=True)
        self.held = []
        self.rng = rng

    @property
    def dense_params(self) -> list:
        return [self.positions] + [p for layer in self.layers for p in layer.params]

    def _encode(self, steps: Steps, item_rows: Tensor) -> Tensor:
        """The L2-normalised outputs (T, D) of the input rows E[ids] (T, D)."""
        tape, b = steps.tape, steps.batch
        x = AddFn.apply(
            tape,
            ScaleByFn.apply(tape, item_rows, factor=math.sqrt(self.cfg.dim)),
            GatherRowsFn.apply(tape, self.positions, index=b.positions),
        )
        x = steps.dropout(self, x, self.cfg.dropout, INPUT_DROPOUT_ID)
        for layer in self.layers:
            x = layer(steps, x)
        return L2NormFn.apply(tape, x)

    def loss(self, tape: Tape, batch: JaggedBatch, step: int = 0) -> Tensor:
        """The sampled softmax loss of a training batch (0-d Tensor); negatives drawn uniformly from
        1..num_items with the model's generator (a negative equal to the label gets logit -5e4). The batch's
        distinct items (inputs, labels, negatives) are read from the engine once: (U, D) rows that the
        inputs gather and whose normalised copies the loss indexes."""
        t, r = batch.ids.size, self.cfg.negatives
        neg = self.rng.integers(1, self.num_items + 1, t * r)
        uniq, inv = distinct(np.concatenate([batch.ids, batch.labels, neg]), self.num_items + 1)
        rows = ItemRowsFn.apply(tape, self.anchor, model=self, indices=uniq)  # (U, D)
        steps = Steps(tape, batch, self.n_pad, True, self.cfg.seed, step)
        out = self._encode(steps, GatherRowsFn.apply(tape, rows, index=inv[:t]))
        xp = device.xp()
        return SampledSoftmaxFn.apply(
            tape,
            out,
            L2NormFn.apply(tape, rows),
            pos=xp.asarray(inv[t : 2 * t]),
            neg=xp.asarray(inv[2 * t :].reshape(t, r)),
            weights=xp.asarray((batch.labels > 0).astype(np.float32)),
            temperature=self.cfg.temperature,
        )

    def apply_item_gradients(self) -> None:
        """The engine's fused update of the rows read this step (after the tape's backward)."""
        for lookup, dy in self.held:
            self.items.backward(lookup, dy)
        self.held.clear()

    def user_embeddings(self, batch: JaggedBatch):
        """(B, D) device array: each sequence's normalised output at its last input (no dropout, no tape)."""
        rows = ItemRowsFn.apply(None, self.anchor, model=self, indices=batch.ids, training=False)
        out = self._encode(Steps(None, batch, self.n_pad, False), Tensor(rows.data))
        return out.data[device.xp().asarray(batch.last)]

    def item_matrix(self):
        """(I, D) device array: the L2-normalised embeddings of items 1..num_items (row i - 1 is item i)."""
        e = self.items.split_weights()[0][1:]
        return e / device.xp().maximum(device.xp().sqrt((e * e).sum(1, keepdims=True)), np.float32(1e-6))
