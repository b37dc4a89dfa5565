"""uint64 arithmetic that wraps modulo 2^64 on purpose, for the hash functions of the kernels.

    mul64(a, b) = (a * b) mod 2^64        add64(a, b) = (a + b) mod 2^64
    splitmix64_mix(z)  = SplitMix64's finalizer (Stafford's mix 13):
        z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9;  z = (z ^ z >> 27) * 0x94D049BB133111EB;  z ^ z >> 31
    fmix64(k)          = murmur3's 64-bit finalizer:
        k = (k ^ k >> 33) * 0xFF51AFD7ED558CCD;  k = (k ^ k >> 33) * 0xC4CEB9FE1A85EC53;  k ^ k >> 33

Hashing needs multiplication and addition modulo 2^64. A compiled kernel wraps silently, but Numba's
CUDA simulator runs the kernel body on NumPy scalars, and NumPy reports every wrapped scalar product or
sum with "RuntimeWarning: overflow encountered in scalar multiply" (a warning per thread and call).
These device functions split each operand into 32-bit halves so that no intermediate value leaves
[0, 2^64): products of two halves are < 2^64 and only the low 32 bits of the cross terms are kept.
The result is the exact wrapped value, bit for bit, on the GPU, in the simulator and in the NumPy
references (NumPy array arithmetic wraps without a check; ``*_ref`` below are those references).
On a GPU the split costs a few integer instructions per hash, next to the memory access it feeds.

All arguments must be uint64 (write constants as ``uint64(...)``: see notes on integer promotion).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, uint64

from .launch import launch_1d

LO32 = 0xFFFFFFFF
SPLITMIX_M1 = 0xBF58476D1CE4E5B9
SPLITMIX_M2 = 0x94D049BB133111EB
FMIX_C1 = 0xFF51AFD7ED558CCD
FMIX_C2 = 0xC4CEB9FE1A85EC53


# ---- NumPy references (array arithmetic wraps modulo 2^64 and never warns) ------------------------
def mul64_ref(a, b) -> np.ndarray:
    return np.asarray(a, np.uint64).reshape(-1) * np.asarray(b, np.uint64).reshape(-1)


def add64_ref(a, b) -> np.ndarray:
    return np.asarray(a, np.uint64).reshape(-1) + np.asarray(b, np.uint64).reshape(-1)


def splitmix64_mix_ref(z) -> np.ndarray:
    z = np.asarray(z, np.uint64).reshape(-1)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(SPLITMIX_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(SPLITMIX_M2)
    return z ^ (z >> np.uint64(31))


def fmix64_ref(k) -> np.ndarray:
    k = np.asarray(k, np.uint64).reshape(-1)
    k = (k ^ (k >> np.uint64(33))) * np.uint64(FMIX_C1)
    k = (k ^ (k >> np.uint64(33))) * np.uint64(FMIX_C2)
    return k ^ (k >> np.uint64(33))


# ---- device functions -----------------------------------------------------------------------------
@cuda.jit(device=True, inline=True)
def mul64(a, b):
    """(a * b) mod 2^64 without an intermediate >= 2^64 (see the module docstring)."""
    a_lo = a & uint64(LO32)
    a_hi = a >> uint64(32)
    b_lo = b & uint64(LO32)
    b_hi = b >> uint64(32)
    lo = a_lo * b_lo                                             # < 2^64: exact
    # high word: carry of lo + low halves of the cross products (a_hi * b_hi only feeds bits >= 64)
    hi = (lo >> uint64(32)) + ((a_hi * b_lo) & uint64(LO32)) + ((a_lo * b_hi) & uint64(LO32))
    return ((hi & uint64(LO32)) << uint64(32)) | (lo & uint64(LO32))


@cuda.jit(device=True, inline=True)
def add64(a, b):
    """(a + b) mod 2^64 without an intermediate >= 2^64."""
    lo = (a & uint64(LO32)) + (b & uint64(LO32))                 # < 2^33
    hi = (a >> uint64(32)) + (b >> uint64(32)) + (lo >> uint64(32))
    return ((hi & uint64(LO32)) << uint64(32)) | (lo & uint64(LO32))


@cuda.jit(device=True, inline=True)
def splitmix64_mix(z):
    z = mul64(z ^ (z >> uint64(30)), uint64(SPLITMIX_M1))
    z = mul64(z ^ (z >> uint64(27)), uint64(SPLITMIX_M2))
    return z ^ (z >> uint64(31))


@cuda.jit(device=True, inline=True)
def fmix64(k):
    k = mul64(k ^ (k >> uint64(33)), uint64(FMIX_C1))
    k = mul64(k ^ (k >> uint64(33)), uint64(FMIX_C2))
    return k ^ (k >> uint64(33))


# ---- a kernel that applies them elementwise (tests compare it with the references) ---------------
@cuda.jit
def wrapping_kernel(a, b, prod, total, mixed, fmixed):
    for i in range(cuda.grid(1), a.shape[0], cuda.gridsize(1)):
        prod[i] = mul64(a[i], b[i])
        total[i] = add64(a[i], b[i])
        mixed[i] = splitmix64_mix(a[i])
        fmixed[i] = fmix64(a[i])


def wrapping_apply(a, b, prod, total, mixed, fmixed) -> None:
    """Elementwise over (N,) uint64 arrays: prod = mul64(a, b), total = add64(a, b),
    mixed = splitmix64_mix(a), fmixed = fmix64(a)."""
    launch_1d(wrapping_kernel, a.shape[0], a, b, prod, total, mixed, fmixed)


PTX_CHECKS = [
    (wrapping_kernel, "void(uint64[::1], uint64[::1], uint64[::1], uint64[::1], uint64[::1], uint64[::1])"),
]
