"""Table-batched embedding (TBE): every feature of every table looked up, pooled and updated in one op.

Layout (shapes: T tables, F features, B samples, N occurrences, D width, V rows)
    table t      V_t rows of width D_t; feature f reads table ftable[f] (FBGEMM's feature_table_map)
    indices (N,) one row index per occurrence; offsets (F*B + 1,) CSR: bag j holds indices
                 offsets[j]:offsets[j+1], with j = f*B + b (FEATURE_MAJOR, FBGEMM's order) or
                 j = b*F + f (SAMPLE_MAJOR, HugeCTR's reader: all slots of a sample side by side)
    rows (N,)    the local row of each occurrence in its feature's table after the bounds check;
                 -1 = no row (a key missing in evaluation, a pruned index): contributes 0, gets no update
    L_j          offsets[j+1] - offsets[j], every occurrence counted (-1 rows too: HugeCTR's mean rule)
    s_j          1 / L_j for MEAN pooling with L_j > 0, else 1;   p_k = per_sample_weights[k] (else 1)
    c_f          first output column of feature f: sum of D over the features before it

Forward
    SUM, MEAN   out[b, c_f + d] = s_j * sum_{k in bag j, rows[k] >= 0} p_k W_t[rows[k], d]     (B, sum_f D_f)
    NONE        out[k, d] = p_k W_t[rows[k], d]   (0 where rows[k] = -1)          (N, D): all D_f equal
Backward, dy = dLoss/dout
    occurrence  g_k = s_j p_k dy[b, c_f:c_f + D_f]          (NONE: g_k = p_k dy[k])
    row         G_t[r] = sum of g_k over the occurrences of row r of table t, IN OCCURRENCE ORDER
                (the only order; no float atomics), for every touched row and only those
    weights     dp_k = s_j <dy[b, c_f:c_f + D_f], W_t[rows[k]]>   (NONE: <dy[k], W_t[rows[k]]>)
Update (fused: each touched row is reduced and updated once, no dense (V, D) gradient anywhere)
    g = G_t[r]; t = update step (1, 2, ...)
    EXACT_SGD              w -= lr g
    EXACT_ADAGRAD          m += g^2;  w -= lr g / (sqrt(m) + eps)                          m (V, D)
    EXACT_ROWWISE_ADAGRAD  g' = g + wd w (L2) else g;  m += mean_d(g'^2)                    m (V,)
                           u = lr / (sqrt(m) + eps);  c = 1 - u wd (L2) | 1 - lr wd (DECOUPLE) | 1
                           w = c w - u g
      with COUNTER/COWCLIP the same w = c w - u g, u and c from the row's counter  + prev_iter, row_counter (V,)
                           (tbe_math.counter_row_scalars: FBGEMM's rowwise_adagrad_with_counter)
    ADAM                   m1 = b1 m1 + (1 - b1) g;  m2 = b2 m2 + (1 - b2) g^2          m1, m2 (V, D)
                           w -= lr (m1 / (1 - b1^t) / (sqrt(m2 / (1 - b2^t)) + eps) + wd w)
      rowwise bias correction: t = n, the row's own update count (row_counter (V,) = n)
    PARTIAL_ROWWISE_ADAM   as ADAM with m2 (V,) = b2 m2 + (1 - b2) mean_d(g^2)
    LAMB                   r = m1 / (1 - b1^t) / (sqrt(m2 / (1 - b2^t)) + eps) + wd w  (ADAM's m1, m2)
                           w -= lr (|w| / |r|) r        (|.| the row's L2 norm; ratio 0 when |r| = 0)
    PARTIAL_ROWWISE_LAMB   as LAMB with PARTIAL_ROWWISE_ADAM's m2 (V,)
    LARS_SGD               rate = lr eta |w| / (|g| + wd |w|)  (0 when the denominator is 0)    m (V, D)
                           m = momentum m + rate (g + wd w);  w -= m
    HugeCTR's sparse optimizers, gradient divided by the loss scaler first (kernels/optimizers.py has
    the formulas): HUGECTR_SGD, HUGECTR_MOMENTUM_SGD, HUGECTR_NESTEROV, HUGECTR_ADAM, HUGECTR_ADAGRAD
    with Update_t LOCAL (touched rows), GLOBAL (touched rows, then/before a pass over every row in
    use) and LAZY_GLOBAL (Adam: each row catches up on the steps it skipped; prev step per row (V,)).
    max_norm > 0 (any optimizer): a row whose new L2 norm n exceeds max_norm is scaled by max_norm / n.
    NONE                   no update: the row gradients G are returned (rows sorted by linear row id)
FP16 weights: the update runs in float32 and is rounded back to float16, stochastically by default:
    up (away from zero) with probability (|x| - |lo|) / (|hi| - |lo|) between the two float16
    neighbours lo, hi of x, the random bits a hash of (seed, step, linear row, d, pass), so every device
    and the reference round alike; finite values beyond float16's range saturate to +-65504 (FBGEMM's
    round-toward-zero after adding noise does the same). Without stochastic rounding: round to nearest
    even. FP16 output: rounded to nearest even from the float32 pooled value.
Bounds check (FBGEMM's modes, before anything reads the table):
    offsets: the last offset must be N; every offset is clamped into [0, N] and made non-decreasing
    (running maximum), which is exactly FBGEMM's sequential repair. indices: -1 passes as "no row";
    any other index outside [0, V_t) is
    FATAL    an EmbeddingBoundsError naming the feature, sample, position, index and table size
    WARNING  set to row 0, with one warning per call naming the first offender and the count
    IGNORE   set to row 0 silently
    NONE     not reported (the caller promises valid input); it reads and updates nothing
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
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, float64, int64, uint64

from . import optimizers as OPT
from . import tbe_math as M
from .embedding_init import _splitmix64, _splitmix64_ref
from .launch import block_rows, count_launch, launch_1d, launch_lanes, lanes_for
from .scan import exclusive_scan, inclusive_max_scan
from .tbe_math import (BoundsCheck, CounterWeightDecay, Layout, Optim, Pooling, Precision, UpdateType,  # noqa: F401
                       WeightDecay)


# the engine's enums live in the lowest layer, tbe_math (numbactr.embedding.engine re-exports them)
HUGECTR_KINDS = frozenset({Optim.HUGECTR_SGD, Optim.HUGECTR_MOMENTUM_SGD, Optim.HUGECTR_NESTEROV,
                           Optim.HUGECTR_ADAM, Optim.HUGECTR_ADAGRAD})

#: optimizer state arrays per kind, in the order split_optimizer_states returns them (FBGEMM's order for
#: FBGEMM's kinds, HugeCTR's file order for HugeCTR's): (name, per_row, dtype). LAZY_GLOBAL Adam adds
#: ("prev_step", True, int64) after m and v.
STATES = {
    Optim.NONE: (), Optim.EXACT_SGD: (), Optim.HUGECTR_SGD: (),
    Optim.EXACT_ADAGRAD: (("momentum1", False, np.float32),),
    Optim.EXACT_ROWWISE_ADAGRAD: (("momentum1", True, np.float32),),
    Optim.ADAM: (("momentum1", False, np.float32), ("momentum2", False, np.float32)),
    Optim.LAMB: (("momentum1", False, np.float32), ("momentum2", False, np.float32)),
    Optim.PARTIAL_ROWWISE_ADAM: (("momentum1", False, np.float32), ("momentum2", True, np.float32)),
    Optim.PARTIAL_ROWWISE_LAMB: (("momentum1", False, np.float32), ("momentum2", True, np.float32)),
    Optim.HUGECTR_MOMENTUM_SGD: (("momentum", False, np.float32),),
    Optim.HUGECTR_NESTEROV: (("accum", False, np.float32),),
    Optim.HUGECTR_ADAM: (("m", False, np.float32), ("v", False, np.float32)),
    Optim.HUGECTR_ADAGRAD: (("accum", False, np.float32),),
    Optim.LARS_SGD: (("momentum1", False, np.float32),),
}
LAZY_PREV_STEP = ("prev_step", True, np.int64)
#: EXACT_ROWWISE_ADAGRAD with WeightDecay.COUNTER / COWCLIP adds these after momentum1 (FBGEMM's order and
#: dtypes); ADAM with rowwise bias correction adds ROW_COUNTER after its moments
PREV_ITER = ("prev_iter", True, np.float32)
ROW_COUNTER = ("row_counter", True, np.float32)


@dataclass(frozen=True)
class CounterRegularization:
    """The settings of WeightDecay.COUNTER / COWCLIP (FBGEMM's CounterBasedRegularizationDefinition and
    CowClipDefinition, flattened; tbe_math.counter_row_scalars has the rules). max_counter_update_freq > 0:
    at every step t that is a multiple of it, max_counter becomes 1 + the largest row counter of every
    table (before the step's update); it starts at 1."""
    weight_decay_mode: CounterWeightDecay = CounterWeightDecay.NONE
    halflife: int = -1
    adjustment_iter: int = -1
    adjustment_ub: float = 1.0
    learning_rate_mode: int = -1             # FBGEMM's LearningRateMode: -1 EQUAL, 0 increase, 1 decrease, 2 SGD
    tail_id_threshold: float = 0.0
    tail_id_threshold_is_ratio: bool = False
    max_counter_update_freq: int = 1000
    weight_norm_coefficient: float = 0.0     # COWCLIP
    lower_bound: float = 0.0                 # COWCLIP

    def uses_max_counter(self) -> bool:
        """Whether max_counter can change an update (tail-id learning-rate modes, a ratio threshold)."""
        return self.learning_rate_mode in (0, 1) or (self.learning_rate_mode >= 0 and self.tail_id_threshold_is_ratio)


class EmbeddingBoundsError(IndexError):
    """An index outside its table, or offsets that do not describe N occurrences (bounds_check FATAL)."""


# ---- hyper-parameters ------------------------------------------------------------------------------
#: float hyper-parameters in the order the kernels receive them (one float32 array, HP_*)
HP_FIELDS = ("learning_rate", "eps", "beta1", "beta2", "weight_decay", "momentum", "max_norm", "scaler", "eta")


def kernel_scalars(hp: dict, step: int, counter: CounterRegularization | None = None, max_counter: float = 1.0,
                   refresh: bool = False) -> np.ndarray:
    """The packed float32 scalars (tbe_math.KS_*) of the compiled paths for hyper-parameters hp at step t
    (counter: the COUNTER / COWCLIP settings, max_counter this step's value, refresh whether it is renewed
    at this step)."""
    ks = np.zeros(M.N_KS, np.float32)
    if counter is not None:
        ks[M.KS_CNT_UB], ks[M.KS_CNT_TAIL] = counter.adjustment_ub, counter.tail_id_threshold
        ks[M.KS_CNT_WNC], ks[M.KS_CNT_LB] = counter.weight_norm_coefficient, counter.lower_bound
    ks[M.KS_MAXC], ks[M.KS_REFRESH] = max_counter, float(refresh)
    for name, at in (("learning_rate", M.KS_LR), ("eps", M.KS_EPS), ("beta1", M.KS_B1), ("beta2", M.KS_B2),
                     ("weight_decay", M.KS_WD), ("momentum", M.KS_MOM), ("max_norm", M.KS_MAXN),
                     ("scaler", M.KS_SCALER)):
        ks[at] = hp[name]
    ks[M.KS_ETA] = hp.get("eta", 0.001)                 # LARS_SGD's only (OptimizerSpec's default)
    b1, b2 = _f32(hp["beta1"]), _f32(hp["beta2"])
    ks[M.KS_BC1], ks[M.KS_BC2] = 1.0 - b1 ** step, 1.0 - b2 ** step
    if b1 != 1.0:
        ks[M.KS_ALPHA] = OPT.adam_alpha_t(hp["learning_rate"], hp["beta1"], hp["beta2"], step)
        ks[M.KS_LAZY] = OPT.lazy_adam_alpha_common(hp["learning_rate"], hp["beta1"])
    return ks


def kernel_ints(kind, update, wd_mode, step: int, stochastic: bool, pooling, layout, batch: int,
                counter: CounterRegularization | None = None, rowwise_bias_correction: bool = False) -> np.ndarray:
    """The packed int64 parameters (tbe_math.KI_*) of the compiled paths."""
    ki = np.zeros(M.N_KI, np.int64)
    if counter is not None:
        ki[M.KI_CNT_WD], ki[M.KI_CNT_HALF] = int(counter.weight_decay_mode), counter.halflife
        ki[M.KI_CNT_ADJ], ki[M.KI_CNT_LRM] = counter.adjustment_iter, int(counter.learning_rate_mode)
        ki[M.KI_CNT_RATIO] = bool(counter.tail_id_threshold_is_ratio)
    ki[M.KI_RBC] = bool(rowwise_bias_correction)
    ki[M.KI_KIND], ki[M.KI_UPDATE], ki[M.KI_WD_MODE] = int(kind), int(update), int(wd_mode)
    ki[M.KI_STEP], ki[M.KI_SR], ki[M.KI_POOLING], ki[M.KI_LAYOUT] = step, stochastic, int(pooling), int(layout)
    ki[M.KI_BATCH] = batch
    ki[M.KI_GO] = 1
    return ki


def _f32(x) -> float:
    """x rounded to float32, returned as a Python float: the value a float32 kernel argument holds."""
    return float(np.float32(x))


# ---- FP16 rounding (reference) ----------------------------------------------------------------------
SR_PASS_HOT, SR_PASS_ALL = 0, 1         # the update of touched rows / HugeCTR's all-rows pass


def rounding_bits_ref(seed: int, step: int, lin_rows: np.ndarray, width: int, pass_id: int) -> np.ndarray:
    """(U, width) uint32 random bits of each element: the top 32 bits of
    splitmix64((lin_row << 16 | d) ^ rounding_base(seed, step, pass))."""
    key = (np.asarray(lin_rows, np.uint64)[:, None] << np.uint64(16)) | np.arange(width, dtype=np.uint64)
    h = _splitmix64_ref(key ^ rounding_base(seed, step, pass_id))
    return (h >> np.uint64(32)).astype(np.uint32)


def rounding_base(seed: int, step: int, pass_id: int) -> np.uint64:
    """The per-launch uint64 salt of stochastic rounding: splitmix64(seed + golden (2 step + pass))."""
    salt = (np.asarray([seed], np.uint64) + np.asarray([0x9E3779B97F4A7C15], np.uint64)
            * np.asarray([2 * int(step) + int(pass_id)], np.uint64))          # array arithmetic wraps
    return _splitmix64_ref(salt)[0]


def to_half_ref(x: np.ndarray, bits: np.ndarray | None) -> np.ndarray:
    """float16 of x (float32 values): stochastic with the uint32 `bits` (same shape), else nearest even."""
    x = np.asarray(x, np.float32)
    if bits is None:
        with np.errstate(over="ignore"):
            return x.astype(np.float16)
    a = np.abs(x).astype(np.float64)
    lo = np.abs(x).astype(np.float16)                      # nearest even: lo may lie above |x|
    with np.errstate(over="ignore", invalid="ignore"):
        lo = np.where(lo.astype(np.float64) > a, np.nextafter(lo, np.float16(0)), lo)   # toward zero
        hi = np.nextafter(lo, np.float16(np.inf))
        span = hi.astype(np.float64) - lo.astype(np.float64)
        frac = np.where(np.isfinite(span) & (span > 0), (a - lo.astype(np.float64)) / span, 0.0)
    u = (np.asarray(bits, np.uint32) >> np.uint32(8)).astype(np.float64) * 2.0 ** -24
    up = (u < frac) & np.isfinite(hi.astype(np.float64))   # never rounds up to infinity: saturates
    mag = np.where(up, hi, lo)
    mag = np.where(np.isnan(x), np.float16(np.nan), mag)
    mag = np.where(np.isinf(x), np.float16(np.inf), mag)
    return np.where(np.signbit(x), -mag, mag).astype(np.float16)


# ---- layout and bounds check (reference) ------------------------------------------------------------
def bag_feature_sample_ref(n_features: int, batch: int, layout: int) -> tuple[np.ndarray, np.ndarray]:
    """(feature (F*B,), sample (F*B,)) of every bag j."""
    j = np.arange(n_features * batch, dtype=np.int64)
    if layout == Layout.FEATURE_MAJOR:
        return j // max(batch, 1), j % max(batch, 1)
    return j % max(n_features, 1), j // max(n_features, 1)


def check_offsets_ref(offsets: np.ndarray, n_indices: int, mode: int) -> tuple[np.ndarray, int]:
    """(offsets (F*B + 1,) int64, number of offsets repaired): every offset clamped into [0, N], made
    non-decreasing (running maximum) and the last set to N. FATAL raises EmbeddingBoundsError instead."""
    off = np.asarray(offsets).astype(np.int64).reshape(-1)
    fixed = np.maximum.accumulate(np.clip(off, 0, n_indices)) if off.size else off.copy()
    fixed[-1:] = n_indices
    bad = np.flatnonzero(fixed != off)
    if bad.size and mode == BoundsCheck.FATAL:
        raise EmbeddingBoundsError(offsets_message(int(bad[0]), int(off[bad[0]]), n_indices, off.size - 1))
    return fixed, int(bad.size)


def offsets_message(j: int, value: int, n_indices: int, n_bags: int) -> str:
    """The FATAL error text for offsets[j] = value (the first offset that needed repair)."""
    return (f"offsets[{j}] = {value} breaks the CSR layout of {n_indices} indices in {n_bags} bags (offsets "
            f"must start >= 0, never decrease and end at {n_indices}) (bounds_check FATAL)")


def check_indices_ref(indices: np.ndarray, offsets: np.ndarray, feature_rows: np.ndarray, batch: int,
                      layout: int, mode: int) -> tuple[np.ndarray, int, tuple | None]:
    """(rows (N,) int64, count of bad indices, first bad (position, feature, sample, index, rows) or None).

    offsets: repaired by check_offsets_ref; feature_rows (F,): the row count of each feature's table
    (-1: not checked, the indices are keys of a keyed table).
    An index outside [0, rows) other than -1 is FATAL: EmbeddingBoundsError; WARNING, IGNORE: row 0;
    NONE: -1 (reads and updates nothing). Positions outside every bag get -1.
    """
    idx = np.asarray(indices).astype(np.int64).reshape(-1)       # uint64 keys wrap: they are not checked
    bag, feat, samp = _occurrences(offsets, len(feature_rows), batch, layout)
    inside = bag >= 0
    limit = np.where(inside, np.asarray(feature_rows, np.int64)[np.maximum(feat, 0)], 0)
    bad = inside & (limit >= 0) & (idx != -1) & ((idx < 0) | (idx >= limit))
    rows = np.where(inside, idx, -1)
    count = int(bad.sum())
    first = None
    if count:
        k = int(np.flatnonzero(bad)[0])
        first = (k, int(feat[k]), int(samp[k]), int(idx[k]), int(limit[k]))
        if mode == BoundsCheck.FATAL:
            raise EmbeddingBoundsError(bounds_message(first, count, mode))
        rows[bad] = -1 if mode == BoundsCheck.NONE else 0
    return rows, count, first


def bounds_message(first, count: int, mode: int) -> str:
    """The error / warning text for `count` bad indices whose first is `first` (see bounds_check_ref)."""
    pos, f, b, value, rows = first
    fix = {BoundsCheck.FATAL: "", BoundsCheck.WARNING: "; set to row 0"}.get(BoundsCheck(mode), "")
    more = f" ({count - 1} more in this batch)" if count > 1 else ""
    return (f"index {value} at position {pos} (feature {f}, sample {b}) is outside its table of {rows} rows"
            f"{fix}{more} (bounds_check {BoundsCheck(mode).name})")


# ---- forward / backward (reference) -----------------------------------------------------------------
def _bag_scale(offsets: np.ndarray, pooling: int) -> np.ndarray:
    lens = np.diff(offsets).astype(np.float64)
    if pooling == Pooling.MEAN:
        return np.where(lens > 0, 1.0 / np.maximum(lens, 1.0), 1.0)
    return np.ones(lens.shape, np.float64)


def _occurrences(offsets, n_features, batch, layout):
    """(bag (N,), feature (N,), sample (N,)) of every occurrence; -1 for positions outside every bag.

    offsets must be repaired (check_offsets_ref): non-decreasing, last = N."""
    offsets = np.asarray(offsets, np.int64)
    n = int(offsets[-1]) if offsets.size else 0
    bag = np.full(n, -1, np.int64)
    if offsets.size > 1:
        bag[offsets[0]:] = np.repeat(np.arange(offsets.size - 1, dtype=np.int64), np.diff(offsets))
    feat, samp = bag_feature_sample_ref(n_features, batch, layout)
    inside = bag >= 0
    f = np.full(n, -1, np.int64)
    b = np.full(n, -1, np.int64)
    f[inside], b[inside] = feat[bag[inside]], samp[bag[inside]]
    return bag, f, b


def _weights(per_sample_weights, n):
    return np.ones(n) if per_sample_weights is None else np.asarray(per_sample_weights, np.float64)


def tbe_forward_ref(tables: list, feature_table_map, rows: np.ndarray, offsets: np.ndarray, batch: int,
                    pooling: int, layout: int, per_sample_weights=None) -> np.ndarray:
    """Pooled (B, sum D_f) or, for Pooling.NONE, per-occurrence (N, D) output, in float64.

    tables: one (V_t, D_t) array per table; rows (N,) int64 from check_indices_ref (-1 = no row);
    offsets repaired by check_offsets_ref.
    """
    ftable = np.asarray(feature_table_map, np.int64)
    dims = [tables[t].shape[1] for t in ftable]
    rows = np.asarray(rows, np.int64)
    bag, feat, samp = _occurrences(offsets, ftable.size, batch, layout)
    p = _weights(per_sample_weights, rows.shape[0])
    live = (bag >= 0) & (rows >= 0)
    if pooling == Pooling.NONE:
        out = np.zeros((rows.shape[0], dims[0] if dims else 0))
        for f in range(ftable.size):
            k = np.flatnonzero(live & (feat == f))
            out[k] = p[k, None] * np.asarray(tables[ftable[f]], np.float64)[rows[k]]
        return out
    cols = np.concatenate([[0], np.cumsum(dims)]).astype(np.int64)
    out = np.zeros((batch, int(cols[-1])))
    scale = _bag_scale(np.asarray(offsets, np.int64), pooling)
    for f in range(ftable.size):
        k = np.flatnonzero(live & (feat == f))
        vals = (scale[bag[k]] * p[k])[:, None] * np.asarray(tables[ftable[f]], np.float64)[rows[k]]
        block = np.zeros((batch, dims[f]))
        np.add.at(block, samp[k], vals)                  # in occurrence order
        out[:, cols[f]:cols[f + 1]] = block
    return out


def occurrence_grads_ref(dims_of_features, rows, offsets, batch, pooling, layout, dy, per_sample_weights=None):
    """(feature (N,), g (N, max D)) per occurrence: g_k = s_j p_k dy[b, c_f:c_f + D_f], zero padded;
    feature -1 (and g = 0) outside every bag."""
    dims = np.asarray(dims_of_features, np.int64)
    rows = np.asarray(rows, np.int64)
    bag, feat, samp = _occurrences(offsets, dims.size, batch, layout)
    p = _weights(per_sample_weights, rows.shape[0])
    dy = np.asarray(dy, np.float64)
    g = np.zeros((rows.shape[0], int(dims.max()) if dims.size else 0))
    cols = np.concatenate([[0], np.cumsum(dims)]).astype(np.int64)
    scale = _bag_scale(np.asarray(offsets, np.int64), pooling)
    for f in range(dims.size):
        k = np.flatnonzero(feat == f)
        if pooling == Pooling.NONE:
            g[k, :dims[f]] = p[k, None] * dy[k]
        else:
            g[k, :dims[f]] = (scale[bag[k]] * p[k])[:, None] * dy[samp[k], cols[f]:cols[f + 1]]
    return feat, g


def tbe_backward_ref(dims_of_tables, feature_table_map, rows, offsets, batch, pooling, layout, dy,
                     per_sample_weights=None) -> list:
    """Row gradients per table: a list of (rows (U_t,) int64 ascending, G (U_t, D_t) float64).

    Occurrences of the same row are summed in occurrence order; rows[k] = -1 contribute nothing.
    """
    ftable = np.asarray(feature_table_map, np.int64)
    dims = np.asarray(dims_of_tables, np.int64)
    feat, g = occurrence_grads_ref(dims[ftable], rows, offsets, batch, pooling, layout, dy, per_sample_weights)
    rows = np.asarray(rows, np.int64)
    table = np.where(feat >= 0, ftable[np.maximum(feat, 0)] if ftable.size else -1, -1)
    out = []
    for t in range(dims.size):
        k = np.flatnonzero((table == t) & (rows >= 0))
        uniq, where = np.unique(rows[k], return_inverse=True)
        grads = np.zeros((uniq.size, int(dims[t])))
        if k.size:                                       # (a table no feature reads has none)
            np.add.at(grads, where.reshape(-1), g[k, :dims[t]])    # in occurrence order
        out.append((uniq.astype(np.int64), grads))
    return out


def per_sample_weights_grad_ref(tables, feature_table_map, rows, offsets, batch, pooling, layout, dy,
                                feature_requires_grad=None) -> np.ndarray:
    """(N,) float64: dp_k = <g_k with p_k = 1, W_t[rows[k]]>; 0 for features not requiring grad."""
    ftable = np.asarray(feature_table_map, np.int64)
    dims = [tables[t].shape[1] for t in ftable]
    feat, g = occurrence_grads_ref(dims, rows, offsets, batch, pooling, layout, dy)
    rows = np.asarray(rows, np.int64)
    out = np.zeros(rows.shape[0])
    for f in range(ftable.size):
        if feature_requires_grad is not None and not feature_requires_grad[f]:
            continue
        k = np.flatnonzero((feat == f) & (rows >= 0))
        w = np.asarray(tables[ftable[f]], np.float64)[rows[k]]
        out[k] = np.sum(g[k, :dims[f]] * w, axis=1)
    return out


# ---- optimizer row updates (reference) --------------------------------------------------------------
def _row_norm(x):
    return np.sqrt(np.sum(x * x, axis=1, keepdims=True))


def counter_update_ref(mode: int, c: CounterRegularization, hp: dict, w, g, states: list, step: int,
                       max_counter: float):
    """FBGEMM's rowwise AdaGrad with a counter (WeightDecay.COUNTER / COWCLIP) on U touched rows, float64:
    new (w, [momentum1, prev_iter, row_counter]); tbe_math.counter_row_scalars has the rules."""
    lr, eps, wd = hp["learning_rate"], hp["eps"], hp["weight_decay"]
    m, prev, cnt = (np.array(x, np.float64) for x in states)
    width = max(w.shape[1], 1)
    half, cwd = c.halflife, CounterWeightDecay(c.weight_decay_mode)
    tail = math.floor(_f32(c.tail_id_threshold) * max_counter) if c.tail_id_threshold_is_ratio \
        else _f32(c.tail_id_threshold)
    delta = np.where(prev == 0, 1.0, step - prev)
    if half > 0:
        cnt = 1.0 + np.exp(-delta * math.log(2.0) / half) * cnt
    elif half == 0:
        cnt = np.ones_like(cnt)
    else:
        cnt = cnt + 1.0
    freq = half / cnt
    gd = g + wd * w if cwd == CounterWeightDecay.L2 else g
    gsq = np.sum(gd * gd, axis=1)
    m = m + gsq / width
    mult = lr / (np.sqrt(m) + eps)
    on = c.adjustment_iter <= 0 or step > c.adjustment_iter
    u, corr = mult.copy(), np.ones_like(mult)
    ub = _f32(c.adjustment_ub)
    if mode == WeightDecay.COUNTER:
        if c.learning_rate_mode >= 0 and on:
            adj = {0: lambda: mult * np.clip((max_counter / (cnt + 1.0)) ** ub, 1.0, 10.0),
                   1: lambda: mult * np.clip(((cnt + 1.0) / max_counter) ** ub, 0.1, 1.0),
                   2: lambda: lr / (np.sqrt(ub * cnt) + eps)}.get(int(c.learning_rate_mode))
            if adj is not None:
                u = np.where(cnt > tail, adj(), u)
        if on:
            if cwd == CounterWeightDecay.ADAGRADW:
                if half == -1:
                    u = mult * np.sqrt(cnt)
                elif half == -2:
                    u = np.minimum(lr * cnt, ub) / (np.sqrt(m) + eps)
                lazy = (1.0 - wd * lr) ** (np.minimum(delta, step - c.adjustment_iter) - 1.0)
                u, corr = u * lazy, (1.0 - wd * lr) * lazy
            elif cwd == CounterWeightDecay.DECOUPLE:
                corr = 1.0 - freq * wd * lr
            elif cwd == CounterWeightDecay.L2:
                corr = 1.0 - freq * wd * mult
    else:                                                   # COWCLIP
        clip = cnt * np.maximum(_f32(c.weight_norm_coefficient) * np.sqrt(np.sum(w * w, axis=1)),
                                _f32(c.lower_bound))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(gsq > 0, np.minimum(1.0, clip / np.sqrt(gsq)), 1.0)
        u = ratio * mult
        if cwd == CounterWeightDecay.DECOUPLE:
            corr = 1.0 - wd * lr
        elif cwd == CounterWeightDecay.L2:
            corr = 1.0 - wd * u
    corr = np.broadcast_to(np.asarray(corr, np.float64), u.shape)
    w = corr[:, None] * w - u[:, None] * g
    return w, [m, np.full_like(m, float(step)), cnt]


def optimizer_update_ref(kind: int, hp: dict, w, g, states: list, step: int, update_type: int = 0,
                         weight_decay_mode: int = 0, counter: CounterRegularization | None = None,
                         max_counter: float = 1.0, rowwise_bias_correction: bool = False):
    """New (w (U, D), [states]) in float64 for U touched rows with summed gradients g (U, D).

    w, g and per-element states are (U, D); per-row states (U,). hp: the HP_FIELDS values (rounded to
    float32 first, the values the kernels receive). `step` is this update's t (>= 1). For HugeCTR's
    GLOBAL kinds this is the touched-row part only; global_pass_ref is the all-rows pass (the engine
    runs them in HugeCTR's order). max_norm is applied here. weight_decay_mode COUNTER / COWCLIP take
    `counter` and this step's max_counter (states: momentum1, prev_iter, row_counter);
    rowwise_bias_correction (ADAM): t is each row's own update count, its row_counter (the third state) + 1.
    """
    h = {k: _f32(v) for k, v in hp.items()}
    lr, eps, b1, b2, wd = h["learning_rate"], h["eps"], h["beta1"], h["beta2"], h["weight_decay"]
    w = np.array(w, np.float64)
    g = np.array(g, np.float64)
    s = [np.array(x, np.float64) for x in states]
    kind = Optim(kind)
    width = max(w.shape[1], 1)
    if kind == Optim.EXACT_SGD:
        w = w - lr * g
    elif kind == Optim.EXACT_ADAGRAD:
        s[0] = s[0] + g * g
        w = w - lr * g / (np.sqrt(s[0]) + eps)
    elif kind == Optim.EXACT_ROWWISE_ADAGRAD and weight_decay_mode in (WeightDecay.COUNTER, WeightDecay.COWCLIP):
        w, s = counter_update_ref(weight_decay_mode, counter, h, w, g, s, step, max_counter)
    elif kind == Optim.EXACT_ROWWISE_ADAGRAD:
        gd = g + wd * w if weight_decay_mode == WeightDecay.L2 else g
        s[0] = s[0] + np.sum(gd * gd, axis=1) / width
        u = (lr / (np.sqrt(s[0]) + eps))[:, None]
        c = {WeightDecay.L2: 1.0 - u * wd, WeightDecay.DECOUPLE: 1.0 - lr * wd}.get(
            WeightDecay(weight_decay_mode), 1.0)
        w = c * w - u * g
    elif kind in (Optim.ADAM, Optim.PARTIAL_ROWWISE_ADAM, Optim.LAMB, Optim.PARTIAL_ROWWISE_LAMB):
        bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
        if rowwise_bias_correction:
            s[2] = s[2] + 1.0
            bc1, bc2 = (1.0 - b1 ** s[2])[:, None], (1.0 - b2 ** s[2])[:, None]
        s[0] = b1 * s[0] + (1.0 - b1) * g
        if kind in (Optim.ADAM, Optim.LAMB):
            s[1] = b2 * s[1] + (1.0 - b2) * g * g
            v = s[1]
        else:
            s[1] = b2 * s[1] + (1.0 - b2) * np.sum(g * g, axis=1) / width
            v = s[1][:, None]
        r = s[0] / bc1 / (np.sqrt(v / bc2) + eps) + wd * w
        if kind in (Optim.ADAM, Optim.PARTIAL_ROWWISE_ADAM):
            w = w - lr * r
        else:
            wn, rn = _row_norm(w), _row_norm(r)
            ratio = np.where(rn > 0, wn / np.where(rn > 0, rn, 1.0), 0.0)
            w = w - lr * ratio * r
    elif kind == Optim.LARS_SGD:
        wn, gn = _row_norm(w), _row_norm(g)
        den = gn + wd * wn
        rate = np.where(den > 0, lr * h["eta"] * wn / np.where(den > 0, den, 1.0), 0.0)        # (U, 1)
        s[0] = h["momentum"] * s[0] + rate * (g + wd * w)
        w = w - s[0]
    elif kind in HUGECTR_KINDS:
        w, s = _hugectr_hot_ref(kind, h, w, g, s, step, UpdateType(update_type))
    else:
        raise ValueError(f"optimizer {kind.name} has no row update (NONE returns the gradient)")
    if h["max_norm"] > 0:
        n = _row_norm(w)
        w = np.where(n > h["max_norm"], w * (h["max_norm"] / np.where(n > 0, n, 1.0)), w)
    return w, s


def _hugectr_hot_ref(kind, h, w, g, s, step, update):
    """HugeCTR's touched-row rule through kernels/optimizers.py's references (float64 in and out)."""
    lr, sc, f = h["learning_rate"], h["scaler"], h["momentum"]
    if kind == Optim.HUGECTR_SGD:
        return OPT.sgd_update_ref(w, g, lr, sc), s
    if kind == Optim.HUGECTR_ADAGRAD:
        w, a = OPT.adagrad_update_ref(w, s[0], g, lr, h["eps"], sc)
        return w, [a]
    if kind == Optim.HUGECTR_MOMENTUM_SGD:
        if update == UpdateType.GLOBAL and f != 0:
            return w, [OPT.sparse_momentum_sgd_global_hot_ref(s[0], np.arange(len(w)), g, lr, f, sc)]
        # LOCAL; and GLOBAL with f = 0, whose all-rows pass zeroed m first (numbactr.optim's docstring)
        w, m = OPT.momentum_sgd_update_ref(w, s[0], g, lr, f, sc)
        return w, [m]
    if kind == Optim.HUGECTR_NESTEROV:
        if update == UpdateType.GLOBAL:
            w, a = OPT.sparse_nesterov_global_hot_ref(w, s[0], np.arange(len(w)), g, lr, f, sc)
        else:
            w, a = OPT.nesterov_update_ref(w, s[0], g, lr, f, sc)
        return w, [a]
    b1, b2, eps = h["beta1"], h["beta2"], h["eps"]
    if update == UpdateType.GLOBAL:
        m, v = OPT.sparse_adam_global_hot_ref(s[0], s[1], np.arange(len(w)), g, b1, b2, sc)
        return w, [m, v]
    if update == UpdateType.LAZY_GLOBAL:
        prev = np.repeat(np.asarray(s[2], np.int64)[:, None], w.shape[1], axis=1)
        w, m, v, _ = OPT.adam_lazy_update_ref(w, s[0], s[1], prev, g, lr, b1, b2, eps, step, sc)
        return w, [m, v, np.full(len(w), step, np.float64)]
    w, m, v = OPT.adam_update_ref(w, s[0], s[1], g, lr, b1, b2, eps, step, sc)
    return w, [m, v]


def global_pass_ref(kind: int, hp: dict, w, states: list, step: int):
    """HugeCTR's all-rows pass of a GLOBAL update over the rows in use (V, D): new (w, states), float64.

    Adam: m *= b1; v *= b2; w -= alpha_t m / (sqrt(v) + eps).  MomentumSGD: m *= f; w += m.
    Nesterov: a *= mu; w += mu a.  SGD and AdaGrad have none (their Global is their Local).
    """
    h = {k: _f32(v) for k, v in hp.items()}
    w = np.array(w, np.float64)
    s = [np.array(x, np.float64) for x in states]
    n = w.shape[0]
    if kind == Optim.HUGECTR_ADAM:
        w, m, v = OPT.sparse_adam_global_all_ref(w, s[0], s[1], n, h["learning_rate"], h["beta1"],
                                                 h["beta2"], h["eps"], step)
        return w, [m, v]
    if kind == Optim.HUGECTR_MOMENTUM_SGD:
        w, m = OPT.sparse_momentum_sgd_global_all_ref(w, s[0], n, h["momentum"])
        return w, [m]
    if kind == Optim.HUGECTR_NESTEROV:
        w, a = OPT.sparse_nesterov_global_all_ref(w, s[0], n, h["momentum"])
        return w, [a]
    return w, s


def global_pass_first(kind: int, hp: dict) -> bool:
    """True when HugeCTR runs the all-rows pass BEFORE the touched rows (Nesterov; MomentumSGD with
    momentum 0, where numbactr zeroes m first instead of dividing by 0)."""
    return kind == Optim.HUGECTR_NESTEROV or (kind == Optim.HUGECTR_MOMENTUM_SGD and hp["momentum"] == 0)


def has_global_pass(kind: int, update_type: int) -> bool:
    return update_type == UpdateType.GLOBAL and kind in (Optim.HUGECTR_ADAM, Optim.HUGECTR_MOMENTUM_SGD,
                                                         Optim.HUGECTR_NESTEROV)



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
    the other poolings' code and its registers (fp32 rows and output: 86 -> 71-76 on sm_90); -1 reads the
    pooling argument."""
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
    with them their registers (one body for every optimizer needs the largest rule's: 94 registers, 25%
    occupancy at 256 threads on sm_90; ptx_check's report gives each variant's). -1 reads them from ki."""
    load = _load16 if w_half else _load32
    store = _store16 if w_half else _store32
    KIND, WD_MODE = int(kind_const), int(wd_mode_const)

    @_device
    def lane_sum(sh, ty, tx, v):
        cuda.syncthreads()
        sh[ty, tx] = v
        cuda.syncthreads()
        step = lanes // 2
        while step > 0:
            if tx < step:
                sh[ty, tx] += sh[ty, tx + step]
            cuda.syncthreads()
            step //= 2
        return sh[ty, 0]

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
                gsum = lane_sum(sh, ty, tx, gpart)
                wsum = lane_sum(sh, ty, tx, wpart)
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
                sumsq = lane_sum(sh, ty, tx, part)
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
                ratio = lamb_ratio(lane_sum(sh, ty, tx, wpart), lane_sum(sh, ty, tx, rpart))
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
                scale = max_norm_scale(lane_sum(sh, ty, tx, npart), ks[M.KS_MAXN])
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
            cuda.syncthreads()
            sh[ty, tx] = part
            cuda.syncthreads()
            step = lanes // 2
            while step > 0:
                if tx < step:
                    sh[ty, tx] += sh[ty, tx + step]
                cuda.syncthreads()
                step //= 2
            if tx == 0 and k < n:
                out[k] = sc * sh[ty, 0]

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


def fused_update(w, sa, sb, srow, sprev, spit, scnt, elem_off, strides, dims, row_off, fcols, lin, perm, seg_start,
                 pos, bag_of, offsets, psw, has_psw: bool, dy, ks, ki, kb, grad_rows, grad_vals, w_half: bool,
                 max_dim: int, sr_rows=None, kind: int = -1, wd_mode: int = -1) -> None:
    """Every touched row reduced and updated (or, for optimizer NONE, its gradient into grad_rows /
    grad_vals) in one launch sized for N rows; the real count U = pos[N] stays on the device. sr_rows (R,):
    the row number stochastic rounding hashes for each linear row (None: the linear row itself). srow, sprev,
    spit, scnt: the per-row states (the rowwise kinds' float state, HugeCTR's prev step, prev_iter and
    row_counter; a stand-in array where the optimizer keeps none).

    The step's scalars are device arrays: ks (N_KS,) float32 (kernel_scalars), ki (N_KI,) int64
    (kernel_ints) and kb (1,) uint64 (rounding_base), uploaded once per step (numbactr.runtime.step_values), so a
    launch's arguments are the same every step (what a CUDA graph replays). kind / wd_mode: ki's optimizer
    kind and weight-decay mode, when the caller knows them on the host (a kernel compiled for them: fewer
    registers); -1 (the default) launches the kernel that reads them from ki."""
    lanes, items, per_lane = lanes_items(max_dim)
    kernel = make_update_kernel(w_half, lanes, items, per_lane, int(kind), int(wd_mode))
    launch_lanes(kernel, perm.shape[0], lanes, w, sa, sb, srow,
                 sprev, spit, scnt, elem_off, strides, dims, row_off, fcols, lin, perm, seg_start, pos, bag_of,
                 offsets, psw, has_psw, dy, ks, ki, kb, grad_rows, grad_vals, lin if sr_rows is None else sr_rows,
                 sr_rows is not None)


def global_pass(w, sa, sb, elem_off, strides, dims, row_off, total_rows: int, live, ks, ki, kb, w_half: bool,
                max_dim: int, sr_rows=None) -> None:
    """HugeCTR's all-rows pass (sr_rows, ks, ki and kb as in fused_update). total_rows = row_off[-1], given by the caller
    from its host copy: reading it from the device array would be a host synchronization every step."""
    launch_lanes(make_global_kernel(w_half), int(total_rows), lanes_items(max_dim)[0], w, sa, sb, elem_off,
                 strides, dims, row_off, live, ks, ki, kb, live if sr_rows is None else sr_rows,
                 sr_rows is not None)


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
