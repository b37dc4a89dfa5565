"""Metrics over groups of rows: HitRate@K and NDCG@K of a ranking with sampled negatives, and group AUC.

A group is one user's rows. In the NCF protocol (He et al., WWW 2017; HugeCTR's NCF sample) the eval set
holds, per user, the held-out positive item followed by N sampled negatives, so every N + 1 consecutive rows
are one ranking: give ``groups=N + 1``. Elsewhere (DIN, BARS/FuxiCTR) a user's impressions are scattered
over the eval set: give ``groups=`` the user key of each row.

Ties. A positive ranks behind every row of its group that scores the same (pessimistic): its 0-based rank
is the number of rows scoring higher or equal. This is what He et al.'s evaluate.py gives under Python 3:
it appends the positive after its negatives and takes ``heapq.nlargest``, which keeps tied items in their
order. (Their Python 2 dictionaries ordered ties by item id hash; a tie is then a coin flip.) It never
credits a model that scores everything the same: HitRate@K of constant scores is 0 for K <= N.

All functions take (n,) arrays (or (n, 1)) and return Python floats, nan where no group qualifies.
"""

from __future__ import annotations

import numpy as np


def group_ids(n: int, groups, who: str = "groups") -> np.ndarray:
    """(n,) int64 group index per row, numbered 0..G-1.

    Args:
        n: the number of rows.
        groups: an int N: every N consecutive rows are one group (n must be a multiple of N);
            or an (n,) array of group keys (any values that compare equal within a group, e.g. user ids),
            rows of one group need not be consecutive.
        who: the name errors give.
    """
    if isinstance(groups, (int, np.integer)) and not isinstance(groups, bool):
        size = int(groups)
        if size <= 0:
            raise ValueError(f"{who}: a group size must be > 0, got {size}")
        if n % size:
            raise ValueError(
                f"{who}: {n} rows are not whole groups of {size} consecutive rows "
                f"({n // size} groups and {n % size} rows left over)"
            )
        return np.arange(n, dtype=np.int64) // size
    keys = np.asarray(groups)
    if keys.ndim == 2 and keys.shape[1] == 1:
        keys = keys[:, 0]
    if keys.shape != (n,):
        raise ValueError(f"{who}: {n} rows need {n} group keys (or a group size), got shape {keys.shape}")
    return np.unique(keys, return_inverse=True)[1].reshape(-1).astype(np.int64)


def _columns(labels, scores, who: str) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(labels, dtype=np.float64)
    s = np.asarray(scores, dtype=np.float64)
    y = y.reshape(-1) if y.ndim == 2 and y.shape[1] == 1 else y
    s = s.reshape(-1) if s.ndim == 2 and s.shape[1] == 1 else s
    if y.ndim != 1 or y.shape != s.shape:
        raise ValueError(f"{who}: labels {y.shape} and scores {s.shape} must be one column of the same length")
    if np.isnan(s).any():
        raise ValueError(f"{who}: the scores contain NaN (row {int(np.flatnonzero(np.isnan(s))[0])})")
    return y, s


def _check_k(k, who: str) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"{who}: k must be an int >= 1, got {k!r}")
    return int(k)


def _ranks(labels, scores, groups, who: str):
    """Per row of the group-wise ranking: (group (n,), 0-based rank (n,), relevant (n,) bool), and
    the positives per group (G,). Within a group rows sort by score, high first, ties negatives first."""
    y, s = _columns(labels, scores, who)
    bad = (y != 0) & (y != 1)
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{who}: labels must be 0 or 1 (relevant or not), got {y[at]} at row {at}")
    g = group_ids(y.size, groups, who)
    order = np.lexsort((y, -s, g))  # by group, then score descending, then label: ties rank the positive last
    g, rel = g[order], y[order] == 1
    first = np.r_[0, np.flatnonzero(np.diff(g)) + 1] if g.size else np.zeros(0, np.int64)
    rank = np.arange(g.size) - np.repeat(first, np.diff(np.r_[first, g.size]))
    positives = np.bincount(g, weights=rel, minlength=len(first))
    return g, rank, rel, positives


def hit_rate_at_k(labels, scores, groups, k: int = 10) -> float:
    """HitRate@K (HR@K): the share of groups with a positive among their K best-scored rows.

    With one positive per group (the NCF protocol) it is the share of users whose held-out item ranks in the
    top K of itself and its N sampled negatives. Groups without a positive are skipped (nothing to hit).

    Args:
        labels: (n,) 0/1 relevance.
        scores: (n,) predictions.
        groups: a group size, or (n,) group keys (see group_ids).
        k: the cutoff K >= 1.
    """
    k = _check_k(k, "hit_rate_at_k")
    g, rank, rel, positives = _ranks(labels, scores, groups, "hit_rate_at_k")
    hits = np.bincount(g, weights=rel & (rank < k), minlength=positives.size)
    scored = positives > 0
    return float(np.mean(hits[scored] > 0)) if scored.any() else float("nan")


def ndcg_at_k(labels, scores, groups, k: int = 10) -> float:
    """NDCG@K averaged over the groups that hold a positive.

    A group's DCG@K = sum over its positives ranked r < K (0-based) of 1 / log2(r + 2); its ideal DCG@K is the
    same sum with the positives on top. With one positive per group it is 1 / log2(rank + 2) when rank < K,
    else 0 (He et al.'s getNDCG).

    Args:
        labels: (n,) 0/1 relevance.
        scores: (n,) predictions.
        groups: a group size, or (n,) group keys (see group_ids).
        k: the cutoff K >= 1.
    """
    k = _check_k(k, "ndcg_at_k")
    g, rank, rel, positives = _ranks(labels, scores, groups, "ndcg_at_k")
    gain = np.where(rel & (rank < k), 1.0 / np.log2(rank + 2.0), 0.0)
    dcg = np.bincount(g, weights=gain, minlength=positives.size)
    # ideal[j]: DCG of j positives on top
    ideal = np.r_[0.0, np.cumsum(1.0 / np.log2(np.arange(k) + 2.0))]
    scored = positives > 0
    if not scored.any():
        return float("nan")
    best = ideal[np.minimum(positives[scored], k).astype(np.int64)]
    return float(np.mean(dcg[scored] / best))


def group_auc(labels, scores, groups) -> float:
    """Group AUC (gAUC; Zhou et al., DIN, KDD 2018): each group's ROC-AUC weighted by its row count,
    sum_g n_g AUC_g / sum_g n_g, over the groups that hold both classes (others are skipped, as FuxiCTR's
    gAUC does). AUC_g counts tied positive/negative pairs as one half (sklearn's roc_auc_score and
    numbactr.metrics.roc_auc); fractional labels weigh a row as positive y and negative 1 - y.

    Args:
        labels: (n,) labels in [0, 1].
        scores: (n,) predictions.
        groups: a group size, or (n,) group keys (see group_ids).
    """
    y, s = _columns(labels, scores, "group_auc")
    g = group_ids(y.size, groups, "group_auc")
    order = np.lexsort((s, g))  # by group, then score ascending
    g, s, y = g[order], s[order], y[order]
    neg = 1.0 - y
    n = y.size
    # a run: rows of one group with one score (a tie); its positives beat the group's negatives below it
    # and tie with the run's own negatives
    new_run = np.r_[True, (g[1:] != g[:-1]) | (s[1:] != s[:-1])] if n else np.zeros(0, bool)
    new_group = np.r_[True, g[1:] != g[:-1]] if n else np.zeros(0, bool)
    run = np.cumsum(new_run) - 1
    neg_before = np.r_[0.0, np.cumsum(neg)][:-1]  # negatives before each row, over all groups
    run_start = np.flatnonzero(new_run)
    group_start = np.flatnonzero(new_group)
    below = neg_before[run_start] - neg_before[group_start][g[run_start]]  # (runs,) group's negatives below
    pos_run = np.bincount(run, weights=y, minlength=run_start.size)
    neg_run = np.bincount(run, weights=neg, minlength=run_start.size)
    groups_n = group_start.size
    pairs = np.bincount(g[run_start], weights=pos_run * (below + 0.5 * neg_run), minlength=groups_n)
    pos = np.bincount(g, weights=y, minlength=groups_n)
    negs = np.bincount(g, weights=neg, minlength=groups_n)
    rows = np.bincount(g, minlength=groups_n).astype(np.float64)
    both = (pos > 0) & (negs > 0)
    if not both.any():
        return float("nan")
    auc = pairs[both] / (pos[both] * negs[both])
    return float(np.sum(auc * rows[both]) / np.sum(rows[both]))


def row_group_keys(sparse, slot_nums, slot: int, rows: int, who: str, to_host=np.asarray) -> np.ndarray:
    """(rows,) the key that sparse slot ``slot`` holds for each of a batch's first ``rows`` samples: the
    group (user) id ``eval_group_slot`` / ``--group-slot`` names. Slots are numbered over all sparse inputs
    in order, as a data file lays them out (input 0's slots first).

    Args:
        sparse: the batch's [(keys (N,), offsets (B * S_i + 1,)), ...] per sparse input; bag b = sample * S_i + slot.
        slot_nums: S_i of each sparse input.
        slot: the slot, 0 <= slot < sum(slot_nums).
        rows: the valid samples.
        who: the name errors give.
        to_host: copies a device array to a NumPy one.
    """
    total = int(sum(slot_nums))
    if not 0 <= slot < total:
        raise ValueError(f"{who}: slot {slot} does not exist; the data has {total} sparse slots (0..{total - 1})")
    i = 0
    while slot >= slot_nums[i]:
        slot -= slot_nums[i]
        i += 1
    keys, offsets = sparse[i]
    offsets = np.asarray(to_host(offsets), np.int64)
    bags = np.arange(rows, dtype=np.int64) * slot_nums[i] + slot
    count = offsets[bags + 1] - offsets[bags]
    if (count != 1).any():
        at = int(np.flatnonzero(count != 1)[0])
        raise ValueError(
            f"{who}: sample {at} of the batch holds {int(count[at])} keys in the group slot; it must hold "
            "one key (the group or user id) per sample"
        )
    return np.asarray(to_host(keys))[offsets[bags]]
