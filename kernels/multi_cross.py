"""MultiCross (DCN cross network), one cross layer per call; x0, x_l (B, D).

DCNv1 (projection_dim = 0), weights w_l (D,), b_l (D,):
    h[b]         = sum_j x_l[b, j] * w_l[j]                     # (B,) per-row dot: a block reduction
    x_{l+1}      = x0 * h[:, None] + x_l + b_l                  # (B, D)
  backward, g = dL/dx_{l+1}:
    dh[b]        = sum_j g[b, j] * x0[b, j]                     # (B,) per-row dot
    dx0         += g * h[:, None]
    dx_l         = g + dh[:, None] * w_l
    dw_l[j]      = sum_b dh[b] * x_l[b, j]                      # column reductions
    db_l[j]      = sum_b g[b, j]
DCNv2 (projection_dim = P > 0), weights U_l (D, P), V_l (P, D), b_l (D,); the matmuls are the caller's:
    z            = (x_l @ U_l) @ V_l                            # (B, D)
    x_{l+1}      = x0 * (z + b_l) + x_l                         # elementwise kernel
  backward: dz = g * x0; dx0 += g * (z + b_l)  (elementwise kernel); db_l = sum_b dz;
            dV = (x_l U)^T dz; dU = x_l^T (dz V^T); dx_l = g + dz V^T U^T (matmuls by the caller).
The input's total gradient is dx0 + dx_0 (the x0 path plus the x_l path of layer 0).

HugeCTR: HugeCTR/src/layers/multi_cross_layer.cu (v1: the rank-1 DCN where w is a vector; HugeCTR
accumulates dw and overwrites db; here both are overwritten and the model adds other terms).

Row kernels: one block per row, threads stride over D, shared-memory tree (tpb power of two <= 1024).

Compiled CPU versions (numba.njit, the cpu device's path), over fixed chunks of rows (kernels/parallel_cpu.py):
v1 one pass per layer each way (the row's dot product, then its outputs; the backward's column sums dw, db
as one partial row per chunk, added in chunk order: the same bits at any thread count). v2 keeps its
matmuls in BLAS (faster than any loop here) and compiles the passes between them: the forward's
x0 * (z + b) + x_l, and the backward's dz, dx0 and db in one pass that also adds the x_l path's matmul part
of the layer above (g + dz V^T U^T) to the gradient it reads.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, njit, prange

from .launch import check_block_size, launch_1d, launch_rows, REDUCE_THREADS
from .block_reduce import block_sum, block_sum2
from .parallel_cpu import PARALLEL_MIN, ROW_CHUNK, pjit, sum_partials


# ---- NumPy references (whole stack of layers) --------------------------------------------------
def multi_cross_v1_forward_ref(x0, ws, bs):
    """ws, bs: lists of (D,) arrays, one per layer. Returns (y, xs, hs): xs[l] = x_l, hs[l] (B,)."""
    xs, hs = [x0], []
    x = x0
    for w, b in zip(ws, bs):
        h = x @ w
        x = x0 * h[:, None] + x + b
        xs.append(x)
        hs.append(h)
    return x, xs, hs


def multi_cross_v1_backward_ref(dy, x0, ws, xs, hs):
    """Returns (dx0 (B, D), dws list, dbs list)."""
    g = dy
    dx0 = np.zeros_like(x0)
    dws, dbs = [None] * len(ws), [None] * len(ws)
    for layer in reversed(range(len(ws))):
        dh = (g * x0).sum(axis=1)
        dx0 = dx0 + g * hs[layer][:, None]
        dws[layer] = xs[layer].T @ dh
        dbs[layer] = g.sum(axis=0)
        g = g + dh[:, None] * ws[layer]
    return dx0 + g, dws, dbs


def multi_cross_v2_forward_ref(x0, us, vs, bs):
    """us (D, P), vs (P, D), bs (D,) per layer. Returns (y, xs, zs)."""
    xs, zs = [x0], []
    x = x0
    for u, v, b in zip(us, vs, bs):
        z = (x @ u) @ v
        x = x0 * (z + b) + x
        xs.append(x)
        zs.append(z)
    return x, xs, zs


def multi_cross_v2_backward_ref(dy, x0, us, vs, bs, xs, zs):
    """Returns (dx0, dus, dvs, dbs)."""
    g = dy
    dx0 = np.zeros_like(x0)
    n = len(us)
    dus, dvs, dbs = [None] * n, [None] * n, [None] * n
    for layer in reversed(range(n)):
        u, v, x = us[layer], vs[layer], xs[layer]
        dz = g * x0
        dx0 = dx0 + g * (zs[layer] + bs[layer])
        dbs[layer] = dz.sum(axis=0)
        dvs[layer] = (x @ u).T @ dz
        dt = dz @ v.T
        dus[layer] = x.T @ dt
        g = g + dt @ u.T
    return dx0 + g, dus, dvs, dbs


# ---- kernels ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def make_v1_forward_kernel(tpb: int):
    check_block_size(tpb)

    @cuda.jit
    def mc_v1_forward_kernel(x0, xl, w, b, out, h):
        # x0, xl, out: (B, D); w, b: (D,); h: (B,) saved for the backward
        part = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        width = x0.shape[1]
        for r in range(cuda.blockIdx.x, x0.shape[0], cuda.gridDim.x):    # uniform per block
            acc = float32(0.0)
            for j in range(t, width, tpb):
                acc += float32(xl[r, j]) * w[j]
            part[t] = acc
            block_sum(part, t, tpb)
            dot = part[0]
            cuda.syncthreads()
            for j in range(t, width, tpb):
                out[r, j] = float32(x0[r, j]) * dot + float32(xl[r, j]) + b[j]
            if t == 0:
                h[r] = dot

    return mc_v1_forward_kernel


@functools.lru_cache(maxsize=None)
def make_v1_backward_rows_kernel(tpb: int):
    check_block_size(tpb)

    @cuda.jit
    def mc_v1_backward_rows_kernel(g, x0, w, h, first, dx0, dxl, dh):
        # g, x0, dx0, dxl: (B, D); w: (D,); h, dh: (B,). first == 1: dx0 is overwritten, else added to.
        part = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        width = x0.shape[1]
        for r in range(cuda.blockIdx.x, x0.shape[0], cuda.gridDim.x):
            acc = float32(0.0)
            for j in range(t, width, tpb):
                acc += float32(g[r, j]) * float32(x0[r, j])
            part[t] = acc
            block_sum(part, t, tpb)
            d = part[0]
            cuda.syncthreads()
            hr = h[r]
            for j in range(t, width, tpb):
                gj = float32(g[r, j])
                if first != 0:
                    dx0[r, j] = gj * hr
                else:
                    dx0[r, j] = float32(dx0[r, j]) + gj * hr
                dxl[r, j] = gj + d * w[j]
            if t == 0:
                dh[r] = d

    return mc_v1_backward_rows_kernel


@functools.lru_cache(maxsize=None)
def make_v1_param_grad_kernel(tpb: int):
    check_block_size(tpb)

    @cuda.jit
    def mc_v1_param_grad_kernel(g, xl, dh, dw, db):
        # column sums over the B rows: dw[j] = sum dh * xl[:, j], db[j] = sum g[:, j] (overwritten)
        s_w = cuda.shared.array(tpb, float32)
        s_b = cuda.shared.array(tpb, float32)
        t = cuda.threadIdx.x
        rows = g.shape[0]
        for c in range(cuda.blockIdx.x, g.shape[1], cuda.gridDim.x):
            a1 = float32(0.0)
            a2 = float32(0.0)
            for m in range(t, rows, tpb):
                a1 += dh[m] * float32(xl[m, c])
                a2 += float32(g[m, c])
            s_w[t] = a1
            s_b[t] = a2
            block_sum2(s_w, s_b, t, tpb)
            if t == 0:
                dw[c] = s_w[0]
                db[c] = s_b[0]
            cuda.syncthreads()

    return mc_v1_param_grad_kernel


@cuda.jit
def mc_v2_forward_kernel(x0, xl, z, b, out):
    # flat (B*D,) views; b (D,): out = x0 * (z + b) + xl
    n = b.shape[0]
    for i in range(cuda.grid(1), x0.shape[0], cuda.gridsize(1)):
        out[i] = float32(x0[i]) * (float32(z[i]) + b[i % n]) + float32(xl[i])


@cuda.jit
def mc_v2_backward_kernel(g, x0, z, b, first, dz, dx0):
    # flat (B*D,) views: dz = g * x0; dx0 (+)= g * (z + b)
    n = b.shape[0]
    for i in range(cuda.grid(1), g.shape[0], cuda.gridsize(1)):
        gi = float32(g[i])
        dz[i] = gi * float32(x0[i])
        v = gi * (float32(z[i]) + b[i % n])
        if first != 0:
            dx0[i] = v
        else:
            dx0[i] = float32(dx0[i]) + v


@cuda.jit
def mc_add_kernel(a, b, out):
    # flat views: out = a + b (the input's two gradient paths)
    for i in range(cuda.grid(1), a.shape[0], cuda.gridsize(1)):
        out[i] = float32(a[i]) + float32(b[i])


# ---- launch wrappers (contiguous float32; allocate nothing) ----------------------------------
def v1_forward(x0, xl, w, b, out, h, threads: int | None = None) -> None:
    if x0.shape[0] == 0:
        return
    tpb = threads or REDUCE_THREADS
    launch_rows(make_v1_forward_kernel(tpb), x0.shape[0], x0, xl, w, b, out, h, threads=tpb)


def v1_backward(g, x0, xl, w, h, first: bool, dx0, dxl, dh, dw, db, threads: int | None = None) -> None:
    """One layer's backward: dx0 (+)=, dxl, dh (scratch (B,)), dw, db (overwritten)."""
    tpb = threads or REDUCE_THREADS
    if x0.shape[0] > 0:
        launch_rows(make_v1_backward_rows_kernel(tpb), x0.shape[0], g, x0, w, h, np.int32(bool(first)),
                    dx0, dxl, dh, threads=tpb)
    launch_rows(make_v1_param_grad_kernel(tpb), x0.shape[1], g, xl, dh, dw, db, threads=tpb)


def v2_forward(x0, xl, z, b, out) -> None:
    launch_1d(mc_v2_forward_kernel, x0.size, x0.reshape(-1), xl.reshape(-1), z.reshape(-1), b,
              out.reshape(-1))


def v2_backward(g, x0, z, b, first: bool, dz, dx0) -> None:
    launch_1d(mc_v2_backward_kernel, g.size, g.reshape(-1), x0.reshape(-1), z.reshape(-1), b,
              np.int32(bool(first)), dz.reshape(-1), dx0.reshape(-1))


def add(a, b, out) -> None:
    launch_1d(mc_add_kernel, a.size, a.reshape(-1), b.reshape(-1), out.reshape(-1))


# ---- compiled CPU versions (numba.njit; the cpu device; work split by parallel_cpu) ----------------
@njit(cache=True, fastmath={"reassoc"})
def _dot(a, b):
    # reassoc lets LLVM vectorize the sum (several partial sums, added at the end); a function of its
    # own so that the flag reaches no other arithmetic: the passes below keep the reference's order
    acc = float32(0.0)
    for j in range(a.shape[0]):
        acc += a[j] * b[j]
    return acc


@njit(cache=True, inline="always")
def _v1_forward_rows(x0, xl, w, b, out, h, c):
    for r in range(c * ROW_CHUNK, min(x0.shape[0], (c + 1) * ROW_CHUNK)):
        x0r, xr, o = x0[r], xl[r], out[r]
        hr = _dot(xr, w)
        for j in range(o.shape[0]):
            o[j] = x0r[j] * hr + xr[j] + b[j]
        h[r] = hr


@pjit(cache=True)
def _v1_forward_cpu(x0, xl, w, b, out, h):
    chunks = (x0.shape[0] + ROW_CHUNK - 1) // ROW_CHUNK
    if x0.size < PARALLEL_MIN:
        for c in range(chunks):
            _v1_forward_rows(x0, xl, w, b, out, h, c)
    else:
        for c in prange(chunks):
            _v1_forward_rows(x0, xl, w, b, out, h, c)


@njit(cache=True, inline="always")
def _v1_backward_rows(g, x0, xl, w, h, first, dx0, dxl, dh, part, c):
    pw, pb = part[0, c], part[1, c]                      # this chunk's partial dw, db (D,)
    for j in range(pw.shape[0]):
        pw[j] = float32(0.0)
        pb[j] = float32(0.0)
    for r in range(c * ROW_CHUNK, min(x0.shape[0], (c + 1) * ROW_CHUNK)):
        gr, x0r, xr, d0, dl = g[r], x0[r], xl[r], dx0[r], dxl[r]
        d = _dot(gr, x0r)
        hr = h[r]
        if first:
            for j in range(gr.shape[0]):
                d0[j] = gr[j] * hr
        else:
            for j in range(gr.shape[0]):
                d0[j] = d0[j] + gr[j] * hr
        for j in range(gr.shape[0]):
            dl[j] = gr[j] + d * w[j]
            pw[j] += d * xr[j]
            pb[j] += gr[j]
        dh[r] = d


@pjit(cache=True)
def _v1_backward_cpu(g, x0, xl, w, h, first, dx0, dxl, dh, dw, db, part):
    # part (2, chunks, D): scratch for the chunks' partial dw and db
    chunks = (x0.shape[0] + ROW_CHUNK - 1) // ROW_CHUNK
    if x0.size < PARALLEL_MIN:
        for c in range(chunks):
            _v1_backward_rows(g, x0, xl, w, h, first, dx0, dxl, dh, part, c)
    else:
        for c in prange(chunks):
            _v1_backward_rows(g, x0, xl, w, h, first, dx0, dxl, dh, part, c)
    sum_partials(part[0], dw)
    sum_partials(part[1], db)


def v1_forward_cpu(x0, xl, w, b, out, h) -> None:
    """v1_forward compiled for the CPU: out (B, D) = x0 * h + x_l + b, h (B,) = x_l w (contiguous float32)."""
    if x0.shape[0] == 0:
        return
    _v1_forward_cpu(x0, xl, w, b, out, h)


def v1_backward_cpu(g, x0, xl, w, h, first: bool, dx0, dxl, dh, dw, db) -> None:
    """v1_backward compiled for the CPU: one layer's dx0 (+)=, dxl, dh (scratch (B,)), dw, db (overwritten)."""
    chunks = (x0.shape[0] + ROW_CHUNK - 1) // ROW_CHUNK
    part = np.zeros((2, max(chunks, 1), x0.shape[1]), np.float32)    # B = 0: dw = db = 0
    _v1_backward_cpu(g, x0, xl, w, h, bool(first), dx0, dxl, dh, dw, db, part)


@njit(cache=True, inline="always")
def _v2_forward_rows(x0, xl, z, b, out, c):
    for r in range(c * ROW_CHUNK, min(x0.shape[0], (c + 1) * ROW_CHUNK)):
        x0r, xr, zr, o = x0[r], xl[r], z[r], out[r]
        for j in range(o.shape[0]):
            o[j] = x0r[j] * (zr[j] + b[j]) + xr[j]


@pjit(cache=True)
def _v2_forward_cpu(x0, xl, z, b, out):
    chunks = (x0.shape[0] + ROW_CHUNK - 1) // ROW_CHUNK
    if x0.size < PARALLEL_MIN:
        for c in range(chunks):
            _v2_forward_rows(x0, xl, z, b, out, c)
    else:
        for c in prange(chunks):
            _v2_forward_rows(x0, xl, z, b, out, c)


_NO_GM = np.zeros((0, 0), np.float32)      # stands in for an absent gm (never indexed: add_gm is False)


@njit(cache=True, inline="always")
def _v2_backward_row(gr, x0r, zr, b, first, dzr, d0, p):
    for j in range(gr.shape[0]):
        gj = gr[j]
        dzr[j] = gj * x0r[j]
        v = gj * (zr[j] + b[j])
        d0[j] = v if first else d0[j] + v
        p[j] += dzr[j]


@njit(cache=True, inline="always")
def _v2_backward_rows(g, gm, add_gm, x0, z, b, first, dz, dx0, part, c):
    p = part[c]                                         # this chunk's partial db (D,)
    for j in range(p.shape[0]):
        p[j] = float32(0.0)
    for r in range(c * ROW_CHUNK, min(x0.shape[0], (c + 1) * ROW_CHUNK)):
        if add_gm:                                      # the layer's gradient is g + gm: kept in gm
            gr, gmr = g[r], gm[r]
            for j in range(gmr.shape[0]):
                gmr[j] = gr[j] + gmr[j]
            _v2_backward_row(gmr, x0[r], z[r], b, first, dz[r], dx0[r], p)
        else:
            _v2_backward_row(g[r], x0[r], z[r], b, first, dz[r], dx0[r], p)


@pjit(cache=True)
def _v2_backward_cpu(g, gm, add_gm, x0, z, b, first, dz, dx0, db, part):
    # part (chunks, D): scratch for the chunks' partial db
    chunks = (x0.shape[0] + ROW_CHUNK - 1) // ROW_CHUNK
    if x0.size < PARALLEL_MIN:
        for c in range(chunks):
            _v2_backward_rows(g, gm, add_gm, x0, z, b, first, dz, dx0, part, c)
    else:
        for c in prange(chunks):
            _v2_backward_rows(g, gm, add_gm, x0, z, b, first, dz, dx0, part, c)
    sum_partials(part, db)


def v2_forward_cpu(x0, xl, z, b, out) -> None:
    """v2_forward compiled for the CPU: out (B, D) = x0 * (z + b) + x_l (contiguous float32)."""
    if x0.shape[0] == 0:
        return
    _v2_forward_cpu(x0, xl, z, b, out)


def v2_backward_cpu(g, gm, x0, z, b, first: bool, dz, dx0, db) -> None:
    """One layer's elementwise backward, compiled for the CPU, with the layer's gradient g + gm (gm None:
    g alone); gm (B, D), when given, is overwritten with g + gm. Writes dz = (g + gm) * x0, dx0 (+)=
    (g + gm) * (z + b) (overwritten when first) and db (D,) = sum_b dz."""
    chunks = (x0.shape[0] + ROW_CHUNK - 1) // ROW_CHUNK
    part = np.zeros((max(chunks, 1), x0.shape[1]), np.float32)    # B = 0: db = 0
    _v2_backward_cpu(g, _NO_GM if gm is None else gm, gm is not None, x0, z, b, bool(first), dz, dx0, db, part)


_M, _V = "float32[:, ::1]", "float32[::1]"
_MH, _VH = "float16[:, ::1]", "float16[::1]"
PTX_CHECKS = [
    (make_v1_forward_kernel(256), f"void({_M}, {_M}, {_V}, {_V}, {_M}, {_V})"),
    (make_v1_backward_rows_kernel(256), f"void({_M}, {_M}, {_V}, {_V}, int32, {_M}, {_M}, {_V})"),
    (make_v1_param_grad_kernel(256), f"void({_M}, {_M}, {_V}, {_V}, {_V})"),
    (mc_v2_forward_kernel, f"void({_V}, {_V}, {_V}, {_V}, {_V})"),
    (mc_v2_backward_kernel, f"void({_V}, {_V}, {_V}, {_V}, int32, {_V}, {_V})"),
    (mc_add_kernel, f"void({_V}, {_V}, {_V})"),
    # mixed precision on gpu/sim: float16 x0, x_l, z and their gradients; float32 weights, h and dh
    (make_v1_forward_kernel(256), f"void({_MH}, {_MH}, {_V}, {_V}, {_MH}, {_V})"),
    (make_v1_backward_rows_kernel(256), f"void({_MH}, {_MH}, {_V}, {_V}, int32, {_MH}, {_MH}, {_V})"),
    (make_v1_param_grad_kernel(256), f"void({_MH}, {_MH}, {_V}, {_V}, {_V})"),
    (mc_v2_forward_kernel, f"void({_VH}, {_VH}, {_VH}, {_V}, {_VH})"),
    (mc_v2_backward_kernel, f"void({_VH}, {_VH}, {_VH}, {_V}, int32, {_VH}, {_VH})"),
    (mc_add_kernel, f"void({_VH}, {_VH}, {_VH})"),
]
