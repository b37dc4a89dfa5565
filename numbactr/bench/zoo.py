"""``numbactr bench zoo``: HugeCTR's sample zoo trained by numbactr beside its PyTorch twins, samples/s, the
ratio and where numbactr's step time goes.

Models: numbactr/bench/zoo_models.py (the HugeCTR-API graphs, the synthetic batches), twins:
numbactr/bench/zoo_twins.py (tests/test_bench_zoo_torch.py checks that each twin computes numbactr's loss and
dense gradients from the same weights). Both start from the same weights (the twin's embedding tables loaded
into numbactr's hash tables, numbactr's dense weights copied into the twin) and train on the same batches,
held in memory and cycled, so a step is forward + backward + Adam update only.

Timing: per cell (model, threads, batch) numbactr and the twin are measured in turn, ``rounds`` times each
(numbactr.bench.common.measure: the median step after a warm-up), and each keeps its best median: on a
shared machine the other jobs slow whichever runs while they do, and the interleaved best-of is the figure
least skewed by them. ratio = numbactr's samples/s / the twin's (> 1: numbactr faster).

Breakdown of numbactr's step (numbactr/bench/step_breakdown.py's PhaseTimer, plus the ops' kernels): over
``breakdown_steps`` further steps by the host clock, embedding (the SparseEmbeddings' lookup, gradient
hand-over, fused backward + Adam update), GEMMs (the fully connected layers' matrix products, BLAS),
kernels (every other op's math: the function ``numbactr.ops.dispatch.pick`` chose, compiled CPU code or a
NumPy reference, including its call), and Python (the rest: the planned step's op loop, numbactr.train.plan,
or the general step's tape, Tensors and layer dispatch; allocation, the dense optimizer's call); the ``step``
column says which step ran.

Inference (numbactr/bench/zoo_infer.py): each model saved as a HugeCTR user saves it and served by numbactr's
InferenceSession beside onnxruntime on the exported model, batch 1 to 4096 (``infer_batches``), a third
Table; ``infer=False`` leaves it out, ``infer_only=True`` runs it alone (no training, no torch needed).
"""

from __future__ import annotations

import contextlib
import gc
import io
import sys
import time

from numbactr.bench.common import Env, Table, measure, thread_count

COLUMNS = ["impl", "model", "threads", "batch", "step ms", "samples/s", "ratio"]
BREAKDOWN_COLUMNS = [
    "model",
    "threads",
    "batch",
    "eager ms",
    "embedding ms",
    "GEMMs ms",
    "kernels ms",
    "rest ms",
    "step",
]
FULL = dict(batches=(256, 1024, 4096), threads=(1, 2), rounds=3, breakdown_steps=3, infer_batches=(1, 16, 256, 4096))
QUICK = dict(batches=(64,), threads=(1,), rounds=1, breakdown_steps=1, infer_batches=(1, 64))


class KernelTimer:
    """Host-clock seconds of the ops' picked implementations (``numbactr.ops.dispatch.pick``'s choice, as
    every op module imported it) called outside a PhaseTimer phase; nested picks count once."""

    def __init__(self, phases):
        from numbactr.ops import dispatch

        self.phases, self.seconds, self._depth = phases, 0.0, 0
        self._orig = dispatch.pick
        self._owners = [m for n, m in list(sys.modules.items()) if n.startswith("numbactr.") and _picks(m, dispatch)]

    def _pick(self, *a, **k):
        fn = self._orig(*a, **k)

        def timed(*args, **kw):
            if self._depth or self.phases._stack:  # inside another pick, or a phase counts it
                return fn(*args, **kw)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
                self._depth -= 1

        return timed

    def __enter__(self):
        for m in self._owners:
            m.pick = self._pick
        return self

    def __exit__(self, *exc):
        for m in self._owners:
            m.pick = self._orig


def _picks(module, dispatch) -> bool:
    return getattr(module, "pick", None) is dispatch.pick and module is not dispatch


def breakdown(model, env, steps: int) -> dict:
    """Seconds per step: eager, embedding, gemm, kernels (with the bias/ReLU kernels the GEMM phase gives
    to "other"), python (the rest), over ``steps`` host-clock steps (module docstring)."""
    from numbactr.bench.step_breakdown import PhaseTimer, WallClock

    phases = PhaseTimer(model, WallClock(env.sync))
    kernels = KernelTimer(phases)
    total = 0.0
    with phases, kernels:
        for _ in range(steps):
            t0 = time.perf_counter()
            model.train()
            env.sync()
            total += time.perf_counter() - t0
    ph = {k: v / steps for k, v in phases.seconds().items()}
    eager = total / steps
    kern = kernels.seconds / steps + ph["other"]
    return dict(
        eager=eager,
        embedding=ph["embedding"],
        gemm=ph["gemm"],
        kernels=kern,
        python=max(eager - ph["embedding"] - ph["gemm"] - kern, 0.0),
    )


def pair(env, spec, batch: int, seed: int, lr: float = 1e-3, batches: int = 4):
    """numbactr's model and the twin's step function from the same weights, fed the same batches."""
    import numbactr as hugectr
    from numbactr.bench import zoo_models as Z
    from numbactr.bench import zoo_twins as T

    with contextlib.redirect_stdout(io.StringIO()):
        model = Z.build(hugectr, spec, batch, lr=lr, seed=seed)
    data = Z.make_batches(spec, batch, batches, seed=seed)
    Z.feed(model, data)
    twin = T.make_twin(spec, seed=seed)
    Z.load_embeddings(model, spec, {n: e.weight.detach().numpy() for n, e in twin.emb.items()})
    T.copy_from(twin, Z.dense_params(model))
    return model, T.stepper(twin, spec, data, lr)


def bench_zoo(
    env: Env,
    *,
    models=None,
    batches=(256, 1024, 4096),
    threads=(1, 2),
    min_time: float = 0.5,
    rounds: int = 2,
    breakdown_steps: int = 3,
    seed: int = 0,
    out=None,
    infer_batches=(1, 16, 256, 4096),
    infer: bool = True,
    infer_only: bool = False,
) -> list:
    """Three Tables: the training step of each zoo model (numbactr and its twin, samples/s, ratio), the
    breakdown of numbactr's step and the inference column (module docstring). ``models``: names of
    zoo_models.SPECS (default all)."""
    from numbactr.bench import zoo_models as Z
    from numbactr.bench.zoo_infer import bench_zoo_infer

    if infer_only and not infer:
        raise ValueError("bench zoo: infer_only needs infer")
    if env.torch is None and not infer_only:
        raise SystemExit(f"numbactr bench zoo needs the PyTorch twins: {env.torch_why}")
    names = list(Z.SPECS) if models is None else list(models)
    unknown = [n for n in names if n not in Z.SPECS]
    if unknown:
        raise ValueError(f"bench zoo: unknown model(s) {unknown}; the zoo has {list(Z.SPECS)}")
    tab = Table(f"Zoo training step ({env.kind})", COLUMNS)
    parts = Table(f"Zoo: where numbactr's step goes ({env.kind})", BREAKDOWN_COLUMNS)
    tab.notes = env.header() + [
        "models (numbactr/bench/zoo_models.py): " + "; ".join(f"{n}: {Z.SPECS[n].sample}" for n in names),
        "every model: Adam (beta1 0.9, beta2 0.999, eps 1e-7, lr 1e-3; HugeCTR's Update_t.Global: every "
        "embedding row each step, as torch.optim.Adam over an nn.Embedding) and BCE; synthetic one-hot batches "
        "(uniform ids, N(0, 1) dense), 4 batches in memory, cycled",
        "twin (numbactr/bench/zoo_twins.py): the same layers, widths and initial weights (copied), "
        "nn.Embedding per embedding, BCEWithLogitsLoss, torch.optim.Adam",
        f"step ms: numbactr and the twin measured in turn, {rounds} round(s) each, the best median step of each "
        f"(>= {min_time} s of steps per median); ratio = numbactr samples/s / twin samples/s (> 1: numbactr faster)",
        "threads: numbactr's compute threads (BLAS, numba) and torch.set_num_threads set to the column's value",
    ]
    parts.notes = [
        f"numbactr's step by the host clock over {breakdown_steps} step(s): embedding = lookup + gradient "
        "hand-over + fused backward/Adam (all rows); GEMMs = the fully connected layers' matrix products (BLAS); "
        "kernels = every other op's math (the compiled CPU function or NumPy reference numbactr.ops.dispatch "
        "picked, and the bias/ReLU epilogues); rest = the Python around them (the planned step's op loop, or the "
        "general step's tape, Tensor objects and layer dispatch; allocation, the dense optimizer's call): eager = "
        "the four; step = planned (numbactr.train.plan: the recorded op calls replayed) or general (and why)",
    ]
    out = out or sys.stdout

    def serving() -> list:
        return [
            bench_zoo_infer(env, names, batches=infer_batches, threads=threads, min_time=min_time, seed=seed, out=out)
        ]

    if infer_only:
        return serving()
    for name in names:
        for n in threads:
            for batch in batches:
                with thread_count(env, n):
                    model, twin_step = pair(env, Z.SPECS[name], batch, seed)
                    ours, theirs = [], []
                    for _ in range(rounds):
                        ours.append(measure(model.train, sync=env.sync, min_time=min_time))
                        theirs.append(measure(twin_step, min_time=min_time))
                    t, tt = min(ours), min(theirs)
                    parts_s = breakdown(model, env, breakdown_steps)
                ratio = tt / t
                tab.add("numbactr", name, n, batch, 1e3 * t, batch / t, ratio)
                tab.add(env.torch_label, name, n, batch, 1e3 * tt, batch / tt, ratio)
                parts.add(
                    name,
                    n,
                    batch,
                    *(1e3 * parts_s[k] for k in ("eager", "embedding", "gemm", "kernels", "python")),
                    "planned" if model._plan_why is None else f"general: {model._plan_why}",
                )
                print(f"zoo {name} threads {n} batch {batch}: ratio {ratio:.2f}", file=out, flush=True)
                del model, twin_step
                gc.collect()
    return [tab, parts] + (serving() if infer else [])
