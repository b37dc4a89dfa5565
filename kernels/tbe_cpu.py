"""The table-batched embedding compiled for the CPU (numba.njit, parallel over samples / rows).

The same operations and the same results as the numba.cuda kernels of kernels/tbe.py (formulas in
kernels/tbe_ref.py's docstring; the scalar math is kernels/tbe_math.py, compiled here with njit), for the
``cpu`` device:

    check_offsets   offsets repaired as FBGEMM repairs them (running maximum of the clamped offsets)
    check_indices   rows (N,) int64 of the indices under a bounds-check mode, in parallel over bags
    forward         pooled (B, sum D_f) or per-occurrence (N, D) output, in parallel over samples
    forward_pooled  forward's feature-major pooled case without per-sample weights, compiled on its own
    linearize       linear row id (table row offset + row) and bag of every occurrence; -1 rows and
                    positions outside every bag get the sentinel V_total (sorted last)
    radix_sort      stable LSD radix sort of the linear ids (per-thread histograms, so 1..n threads
                    give the same permutation): occurrences of a row end up together, in occurrence order
    segments        the first position of each row's run in the sorted ids
    fused_update    per row (in parallel over rows): sum the occurrence gradients in occurrence order,
                    then the optimizer's rule, once; or, for optimizer NONE, write the summed gradient
    global_pass     HugeCTR's all-rows pass of a GLOBAL update
    forward_onehot  forward's pooled case for bags of at most one occurrence: a gather (small tables)
    small_update    fused_update without the sort, through per-row accumulators (small tables)
    psw_grad        gradient of the per-sample weights
Weights are float32, or float16 held as uint16 bits (load/store below dispatch on the array's dtype).
Nothing here allocates per element; the caller passes every buffer the size of the batch.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
import numba
from numba import float32, int64, njit, prange, types, uint64
from numba.core import cgutils
from numba.extending import intrinsic, overload
from numba.np.arrayobj import make_array, populate_array

from . import tbe_math as M
from .parallel_cpu import pjit

_JIT = dict(cache=True, error_model="numpy")       # x / 0 is inf / nan, as in the kernels

half_to_float = njit(**_JIT)(M.half_to_float)
float_to_half_bits = njit(**_JIT)(M.float_to_half_bits)
sr_key = njit(**_JIT)(M.sr_key)
row_scalars = njit(**_JIT)(M.row_scalars)
lazy_scalars = njit(**_JIT)(M.lazy_scalars)
counter_row_scalars = njit(**_JIT)(M.counter_row_scalars)
row_bias_corrections = njit(**_JIT)(M.row_bias_corrections)
elem_update = njit(inline="always", **_JIT)(M.elem_update)
global_elem = njit(**_JIT)(M.global_elem)
lamb_ratio = njit(**_JIT)(M.lamb_ratio)
lars_rate = njit(**_JIT)(M.lars_rate)
elem_state_count = njit(**_JIT)(M.elem_state_count)
max_norm_scale = njit(**_JIT)(M.max_norm_scale)

_GOLDEN = 0x9E3779B97F4A7C15
# Work is split into fixed-size chunks (prange over chunks, each with its own small scratch), never by the
# thread count: the result, the radix sort's permutation included, is the same for any number of threads.
_CHUNK = 64               # samples, bags or rows per chunk
_SORT_CHUNK = 1 << 16     # keys per radix-sort chunk (one digit histogram each)
_RADIX_BITS = 11          # bits per LSD pass: a 1M-row table sorts in 2 passes
_ROWWISE = (M._RW_ADAGRAD, M._PR_ADAM, M._PR_LAMB)


@njit(**_JIT)
def splitmix64(x):
    # kernels/embedding_init's SplitMix64 (the numba.cuda version splits the words to keep the simulator
    # quiet; compiled CPU code wraps modulo 2^64 natively)
    z = x + uint64(_GOLDEN)
    z = (z ^ (z >> uint64(30))) * uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> uint64(27))) * uint64(0x94D049BB133111EB)
    return z ^ (z >> uint64(31))


# Hot loops index with uint64: a signed index makes numba test every access for a negative (wraparound)
# value, which keeps LLVM from vectorizing the row loops (measured 3x slower gathers).
_PF = 16                  # occurrences / rows to prefetch ahead (FBGEMM's CPU kernels prefetch 16 too)
_PF_FWD = 32              # forward, rows of up to 32 floats: occurrences ahead whose row is prefetched (with
#                           the tables in huge pages, 32 measured 1.3x faster than 16 at L = 20, D = 16, and
#                           16 stayed the better distance for D = 64)
_PF_DY = 32               # backward: sorted occurrences ahead whose dy row is prefetched


@intrinsic
def prefetch(typingctx, arr, idx):
    """Ask the CPU to start loading arr[idx] into cache (llvm.prefetch: read, high locality). Any idx is
    safe: a prefetch never faults."""
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, signature.args[0], ary, [args[1]], wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()
    return sig, codegen


@njit(inline="always", **_JIT)
def prefetch_row(arr, start, width):
    """prefetch every 64-byte line of arr[start:start + width] (a row of D = 64 floats spans 4 lines; the
    first line alone brings in at most its neighbour). The backward's rows (weights, dy): one-hot D = 64,
    1 thread, 51 -> 29 ms with rowwise AdaGrad. The forward keeps one line per row: every line of 16 rows
    ahead measured 1.15-1.3x slower there at D = 64."""
    step = 64 // arr.itemsize
    for i in range(0, width, step):
        prefetch(arr, uint64(start) + uint64(i))


@intrinsic
def stack_f32(typingctx, size):
    """A float32 array of a literal length on the stack of the compiled function (its entry block): the
    per-row accumulators of the common widths, which LLVM then keeps in vector registers (a heap array's
    elements it must reload and store around every read of dy, since they might alias)."""
    if not isinstance(size, types.IntegerLiteral):
        return None
    n = size.literal_value
    arrty = types.Array(types.float32, 1, "C")

    def codegen(context, builder, signature, args):
        ptr = cgutils.alloca_once(builder, ir.FloatType(), size=n)
        ary = make_array(arrty)(context, builder)
        itemsize = context.get_constant(types.intp, 4)
        populate_array(ary, data=ptr, shape=[context.get_constant(types.intp, n)], strides=[itemsize],
                       itemsize=itemsize, meminfo=None)
        return ary._getvalue()
    return arrty(size), codegen


# ---- float32 / float16 (uint16 bits) element access -------------------------------------------------
def load(w, i):
    """w[i] as float32 (w float32, or float16 bits as uint16)."""
    return np.float32(M.half_to_float(w[i]) if w.dtype == np.uint16 else w[i])


def store(w, i, v, h, stochastic):
    """w[i] = v, rounded to float16 bits (stochastically with hash h when asked) for a uint16 w."""
    w[i] = M.float_to_half_bits(v, h, stochastic) if w.dtype == np.uint16 else v


@overload(load, jit_options=_JIT)
def _load(w, i):
    if w.dtype == types.uint16:
        return lambda w, i: half_to_float(w[i])
    return lambda w, i: float32(w[i])


@overload(store, jit_options=_JIT)
def _store(w, i, v, h, stochastic):
    if w.dtype == types.uint16:
        def impl(w, i, v, h, stochastic):
            w[i] = float_to_half_bits(v, h, stochastic)
        return impl

    def impl_f32(w, i, v, h, stochastic):
        w[i] = v
    return impl_f32


# ---- layout helpers ---------------------------------------------------------------------------------
@njit(**_JIT)
def bag_fb(j, n_features, batch, layout):
    """(feature, sample) of bag j."""
    if layout == 0:
        return j // batch, j - (j // batch) * batch
    return j - (j // n_features) * n_features, j // n_features


@njit(inline="always", **_JIT)
def table_of(lin, row_offsets):
    """The table holding linear row lin (binary search over row_offsets (T + 1,))."""
    if row_offsets.shape[0] == 2:
        return 0
    lo, hi = 0, row_offsets.shape[0] - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if row_offsets[mid] <= lin:
            lo = mid
        else:
            hi = mid - 1
    return lo


@njit(**_JIT)
def _chunk(c, n_chunks, n):
    return (n * c) // n_chunks, (n * (c + 1)) // n_chunks


# ---- bounds check -----------------------------------------------------------------------------------
@njit(**_JIT)
def check_offsets(offsets, n, out):
    """out (F*B + 1,) int64 <- repaired offsets; returns (number repaired, first repaired position or -1)."""
    count, first = 0, -1
    run = 0
    last = out.shape[0] - 1
    for j in range(out.shape[0]):
        v = min(max(int64(offsets[j]), 0), n)
        run = v if j == 0 else max(run, v)
        if j == last:
            run = n
        out[j] = run
        if run != offsets[j]:
            count += 1
            if first < 0:
                first = j
    return count, first


@pjit(**_JIT)
def check_indices(indices, offsets, feature_rows, batch, layout, mode, rows):
    """rows (N,) int64 <- indices under the bounds-check mode (FATAL: unchanged, the caller raises;
    WARNING/IGNORE: 0; NONE: -1 for out-of-range; features with feature_rows -1 (keyed) unchecked);
    returns the number of bad indices."""
    n_features = feature_rows.shape[0]
    n_bags = offsets.shape[0] - 1
    fill = -1 if mode == 3 else 0
    for k in range(offsets[0]):
        rows[k] = -1
    bad = 0
    for j in prange(n_bags):
        f, _ = bag_fb(j, n_features, batch, layout)
        limit = feature_rows[f]                       # -1: a keyed feature, not checked
        for k in range(offsets[j], offsets[j + 1]):
            v = int64(indices[k])
            if limit >= 0 and v != -1 and (v < 0 or v >= limit):
                bad += 1
                v = v if mode == 0 else fill
            rows[k] = v
    return bad


@njit(**_JIT)
def offsets_valid(offsets, n):
    """True when check_offsets would change nothing: 0 <= offsets[j] <= n, non-decreasing, last == n.
    Branch-free counting over the array (vectorizes), so a valid batch costs one streaming read."""
    m = offsets.shape[0]
    if m == 0:
        return False
    bad = 0
    for j in range(m):
        v = int64(offsets[j])
        bad += int64((v < 0) | (v > n))
    for j in range(1, m):
        bad += int64(int64(offsets[j]) < int64(offsets[j - 1]))
    return bad == 0 and int64(offsets[m - 1]) == n


@njit(**_JIT)
def _bad_in(indices, lo, hi, limit):
    """Indices k in lo..hi outside [0, limit) other than -1 (limit -1, a keyed feature: none)."""
    nb = 0
    if limit >= 0:
        for k in range(lo, hi):
            v = int64(indices[k])
            nb += int64((v != -1) & ((v < 0) | (v >= limit)))
    return nb


@pjit(**_JIT)
def count_bad_indices(indices, offsets, feature_rows, batch, layout):
    """The number of indices outside their feature's table (-1 and keyed features, feature_rows -1,
    excepted), without writing anything: the common clean batch then uses the indices as its rows.
    Feature-major batches are walked feature by feature (no division per bag). Each prange iteration
    adds one count from a separate function (numba dropped a prange reduction updated inside a
    conditional inner loop: the count came back 0)."""
    n_features = feature_rows.shape[0]
    bad = 0
    if layout == 0:
        for f in prange(n_features):
            bad += _bad_in(indices, offsets[f * batch], offsets[(f + 1) * batch], feature_rows[f])
    else:
        for b in prange(batch):
            nb = 0
            for f in range(n_features):
                j = b * n_features + f
                nb += _bad_in(indices, offsets[j], offsets[j + 1], feature_rows[f])
            bad += nb
    return bad


@njit(**_JIT)
def first_bad_index(indices, offsets, feature_rows, batch, layout):
    """(position, feature, sample, index, rows) of the first index outside its table (there is one)."""
    n_features = feature_rows.shape[0]
    for j in range(offsets.shape[0] - 1):
        f, b = bag_fb(j, n_features, batch, layout)
        for k in range(offsets[j], offsets[j + 1]):
            v = int64(indices[k])
            if feature_rows[f] >= 0 and v != -1 and (v < 0 or v >= feature_rows[f]):
                return k, f, b, v, feature_rows[f]
    return -1, -1, -1, 0, 0


# ---- forward ----------------------------------------------------------------------------------------
@njit(inline="always", **_JIT)
def pool_bag(w, rows, psw, has_psw, begin, end, off, stride, width, scale, acc, out, o):
    """out[o:o + width] <- scale * sum of p_k W[rows[k]] over the bag's occurrences k in begin..end (rows
    -1 skipped). The row pf occurrences ahead is prefetched (the guard is one compare against a bound
    computed once per bag). A bag without weights has its own loop, which adds the rows themselves: no
    multiply by 1 (10% of an L = 20, D = 16 forward)."""
    pf = _PF_FWD if width <= 32 else _PF                 # wider rows: fewer rows in flight fill the buffers
    stop = max(begin, min(end, rows.shape[0] - pf))
    for d in range(width):
        acc[d] = float32(0.0)
    if has_psw:
        for k in range(begin, end):
            if k < stop:
                prefetch(w, uint64(off + rows[k + pf] * stride))
            r = rows[k]
            if r >= 0:
                base = uint64(off + r * stride)
                p = psw[k]
                for d in range(width):
                    acc[d] += p * load(w, base + uint64(d))
    else:
        for k in range(begin, end):
            if k < stop:
                prefetch(w, uint64(off + rows[k + pf] * stride))
            r = rows[k]
            if r >= 0:
                base = uint64(off + r * stride)
                for d in range(width):
                    acc[d] += load(w, base + uint64(d))
    if scale != float32(1.0):            # a MEAN bag of several rows; a sum is stored as it is (a multiply
        for d in range(width):           # by 1 on every bag measured 15% of a one-hot D = 16 forward)
            store(out, o + uint64(d), acc[d] * scale, uint64(0), False)
    else:
        for d in range(width):
            store(out, o + uint64(d), acc[d], uint64(0), False)


@njit(inline="always", **_JIT)
def pool_one(w, rows, psw, has_psw, offsets, j, off, stride, width, pooling, acc, out, o):
    """Bag j pooled into out[o:o + width] (SUM, or MEAN: scaled by 1 / its length)."""
    begin, end = offsets[j], offsets[j + 1]
    scale = float32(1.0)
    if pooling == 1 and end > begin:
        scale = float32(1.0) / float32(end - begin)
    pool_bag(w, rows, psw, has_psw, begin, end, off, stride, width, scale, acc, out, o)


@njit(inline="always", **_JIT)
def pool_run(w, rows, psw, has_psw, offsets, j0, count, b0, off, stride, width, total, col, pooling, acc, out):
    """Bags j0 .. j0 + count - 1 of one feature (samples b0 ..) into their output columns col .."""
    for i in range(count):
        pool_one(w, rows, psw, has_psw, offsets, j0 + i, off, stride, width, pooling, acc, out,
                 uint64(b0 + i) * total + col)


@njit(inline="always", **_JIT)
def pool_dispatch(w, rows, psw, has_psw, offsets, j0, count, b0, off, stride, dim, total, col, pooling, acc, out):
    """pool_run with the common widths compiled as constants: an unrolled row loop without alias checks,
    measured 1.3-2x faster than the generic loop for one-hot bags; their accumulators are stack arrays,
    which LLVM keeps in registers across a bag (acc, the caller's scratch row, serves the other widths)."""
    if dim == 16 and stride == 16:
        pool_run(w, rows, psw, has_psw, offsets, j0, count, b0, off, 16, 16, total, col, pooling,
                 stack_f32(16), out)
    elif dim == 32 and stride == 32:
        pool_run(w, rows, psw, has_psw, offsets, j0, count, b0, off, 32, 32, total, col, pooling,
                 stack_f32(32), out)
    elif dim == 64 and stride == 64:
        pool_run(w, rows, psw, has_psw, offsets, j0, count, b0, off, 64, 64, total, col, pooling,
                 stack_f32(64), out)
    elif dim == 128 and stride == 128:
        pool_run(w, rows, psw, has_psw, offsets, j0, count, b0, off, 128, 128, total, col, pooling,
                 stack_f32(128), out)
    else:
        pool_run(w, rows, psw, has_psw, offsets, j0, count, b0, off, stride, dim, total, col, pooling, acc, out)


@pjit(**_JIT)
def forward(w, elem_off, strides, ftable, fcols, rows, offsets, psw, has_psw, batch, layout, pooling, out, scratch):
    """out, flat: pooled (B * sum D_f) (float32, or float16 bits), or per occurrence (N * D) for NONE.

    Bags are taken in CSR order, so the indices are read front to back and the rows of later occurrences
    are prefetched whatever the layout. Feature-major (FBGEMM's layout): chunks of _CHUNK samples of one
    feature, whose table, width and output column are looked up once per chunk; sample-major: chunks of
    samples, all features of each. A pooled bag accumulates in a float32 scratch row (pool_bag): row
    numba.get_thread_id() of scratch (threads, >= max D), allocated once by the caller."""
    n_features = ftable.shape[0]
    n_bags = offsets.shape[0] - 1
    n = rows.shape[0]
    total = uint64(fcols[n_features])
    zero = float32(0.0)
    if pooling == 2:                                   # NONE: one output row per occurrence
        n_chunks = (n_bags + _CHUNK - 1) // _CHUNK
        for c in prange(n_chunks):
            lo, hi = _chunk(c, n_chunks, n_bags)
            for j in range(lo, hi):
                f, _ = bag_fb(j, n_features, batch, layout)
                t = ftable[f]
                dim = uint64(fcols[f + 1] - fcols[f])
                stride, off = strides[t], elem_off[t]
                for k in range(offsets[j], offsets[j + 1]):
                    if k + _PF < n:
                        prefetch(w, uint64(off + rows[k + _PF] * stride))
                    r = rows[k]
                    p = psw[k] if has_psw else float32(1.0)
                    o = uint64(k) * dim
                    base = uint64(off + max(r, 0) * stride)
                    for d in range(dim):
                        store(out, o + d, p * load(w, base + d) if r >= 0 else zero, uint64(0), False)
        return
    per = (batch + _CHUNK - 1) // _CHUNK               # chunks per feature (feature-major) / in all
    # (One call site of pool_dispatch for both layouts compiled in half the time but made a multi-hot
    # D = 64 forward 13-16% slower in an interleaved A/B: each layout keeps its own copy.)
    if layout == 0:
        for c in prange(n_features * per):
            acc = scratch[numba.get_thread_id()]
            f = c // per
            b0 = (c - f * per) * _CHUNK
            t = ftable[f]
            pool_dispatch(w, rows, psw, has_psw, offsets, f * batch + b0, min(batch - b0, _CHUNK), b0,
                          elem_off[t], strides[t], fcols[f + 1] - fcols[f], total, uint64(fcols[f]), pooling,
                          acc, out)
    else:
        for c in prange(per):
            acc = scratch[numba.get_thread_id()]
            for b in range(c * _CHUNK, min(batch, (c + 1) * _CHUNK)):
                for f in range(n_features):
                    t = ftable[f]
                    pool_dispatch(w, rows, psw, has_psw, offsets, b * n_features + f, 1, b, elem_off[t],
                                  strides[t], fcols[f + 1] - fcols[f], total, uint64(fcols[f]), pooling, acc, out)


@pjit(**_JIT)
def forward_pooled(w, elem_off, strides, ftable, fcols, rows, offsets, batch, pooling, out, scratch):
    """forward's common case, FBGEMM's: pooled (SUM or MEAN), feature-major, without per-sample weights,
    compiled on its own: has_psw is the literal False, so the weighted loops are absent. The same results;
    measured 1.15-1.3x faster than forward on a one-hot D = 16 lookup (26 x 8192 bags, one thread). (The
    sample-major layout in here too doubled its compile time, 17 -> 34 s per signature.)"""
    n_features = ftable.shape[0]
    total = uint64(fcols[n_features])
    per = (batch + _CHUNK - 1) // _CHUNK
    for c in prange(n_features * per):
        acc = scratch[numba.get_thread_id()]
        f = c // per
        b0 = (c - f * per) * _CHUNK
        t = ftable[f]
        pool_dispatch(w, rows, acc, False, offsets, f * batch + b0, min(batch - b0, _CHUNK), b0, elem_off[t],
                      strides[t], fcols[f + 1] - fcols[f], total, uint64(fcols[f]), pooling, acc, out)


# ---- backward: linearize, sort, segment -------------------------------------------------------------
@pjit(**_JIT)
def linearize(rows, offsets, ftable, row_off, fcols, batch, layout, pooling, by_bag, sentinel, dy, dys, lin, pay,
              bag_of, bag_src, bag_scale):
    """Per occurrence k: lin[k] <- row_off[table] + row (the sentinel for -1 rows and positions outside every
    bag) and pay[k] <- the payload the sort carries.

    by_bag (pooled, no per-sample weights): pay[k] <- where its bag's dy row starts in the flat dy, so the
    reduction reads dy straight from the sorted payload (one random read per occurrence, no lookup of the
    bag first); for MEAN the bag's dy row is written pre-scaled by 1/L into dys (else dys is unused).
    Otherwise pay[k] <- k, bag_of[k] <- its bag, and per bag j of a pooled lookup bag_src[j] <- where its dy
    row starts, bag_scale[j] <- 1/L for MEAN, else 1."""
    n_features = ftable.shape[0]
    n_bags = offsets.shape[0] - 1
    total = fcols[n_features]
    for k in range(offsets[0]):
        lin[k] = sentinel
        pay[k] = -1 if by_bag else k
        if not by_bag:
            bag_of[k] = -1
    if by_bag and pooling == 1:
        # MEAN: dy pre-scaled, swept sample by sample so both arrays are walked front to back (per bag,
        # feature-major bags would jump a whole dy row from one bag to the next: 2-3x slower at L = 1)
        for b in prange(batch):
            for f in range(n_features):
                j = f * batch + b if layout == 0 else b * n_features + f
                begin, end = offsets[j], offsets[j + 1]
                scale = float32(1.0) / float32(end - begin) if end > begin else float32(1.0)
                src = b * total + fcols[f]
                for d in range(fcols[f + 1] - fcols[f]):
                    dys[src + d] = dy[src + d] * scale
    for j in prange(n_bags):
        f, b = bag_fb(j, n_features, batch, layout)
        base = row_off[ftable[f]]
        begin, end = offsets[j], offsets[j + 1]
        src = b * total + fcols[f]
        scale = float32(1.0) / float32(end - begin) if pooling == 1 and end > begin else float32(1.0)
        if by_bag:
            for k in range(begin, end):
                r = rows[k]
                lin[k] = base + r if r >= 0 else sentinel
                pay[k] = src
        else:
            if pooling != 2:
                bag_src[j] = src
                bag_scale[j] = scale
            for k in range(begin, end):
                r = rows[k]
                lin[k] = base + r if r >= 0 else sentinel
                bag_of[k] = j
                pay[k] = k


@njit(**_JIT)
def longest_bag(offsets):
    """The largest offsets[j + 1] - offsets[j] (0 for no bags)."""
    m = 0
    for j in range(offsets.shape[0] - 1):
        m = max(m, offsets[j + 1] - offsets[j])
    return m


@pjit(**_JIT)
def radix_sort(keys, vals, n_bits, keys_out, vals_out, keys_tmp, vals_tmp):
    """Stable sort of the pairs (keys (N,) in [0, 2^n_bits), vals (N,)) by key into keys_out, vals_out
    (keys_tmp, vals_tmp: scratch of the same size and types; int32 or int64 each).

    LSD passes of up to _RADIX_BITS bits; each pass: per-chunk digit counts (chunks in order), their
    exclusive scan in (digit, chunk) order, then every chunk scatters its elements in order: stable."""
    n = keys.shape[0]
    n_chunks = (n + _SORT_CHUNK - 1) // _SORT_CHUNK
    passes = max(1, (n_bits + _RADIX_BITS - 1) // _RADIX_BITS)
    bits = max(1, (n_bits + passes - 1) // passes)
    radix = 1 << bits
    mask = radix - 1
    # the first pass reads the input itself, and writes where the last pass will end in keys_out /
    # vals_out (an even number of passes starts in the tmp buffers): no copy pass before or after
    src_k, src_p = keys, vals
    if passes % 2 == 0:
        dst_k, dst_p, nxt_k, nxt_p = keys_tmp, vals_tmp, keys_out, vals_out
    else:
        dst_k, dst_p, nxt_k, nxt_p = keys_out, vals_out, keys_tmp, vals_tmp
    counts = np.zeros((n_chunks, radix), np.int64)
    for ps in range(passes):
        shift = ps * bits
        for c in prange(n_chunks):
            lo, hi = _chunk(c, n_chunks, n)
            for v in range(radix):
                counts[c, v] = 0
            for i in range(lo, hi):
                counts[c, (src_k[i] >> shift) & mask] += 1
        run = 0
        for v in range(radix):
            for c in range(n_chunks):
                here = counts[c, v]
                counts[c, v] = run
                run += here
        for c in prange(n_chunks):
            lo, hi = _chunk(c, n_chunks, n)
            for i in range(lo, hi):
                v = (src_k[i] >> shift) & mask
                at = counts[c, v]
                counts[c, v] = at + 1
                dst_k[at] = src_k[i]
                dst_p[at] = src_p[i]
        src_k, src_p = dst_k, dst_p
        dst_k, dst_p, nxt_k, nxt_p = nxt_k, nxt_p, dst_k, dst_p


@njit(**_JIT)
def segments(sorted_keys, sentinel, seg_start):
    """seg_start[s] <- first position of the s-th distinct key below the sentinel; seg_start[U] <- the
    end of the last run; returns U."""
    u = 0
    n = sorted_keys.shape[0]
    for i in range(n):
        key = sorted_keys[i]
        if key == sentinel:
            seg_start[u] = i
            return u
        if i == 0 or key != sorted_keys[i - 1]:
            seg_start[u] = i
            u += 1
    seg_start[u] = n
    return u


# ---- backward: fused reduce + update ----------------------------------------------------------------
@njit(inline="always", **_JIT)
def reduce_row(i0, i1, pay, by_bag, bag_of, bag_src, bag_scale, psw, has_psw, dy, pooling, width, g):
    """g[:width] <- sum over the sorted positions i0..i1 of the occurrence gradients, in order. pay[i] is
    the start of the bag's (pre-scaled) dy row (by_bag: pooled, no per-sample weights) or the occurrence;
    dy is flat."""
    n = pay.shape[0]
    for d in range(width):
        g[d] = 0.0
    for i in range(i0, i1):
        # the dy row of the occurrence _PF_DY sorted positions ahead: one prefetch per occurrence read, so
        # every random dy row is requested long before the reduction reaches it
        ahead = i + _PF_DY
        if ahead < n:
            later = pay[ahead]
            if later >= 0:
                if by_bag:
                    prefetch_row(dy, later, width)
                elif pooling == 2:
                    prefetch_row(dy, uint64(later) * uint64(width), width)
        if by_bag:
            o = uint64(pay[i])
            for d in range(width):
                g[d] += dy[o + uint64(d)]
            continue
        k = pay[i]
        s = psw[k] if has_psw else float32(1.0)
        if pooling == 2:
            o = uint64(k) * uint64(width)
        else:
            j = bag_of[k]
            o = uint64(bag_src[j])
            s *= bag_scale[j]
        for d in range(width):
            g[d] += s * dy[o + uint64(d)]


@njit(inline="always", **_JIT)
def row_update(w, sa, sb, srows, sprev, e0, lin, sr_lin, width, g, buf, ks, ki, base):
    """The optimizer's rule on one touched row (weights and per-element states at e0, per-row states at
    lin), from its summed gradient g; buf is scratch of the row's width; sr_lin: the row number stochastic
    rounding hashes (lin, or the row a tiered table's slot holds). srows: the per-row float states (the
    rowwise kinds' state, prev_iter, row_counter; fused_update's docstring)."""
    kind, update, wd_mode = ki[M.KI_KIND], ki[M.KI_UPDATE], ki[M.KI_WD_MODE]
    step, sr = ki[M.KI_STEP], ki[M.KI_SR] != 0
    lr, eps, b1, b2, wd = ks[M.KS_LR], ks[M.KS_EPS], ks[M.KS_B1], ks[M.KS_B2], ks[M.KS_WD]
    n_states = elem_state_count(kind)
    n_a, n_b = n_states >= 1, n_states >= 2
    c0, c1, c2 = float32(0.0), float32(0.0), float32(0.0)
    srow, spit, scnt = srows[0], srows[1], srows[2]
    bc1, bc2 = ks[M.KS_BC1], ks[M.KS_BC2]
    counted = kind == M._RW_ADAGRAD and (wd_mode == M._COUNTER or wd_mode == M._COWCLIP)
    if counted or kind == M._LARS:                     # both read the row's |g'|^2 and |w|^2
        cwd = ki[M.KI_CNT_WD] if counted else 0
        gsum, wsum = float32(0.0), float32(0.0)
        for d in range(width):
            wv = load(w, e0 + d)
            gd = g[d]
            if cwd == 1:
                gd += wd * wv
            gsum += gd * gd
            wsum += wv * wv
        if kind == M._LARS:
            c0 = lars_rate(wsum, gsum, lr, ks[M.KS_ETA], wd)
        else:
            mnew, cnew, c0, c1 = counter_row_scalars(
                wd_mode, cwd, srow[lin], scnt[lin], spit[lin], step, gsum, wsum, width, lr, eps, wd,
                ki[M.KI_CNT_HALF], ki[M.KI_CNT_ADJ], ks[M.KS_CNT_UB], ki[M.KI_CNT_LRM], ks[M.KS_MAXC],
                ks[M.KS_CNT_TAIL], ki[M.KI_CNT_RATIO], ks[M.KS_CNT_WNC], ks[M.KS_CNT_LB])
            srow[lin], scnt[lin], spit[lin] = mnew, cnew, float32(step)
    elif kind == M._RW_ADAGRAD or kind == M._PR_ADAM or kind == M._PR_LAMB:
        sumsq = float32(0.0)
        for d in range(width):
            gd = g[d]
            if kind == M._RW_ADAGRAD and wd_mode == M._L2:
                gd += wd * load(w, e0 + d)
            sumsq += gd * gd
        rnew, c0, c1 = row_scalars(kind, wd_mode, sumsq, width, srow[lin], lr, eps, b2, wd, ks[M.KS_BC2])
        srow[lin] = rnew
    elif kind == M._H_ADAM and update == M._LAZY:
        c0, c1, c2 = lazy_scalars(sprev[lin], step, b1, b2, ks[M.KS_LAZY])
        sprev[lin] = step
    elif kind == M._H_FTRL:
        c0, c1 = ks[M.KS_L1], ks[M.KS_L2P]
    elif kind == M._ADAM and ki[M.KI_RBC] != 0:             # the row's own step count
        n_upd, bc1, bc2 = row_bias_corrections(scnt[lin], b1, b2)
        scnt[lin] = n_upd
    if kind == M._SGD:                                  # the common cases without the general rule's branches
        for d in range(width):
            buf[d] = load(w, e0 + d) - lr * g[d]
    elif kind == M._H_SGD:
        scaler = ks[M.KS_SCALER]
        for d in range(width):
            buf[d] = load(w, e0 + d) - lr * (g[d] / scaler)
    else:
        lamb = kind == M._LAMB or kind == M._PR_LAMB
        wsq, rsq = float32(0.0), float32(0.0)
        for d in range(width):
            wv = load(w, e0 + d)
            av = sa[e0 + d] if n_a else float32(0.0)
            bv = sb[e0 + d] if n_b else float32(0.0)
            wn, an, bn, rv = elem_update(kind, update, g[d], wv, av, bv, c0, c1, c2, lr, eps, b1, b2, wd,
                                         ks[M.KS_MOM], ks[M.KS_SCALER], bc1, bc2, ks[M.KS_ALPHA])
            if n_a:
                sa[e0 + d] = an
            if n_b:
                sb[e0 + d] = bn
            if lamb:
                buf[d] = rv
                wsq += wv * wv
                rsq += rv * rv
            else:
                buf[d] = wn
        if lamb:
            ratio = lamb_ratio(wsq, rsq)
            for d in range(width):
                buf[d] = load(w, e0 + d) - lr * ratio * buf[d]
    scale = float32(1.0)
    if ks[M.KS_MAXN] > 0:
        nsq = float32(0.0)
        for d in range(width):
            nsq += buf[d] * buf[d]
        scale = max_norm_scale(nsq, ks[M.KS_MAXN])
    for d in range(width):
        store(w, e0 + d, buf[d] * scale, splitmix64(sr_key(sr_lin, d) ^ base) if sr else uint64(0), sr)


@njit(inline="always", **_JIT)
def update_segment(w, sa, sb, srows, sprev, pay, by_bag, seg_start, s, bag_of, bag_src, bag_scale, psw, has_psw, dy,
                   ks, ki, base, grad_rows, grad_vals, sr_lin, e0, lin, width, g, gh, bh):
    """Segment s (linear row lin, weights at element e0): reduce its gradient into g, then update the row
    (kind NONE: record it). Inlined with a literal width for the common widths, so the accumulator g can
    live in registers: it must never escape to a called function, so the general rule gets a copy in the
    heap rows gh, bh. (Under 30 arguments: CPython passes more as *args, which Numba cannot inline.)"""
    pooling = ki[M.KI_POOLING]
    reduce_row(seg_start[s], seg_start[s + 1], pay, by_bag, bag_of, bag_src, bag_scale, psw, has_psw, dy, pooling,
               width, g)
    update_row(w, sa, sb, srows, sprev, ks, ki, base, grad_rows, grad_vals, s, sr_lin, e0, lin, width, g, gh, bh)


@njit(inline="always", **_JIT)
def update_row(w, sa, sb, srows, sprev, ks, ki, base, grad_rows, grad_vals, s, sr_lin, e0, lin, width, g, gh, bh):
    """Row lin (weights at element e0, the s-th row updated) from its summed gradient g: the optimizer's
    rule (kind NONE: grad_rows[s], grad_vals[s] <- the row and g). The half of update_segment that the
    small-table update (small_update) shares: one rule, so both paths store the same bits."""
    wu = uint64(width)                                 # element offsets stay unsigned (e0 + d)
    if ki[M.KI_KIND] == M._SGD and ki[M.KI_SR] == 0 and ks[M.KS_MAXN] == 0:     # plain SGD: w -= lr g
        lr = ks[M.KS_LR]
        for d in range(wu):
            store(w, e0 + d, load(w, e0 + d) - lr * g[d], uint64(0), False)
    elif ki[M.KI_KIND] == M._RW_ADAGRAD and ki[M.KI_SR] == 0 and ks[M.KS_MAXN] == 0 and ki[M.KI_WD_MODE] <= M._DECOUPLE:
        # rowwise AdaGrad, the common case, inline (row_update's rule and rounding, without its branches)
        wd_mode, wd = ki[M.KI_WD_MODE], ks[M.KS_WD]
        sumsq = float32(0.0)
        for d in range(wu):
            gd = g[d]
            if wd_mode == M._L2:
                gd += wd * load(w, e0 + d)
            sumsq += gd * gd
        srow = srows[0]
        rnew, c0, c1 = row_scalars(M._RW_ADAGRAD, wd_mode, sumsq, wu, srow[lin], ks[M.KS_LR], ks[M.KS_EPS],
                                   ks[M.KS_B2], wd, ks[M.KS_BC2])
        srow[lin] = rnew
        for d in range(wu):
            store(w, e0 + d, c1 * load(w, e0 + d) - c0 * g[d], uint64(0), False)
    elif ki[M.KI_KIND] == M._H_ADAM and ki[M.KI_UPDATE] == M._GLOBAL and ki[M.KI_SR] == 0 and ks[M.KS_MAXN] == 0:
        # HugeCTR Adam's GLOBAL touched rows, the zoo's common case: only the moments move (the all-rows pass
        # moves the weights; each is stored back as row_update stores it). elem_update with the kind as a
        # constant, so the loop compiles without row_update's branches
        zero = float32(0.0)
        b1, b2, scaler = ks[M.KS_B1], ks[M.KS_B2], ks[M.KS_SCALER]
        for d in range(wu):
            wn, an, bn, _ = elem_update(M._H_ADAM, M._GLOBAL, g[d], load(w, e0 + d), sa[e0 + d], sb[e0 + d], zero,
                                        zero, zero, zero, zero, b1, b2, zero, zero, scaler, zero, zero, zero)
            sa[e0 + d], sb[e0 + d] = an, bn
            store(w, e0 + d, wn, uint64(0), False)
    elif ki[M.KI_KIND] == 0:
        grad_rows[s] = lin
        for d in range(grad_vals.shape[1]):
            grad_vals[s, d] = g[d] if d < width else float32(0.0)
    else:
        for d in range(wu):
            gh[d] = g[d]
        row_update_call(w, sa, sb, srows, sprev, e0, lin, sr_lin, wu, gh, bh, ks, ki, base)


# the optimizer rule as one compiled function called per row (inlining it into each width's copy of
# update_segment multiplied the compile time by five for no measurable gain: the row's memory dominates)
row_update_call = njit(**_JIT)(row_update.py_func)


# A pjit twin, as global_pass: at one thread the serial twin (arguments borrowed) runs. Measured 2026-12-07
# (numbactr bench zoo shapes, 1 thread, the two side by side in one process): as fast as the parallel region on
# big steps (DLRM B 4096: 50.3 against 50.4 ms a step; W&D B 4096: 110.0 against 109.5), and on small ones it
# saves the two regions' wake-ups (GMF B 256: 0.62 against 0.79 ms a step). An earlier measurement that found
# the serial copy 1.4x slower predates the borrowed arguments.
@pjit(**_JIT)
def fused_update(w, sa, sb, srows, sprev, elem_off, strides, dims, row_off, sorted_keys, pay, by_bag, seg_start,
                 n_seg, bag_of, bag_src, bag_scale, psw, has_psw, dy, ks, ki, base, grad_rows, grad_vals, sr_rows,
                 has_sr_rows):
    """Every touched row: its gradient summed in occurrence order, then the optimizer's rule (kind NONE:
    grad_rows[s], grad_vals[s] <- linear row and summed gradient of segment s). has_sr_rows: stochastic
    rounding hashes row sr_rows[lin] instead of lin (a tiered table's slots). dy: the pre-scaled copy for
    a MEAN lookup by bag (see linearize). srows: a tuple of the per-row float32 states (the rowwise kinds'
    momentum, prev_iter, row_counter; a stand-in array where the optimizer keeps none)."""
    if ki[M.KI_GO] == 0:                               # a skipped step (kernels.tbe_math.KI_GO)
        return
    dy = dy.reshape(-1)
    dmax = 0
    for t in range(dims.shape[0]):
        dmax = max(dmax, dims[t])
    kind = ki[M.KI_KIND]
    rowwise = kind == M._RW_ADAGRAD or kind == M._PR_ADAM or kind == M._PR_LAMB
    n_chunks = (n_seg + _CHUNK - 1) // _CHUNK
    for c in prange(n_chunks):
        acc = np.empty(dmax, np.float32)          # the other widths' accumulators (heap)
        g = np.empty(dmax, np.float32)            # the gradient row and scratch the general rule reads
        buf = np.empty(dmax, np.float32)
        lo, hi = _chunk(c, n_chunks, n_seg)
        for s in range(lo, hi):
            lin = sorted_keys[seg_start[s]]
            t = table_of(lin, row_off)
            width = dims[t]
            if s + _PF < n_seg:                          # the weights row of a later run
                later = sorted_keys[seg_start[s + _PF]]
                t_later = table_of(later, row_off)
                prefetch_row(w, elem_off[t_later] + (later - row_off[t_later]) * strides[t_later], dims[t_later])
                if rowwise:
                    prefetch(srows[0], uint64(later))
            e0 = uint64(elem_off[t] + (lin - row_off[t]) * strides[t])
            sr_lin = sr_rows[lin] if has_sr_rows else lin
            # the common widths get their own copy (a literal trip count, accumulators on the stack)
            if width == 16:
                update_segment(w, sa, sb, srows, sprev, pay, by_bag, seg_start, s, bag_of, bag_src, bag_scale, psw,
                               has_psw, dy, ks, ki, base, grad_rows, grad_vals, sr_lin, e0, lin, 16, stack_f32(16), g,
                               buf)
            elif width == 32:
                update_segment(w, sa, sb, srows, sprev, pay, by_bag, seg_start, s, bag_of, bag_src, bag_scale, psw,
                               has_psw, dy, ks, ki, base, grad_rows, grad_vals, sr_lin, e0, lin, 32, stack_f32(32), g,
                               buf)
            elif width == 64:
                update_segment(w, sa, sb, srows, sprev, pay, by_bag, seg_start, s, bag_of, bag_src, bag_scale, psw,
                               has_psw, dy, ks, ki, base, grad_rows, grad_vals, sr_lin, e0, lin, 64, stack_f32(64), g,
                               buf)
            elif width == 128:
                update_segment(w, sa, sb, srows, sprev, pay, by_bag, seg_start, s, bag_of, bag_src, bag_scale, psw,
                               has_psw, dy, ks, ki, base, grad_rows, grad_vals, sr_lin, e0, lin, 128, stack_f32(128), g,
                               buf)
            else:
                update_segment(w, sa, sb, srows, sprev, pay, by_bag, seg_start, s, bag_of, bag_src, bag_scale, psw,
                               has_psw, dy, ks, ki, base, grad_rows, grad_vals, sr_lin, e0, lin, width, acc, g, buf)


@pjit(**_JIT)
def global_pass(w, sa, sb, elem_off, strides, dims, row_off, live, ks, ki, base, sr_rows, has_sr_rows):
    """HugeCTR's all-rows pass over rows [0, live[t]) of every table t (stochastic rounding hashes
    sr_rows[lin] when has_sr_rows, as fused_update)."""
    if ki[M.KI_GO] == 0:
        return
    kind, sr = ki[M.KI_KIND], ki[M.KI_SR] != 0
    n_b = elem_state_count(kind) >= 2
    if kind == M._H_ADAM and not sr:                    # the zoo's common case: global_elem's Adam, branch free
        b1, b2, eps, alpha = ks[M.KS_B1], ks[M.KS_B2], ks[M.KS_EPS], ks[M.KS_ALPHA]
        for t in range(dims.shape[0]):
            for r in prange(live[t]):
                e0 = uint64(elem_off[t] + r * strides[t])
                for d in range(uint64(dims[t])):
                    wn, an, bn = global_elem(M._H_ADAM, load(w, e0 + d), sa[e0 + d], sb[e0 + d], b1, b2, eps,
                                             float32(0.0), alpha)
                    sa[e0 + d], sb[e0 + d] = an, bn
                    store(w, e0 + d, wn, uint64(0), False)
        return
    for t in range(dims.shape[0]):
        for r in prange(live[t]):
            e0 = uint64(elem_off[t] + r * strides[t])
            lin = row_off[t] + r
            srl = sr_rows[lin] if has_sr_rows else lin
            for d in range(uint64(dims[t])):
                bv = sb[e0 + d] if n_b else float32(0.0)
                wn, an, bn = global_elem(kind, load(w, e0 + d), sa[e0 + d], bv, ks[M.KS_B1], ks[M.KS_B2],
                                         ks[M.KS_EPS], ks[M.KS_MOM], ks[M.KS_ALPHA])
                sa[e0 + d] = an
                if n_b:
                    sb[e0 + d] = bn
                store(w, e0 + d, wn, splitmix64(sr_key(srl, d) ^ base), sr)


# ---- small tables: a gather forward and a sort-free update --------------------------------------------
@pjit(**_JIT)
def forward_onehot(w, elem_off, strides, ftable, fcols, rows, offsets, batch, layout, out):
    """forward's pooled case when no bag holds more than one occurrence and there are no per-sample
    weights: a gather, out[b, feature f's columns] <- 0 + W[row] (zeros for an empty bag or a -1 row).
    The same bits as pool_bag (its accumulator starts at +0.0, so a -0.0 weight pools to +0.0, and a MEAN
    of one row is scaled by exactly 1), without its per-bag setup; the bags are walked sample by sample,
    so out is written front to back in either layout."""
    n_features = ftable.shape[0]
    total = uint64(fcols[n_features])
    zero = float32(0.0)
    n_chunks = (batch + _CHUNK - 1) // _CHUNK
    for c in prange(n_chunks):
        lo, hi = _chunk(c, n_chunks, batch)
        for b in range(lo, hi):
            for f in range(n_features):
                j = f * batch + b if layout == 0 else b * n_features + f
                t = ftable[f]
                o = uint64(b) * total + uint64(fcols[f])
                dim = uint64(fcols[f + 1] - fcols[f])
                k = offsets[j]
                r = rows[k] if offsets[j + 1] > k else -1
                if r >= 0:
                    src = uint64(elem_off[t] + r * strides[t])
                    for d in range(dim):
                        out[o + d] = zero + load(w, src + d)
                else:
                    for d in range(dim):
                        out[o + d] = zero


@njit(inline="always", **_JIT)
def _moments_only(ks, ki):
    """HugeCTR Adam with Update_t.Global, no stochastic rounding, no max norm: a touched row's update moves
    only its moments (the weights are the all-rows pass's), by terms of its gradient alone."""
    return ki[M.KI_KIND] == M._H_ADAM and ki[M.KI_UPDATE] == M._GLOBAL and ki[M.KI_SR] == 0 and ks[M.KS_MAXN] == 0


@njit(inline="always", **_JIT)
def _small_row(w, sa, sb, srows, sprev, elem_off, strides, row_off, lin, acc, ks, ki, base, no_i64, no_f32, sr_rows,
               has_sr_rows, width, g, gh, bh):
    """small_update's update of touched linear row lin (of `width`, a literal for the common widths) by any rule
    but HugeCTR Adam GLOBAL's (small_update moves those moments itself): its accumulator (acc flat, rows of
    gh's width) copied into g (a stack row for the common widths, as fused_update's), then update_row."""
    t = table_of(lin, row_off)
    e0 = uint64(elem_off[t] + (lin - row_off[t]) * strides[t])
    sr_lin = sr_rows[lin] if has_sr_rows else lin
    src = uint64(lin) * uint64(gh.shape[0])
    for d in range(uint64(width)):
        g[d] = acc[src + d]
    update_row(w, sa, sb, srows, sprev, ks, ki, base, no_i64, no_f32, lin, sr_lin, e0, lin, width, g, gh, bh)


@pjit(**_JIT)
def small_update(w, sa, sb, srows, sprev, elem_off, strides, dims, row_off, rows, offsets, ftable, fcols, batch,
                 layout, pooling, psw, has_psw, dy, touched, acc, ks, ki, base, sr_rows, has_sr_rows, scratch,
                 no_rows, no_vals):
    """fused_update without the linearize / sort / segments before it, for tables whose linear rows are few
    (the CPU impl's choice, engine/impl_cpu.py; not for optimizer NONE, whose rows it returns).

    Each occurrence's gradient term (reduce_row's: dy's row, times its per-sample weight and 1 / L for a
    MEAN bag) is added into its linear row's accumulator acc[lin] (flat: V_total rows of the widest
    table's width), the occurrences walked in order: every row's sum has the same terms in the same order
    as fused_update's stable sort gives it, so the same bits. touched (V_total,) int8 is 0 for a row not
    yet touched by this call: its first occurrence zeroes its accumulator and sets it. Then the rows are
    walked in order, and each touched one gets update_row (fused_update's rule; rows are independent) and
    is cleared: the weights, states and accumulators are read front to back, not in the batch's random
    order. (Measured 2026-12-07, one thread, a loaded machine: 8,192 one-hot bags on 2,625 rows of D 16,
    HugeCTR Adam GLOBAL: 0.28 ms against 0.47 ms for linearize + radix sort + fused_update; about a third
    of it is the gradient sum, a third the moments' divisions; the moments' loop since vectorized: 0.10-0.17
    ms in all.) scratch (threads, 3 x the widest width) float32 holds the rows' working rows, and no_rows (1,) int64, no_vals (1, 1) float32
    stand in for update_row's NONE outputs: all passed in, not made here, so the serial twin borrows them
    (an array made here is reference-counted at every call of the inlined row update). Returns the number
    of touched rows U."""
    if ki[M.KI_GO] == 0:                               # a skipped step (kernels.tbe_math.KI_GO)
        return 0
    dy = dy.reshape(-1)
    n_features = ftable.shape[0]
    n_bags = offsets.shape[0] - 1
    total = fcols[n_features]
    aw = uint64(acc.shape[0] // max(touched.shape[0], 1))     # the accumulator rows' width
    n_rows = touched.shape[0]
    one = float32(1.0)
    by_bag = pooling != 2 and not has_psw              # reduce_row's by_bag: dy's row added as it is
    u = 0
    f, b = 0, 0                                        # bag j's feature and sample, stepped (no division)
    for j in range(n_bags):
        t = ftable[f]
        width = uint64(fcols[f + 1] - fcols[f])
        begin, end = offsets[j], offsets[j + 1]
        scale = one / float32(end - begin) if pooling == 1 and end > begin else one
        src = uint64(b * total + fcols[f])
        if layout == 0:
            b += 1
            if b == batch:
                b, f = 0, f + 1
        else:
            f += 1
            if f == n_features:
                f, b = 0, b + 1
        for k in range(begin, end):
            r = rows[k]
            if r < 0:
                continue
            lin = row_off[t] + r
            at = uint64(lin) * aw
            if touched[lin] == 0:
                touched[lin] = 1
                u += 1
                for d in range(width):
                    acc[at + d] = float32(0.0)
            if by_bag and scale == one:                # linearize's SUM (and MEAN of one row): dy itself
                for d in range(width):
                    acc[at + d] += dy[src + d]
            elif by_bag:                               # MEAN: the pre-scaled dy linearize writes
                for d in range(width):
                    acc[at + d] += dy[src + d] * scale
            else:                                      # reduce_row's weighted term
                s = (psw[k] if has_psw else one) * scale
                o = uint64(k) * width if pooling == 2 else src
                for d in range(width):
                    acc[at + d] += s * dy[o + d]
    n_chunks = (n_rows + _CHUNK - 1) // _CHUNK
    moments_only = _moments_only(ks, ki)
    b1, b2, scaler = ks[M.KS_B1], ks[M.KS_B2], ks[M.KS_SCALER]
    for c in prange(n_chunks):
        row = scratch[numba.get_thread_id()]
        gh, bh, g = row[:aw], row[aw:2 * aw], row[2 * aw:3 * aw]
        lo, hi = _chunk(c, n_chunks, n_rows)
        if moments_only:        # HugeCTR Adam GLOBAL: a touched row moves only its moments, by elem_update's
            # expressions, in a loop over the row's width the compiler vectorizes (through update_row, with
            # literal widths, it stayed scalar: 8,192 one-hot bags on 2,625 rows of D 16, one thread, 0.31 ->
            # 0.10-0.17 ms for the whole small_update)
            for lin in range(lo, hi):
                if touched[lin] == 0:
                    continue
                touched[lin] = 0
                t = table_of(lin, row_off)
                e0 = uint64(elem_off[t] + (lin - row_off[t]) * strides[t])
                src = uint64(lin) * aw
                for d in range(uint64(dims[t])):
                    gs = acc[src + d] / scaler
                    sa[e0 + d] = sa[e0 + d] + float32((one - b1) * gs / b1)
                    sb[e0 + d] = sb[e0 + d] + float32((one - b2) * gs * gs / b2)
            continue
        for lin in range(lo, hi):
            if touched[lin] == 0:
                continue
            touched[lin] = 0
            width = dims[table_of(lin, row_off)]
            if width == 16:
                _small_row(w, sa, sb, srows, sprev, elem_off, strides, row_off, lin, acc, ks, ki, base, no_rows,
                           no_vals, sr_rows, has_sr_rows, 16, stack_f32(16), gh, bh)
            elif width == 32:
                _small_row(w, sa, sb, srows, sprev, elem_off, strides, row_off, lin, acc, ks, ki, base, no_rows,
                           no_vals, sr_rows, has_sr_rows, 32, stack_f32(32), gh, bh)
            else:
                _small_row(w, sa, sb, srows, sprev, elem_off, strides, row_off, lin, acc, ks, ki, base, no_rows,
                           no_vals, sr_rows, has_sr_rows, width, g, gh, bh)
    return u


@pjit(**_JIT)
def psw_grad(w, elem_off, strides, ftable, fcols, rows, offsets, dy, want, batch, layout, pooling, out):
    """out (N,) <- s_j <dy row of the bag (NONE: of the occurrence), W row> for features with want[f]."""
    n_features = ftable.shape[0]
    n_bags = offsets.shape[0] - 1
    for k in range(offsets[0]):
        out[k] = 0.0
    for j in prange(n_bags):
        f, b = bag_fb(j, n_features, batch, layout)
        t = ftable[f]
        col = fcols[f]
        dim = fcols[f + 1] - col
        s = float32(1.0)
        if pooling == 1 and offsets[j + 1] > offsets[j]:
            s = float32(1.0) / float32(offsets[j + 1] - offsets[j])
        for k in range(offsets[j], offsets[j + 1]):
            r = rows[k]
            acc = float32(0.0)
            if r >= 0 and want[f]:
                base = elem_off[t] + r * strides[t]
                for d in range(dim):
                    acc += (dy[k, d] if pooling == 2 else dy[b, col + d]) * load(w, base + d)
            out[k] = s * acc


def radix_bits(sentinel: int) -> int:
    """Bits the radix sort needs for keys in [0, sentinel]."""
    return max(1, int(sentinel).bit_length())


#: CPU code only (numba.njit); the numba.cuda kernels of the same ops are in kernels/tbe.py
PTX_CHECKS = []
