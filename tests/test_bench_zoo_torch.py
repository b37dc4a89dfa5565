"""``numbactr bench zoo``: every zoo model's PyTorch twin computes numbactr's loss and dense gradients from the
same weights, and a smoke run of the benchmark gives its table and JSON rows.

On the cpu device (numbactr's compiled CPU ops, the device the benchmark measures); the module's name says
torch, so CI's pass with the PyTorch peers installed runs it (.ci/run: -k "torch or ...")."""

import contextlib
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numbactr as hugectr  # noqa: E402

pytestmark = pytest.mark.usefixtures("cpu")
from numbactr.bench import zoo_models as Z  # noqa: E402
from numbactr.bench import zoo_twins as T  # noqa: E402


def twins(name: str, batch: int = 32):
    spec = Z.SPECS[name]
    with contextlib.redirect_stdout(io.StringIO()):
        model = Z.build(hugectr, spec, batch)
    batches = Z.make_batches(spec, batch, 2, seed=3)
    Z.feed(model, batches)
    twin = T.make_twin(spec, seed=1)
    Z.load_embeddings(model, spec, {n: e.weight.detach().numpy() for n, e in twin.emb.items()})
    T.copy_from(twin, Z.dense_params(model))
    return spec, model, twin, T.stepper(twin, spec, batches)


@pytest.mark.parametrize("name", list(Z.SPECS))
def test_twin_computes_numbactrs_loss_and_gradients(name):
    _, model, twin, step = twins(name)
    before = [p.detach().clone() for p, _ in twin.hugectr_params()]
    model.train()
    loss = step().item()
    assert model.get_current_loss() == pytest.approx(loss, rel=1e-6, abs=1e-7)
    grads = Z.dense_grads(model)
    assert len(grads) == len(before)
    # a gradient that is 0 in exact arithmetic (DIN's attention biases: the Softmax ignores a shift) is
    # rounding noise on both sides: compared at 1e-3 of the model's largest gradient
    floor = 1e-3 * max(float(np.abs(g).max()) for g in grads)
    for (p, transposed), g in zip(twin.hugectr_params(), grads):
        ours = (p.grad.T if transposed else p.grad).numpy()
        scale = max(float(np.abs(g).max()), floor, 1e-6)
        np.testing.assert_allclose(ours, g, rtol=0, atol=1e-5 * scale, err_msg=f"{name}: {tuple(g.shape)}")
    # the second step starts from weights both updated (Adam: numbactr puts epsilon where HugeCTR does,
    # inside the bias correction, torch outside: a relative difference well under 1e-3 after one step)
    model.train()
    assert model.get_current_loss() == pytest.approx(step().item(), rel=1e-3)


def test_copy_from_refuses_a_wrong_parameter_list():
    spec = Z.SPECS["GMF"]
    twin = T.make_twin(spec)
    with pytest.raises(ValueError, match="GMF twin: 2 parameters, numbactr has 1"):
        T.copy_from(twin, [np.zeros((16, 1), np.float32)])
    with pytest.raises(ValueError, match=r"GMF twin: parameter \(1,\) <- numbactr \(2,\)"):
        T.copy_from(twin, [np.zeros((16, 1), np.float32), np.zeros(2, np.float32)])


def test_a_twin_with_a_wrong_weight_computes_another_loss():
    """The loss check can fail: one changed weight changes the twin's loss."""
    _, model, twin, step = twins("DLRM")
    with torch.no_grad():
        twin.out.bias += 0.5
    model.train()
    assert abs(model.get_current_loss() - step().item()) > 1e-3


def test_bench_zoo_smoke_rows_carry_model_batch_threads_ratio():
    from numbactr.bench import results, zoo
    from numbactr.bench.common import Env

    tab, parts = zoo.bench_zoo(
        Env(), models=("GMF",), batches=(16,), threads=(1,), min_time=0.01, rounds=1, breakdown_steps=1,
        infer=False, out=io.StringIO(),
    )  # fmt: skip
    rows = results.from_table(tab)
    assert {r["implementation"] for r in rows} == {"numbactr", "torch-cpu"}
    for r in rows:
        assert (r["model"], r["batch"], r["threads"]) == ("GMF", 16, 1) and r["ratio"] > 0
    ours, theirs = (dict(zip(tab.columns, raw)) for raw in tab.raw)
    assert ours["ratio"] == pytest.approx(ours["samples/s"] / theirs["samples/s"])
    eager, *split, step = parts.raw[0][3:]
    assert sum(split) == pytest.approx(eager, rel=1e-6) and min(split) >= 0
    assert step == "planned"


def test_bench_zoo_refuses_an_unknown_model():
    from numbactr.bench import zoo
    from numbactr.bench.common import Env

    with pytest.raises(ValueError, match=r"unknown model\(s\) \['DIEN'\]"):
        zoo.bench_zoo(Env(), models=("DIEN",))
