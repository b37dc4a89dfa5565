"""Metrics of a full ranking: each user's held-out item ranked against every item of the catalogue.

The sequential recommenders' protocol (SASRec, Kang and McAuley, ICDM 2018, as generative-recommenders
evaluates it; arXiv 2402.17152 section 4.1.1): the model scores all items for a user, the items of the user's
own history are left out (they cannot be the next new item), and the held-out item's 0-based rank r is the
number of remaining items scoring higher or equal (ties count against it, as in numbactr.metrics.grouped:
constant scores never hit). Then, averaged over users:

    HR@K   = [r < K]                     the held-out item is in the top K
    NDCG@K = [r < K] / log2(r + 2)       one relevant item, so the ideal DCG is 1
    MRR    = 1 / (r + 1)                 over the whole ranking (no cutoff)
"""

from __future__ import annotations

import numpy as np


def full_ranking_ranks(scores, targets, exclude) -> np.ndarray:
    """(U,) int64 0-based rank of each user's target among the items not excluded.

    Args:
        scores: (U, I) float, user u's score of every item id 0..I-1.
        targets: (U,) ints, the held-out item of each user (never excluded itself).
        exclude: per user a sequence of item ids left out of the ranking (the history; duplicates and the
            target allowed), or a (U, I) bool mask.
    """
    scores = np.asarray(scores)
    targets = np.asarray(targets, np.int64)
    if scores.ndim != 2 or targets.shape != (scores.shape[0],):
        raise ValueError(
            f"full_ranking_ranks: scores must be (U, I) and targets (U,), got {scores.shape}, {targets.shape}"
        )
    users, items = scores.shape
    if targets.size and (targets.min() < 0 or targets.max() >= items):
        u = int(np.argmax((targets < 0) | (targets >= items)))
        raise ValueError(f"full_ranking_ranks: user {u}'s target {targets[u]} is not an item id in [0, {items})")
    if isinstance(exclude, np.ndarray) and exclude.dtype == np.bool_:
        if exclude.shape != scores.shape:
            raise ValueError(f"full_ranking_ranks: an exclude mask must be {scores.shape}, got {exclude.shape}")
        mask = exclude.copy()
    else:
        if len(exclude) != users:
            raise ValueError(f"full_ranking_ranks: exclude has {len(exclude)} entries for {users} users")
        mask = np.zeros(scores.shape, bool)
        for u, seen in enumerate(exclude):
            mask[u, np.asarray(seen, np.int64)] = True
    rows = np.arange(users)
    mask[rows, targets] = False
    target_score = scores[rows, targets][:, None]
    beats = (scores >= target_score) & ~mask
    beats[rows, targets] = False  # the target does not count against itself
    return beats.sum(axis=1).astype(np.int64)


def ranking_metrics(ranks, k: int = 10) -> dict:
    """{"hr@k", "ndcg@k", "mrr"} averaged over the users of (U,) 0-based ranks (nan when U = 0)."""
    if int(k) < 1:
        raise ValueError(f"ranking_metrics: k must be >= 1, got {k}")
    r = np.asarray(ranks, np.float64)
    if r.size == 0:
        return {f"hr@{k}": float("nan"), f"ndcg@{k}": float("nan"), "mrr": float("nan")}
    hit = r < k
    return {
        f"hr@{k}": float(hit.mean()),
        f"ndcg@{k}": float(np.where(hit, 1.0 / np.log2(r + 2.0), 0.0).mean()),
        "mrr": float((1.0 / (r + 1.0)).mean()),
    }
