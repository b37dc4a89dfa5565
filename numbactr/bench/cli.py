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
                              breakdown (embedding, GEMMs, the rest, host gaps; numbactr/bench/mlperf.py);
                              --dim 128,16 --optimizer sgd,adam --batch N --rows N --tf32 --amp
    numbactr bench all        the three above
    numbactr bench cache      a table 4-50x larger than its cache's byte budget, trained through the cache
                              on a memory-mapped file: hit rate and samples/s against cache size, LRU and
                              LFU, and a plot (--plot; numbactr/bench/cache.py says more)
    numbactr bench sok        SOK's seed benchmark: a PyTorch model with its native nn.Embedding vs numbactr.sok's
                              All2AllDenseEmbedding, 1 rank and mpiexec -n 2 (numbactr/bench/sok.py)
    --quick                   small shapes (seconds; the smoke test uses it)
    --threads 1,2             thread counts of the embedding and dlrm runs (cpu; default 1,2)

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
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import io
import itertools
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

SUBCOMMANDS = ("hash", "embedding", "dlrm", "all", "cache", "sok")

HASH_COLUMNS = ["impl", "keys", "op", "batch keys", "distinct", "capacity", "ms", "Mkeys/s"]
EMBEDDING_FWD_COLUMNS = ["impl", "threads", "pooling", "B", "features", "L", "D", "rows", "fwd ms", "fwd GB/s"]
EMBEDDING_BWD_COLUMNS = ["impl", "threads", "pooling", "optimizer", "state B/row", "B", "features", "L", "D",
                         "rows", "bwd+upd ms", "bwd+upd GB/s"]
EMBEDDING_PEAK_COLUMNS = ["fwd % peak", "bwd+upd % peak"]      # appended on a GPU (peak: peak_bandwidth)
DLRM_COLUMNS = ["impl", "threads", "batch", "slots", "rows", "D", "step ms", "samples/s"]

#: peak memory bandwidth in GB/s by device-name fragments; the first entry whose fragments all occur
#: in the (lower-cased) name wins, so the more specific names come first
KNOWN_GPU_BANDWIDTH = [
    (("h200",), 4800.0, "H200"),
    (("h100", "pcie"), 2000.0, "H100 PCIe"),
    (("h100",), 3350.0, "H100 SXM"),
    (("a100", "80gb", "pcie"), 1935.0, "A100 80GB PCIe"),
    (("a100", "80gb"), 2039.0, "A100 80GB"),
    (("a100",), 1555.0, "A100 40GB"),
]


# ---- results -----------------------------------------------------------------------------------
@dataclass
class Table:
    """One benchmark's result: a title, context lines and a markdown table."""
    title: str
    columns: list
    rows: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def add(self, *cells) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.title}: {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append([_cell(c) for c in cells])

    def markdown(self) -> str:
        out = [f"### {self.title}", ""]
        out += [f"- {n}" for n in self.notes]
        out += ["", "| " + " | ".join(self.columns) + " |",
                "|" + "|".join("---" if i == 0 else "---:" for i in range(len(self.columns))) + "|"]
        out += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(out) + "\n"


def _cell(v) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, (int, np.integer)):
        return f"{int(v):,}"
    if v is None or not np.isfinite(v):
        return "-"
    v = float(v)
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}" if v < 1 else f"{v:.2f}"


# ---- environment -------------------------------------------------------------------------------
class Env:
    """The device numbactr runs on, its array module and synchronisation, and the torch baseline."""

    def __init__(self, use_torch: bool = True):
        from numbactr.runtime import device
        self.kind = device.kind()
        self.kernels = device.uses_kernels()
        self.xp = device.xp()
        self.device_name = _device_name(self.kind)
        self.torch = None
        self.torch_why = ""
        self.torch_dev = "cpu"
        if not use_torch:
            self.torch_why = "torch baseline skipped (--no-torch)"
        else:
            try:
                import torch
            except ImportError:
                self.torch_why = "torch not installed: no PyTorch baseline (pip install torch to compare)"
            else:
                self.torch = torch
                if self.kind == "gpu" and torch.cuda.is_available():
                    self.torch_dev = "cuda"
        self.peak_gbs, self.peak_src = (None, "")
        if self.kind == "gpu":
            self.peak_gbs, self.peak_src = peak_bandwidth(self.device_name)

    def sync(self) -> None:
        if self.kind == "gpu":
            import cupy
            cupy.cuda.runtime.deviceSynchronize()

    def torch_sync(self) -> None:
        if self.torch is not None and self.torch_dev == "cuda":
            self.torch.cuda.synchronize()

    @property
    def torch_label(self) -> str:
        return f"torch-{self.torch_dev}"

    def header(self) -> list:
        """Context lines every table starts with: device, date, versions."""
        now = datetime.datetime.now().astimezone()
        from numbactr.runtime import threads
        lines = [f"device: {self.kind} ({self.device_name})",
                 f"date: {now.strftime('%Y-%m-%d %H:%M %Z')}",
                 f"numpy {np.__version__}, python {platform.python_version()}",
                 f"{threads.current().describe()} (numbactr.runtime.threads; NUMBACTR_THREADS=N sets the compute "
                 f"threads)"]
        if hasattr(os, "getloadavg"):       # other work on the host skews every figure: say how much
            lines.append(f"host load average (1 min) at start: {os.getloadavg()[0]:.1f} on "
                         f"{os.cpu_count()} cores")
        if self.kind == "sim":
            lines.append("WARNING: device=sim times Numba's CUDA simulator; these are not performance figures")
        if self.torch is not None:
            lines.append(f"torch {self.torch.__version__} on {self.torch_dev}"
                         + (f" ({self.torch.get_num_threads()} threads)" if self.torch_dev == "cpu" else ""))
        else:
            lines.append(self.torch_why)
        return lines


def _device_name(kind: str) -> str:
    if kind == "gpu":
        from numba import cuda
        name = cuda.get_current_device().name
        return name.decode() if isinstance(name, bytes) else str(name)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def known_peak_bandwidth(name: str):
    """(GB/s, label) of a GPU in KNOWN_GPU_BANDWIDTH by its device name, or (None, '')."""
    low = name.lower()
    for frags, gbs, label in KNOWN_GPU_BANDWIDTH:
        if all(f in low for f in frags):
            return gbs, label
    return None, ""


def measure_copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """GB/s of a cupy device-to-device copy (read + write counted)."""
    import cupy
    src = cupy.ones(nbytes // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    dst[...] = src
    cupy.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst[...] = src
    cupy.cuda.runtime.deviceSynchronize()
    return 2.0 * src.nbytes * reps / (time.perf_counter() - t0) / 1e9


def peak_bandwidth(name: str):
    """(GB/s, where it came from): the memory bandwidth the benchmarks' "% peak" columns divide by. The
    measured device-to-device copy (issue 14's goals are fractions of the measured bandwidth; a copy
    reaches about 90% of an H100's spec sheet), with the spec sheet's figure beside it; the spec sheet
    alone when the copy cannot run."""
    gbs, label = known_peak_bandwidth(name)
    spec = f"; {label} spec sheet: {gbs:g} GB/s" if gbs is not None else ""
    try:
        return measure_copy_bandwidth(), "measured cupy device-to-device copy, read + write counted" + spec
    except Exception as e:     # noqa: BLE001 (a benchmark keeps going without the fraction)
        if gbs is not None:
            return gbs, f"{label} spec sheet (the copy failed: {type(e).__name__}: {e})"
        return None, f"unknown ({type(e).__name__}: {e})"


def measure(fn, *, sync=None, setup=None, min_time: float = 1.0, max_reps: int = 50) -> float:
    """Median seconds of fn() after one warm-up call; repeats until min_time has passed (>= 1 rep).

    setup(), when given, runs before every call outside the timed region (e.g. clearing a table).
    """
    sync = sync or (lambda: None)
    if setup:
        setup()
    fn()                                          # warm-up: JIT compilation, first-touch page faults
    sync()
    times = []
    start = time.perf_counter()
    while not times or (time.perf_counter() - start < min_time and len(times) < max_reps):
        if setup:
            setup()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- hash table --------------------------------------------------------------------------------
class TorchKeyIndex:
    """Key -> row as one would write it in plain PyTorch: a sorted key tensor and its rows.

    insert: torch.unique dedups the batch, searchsorted finds known keys, new keys take the next rows
    (in sorted-key order) and the index is re-sorted; find: one searchsorted.
    Keys are int64 (uint64 keys reinterpreted; the order differs but stays consistent).
    """

    def __init__(self, torch, dev: str):
        self.torch, self.dev = torch, dev
        self.clear()

    def clear(self) -> None:
        t = self.torch
        self.keys = t.empty(0, dtype=t.int64, device=self.dev)     # (size,) sorted
        self.rows = t.empty(0, dtype=t.int64, device=self.dev)     # (size,) row of each key
        self.size = 0

    def _lookup(self, keys):
        """(rows (N,) with -1 for absent keys, hit (N,) bool)."""
        t = self.torch
        if self.size == 0:
            return (t.full(keys.shape, -1, dtype=t.int64, device=self.dev),
                    t.zeros(keys.shape, dtype=t.bool, device=self.dev))
        pos = t.searchsorted(self.keys, keys).clamp_(max=self.size - 1)
        hit = self.keys[pos] == keys
        return t.where(hit, self.rows[pos], t.full_like(pos, -1)), hit

    def insert(self, keys):
        t = self.torch
        uniq, inverse = t.unique(keys, return_inverse=True)      # (U,) sorted, (N,)
        urows, hit = self._lookup(uniq)
        new = ~hit
        n_new = int(new.sum())
        if n_new:
            urows[new] = t.arange(self.size, self.size + n_new, dtype=t.int64, device=self.dev)
            merged, order = t.sort(t.cat([self.keys, uniq[new]]))
            self.keys, self.rows = merged, t.cat([self.rows, urows[new]])[order]
            self.size += n_new
        return urows[inverse]

    def find(self, keys):
        return self._lookup(keys)[0]


def hash_keys(dist: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """(n,) uint64 batch keys: 'uniform' over [0, 2**63), or 'power-law' (alpha 1.2 over 10 n keys,
    HugeCTR's generator) — many repeats, like a Criteo slot."""
    if dist == "uniform":
        return rng.integers(0, 2 ** 63 - 1, n, dtype=np.int64).view(np.uint64)
    from numbactr.data.synthetic import power_law_keys
    return power_law_keys(rng, n, 10 * n, 1.2).astype(np.uint64)


def bench_hash(env: Env, *, n: int, load_factor: float = 0.75, min_time: float = 1.0, seed: int = 0) -> Table:
    from numbactr.runtime import device
    from numbactr.embedding.hash_table import HashTable
    tab = Table(f"hash table insert/find ({env.kind})", HASH_COLUMNS)
    tab.notes = env.header() + [
        f"batch of {n:,} keys; table rows = the batch's distinct keys, capacity = rows / {load_factor} "
        f"(load factor {load_factor} once the batch is in)",
        "insert-new: empty table (cleared outside the timer); insert-known: every key already present "
        "(the steady training state); find: every key present",
        "Mkeys/s = batch keys (duplicates included) / median time",
        "numbactr: the table the engine's keyed tables use on this device (" +
        ("numba.cuda kernels" if env.kernels else "compiled CPU code" if device.compiled_cpu()
         else "the NumPy reference") + ")",
        "torch: torch.unique dedup + sorted keys with searchsorted (re-sorted on insert)"]
    rng = np.random.default_rng(seed)
    for dist in ("uniform", "power-law"):
        keys_h = hash_keys(dist, n, rng)                                # (N,) uint64
        distinct = int(np.unique(keys_h).size)
        keys = env.xp.asarray(keys_h)
        # the path the engine's keyed tables take on this device: the kernels (gpu/sim), else the
        # compiled CPU table (or the NumPy reference where the cpu device runs its references only)
        table = HashTable(distinct, load_factor=load_factor, use_kernels=env.kernels, xp=env.xp,
                          compiled=not env.kernels and device.compiled_cpu())
        inserted = {}

        def insert():
            inserted["rows"] = table.insert(keys)

        t_new = measure(insert, sync=env.sync, setup=table.clear, min_time=min_time)
        t_known = measure(insert, sync=env.sync, min_time=min_time)
        t_find = measure(lambda: table.find(keys), sync=env.sync, min_time=min_time)
        found = np.asarray(_host(table.find(keys)))
        if table.size != distinct or not np.array_equal(found, _host(inserted["rows"])):
            raise AssertionError(f"bench hash: numbactr table disagrees with itself ({dist})")
        for op, t in (("insert-new", t_new), ("insert-known", t_known), ("find", t_find)):
            tab.add("numbactr", dist, op, n, distinct, table.capacity, 1e3 * t, n / t / 1e6)

        if env.torch is not None:
            torch = env.torch
            tkeys = torch.from_numpy(keys_h.view(np.int64)).to(env.torch_dev)
            idx = TorchKeyIndex(torch, env.torch_dev)
            out = {}

            def tinsert():
                out["rows"] = idx.insert(tkeys)

            s_new = measure(tinsert, sync=env.torch_sync, setup=idx.clear, min_time=min_time)
            s_known = measure(tinsert, sync=env.torch_sync, min_time=min_time)
            s_find = measure(lambda: idx.find(tkeys), sync=env.torch_sync, min_time=min_time)
            if idx.size != distinct or not torch.equal(idx.find(tkeys), out["rows"]):
                raise AssertionError(f"bench hash: torch key index disagrees with itself ({dist})")
            for op, t in (("insert-new", s_new), ("insert-known", s_known), ("find", s_find)):
                tab.add(env.torch_label, dist, op, n, distinct, "-", 1e3 * t, n / t / 1e6)
        del table, keys
    return tab


def _host(a) -> np.ndarray:
    from numbactr.runtime import device
    return device.to_host(a)


# ---- embedding bag (TBE) -----------------------------------------------------------------------
#: the optimizers of `bench embedding`: numbactr's engine kind, FBGEMM's OptimType name (None: FBGEMM's
#: CPU build lacks it), torch's nearest optimizer for sparse gradients
EMBEDDING_OPTIMIZERS = {
    "sgd": ("EXACT_SGD", "EXACT_SGD", "SGD"),
    "rowwise_adagrad": ("EXACT_ROWWISE_ADAGRAD", "EXACT_ROWWISE_ADAGRAD", "Adagrad"),
    "adam": ("ADAM", "ADAM", "SparseAdam"),
}
EMBEDDING_LR = {"sgd": 0.01, "rowwise_adagrad": 0.01, "adam": 0.001}


def embedding_bytes(nbags: int, hot: int, dim: int) -> int:
    """FBGEMM's forward byte count: rows read nbags*L*D*4 + output written nbags*D*4 (float32)."""
    return nbags * hot * dim * 4 + nbags * dim * 4


def state_bytes_per_row(impl: str, optimizer: str, dim: int) -> int:
    """Optimizer-state bytes per table row (float32 states): rowwise AdaGrad 1 value, Adam 2 x D; torch's
    Adagrad keeps D values (it has no rowwise form)."""
    per_element = {"sgd": 0, "rowwise_adagrad": 0, "adam": 2}[optimizer]
    per_row = 1 if optimizer == "rowwise_adagrad" else 0
    if impl.startswith("torch") and optimizer == "rowwise_adagrad":
        per_element, per_row = 1, 0
    return 4 * (per_element * dim + per_row)


def fbgemm_training_module():
    """fbgemm_gpu's training TBE module, or None when fbgemm_gpu is not installed (or fails to load)."""
    import importlib.util
    import warnings
    if importlib.util.find_spec("fbgemm_gpu") is None:
        return None
    with warnings.catch_warnings():               # fbgemm_gpu warns about its own missing SSD modules
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            from fbgemm_gpu import split_table_batched_embeddings_ops_training as fb
        except (ImportError, OSError, RuntimeError):
            return None
    return fb


@contextlib.contextmanager
def thread_count(env: Env, n):
    """numbactr's compute threads (numbactr.runtime.threads: BLAS + numba) and torch's intra-op threads (which
    FBGEMM's CPU kernels use) set to n inside; n = None leaves them (a GPU run)."""
    if n is None:
        yield
        return
    from numbactr.runtime import threads
    before = threads.current()
    torch_before = env.torch.get_num_threads() if env.torch is not None else None
    threads.configure(compute=n, reader_workers=before.reader_workers)
    if env.torch is not None:
        env.torch.set_num_threads(n)
    try:
        yield
    finally:
        threads.configure(compute=before.compute, reader_workers=before.reader_workers)
        if env.torch is not None:
            env.torch.set_num_threads(torch_before)


def _peak_cells(env, gbs_list) -> list:
    return [f"{100 * g / env.peak_gbs:.1f}%" for g in gbs_list] if env.peak_gbs else []


def bench_embedding(env: Env, *, batch: int, features: int, hots, dims, rows: int, poolings=("sum", "mean"),
                    optimizers=tuple(EMBEDDING_OPTIMIZERS), threads=(1, 2), min_time: float = 1.0,
                    seed: int = 0) -> list:
    """TBE forward and backward + fused update: numbactr's engine, torch nn.EmbeddingBag + its optimizer,
    FBGEMM's TBE (when installed), side by side per thread count; returns [forward Table, backward Table]."""
    fb = fbgemm_training_module()
    threads = (None,) if env.kind == "gpu" else tuple(threads)
    fwd = Table(f"TBE forward ({env.kind})", EMBEDDING_FWD_COLUMNS + (EMBEDDING_PEAK_COLUMNS[:1] if env.peak_gbs else []))
    bwd = Table(f"TBE backward + fused optimizer update ({env.kind})",
                EMBEDDING_BWD_COLUMNS + (EMBEDDING_PEAK_COLUMNS[1:] if env.peak_gbs else []))
    nbags = batch * features
    notes = env.header() + [
        f"one float32 table of {rows:,} rows read by {features} features x B={batch:,} samples: nbags = "
        f"{nbags:,} bags of L indices each (rows uniform at random), pooling sum or mean",
        "numbactr: numbactr.embedding.engine.TableBatchedEmbedding (forward; backward = sort/segment by row "
        f"+ the fused optimizer), impl {_engine_impl()}; fbgemm: fbgemm_gpu's SplitTableBatchedEmbedding"
        "BagsCodegen (" + ("installed" if fb is not None else "not installed: pip install -e '.[fbgemm]'") +
        "); torch: nn.EmbeddingBag(sparse=True) + torch.optim SGD / Adagrad (elementwise: torch has no "
        "rowwise AdaGrad) / SparseAdam",
        "GB/s as FBGEMM counts: forward bytes = nbags*L*D*4 (rows read) + nbags*D*4 (output); backward + "
        "update bytes = 2 x forward bytes; 'state B/row' = optimizer-state bytes per table row",
        "threads: numbactr's compute threads (numbactr.runtime.threads: numba + BLAS) and torch.set_num_threads "
        "(torch and FBGEMM's CPU kernels) set to the column's value for that row",
        f"learning rates {EMBEDDING_LR}; FBGEMM's CPU build has no ADAM (CUDA only): no fbgemm adam rows"]
    if env.kind == "gpu":
        notes.append(f"peak memory bandwidth: {env.peak_gbs or '?'} GB/s ({env.peak_src})")
    fwd.notes = bwd.notes = notes
    rng = np.random.default_rng(seed)
    for dim in dims:
        pool_h = rng.uniform(-0.05, 0.05, (rows, dim)).astype(np.float32)           # (V, D)
        for hot in hots:
            n = nbags * hot
            shape = [batch, features, hot, dim, rows]
            data = dict(pool=pool_h, indices=rng.integers(0, rows, n, dtype=np.int64),      # (N,)
                        offsets=np.arange(0, n + 1, hot, dtype=np.int64),                   # (nbags + 1,)
                        dy=rng.standard_normal((batch, features * dim)).astype(np.float32))  # (B, F*D)
            nbytes = embedding_bytes(nbags, hot, dim)
            for pooling in poolings:
                for n_threads in threads:
                    with thread_count(env, n_threads):
                        label = "-" if n_threads is None else n_threads
                        expect = None
                        for impl, runner in _embedding_impls(env, fb):
                            for i, opt in enumerate(optimizers):
                                got = runner(env, data, features, pooling, opt, min_time, fwd=i == 0)
                                # the tables, states and last gradients (GBs at full size) sit in reference
                                # cycles (engine <-> impl, modules); free them before the next one is built
                                gc.collect()
                                if got is None:
                                    continue
                                t_f, t_b, out = got
                                if t_f is not None:
                                    expect = _agree(impl, out, expect, pooling)
                                    fwd.add(impl, label, pooling, *shape, 1e3 * t_f, nbytes / t_f / 1e9,
                                            *_peak_cells(env, [nbytes / t_f / 1e9]))
                                bwd.add(impl, label, pooling, opt, state_bytes_per_row(impl, opt, dim), *shape,
                                        1e3 * t_b, 2 * nbytes / t_b / 1e9,
                                        *_peak_cells(env, [2 * nbytes / t_b / 1e9]))
            del data
    return [fwd, bwd]


def _engine_impl() -> str:
    from numbactr.embedding.engine import TableBatchedEmbedding
    return TableBatchedEmbedding([(1, 1)]).impl


def _agree(impl, out, expect, pooling):
    """The first impl's forward output is the reference; every other must agree with it."""
    if expect is None:
        return out
    if not np.allclose(out, expect, rtol=1e-4, atol=1e-5):
        raise AssertionError(f"bench embedding: {impl} and numbactr forward ({pooling}) differ by "
                             f"{np.abs(out - expect).max():.3g}")
    return expect


def _embedding_impls(env, fb) -> list:
    impls = [("numbactr", _numbactr_tbe)]
    if env.torch is not None:
        impls.append((env.torch_label, _torch_embedding_bag))
        if fb is not None:
            impls.append(("fbgemm", lambda *a, **k: _fbgemm_tbe(fb, *a, **k)))
    return impls


def _numbactr_tbe(env, data, features, pooling, opt, min_time, fwd):
    """(forward s or None, backward + update s, forward output (B, F*D) on the host)."""
    from numbactr.embedding.engine import Optim, OptimizerSpec, Pooling, TableBatchedEmbedding
    xp = env.xp
    kind = Optim[EMBEDDING_OPTIMIZERS[opt][0]]
    eng = TableBatchedEmbedding([data["pool"].shape], [0] * features, pooling=Pooling[pooling.upper()],
                                optimizer=OptimizerSpec(kind, EMBEDDING_LR[opt]))
    eng.split_weights()[0][...] = xp.asarray(data["pool"])
    idx, offs, dy = (xp.asarray(data[k]) for k in ("indices", "offsets", "dy"))
    out = _host(eng.forward(idx, offs)[0])
    t_f = measure(lambda: eng.forward(idx, offs), sync=env.sync, min_time=min_time) if fwd else None
    held = {}

    def setup():
        held["ctx"] = eng.forward(idx, offs)[1]

    t_b = measure(lambda: eng.backward(held["ctx"], dy), sync=env.sync, setup=setup, min_time=min_time)
    return t_f, t_b, out


def _time_torch_module(env, module, inputs, dy, opt, min_time, fwd):
    """(forward s or None, backward (+ torch optimizer step) s, forward output on the host)."""
    out = module(*inputs).detach().cpu().numpy()
    t_f = measure(lambda: module(*inputs), sync=env.torch_sync, min_time=min_time) if fwd else None
    held = {}

    def setup():
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        held["out"] = module(*inputs)

    def backward_update():
        held["out"].backward(dy)
        if opt is not None:
            # torch's sparse Adagrad builds coalesced tensors; say that no invariant check is wanted (else
            # torch warns that it skips them implicitly)
            with env.torch.sparse.check_sparse_tensor_invariants(enable=False):
                opt.step()

    t_b = measure(backward_update, sync=env.torch_sync, setup=setup, min_time=min_time)
    return t_f, t_b, out


def _torch_embedding_bag(env, data, features, pooling, opt, min_time, fwd):
    torch, dev = env.torch, env.torch_dev
    pool = data["pool"]
    bag = torch.nn.EmbeddingBag(pool.shape[0], pool.shape[1], mode=pooling, sparse=True,
                                include_last_offset=True, device=dev)
    with torch.no_grad():
        bag.weight.copy_(torch.from_numpy(pool))
    optim = getattr(torch.optim, EMBEDDING_OPTIMIZERS[opt][2])(bag.parameters(), lr=EMBEDDING_LR[opt])
    idx, offs, dy = (torch.from_numpy(data[k]).to(dev) for k in ("indices", "offsets", "dy"))
    batch = dy.shape[0]

    class Bags(torch.nn.Module):
        """The bags are feature-major (f*B + b): output row f*B + b is column block f of sample b."""
        def forward(self, i, o):
            return bag(i, o).view(features, batch, -1).transpose(0, 1).reshape(batch, -1)    # (B, F*D)

    return _time_torch_module(env, Bags(), (idx, offs), dy, optim, min_time, fwd)


def _fbgemm_tbe(fb, env, data, features, pooling, opt, min_time, fwd):
    torch = env.torch
    name = EMBEDDING_OPTIMIZERS[opt][1]
    gpu = env.torch_dev == "cuda"
    if not gpu and name not in ("EXACT_SGD", "EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD"):
        return None                                      # FBGEMM's CPU build runs these three only
    pool = data["pool"]
    location = fb.EmbeddingLocation.DEVICE if gpu else fb.EmbeddingLocation.HOST
    compute = fb.ComputeDevice.CUDA if gpu else fb.ComputeDevice.CPU
    tbe = fb.SplitTableBatchedEmbeddingBagsCodegen(
        [(pool.shape[0], pool.shape[1], location, compute)], feature_table_map=[0] * features,
        optimizer=getattr(fb.OptimType, name), learning_rate=EMBEDDING_LR[opt],
        pooling_mode=getattr(fb.PoolingMode, pooling.upper()))
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(torch.from_numpy(pool))
    idx, offs, dy = (torch.from_numpy(data[k]).to(env.torch_dev) for k in ("indices", "offsets", "dy"))
    return _time_torch_module(env, tbe, (idx, offs), dy, None, min_time, fwd)


# ---- DLRM --------------------------------------------------------------------------------------
def bench_dlrm(env: Env, *, batch: int, batches: int, total_rows: int, threads=(1, 2), min_time: float = 1.0,
               seed: int = 0, lr: float = 1e-3) -> Table:
    """One training step of a 26-slot DLRM: numbactr's HugeCTR model, plain PyTorch (nn.EmbeddingBag), and the
    same PyTorch DLRM with its embeddings in one TBE: numbactr's FBGEMM face and FBGEMM (when installed)."""
    from numbactr import demo
    from numbactr.data.synthetic import criteo_like_slot_sizes, make_planted_dataset
    from numbactr.embedding.sparse_embedding import workspace_mb_for

    slots, vec, dense_dim = 26, 16, 13
    tab = Table(f"DLRM training step ({env.kind})", DLRM_COLUMNS)
    tab.notes = env.header() + [
        f"numbactr.demo.build_dlrm: 13 dense -> 64-32-16, {slots} one-hot slots of width {vec} (hash "
        f"embedding), dot interaction, 128-64-1, BCE, Adam (Update_t.Global); {total_rows:,} embedding rows",
        f"data: make_planted_dataset (Norm files), {batches} batches read into memory first and cycled; "
        "samples/s = batch / median step time (forward + backward + update)",
        "torch: the same layer widths, one nn.EmbeddingBag per slot (dense gradients), dot interaction "
        "with HugeCTR's output layout [dense | strict lower triangle | 0 pad], BCEWithLogitsLoss, "
        "torch.optim.Adam over all parameters (every embedding row moves each step, as HugeCTR's "
        "Adam Global does)",
        "torch+numbactr-tbe / torch+fbgemm-tbe: that PyTorch DLRM with its 26 tables in one "
        "SplitTableBatchedEmbeddingBagsCodegen (numbactr.fbgemm_gpu / fbgemm_gpu), whose fused "
        "EXACT_ROWWISE_ADAGRAD (lr 0.01) updates the rows read in the step (FBGEMM's CPU build has no Adam); "
        "torch.optim.Adam for the MLPs",
        "numbactr's HugeCTR model runs its SparseEmbedding on the same engine: the 26 slots are one fused lookup "
        "of one keyed table, and the update is the engine's fused backward + HugeCTR's Adam (Global)",
        "threads: numbactr.runtime.threads' compute threads and torch.set_num_threads set to the column's value"]
    if env.kind == "cpu":
        from numbactr.runtime import device
        tab.notes.append("numbactr's dense ops on cpu: " + (
            "their compiled CPU versions (numba.njit: interaction, bias, ReLU, BCE, the dense update; matrix "
            "products in BLAS)" if device.compiled_cpu() else
            "their NumPy references (NUMBACTR_CPU_REFERENCE=1; the engine runs its reference impl too)"))
    sizes = criteo_like_slot_sizes(slots, total_rows)
    with tempfile.TemporaryDirectory(prefix="numbactr-bench-") as tmp:
        data = make_planted_dataset(os.path.join(tmp, "data"), num_train=batch * batches, num_eval=batch,
                                    dense_dim=dense_dim, slot_sizes=sizes, seed=seed, files=(1, 1),
                                    calibration_samples=min(50_000, max(2_000, batch * batches)))
        import numbactr as hugectr
        with contextlib.redirect_stdout(io.StringIO()):           # keep the tables readable
            model = demo.build_dlrm(hugectr, data.train_list, data.eval_list, batch=batch, batch_eval=batch,
                                    eval_batches=1, lr=lr, workspace_mb=workspace_mb_for(total_rows, vec, 2) + 1,
                                    vec=vec, slots=slots, dense=dense_dim, seed=seed)
        reader = iter(model._make_reader(data.train_list, batch, True))
        host_batches = [next(reader) for _ in range(batches)]
        model.start_data_reading()                               # opens the files, so inside the folder
        model._train_reader = itertools.cycle(host_batches)      # the step without file reading
        impls = [("numbactr", lambda: measure(model.train, sync=env.sync, min_time=min_time))]
        if env.torch is not None:
            from numbactr.fbgemm_gpu import split_table_batched_embeddings_ops_training as ours
            fb = fbgemm_training_module()
            for label, tbe in [(env.torch_label, None), ("torch+numbactr-tbe", ours)] + \
                    ([("torch+fbgemm-tbe", fb)] if fb is not None else []):
                impls.append((label, lambda tbe=tbe: _torch_dlrm(env, host_batches, sizes, data.slot_offsets,
                                                                 dense_dim, vec, lr, min_time, seed, tbe)))
        for n_threads in ((None,) if env.kind == "gpu" else tuple(threads)):
            with thread_count(env, n_threads):
                for label, timed in impls:
                    t = timed()
                    gc.collect()                     # the previous model's tables before the next one
                    tab.add(label, "-" if n_threads is None else n_threads, batch, slots, total_rows, vec,
                            1e3 * t, batch / t)
    if not np.isfinite(model.get_current_loss()):
        raise AssertionError("bench dlrm: numbactr loss is not finite")
    return tab


def torch_dlrm(torch, slot_sizes, dense_dim: int = 13, vec: int = 16, tbe=None):
    """Plain-PyTorch DLRM with numbactr.demo.build_dlrm's widths and HugeCTR's interaction layout.

    tbe: None for one nn.EmbeddingBag per slot (forward(dense, [indices per slot], [offsets per slot]));
    else an FBGEMM-style training module (fbgemm_gpu's or numbactr.fbgemm_gpu's
    split_table_batched_embeddings_ops_training) whose SplitTableBatchedEmbeddingBagsCodegen holds every
    slot as a table, with the fused EXACT_ROWWISE_ADAGRAD (forward(dense, indices, offsets), FBGEMM's CSR)."""
    nn = torch.nn
    slots = len(slot_sizes)
    n = slots + 1
    width = vec + n * (n - 1) // 2 + 1

    class DLRM(nn.Module):
        def __init__(self):
            super().__init__()
            if tbe is None:
                self.emb = nn.ModuleList(nn.EmbeddingBag(int(v), vec, mode="sum") for v in slot_sizes)
            else:
                cuda = torch.cuda.is_available() and tbe.get_available_compute_device().name == "CUDA"
                where = (tbe.EmbeddingLocation.DEVICE, tbe.ComputeDevice.CUDA) if cuda else \
                    (tbe.EmbeddingLocation.HOST, tbe.ComputeDevice.CPU)
                self.emb = tbe.SplitTableBatchedEmbeddingBagsCodegen(
                    [(int(v), vec, *where) for v in slot_sizes], optimizer=tbe.OptimType.EXACT_ROWWISE_ADAGRAD,
                    learning_rate=0.01)
                self.emb.init_embedding_weights_uniform(-0.05, 0.05)
            self.bottom = nn.Sequential(nn.Linear(dense_dim, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                                        nn.Linear(32, vec), nn.ReLU())
            self.top = nn.Sequential(nn.Linear(width, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                                     nn.Linear(64, 1))
            # torch.tril_indices lists the strict lower triangle row-major: (1,0), (2,0), (2,1), ...
            # which is HugeCTR's column order for the pairs
            self.register_buffer("tril", torch.tril_indices(n, n, offset=-1))

        def forward(self, dense, idx, offsets):
            x = self.bottom(dense)                                              # (B, vec)
            if tbe is None:
                z = torch.stack([x] + [e(i, o) for e, i, o in zip(self.emb, idx, offsets)], 1)   # (B, n, vec)
            else:
                z = torch.cat([x[:, None], self.emb(idx, offsets).view(x.shape[0], slots, vec)], 1)
            m = torch.bmm(z, z.transpose(1, 2))                                  # (B, n, n)
            pairs = m[:, self.tril[0], self.tril[1]]                             # (B, n(n-1)/2)
            pad = torch.zeros(x.shape[0], 1, dtype=x.dtype, device=x.device)
            return self.top(torch.cat([x, pairs, pad], 1))                       # (B, 1) logits

    return DLRM()


def _torch_dlrm(env, host_batches, sizes, slot_offsets, dense_dim, vec, lr, min_time, seed, tbe=None) -> float:
    torch, dev = env.torch, env.torch_dev
    torch.manual_seed(seed)
    model = torch_dlrm(torch, sizes, dense_dim, vec, tbe).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-7)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    slots = len(sizes)
    prepared = []
    for b in host_batches:                       # per-slot (indices, offsets) tensors, prepared up front
        keys, offsets = b.sparse[0]                                             # bag j = sample * S + slot
        keys = np.asarray(keys, dtype=np.int64)
        nnz = np.diff(offsets).reshape(b.batch_size, slots)                     # (B, S)
        idx, offs = [], []
        for s in range(slots):
            bags = np.arange(b.batch_size) * slots + s                          # (B,) this slot's bags
            take = np.concatenate([np.arange(offsets[j], offsets[j + 1]) for j in bags]) \
                if (nnz[:, s] != 1).any() else offsets[bags]                    # one-hot: one key per bag
            idx.append(torch.from_numpy(keys[take] - slot_offsets[s]).to(dev))  # slot-local rows
            offs.append(torch.from_numpy(np.concatenate([[0], np.cumsum(nnz[:, s])[:-1]])).to(dev))
        if tbe is not None:                      # one CSR for all slots, feature-major (FBGEMM's)
            idx = torch.cat(idx)
            offs = torch.from_numpy(np.concatenate([[0], np.cumsum(nnz.T.reshape(-1))])).to(dev)
        prepared.append((torch.from_numpy(b.dense).to(dev), idx, offs, torch.from_numpy(b.label).to(dev)))
    it = itertools.cycle(prepared)
    last = {}

    def step():
        dense, idx, offs, label = next(it)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(dense, idx, offs), label)
        loss.backward()
        opt.step()
        last["loss"] = loss

    t = measure(step, sync=env.torch_sync, min_time=min_time)
    if not torch.isfinite(last["loss"]).item():
        raise AssertionError("bench dlrm: torch loss is not finite")
    return t


# ---- SOK ---------------------------------------------------------------------------------------
SOK_FULL = dict(batch=8192, reps=5)             # SOK's batch per GPU
SOK_QUICK = dict(batch=64, reps=2, threads=(1,), shape=dict(layers=2, width=64), timeout=180)


def _bench_sok(env: Env, **kwargs) -> Table:
    """SOK's seed benchmark (numbactr/bench/sok.py; needs torch)."""
    from numbactr.bench.sok import bench_sok
    return bench_sok(env, **kwargs)


# ---- command line ------------------------------------------------------------------------------
FULL = dict(hash=dict(n=1_000_000),
            embedding=dict(batch=8192, features=26, hots=(1, 20), dims=(16, 64, 128), rows=1_000_000),
            dlrm=dict(batch=4096, batches=8, total_rows=200_000))
QUICK = dict(hash=dict(n=20_000),
             embedding=dict(batch=64, features=26, hots=(1, 4), dims=(16,), rows=10_000, threads=(1,)),
             dlrm=dict(batch=128, batches=2, total_rows=5_000, threads=(1,)))


def run(which: str, env: Env, *, quick: bool = False, min_time: float | None = None, seed: int = 0,
        out=None, options: dict | None = None) -> list:
    """Run one benchmark ('hash', 'embedding', 'dlrm') or 'all'; print and return the Tables.

    options: per benchmark, keyword arguments over the sizes (e.g. {'embedding': {'threads': (1,)}})."""
    out = out or sys.stdout
    sizes = QUICK if quick else FULL
    min_time = (0.05 if quick else 1.0) if min_time is None else min_time
    from numbactr.runtime import log
    from numbactr.bench import cache as bench_cache
    fns = {"hash": bench_hash, "embedding": bench_embedding, "dlrm": bench_dlrm}
    names = list(fns) if which == "all" else [which]
    fns["cache"] = bench_cache.bench_cache
    sizes = {**sizes, "cache": bench_cache.QUICK if quick else bench_cache.FULL}
    fns["sok"] = _bench_sok                     # not in 'all': it launches mpiexec itself
    sizes = {**sizes, "sok": SOK_QUICK if quick else SOK_FULL}
    tables = []
    with log.progress(total=len(names), desc="numbactr bench", unit="benchmark") as bar:
        for name in names:
            made = fns[name](env, min_time=min_time, seed=seed, **{**sizes[name], **(options or {}).get(name, {})})
            for tab in made if isinstance(made, list) else [made]:      # embedding: forward, backward
                print(tab.markdown(), file=out, flush=True)
                tables.append(tab)
            bar.update(1)
    return tables


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="numbactr bench", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("what", choices=SUBCOMMANDS, help="which benchmark (all: the three, one table each)")
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke run, seconds)")
    ap.add_argument("--min-time", type=float, default=None,
                    help="seconds of repetitions per measurement (default 1, --quick 0.05)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    ap.add_argument("--seed", type=int, default=0, help="seed of the generated keys and data (default: %(default)s)")
    ap.add_argument("--plot", default="runs/bench/cache_hit_rate.png",
                    help="bench cache: where to save its chart (default: %(default)s)")
    ap.add_argument("--threads", type=_thread_list, default=None,
                    help="comma-separated thread counts for embedding and dlrm (default 1,2; --quick 1; --model mlperf: numbactr's compute threads), set for numbactr and torch alike")
    ap.add_argument("--model", choices=("demo", "mlperf"), default="demo",
                    help="bench dlrm: the demo's small DLRM (default) or the MLPerf DLRM shape")
    ap.add_argument("--dim", type=_dim_list, default=(128,),
                    help="bench dlrm --model mlperf: embedding widths, 128 and/or 16 (default 128)")
    ap.add_argument("--optimizer", type=_optimizer_list, default=("sgd", "adam"),
                    help="bench dlrm --model mlperf: sgd and/or adam (default sgd,adam)")
    ap.add_argument("--batch", type=int, default=None,
                    help="bench dlrm --model mlperf: batch size (default 65536 on a GPU, 2048 on cpu)")
    ap.add_argument("--rows", type=int, default=None,
                    help="bench dlrm --model mlperf: embedding rows over the 26 tables (default 8M on a GPU, "
                         "20K on cpu)")
    ap.add_argument("--tf32", action="store_true", help="bench dlrm --model mlperf: TF32 matrix products")
    ap.add_argument("--amp", action="store_true", help="bench dlrm --model mlperf: mixed precision")
    args = ap.parse_args(argv)
    mlperf_only = [f"--{k}" for k in ("batch", "rows") if getattr(args, k) is not None] + \
        [f"--{k}" for k in ("tf32", "amp") if getattr(args, k)]
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
        sizes = {**quick, **{k: getattr(args, k) for k in ("batch", "rows") if getattr(args, k) is not None}}
        tab = bench_mlperf(env, dims=args.dim, optimizers=args.optimizer, tf32=args.tf32, amp=args.amp,
                           seed=args.seed, min_time=(0.05 if args.quick else 1.0) if args.min_time is None
                           else args.min_time, threads=args.threads, **sizes)
        print(tab.markdown(), flush=True)
        return 0
    options = {} if args.threads is None else {k: {"threads": args.threads}
                                                for k in ("embedding", "dlrm", "cache", "sok")}
    options.setdefault("cache", {})["plot"] = args.plot
    run(args.what, env, quick=args.quick, min_time=args.min_time, seed=args.seed, options=options)
    return 0


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
