"""Scalar math of the table-batched embedding, written once as plain Python and compiled twice.

kernels/tbe.py compiles these functions as inlined numba.cuda device functions for its
kernels (gpu, sim), kernels/tbe_cpu.py with ``numba.njit`` for the compiled cpu path, so the optimizer
rules, the float16 conversions and stochastic rounding are one text whichever device runs them. Each
function is a leaf (it calls no other function of this module, so each target binds its own copies), works
on float32 scalars and returns float32; kernels/tbe.py's NumPy reference is the oracle they are tested
against. The enums of the engine are defined here, the lowest layer (numbactr.embedding.engine re-exports).
Editing this module: Numba's on-disk cache keys a compiled function on its own file's timestamp, not on the
functions it inlines from here, so delete kernels/__pycache__/tbe_cpu*.nbi and *.nbc (or touch tbe_cpu.py)
before measuring a change of a rule on the cpu path (a fresh install or clone has no stale cache).

float16 as bits (uint16): value = (-1)^s 2^(e - 15) (1 + m / 1024) for e in 1..30, 2^-24 m for e = 0,
inf / nan for e = 31. float_to_half_bits rounds a float32 x to those bits:
    x = M 2^E with M in [1, 2):  normal (E >= -14): q = (M - 1) 1024,  bits = (E + 15) << 10 | floor(q)
                                 subnormal:        q = |x| 2^24,      bits = floor(q)
    frac = q - floor(q) in [0, 1): nearest-even rounds up when frac > 1/2 (or = 1/2 and floor(q) odd);
    stochastic rounds up when u < frac, u = (top 24 bits of the hash) / 2^24, so up with probability frac.
    A carry out of the mantissa moves to the next binade by itself (bits + 1). Overflow: nearest-even
    gives inf (IEEE); stochastic saturates at 65504 (FBGEMM rounds toward zero after adding its noise).
"""
from __future__ import annotations

import enum
import math

from numba import float32, float64, int32, uint16, uint64


# ---- enums ------------------------------------------------------------------------------------------
class Pooling(enum.IntEnum):
    SUM = 0
    MEAN = 1
    NONE = 2


class Layout(enum.IntEnum):
    FEATURE_MAJOR = 0      # bag j = f * B + b (FBGEMM)
    SAMPLE_MAJOR = 1       # bag j = b * F + f (HugeCTR's reader)


class BoundsCheck(enum.IntEnum):
    FATAL = 0              # FBGEMM's BoundsCheckMode values
    WARNING = 1
    IGNORE = 2
    NONE = 3


class Precision(enum.IntEnum):
    FP32 = 0
    FP16 = 1
    INT8 = 2               # FBGEMM's fused 8-bit rowwise rows (kernels/fused8bit.py): forward only


class WeightDecay(enum.IntEnum):
    NONE = 0               # FBGEMM's WeightDecayMode values
    L2 = 1
    DECOUPLE = 2
    COUNTER = 3            # EXACT_ROWWISE_ADAGRAD with a per-row counter (counter_row_scalars)
    COWCLIP = 4


class CounterWeightDecay(enum.IntEnum):
    NONE = 0               # FBGEMM's CounterWeightDecayMode values: the decay inside COUNTER / COWCLIP
    L2 = 1
    DECOUPLE = 2
    ADAGRADW = 3


class UpdateType(enum.IntEnum):
    LOCAL = 0              # HugeCTR's Update_t
    GLOBAL = 1
    LAZY_GLOBAL = 2


class Optim(enum.IntEnum):
    NONE = 0
    EXACT_SGD = 1
    EXACT_ADAGRAD = 2
    EXACT_ROWWISE_ADAGRAD = 3
    ADAM = 4
    PARTIAL_ROWWISE_ADAM = 5
    LAMB = 6
    PARTIAL_ROWWISE_LAMB = 7
    HUGECTR_SGD = 8
    HUGECTR_MOMENTUM_SGD = 9
    HUGECTR_NESTEROV = 10
    HUGECTR_ADAM = 11
    HUGECTR_ADAGRAD = 12
    LARS_SGD = 13          # FBGEMM's (GPU-only there): momentum SGD with a per-row trust-ratio rate
    HUGECTR_FTRL = 14      # HugeCTR's Ftrl (EmbeddingCollection tables): per-element z, n; LOCAL only


# plain ints for compiled code (IntEnum members would be typed as enum members)
_SGD, _ADAGRAD, _RW_ADAGRAD = int(Optim.EXACT_SGD), int(Optim.EXACT_ADAGRAD), int(Optim.EXACT_ROWWISE_ADAGRAD)
_ADAM, _PR_ADAM, _LAMB, _PR_LAMB = (int(Optim.ADAM), int(Optim.PARTIAL_ROWWISE_ADAM), int(Optim.LAMB),
                                    int(Optim.PARTIAL_ROWWISE_LAMB))
_H_SGD, _H_MOM, _H_NES, _H_ADAM, _H_ADAGRAD = (int(Optim.HUGECTR_SGD), int(Optim.HUGECTR_MOMENTUM_SGD),
                                               int(Optim.HUGECTR_NESTEROV), int(Optim.HUGECTR_ADAM),
                                               int(Optim.HUGECTR_ADAGRAD))
_LARS = int(Optim.LARS_SGD)
_H_FTRL = int(Optim.HUGECTR_FTRL)
_GLOBAL, _LAZY = int(UpdateType.GLOBAL), int(UpdateType.LAZY_GLOBAL)
_L2, _DECOUPLE = int(WeightDecay.L2), int(WeightDecay.DECOUPLE)
_COUNTER, _COWCLIP = int(WeightDecay.COUNTER), int(WeightDecay.COWCLIP)

# packed kernel scalars: one float32 array KS (host-computed from the hyper-parameters and the step)
KS_LR, KS_EPS, KS_B1, KS_B2, KS_WD, KS_MOM, KS_MAXN, KS_SCALER = range(8)
KS_BC1, KS_BC2, KS_ALPHA, KS_LAZY = 8, 9, 10, 11        # 1 - b1^t, 1 - b2^t, HugeCTR alpha_t, lr / (1 - b1)
# counter-based regularization (WeightDecay.COUNTER / COWCLIP): adjustment_ub, tail_id_threshold,
# weight_norm_coefficient, lower_bound, the step's max_counter and whether this step refreshes it
KS_CNT_UB, KS_CNT_TAIL, KS_CNT_WNC, KS_CNT_LB, KS_MAXC, KS_REFRESH = 12, 13, 14, 15, 16, 17
KS_ETA = 18                                              # LARS_SGD's eta
KS_L1, KS_L2P = 19, 20                                   # Ftrl's lambda1 and l2' = lambda2 + beta / lr (float32)
N_KS = 21
# packed integers: one int64 array KI
KI_KIND, KI_UPDATE, KI_WD_MODE, KI_STEP, KI_SR, KI_POOLING, KI_LAYOUT, KI_BATCH = range(8)
KI_GO = 8            # the step's gate: 0 makes the update kernels change nothing (a skipped mixed-precision step)
# counter-based regularization: CounterWeightDecay, counter_halflife, adjustment_iter, learning_rate_mode,
# tail_id_threshold.is_ratio; ADAM's rowwise bias correction (1: t is the row's own update count)
KI_CNT_WD, KI_CNT_HALF, KI_CNT_ADJ, KI_CNT_LRM, KI_CNT_RATIO, KI_RBC = 9, 10, 11, 12, 13, 14
N_KI = 15


# ---- float16 <-> float32 ----------------------------------------------------------------------------
def half_to_float(h):
    """float32 value of the float16 bits h (exact)."""
    bits = int32(h)
    e = (bits >> int32(10)) & int32(31)
    m = bits & int32(1023)
    if e == int32(31):
        v = float32(math.inf) if m == int32(0) else float32(math.nan)
    elif e == int32(0):
        v = float32(math.ldexp(float32(m), -24))
    else:
        v = float32(math.ldexp(float32(m + int32(1024)), int(e - int32(25))))   # int(): Python's ldexp
    if (bits >> int32(15)) & int32(1):
        return -v
    return v


def float_to_half_bits(x, h, stochastic):
    """float16 bits (uint16) of float32 x: stochastic (uniform from the top 24 bits of the uint64 hash h)
    or nearest-even rounding (see the module docstring)."""
    if x != x:
        return uint16(0x7E00)
    sign = int32(0x8000) if math.copysign(float32(1.0), x) < float32(0.0) else int32(0)
    a = abs(x)
    if a == float32(math.inf):
        return uint16(sign | int32(0x7C00))
    if a == float32(0.0):
        return uint16(sign)
    m, e = math.frexp(a)                                  # a = m 2^e, m in [0.5, 1)
    if e - 1 >= -14:
        q = float32((float32(m) * float32(2.0) - float32(1.0)) * float32(1024.0))   # exact, a multiple of 2^-13
        base = int32((e - 1 + 15) << 10)
    else:
        q = float32(math.ldexp(a, 24))                    # exact: |x| / 2^-24 < 1024
        base = int32(0)
    mi = int32(math.floor(q))
    frac = q - float32(mi)
    if stochastic:
        up = float32(h >> uint64(40)) * float32(5.9604644775390625e-08) < frac     # u in [0, 1): 24 bits
    else:
        up = frac > float32(0.5) or (frac == float32(0.5) and (mi & int32(1)) == int32(1))
    bits = base + mi + (int32(1) if up else int32(0))
    if bits >= int32(0x7C00):
        bits = int32(0x7BFF) if stochastic else int32(0x7C00)
    return uint16(sign | bits)


def sr_key(lin_row, d):
    """The uint64 hashed (xor the step's base) for element d of linear row lin_row: lin_row << 16 | d."""
    return (uint64(lin_row) << uint64(16)) | uint64(d)


# ---- optimizer rules (float32 scalars) ---------------------------------------------------------------
def elem_state_count(kind):
    """How many per-element state arrays (a, b of elem_update) the optimizer keeps: 0, 1 or 2."""
    if kind == _ADAM or kind == _LAMB or kind == _H_ADAM or kind == _H_FTRL:
        return 2
    if kind == _SGD or kind == _RW_ADAGRAD or kind == _H_SGD or kind == 0:
        return 0
    return 1


def row_scalars(kind, wd_mode, sumsq, width, rstate, lr, eps, b2, wd, bc2):
    """(new per-row state, c0, c1) of the rowwise kinds from sumsq = sum_d g'^2 of the row:
    EXACT_ROWWISE_ADAGRAD: m += sumsq / D; c0 = lr / (sqrt(m) + eps) (the multiplier), c1 = correction.
    PARTIAL_ROWWISE_ADAM/LAMB: v = b2 v + (1 - b2) sumsq / D; c0 = sqrt(v / (1 - b2^t)) + eps."""
    mean = sumsq / float32(width)
    if kind == _RW_ADAGRAD:
        m = rstate + mean
        mult = lr / (float32(math.sqrt(m)) + eps)
        corr = float32(1.0)
        if wd_mode == _L2:
            corr = float32(1.0) - mult * wd
        elif wd_mode == _DECOUPLE:
            corr = float32(1.0) - lr * wd
        return m, mult, corr
    v = b2 * rstate + (float32(1.0) - b2) * mean
    return v, float32(math.sqrt(v / bc2)) + eps, float32(0.0)


def counter_row_scalars(reg, cwd, m, cnt, prev, it, gsumsq, wsumsq, width, lr, eps, wd, half, adj_iter, adj_ub,
                        lr_mode, max_counter, tail, is_ratio, wnc, lower):
    """FBGEMM's rowwise AdaGrad with a counter (rowwise_adagrad_with_counter) for one touched row at
    iteration it: (new m, new row counter, u, c); the row becomes w = c w - u g (g the raw gradient) and its
    prev_iter becomes it. reg: WeightDecay.COUNTER or COWCLIP; cwd: CounterWeightDecay; m, cnt, prev the
    row's momentum1, row_counter and prev_iter before the step; gsumsq = sum_d g'^2 with g' = g + wd w when
    cwd is L2 (else g); wsumsq = sum_d w^2 (COWCLIP). The rules, in FBGEMM's order:
      delta = 1 if prev == 0 else it - prev
      counter: half > 0: cnt = 1 + exp(-delta ln2 / half) cnt;  half == 0: cnt = 1;  half < 0: cnt += 1
      freq = half / cnt;  m += gsumsq / D;  u0 = lr / (sqrt(m) + eps);  on = adj_iter <= 0 or it > adj_iter
      COUNTER: u = u0, and when lr_mode >= 0, on and cnt > tail (floor(tail max_counter) when is_ratio):
                 0: u0 clamp((max_counter / (cnt + 1))^ub, 1, 10)   1: u0 clamp(((cnt + 1) / max_counter)^ub, 0.1, 1)
                 2: lr / (sqrt(ub cnt) + eps)
               when on: ADAGRADW: u = u0 sqrt(cnt) (half = -1) | min(lr cnt, ub) / (sqrt(m) + eps) (half = -2);
                          c = 1 - wd lr; both times c^(min(delta, it - adj_iter) - 1) (the skipped decays)
                        DECOUPLE: c = 1 - freq wd lr;  L2: c = 1 - freq wd u0
      COWCLIP: u = u0 min(1, cnt max(wnc |w|, lower) / |g'|);  DECOUPLE: c = 1 - wd lr;  L2: c = 1 - wd u"""
    one = float32(1.0)
    itf = float32(it)
    tail_val = tail
    if is_ratio != 0:
        tail_val = float32(math.floor(tail * max_counter))
    delta = one if prev == float32(0.0) else itf - prev
    if half > 0:
        rho = float32(0.6931471805599453) / float32(half)
        cnt = one + float32(math.exp(-delta * rho)) * cnt
    elif half == 0:
        cnt = one
    else:
        cnt = cnt + one
    freq = float32(half) / cnt
    m = m + gsumsq / float32(width)
    mult = lr / (float32(math.sqrt(m)) + eps)
    on = adj_iter <= 0 or it > adj_iter
    u = mult
    c = one
    if reg == _COUNTER:
        if lr_mode >= 0 and on and cnt > tail_val:
            if lr_mode == 0:
                u = mult * min(max(float32(math.pow(max_counter / (cnt + one), adj_ub)), one), float32(10.0))
            elif lr_mode == 1:
                u = mult * max(min(float32(math.pow((cnt + one) / max_counter, adj_ub)), one), float32(0.1))
            elif lr_mode == 2:
                u = lr / (float32(math.sqrt(adj_ub * cnt)) + eps)
        if on:
            if cwd == 3:
                if half == -1:
                    u = mult * float32(math.sqrt(cnt))
                elif half == -2:
                    u = min(lr * cnt, adj_ub) / (float32(math.sqrt(m)) + eps)
                c = one - wd * lr
                lazy = float32(math.pow(c, min(delta, itf - float32(adj_iter)) - one))
                u = u * lazy
                c = c * lazy
            elif cwd == 2:
                c = one - freq * wd * lr
            elif cwd == 1:
                c = one - freq * wd * mult
    else:
        clip = cnt * max(wnc * float32(math.sqrt(wsumsq)), lower)
        ratio = one
        if gsumsq > float32(0.0):
            ratio = min(one, clip / float32(math.sqrt(gsumsq)))
        u = ratio * mult
        if cwd == 2:
            c = one - wd * lr
        elif cwd == 1:
            c = one - wd * u
    return m, cnt, u, c


def row_bias_corrections(cnt, b1, b2):
    """ADAM's rowwise bias correction: the row's update count n = cnt + 1 and (1 - b1^n, 1 - b2^n)."""
    n = cnt + float32(1.0)
    return n, float32(1.0) - float32(math.pow(b1, n)), float32(1.0) - float32(math.pow(b2, n))


def lazy_scalars(prev, step, b1, b2, alpha_common):
    """HugeCTR's LazyGlobal Adam for a row last updated at step prev (1 before its first update):
    (b1^skipped, b2^skipped, catch-up alpha = lr/(1-b1) sqrt(1 - b2^prev)/(1 - b1^prev) (1 - b1^skipped))."""
    skipped = float32(step - prev)
    prev_f = float32(prev)
    b1_skip = float32(math.pow(b1, skipped))
    one = float32(1.0)
    alpha = (alpha_common * float32(math.sqrt(one - float32(math.pow(b2, prev_f))))
             / (one - float32(math.pow(b1, prev_f))) * (one - b1_skip))
    return b1_skip, float32(math.pow(b2, skipped)), alpha


def elem_update(kind, update, g, w, a, b, c0, c1, c2, lr, eps, b1, b2, wd, mom, scaler, bc1, bc2, alpha):
    """One element of a touched row: (w, a, b, r) after the rule of `kind` (kernels/tbe.py's formulas).

    g the summed (clipped) gradient, w the weight, a and b the per-element states (momentum1/m/accum,
    momentum2/v; unused ones pass through), c0..c2 the row scalars (row_scalars / lazy_scalars), bc1, bc2
    = 1 - b1^t, 1 - b2^t, alpha HugeCTR's alpha_t. r is LAMB's direction (the caller applies the trust
    ratio: w - lr (|w| / |r|) r); for other kinds r = 0 and w is final.
    HUGECTR_FTRL (a = z, b = n, c0 = lambda1, c1 = l2' = lambda2 + beta / lr, e = FLT_EPSILON), in float64
    from the float32 values and rounded once, as kernels/optimizers.py's ftrl_update_ref computes it (why:
    every device then gives that reference's bits, the collection's Ftrl results before the engine had it):
        g' = g / scaler;  n' = n + g'^2;  lr = 0: z += g', w kept (HugeCTR would divide by 0)
        z += g' + (sqrt(n + e) - sqrt(n' + e)) w / lr;  w = (lambda1 sign(z) - z) / (sqrt(n' + e) / lr + l2')
        where |z| > lambda1, else 0
    """
    one = float32(1.0)
    r = float32(0.0)
    if kind == _SGD:
        w = w - lr * g
    elif kind == _ADAGRAD:
        a = a + g * g
        w = w - lr * g / (float32(math.sqrt(a)) + eps)
    elif kind == _RW_ADAGRAD:
        w = c1 * w - c0 * g
    elif kind == _LARS:                                     # c0: the row's rate (lars_rate)
        a = mom * a + c0 * (g + wd * w)
        w = w - a
    elif kind == _ADAM or kind == _LAMB:
        a = b1 * a + (one - b1) * g
        b = b2 * b + (one - b2) * g * g
        r = a / bc1 / (float32(math.sqrt(b / bc2)) + eps) + wd * w
        if kind == _ADAM:
            w = w - lr * r
    elif kind == _PR_ADAM or kind == _PR_LAMB:
        a = b1 * a + (one - b1) * g
        r = a / bc1 / c0 + wd * w
        if kind == _PR_ADAM:
            w = w - lr * r
    elif kind == _H_SGD:
        w = w - lr * (g / scaler)
    elif kind == _H_ADAGRAD:
        gs = g / scaler
        a = a + gs * gs
        w = w - lr * gs / (float32(math.sqrt(a)) + eps)
    elif kind == _H_MOM:
        gs = g / scaler
        if update == _GLOBAL and mom != float32(0.0):
            a = a - lr * gs / mom                          # the all-rows pass multiplies by mom next
        else:
            a = mom * a - lr * gs
            w = w + a
    elif kind == _H_NES:
        gs = g / scaler
        if update == _GLOBAL:
            step = lr * gs                                  # after the all-rows pass a *= mu; w += mu a
            a = a - step
            w = w - (one + mom) * step
        else:
            a_new = mom * a - lr * gs
            w = w + (-mom * a + (one + mom) * a_new)
            a = a_new
    elif kind == _H_ADAM:
        gs = g / scaler
        if update == _GLOBAL:
            a = a + (one - b1) * gs / b1                    # the all-rows pass multiplies by b1, b2 next
            b = b + (one - b2) * gs * gs / b2
        elif update == _LAZY:
            w = w - c2 * a / (float32(math.sqrt(b)) + eps)  # catch up on the old moments
            a = c0 * a + (one - b1) * gs
            b = c1 * b + (one - b2) * gs * gs
        else:
            a = b1 * a + (one - b1) * gs
            b = b2 * b + (one - b2) * gs * gs
            w = w - alpha * a / (float32(math.sqrt(b)) + eps)
    elif kind == _H_FTRL:
        e64 = float64(1.1920928955078125e-07)              # FLT_EPSILON
        gd = float64(g) / float64(scaler)
        nd = float64(b)
        n_new = nd + gd * gd
        b = float32(n_new)
        if lr == float32(0.0):
            a = float32(float64(a) + gd)
        else:
            lrd = float64(lr)
            zd = float64(a) + gd + (math.sqrt(nd + e64) - math.sqrt(n_new + e64)) * float64(w) / lrd
            a = float32(zd)
            wd64 = float64(0.0)
            if abs(zd) > float64(c0):
                wd64 = (float64(c0) * math.copysign(1.0, zd) - zd) / (math.sqrt(n_new + e64) / lrd + float64(c1))
            w = float32(wd64)
    return w, a, b, r


def global_elem(kind, w, a, b, b1, b2, eps, mom, alpha):
    """HugeCTR's all-rows pass of a GLOBAL update on one element in use: (w, a, b).
    Adam: a *= b1; b *= b2; w -= alpha_t a / (sqrt(b) + eps).  MomentumSGD: a *= f; w += a.
    Nesterov: a *= mu; w += mu a."""
    if kind == _H_ADAM:
        a = b1 * a
        b = b2 * b
        w = w - alpha * a / (float32(math.sqrt(b)) + eps)
    elif kind == _H_MOM:
        a = mom * a
        w = w + a
    elif kind == _H_NES:
        a = mom * a
        w = w + mom * a
    return w, a, b


def lars_rate(w_sumsq, g_sumsq, lr, eta, wd):
    """LARS_SGD's rate of a row: lr eta |w| / (|g| + wd |w|) from the row's sums of squares (FBGEMM's
    formula; 0 where the denominator is 0, where FBGEMM divides by 0: its row then turns NaN through inf * 0)."""
    wn = float32(math.sqrt(w_sumsq))
    den = float32(math.sqrt(g_sumsq)) + wd * wn
    if den == float32(0.0):
        return float32(0.0)
    return lr * eta * wn / den


def lamb_ratio(w_sumsq, r_sumsq):
    """LAMB's trust ratio |w| / |r| (0 when |r| = 0: the direction is then 0 anyway)."""
    if r_sumsq > float32(0.0):
        return float32(math.sqrt(w_sumsq)) / float32(math.sqrt(r_sumsq))
    return float32(0.0)


def max_norm_scale(w_sumsq, max_norm):
    """The factor of a row whose new squared norm is w_sumsq: max_norm / |w| above max_norm, else 1."""
    n = float32(math.sqrt(w_sumsq))
    if max_norm > float32(0.0) and n > max_norm:
        return max_norm / n
    return float32(1.0)


#: no kernels here: the device functions compile to PTX inside kernels/tbe.py's kernels
PTX_CHECKS = []
