"""CUDA graphs of the training step (numbactr.cuda_graphs), what can be checked without a GPU.

A replayed graph runs none of the step's Python: the host halves that the step registered while it was
recorded (numbactr.step_values.on_replay) must alone bring the host counters and the per-step device values
to what an eager step brings them to. Here, on the simulator, model B records its second step and then
"replays" its third (the host halves only), model A runs both steps eagerly: the values every kernel of
step 3 would read (learning rate, Adam's t and bias corrections, rounding salts, the dropout step, the step
number of the non-finite flag) and the counters must agree. The launches themselves are checked to be the
same every step in tests/test_step_counts.py."""
import dataclasses

import numpy as np
import pytest
from numba import config

import numbactr as hugectr
from numbactr import cuda_graphs, step_values
from numbactr.bench_mlperf import DENSE, SLOTS, build_mlperf_dlrm
from tests.model_util import tiny_data

pytestmark = pytest.mark.skipif(not config.ENABLE_CUDASIM, reason="records the simulator's steps")


def _model(tmp_path, optimizer):
    train, evl = tiny_data(str(tmp_path), n_train=16, n_eval=8, slots=SLOTS, dense=DENSE, keys_per_slot=2, files=1)
    m = build_mlperf_dlrm(hugectr, train, evl, batch=4, dim=4, optimizer=optimizer, workspace_mb=1,
                          bottom=(8,), top=(8, 4, 1), dropout=0.25)
    m.solver = dataclasses.replace(m.solver, repeat_dataset=True)
    return m


def _device_values(m) -> dict:
    """Every per-step device array of the model's consumers, by name."""
    out = {"dense": np.array(m.dense_optimizer._values.dev)}
    for i, e in enumerate(m.embeddings):
        for name, sv in e.engine._impl._step_values.items():
            out[f"emb{i}.{name}"] = np.array(sv.dev)
    for layer in m.layers:
        sv = getattr(layer, "_step_values", None)
        if sv is not None:
            out[f"{layer.cfg.top_names[0]}.step"] = np.array(sv.dev)
    out["nonfinite.step"] = np.array(m._step_value.dev)
    return out


def _counters(m) -> dict:
    return {"step": m.step, "dense_t": m.dense_optimizer.t,
            "engine_steps": [e.engine.step for e in m.embeddings],
            "engine_lr": [e.engine.learning_rate for e in m.embeddings],
            "tables_unchecked": [t._unchecked for e in m.embeddings for t in e.engine.hash_tables.values()]}


def _device_step(m, lr):
    m.lr = lr
    batch = m._next_train_batch()
    m._device_step(batch)
    m._after_device_step()


@pytest.mark.slow
def test_replay_hooks_do_what_the_step_did_on_the_host(tmp_path):
    # Adam: its t and bias corrections (dense and the embedding's Global update, whose all-rows pass has
    # its own values) are the counters a replay must advance
    a, b = _model(tmp_path / "a", "adam"), _model(tmp_path / "b", "adam")
    for m in (a, b):
        assert m.train()                      # step 1 eager (first-call allocations)
    _device_step(a, 0.02)
    _device_step(a, 0.005)
    b.lr = 0.02
    batch = b._next_train_batch()
    rec = step_values.Recording(defer=False)
    with step_values.recording(rec):
        b._device_step(batch)
    b._after_device_step()
    kinds = {k[0] for k in rec.hooks}
    assert {"dense", "sparse", "engine", "dropout", "nonfinite", "loss", "hash"} <= kinds, kinds
    kept = b._pending_loss
    b.check_deferred()                        # clears the tables' records: the replay must mark them again
    b.lr = 0.005
    b._next_train_batch()                     # the replayed step's batch (its upload is the stager's)
    rec.replay(b._replay_run())
    b._after_device_step()
    assert _counters(b) == _counters(a)
    got, want = _device_values(b), _device_values(a)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert b._pending_loss is kept            # the captured loss array is the one read at display


def test_graphs_switch_and_eligibility(tmp_path, monkeypatch):
    m = _model(tmp_path, "sgd")
    assert m.train()
    batch = m._next_train_batch()
    monkeypatch.delenv(cuda_graphs.ENV, raising=False)
    assert cuda_graphs.ineligible(m, batch) == f"{cuda_graphs.ENV}=0"           # off unless asked for
    monkeypatch.setenv(cuda_graphs.ENV, "1")
    assert cuda_graphs.ineligible(m, batch) == "not on a GPU"
    assert m.train() and m._graphs is None                                       # sim: eager steps
    monkeypatch.setenv(cuda_graphs.ENV, "yes")
    with pytest.raises(ValueError, match=f"{cuda_graphs.ENV} must be 0 or 1"):
        m.train()
    # the key: the input buffers, the frozen flags and the scaler
    k1 = cuda_graphs.batch_key(m, batch)
    m.freeze_dense()
    assert cuda_graphs.batch_key(m, batch) != k1
