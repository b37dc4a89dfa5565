"""Initial values of newly inserted embedding rows, drawn from a hash of (seed, key, d).

    pool[row(key), d] = lo + (hi - lo) * u(seed, key, d),   u = top 24 bits of splitmix64(...) / 2^24

for every key whose row was handed out in this batch (row >= first_new). Every (seed, key, d) gives the
same value on gpu, sim and cpu and whichever rank owns the key, so a sharded run starts from exactly the
embedding vectors of the one-rank run. HugeCTR instead fills the whole pool with U(lo, hi) from curand
at start and a new key takes whatever its row holds: the same distribution, but tied to row order.
HugeCTR: HugeCTR/src/embeddings/... (pool init with curand uniform, spec §5.3).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint64

from .launch import launch_1d
from .hash64 import add64, splitmix64_mix, splitmix64_mix_ref

_GOLDEN = 0x9E3779B97F4A7C15


# ---- NumPy reference -------------------------------------------------------------------------
def _splitmix64_ref(x: np.ndarray) -> np.ndarray:
    """SplitMix64 output for state x, any shape (array arithmetic wraps modulo 2^64 silently)."""
    x = np.asarray(x, np.uint64)
    return splitmix64_mix_ref(x + np.uint64(_GOLDEN)).reshape(x.shape)


def row_values_ref(keys: np.ndarray, width: int, seed: int, lo: float, hi: float) -> np.ndarray:
    """(N, D) float32 initial vectors of keys (N,) uint64."""
    keys = np.asarray(keys, dtype=np.uint64)
    base = _splitmix64_ref(keys ^ _splitmix64_ref(np.full(keys.shape, seed, np.uint64)))      # (N,)
    h = _splitmix64_ref(base[:, None] + np.arange(width, dtype=np.uint64)[None, :])           # (N, D)
    u = (h >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / 16777216.0)
    return (np.float32(lo) + np.float32(hi - lo) * u).astype(np.float32)


def init_new_rows_ref(pool: np.ndarray, rows: np.ndarray, keys: np.ndarray, first_new: int, seed: int,
                      lo: float, hi: float) -> np.ndarray:
    """New pool with the rows >= first_new (handed out this batch) set from their keys."""
    out = pool.copy()
    new = rows >= first_new
    out[rows[new]] = row_values_ref(keys[new], pool.shape[1], seed, lo, hi)
    return out


# ---- kernel ----------------------------------------------------------------------------------
@cuda.jit(device=True, inline=True)
def _splitmix64(x):
    # explicit wrapping arithmetic: the same bits as _splitmix64_ref, no overflow warning in the simulator
    return splitmix64_mix(add64(x, uint64(_GOLDEN)))


@cuda.jit
def init_new_rows_kernel(pool, rows, keys, first_new, seed, lo, span):
    # One (key occurrence, d) per loop step; duplicates of a new key write the same value.
    d_size = pool.shape[1]
    for i in range(cuda.grid(1), rows.shape[0] * d_size, cuda.gridsize(1)):
        k = i // d_size
        d = i - k * d_size
        r = rows[k]
        if r >= first_new:
            base = _splitmix64(keys[k] ^ _splitmix64(seed))
            h = _splitmix64(add64(base, uint64(d)))
            u = float32(h >> uint64(40)) * float32(1.0 / 16777216.0)
            pool[r, d] = lo + span * u


def init_new_rows(pool, rows, keys, first_new: int, seed: int, lo: float, hi: float) -> None:
    """In place: pool (V, D) float32, rows (N,) int64, keys (N,) uint64."""
    launch_1d(init_new_rows_kernel, rows.shape[0] * pool.shape[1], pool, rows, keys, np.int64(first_new),
              np.uint64(seed), np.float32(lo), np.float32(hi - lo))


@cuda.jit
def init_flagged_rows_kernel(w, base, stride, dim, rows, keys, flags, seed, lo, span):
    """init_new_rows_kernel for the rows of occurrences flagged new (flags[k] != 0, rows[k] >= 0): the
    deferred hash insert's first occurrences (kernels.hash_table.hash_insert_deferred), no threshold read.
    The table is rows of `stride` elements from w[base] (flat: a padded table's rows are not contiguous)."""
    for i in range(cuda.grid(1), rows.shape[0] * dim, cuda.gridsize(1)):
        k = i // dim
        d = i - k * dim
        r = rows[k]
        if flags[k] != 0 and r >= 0:
            h0 = _splitmix64(keys[k] ^ _splitmix64(seed))
            h = _splitmix64(add64(h0, uint64(d)))
            u = float32(h >> uint64(40)) * float32(1.0 / 16777216.0)
            w[base + r * stride + d] = lo + span * u


def init_flagged_rows(w, base: int, stride: int, dim: int, rows, keys, flags, seed: int, lo: float,
                      hi: float) -> None:
    """In place: the flagged occurrences' rows of the table at w[base:] (flat float32, rows of `stride`
    elements, the first `dim` used); rows (N,) int64, keys (N,) uint64, flags (N,) int64."""
    launch_1d(init_flagged_rows_kernel, rows.shape[0] * dim, w, np.int64(base), np.int64(stride), np.int64(dim),
              rows, keys, flags, np.uint64(seed), np.float32(lo), np.float32(hi - lo))


PTX_CHECKS = [
    (init_new_rows_kernel, "void(float32[:, ::1], int64[::1], uint64[::1], int64, uint64, float32, float32)"),
    (init_flagged_rows_kernel, "void(float32[::1], int64, int64, int64, int64[::1], uint64[::1], int64[::1], uint64, "
                               "float32, float32)"),
]
