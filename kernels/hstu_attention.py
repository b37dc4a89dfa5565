"""HSTU's jagged attention as numba.cuda kernels (forward, and a hand-written backward) and, for the CPU, blocked
into matrix products (NumPy's BLAS) with a compiled (numba.njit) elementwise step. The formulas, the mask and
the arguments' rules are in kernels/hstu_attention_ref.py (its NumPy reference is the oracle of both
versions here):

    p[i, j] = m[i, j] silu(alpha (q_i . k_j + rab[b, h, i, j])) / S,    out_i = sum_j p[i, j] v_j

FBGEMM: fbgemm_gpu/experimental/hstu (``hstu_attn_varlen_func``; the kernels hstu_ampere/hstu_fwd.h and
hstu_bwd.h are CUTLASS code with the same blocking). The scalar rules (which keys a query sees, silu and its
derivative) are written once below as plain Python; the kernels compile them as cuda device functions, the
cpu version calls ``visible_rule`` compiled with njit and ``key_range_rule`` in Python, and writes silu
and silu' with the same formula, its tanh from NumPy (vectorized; numba's scalar tanhf cost 30x more).

The kernels (one block per unit of work, grid-stride over the units; every thread of a block walks the same
units, so all reach every syncthreads; all sums in float32):

``forward``, a unit = (sequence b, head h, query tile of ``bm`` rows):
    load the tile's q rows into shared memory, zero the out accumulators (bm, Dv) in shared memory;
    for each key tile of ``bn`` keys in the keys these rows can see (``key_range``):
        load the tile's k and v rows into shared memory                              | sync
        p[r, c] for the bm x bn pairs, 0 where masked, into shared memory            | sync
        out[r, :] += sum_c p[r, c] v[c, :]   (each thread owns the same accumulators in every tile)
    write the tile's out rows.
``backward_dq``, the same units: like the forward with ds in place of p and k in place of v:
    ds[r, c] = (dout_r . v_c) silu'(x) alpha / S, 0 where masked;  dq[r, :] += sum_c ds[r, c] k[c, :].
    Every (query, key) pair of a head passes here once, so drab (when asked) is written here: added to
    (the caller zeroes it), with an atomic add when rab has one head for all heads.
``backward_dkdv``, a unit = (sequence, head, key tile of ``bn`` keys): its k and v rows stay in shared
    memory while the query tiles that can see them (``query_range``) pass:
        load the query tile's q and dout rows                                         | sync
        p[r, c] and ds[r, c] for the tile's pairs                                    | sync
        dv[c, :] += sum_r p[r, c] dout[r, :];  dk[c, :] += sum_r ds[r, c] q[r, :]
Two backward kernels, each writing only its own rows, need no atomics for dq, dk, dv (FBGEMM's backward is
one kernel over key tiles adding dq with atomics); each recomputes q . k, which the forward does not keep.

Tiles: ``tile_for(D, Dv)`` picks bm = bn so that the dk/dv kernel's eight shared arrays stay within 48 KB
(16 for D <= 64, 8 up to 128, 4 up to 256); tests use tiny tiles and blocks in the simulator.

The cpu version (``hstu_attn_forward_cpu`` / ``hstu_attn_backward_cpu``), a unit = one sequence b, all
heads at once; its query rows are cut into tiles of ``CPU_TILE`` (64) rows, and a tile's keys are the range
``key_range_rule`` gives its rows (causal: the keys up to its last row; the blocks above the diagonal,
where every pair is masked, are never computed: the jagged and causal saving is real, only the diagonal
block's upper half is computed and zeroed). Per tile, with Q, K, V, dO the (H, rows, D) views of the
sequence's rows (strided, read by BLAS in place) and X (H, R, C) the tile's block (np.matmul on the (H, R, C)
stacks: one BLAS sgemm per head)::

    forward:  X = Q_t K_r^T (+ rab);  P = m silu(alpha X) / S (compiled, in place);  O_t = P V_r
    backward: X as above, dP = dO_t V_r^T;  P and dS = dP silu'(alpha X) alpha / S, 0 where masked
              (compiled, in place; drab's block written there);  dQ_t = dS K_r;  dK_r += dS^T Q_t;
              dV_r += P^T dO_t

The sums are BLAS's, in its order, not the
kernels' key order: the cpu version matches the reference (and the kernels) to float32 rounding, not bit for
bit (tests/test_hstu_attention.py compares each to the float64 reference with a tolerance). Threads: with
more than one (numba's count in the calling thread) and enough work, the sequences are spread over a pool
of Python threads (NumPy and the njit step release the GIL), longest first, BLAS held to 1 thread
meanwhile; each sequence runs wholly in one thread in a fixed order, so any thread count gives the same bits.
Measured (``numbactr bench hstu``'s batches: 4 sequences of L down to L/2, H 2, D 64, causal; 1 thread, median
CPU time of a call on the shared 2-core sandbox, whose wall times the load inflates), ms at L 128 / 256 / 512:
forward 0.36 / 1.1 / 5.2, backward 0.97 / 3.1 / 9.7; the per-(query, key)-pair float32 loop this replaced
3.4 / 13 / 51 and 4.7 / 18 / 70; PyTorch padded dense (the bench's) 1.3 / 5.3 / 15 and 2.3 / 8.7 / 26.
"""
from __future__ import annotations

import concurrent.futures
import functools
import math
import queue

import numpy as np
from numba import cuda, float32, njit

from .hstu_attention_ref import resolve_window
from .launch import SIMULATED, launch_rows
from .parallel_cpu import PARALLEL_MIN, _num_threads


# ---- the scalar rules, plain Python (each a leaf: compiled for cuda and for the cpu below) ------------------
def visible_rule(i, j, hist, ctx, wl, wr, group):
    """Whether query i sees key j (local positions; hist = where the targets start, ctx = contexts)."""
    if i < ctx and j < hist:
        return True
    if j < i - wl or j > i + wr:
        return False
    return not (i >= hist and j >= hist and j < hist + group * ((i - hist) // group))


def key_range_rule(i_first, i_last, n, hist, ctx, wl, wr):
    """[lo, hi): the keys queries i_first..i_last can see lie in it (the mask decides within)."""
    lo = max(0, i_first - wl)
    hi = min(n, i_last + wr + 1)
    if i_first < ctx:                     # context rows see every non-target key
        lo = 0
        hi = max(hi, hist)
    return lo, hi


def query_range_rule(j_first, j_last, n, hist, ctx, wl, wr):
    """[lo, hi): the queries that can see keys j_first..j_last lie in it."""
    lo = max(0, j_first - wr)
    hi = min(n, j_last + wl + 1)
    if j_first < hist and ctx > 0:        # context rows see every non-target key
        lo = 0
        hi = max(hi, ctx)
    return lo, hi


def silu_and_grad_rule(x):
    """(silu(x), silu'(x)) with sig(x) = 1/2 + tanh(x/2)/2 (no overflow for any x)."""
    s = float32(0.5) + float32(0.5) * math.tanh(float32(0.5) * x)
    return x * s, s * (float32(1.0) + x * (float32(1.0) - s))


_device = functools.partial(cuda.jit, device=True, inline=True)    # inline: compiles without a GPU
_visible = _device(visible_rule)
_key_range = _device(key_range_rule)
_query_range = _device(query_range_rule)
_silu_and_grad = _device(silu_and_grad_rule)

MAX_HEAD_DIM = 256
SHARED_BYTES = 48 * 1024


def tile_for(d: int, dv: int) -> int:
    """Rows of a query tile = keys of a key tile on a GPU: the largest of 16, 8, 4 whose dk/dv kernel's
    shared arrays (k, v, q, dout, dk, dv tiles and two tile x tile scores) fit in 48 KB."""
    for t in (16, 8, 4):
        if 4 * (t * (3 * d + 3 * dv) + 2 * t * t) <= SHARED_BYTES:
            return t
    raise ValueError(f"hstu attention: head dims D {d}, Dv {dv} too large (at most {MAX_HEAD_DIM})")


# ---- device helpers ------------------------------------------------------------------------------------------
@_device
def _load_rows(x, row0, rows, h, s, t, tpb):
    """s (R, E) <- x[row0 + r, h, :] for r < rows, zeros below (the block's threads share the copy)."""
    width = s.shape[1]
    for e in range(t, s.shape[0] * width, tpb):
        r = e // width
        c = e - r * width
        s[r, c] = x[row0 + r, h, c] if r < rows else float32(0.0)


@_device
def _zero(s, t, tpb):
    width = s.shape[1]
    for e in range(t, s.shape[0] * width, tpb):
        s[e // width, e % width] = float32(0.0)


@_device
def _dot(a, r, b, c):
    """a[r, :] . b[c, :] in float32."""
    acc = float32(0.0)
    for e in range(a.shape[1]):
        acc += a[r, e] * b[c, e]
    return acc


@_device
def _store_rows(s, rows, x, row0, h, t, tpb):
    """x[row0 + r, h, :] <- s[r, :] for r < rows."""
    width = s.shape[1]
    for e in range(t, s.shape[0] * width, tpb):
        r = e // width
        if r < rows:
            x[row0 + r, h, e - r * width] = s[r, e - r * width]


# ---- kernels ---------------------------------------------------------------------------------------------------
# Arguments shared by the three: q, k (T, H, D), v (T, H, Dv) float32; cu (B + 1,) int32; num_contexts,
# num_targets (B,) int32; rab (B, 1|H, M, M) float32 (a (1, 1, 1, 1) stand-in when has_rab is 0); n_tiles =
# tiles of the longest sequence; wl, wr the resolved window; alpha, inv_scale = 1/S float32.
@functools.lru_cache(maxsize=None)
def make_forward_kernel(bm: int, bn: int, d: int, dv: int, tpb: int):
    """The forward for query tiles of bm rows, key tiles of bn keys, head dims d, dv, blocks of tpb threads."""

    @cuda.jit
    def hstu_forward_kernel(q, k, v, cu, num_contexts, num_targets, rab, has_rab, out, n_tiles, wl, wr, group,
                            alpha, inv_scale):
        sq = cuda.shared.array((bm, d), float32)        # the unit's query rows
        sk = cuda.shared.array((bn, d), float32)        # one key tile
        sv = cuda.shared.array((bn, dv), float32)       # its values
        sp = cuda.shared.array((bm, bn), float32)       # p of (query row, key)
        so = cuda.shared.array((bm, dv), float32)       # the out rows being summed
        t = cuda.threadIdx.x
        heads = q.shape[1]
        for u in range(cuda.blockIdx.x, (cu.shape[0] - 1) * heads * n_tiles, cuda.gridDim.x):
            b = u // (heads * n_tiles)
            h = (u // n_tiles) % heads
            i0 = (u % n_tiles) * bm
            start = cu[b]
            n = cu[b + 1] - start
            if i0 >= n:                                 # the same for every thread of the block
                continue
            hist = n - num_targets[b]
            ctx = num_contexts[b]
            hr = h if rab.shape[1] > 1 else 0
            rows = min(bm, n - i0)
            _load_rows(q, start + i0, rows, h, sq, t, tpb)
            _zero(so, t, tpb)
            lo, hi = _key_range(i0, i0 + rows - 1, n, hist, ctx, wl, wr)
            for j0 in range(lo, hi, bn):
                cols = min(bn, hi - j0)
                cuda.syncthreads()                      # all are done with the previous tile (and sq is in)
                _load_rows(k, start + j0, cols, h, sk, t, tpb)
                _load_rows(v, start + j0, cols, h, sv, t, tpb)
                cuda.syncthreads()
                for e in range(t, bm * bn, tpb):
                    r = e // bn
                    c = e - r * bn
                    p = float32(0.0)
                    if r < rows and c < cols and _visible(i0 + r, j0 + c, hist, ctx, wl, wr, group):
                        s = _dot(sq, r, sk, c)
                        if has_rab:
                            s += rab[b, hr, i0 + r, j0 + c]
                        p = _silu_and_grad(alpha * s)[0] * inv_scale
                    sp[r, c] = p
                cuda.syncthreads()
                for e in range(t, bm * dv, tpb):        # each thread: the same accumulators every tile
                    r = e // dv
                    c = e - r * dv
                    acc = so[r, c]
                    for jj in range(cols):
                        acc += sp[r, jj] * sv[jj, c]
                    so[r, c] = acc
            _store_rows(so, rows, out, start + i0, h, t, tpb)
            cuda.syncthreads()                          # the shared tiles are free for the next unit

    return hstu_forward_kernel


@functools.lru_cache(maxsize=None)
def make_backward_dq_kernel(bm: int, bn: int, d: int, dv: int, tpb: int):
    """dq (and drab when has_drab) per query tile; drab is added to (zeroed by the caller)."""

    @cuda.jit
    def hstu_backward_dq_kernel(q, k, v, dout, cu, num_contexts, num_targets, rab, has_rab, dq, drab, has_drab,
                                n_tiles, wl, wr, group, alpha, inv_scale):
        sq = cuda.shared.array((bm, d), float32)
        sdo = cuda.shared.array((bm, dv), float32)      # dout of the query rows
        sk = cuda.shared.array((bn, d), float32)
        sv = cuda.shared.array((bn, dv), float32)
        sds = cuda.shared.array((bm, bn), float32)      # ds of (query row, key)
        sdq = cuda.shared.array((bm, d), float32)       # the dq rows being summed
        t = cuda.threadIdx.x
        heads = q.shape[1]
        for u in range(cuda.blockIdx.x, (cu.shape[0] - 1) * heads * n_tiles, cuda.gridDim.x):
            b = u // (heads * n_tiles)
            h = (u // n_tiles) % heads
            i0 = (u % n_tiles) * bm
            start = cu[b]
            n = cu[b + 1] - start
            if i0 >= n:
                continue
            hist = n - num_targets[b]
            ctx = num_contexts[b]
            hr = h if rab.shape[1] > 1 else 0
            rows = min(bm, n - i0)
            _load_rows(q, start + i0, rows, h, sq, t, tpb)
            _load_rows(dout, start + i0, rows, h, sdo, t, tpb)
            _zero(sdq, t, tpb)
            lo, hi = _key_range(i0, i0 + rows - 1, n, hist, ctx, wl, wr)
            for j0 in range(lo, hi, bn):
                cols = min(bn, hi - j0)
                cuda.syncthreads()
                _load_rows(k, start + j0, cols, h, sk, t, tpb)
                _load_rows(v, start + j0, cols, h, sv, t, tpb)
                cuda.syncthreads()
                for e in range(t, bm * bn, tpb):
                    r = e // bn
                    c = e - r * bn
                    ds = float32(0.0)
                    if r < rows and c < cols and _visible(i0 + r, j0 + c, hist, ctx, wl, wr, group):
                        s = _dot(sq, r, sk, c)
                        if has_rab:
                            s += rab[b, hr, i0 + r, j0 + c]
                        ds = _dot(sdo, r, sv, c) * _silu_and_grad(alpha * s)[1] * alpha * inv_scale
                        if has_drab:
                            if drab.shape[1] > 1:       # one plane per head: this thread alone writes here
                                drab[b, h, i0 + r, j0 + c] += ds
                            else:                       # heads share the plane
                                cuda.atomic.add(drab, (b, 0, i0 + r, j0 + c), ds)
                    sds[r, c] = ds
                cuda.syncthreads()
                for e in range(t, bm * d, tpb):
                    r = e // d
                    c = e - r * d
                    acc = sdq[r, c]
                    for jj in range(cols):
                        acc += sds[r, jj] * sk[jj, c]
                    sdq[r, c] = acc
            _store_rows(sdq, rows, dq, start + i0, h, t, tpb)
            cuda.syncthreads()

    return hstu_backward_dq_kernel


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_kernel(bm: int, bn: int, d: int, dv: int, tpb: int):
    """dk and dv per key tile."""

    @cuda.jit
    def hstu_backward_dkdv_kernel(q, k, v, dout, cu, num_contexts, num_targets, rab, has_rab, dk, dv_out,
                                  n_tiles, wl, wr, group, alpha, inv_scale):
        sk = cuda.shared.array((bn, d), float32)        # the unit's keys, resident
        sv = cuda.shared.array((bn, dv), float32)
        sq = cuda.shared.array((bm, d), float32)        # one query tile
        sdo = cuda.shared.array((bm, dv), float32)
        sp = cuda.shared.array((bm, bn), float32)
        sds = cuda.shared.array((bm, bn), float32)
        sdk = cuda.shared.array((bn, d), float32)       # the dk, dv rows being summed
        sdv = cuda.shared.array((bn, dv), float32)
        t = cuda.threadIdx.x
        heads = q.shape[1]
        for u in range(cuda.blockIdx.x, (cu.shape[0] - 1) * heads * n_tiles, cuda.gridDim.x):
            b = u // (heads * n_tiles)
            h = (u // n_tiles) % heads
            j0 = (u % n_tiles) * bn
            start = cu[b]
            n = cu[b + 1] - start
            if j0 >= n:
                continue
            hist = n - num_targets[b]
            ctx = num_contexts[b]
            hr = h if rab.shape[1] > 1 else 0
            cols = min(bn, n - j0)
            _load_rows(k, start + j0, cols, h, sk, t, tpb)
            _load_rows(v, start + j0, cols, h, sv, t, tpb)
            _zero(sdk, t, tpb)
            _zero(sdv, t, tpb)
            lo, hi = _query_range(j0, j0 + cols - 1, n, hist, ctx, wl, wr)
            for i0 in range(lo, hi, bm):
                rows = min(bm, hi - i0)
                cuda.syncthreads()
                _load_rows(q, start + i0, rows, h, sq, t, tpb)
                _load_rows(dout, start + i0, rows, h, sdo, t, tpb)
                cuda.syncthreads()
                for e in range(t, bm * bn, tpb):
                    r = e // bn
                    c = e - r * bn
                    p = float32(0.0)
                    ds = float32(0.0)
                    if r < rows and c < cols and _visible(i0 + r, j0 + c, hist, ctx, wl, wr, group):
                        s = _dot(sq, r, sk, c)
                        if has_rab:
                            s += rab[b, hr, i0 + r, j0 + c]
                        f, g = _silu_and_grad(alpha * s)
                        p = f * inv_scale
                        ds = _dot(sdo, r, sv, c) * g * alpha * inv_scale
                    sp[r, c] = p
                    sds[r, c] = ds
                cuda.syncthreads()
                for e in range(t, bn * dv, tpb):
                    c = e // dv
                    x = e - c * dv
                    acc = sdv[c, x]
                    for r in range(rows):
                        acc += sp[r, c] * sdo[r, x]
                    sdv[c, x] = acc
                for e in range(t, bn * d, tpb):
                    c = e // d
                    x = e - c * d
                    acc = sdk[c, x]
                    for r in range(rows):
                        acc += sds[r, c] * sq[r, x]
                    sdk[c, x] = acc
            _store_rows(sdk, cols, dk, start + j0, h, t, tpb)
            _store_rows(sdv, cols, dv_out, start + j0, h, t, tpb)
            cuda.syncthreads()

    return hstu_backward_dkdv_kernel


# ---- launch wrappers (allocate nothing but a 4-byte rab stand-in; arrays contiguous float32) -------------------
def _check_buffers(name, q, k, v, cu_seqlens, num_contexts, num_targets, rab, outs):
    t, heads, d = q.shape
    dv = v.shape[2]
    if k.shape != q.shape or v.shape[:2] != (t, heads) or max(d, dv) > MAX_HEAD_DIM:
        raise ValueError(f"{name}: q, k (T, H, D) and v (T, H, Dv) with D, Dv <= {MAX_HEAD_DIM}, got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    batch = cu_seqlens.shape[0] - 1
    if num_contexts.shape != (batch,) or num_targets.shape != (batch,):
        raise ValueError(f"{name}: num_contexts, num_targets must be ({batch},) (zeros when there are none), got "
                         f"{num_contexts.shape}, {num_targets.shape}")
    if rab is not None and (rab.ndim != 4 or rab.shape[:2] not in ((batch, 1), (batch, heads))):
        raise ValueError(f"{name}: rab must be (B, 1 or H, M, M), got {rab.shape}")
    for what, arr, shape in outs:
        if arr is not None and arr.shape != shape:
            raise ValueError(f"{name}: {what} must be {shape}, got {arr.shape}")
    return batch, heads, d, dv


@functools.lru_cache(maxsize=None)
def _no_rab_device():
    return np.zeros((1, 1, 1, 1), np.float32) if SIMULATED else cuda.to_device(np.zeros((1, 1, 1, 1), np.float32))


def _scalars(max_seqlen, scaling_seqlen, window, target_group_size, alpha):
    wl, wr = resolve_window(window, int(max_seqlen))
    scale = int(max_seqlen) if scaling_seqlen == -1 else scaling_seqlen
    return wl, wr, int(target_group_size), np.float32(alpha), np.float32(1.0 / scale)


def _grid(batch, heads, max_seqlen, tile):
    n_tiles = -(-int(max_seqlen) // tile)
    return batch * heads * n_tiles, n_tiles


def hstu_attn_forward(q, k, v, cu_seqlens, num_contexts, num_targets, out, max_seqlen, scaling_seqlen=-1,
                      target_group_size=1, window=(-1, -1), alpha=1.0, rab=None, tile=None, threads=None) -> None:
    """out (T, H, Dv) <- the attention (overwritten); arguments as hstu_attention_ref.hstu_attn_forward_ref,
    num_contexts / num_targets as (B,) int32 arrays (zeros for none), checked on the host beforehand
    (hstu_attention_ref.check_args: their values are not read here). tile: (bm, bn), threads: block size."""
    batch, heads, d, dv = _check_buffers("hstu_attn_forward", q, k, v, cu_seqlens, num_contexts, num_targets,
                                         rab, [("out", out, v.shape)])
    bm, bn = tile or (tile_for(d, dv),) * 2
    tpb = threads or (16 if SIMULATED else 128)
    units, n_tiles = _grid(batch, heads, max_seqlen, bm)
    wl, wr, group, a, inv = _scalars(max_seqlen, scaling_seqlen, window, target_group_size, alpha)
    kernel = make_forward_kernel(bm, bn, d, dv, tpb)
    launch_rows(kernel, units, q, k, v, cu_seqlens, num_contexts, num_targets,
                _no_rab_device() if rab is None else rab, int(rab is not None), out, n_tiles, wl, wr, group, a, inv,
                threads=tpb)


def hstu_attn_backward(q, k, v, dout, cu_seqlens, num_contexts, num_targets, dq, dk, dv, max_seqlen,
                       scaling_seqlen=-1, target_group_size=1, window=(-1, -1), alpha=1.0, rab=None, drab=None,
                       tile=None, threads=None) -> None:
    """dq, dk, dv (overwritten) and, when given, drab (rab's shape: added to, zero it first) of the attention;
    two launches (dq and drab per query tile, dk and dv per key tile)."""
    if drab is not None and rab is None:
        raise ValueError("hstu_attn_backward: drab needs rab")
    batch, heads, d, dvw = _check_buffers(
        "hstu_attn_backward", q, k, v, cu_seqlens, num_contexts, num_targets, rab,
        [("dout", dout, v.shape), ("dq", dq, q.shape), ("dk", dk, k.shape), ("dv", dv, v.shape),
         ("drab", drab, None if rab is None else rab.shape)])
    bm, bn = tile or (tile_for(d, dvw),) * 2
    tpb = threads or (16 if SIMULATED else 128)
    wl, wr, group, a, inv = _scalars(max_seqlen, scaling_seqlen, window, target_group_size, alpha)
    rab_arg = _no_rab_device() if rab is None else rab
    units, n_tiles = _grid(batch, heads, max_seqlen, bm)
    launch_rows(make_backward_dq_kernel(bm, bn, d, dvw, tpb), units, q, k, v, dout, cu_seqlens, num_contexts,
                num_targets, rab_arg, int(rab is not None), dq, rab_arg if drab is None else drab,
                int(drab is not None), n_tiles, wl, wr, group, a, inv, threads=tpb)
    units, n_tiles = _grid(batch, heads, max_seqlen, bn)
    launch_rows(make_backward_dkdv_kernel(bm, bn, d, dvw, tpb), units, q, k, v, dout, cu_seqlens, num_contexts,
                num_targets, rab_arg, int(rab is not None), dk, dv, n_tiles, wl, wr, group, a, inv, threads=tpb)


# ---- cpu version: blocked into matrix products -----------------------------------------------------------------
CPU_TILE = 64      # query rows of a tile on the cpu (measured at D 64, 1 thread: 32 and 128 no faster)
_JIT = dict(cache=True, error_model="numpy", nogil=True)
_visible_cpu = njit(inline="always", **_JIT)(visible_rule)


@njit(**_JIT)
def _p_tile(x, th, i0, lo, hist, ctx, wl, wr, group, alpha, inv_scale):
    """x (H, R, C): the scores s = q . k (+ rab) of query rows i0.. and keys lo.. of a tile; th = tanh(alpha
    s / 2). x <- p = m silu(alpha s) / S in place, 0 where masked (silu_and_grad_rule's formula, its tanh
    from NumPy). The mask is a select, not a branch, so the loop vectorizes."""
    for h in range(x.shape[0]):
        for r in range(x.shape[1]):
            xr = x[h, r]
            tr = th[h, r]
            for c in range(x.shape[2]):
                y = alpha * xr[c]
                p = y * (float32(0.5) + float32(0.5) * tr[c]) * inv_scale
                xr[c] = p if _visible_cpu(i0 + r, lo + c, hist, ctx, wl, wr, group) else float32(0.0)


@njit(**_JIT)
def _p_ds_tile(x, th, dp, i0, lo, hist, ctx, wl, wr, group, alpha, inv_scale, drab, has_drab):
    """The backward's elementwise step (arguments as _p_tile; dp (H, R, C) = dout . v): in place, x <- p and
    dp <- ds = dp silu'(alpha s) alpha / S, both 0 where masked. When has_drab, drab (Hr, R, C), the tile's
    block of rab's gradient, <- ds of each head, or, when Hr = 1, the sum of ds over the heads in head order."""
    for h in range(x.shape[0]):
        for r in range(x.shape[1]):
            xr = x[h, r]
            tr = th[h, r]
            dr = dp[h, r]
            for c in range(x.shape[2]):
                y = alpha * xr[c]
                sg = float32(0.5) + float32(0.5) * tr[c]
                f = y * sg * inv_scale
                g = sg * (float32(1.0) + y * (float32(1.0) - sg)) * alpha * inv_scale
                seen = _visible_cpu(i0 + r, lo + c, hist, ctx, wl, wr, group)
                xr[c] = f if seen else float32(0.0)
                dr[c] = dr[c] * g if seen else float32(0.0)
            if has_drab:
                if drab.shape[0] > 1 or h == 0:
                    drab[h if drab.shape[0] > 1 else 0, r] = dr
                else:
                    drab[0, r] += dr


class _CpuCall:
    """One call of the cpu version, resolved on the host: the per-sequence ints as Python ints, the window,
    the scalars, the tile."""

    def __init__(self, q, cu_seqlens, num_contexts, num_targets, max_seqlen, scaling_seqlen, window,
                 target_group_size, alpha, rab, tile):
        self.cu = [int(c) for c in cu_seqlens]
        self.ctx = [int(c) for c in num_contexts]
        self.tgt = [int(t) for t in num_targets]
        self.wl, self.wr, self.group, self.alpha, self.inv = _scalars(max_seqlen, scaling_seqlen, window,
                                                                      target_group_size, alpha)
        self.half_alpha = np.float32(self.alpha * np.float32(0.5))      # exact: alpha s / 2 = (alpha s) / 2
        self.rab = rab
        self.heads = q.shape[1]
        self.tile = CPU_TILE if tile is None else int(tile)
        if self.tile < 1:
            raise ValueError(f"hstu attention cpu: tile must be >= 1 query rows, got {tile}")
        self.lengths = [self.cu[b + 1] - self.cu[b] for b in range(len(self.cu) - 1)]
        self.longest = max(self.lengths, default=0)

    def tiles(self, b):
        """(start, n, hist, ctx) of sequence b and its tiles (i0, i1, lo, hi): query rows i0..i1 - 1 and the
        keys key_range_rule gives them (every key outside lo..hi - 1 is masked for all of these rows)."""
        start, n = self.cu[b], self.lengths[b]
        hist, ctx = n - self.tgt[b], self.ctx[b]
        out = []
        for i0 in range(0, n, self.tile):
            i1 = min(n, i0 + self.tile)
            out.append((i0, i1) + key_range_rule(i0, i1 - 1, n, hist, ctx, self.wl, self.wr))
        return start, n, hist, ctx, out

    def scores(self, b, qs, ks, i0, i1, lo, hi, ws):
        """(x, th), views of the workspace ws: x = q k^T (+ rab) (H, R, C) of the tile, th = tanh(alpha x / 2)."""
        shape = (self.heads, i1 - i0, hi - lo)
        x = ws[0, :math.prod(shape)].reshape(shape)
        th = ws[1, :math.prod(shape)].reshape(shape)
        np.matmul(qs[:, i0:i1], ks[:, lo:hi].transpose(0, 2, 1), out=x)
        if self.rab is not None:
            x += self.rab[b, :, i0:i1, lo:hi]                              # (1 or H, R, C): broadcast over heads
        np.multiply(x, self.half_alpha, out=th)
        np.tanh(th, out=th)                                                # NumPy's tanh: vectorized
        return x, th

    def threads(self, d):
        """Threads for this call: numba's count for the calling thread, at most one per sequence, and 1
        when the work (H sum L^2 d multiply-adds) is below parallel_cpu.PARALLEL_MIN."""
        work = self.heads * sum(n * n for n in self.lengths) * d
        return 1 if work < PARALLEL_MIN else min(_num_threads(), len(self.lengths))


def _heads_first(a, start, n):
    """Rows start..start + n - 1 of a (T, H, E) as an (H, n, E) view (BLAS reads it in place)."""
    return a[start:start + n].transpose(1, 0, 2)


def _forward_sequence(call, b, q, k, v, out, ws):
    """out rows of sequence b, tile by tile: x = q k^T, p = m silu(alpha x) / S, out = p v."""
    start, n, hist, ctx, tiles = call.tiles(b)
    qs, ks, vs, os_ = (_heads_first(a, start, n) for a in (q, k, v, out))
    for i0, i1, lo, hi in tiles:
        x, th = call.scores(b, qs, ks, i0, i1, lo, hi, ws)
        _p_tile(x, th, i0, lo, hist, ctx, call.wl, call.wr, call.group, call.alpha, call.inv)
        np.matmul(x, vs[:, lo:hi], out=os_[:, i0:i1])


def _backward_sequence(call, b, q, k, v, dout, dq, dk, dv, drab, ws):
    """dq, dk, dv rows (and drab's blocks) of sequence b, tile by tile: dp = dout v^T, p and ds from x, then
    dq = ds k (the tile's rows, written), dk += ds^T q and dv += p^T dout (the tile's keys, added)."""
    start, n, hist, ctx, tiles = call.tiles(b)
    qs, ks, vs, dos, dqs, dks, dvs = (_heads_first(a, start, n) for a in (q, k, v, dout, dq, dk, dv))
    dks[...] = float32(0.0)
    dvs[...] = float32(0.0)
    heads, d, dvw = call.heads, q.shape[2], v.shape[2]
    for i0, i1, lo, hi in tiles:
        r, c = i1 - i0, hi - lo
        x, th = call.scores(b, qs, ks, i0, i1, lo, hi, ws)
        dp = ws[2, :heads * r * c].reshape(heads, r, c)
        np.matmul(dos[:, i0:i1], vs[:, lo:hi].transpose(0, 2, 1), out=dp)
        block = _NO_RAB[0] if drab is None else drab[b, :, i0:i1, lo:hi]
        _p_ds_tile(x, th, dp, i0, lo, hist, ctx, call.wl, call.wr, call.group, call.alpha, call.inv, block,
                   drab is not None)
        np.matmul(dp, ks[:, lo:hi], out=dqs[:, i0:i1])
        dks[:, lo:hi] += np.matmul(dp.transpose(0, 2, 1), qs[:, i0:i1],
                                   out=ws[3, :heads * c * d].reshape(heads, c, d))
        dvs[:, lo:hi] += np.matmul(x.transpose(0, 2, 1), dos[:, i0:i1],
                                   out=ws[3, :heads * c * dvw].reshape(heads, c, dvw))


def _run(call, work, planes, width, threads):
    """work(b, ws) for every sequence b, ws a (planes, width) float32 workspace: in the calling thread, or
    in a pool of ``threads`` threads, longest sequences first, with BLAS held to 1 thread meanwhile (threads
    x BLAS threads would oversubscribe the cores). A sequence runs wholly in one thread, in the same order of
    operations whichever: any thread count gives the same bits."""
    batch = len(call.lengths)
    if threads <= 1:
        ws = np.empty((planes, width), np.float32)
        for b in range(batch):
            work(b, ws)
        return
    spaces = queue.SimpleQueue()
    for _ in range(threads):
        spaces.put(np.empty((planes, width), np.float32))

    def one(b):
        ws = spaces.get()
        try:
            work(b, ws)
        finally:
            spaces.put(ws)

    order = sorted(range(batch), key=lambda b: -call.lengths[b])
    with _blas_controller().limit(limits=1, user_api="blas"):
        for f in [_pool(threads).submit(one, b) for b in order]:
            f.result()


@functools.lru_cache(maxsize=None)
def _pool(threads):
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="hstu-cpu")


@functools.lru_cache(maxsize=None)
def _blas_controller():
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


_NO_RAB = np.zeros((1, 1, 1, 1), np.float32)


def hstu_attn_forward_cpu(q, k, v, cu_seqlens, num_contexts, num_targets, out, max_seqlen, scaling_seqlen=-1,
                          target_group_size=1, window=(-1, -1), alpha=1.0, rab=None, tile=None) -> None:
    """hstu_attn_forward on host float32 arrays, blocked into matrix products (module docstring); tile:
    query rows per tile (CPU_TILE)."""
    _check_buffers("hstu_attn_forward_cpu", q, k, v, cu_seqlens, num_contexts, num_targets, rab,
                   [("out", out, v.shape)])
    call = _CpuCall(q, cu_seqlens, num_contexts, num_targets, max_seqlen, scaling_seqlen, window,
                    target_group_size, alpha, rab, tile)
    _run(call, lambda b, ws: _forward_sequence(call, b, q, k, v, out, ws), 2,
         call.heads * call.tile * call.longest, call.threads(q.shape[2] + v.shape[2]))


def hstu_attn_backward_cpu(q, k, v, dout, cu_seqlens, num_contexts, num_targets, dq, dk, dv, max_seqlen,
                           scaling_seqlen=-1, target_group_size=1, window=(-1, -1), alpha=1.0, rab=None,
                           drab=None, tile=None) -> None:
    """hstu_attn_backward on host float32 arrays, blocked like the forward; drab (when given) is
    overwritten."""
    if drab is not None and rab is None:
        raise ValueError("hstu_attn_backward_cpu: drab needs rab")
    _check_buffers("hstu_attn_backward_cpu", q, k, v, cu_seqlens, num_contexts, num_targets, rab,
                   [("dout", dout, v.shape), ("dq", dq, q.shape), ("dk", dk, k.shape), ("dv", dv, v.shape),
                    ("drab", drab, None if rab is None else rab.shape)])
    call = _CpuCall(q, cu_seqlens, num_contexts, num_targets, max_seqlen, scaling_seqlen, window,
                    target_group_size, alpha, rab, tile)
    if drab is not None:
        drab[...] = float32(0.0)                   # the tiles write the blocks some query sees
    width = call.heads * call.longest * max(call.tile, q.shape[2], v.shape[2])
    _run(call, lambda b, ws: _backward_sequence(call, b, q, k, v, dout, dq, dk, dv, drab, ws), 4, width,
         call.threads(3 * q.shape[2] + 2 * v.shape[2]))


def _ptx_checks():
    f3, f4, i1 = "float32[:, :, ::1]", "float32[:, :, :, ::1]", "int32[::1]"
    head = f"{f3}, {f3}, {f3}"                                   # q, k, v
    masks = f"{i1}, {i1}, {i1}, {f4}, int64"                     # cu, num_contexts, num_targets, rab, has_rab
    tail = "int64, int64, int64, int64, float32, float32"        # n_tiles, wl, wr, group, alpha, inv_scale
    fwd = f"void({head}, {masks}, {f3}, {tail})"
    dq = f"void({head}, {f3}, {masks}, {f3}, {f4}, int64, {tail})"
    dkdv = f"void({head}, {f3}, {masks}, {f3}, {f3}, {tail})"
    checks = []
    for t, d in ((16, 64), (8, 128)):                           # the GPU tiles of D = Dv = 64 and 128
        checks += [(make_forward_kernel(t, t, d, d, 128), fwd), (make_backward_dq_kernel(t, t, d, d, 128), dq),
                   (make_backward_dkdv_kernel(t, t, d, d, 128), dkdv)]
    return checks


PTX_CHECKS = _ptx_checks()
