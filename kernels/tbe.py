"""Table-batched embedding (TBE): the numba.cuda kernels and their launch wrappers.

What the op computes (layout, forward, backward, every optimizer's update, FP16 rounding, the bounds check)
is the NumPy reference's docstring, kernels/tbe_ref.py; its names are re-exported here, so tbe.X_ref keeps
working. Here: how the kernels compute it, one launch per op for all tables, with no float atomics, so a
row's gradient is summed in occurrence order and a step gives the same bits every time.

Kernels (one launch per op for all tables; every loop grid-stride; sizes known before each launch):
    clamp_offsets + scan.inclusive_max_scan   repaired offsets          check_indices   rows + status
    forward      block (lanes, bags): threadIdx.y a bag, the lanes its columns d = tx, tx + lanes, ...
    linearize    linear row and bag of every occurrence; then a stable sort of the linear rows (CuPy's CUB
                 radix sort on a GPU, NumPy's in the simulator)
    segment_flags + scan.exclusive_scan + segment_starts   the runs of equal rows; U stays on the device
    update       block (lanes, runs): a run per threadIdx.y, its gradient summed in sorted (= occurrence)
                 order in registers, row sums across the lanes in shared memory, the optimizer's rule, the
                 row written once; rows past U compute zeros so every thread meets the same barriers
    global       HugeCTR's all-rows pass        psw_grad   the per-sample-weight gradients
Rows are padded to 16 bytes, so lanes read aligned, coalesced 4-byte (or 2-byte) elements of one row.
HugeCTR: HugeCTR/src/embeddings/ (forward_sum/mean, backward, the sparse optimizers);
FBGEMM: fbgemm_gpu/codegen/training/ (split_embedding_codegen forward/backward templates, optimizers.py,
embedding_bounds_check_*). Their formulas, our code.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, float64, int64, uint64

from . import optimizers as OPT
from . import tbe_math as M
from .block_reduce import lane_sum
from .embedding_init import _splitmix64
from .launch import block_rows, count_launch, launch_1d, launch_lanes, lanes_for
from .scan import exclusive_scan, inclusive_max_scan
from .tbe_math import (BoundsCheck, CounterWeightDecay, Layout, Optim, Pooling, Precision, UpdateType,  # noqa: F401
                       WeightDecay)
# the NumPy reference and the host-side definitions it shares with the kernels (tbe_ref.py)
from .tbe_ref import (HUGECTR_KINDS, STATES, LAZY_PREV_STEP, PREV_ITER, ROW_COUNTER, CounterRegularization,  # noqa: F401
                      EmbeddingBoundsError, HP_FIELDS, _f32, SR_PASS_HOT, SR_PASS_ALL, rounding_bits_ref,
                      rounding_base, to_half_ref, bag_feature_sample_ref, check_offsets_ref,
                      offsets_message, check_indices_ref, bounds_message, _bag_scale, _occurrences,
                      _weights, tbe_forward_ref, occurrence_grads_ref, tbe_backward_ref,
                      per_sample_weights_grad_ref, _row_norm, counter_update_ref, optimizer_update_ref,
                      _hugectr_hot_ref, global_pass_ref, global_pass_first, has_global_pass)


# ---- step scalars (packed for the compiled paths) ---------------------------------------------------
def kernel_scalars(hp: dict, step: int, counter: CounterRegularization | None = None, max_counter: float = 1.0,
                   refresh: bool = False) -> np.ndarray:
    """The packed float32 scalars (tbe_math.KS_*) of the compiled paths for hyper-parameters hp at step t
    (counter: the COUNTER / COWCLIP settings, max_counter this step's value, refresh whether it is renewed
    at this step): step_free_scalars, then set_step_scalars."""
    ks = step_free_scalars(hp, counter)
    set_step_scalars(ks, hp, step, max_counter, refresh)
    return ks


def step_free_scalars(hp: dict, counter: CounterRegularization | None = None) -> np.ndarray:
    """kernel_scalars' entries that stay the same from step to step (the step's entries zero): a caller that
    keeps them (the engine, while its optimizer spec is unchanged) fills a copy with set_step_scalars."""
    ks = np.zeros(M.N_KS, np.float32)
    if counter is not None:
        ks[M.KS_CNT_UB], ks[M.KS_CNT_TAIL] = counter.adjustment_ub, counter.tail_id_threshold
        ks[M.KS_CNT_WNC], ks[M.KS_CNT_LB] = counter.weight_norm_coefficient, counter.lower_bound
    for name, at in (("learning_rate", M.KS_LR), ("eps", M.KS_EPS), ("beta1", M.KS_B1), ("beta2", M.KS_B2),
                     ("weight_decay", M.KS_WD), ("momentum", M.KS_MOM), ("max_norm", M.KS_MAXN),
                     ("scaler", M.KS_SCALER)):
        ks[at] = hp[name]
    ks[M.KS_ETA] = hp.get("eta", 0.001)                 # LARS_SGD's only (OptimizerSpec's default)
    ks[M.KS_L1] = hp.get("lambda1", 0.0)                # HUGECTR_FTRL's lambda1 and float32 l2'
    ks[M.KS_L2P] = OPT.ftrl_lambda2(hp["learning_rate"], hp.get("beta", 0.0), hp.get("lambda2", 0.0))
    if _f32(hp["beta1"]) != 1.0:
        ks[M.KS_LAZY] = OPT.lazy_adam_alpha_common(hp["learning_rate"], hp["beta1"])
    return ks


def set_step_scalars(ks: np.ndarray, hp: dict, step: int, max_counter: float = 1.0, refresh: bool = False) -> None:
    """Write kernel_scalars' entries of step t into ks (from step_free_scalars) in place: max_counter and its
    refresh flag, Adam's bias corrections 1 - b^t and its bias-corrected step size."""
    ks[M.KS_MAXC], ks[M.KS_REFRESH] = max_counter, float(refresh)
    b1, b2 = _f32(hp["beta1"]), _f32(hp["beta2"])
    ks[M.KS_BC1], ks[M.KS_BC2] = 1.0 - b1 ** step, 1.0 - b2 ** step
    if b1 != 1.0:
        ks[M.KS_ALPHA] = OPT.adam_alpha_t(hp["learning_rate"], hp["beta1"], hp["beta2"], step)


def kernel_ints(kind, update, wd_mode, step: int, stochastic: bool, pooling, layout, batch: int,
                counter: CounterRegularization | None = None, rowwise_bias_correction: bool = False) -> np.ndarray:
    """The packed int64 parameters (tbe_math.KI_*) of the compiled paths: step_free_ints, then set_step_ints."""
    ki = step_free_ints(kind, update, wd_mode, counter, rowwise_bias_correction)
    set_step_ints(ki, step, stochastic, pooling, layout, batch)
    return ki


def step_free_ints(kind, update, wd_mode, counter: CounterRegularization | None = None,
                   rowwise_bias_correction: bool = False) -> np.ndarray:
    """kernel_ints' entries fixed by the optimizer spec (those of the step and the lookup zero; KI_GO 1)."""
    ki = np.zeros(M.N_KI, np.int64)
    if counter is not None:
        ki[M.KI_CNT_WD], ki[M.KI_CNT_HALF] = int(counter.weight_decay_mode), counter.halflife
        ki[M.KI_CNT_ADJ], ki[M.KI_CNT_LRM] = counter.adjustment_iter, int(counter.learning_rate_mode)
        ki[M.KI_CNT_RATIO] = bool(counter.tail_id_threshold_is_ratio)
    ki[M.KI_RBC] = bool(rowwise_bias_correction)
    ki[M.KI_KIND], ki[M.KI_UPDATE], ki[M.KI_WD_MODE] = int(kind), int(update), int(wd_mode)
    ki[M.KI_GO] = 1
    return ki


def set_step_ints(ki: np.ndarray, step: int, stochastic: bool, pooling, layout, batch: int) -> None:
    """Write kernel_ints' entries of step t and of the lookup (rounding, pooling, layout, batch) into ki."""
    ki[M.KI_STEP], ki[M.KI_SR], ki[M.KI_POOLING], ki[M.KI_LAYOUT] = step, stochastic, int(pooling), int(layout)
    ki[M.KI_BATCH] = batch


# ---- device functions: tbe_math compiled for numba.cuda ---------------------------------------------
_device = functools.partial(cuda.jit, device=True, inline=True)    # inline: compiles without a GPU
half_to_float = _device(M.half_to_float)
float_to_half_bits = _device(M.float_to_half_bits)
sr_key = _device(M.sr_key)
row_scalars = _device(M.row_scalars)
counter_row_scalars = _device(M.counter_row_scalars)
row_bias_corrections = _device(M.row_bias_corrections)
lazy_scalars = _device(M.lazy_scalars)
elem_update = _device(M.elem_update)
global_elem = _device(M.global_elem)
lamb_ratio = _device(M.lamb_ratio)
lars_rate = _device(M.lars_rate)
max_norm_scale = _device(M.max_norm_scale)
elem_state_count = _device(M.elem_state_count)


@_device
def _load32(w, i):
    return w[i]


@_device
def _load16(w, i):
    return half_to_float(w[i])


@_device
def _store32(w, i, v, h, stochastic):
    w[i] = v


@_device
def _store16(w, i, v, h, stochastic):
    w[i] = float_to_half_bits(v, h, stochastic)


@_device
def _bag_fb(j, n_features, batch, layout):
    """(feature, sample) of bag j."""
    if layout == 0:
        return j // batch, j - (j // batch) * batch
    return j - (j // n_features) * n_features, j // n_features


@_device
def _last_at_most(a, hi, v):
    """The last j in [0, hi] with a[j] <= v (a non-decreasing, a[0] <= v): a binary search."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid] <= v:
            lo = mid
        else:
            hi = mid - 1
    return lo


@_device
def _table_of(lin, row_off):
    """The table holding linear row lin (row_off (T + 1,))."""
    return _last_at_most(row_off, row_off.shape[0] - 2, lin)


# ---- kernels: bounds check --------------------------------------------------------------------------
_I64_MAX = 0x7FFFFFFFFFFFFFFF
#: status (4,) int64 of a bounds check: offsets repaired, indices out of range, first bad index position,
#: first repaired offset position (INT64_MAX when none)
ST_BAD_OFFSETS, ST_BAD_INDICES, ST_FIRST_INDEX, ST_FIRST_OFFSET = range(4)


@cuda.jit
def clamp_offsets_kernel(offsets, n, fixed, status):
    """fixed[j] <- offsets[j] clamped into [0, n], the last one n; status reset (the running maximum that
    completes the repair is scan.inclusive_max_scan)."""
    last = fixed.shape[0] - 1
    for j in range(cuda.grid(1), fixed.shape[0], cuda.gridsize(1)):
        v = int64(offsets[j])
        v = min(max(v, int64(0)), n)
        fixed[j] = n if j == last else v
        if j == 0:
            status[0] = 0
            status[1] = 0
            status[2] = _I64_MAX
            status[3] = _I64_MAX


@cuda.jit
def check_indices_kernel(indices, offsets, fixed, feature_rows, batch, layout, mode, rows, status, keyed_table,
                         occ, want_occ):
    """rows[k] <- indices[k] of every bag under the mode (out of range: FATAL kept, WARNING/IGNORE 0,
    NONE -1); positions before the first bag -1; status counts repaired offsets and bad indices and
    keeps the first of each (atomic min: the same answer whatever the thread order). want_occ: also
    occ[k] <- keyed_table[feature of k] (-1 outside every bag), the keyed table of each occurrence."""
    n_features = feature_rows.shape[0]
    n_bags = fixed.shape[0] - 1
    fill = int64(-1) if mode == 3 else int64(0)
    for k in range(cuda.grid(1), fixed[0], cuda.gridsize(1)):
        rows[k] = -1
        if want_occ:
            occ[k] = -1
    for j in range(cuda.grid(1), n_bags + 1, cuda.gridsize(1)):
        if fixed[j] != offsets[j]:
            cuda.atomic.add(status, ST_BAD_OFFSETS, 1)
            cuda.atomic.min(status, ST_FIRST_OFFSET, int64(j))
        if j == n_bags:
            continue
        f, _ = _bag_fb(j, n_features, batch, layout)
        limit = feature_rows[f]                            # -1: a keyed feature, not checked
        if want_occ:
            t = keyed_table[f]
            for k in range(fixed[j], fixed[j + 1]):
                occ[k] = t
        for k in range(fixed[j], fixed[j + 1]):
            v = int64(indices[k])
            if limit >= 0 and v != int64(-1) and (v < int64(0) or v >= limit):
                cuda.atomic.add(status, ST_BAD_INDICES, 1)
                cuda.atomic.min(status, ST_FIRST_INDEX, int64(k))
                if mode != 0:
                    v = fill
            rows[k] = v


#: rec (11,) int64 of deferred bounds checks (a training step on a GPU reads nothing; the caller reads rec
#: when it chooses to): offsets repaired (sum), first repaired offset's position (-1: none) and value,
#: indices out of range (sum), the first one's position (-1: none), feature, sample, value and table rows,
#: and that batch's N and F*B
REC_SIZE = 11


def new_bounds_record(xp):
    rec = xp.zeros(REC_SIZE, np.int64)
    rec[1] = rec[4] = -1
    return rec


@cuda.jit
def record_bounds_kernel(status, indices, offsets, fixed, feature_rows, batch, layout, rec):
    """One thread: add this batch's bounds-check status to rec, keeping the first offender's details."""
    if cuda.grid(1) != 0:
        return
    n_bags = fixed.shape[0] - 1
    rec[0] += status[ST_BAD_OFFSETS]
    rec[3] += status[ST_BAD_INDICES]
    first = rec[1] < 0 and rec[4] < 0
    if first and status[ST_BAD_OFFSETS] > 0:
        j = status[ST_FIRST_OFFSET]
        rec[1] = j
        rec[2] = int64(offsets[j])
    if first and status[ST_BAD_INDICES] > 0:
        k = status[ST_FIRST_INDEX]
        j = _last_at_most(fixed, n_bags - 1, k)            # the bag holding k
        f, b = _bag_fb(j, feature_rows.shape[0], batch, layout)
        rec[4] = k
        rec[5] = f
        rec[6] = b
        rec[7] = int64(indices[k])
        rec[8] = feature_rows[f]
    if first and (status[ST_BAD_OFFSETS] > 0 or status[ST_BAD_INDICES] > 0):
        rec[9] = indices.shape[0]
        rec[10] = n_bags


# ---- kernels: forward -------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def make_forward_kernel(w_half: bool, out_half: bool, pooling_const: int = -1):
    """Pooled / per-occurrence lookup; block (lanes, items): threadIdx.y a bag, threadIdx.x columns d,
    d + lanes, ... of it (consecutive threads read consecutive elements of one row: coalesced).
    pooling_const >= 0 compiles it for that pooling (forward() always does: the host knows it), which drops
    the other poolings' code and its registers; -1 reads the pooling argument."""
    load = _load16 if w_half else _load32
    store = _store16 if out_half else _store32
    POOL = int(pooling_const)

    def forward_kernel(w, elem_off, strides, ftable, fcols, rows, offsets, psw, has_psw, batch, layout,
                       pooling, out):
        pooling = pooling if POOL < 0 else int64(POOL)
        n_features = ftable.shape[0]
        total = fcols[n_features]
        items = cuda.blockDim.y
        for j in range(cuda.blockIdx.x * items + cuda.threadIdx.y, offsets.shape[0] - 1, cuda.gridDim.x * items):
            f, b = _bag_fb(j, n_features, batch, layout)
            t = ftable[f]
            dim = fcols[f + 1] - fcols[f]
            begin = offsets[j]
            end = offsets[j + 1]
            for d in range(cuda.threadIdx.x, dim, cuda.blockDim.x):
                if pooling == 2:
                    for k in range(begin, end):
                        r = rows[k]
                        v = float32(0.0)
                        if r >= 0:
                            p = psw[k] if has_psw else float32(1.0)
                            v = p * load(w, elem_off[t] + r * strides[t] + d)
                        store(out, k * dim + d, v, uint64(0), False)
                    continue
                acc = float32(0.0)
                for k in range(begin, end):
                    r = rows[k]
                    if r >= 0:
                        p = psw[k] if has_psw else float32(1.0)
                        acc += p * load(w, elem_off[t] + r * strides[t] + d)
                if pooling == 1 and end > begin:
                    acc *= float32(1.0) / float32(end - begin)
                store(out, b * total + fcols[f] + d, acc, uint64(0), False)

    if POOL >= 0:
        forward_kernel.__name__ = forward_kernel.__qualname__ = f"forward_kernel_{M.Pooling(POOL).name.lower()}"
    return cuda.jit(forward_kernel)


# ---- kernels: backward (linearize, segment, fused reduce + update) -----------------------------------
@cuda.jit
def linearize_kernel(rows, offsets, ftable, row_off, batch, layout, sentinel, lin, bag_of):
    """lin[k] <- row_off[table] + row (the sentinel for -1 rows and positions outside every bag);
    bag_of[k] <- the bag of occurrence k (-1 outside every bag)."""
    n_features = ftable.shape[0]
    for k in range(cuda.grid(1), offsets[0], cuda.gridsize(1)):
        lin[k] = sentinel
        bag_of[k] = -1
    for j in range(cuda.grid(1), offsets.shape[0] - 1, cuda.gridsize(1)):
        f, _ = _bag_fb(j, n_features, batch, layout)
        base = row_off[ftable[f]]
        for k in range(offsets[j], offsets[j + 1]):
            r = rows[k]
            lin[k] = base + r if r >= 0 else sentinel
            bag_of[k] = j


@cuda.jit
def segment_flags_kernel(lin, perm, sentinel, flags):
    """flags[i] <- 1 where the i-th smallest linear row starts a run of equal rows (sentinels excluded)."""
    for i in range(cuda.grid(1), perm.shape[0], cuda.gridsize(1)):
        key = lin[perm[i]]
        flags[i] = int64(1) if key != sentinel and (i == 0 or key != lin[perm[i - 1]]) else int64(0)


@cuda.jit
def segment_starts_kernel(lin, perm, sentinel, flags, pos, seg_start):
    """seg_start[pos[i]] <- i at every run start; seg_start[U] <- the end of the last run (U = pos[N])."""
    n = perm.shape[0]
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        if flags[i] != 0:
            seg_start[pos[i]] = i
        key = lin[perm[i]]
        if key != sentinel and (i == n - 1 or lin[perm[i + 1]] == sentinel):
            seg_start[pos[n]] = i + 1


@functools.lru_cache(maxsize=None)
def make_update_kernel(w_half: bool, lanes: int, items: int, per_lane: int, kind_const: int = -1,
                       wd_mode_const: int = -1):
    """The fused backward + optimizer: block (lanes, items), threadIdx.y one touched row (segment),
    threadIdx.x columns d = tx + v lanes (v < per_lane, held in registers). Row sums (rowwise states,
    LAMB's norms, max_norm) reduce across the lanes in shared memory; every thread of the block runs the
    same barriers (rows past the last segment compute with zeros).

    kind_const / wd_mode_const >= 0 compile the kernel for that optimizer kind and weight-decay mode (the
    values ki holds, which the caller knows on the host): the other optimizers' branches fold away, and
    with them their registers (one body for every optimizer holds the largest rule's registers, which
    lowers occupancy; ptx_check's report gives each variant's). -1 reads them from ki."""
    load = _load16 if w_half else _load32
    store = _store16 if w_half else _store32
    KIND, WD_MODE = int(kind_const), int(wd_mode_const)

    def update_kernel(w, sa, sb, srow, sprev, spit, scnt, elem_off, strides, dims, row_off, fcols, lin_of, perm,
                      seg_start, pos, bag_of, offsets, psw, has_psw, dy, ks, ki, kb, grad_rows, grad_vals, sr_rows,
                      has_sr_rows):
        if ki[M.KI_GO] == 0:                             # a skipped step (the same for every thread)
            return
        sh = cuda.shared.array((items, lanes), float32)
        g = cuda.local.array(per_lane, float32)
        buf = cuda.local.array(per_lane, float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        n = perm.shape[0]
        n_seg = pos[n]                                   # on the device: no host read
        n_features = fcols.shape[0] - 1
        total = fcols[n_features]
        kind = ki[M.KI_KIND] if KIND < 0 else int64(KIND)            # a constant folds the other kinds away
        wd_mode = ki[M.KI_WD_MODE] if WD_MODE < 0 else int64(WD_MODE)
        update = ki[M.KI_UPDATE]
        batch, layout, pooling = ki[M.KI_BATCH], ki[M.KI_LAYOUT], ki[M.KI_POOLING]
        step, sr = ki[M.KI_STEP], ki[M.KI_SR] != 0
        lr, eps, b1, b2, wd = ks[M.KS_LR], ks[M.KS_EPS], ks[M.KS_B1], ks[M.KS_B2], ks[M.KS_WD]
        base = kb[0]
        n_states = elem_state_count(kind)
        for first in range(cuda.blockIdx.x * items, n, cuda.gridDim.x * items):
            if first >= n_seg:                           # the same for the whole block
                break
            s = first + ty
            active = s < n_seg
            width = int64(0)
            lin = int64(0)
            e0 = int64(0)
            i0 = int64(0)
            i1 = int64(0)
            if active:
                i0 = seg_start[s]
                i1 = seg_start[s + 1]
                lin = lin_of[perm[i0]]
                t = _table_of(lin, row_off)
                width = dims[t]
                e0 = elem_off[t] + (lin - row_off[t]) * strides[t]
            # 1. the row's gradient, occurrences in sorted = occurrence order
            for v in range(per_lane):
                d = tx + v * lanes
                acc = float32(0.0)
                if d < width:
                    for i in range(i0, i1):
                        k = perm[i]
                        sc = psw[k] if has_psw else float32(1.0)
                        if pooling == 2:
                            acc += sc * dy[k * width + d]
                        else:
                            j = bag_of[k]
                            f, b = _bag_fb(j, n_features, batch, layout)
                            if pooling == 1:
                                sc = sc * (float32(1.0) / float32(offsets[j + 1] - offsets[j]))
                            acc += sc * dy[b * total + fcols[f] + d]
                g[v] = acc
            if kind == 0:                                # optimizer NONE: hand the gradient back
                if active:
                    if tx == 0:
                        grad_rows[s] = lin
                    for v in range(per_lane):
                        d = tx + v * lanes
                        if d < grad_vals.shape[1]:
                            grad_vals[s, d] = g[v] if d < width else float32(0.0)
                continue
            # 2. row scalars (rowwise states, HugeCTR's lazy catch-up)
            c0 = float32(0.0)
            c1 = float32(0.0)
            c2 = float32(0.0)
            bc1 = ks[M.KS_BC1]
            bc2 = ks[M.KS_BC2]
            counted = kind == M._RW_ADAGRAD and (wd_mode == M._COUNTER or wd_mode == M._COWCLIP)
            if counted or kind == M._LARS:               # both read the row's |g'|^2 and |w|^2
                cwd = ki[M.KI_CNT_WD] if counted else 0
                gpart = float32(0.0)
                wpart = float32(0.0)
                for v in range(per_lane):
                    d = tx + v * lanes
                    if d < width:
                        wv = load(w, e0 + d)
                        gd = g[v]
                        if cwd == 1:
                            gd += wd * wv
                        gpart += gd * gd
                        wpart += wv * wv
                gsum = lane_sum(sh, ty, tx, gpart, lanes)
                wsum = lane_sum(sh, ty, tx, wpart, lanes)
                if kind == M._LARS:
                    if active:
                        c0 = lars_rate(wsum, gsum, lr, ks[M.KS_ETA], wd)
                else:                                    # (kind is the same in every thread of the block)
                    mnew = float32(0.0)
                    cnew = float32(0.0)
                    if active:
                        mnew, cnew, c0, c1 = counter_row_scalars(
                            wd_mode, cwd, srow[lin], scnt[lin], spit[lin], step, gsum, wsum, width, lr, eps, wd,
                            ki[M.KI_CNT_HALF], ki[M.KI_CNT_ADJ], ks[M.KS_CNT_UB], ki[M.KI_CNT_LRM], ks[M.KS_MAXC],
                            ks[M.KS_CNT_TAIL], ki[M.KI_CNT_RATIO], ks[M.KS_CNT_WNC], ks[M.KS_CNT_LB])
                    cuda.syncthreads()                   # every lane has read the row's states
                    if active and tx == 0:
                        srow[lin] = mnew
                        scnt[lin] = cnew
                        spit[lin] = float32(step)
            elif kind == M._RW_ADAGRAD or kind == M._PR_ADAM or kind == M._PR_LAMB:
                part = float32(0.0)
                for v in range(per_lane):
                    d = tx + v * lanes
                    if d < width:
                        gd = g[v]
                        if kind == M._RW_ADAGRAD and wd_mode == M._L2:
                            gd += wd * load(w, e0 + d)
                        part += gd * gd
                sumsq = lane_sum(sh, ty, tx, part, lanes)
                rnew = float32(0.0)
                if active:
                    rnew, c0, c1 = row_scalars(kind, wd_mode, sumsq, width, srow[lin], lr, eps, b2, wd,
                                               ks[M.KS_BC2])
                cuda.syncthreads()                       # every lane has read srow[lin] before it changes
                if active and tx == 0:
                    srow[lin] = rnew
            elif kind == M._H_ADAM and update == M._LAZY:
                if active:
                    c0, c1, c2 = lazy_scalars(sprev[lin], step, b1, b2, ks[M.KS_LAZY])
                cuda.syncthreads()
                if active and tx == 0:
                    sprev[lin] = step
            elif kind == M._H_FTRL:
                c0, c1 = ks[M.KS_L1], ks[M.KS_L2P]
            elif kind == M._ADAM and ki[M.KI_RBC] != 0:         # the row's own step count
                n_upd = float32(0.0)
                if active:
                    n_upd, bc1, bc2 = row_bias_corrections(scnt[lin], b1, b2)
                cuda.syncthreads()
                if active and tx == 0:
                    scnt[lin] = n_upd
            # 3. the element rule
            lamb = kind == M._LAMB or kind == M._PR_LAMB
            wpart = float32(0.0)
            rpart = float32(0.0)
            for v in range(per_lane):
                d = tx + v * lanes
                if d < width:
                    wv = load(w, e0 + d)
                    av = sa[e0 + d] if n_states >= 1 else float32(0.0)
                    bv = sb[e0 + d] if n_states >= 2 else float32(0.0)
                    wn, an, bn, rv = elem_update(kind, update, g[v], wv, av, bv, c0, c1, c2, lr, eps, b1, b2, wd,
                                                 ks[M.KS_MOM], ks[M.KS_SCALER], bc1, bc2, ks[M.KS_ALPHA])
                    if n_states >= 1:
                        sa[e0 + d] = an
                    if n_states >= 2:
                        sb[e0 + d] = bn
                    if lamb:
                        buf[v] = rv
                        wpart += wv * wv
                        rpart += rv * rv
                    else:
                        buf[v] = wn
            if lamb:
                ratio = lamb_ratio(lane_sum(sh, ty, tx, wpart, lanes), lane_sum(sh, ty, tx, rpart, lanes))
                for v in range(per_lane):
                    d = tx + v * lanes
                    if d < width:
                        buf[v] = load(w, e0 + d) - lr * ratio * buf[v]
            scale = float32(1.0)
            if ks[M.KS_MAXN] > float32(0.0):
                npart = float32(0.0)
                for v in range(per_lane):
                    if tx + v * lanes < width:
                        npart += buf[v] * buf[v]
                scale = max_norm_scale(lane_sum(sh, ty, tx, npart, lanes), ks[M.KS_MAXN])
            for v in range(per_lane):
                d = tx + v * lanes
                if d < width:
                    h = _splitmix64(sr_key(sr_rows[lin] if has_sr_rows else lin, d) ^ base) if sr else uint64(0)
                    store(w, e0 + d, buf[v] * scale, h, sr)

    if KIND >= 0:             # named for what it was compiled for (profiles, ptx_check's report)
        update_kernel.__name__ = update_kernel.__qualname__ = (
            f"update_kernel_{M.Optim(KIND).name.lower()}" + (f"_{M.WeightDecay(WD_MODE).name.lower()}"
                                                             if WD_MODE > 0 else ""))
    return cuda.jit(update_kernel)


@cuda.jit
def gate_scalars_kernel(ks, ki, go, skips, tv, fv):
    """A gated step's scalars on the device (one thread): the gate into KI_GO and, when it is open, the
    step-dependent values of kernel_scalars / kernel_ints for t = the host's step tv[0] less the skips the
    host has not seen yet (skips[0] - tv[1]): 1 - b1^t, 1 - b2^t (float32 betas, float64 math), Adam's
    alpha_t from fv = (lr, beta1, beta2) and KI_STEP, computed as the host computes them."""
    if cuda.grid(1) != 0:
        return
    ki[M.KI_GO] = go[0]
    if go[0] == 0:
        return
    step = tv[0] - (skips[0] - tv[1])
    t = float64(step)
    b1 = float64(ks[M.KS_B1])
    ks[M.KS_BC1] = float32(1.0 - math.pow(b1, t))
    ks[M.KS_BC2] = float32(1.0 - math.pow(float64(ks[M.KS_B2]), t))
    if b1 != 1.0:
        ks[M.KS_ALPHA] = float32(fv[0] * math.sqrt(1.0 - math.pow(fv[2], t)) / (1.0 - math.pow(fv[1], t)))
    ki[M.KI_STEP] = step


def gate_scalars(ks, ki, go, skips, tv, fv) -> None:
    launch_1d(gate_scalars_kernel, 1, ks, ki, go, skips, tv, fv)


@functools.lru_cache(maxsize=None)
def make_global_kernel(w_half: bool):
    """HugeCTR's all-rows pass over every live row of every table; block (lanes, items) like the lookup."""
    load = _load16 if w_half else _load32
    store = _store16 if w_half else _store32

    @cuda.jit
    def global_kernel(w, sa, sb, elem_off, strides, dims, row_off, live, ks, ki, kb, sr_rows, has_sr_rows):
        if ki[M.KI_GO] == 0:                             # a skipped step
            return
        kind, sr = ki[M.KI_KIND], ki[M.KI_SR] != 0
        base = kb[0]
        two = elem_state_count(kind) >= 2
        items = cuda.blockDim.y
        for lin in range(cuda.blockIdx.x * items + cuda.threadIdx.y, row_off[row_off.shape[0] - 1],
                         cuda.gridDim.x * items):
            t = _table_of(lin, row_off)
            r = lin - row_off[t]
            if r >= live[t]:
                continue
            e0 = elem_off[t] + r * strides[t]
            for d in range(cuda.threadIdx.x, dims[t], cuda.blockDim.x):
                bv = sb[e0 + d] if two else float32(0.0)
                wn, an, bn = global_elem(kind, load(w, e0 + d), sa[e0 + d], bv, ks[M.KS_B1], ks[M.KS_B2],
                                         ks[M.KS_EPS], ks[M.KS_MOM], ks[M.KS_ALPHA])
                sa[e0 + d] = an
                if two:
                    sb[e0 + d] = bn
                h = _splitmix64(sr_key(sr_rows[lin] if has_sr_rows else lin, d) ^ base) if sr else uint64(0)
                store(w, e0 + d, wn, h, sr)

    return global_kernel


@functools.lru_cache(maxsize=None)
def make_psw_grad_kernel(w_half: bool, lanes: int, items: int):
    """dLoss/dp_k for every occurrence k: threadIdx.y an occurrence, the lanes its dot product."""
    load = _load16 if w_half else _load32

    @cuda.jit
    def psw_grad_kernel(w, elem_off, strides, ftable, fcols, rows, offsets, bag_of, dy, want, batch, layout,
                        pooling, out):
        sh = cuda.shared.array((items, lanes), float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        n = rows.shape[0]
        n_features = ftable.shape[0]
        total = fcols[n_features]
        for first in range(cuda.blockIdx.x * items, n, cuda.gridDim.x * items):
            k = first + ty
            part = float32(0.0)
            sc = float32(0.0)
            if k < n and rows[k] >= 0 and bag_of[k] >= 0:
                j = bag_of[k]
                f, b = _bag_fb(j, n_features, batch, layout)
                if want[f]:
                    t = ftable[f]
                    dim = fcols[f + 1] - fcols[f]
                    sc = float32(1.0)
                    if pooling == 1:
                        sc = float32(1.0) / float32(offsets[j + 1] - offsets[j])
                    base = elem_off[t] + rows[k] * strides[t]
                    for d in range(tx, dim, lanes):
                        g = dy[k * dim + d] if pooling == 2 else dy[b * total + fcols[f] + d]
                        part += g * load(w, base + d)
            total_k = lane_sum(sh, ty, tx, part, lanes)
            if tx == 0 and k < n:
                out[k] = sc * total_k

    return psw_grad_kernel


# ---- launch wrappers (allocate nothing) -------------------------------------------------------------
def lanes_items(width: int) -> tuple[int, int, int]:
    """(lanes, items per block, columns per lane) of the lanes kernels for rows of up to `width` elements."""
    lanes = lanes_for(width)
    return lanes, block_rows(lanes), max(1, -(-width // lanes))


def repair_offsets(offsets, n: int, fixed, status, partials) -> None:
    """fixed (F*B + 1,) int64 <- FBGEMM's repaired offsets (clamp, running maximum, last = n); resets the
    bounds-check status (4,) int64."""
    launch_1d(clamp_offsets_kernel, fixed.shape[0], offsets, np.int64(n), fixed, status)
    inclusive_max_scan(fixed, fixed, partials)


def check_indices(indices, offsets, fixed, feature_rows, batch: int, layout: int, mode: int, rows, status,
                  keyed_table, occ, want_occ: bool) -> None:
    """rows (N,) int64 <- the bounds-checked rows; status counts what was wrong (ST_*); want_occ: also occ (N,)
    int64 <- each occurrence's keyed table from keyed_table (F,) int64 (-1: unkeyed feature; -1 outside every
    bag). Without want_occ, pass a small device array of its own for each (never an array passed already: the
    simulator copies every argument back after the launch)."""
    launch_1d(check_indices_kernel, max(fixed.shape[0], 1), indices, offsets, fixed, feature_rows,
              np.int64(batch), np.int64(layout), np.int64(mode), rows, status, keyed_table, occ, bool(want_occ))


def record_bounds(status, indices, offsets, fixed, feature_rows, batch: int, layout: int, rec) -> None:
    """rec += this batch's status (see REC_SIZE); one thread, no host read."""
    launch_1d(record_bounds_kernel, 1, status, indices, offsets, fixed, feature_rows, np.int64(batch),
              np.int64(layout), rec)


def forward(w, elem_off, strides, ftable, fcols, rows, offsets, psw, has_psw: bool, batch: int, layout: int,
            pooling: int, out, w_half: bool, out_half: bool, max_dim: int) -> None:
    """out (flat) <- the lookup (see the module docstring); w / out as float32 or uint16 (float16 bits)."""
    lanes = lanes_items(max_dim)[0]
    launch_lanes(make_forward_kernel(w_half, out_half, int(pooling)), offsets.shape[0] - 1, lanes, w, elem_off,
                 strides, ftable, fcols, rows, offsets, psw, has_psw, np.int64(batch), np.int64(layout),
                 np.int64(pooling), out)


def segment_rows(rows, offsets, ftable, row_off, sentinel: int, batch: int, layout: int, lin, bag_of, perm, flags,
                 pos, seg_start, partials, xp) -> None:
    """Group the occurrences by linear row: lin/bag_of per occurrence, perm the stable sort by lin (the
    array library's: CUB radix sort through CuPy on a GPU, NumPy's in the simulator), seg_start[0..U] the
    runs, U = pos[N] left on the device. sentinel: the total row count (-1 rows sort after every row)."""
    sentinel = np.int64(sentinel)
    launch_1d(linearize_kernel, max(offsets.shape[0] - 1, 1), rows, offsets, ftable, row_off, np.int64(batch),
              np.int64(layout), sentinel, lin, bag_of)
    count_launch()
    perm[...] = xp.argsort(lin, kind="stable") if xp is np else xp.argsort(lin)   # CuPy's is always stable
    launch_1d(segment_flags_kernel, lin.shape[0], lin, perm, sentinel, flags)
    exclusive_scan(flags, pos, partials=partials)
    launch_1d(segment_starts_kernel, lin.shape[0], lin, perm, sentinel, flags, pos, seg_start)


class RowStates(NamedTuple):
    """The optimizer states an update reads and writes, flat as the weights are: sa, sb (per element: a
    kind's first and second state), srow (per row: a rowwise kind's float state), sprev (int64 per row:
    HugeCTR LAZY_GLOBAL's prev step), spit, scnt (per row: prev_iter, row_counter); a small stand-in
    array where the optimizer keeps none."""
    sa: object
    sb: object
    srow: object
    sprev: object
    spit: object
    scnt: object


class Tables(NamedTuple):
    """Where every table lives in the flat buffers (device arrays, int64): elem_off (T + 1,) each table's
    first element, strides (T,) its padded row width, dims (T,) its width, row_off (T + 1,) its first
    linear row, ftable (F,) each feature's table, fcols (F + 1,) each feature's first output column."""
    elem_off: object
    strides: object
    dims: object
    row_off: object
    ftable: object
    fcols: object


class Segments(NamedTuple):
    """segment_rows' result, the occurrences grouped by linear row: lin and bag_of (N,) per occurrence, perm
    the stable sort by lin, pos the run number of each sorted position (U = pos[N], left on the device),
    seg_start (N + 1,) where each run starts."""
    lin: object
    bag_of: object
    perm: object
    pos: object
    seg_start: object


class StepScalars(NamedTuple):
    """A step's scalars in device arrays, written once per step (numbactr.runtime.step_values): ks (N_KS,)
    float32 (kernel_scalars), ki (N_KI,) int64 (kernel_ints), kb (1,) uint64 (rounding_base)."""
    ks: object
    ki: object
    kb: object


def update_rows(w, states: RowStates, tables: Tables, segments: Segments, offsets, psw, has_psw: bool, dy,
                step: StepScalars, grad_rows, grad_vals, w_half: bool, max_dim: int, sr_rows=None,
                kind: int = -1, wd_mode: int = -1) -> None:
    """Every touched row reduced and updated (or, for optimizer NONE, its gradient into grad_rows (N,) /
    grad_vals (N, max_dim)) in one launch sized for N rows; the real count U = pos[N] stays on the device.
    offsets, psw (a stand-in when not has_psw) and dy (flat): the lookup's. sr_rows (R,): the row number
    stochastic rounding hashes for each linear row (None: the linear row itself).

    The step's scalars are device arrays (StepScalars), so a launch's arguments are the same every step
    (what a CUDA graph replays). kind / wd_mode: ki's optimizer kind and weight-decay mode, when the caller
    knows them on the host (a kernel compiled for them: fewer registers); -1 (the default) launches the
    kernel that reads them from ki."""
    lanes, items, per_lane = lanes_items(max_dim)
    kernel = make_update_kernel(w_half, lanes, items, per_lane, int(kind), int(wd_mode))
    sa, sb, srow, sprev, spit, scnt = states
    t = tables
    g = segments
    launch_lanes(kernel, g.perm.shape[0], lanes, w, sa, sb, srow, sprev, spit, scnt,
                 t.elem_off, t.strides, t.dims, t.row_off, t.fcols, g.lin, g.perm, g.seg_start, g.pos, g.bag_of,
                 offsets, psw, has_psw, dy, step.ks, step.ki, step.kb, grad_rows, grad_vals,
                 g.lin if sr_rows is None else sr_rows, sr_rows is not None)


def fused_update(w, sa, sb, srow, sprev, spit, scnt, elem_off, strides, dims, row_off, fcols, lin, perm, seg_start,
                 pos, bag_of, offsets, psw, has_psw: bool, dy, ks, ki, kb, grad_rows, grad_vals, w_half: bool,
                 max_dim: int, sr_rows=None, kind: int = -1, wd_mode: int = -1) -> None:
    """update_rows with every array its own argument (the flat form tutorials/07 launches)."""
    update_rows(w, RowStates(sa, sb, srow, sprev, spit, scnt), Tables(elem_off, strides, dims, row_off, None, fcols),
                Segments(lin, bag_of, perm, pos, seg_start), offsets, psw, has_psw, dy, StepScalars(ks, ki, kb),
                grad_rows, grad_vals, w_half, max_dim, sr_rows, kind, wd_mode)


def global_pass(w, states: RowStates, tables: Tables, total_rows: int, live, step: StepScalars, w_half: bool,
                max_dim: int, sr_rows=None) -> None:
    """HugeCTR's all-rows pass over the first live[t] rows of every table t (states.sa, states.sb; sr_rows and
    step as in update_rows). total_rows = row_off[-1], given by the caller from its host copy: reading it
    from the device array would be a host synchronization every step."""
    t = tables
    launch_lanes(make_global_kernel(w_half), int(total_rows), lanes_items(max_dim)[0], w, states.sa, states.sb,
                 t.elem_off, t.strides, t.dims, t.row_off, live, step.ks, step.ki, step.kb,
                 live if sr_rows is None else sr_rows, sr_rows is not None)


def psw_grad(w, elem_off, strides, ftable, fcols, rows, offsets, bag_of, dy, want, batch: int, layout: int,
             pooling: int, out, w_half: bool, max_dim: int) -> None:
    lanes, items, _ = lanes_items(max_dim)
    launch_lanes(make_psw_grad_kernel(w_half, lanes, items), rows.shape[0], lanes, w, elem_off, strides, ftable,
                 fcols, rows, offsets, bag_of, dy, want, np.int64(batch), np.int64(layout), np.int64(pooling), out)


_F1, _U16, _I1, _F2 = "float32[::1]", "uint16[::1]", "int64[::1]", "float32[:, ::1]"
_KS, _KI, _KB = "float32[::1]", "int64[::1]", "uint64[::1]"        # the step's scalars (device arrays)


def _sig(*types) -> str:
    return f"void({', '.join(types)})"


PTX_CHECKS = [
    (clamp_offsets_kernel, _sig(_I1, "int64", _I1, _I1)),
    (check_indices_kernel, _sig(_I1, _I1, _I1, _I1, "int64", "int64", "int64", _I1, _I1, _I1, _I1, "boolean")),
    (check_indices_kernel, _sig("int32[::1]", "int32[::1]", _I1, _I1, "int64", "int64", "int64", _I1, _I1, _I1, _I1,
                                "boolean")),
    (check_indices_kernel, _sig("uint64[::1]", _I1, _I1, _I1, "int64", "int64", "int64", _I1, _I1, _I1, _I1,
                                "boolean")),
    (record_bounds_kernel, _sig(_I1, _I1, _I1, _I1, _I1, "int64", "int64", _I1)),
    (record_bounds_kernel, _sig(_I1, "int32[::1]", "int32[::1]", _I1, _I1, "int64", "int64", _I1)),
    (record_bounds_kernel, _sig(_I1, "uint64[::1]", _I1, _I1, _I1, "int64", "int64", _I1)),
    (linearize_kernel, _sig(_I1, _I1, _I1, _I1, "int64", "int64", "int64", _I1, _I1)),
    (segment_flags_kernel, _sig(_I1, _I1, "int64", _I1)),
    (segment_starts_kernel, _sig(_I1, _I1, "int64", _I1, _I1, _I1)),
    (gate_scalars_kernel, _sig(_KS, _KI, _I1, _I1, _I1, "float64[::1]")),
] + [
    # the variants forward() launches: one per pooling (compiled for it) and weight / output precision
    (make_forward_kernel(wh, oh, int(pool)), _sig(_U16 if wh else _F1, _I1, _I1, _I1, _I1, _I1, _I1, _F1, "boolean",
                                                  "int64", "int64", "int64", _U16 if oh else _F1))
    for wh in (False, True) for oh in (False, True) for pool in Pooling
] + [
    # the generic update kernel (kind and weight-decay mode read from ki) and the variants compiled for the
    # optimizers HugeCTR's and FBGEMM's models train with most (the engine launches the variant of its kind)
    (make_update_kernel(wh, 32, 8, 4, kind, wd), _sig(_U16 if wh else _F1, _F1, _F1, _F1, _I1, _F1, _F1, _I1, _I1,
                                                      _I1, _I1, _I1, _I1, _I1, _I1, _I1, _I1, _I1, _F1, "boolean",
                                                      _F1, _KS, _KI, _KB, _I1, _F2, _I1, "boolean"))
    for wh, kind, wd in ((False, -1, -1), (True, -1, -1), (False, int(Optim.HUGECTR_SGD), 0),
                         (False, int(Optim.HUGECTR_ADAM), 0), (False, int(Optim.EXACT_ROWWISE_ADAGRAD), 0),
                         (True, int(Optim.EXACT_ROWWISE_ADAGRAD), 0),
                         (False, int(Optim.EXACT_ROWWISE_ADAGRAD), int(WeightDecay.COUNTER)))
] + [
    (make_global_kernel(wh), _sig(_U16 if wh else _F1, _F1, _F1, _I1, _I1, _I1, _I1, _I1, _KS, _KI, _KB, _I1,
                                  "boolean"))
    for wh in (False, True)
] + [
    (make_psw_grad_kernel(False, 32, 8), _sig(_F1, _I1, _I1, _I1, _I1, _I1, _I1, _I1, _F1, "boolean[::1]",
                                              "int64", "int64", "int64", _F1)),
]
