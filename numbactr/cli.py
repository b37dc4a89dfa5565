"""The ``numbactr`` command: ``numbactr [--version] [--debug] <command> ...``.

Commands: demo (the main job), bench (kernel/step benchmarks, or `bench data` for the readers), data
(converters: criteo), export-onnx (a trained model to ONNX), predict, serve (Triton's HTTP protocol) and
serve-export (a Triton model repository), device (which device and threads numbactr would
use, and why). Every command has
``--help``. An error is one line on stderr (exit status 1) unless ``--debug`` (anywhere on the line) or
NUMBACTR_DEBUG=1 asks for the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

DEBUG_ENV = "NUMBACTR_DEBUG"

#: converters under `numbactr data`: name -> (module, one-line description)
CONVERTERS = {
    "criteo": (
        "numbactr.data.criteo",
        "Criteo TSV click logs -> HugeCTR Norm or Parquet (HugeCTR's pandas "
        "preprocessing, streamed in chunks; prints the slot_size_array)",
    ),
    "movielens": (
        "numbactr.data.convert.movielens",
        "MovieLens ratings (u.data, ratings.dat, ratings.csv) -> leave-last-out split, NCF's sampled negatives",
    ),
    "avazu": ("numbactr.data.convert.avazu", "Avazu CSV click logs (Kaggle) -> 23 one-hot slots"),
    "libfm": (
        "numbactr.data.convert.libfm",
        "libFM files (label field:feature:value; Frappe, BARS) -> one slot per field",
    ),
    "libsvm": ("numbactr.data.convert.libsvm", "libSVM files (label feature:value) -> slots by position or boundaries"),
    "census": ("numbactr.data.convert.census", "UCI census income (adult) -> Wide & Deep features, the >50K label"),
    "taobao": ("numbactr.data.convert.taobao", "Taobao UserBehavior.csv -> behaviour histories for DIN/BST"),
}
BENCH_HELP = """benchmarks (markdown tables; not tests):
  hash                 hash-table insert/find, Mkeys/s
  embedding            table-batched embedding forward, backward + fused update: numbactr, torch, FBGEMM, GB/s
  dlrm                 one DLRM training step, samples/s
  all                  the three above
  cache                a table larger than its cache's budget on a memory-mapped file: hit rate, samples/s
  sok                  SOK's seed benchmark: nn.Embedding vs numbactr.sok in PyTorch, 1 and 2 ranks (torch)
  data                 data-reader throughput: Norm, Raw, Parquet with 1, 2, 4 workers
  inference            InferenceSession vs onnxruntime: predictions/s, p50/p99 latency, cache hit rate
  serve                `numbactr serve` under load over loopback (tritonclient): preds/s, p50/p99, failures
  zoo                  HugeCTR's sample zoo (W&D, DCN, DeepFM, DLRM, NCF...) beside PyTorch twins, samples/s
  hkv                  the evicting table (HierarchicalKV's operations) beside the fixed hash table, M-KV/s
  hstu                 HSTU's jagged attention forward and backward beside PyTorch padded dense, ms
Each runs on the device numbactr picks, with the thread plan of the start-up line, and beside PyTorch
when torch is installed. `numbactr bench data --help` / `numbactr bench hash --help` for the options."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("numbactr")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from numbactr import __version__

        return __version__


def _delegate(parser, name: str, help_text: str):
    """A subcommand whose own module parses the rest of the line (its --help is the module's): it
    declares no arguments, so parse_known_args hands everything after it to the module."""
    p = parser.add_parser(name, help=help_text, description=help_text, add_help=False)
    p.set_defaults(delegated=True)
    return p


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="numbactr",
        description="HugeCTR's training API re-implemented in Python with numba.cuda kernels. "
        "A HugeCTR script runs with `import numbactr as hugectr`; these commands are the extras.",
        epilog="`numbactr <command> --help` describes a command. Environment: NUMBACTR_DEVICE=gpu|sim|cpu, "
        "NUMBACTR_THREADS, NUMBACTR_READER_WORKERS, NUMBACTR_HUGECTR_EXACT=1, NUMBACTR_PROGRESS=0, "
        "NUMBACTR_DEBUG=1 (see README).",
    )
    ap.add_argument("--version", action="version", version=f"numbactr {_version()}")
    ap.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = ap.add_subparsers(dest="command", metavar="<command>", required=True)

    from numbactr import demo

    p = sub.add_parser(
        "demo",
        help="train a DLRM on built-in planted-signal data and print its AUC next to "
        "the best AUC possible (the main job)",
        description=demo.__doc__.split("\n\n")[0],
    )
    demo.add_arguments(p)

    _delegate(sub, "bench", "kernel, training-step and data-reader benchmarks (see `numbactr bench --help`)")

    p = sub.add_parser(
        "data",
        help="convert click logs to HugeCTR's data formats (converters: " + ", ".join(CONVERTERS) + ")",
        description="Convert data sets to HugeCTR's formats. Converters:",
        epilog="`numbactr data <converter> --help` lists a converter's options.",
    )
    conv = p.add_subparsers(dest="converter", metavar="<converter>", required=True)
    for name, (_, text) in CONVERTERS.items():
        _delegate(conv, name, text)

    from numbactr.onnx_converter import command as export_onnx

    p = sub.add_parser(
        "export-onnx",
        help="convert a trained model (graph JSON + model files) to ONNX",
        description=export_onnx.DESCRIPTION,
        epilog=export_onnx.EPILOG,
    )
    export_onnx.add_arguments(p)

    from numbactr.inference import predict

    p = sub.add_parser(
        "predict",
        help="predict a file list or Parquet folder with a trained model (HugeCTR's "
        "inference API) and write the predictions (CSV or Parquet)",
        description=predict.__doc__.split("\n\n")[0],
    )
    predict.add_arguments(p)

    from numbactr.serve import command as serve

    p = sub.add_parser("serve", help=serve.DESCRIPTION, description=serve.DESCRIPTION + serve.SERVE_NOTE)
    serve.add_arguments(p)
    p = sub.add_parser("serve-export", help=serve.EXPORT_DESCRIPTION, description=serve.EXPORT_DESCRIPTION)
    serve.add_export_arguments(p)

    ap.commands = sub.choices  # name -> parser, for error messages
    sub.add_parser(
        "device",
        help="print which device (gpu, sim, cpu) and threads numbactr would use, and why; "
        "the GPU, driver, CUDA, numba-cuda, CuPy, NCCL and MPI found, and what does not fit",
        description="Resolve the device as `import numbactr` would (NUMBACTR_DEVICE, the simulator, "
        "a CUDA GPU with cupy, else cpu) and print the start-up line: the device, the "
        "reason, and the thread plan (compute threads, reader workers). Then report this "
        "rank's placement and GPU, the NVIDIA driver and the CUDA version it supports, "
        "the GPUs (compute capability, memory), numba-cuda and CuPy with the CUDA majors "
        "they are built for, NCCL and MPI, and diagnose what does not fit (exit status "
        "1 when something is an error, e.g. a CuPy for CUDA 13 under a CUDA 12 driver).",
    )
    return ap


def _bench(rest: list) -> int:
    if not rest or rest[0] in ("-h", "--help"):
        print(
            "usage: numbactr bench {hash,embedding,dlrm,all,cache,sok,data,inference,serve,zoo,hkv,hstu} [options]\n\n"
            + BENCH_HELP
        )
        return 0
    if rest[0] == "data":
        from numbactr.bench.data import main as bench_data

        return bench_data(rest[1:])
    if rest[0] == "inference":
        from numbactr.bench.inference import main as bench_inference

        return bench_inference(rest[1:])
    if rest[0] == "serve":
        from numbactr.bench.serve import main as bench_serve

        return bench_serve(rest[1:])
    from numbactr.bench.cli import main as bench

    return bench(rest)


def _run(args) -> int:
    if args.command == "demo":
        from numbactr.demo import run

        return run(args)
    if args.command == "bench":
        return _bench(args.rest)
    if args.command == "data":
        import importlib

        return importlib.import_module(CONVERTERS[args.converter][0]).main(args.rest)
    if args.command == "export-onnx":
        from numbactr.onnx_converter.command import run

        return run(args)
    if args.command == "predict":
        from numbactr.inference.predict import run

        return run(args)
    if args.command in ("serve", "serve-export"):
        from numbactr.serve import command as serve

        return serve.run(args) if args.command == "serve" else serve.run_export(args)
    if args.command == "device":
        from numbactr.runtime.device_report import main as device_report

        return device_report()
    raise AssertionError(args.command)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    ap = build_parser()
    args, rest = ap.parse_known_args(argv)
    if rest and not getattr(args, "delegated", False):  # the subcommand's own usage and error
        ap.commands[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("numbactr: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 (the command line reports every error in one line)
        if debug:
            raise
        msg = " ".join(str(e).split()) or type(e).__name__
        print(
            f"numbactr {args.command}: error: {msg} ({type(e).__name__}; --debug shows the traceback)", file=sys.stderr
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
