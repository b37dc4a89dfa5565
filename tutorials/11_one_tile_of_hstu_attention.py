# %% [markdown]
# # Tutorial 11: one tile of HSTU's jagged attention, forward and backward, step by step.
#
# Run:
# ```bash
# NUMBACTR_DEVICE=sim python tutorials/11_one_tile_of_hstu_attention.py
# ```
#
# HSTU (Meta's "Actions Speak Louder than Words", arXiv 2402.17152; the attention of generative
# recommenders and MLPerf's DLRMv3) replaces softmax by a pointwise SiLU, so every (query, key) pair is
# independent of the others in its row:
#
#     out_i = sum_j  m[i, j] * silu(alpha * (q_i . k_j + rab[b, h, i, j])) * v_j / S
#
# over jagged sequences (no padding), with a mask m made of a causal window, context rows and target
# groups (kernels/hstu_attention_ref.py's docstring has the rules and the hand-derived backward). The
# numba.cuda forward gives one block to each (sequence, head, query tile); here we do by hand what that
# block does, then the backward's two kernels for the same tile:
#   1. a tiny batch of two sequences, its mask, and the tile we follow;
#   2. the block's unit: which sequence, head and query rows its index names; the q tile;
#   3. the key range: which keys these rows can see at all (key_range_rule);
#   4. key tile by key tile: the mask, the scores, silu, and the accumulation of out;
#   5. the tile's out rows against the NumPy reference, the numba.cuda kernel (in the simulator) and
#      numbactr.hstu.hstu_attn_varlen_func (FBGEMM's signature; the compiled cpu version);
#   6. backward, the dq kernel's unit: ds, dq and drab for the same query rows;
#   7. backward, the dk/dv kernel's unit: a key tile, the queries that see it (query_range_rule), dk and dv;
#      every gradient against the reference, the kernels and the face.
# The kernel modules are imported, never copied: the scalar rules used below (visible_rule,
# key_range_rule, query_range_rule, silu_and_grad_rule) are the plain Python functions the kernels compile.

# %%
import os

# The simulator must be chosen before numba is imported for the first time (numba reads the
# environment once, at import). Sections 5 and 7 run the kernels in it.
os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
os.environ["NUMBACTR_DEVICE"] = "sim"

import numpy as np                                                    # noqa: E402

from numbactr.hstu import hstu_attn_varlen_backward, hstu_attn_varlen_func  # noqa: E402
from numbactr.kernels import hstu_attention as K                      # noqa: E402  (kernels, scalar rules)
from numbactr.kernels import hstu_attention_ref as R                  # noqa: E402  (the NumPy reference)

np.set_printoptions(precision=4, suppress=True, linewidth=110)
f32 = np.float32


def title(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 70 - len(text)))


# %% [markdown]
# ## 1. A tiny batch and its mask
# Two sequences of 6 and 3 tokens, stored one after the other (rows 0-5 and 6-8): ``cu_seqlens`` [0, 6, 9].
# Two heads of width D = 4 (values Dv = 3). Sequence 0 has 1 context token (row 0: it sees every
# non-target row) and 2 targets (rows 4 and 5: each sees the history and itself, never the other
# target); the window is causal, (-1, 0). A relative bias rab (one plane for all heads, 6 x 6: FBGEMM
# gives it max_seqlen rows and columns) is added to each score. alpha = 0.5; S = max_seqlen = 6.
# Printed: sequence 0's mask, query rows down, keys across. The tile we follow is rows 4 and 5 (the two
# targets) of head 1, with tiles of 2 rows and 2 keys (a GPU uses 16 x 16 at D = 64).

# %%
title("1. the batch and sequence 0's mask")
rng = np.random.default_rng(11)
lengths = [6, 3]
cu = np.array([0, 6, 9], np.int32)
H, D, DV, M = 2, 4, 3, 6
q = rng.uniform(-1, 1, (9, H, D)).astype(f32)                 # (T, H, D)
k = rng.uniform(-1, 1, (9, H, D)).astype(f32)
v = rng.uniform(-1, 1, (9, H, DV)).astype(f32)                # (T, H, Dv)
dout = rng.uniform(-1, 1, (9, H, DV)).astype(f32)             # dL/dout, for the backward
rab = rng.uniform(-1, 1, (2, 1, M, M)).astype(f32)            # (B, 1, M, M)
num_contexts, num_targets = np.array([1, 0], np.int32), np.array([2, 0], np.int32)
alpha, window, group = f32(0.5), (-1, 0), 1
S = M                                                         # scaling_seqlen = -1 means max_seqlen
wl, wr = R.resolve_window(window, M)                          # (-1, 0) -> (6, 0): unbounded left, causal
n, hist, ctx = lengths[0], lengths[0] - 2, 1                  # sequence 0: targets start at row 4
mask = R.hstu_mask_ref(n, hist, ctx, wl, wr, group)
print("window (left, right) resolved:", (wl, wr), "  targets start at", hist)
print(mask.astype(int))
BM = BN = 2                                                   # rows of a query tile, keys of a key tile

# %% [markdown]
# ## 2. The block's unit: (sequence, head, query tile) from its index
# The forward kernel runs a grid-stride loop over units u = (b * H + h) * n_tiles + tile, n_tiles being
# the query tiles of the longest sequence (3 here). Our unit, b 0, h 1, tile 2, is u = 5. A unit past
# the end of its sequence (sequence 1 has no tile 2) is skipped by the whole block. The block loads the
# tile's q rows into shared memory: row ``cu[b] + i`` of q, head h.

# %%
title("2. unit u = 5: sequence 0, head 1, query rows 4 and 5")
n_tiles = -(-M // BM)
u = 5
b, h, i0 = u // (H * n_tiles), (u // n_tiles) % H, (u % n_tiles) * BM
start = cu[b]
rows = min(BM, n - i0)
print(f"b {b}, h {h}, i0 {i0}, rows {rows} (n_tiles {n_tiles})")
sq = q[start + i0:start + i0 + rows, h]                       # (BM, D): the q tile in shared memory
print("q tile:\n", sq)

# %% [markdown]
# ## 3. The key range
# Which keys can rows 4 and 5 see at all? key_range_rule: from i_first - wl to i_last + wr (the window),
# widened to every non-target key when the tile holds a context row. The kernel walks only these keys,
# in key tiles of BN; the mask decides pair by pair inside. Causal rows 4-5 see keys 0..5.

# %%
title("3. key range of the tile")
lo, hi = K.key_range_rule(i0, i0 + rows - 1, n, hist, ctx, wl, wr)
print(f"keys [{lo}, {hi}) in key tiles starting at {list(range(lo, hi, BN))}")

# %% [markdown]
# ## 4. Key tile by key tile: mask, scores, silu, accumulate
# For each key tile the block loads k and v rows into shared memory, then each (row r, key c) pair gets
#     p[r, c] = silu(alpha * (q_r . k_c + rab[b, 0, i, j])) / S      where visible_rule says so, else 0,
# and each out row adds sum_c p[r, c] v_c to its accumulator (float32, in shared memory). In the last key
# tile the targets meet: (4, 5) is hidden by the causal window and (5, 4) by the target rule (a target
# sees no other target of an earlier group; with groups of 1 every other target is one).

# %%
title("4. the accumulation")
so = np.zeros((BM, DV), f32)                                   # the out accumulators
for j0 in range(lo, hi, BN):
    cols = min(BN, hi - j0)
    sk, sv = k[start + j0:start + j0 + cols, h], v[start + j0:start + j0 + cols, h]
    sp = np.zeros((BM, BN), f32)
    for r in range(rows):
        for c in range(cols):
            i, j = i0 + r, j0 + c
            if K.visible_rule(i, j, hist, ctx, wl, wr, group):
                s = f32(sq[r] @ sk[c]) + rab[b, 0, i, j]
                sp[r, c] = K.silu_and_grad_rule(alpha * s)[0] / f32(S)
    so[:rows] += sp[:rows, :cols] @ sv
    print(f"keys {j0}..{j0 + cols - 1}: p =\n{sp}\n  out so far =\n{so}")

# %% [markdown]
# ## 5. The tile's out rows, checked
# Against the NumPy reference (float64, the whole batch), the numba.cuda forward kernel run in the
# simulator with the same 2 x 2 tiles (every thread a Python thread), and the face with FBGEMM's
# signature, numbactr.hstu.hstu_attn_varlen_func, on NumPy arrays (the compiled cpu version).

# %%
title("5. out: by hand == reference == kernel (sim) == face")
kw = dict(num_contexts=num_contexts, num_targets=num_targets, target_group_size=group, window=window,
          alpha=float(alpha))
f64 = [a.astype(np.float64) for a in (q, k, v, dout, rab)]
ref_out = R.hstu_attn_forward_ref(*f64[:3], cu, M, rab=f64[4], **kw)
out_kernel = np.full(v.shape, np.nan, f32)
K.hstu_attn_forward(q, k, v, cu, num_contexts, num_targets, out_kernel, M, window=window, alpha=alpha,
                    rab=rab, tile=(BM, BN), threads=4)
out_face = hstu_attn_varlen_func(q, k, v, cu, cu, None, None, M, M, -1, num_contexts, num_targets,
                                 window_size=window, alpha=float(alpha), rab=rab)
tile_rows = slice(start + i0, start + i0 + rows)
print("by hand  :\n", so[:rows], "\nreference:\n", ref_out[tile_rows, h])
for name, got in (("by hand", so[:rows]), ("kernel", out_kernel[tile_rows, h]), ("face", out_face[tile_rows, h])):
    np.testing.assert_allclose(got, ref_out[tile_rows, h], rtol=1e-5, atol=1e-6, err_msg=name)
np.testing.assert_allclose(out_kernel, ref_out, rtol=1e-5, atol=1e-6)
np.testing.assert_allclose(out_face, ref_out, rtol=1e-5, atol=1e-6)
print("the tile agrees, and so do the whole batch's rows of the kernel and the face")

# %% [markdown]
# ## 6. Backward, the dq kernel's unit: the same query rows
# The backward (derived by hand in kernels/hstu_attention_ref.py) needs, for every visible pair,
#     ds[r, c] = (dout_r . v_c) * silu'(x) * alpha / S,    x = alpha * (q_r . k_c + rab),
# and then dq_r = sum_c ds[r, c] k_c. The dq kernel walks the same units and key range as the forward;
# since each (query, key) pair of a head passes there exactly once, it also writes drab[b, 0, i, j] = ds
# (added over the heads when rab has one plane for all, as here: an atomic add on a GPU).

# %%
title("6. dq and drab of rows 4, 5 (head 1)")
sdo = dout[tile_rows, h]
sdq = np.zeros((BM, D), f32)
drab_tile = np.zeros((rows, hi - lo), f32)
for j0 in range(lo, hi, BN):
    cols = min(BN, hi - j0)
    sk, sv = k[start + j0:start + j0 + cols, h], v[start + j0:start + j0 + cols, h]
    sds = np.zeros((BM, BN), f32)
    for r in range(rows):
        for c in range(cols):
            i, j = i0 + r, j0 + c
            if K.visible_rule(i, j, hist, ctx, wl, wr, group):
                x = alpha * (f32(sq[r] @ sk[c]) + rab[b, 0, i, j])
                sds[r, c] = f32(sdo[r] @ sv[c]) * K.silu_and_grad_rule(x)[1] * alpha / f32(S)
    sdq[:rows] += sds[:rows, :cols] @ sk
    drab_tile[:, j0 - lo:j0 - lo + cols] = sds[:rows, :cols]
ref_dq, ref_dk, ref_dv, ref_drab = R.hstu_attn_backward_ref(*f64[:4], cu, M, rab=f64[4], **kw)
print("dq by hand:\n", sdq[:rows], "\nreference:\n", ref_dq[tile_rows, h])
np.testing.assert_allclose(sdq[:rows], ref_dq[tile_rows, h], rtol=1e-5, atol=1e-6)
# the reference's drab sums both heads (one rab plane): with head 0's dout zeroed (so its ds is 0) it
# gives head 1's share, the part this unit adds
dout_h1_only = np.where(np.arange(H)[None, :, None] == h, f64[3], 0)
only_h1 = R.hstu_attn_backward_ref(*f64[:3], dout_h1_only, cu, M, rab=f64[4], **kw)[3]
np.testing.assert_allclose(drab_tile, only_h1[b, 0, i0:i0 + rows, lo:hi], rtol=1e-5, atol=1e-6)
print("drab of this unit (head 1's share):\n", drab_tile)

# %% [markdown]
# ## 7. Backward, the dk/dv kernel's unit: keys 4 and 5, and the queries that see them
# Two kernels, each writing only its own rows, need no atomics for dq, dk, dv: the dk/dv kernel gives one
# block to each (sequence, head, KEY tile), keeps its k and v rows in shared memory and walks the query
# tiles that can see them (query_range_rule: keys 4, 5 are targets, so no context row sees them and the
# causal window leaves queries 4 and 5). Per pair it recomputes p and ds, then
#     dv_c = sum_r p[r, c] dout_r,      dk_c = sum_r ds[r, c] q_r.
# Finally all gradients of the whole batch: reference == kernels in the simulator == face.

# %%
title("7. dk, dv of keys 4, 5 (head 1); then everything")
j0 = 4
cols = min(BN, n - j0)
kk, vv = k[start + j0:start + j0 + cols, h], v[start + j0:start + j0 + cols, h]
qlo, qhi = K.query_range_rule(j0, j0 + cols - 1, n, hist, ctx, wl, wr)
print(f"queries [{qlo}, {qhi}) see keys {j0}..{j0 + cols - 1}")
sdk, sdv = np.zeros((BN, D), f32), np.zeros((BN, DV), f32)
for i in range(qlo, qhi):
    qi, doi = q[start + i, h], dout[start + i, h]
    for c in range(cols):
        if K.visible_rule(i, j0 + c, hist, ctx, wl, wr, group):
            x = alpha * (f32(qi @ kk[c]) + rab[b, 0, i, j0 + c])
            silu, dsilu = K.silu_and_grad_rule(x)
            sdv[c] += silu / f32(S) * doi
            sdk[c] += f32(doi @ vv[c]) * dsilu * alpha / f32(S) * qi
key_rows = slice(start + j0, start + j0 + cols)
print("dk by hand:\n", sdk[:cols], "\nreference:\n", ref_dk[key_rows, h])
np.testing.assert_allclose(sdk[:cols], ref_dk[key_rows, h], rtol=1e-5, atol=1e-6)
np.testing.assert_allclose(sdv[:cols], ref_dv[key_rows, h], rtol=1e-5, atol=1e-6)

grads_kernel = [np.full(a.shape, np.nan, f32) for a in (q, k, v)] + [np.zeros(rab.shape, f32)]
K.hstu_attn_backward(q, k, v, dout, cu, num_contexts, num_targets, *grads_kernel[:3], M, window=window,
                     alpha=alpha, rab=rab, drab=grads_kernel[3], tile=(BM, BN), threads=4)
grads_face = hstu_attn_varlen_backward(dout, q, k, v, cu, cu, None, None, M, M, -1, num_contexts, num_targets,
                                       window_size=window, alpha=float(alpha), rab=rab, has_drab=True)
for name, want, got_kernel, got_face in zip(("dq", "dk", "dv", "drab"), (ref_dq, ref_dk, ref_dv, ref_drab),
                                            grads_kernel, grads_face):
    np.testing.assert_allclose(got_kernel, want, rtol=1e-5, atol=1e-6, err_msg=f"kernel {name}")
    np.testing.assert_allclose(got_face, want, rtol=1e-5, atol=1e-6, err_msg=f"face {name}")
print("dq, dk, dv, drab: reference == numba.cuda kernels (simulator) == hstu_attn_varlen_backward")
print("\ntutorial 11 OK")
