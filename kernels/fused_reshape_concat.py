"""FusedReshapeConcat and FusedReshapeConcatGeneral (DIN's item/ad split of behaviour sequences).

Inputs x_i (B, S, w_i), i = 0..k-1, W = sum w_i, c_i = w_0 + ... + w_{i-1}. Row (b, s) of the
concatenation z[b, s, :] = [x_0[b, s, :] | x_1[b, s, :] | ...] goes to

    FusedReshapeConcat:         s < S-1 -> item[b*(S-1) + s, :]    item (B*(S-1), W)
                                s = S-1 -> ad[b, :]                ad   (B, W)
    FusedReshapeConcatGeneral:  out[b*S + s, :]                     out  (B*S, W)

Backward is the inverse copy: dx_i[b, s, c] = d(item | ad | out)[row(b, s), c_i + c] (every output
element comes from exactly one input element, so nothing adds up).

The kernels copy one input at a time (launch per input, like Concat): numba has no arrays of
pointers. ``split`` = 1 selects the item/ad routing, 0 the General one (``ad`` is then unused).

HugeCTR: HugeCTR/src/layers/fused_reshape_concat_layer.cu and fused_reshape_concat_general_layer.cu.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from .launch import launch_1d


# ---- NumPy reference -------------------------------------------------------------------------
def fused_reshape_concat_forward_ref(xs) -> tuple[np.ndarray, np.ndarray]:
    """(item (B*(S-1), W), ad (B, W)) from inputs (B, S, w_i)."""
    z = np.concatenate(xs, axis=2)                                   # (B, S, W)
    b, s, w = z.shape
    return z[:, :-1, :].reshape(b * (s - 1), w).copy(), z[:, -1, :].copy()


def fused_reshape_concat_backward_ref(d_item, d_ad, widths, slots: int) -> list:
    """dx_i (B, S, w_i) from d_item (B*(S-1), W) and d_ad (B, W)."""
    b, w = d_ad.shape
    dz = np.concatenate([d_item.reshape(b, slots - 1, w), d_ad.reshape(b, 1, w)], axis=1)
    return [np.array(p) for p in np.split(dz, np.cumsum(widths)[:-1], axis=2)]


def fused_reshape_concat_general_forward_ref(xs) -> np.ndarray:
    """out (B*S, W) from inputs (B, S, w_i)."""
    z = np.concatenate(xs, axis=2)
    return z.reshape(-1, z.shape[2])


def fused_reshape_concat_general_backward_ref(d_out, widths, slots: int) -> list:
    dz = d_out.reshape(-1, slots, d_out.shape[1])
    return [np.array(p) for p in np.split(dz, np.cumsum(widths)[:-1], axis=2)]


# ---- kernels (one thread per element of one input x (B, S, w), grid-stride) ------------------
@cuda.jit
def fused_reshape_concat_forward_kernel(x, item, ad, c0, split):
    slots, w = x.shape[1], x.shape[2]
    for e in range(cuda.grid(1), x.shape[0] * slots * w, cuda.gridsize(1)):
        r = e // w                       # r = b*S + s
        c = e - r * w
        b = r // slots
        s = r - b * slots
        if split != 0 and s == slots - 1:
            ad[b, c0 + c] = x[b, s, c]
        else:
            item[r - b * split, c0 + c] = x[b, s, c]   # split: b*(S-1) + s


@cuda.jit
def fused_reshape_concat_backward_kernel(d_item, d_ad, dx, c0, split):
    slots, w = dx.shape[1], dx.shape[2]
    for e in range(cuda.grid(1), dx.shape[0] * slots * w, cuda.gridsize(1)):
        r = e // w
        c = e - r * w
        b = r // slots
        s = r - b * slots
        if split != 0 and s == slots - 1:
            dx[b, s, c] = d_ad[b, c0 + c]
        else:
            dx[b, s, c] = d_item[r - b * split, c0 + c]


# ---- launch wrappers (allocate nothing; arrays are contiguous float32) ------------------------
def _offsets(pieces, width: int) -> list:
    offs, c0 = [], 0
    for p in pieces:
        offs.append(c0)
        c0 += p.shape[2]
    if c0 != width:
        raise ValueError(f"fused_reshape_concat: inputs are {c0} wide in total, outputs {width}")
    return offs


def fused_reshape_concat_forward(xs, item, ad, threads: int | None = None) -> None:
    """item (B*(S-1), W), ad (B, W) <- inputs xs (B, S, w_i); overwrites both."""
    for x, c0 in zip(xs, _offsets(xs, item.shape[1])):
        launch_1d(fused_reshape_concat_forward_kernel, x.size, x, item, ad, c0, 1, threads=threads)


def fused_reshape_concat_backward(d_item, d_ad, dxs, threads: int | None = None) -> None:
    """dxs[i] (B, S, w_i) <- d_item, d_ad; overwrites every dxs[i]."""
    for dx, c0 in zip(dxs, _offsets(dxs, d_item.shape[1])):
        launch_1d(fused_reshape_concat_backward_kernel, dx.size, d_item, d_ad, dx, c0, 1, threads=threads)


def fused_reshape_concat_general_forward(xs, out, threads: int | None = None) -> None:
    """out (B*S, W) <- inputs xs (B, S, w_i); overwrites out."""
    for x, c0 in zip(xs, _offsets(xs, out.shape[1])):
        # ad is unused when split == 0: an empty view stands in for it (no allocation, and no
        # aliased argument, which the simulator would copy back over out)
        launch_1d(fused_reshape_concat_forward_kernel, x.size, x, out, out[:0], c0, 0, threads=threads)


def fused_reshape_concat_general_backward(d_out, dxs, threads: int | None = None) -> None:
    for dx, c0 in zip(dxs, _offsets(dxs, d_out.shape[1])):
        launch_1d(fused_reshape_concat_backward_kernel, dx.size, d_out, d_out[:0], dx, c0, 0, threads=threads)


PTX_CHECKS = [
    (fused_reshape_concat_forward_kernel,
     "void(float32[:, :, ::1], float32[:, ::1], float32[:, ::1], int64, int64)"),
    (fused_reshape_concat_backward_kernel,
     "void(float32[:, ::1], float32[:, ::1], float32[:, :, ::1], int64, int64)"),
]
