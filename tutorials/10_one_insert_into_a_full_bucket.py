# %% [markdown]
# # Tutorial 10: one insert into a full bucket of the evicting table, step by step.
#
# Run:
# ```bash
# NUMBACTR_DEVICE=sim python tutorials/10_one_insert_into_a_full_bucket.py
# ```
#
# An evicting table (numbactr.embedding.evicting.EvictingTable, after NVIDIA's HierarchicalKV, SOK's
# "hybrid" backend) never fills: when a key arrives at a full bucket, the key with the lowest score
# leaves to make room, or the new key is refused when its own score is lower still. Here:
#   1. a tiny table: 2 buckets of 4 slots, rows of width 2, at its maximum capacity;
#   2. kLru: a new key meets a full bucket; the victim is the bucket's minimum score, the lowest slot
#      among equal minima, worked out by hand and then by the NumPy reference (kernels/hkv_ref.py);
#   3. kCustomized and kLfu: scores the caller gives; a new key scoring below the bucket's minimum is
#      refused (reported as evicted, with its own row);
#   4. the same insert through the compiled cpu code (kernels/hkv_cpu.py) and the numba.cuda kernels
#      (kernels/hkv.py) in the simulator: all three give the same table, bit for bit;
#   5. what EvictingTable.insert_and_evict hands back;
#   6. growth: before the maximum is reached the table doubles instead of evicting.
# The modules are imported, never copied; the contract is kernels/hkv_ref.py's docstring.

# %%
import os

# The simulator must be chosen before numba is imported for the first time (numba reads the
# environment once, at import). Section 4 runs the kernels in it, so this tutorial always asks for it.
os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
os.environ["NUMBACTR_DEVICE"] = "sim"

import numpy as np                                            # noqa: E402

from numbactr.embedding.evicting import EvictingTable         # noqa: E402
from numbactr.kernels import hkv as K                         # noqa: E402  (the numba.cuda kernels)
from numbactr.kernels import hkv_cpu as C                     # noqa: E402  (the compiled cpu code)
from numbactr.kernels import hkv_ref as R                     # noqa: E402  (the NumPy reference)
from numbactr.kernels.hkv_math import Arrays, EvictStrategy, Mode, Status  # noqa: E402

np.set_printoptions(precision=3, suppress=True, linewidth=110)
NB, B, D = 2, 4, 2          # buckets, slots per bucket, row width: 8 slots in all


def title(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 70 - len(text)))


def show(t: Arrays) -> None:
    """Each bucket's slots: key (-- where free) and score."""
    for b in range(NB):
        cells = []
        for s in range(b * B, (b + 1) * B):
            key = "--" if t.keys[s] == R.EMPTY else str(t.keys[s])
            cells.append(f"slot {s}: key {key:>2} score {t.scores[s]:>2}")
        print(f"  bucket {b} | " + " | ".join(cells))


def upsert(t, keys, strategy, clock, scores=None, impl=R.upsert_ref):
    """insert_or_assign of keys (row of key k: [k, -k]) on t in place, by impl (upsert_ref by default)."""
    keys = np.asarray(keys, np.uint64)
    given = np.zeros(keys.size, np.uint64) if scores is None else np.asarray(scores, np.uint64)
    rows = np.stack([keys, -keys.astype(np.float64)], axis=1).astype(np.float32)       # (N, D)
    return impl(t, keys, given, rows, rows.copy(), Mode.INSERT_OR_ASSIGN, strategy, clock, 0)


# %% [markdown]
# ## 1. A tiny table, full
# A key's bucket is fmix64(key) % 2 (murmur3's finalizer, as HierarchicalKV's); within its bucket a key
# may sit in any slot. Keys 1, 3, 11, 14 hash to bucket 0; 2, 4, 5, 6 to bucket 1. Under kLru the score
# is a clock of the table that ticks once per batch that writes scores (HierarchicalKV reads the GPU's
# timer instead; a clock per batch is reproducible). We insert bucket 0's keys in one batch (clock 1:
# all four tie), bucket 1's in the next (clock 2), then touch key 1 again (clock 3: a hit updates its
# score). The table is at its maximum capacity: this is where eviction begins.

# %%
title("1. a full table of 2 buckets x 4 slots")
print("buckets of keys 1..6, 11, 14, 16:", dict(zip([1, 2, 3, 4, 5, 6, 11, 14, 16],
      R.bucket_of_ref(np.array([1, 2, 3, 4, 5, 6, 11, 14, 16], np.uint64), NB).tolist())))
t = R.new_arrays(NB, B, D)
upsert(t, [1, 3, 11, 14], EvictStrategy.kLru, clock=1)
upsert(t, [2, 4, 5, 6], EvictStrategy.kLru, clock=2)
status, *_ = upsert(t, [1], EvictStrategy.kLru, clock=3)
print("touching key 1 again:", Status(status[0]).name)
show(t)
assert t.sizes.tolist() == [B, B]

# %% [markdown]
# ## 2. kLru: a new key meets the full bucket 0
# Key 16 hashes to bucket 0, which has no free slot. The victim is the slot with the lowest score; key 1
# (slot 0) was touched at clock 3, keys 3, 11, 14 (slots 1-3) all have clock 1: a tie, which goes to the
# LOWEST slot (np.argmin's first; the kernels scan the bucket with a strict `<`). So key 3 in slot 1
# leaves. A new kLru key is never refused: the clock only grows, so it is never below the minimum.

# %%
title("2. kLru: key 16 into bucket 0")
bucket0 = t.scores[0:B]
victim = int(np.argmin(bucket0))
print(f"scores of bucket 0: {bucket0}  -> minimum {bucket0.min()} at slot {victim} (key {t.keys[victim]})")
status, slots, ev_keys, ev_vals, ev_scores = upsert(t, [16], EvictStrategy.kLru, clock=4)
print(f"status {Status(status[0]).name}: key 16 took slot {slots[0]}; evicted key {ev_keys[0]} "
      f"with its row {ev_vals[0]} and score {ev_scores[0]}")
assert (status[0], slots[0], ev_keys[0]) == (Status.EVICTED, victim, 3)
show(t)

# %% [markdown]
# ## 3. Scores the caller gives: kCustomized and kLfu, and a refused key
# kCustomized stores the score given with each key. Bucket 0 gets keys 1, 3, 11, 14 with scores 30, 10,
# 10, 20. Key 16 with score 15: the minimum is 10, in slots 1 and 2, so slot 1 goes (the lowest).
# Then key 17 with score 5: below the bucket's new minimum (10, slot 2), so it is REFUSED: not stored,
# and reported as evicted with its own key, row and score (insert_and_evict returns it; find_or_insert
# would hand back its initial row, used for the batch but not stored). An equal score is not refused:
# strictly below refuses, equal evicts.
# kLfu adds the given frequency (1 by default) to a key's score on every hit; a new key starts at its
# frequency, so a cold newcomer (1) is refused by a bucket whose keys were all seen twice (2).

# %%
title("3a. kCustomized: key 16 (score 15), then key 17 (score 5)")
tc = R.new_arrays(NB, B, D)
upsert(tc, [1, 3, 11, 14], EvictStrategy.kCustomized, clock=1, scores=[30, 10, 10, 20])
show(tc)
status, slots, ev_keys, _, ev_scores = upsert(tc, [16], EvictStrategy.kCustomized, clock=2, scores=[15])
print(f"key 16: {Status(status[0]).name} into slot {slots[0]}, evicting key {ev_keys[0]} (score {ev_scores[0]})")
assert (status[0], slots[0], ev_keys[0]) == (Status.EVICTED, 1, 3)
status, slots, ev_keys, ev_vals, ev_scores = upsert(tc, [17], EvictStrategy.kCustomized, clock=3, scores=[5])
print(f"key 17: {Status(status[0]).name} (slot {slots[0]}); reported: key {ev_keys[0]}, row {ev_vals[0]}, "
      f"score {ev_scores[0]} < the minimum {tc.scores[0:B].min()}")
assert status[0] == Status.REFUSED and ev_keys[0] == 17 and 17 not in tc.keys
show(tc)

title("3b. kLfu: every key of bucket 0 seen twice, then a newcomer")
tl = R.new_arrays(NB, B, D)
upsert(tl, [1, 3, 11, 14], EvictStrategy.kLfu, clock=1, scores=[1, 1, 1, 1])
upsert(tl, [1, 3, 11, 14], EvictStrategy.kLfu, clock=2, scores=[1, 1, 1, 1])     # hits: 1 + 1
status, *_ = upsert(tl, [16], EvictStrategy.kLfu, clock=3, scores=[1])
print(f"bucket 0 scores {tl.scores[0:B]}; key 16 with frequency 1: {Status(status[0]).name}")
status, slots, ev_keys, *_ = upsert(tl, [16], EvictStrategy.kLfu, clock=4, scores=[2])
print(f"key 16 with frequency 2 (equal to the minimum): {Status(status[0]).name} into slot {slots[0]}, "
      f"evicting key {ev_keys[0]}")
assert status[0] == Status.EVICTED and slots[0] == 0

# %% [markdown]
# ## 4. The same insert, compiled for the cpu and as numba.cuda kernels in the simulator
# kernels/hkv_math.upsert_key is one key meeting its bucket, written once as plain Python: numba.njit
# compiles it for the cpu (kernels/hkv_cpu.py runs a batch's keys in order), numba.cuda for the GPU
# (kernels/hkv.py: one thread per bucket, its keys in input order; here the simulator runs each thread
# as a Python thread). We replay key 16 (evicting) and key 17 (refused) of section 3a on copies of the
# state before them, with each implementation, and compare everything: table and outputs.

# %%
title("4. reference == compiled cpu == numba.cuda (simulator)")
start = R.new_arrays(NB, B, D)
upsert(start, [1, 3, 11, 14], EvictStrategy.kCustomized, clock=1, scores=[30, 10, 10, 20])
results = {}
for name, impl in (("reference", R.upsert_ref), ("compiled cpu", C.upsert_cpu), ("numba.cuda (sim)", K.upsert)):
    s = Arrays(*(a.copy() for a in start))
    out16 = upsert(s, [16], EvictStrategy.kCustomized, clock=2, scores=[15], impl=impl)
    out17 = upsert(s, [17], EvictStrategy.kCustomized, clock=3, scores=[5], impl=impl)
    results[name] = (s, out16, out17)
    print(f"{name:>17}: key 16 {Status(out16[0][0]).name} slot {out16[1][0]} (out: key {out16[2][0]}), "
          f"key 17 {Status(out17[0][0]).name}")
ref_t, ref16, ref17 = results["reference"]
for a, b in zip(ref_t, tc):                          # the reference replay ends where section 3a did
    np.testing.assert_array_equal(a, b)
for name, (s, o16, o17) in results.items():
    for x, y in zip((*s, *o16, *o17), (*ref_t, *ref16, *ref17)):
        np.testing.assert_array_equal(x, y, err_msg=name)
print("all three agree: keys, rows, scores, bucket sizes, statuses, slots and the evicted key, row and score")

# %% [markdown]
# ## 5. What EvictingTable.insert_and_evict returns
# The table users meet keeps HierarchicalKV's method names and picks the implementation for the device
# (here: the numba.cuda kernels, in the simulator). insert_and_evict is insert_or_assign that also hands
# back what left: (evicted_keys, evicted_values, evicted_scores), one entry per evicting or refused key,
# in input order. max_capacity = 8 with buckets of 4: the table starts (and stays) at 2 buckets.

# %%
title("5. EvictingTable.insert_and_evict")
table = EvictingTable(dim=D, init_capacity=8, max_capacity=8, max_bucket_size=B, evict_strategy="kCustomized")
keys = np.array([1, 3, 11, 14], np.uint64)
vals = np.stack([keys, -keys.astype(np.float64)], axis=1).astype(np.float32)
table.insert_or_assign(keys, vals, scores=np.array([30, 10, 10, 20]))
ev_keys, ev_vals, ev_scores = table.insert_and_evict(
    np.array([16, 17]), np.array([[16, -16], [17, -17]], np.float32), scores=np.array([15, 5]))
print(table)
print("evicted keys  :", ev_keys, "  (3 made room for 16; 17 was refused)")
print("evicted values:", ev_vals.tolist(), "  scores:", ev_scores)
np.testing.assert_array_equal(ev_keys, [3, 17])
np.testing.assert_array_equal(ev_scores, [10, 5])
np.testing.assert_array_equal(table.arrays.keys, ref_t.keys)          # the same table as section 4's
rows, found = table.find(np.array([16, 3]))
print("find(16, 3):", rows.tolist(), found.tolist(), "  (find changes no score)")

# %% [markdown]
# ## 6. Growth: double first, evict only at max_capacity
# Before a batch of n keys that may insert, the table doubles while (size + n) > max_load_factor *
# capacity and capacity < max_capacity (HierarchicalKV's rule, the batch counted in); doubling places
# every key anew in a table of twice the buckets. Once at max_capacity it stops growing and evicts.
# Eviction is per bucket: a bucket that is full evicts even while other buckets still have free slots,
# so an evicting table runs a little below its capacity (here 10 to 15 keys of 16).

# %%
title("6. growth from 4 to 16 slots, then eviction")
grow = EvictingTable(dim=D, init_capacity=4, max_capacity=16, max_bucket_size=B, max_load_factor=0.5)
sizes = []
for lo in range(1, 25, 4):                          # 6 batches of 4 new keys (24 keys > 16 slots)
    k = np.arange(lo, lo + 4, dtype=np.uint64)
    out = grow.insert_and_evict(k, np.zeros((4, D), np.float32))
    sizes.append((grow.size(), grow.capacity(), len(out[0])))
print("after each batch (size, capacity, evicted):", sizes)
assert [c for _, c, _ in sizes] == [8, 16, 16, 16, 16, 16] and grow.size() <= 16
assert sum(e for *_, e in sizes) == 24 - grow.size()        # every key is present or was reported

print("\ntutorial 10 OK")
