# %% [markdown]
# # Tutorial 04: the GRU forward and its hand-written backward through time, step by step.
#
# Run:
# ```bash
# NUMBACTR_DEVICE=sim python tutorials/04_gru_through_time.py
# ```
#
# What you will see:
#   1. the weights as HugeCTR stores them: ONE flat vector [W_r W_z W_n | U_r U_z U_n | b_r b_z b_n]
#      (cuDNN's order, gate order r, z, n, a single input bias) plus the initial state hx;
#   2. the forward: one matmul x W^T for all steps, then per step a matmul h U^T and the REAL step
#      kernel of numbactr.kernels.gru (imported, never copied) doing the gates elementwise;
#   3. the backward through time, last step first: the step kernel turns dL/dh into the gate
#      gradients, a matmul carries dL/dh back one step, and the weight gradients are three matmuls
#      and a column sum at the end;
#   4. the kernels against the NumPy reference, and the reference against float64 central differences
#      (every weight, the input and h_0);
#   5. the same numbers from the numbactr GRU layer (what a model runs).

# %%
import os

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"      # the simulator must be chosen before numba's import
os.environ.setdefault("NUMBACTR_DEVICE", "sim")

import numpy as np                                              # noqa: E402

from numbactr.runtime import device                                     # noqa: E402
from numbactr.kernels import bias as bias_kernels               # noqa: E402
from numbactr.kernels import gru                                # noqa: E402  (the real kernels)
from numbactr.layers.recurrent import gru_weight_count, split_gru_weights  # noqa: E402

np.set_printoptions(precision=4, suppress=True)


def title(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 70 - len(text)))


# %% [markdown]
# 1. Shapes and weights. B sequences of T steps of V features; H hidden units.
#    cuDNN's GRU (HugeCTR's GRU layer):
#        r = sigmoid(W_r x + b_r + U_r h)      z = sigmoid(W_z x + b_z + U_z h)
#        n = tanh(W_n x + b_n + r * (U_n h))   h' = (1 - z) * n + z * h
#    (CUDNN_RNN_SINGLE_INP_BIAS: no recurrent bias inside r * (...)).

# %%
title("1. weights: one flat vector")
B, T, V, H = 2, 3, 2, 2
rng = np.random.default_rng(0)
n_w = gru_weight_count(H, V)
print(f"weight count 3H*V + 3H*H + 3H = {3 * H * V} + {3 * H * H} + {3 * H} = {n_w}")
wflat = (rng.normal(size=(1, n_w)) * 0.7).astype(np.float32)          # (1, W): HugeCTR's weight 0
hx = (rng.normal(size=(1, B * H)) * 0.5).astype(np.float32)           # (1, B*H): HugeCTR's weight 1
W, U, b = split_gru_weights(wflat, H, V)                              # views: (3H, V), (3H, H), (3H,)
print("W (3H, V), rows r|z|n:\n", W, "\nU (3H, H):\n", U, "\nb (3H,):", b)
x = rng.normal(size=(B, T, V)).astype(np.float32)                     # (B, T, V): batch-major
h0 = hx.reshape(B, H)

# %% [markdown]
# 2. Forward. gx = x W^T for every step at once (a matmul: the array library's job). Then for each
#    t: gh = h_t U^T (a matmul) and the step kernel, one thread per hidden unit (b, j):
#        reads gx[b, t, :], b, gh[b, :], h_t[b, j]; writes h_{t+1}[b, j] into hs (B, T+1, H) and
#        r, z, n, gh_n into gates (B, T, 4H) for the backward.

# %%
title("2. forward, one step kernel launch per time step")
gx = np.ascontiguousarray((x.reshape(B * T, V) @ W.T).reshape(B, T, 3 * H))   # (B, T, 3H)
hs = np.zeros((B, T + 1, H), np.float32)
hs[:, 0] = h0
gates = np.zeros((B, T, 4 * H), np.float32)
for t in range(T):
    gh = np.ascontiguousarray(hs[:, t] @ U.T)                                   # (B, 3H)
    gru.gru_step_forward_kernel[1, 4](gx, b, gh, hs, gates, np.int64(t))        # B*H = 4 threads
    r, z, n = gates[:, t, :H], gates[:, t, H:2 * H], gates[:, t, 2 * H:3 * H]
    print(f"t={t}: r={r.ravel()} z={z.ravel()} n={n.ravel()} -> h={hs[:, t + 1].ravel()}")
y_ref, cache = gru.gru_forward_ref(x.astype(np.float64), W, U, b, h0)
np.testing.assert_allclose(hs[:, 1:], y_ref, rtol=1e-5, atol=1e-6)
print("outputs y = h_1..h_T (B, T, H) match the NumPy reference")

# %% [markdown]
# 3. Backward through time. dL/dh_{t+1} has two sources: dy[:, t] (this step's output) and the
#    carry from step t+1. The carry has two parts, kept apart so that no extra add kernel runs:
#        dh_dir = dh * z                  (h' = ... + z * h: the direct path; the kernel writes it)
#        dh_mm  = dgh_t @ U               (through the gates' U h: a matmul)
#    The step kernel computes, per (b, j):
#        dh = dy + dh_mm + dh_dir
#        a_n = dh (1 - z)(1 - n^2);  a_z = dh (h - n) z (1 - z);  a_r = a_n * gh_n * r (1 - r)
#        dgx = [a_r, a_z, a_n] (input pre-activations)   dgh = [a_r, a_z, a_n * r] (U h's)
#    After the loop: dW = dgx^T x, dU = dgh^T h_{0..T-1}, db = column sums of dgx, dx = dgx W,
#    dh_0 = dh_mm + dh_dir.

# %%
title("3. backward through time, last step first")
dy = rng.normal(size=(B, T, H)).astype(np.float32)
dgx = np.zeros((B, T, 3 * H), np.float32)
dgh = np.zeros_like(dgx)
dh_mm = np.zeros((B, H), np.float32)
dh_dir = np.zeros((B, H), np.float32)
for t in reversed(range(T)):
    gru.gru_step_backward_kernel[1, 4](dy, dh_mm, dh_dir, gates, hs, np.int64(t), dgx, dgh)
    dh_mm = np.ascontiguousarray(dgh[:, t] @ U)
    print(f"t={t}: dgx[:, t]={dgx[:, t].ravel()}")
dh0 = np.zeros((B, H), np.float32)
gru.gru_add_kernel[1, 4](dh_mm.reshape(-1), dh_dir.reshape(-1), dh0.reshape(-1))
dgx2 = dgx.reshape(-1, 3 * H)
dW = dgx2.T @ x.reshape(-1, V)
dU = dgh.reshape(-1, 3 * H).T @ np.ascontiguousarray(hs[:, :T]).reshape(-1, H)
db = np.zeros(3 * H, np.float32)
bias_kernels.bias_grad(dgx2, db)                    # column sums: the shared-memory reduction kernel
dx = (dgx2 @ W).reshape(B, T, V)

# %% [markdown]
# 4. Checks: kernels vs reference; reference vs float64 central differences of sum(y * dy).

# %%
title("4. kernels == reference == central differences")
rdx, rdW, rdU, rdb, rdh0 = gru.gru_backward_ref(dy.astype(np.float64), x.astype(np.float64), W, U, cache)
for name, got, want in (("dx", dx, rdx), ("dW", dW, rdW), ("dU", dU, rdU), ("db", db, rdb), ("dh0", dh0, rdh0)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    print(f"{name}: kernels match the reference (max |diff| {np.abs(got - want).max():.1e})")

x64, W64, U64, b64, h64 = (a.astype(np.float64) for a in (x, W, U, b, h0))
dy64 = dy.astype(np.float64)


def loss(xx, ww, uu, bb, hh):
    return float((gru.gru_forward_ref(xx, ww, uu, bb, hh)[0] * dy64).sum())


_, c64 = gru.gru_forward_ref(x64, W64, U64, b64, h64)
analytic = gru.gru_backward_ref(dy64, x64, W64, U64, c64)            # (dx, dW, dU, db, dh0)
args = [x64, W64, U64, b64, h64]                                     # analytic[k] is d loss / d args[k]
eps = 1e-6
for k, name in enumerate(("x", "W", "U", "b", "h0")):
    num = np.zeros_like(args[k])
    for idx in np.ndindex(*args[k].shape):
        plus = [a.copy() for a in args]
        minus = [a.copy() for a in args]
        plus[k][idx] += eps
        minus[k][idx] -= eps
        num[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
    np.testing.assert_allclose(analytic[k], num, rtol=1e-5, atol=1e-7)
    print(f"d/d{name}: reference == central differences (max |diff| {np.abs(analytic[k] - num).max():.1e})")

# %% [markdown]
# 5. The layer. numbactr's GRU layer runs exactly these launches (numbactr/layers/recurrent.py,
#    GRUFn); its input is (B, T*V) with rows = samples, its output (B, T*H).

# %%
title("5. the GRU layer on the simulator")
from numbactr.autograd import Tape, Tensor              # noqa: E402
from numbactr.config import DenseLayer                  # noqa: E402
from numbactr.enums import Layer_t                      # noqa: E402
from numbactr.layers import RunInfo, build              # noqa: E402

device.set_device("sim")
layer = build(DenseLayer(Layer_t.GRU, ["x"], ["h"], num_output=H, batchsize=B, SeqLength=T, vector_size=V),
              [(B, T * V)])
layer.params = [Tensor(wflat.copy(), requires_grad=True), Tensor(hx.copy(), requires_grad=True)]
xin = Tensor(x.reshape(B, T * V).copy(), requires_grad=True)
tape = Tape()
(out,) = layer.forward(tape, [xin], RunInfo(training=True, valid=B))
tape.backward({id(out): (out, dy.reshape(B, T * H))})
np.testing.assert_allclose(out.data, hs[:, 1:].reshape(B, T * H), rtol=1e-6)
np.testing.assert_allclose(xin.grad, dx.reshape(B, T * V), rtol=1e-5, atol=1e-6)
np.testing.assert_allclose(layer.params[1].grad, dh0.reshape(1, -1), rtol=1e-5, atol=1e-6)
print("layer output and gradients (x, hx) equal the step-by-step run")

print("\ntutorial 04 OK")
