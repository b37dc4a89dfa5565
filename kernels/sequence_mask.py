"""SequenceMask: an attention mask from per-sample sequence lengths (no gradient).

    y[b, 0, i, j] = 1 if i < int(len_from[b]) and j < int(len_to[b]) else 0
    # len_from, len_to (B, 1) float lengths (truncated to int) -> y (B, 1, Lf, Lt)

HugeCTR: HugeCTR/src/layers/sequence_mask_layer.cu (lengths are stored as floats and cast to int).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int64

from .launch import launch_1d


# ---- NumPy reference -------------------------------------------------------------------------
def sequence_mask_ref(len_from: np.ndarray, len_to: np.ndarray, lf: int, lt: int) -> np.ndarray:
    nf = np.trunc(np.asarray(len_from, np.float64).reshape(-1, 1, 1, 1))   # (B, 1, 1, 1)
    nt = np.trunc(np.asarray(len_to, np.float64).reshape(-1, 1, 1, 1))
    i = np.arange(lf).reshape(1, 1, lf, 1)
    j = np.arange(lt).reshape(1, 1, 1, lt)
    return ((i < nf) & (j < nt)).astype(np.float32)


# ---- kernel (one thread per mask element, grid-stride) ---------------------------------------
@cuda.jit
def sequence_mask_kernel(len_from, len_to, y):
    # len_from, len_to (B,), y (B, Lf, Lt)
    lf, lt = y.shape[1], y.shape[2]
    for e in range(cuda.grid(1), y.shape[0] * lf * lt, cuda.gridsize(1)):
        b = e // (lf * lt)
        rest = e - b * lf * lt
        i = rest // lt
        j = rest - i * lt
        inside = i < int64(len_from[b]) and j < int64(len_to[b])
        y[b, i, j] = float32(1.0) if inside else float32(0.0)


# ---- launch wrapper (allocates nothing; arrays are contiguous float32) -----------------------
def sequence_mask(len_from, len_to, y, threads: int | None = None) -> None:
    """y (B, 1, Lf, Lt) <- lengths len_from, len_to (B, 1); overwrites y."""
    b = y.shape[0]
    if len_from.size != b or len_to.size != b:
        raise ValueError(f"sequence_mask: lengths {len_from.shape}, {len_to.shape} do not match y {y.shape}")
    launch_1d(sequence_mask_kernel, y.size, len_from.reshape(-1), len_to.reshape(-1),
              y.reshape(b, y.shape[-2], y.shape[-1]), threads=threads)


PTX_CHECKS = [
    (sequence_mask_kernel, "void(float32[::1], float32[::1], float32[:, :, ::1])"),
]
