"""``numbactr bench cache``: a table several times larger than the fast tier's byte budget, trained through
the embedding cache (numbactr.embedding.tiered) on a memory-mapped backing tier; samples/s and hit rate
against the cache's size, LRU and LFU, beside the same engine with the whole table in memory, and a plot.

Workload: one table of V rows x D (float32) read by F features, batches of B samples with L indices per
bag, the rows drawn from a Zipf law (P(rank r) ~ 1 / (r + 1)^alpha, the ranks scattered over the table by a
fixed permutation), EXACT_ROWWISE_ADAGRAD. Each configuration trains 2 x `batches` batches drawn alike:
the first half fills the cache (and compiles), the second is measured: hit rate = hits / lookups of those
batches (every index counted), samples/s = B * batches / their time (forward + backward + update + the
cache's loads and write-backs). The cache's size is a byte budget for the rows' weights, optimizer states
and bookkeeping, as a fraction of what the whole table takes; the backing tier is a file (numpy.memmap)
in a temporary directory, so the operating system's page cache sits between it and the disk (on a
machine whose RAM holds the file, a miss costs a memory copy, not a disk read).
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from numbactr.bench.common import Env, Table, thread_count
from numbactr.embedding.engine import OptimizerSpec, Optim, Precision, TableBatchedEmbedding
from numbactr.embedding.tiered import CacheConfig, TieredEmbedding, slot_bytes
from numbactr.kernels.tbe import STATES

COLUMNS = [
    "impl",
    "policy",
    "cache / table",
    "cache MiB",
    "slots",
    "hit rate",
    "loads/step",
    "write-backs/step",
    "step ms",
    "samples/s",
]
FULL = dict(
    rows=2_000_000,
    dim=64,
    batch=2048,
    features=8,
    hot=4,
    batches=24,
    alpha=1.05,
    fractions=(0.02, 0.05, 0.1, 0.25),
    policies=("lru", "lfu"),
)
QUICK = dict(
    rows=20_000,
    dim=16,
    batch=64,
    features=4,
    hot=2,
    batches=6,
    alpha=1.05,
    fractions=(0.1, 0.25),
    policies=("lru", "lfu"),
)
OPTIMIZER = Optim.EXACT_ROWWISE_ADAGRAD


def zipf_batches(rng, rows: int, batches: int, batch: int, features: int, hot: int, alpha: float) -> list:
    """[(indices (F*B*L,) int64, offsets (F*B + 1,) int64)]: fixed-length bags of Zipf-ranked rows."""
    weights = 1.0 / np.arange(1, rows + 1, dtype=np.float64) ** alpha
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    perm = rng.permutation(rows)
    n = features * batch * hot
    offsets = np.arange(0, n + 1, hot, dtype=np.int64)
    return [
        (perm[np.minimum(np.searchsorted(cdf, rng.random(n)), rows - 1)].astype(np.int64), offsets)
        for _ in range(batches)
    ]


def _run(e, data, dy, prefetch: bool) -> float:
    """Seconds for one pass over the batches (forward, optional prefetch of the next, backward)."""
    t0 = time.perf_counter()
    for k, (idx, off) in enumerate(data):
        out, ctx = e.forward(idx, off)
        if prefetch and k + 1 < len(data):
            e.prefetch(*data[k + 1])
        e.backward(ctx, dy)
    return time.perf_counter() - t0


def bench_cache(
    env: Env,
    *,
    rows: int,
    dim: int,
    batch: int,
    features: int,
    hot: int,
    batches: int,
    alpha: float,
    fractions,
    policies,
    min_time: float = 1.0,
    seed: int = 0,
    plot: str | None = None,
    threads=None,
) -> Table:
    """The table described in the module docstring; `plot`: where to save the hit-rate / samples/s chart
    (PNG; None: no chart). min_time is unused (each configuration runs a fixed number of batches)."""
    del min_time
    rng = np.random.default_rng(seed)
    data = zipf_batches(rng, rows, 2 * batches, batch, features, hot, alpha)
    warm, data = data[:batches], data[batches:]
    opt = OptimizerSpec(OPTIMIZER, learning_rate=0.01)
    state_specs = STATES[OPTIMIZER]
    row_bytes = dim * 4 + sum(np.dtype(d).itemsize * (1 if per_row else dim) for _, per_row, d in state_specs)
    table_bytes = rows * row_bytes
    ftm = [0] * features
    dy = np.random.default_rng(seed + 1).normal(size=(batch, features * dim)).astype(np.float32)
    uniq = max(np.unique(i).size for i, _ in warm + data)
    n_threads = None if threads is None else threads[0]
    tab = Table(
        f"Embedding cache: a {rows:,} x {dim} table ({table_bytes / 2**20:,.0f} MiB with its "
        f"{OPTIMIZER.name} state) behind a cache of a fraction of it",
        COLUMNS,
    )
    tab.notes += env.header() + [
        f"workload: {features} features x batch {batch} x {hot} indices, Zipf alpha {alpha} over the rows "
        f"(scattered), {batches} warm-up then {batches} measured batches, at most {uniq:,} distinct rows "
        "per batch",
        "impl 'in memory': the same engine with the whole table in RAM; 'cached': numbactr.embedding.tiered "
        "with a numpy.memmap backing tier in a temporary directory; '+prefetch': the next batch is staged on "
        "a worker thread during the backward",
        "hit rate, loads (rows read from the backing tier) and write-backs (updated rows written to it) over "
        "the measured batches",
        "cache / table: the cache's byte budget (weights, optimizer state and 29 bytes of bookkeeping per "
        f"slot) over the table's {table_bytes / 2**20:,.0f} MiB; the row -> slot map adds 8 bytes per table "
        f"row ({rows * 8 / 2**20:,.1f} MiB) beside it",
    ]
    results = []
    with thread_count(env, n_threads), tempfile.TemporaryDirectory(prefix="numbactr-bench-cache-") as tmp:
        whole = TableBatchedEmbedding([(rows, dim)], ftm, optimizer=opt)
        whole.init_uniform(-0.05, 0.05)
        _run(whole, warm, dy, False)
        secs = _run(whole, data, dy, False)
        tab.add(
            "in memory", "-", "1", table_bytes / 2**20, rows, 1.0, 0, 0, 1e3 * secs / batches, batch * batches / secs
        )
        del whole
        per_slot = slot_bytes(dim, Precision.FP32, state_specs)
        for frac in fractions:
            for policy in policies:
                for prefetch in (False, True) if policy == policies[0] else (False,):
                    cfg = CacheConfig(policy, budget_bytes=int(frac * table_bytes), prefetch_thread=prefetch)
                    path = os.path.join(tmp, f"{policy}-{frac}-{prefetch}")
                    try:
                        tier = TieredEmbedding(
                            [(rows, dim)], ftm, cache=cfg, backing="memmap", path=path, optimizer=opt
                        )
                    except ValueError as e:
                        tab.notes.append(f"cache {frac}: {e}")
                        continue
                    slots = tier.capacities[0]
                    if slots < (2 if prefetch else 1) * uniq:
                        tab.notes.append(
                            f"cache {frac:g} ({slots:,} slots) skipped with {policy}"
                            f"{' + prefetch' if prefetch else ''}: a batch needs up to {uniq:,}"
                        )
                        tier.close()
                        continue
                    tier.init_uniform(-0.05, 0.05)
                    _run(tier, warm, dy, prefetch)
                    tier.stats.reset()
                    secs = _run(tier, data, dy, prefetch)
                    st = tier.stats
                    label = "cached+prefetch" if prefetch else "cached"
                    tab.add(
                        label,
                        policy,
                        f"{frac:g}",
                        slots * per_slot / 2**20,
                        slots,
                        st.hit_rate,
                        st.unique_misses / batches,
                        st.writebacks / batches,
                        1e3 * secs / batches,
                        batch * batches / secs,
                    )
                    results.append((label, policy, frac, st.hit_rate, batch * batches / secs))
                    tier.close()
    if plot:
        whole_sps = float(tab.rows[0][-1].replace(",", ""))
        save_cache_plot(plot, results, whole_sps, tab.title)
        tab.notes.append(f"plot: {plot}")
    return tab


def save_cache_plot(path, results: list, whole_sps: float, title: str) -> str:
    """Hit rate (left) and samples/s (right) against the cache's share of the table, one line per
    configuration, the in-memory engine's samples/s dashed; PNG at `path` (written whole, then renamed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from numbactr.runtime import atomic

    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig = Figure(figsize=(10, 4.2), dpi=110, layout="constrained")
    ax_hit, ax_sps = fig.subplots(1, 2)
    for k, key in enumerate(sorted({(lab, pol) for lab, pol, *_ in results})):
        pts = sorted((f, h, s) for lab, pol, f, h, s in results if (lab, pol) == key)
        fr = [100 * p[0] for p in pts]
        style = dict(marker="o", color=f"C{k}", label=f"{key[0]} {key[1].upper()}")
        ax_hit.plot(fr, [100 * p[1] for p in pts], **style)
        ax_sps.plot(fr, [p[2] for p in pts], **style)
    ax_sps.axhline(whole_sps, linestyle="--", color="0.3", label="whole table in memory")
    ax_hit.set_ylabel("hit rate (%)")
    ax_sps.set_ylabel("samples / s")
    ticks = sorted({100 * r[2] for r in results})
    for ax in (ax_hit, ax_sps):
        ax.set_xlabel("cache size (% of the table's bytes)")
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(ticks, [f"{t:g}%" for t in ticks])
        ax.grid(True, color="0.9")
        ax.legend(fontsize=9, loc="best")
    fig.suptitle(title, fontsize=10)
    FigureCanvasAgg(fig)
    with atomic.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path
