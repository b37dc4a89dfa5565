"""DLRM dot interaction.

    Z = [dense; emb]                          # dense (B, D), emb (B, S, D) -> Z (B, n, D), n = S + 1
    y = [dense | Z_i . Z_j for i = 1..n-1, j = 0..i-1 | 0]     # (B, D + P + 1), P = n(n-1)/2

The pair (i, j), j < i, sits in column D + i(i-1)/2 + j (strict lower triangle, row-major); the last
column is a 0.0 pad that gets no gradient.

    dZ_i = sum_{j != i} dy[b, pair(i, j)] * Z_j          # (B, n, D), pair(i, j) = pair(j, i)
    d_dense = dy[:, :D] + dZ_0;   d_emb = dZ_1..n-1      # (B, D), (B, S, D)

HugeCTR: HugeCTR/src/layers/interaction_layer.cu (fp32 path; it never writes the pad, numbactr
writes 0.0 as the fp16 path does).

Kernels (gpu, sim): one block per sample with shared memory (the default, ``method="block"``): the block
copies Z of its sample into shared memory once (coalesced reads of dense[b] and emb[b], rows padded to D + 1
floats so a warp reading Z_j of consecutive pairs hits different banks), then its threads write the output
row (consecutive columns: coalesced) with every dot product read from shared memory; the backward also
stages dy's P pair values there and gives each thread one (i, v) of dZ. Each output element sums the same
products in the same order as the elementwise kernels (``method="elementwise"``, one thread per output
element reading Z from global memory), so the two give the same bits on the simulator. A sample whose Z
(and pairs) do not fit BLOCK_SMEM_BYTES falls back to the elementwise kernels. One launch each way, no
scratch memory.

Compiled CPU versions (numba.njit, the cpu device's path): one sample at a time, over fixed chunks of
samples (kernels/parallel_cpu.py), so any thread count gives the same bits. The forward's dot products are compiled with
the 'reassoc' fast-math flag alone, which lets LLVM sum the D products in vector lanes (another float32
summation order; no other flag, so NaN, inf and signed zeros behave as without it). The backward adds
G_ij Z_j and G_ij Z_i pair by pair, j in increasing order for every i, as the kernel does: no fast math.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int64, njit, prange

from .launch import SIMULATED, _sm_count, launch, launch_1d
from .parallel_cpu import PARALLEL_MIN, pjit


def interaction_out_width(num_slots: int, width: int) -> int:
    """D + n(n-1)/2 + 1 for n = S + 1 interacting vectors of width D."""
    n = num_slots + 1
    return width + n * (n - 1) // 2 + 1


# ---- NumPy reference -------------------------------------------------------------------------
def interaction_forward_ref(dense: np.ndarray, emb: np.ndarray) -> np.ndarray:
    bsz, width = dense.shape
    z = np.concatenate([dense[:, None, :], emb], axis=1)           # (B, n, D)
    n = z.shape[1]
    m = np.einsum("biv,bjv->bij", z, z)                            # (B, n, n)
    rows, cols = np.tril_indices(n, k=-1)                          # row-major strict lower triangle
    pad = np.zeros((bsz, 1), dtype=dense.dtype)
    return np.concatenate([dense, m[:, rows, cols], pad], axis=1)


def interaction_backward_ref(dense: np.ndarray, emb: np.ndarray, dy: np.ndarray):
    """-> (d_dense (B, D), d_emb (B, S, D))."""
    bsz, width = dense.shape
    z = np.concatenate([dense[:, None, :], emb], axis=1)           # (B, n, D)
    n = z.shape[1]
    rows, cols = np.tril_indices(n, k=-1)
    g = np.zeros((bsz, n, n), dtype=dy.dtype)                      # (B, n, n)
    g[:, rows, cols] = dy[:, width:width + rows.size]
    dz = np.einsum("bij,bjv->biv", g + g.transpose(0, 2, 1), z)     # (B, n, D)
    return dy[:, :width] + dz[:, 0], dz[:, 1:]


# ---- kernels ---------------------------------------------------------------------------------
@cuda.jit(device=True, inline=True)
def _pair_of(p):
    """(i, j) of pair column p = i(i-1)/2 + j (0 <= j < i): a float guess, then fixed up exactly."""
    i = int64((float64(1.0) + math.sqrt(float64(1.0) + float64(8.0) * p)) * float64(0.5))
    while i * (i - 1) // 2 > p:
        i -= 1
    while (i + 1) * i // 2 <= p:
        i += 1
    return i, p - i * (i - 1) // 2


@cuda.jit(device=True, inline=True)
def _stage(dense, emb, z, b, stride, tid, nt):
    """Sample b's Z rows (dense, then its S embeddings) into shared z, row i at i * stride, by the block's
    nt threads (coalesced reads)."""
    width = dense.shape[1]
    for k in range(tid, (emb.shape[1] + 1) * width, nt):
        i = k // width
        v = k - i * width
        if i == 0:
            z[v] = dense[b, v]
        else:
            z[i * stride + v] = emb[b, i - 1, v]


@cuda.jit
def interaction_forward_kernel(dense, emb, out):
    # dense (B, D), emb (B, S, D), out (B, D + P + 1); one thread per output element.
    width = dense.shape[1]
    n = emb.shape[1] + 1
    npairs = n * (n - 1) // 2
    ncols = out.shape[1]
    for idx in range(cuda.grid(1), dense.shape[0] * ncols, cuda.gridsize(1)):
        b = idx // ncols
        c = idx - b * ncols
        if c < width:
            out[b, c] = dense[b, c]
        elif c < width + npairs:
            i, j = _pair_of(c - width)
            # Z_i = emb[b, i-1] (i >= 1); Z_j = dense[b] when j == 0 else emb[b, j-1]
            acc = float32(0.0)
            if j == 0:
                for v in range(width):
                    acc += float32(emb[b, i - 1, v]) * float32(dense[b, v])
            else:
                for v in range(width):
                    acc += float32(emb[b, i - 1, v]) * float32(emb[b, j - 1, v])
            out[b, c] = acc
        else:
            out[b, c] = float32(0.0)


@cuda.jit
def interaction_backward_kernel(dense, emb, dy, d_dense, d_emb):
    # One thread per (b, i, v) of dZ (B, n, D); each loops over the other n-1 vectors, so every
    # gradient element has exactly one writer (no atomics).
    width = dense.shape[1]
    n = emb.shape[1] + 1
    per_row = n * width
    for idx in range(cuda.grid(1), dense.shape[0] * per_row, cuda.gridsize(1)):
        b = idx // per_row
        rem = idx - b * per_row
        i = rem // width
        v = rem - i * width
        acc = float32(0.0)
        for j in range(n):
            if j != i:
                hi = max(i, j)
                lo = min(i, j)
                zj = float32(dense[b, v]) if j == 0 else float32(emb[b, j - 1, v])
                acc += float32(dy[b, width + hi * (hi - 1) // 2 + lo]) * zj
        if i == 0:
            d_dense[b, v] = float32(dy[b, v]) + acc
        else:
            d_emb[b, i - 1, v] = acc


#: dynamic shared memory one block of the block kernels may use (the limit without an opt-in on every GPU)
BLOCK_SMEM_BYTES = 48 * 1024


def block_smem_bytes(num_slots: int, width: int, backward: bool) -> int:
    """Shared memory of one block: Z (n rows of D + 1 floats), and in backward dy's P pair values."""
    n = num_slots + 1
    return 4 * (n * (width + 1) + (n * (n - 1) // 2 if backward else 0))


@cuda.jit
def interaction_forward_block_kernel(dense, emb, out):
    # One block per sample (grid-stride over samples); dynamic shared memory z: n rows of D + 1 floats.
    z = cuda.shared.array(0, float32)
    width = dense.shape[1]
    stride = width + 1
    n = emb.shape[1] + 1
    npairs = n * (n - 1) // 2
    ncols = out.shape[1]
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for b in range(cuda.blockIdx.x, dense.shape[0], cuda.gridDim.x):
        _stage(dense, emb, z, b, stride, tid, nt)
        cuda.syncthreads()
        for c in range(tid, ncols, nt):
            if c < width:
                out[b, c] = z[c]
            elif c < width + npairs:
                i, j = _pair_of(c - width)
                acc = float32(0.0)
                for v in range(width):
                    acc += z[i * stride + v] * z[j * stride + v]
                out[b, c] = acc
            else:
                out[b, c] = float32(0.0)
        cuda.syncthreads()                     # z is overwritten by the block's next sample


@cuda.jit
def interaction_backward_block_kernel(dense, emb, dy, d_dense, d_emb):
    # One block per sample; shared: z (n rows of D + 1 floats), then g (the P pair values of dy[b]).
    sm = cuda.shared.array(0, float32)
    width = dense.shape[1]
    stride = width + 1
    n = emb.shape[1] + 1
    npairs = n * (n - 1) // 2
    g0 = n * stride
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for b in range(cuda.blockIdx.x, dense.shape[0], cuda.gridDim.x):
        _stage(dense, emb, sm, b, stride, tid, nt)
        for p in range(tid, npairs, nt):
            sm[g0 + p] = dy[b, width + p]
        cuda.syncthreads()
        for k in range(tid, n * width, nt):   # one (i, v) of dZ per thread: one writer per element
            i = k // width
            v = k - i * width
            acc = float32(0.0)
            for j in range(n):
                if j != i:
                    hi = max(i, j)
                    lo = min(i, j)
                    acc += sm[g0 + hi * (hi - 1) // 2 + lo] * sm[j * stride + v]
            if i == 0:
                d_dense[b, v] = float32(dy[b, v]) + acc
            else:
                d_emb[b, i - 1, v] = acc
        cuda.syncthreads()


# ---- launch wrappers (allocate nothing; arrays are contiguous float32) ------------------------
METHODS = ("block", "elementwise")


def _method(method, num_slots: int, width: int, backward: bool) -> str:
    """The kernel to run: 'block' unless its shared memory does not fit (then 'elementwise')."""
    if method is None:
        fits = block_smem_bytes(num_slots, width, backward) <= BLOCK_SMEM_BYTES
        return "block" if fits else "elementwise"
    if method not in METHODS:
        raise ValueError(f"interaction: method must be one of {METHODS}, got {method!r}")
    if method == "block" and block_smem_bytes(num_slots, width, backward) > BLOCK_SMEM_BYTES:
        raise ValueError(f"interaction: method 'block' needs {block_smem_bytes(num_slots, width, backward)} "
                         f"bytes of shared memory for {num_slots} slots of width {width}; the limit is "
                         f"{BLOCK_SMEM_BYTES} (use method 'elementwise')")
    return method


def _launch_blocks(kernel, samples: int, smem: int, threads: int | None, *args) -> None:
    """One block per sample (grid-stride over samples), ``smem`` bytes of dynamic shared memory each."""
    if samples <= 0:
        return
    tpb = threads or (32 if SIMULATED else 128)
    if not 0 < tpb <= 1024:
        raise ValueError(f"threads per block must be in 1..1024, got {tpb}")
    cap = 2 if SIMULATED else 32 * _sm_count()
    launch(kernel, max(1, min(samples, cap)), tpb, *args, shared=smem)


def _check_shapes(dense, emb, wide) -> None:
    bsz, width = dense.shape
    if emb.ndim != 3 or emb.shape[0] != bsz or emb.shape[2] != width:
        raise ValueError(f"interaction: emb {emb.shape} does not match dense {dense.shape}")
    expect = (bsz, interaction_out_width(emb.shape[1], width))
    if tuple(wide.shape) != expect:
        raise ValueError(f"interaction: output/grad shape {wide.shape}, expected {expect}")


def interaction_forward(dense, emb, out, threads: int | None = None, method: str | None = None) -> None:
    """out (B, D + P + 1) = [dense, pair dots, 0]; out must not alias dense or emb.
    method: 'block' (one block per sample, shared memory; the default where it fits) or 'elementwise'."""
    _check_shapes(dense, emb, out)
    slots, width = emb.shape[1], dense.shape[1]
    if _method(method, slots, width, False) == "block":
        _launch_blocks(interaction_forward_block_kernel, dense.shape[0], block_smem_bytes(slots, width, False),
                       threads, dense, emb, out)
    else:
        launch_1d(interaction_forward_kernel, out.size, dense, emb, out, threads=threads)


def interaction_backward(dense, emb, dy, d_dense, d_emb, threads: int | None = None,
                         method: str | None = None) -> None:
    """Overwrite d_dense (B, D) and d_emb (B, S, D) from dy; they must not alias dense or emb
    (other threads still read the forward inputs). method as in interaction_forward."""
    _check_shapes(dense, emb, dy)
    slots, width = emb.shape[1], dense.shape[1]
    if _method(method, slots, width, True) == "block":
        _launch_blocks(interaction_backward_block_kernel, dense.shape[0], block_smem_bytes(slots, width, True),
                       threads, dense, emb, dy, d_dense, d_emb)
    else:
        launch_1d(interaction_backward_kernel, dense.shape[0] * (emb.shape[1] + 1) * dense.shape[1],
                  dense, emb, dy, d_dense, d_emb, threads=threads)


# ---- compiled CPU versions (numba.njit; the cpu device; work split by parallel_cpu) ----------------
_CHUNK = 64           # samples per chunk


@njit(cache=True, inline="always")
def _dot(a, b, width):
    acc = float32(0.0)
    for v in range(width):
        acc += a[v] * b[v]
    return acc


# The j = 0 term (Z_0 = dense) is written out of the j loops below: choosing the array inside the loop
# (dense if j == 0 else emb[b, j - 1]) keeps LLVM from vectorizing the D loop (measured 10x slower).
@njit(cache=True, inline="always")
def _forward_chunk(dense, emb, out, c):
    width, n = dense.shape[1], emb.shape[1] + 1
    for b in range(c * _CHUNK, min(dense.shape[0], (c + 1) * _CHUNK)):
        d, e, o = dense[b], emb[b], out[b]            # (D,), (S, D), (D + P + 1,)
        for v in range(width):
            o[v] = d[v]
        p = width                                     # pairs of Z_i sit in columns p .. p + i - 1
        for i in range(1, n):
            zi = e[i - 1]
            o[p] = _dot(zi, d, width)
            for j in range(1, i):
                o[p + j] = _dot(zi, e[j - 1], width)
            p += i
        o[p] = float32(0.0)


@njit(cache=True, inline="always")
def _axpy(a, x, y, width):
    # y += a x
    for v in range(width):
        y[v] += a * x[v]


# Row by row: dZ_i = sum_j G_sym(i, j) Z_j accumulates in its own output row, one stream of Z_j rows
# (the sample's Z, in L1) per multiply-add; a pair at a time (dZ_i += g Z_j and dZ_j += g Z_i) moved two
# rows in and out per pair and ran 2-2.5x slower (B = 2048, 27 x 128).
@njit(cache=True, inline="always")
def _backward_chunk(dense, emb, dy, d_dense, d_emb, c):
    width, n = dense.shape[1], emb.shape[1] + 1
    for b in range(c * _CHUNK, min(dense.shape[0], (c + 1) * _CHUNK)):
        d, e, g = dense[b], emb[b], dy[b]
        dd, de = d_dense[b], d_emb[b]                 # dZ_0, dZ_1..n-1
        for v in range(width):                        # dZ_0 = dY's dense part + sum_i g(i, 0) Z_i
            dd[v] = g[v]
        for i in range(1, n):
            _axpy(g[width + i * (i - 1) // 2], e[i - 1], dd, width)
        for i in range(1, n):                         # dZ_i = g(i, 0) Z_0 + sum_{j != i} g(max, min) Z_j
            dzi = de[i - 1]
            base = width + i * (i - 1) // 2
            gi0 = g[base]
            for v in range(width):
                dzi[v] = gi0 * d[v]
            for j in range(1, i):
                _axpy(g[base + j], e[j - 1], dzi, width)
            for j in range(i + 1, n):
                _axpy(g[width + j * (j - 1) // 2 + i], e[j - 1], dzi, width)


@pjit(cache=True, fastmath={"reassoc"})
def _forward_cpu(dense, emb, out):
    chunks = (dense.shape[0] + _CHUNK - 1) // _CHUNK
    if out.size * dense.shape[1] < PARALLEL_MIN:     # ~ the multiply-adds
        for c in range(chunks):
            _forward_chunk(dense, emb, out, c)
    else:
        for c in prange(chunks):
            _forward_chunk(dense, emb, out, c)


@pjit(cache=True, fastmath={"contract"})
def _backward_cpu(dense, emb, dy, d_dense, d_emb):
    chunks = (dense.shape[0] + _CHUNK - 1) // _CHUNK
    if dy.size * dense.shape[1] < PARALLEL_MIN:
        for c in range(chunks):
            _backward_chunk(dense, emb, dy, d_dense, d_emb, c)
    else:
        for c in prange(chunks):
            _backward_chunk(dense, emb, dy, d_dense, d_emb, c)


def interaction_forward_cpu(dense, emb, out) -> None:
    """interaction_forward compiled for the CPU: out (B, D + P + 1) from dense (B, D), emb (B, S, D)."""
    _check_shapes(dense, emb, out)
    _forward_cpu(dense, emb, out)


def interaction_backward_cpu(dense, emb, dy, d_dense, d_emb) -> None:
    """interaction_backward compiled for the CPU: overwrite d_dense (B, D) and d_emb (B, S, D)."""
    _check_shapes(dense, emb, dy)
    _backward_cpu(dense, emb, dy, d_dense, d_emb)


PTX_CHECKS = [
    (interaction_forward_kernel, "void(float32[:, ::1], float32[:, :, ::1], float32[:, ::1])"),
    (interaction_backward_kernel, "void(float32[:, ::1], float32[:, :, ::1], float32[:, ::1], "
                                  "float32[:, ::1], float32[:, :, ::1])"),
    (interaction_forward_block_kernel, "void(float32[:, ::1], float32[:, :, ::1], float32[:, ::1])"),
    (interaction_backward_block_kernel, "void(float32[:, ::1], float32[:, :, ::1], float32[:, ::1], "
                                        "float32[:, ::1], float32[:, :, ::1])"),
    # mixed precision on gpu/sim: float16 tensors in and out, float32 arithmetic inside
    (interaction_forward_kernel, "void(float16[:, ::1], float16[:, :, ::1], float16[:, ::1])"),
    (interaction_backward_kernel, "void(float16[:, ::1], float16[:, :, ::1], float16[:, ::1], "
                                  "float16[:, ::1], float16[:, :, ::1])"),
    (interaction_forward_block_kernel, "void(float16[:, ::1], float16[:, :, ::1], float16[:, ::1])"),
    (interaction_backward_block_kernel, "void(float16[:, ::1], float16[:, :, ::1], float16[:, ::1], "
                                        "float16[:, ::1], float16[:, :, ::1])"),
]
