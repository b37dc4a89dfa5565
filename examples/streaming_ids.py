"""Online training on a click stream whose IDs keep arriving and drifting, with tables that evict (issue 42).

    python examples/streaming_ids.py                  # the recorded run (a few minutes on one core)
    python examples/streaming_ids.py --quick          # the same code at smoke size (seconds)
    python examples/streaming_ids.py --json out.json  # also write the figures (numbactr/bench/results.py)

The stream: in window w the active user IDs are ``[w * shift, w * shift + span)`` (items likewise, with their
own span and shift): each window new IDs appear at the top of the range and old ones leave at its bottom.
Within the range an ID's popularity is a heavy-tailed weight of its own (Pareto) times a bump over its life
(it rises, peaks and fades as the range slides over it). A click's label is drawn from a hidden truth, the
logistic of ``bias[user] + bias[item] + <p[user], q[item]>``, so a model that remembers the IDs it currently
sees predicts well and one that forgot them guesses. Everything is drawn from ``--seed``.

The model, through SOK's face (numbactr.sok, which needs torch): a ``sok.DynamicVariable`` of width D for
users and one for items, ``logit = <u, v> + Linear(2D -> 1)([u, v])``, Adagrad (the tables by the engine's
fused Adagrad through ``sok.OptimizerWrapper``, the linear head by torch). Progressive validation: each
window is first predicted (its AUC, before the model saw it), then trained on, batch by batch.

The runs: ``unbounded`` (``var_type="hbm"``, a fixed table with room for every key of the stream) and
``var_type="hybrid"`` tables evicting at 10%, 25% and 50% of each table's distinct keys (rounded down to
whole buckets as HierarchicalKV does) under kLru, kLfu, kEpochLru and kEpochLfu (the window number is the
epoch: ``set_global_epoch``). As in SOK, every lookup inserts, the validation lookups too (a key first seen
in validation reads its initial row and takes a slot), and a lookup refreshes a key's score.
Memory is the bytes of the rows and the Adagrad state the tables hold (slots, used or not; the index's keys
and scores come on top); keys/s counts the keys the training lookups read per second of training.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from numbactr.bench import results
from numbactr.bench.common import Table
from numbactr.metrics.pointwise import roc_auc
from numbactr.runtime import device, threads

# (span, shift) of users and items per window, windows, events per window, batch, width D
SIZES = {
    "full": dict(users=(6000, 1500), items=(3000, 750), windows=24, events=50_000, batch=1000, dim=8),
    "quick": dict(users=(600, 150), items=(300, 75), windows=8, events=2_000, batch=250, dim=4),
}
FRACTIONS = (0.10, 0.25, 0.50)
STRATEGIES = ("kLru", "kLfu", "kEpochLru", "kEpochLfu")


def click_stream(users, items, windows: int, events: int, seed: int = 0) -> list:
    """The stream as one (users, items, labels, true logits) of arrays per window (module docstring)."""
    rng = np.random.default_rng(seed)
    side = {}
    for name, (span, shift) in (("u", users), ("i", items)):
        n = span + (windows - 1) * shift
        side[name] = dict(
            span=span,
            shift=shift,
            weight=rng.pareto(1.2, n) + 0.05,  # heavy-tailed popularity of each ID
            bias=rng.normal(0.0, 1.0, n),
            vec=rng.normal(0.0, 0.7, (n, 4)),
        )
    out = []
    for w in range(windows):
        ids = []
        for s in side.values():
            lo = w * s["shift"]
            bump = np.sin(np.pi * (np.arange(s["span"]) + 0.5) / s["span"])  # rises, peaks, fades over its life
            p = s["weight"][lo : lo + s["span"]] * bump
            ids.append(lo + rng.choice(s["span"], events, p=p / p.sum()))
        u, i = ids
        logit = side["u"]["bias"][u] + side["i"]["bias"][i] + (side["u"]["vec"][u] * side["i"]["vec"][i]).sum(1)
        labels = (rng.random(events) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        out.append((u.astype(np.int64), i.astype(np.int64), labels, logit))
    return out


def make_model(sok, torch, dim: int, capacity: dict, strategy: str | None):
    """The two tables and the head; capacity: keys per table (strategy None: fixed 'hbm' tables)."""

    class ClickModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tables = torch.nn.ModuleList([self.table(n, capacity[n]) for n in ("users", "items")])
            self.head = torch.nn.Linear(2 * dim, 1)

        def table(self, name: str, cap: int):
            if strategy is None:
                return sok.DynamicVariable(dim, (-0.05, 0.05), "hbm", name, max_capacity=cap)
            # a hybrid table starts small and doubles as keys come, up to max_capacity, then evicts
            return sok.DynamicVariable(
                dim,
                (-0.05, 0.05),
                "hybrid",
                name,
                init_capacity=min(cap, 1024),
                max_capacity=cap,
                evict_strategy=strategy,
            )

        def forward(self, u, i):
            eu, ei = sok.lookup_sparse(list(self.tables), [u.reshape(-1, 1), i.reshape(-1, 1)], combiners=["sum"] * 2)
            return (eu * ei).sum(1) + self.head(torch.cat([eu, ei], 1)).squeeze(1)

    return ClickModel()


def table_bytes(var) -> int:
    """Bytes of a table's rows and optimizer state on this rank (every slot the engine holds)."""
    eng = var.table.engine
    return int(eng.split_weights()[0].nbytes + sum(v.nbytes for v in eng.split_optimizer_states()[0]))


def run(stream, capacity: dict, strategy, dim: int, batch: int, lr: float, seed: int) -> dict:
    """Train one model on the stream with progressive validation; the per-window figures."""
    import torch

    import numbactr.sok as sok

    sok.init(seed=seed)
    torch.manual_seed(seed)
    model = make_model(sok, torch, dim, capacity, strategy)
    opt = sok.OptimizerWrapper(torch.optim.Adagrad(model.parameters(), lr=lr, initial_accumulator_value=0.1))
    bce = torch.nn.BCEWithLogitsLoss()
    got = dict(auc=[], keys=[], bytes=[], capacity=[])
    keys_read, seconds = 0, 0.0
    for w, (u, i, y, _) in enumerate(stream):
        if strategy is not None and strategy.startswith("kEpoch"):
            for t in model.tables:
                t.table.index.set_global_epoch(w)
        u, i, y = torch.from_numpy(u), torch.from_numpy(i), torch.from_numpy(y)
        with torch.no_grad():
            scores = torch.cat([model(u[b : b + batch], i[b : b + batch]) for b in range(0, len(y), batch)])
        got["auc"].append(roc_auc(y.numpy(), scores.numpy()))
        t0 = time.perf_counter()
        for b in range(0, len(y), batch):
            opt.zero_grad()
            bce(model(u[b : b + batch], i[b : b + batch]), y[b : b + batch]).backward()
            opt.step()
        seconds += time.perf_counter() - t0
        keys_read += 2 * len(y)
        got["keys"].append([t.size for t in model.tables])
        got["bytes"].append(sum(table_bytes(t) for t in model.tables))
    got["keys/s"] = keys_read / seconds
    got["held"] = [t.table.index.max_capacity() if strategy else t.table.capacity for t in model.tables]
    return got


def bucketed(n: int) -> int:
    """The smallest whole-bucket capacity (128 * 2**k, HierarchicalKV's rounding) holding n keys."""
    return 128 << max(0, -(-n // 128) - 1).bit_length()


def to_results(tables, measured) -> list:
    """numbactr/bench/results.py's result rows of bench Tables (as its from_table, with this example's
    measured columns: AUC, keys and MB are not among the bench commands' MEASURED)."""
    out = []
    for table in tables:
        for cells in table.raw:
            row = dict(zip(table.columns, cells))
            params = {k: v for k, v in row.items() if k not in measured}
            out += [
                dict(name=table.title, implementation="numbactr", metric=m, value=float(row[m]), **params)
                for m in measured
                if m in row
            ]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke size (seconds); its figures say nothing")
    ap.add_argument("--json", default=None, help="write the figures to this file (numbactr/bench/results.py)")
    ap.add_argument("--threads", type=int, default=1, help="numbactr's and torch's compute threads (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the stream and the models (default 0)")
    ap.add_argument("--lr", type=float, default=1.0, help="Adagrad learning rate (default %(default)s)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="evict strategies (comma-separated)")
    args = ap.parse_args(argv)
    size = SIZES["quick" if args.quick else "full"]
    device.set_device("cpu")
    threads.configure(args.threads)
    stream = click_stream(size["users"], size["items"], size["windows"], size["events"], args.seed)
    distinct = {n: len(np.unique(np.concatenate([s[k] for s in stream]))) for k, n in enumerate(("users", "items"))}
    total, half = sum(distinct.values()), size["windows"] // 2
    oracle = float(np.mean([roc_auc(s[2], s[3]) for s in stream[half:]]))
    print(
        f"{size['windows']} windows x {size['events']:,} clicks: {distinct['users']:,} distinct users, "
        f"{distinct['items']:,} distinct items; D={size['dim']}, batch {size['batch']}, {args.threads} thread(s); "
        f"the hidden truth's AUC (last half) {oracle:.3f}"
    )
    plans = [("unbounded", None, "all", distinct)]
    plans += [("unbounded hybrid", "kLru", "all", {k: bucketed(v) for k, v in distinct.items()})]
    plans += [
        (f"{s} {f:.0%}", s, f"{f:.0%}", {k: int(f * v) for k, v in distinct.items()})
        for f in FRACTIONS
        for s in args.strategies.split(",")
        if s
    ]
    summary = Table(
        "streaming IDs: summary",
        ["run", "strategy", "capacity", "% of keys", "AUC (last half)", "final keys", "MB", "Mkeys/s"],
        notes=[
            f"{size['windows'] * size['events']:,} clicks in {size['windows']} windows; {distinct['users']:,} + "
            f"{distinct['items']:,} distinct user + item keys; AUC of each window before training on it "
            f"(progressive validation), the mean over the last {size['windows'] - half}; the hidden truth's: {oracle:.3f}",
            "MB: rows + Adagrad state of both tables at the end; Mkeys/s: keys the training lookups read per second",
            f"cpu device, {args.threads} thread(s), on a shared, noisy 2-core machine: Mkeys/s are rough",
        ],
    )
    per_window = Table("streaming IDs: per window", ["run", "strategy", "fraction", "window", "AUC", "keys", "MB"])
    for strategy in (None, "kLru"):  # compile the tables' code before any timing
        run([tuple(a[:500] for a in stream[0])], {"users": 1024, "items": 1024}, strategy, size["dim"], 250, 0.1, 0)
    for label, strategy, frac, cap in plans:
        got = run(stream, cap, strategy, size["dim"], size["batch"], args.lr, args.seed)
        over = [k for k in got["keys"] if any(a > b for a, b in zip(k, got["held"]))]
        if over:
            sys.exit(f"{label}: the tables held {over[0]} keys, more than their capacity {got['held']}")
        held = sum(got["held"])
        summary.add(
            label,
            strategy or "none (hbm)",
            held,
            100.0 * held / total,
            float(np.mean(got["auc"][half:])),
            sum(got["keys"][-1]),
            got["bytes"][-1] / 2**20,
            got["keys/s"] / 1e6,
        )
        for w, (auc, keys, nbytes) in enumerate(zip(got["auc"], got["keys"], got["bytes"])):
            per_window.add(label, strategy or "none (hbm)", frac, w, auc, sum(keys), nbytes / 2**20)
        print(f"{label:>16}: AUC per window {' '.join(f'{a:.3f}' for a in got['auc'])}", flush=True)
        print(f"{'':>16}  keys held {' '.join(str(sum(k)) for k in got['keys'])}", flush=True)
    print()
    print(summary.markdown())
    if args.json:
        rows = to_results([summary, per_window], ("AUC (last half)", "final keys", "MB", "Mkeys/s", "AUC", "keys"))
        command = ["python", "examples/streaming_ids.py", *(sys.argv[1:] if argv is None else argv)]
        doc = results.document(rows, command=command, notes="\n".join(summary.notes), peers=["torch"])
        print(f"results written to {results.write(args.json, doc)}")
    return {"summary": summary, "per_window": per_window, "distinct": distinct, "oracle": oracle}


if __name__ == "__main__":
    main()
