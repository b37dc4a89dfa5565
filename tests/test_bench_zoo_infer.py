"""``numbactr bench zoo``'s inference column (numbactr/bench/zoo_infer.py): zoo models saved as a HugeCTR user
saves them, served by InferenceSession beside onnxruntime on the exported model; the rows, the JSON, the
agreement check, and the rows of a model that cannot be exported.

On the cpu device (the device the benchmark measures), a smoke size: batches 1 and 8, 1 thread."""

import io
import json

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from numbactr.bench import results, zoo_infer  # noqa: E402
from numbactr.bench.common import Env  # noqa: E402

pytestmark = pytest.mark.usefixtures("cpu")
SMOKE = dict(batches=(1, 8), threads=(1,), min_time=0.01)


def rows_of(tab) -> list:
    return [dict(zip(tab.columns, raw)) for raw in tab.raw]


def test_models_are_served_by_both_and_agree():
    tab = zoo_infer.bench_zoo_infer(Env(use_torch=False), ["GMF", "DLRM", "DIN"], **SMOKE, out=io.StringIO())
    assert tab.title == "Zoo inference (cpu)"
    rows = rows_of(tab)
    assert [(r["impl"], r["model"], r["batch"]) for r in rows] == [
        (impl, model, b) for model in ("GMF", "DLRM", "DIN") for b in (1, 8) for impl in ("numbactr", "onnxruntime")
    ]
    for ours, theirs in zip(rows[::2], rows[1::2]):
        assert ours["ratio"] == theirs["ratio"] == pytest.approx(ours["samples/s"] / theirs["samples/s"])
        for r in (ours, theirs):
            assert r["threads"] == 1 and r["ms"] > 0 and r["note"] == ""
            assert r["samples/s"] == pytest.approx(r["batch"] / (r["ms"] / 1e3))
            assert 0 <= r["max abs diff"] <= 1e-5  # float32 rounding of the same math, not another model
    found = results.from_table(tab)
    assert {r["implementation"] for r in found} == {"numbactr", "onnxruntime"}
    assert {r["metric"] for r in found} == {"ms", "samples/s"}
    for r in found:
        assert "inference" in r["name"] and {"model", "batch", "threads", "ratio"} <= set(r)


def test_a_model_trained_a_few_steps_predicts_what_its_session_serves(tmp_path):
    """The saved files hold trained weights (not the initial ones), and the request is in the graph's table
    order: W&D's wide table comes first in the graph, its deep input first in the Data layer."""
    import numbactr as hugectr
    from numbactr.bench import zoo_models as Z

    spec = Z.SPECS["W&D"]
    trained = zoo_infer.save_trained(hugectr, spec, str(tmp_path / "a"), seed=0, steps=2)
    fresh = zoo_infer.save_trained(hugectr, spec, str(tmp_path / "b"), seed=0, steps=0)
    dense = [np.fromfile(f["dense"], np.float32) for f in (trained, fresh)]
    assert dense[0].shape == dense[1].shape and not np.array_equal(*dense)
    dense_feature, keys, ptrs = zoo_infer.csr_request(spec, 4)
    assert ptrs.shape == (4 * 2 + 1 + 4 * 26 + 1,) and keys.shape == (4 * 28,)
    assert (keys[:8] >= 0).all() and (keys[:8] < 10_000).all()  # the wide slots' ids
    session = zoo_infer.open_session(trained, spec.name, 4)
    try:
        preds = np.asarray(session.predict(dense_feature, keys, ptrs))
    finally:
        session.close()
    assert preds.shape == (4,) and ((preds > 0) & (preds < 1)).all()


def test_a_model_the_exporter_refuses_keeps_its_rows_and_says_why(monkeypatch):
    from numbactr.onnx_converter import OnnxExportError

    def refuse(files):
        raise OnnxExportError("layer 7 (FancyLayer): no ONNX operator for it")

    monkeypatch.setattr(zoo_infer, "export", refuse)
    tab = zoo_infer.bench_zoo_infer(Env(use_torch=False), ["GMF"], **SMOKE, out=io.StringIO())
    ours, theirs = (r for r in rows_of(tab) if r["batch"] == 8)
    assert ours["ms"] > 0 and ours["note"] == "" and ours["ratio"] is None and ours["max abs diff"] is None
    assert theirs["ms"] is None and theirs["note"] == "ONNX export: no ONNX operator for it (notes)"
    assert any("GMF: ONNX export: OnnxExportError: layer 7 (FancyLayer)" in n for n in tab.notes)
    assert {r["implementation"] for r in results.from_table(tab)} == {"numbactr"}


def test_predictions_that_differ_are_named(monkeypatch):
    """The agreement check can fail: onnxruntime's predictions moved by 1e-4 are reported as differing."""
    from numbactr.onnx_converter.runtime import OnnxPredictor

    right = OnnxPredictor.predict_csr
    monkeypatch.setattr(OnnxPredictor, "predict_csr", lambda self, *a: right(self, *a) + 1e-4)
    tab = zoo_infer.bench_zoo_infer(Env(use_torch=False), ["GMF"], **SMOKE, out=io.StringIO())
    for r in rows_of(tab):
        assert r["max abs diff"] == pytest.approx(1e-4, rel=0.01)
        assert r["note"] == "predictions differ (rtol 1e-05, atol 1e-06)"


def test_cli_infer_only_writes_the_inference_rows(tmp_path, capsys):
    from numbactr.bench import cli

    path = tmp_path / "zoo.json"
    argv = ["zoo", "--infer-only", "--quick", "--models", "NCF", "--min-time", "0.01", "--json", str(path)]
    assert cli.main([*argv, "--infer-batch", "2,4"]) == 0
    assert "### Zoo inference (cpu)" in capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert not results.validate(doc)
    assert {(r["name"], r["model"], r["batch"], r["threads"]) for r in doc["results"]} == {
        ("Zoo inference (cpu)", "NCF", b, 1) for b in (2, 4)
    }


@pytest.mark.parametrize(
    "argv, message",
    [
        (["dlrm", "--no-infer"], "--no-infer applies to `bench zoo` only"),
        (["hash", "--infer-batch", "1,2", "--models", "GMF"], "--models, --infer-batch apply to `bench zoo` only"),
        (["zoo", "--no-infer", "--infer-only"], "--no-infer and --infer-only exclude each other"),
    ],
)
def test_cli_refuses_misplaced_inference_options(argv, message, capsys):
    from numbactr.bench import cli

    with pytest.raises(SystemExit):
        cli.main(argv)
    assert message in capsys.readouterr().err
