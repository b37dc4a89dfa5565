# %% [markdown]
# # Tutorial 01: the embedding-bag kernel, thread by thread, in Numba's CUDA simulator.
#
# Run:
# ```bash
# NUMBACTR_DEVICE=sim python tutorials/01_embedding_bag_kernel.py
# STEP=1 NUMBACTR_DEVICE=sim python tutorials/01_embedding_bag_kernel.py   # stop inside a kernel (pdb)
# ```
#
# What you will see:
#   1. the data an embedding layer hands the kernel: a table of rows, and CSR "bags" of row indices;
#   2. which simulated thread computes which output element (bag, d) under a grid-stride loop, worked
#      out in plain Python and then recorded by a tiny kernel;
#   3. the REAL forward kernel of numbactr.kernels.embedding_bag (imported, never copied) launched with
#      1 block of 8 threads, checked against its NumPy reference;
#   4. the backward pass, where a key that occurs twice receives its gradient twice (atomic adds);
#   5. how an error inside a kernel names the thread that raised it, and how to stop in a kernel with
#      breakpoint().
# Everything runs on the CPU: the simulator runs every CUDA thread as a Python thread.

# %%
import os

# The simulator must be chosen before numba is imported for the first time (numba reads the
# environment once, at import). This tutorial is about the simulator, so it always asks for it.
os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np                                     # noqa: E402
from numba import cuda                                 # noqa: E402

from numbactr.kernels import embedding_bag as eb       # noqa: E402  (the real kernels)

np.set_printoptions(precision=3, suppress=True)


def title(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 70 - len(text)))


# %% [markdown]
# 1. The data. An embedding table has V rows of width D. A batch of B samples with S slots gives
#    B*S "bags"; bag j is a list of keys, already turned into table rows by the hash table (that is
#    another kernel; here we write the rows directly). The bags are stored CSR-style: all rows in one
#    flat array `rows` (N,), and `offsets` (nbags+1,) so that bag j is rows[offsets[j]:offsets[j+1]].

# %%
title("1. table and bags")
V, D = 4, 3
# row r holds [10(r+1), 10(r+1)+1, 10(r+1)+2], so every sum below can be checked by eye
table = (10 * np.arange(1, V + 1)[:, None] + np.arange(D)[None, :]).astype(np.float32)  # (V, D)
rows = np.array([1, 3,            # bag 0: rows 1 and 3
                 # bag 1: empty (a sample with no key in this slot)
                 2, 0, 2],        # bag 2: row 2 twice (the same key twice in one slot)
                dtype=np.int64)                                                        # (N,)
offsets = np.array([0, 2, 2, 5], dtype=np.int64)                                       # (nbags+1,)
nbags = len(offsets) - 1
print("table (V, D):\n", table)
for j in range(nbags):
    print(f"bag {j}: rows {rows[offsets[j]:offsets[j + 1]].tolist()}")

# %% [markdown]
# 2. Who computes what. The forward kernel gives one output element out[j, d] to one loop step:
#        for i in range(cuda.grid(1), nbags * D, cuda.gridsize(1)):
#            j, d = i // D, i % D
#    cuda.grid(1)     = blockIdx.x * blockDim.x + threadIdx.x   (this thread's global index)
#    cuda.gridsize(1) = gridDim.x * blockDim.x                  (threads in the whole grid)
#    This is a grid-stride loop: thread t takes elements t, t + stride, t + 2*stride, ... so ANY
#    launch shape covers every element exactly once. With 1 block of 8 threads and 3*3 = 9
#    elements, thread 0 does elements 0 and 8, threads 1..7 do one each. On a GPU the same code
#    runs with hundreds of blocks of 256 threads; in the simulator we keep it tiny.

# %%
title("2. grid-stride mapping: thread -> (bag, d)")
BLOCKS, THREADS = 1, 8
n_out = nbags * D
stride = BLOCKS * THREADS
plan = np.full((nbags, D), -1, dtype=np.int64)        # plan[j, d] = global thread index
for block in range(BLOCKS):
    for thread in range(THREADS):
        tid = block * THREADS + thread                # what cuda.grid(1) returns in that thread
        mine = []
        for i in range(tid, n_out, stride):
            plan[i // D, i % D] = tid
            mine.append((i // D, i % D))
        print(f"block {block} thread {thread} (global {tid}): (bag, d) = {mine}")


# The same thing measured rather than predicted: a tiny kernel of this tutorial's own runs the same
# loop as the forward kernel but writes, instead of a sum, the index of the thread that got there.
@cuda.jit
def who_computes_kernel(who):
    n_cols = who.shape[1]
    for i in range(cuda.grid(1), who.shape[0] * n_cols, cuda.gridsize(1)):
        who[i // n_cols, i % n_cols] = cuda.grid(1)


who = np.full((nbags, D), -1, dtype=np.int64)
who_computes_kernel[BLOCKS, THREADS](who)
print("thread index per output element, recorded by a kernel (rows = bags, columns = d):\n", who)
assert (who == plan).all(), "the simulator disagrees with the grid-stride arithmetic"

# %% [markdown]
# 3. The real forward kernel. Each loop step walks its bag's rows and sums table[row, d]:
#        out[j, d] = scale_j * sum_{k in bag j} table[rows[k], d]
#    combiner SUM: scale 1.  MEAN: scale 1/nnz when nnz > 1.  Empty bag: zeros.
#    In the simulator a kernel accepts plain NumPy arrays and writes the results back into them.

# %%
title("3. forward kernel, 1 block x 8 threads")
for name, combiner in (("sum", eb.SUM), ("mean", eb.MEAN)):
    out = np.full((nbags, D), np.nan, dtype=np.float32)                 # (nbags, D)
    eb.embedding_bag_forward_kernel[BLOCKS, THREADS](table, rows, offsets, combiner, out)
    ref = eb.embedding_bag_forward_ref(table, rows, offsets, combiner)
    print(f"{name}:\n{out}")
    np.testing.assert_allclose(out, ref, rtol=1e-6)
# `out` now holds the mean: bag 0 = (row 1 + row 3) / 2, bag 1 (empty) = 0, bag 2 = (2 row 2 + row 0) / 3
assert np.allclose(out[0], (table[1] + table[3]) / 2) and np.all(out[1] == 0)
assert np.allclose(out[2], (2 * table[2] + table[0]) / 3)

# Grid-stride means the launch shape never changes the answer. The library's launch wrapper picks
# the shape itself (kernels/launch.py: tiny in the simulator, SM-count based on a GPU):
for blocks, threads in ((1, 1), (2, 4), (3, 32)):
    again = np.full_like(out, np.nan)
    eb.embedding_bag_forward_kernel[blocks, threads](table, rows, offsets, eb.MEAN, again)
    np.testing.assert_allclose(again, out, rtol=1e-6)
eb.embedding_bag_forward(table, rows, offsets, eb.MEAN, again)          # the launch wrapper
np.testing.assert_allclose(again, out, rtol=1e-6)
print("same result with launches [1, 1], [2, 4], [3, 32] and the launch wrapper")

# %% [markdown]
# 4. Backward. Given dy (nbags, D), every key occurrence k sends scale * dy[bag(k)] to its row.
#    The optimizer later updates only the rows the batch touched, so gradients are collected per
#    UNIQUE row: first_occurrence_index gives the unique rows (U,) in first-seen order and, per key,
#    its compact index `local` into them. The kernel runs one loop step per (key, d): it needs the
#    bag of each key, which bag_of_key (another kernel) writes from the CSR offsets. Two keys with
#    the same row (row 2 in bag 2) add into the same grad element at the same time on a GPU, so the
#    kernel uses cuda.atomic.add.

# %%
title("4. backward kernel: duplicate keys accumulate")
dy = np.array([[1, 1, 1], [7, 7, 7], [1, 2, 3]], dtype=np.float32)     # (nbags, D); bag 1 has no keys
unique_rows, local = eb.first_occurrence_index(rows)
print("unique rows (U,):", unique_rows, "  local index per key (N,):", local)
bag_ids = np.full(rows.shape, -1, dtype=np.int64)
eb.bag_of_key_kernel[BLOCKS, THREADS](offsets, bag_ids)
print("bag of each key (N,):", bag_ids)
for name, combiner in (("sum", eb.SUM), ("mean", eb.MEAN)):
    grad = np.zeros((unique_rows.size, D), dtype=np.float32)           # (U, D), zeroed by the caller
    eb.embedding_bag_backward_kernel[BLOCKS, THREADS](dy, local, offsets, bag_ids, combiner, grad)
    ref_rows, ref_grad = eb.embedding_bag_backward_ref(dy, rows, offsets, combiner)
    np.testing.assert_array_equal(ref_rows, unique_rows)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-6)
    print(f"{name}: grad per unique row")
    for u, r in enumerate(unique_rows):
        print(f"  row {r}: {grad[u]}")
u2 = int(np.flatnonzero(unique_rows == 2)[0])
# with MEAN, bag 2 has nnz 3: row 2 gets 2 * dy[2] / 3 (two occurrences, each scaled by 1/3)
np.testing.assert_allclose(grad[u2], 2 * dy[2] / 3, rtol=1e-6)
print("row 2 occurs twice in bag 2, so it received dy[2] twice (scaled by 1/3 under mean)")

# %% [markdown]
# 5. Debugging. (a) An exception raised inside a simulated kernel carries the CUDA coordinates of
#    the thread that raised it: "tid=[x, y, z] ctaid=[x, y, z]: ..." (threadIdx, blockIdx). The
#    simulator also checks array bounds, which a GPU never does (there, use compute-sanitizer).
#    Here a row index 9 is past the end of the 4-row table:

# %%
title("5. debugging inside a kernel")
bad_rows = np.array([1, 3, 9, 0, 2], dtype=np.int64)
try:
    eb.embedding_bag_forward_kernel[BLOCKS, THREADS](table, bad_rows, offsets, eb.SUM,
                                                     np.zeros((nbags, D), np.float32))
    raise SystemExit("expected an IndexError from the out-of-range row")
except IndexError as exc:
    print(f"{type(exc).__name__}: {exc}")
    assert "tid=[" in str(exc) and "ctaid=[" in str(exc)
    # tid=[t,0,0] is a thread of bag 2 (global index 6, 7 or 0 from the table in section 2)

# (b) Stepping. In the simulator a kernel body is ordinary Python run by one Python thread per CUDA
#     thread, so breakpoint() (pdb) works inside it. Guard it to ONE thread, or every thread of the
#     block opens its own prompt. At the (Pdb) prompt: `p i, j, d, acc`, `n` (next line), `c`
#     (continue); `PYTHONBREAKPOINT=0` disables every breakpoint(). You may put such a guarded
#     breakpoint() temporarily into a real kernel (kernels/embedding_bag.py) while investigating; it
#     does not compile for a GPU, so remove it afterwards (tests/ptx_check.py would fail). Below, a
#     kernel of this tutorial's own, run only with STEP=1:


@cuda.jit
def step_into_kernel(table, rows, offsets):
    # the forward kernel's loop for column d = 0 only, stopping in thread 0 of each block at the
    # start of every bag that thread handles (launched [1, 2] below: thread 0 gets bags 0 and 2)
    for j in range(cuda.grid(1), offsets.shape[0] - 1, cuda.gridsize(1)):
        total = 0.0
        if cuda.threadIdx.x == 0:
            breakpoint()        # (Pdb) p j, offsets[j], offsets[j + 1]   n  n  p total   c
        for k in range(offsets[j], offsets[j + 1]):
            total += table[rows[k], 0]
    # thread 1 runs on by itself meanwhile: its output may interleave with the prompt


if os.environ.get("STEP") == "1":
    print("STEP=1: stopping in thread 0; try `p j, offsets[j], offsets[j + 1]`, `n`, `p total`, `c`")
    step_into_kernel[1, 2](table, rows, offsets)
else:
    print("(set STEP=1 to stop inside a kernel with pdb)")

print("\ntutorial 01 OK")
