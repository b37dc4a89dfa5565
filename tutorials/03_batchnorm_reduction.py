# %% [markdown]
# # Tutorial 03: BatchNorm's shared-memory reductions, barrier by barrier, in Numba's CUDA simulator.
#
# Run:
# ```bash
# NUMBACTR_DEVICE=sim python tutorials/03_batchnorm_reduction.py
# ```
#
# What you will see:
#   1. the data: a batch x (B, F); BatchNorm normalizes every feature (column) over the batch;
#   2. which block handles which feature and which thread sums which rows (grid-stride loops);
#   3. the tree reduction in shared memory: the partial sums after every syncthreads(), worked out in
#      Python, then the REAL kernel of numbactr.kernels.batch_norm (imported, never copied) agreeing,
#      for several launch shapes;
#   4. why there are two passes (mean, then the centred sum of squares) instead of E[x^2] - E[x]^2;
#   5. the running statistics (factor, unbiased variance) and eval mode, which uses them;
#   6. the backward kernel (dgamma, dbeta reduced the same way) against the NumPy reference, and the
#      reference against float64 central differences.

# %%
import os

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"      # the simulator must be chosen before numba's import

import numpy as np                                      # noqa: E402

from numbactr.kernels import batch_norm as bn           # noqa: E402  (the real kernels)

np.set_printoptions(precision=4, suppress=True)


def title(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 70 - len(text)))


# %% [markdown]
# 1. The data. x is (B, F) = (10, 3). Feature 0 is 0..9, feature 1 is 10 * feature 0, feature 2 is
#    constant 5 (its variance is 0; eps keeps 1/sqrt(var + eps) finite).

# %%
title("1. a batch (B, F)")
B, F = 10, 3
x = np.stack([np.arange(B), 10 * np.arange(B), np.full(B, 5)], axis=1).astype(np.float32)   # (B, F)
gamma = np.array([1.0, 2.0, 1.0], np.float32)                                                 # (F,)
beta = np.array([0.0, 1.0, -1.0], np.float32)                                                 # (F,)
EPS = 1e-5
print("x (B, F):\n", x)

# %% [markdown]
# 2. Who does what. The forward kernel gives a whole feature to ONE block:
#        for f in range(cuda.blockIdx.x, F, cuda.gridDim.x):          # blocks stride over features
#            for m in range(t, B, tpb): acc += x[m, f]                  # threads stride over rows
#    The feature loop depends only on blockIdx, so every thread of a block runs the same number of
#    iterations and reaches every cuda.syncthreads() (a barrier some threads skip hangs a GPU).

# %%
title("2. blocks -> features, threads -> rows")
BLOCKS, TPB = 2, 4
for blk in range(BLOCKS):
    print(f"block {blk}: features {list(range(blk, F, BLOCKS))}")
for t in range(TPB):
    print(f"  thread {t}: rows {list(range(t, B, TPB))}")

# %% [markdown]
# 3. The tree. Each thread writes its partial sum to part[t] (a cuda.shared.array of tpb floats,
#    one per block), then:
#        step = tpb // 2
#        while step > 0:
#            if t < step: part[t] += part[t + step]
#            cuda.syncthreads()
#            step //= 2
#    After log2(tpb) barriers part[0] holds the block's total. The barrier after every step is what
#    makes it correct on a GPU: thread 0 must not read part[1] before thread 1 has added part[3]
#    into it. The simulator runs threads as Python threads and hides most races, so the rule is
#    enforced by reading the code (and by running the same tests on a GPU).
#    A last syncthreads() after everyone has read part[0] lets the next pass reuse part[].

# %%
title("3. the shared-memory tree for feature 0's sum")
part = np.array([x[t::TPB, 0].sum() for t in range(TPB)], np.float32)
print(f"after the row loop        part = {part}")
step = TPB // 2
barrier = 1
while step > 0:
    for t in range(step):                      # the threads with t < step, all "at once"
        part[t] += part[t + step]
    print(f"after barrier {barrier} (step {step})  part = {part}   (threads 0..{step - 1} added)")
    step //= 2
    barrier += 1
mean0 = part[0] / B
print(f"mean of feature 0 = {part[0]} / {B} = {mean0}")

y = np.full_like(x, np.nan)
mean, inv = np.zeros(F, np.float32), np.zeros(F, np.float32)
rm, rv = np.zeros(F, np.float32), np.ones(F, np.float32)
kernel = bn.make_bn_forward_train_kernel(TPB)              # a factory: tpb is a compile-time constant
kernel[BLOCKS, TPB](x, gamma, beta, np.float32(EPS), np.float32(1.0), y, mean, inv, rm, rv)
print("kernel mean per feature:", mean)
assert mean[0] == mean0
ref_y, ref_mean, ref_inv, _, _ = bn.batch_norm_forward_ref(x.astype(np.float64), gamma, beta, EPS)
np.testing.assert_allclose(mean, ref_mean, rtol=1e-6)
np.testing.assert_allclose(y, ref_y, rtol=1e-4, atol=1e-4)
print("y (B, F):\n", y)

for blocks, tpb in ((1, 1), (1, 2), (3, 8), (2, 32)):      # any grid, any power-of-two block size
    again = np.full_like(x, np.nan)
    bn.make_bn_forward_train_kernel(tpb)[blocks, tpb](x, gamma, beta, np.float32(EPS), np.float32(1.0), again,
                                                      np.zeros(F, np.float32), np.zeros(F, np.float32),
                                                      np.zeros(F, np.float32), np.ones(F, np.float32))
    np.testing.assert_allclose(again, y, rtol=1e-5, atol=1e-5)
print("same y with launches [1, 1], [1, 2], [3, 8], [2, 32]")

# %% [markdown]
# 4. Two passes. The kernel reduces sum(x) first, then sum((x - mean)^2). The one-pass formula
#    E[x^2] - E[x]^2 subtracts two nearly equal numbers when |mean| >> std: in float32 it loses
#    every significant digit.

# %%
title("4. why two passes")
big = (10000.0 + np.array([0.0, 0.1, 0.2, 0.3], np.float32)).astype(np.float32)[:, None]   # (4, 1)
one_pass = np.mean(big * big, dtype=np.float32) - np.mean(big, dtype=np.float32) ** 2
yb, mb, ib = np.zeros_like(big), np.zeros(1, np.float32), np.zeros(1, np.float32)
bn.make_bn_forward_train_kernel(4)[1, 4](big, np.ones(1, np.float32), np.zeros(1, np.float32), np.float32(EPS),
                                         np.float32(1.0), yb, mb, ib, np.zeros(1, np.float32), np.ones(1, np.float32))
two_pass = 1.0 / ib[0] ** 2 - EPS
print(f"true variance 0.0125; float32 one-pass {one_pass:.4f}; the kernel's two-pass {two_pass:.4f}")
assert abs(two_pass - 0.0125) < 1e-3

# %% [markdown]
# 5. Running statistics and eval mode. Thread 0 of each block updates, after the reductions,
#        running_mean = (1 - factor) * running_mean + factor * mean
#        running_var  = (1 - factor) * running_var  + factor * var * B / (B - 1)   (UNBIASED, as cuDNN)
#    HugeCTR's default factor is 1.0 (the running stats are the last batch's). Eval mode normalizes
#    with them: one elementwise kernel, no reduction, so even a single-row batch works.

# %%
title("5. running stats (factor 0.5) and eval mode")
factor = 0.5
rm, rv = np.zeros(F, np.float32), np.ones(F, np.float32)
for step_no, batch in enumerate((x, x[::-1] + 1)):
    bn.batch_norm_forward_train(batch, gamma, beta, EPS, factor, np.zeros_like(batch), np.zeros(F, np.float32),
                                np.zeros(F, np.float32), rm, rv)
    print(f"after batch {step_no}: running_mean {rm}  running_var {rv}")
want_m = factor * (x + 1).mean(0) + (1 - factor) * factor * x.mean(0)
want_v = factor * x.var(0, ddof=1) + (1 - factor) * (factor * x.var(0, ddof=1) + (1 - factor))
np.testing.assert_allclose(rm, want_m, rtol=1e-5)
np.testing.assert_allclose(rv, want_v, rtol=1e-5)
row = x[3:4]                                                             # (1, F): one sample
y_eval, inv_eval = np.zeros_like(row), np.zeros(F, np.float32)
bn.batch_norm_forward_eval(row, gamma, beta, rm, rv, EPS, y_eval, inv_eval)
np.testing.assert_allclose(y_eval, bn.batch_norm_forward_ref(row, gamma, beta, EPS, False, rm, rv)[0], rtol=1e-5)
print("eval on one row:", y_eval, "= gamma * (x - running_mean) / sqrt(running_var + eps) + beta")

# %% [markdown]
# 6. Backward. Per feature: dbeta = sum dy, dgamma = sum dy * xhat (two shared arrays reduced by the
#    same tree, in the same barriers), then every thread writes dx for its rows:
#        dx = gamma * inv / B * (B * dy - dbeta - xhat * dgamma)
#    The reference is checked against float64 central differences of the reference forward.

# %%
title("6. backward kernel and the gradient check")
dy = np.random.default_rng(0).normal(size=x.shape).astype(np.float32)
dx, dgamma, dbeta = np.zeros_like(x), np.zeros(F, np.float32), np.zeros(F, np.float32)
bn.make_bn_backward_kernel(TPB)[BLOCKS, TPB](x, dy, gamma, mean, inv, np.int32(1), dx, dgamma, dbeta)
rdx, rdg, rdb = bn.batch_norm_backward_ref(x.astype(np.float64), dy, gamma, ref_mean, ref_inv)
np.testing.assert_allclose(dbeta, rdb, rtol=1e-5, atol=1e-5)
np.testing.assert_allclose(dgamma, rdg, rtol=1e-4, atol=1e-4)
np.testing.assert_allclose(dx[:, :2], rdx[:, :2], rtol=1e-3, atol=1e-3)    # feature 2: var 0, inv ~316
print("dgamma", dgamma, " dbeta", dbeta)

x64 = x.astype(np.float64)[:, :2] + np.random.default_rng(1).normal(size=(B, 2))
g64, b64, dy64 = gamma[:2].astype(np.float64), beta[:2].astype(np.float64), dy[:, :2].astype(np.float64)
_, m64, i64, _, _ = bn.batch_norm_forward_ref(x64, g64, b64, EPS)
analytic = bn.batch_norm_backward_ref(x64, dy64, g64, m64, i64)[0]
numeric = np.zeros_like(x64)
h = 1e-6
for idx in np.ndindex(*x64.shape):
    xp_, xm_ = x64.copy(), x64.copy()
    xp_[idx] += h
    xm_[idx] -= h
    numeric[idx] = ((bn.batch_norm_forward_ref(xp_, g64, b64, EPS)[0] -
                     bn.batch_norm_forward_ref(xm_, g64, b64, EPS)[0]) * dy64).sum() / (2 * h)
np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-7)
print(f"reference dx == central differences (max |diff| {np.abs(analytic - numeric).max():.2e})")

print("\ntutorial 03 OK")
