"""HSTU's relative attention bias: a learned weight per relative position plus one per log-time bucket.

generative-recommenders' research ``RelativeBucketedTimeAndPositionBasedBias``
(generative_recommenders/research/modeling/sequential/hstu.py), over timestamps padded to N per sequence:

    rab[b, i, j] = pos_w[N - 1 + j - i] + ts_w[bucket(ts[b, i'] - ts[b, j])],   i' = min(i + 1, N - 1)
    bucket(dt)   = min(floor(ln(max(|dt|, 1)) / 0.301), num_buckets)

pos_w (2N - 1,), ts_w (num_buckets + 1,). Query i is compared with the time of the item after it (i + 1: the
item it predicts; the last row repeats the last time), as the original's ``ext_timestamps[:, 1:] -
ext_timestamps[:, :-1]``. Its position part is written there as a pad / repeat / reshape of pos_w whose
entry (i, j) is pos_w[N - 1 + j - i]; 0.301 is its constant (log10(2) applied to a natural log, so a bucket
spans a factor of e^0.301 = 1.35). The weights' gradients sum drab over the pairs of each weight:

    dpos_w[N - 1 + j - i] += drab[b, i, j],   dts_w[bucket(...)] += drab[b, i, j]

The result is the attention's rab with one head for all heads: rab[:, None] (kernels/hstu_attention.py).
The kernels are one thread per (b, i, j), grid-stride; the backward adds with float32 atomics (so its
sums' order, and last bits, vary on a GPU). Buckets are computed in float64 in both, so the kernel's
buckets are the reference's.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int64

from .launch import launch_1d

LOG_BUCKET_DIVISOR = 0.301


def time_bucket_ref(dt, num_buckets: int) -> np.ndarray:
    """bucket(dt) of the module docstring, elementwise (int64)."""
    dt = np.abs(np.asarray(dt, np.int64)).astype(np.float64)
    return np.minimum(np.floor(np.log(np.maximum(dt, 1.0)) / LOG_BUCKET_DIVISOR), num_buckets).astype(np.int64)


def _check(timestamps, pos_w, ts_w):
    if timestamps.ndim != 2 or not np.issubdtype(timestamps.dtype, np.integer):
        raise ValueError(f"hstu rab: timestamps must be (B, N) integers, got {timestamps.dtype} {timestamps.shape}")
    n = timestamps.shape[1]
    if pos_w.shape != (2 * n - 1,) or ts_w.ndim != 1 or ts_w.size < 1:
        raise ValueError(f"hstu rab: pos_w must be (2N - 1,) = ({2 * n - 1},) and ts_w (num_buckets + 1,), got "
                         f"{pos_w.shape}, {ts_w.shape}")
    return n, ts_w.size - 1


def _pairs(timestamps, num_buckets):
    """(position index, bucket) of every (b, i, j): (N, N) and (B, N, N) int64."""
    n = timestamps.shape[1]
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    nxt = timestamps[:, np.minimum(np.arange(n) + 1, n - 1)]            # (B, N): ts of item i + 1
    return n - 1 + j - i, time_bucket_ref(nxt[:, :, None] - timestamps[:, None, :], num_buckets)


def rab_forward_ref(timestamps, pos_w, ts_w):
    """rab (B, N, N) from timestamps (B, N) int, pos_w (2N - 1,), ts_w (num_buckets + 1,)."""
    _, nb = _check(timestamps, pos_w, ts_w)
    pos, bucket = _pairs(timestamps, nb)
    return pos_w[pos][None] + ts_w[bucket]


def rab_backward_ref(timestamps, drab, pos_w, ts_w):
    """(dpos_w, dts_w) of rab_forward_ref for drab (B, N, N)."""
    n, nb = _check(timestamps, pos_w, ts_w)
    if drab.shape != (timestamps.shape[0], n, n):
        raise ValueError(f"hstu rab backward: drab must be {(timestamps.shape[0], n, n)}, got {drab.shape}")
    pos, bucket = _pairs(timestamps, nb)
    dpos = np.zeros(pos_w.shape, drab.dtype)
    dts = np.zeros(ts_w.shape, drab.dtype)
    np.add.at(dpos, np.broadcast_to(pos, drab.shape), drab)
    np.add.at(dts, bucket, drab)
    return dpos, dts


# ---- kernels (one thread per (b, i, j), grid-stride) ----------------------------------------------------------
@cuda.jit(device=True, inline=True)
def _bucket(dt, num_buckets):
    a = float64(abs(dt))
    if a < 1.0:
        a = 1.0
    return min(int64(math.floor(math.log(a) / LOG_BUCKET_DIVISOR)), num_buckets)


@cuda.jit
def rab_forward_kernel(timestamps, pos_w, ts_w, rab):
    # timestamps (B, N) int64, pos_w (2N - 1,), ts_w (nb + 1,) float32 -> rab (B, N, N) float32
    n = timestamps.shape[1]
    nb = ts_w.shape[0] - 1
    for e in range(cuda.grid(1), rab.size, cuda.gridsize(1)):
        j = e % n
        i = (e // n) % n
        b = e // (n * n)
        dt = timestamps[b, min(i + 1, n - 1)] - timestamps[b, j]
        rab[b, i, j] = pos_w[n - 1 + j - i] + ts_w[_bucket(dt, nb)]


@cuda.jit
def rab_backward_kernel(timestamps, drab, dpos_w, dts_w):
    # adds drab (B, N, N) into dpos_w (2N - 1,) and dts_w (nb + 1,) (zeroed by the caller)
    n = timestamps.shape[1]
    nb = dts_w.shape[0] - 1
    for e in range(cuda.grid(1), drab.size, cuda.gridsize(1)):
        j = e % n
        i = (e // n) % n
        b = e // (n * n)
        g = float32(drab[b, i, j])
        cuda.atomic.add(dpos_w, n - 1 + j - i, g)
        cuda.atomic.add(dts_w, _bucket(timestamps[b, min(i + 1, n - 1)] - timestamps[b, j], nb), g)


def rab_forward(timestamps, pos_w, ts_w, rab, threads: int | None = None) -> None:
    """rab (B, N, N) <- the bias (overwritten); timestamps int64, weights float32."""
    b, n = timestamps.shape
    if rab.shape != (b, n, n) or pos_w.shape != (2 * n - 1,):
        raise ValueError(f"rab_forward: rab must be {(b, n, n)} and pos_w ({2 * n - 1},), got {rab.shape}, "
                         f"{pos_w.shape}")
    launch_1d(rab_forward_kernel, b * n * n, timestamps, pos_w, ts_w, rab, threads=threads)


def rab_backward(timestamps, drab, dpos_w, dts_w, threads: int | None = None) -> None:
    """dpos_w, dts_w += the weights' gradients of drab (zero them first)."""
    b, n = timestamps.shape
    if drab.shape != (b, n, n) or dpos_w.shape != (2 * n - 1,):
        raise ValueError(f"rab_backward: drab must be {(b, n, n)} and dpos_w ({2 * n - 1},), got {drab.shape}, "
                         f"{dpos_w.shape}")
    launch_1d(rab_backward_kernel, b * n * n, timestamps, drab, dpos_w, dts_w, threads=threads)


PTX_CHECKS = [
    (rab_forward_kernel, "void(int64[:, ::1], float32[::1], float32[::1], float32[:, :, ::1])"),
    (rab_backward_kernel, "void(int64[:, ::1], float32[:, :, ::1], float32[::1], float32[::1])"),
]
