"""``numbactr bench sok``: SOK's seed benchmark (its DenseDemo) in PyTorch, native embedding vs numbactr.sok.

The model of SOK's first benchmark (sparse_operation_kit/documents/tutorials/DenseDemo): 100 feature
fields (slots) of 10 keys each drawn uniformly from a vocabulary of 8192, embedding width 4 without pooling
(All2AllDenseEmbedding: (B, 100, 10, 4) -> (B, 4000)), six Dense(1024, ReLU) layers and Dense(1), binary
cross-entropy on random labels, Adam. SOK measured it at batch 8192 per GPU (one A100: 25.9 ms per
iteration against TensorFlow's native embedding's 179.9 ms; NVIDIA's blog quotes 7.9x on one A100).

Implementations, each the same PyTorch model with a different embedding:
  torch nn.Embedding          the native layer (dense gradient), torch.optim.Adam over every parameter
  torch nn.Embedding sparse   nn.Embedding(sparse=True) trained by torch.optim.SparseAdam (one rank only:
                              a sparse gradient is not averaged over ranks)
  numbactr.sok                sok.All2AllDenseEmbedding(8192, 4, 100, 10) (keyed, SOK's default), trained by
                              sok.OptimizerWrapper(torch.optim.Adam) (the engine's fused Adam on the rows in use)
  numbactr.sok no hash        the same with use_hashtable=False (keys are rows: no hash-table work)
Ranks: 1, and ``mpiexec -n 2`` launched by the benchmark (the global batch split over the ranks; the dense
gradients averaged with numbactr.sok.average_gradients; SOK's table model-parallel, the native table
replicated). Figures: the median over ``reps`` of the whole training step (forward, backward, allreduce,
update) and of the embedding alone (its forward, backward with a fixed dY and update), after one warm-up.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from numbactr.runtime import device

SEED_SHAPE = dict(slots=100, nnz=10, vocab=8192, dim=4, layers=6, width=1024)
COLUMNS = [
    "impl",
    "ranks",
    "threads/rank",
    "global batch",
    "step ms",
    "samples/s",
    "x native step",
    "embedding ms",
    "x native embedding",
]
IMPLS = ("torch nn.Embedding", "torch nn.Embedding sparse", "numbactr.sok", "numbactr.sok no hash")


def _model(torch, impl: str, shape: dict):
    """The DenseDemo model with the embedding of `impl`, and its optimizers."""
    import numbactr.sok as sok

    nn = torch.nn
    slots, nnz, dim, width = shape["slots"], shape["nnz"], shape["dim"], shape["width"]
    if impl.startswith("numbactr.sok"):
        emb = sok.All2AllDenseEmbedding(shape["vocab"], dim, slots, nnz, use_hashtable=not impl.endswith("no hash"))
    else:
        emb = nn.Embedding(shape["vocab"], dim, sparse=impl.endswith("sparse"))
    layers = []
    for i in range(shape["layers"]):
        layers += [nn.Linear(slots * nnz * dim if i == 0 else width, width), nn.ReLU()]
    model = nn.ModuleDict(dict(emb=emb, mlp=nn.Sequential(*layers, nn.Linear(width, 1))))
    if impl.startswith("numbactr.sok"):
        opts = [sok.OptimizerWrapper(torch.optim.Adam(model.parameters(), lr=1e-3))]
        emb_opt = sok.OptimizerWrapper(torch.optim.Adam(emb.parameters(), lr=1e-3))
    elif impl.endswith("sparse"):
        opts = [torch.optim.Adam(model["mlp"].parameters(), lr=1e-3), torch.optim.SparseAdam(emb.parameters(), lr=1e-3)]
        emb_opt = opts[1]
    else:
        opts = [torch.optim.Adam(model.parameters(), lr=1e-3)]
        emb_opt = torch.optim.Adam(emb.parameters(), lr=1e-3)
    return model, opts, emb_opt


def measure_impl(impl: str, shape: dict, batch: int, reps: int, seed: int = 0) -> dict:
    """{'step': median s, 'embedding': median s} of `impl` on this process's ranks (every rank calls it);
    batch is this rank's share."""
    import torch

    import numbactr.sok as sok

    comm = sok.num_gpus(), sok.global_gpu_id()
    torch.manual_seed(seed)
    model, opts, emb_opt = _model(torch, impl, shape)
    sok.broadcast_parameters(model)
    rng = np.random.default_rng(seed + comm[1])
    ids = [torch.from_numpy(rng.integers(0, shape["vocab"], (batch, shape["slots"], shape["nnz"]))) for _ in range(2)]
    labels = [torch.from_numpy((rng.random((batch, 1)) < 0.5).astype(np.float32)) for _ in range(2)]
    dy = torch.from_numpy(rng.normal(size=(batch, shape["slots"], shape["nnz"], shape["dim"])).astype(np.float32))
    bce = torch.nn.BCEWithLogitsLoss()
    it = [0]

    def step():
        i = it[0] = (it[0] + 1) % 2
        for o in opts:
            o.zero_grad()
        out = model["emb"](ids[i])
        loss = bce(model["mlp"](out.reshape(batch, -1)), labels[i])
        loss.backward()
        sok.average_gradients(model)
        for o in opts:
            o.step()
        if not torch.isfinite(loss).item():
            raise AssertionError(f"bench sok: {impl}: the loss is not finite")

    def embedding_step():
        i = it[0] = (it[0] + 1) % 2
        emb_opt.zero_grad()
        model["emb"](ids[i]).backward(dy)
        sok.average_gradients(model["emb"])
        emb_opt.step()

    return {"step": _median(step, reps), "embedding": _median(embedding_step, reps)}


def _median(fn, reps: int) -> float:
    from numbactr.distributed.comm import world

    comm = world()
    fn()  # warm-up: JIT compilation, first touches, key insertion
    times = []
    for _ in range(reps):
        comm.barrier()  # ranks start each step together
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_sok(
    env,
    *,
    batch: int,
    reps: int,
    threads=(1, 2),
    ranks=(1, 2),
    seed: int = 0,
    min_time=None,
    shape: dict | None = None,
    timeout: float = 3600,
):
    """The seed benchmark's table (module docstring): every implementation on 1 rank at each thread count,
    then on the other rank counts through mpiexec (one thread per rank when ranks share the cores; an
    mpiexec run taking more than `timeout` seconds is an error). min_time is not used (`reps` counts)."""
    from numbactr.bench.common import Table, thread_count

    if env.torch is None:
        raise RuntimeError("bench sok needs torch (numbactr.sok is SOK's PyTorch interface): pip install torch")
    if env.kind == "gpu":
        raise NotImplementedError(
            "bench sok runs on the cpu device: the torch baseline would run on the GPU "
            "and numbactr.sok's tables there too, not yet compared (NUMBACTR_DEVICE=cpu)"
        )
    shape = {**SEED_SHAPE, **(shape or {})}
    tab = Table(f"SOK's seed benchmark: PyTorch's native embedding vs numbactr.sok ({env.kind})", COLUMNS)
    tab.notes = env.header() + [
        f"SOK's DenseDemo: {shape['slots']} slots x {shape['nnz']} keys from a vocabulary of {shape['vocab']:,}, "
        f"width {shape['dim']} without pooling, {shape['layers']} x Dense({shape['width']}, ReLU) + Dense(1), "
        "BCE, Adam (lr 1e-3); SOK's published run: batch 8192 per GPU, 25.9 ms/iteration on one A100 vs "
        "179.9 ms for TensorFlow's native embedding (NVIDIA quotes 7.9x)",
        "step ms: median of whole training steps (forward, backward, dense allreduce, update); embedding ms: "
        "the embedding alone (forward, backward of a fixed dY, update); x native: the native nn.Embedding's "
        "time over this row's (> 1 is faster than native)",
        "ranks > 1: mpiexec -n R, the global batch split over the ranks, dense gradients averaged by "
        "numbactr.sok.average_gradients (SOK's table model-parallel, nn.Embedding's replicated); ranks on "
        "one host share its cores",
        f"{reps} timed repetitions after one warm-up; the machine may be shared: compare rows of one run",
    ]
    for n_threads in tuple(threads):
        with thread_count(env, n_threads):
            results = {impl: measure_impl(impl, shape, batch, reps, seed) for impl in IMPLS}
        _add_rows(tab, results, 1, n_threads, batch)
    for r in (r for r in ranks if r > 1):
        results, why = _launch(r, shape, batch, reps, seed, timeout)
        if results is None:
            tab.notes.append(f"{r} ranks: not measured ({why})")
        else:
            _add_rows(tab, results["results"], r, results["threads"], batch)
    return tab


def _add_rows(tab, results: dict, ranks: int, threads: int, batch: int) -> None:
    native = results["torch nn.Embedding"]
    for impl, t in results.items():
        tab.add(
            impl,
            ranks,
            threads,
            batch,
            1e3 * t["step"],
            batch / t["step"],
            native["step"] / t["step"],
            1e3 * t["embedding"],
            native["embedding"] / t["embedding"],
        )


def _launch(ranks: int, shape: dict, batch: int, reps: int, seed: int, timeout: float):
    """(results of `mpiexec -n ranks python -m numbactr.bench.sok --worker`, None) or (None, why not)."""
    exe = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if exe is None or importlib.util.find_spec("mpi4py") is None:
        return None, "mpiexec or mpi4py not found (pip install 'numbactr[mpi]')"
    if batch % ranks:
        return None, f"the batch {batch} does not split over {ranks} ranks"
    with tempfile.TemporaryDirectory(prefix="numbactr-bench-sok-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [
            exe,
            "-n",
            str(ranks),
            sys.executable,
            "-m",
            "numbactr.bench.sok",
            "--worker",
            out,
            "--batch",
            str(batch),
            "--reps",
            str(reps),
            "--seed",
            str(seed),
            "--shape",
            json.dumps(shape),
        ]
        # the ranks run on this process's device and divide the cores among them
        env = {k: v for k, v in os.environ.items() if k != "NUMBACTR_THREADS"}
        env["NUMBACTR_DEVICE"] = device.kind()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"bench sok: mpiexec -n {ranks} failed (exit {r.returncode}): {r.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f), ""


def worker(argv=None) -> int:
    """One rank of ``bench sok`` under mpiexec: every rank measures its share, rank 0 writes the JSON."""
    ap = argparse.ArgumentParser(prog="python -m numbactr.bench.sok")
    ap.add_argument("--worker", required=True, help="where rank 0 writes the results (JSON)")
    ap.add_argument("--batch", type=int, required=True, help="the global batch")
    ap.add_argument("--reps", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", type=json.loads, default={})
    args = ap.parse_args(argv)
    import numbactr.sok as sok

    comm = sok.init(seed=args.seed)  # torch's threads: this rank's share of the cores
    import torch

    per_rank = args.batch // comm.size
    shape = {**SEED_SHAPE, **args.shape}
    results = {
        impl: measure_impl(impl, shape, per_rank, args.reps, args.seed) for impl in IMPLS if not impl.endswith("sparse")
    }
    if comm.rank == 0:
        with open(args.worker, "w") as f:
            json.dump({"results": results, "threads": torch.get_num_threads()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(worker())
