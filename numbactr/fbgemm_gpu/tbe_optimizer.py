"""TBECore's optimizer plumbing beyond the engine's fused update: FBGEMM's optimizer-state views and names,
hyper-parameters, global weight decay, EMA in place and the writeback mask.

Contract (FBGEMM 1.8's):
    DECOUPLE_GLOBAL    f = max(lower_bound, (1 - lr wd) ** max(iter - prev_iter - 1, 0)) per row (1 while
                       prev_iter = 0); the forward reads f w, the backward stores f w, sets prev_iter = iter,
                       then runs DECOUPLE's update
    EMAINPLACE         every step_ema iterations from step_start on: slow += step_ema_coef * (fast - slow),
                       fast = a row's first D/2 values, slow = the rest (torch.lerp_'s rounding)
    writeback (SGD)    only the first occurrence of each (feature, index) keeps its dLoss/doutput
The rows' arithmetic is the engine's (TableBatchedEmbedding.touched_rows, scale_rows, lerp_halves: one op on
the device each); this module decides when, which rows and which factors (FBGEMM's scalars, computed with the
device's array library, no host copy). TBEOptimizerState is mixed into TBECore (array_tbe.py), whose
attributes it reads.
"""

from __future__ import annotations

import numpy as np

from numbactr.runtime import device
from numbactr.embedding.engine import (
    CounterWeightDecay,
    TableBatchedEmbedding,
    WeightDecay,
    lerp_halves_of,
    state_specs,
)
from numbactr.fbgemm_gpu.optimizer_config import (
    CounterBasedRegularizationDefinition,
    CowClipDefinition,
    UserEnabledConfigDefinition,
)
from numbactr.fbgemm_gpu.split_embedding_configs import EmbOptimType
from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode, WeightDecayMode
from numbactr.fbgemm_gpu.tbe_args import (
    _DECAYS,
    _EXTRA_STATE_NAMES,
    _STATE_NAMES,
    WHO,
    FBGEMMAssertion,
    OptimizerArgs,
    _enum,
    _value,
)


class TBEOptimizerState:
    """TBECore's optimizer methods (FBGEMM's names): states, hyper-parameters, and the rules around the
    fused update (global weight decay, ema_inplace, the writeback mask)."""

    # ---- around the update ---------------------------------------------------------------------------
    def _decay_factors(self, rows, iteration: int):
        """FBGEMM's global weight decay factor of each linear row of `rows` at `iteration` (arrays of the
        engine's device): f = max(lower_bound, (1 - lr wd) ** max(iteration - prev_iter - 1, 0)), 1 for a row
        never updated (prev_iter = 0)."""
        xp = device.xp()
        eng = self.engine
        lr = np.float32(eng.learning_rate)
        base = np.float32(np.float32(1.0) - lr * np.float32(eng.optimizer.weight_decay))
        p = eng.row_state("prev_iter")[rows]
        n = xp.maximum(np.float32(iteration) - p - np.float32(1.0), np.float32(0.0)).astype(np.float32)
        factor = xp.maximum(np.float32(self.gwd_lower_bound), xp.power(base, n).astype(np.float32))
        return xp.where(p == 0, np.float32(1.0), factor).astype(np.float32)

    def _decayed_lookup(self, indices, offsets, per_sample_weights, feature_requires_grad, iteration: int):
        """(output, ctx, rows) of a lookup that reads each of its rows scaled by its global weight decay at
        `iteration` and leaves the tables as they were (FBGEMM's forward only scales what it reads). rows: the
        distinct linear rows the lookup reads (after the bounds check's repairs), which the backward decays.
        A FATAL bounds check raises in the engine's lookup, before anything is scaled."""
        eng = self.engine
        ctx = eng.lookup(indices, offsets, per_sample_weights, feature_requires_grad=feature_requires_grad)
        rows = eng.touched_rows(ctx)
        saved = eng.copy_rows(rows)
        eng.scale_rows(rows, self._decay_factors(rows, iteration))
        try:
            out = eng.pool(ctx)
        finally:
            eng.restore_rows(rows, saved)
        return out, ctx, rows

    def _decay_before_update(self, rows, iteration: int) -> tuple:
        """The backward's global weight decay, before its DECOUPLE update (as FBGEMM's backward): `rows` scaled
        by their factors and their prev_iter set to `iteration`; float16 rows round after the decay (FBGEMM
        scales in registers) and again after the update. Returns what _undo_decay puts back."""
        eng = self.engine
        prev = eng.row_state("prev_iter")
        saved = (eng.copy_rows(rows), prev[rows].copy())
        eng.scale_rows(rows, self._decay_factors(rows, iteration))
        prev[rows] = np.float32(iteration)
        return saved

    def _undo_decay(self, rows, saved: tuple) -> None:
        """Put back the rows and prev_iter _decay_before_update changed."""
        self.engine.restore_rows(rows, saved[0])
        self.engine.row_state("prev_iter")[rows] = saved[1]

    def decays_globally(self, iteration: int, training: bool) -> bool:
        """Whether a forward at `iteration` applies global weight decay: in training, DECOUPLE_GLOBAL with a
        weight_decay above 0 (FBGEMM's condition: with 0, prev_iter is never written), from
        global_weight_decay.start_iter on."""
        return bool(
            training
            and self.global_weight_decay
            and iteration >= self.gwd_start_iter
            and self.engine.optimizer.weight_decay > 0
        )

    def ema_inplace(self, iteration: int, emainplace_mode: dict | None = None) -> None:
        """FBGEMM's EMAINPLACE_ROWWISE_ADAGRAD step, which its training forwards take before the lookup: each
        row is a fast half (its first D/2 values, trained) and a slow half (the rest), and every step_ema
        iterations from step_start on, slow += step_ema_coef * (fast - slow) over the whole table.
        emainplace_mode: FBGEMM's dict of floats (default: this module's EmainplaceModeDefinition)."""
        mode = self.emainplace_mode if emainplace_mode is None else emainplace_mode
        iteration = int(iteration)
        if iteration % int(mode["step_ema"]) or iteration < int(mode["step_start"]):
            return
        for t, spec in enumerate(self.embedding_specs):
            dim = int(spec[1])
            if dim % 2:
                raise FBGEMMAssertion(
                    f"{WHO}: table {t}'s dimension {dim} is odd, not supported for ema_inplace_rowwise_adagrad"
                )
        coef = float(mode["step_ema_coef"])
        if isinstance(self.engine, TableBatchedEmbedding):
            self.engine.lerp_halves(coef)
        else:  # a cache (MANAGED_CACHING): flushed and emptied, the backing tier's host rows
            lerp_halves_of(self.split_embedding_weights(), coef)

    def _writeback_mask(self, indices, offsets):
        """FBGEMM's writeback (use_writeback_bwd_prehook, EXACT_SGD): SGD with lr 1 and a gradient of
        (old - new) "assigns" a row, so only the first occurrence of each (feature, index) in the batch keeps
        its gradient; the others' dLoss/doutput are zeroed. writeback_first_feature_only: only feature 0's
        first occurrences keep theirs (the other features are read-only). Returns the 0/1 float32 mask of
        dLoss/doutput: (N, 1) for PoolingMode.NONE, else (B, total_D), whose bags must hold at most one index
        (FBGEMM's writeback is for one-hot bags; it would misplace longer ones)."""
        xp = device.xp()
        idx, off = indices.astype(np.int64), offsets.astype(np.int64)
        n_feat = len(self.feature_table_map)
        n_bags = int(off.shape[0]) - 1
        batch = n_bags // n_feat
        lengths = xp.maximum(off[1:] - off[:-1], 0)
        bag = xp.repeat(xp.arange(n_bags, dtype=np.int64), lengths)[: idx.shape[0]]  # each index's bag
        considered = bag < batch if self.writeback_first_feature_only else xp.ones(bag.shape[0], bool)
        keep = xp.zeros(bag.shape[0], bool)
        if bag.shape[0]:
            span = int(idx.max()) + 1
            key = xp.where(considered, (bag // batch) * span + idx, -1)
            _, first = xp.unique(key, return_index=True)
            keep[first] = True
            keep &= considered
        if self.pooling_mode == PoolingMode.NONE:
            return keep.astype(np.float32)[:, None]
        if bag.shape[0] and int(lengths.max()) > 1:
            raise ValueError(
                f"{WHO}: use_writeback_bwd_prehook with pooling needs bags of at most one index "
                f"(one-hot features); a bag here holds {int(lengths.max())}"
            )
        bag_keep = xp.ones(n_bags, np.float32)
        bag_keep[bag[~keep]] = 0.0
        if self.writeback_first_feature_only:
            bag_keep[batch:] = 0.0
        return xp.repeat(bag_keep.reshape(n_feat, batch).T, xp.asarray(self.feature_dims), axis=1)

    # ---- state ------------------------------------------------------------------------------------------
    def split_optimizer_states(self) -> list:
        """Per table, [momentum1 (, momentum2)] views in FBGEMM's order; [] for EXACT_SGD (FBGEMM's)."""
        self._need_optimizer("Getting optimizer states")
        states = self.engine.split_optimizer_states()
        return states if any(states) else []

    def optimizer_state_names(self) -> tuple:
        """get_optimizer_state()'s key of each state (PyTorch's names: sum, exp_avg, exp_avg_sq; then
        prev_iter, row_counter where the optimizer's mode keeps them)."""
        self._need_optimizer("Getting optimizer state")
        if self.optimizer not in _STATE_NAMES:  # FBGEMM names no states for LARS_SGD either
            raise NotImplementedError(f"Getting optimizer state {self.optimizer} is not implemented")
        names = _STATE_NAMES[self.optimizer]
        extra = [_EXTRA_STATE_NAMES[name] for name, _, _ in state_specs(self.engine.optimizer)[len(names) :]]
        return names + tuple(extra)

    @property
    def state_wants_iter(self) -> bool:
        """FBGEMM's get_optimizer_state adds "iter" for COUNTER with CounterWeightDecayMode.ADAGRADW."""
        opt = self.engine.optimizer
        return self.global_weight_decay or (
            opt.weight_decay_mode == WeightDecay.COUNTER
            and int(opt.counter.weight_decay_mode) == int(CounterWeightDecay.ADAGRADW)
        )

    @property
    def max_counter(self):
        """COUNTER / COWCLIP's max_counter, a (1,) float32 array of the engine's device (1 elsewhere)."""
        eng = self.engine
        return getattr(eng, "engine", eng).max_counter

    def set_learning_rate(self, lr: float) -> None:
        self._need_optimizer("Setting learning rate")
        self.engine.learning_rate = float(lr)

    def optimizer_args(self) -> OptimizerArgs:
        """FBGEMM's OptimizerArgs of this module, as its constructor fills them (the current eps, betas and
        weight decay: update_hyper_parameters changes them)."""
        cfg, hp = self.config, self.engine.optimizer if hasattr(self.engine, "optimizer") else None
        counter = cfg.counter_based_regularization or CounterBasedRegularizationDefinition()
        cowclip = cfg.cowclip_regularization or CowClipDefinition()
        extra = cfg.extra_optimizer_config or UserEnabledConfigDefinition()
        mode = _enum(WeightDecayMode, cfg.weight_decay_mode, "weight_decay_mode")
        counted = self.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD and mode in (
            WeightDecayMode.COUNTER,
            WeightDecayMode.COWCLIP,
        )
        if counted:
            kept = counter if mode == WeightDecayMode.COUNTER else cowclip
            arg_mode, halflife = int(_value(kept.counter_weight_decay_mode)), int(kept.counter_halflife)
        else:
            arg_mode, halflife = int(_value(mode)), -1

        def current(name, default):
            return float(getattr(hp, name, default)) if hp is not None else float(default)

        return OptimizerArgs(
            bool(cfg.stochastic_rounding),
            bool(cfg.gradient_clipping),
            float(cfg.max_gradient),
            float(cfg.max_norm),
            current("eps", cfg.eps),
            current("beta1", cfg.beta1),
            current("beta2", cfg.beta2),
            current("weight_decay", cfg.weight_decay),
            arg_mode,
            float(cfg.eta),
            float(cfg.momentum),
            halflife,
            int(counter.adjustment_iter),
            float(counter.adjustment_ub),
            int(_value(counter.learning_rate_mode)),
            int(_value(counter.grad_sum_decay)),
            float(counter.tail_id_threshold.val),
            int(counter.tail_id_threshold.is_ratio),
            int(sum(int(spec[0]) for spec in self.embedding_specs)),
            float(cowclip.weight_norm_coefficient),
            float(cowclip.lower_bound),
            int(_value(mode)),
            bool(extra.use_rowwise_bias_correction),
        )

    def get_learning_rate(self) -> float:
        """The rate as FBGEMM reads it back: float32 (its learning_rate_tensor)."""
        return float(np.float32(self.engine.learning_rate))

    def update_hyper_parameters(self, params_dict: dict) -> None:
        """FBGEMM's names: lr, eps, beta1, beta2, weight_decay and lower_bound (global weight decay's)."""
        self._need_optimizer("Setting hyper-parameters")
        unknown = sorted(set(params_dict) - {"lr", "eps", "beta1", "beta2", "weight_decay", "lower_bound"})
        if unknown:
            raise NotImplementedError(f"Setting hyper-parameter {unknown[0]} is not supported")
        values = {
            ("learning_rate" if k == "lr" else k): float(v)
            for k, v in params_dict.items()
            if k != "lower_bound" and not (k == "weight_decay" and self.optimizer not in _DECAYS)
        }
        self.engine.set_hyper_parameters(**values)
        if "lower_bound" in params_dict:
            self.gwd_lower_bound = float(params_dict["lower_bound"])  # global weight decay's floor

    def _need_optimizer(self, what: str) -> None:
        if self.optimizer == EmbOptimType.NONE:
            raise NotImplementedError(f"{what} is not supported for {self.optimizer}")
