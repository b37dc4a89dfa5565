# %% [markdown]
# # Tutorial 07: the fused backward + optimizer of the embedding engine, step by step in the simulator.
#
# Run:
# ```bash
# NUMBACTR_DEVICE=sim python tutorials/07_fused_backward_optimizer.py
# STEP=1 NUMBACTR_DEVICE=sim python tutorials/07_fused_backward_optimizer.py   # stop inside a segment (pdb)
# ```
#
# The engine (numbactr/embedding/engine.py) looks up every feature of every table in one launch, and its
# backward updates every row the batch touched in one more launch, without ever building a dense
# (rows x D) gradient and without float atomics. In between, the occurrences of each row are brought
# together:
#   1. linearize  every occurrence gets its linear row id (table offset + row) and its bag;
#   2. sort       a STABLE sort of the linear ids: occurrences of one row end up side by side, still in
#                 the order they had in the batch (CUB's radix sort through CuPy on a GPU; NumPy here);
#   3. segment    a flag where a new row starts, a multi-block scan of the flags, the start of each run;
#   4. reduce + update  one group of threads per run: sum the run's gradients in that fixed order, then
#                 the optimizer's rule on the row, in the same kernel.
# We run each of these REAL kernels (numbactr.kernels.tbe, imported, never copied) on a batch whose rows
# repeat within a bag, across bags and across two features that share a table, and check every
# intermediate against the NumPy reference.

# %%
import os

# The simulator must be chosen before numba is imported for the first time (numba reads the
# environment once, at import). This tutorial is about the simulator, so it always asks for it.
os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
os.environ["NUMBACTR_DEVICE"] = "sim"

import numpy as np                                              # noqa: E402
from numba import cuda                                          # noqa: E402

from numbactr.embedding.engine import (OptimizerSpec, Optim, Pooling,  # noqa: E402
                                       TableBatchedEmbedding)
from numbactr.kernels import scan                               # noqa: E402
from numbactr.kernels import tbe as K                           # noqa: E402  (the real kernels)

np.set_printoptions(precision=4, suppress=True, linewidth=110)


def title(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 70 - len(text)))


# %% [markdown]
# ## 1. Two tables, three features, one batch with repeated rows
# Table 0 has 6 rows of width 4, table 1 has 3 rows of width 4. Features 0 and 2 both read table 0
# (feature_table_map = [0, 1, 0]). The batch has B = 2 samples; bag j = f*B + b (FBGEMM's order).
# Row 2 of table 0 occurs twice in bag (f0, b0), again in (f0, b1) and in feature 2's bag (f2, b1):
# four occurrences whose gradients must be summed before the optimizer sees them.
# The optimizer is EXACT_ROWWISE_ADAGRAD: one accumulator per row, fed by the mean of the squared row
# gradient, so the update also needs a sum ACROSS the row (a lane reduction in shared memory).

# %%
title("1. the engine and the batch")
eng = TableBatchedEmbedding([(6, 4), (3, 4)], feature_table_map=[0, 1, 0], pooling=Pooling.SUM,
                            optimizer=OptimizerSpec(Optim.EXACT_ROWWISE_ADAGRAD, learning_rate=0.5),
                            impl="kernels")
eng.init_uniform(-1.0, 1.0, seed=7)
indices = np.array([2, 2, 5,     # (f0, b0): row 2 twice, row 5
                    2,           # (f0, b1): row 2
                    1,           # (f1, b0): table 1, row 1
                    0, 1,        # (f1, b1)
                    4,           # (f2, b0): table 0 again, row 4
                    2, 5],       # (f2, b1): row 2 and row 5 of table 0 once more
                   dtype=np.int64)
offsets = np.array([0, 3, 4, 5, 7, 8, 10], dtype=np.int64)
before = [w.copy() for w in eng.split_weights()]
out, ctx = eng.forward(indices, offsets)
print("pooled output (B=2, 3 features x 4):\n", out)
dy = np.arange(out.size, dtype=np.float32).reshape(out.shape) / 10        # a gradient we can follow
print("dLoss/dout:\n", dy)

# %% [markdown]
# ## 2. Linearize: one linear row id and one bag per occurrence
# The engine's tables live in one buffer; table t's rows are numbered from row_offsets[t], so every
# (table, row) is one integer. Row r of table 1 is 6 + r. A `-1` row (a key missing in evaluation)
# would get the sentinel 9 (the total row count) and sort behind every real row.

# %%
title("2. linearize")
n = ctx.rows.shape[0]
sentinel = int(eng.row_offsets[-1])
lin = np.full(n, -7, np.int64)
bag_of = np.full(n, -7, np.int64)
ftable = np.array(eng.feature_table_map, np.int64)
K.linearize_kernel[1, 8](ctx.rows, ctx.offsets, ftable, eng.row_offsets, np.int64(ctx.batch), np.int64(0),
                         np.int64(sentinel), lin, bag_of)
print("occurrence k :", np.arange(n))
print("bag of k     :", bag_of)
print("linear row   :", lin)

# %% [markdown]
# ## 3. Sort, stably
# A stable sort keeps equal keys in their original order, so after it the four occurrences of linear row
# 2 sit side by side in batch order (k = 0, 1, 3, 8). That order is the summation order of the row's
# gradient: fixed, whatever the thread count or the GPU, which is what makes the update deterministic.

# %%
title("3. stable sort")
perm = np.argsort(lin, kind="stable")
print("perm (sorted position -> occurrence):", perm)
print("sorted linear rows                  :", lin[perm])
assert list(perm[lin[perm] == 2]) == [0, 1, 3, 8]

# %% [markdown]
# ## 4. Segment: where each row's run starts
# flags[i] = 1 where a new row starts in sorted order; an exclusive scan of the flags numbers the runs
# (pos[i] = run of position i, pos[N] = U runs); then each run start writes its position. The scan runs
# over several blocks (reduce, scan of the block totals, scan), here 2 blocks of 2 threads; U stays in
# device memory: the update kernel reads it, the host never waits for it.

# %%
title("4. segment")
flags = np.zeros(n, np.int64)
K.segment_flags_kernel[1, 8](lin, perm, np.int64(sentinel), flags)
pos = np.zeros(n + 1, np.int64)
partials = np.zeros(scan.scan_partials_size(n, 2), np.int64)
scan.exclusive_scan(flags, pos, threads=2, partials=partials)
seg_start = np.zeros(n + 1, np.int64)
K.segment_starts_kernel[1, 8](lin, perm, np.int64(sentinel), flags, pos, seg_start)
u = int(pos[n])
print("flags     :", flags)
print("pos       :", pos)
print(f"{u} touched rows; run s covers sorted positions seg_start[s]:seg_start[s + 1]")
for s in range(u):
    lo, hi = seg_start[s], seg_start[s + 1]
    print(f"  run {s}: linear row {lin[perm[lo]]}, occurrences {perm[lo:hi].tolist()}")


# %% [markdown]
# ## 5. Reduce + update, one launch
# The update kernel runs blocks of (lanes, items) threads: threadIdx.y picks a run, the lanes walk the
# row's columns (d = tx, tx + lanes, ...: neighbouring threads read neighbouring floats, coalesced on a
# GPU). Each lane sums its columns of the run's gradients in sorted order, the lanes add their squared
# sums in shared memory for the rowwise accumulator, and each lane writes its columns of the new row.
# The kernel's own buffers are launched exactly as the engine launches them; the reference computes
# the same row gradients (tbe_backward_ref) and the same rule (optimizer_update_ref) in float64.

# %%
title("5. fused reduce + update")
(r0, g0), (r1, g1) = K.tbe_backward_ref(eng.dims, eng.feature_table_map, ctx.rows, ctx.offsets, ctx.batch,
                                        Pooling.SUM, eng.layout, dy)
print("reference row gradients, table 0 rows", r0.tolist(), ":\n", g0)
hp = eng.optimizer.hp()
want_w, (want_m,) = K.optimizer_update_ref(Optim.EXACT_ROWWISE_ADAGRAD, hp, before[0][r0], g0,
                                           [np.zeros(len(r0))], 1)
# the step's scalars travel in three small device arrays, not as launch arguments: float32 ks (learning
# rate, betas, bias corrections), int64 ki (optimizer kind, step, batch) and the uint64 salt of stochastic
# rounding. The engine writes them once per step (numbactr.runtime.step_values), so every launch of a step has the
# same arguments every step: what a CUDA graph replays. On the sim device "device arrays" are NumPy arrays.
ks = K.kernel_scalars(hp, 1)
ki = K.kernel_ints(Optim.EXACT_ROWWISE_ADAGRAD, 0, 0, 1, False, Pooling.SUM, eng.layout, ctx.batch)
kb = np.array([K.rounding_base(eng.seed, 1, K.SR_PASS_HOT)], np.uint64)
lanes, items, per_lane = K.lanes_items(int(eng.dims.max()))
print(f"block = ({lanes} lanes, {items} runs): run s -> threadIdx.y = s % {items}, columns d -> lanes")
momentum = eng.states[0]                              # the per-row accumulators of every table, (6 + 3,)
no_f32, no_i64 = np.zeros(1, np.float32), np.zeros(1, np.int64)    # states this optimizer does not keep
K.fused_update(eng.weights, no_f32, no_f32, momentum, no_i64, no_f32, no_f32,
               eng.elem_offsets, eng.strides, eng.dims, eng.row_offsets, eng.feature_cols, lin, perm, seg_start,
               pos, bag_of, ctx.offsets, no_f32, False, dy.reshape(-1), ks, ki, kb,
               no_i64, np.zeros((1, 1), np.float32),
               False, int(eng.dims.max()))
eng.step = 1
new = eng.split_weights()[0]
print("table 0 row 2 before:", before[0][2], "\n            after :", new[2])
np.testing.assert_allclose(new[r0], want_w, rtol=1e-5, atol=1e-6)
np.testing.assert_allclose(eng.split_optimizer_states()[0][0][r0], want_m, rtol=1e-5)
untouched = [r for r in range(6) if r not in r0]
np.testing.assert_array_equal(new[untouched], before[0][untouched])
print("every touched row equals the float64 reference; rows", untouched, "were not touched")

# %% [markdown]
# ## 6. The engine does all of the above in `backward`, and does it the same way every time
# A fresh engine, the same batch: `backward` runs linearize, sort, segment and the fused update (and,
# for HugeCTR's Global updates, one more pass over the rows in use), and gives bit-identical weights,
# because every row's sum has one order.

# %%
title("6. engine.backward, twice")
runs = []
for _ in range(2):
    e = TableBatchedEmbedding([(6, 4), (3, 4)], feature_table_map=[0, 1, 0], pooling=Pooling.SUM,
                              optimizer=OptimizerSpec(Optim.EXACT_ROWWISE_ADAGRAD, learning_rate=0.5), impl="kernels")
    e.init_uniform(-1.0, 1.0, seed=7)
    o, c = e.forward(indices, offsets)
    e.backward(c, dy)
    runs.append(e.split_weights()[0].copy())
np.testing.assert_array_equal(runs[0], runs[1])
np.testing.assert_array_equal(runs[0], new)
print("engine.backward == the step-by-step launches, bit for bit, run after run")


# %% [markdown]
# ## 7. Stopping inside a run
# In the simulator every CUDA thread is a Python thread, so `breakpoint()` works inside a kernel. The
# kernel below is this tutorial's own: it walks each run the way the update kernel's reduction does
# (run s, sorted positions seg_start[s]:seg_start[s + 1], occurrence perm[i], its bag and sample) and
# adds up column 0 of the run's gradient; with STEP=1 it stops in thread 0 at the start of every run that
# thread handles. At the (Pdb) prompt try `p s, i0, i1`, `n`, `p total`, `c`.

# %%
@cuda.jit
def walk_runs_kernel(perm, seg_start, pos, bag_of, fcols, batch, dy, step, out):
    for s in range(cuda.grid(1), pos[perm.shape[0]], cuda.gridsize(1)):
        i0 = seg_start[s]
        i1 = seg_start[s + 1]
        total = 0.0
        if step and cuda.threadIdx.x == 0:
            breakpoint()        # (Pdb) p s, i0, i1   n   p total   c
        for i in range(i0, i1):
            j = bag_of[perm[i]]                          # bag j = f * B + b
            total += dy[j % batch, fcols[j // batch]]    # column 0 of this occurrence's gradient
        out[s] = total


column0 = np.zeros(u, np.float64)
walk_runs_kernel[1, 2](perm, seg_start, pos, bag_of, eng.feature_cols, ctx.batch, dy, os.environ.get("STEP") == "1",
                       column0)
print("column 0 of every touched row's gradient:", column0)
np.testing.assert_allclose(column0, np.concatenate([g0[:, 0], g1[:, 0]]), rtol=1e-6)

print("\ntutorial 07 OK")
