"""SOK's optimizer wrappers for PyTorch: one step() trains the dense parameters with torch's optimizer and the
SOK tables with the engine's fused optimizers (imports torch).

SOK (TensorFlow) wraps a Keras optimizer so that apply_gradients also updates its DynamicVariables
(sok.OptimizerWrapper: the optimizer's rule on a static copy of the rows the batch touched), trains a
sok.Variable (a tf.Variable) with the Keras optimizer itself, and offers its own sok.SGD and, in its first
API, sok.optimizers.Adam (HugeCTR's Adam over every row, "global"). Here:

  OptimizerWrapper(torch_optimizer)   the optimizer's parameter groups may hold SOK placeholders (a layer's
        or variable's ``placeholder``, which model.parameters() yields): those tables are trained by the
        engine with the group's hyper-parameters, read again at every step (so an LR scheduler attached to
        the wrapped optimizer reaches them), the rest by the torch optimizer:
          torch.optim.SGD (momentum 0)    w -= lr g on the touched rows                  (EXACT_SGD)
          torch.optim.Adam                Keras' Adam (SOK's tf.keras.optimizers.Adam):
                                          m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
                                          w -= lr sqrt(1-b2^t)/(1-b1^t) m / (sqrt(v) + eps)  (HUGECTR_ADAM)
                                          on a DynamicVariable and the layers: the touched rows only (SOK's
                                          wrapper hands Keras a copy of just those rows; torch.optim.SparseAdam's
                                          and HugeCTR's Adam Local rule); on a sok.Variable: every row, g = 0
                                          where untouched (Keras' _resource_apply_sparse decays all of m and v
                                          and moves every row: the dense rule; HugeCTR's Update_t.Global)
                                          (torch.optim.Adam's own dense rule adds eps after the bias correction
                                          instead: the same update unless sqrt(v) is near eps)
          torch.optim.SparseAdam          the touched-rows rule above on every table
          torch.optim.Adagrad             s += g^2; w -= lr g / (sqrt(s) + eps), s from
                                          initial_accumulator_value, touched rows        (HUGECTR_ADAGRAD)
        g is each touched row's gradient summed over the step's occurrences (every lookup of the table since
        the last step). t counts the wrapper's steps that applied a table gradient (SOK's wrapper counts
        its apply_gradients calls, Keras its iterations): every table the wrapper holds uses the same t, also
        one that had no gradient at earlier steps. Weight decay, momentum, amsgrad, lr_decay, maximize: not
        implemented for tables (an error).
  SGD(params, lr)                     SOK's sok.SGD: OptimizerWrapper(torch.optim.SGD(params, lr)).
  Adam(params, learning_rate, beta_1, beta_2, epsilon)   SOK's sok.optimizers.Adam: HugeCTR's Adam with
        Update_t.Global on SOK tables only (every row in use moves every step: m, v decay, w -= alpha_t
        m / (sqrt(v) + eps)); dense parameters are an error (train them with a torch optimizer).
  SGD and Adam take SOK's variables and layers themselves as well as their placeholders (SOK passes its
  variables to the optimizer).

step() applies the gradients the tables hold since the last step (loss.backward() only holds them) and
then steps the torch optimizer; zero_grad() drops both. A table's gradient is applied by the step of a
wrapper that holds it only: a plain torch optimizer never updates a SOK table (its second backward is an
error naming the fix). state_dict() / load_state_dict() carry the torch optimizer's state, the wrapper's
step count and the tables' optimizer states (this rank's rows; load the model's state_dict first).
Under mpiexec call numbactr.sok.average_gradients(model) between backward() and step() for the dense part;
the tables are model-parallel already.
"""

from __future__ import annotations

import torch

from numbactr.embedding.engine import Optim, OptimizerSpec, UpdateType

__all__ = ["OptimizerWrapper", "SGD", "Adam", "filter_variables", "split_embedding_variable_from_others"]


def _table(p):
    return getattr(p, "_sok_table", None)


def _sok_object(v) -> bool:
    """A numbactr.sok variable or layer (a module with a SOK placeholder)."""
    return isinstance(v, torch.nn.Module) and _table(getattr(v, "placeholder", None)) is not None


def filter_variables(variables):
    """SOK's sok.filter_variables: (SOK tables, everything else) of a list of SOK variables / layers,
    placeholders and other parameters, or of a module (its parameters: (placeholders, other parameters)).
    SOK's Variable, DynamicVariable and layers go to the first list as themselves, placeholders as
    placeholders (both are what sok.SGD / sok.Adam take)."""
    params = (
        variables.parameters()
        if isinstance(variables, torch.nn.Module) and not _sok_object(variables)
        else ([variables] if _sok_object(variables) else variables)
    )
    sok, other = [], []
    for p in params:
        (sok if _table(p) is not None or _sok_object(p) else other).append(p)
    return sok, other


def _parameters(params) -> list:
    """params (a module, an iterable of tensors or of parameter-group dicts) with SOK variables and layers
    replaced by their placeholders (SOK's optimizers take the variables themselves)."""
    if isinstance(params, torch.nn.Module) and not _sok_object(params):
        return list(params.parameters())
    if _sok_object(params) or isinstance(params, torch.Tensor):
        params = [params]
    out = []
    for p in params:
        if isinstance(p, dict):
            group = dict(p)
            group["params"] = _parameters(group["params"])
            out.append(group)
        else:
            out.append(p.placeholder if _sok_object(p) else p)
    return out


split_embedding_variable_from_others = filter_variables  # SOK's first API name


def _unsupported(optimizer, group, what: dict) -> None:
    bad = {k: group.get(k) for k, ok in what.items() if not ok(group.get(k))}
    if bad:
        raise NotImplementedError(
            f"numbactr.sok: {type(optimizer).__name__} with {bad} is not implemented for SOK "
            "tables (their fused optimizers take plain SGD, Adam and Adagrad)"
        )


def engine_optimizer(optimizer, group: dict, table=None) -> OptimizerSpec:
    """The engine optimizer that applies torch optimizer ``optimizer``'s rule, with parameter group
    ``group``'s hyper-parameters, to a table (module docstring; torch.optim.Adam: the table's adam_update)."""
    lr = float(group["lr"])
    off = lambda v: not v  # noqa: E731 (flags that must be off / zero)
    kind = type(optimizer)
    if kind is torch.optim.SGD:
        _unsupported(optimizer, group, {"momentum": off, "weight_decay": off, "nesterov": off, "maximize": off})
        return OptimizerSpec(Optim.EXACT_SGD, learning_rate=lr)
    if kind in (torch.optim.Adam, torch.optim.SparseAdam):
        _unsupported(
            optimizer, group, {"weight_decay": off, "amsgrad": off, "maximize": off, "decoupled_weight_decay": off}
        )
        b1, b2 = (float(b) for b in group["betas"])
        every_row = kind is torch.optim.Adam and table is not None and table.adam_update == UpdateType.GLOBAL
        if every_row and (b1 == 0 or b2 == 0):
            raise NotImplementedError(
                f"numbactr.sok: {table.who}: torch.optim.Adam with betas {(b1, b2)} is not "
                "implemented for a sok.Variable (Keras' every-row Adam needs beta1 > 0 and "
                "beta2 > 0 here); wrap torch.optim.SparseAdam for the touched-rows rule"
            )
        return OptimizerSpec(
            Optim.HUGECTR_ADAM,
            learning_rate=lr,
            beta1=b1,
            beta2=b2,
            eps=float(group["eps"]),
            update_type=UpdateType.GLOBAL if every_row else UpdateType.LOCAL,
        )
    if kind is torch.optim.Adagrad:
        _unsupported(optimizer, group, {"weight_decay": off, "lr_decay": off, "maximize": off})
        return OptimizerSpec(
            Optim.HUGECTR_ADAGRAD,
            learning_rate=lr,
            eps=float(group["eps"]),
            initial_accumulator=float(group["initial_accumulator_value"]),
        )
    raise NotImplementedError(
        f"numbactr.sok: {kind.__name__} cannot train SOK tables; wrap torch.optim.SGD, "
        "torch.optim.Adam / SparseAdam or torch.optim.Adagrad"
    )


class OptimizerWrapper:
    """SOK's sok.OptimizerWrapper around a torch optimizer (module docstring). Attributes other than step,
    zero_grad, state_dict, load_state_dict, iterations and the wrapped ``optimizer`` are the torch
    optimizer's (param_groups, state...); the tables' optimizer states live in the tables.

    iterations: the steps so far that applied a table gradient (SOK's wrapper's iterations): Adam's t of
    the next step is iterations + 1, for every table this wrapper holds.
    """

    def __init__(self, optimizer):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"OptimizerWrapper wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.iterations = 0
        self._tables = []  # (table, its parameter group)
        for group in optimizer.param_groups:
            for p in group["params"]:
                table = _table(p)
                if table is not None:
                    table.set_optimizer(self._spec(group, table))
                    self._tables.append((table, group))
        for table, _ in self._tables:
            table.wrappers.add(self)

    def _spec(self, group: dict, table=None) -> OptimizerSpec:
        return engine_optimizer(self.optimizer, group, table)

    def step(self, closure=None):
        """Apply the tables' held gradients with their fused optimizers (step t = iterations + 1 for every
        table), then step the torch optimizer. closure (torch's): re-evaluates the model (forward +
        backward) first; its loss is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if any(table.has_gradient() for table, _ in self._tables):
            self.iterations += 1
        for table, group in self._tables:
            table.set_optimizer(self._spec(group, table))  # the group's hyper-parameters now
            if table.has_gradient():
                table.engine.step = self.iterations - 1  # the engine's update is its step + 1
                table.apply()
        self.optimizer.step()
        return loss

    def state_dict(self) -> dict:
        """The torch optimizer's state_dict plus "sok_iterations" (this wrapper's step count) and
        "sok_tables": per table this wrapper trains (in parameter order), the engine optimizer's state of
        the rows this rank holds (keys, states, the table's last step)."""
        sd = self.optimizer.state_dict()
        sd["sok_iterations"] = self.iterations
        sd["sok_tables"] = [_tensors(table.optimizer_state()) for table, _ in self._tables]
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """state_dict() of the same model and optimizer on this rank; load the model's state_dict first (a
        keyed table must hold the keys whose states come back). Every table's state is checked before
        any changes. A state dict saved before "sok_iterations" existed resumes at the largest of its
        tables' step counts (each table counted its own updates then)."""
        sd = dict(state_dict)
        tables = sd.pop("sok_tables", None)
        iterations = sd.pop("sok_iterations", None)
        if tables is None:
            if self._tables:
                raise ValueError(
                    "OptimizerWrapper.load_state_dict: the state has no 'sok_tables' entry, so it "
                    f"cannot restore the optimizer states of this wrapper's {len(self._tables)} SOK "
                    "table(s)"
                )
            tables = []
        if len(tables) != len(self._tables):
            raise ValueError(
                f"OptimizerWrapper.load_state_dict: the state has {len(tables)} SOK table(s), this "
                f"wrapper trains {len(self._tables)}"
            )
        states = [_arrays(st) for st in tables]
        for (table, _), st in zip(self._tables, states):  # checks first (a bad state changes nothing)
            table.check_optimizer_state(st)
        if iterations is None:
            iterations = max([int(st["step"]) for st in states], default=self.iterations)
        self.optimizer.load_state_dict(sd)
        for (table, _), st in zip(self._tables, states):
            table.load_optimizer_state(st)
        self.iterations = int(iterations)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The torch optimizer's zero_grad, and the tables' held gradients dropped."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for table, _ in self._tables:
            table.drop_gradient()

    def __getattr__(self, name):
        if name in ("optimizer", "_tables", "iterations"):  # not set yet (during __init__)
            raise AttributeError(name)
        return getattr(self.optimizer, name)


def _tensors(st: dict) -> dict:
    """A table's optimizer_state() with torch tensors in place of arrays (torch.save's usual contents)."""
    return {
        **st,
        "keys": torch.from_numpy(st["keys"]),
        "states": {k: torch.from_numpy(v) for k, v in st["states"].items()},
    }


def _arrays(st: dict) -> dict:
    if not isinstance(st, dict) or not {"optimizer", "step", "keys", "states"} <= set(st):
        raise ValueError(
            "OptimizerWrapper.load_state_dict: each 'sok_tables' entry must hold optimizer, step, keys and states"
        )
    arr = lambda v: v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return {**st, "keys": arr(st["keys"]), "states": {k: arr(v) for k, v in st["states"].items()}}


class SGD(OptimizerWrapper):
    """SOK's sok.SGD(lr): plain SGD, w -= lr g, for SOK tables (and any dense parameters in params)."""

    def __init__(self, params, lr: float):
        super().__init__(torch.optim.SGD(_parameters(params), lr=lr))


class Adam(OptimizerWrapper):
    """SOK's sok.optimizers.Adam: HugeCTR's Adam with Update_t.Global on SOK tables (module docstring).

    params: SOK variables / layers or their placeholders (e.g. sok.filter_variables(model)[0]); learning_rate
    (or lr), beta_1, beta_2,
    epsilon: SOK's names and defaults (Keras': epsilon 1e-7). The learning rate may change between steps
    through param_groups[i]['lr'].
    """

    def __init__(
        self,
        params,
        learning_rate: float = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        **kwargs,
    ):
        lr = kwargs.pop("lr", learning_rate)
        if kwargs:
            raise TypeError(f"sok Adam: unexpected arguments {sorted(kwargs)}")
        params = _parameters(params)
        dense = [tuple(p.shape) for p in params if _table(p) is None]
        if dense:
            raise ValueError(
                f"sok Adam updates SOK tables only (SOK's rule); {len(dense)} other parameter(s) were "
                f"given (shapes {dense[:3]}...): train them with a torch optimizer, "
                "sok.filter_variables splits them"
            )
        super().__init__(torch.optim.Adam(params, lr=lr, betas=(beta_1, beta_2), eps=epsilon))

    def _spec(self, group: dict, table=None) -> OptimizerSpec:
        b1, b2 = (float(b) for b in group["betas"])
        return OptimizerSpec(
            Optim.HUGECTR_ADAM,
            learning_rate=float(group["lr"]),
            beta1=b1,
            beta2=b2,
            eps=float(group["eps"]),
            update_type=UpdateType.GLOBAL,
        )
