"""``numbactr bench``: throughput benchmarks that print markdown tables (not timed tests).

    numbactr bench hash       hash-table insert/find, Mkeys/s (uniform and power-law keys, load 0.75)
    numbactr bench embedding  table-batched embedding (TBE) forward, and backward + fused SGD / rowwise
                              AdaGrad / Adam update, SUM and MEAN: numbactr's engine, torch
                              nn.EmbeddingBag and FBGEMM's TBE side by side, GB/s
    numbactr bench dlrm       one DLRM training step: numbactr's HugeCTR model, plain PyTorch, and PyTorch
                              with numbactr's / FBGEMM's TBE for the embeddings, samples/s
    numbactr bench dlrm --model mlperf
                              the MLPerf DLRM (26 slots, 13-512-256-D, 1024-1024-512-256-1; batch 64K on a
                              GPU, 2048 on cpu) with SGD and Adam beside PyTorch's: samples/s and a step-time
                              breakdown (embedding, GEMMs, the rest, host gaps; bench/step_breakdown.py);
                              --dim 128,16 --optimizer sgd,adam --batch N --rows N --tf32 --amp
    numbactr bench zoo        HugeCTR's sample zoo (W&D, DCN v1/v2, DeepFM, DLRM, NeuMF, GMF, NCF, MMoE, DIN, BST)
                              built through the HugeCTR API beside PyTorch twins from the same weights: samples/s,
                              the ratio, and numbactr's step breakdown (numbactr/bench/zoo.py); and each model
                              served by InferenceSession beside onnxruntime on its ONNX export
                              (numbactr/bench/zoo_infer.py); --batch 256,1024,4096 --threads 1,2
                              --models DLRM,NeuMF --infer-batch 1,16,256,4096 --no-infer --infer-only
    numbactr bench all        the three above
    numbactr bench cache      a table 4-50x larger than its cache's byte budget, trained through the cache
                              on a memory-mapped file: hit rate and samples/s against cache size, LRU and
                              LFU, and a plot (--plot; numbactr/bench/cache.py says more)
    numbactr bench hkv        the evicting table (HierarchicalKV's insert_or_assign, insert_and_evict,
                              find_or_insert, find) at load factor 0.5 and 1.0, D 8 and 32, beside the fixed
                              hash table: M-KV/s, the cost of eviction (numbactr/bench/hkv.py)
    numbactr bench hstu       HSTU's jagged attention (numbactr.hstu.hstu_attn_varlen_func), forward and backward,
                              beside the same math in PyTorch padded dense, at max lengths 50-512
                              (numbactr/bench/hstu.py); --threads 1,2
    numbactr bench sok        SOK's seed benchmark: a PyTorch model with its native nn.Embedding vs numbactr.sok's
                              All2AllDenseEmbedding, 1 rank and mpiexec -n 2 (numbactr/bench/sok.py)
    --quick                   small shapes (seconds; the smoke test uses it)
    --threads 1,2             thread counts of the embedding and dlrm runs (cpu; default 1,2)
    --json PATH               also write every figure as JSON (machine, date, threads, versions; the
                              format: numbactr/bench/results.py)

Everything runs on the device numbactr picked (``numbactr.runtime.device.kind()``): the numba.cuda kernels on
a GPU (cupy arrays), numbactr's compiled CPU code or NumPy references on cpu. When torch is installed
each benchmark also runs a plain-PyTorch baseline (on CUDA when this torch build has it and numbactr runs
on a GPU, else on cpu), and FBGEMM's TBE when fbgemm_gpu is installed (pip install -e ".[fbgemm]").

Counting (each table says it again):
  hash       Mkeys/s = batch keys (duplicates included) / time.
  embedding  FBGEMM's byte count: forward = rows read nbags*L*D*4 + output written nbags*D*4, with
             nbags = B * features; backward + update = 2 x the forward bytes. GB/s = bytes / time / 1e9;
             optimizer-state bytes per table row beside.
             On a GPU also the fraction of the device's peak memory bandwidth.
  dlrm       samples/s = batch / median step time; batches are read into memory first, so the step is
             forward + backward + optimizer update (numbactr's includes its hash-table insert).
Times are medians over repetitions after one warm-up call (which also absorbs JIT compilation).
Threads: numbactr's compute threads (BLAS, numba) are those of numbactr.runtime.threads (NUMBACTR_THREADS=N);
torch keeps its own setting (torch.set_num_threads); every table's notes state both. The embedding and
dlrm benchmarks set both to each of --threads in turn, side by side in one run.
"""

import argparse
import sys


from numbactr.bench.common import Env, Table
from numbactr.bench.dlrm import bench_dlrm
from numbactr.bench.embedding import bench_embedding
from numbactr.bench.hash import bench_hash

SUBCOMMANDS = ("hash", "embedding", "dlrm", "all", "cache", "sok", "zoo", "hkv", "hstu")


# ---- SOK ---------------------------------------------------------------------------------------
SOK_FULL = dict(batch=8192, reps=5)  # SOK's batch per GPU
SOK_QUICK = dict(batch=64, reps=2, threads=(1,), shape=dict(layers=2, width=64), timeout=180)


def _bench_sok(env: Env, **kwargs) -> Table:
    """SOK's seed benchmark (numbactr/bench/sok.py; needs torch)."""
    from numbactr.bench.sok import bench_sok

    return bench_sok(env, **kwargs)


# ---- command line ------------------------------------------------------------------------------
FULL = dict(
    hash=dict(n=1_000_000),
    embedding=dict(batch=8192, features=26, hots=(1, 20), dims=(16, 64, 128), rows=1_000_000),
    dlrm=dict(batch=4096, batches=8, total_rows=200_000),
)
QUICK = dict(
    hash=dict(n=20_000),
    embedding=dict(batch=64, features=26, hots=(1, 4), dims=(16,), rows=10_000, threads=(1,)),
    dlrm=dict(batch=128, batches=2, total_rows=5_000, threads=(1,)),
)


def run(
    which: str,
    env: Env,
    *,
    quick: bool = False,
    min_time: float | None = None,
    seed: int = 0,
    out=None,
    options: dict | None = None,
) -> list:
    """Run one benchmark ('hash', 'embedding', 'dlrm') or 'all'; print and return the Tables.

    options: per benchmark, keyword arguments over the sizes (e.g. {'embedding': {'threads': (1,)}})."""
    out = out or sys.stdout
    sizes = QUICK if quick else FULL
    min_time = (0.05 if quick else 1.0) if min_time is None else min_time
    from numbactr import log
    from numbactr.bench import cache as bench_cache
    from numbactr.bench import zoo as bench_zoo

    fns = {"hash": bench_hash, "embedding": bench_embedding, "dlrm": bench_dlrm}
    names = list(fns) if which == "all" else [which]
    fns["cache"] = bench_cache.bench_cache
    sizes = {**sizes, "cache": bench_cache.QUICK if quick else bench_cache.FULL}
    fns["sok"] = _bench_sok  # not in 'all': it launches mpiexec itself
    sizes = {**sizes, "sok": SOK_QUICK if quick else SOK_FULL}
    fns["zoo"] = bench_zoo.bench_zoo  # not in 'all': minutes of its own
    sizes = {**sizes, "zoo": bench_zoo.QUICK if quick else bench_zoo.FULL}
    from numbactr.bench import hkv as bench_hkv

    fns["hkv"] = bench_hkv.bench_hkv  # not in 'all': the evicting table's own question
    sizes = {**sizes, "hkv": bench_hkv.QUICK if quick else bench_hkv.FULL}
    from numbactr.bench import hstu as bench_hstu

    fns["hstu"] = bench_hstu.bench_hstu  # not in 'all': the attention of issue 43
    sizes = {**sizes, "hstu": bench_hstu.QUICK if quick else bench_hstu.FULL}
    tables = []
    with log.progress(total=len(names), desc="numbactr bench", unit="benchmark") as bar:
        for name in names:
            made = fns[name](env, min_time=min_time, seed=seed, **{**sizes[name], **(options or {}).get(name, {})})
            for tab in made if isinstance(made, list) else [made]:  # embedding: forward, backward
                print(tab.markdown(), file=out, flush=True)
                tables.append(tab)
            bar.update(1)
    return tables


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="numbactr bench",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    ap.add_argument("what", choices=SUBCOMMANDS, help="which benchmark (all: the three, one table each)")
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke run, seconds)")
    ap.add_argument(
        "--min-time", type=float, default=None, help="seconds of repetitions per measurement (default 1, --quick 0.05)"
    )
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    ap.add_argument("--seed", type=int, default=0, help="seed of the generated keys and data (default: %(default)s)")
    ap.add_argument(
        "--plot",
        default="runs/bench/cache_hit_rate.png",
        help="bench cache: where to save its chart (default: %(default)s)",
    )
    ap.add_argument(
        "--threads",
        type=_thread_list,
        default=None,
        help="comma-separated thread counts for embedding, dlrm and hstu (default 1,2; --quick 1; --model mlperf: numbactr's compute threads), set for numbactr and torch alike",
    )
    ap.add_argument(
        "--model",
        choices=("demo", "mlperf"),
        default="demo",
        help="bench dlrm: the demo's small DLRM (default) or the MLPerf DLRM shape",
    )
    ap.add_argument(
        "--dim",
        type=_dim_list,
        default=(128,),
        help="bench dlrm --model mlperf: embedding widths, 128 and/or 16 (default 128)",
    )
    ap.add_argument(
        "--optimizer",
        type=_optimizer_list,
        default=("sgd", "adam"),
        help="bench dlrm --model mlperf: sgd and/or adam (default sgd,adam)",
    )
    ap.add_argument(
        "--batch",
        type=_thread_list,
        default=None,
        help="bench zoo: batch sizes (default 256,1024,4096; --quick 64); bench dlrm --model mlperf: one batch "
        "size (default 65536 on a GPU, 2048 on cpu)",
    )
    ap.add_argument("--models", default=None, help="bench zoo: comma-separated model names (default: all)")
    ap.add_argument(
        "--infer-batch",
        type=_thread_list,
        default=None,
        help="bench zoo: batch sizes of the inference table (default 1,16,256,4096; --quick 1,64)",
    )
    ap.add_argument("--no-infer", action="store_true", help="bench zoo: skip the inference table")
    ap.add_argument("--infer-only", action="store_true", help="bench zoo: only the inference table (no training)")
    ap.add_argument(
        "--rows",
        type=int,
        default=None,
        help="bench dlrm --model mlperf: embedding rows over the 26 tables (default 8M on a GPU, 20K on cpu)",
    )
    ap.add_argument("--tf32", action="store_true", help="bench dlrm --model mlperf: TF32 matrix products")
    ap.add_argument("--amp", action="store_true", help="bench dlrm --model mlperf: mixed precision")
    ap.add_argument("--json", metavar="PATH", default=None, help="also write the results there as JSON")
    args = ap.parse_args(argv)
    command = ["numbactr", "bench", *(sys.argv[1:] if argv is None else argv)]
    if args.batch is not None and len(args.batch) > 1 and args.what != "zoo":
        ap.error("several --batch sizes apply to `bench zoo` only")
    mlperf_only = [f"--{k}" for k in ("rows",) if getattr(args, k) is not None] + [
        f"--{k}" for k in ("tf32", "amp") if getattr(args, k)
    ]
    if args.batch is not None and args.what != "zoo" and (args.what != "dlrm" or args.model != "mlperf"):
        mlperf_only.insert(0, "--batch")
    zoo_only = [f"--{k}" for k in ("models", "infer_batch") if getattr(args, k) is not None]
    zoo_only += [f"--{k}" for k in ("no_infer", "infer_only") if getattr(args, k)]
    if zoo_only and args.what != "zoo":
        verb = "apply" if len(zoo_only) > 1 else "applies"
        ap.error(f"{', '.join(o.replace('_', '-') for o in zoo_only)} {verb} to `bench zoo` only")
    if args.no_infer and args.infer_only:
        ap.error("--no-infer and --infer-only exclude each other")
    if mlperf_only and (args.what != "dlrm" or args.model != "mlperf"):
        ap.error(f"{', '.join(mlperf_only)} only apply to `bench dlrm --model mlperf`")
    if args.model == "mlperf" and args.what != "dlrm":
        ap.error("--model mlperf applies to `bench dlrm` only")
    env = Env(use_torch=not args.no_torch)
    if env.torch is None:
        print(f"numbactr bench: {env.torch_why}", flush=True)
    if args.model == "mlperf":
        from numbactr.bench.mlperf import bench_mlperf

        quick = dict(batch=256, rows=2_000, batches=1, breakdown_steps=1) if args.quick else {}
        sizes = {**quick, **({"batch": args.batch[0]} if args.batch else {})}
        sizes.update({"rows": args.rows} if args.rows is not None else {})
        tab = bench_mlperf(
            env,
            dims=args.dim,
            optimizers=args.optimizer,
            tf32=args.tf32,
            amp=args.amp,
            seed=args.seed,
            min_time=(0.05 if args.quick else 1.0) if args.min_time is None else args.min_time,
            threads=args.threads,
            **sizes,
        )
        print(tab.markdown(), flush=True)
        _write_json(args.json, [tab], command)
        return 0
    options = (
        {}
        if args.threads is None
        else {k: {"threads": args.threads} for k in ("embedding", "dlrm", "cache", "sok", "zoo", "hstu")}
    )
    options.setdefault("cache", {})["plot"] = args.plot
    if args.batch is not None:
        options.setdefault("zoo", {})["batches"] = args.batch
    if args.models is not None:
        options.setdefault("zoo", {})["models"] = tuple(m.strip() for m in args.models.split(","))
    if args.infer_batch is not None:
        options.setdefault("zoo", {})["infer_batches"] = args.infer_batch
    options.setdefault("zoo", {}).update(infer=not args.no_infer, infer_only=args.infer_only)
    tables = run(args.what, env, quick=args.quick, min_time=args.min_time, seed=args.seed, options=options)
    _write_json(args.json, tables, command)
    return 0


def _write_json(path, tables: list, command: list) -> None:
    if path:
        from numbactr.bench import results

        print(f"numbactr bench: results written to {results.write_tables(path, tables, command)}", flush=True)


def _dim_list(text: str) -> tuple:
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"expected embedding widths like 128,16, got {text!r}")
    return dims


def _optimizer_list(text: str) -> tuple:
    names = tuple(x.strip().lower() for x in text.split(","))
    if not names or any(n not in ("sgd", "adam") for n in names):
        raise argparse.ArgumentTypeError(f"expected sgd and/or adam like sgd,adam, got {text!r}")
    return names


def _thread_list(text: str) -> tuple:
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive thread counts like 1,2, got {text!r}")
    return counts


if __name__ == "__main__":
    sys.exit(main())
