"""Taobao user behaviour (Tianchi's UserBehavior.csv) -> behaviour sequences for DIN / BST, laid out as
HugeCTR's DIN sample reads them.

    numbactr data taobao UserBehavior.csv out/ --max-len 10

Input: no header; one behaviour per line, ``user,item,category,behavior,timestamp`` with behavior one
of pv (click), buy, cart, fav. Blank lines are skipped; an exact duplicate line is dropped (counted).
Sequences: each user's behaviours of the kinds in ``behaviors`` (clicks, ``pv``) in time order (ties:
file order). Users with fewer than ``min_clicks`` (3) are dropped. A sample is a target position p of a
user's sequence: the history is the up to ``max_len`` behaviours before p (the most recent ones, oldest
first, padded at the end with id 0), the target the item at p (label 1), and beside it a sample with
the same history and a negative target (label 0): an item drawn uniformly from all items, never one
the user had a behaviour with, with its category. Eval: each user's last behaviour; train: the one
before it (``train_targets="last"``, HugeCTR's DIN preprocessing) or every position with a history
(``"all"``), shuffled unless ``shuffle=False``. Eval rows come in pairs: the positive, then its negative.
Ids: users 0..U-1, items 1..I, categories 1..C in ascending order of the original ids (0 = padding);
an item's category is the one on its first line.
Slots (HugeCTR samples/din: inputs UserID 1 slot, GoodID max_len + 1 slots, CateID max_len + 1 slots;
``FusedReshapeConcat`` splits each group into its history and its target, the last slot):
  0                 user
  1 .. L            item history, oldest first (L = max_len), then slot L + 1 the target item
  L + 2 .. 2L + 1   category history, then slot 2L + 2 the target's category
slot_size_array (Norm, Parquet) = [U, 0 x L, I + 1, 0 x L, C + 1] as in HugeCTR's din_parquet.py: the
slots of a group share one key space (an item has one embedding whether in the history or the target).
Raw (one-hot, every slot its own range): [U, (I + 1) x (L + 1), (C + 1) x (L + 1)].
HugeCTR: samples/din/utils/3_padding.py, samples/din/din_parquet.py. DIN: Zhou et al., KDD 2018.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

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

__all__ = ["BEHAVIORS", "convert_taobao", "main"]

WHAT = "Taobao UserBehavior"
BEHAVIORS = ("pv", "buy", "cart", "fav")


def _read(path, chunk_size, encoding):
    parts = {k: [] for k in ("user", "item", "cat", "beh", "ts")}
    for lines, nums in read_blocks(path, WHAT, chunk_size, encoding):
        rows = split_fields(lines, nums, ",", 5, path, WHAT, "user,item,category,behavior,timestamp")
        u, i, c, b, t = zip(*rows)
        for k, v in (("user", u), ("item", i), ("cat", c), ("ts", t)):
            parts[k].append(to_numbers(v, nums, path, WHAT, {"cat": "category", "ts": "timestamp"}.get(k, k)))
        beh = np.asarray(b)
        bad = ~np.isin(beh, BEHAVIORS)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(
                f"{WHAT} file {path!r}, line {nums[j]}: behavior {str(beh[j])!r} is not one of {BEHAVIORS}"
            )
        parts["beh"].append(np.searchsorted(np.asarray(sorted(BEHAVIORS)), beh).astype(np.int8))
    if not parts["user"]:
        raise ValueError(f"{WHAT} file {path!r} has no records")
    return {k: np.concatenate(v) for k, v in parts.items()}


def convert_taobao(
    source: str,
    out_dir: str,
    fmt: str = "parquet",
    max_len: int = 10,
    behaviors=("pv",),
    min_clicks: int = 3,
    train_targets: str = "last",
    shuffle: bool = True,
    seed: int = 0,
    samples_per_file: int = 1_000_000,
    i64_keys: bool = True,
    check=Check_t.Sum,
    chunk_size: int = 500_000,
    encoding: str = "utf-8",
    verbose: bool = True,
):
    """Convert UserBehavior.csv; see the module docstring. Returns a ConversionResult whose extra names
    the three inputs (UserID, GoodID, CateID) and the history length."""
    if max_len < 1 or min_clicks < 3 or train_targets not in ("last", "all"):
        raise ValueError("max_len must be >= 1, min_clicks >= 3 and train_targets 'last' or 'all'")
    bad = [b for b in behaviors if b not in BEHAVIORS]
    if bad or not behaviors:
        raise ValueError(f"behaviors must be some of {BEHAVIORS}, got {list(behaviors)}")
    rng = np.random.default_rng(seed)
    r = _read(source, chunk_size, encoding)
    n_read, dropped = len(r["user"]), {}
    # exact duplicate lines
    key = np.stack([r["user"], r["item"], r["cat"], r["beh"].astype(np.int64), r["ts"]], axis=1)
    _, first = np.unique(key, axis=0, return_index=True)
    keep = np.sort(first)
    if len(keep) < n_read:
        dropped["duplicate line"] = int(n_read - len(keep))
    r = {k: v[keep] for k, v in r.items()}
    codes = np.searchsorted(np.asarray(sorted(BEHAVIORS)), list(behaviors))
    use = np.isin(r["beh"], codes)
    if (~use).any():
        dropped[f"behavior not in {list(behaviors)}"] = int((~use).sum())
    r = {k: v[use] for k, v in r.items()}
    users, n_clicks = np.unique(r["user"], return_counts=True)
    kept = users[n_clicks >= min_clicks]
    ok = np.isin(r["user"], kept)
    if (~ok).any():
        dropped[f"user with fewer than {min_clicks} behaviours"] = int((~ok).sum())
    items_all, first_line = np.unique(r["item"], return_index=True)  # every item can be a negative
    cat_of_all = r["cat"][first_line]
    r = {k: v[ok] for k, v in r.items()}
    if len(kept) == 0:
        raise ValueError(f"{WHAT}: no user has {min_clicks} or more behaviours")
    cats = np.unique(cat_of_all)
    U, n_items, n_cats = len(kept), len(items_all), len(cats)
    uid = np.searchsorted(kept, r["user"])
    iid = np.searchsorted(items_all, r["item"]) + 1  # 0 = padding
    item_cat = np.concatenate([[0], np.searchsorted(cats, cat_of_all) + 1])  # (I + 1,) category id of item id
    order = np.lexsort((np.arange(len(uid)), r["ts"], uid))
    uid, iid = uid[order], iid[order]
    starts = np.searchsorted(uid, np.arange(U + 1))
    seen = np.unique(uid * (n_items + 1) + iid)

    def samples(user, pos):
        """(2m,) rows: each target's positive then its negative. user, pos: (m,) target user, position."""
        s = starts[user]
        hlen = np.minimum(pos, max_len)
        j = np.arange(max_len)
        idx = (s + pos - hlen)[:, None] + j  # (m, L)
        hist = np.where(j < hlen[:, None], iid[np.minimum(idx, len(iid) - 1)], 0)
        tgt = iid[s + pos]
        neg = rng.integers(1, n_items + 1, size=len(user))
        bad = np.isin(user * (n_items + 1) + neg, seen)
        while bad.any():
            neg[bad] = rng.integers(1, n_items + 1, size=int(bad.sum()))
            bad[bad] = np.isin(user[bad] * (n_items + 1) + neg[bad], seen)
        both = np.stack([tgt, neg], axis=1).reshape(-1)  # (2m,)
        hist2 = np.repeat(hist, 2, axis=0)
        ids = np.concatenate(
            [np.repeat(user, 2)[:, None], hist2, both[:, None], item_cat[hist2], item_cat[both][:, None]], 1
        )
        label = np.tile(np.float32([1, 0]), len(user))
        return label, ids

    per = np.diff(starts)
    if (per >= n_items).any():
        raise ValueError(f"{WHAT}: user {int(np.argmax(per >= n_items))} had a behaviour with every item")
    users_ = np.arange(U)
    e_label, e_ids = samples(users_, per - 1)
    if train_targets == "last":
        t_user, t_pos = users_, per - 2
    else:
        t_user = np.repeat(users_, per - 2)
        t_pos = np.arange(len(t_user)) - np.repeat(np.cumsum(per - 2) - (per - 2), per - 2) + 1
    t_label, t_ids = samples(t_user, t_pos)
    if shuffle:
        p = rng.permutation(len(t_label))
        t_label, t_ids = t_label[p], t_ids[p]

    L = max_len
    names = ["user"] + [f"item_{j}" for j in range(L)] + ["item_target"]
    names += [f"category_{j}" for j in range(L)] + ["category_target"]
    if fmt == "raw":
        sizes = [U] + [n_items + 1] * (L + 1) + [n_cats + 1] * (L + 1)
    else:
        sizes = [U] + [0] * L + [n_items + 1] + [0] * L + [n_cats + 1]
    splits = make_splits(out_dir, fmt, ["label"], [], names, sizes, samples_per_file, i64_keys, check)
    for name, lab, ids in (("train", t_label, t_ids), ("eval", e_label, e_ids)):
        for a in range(0, len(lab), 1_000_000):
            splits[name].write(lab[a : a + 1_000_000], None, ids[a : a + 1_000_000])
    return finish(
        splits,
        out_dir,
        verbose,
        converter="taobao",
        inputs=[os.path.abspath(source)],
        label_dim=1,
        dense_dim=0,
        slot_num=len(names),
        slot_names=names,
        slot_size_array=sizes,
        max_nnz_per_slot=[1] * len(names),
        label="1 = the user's next behaviour was with the target item, 0 = a sampled item the user never touched",
        i64_input_key=i64_keys,
        rows_read=n_read,
        dropped=dropped,
        split="eval: each user's last behaviour; train: "
        + ("the one before it" if train_targets == "last" else "every earlier position with a history"),
        seed=seed,
        extra={
            "inputs": [
                {"name": "UserID", "slots": 1},
                {"name": "GoodID", "slots": L + 1},
                {"name": "CateID", "slots": L + 1},
            ],
            "history_length": L,
            "target_slot_in_group": L,
            "padding_id": 0,
            "eval_group_size": 2,
            "num_users": U,
            "num_items": n_items,
            "num_categories": n_cats,
            "behaviors": list(behaviors),
            "train_targets": train_targets,
            "train_shuffled": shuffle,
        },
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="numbactr data taobao",
        description="Taobao UserBehavior.csv -> behaviour sequences for DIN/BST (HugeCTR's DIN sample layout).",
    )
    ap.add_argument("input", help="UserBehavior.csv: user,item,category,behavior,timestamp")
    ap.add_argument("out_dir", help="output folder: OUT/train, OUT/eval, slot_size_array.json, conversion.json")
    ap.add_argument("--max-len", type=int, default=10, help="history length (HugeCTR's DIN: 10)")
    ap.add_argument("--behaviors", default="pv", help="comma-separated behaviours that form the sequences (pv)")
    ap.add_argument("--min-clicks", type=int, default=3, help="drop users with fewer behaviours (3)")
    ap.add_argument("--train-targets", choices=["last", "all"], default="last", help="training targets per user")
    ap.add_argument("--no-shuffle", action="store_true", help="keep the training rows in user order")
    ap.add_argument("--encoding", default="utf-8", help="text encoding of the input (default utf-8)")
    add_common_args(ap)
    a = ap.parse_args(argv)
    return run_main(
        ap.prog,
        convert_taobao,
        a.input,
        a.out_dir,
        max_len=a.max_len,
        behaviors=tuple(a.behaviors.split(",")),
        min_clicks=a.min_clicks,
        train_targets=a.train_targets,
        shuffle=not a.no_shuffle,
        encoding=a.encoding,
        **common_kwargs(a),
    )


if __name__ == "__main__":
    sys.exit(main())
