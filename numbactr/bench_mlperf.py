"""``numbactr bench dlrm --model mlperf``: the MLPerf DLRM shape, numbactr beside an equivalent PyTorch DLRM.

The model (MLPerf's DLRM on Criteo, as HugeCTR's samples build it): 13 dense features, 26 one-hot slots,
bottom MLP 13-512-256-D, dot interaction of the 27 vectors, top MLP 1024-1024-512-256-1, BCE; D = 128
(MLPerf's) or 16. Built through the HugeCTR API (``build_mlperf_dlrm``) and trained with SGD or Adam
(Update_t.Global). On a GPU the batch is 64K (65536) and the tables hold --rows rows in all; on cpu (or
sim) the batch is 2048 and the tables small, so that CI can smoke-test the command.

Reported per (implementation, optimizer): step time and samples/s (median of clean steps: no timers
inside), and a step-time breakdown from separate steps with timers around the phases (each phase
bracketed by a device synchronization, so the phases add up to a slightly longer step than the clean one):

* embedding: the SparseEmbedding's lookup, its gradient hand-over and its fused backward + update;
* dense: the fully connected layers' forward and backward (the matrix products with their bias/ReLU);
* rest: the step minus the two (interaction, loss, the dense optimizer, host work and gaps).

The embedding's bytes follow FBGEMM's count (bench embedding): forward reads B*26*D*4 and writes as
much, backward + update twice that; its GB/s is those bytes over the embedding phase's time, and on a
GPU also as a share of the device's peak memory bandwidth. PyTorch (when installed): the same widths with
one nn.EmbeddingBag per slot, torch.optim.SGD/Adam, on CUDA when numbactr runs on a GPU (there also
its whole step captured as one CUDA graph, the "+graph" row, unless --amp); ``--tf32``
allows TF32 matrix products (numbactr: enable_tf32_compute) and ``--amp`` runs torch under autocast
float16 with a GradScaler (numbactr: use_mixed_precision). No breakdown is measured for torch.
"""
from __future__ import annotations

import contextlib
import io
import itertools
import os
import tempfile
import time

import numpy as np

SLOTS, DENSE = 26, 13
BOTTOM = (512, 256)              # then D
TOP = (1024, 1024, 512, 256, 1)
#: per device kind: batch, total embedding rows
SIZES = {"gpu": dict(batch=65536, rows=8_000_000), "cpu": dict(batch=2048, rows=20_000),
         "sim": dict(batch=64, rows=2_000)}
COLUMNS = ["impl", "threads", "optimizer", "D", "batch", "rows", "step ms", "samples/s", "embedding ms", "dense ms",
           "rest ms", "embedding GB/s"]


def build_mlperf_dlrm(hugectr, train_list: str, eval_list: str, *, batch: int, dim: int = 128,
                      optimizer: str = "sgd", lr: float = 0.01, workspace_mb: int = 64, bottom=BOTTOM, top=TOP,
                      tf32: bool = False, amp: bool = False, seed: int = 0, dropout: float = 0.0,
                      embedding_type: str = "DistributedSlotSparseEmbeddingHash"):
    """The MLPerf DLRM through the HugeCTR API (module docstring); compiled. dropout > 0 adds a Dropout after
    each ReLU of the top MLP (MLPerf's model has none; the tests use it); embedding_type names the
    hugectr.Embedding_t of its one table (the tests also train a slot-owned Localized one)."""
    opt = optimizer.lower()
    if opt not in ("sgd", "adam"):
        raise ValueError(f"bench mlperf: optimizer must be sgd or adam, got {optimizer!r}")
    kw = dict(enable_tf32_compute=True) if tf32 else {}
    if amp:
        kw["use_mixed_precision"] = True
    solver = hugectr.CreateSolver(max_eval_batches=1, batchsize_eval=batch, batchsize=batch, lr=lr, vvgpu=[[0]],
                                  repeat_dataset=True, i64_input_key=True, seed=seed, **kw)
    reader = hugectr.DataReaderParams(data_reader_type=hugectr.DataReaderType_t.Norm, source=[train_list],
                                      eval_source=eval_list, check_type=hugectr.Check_t.Sum)
    otype = hugectr.Optimizer_t.Adam if opt == "adam" else hugectr.Optimizer_t.SGD
    optimizer_params = hugectr.CreateOptimizer(optimizer_type=otype, update_type=hugectr.Update_t.Global,
                                               **(dict(beta1=0.9, beta2=0.999, epsilon=1e-7) if opt == "adam"
                                                  else {}))
    model = hugectr.Model(solver, reader, optimizer_params)
    model.add(hugectr.Input(label_dim=1, label_name="label", dense_dim=DENSE, dense_name="dense",
                            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True,
                                                                                          SLOTS)]))
    model.add(hugectr.SparseEmbedding(embedding_type=getattr(hugectr.Embedding_t, embedding_type),
                                      workspace_size_per_gpu_in_mb=workspace_mb, embedding_vec_size=dim,
                                      combiner="sum", sparse_embedding_name="sparse_embedding1",
                                      bottom_name="data1", optimizer=optimizer_params))
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


class PhaseTimer:
    """Seconds spent in the embedding and dense phases of a numbactr step, with a device synchronization
    before and after each phase; installed by wrapping the phases' entry points for the ``with`` block."""

    def __init__(self, model, sync):
        from . import ops
        from .layers import dense
        self.sync, self.seconds = sync, {"embedding": 0.0, "dense": 0.0}
        self._depth = 0
        self._patches = []              # (owner, name, original, restore-as-staticmethod)
        for emb in model.embeddings:
            for name in ("lookup", "hold_gradient", "update"):
                self._patches.append((emb, name, getattr(emb, name), False))
        for cls in (ops.Linear, dense.FcBiasAct):
            for name in ("forward", "backward"):
                self._patches.append((cls, name, cls.__dict__[name], True))

    def _timed(self, fn, phase):
        def run(*a, **k):
            if self._depth:             # a phase inside a phase counts once
                return fn(*a, **k)
            self._depth += 1
            self.sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.sync()
                self.seconds[phase] += time.perf_counter() - t0
                self._depth -= 1
        return run

    def __enter__(self):
        for owner, name, orig, static in self._patches:
            phase = "dense" if static else "embedding"
            if static:
                setattr(owner, name, staticmethod(self._timed(orig.__func__, phase)))
            else:
                setattr(owner, name, self._timed(orig, phase))
        return self

    def __exit__(self, *exc):
        for owner, name, orig, static in self._patches:
            if static:
                setattr(owner, name, orig)
            else:
                delattr(owner, name)    # the instance attribute goes; the class's method shows again


def _prepare_torch(torch, dev, host_batches, slot_offsets):
    """Per batch: dense, per-slot indices (slot-local rows), per-slot offsets, labels as torch tensors."""
    out = []
    for b in host_batches:
        keys, offsets = b.sparse[0]                          # bag j = sample * S + slot, one key per bag
        keys = np.asarray(keys, dtype=np.int64)
        if (np.diff(offsets) != 1).any():
            raise AssertionError("bench mlperf: the generated data must be one-hot")
        per_slot = keys[offsets[:-1]].reshape(b.batch_size, SLOTS)
        idx = [torch.from_numpy(np.ascontiguousarray(per_slot[:, s] - slot_offsets[s])).to(dev)
               for s in range(SLOTS)]
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
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-7, **extra) \
        if optimizer == "adam" else torch.optim.SGD(model.parameters(), lr=lr)
    return model, opt


def _time_torch_graph(env, prepared, sizes, dim, optimizer, lr, min_time, seed, tf32) -> float:
    """PyTorch's step captured whole as one CUDA graph (forward, backward and the optimizer step; Adam
    with capturable=True), replayed on static input tensors that each step's batch is copied into: the
    recipe of torch.cuda.graphs' "whole network capture", as NVIDIA's MLPerf DLRM runs. float32/TF32
    only (GradScaler's unscale and skip read the host)."""
    from .bench import measure
    torch = env.torch
    model, opt = _torch_model_and_optimizer(env, sizes, dim, optimizer, lr, seed, tf32, capturable=True)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    dense, idx, offs, label = (t.clone() if not isinstance(t, list) else [i.clone() for i in t]
                               for t in prepared[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                     # warm-up on a side stream, as capture requires
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
    from .bench import measure
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


def bench_mlperf(env, *, batch: int | None = None, rows: int | None = None, dims=(128,),
                 optimizers=("sgd", "adam"), batches: int = 2, min_time: float = 1.0, breakdown_steps: int = 3,
                 tf32: bool = False, amp: bool = False, seed: int = 0, lr: float | None = None, threads=None, **_):
    """One Table: numbactr's MLPerf DLRM step (and PyTorch's) for each D and optimizer (module docstring).
    On the cpu device each row runs with numbactr's compute threads and torch's set to the same count:
    each of ``threads``, or numbactr's current compute threads (a GPU run leaves both as they are)."""
    from . import bench as B
    from . import threads as T
    from .data.synthetic import criteo_like_slot_sizes, make_planted_dataset
    from .embedding.sparse_embedding import workspace_mb_for

    size = SIZES.get(env.kind, SIZES["cpu"])
    batch = batch or size["batch"]
    rows = rows or size["rows"]
    for name, v in (("batch", batch), ("rows", rows), ("batches", batches), ("breakdown_steps", breakdown_steps)):
        if v < 1:
            raise ValueError(f"bench mlperf: {name} must be >= 1, got {v}")
    if rows < SLOTS:
        raise ValueError(f"bench mlperf: rows must be >= {SLOTS} (one per slot at least), got {rows}")
    tab = B.Table(f"MLPerf DLRM training step ({env.kind})", COLUMNS)
    tab.notes = env.header() + [
        f"model: 13 dense -> {'-'.join(map(str, BOTTOM))}-D, {SLOTS} one-hot slots of width D (hash embedding, "
        f"{rows:,} rows in all), dot interaction, top {'-'.join(map(str, TOP))}, BCE; Update_t.Global",
        "precision: " + ("TF32 allowed" if tf32 else "float32")
        + (", mixed precision (torch: autocast fp16)" if amp else ""),
        "samples/s = batch / median clean step (forward + backward + update; batches in memory); the ms "
        f"breakdown comes from {breakdown_steps} further steps with a device sync around each phase "
        "(embedding = lookup + gradient hand-over + fused backward/update; dense = the fully connected "
        "layers' forward and backward; rest = step - both)",
        "embedding GB/s: FBGEMM's count, 3 x (B*26*D*4 read + B*26*D*4 written) over the embedding phase"]
    if env.peak_gbs:
        tab.notes.append(f"memory bandwidth (the % column): {env.peak_gbs:.0f} GB/s ({env.peak_src})")
    sizes = criteo_like_slot_sizes(SLOTS, rows)
    with tempfile.TemporaryDirectory(prefix="numbactr-mlperf-") as tmp:
        data = make_planted_dataset(os.path.join(tmp, "data"), num_train=batch * batches, num_eval=batch,
                                    dense_dim=DENSE, slot_sizes=sizes, seed=seed, files=(1, 1),
                                    calibration_samples=min(50_000, max(2_000, batch * batches)))
        import numbactr as hugectr
        counts = (None,) if env.kind == "gpu" else tuple(threads or (T.current().compute,))
        for dim, opt, n in itertools.product(dims, optimizers, counts):
            with B.thread_count(env, n):
                step_lr = lr if lr is not None else (0.001 if opt == "adam" else 0.01)
                with contextlib.redirect_stdout(io.StringIO()):
                    model = build_mlperf_dlrm(hugectr, data.train_list, data.eval_list, batch=batch, dim=dim,
                                              optimizer=opt, lr=step_lr,
                                              workspace_mb=workspace_mb_for(rows, dim, 1 if opt == "sgd" else 2) + 1,
                                              tf32=tf32, amp=amp, seed=seed)
                reader = iter(model._make_reader(data.train_list, batch, True))
                host_batches = [next(reader) for _ in range(batches)]
                model.start_data_reading()
                model._train_reader = itertools.cycle(host_batches)
                t = B.measure(model.train, sync=env.sync, min_time=min_time)
                timer = PhaseTimer(model, env.sync)
                env.sync()
                t0 = time.perf_counter()
                with timer:
                    for _ in range(breakdown_steps):
                        model.train()
                    env.sync()
                whole = (time.perf_counter() - t0) / breakdown_steps
                _profiled_step(model, env)
                emb = timer.seconds["embedding"] / breakdown_steps
                dense = timer.seconds["dense"] / breakdown_steps
                if not np.isfinite(model.get_current_loss()):
                    raise AssertionError("bench mlperf: numbactr loss is not finite")
                emb_bytes = 3 * B.embedding_bytes(batch * SLOTS, 1, dim)
                gbs = emb_bytes / emb / 1e9 if emb > 0 else float("nan")
                gb_cell = f"{gbs:.1f}" + (f" ({100 * gbs / env.peak_gbs:.0f}% of measured)" if env.peak_gbs else "")
                tab.add("numbactr", n or "-", opt, dim, batch, rows, 1e3 * t, batch / t, 1e3 * emb, 1e3 * dense,
                        1e3 * max(whole - emb - dense, 0.0), gb_cell)
                del model
                if env.torch is not None:
                    prepared = _prepare_torch(env.torch, env.torch_dev, host_batches, data.slot_offsets)
                    tt = _time_torch(env, prepared, sizes, dim, opt, step_lr, min_time, seed, tf32, amp)
                    label = env.torch_label + ("+tf32" if tf32 else "") + ("+amp" if amp and env.torch_dev == "cuda"
                                                                           else "")
                    tab.add(label, n or "-", opt, dim, batch, rows, 1e3 * tt, batch / tt, "-", "-", "-", "-")
                    if env.torch_dev == "cuda" and not amp:          # torch's step as one CUDA graph too
                        try:
                            tg = _time_torch_graph(env, prepared, sizes, dim, opt, step_lr, min_time, seed, tf32)
                        except Exception as e:   # noqa: BLE001 (a baseline that cannot capture is noted, not fatal)
                            tab.notes.append(f"torch CUDA graph ({opt}, D={dim}) not measured: {type(e).__name__}: {e}")
                        else:
                            tab.add(label + "+graph", n or "-", opt, dim, batch, rows, 1e3 * tg, batch / tg, "-", "-", "-", "-")
    return tab
