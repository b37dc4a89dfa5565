"""Issue 3, model level: HugeCTR's sample graphs train on cpu, and one step on sim matches cpu."""

import numpy as np
import pytest

from numbactr.runtime import device
from tests.sample_graphs import GRAPHS, build


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_graph_trains_on_cpu(tmp_path, on_device, name):
    on_device("cpu")
    m = build(name, str(tmp_path), lr=0.02)
    m.summary()
    losses = []
    for _ in range(120):
        assert m.train()
        losses.append(m.get_current_loss())
    assert np.isfinite(losses).all()
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.01, losses
    metrics = dict(m.eval_whole_source())
    assert metrics["AUC"] > 0.6, metrics


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_one_step_on_sim_matches_cpu(tmp_path, on_device, name):
    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    out = {}
    for dev in ("cpu", "sim"):
        on_device(dev)
        m = build(name, str(tmp_path / dev), batch=8, lr=0.01)
        assert m.train()
        out[dev] = (m.get_current_loss(), np.array(m.weights), [np.array(e.dump()[1]) for e in m.embeddings])
    (l0, w0, e0), (l1, w1, e1) = out["cpu"], out["sim"]
    assert l1 == pytest.approx(l0, rel=1e-4)
    np.testing.assert_allclose(w1, w0, rtol=1e-3, atol=1e-5)
    for a, b in zip(e1, e0):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_graph_json_round_trip(tmp_path, on_device, name):
    """graph_to_json -> construct_from_json -> graph_to_json gives the same JSON, auto-Slices included."""
    import json

    import numbactr as hugectr

    on_device("cpu")
    m = build(name, str(tmp_path))
    first = tmp_path / "a.json"
    m.graph_to_json(str(first))
    m2 = hugectr.Model(m.solver, m.reader_params, m.opt_params)
    m2.construct_from_json(str(first), include_dense_network=True)
    if name == "mmoe":
        m2.compile(loss_names=["income", "married"], loss_weights=[0.5, 0.5])
    else:
        m2.compile()
    second = tmp_path / "b.json"
    m2.graph_to_json(str(second))
    assert json.loads(second.read_text()) == json.loads(first.read_text())
    assert m2.train()
