"""Dropout with a counter-based hash mask (no mask buffer, no RNG state).

    train:  y = x * keep / (1 - r),  keep = [hash(seed, step, layer_id, i) >> 32 >= threshold]
    eval:   y = x                                   (the caller just passes x through)
    backward: dx = dy * keep / (1 - r)              (the same kernel, same mask, applied to dy)

x, y: any shape, M elements; i is the flat (row-major) element index. threshold = round(r * 2^32),
so P(keep) = 1 - r up to 2^-32. The hash is SplitMix64's finalizer (``mix``) chained over the words:

    k = mix(mix(mix(seed ^ SEED_SALT) ^ step) ^ layer_id)
    h_i = mix(k + (i + 1) * GAMMA)                  # SplitMix64's i-th output for state k

All of it is uint64 integer arithmetic (wrapping), evaluated inside the kernel, so the GPU, the
simulator and the NumPy reference draw bit-identical masks for the same (seed, step, layer_id), and
the backward pass recomputes the forward mask instead of storing it. The kept values are multiplied
by the float32 ``scale = float32(1 / (1 - r))`` in both, so outputs match exactly too.

HugeCTR: HugeCTR/src/layers/dropout_layer.cu (cuRAND uniform mask seeded from /dev/urandom, kept
where 1 - u >= r, scaled by 1/(1 - r); inference is a copy). Its masks are not reproducible; these are.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint64

from .launch import launch_1d
from .hash64 import add64, mul64, splitmix64_mix, splitmix64_mix_ref

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15          # SplitMix64 increment (2^64 / golden ratio)
SEED_SALT = 0xD1B54A32D192ED03      # keeps seed 0 away from the fixed point mix(0) == 0


# ---- NumPy reference -------------------------------------------------------------------------
def dropout_threshold(rate: float) -> int:
    """The uint32-scale threshold: an element is kept when its hash's top 32 bits >= threshold."""
    if not 0.0 < rate < 1.0:
        raise ValueError(f"dropout rate must be in (0, 1), got {rate}")
    return int(round(rate * 2.0 ** 32))


def dropout_scale(rate: float) -> np.float32:
    return np.float32(1.0 / (1.0 - rate))


def dropout_mask_ref(n: int, rate: float, seed: int, step: int, layer_id: int) -> np.ndarray:
    """Boolean keep-mask (n,) for flat element indices 0..n-1."""
    # (1,) and (n,) uint64 arrays: NumPy array arithmetic wraps modulo 2^64 without a warning
    k = splitmix64_mix_ref(np.uint64(seed & MASK64) ^ np.uint64(SEED_SALT))
    k = splitmix64_mix_ref(k ^ np.uint64(step & MASK64))
    k = splitmix64_mix_ref(k ^ np.uint64(layer_id & MASK64))
    i = np.arange(1, n + 1, dtype=np.uint64)
    h = splitmix64_mix_ref(k + i * np.uint64(GAMMA))
    return (h >> np.uint64(32)) >= np.uint64(dropout_threshold(rate))


def dropout_forward_ref(x: np.ndarray, rate: float, seed: int, step: int, layer_id: int) -> np.ndarray:
    keep = dropout_mask_ref(x.size, rate, seed, step, layer_id).reshape(x.shape)
    scale = x.dtype.type(dropout_scale(rate))
    return np.where(keep, x * scale, x.dtype.type(0))


def dropout_backward_ref(dy: np.ndarray, rate: float, seed: int, step: int, layer_id: int) -> np.ndarray:
    """Dropout is linear in x with a fixed mask: the backward is the same map applied to dy."""
    return dropout_forward_ref(dy, rate, seed, step, layer_id)


# ---- kernel (flat views, grid-stride) --------------------------------------------------------
@cuda.jit
def dropout_kernel(x, y, seed, stepv, layer_id, threshold, scale):
    # Per-launch key from (seed, step, layer_id): three SplitMix64 finalizer rounds (same per thread).
    # The arithmetic wraps explicitly (hash64.py): the same bits, no overflow warning in the simulator.
    # The step comes from device memory (stepv[0]): it changes every step, a launch argument would not
    # (what a CUDA graph replays).
    k = splitmix64_mix(seed ^ uint64(SEED_SALT))
    k = splitmix64_mix(k ^ stepv[0])
    k = splitmix64_mix(k ^ layer_id)
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        h = splitmix64_mix(add64(k, mul64(uint64(i) + uint64(1), uint64(GAMMA))))
        if (h >> uint64(32)) >= threshold:
            y[i] = float32(x[i]) * scale            # a float16 x (mixed precision): float32 product
        else:
            y[i] = float32(0.0)


# ---- launch wrappers (allocate nothing; arrays are contiguous float32) ------------------------
def dropout_apply(x, y, rate: float, seed: int, step, layer_id: int) -> None:
    """y = x * mask / (1 - rate). Forward: x = input; backward: x = dy, y = dx (same mask). step: an int,
    or a (1,) uint64 device array holding it (the model's per-step array, numbactr.runtime.step_values)."""
    if x.size != y.size:
        raise ValueError(f"dropout: input has {x.size} elements, output {y.size}")
    if isinstance(step, (int, np.integer)):
        step = cuda.to_device(np.array([int(step) & MASK64], np.uint64))
    launch_1d(dropout_kernel, x.size, x.reshape(-1), y.reshape(-1), np.uint64(seed & MASK64),
              step, np.uint64(layer_id & MASK64), np.uint64(dropout_threshold(rate)), dropout_scale(rate))


PTX_CHECKS = [
    (dropout_kernel, "void(float32[::1], float32[::1], uint64, uint64[::1], uint64, uint64, float32)"),
    (dropout_kernel, "void(float16[::1], float16[::1], uint64, uint64[::1], uint64, uint64, float32)"),
]
