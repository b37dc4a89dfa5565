"""``numbactr bench inference``: serving throughput and latency of InferenceSession, and the embedding
cache's hit rate against its size, beside onnxruntime running the same model exported to ONNX.

    numbactr bench inference [--quick] [--min-time S] [--batches 1,64,1024] [--threads N] [--no-onnx] [--json PATH]

The model is a DLRM (13 dense features; 26 one-hot slots of one table, 16-wide vectors; bottom MLP 13-64-16,
dot interaction, top MLP 128-64-1) with random weights saved in HugeCTR's files, its table holding
26 x 10,000 keys (--quick: 26 x 500); requests draw each slot's key from a power law (Zipf, exponent 1.1)
over its keys. Each request is HugeCTR's CSR request (dense_feature, embeddingcolumns, row_ptrs) as numpy
arrays, answered by InferenceSession.predict (embedding cache on, 100% of the table, filled at start with init_ec) and by
onnxruntime's session over the exported model (numbactr.onnx_converter, when present) with the same number
of intra-op threads as numbactr's compute threads, the two called alternately with the same requests (so
both see the same machine). Latency is one request's wall time (p50, p99 over the repetitions);
predictions/s is samples over the total time.

The second table is the cache: a fresh session per cache_size_percentage, warmed by --warm requests of 1024
samples, then the share of the distinct keys of the next requests found in the cache, and the throughput
at that size (HugeCTR counts its hit rate over a request's distinct keys, as here).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from numbactr.runtime import device, threads
from numbactr import log
from numbactr.bench.common import Table

FULL = dict(
    batches=(1, 16, 256, 1024, 4096, 16384),
    keys=10_000,
    sizes=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0),
    warm=8,
    measure=8,
    min_time=1.0,
)
QUICK = dict(batches=(1, 64, 512), keys=500, sizes=(0.05, 0.5), warm=2, measure=2, min_time=0.05)
SLOTS, DENSE, VEC, ZIPF = 26, 13, 16, 1.1


def build_model(folder: str, keys_per_slot: int, seed: int = 0) -> dict:
    """Write the benchmark DLRM's graph JSON, dense model and sparse model folder; returns their paths."""
    import numbactr as hugectr
    from numbactr.config import workspace_mb_for

    L = hugectr.Layer_t
    n_keys = SLOTS * keys_per_slot
    solver = hugectr.CreateSolver(batchsize=1024, batchsize_eval=1024, vvgpu=[[0]], i64_input_key=True, seed=seed)
    lst = os.path.join(folder, "unused_file_list.txt")
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[lst], eval_source=lst, check_type=hugectr.Check_t.Sum
    )
    opt = hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.SGD)
    m = hugectr.Model(solver, reader, opt)
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=DENSE,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, SLOTS)],
        )
    )
    m.add(
        hugectr.SparseEmbedding(
            hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
            workspace_mb_for(n_keys, VEC, 0),
            VEC,
            "sum",
            "sparse_embedding1",
            "data1",
        )
    )
    for layer in [
        hugectr.DenseLayer(L.InnerProduct, ["dense"], ["fc1"], num_output=64),
        hugectr.DenseLayer(L.ReLU, ["fc1"], ["relu1"]),
        hugectr.DenseLayer(L.InnerProduct, ["relu1"], ["fc2"], num_output=VEC),
        hugectr.DenseLayer(L.ReLU, ["fc2"], ["relu2"]),
        hugectr.DenseLayer(L.Interaction, ["relu2", "sparse_embedding1"], ["inter"]),
        hugectr.DenseLayer(L.InnerProduct, ["inter"], ["fc3"], num_output=128),
        hugectr.DenseLayer(L.ReLU, ["fc3"], ["relu3"]),
        hugectr.DenseLayer(L.InnerProduct, ["relu3"], ["fc4"], num_output=64),
        hugectr.DenseLayer(L.ReLU, ["fc4"], ["relu4"]),
        hugectr.DenseLayer(L.InnerProduct, ["relu4"], ["fc5"], num_output=1),
        hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc5", "label"], ["loss"]),
    ]:
        m.add(layer)
    m.compile()
    prefix = os.path.join(folder, "dlrm")
    m.save_params_to_files(prefix, 0)  # the dense model (the table is written below)
    m.graph_to_json(os.path.join(folder, "dlrm.json"))
    sparse = os.path.join(folder, "table", "dlrm0_sparse_0.model")  # HugeCTR's layout, no manifest
    os.makedirs(sparse)
    rng = np.random.default_rng(seed)
    np.arange(n_keys, dtype="<i8").tofile(os.path.join(sparse, "key"))
    rng.uniform(-0.05, 0.05, (n_keys, VEC)).astype("<f4").tofile(os.path.join(sparse, "emb_vector"))
    return dict(graph=os.path.join(folder, "dlrm.json"), dense=f"{prefix}_dense_0.model", sparse=[sparse])


def make_requests(batch: int, count: int, keys_per_slot: int, rng) -> list:
    """count CSR requests of `batch` samples: (dense (B*13,), keys (B*26,), row_ptrs (B*26 + 1,))."""
    ranks = np.arange(1, keys_per_slot + 1, dtype=np.float64)
    p = ranks**-ZIPF
    p /= p.sum()
    out = []
    for _ in range(count):
        k = rng.choice(keys_per_slot, size=(batch, SLOTS), p=p) + np.arange(SLOTS) * keys_per_slot
        out.append(
            (
                rng.normal(0, 1, batch * DENSE).astype(np.float32),
                k.reshape(-1).astype(np.int64),
                np.arange(batch * SLOTS + 1, dtype=np.int64),
            )
        )
    return out


def timed(fn, requests: list, min_time: float) -> np.ndarray:
    """Wall seconds of each call fn(*request), cycling through requests for at least min_time (3 calls
    at least)."""
    fn(*requests[0])  # warm-up (compilation, first allocations)
    times, start, i = [], time.perf_counter(), 0
    while len(times) < 3 or time.perf_counter() - start < min_time:
        t = time.perf_counter()
        fn(*requests[i % len(requests)])
        times.append(time.perf_counter() - t)
        i += 1
    return np.asarray(times)


def timed_pair(fn_a, fn_b, requests: list, min_time: float) -> tuple[np.ndarray, np.ndarray]:
    """timed() of two answerers interleaved call by call (a, b, a, b, ...), so both see the same machine:
    on a shared machine, load that comes and goes then lands on both columns alike."""
    # warm-up: two rounds of every request, alternately, so both have made their big allocations in the
    # shared process (the first calls page memory in: with few repetitions at 16K that would be the p99)
    for _ in range(2):
        for r in requests:
            fn_a(*r)
            fn_b(*r)
    ta, tb, start, i = [], [], time.perf_counter(), 0
    while len(ta) < 3 or time.perf_counter() - start < 2 * min_time:
        r = requests[i % len(requests)]
        t = time.perf_counter()
        fn_a(*r)
        ta.append(time.perf_counter() - t)
        t = time.perf_counter()
        fn_b(*r)
        tb.append(time.perf_counter() - t)
        i += 1
    return np.asarray(ta), np.asarray(tb)


def _params(files: dict, batch: int, pct: float, **kw):
    from numbactr.inference.params import InferenceParams

    return InferenceParams(
        model_name="dlrm",
        max_batchsize=batch,
        hit_rate_threshold=1.0,
        dense_model_file=files["dense"],
        sparse_model_files=files["sparse"],
        use_gpu_embedding_cache=True,
        cache_size_percentage=pct,
        i64_input_key=True,
        **kw,
    )


def _onnx(files: dict, n_threads: int, use: bool):
    """(predictor or None, why not)."""
    if not use:
        return None, "onnxruntime skipped (--no-onnx)"
    try:
        from numbactr.onnx_converter.runtime import onnxruntime_predictor

        return onnxruntime_predictor(files["graph"], files["dense"], files["sparse"], threads=n_threads), ""
    except ImportError as e:
        return None, f"no onnxruntime column: {e}"


def bench_inference(batches, keys, sizes, warm, measure, min_time, seed=0, use_onnx=True) -> list:
    from numbactr.inference.session import CreateInferenceSession

    plan = threads.current()
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="numbactr-bench-inference-") as folder:
        files = build_model(folder, keys, seed)
        ort, why = _onnx(files, plan.compute, use_onnx)
        where = f"{device.describe()}; onnxruntime: CPU, {plan.compute} intra-op thread(s)"
        lat = Table(
            "InferenceSession vs onnxruntime: one CSR request (DLRM, 26 power-law keys + 13 dense per sample)",
            [
                "batch",
                "numbactr preds/s",
                "numbactr p50 ms",
                "numbactr p99 ms",
                "onnxruntime preds/s",
                "ort p50 ms",
                "ort p99 ms",
                "max abs diff",
            ],
            notes=[
                where,
                f"{SLOTS} x {keys:,} keys, cache 100%, filled at start (init_ec); " + (why or "same requests"),
            ],
        )
        # the whole table in the cache from the start (HugeCTR's init_ec with a refresh percentage), so the
        # latency table measures a warm cache, not the first sight of each power-law key
        session = CreateInferenceSession(
            files["graph"], _params(files, max(batches), 1.0, init_ec=True, cache_refresh_percentage_per_iteration=0.1)
        )
        with log.progress(total=len(batches) + len(sizes), desc="bench inference", unit="measurement") as bar:
            for b in batches:
                reqs = make_requests(b, 4, keys, rng)
                for r in reqs:  # a warm cache
                    session.predict(*r)
                if ort is not None:
                    t, to = timed_pair(session.predict, ort.predict_csr, reqs, min_time)
                else:
                    t = timed(session.predict, reqs, min_time)
                row = [b, b / t.mean(), 1e3 * np.median(t), 1e3 * np.percentile(t, 99)]
                if ort is not None:
                    diff = np.abs(np.asarray(session.predict(*reqs[0])).reshape(b, -1) - ort.predict_csr(*reqs[0]))
                    row += [b / to.mean(), 1e3 * np.median(to), 1e3 * np.percentile(to, 99), float(diff.max())]
                else:
                    row += [None] * 4
                lat.add(*row)
                bar.update(1)
            session.close()
            hit = Table(
                "Embedding cache: hit rate against cache size (power-law keys, batch 1024)",
                ["cache % of table", "slots", "hit rate", "numbactr preds/s", "onnxruntime preds/s"],
                notes=[
                    where,
                    f"warm-up: {warm} requests, then {measure} measured; the ONNX model holds the "
                    "whole table (no cache)",
                ],
            )
            reqs = make_requests(1024, warm + measure, keys, rng)
            ort_rate = None
            if ort is not None:
                ort_rate = 1024 / timed(ort.predict_csr, reqs[warm:], min_time).mean()
            for pct in sizes:
                s = CreateInferenceSession(files["graph"], _params(files, 1024, pct))
                for r in reqs[:warm]:
                    s.predict(*r)
                h0, q0 = s.cache.hits[0], s.cache.queried[0]
                t = []
                for r in reqs[warm:]:
                    t0 = time.perf_counter()
                    s.predict(*r)
                    t.append(time.perf_counter() - t0)
                hit.add(
                    f"{100 * pct:g}%",
                    s.cache.capacities[0],
                    (s.cache.hits[0] - h0) / (s.cache.queried[0] - q0),
                    1024 / np.mean(t),
                    ort_rate,
                )
                s.close()
                bar.update(1)
    return [lat, hit]


def _ints(text: str) -> tuple:
    try:
        vals = tuple(int(x) for x in text.split(","))
    except ValueError:
        vals = ()
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return vals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="numbactr bench inference",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    ap.add_argument("--quick", action="store_true", help="small model and batches (a smoke run, seconds)")
    ap.add_argument(
        "--min-time", type=float, default=None, help="seconds of repetitions per measurement (default 1, --quick 0.05)"
    )
    ap.add_argument(
        "--batches",
        type=_ints,
        default=None,
        help="comma-separated batch sizes (default 1,16,256,1024,4096,16384; --quick 1,64,512)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="compute threads of numbactr and onnxruntime (default: numbactr's thread plan)",
    )
    ap.add_argument("--no-onnx", action="store_true", help="skip the onnxruntime column")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and requests (default: %(default)s)")
    ap.add_argument("--json", metavar="PATH", default=None, help="also write the results there as JSON")
    args = ap.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads must be >= 1, got {args.threads}")
        threads.configure(compute=args.threads)
    sizes = dict(QUICK if args.quick else FULL)
    if args.batches:
        sizes["batches"] = args.batches
    if args.min_time is not None:
        sizes["min_time"] = args.min_time
    device.kind()
    tables = bench_inference(seed=args.seed, use_onnx=not args.no_onnx, **sizes)
    for table in tables:
        print(table.markdown(), flush=True)
    if args.json:
        from numbactr.bench import results

        doc = results.document(
            json_results(tables),
            command=None if argv is None else ["numbactr", "bench", "inference", *argv],
            notes="\n".join(dict.fromkeys(n for t in tables for n in t.notes)),
        )
        print(f"numbactr bench inference: results written to {results.write(args.json, doc)}")
    return 0


def json_results(tables: list) -> list:
    """The figures of bench_inference's two tables as JSON results (numbactr.bench.results): one per
    implementation and metric, the batch (or the cache's size) as parameters."""
    lat, hit = tables
    out = []
    for batch, *cells in lat.raw:
        for impl, (rate, p50, p99) in (("numbactr", cells[:3]), ("onnxruntime", cells[3:6])):
            for metric, v in (("preds/s", rate), ("p50 ms", p50), ("p99 ms", p99)):
                if v is not None:
                    out.append(dict(name=lat.title, implementation=impl, metric=metric, value=float(v), batch=batch))
        if cells[6] is not None:
            out.append(
                dict(
                    name=lat.title,
                    implementation="onnxruntime",
                    metric="max abs diff",
                    value=float(cells[6]),
                    batch=batch,
                )
            )
    for pct, slots, rate, ours, ort in hit.raw:
        shape = dict(cache_percent=float(pct.rstrip("%")), slots=int(slots), batch=1024)
        out.append(dict(name=hit.title, implementation="numbactr", metric="hit rate", value=float(rate), **shape))
        out.append(dict(name=hit.title, implementation="numbactr", metric="preds/s", value=float(ours), **shape))
        if ort is not None:
            out.append(dict(name=hit.title, implementation="onnxruntime", metric="preds/s", value=float(ort), **shape))
    return out
