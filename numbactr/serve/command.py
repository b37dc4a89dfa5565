"""``numbactr serve`` (Triton's command line where it applies) and ``numbactr serve-export``.

    numbactr serve --model-repository DIR --http-port 8000 [--http-address 0.0.0.0] [--metrics-port 8002]
                   [--backend-config=hugectr,ps=ps.json]
    numbactr serve-export GRAPH.json --dense MODEL_dense_N.model [--sparse FOLDER ...] \\
                   --model-repository DIR --model NAME [--version 1] [--max-batch-size 64] ...

serve loads every model of the repository (numbactr.serve.repository) before it listens, and stops with
the reason (file and line) when one cannot be loaded, as Triton does by default (``--exit-on-error``).
It serves HTTP with uvicorn (one process, one event loop; each model's batches run on a worker thread,
numbactr.serve.batcher, and on worker processes for an instance_group count above 1,
numbactr.serve.instances); /metrics is on the HTTP port unless ``--metrics-port`` gives it its own.

serve-export writes a Triton repository from a trained model: the network JSON and the dense and sparse
model files copied into ``<repo>/<model>/<version>/`` and a config.pbtxt whose parameters are read off
the network (des_feature_num, slots, label_dim, ...), then loads it back as serve would, so a repository
it wrote is one serve takes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys

from numbactr.serve.instances import load_instances
from numbactr.serve.repository import RepositoryError, SharedHPS, load_model, load_newest_good

DESCRIPTION = "serve a Triton model repository of HugeCTR models over Triton's HTTP protocol (KServe v2)"
SERVE_NOTE = (
    ". Every model of the repository loads before the server listens (its newest version that loads); "
    "/metrics is on the HTTP port unless --metrics-port is given; one JSON access-log line per request on stderr."
)
EXPORT_DESCRIPTION = "write a Triton model repository (config.pbtxt, version folder) from a trained model"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model-repository", required=True, metavar="DIR", help="<DIR>/<model>/config.pbtxt, <version>/")
    ap.add_argument("--http-port", type=int, default=8000, metavar="N", help="HTTP port (default: %(default)s)")
    ap.add_argument("--http-address", default="0.0.0.0", metavar="ADDR", help="HTTP address (default: %(default)s)")
    ap.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="N",
        help="serve /metrics on this port (default: the HTTP port)",
    )
    ap.add_argument(
        "--model-control-mode",
        choices=("none", "poll", "explicit"),
        default="none",
        help="none: serve what loaded at start; poll: load new versions every --repository-poll-secs; "
        "explicit: on POST /v2/repository/models/{m}/load (also in poll mode) (default: %(default)s)",
    )
    ap.add_argument(
        "--repository-poll-secs",
        type=float,
        default=15.0,
        metavar="S",
        help="poll mode's period (default: %(default)s)",
    )
    ap.add_argument(
        "--backend-config",
        action="append",
        default=[],
        metavar="hugectr,ps=PATH",
        help="HugeCTR's parameter server JSON (Triton's --backend-config=hugectr,ps=PATH)",
    )


def backend_ps(values: list) -> str | None:
    """The ps=PATH of the --backend-config values (only hugectr's ps is known)."""
    ps = None
    for v in values:
        backend, _, setting = v.partition(",")
        key, _, value = setting.partition("=")
        if backend != "hugectr" or key != "ps" or not value:
            raise ValueError(f"--backend-config={v!r}: numbactr takes hugectr,ps=PATH (the HPS JSON)")
        ps = value
    return ps


def load_repository(repo: str, ps: str | None) -> tuple:
    """(loaded models, the shared HPS or None, {model: [(version, stamp, reason)] of higher versions that
    failed}): each model's newest version that loads (repository.load_newest_good); RepositoryError when a
    model cannot be served at all."""
    if not os.path.isdir(repo):
        raise RepositoryError(f"--model-repository {repo!r} is not a folder")
    names = sorted(d for d in os.listdir(repo) if os.path.isfile(os.path.join(repo, d, "config.pbtxt")))
    if not names:
        raise RepositoryError(f"--model-repository {repo!r} holds no <model>/config.pbtxt")
    hps = SharedHPS(ps) if ps else None
    models, failed = [], {}
    try:
        for name in names:
            model, failed[name] = load_newest_good(repo, name, hps, load_instances)
            models.append(model)
    except BaseException:
        for m in models:
            m.close()
        raise
    return models, hps, failed


def run(args) -> int:
    try:
        import uvicorn

        from numbactr.serve.app import Server, make_app, metrics_app
    except ImportError as e:
        raise ImportError(f"numbactr serve needs the serve extra (pip install 'numbactr[serve]'): {e}") from None
    from numbactr import __version__

    models, hps, failed = load_repository(args.model_repository, backend_ps(args.backend_config))
    server = Server(models, __version__)
    for name, versions in failed.items():
        if versions:  # served: a lower version; the failures show on /v2/models/{m} (reload.py retries none)
            v, stamp, reason = versions[0]
            server.slots[name].reason, server.slots[name].failed = f"version {v}: {reason}", (v, stamp)
            print(f"numbactr serve: model {name!r}: {server.slots[name].reason}", file=sys.stderr, flush=True)
    if args.model_control_mode != "none":
        from numbactr.serve.reload import Reloader

        server.reloader = Reloader(server, args.model_repository, hps)
        server.poll_seconds = args.repository_poll_secs if args.model_control_mode == "poll" else 0.0
    separate = args.metrics_port is not None and args.metrics_port != args.http_port
    quiet = dict(log_level="warning", access_log=False)
    servers = [
        uvicorn.Server(uvicorn.Config(make_app(server, not separate), args.http_address, args.http_port, **quiet))
    ]
    if separate:
        servers.append(
            uvicorn.Server(
                uvicorn.Config(metrics_app(server), args.http_address, args.metrics_port, lifespan="off", **quiet)
            )
        )
    listing = ", ".join(f"{m.name} (version {m.version})" for m in models)
    print(
        f"numbactr serve: {listing}; HTTP on {args.http_address}:{args.http_port}"
        + (f", metrics on port {args.metrics_port}" if separate else ", metrics at /metrics"),
        file=sys.stderr,
        flush=True,
    )

    async def serve_all():
        tasks = [asyncio.create_task(s.serve()) for s in servers]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for s in servers:  # one stopped (a signal, a port in use): stop the others
            s.should_exit = True
        await asyncio.gather(*tasks)

    try:
        asyncio.run(serve_all())
    finally:
        if hps is not None:
            hps.close()
    return 0


# ---- serve-export --------------------------------------------------------------------------------------
def add_export_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("graph", help="the model's network JSON (Model.graph_to_json)")
    ap.add_argument("--dense", required=True, metavar="FILE", help="the dense model file ({prefix}_dense_{iter}.model)")
    ap.add_argument(
        "--sparse",
        nargs="+",
        required=True,
        metavar="FOLDER",
        help="the sparse model folders, one per table (graph order)",
    )
    ap.add_argument("--model-repository", required=True, metavar="DIR", help="the repository to write into")
    ap.add_argument("--model", required=True, metavar="NAME", help="the model's name in the repository")
    ap.add_argument("--version", type=int, default=1, metavar="N", help="its version folder (default: %(default)s)")
    ap.add_argument(
        "--max-batch-size", type=int, default=64, metavar="B", help="samples per batch (default: %(default)s)"
    )
    ap.add_argument(
        "--preferred-batch-size",
        type=int,
        nargs="*",
        default=[],
        metavar="B",
        help="dynamic batching's preferred sizes",
    )
    ap.add_argument(
        "--max-queue-delay-us", type=int, default=None, metavar="US", help="enable dynamic batching with this delay"
    )
    ap.add_argument("--i32-keys", action="store_true", help="32-bit keys (CATCOLUMN UINT32)")
    ap.add_argument("--gpucacheper", type=float, default=0.5, metavar="P", help="cache share (default: %(default)s)")
    ap.add_argument(
        "--hit-rate-threshold",
        type=float,
        default=1.0,
        metavar="T",
        help="HugeCTR's hit_rate_threshold (default %(default)s: every answer exact)",
    )


CONFIG = """name: "{name}"
backend: "hugectr"
max_batch_size: {mbs}
input [
  {{ name: "DES" data_type: TYPE_FP32 dims: [ -1 ] }},
  {{ name: "CATCOLUMN" data_type: {key_type} dims: [ -1 ] }},
  {{ name: "ROWINDEX" data_type: TYPE_INT32 dims: [ -1 ] }}
]
output [
  {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }}
]
{batching}parameters [
{parameters}
]
"""


def export(args) -> str:
    """Write the repository entry (module docstring); returns the version folder."""
    from numbactr.inference import InferenceParams, InferenceSession

    for path in [args.graph, args.dense] + args.sparse:
        if not os.path.exists(path):
            raise FileNotFoundError(f"serve-export: {path!r} does not exist")
    params = InferenceParams(
        model_name=args.model,
        max_batchsize=args.max_batch_size,
        hit_rate_threshold=1.0,
        dense_model_file=args.dense,
        sparse_model_files=args.sparse,
        use_gpu_embedding_cache=False,
        cache_size_percentage=0.5,
        i64_input_key=not args.i32_keys,
    )
    session = InferenceSession(args.graph, params)  # the model loads: its files and network agree
    g = session.graph
    sp = [g.sparse_param(e) for e in g.embeddings]
    values = {
        "config": os.path.basename(args.graph),
        "gpucache": "true",
        "gpucacheper": str(args.gpucacheper),
        "hit_rate_threshold": str(args.hit_rate_threshold),
        "label_dim": session._width(),
        "slots": sum(p.slot_num for p in sp),
        "cat_feature_num": sum(p.max_feature_num for p in sp),
        "des_feature_num": g.input.dense_dim,
        "max_nnz": max(max(p.nnz_per_slot) for p in sp),
        "embedding_vector_size": max(e.embedding_vec_size for e in g.embeddings),
        "embeddingkey_long_type": "false" if args.i32_keys else "true",
    }
    session.close()
    batching = ""
    if args.max_queue_delay_us is not None or args.preferred_batch_size:
        sizes = ", ".join(map(str, args.preferred_batch_size))
        delay = args.max_queue_delay_us or 0
        batching = (
            f"dynamic_batching {{\n  preferred_batch_size: [ {sizes} ]\n  max_queue_delay_microseconds: {delay}\n}}\n"
        )
    entries = ",\n".join(f'  {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in values.items())
    text = CONFIG.format(
        name=args.model,
        mbs=args.max_batch_size,
        key_type="TYPE_UINT32" if args.i32_keys else "TYPE_INT64",
        batching=batching,
        parameters=entries,
    )
    mdir = os.path.join(args.model_repository, args.model)
    vdir = os.path.join(mdir, str(args.version))
    if os.path.exists(vdir):
        raise FileExistsError(f"serve-export: {vdir} exists; give another --version")
    os.makedirs(vdir)
    shutil.copy2(args.graph, vdir)
    shutil.copy2(args.dense, vdir)
    ntp = args.dense + ".ntp.json"
    if os.path.exists(ntp):
        shutil.copy2(ntp, vdir)
    for folder in args.sparse:
        shutil.copytree(folder, os.path.join(vdir, os.path.basename(folder.rstrip(os.sep))))
    with open(os.path.join(mdir, "config.pbtxt"), "w") as f:
        f.write(text)
    load_model(args.model_repository, args.model, args.version).close()  # as serve will read it
    return vdir


def run_export(args) -> int:
    vdir = export(args)
    print(f"numbactr serve-export: wrote {vdir} and {os.path.join(os.path.dirname(vdir), 'config.pbtxt')}")
    return 0
