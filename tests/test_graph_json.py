"""graph_to_json / construct_from_json round trip (spec §7.4)."""

import copy
import json

import pytest

import numbactr as hugectr
from tests.model_util import tiny_data, tiny_dlrm


def test_dlrm_graph_json_layout_and_round_trip(tmp_path):
    tr, ev = tiny_data(str(tmp_path))
    m = tiny_dlrm(tr, ev)
    path = tmp_path / "graph.json"
    m.graph_to_json(str(path))
    g = json.loads(path.read_text())
    types = [layer["type"] for layer in g["layers"]]
    assert types[0] == "Data" and types[1] == "DistributedSlotSparseEmbeddingHash"
    data = g["layers"][0]
    assert data["label"] == {"top": "label", "label_dim": 1}
    assert data["dense"] == {"top": "dense", "dense_dim": 2}
    assert data["sparse"][0]["slot_num"] == 3 and data["sparse"][0]["nnz_per_slot"] == [1, 1, 1]
    emb = g["layers"][1]
    assert emb["sparse_embedding_hparam"]["embedding_vec_size"] == 4
    assert emb["sparse_embedding_hparam"]["max_vocabulary_size_global"] == m.embeddings[0].max_rows
    assert emb["optimizer"]["type"] == "Adam" and emb["optimizer"]["adam_hparam"]["beta1"] == 0.9
    # "emb" feeds Interaction and Reshape: HugeCTR inserts a Slice with two full copies
    sl = next(layer for layer in g["layers"] if layer["type"] == "Slice")
    assert sl["bottom"] == "emb" and sl["top"] == ["emb_slice0", "emb_slice1"] and sl["ranges"] == [[0, 4], [0, 4]]
    inter = next(layer for layer in g["layers"] if layer["type"] == "Interaction")
    assert inter["bottom"] == ["relu1", "emb_slice0"]
    fc = next(layer for layer in g["layers"] if layer["type"] == "InnerProduct")
    assert fc["fc_param"] == {"num_output": 4}

    # rebuild: Input + embedding only, then the dense network too
    s = hugectr.CreateSolver(batchsize=64, batchsize_eval=64, i64_input_key=True)
    r = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[tr], eval_source=ev, check_type=hugectr.Check_t.Sum
    )
    m2 = hugectr.Model(s, r, hugectr.CreateOptimizer())
    m2.construct_from_json(str(path), include_dense_network=False)
    assert [e.name for e in m2.embeddings] == ["emb"] and not m2.layers
    graph_wo_slices = copy.deepcopy(dict(g, layers=[layer for layer in g["layers"] if layer["type"] != "Slice"]))
    for layer in graph_wo_slices["layers"]:  # readers of the auto-Slice read the original again
        if isinstance(layer.get("bottom"), list):
            layer["bottom"] = [b.replace("emb_slice0", "emb").replace("emb_slice1", "emb") for b in layer["bottom"]]
        elif isinstance(layer.get("bottom"), str):
            layer["bottom"] = layer["bottom"].replace("emb_slice1", "emb").replace("emb_slice0", "emb")
    p2 = tmp_path / "graph2.json"
    p2.write_text(json.dumps(graph_wo_slices))
    m3 = hugectr.Model(s, r, hugectr.CreateOptimizer())
    m3.construct_from_json(str(p2), include_dense_network=True)
    m3.compile()
    p3 = tmp_path / "graph3.json"
    m3.graph_to_json(str(p3))
    assert json.loads(p3.read_text()) == g
    assert m3.train()


def test_bad_graph_json_is_a_clear_error(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"layers": [{"type": "Dense"}]}')
    s = hugectr.CreateSolver(batchsize=8)
    r = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=["x"], eval_source="y", check_type=hugectr.Check_t.Sum
    )
    m = hugectr.Model(s, r, hugectr.CreateOptimizer())
    with pytest.raises(ValueError, match="starting with the Data layer"):
        m.construct_from_json(str(p), True)
    p.write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        m.construct_from_json(str(p), True)


def test_fused_inner_product_position_and_activation_default_as_in_hugectr(tmp_path):
    # HugeCTR's parser reads both keys only when present (test/scripts/dlrm_fp16_1gpu.json leaves them out)
    import json

    layers = [
        {
            "name": "data",
            "type": "Data",
            "source": "./x",
            "eval_source": "./y",
            "check": "Sum",
            "label": {"top": "label", "label_dim": 1},
            "dense": {"top": "dense", "dense_dim": 13},
            "sparse": [{"top": "data1", "slot_num": 2, "is_fixed_length": False, "nnz_per_slot": 1}],
        },
        {
            "name": "e",
            "type": "DistributedSlotSparseEmbeddingHash",
            "bottom": "data1",
            "top": "e",
            "sparse_embedding_hparam": {"embedding_vec_size": 4, "combiner": "sum", "workspace_size_per_gpu_in_mb": 1},
        },
        {"name": "fc1", "type": "FusedInnerProduct", "bottom": "dense", "top": "fc1", "fc_param": {"num_output": 8}},
        {"name": "fc2", "type": "InnerProduct", "bottom": "fc1", "top": "fc2", "fc_param": {"num_output": 1}},
        {"name": "loss", "type": "BinaryCrossEntropyLoss", "bottom": ["fc2", "label"], "top": "loss"},
    ]
    p = tmp_path / "g.json"
    p.write_text(json.dumps({"layers": layers}))
    m = hugectr.Model(
        hugectr.CreateSolver(batchsize=8),
        hugectr.DataReaderParams(
            data_reader_type=hugectr.DataReaderType_t.Norm,
            source=["x"],
            eval_source="y",
            check_type=hugectr.Check_t.Sum,
        ),
        hugectr.CreateOptimizer(),
    )
    m.construct_from_json(str(p), True)
    fc1 = next(layer for layer in m.layers if layer.cfg.top_names == ["fc1"])
    assert (fc1.cfg.pos_type, fc1.cfg.act_type) == (hugectr.FcPosition_t.Non, hugectr.Activation_t.Relu)
    layers[2]["position"] = "Sideways"
    p.write_text(json.dumps({"layers": layers}))
    m2 = hugectr.Model(m.solver, m.reader_params, m.opt_params)
    with pytest.raises(ValueError, match="Sideways"):
        m2.construct_from_json(str(p), True)


def test_a_tensor_read_by_more_than_five_layers_is_copied_by_a_chain_of_slices():
    from numbactr.files.graph_json import _copies

    layers, names = _copies("x", 11, 3)
    assert names == [f"x_slice{j}" for j in range(11)]
    assert [(s["bottom"], s["top"]) for s in layers] == [
        ("x", ["x_slice0", "x_slice1", "x_slice2", "x_slice3", "x_fanout0"]),
        ("x_fanout0", ["x_slice4", "x_slice5", "x_slice6", "x_slice7", "x_fanout1"]),
        ("x_fanout1", ["x_slice8", "x_slice9", "x_slice10"]),
    ]
    assert all(len(s["ranges"]) <= 5 and s["ranges"][0] == [0, 3] for s in layers)
    assert _copies("x", 5, 2)[1] == [f"x_slice{j}" for j in range(5)] and len(_copies("x", 5, 2)[0]) == 1


def test_mmoe_whose_input_feeds_six_layers_is_written_as_hugectr_reads_it(cpu):
    """The zoo's MMoE feeds one tensor to 4 experts and 2 gates: its graph file (HugeCTR's Slice takes at most
    5 ranges, so a chain of two) reads back, and numbactr's session and onnxruntime both serve it alike."""
    import io

    from numbactr.bench.common import Env
    from numbactr.bench import zoo_infer

    tab = zoo_infer.bench_zoo_infer(
        Env(use_torch=False), ["MMoE"], threads=[1], batches=[4], min_time=0.01, out=io.StringIO()
    )
    rows = [dict(zip(tab.columns, raw)) for raw in tab.raw]
    assert [r["impl"] for r in rows] == ["numbactr", "onnxruntime"]
    assert all(r["note"] == "" and 0 <= r["max abs diff"] <= 1e-5 for r in rows), rows
