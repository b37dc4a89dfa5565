# %% [markdown]
# # Tutorial 02: three ways CTR models cross features — DLRM's dot Interaction, FM's FmOrder2 and DCN's
# MultiCross — stepped through in Numba's CUDA simulator with the REAL kernels.
#
# Run:
# ```bash
# NUMBACTR_DEVICE=sim python tutorials/02_feature_interactions.py
# ```
#
# For each op we (1) build a tiny input you can check by eye, (2) launch the numba.cuda kernel with a
# small grid, (3) compare with the NumPy reference beside it, and (4) show the backward pass against
# central differences. Shapes: B batch, S slots, V embedding width, D feature width.

# %%
import os

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"          # before numba is imported: the simulator

import numpy as np                                 # noqa: E402

from numbactr.kernels import fm_order2, interaction, multi_cross   # noqa: E402  (the real kernels)

np.set_printoptions(precision=3, suppress=True)


def title(text):
    print(f"\n=== {text} " + "=" * max(0, 70 - len(text)))


def numeric_grad(f, x, dy, eps=1e-3):
    """d/dx of sum(f(x) * dy) by central differences (float64)."""
    x = x.astype(np.float64)
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + eps
        up = np.sum(f(x) * dy)
        x[i] = old - eps
        down = np.sum(f(x) * dy)
        x[i] = old
        g[i] = (up - down) / (2 * eps)
    return g


# %% [markdown]
# 1. DLRM dot interaction. Z = [dense; emb_1..emb_S] stacks n = S+1 vectors of width V per sample.
#    HugeCTR's output row: [dense (V values), Z_i . Z_j for i = 1..n-1, j < i (row-major strict lower
#    triangle), one 0.0 pad] -> width V + n(n-1)/2 + 1. Each output element is one thread's work.

# %%
title("1. Interaction (DLRM)")
B, S, V = 1, 2, 3
dense = np.array([[1.0, 0.0, 2.0]], np.float32)                       # (B, V)
emb = np.array([[[1.0, 1.0, 0.0], [0.0, 2.0, 1.0]]], np.float32)      # (B, S, V)
n = S + 1
out = np.zeros((B, interaction.interaction_out_width(S, V)), np.float32)
interaction.interaction_forward(dense, emb, out, threads=8)           # 1 block of 8 threads here
print("output row:", out[0])
labels = [f"dense[{v}]" for v in range(V)]
labels += [f"Z{i}.Z{j}" for i in range(1, n) for j in range(i)] + ["pad"]
for name, value in zip(labels, out[0]):
    print(f"  {name:<9} = {value:5.1f}")
# Z0 = dense, Z1 = emb_0, Z2 = emb_1: Z1.Z0 = 1, Z2.Z0 = 2, Z2.Z1 = 2
assert np.allclose(out[0, V:], [1.0, 2.0, 2.0, 0.0])
np.testing.assert_allclose(out, interaction.interaction_forward_ref(dense, emb))
dy = np.random.default_rng(0).normal(size=out.shape).astype(np.float32)
d_dense, d_emb = np.empty_like(dense), np.empty_like(emb)
interaction.interaction_backward(dense, emb, dy, d_dense, d_emb, threads=8)
num = numeric_grad(lambda e: interaction.interaction_forward_ref(dense.astype(np.float64), e), emb, dy)
np.testing.assert_allclose(d_emb, num, rtol=1e-3, atol=1e-3)
print("backward: dEmb matches central differences; the pad column gets no gradient")

# %% [markdown]
# 2. FmOrder2 (factorization machine, 2nd order). Input (B, S*V): S feature vectors of width V.
#    y[b, v] = 0.5 * ((sum_s x_sv)^2 - sum_s x_sv^2) = sum_{s<t} x_sv x_tv — all pairwise products in
#    O(S) instead of O(S^2): one thread per (b, v) keeps a running sum and a running sum of squares.

# %%
title("2. FmOrder2 (FM)")
x = np.array([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]], np.float32)            # (B, S*V) with S = 3, V = 2
y = np.zeros((1, 2), np.float32)
fm_order2.fm_order2_forward(x, y)
pairs = x.reshape(3, 2)
brute = sum(pairs[s] * pairs[t] for s in range(3) for t in range(s + 1, 3))
print("kernel:", y[0], " brute force sum_{s<t} x_s*x_t:", brute)
np.testing.assert_allclose(y[0], brute)
dx = np.zeros_like(x)
fm_order2.fm_order2_backward(x, np.ones_like(y), dx)
print("dX = (sum_s x_s) - x_s per column:", dx[0])
np.testing.assert_allclose(dx[0], (pairs.sum(0) - pairs).reshape(-1))

# %% [markdown]
# 3. MultiCross (DCN v1). One cross layer: h[b] = x_l[b] . w (a per-row dot product), then
#    x_{l+1} = x0 * h + x_l + b. The dot product is a shared-memory tree reduction: one block per row,
#    each thread sums a strided part of the row, then the block halves the partial sums log2(tpb) times.

# %%
title("3. MultiCross (DCN)")
D = 6
rng = np.random.default_rng(1)
x0 = rng.normal(size=(2, D)).astype(np.float32)
w = rng.normal(size=D).astype(np.float32)
b = rng.normal(size=D).astype(np.float32)
out = np.zeros_like(x0)
h = np.zeros(2, np.float32)
multi_cross.v1_forward(x0, x0, w, b, out, h, threads=4)    # tpb 4 < D: each thread sums 2 elements
print("per-row dot h = x0 . w:", h, " (numpy:", x0 @ w, ")")
np.testing.assert_allclose(h, x0 @ w, rtol=1e-5)
ref = multi_cross.multi_cross_v1_forward_ref(x0, [w], [b])
ref_out = ref[0] if isinstance(ref, tuple) else ref
np.testing.assert_allclose(out, np.asarray(ref_out).reshape(out.shape), rtol=1e-5, atol=1e-6)
print("x1 = x0*h + x0 + b matches the reference")
print("\ntutorial 02 OK")
