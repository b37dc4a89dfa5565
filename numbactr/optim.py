"""Optimizers (dense and sparse) and HugeCTR's learning-rate schedule.

Dense weights live in one flat float32 vector (HugeCTR's layout, spec §7.2), so a dense update is one
kernel launch. Sparse updates touch the rows a batch used (spec §3.3). Every update goes through
numbactr.kernels.optimizers: kernels on gpu/sim, their NumPy references on cpu.
"""
from __future__ import annotations

import numpy as np

from . import device
from .enums import Optimizer_t, Update_t
from .kernels import optimizers as K

SUPPORTED = {(Optimizer_t.SGD, Update_t.Local), (Optimizer_t.SGD, Update_t.Global),
             (Optimizer_t.Adam, Update_t.Local), (Optimizer_t.Adam, Update_t.Global)}


def check_supported(opt, where: str) -> None:
    if (opt.optimizer_type, opt.update_type) not in SUPPORTED:
        raise NotImplementedError(
            f"{where}: optimizer {opt.optimizer_type.name} with Update_t.{opt.update_type.name} is not "
            f"implemented yet in numbactr (tracked by issue 4); available: SGD and Adam, Local or Global")


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


class DenseOptimizer:
    """Updates the flat weight vector w (P,) from the flat gradient g (P,)."""

    def __init__(self, opt, n_params: int):
        check_supported(opt, "dense optimizer")
        self.opt, self.t = opt, 0
        xp = device.xp()
        self.states = ([xp.zeros(n_params, np.float32), xp.zeros(n_params, np.float32)]
                       if opt.optimizer_type == Optimizer_t.Adam else [])

    def step(self, w, g, lr: float, scaler: float) -> None:
        o = self.opt
        if o.optimizer_type == Optimizer_t.SGD:
            if device.uses_kernels():
                K.sgd_update(w, g, lr, scaler)
            else:
                w[...] = K.sgd_update_ref(w, g, lr, scaler)
            return
        self.t += 1
        m, v = self.states
        if device.uses_kernels():
            K.adam_update(w, m, v, g, lr, o.beta1, o.beta2, o.epsilon, self.t, scaler)
        else:
            w[...], m[...], v[...] = K.adam_update_ref(w, m, v, g, lr, o.beta1, o.beta2, o.epsilon, self.t, scaler)


class SparseOptimizer:
    """Updates an embedding's value pool (V, D) at the unique rows a batch touched.

    Adam Global updates EVERY row each step in HugeCTR (cold rows keep moving on their decaying
    moments). We run that all-rows pass over the rows handed out so far: a row never handed out has
    m = v = 0, so HugeCTR's update leaves it unchanged too — same result, less work.
    """

    def __init__(self, opt, pool_shape: tuple, where: str):
        check_supported(opt, where)
        self.opt, self.t = opt, 0
        xp = device.xp()
        self.states = ([xp.zeros(pool_shape, np.float32), xp.zeros(pool_shape, np.float32)]
                       if opt.optimizer_type == Optimizer_t.Adam else [])

    def step(self, table, rows, grads, n_rows: int, lr: float, scaler: float) -> None:
        """table (V, D); rows (U,) unique int64; grads (U, D); n_rows = rows in use."""
        o, kern = self.opt, device.uses_kernels()
        if o.optimizer_type == Optimizer_t.SGD:
            if kern:
                K.sparse_sgd_update(table, rows, grads, lr, scaler)
            else:
                table[rows] = K.sgd_update_ref(table[rows], grads, lr, scaler)
            return
        self.t += 1
        m, v = self.states
        b1, b2, eps, t = o.beta1, o.beta2, o.epsilon, self.t
        if o.update_type == Update_t.Local:
            if kern:
                K.sparse_adam_local_update(table, m, v, rows, grads, lr, b1, b2, eps, t, scaler)
            else:   # the dense reference applied to the gathered hot rows
                table[rows], m[rows], v[rows] = K.adam_update_ref(table[rows], m[rows], v[rows], grads,
                                                                  lr, b1, b2, eps, t, scaler)
            return
        # Global: hot rows pre-divide their moment increments, then every row decays and steps
        if kern:
            K.sparse_adam_global_hot(m, v, rows, grads, b1, b2, scaler)
            K.sparse_adam_global_all(table, m, v, n_rows, lr, b1, b2, eps, t)
        else:
            hot = np.arange(rows.shape[0])
            m[rows], v[rows] = K.sparse_adam_global_hot_ref(m[rows], v[rows], hot, grads, b1, b2, scaler)
            n = n_rows
            table[:n], m[:n], v[:n] = K.sparse_adam_global_all_ref(table[:n], m[:n], v[:n], n, lr, b1, b2, eps, t)
