# %% [markdown]
# # Tutorial 08: a cache miss, an eviction and a write-back, step by step in the simulator.
#
# Run:
# ```bash
# NUMBACTR_DEVICE=sim python tutorials/08_embedding_cache.py
# STEP=1 NUMBACTR_DEVICE=sim python tutorials/08_embedding_cache.py   # stop at each eviction (pdb)
# ```
#
# A tiered table (numbactr/embedding/tiered.py) keeps every row, with its optimizer state, in a large
# backing tier (host memory, or a file) and runs the embedding engine on a small cache of slots in the
# fast tier (the GPU's memory; here the simulator's). Before a batch is looked up its rows are PLACED:
#   1. lookup   each distinct row of the batch: which slot holds it (row_slot), -1 = a miss;
#   2. victims  every slot gets an eviction priority (empty first, then least recently used, or least
#               frequently used); slots used by this batch or pinned by a pending backward are blocked;
#               each table's misses take its lowest-priority slots;
#   3. evict    a victim's row, if it was updated (dirty), is written back to the backing tier: its
#               weights AND its optimizer state, so nothing the optimizer learnt is lost;
#   4. load     the missing rows (weights, state) come from the backing tier into their slots;
#   5. touch    every row of the batch gets the batch clock (LRU) and its occurrence count (LFU).
# Then the engine runs on slot numbers. We step through each stage with the REAL kernels
# (numbactr.kernels.cache, imported, never copied) on copies of the cache's state, check that the tiered
# table did the same, and that training through a 4-slot cache gives exactly the weights and AdaGrad
# state of the same engine holding all 12 rows.

# %%
import os

# The simulator must be chosen before numba is imported for the first time (numba reads the
# environment once, at import). This tutorial is about the simulator, so it always asks for it.
os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
os.environ["NUMBACTR_DEVICE"] = "sim"

import numpy as np                                              # noqa: E402
from numba import cuda                                          # noqa: E402

from numbactr.embedding.engine import OptimizerSpec, Optim, TableBatchedEmbedding  # noqa: E402
from numbactr.embedding.tiered import CacheConfig, TieredEmbedding                # noqa: E402
from numbactr.kernels import cache as K                         # noqa: E402  (the real kernels)

np.set_printoptions(precision=4, suppress=True, linewidth=110)


def title(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 70 - len(text)))


def show(cache) -> None:
    print("  slot_row (slot -> row) :", cache.slot_row)
    print("  stamp    (last batch)  :", cache.stamp, "   dirty:", cache.dirty, "   pins:", cache.pins)


# %% [markdown]
# ## 1. A 12-row table behind a 4-slot cache, and its twin with every row in memory
# One table of 12 rows x 4, one feature, EXACT_ROWWISE_ADAGRAD (a per-row accumulator: the state that
# must travel with its row). The cache holds 4 rows, LRU. `twin` is the same engine without a cache: the
# tiered table must train exactly like it.

# %%
title("1. the tiered table and its twin")
opt = OptimizerSpec(Optim.EXACT_ROWWISE_ADAGRAD, learning_rate=0.5)
tier = TieredEmbedding([(12, 4)], cache=CacheConfig("lru", capacities=[4]), optimizer=opt, impl="kernels")
twin = TableBatchedEmbedding([(12, 4)], optimizer=opt, impl="kernels")
tier.init_uniform(-0.1, 0.1)
twin.init_uniform(-0.1, 0.1)
cache, store = tier.cache, tier.store
weights, accum = store.views(0)[0], store.views(0)[1]          # the backing tier: (12, 4) and (12,)
print("cache slots:", tier.capacities, "  backing tier:", type(store).__name__, weights.shape)
show(cache)


# %% [markdown]
# ## 2. The first batch: four misses into empty slots
# Two samples, bags [1, 2] and [2, 5]: rows 1, 2, 5 are distinct (row 2 twice). We replay the placement
# on copies of the cache's arrays with the kernels, then let the tiered table's forward do it for real.

# %%
title("2. batch 1: lookup, priorities, victims, install")
idx1, off1 = np.array([1, 2, 2, 5]), np.array([0, 2, 4])
u, counts = np.unique(idx1, return_counts=True)                 # (U,) distinct rows, ascending
state = {k: getattr(cache, k).copy() for k in ("slot_row", "row_slot", "stamp", "freq", "pins", "dirty")}
hit = np.empty(u.size, np.int64)
K.lookup(u, state["row_slot"], hit)
print("rows", u, "-> slots", hit, "(all misses)")
prio = np.empty(cache.n_slots, np.int64)
K.priorities(state["slot_row"], state["stamp"], state["freq"], state["pins"], hit, K.LRU, prio)
print("priorities (empty = -1):", prio)
misses = u[hit < 0]
order = np.argsort(prio, kind="stable")                         # one table: its slots by priority
victims = np.empty(misses.size, np.int64)
K.victims(misses, cache.row_offsets, np.searchsorted(misses, cache.row_offsets), cache.slot_offsets, order,
          victims)
evicted, evicted_dirty = np.empty(misses.size, np.int64), np.empty(misses.size, np.int8)
K.install(misses, victims, state["slot_row"], state["row_slot"], state["dirty"], evicted, evicted_dirty)
print("misses", misses, "take slots", victims, "; they held rows", evicted, "(-1: empty, nothing to write back)")

out1, ctx1 = tier.forward(idx1, off1)
np.testing.assert_array_equal(cache.slot_row, state["slot_row"])   # the tiered table placed them alike
print("after the forward:")
show(cache)
print("the engine ran on slots:", ctx1.rows, "(the batch's rows", idx1, ")")

# %% [markdown]
# ## 3. The backward updates the slots; the backing tier is now stale
# The engine's fused backward + rowwise AdaGrad runs on slots 0-2. The rows' new weights and
# accumulators exist only in the cache, which marks them dirty; the backing tier still has the old ones.

# %%
title("3. backward: dirty slots, stale backing rows")
dy = np.random.default_rng(0).normal(size=out1.shape).astype(np.float32)
out_twin, ctx_twin = twin.forward(idx1, off1)
np.testing.assert_array_equal(out1, out_twin)
tier.backward(ctx1, dy)
twin.backward(ctx_twin, dy)
show(cache)
print("row 2 in the cache   :", tier.engine.split_weights()[0][cache.row_slot[2]],
      " accumulator", tier.engine.split_optimizer_states()[0][0][cache.row_slot[2]])
print("row 2 in the backing :", weights[2], " accumulator", accum[2], "  <- stale")

# %% [markdown]
# ## 4. The second batch: a hit, a free slot and two evictions with write-back
# Rows 1, 7, 8, 9. Row 1 is a hit: it keeps slot 0 and blocks it. Three misses need three slots: slot 3
# is empty; the other two are the least recently used of the rest. Rows 2 and 5 were both last used by
# batch 1 (a tie), so the lower slots go first: slots 1 and 2. Both are dirty: rows 2 and 5 are written
# back, weights and accumulators, before rows 8 and 9 are loaded over them.

# %%
title("4. batch 2: eviction and write-back")
idx2, off2 = np.array([7, 1, 8, 9]), np.array([0, 2, 4])
u2 = np.unique(idx2)
hit2 = np.empty(u2.size, np.int64)
K.lookup(u2, cache.row_slot.copy(), hit2)
prio2 = np.empty(cache.n_slots, np.int64)
K.priorities(cache.slot_row, cache.stamp, cache.freq, cache.pins, hit2, K.LRU, prio2)
print("rows", u2, "-> slots", hit2, "; priorities", prio2, "(blocked = int64 max: row 1's slot)")
print(f"expected: {u2[hit2 < 0]} -> slots 3 (empty), 1, 2 (least recently used, ties by slot)")

out2, ctx2 = tier.forward(idx2, off2)
show(cache)
print("row 2 in the backing, written back:", weights[2], " accumulator", accum[2])
print("row 2 in the twin                 :", twin.split_weights()[0][2], " accumulator",
      twin.split_optimizer_states()[0][0][2])
np.testing.assert_array_equal(weights[[2, 5]], twin.split_weights()[0][[2, 5]])
np.testing.assert_array_equal(accum[[2, 5]], twin.split_optimizer_states()[0][0][[2, 5]])
print("stats:", tier.stats)

# %% [markdown]
# ## 5. Walking the evictions inside a kernel (STEP=1 stops here)
# In the simulator every CUDA thread is a Python thread, so `breakpoint()` works inside a kernel. The
# kernel below is this tutorial's own: one thread per miss, it reads what install_kernel read (the victim
# slot, the row it held, its dirty flag) from a replay of batch 2 on batch 1's state. At the (Pdb) prompt
# try `p i, v, old, dirty[v]`, `c`.

# %%
@cuda.jit
def walk_evictions_kernel(misses, victims, slot_row, dirty, step, out):
    for i in range(cuda.grid(1), misses.shape[0], cuda.gridsize(1)):
        v = victims[i]
        old = slot_row[v]
        if step and cuda.threadIdx.x == 0:
            breakpoint()        # (Pdb) p i, v, old, dirty[v]   c
        out[i, 0] = old
        out[i, 1] = dirty[v]


replay = K.place_ref(dict(state, pin=state["pins"], row_freq=np.zeros(12, np.int64),
                          stamp=np.where(state["slot_row"] >= 0, 1, 0)),
                     idx2, cache.slot_offsets, cache.row_offsets, K.LRU, clock=2)
walked = np.zeros((replay["misses"].size, 2), np.int64)
dirty_after_1 = np.where(state["slot_row"] >= 0, 1, 0).astype(np.int8)      # batch 1's backward dirtied them
walk_evictions_kernel[1, 4](replay["misses"], replay["victims"], state["slot_row"], dirty_after_1,
                            os.environ.get("STEP") == "1", walked)
for m, v, (old, d) in zip(replay["misses"], replay["victims"], walked):
    print(f"miss row {m} -> slot {v}: evicts row {old}" + (" (dirty: written back)" if d else ""))
np.testing.assert_array_equal(replay["victims"], [3, 1, 2])

# %% [markdown]
# ## 6. Keep training, then compare the whole table
# A few more batches through the 4-slot cache, with the next batch prefetched before each backward (its
# rows are placed while the current batch's slots stay pinned). flush() writes every dirty row back;
# split_weights() reads the backing tier. Weights and accumulators equal the twin's, bit for bit.

# %%
title("6. more steps, then the whole table")
rng = np.random.default_rng(1)
batches = [(rng.integers(0, 12, size=2), np.array([0, 1, 2])) for _ in range(3)]    # 2 pinned + 2 prefetched
tier.backward(ctx2, dy)
out_twin, ctx_twin = twin.forward(idx2, off2)
twin.backward(ctx_twin, dy)
for k, (idx, off) in enumerate(batches):
    a, ca = tier.forward(idx, off)
    if k + 1 < len(batches):
        tier.prefetch(*batches[k + 1])
    b, cb = twin.forward(idx, off)
    np.testing.assert_array_equal(a, b)
    g = rng.normal(size=a.shape).astype(np.float32)
    tier.backward(ca, g)
    twin.backward(cb, g)
np.testing.assert_array_equal(tier.split_weights()[0], twin.split_weights()[0])
np.testing.assert_array_equal(tier.split_optimizer_states()[0][0], twin.split_optimizer_states()[0][0])
print("12 rows trained through 4 slots == the twin, weights and accumulators;", tier.stats)

print("\ntutorial 08 OK")
