"""``numbactr predict``: predict every sample of a data set with a trained model and write the predictions.

    numbactr predict GRAPH.json --dense MODEL_dense_N.model [--sparse MODEL0_sparse_N.model ...] \\
        --source eval/_file_list.txt --format norm --output preds.csv

The model is read as HugeCTR's inference reads it (numbactr.inference.InferenceSession: the graph JSON,
the dense and sparse model files, the BatchNorm .ntp.json beside the dense file); the source is a file list,
or a Parquet folder (its _file_list.txt, else its *.parquet files in name order). Every sample is predicted
once, in file order (the last batch may be partial). The output is CSV (one row per sample, a column per
prediction: ``prediction``, or ``<label>`` / ``<label>_<k>`` per loss layer) or Parquet (by the extension
.parquet), written to a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile

import numpy as np

from numbactr.runtime import atomic

FORMATS = {"norm": "Norm", "raw": "Raw", "parquet": "Parquet"}


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
    try:
        preds = session.predict_source(
            source,
            getattr(hugectr.DataReaderType_t, FORMATS[args.format]),
            hugectr.Check_t.Sum if args.check == "sum" else hugectr.Check_t.Non,
            slots,
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
    return 0
