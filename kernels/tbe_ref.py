"""Table-batched embedding (TBE), the NumPy reference: the contract and the oracle of every device.

Every feature of every table looked up, pooled and updated in one op. This module says what that op computes,
in float64 NumPy a reader can check line by line; the numba.cuda kernels (kernels/tbe.py) and the compiled
CPU code (kernels/tbe_cpu.py) compute the same in float32, and the tests hold them to these functions.

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
    HUGECTR_FTRL           HugeCTR's Ftrl on the touched rows (EmbeddingCollection's), LOCAL only  z, n (V, D)
                           (kernels/optimizers.py's ftrl_update_ref, on the float32 values: its bits)
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
HugeCTR: HugeCTR/src/embeddings/ (forward_sum/mean, backward, the sparse optimizers);
FBGEMM: fbgemm_gpu/codegen/training/ (split_embedding_codegen forward/backward templates, optimizers.py,
embedding_bounds_check_*). Their formulas, our code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import optimizers as OPT
from .embedding_init import _splitmix64_ref
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
    Optim.HUGECTR_FTRL: (("z", False, np.float32), ("n", False, np.float32)),
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
HP_FIELDS = ("learning_rate", "eps", "beta1", "beta2", "weight_decay", "momentum", "max_norm", "scaler", "eta",
             "beta", "lambda1", "lambda2")



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
    elif kind == Optim.HUGECTR_FTRL:        # on the float32 values the kernels hold (g: their float32 sum)
        f32 = [np.asarray(x, np.float32) for x in (w, s[0], s[1], g)]
        w, z, n = (np.asarray(x, np.float64) for x in OPT.ftrl_update_ref(
            *f32, h["learning_rate"], h["beta"], h["lambda1"], h["lambda2"], h["scaler"]))
        s = [z, n]
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


PTX_CHECKS = []  # no kernels: the NumPy reference (the kernels are in tbe.py and tbe_row_ops.py)
