"""Optimizers (dense and sparse) and HugeCTR's learning-rate schedule.

Dense weights live in one flat float32 vector (HugeCTR's layout, spec §7.2), so a dense update is one
kernel launch. Sparse updates touch the rows a batch used (spec §3.3). Every update goes through
numbactr.kernels.optimizers (formulas in its docstring): kernels on gpu/sim, their NumPy references
on cpu.

Which combinations exist (as in HugeCTR):
  * dense: every Optimizer_t (SGD, MomentumSGD, Nesterov, Adam, AdaGrad, Ftrl); update_type is ignored.
  * sparse (SparseEmbedding): SGD, MomentumSGD, Nesterov, AdaGrad with Local or Global; Adam with Local,
    Global or LazyGlobal. Ftrl raises (HugeCTR: "Invalid optimizer type"); LazyGlobal with anything but
    Adam raises (HugeCTR: "lazy global update is only implemented for Adam").

State arrays (``.states``) are listed in HugeCTR's file order (spec §7.2/§7.3): Adam [m, v],
AdaGrad [acc], MomentumSGD [m], Nesterov [acc], Ftrl [z, n], SGD []. Adam LazyGlobal keeps one more
state, ``.prev_time`` (V, D) int64, OUTSIDE ``.states``: HugeCTR's sparse opt-state file holds m and v
only (prev_time, like the step counter ``.t``, is not saved; after a reload both restart, t at 0 and
prev_time at 1, which is consistent). Save it, if ever, together with ``.t``, never alone.

Freezing (freeze_dense / freeze_embedding) is lr = 0, as in HugeCTR: the states keep updating and
the weights stay, except that MomentumSGD and Nesterov weights keep moving on their remaining
momentum (HugeCTR does the same) and Ftrl, which divides by lr in HugeCTR (NaN), keeps w and only
accumulates z += g, n += g^2 here.

Deviations from HugeCTR, each the only sensible result where HugeCTR produces NaN:
  * MomentumSGD Global with momentum_factor == 0 (the CreateOptimizer default): HugeCTR divides the hot
    rows' increment by the factor. Here: all rows m *= 0, then the Local rule on the hot rows, which
    is exactly the Global semantics (every row, cold rows g = 0).
  * Adam Global with beta1 == 0 or beta2 == 0 (same division): rejected with a ValueError.
AdaGrad's accumulator starts at initial_accu_value; under numbactr.compat.hugectr_exact() it starts
at HugeCTR's byte-memset value instead (see kernels.optimizers.adagrad_initial_accumulator).
"""
from __future__ import annotations

import numpy as np

from . import compat, device
from .enums import Optimizer_t, Update_t
from .kernels import optimizers as K

O, U = Optimizer_t, Update_t

#: every optimizer HugeCTR's dense network accepts (update_type does not apply to dense weights)
DENSE_SUPPORTED = frozenset({O.SGD, O.MomentumSGD, O.Nesterov, O.Adam, O.AdaGrad, O.Ftrl})
#: every (optimizer, update type) HugeCTR's SparseEmbedding accepts
SUPPORTED = frozenset({(O.SGD, U.Local), (O.SGD, U.Global),
                       (O.MomentumSGD, U.Local), (O.MomentumSGD, U.Global),
                       (O.Nesterov, U.Local), (O.Nesterov, U.Global),
                       (O.AdaGrad, U.Local), (O.AdaGrad, U.Global),
                       (O.Adam, U.Local), (O.Adam, U.Global), (O.Adam, U.LazyGlobal)})
SPARSE_SUPPORTED = SUPPORTED


def check_supported(opt, where: str, sparse: bool = True) -> None:
    """Raise (NotImplementedError / ValueError, naming `where` and the combination) unless HugeCTR
    accepts ``opt`` for dense weights (sparse=False) or for a SparseEmbedding (sparse=True)."""
    t, u = opt.optimizer_type, opt.update_type
    combo = f"Optimizer_t.{t.name} with Update_t.{u.name}"
    if not sparse:
        if t not in DENSE_SUPPORTED:
            raise NotImplementedError(f"{where}: Optimizer_t.{t.name} is not a dense optimizer; "
                                      f"available: {sorted(o.name for o in DENSE_SUPPORTED)}")
        return
    if t == O.Ftrl:
        raise NotImplementedError(
            f"{where}: {combo}: Ftrl is not available for SparseEmbedding (HugeCTR: 'Invalid optimizer "
            f"type'); it trains dense weights only. Give the embedding its own optimizer, e.g. "
            f"SparseEmbedding(..., optimizer=CreateOptimizer(optimizer_type=Optimizer_t.SGD))")
    if u == U.LazyGlobal and t != O.Adam:
        raise NotImplementedError(
            f"{where}: {combo}: lazy global update is only implemented for Adam (as in HugeCTR); "
            f"use Update_t.Local or Update_t.Global")
    if (t, u) not in SUPPORTED:
        raise NotImplementedError(f"{where}: {combo} is not a sparse optimizer; available: "
                                  f"{sorted(f'{a.name}/{b.name}' for a, b in SUPPORTED)}")
    if t == O.Adam and u == U.Global and (opt.beta1 == 0 or opt.beta2 == 0):
        raise ValueError(f"{where}: {combo} needs beta1 > 0 and beta2 > 0 (HugeCTR divides the hot rows' "
                         f"moment increments by them; got beta1={opt.beta1}, beta2={opt.beta2}); "
                         f"use Update_t.Local")


class LearningRateScheduler:
    """``get_next()`` as HugeCTR's learning_rate_scheduler.hpp (spec §1.1): warmup, then polynomial decay."""

    def __init__(self, base_lr, warmup_steps=1, decay_start=0, decay_steps=1, decay_power=2.0, end_lr=0.0):
        if decay_power < 1.0:
            raise ValueError(f"decay_power must be >= 1, got {decay_power}")
        if warmup_steps < 0 or decay_steps <= 0:
            raise ValueError("warmup_steps must be >= 0 and decay_steps > 0")
        self.base_lr, self.warmup_steps, self.decay_start = float(base_lr), int(warmup_steps), int(decay_start)
        self.decay_steps, self.decay_power, self.end_lr = int(decay_steps), float(decay_power), float(end_lr)
        self.step = 0

    def get_next(self) -> float:
        self.step += 1
        s = self.step
        if s <= self.warmup_steps:
            return s * self.base_lr / self.warmup_steps
        if self.decay_start == 0 or s <= self.decay_start:
            return self.base_lr
        if s <= self.decay_start + self.decay_steps:
            f = ((self.decay_start + self.decay_steps - s) / self.decay_steps) ** self.decay_power
            return max(self.base_lr * f, self.end_lr)
        return self.end_lr


def _new_states(opt, shape) -> list:
    """Zeroed state arrays in HugeCTR's file order; AdaGrad's accumulator at its initial value."""
    xp, t = device.xp(), opt.optimizer_type
    count = {O.SGD: 0, O.MomentumSGD: 1, O.Nesterov: 1, O.Adam: 2, O.Ftrl: 2}.get(t)
    if t == O.AdaGrad:
        init = K.adagrad_initial_accumulator(opt.initial_accu_value, compat.hugectr_exact())
        return [xp.full(shape, init, np.float32)]
    return [xp.zeros(shape, np.float32) for _ in range(count)]


class DenseOptimizer:
    """Updates the flat weight vector w (P,) from the flat gradient g (P,)."""

    def __init__(self, opt, n_params: int):
        check_supported(opt, "dense optimizer", sparse=False)
        self.opt, self.t = opt, 0
        self.states = _new_states(opt, (n_params,))

    def step(self, w, g, lr: float, scaler: float) -> None:
        o, s, kern = self.opt, self.states, device.uses_kernels()
        t = o.optimizer_type
        f = o.momentum_factor
        if t == O.SGD:
            if kern:
                K.sgd_update(w, g, lr, scaler)
            else:
                w[...] = K.sgd_update_ref(w, g, lr, scaler)
        elif t == O.MomentumSGD:
            if kern:
                K.momentum_sgd_update(w, s[0], g, lr, f, scaler)
            else:
                w[...], s[0][...] = K.momentum_sgd_update_ref(w, s[0], g, lr, f, scaler)
        elif t == O.Nesterov:
            if kern:
                K.nesterov_update(w, s[0], g, lr, f, scaler)
            else:
                w[...], s[0][...] = K.nesterov_update_ref(w, s[0], g, lr, f, scaler)
        elif t == O.Adam:
            self.t += 1
            args = (lr, o.beta1, o.beta2, o.epsilon, self.t, scaler)
            if kern:
                K.adam_update(w, s[0], s[1], g, *args)
            else:
                w[...], s[0][...], s[1][...] = K.adam_update_ref(w, s[0], s[1], g, *args)
        elif t == O.AdaGrad:
            if kern:
                K.adagrad_update(w, s[0], g, lr, o.epsilon, scaler)
            else:
                w[...], s[0][...] = K.adagrad_update_ref(w, s[0], g, lr, o.epsilon, scaler)
        else:  # Ftrl, states [z, n]
            args = (lr, o.beta, o.lambda1, o.lambda2, scaler)
            if kern:
                K.ftrl_update(w, s[0], s[1], g, *args)
            else:
                w[...], s[0][...], s[1][...] = K.ftrl_update_ref(w, s[0], s[1], g, *args)


class SparseOptimizer:
    """Updates an embedding's value pool (V, D) at the unique rows a batch touched.

    Global updates EVERY row each step in HugeCTR (cold rows keep moving on their decaying moments).
    We run the all-rows pass over the rows handed out so far: a row never handed out has zero
    moments, so HugeCTR's update leaves it unchanged too — same result, less work.
    """

    def __init__(self, opt, pool_shape: tuple, where: str):
        check_supported(opt, where, sparse=True)
        self.opt, self.t = opt, 0
        self.states = _new_states(opt, pool_shape)
        self.prev_time = None
        if opt.optimizer_type == O.Adam and opt.update_type == U.LazyGlobal:
            self.prev_time = device.xp().ones(pool_shape, np.int64)          # (V, D), HugeCTR starts at 1

    def step(self, table, rows, grads, n_rows: int, lr: float, scaler: float) -> None:
        """table (V, D); rows (U,) unique int64; grads (U, D); n_rows = rows in use."""
        o, kern = self.opt, device.uses_kernels()
        t, glob = o.optimizer_type, o.update_type == U.Global
        if t == O.Adam:
            self.t += 1
            if o.update_type == U.LazyGlobal:
                self._adam_lazy(table, rows, grads, lr, scaler, kern)
            elif glob:
                self._adam_global(table, rows, grads, n_rows, lr, scaler, kern)
            else:
                self._local(K.sparse_adam_local_update, K.adam_update_ref, table, rows, grads, kern,
                            lr, o.beta1, o.beta2, o.epsilon, self.t, scaler)
        elif t == O.SGD:                          # Global is Local for SGD; atomic_update: same sum
            self._local(K.sparse_sgd_update, K.sgd_update_ref, table, rows, grads, kern, lr, scaler)
        elif t == O.AdaGrad:                      # Global is Local for AdaGrad
            self._local(K.sparse_adagrad_update, K.adagrad_update_ref, table, rows, grads, kern,
                        lr, o.epsilon, scaler)
        elif t == O.MomentumSGD:
            if glob:
                self._momentum_global(table, rows, grads, n_rows, lr, scaler, kern)
            else:
                self._local(K.sparse_momentum_sgd_local_update, K.momentum_sgd_update_ref, table, rows,
                            grads, kern, lr, o.momentum_factor, scaler)
        elif glob:                                # Nesterov
            self._nesterov_global(table, rows, grads, n_rows, lr, scaler, kern)
        else:
            self._local(K.sparse_nesterov_local_update, K.nesterov_update_ref, table, rows, grads, kern,
                        lr, o.momentum_factor, scaler)

    def take_rows(self, src) -> None:
        """Re-index the states after the embedding table was rebuilt (a sparse-weight load), so that
        each key keeps its state: new row i takes old row src[i] (src (n,) int64 on the device; -1 =
        a key new to the table, which starts from the initial state, as do all rows >= n)."""
        n, hit = src.shape[0], src >= 0
        kept = [s[src[hit]] for s in self.states]
        if self.states:
            fresh = _new_states(self.opt, self.states[0].shape)
            for s, f, k in zip(self.states, fresh, kept):
                s[...] = f
                s[:n][hit] = k
        if self.prev_time is not None:
            old = self.prev_time[src[hit]]
            self.prev_time.fill(1)
            self.prev_time[:n][hit] = old

    def _local(self, kernel_fn, row_ref, table, rows, grads, kern, *args) -> None:
        """The Local rule: a sparse kernel, or the dense reference on the gathered hot rows."""
        arrays = [table, *self.states]
        if kern:
            kernel_fn(*arrays, rows, grads, *args)
            return
        new = row_ref(*[a[rows] for a in arrays], grads, *args)
        for a, b in zip(arrays, new if isinstance(new, tuple) else (new,)):
            a[rows] = b

    def _adam_lazy(self, table, rows, grads, lr, scaler, kern) -> None:
        o, (m, v), prev = self.opt, self.states, self.prev_time
        args = (lr, o.beta1, o.beta2, o.epsilon, self.t, scaler)
        if kern:
            K.sparse_adam_lazy_update(table, m, v, prev, rows, grads, *args)
        else:
            table[rows], m[rows], v[rows], prev[rows] = K.adam_lazy_update_ref(
                table[rows], m[rows], v[rows], prev[rows], grads, *args)

    def _adam_global(self, table, rows, grads, n, lr, scaler, kern) -> None:
        """Hot rows pre-divide their moment increments, then every live row decays and steps."""
        o, (m, v) = self.opt, self.states
        b1, b2, eps, t = o.beta1, o.beta2, o.epsilon, self.t
        if kern:
            K.sparse_adam_global_hot(m, v, rows, grads, b1, b2, scaler)
            K.sparse_adam_global_all(table, m, v, n, lr, b1, b2, eps, t)
        else:
            hot = np.arange(rows.shape[0])
            m[rows], v[rows] = K.sparse_adam_global_hot_ref(m[rows], v[rows], hot, grads, b1, b2, scaler)
            table[:n], m[:n], v[:n] = K.sparse_adam_global_all_ref(table[:n], m[:n], v[:n], n, lr, b1, b2,
                                                                   eps, t)

    def _momentum_global(self, table, rows, grads, n, lr, scaler, kern) -> None:
        f, (m,) = self.opt.momentum_factor, self.states
        if f == 0:
            # HugeCTR would divide by f (NaN). The Global semantics with f = 0: every row's m becomes
            # 0 - lr g (cold rows: 0); all rows m *= 0 first, then the Local rule on the hot rows.
            if kern:
                K.sparse_momentum_sgd_global_all(table, m, n, 0.0)
            else:
                table[:n], m[:n] = K.sparse_momentum_sgd_global_all_ref(table[:n], m[:n], n, 0.0)
            self._local(K.sparse_momentum_sgd_local_update, K.momentum_sgd_update_ref, table, rows, grads,
                        kern, lr, 0.0, scaler)
            return
        if kern:
            K.sparse_momentum_sgd_global_hot(m, rows, grads, lr, f, scaler)
            K.sparse_momentum_sgd_global_all(table, m, n, f)
        else:
            hot = np.arange(rows.shape[0])
            m[rows] = K.sparse_momentum_sgd_global_hot_ref(m[rows], hot, grads, lr, f, scaler)
            table[:n], m[:n] = K.sparse_momentum_sgd_global_all_ref(table[:n], m[:n], n, f)

    def _nesterov_global(self, table, rows, grads, n, lr, scaler, kern) -> None:
        mu, (a,) = self.opt.momentum_factor, self.states
        if kern:
            K.sparse_nesterov_global_all(table, a, n, mu)
            K.sparse_nesterov_global_hot(table, a, rows, grads, lr, mu, scaler)
        else:
            table[:n], a[:n] = K.sparse_nesterov_global_all_ref(table[:n], a[:n], n, mu)
            hot = np.arange(rows.shape[0])
            table[rows], a[rows] = K.sparse_nesterov_global_hot_ref(table[rows], a[rows], hot, grads, lr, mu,
                                                                   scaler)
