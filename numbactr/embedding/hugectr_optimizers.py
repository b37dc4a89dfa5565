"""HugeCTR's sparse optimizers (a CreateOptimizer on a SparseEmbedding or an EmbeddingCollection table) as the
engine's fused optimizer. The rules of which combinations HugeCTR accepts are numbactr.optim.check_supported;
this module only maps an accepted one onto numbactr.embedding.engine's OptimizerSpec."""

from __future__ import annotations

from numbactr import hugectr_exact
from numbactr.embedding.engine import Optim, OptimizerSpec, UpdateType
from numbactr.enums import Optimizer_t as O, Update_t as U
from numbactr.kernels import optimizers
from numbactr.optim import check_supported

#: HugeCTR's sparse optimizers as the engine's fused kinds
SPARSE_KINDS = {
    O.SGD: Optim.HUGECTR_SGD,
    O.MomentumSGD: Optim.HUGECTR_MOMENTUM_SGD,
    O.Nesterov: Optim.HUGECTR_NESTEROV,
    O.Adam: Optim.HUGECTR_ADAM,
    O.AdaGrad: Optim.HUGECTR_ADAGRAD,
}
SPARSE_UPDATES = {U.Local: UpdateType.LOCAL, U.Global: UpdateType.GLOBAL, U.LazyGlobal: UpdateType.LAZY_GLOBAL}


def sparse_optimizer_spec(opt, where: str) -> OptimizerSpec:
    """The engine's fused optimizer for HugeCTR's sparse optimizer ``opt`` (a CreateOptimizer), after
    check_supported. The learning rate and the loss scaler are set per step by the embedding."""
    check_supported(opt, where, sparse=True)
    t = opt.optimizer_type
    return OptimizerSpec(
        SPARSE_KINDS[t],
        learning_rate=0.0,
        eps=opt.epsilon,
        beta1=opt.beta1,
        beta2=opt.beta2,
        momentum=opt.momentum_factor,
        update_type=SPARSE_UPDATES[opt.update_type],
        initial_accumulator=float(
            optimizers.adagrad_initial_accumulator(opt.initial_accu_value, hugectr_exact.hugectr_exact())
        )
        if t == O.AdaGrad
        else 0.0,
    )
