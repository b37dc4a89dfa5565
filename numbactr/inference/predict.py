"""``numbactr predict``: predict every sample of a data set with a trained model and write the predictions.

    numbactr predict GRAPH.json --dense MODEL_dense_N.model [--sparse MODEL0_sparse_N.model ...] \\
        --source eval/_file_list.txt --format norm --output preds.csv

The model is read as HugeCTR's inference reads it (numbactr.inference.InferenceSession: the graph JSON,
the dense and sparse model files, the BatchNorm .ntp.json beside the dense file); the source is a file list,
or a Parquet folder (its _file_list.txt, else its *.parquet files in name order). Every sample is predicted
once, in file order (the last batch may be partial). The output is CSV (one row per sample, a column per
prediction: ``prediction``, or ``<label>`` / ``<label>_<k>`` per loss layer) or Parquet (by the extension
.parquet), written to a temporary name and renamed when complete.

With ``--metrics auc,logloss,gauc,hr@10,ndcg@10`` it also scores the predictions against the source's labels
and prints one ``NAME: VALUE`` line per metric, by the names Model.get_eval_metrics() gives (AUC, LogLoss,
GroupAUC, HitRate@10, NDCG@10; numbactr.metrics); ``--metrics-json PATH`` writes them as a JSON object.
gauc, hr@K and ndcg@K score groups of samples (users): ``--group-size N`` (every N consecutive samples, e.g.
a held-out positive and its N - 1 sampled negatives) or ``--group-slot S`` (the key of sparse slot S, over
the sparse inputs in order, is the sample's group).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import tempfile

import numpy as np

from numbactr.enums import MetricsType
from numbactr.metrics import GROUPED, column_metric, metric_name
from numbactr.runtime import atomic

FORMATS = {"norm": "Norm", "raw": "Raw", "parquet": "Parquet"}
#: --metrics words: the plain ones, and those written NAME@K
PLAIN = {"auc": MetricsType.AUC, "logloss": MetricsType.LogLoss, "gauc": MetricsType.GroupAUC}
AT_K = {"hr": MetricsType.HitRateAtK, "ndcg": MetricsType.NDCGAtK}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("graph", help="the model's graph JSON (Model.graph_to_json)")
    ap.add_argument("--dense", required=True, metavar="FILE", help="the dense model file ({prefix}_dense_{iter}.model)")
    ap.add_argument(
        "--sparse",
        nargs="*",
        default=None,
        metavar="FOLDER",
        help="the sparse model folders, one per embedding in graph order ({prefix}{i}_sparse_{iter}.model; "
        "default: the ones beside the dense model)",
    )
    ap.add_argument("--source", required=True, metavar="PATH", help="a file list, or a folder of Parquet files")
    ap.add_argument("--format", choices=sorted(FORMATS), default="norm", help="the data format (default: %(default)s)")
    ap.add_argument(
        "--check",
        choices=("sum", "none"),
        default="sum",
        help="Norm/Raw checksum (HugeCTR's Check_t; default: %(default)s)",
    )
    ap.add_argument(
        "--slot-size-array",
        default="",
        metavar="N,N,...",
        help="Parquet: the slot sizes whose running sums offset each slot's keys (as in training)",
    )
    ap.add_argument("--output", required=True, metavar="FILE", help="predictions: .csv, or .parquet")
    ap.add_argument(
        "--batch-size", type=int, default=1024, metavar="B", help="samples per batch (default: %(default)s)"
    )
    ap.add_argument(
        "--metrics",
        default="",
        metavar="M,M,...",
        help="score the predictions against the source's labels: auc, logloss, gauc, hr@K, ndcg@K",
    )
    ap.add_argument(
        "--group-size", type=int, default=0, metavar="N", help="gauc/hr/ndcg: N consecutive samples a group"
    )
    ap.add_argument(
        "--group-slot", type=int, default=None, metavar="S", help="gauc/hr/ndcg: the sparse slot whose key is the group"
    )
    ap.add_argument("--metrics-json", default="", metavar="PATH", help="write the metrics as a JSON object")
    ap.add_argument("--i32-keys", action="store_true", help="the model's keys are 32-bit (i64_input_key=False)")
    ap.add_argument(
        "--cache-size-percentage",
        type=float,
        default=1.0,
        metavar="P",
        help="the embedding cache's share of each table (default: %(default)s)",
    )


def _source(path: str, fmt: str) -> str:
    """A file list for the reader: the path itself, or a Parquet folder's list."""
    if not os.path.isdir(path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--source {path!r} does not exist")
        return path
    listed = os.path.join(path, "_file_list.txt")
    if os.path.isfile(listed):
        return listed
    if fmt != "parquet":
        raise ValueError(f"--source {path!r} is a folder without _file_list.txt; give a file list for --format {fmt}")
    files = sorted(glob.glob(os.path.join(path, "*.parquet")))
    if not files:
        raise FileNotFoundError(f"--source {path!r} holds no _file_list.txt and no *.parquet file")
    from numbactr.data.file_list import write_file_list

    fd, lst = tempfile.mkstemp(prefix="numbactr-predict-", suffix=".txt")
    os.close(fd)
    write_file_list(lst, [os.path.abspath(f) for f in files])
    return lst


def parse_metrics(text: str) -> list[tuple]:
    """``--metrics`` as [(MetricsType member, K)]: e.g. "auc,hr@10" -> [(AUC, 10), (HitRateAtK, 10)]."""
    out = []
    for word in (w.strip().lower() for w in text.split(",") if w.strip()):
        name, _, k = word.partition("@")
        if name in PLAIN and not k:
            out.append((PLAIN[name], 10))
        elif name in AT_K and k.isdigit() and int(k) > 0:
            out.append((AT_K[name], int(k)))
        elif name in AT_K:
            raise ValueError(f"--metrics: {word!r} needs a cutoff K >= 1, as {name}@10")
        else:
            known = ", ".join(list(PLAIN) + [f"{n}@K" for n in AT_K])
            raise ValueError(f"--metrics: unknown metric {word!r} (known: {known})")
    return out


def _check_metric_args(args, metrics: list) -> None:
    """--metrics, --group-size, --group-slot and --metrics-json fit together (before any prediction)."""
    grouped = [metric_name(m, k) for m, k in metrics if m in GROUPED]
    if args.group_size < 0:
        raise ValueError(f"--group-size must be > 0, got {args.group_size}")
    if args.group_slot is not None and args.group_slot < 0:
        raise ValueError(f"--group-slot must be >= 0, got {args.group_slot}")
    if args.group_size and args.group_slot is not None:
        raise ValueError("give --group-size or --group-slot, not both")
    if grouped and not args.group_size and args.group_slot is None:
        raise ValueError(
            f"--metrics {', '.join(grouped)} score groups of samples (users): give "
            "--group-size N (every N consecutive samples) or --group-slot S (the key of sparse slot S)"
        )
    if args.metrics_json and not metrics:
        raise ValueError("--metrics-json needs --metrics")


def score(metrics: list, labels: np.ndarray, preds: np.ndarray, groups) -> dict:
    """{name: value} of [(MetricsType, K)] for preds against labels ((n, C) each; numbactr.metrics)."""
    return {metric_name(m, k): column_metric(m, labels, preds, groups, k) for m, k in metrics}


def run(args) -> int:
    import numbactr as hugectr
    from numbactr.files import checkpoint
    from numbactr.runtime import device
    from numbactr import log
    from numbactr.inference.params import InferenceParams
    from numbactr.inference.session import InferenceSession

    if args.batch_size <= 0:
        raise ValueError(f"--batch-size must be > 0, got {args.batch_size}")
    out_ext = os.path.splitext(args.output)[1].lower()
    if out_ext not in (".csv", ".parquet"):
        raise ValueError(f"--output {args.output!r}: the extension must be .csv or .parquet")
    slots = [int(x) for x in args.slot_size_array.split(",") if x.strip()] if args.slot_size_array else []
    metrics = parse_metrics(args.metrics)
    _check_metric_args(args, metrics)
    device.kind()
    source = _source(args.source, args.format)
    params = InferenceParams(
        model_name="predict",
        max_batchsize=args.batch_size,
        hit_rate_threshold=1.0,
        dense_model_file=args.dense,
        sparse_model_files=(
            list(args.sparse)
            if args.sparse is not None
            else checkpoint.sparse_models_beside(args.graph, args.dense, "predict")
        ),
        use_gpu_embedding_cache=True,
        cache_size_percentage=args.cache_size_percentage,
        i64_input_key=not args.i32_keys,
    )
    session = InferenceSession(args.graph, params)
    group_slot = args.group_slot if any(m in GROUPED for m, _ in metrics) else None
    try:
        inp = session.graph.input
        if metrics and inp.label_dim == 0:
            raise ValueError(f"--metrics: the model {args.graph!r} reads no labels, so there is nothing to score")
        total = sum(sp.slot_num for sp in inp.sparse)
        if group_slot is not None and group_slot >= total:
            raise ValueError(f"--group-slot {group_slot}: the model's data has {total} sparse slots (0..{total - 1})")
        preds, (p, y), keys = session.score_source(
            source,
            getattr(hugectr.DataReaderType_t, FORMATS[args.format]),
            hugectr.Check_t.Sum if args.check == "sum" else hugectr.Check_t.Non,
            slots,
            group_slot,
        )
    finally:
        session.close()
    columns = session.prediction_names()
    with atomic.atomic_path(args.output, tmp=args.output + ".partial") as tmp:
        if out_ext == ".csv":
            np.savetxt(tmp, preds, delimiter=",", header=",".join(columns), comments="", fmt="%.9g")
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({c: preds[:, i] for i, c in enumerate(columns)}), tmp)
    log.info(f"predict: {preds.shape[0]:,} samples -> {args.output} ({', '.join(columns)})")
    if metrics:
        try:
            values = score(metrics, y, p, args.group_size or keys)
        except ValueError as e:
            raise ValueError(f"{e} (the predictions are written to {args.output})") from None
        for name, value in values.items():
            print(f"{name}: {value:.6f}")
        if args.metrics_json:
            with atomic.atomic_path(args.metrics_json, tmp=args.metrics_json + ".partial") as tmp:
                with open(tmp, "w") as f:  # nan (no group to score) as null: JSON has no NaN
                    json.dump({n: None if math.isnan(v) else v for n, v in values.items()}, f, indent=1)
    return 0
