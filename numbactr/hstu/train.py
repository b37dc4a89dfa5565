"""Training and evaluation of the sequential recommenders: AdamW steps, full-ranking evaluation, a
popularity baseline.

One step: the tape records the model's loss (numbactr.hstu.model.SequentialRecommender.loss), its backward
leaves the dense gradients on the parameters and the item rows' gradients with the model; the engine applies
its fused ADAM to the item rows, and ``AdamW`` here updates the dense weights::

    w <- w (1 - lr wd)                                   decoupled weight decay (Loshchilov and Hutter)
    w <- Adam(w, g)                                      numbactr.optim.DenseOptimizer, Optimizer_t.Adam

The dense weights are views of one flat float32 vector, so the update is one DenseOptimizer call (HugeCTR's
Adam kernel on gpu/sim, its compiled CPU version on cpu).

Evaluation (numbactr.metrics.ranking): every user's held-out last item ranked by the dot product of the
user's output at its last input with every item's normalised embedding, the user's earlier items left out;
HR@10, NDCG@10 and MRR. The popularity baseline ranks items by how often they occur in the training part.
"""

from __future__ import annotations

import time

import numpy as np

from numbactr.autograd import Tape
from numbactr.config.solver import CreateOptimizer
from numbactr.enums import Optimizer_t
from numbactr.hstu.data import Sequences, eval_batches, history, train_batches
from numbactr.hstu.model import RecommenderConfig, SequentialRecommender
from numbactr.metrics.ranking import full_ranking_ranks, ranking_metrics
from numbactr.optim import DenseOptimizer
from numbactr.runtime import device


class AdamW:
    """Adam with decoupled weight decay over a list of parameter Tensors, which it rebinds to views of one
    flat vector (so one optimizer call updates them all)."""

    def __init__(self, params, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8):
        xp = device.xp()
        self.params, self.lr, self.wd = list(params), float(lr), float(weight_decay)
        sizes = [int(p.data.size) for p in self.params]
        self.bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.flat = xp.empty(int(self.bounds[-1]), np.float32)
        for p, a, b in zip(self.params, self.bounds[:-1], self.bounds[1:]):
            self.flat[a:b] = p.data.reshape(-1)
            p.data = self.flat[a:b].reshape(p.data.shape)
        opt = CreateOptimizer(Optimizer_t.Adam, beta1=betas[0], beta2=betas[1], epsilon=eps)
        self.opt = DenseOptimizer(opt, self.flat.size)

    def step(self) -> None:
        xp = device.xp()
        grad = xp.zeros_like(self.flat)
        for p, a, b in zip(self.params, self.bounds[:-1], self.bounds[1:]):
            if p.grad is not None:
                grad[a:b] = p.grad.reshape(-1)
                p.grad = None
        if self.wd:
            self.flat *= np.float32(1.0 - self.lr * self.wd)
        self.opt.step(self.flat, grad, self.lr, 1.0)


def train_epoch(
    model: SequentialRecommender, opt: AdamW, seqs: Sequences, batch_size: int, rng, step: int = 0
) -> tuple[float, int]:
    """One pass over the users in a random order: (mean loss, the step count after it)."""
    losses = []
    for batch in train_batches(seqs, batch_size, model.cfg.max_len, rng):
        tape = Tape()
        loss = model.loss(tape, batch, step)
        tape.backward({id(loss): (loss, device.xp().ones((), np.float32))})
        model.apply_item_gradients()
        opt.step()
        losses.append(float(device.to_host(loss.data)))
        step += 1
    return float(np.mean(losses)), step


def evaluate(model: SequentialRecommender, seqs: Sequences, batch_size: int = 256, k: int = 10) -> dict:
    """HR@k, NDCG@k, MRR of the full ranking (module docstring)."""
    items = model.item_matrix()  # (I, D)
    ranks = []
    for batch in eval_batches(seqs, batch_size, model.cfg.max_len):
        scores = device.to_host(model.user_embeddings(batch) @ items.T)  # (B, I): item i at column i - 1
        seen = [history(seqs, int(u)) - 1 for u in batch.users]
        ranks.append(full_ranking_ranks(scores, batch.targets - 1, seen))
    return ranking_metrics(np.concatenate(ranks), k)


def popularity_metrics(seqs: Sequences, k: int = 10) -> dict:
    """The same metrics for ranking by training popularity (counts over every user's items but the last)."""
    counts = np.zeros(seqs.num_items + 1)
    ranks = []
    for u in range(seqs.num_users):
        np.add.at(counts, history(seqs, u), 1)
    scores = counts[1:][None]
    for u in range(seqs.num_users):
        items = seqs.user(u)[0]
        ranks.append(full_ranking_ranks(scores, items[-1:] - 1, [history(seqs, u) - 1])[0])
    return ranking_metrics(np.asarray(ranks), k)


def fit(cfg: RecommenderConfig, seqs: Sequences, epochs: int, batch_size: int = 128, log=None) -> dict:
    """Train a fresh model for ``epochs`` epochs and evaluate it: {"metrics", "losses", "seconds", ...}."""
    model = SequentialRecommender(cfg, seqs.num_items)
    opt = AdamW(model.dense_params, cfg.learning_rate, cfg.weight_decay)
    rng = np.random.default_rng(cfg.seed + 1)
    losses, step, start = [], 0, time.perf_counter()
    for epoch in range(epochs):
        loss, step = train_epoch(model, opt, seqs, batch_size, rng, step)
        losses.append(loss)
        if log is not None:
            log(f"{cfg.kind} seed {cfg.seed} epoch {epoch + 1}/{epochs}: loss {loss:.4f}")
    seconds = time.perf_counter() - start
    return {"metrics": evaluate(model, seqs), "losses": losses, "seconds": seconds, "steps": step, "model": model}
