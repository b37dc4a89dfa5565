"""`numbactr export-onnx`, HugeCTR's converter command line (``python -m numbactr.onnx_converter.hugectr2onnx``),
and the graph JSON keys HugeCTR's own tools index: graph_to_json writes every key HugeCTR's writer writes
(HugeCTR's converter stopped with KeyError: 'axis' on numbactr's graphs before)."""

import json
import os
import re

import numpy as np

import numbactr as hugectr
from numbactr import cli
from numbactr.onnx_converter.hugectr2onnx.__main__ import main as hugectr2onnx_main
from numbactr.onnx_converter.runtime import OnnxPredictor
from tests import sample_graphs
from tests.model_util import tiny_data, tiny_dlrm
from tests.test_onnx_converter import assert_same, eval_batches, save, trained, zoo_model


def run_main(capsys, *argv):
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_export_onnx_finds_the_sparse_models_beside_the_dense_one(tmp_path, cpu, capsys):
    m = trained("wdl", str(tmp_path))
    graph, dense, _ = save(m, str(tmp_path))
    out = str(tmp_path / "wdl.onnx")
    rc, stdout, err = run_main(capsys, "export-onnx", graph, dense, "-o", out)
    assert rc == 0, err
    assert f"export-onnx: wrote {out!r}" in stdout
    assert "inputs dense (batch, 3) float, wide_data (batch, 2, 1) int64, deep_data (batch, 3, 1) int64" in stdout
    assert "outputs label (batch, 1) float" in stdout
    assert_same(m, OnnxPredictor(out), eval_batches(m, 1)[0])


def test_export_onnx_dense_only_and_hugectrs_command_line(tmp_path, cpu, capsys):
    m = trained("dcn", str(tmp_path))
    graph, dense, sparse = save(m, str(tmp_path))
    out = str(tmp_path / "dense.onnx")
    rc, stdout, err = run_main(capsys, "export-onnx", graph, dense, "--dense-only", "-o", out, "--graph-name", "dcn")
    assert rc == 0, err
    assert "inputs dense (batch, 3) float, sparse_embedding1 (batch, 4, 4) float" in stdout
    assert OnnxPredictor(out).session.get_modelmeta().graph_name == "dcn"
    out2 = str(tmp_path / "hugectr.onnx")
    hugectr2onnx_main(
        [
            "--onnx_model_path",
            out2,
            "--graph_config",
            graph,
            "--dense_model",
            dense,
            "--convert_embedding",
            "--sparse_models",
            *sparse,
        ]
    )
    assert_same(m, OnnxPredictor(out2), eval_batches(m, 1)[0])


def test_export_onnx_errors_are_one_line(tmp_path, cpu, capsys):
    m = trained("dcn", str(tmp_path))
    graph, dense, sparse = save(m, str(tmp_path))
    out = str(tmp_path / "x.onnx")
    cases = [
        ((graph, str(tmp_path / "gone_dense_3.model"), "-o", out), "dense_model .*gone_dense_3.model' does not exist"),
        ((graph, dense, sparse[0], "--dense-only", "-o", out), "--dense-only takes no sparse model folders"),
        ((graph, dense, str(tmp_path), "-o", out), "embedding 'sparse_embedding1' keys: file .*key' does not exist"),
        ((graph, dense, "-o", str(tmp_path / "no" / "x.onnx")), "the folder of .*x.onnx' does not exist"),
    ]
    renamed = tmp_path / "weights.bin"
    renamed.write_bytes(open(dense, "rb").read())
    cases.append(((graph, str(renamed), "-o", out), "is not named <prefix>_dense_<iter>.model"))
    for argv, pattern in cases:
        rc, _, err = run_main(capsys, "export-onnx", *argv)
        lines = [line for line in err.splitlines() if not line.startswith("numbactr: device=")]
        assert rc == 1 and len(lines) == 1 and lines[0].startswith("numbactr export-onnx: error: "), err
        assert re.search(pattern, lines[0]), (pattern, lines[0])
    assert not os.path.exists(out)


# ---- graph JSON: the keys HugeCTR writes -----------------------------------------------------------------
# save_graph_to_json (HugeCTR src/pybind/add_dense_layer.cpp): the keys it writes for each layer type,
# whatever their values; "a|b" = one of the two (MLP), Reshape: "selected" or leading_dim + time_step
HUGECTR_WRITES = {
    "BatchNorm": ["bn_param.factor", "bn_param.eps"],
    "LayerNorm": ["ln_param.eps"],
    "Dropout": ["rate"],
    "SequenceMask": ["max_sequence_len_from", "max_sequence_len_to"],
    "ELU": ["elu_param.alpha"],
    "MultiHeadAttention": ["num_attention_heads", "transpose_b"],
    "MLP": [
        "mlp_param.num_output",
        "mlp_param.num_outputs",
        "mlp_param.use_bias|mlp_param.biases",
        "mlp_param.activation|mlp_param.activations",
    ],
    "InnerProduct": ["fc_param.num_output"],
    "MultiCross": ["mc_param.num_layers"],
    "Concat": ["axis"],
    "Slice": ["ranges"],
    "WeightMultiply": ["weight_dims"],
    "FmOrder2": ["out_dim"],
    "ReduceSum": ["axis"],
    "ReduceMean": ["axis"],
    "Gather": ["indices"],
    "GRU": ["gru_param.num_output", "gru_param.batchsize", "gru_param.SeqLength", "gru_param.vector_size"],
    "PReLU_Dice": ["prelu_dice_param.alpha", "prelu_dice_param.eps"],
    "Scale": ["scale_param.axis", "scale_param.factor"],
    "Softmax": ["factor"],
}


def _has(layer: dict, path: str) -> bool:
    obj = layer
    for k in path.split("."):
        if not isinstance(obj, dict) or k not in obj:
            return False
        obj = obj[k]
    return True


def graphs(folder):
    """Every graph the ONNX tests use, built (not trained)."""
    out = {}
    for name in sorted(sample_graphs.GRAPHS):
        os.makedirs(os.path.join(folder, name))
        out[name] = sample_graphs.build(name, os.path.join(folder, name))
    out["dlrm"] = tiny_dlrm(*tiny_data(os.path.join(folder, "dlrm"), n_train=32, n_eval=32))
    out["zoo"] = zoo_model(folder)[0]
    return out


def test_graph_to_json_writes_every_key_hugectr_writes(tmp_path, cpu):
    seen = set()
    for name, m in graphs(str(tmp_path)).items():
        path = tmp_path / f"{name}.json"
        m.graph_to_json(str(path))
        g = json.loads(path.read_text())
        for layer in g["layers"][1:]:
            t = layer["type"]
            seen.add(t)
            want = list(HUGECTR_WRITES.get(t, []))
            if t == "Reshape":
                want = ["selected"] if "selected" in layer else ["leading_dim", "time_step"]
            for key in want:
                assert any(_has(layer, k) for k in key.split("|")), (name, t, key, layer)
            if "sparse_embedding_hparam" in layer:  # what HugeCTR's converter reads of a table
                for k in ("max_vocabulary_size_global", "embedding_vec_size", "combiner"):
                    assert k in layer["sparse_embedding_hparam"], (name, k)
        data = g["layers"][0]
        assert {"top", "label_dim"} <= set(data["label"]) and {"top", "dense_dim"} <= set(data["dense"])
        assert all({"top", "nnz_per_slot", "is_fixed_length", "slot_num"} <= set(s) for s in data["sparse"])
        # and numbactr reads its own file back to the same graph
        m2 = hugectr.Model(m.solver, m.reader_params, m.opt_params)
        m2.construct_from_json(str(path), include_dense_network=True)
        m2.compile(**({"loss_names": ["income", "married"], "loss_weights": [0.5, 0.5]} if name == "mmoe" else {}))
        again = tmp_path / f"{name}_again.json"
        m2.graph_to_json(str(again))
        assert json.loads(again.read_text()) == g, name
    assert {"Concat", "Softmax", "Reshape", "MLP"} <= seen


def test_reshape_forms_and_defaults_are_written(tmp_path, cpu):
    """Concat axis, Softmax factor and Reshape time_step at their defaults (the three the issue names), a
    selected Reshape without leading_dim, and MLP's num_output/use_bias/activation when left unset."""
    m = zoo_model(str(tmp_path))[0]
    path = tmp_path / "zoo.json"
    m.graph_to_json(str(path))
    by_top = {str(d["top"]): d for d in json.loads(path.read_text())["layers"][1:]}
    assert by_top["sel"]["selected"] == [2, 0] and "leading_dim" not in by_top["sel"]
    assert (by_top["steps"]["leading_dim"], by_top["steps"]["time_step"]) == (4, 3)
    assert (by_top["rhs"]["leading_dim"], by_top["rhs"]["time_step"], by_top["rhs"]["shape"]) == (0, 0, [-1, 4, 6])
    assert by_top["mm_flat"]["time_step"] == 0
    assert by_top["feat"]["axis"] == 1
    assert by_top["mlp"]["mlp_param"] == {
        "num_output": 1,
        "num_outputs": [12, 8],
        "biases": [True, False],
        "activations": ["Relu", "None"],
    }
    s = sample_graphs
    data = s.make_data(str(tmp_path / "d"), [("data1", 2, 1)], n_train=32, n_eval=32)
    m = s._model(data, [("data1", 2, 1)], 3)
    s.emb(m, "data1", "emb", 4)
    s.D(m, hugectr.Layer_t.Reshape, ["emb"], ["flat"], leading_dim=8)
    s.D(m, hugectr.Layer_t.MLP, ["flat"], ["mlp"], num_outputs=[4, 2])
    s.D(m, hugectr.Layer_t.Softmax, ["mlp"], ["probs"])
    s.D(m, hugectr.Layer_t.Slice, ["probs"], ["p0", "p1"], ranges=[(0, 1), (1, 2)])
    s.D(m, hugectr.Layer_t.BinaryCrossEntropyLoss, ["p1", "label"], ["loss"])
    m.compile()
    m.graph_to_json(str(path))
    by_top = {str(d["top"]): d for d in json.loads(path.read_text())["layers"][1:]}
    assert by_top["mlp"]["mlp_param"] == {
        "num_output": 1,
        "num_outputs": [4, 2],
        "use_bias": True,
        "activation": "Relu",
    }
    assert by_top["probs"]["factor"] == 1.0
    assert np.isclose(by_top["flat"]["time_step"], 0)
