"""CUDA graphs of the training step (numbactr.train.cuda_graphs), what can be checked without a GPU.

A replayed graph runs none of the step's Python: the host halves that the step registered while it was
recorded (numbactr.runtime.step_values.on_replay) must alone bring the host counters and the per-step device values
to what an eager step brings them to. Here, on the simulator, model B records its second step and then
"replays" its third (the host halves only), model A runs both steps eagerly: the values every kernel of
step 3 would read (learning rate, Adam's t and bias corrections, rounding salts, the dropout step, the step
number of the non-finite flag) and the counters must agree. The launches themselves are checked to be the
same every step in tests/test_step_counts.py."""

import dataclasses
import types
import gc

import numpy as np
import pytest
from numba import config

import numbactr as hugectr
from numbactr.train import cuda_graphs, overflow, step
from numbactr.runtime import step_values
from numbactr.bench.mlperf import DENSE, SLOTS, build_mlperf_dlrm
from tests.model_util import tiny_data

sim_only = pytest.mark.skipif(not config.ENABLE_CUDASIM, reason="records the simulator's steps")


@pytest.fixture(autouse=True)
def _sim():
    """The simulator in a simulator session (an earlier module may have left it on cpu); the GPU on one.
    Afterwards the test's models are collected, which stops their readers' worker threads."""
    from numbactr.runtime import device

    if config.ENABLE_CUDASIM:
        device.set_device("sim")  # (conftest's autouse fixture switches back)
    yield
    gc.collect()


def _model(tmp_path, optimizer, amp=False):
    train, evl = tiny_data(str(tmp_path), n_train=16, n_eval=8, slots=SLOTS, dense=DENSE, keys_per_slot=2, files=1)
    m = build_mlperf_dlrm(
        hugectr,
        train,
        evl,
        batch=4,
        dim=4,
        optimizer=optimizer,
        workspace_mb=1,
        bottom=(8,),
        top=(8, 4, 1),
        dropout=0.25,
        amp=amp,
    )
    m.solver = dataclasses.replace(m.solver, repeat_dataset=True)
    return m


def _device_values(m) -> dict:
    """Every per-step device array of the model's consumers, by name."""
    out = {"dense": np.array(m.dense_optimizer._values.dev)}
    if getattr(m.dense_optimizer, "_gate_t", None) is not None:  # mixed precision: Adam's gated t
        out["dense.gate_t"] = np.array(m.dense_optimizer._gate_t.dev)
        out["dense.gate_f"] = np.array(m.dense_optimizer._gate_f.dev)
    for i, e in enumerate(m.embeddings):
        for name, sv in e.engine._impl._step_values.items():
            out[f"emb{i}.{name}"] = np.array(sv.dev)
    for layer in m.layers:
        sv = getattr(layer, "_step_values", None)
        if sv is not None:
            out[f"{layer.cfg.top_names[0]}.step"] = np.array(sv.dev)
    if getattr(m, "_step_value", None) is not None:  # (an eager step on sim checks its loss on the host)
        out["nonfinite.step"] = np.array(m._step_value.dev)
    return out


def _counters(m) -> dict:
    return {
        "step": m.step,
        "dense_t": m.dense_optimizer.t,
        "engine_steps": [e.engine.step for e in m.embeddings],
        "engine_lr": [e.engine.learning_rate for e in m.embeddings],
        "tables_unchecked": [t._unchecked for e in m.embeddings for t in e.engine.hash_tables.values()],
    }


def _device_step(m, lr):
    m.lr = lr
    batch = step.next_train_batch(m)
    step.device_step(m, batch)
    step.after_device_step(m)


@sim_only
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("amp", [False, True])
def test_replay_hooks_do_what_the_step_did_on_the_host(tmp_path, amp):
    # Adam: its t and bias corrections (dense and the embedding's Global update, whose all-rows pass has
    # its own values) are the counters a replay must advance; in mixed precision also the host's t and
    # seen skips that the device-side gate reads
    a, b = _model(tmp_path / "a", "adam", amp), _model(tmp_path / "b", "adam", amp)
    for m in (a, b):
        assert m.train()  # step 1 eager (first-call allocations)
    _device_step(a, 0.02)
    _device_step(a, 0.005)
    b.lr = 0.02
    batch = step.next_train_batch(b)
    rec = step_values.Recording(defer=False)
    with step_values.recording(rec):
        step.device_step(b, batch)
    step.after_device_step(b)
    kinds = {k[0] for k in rec.hooks}
    assert {"dense", "sparse", "engine", "dropout", "nonfinite", "loss", "hash"} <= kinds, kinds
    assert ("dense gate" in kinds) == amp and overflow.overflow_on_device(b) == amp
    kept = b._pending_loss
    b.check_deferred()  # clears the tables' records: the replay must mark them again
    b.lr = 0.005
    step.next_train_batch(b)  # the replayed step's batch (its upload is the stager's)
    rec.replay(step.replay_run(b))
    step.after_device_step(b)
    assert _counters(b) == _counters(a)
    got, want = _device_values(b), _device_values(a)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert b._pending_loss is kept  # the captured loss array is the one read at display


@sim_only
def test_graphs_switch_and_eligibility(tmp_path, monkeypatch):
    m = _model(tmp_path, "sgd")
    assert m.train()
    batch = step.next_train_batch(m)
    monkeypatch.delenv(cuda_graphs.ENV, raising=False)
    assert step.ineligible(batch, **step.graph_facts(m)) == f"{cuda_graphs.ENV}=0"  # off unless asked for
    monkeypatch.setenv(cuda_graphs.ENV, "1")
    assert step.ineligible(batch, **step.graph_facts(m)) == "not on a GPU"
    solver = m.solver  # HugeCTR's switch, CreateSolver's use_cuda_graph
    m.solver = dataclasses.replace(solver, use_cuda_graph=False)
    assert step.ineligible(batch, **step.graph_facts(m)) == "CreateSolver(use_cuda_graph=False)"
    m.solver = solver
    assert m.train() and m._graphs is None  # sim: eager steps
    monkeypatch.setenv(cuda_graphs.ENV, "yes")
    with pytest.raises(ValueError, match=f"{cuda_graphs.ENV} must be 0 or 1"):
        m.train()
    # the key: the input buffers, the frozen flags and the scaler
    k1 = cuda_graphs.batch_key(m, batch)
    m.freeze_dense()
    assert cuda_graphs.batch_key(m, batch) != k1
    # and each embedding engine's optimizer kind and weight-decay mode (the update kernel is compiled for them)
    from numbactr.embedding.engine import WeightDecay

    k2 = cuda_graphs.batch_key(m, batch)
    engine = m.embeddings[0].engine
    assert (int(engine.optimizer.kind), int(engine.optimizer.weight_decay_mode)) in k2[-2]
    engine.optimizer = dataclasses.replace(engine.optimizer, weight_decay_mode=WeightDecay.L2)
    assert cuda_graphs.batch_key(m, batch) != k2
    # several ranks (as on a GPU): only with NCCL between GPUs of their own, and only slot-owned tables (whose
    # exchange sizes a fixed plan holds: numbactr.embedding.sharded); the last part of the key is their plans
    monkeypatch.setenv(cuda_graphs.ENV, "1")
    emb = m.embeddings[0]
    monkeypatch.setattr(cuda_graphs.device, "kind", lambda: "gpu")
    alone = step.ineligible(batch, **step.graph_facts(m))
    # CuPy 13's sorts end in a host synchronization (the embedding backward sorts every step): no capture
    assert cuda_graphs.cupy_sort_synchronizes("13.6.0") and cuda_graphs.cupy_sort_synchronizes("12.3.0")
    assert not cuda_graphs.cupy_sort_synchronizes("14.0.0") and not cuda_graphs.cupy_sort_synchronizes("15.0.0a1")
    monkeypatch.setattr(cuda_graphs, "cupy_sort_synchronizes", lambda version=None: True)
    assert "synchronizes at the end of every sort" in step.ineligible(batch, **step.graph_facts(m))
    monkeypatch.setattr(cuda_graphs, "cupy_sort_synchronizes", lambda version=None: False)
    transport = ["mpi"]
    monkeypatch.setattr(m, "ranks", 2)
    monkeypatch.setattr(m, "comm", types.SimpleNamespace(size=2, transport=lambda: (transport[0], "test")))
    table = types.SimpleNamespace(fixed_key=("one key per bag", 8, 8))
    monkeypatch.setattr(emb, "_sharded", table)
    assert "through host memory" in step.ineligible(batch, **step.graph_facts(m))
    transport[0] = "nccl"
    monkeypatch.setattr(emb, "by_slot", False)  # a key-owned table: its gathered exchange is fixed in size
    assert step.ineligible(batch, **step.graph_facts(m)) == alone
    monkeypatch.setattr(emb, "by_slot", True)
    assert step.ineligible(batch, **step.graph_facts(m)) == alone
    assert cuda_graphs.batch_key(m, batch)[-1] == (("one key per bag", 8, 8),)


class _ToyGraphs(cuda_graphs.StepGraphs):
    """StepGraphs whose capture runs the body once and whose launch runs nothing: the runner's decisions."""

    def _capture(self, batch, body):
        body(batch)
        return cuda_graphs._Graph(None, None, types.SimpleNamespace(replay=lambda run: None, uploads=[]), None)

    def _launch(self, g):
        pass


def _toy_key(buffer_set: int, frozen=False):
    return ((1000 + buffer_set, (4, 13), "float32"),), (frozen,), 1.0, (), ()


def test_a_new_key_after_replays_recaptures_and_a_churning_key_turns_graphs_off():
    g, ran = _ToyGraphs(), []

    def body(batch):
        ran.append(batch)

    def steps(keys):
        for i, k in enumerate(keys):
            g.step(i, k, body, {}, lambda: lambda: None)

    steps([_toy_key(0), _toy_key(1)] * 3)  # 2 eager, 2 captures, 2 replays
    assert (g.captures, g.replays, len(g.graphs), g.disabled) == (2, 2, 2, None)
    # frozen dense layers (a new key with the same shapes): the old graphs go, the new key warms up again
    steps([_toy_key(0, True), _toy_key(1, True)] * 3)
    assert (g.captures, g.replays, g.disabled) == (4, 4, None)
    assert set(g.graphs) == {_toy_key(0, True), _toy_key(1, True)}
    # keys that never repeat: no graph ever replays, so capturing stops (the model's ineligible() reads
    # disabled and runs every later step eagerly)
    churn = _ToyGraphs()
    for i in range(5):
        churn.step(i, _toy_key(10 + i), body, {}, lambda: lambda: None)
    assert churn.captures == 2 and churn.replays == 0 and "changes before its graphs replay" in churn.disabled
    assert not churn.graphs


class _SimGraphs(cuda_graphs.StepGraphs):
    """StepGraphs with the simulator standing in for the GPU: a "capture" runs the step (recording its host
    halves) and a "launch" runs nothing, so a replayed step does only what the host halves do."""

    def __init__(self, fail=False):
        super().__init__()
        self.fail, self.bodies, self.restored = fail, 0, 0

    def _capture(self, batch, body):
        rec = step_values.Recording(defer=False)
        with step_values.recording(rec):
            if self.fail:
                # an operation that cannot be captured, met at the first weight update's kernel (after the
                # dense optimizer advanced Adam's t on the host): up to there the simulator's work (lookups,
                # hash inserts, forward, backward) is pure or idempotent, so running it here stands for a
                # GPU capture that ran none of it
                from numbactr.kernels import optimizers

                def failing(*args, **kwargs):
                    raise RuntimeError("operation not permitted when stream is capturing")

                real, optimizers.adam_update = optimizers.adam_update, failing
                try:
                    body(batch)
                finally:
                    optimizers.adam_update = real
            body(batch)
        return cuda_graphs._Graph(None, None, rec, None)

    def _launch(self, g):
        pass


def _graph_model(tmp_path, monkeypatch, graphs):
    m = _model(tmp_path, "adam")
    monkeypatch.setattr(step, "ineligible", lambda batch, **facts: None)  # as on a GPU
    m._graphs, graphs.model = graphs, m
    return m


@sim_only
@pytest.mark.slow
def test_warm_up_capture_replay_and_a_failed_capture(tmp_path, monkeypatch):
    monkeypatch.setattr(cuda_graphs.StepGraphs, "WARMUP", 1)
    lrs = (0.01, 0.02, 0.03, 0.04)
    eager = _model(tmp_path / "e", "adam")
    for lr in lrs[:3]:
        eager.lr = lr
        assert eager.train()
    after3 = (_counters(eager), np.array(eager.weights))
    eager.lr = lrs[3]
    assert eager.train()
    g = _SimGraphs()
    m = _graph_model(tmp_path / "g", monkeypatch, g)
    tensors = []
    for lr in lrs:
        m.lr = lr
        assert m.train()
        tensors.append(m._last_tensors[True])
    # 1 eager step, one capture per input buffer set of the stager (steps 2 and 3), then a replay
    assert (g.eager, g.captures, g.replays, len(g.graphs)) == (1, 2, 1, 2)
    assert tensors[3] is tensors[1] and tensors[2] is not tensors[1]  # the replayed graph's own tensors
    assert _counters(m) == _counters(eager)
    got, want = _device_values(m), _device_values(eager)
    assert set(want) < set(got)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert m.eval() and not g.graphs and g.eager == 0  # evaluation may grow buffers a graph points to
    # a capture that fails: the host state goes back to where the step started, the step runs eagerly and
    # graphs stay off for the run
    f = _SimGraphs(fail=True)
    m2 = _graph_model(tmp_path / "f", monkeypatch, f)
    for lr in lrs[:3]:
        m2.lr = lr
        assert m2.train()
    assert f.captures == 0 and f.disabled.startswith("capture failed (RuntimeError") and not f.graphs
    assert _counters(m2) == after3[0]
    np.testing.assert_array_equal(np.asarray(m2.weights), after3[1])


@pytest.mark.gpu
def test_graph_steps_train_like_eager_steps_on_a_gpu(tmp_path, monkeypatch):
    """On a GPU: 12 steps with NUMBACTR_CUDA_GRAPHS=1 (2 eager, 2 captures, 8 replays) against 12 eager
    steps of the same model and data: the same weights and tables (to float32 atomics' reordering)."""
    from numbactr.runtime import device

    if device.kind() != "gpu":
        pytest.skip("needs a GPU")
    models = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(cuda_graphs.ENV, flag)
        m = _model(tmp_path / flag, "adam")
        for i in range(12):
            m.lr = 0.01 * (1 + i % 3)
            assert m.train()
        models[flag] = m
    g = models["1"]._graphs
    assert g is not None and g.captures == 2 and g.replays == 8, g and g.disabled
    e, r = models["0"], models["1"]
    np.testing.assert_allclose(device.to_host(r.weights), device.to_host(e.weights), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        device.to_host(r.embeddings[0].weight.data), device.to_host(e.embeddings[0].weight.data), rtol=1e-5, atol=1e-6
    )
    assert r.get_current_loss() == pytest.approx(e.get_current_loss(), rel=1e-5)


@sim_only
def test_step_values_record_and_refuse_to_be_made_in_a_capture():
    sv = step_values.StepValues(2, np.float32)
    rec = step_values.Recording(defer=True)
    with step_values.recording(rec):
        assert sv.put([1.5, 2.5]) is sv.dev
        step_values.on_replay("k", lambda run: sv.put([run["step"], 0.0]))
        step_values.on_replay("k", lambda run: None)  # one hook per key: the first stays
        with pytest.raises(RuntimeError, match="made while a step was being captured"):
            step_values.StepValues(1, np.int64)
    assert np.array(sv.dev).tolist() == [0.0, 0.0]  # deferred: the runner uploads it
    assert [v.tolist() for _, v in rec.uploads] == [[1.5, 2.5]]
    rec.replay({"step": 7})
    assert np.array(sv.dev).tolist() == [7.0, 0.0]
    with pytest.raises(ValueError, match="holds 2 values, got 3"):
        sv.put([1, 2, 3])
