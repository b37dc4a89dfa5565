"""Optimizers (dense and sparse) and HugeCTR's learning-rate schedule.

Dense weights live in one flat float32 vector (HugeCTR's layout, spec §7.2), so a dense update is one
kernel launch (numbactr.kernels.optimizers, formulas in its docstring: kernels on gpu/sim, their NumPy
references on cpu). Sparse updates touch the rows a batch used (spec §3.3): they are the fused optimizers
of the embedding engine (numbactr.embedding.engine), which runs HugeCTR's sparse rules in the same pass
that reduces each row's gradient; ``sparse_optimizer_spec`` maps a CreateOptimizer onto them.

Which combinations exist (as in HugeCTR):
  * dense: every Optimizer_t (SGD, MomentumSGD, Nesterov, Adam, AdaGrad, Ftrl); update_type is ignored.
  * sparse (SparseEmbedding): SGD, MomentumSGD, Nesterov, AdaGrad with Local or Global; Adam with Local,
    Global or LazyGlobal. Ftrl raises (HugeCTR: "Invalid optimizer type"); LazyGlobal with anything but
    Adam raises (HugeCTR: "lazy global update is only implemented for Adam").

State arrays are listed in HugeCTR's file order (spec §7.2/§7.3): Adam [m, v], AdaGrad [acc],
MomentumSGD [m], Nesterov [acc], Ftrl [z, n], SGD []. A sparse Adam LazyGlobal keeps one more state in
the engine, the step each row was last updated at (per row, int64, 1 before its first update), which
HugeCTR's sparse opt-state file does not hold: like the step counter it is not saved, and after a
reload both restart (step 0, previous step 1), which is consistent.

Freezing (freeze_dense / freeze_embedding) is lr = 0, as in HugeCTR: the states keep updating and
the weights stay, except that MomentumSGD and Nesterov weights keep moving on their remaining
momentum (HugeCTR does the same) and Ftrl, which divides by lr in HugeCTR (NaN), keeps w and only
accumulates z += g, n += g^2 here.

Deviations from HugeCTR, each the only sensible result where HugeCTR produces NaN:
  * MomentumSGD Global with momentum_factor == 0 (the CreateOptimizer default): HugeCTR divides the hot
    rows' increment by the factor. Here: all rows m *= 0, then the Local rule on the hot rows, which
    is exactly the Global semantics (every row, cold rows g = 0).
  * Adam Global with beta1 == 0 or beta2 == 0 (same division): rejected with a ValueError.
AdaGrad's accumulator starts at initial_accu_value; under numbactr.hugectr_exact.hugectr_exact() it starts
at HugeCTR's byte-memset value instead (see kernels.optimizers.adagrad_initial_accumulator).
"""

from __future__ import annotations

import numpy as np

from numbactr import hugectr_exact
from numbactr.runtime import device
from numbactr.enums import Optimizer_t, Update_t
from numbactr.kernels import optimizers
from numbactr.kernels import optimizers_cpu as C

O, U = Optimizer_t, Update_t

#: every optimizer HugeCTR's dense network accepts (update_type does not apply to dense weights)
DENSE_SUPPORTED = frozenset({O.SGD, O.MomentumSGD, O.Nesterov, O.Adam, O.AdaGrad, O.Ftrl})
#: every (optimizer, update type) HugeCTR's SparseEmbedding accepts
SUPPORTED = frozenset(
    {
        (O.SGD, U.Local),
        (O.SGD, U.Global),
        (O.MomentumSGD, U.Local),
        (O.MomentumSGD, U.Global),
        (O.Nesterov, U.Local),
        (O.Nesterov, U.Global),
        (O.AdaGrad, U.Local),
        (O.AdaGrad, U.Global),
        (O.Adam, U.Local),
        (O.Adam, U.Global),
        (O.Adam, U.LazyGlobal),
    }
)
SPARSE_SUPPORTED = SUPPORTED


def check_supported(opt, where: str, sparse: bool = True) -> None:
    """Raise (NotImplementedError / ValueError, naming `where` and the combination) unless HugeCTR
    accepts ``opt`` for dense weights (sparse=False) or for a SparseEmbedding (sparse=True)."""
    t, u = opt.optimizer_type, opt.update_type
    combo = f"Optimizer_t.{t.name} with Update_t.{u.name}"
    if not sparse:
        if t not in DENSE_SUPPORTED:
            raise NotImplementedError(
                f"{where}: Optimizer_t.{t.name} is not a dense optimizer; "
                f"available: {sorted(o.name for o in DENSE_SUPPORTED)}"
            )
        return
    if t == O.Ftrl:
        raise NotImplementedError(
            f"{where}: {combo}: Ftrl is not available for SparseEmbedding (HugeCTR: 'Invalid optimizer "
            f"type'); it trains dense weights only. Give the embedding its own optimizer, e.g. "
            f"SparseEmbedding(..., optimizer=CreateOptimizer(optimizer_type=Optimizer_t.SGD))"
        )
    if u == U.LazyGlobal and t != O.Adam:
        raise NotImplementedError(
            f"{where}: {combo}: lazy global update is only implemented for Adam (as in HugeCTR); "
            f"use Update_t.Local or Update_t.Global"
        )
    if (t, u) not in SUPPORTED:
        raise NotImplementedError(
            f"{where}: {combo} is not a sparse optimizer; available: "
            f"{sorted(f'{a.name}/{b.name}' for a, b in SUPPORTED)}"
        )
    if t == O.Adam and u == U.Global and (opt.beta1 == 0 or opt.beta2 == 0):
        raise ValueError(
            f"{where}: {combo} needs beta1 > 0 and beta2 > 0 (HugeCTR divides the hot rows' "
            f"moment increments by them; got beta1={opt.beta1}, beta2={opt.beta2}); "
            f"use Update_t.Local"
        )


class LearningRateScheduler:
    """``get_next()`` as HugeCTR's learning_rate_scheduler.hpp (spec §1.1): warmup, then polynomial decay."""

    def __init__(self, base_lr, warmup_steps=1, decay_start=0, decay_steps=1, decay_power=2.0, end_lr=0.0):
        from numbactr.validate import number as _number

        who = "learning-rate scheduler"
        _number(who, "base_lr", base_lr, 0.0)
        _number(who, "end_lr", end_lr, 0.0)
        _number(who, "warmup_steps", warmup_steps, 0, integer=True)
        _number(who, "decay_start", decay_start, 0, integer=True)
        _number(who, "decay_steps", decay_steps, 1, integer=True)
        _number(who, "decay_power", decay_power, 1.0)
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
        init = optimizers.adagrad_initial_accumulator(opt.initial_accu_value, hugectr_exact.hugectr_exact())
        return [xp.full(shape, init, np.float32)]
    return [xp.zeros(shape, np.float32) for _ in range(count)]


class DenseOptimizer:
    """Updates the flat weight vector w (P,) from the flat gradient g (P,): the kernels on gpu/sim, on cpu
    the compiled update (numbactr.kernels.optimizers_cpu; Ftrl and numbactr.runtime.device.reference_ops() run the
    NumPy references)."""

    def __init__(self, opt, n_params: int):
        check_supported(opt, "dense optimizer", sparse=False)
        self.opt, self.t = opt, 0
        self.states = _new_states(opt, (n_params,))
        # None, or a precision.Gate for one step (kernels only): its go = 0 leaves w and the states as they
        # are (the kernels' gate, kernels.optimizers.step_values), a mixed-precision overflow decided on the
        # device (numbactr.train.overflow.gate); Adam then takes its t from the device too
        self.gate = None

    def step(self, w, g, lr: float, scaler: float) -> None:
        o, s = self.opt, self.states
        t = o.optimizer_type
        if t == O.Adam:
            self.t += 1
        # the numba.cuda kernels (gpu, sim), the compiled CPU update (cpu; Ftrl has none) or the reference
        if device.uses_kernels():
            self._kernel_step(w, g, lr, scaler)
            return
        fast = C if device.compiled_cpu() and t != O.Ftrl else None
        f = o.momentum_factor
        if t == O.SGD:
            if fast is not None:
                fast.sgd_update(w, g, lr, scaler)
            else:
                w[...] = optimizers.sgd_update_ref(w, g, lr, scaler)
        elif t == O.MomentumSGD:
            if fast is not None:
                fast.momentum_sgd_update(w, s[0], g, lr, f, scaler)
            else:
                w[...], s[0][...] = optimizers.momentum_sgd_update_ref(w, s[0], g, lr, f, scaler)
        elif t == O.Nesterov:
            if fast is not None:
                fast.nesterov_update(w, s[0], g, lr, f, scaler)
            else:
                w[...], s[0][...] = optimizers.nesterov_update_ref(w, s[0], g, lr, f, scaler)
        elif t == O.Adam:
            args = (lr, o.beta1, o.beta2, o.epsilon, self.t, scaler)
            if fast is not None:
                fast.adam_update(w, s[0], s[1], g, *args)
            else:
                w[...], s[0][...], s[1][...] = optimizers.adam_update_ref(w, s[0], s[1], g, *args)
        elif t == O.AdaGrad:
            if fast is not None:
                fast.adagrad_update(w, s[0], g, lr, o.epsilon, scaler)
            else:
                w[...], s[0][...] = optimizers.adagrad_update_ref(w, s[0], g, lr, o.epsilon, scaler)
        else:  # Ftrl, states [z, n]
            args = (lr, o.beta, o.lambda1, o.lambda2, scaler)
            if fast is not None:
                fast.ftrl_update(w, s[0], s[1], g, *args)
            else:
                w[...], s[0][...], s[1][...] = optimizers.ftrl_update_ref(w, s[0], s[1], g, *args)

    def _step_values(self, lr: float) -> np.ndarray:
        o, t = self.opt, self.opt.optimizer_type
        kind = "adam" if t == O.Adam else "ftrl" if t == O.Ftrl else "sgd"
        return optimizers.step_values(kind, lr, o.beta1, o.beta2, self.t, o.beta, o.lambda2)

    def _replay(self, run: dict) -> None:
        """The host half of a replayed step (numbactr.runtime.step_values): Adam's t, this step's values."""
        if self.opt.optimizer_type == O.Adam:
            self.t += 1
        self._values.put(self._step_values(run["dense_lr"]))

    def _gate_values(self, lr: float, gate) -> tuple:
        """A gated Adam step's host values, on the device: (the host's t, the skips it has seen) and
        (lr, beta1, beta2) in float64 (kernels.optimizers.adam_gate_kernel)."""
        from numbactr.runtime.step_values import held

        o = self.opt
        return (
            held(self, "_gate_t", 2, np.int64).put([self.t, gate.seen]),
            held(self, "_gate_f", 3, np.float64).put([lr, o.beta1, o.beta2]),
        )

    def _kernel_step(self, w, g, lr: float, scaler: float) -> None:
        """The kernels, with this step's lr / alpha_t / l2' in a device array of fixed address
        (numbactr.runtime.step_values): the launch's arguments are the same every step."""
        from numbactr.runtime import step_values

        o, s, t = self.opt, self.states, self.opt.optimizer_type
        values = self._step_values(lr)
        hp = step_values.held(self, "_values", values.shape[0], np.float32).put(values)
        gate = self.gate
        step_values.on_replay(("dense", id(self)), self._replay)
        if gate is not None and t == O.Adam:  # the gate and alpha_t for the device's t
            optimizers.adam_gate(hp, gate.go, gate.skips, *self._gate_values(lr, gate))
            step_values.on_replay(("dense gate", id(self)), lambda run: self._gate_values(run["dense_lr"], gate))
        elif gate is not None:  # after the upload, in stream order (a captured copy)
            hp[hp.shape[0] - 1 :] = gate.go
        f = o.momentum_factor
        if t == O.SGD:
            optimizers.sgd_update(w, g, lr, scaler, hp=hp)
        elif t == O.MomentumSGD:
            optimizers.momentum_sgd_update(w, s[0], g, lr, f, scaler, hp=hp)
        elif t == O.Nesterov:
            optimizers.nesterov_update(w, s[0], g, lr, f, scaler, hp=hp)
        elif t == O.Adam:
            optimizers.adam_update(w, s[0], s[1], g, lr, o.beta1, o.beta2, o.epsilon, self.t, scaler, hp=hp)
        elif t == O.AdaGrad:
            optimizers.adagrad_update(w, s[0], g, lr, o.epsilon, scaler, hp=hp)
        else:
            optimizers.ftrl_update(w, s[0], s[1], g, lr, o.beta, o.lambda1, o.lambda2, scaler, hp=hp)
