"""``numbactr bench dlrm --model mlperf``: the MLPerf DLRM shape, numbactr beside an equivalent PyTorch DLRM.

The model (MLPerf's DLRM on Criteo, as HugeCTR's samples build it): 13 dense features, 26 one-hot slots,
bottom MLP 13-512-256-D, dot interaction of the 27 vectors, top MLP 1024-1024-512-256-1, BCE; D = 128
(MLPerf's) or 16. Built through the HugeCTR API (``build_mlperf_dlrm``) and trained with SGD or Adam
(Update_t.Global). On a GPU the batch is 64K (65536) and the tables hold --rows rows in all; on cpu (or
sim) the batch is 2048 and the tables small, so that CI can smoke-test the command.

Reported per (implementation, optimizer): step ms and samples/s, the ``graphs`` cell, eager ms and its
breakdown (embedding, GEMMs, rest, host gaps: how each is measured is numbactr/bench/step_breakdown.py's
docstring), and the embedding's GB/s.

The embedding's bytes: FBGEMM's count for the rows the batch touches (bench embedding): forward reads
B*26*D*4 and writes as much, backward + update twice that; plus, where the optimizer has HugeCTR's
all-rows pass (Update_t.Global with Adam; MomentumSGD, Nesterov), that pass's traffic: every row in use
read and written with its optimizer states (rows in use x D x (weight bytes + state bytes) x 2; Adam on
float32: 24 bytes an element). SGD has no such pass. The touched rows' optimizer states are not counted
(FBGEMM's convention): the figure is a lower bound. GB/s is those bytes over the embedding phase's time,
and on a GPU also a share of the measured device-to-device copy bandwidth. PyTorch (when installed): the
same widths with one nn.EmbeddingBag per slot, torch.optim.SGD/Adam, on CUDA when numbactr runs on a GPU
(there also its whole step captured as one CUDA graph, the "+graph" row, unless --amp); ``--tf32``
allows TF32 matrix products (numbactr: enable_tf32_compute) and ``--amp`` runs torch under autocast
float16 with a GradScaler (numbactr: use_mixed_precision). No breakdown is measured for torch.

``bench_mlperf`` also leaves the raw figures (seconds, bytes, the graph status) as ``table.records``, one
dict per numbactr row.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import tempfile

import numpy as np

from numbactr.bench.step_breakdown import (
    GATE_FAILURES as GATE_FAILURES,
    GATE_ROUNDS as GATE_ROUNDS,
    EventClock as EventClock,
    PhaseTimer as PhaseTimer,
    StreamGate as StreamGate,
    WallClock as WallClock,
    _gate_kernel as _gate_kernel,
    _graph_reasons as _graph_reasons,
    _graphs_off as _graphs_off,
    _time_numbactr,
    breakdown as breakdown,
    graph_status as graph_status,
)

SLOTS, DENSE = 26, 13
BOTTOM = (512, 256)  # then D
TOP = (1024, 1024, 512, 256, 1)
#: per device kind: batch, total embedding rows
SIZES = {
    "gpu": dict(batch=65536, rows=8_000_000),
    "cpu": dict(batch=2048, rows=20_000),
    "sim": dict(batch=64, rows=2_000),
}
COLUMNS = [
    "impl",
    "threads",
    "optimizer",
    "D",
    "batch",
    "rows",
    "graphs",
    "step ms",
    "samples/s",
    "eager ms",
    "embedding ms",
    "GEMMs ms",
    "rest ms",
    "host gaps ms",
    "embedding GB/s",
]


def build_mlperf_dlrm(
    hugectr,
    train_list: str,
    eval_list: str,
    *,
    batch: int,
    dim: int = 128,
    optimizer: str = "sgd",
    lr: float = 0.01,
    workspace_mb: int = 64,
    bottom=BOTTOM,
    top=TOP,
    tf32: bool = False,
    amp: bool = False,
    seed: int = 0,
    dropout: float = 0.0,
    embedding_type: str = "DistributedSlotSparseEmbeddingHash",
):
    """The MLPerf DLRM through the HugeCTR API (module docstring); compiled. dropout > 0 adds a Dropout after
    each ReLU of the top MLP (MLPerf's model has none; the tests use it); embedding_type names the
    hugectr.Embedding_t of its one table (the tests also train a slot-owned Localized one)."""
    opt = optimizer.lower()
    if opt not in ("sgd", "adam"):
        raise ValueError(f"bench mlperf: optimizer must be sgd or adam, got {optimizer!r}")
    kw = dict(enable_tf32_compute=True) if tf32 else {}
    if amp:
        kw["use_mixed_precision"] = True
    solver = hugectr.CreateSolver(
        max_eval_batches=1,
        batchsize_eval=batch,
        batchsize=batch,
        lr=lr,
        vvgpu=[[0]],
        repeat_dataset=True,
        i64_input_key=True,
        seed=seed,
        **kw,
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=[train_list],
        eval_source=eval_list,
        check_type=hugectr.Check_t.Sum,
    )
    otype = hugectr.Optimizer_t.Adam if opt == "adam" else hugectr.Optimizer_t.SGD
    optimizer_params = hugectr.CreateOptimizer(
        optimizer_type=otype,
        update_type=hugectr.Update_t.Global,
        **(dict(beta1=0.9, beta2=0.999, epsilon=1e-7) if opt == "adam" else {}),
    )
    model = hugectr.Model(solver, reader, optimizer_params)
    model.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=DENSE,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, SLOTS)],
        )
    )
    model.add(
        hugectr.SparseEmbedding(
            embedding_type=getattr(hugectr.Embedding_t, embedding_type),
            workspace_size_per_gpu_in_mb=workspace_mb,
            embedding_vec_size=dim,
            combiner="sum",
            sparse_embedding_name="sparse_embedding1",
            bottom_name="data1",
            optimizer=optimizer_params,
        )
    )
    L = hugectr.Layer_t
    below = "dense"
    for i, width in enumerate(tuple(bottom) + (dim,), start=1):
        model.add(hugectr.DenseLayer(L.InnerProduct, [below], [f"fc{i}"], num_output=width))
        model.add(hugectr.DenseLayer(L.ReLU, [f"fc{i}"], [f"relu{i}"]))
        below = f"relu{i}"
    model.add(hugectr.DenseLayer(L.Interaction, [below, "sparse_embedding1"], ["interaction1"]))
    below = "interaction1"
    n = len(bottom) + 2
    for i, width in enumerate(top, start=n):
        model.add(hugectr.DenseLayer(L.InnerProduct, [below], [f"fc{i}"], num_output=width))
        if i < n + len(top) - 1:
            model.add(hugectr.DenseLayer(L.ReLU, [f"fc{i}"], [f"relu{i}"]))
            below = f"relu{i}"
            if dropout:
                model.add(hugectr.DenseLayer(L.Dropout, [below], [f"dropout{i}"], dropout_rate=dropout))
                below = f"dropout{i}"
    model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, [f"fc{n + len(top) - 1}", "label"], ["loss"]))
    model.compile()
    return model


def global_pass_bytes(engine) -> int:
    """Bytes a step's HugeCTR all-rows pass moves in an embedding engine (0 when its optimizer has none:
    SGD, or a LOCAL update): every element of every row in use read and written with its per-element
    optimizer states (kernels.tbe.make_global_kernel), rows in use x D x (weight + state bytes) x 2."""
    from numbactr.kernels import tbe

    opt = engine.optimizer
    if not tbe.has_global_pass(opt.kind, opt.update_type):
        return 0
    states = [s for s in engine._state_buffers()[:2] if s is not None]
    per_element = engine.weights.dtype.itemsize + sum(s.dtype.itemsize for s in states)
    elements = sum(int(engine.live_rows(t)) * int(engine.dims[t]) for t in range(len(engine.tables)))
    return 2 * elements * per_element


def embedding_step_bytes(batch: int, dim: int, global_bytes: int = 0) -> int:
    """The embedding's bytes in one step (module docstring): FBGEMM's count of the touched rows, forward
    + backward/update (3 x (B*26*D*4 read + B*26*D*4 written)), plus the all-rows pass's global_bytes."""
    from numbactr.bench.embedding import embedding_bytes

    return 3 * embedding_bytes(batch * SLOTS, 1, dim) + int(global_bytes)


def _prepare_torch(torch, dev, host_batches, slot_offsets):
    """Per batch: dense, per-slot indices (slot-local rows), per-slot offsets, labels as torch tensors."""
    out = []
    for b in host_batches:
        keys, offsets = b.sparse[0]  # bag j = sample * S + slot, one key per bag
        keys = np.asarray(keys, dtype=np.int64)
        if (np.diff(offsets) != 1).any():
            raise AssertionError("bench mlperf: the generated data must be one-hot")
        per_slot = keys[offsets[:-1]].reshape(b.batch_size, SLOTS)
        idx = [torch.from_numpy(np.ascontiguousarray(per_slot[:, s] - slot_offsets[s])).to(dev) for s in range(SLOTS)]
        offs = torch.arange(b.batch_size, dtype=torch.int64, device=dev)
        out.append((torch.from_numpy(b.dense).to(dev), idx, offs, torch.from_numpy(b.label).to(dev)))
    return out


def torch_mlperf_dlrm(torch, slot_sizes, dim: int, bottom=BOTTOM, top=TOP):
    """The same DLRM in plain PyTorch: nn.EmbeddingBag per slot, HugeCTR's interaction output layout
    [bottom output | strict lower triangle of the 27x27 dot products | one zero pad]."""
    nn = torch.nn
    n = len(slot_sizes) + 1
    width = dim + n * (n - 1) // 2 + 1

    def mlp(widths, last_relu):
        layers = []
        for i in range(1, len(widths)):
            layers.append(nn.Linear(widths[i - 1], widths[i]))
            if i < len(widths) - 1 or last_relu:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    class DLRM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.ModuleList(nn.EmbeddingBag(int(v), dim, mode="sum") for v in slot_sizes)
            self.bottom = mlp((DENSE,) + tuple(bottom) + (dim,), True)
            self.top = mlp((width,) + tuple(top), False)
            self.register_buffer("tril", torch.tril_indices(n, n, offset=-1))

        def forward(self, dense, idx, offsets):
            x = self.bottom(dense)
            z = torch.stack([x] + [e(i, offsets) for e, i in zip(self.emb, idx)], 1)
            m = torch.bmm(z, z.transpose(1, 2))
            pairs = m[:, self.tril[0], self.tril[1]]
            pad = torch.zeros(x.shape[0], 1, dtype=x.dtype, device=x.device)
            return self.top(torch.cat([x, pairs, pad], 1))

    return DLRM()


def _torch_model_and_optimizer(env, sizes, dim, optimizer, lr, seed, tf32, capturable=False):
    torch, dev = env.torch, env.torch_dev
    torch.manual_seed(seed)
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
        torch.backends.cudnn.allow_tf32 = bool(tf32)
    model = torch_mlperf_dlrm(torch, sizes, dim).to(dev)
    extra = {"capturable": True} if capturable else {}
    opt = (
        torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-7, **extra)
        if optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=lr)
    )
    return model, opt


def _time_torch_graph(env, prepared, sizes, dim, optimizer, lr, min_time, seed, tf32) -> float:
    """PyTorch's step captured whole as one CUDA graph (forward, backward and the optimizer step; Adam
    with capturable=True), replayed on static input tensors that each step's batch is copied into: the
    recipe of torch.cuda.graphs' "whole network capture", as NVIDIA's MLPerf DLRM runs. float32/TF32
    only (GradScaler's unscale and skip read the host)."""
    from numbactr.bench.common import measure

    torch = env.torch
    model, opt = _torch_model_and_optimizer(env, sizes, dim, optimizer, lr, seed, tf32, capturable=True)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    dense, idx, offs, label = (t.clone() if not isinstance(t, list) else [i.clone() for i in t] for t in prepared[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(dense, idx, offs), label).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = loss_fn(model(dense, idx, offs), label)
        static_loss.backward()
        opt.step()
    it = itertools.cycle(prepared)

    def step():
        d, i, o, y = next(it)
        dense.copy_(d, non_blocking=True)
        for a, b in zip(idx, i):
            a.copy_(b, non_blocking=True)
        offs.copy_(o, non_blocking=True)
        label.copy_(y, non_blocking=True)
        graph.replay()

    t = measure(step, sync=env.torch_sync, min_time=min_time)
    if not torch.isfinite(static_loss).item():
        raise AssertionError("bench mlperf: torch (CUDA graph) loss is not finite")
    return t


def _time_torch(env, prepared, sizes, dim, optimizer, lr, min_time, seed, tf32, amp) -> float:
    from numbactr.bench.common import measure

    torch, dev = env.torch, env.torch_dev
    model, opt = _torch_model_and_optimizer(env, sizes, dim, optimizer, lr, seed, tf32)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    use_amp = bool(amp) and dev == "cuda"
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
    it = itertools.cycle(prepared)
    last = {}

    def step():
        dense, idx, offs, label = next(it)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=dev, dtype=torch.float16, enabled=use_amp):
            loss = loss_fn(model(dense, idx, offs).float(), label)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        last["loss"] = loss

    t = measure(step, sync=env.torch_sync, min_time=min_time)
    if not torch.isfinite(last["loss"]).item():
        raise AssertionError("bench mlperf: torch loss is not finite")
    return t


def _profiled_step(model, env) -> None:
    """With NUMBACTR_PROFILE_STEP=1 on a GPU: one more step between cudaProfilerStart and Stop, so that a
    profiler started with its capture off (``ncu --profile-from-start off``, ``nsys profile
    --capture-range=cudaProfilerApi``) records exactly one warm step of each configuration (.ci/gpu
    profile)."""
    if env.kind != "gpu" or os.environ.get("NUMBACTR_PROFILE_STEP", "0") in ("", "0"):
        return
    import cupy

    env.sync()
    cupy.cuda.profiler.start()
    try:
        model.train()
        env.sync()
    finally:
        cupy.cuda.profiler.stop()


def bench_mlperf(
    env,
    *,
    batch: int | None = None,
    rows: int | None = None,
    dims=(128,),
    optimizers=("sgd", "adam"),
    batches: int = 2,
    min_time: float = 1.0,
    breakdown_steps: int = 3,
    tf32: bool = False,
    amp: bool = False,
    seed: int = 0,
    lr: float | None = None,
    threads=None,
    **_,
):
    """One Table: numbactr's MLPerf DLRM step (and PyTorch's) for each D and optimizer (module docstring).
    On the cpu device each row runs with numbactr's compute threads and torch's set to the same count:
    each of ``threads``, or numbactr's current compute threads (a GPU run leaves both as they are). The
    table's ``records`` hold each numbactr row's raw figures (seconds, bytes, graph status)."""
    from numbactr.bench import common
    from numbactr.train import cuda_graphs
    from numbactr.runtime import threads as T
    from numbactr.data.synthetic import criteo_like_slot_sizes, make_planted_dataset
    from numbactr.config import workspace_mb_for

    size = SIZES.get(env.kind, SIZES["cpu"])
    batch = batch or size["batch"]
    rows = rows or size["rows"]
    for name, v in (("batch", batch), ("rows", rows), ("batches", batches), ("breakdown_steps", breakdown_steps)):
        if v < 1:
            raise ValueError(f"bench mlperf: {name} must be >= 1, got {v}")
    if rows < SLOTS:
        raise ValueError(f"bench mlperf: rows must be >= {SLOTS} (one per slot at least), got {rows}")
    wanted = cuda_graphs.graphs_wanted()
    tab = common.Table(f"MLPerf DLRM training step ({env.kind})", COLUMNS)
    tab.records = []
    if env.kind == "gpu":
        eager_note = (
            f"eager ms = the median clean eager step (= step ms unless graphs replayed; then measured "
            f"apart with graphs off); its breakdown from {breakdown_steps} eager step(s), each queued "
            "whole behind a gate kernel so that the device runs it back to back: CUDA events at the "
            "phases' ends give their device times, host gaps = eager ms - the device's busy time"
        )
    else:
        eager_note = (
            f"eager ms = the wall time of {breakdown_steps} further timed step(s), their phases by the "
            f"host clock; host gaps 0 by definition on {env.kind} (every operation runs when called)"
        )
    tab.notes = env.header() + [
        f"model: 13 dense -> {'-'.join(map(str, BOTTOM))}-D, {SLOTS} one-hot slots of width D (hash embedding, "
        f"{rows:,} rows in all), dot interaction, top {'-'.join(map(str, TOP))}, BCE; Update_t.Global",
        "precision: "
        + ("TF32 allowed" if tf32 else "float32")
        + (", mixed precision (torch: autocast fp16)" if amp else ""),
        "step ms, samples/s: median clean step (forward + backward + update; batches in memory)"
        + (
            ", CUDA graphs asked for (NUMBACTR_CUDA_GRAPHS=1): the graphs column says whether they replayed"
            if wanted
            else "; graphs: off (NUMBACTR_CUDA_GRAPHS=1 asks for CUDA graphs)"
        ),
        "eager ms = embedding + GEMMs + rest + host gaps: embedding = lookup + gradient hand-over + fused "
        "backward/update (+ Adam's all-rows pass); GEMMs = the fully connected layers' forward and backward "
        "less their bias/ReLU kernels; rest = the other work (bias/ReLU, interaction, loss, dense optimizer, "
        "Python between phases)",
        eager_note,
        "embedding GB/s: FBGEMM's count of the touched rows, 3 x (B*26*D*4 read + B*26*D*4 written), plus "
        "the all-rows pass of Global Adam (rows in use x D x (weight + 2 states) x 4 B x read+write), over "
        "the embedding phase",
    ]
    if env.peak_gbs:
        tab.notes.append(f"memory bandwidth (the % column): {env.peak_gbs:.0f} GB/s ({env.peak_src})")
    sizes = criteo_like_slot_sizes(SLOTS, rows)
    with tempfile.TemporaryDirectory(prefix="numbactr-mlperf-") as tmp:
        data = make_planted_dataset(
            os.path.join(tmp, "data"),
            num_train=batch * batches,
            num_eval=batch,
            dense_dim=DENSE,
            slot_sizes=sizes,
            seed=seed,
            files=(1, 1),
            calibration_samples=min(50_000, max(2_000, batch * batches)),
        )
        import numbactr as hugectr

        counts = (None,) if env.kind == "gpu" else tuple(threads or (T.current().compute,))
        for dim, opt, n in itertools.product(dims, optimizers, counts):
            with common.thread_count(env, n):
                step_lr = lr if lr is not None else (0.001 if opt == "adam" else 0.01)
                with contextlib.redirect_stdout(io.StringIO()):
                    model = build_mlperf_dlrm(
                        hugectr,
                        data.train_list,
                        data.eval_list,
                        batch=batch,
                        dim=dim,
                        optimizer=opt,
                        lr=step_lr,
                        workspace_mb=workspace_mb_for(rows, dim, 1 if opt == "sgd" else 2) + 1,
                        tf32=tf32,
                        amp=amp,
                        seed=seed,
                    )
                reader = iter(model._make_reader(data.train_list, batch, True))
                host_batches = [next(reader) for _ in range(batches)]
                model.start_data_reading()
                model._train_reader = itertools.cycle(host_batches)
                rec = _time_numbactr(model, env, wanted, min_time, breakdown_steps)
                _profiled_step(model, env)
                if not np.isfinite(model.get_current_loss()):
                    raise AssertionError("bench mlperf: numbactr loss is not finite")
                global_bytes = sum(global_pass_bytes(e.engine) for e in model.embeddings)
                nbytes = embedding_step_bytes(batch, dim, global_bytes)
                emb = rec["embedding"]
                gbs = nbytes / emb / 1e9 if emb > 0 else float("nan")
                gb_cell = f"{gbs:.1f}" + (f" ({100 * gbs / env.peak_gbs:.0f}% of measured)" if env.peak_gbs else "")
                rec.update(
                    impl="numbactr",
                    threads=n,
                    optimizer=opt,
                    D=dim,
                    batch=batch,
                    rows=rows,
                    embedding_bytes=nbytes,
                    global_pass_bytes=global_bytes,
                    embedding_gbs=gbs,
                )
                tab.records.append(rec)
                gap = rec["host_gap"]
                tab.add(
                    "numbactr",
                    n or "-",
                    opt,
                    dim,
                    batch,
                    rows,
                    rec["graphs"],
                    1e3 * rec["step"],
                    batch / rec["step"],
                    1e3 * rec["eager"],
                    1e3 * emb,
                    1e3 * rec["gemm"],
                    1e3 * rec["rest"],
                    None if gap is None else 1e3 * gap,
                    gb_cell,
                )
                if rec["why"]:
                    tab.notes.append(f"numbactr ({opt}, D={dim}) breakdown by {rec['method']}: {rec['why']}")
                elif rec["host_gap"] is not None and rec["busy"] is not None and rec["busy"] > rec["eager_step"]:
                    tab.notes.append(
                        f"numbactr ({opt}, D={dim}): the gated steps' device time exceeded the clean "
                        "eager step (noise between runs); host gaps shown as 0"
                    )
                del model
                if env.torch is not None:
                    prepared = _prepare_torch(env.torch, env.torch_dev, host_batches, data.slot_offsets)
                    tt = _time_torch(env, prepared, sizes, dim, opt, step_lr, min_time, seed, tf32, amp)
                    label = (
                        env.torch_label
                        + ("+tf32" if tf32 else "")
                        + ("+amp" if amp and env.torch_dev == "cuda" else "")
                    )
                    tab.add(
                        label,
                        n or "-",
                        opt,
                        dim,
                        batch,
                        rows,
                        "off",
                        1e3 * tt,
                        batch / tt,
                        "-",
                        "-",
                        "-",
                        "-",
                        "-",
                        "-",
                    )
                    if env.torch_dev == "cuda" and not amp:  # torch's step as one CUDA graph too
                        try:
                            tg = _time_torch_graph(env, prepared, sizes, dim, opt, step_lr, min_time, seed, tf32)
                        except Exception as e:  # noqa: BLE001 (a baseline that cannot capture is noted, not fatal)
                            tab.notes.append(f"torch CUDA graph ({opt}, D={dim}) not measured: {type(e).__name__}: {e}")
                        else:
                            tab.add(
                                label + "+graph",
                                n or "-",
                                opt,
                                dim,
                                batch,
                                rows,
                                "whole step",
                                1e3 * tg,
                                batch / tg,
                                "-",
                                "-",
                                "-",
                                "-",
                                "-",
                                "-",
                            )
    return tab
