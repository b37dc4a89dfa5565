"""The training loss kept on the device and read when asked for (numbactr/model.py: Model._keep_loss,
Model.current_loss): on gpu and sim (one rank or several, with or without a regularizer) a step reads no
loss to the host.
The lazy path is array-library code only, so it is forced on here on every device (cpu included) and
compared with the eager read of the same steps."""

import numpy as np
import pytest

import numbactr as hugectr
import numbactr.model as model_mod
from numbactr.train import overflow
from numbactr.train import step as train_step
from numbactr.kernels import launch
from tests.model_util import tiny_data, tiny_dlrm


def _pair(tmp_path, monkeypatch, n_train=256):
    tr, ev = tiny_data(str(tmp_path), n_train=n_train, n_eval=64)
    eager = tiny_dlrm(tr, ev, batch=32, optimizer=hugectr.Optimizer_t.SGD)
    lazy = tiny_dlrm(tr, ev, batch=32, optimizer=hugectr.Optimizer_t.SGD)
    _lazy_for(monkeypatch, {eager: False, lazy: True})
    return eager, lazy


def _lazy_for(monkeypatch, choices: dict) -> None:
    """numbactr.train.step.lazy_loss answers ``choices[model]`` for these models, as before for others."""
    real, by_id = train_step.lazy_loss, {id(m): v for m, v in choices.items()}
    monkeypatch.setattr(train_step, "lazy_loss", lambda model: by_id.get(id(model), real(model)))


def _step_reads(model) -> int:
    """The host reads of one training step of model."""
    launch.reset_counts()
    assert model.train()
    return launch.reset_counts()["host_reads"]


def test_lazy_loss_equals_eager_and_reads_once(tmp_path, monkeypatch):
    eager, lazy = _pair(tmp_path, monkeypatch)
    for _ in range(3):
        eager_reads, lazy_reads = _step_reads(eager), _step_reads(lazy)
        assert lazy_reads == eager_reads - 1, (lazy_reads, eager_reads)  # the loss is not read in the step
        assert lazy._pending_loss is not None
        loss = lazy.get_current_loss()
        assert launch.reset_counts()["host_reads"] == 1  # read when asked for
        assert loss == eager.get_current_loss() and np.isfinite(loss)  # same float math, same value
        assert lazy.get_current_loss() == loss
        assert launch.reset_counts()["host_reads"] == 0  # and only once
    np.testing.assert_array_equal(np.asarray(lazy.weights), np.asarray(eager.weights))


def test_unread_lazy_loss_is_replaced_by_the_next_step(tmp_path, monkeypatch):
    eager, lazy = _pair(tmp_path, monkeypatch)
    for _ in range(2):
        assert eager.train() and lazy.train()  # step 1's loss is never read on the lazy model
    assert lazy.get_current_loss() == eager.get_current_loss()
    lazy.current_loss = 1.5  # a value set by hand drops a pending one
    assert lazy._pending_loss is None and lazy.get_current_loss() == 1.5


def _poison(model):
    fc2 = next(layer for layer in model.layers if layer.cfg.top_names == ["fc2"])
    fc2.params[0].data[0, 0] = np.inf


def test_lazy_non_finite_loss_stops_at_its_step_in_host_memory(tmp_path, monkeypatch):
    _, lazy = _pair(tmp_path, monkeypatch)
    assert lazy.train() and lazy.train()
    _poison(lazy)
    before = np.array(lazy.weights).copy()
    with (
        pytest.raises(
            FloatingPointError,
            match=r"non-finite training loss at iteration 3: BinaryCrossEntropyLoss "
            r"'loss' = nan",
        ),
        np.errstate(all="ignore"),
    ):
        lazy.train()
    assert lazy.step == 2
    np.testing.assert_array_equal(np.array(lazy.weights), before)


def test_lazy_non_finite_loss_on_a_gpu_uses_the_device_flag(tmp_path, monkeypatch):
    """Device memory (emulated): the kept loss feeds the device-side non-finite flag, read every
    NONFINITE_CHECK_EVERY iterations, and the error names the first bad iteration."""
    monkeypatch.setattr(overflow, "_host_memory", lambda a: False)
    monkeypatch.setattr(model_mod.Model, "NONFINITE_CHECK_EVERY", 4)
    _, lazy = _pair(tmp_path, monkeypatch, n_train=512)
    for _ in range(5):
        assert lazy.train()
    _poison(lazy)
    with np.errstate(all="ignore"):
        assert lazy.train() and lazy.train()  # 6 (first non-finite) and 7: not read yet
        assert np.isnan(lazy.get_current_loss())  # a display would see it
        with pytest.raises(
            FloatingPointError,
            match=r"first at iteration 6, found at iteration 8 \(keeping the "
            r"loss on the device, a GPU run checks every 4 iterations\)",
        ):
            lazy.train()


def test_lazy_loss_choice():
    """gpu/sim: lazy, on one rank or several (the ranks' sum is kept on the device:
    tests/test_step_counts.py::test_several_ranks_step_reads_nothing_back), with a regularizer too (its term
    kept beside the losses); cpu: read in the step."""

    class Layer:
        regularizer = None

    m = model_mod.Model.__new__(model_mod.Model)
    m.ranks, m.losses = 1, [(Layer(), 1.0)]
    kind = model_mod.device.kind()
    assert train_step.lazy_loss(m) == (kind != "cpu")
    m.ranks = 2
    assert train_step.lazy_loss(m) == (kind != "cpu")
    m.ranks = 1
    reg = Layer()
    reg.regularizer = ("L2", 0.1)
    m.losses = [(reg, 1.0)]
    assert train_step.lazy_loss(m) == (kind != "cpu")


@pytest.mark.parametrize("reg", [hugectr.Regularizer_t.L2, hugectr.Regularizer_t.L1])
def test_regularized_loss_is_kept_on_the_device(tmp_path, on_device, reg, monkeypatch):
    """sim: a loss layer with a regularizer no longer reads its term in the step (the regularizer kernel's
    block sum is kept beside the loss, from the weights before the update); the value read later is the
    one the eager read gives, to the last bit, and equals the plain model's loss + the term."""
    from tests.test_regularized_model import build

    on_device("sim")
    data = tiny_data(str(tmp_path))
    eager, lazy, plain = build(data, reg, 0.5), build(data, reg, 0.5), build(data)
    _lazy_for(monkeypatch, {eager: False})
    assert train_step.lazy_loss(lazy)
    w0 = np.array(lazy.weights, dtype=np.float64)
    assert eager.train() and lazy.train() and plain.train()
    b, lam = 16, 0.5
    term = lam / (2 * b) * np.sum(w0**2) if reg == hugectr.Regularizer_t.L2 else lam / b * np.sum(np.abs(w0))
    assert lazy.get_current_loss() == pytest.approx(plain.get_current_loss() + term, rel=1e-5)
    for _ in range(2):
        eager_reads, lazy_reads = _step_reads(eager), _step_reads(lazy)
        assert lazy_reads == eager_reads - 2, (lazy_reads, eager_reads)  # neither the loss nor the term is read
        assert lazy.get_current_loss() == eager.get_current_loss()  # same float math, same value
    np.testing.assert_array_equal(np.asarray(lazy.weights), np.asarray(eager.weights))
