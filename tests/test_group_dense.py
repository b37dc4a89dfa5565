"""GroupDenseLayer / GroupLayer_t and DenseLayerComputeConfig (issue 13, item 5).

A GroupFusedInnerProduct group is HugeCTR's shorthand for a Head/Body.../Tail chain of FusedInnerProducts;
model.add expands it, so a model built with the group must be the model built with those layers written
out by hand: same tensors and shapes, same weights, same losses step for step (bit for bit), same graph
JSON and summary. The DLRM graph is the one of HugeCTR's test/group_fc_test/dlrm_fp16.py (v23.08), in
float32 and shrunk.
"""

import contextlib
import io
import json
import warnings

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.runtime import device
from tests.model_util import tiny_data

L = hugectr.Layer_t
GROUP = hugectr.GroupLayer_t.GroupFusedInnerProduct
SLOTS, DENSE, VEC = 3, 2, 4


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_data(str(tmp_path_factory.mktemp("group_fc")), n_train=256, n_eval=128, slots=SLOTS, dense=DENSE)


def _bare(data, seed=3):
    """A Model with no layers (construct_from_json adds the Input and embedding)."""
    solver = hugectr.CreateSolver(
        batchsize=32, batchsize_eval=32, max_eval_batches=2, lr=0.01, vvgpu=[[0]], i64_input_key=True, seed=seed
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=[data[0]],
        eval_source=data[1],
        check_type=hugectr.Check_t.Sum,
    )
    opt = hugectr.CreateOptimizer(
        optimizer_type=hugectr.Optimizer_t.Adam,
        update_type=hugectr.Update_t.Global,
        beta1=0.9,
        beta2=0.999,
        epsilon=0.0001,
    )
    return hugectr.Model(solver, reader, opt)


def _base(data):
    m = _bare(data)
    opt = m.opt_params
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=DENSE,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, SLOTS)],
        )
    )
    m.add(
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
            workspace_size_per_gpu_in_mb=1,
            embedding_vec_size=VEC,
            combiner="sum",
            sparse_embedding_name="sparse_embedding1",
            bottom_name="data1",
            optimizer=opt,
        )
    )
    return m


def _fc(bottoms, tops, n, pos, act=hugectr.Activation_t.Relu):
    return hugectr.DenseLayer(L.FusedInnerProduct, bottoms, tops, num_output=n, pos_type=pos, act_type=act)


def _four(t):
    return [t, t + "_mask", t + "_dRelu", t + "_db"]


def dlrm_group(data):
    """test/group_fc_test/dlrm_fp16.py's graph (bottom MLP 512-256-128 -> 8-6-VEC, top MLP 1024-1024-512-256-1
    -> 16-16-8-4-1), written with GroupDenseLayer."""
    m = _base(data)
    m.add(
        hugectr.GroupDenseLayer(
            group_layer_type=GROUP,
            bottom_name_list=["dense"],
            top_name_list=["fc1", "fc2", "fc3"],
            num_outputs=[8, 6, VEC],
            last_act_type=hugectr.Activation_t.Relu,
        )
    )
    m.add(
        hugectr.DenseLayer(
            layer_type=L.Interaction, bottom_names=["fc3", "sparse_embedding1"], top_names=["interaction1"]
        )
    )
    m.add(
        hugectr.GroupDenseLayer(
            group_layer_type=GROUP,
            bottom_name_list=["interaction1"],
            top_name_list=["fc4", "fc5", "fc6", "fc7", "fc8"],
            num_outputs=[16, 16, 8, 4, 1],
            last_act_type=hugectr.Activation_t.Non,
        )
    )
    m.add(hugectr.DenseLayer(layer_type=L.BinaryCrossEntropyLoss, bottom_names=["fc8", "label"], top_names=["loss"]))
    return m


def dlrm_by_hand(data):
    """The same graph, each FusedInnerProduct written out as HugeCTR's Model::add(GroupDenseLayer&) makes it."""
    P = hugectr.FcPosition_t
    m = _base(data)
    m.add(_fc(["dense"], _four("fc1"), 8, P.Head))
    m.add(_fc(_four("fc1"), _four("fc2"), 6, P.Body))
    m.add(_fc(_four("fc2"), ["fc3"], VEC, P.Tail))
    m.add(hugectr.DenseLayer(L.Interaction, ["fc3", "sparse_embedding1"], ["interaction1"]))
    m.add(_fc(["interaction1"], _four("fc4"), 16, P.Head))
    for a, b, n in (("fc4", "fc5", 16), ("fc5", "fc6", 8), ("fc6", "fc7", 4)):
        m.add(_fc(_four(a), _four(b), n, P.Body))
    m.add(_fc(_four("fc7"), ["fc8"], 1, P.Tail, hugectr.Activation_t.Non))
    m.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc8", "label"], ["loss"]))
    return m


def _summary(m) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        m.summary()
    return out.getvalue()


def _train(m, steps):
    m.start_data_reading()
    losses = []
    for _ in range(steps):
        assert m.train()
        losses.append(m.get_current_loss())
    return losses


@pytest.mark.parametrize("dev", ["cpu", "sim"])
def test_group_equals_hand_expanded_layers(data, on_device, dev):
    on_device(dev)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing about the group warns
        a, b = dlrm_group(data), dlrm_by_hand(data)
        assert a.shapes == b.shapes
        assert a.shapes["fc2_db"] == (1, 6) and a.shapes["fc2_mask"] == (32, 6) and a.shapes["fc8"] == (32, 1)
        a.compile()
        b.compile()
        assert a.n_params == b.n_params
        np.testing.assert_array_equal(device.to_host(a.weights), device.to_host(b.weights))
        steps = 2 if dev == "sim" else 6
        la, lb = _train(a, steps), _train(b, steps)
    assert la == lb and all(np.isfinite(la))
    np.testing.assert_array_equal(device.to_host(a.weights), device.to_host(b.weights))
    for t in ("fc3", "interaction1", "fc8"):
        np.testing.assert_array_equal(
            a.check_out_tensor(t, hugectr.Tensor_t.Train), b.check_out_tensor(t, hugectr.Tensor_t.Train)
        )
    if dev == "cpu":
        assert la[-1] < la[0]  # it trains


def test_graph_json_and_summary_match_hugectr_expansion(data, tmp_path, cpu):
    a, b = dlrm_group(data), dlrm_by_hand(data)
    a.compile()
    b.compile()
    pa, pb = str(tmp_path / "group.json"), str(tmp_path / "hand.json")
    a.graph_to_json(pa)
    b.graph_to_json(pb)
    ja = json.load(open(pa))
    assert ja == json.load(open(pb))
    fcs = [d for d in ja["layers"] if d["type"] == "FusedInnerProduct"]
    assert [d["position"] for d in fcs] == ["Head", "Body", "Tail", "Head", "Body", "Body", "Body", "Tail"]
    assert [d["activation"] for d in fcs] == ["Relu"] * 7 + ["None"]
    assert fcs[0]["top"] == ["fc1", "fc1_mask", "fc1_dRelu", "fc1_db"] and fcs[1]["bottom"] == fcs[0]["top"]
    assert fcs[2]["top"] == "fc3" and [d["fc_param"]["num_output"] for d in fcs] == [8, 6, 4, 16, 16, 8, 4, 1]
    sa = _summary(a)
    assert sa == _summary(b)
    assert "fc4_dRelu" in sa and sa.count("FusedInnerProduct") == 8
    # the JSON reads back into the same graph, which trains as the group does
    c = _bare(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.construct_from_json(pa, include_dense_network=True)
    c.compile()
    assert c.shapes == a.shapes
    np.testing.assert_array_equal(device.to_host(c.weights), device.to_host(a.weights))
    assert _train(c, 3) == _train(a, 3)


def test_two_bottom_head_and_two_layer_group(data, cpu):
    """A two-layer group is Head + Tail; a Head may take a second bottom (the fp16 Interaction's mask)."""
    m = _base(data)
    m.add(hugectr.DenseLayer(L.Reshape, ["sparse_embedding1"], ["flat"], leading_dim=SLOTS * VEC))
    m.add(hugectr.GroupDenseLayer(GROUP, ["dense", "flat"], ["g1", "g2"], [5, 1], hugectr.Activation_t.Non))
    cfgs = [layer.cfg for layer in m.layers[1:]]
    assert [(c.pos_type, c.bottom_names, c.top_names) for c in cfgs] == [
        (hugectr.FcPosition_t.Head, ["dense", "flat"], _four("g1")),
        (hugectr.FcPosition_t.Tail, _four("g1"), ["g2"]),
    ]
    assert m.shapes["g1"] == (32, 5) and m.shapes["g2"] == (32, 1)


def test_bad_groups_fail_clearly(data, cpu):
    P = dict(group_layer_type=GROUP, bottom_name_list=["dense"])
    with pytest.raises(ValueError, match="at least two layers for GroupDenseLayer"):
        hugectr.GroupDenseLayer(top_name_list=["a"], num_outputs=[4], **P)
    with pytest.raises(ValueError, match=r"top_name_list has 2 names for 3 layers"):
        hugectr.GroupDenseLayer(top_name_list=["a", "b"], num_outputs=[4, 4, 1], **P)
    with pytest.raises(ValueError, match="num_outputs must be positive ints"):
        hugectr.GroupDenseLayer(top_name_list=["a", "b"], num_outputs=[4, 0], **P)
    with pytest.raises(ValueError, match="group_layer_type must be a GroupLayer_t"):
        hugectr.GroupDenseLayer(L.FusedInnerProduct, ["dense"], ["a", "b"], [4, 1])
    with pytest.raises(ValueError, match="last_act_type must be"):
        hugectr.GroupDenseLayer(top_name_list=["a", "b"], num_outputs=[4, 1], last_act_type="relu", **P)
    with pytest.raises(ValueError, match="bottom_name_list must name 1 tensor"):
        hugectr.GroupDenseLayer(GROUP, ["dense", "dense", "dense"], ["a", "b"], [4, 1])
    m = _base(data)
    with pytest.raises(
        hugectr.ModelError,
        match=r"GroupDenseLayer GroupFusedInnerProduct.*bottom tensor 'nope' "
        r"does not exist",
    ):
        m.add(hugectr.GroupDenseLayer(GROUP, ["nope"], ["a", "b"], [4, 1]))
    # a failure inside the group (the third layer's top exists already) adds none of its layers
    m.add(hugectr.DenseLayer(L.InnerProduct, ["dense"], ["c"], num_output=2))
    n, tensors = len(m.layers), dict(m.shapes)
    with pytest.raises(hugectr.ModelError, match=r"top tensor name 'c' already exists"):
        m.add(hugectr.GroupDenseLayer(GROUP, ["dense"], ["a", "b", "c"], [4, 3, 1]))
    assert len(m.layers) == n and m.shapes == tensors
    m.add(hugectr.GroupDenseLayer(GROUP, ["dense"], ["a", "b", "d"], [4, 3, 1]))  # the names are free again
    assert m.shapes["d"] == (32, 1)
    with pytest.raises(hugectr.ModelError, match="expected Input, SparseEmbedding, DenseLayer or GroupDenseLayer"):
        m.add(hugectr.GroupLayer_t.GroupFusedInnerProduct)


# ---- DenseLayerComputeConfig -------------------------------------------------------------------
def test_compute_config_accepted_and_round_tripped(data, tmp_path, cpu):
    CC = hugectr.DenseLayerComputeConfig
    assert CC() == CC(async_wgrad=False, fuse_wb=False) and CC(True, True).fuse_wb
    with pytest.raises(ValueError, match="async_wgrad must be a bool, got 1"):
        CC(async_wgrad=1)
    with pytest.raises(ValueError, match=r"DenseLayer MLP \['m'\]: compute_config must be a DenseLayerComputeConfig"):
        hugectr.DenseLayer(L.MLP, ["dense"], ["m"], num_outputs=[4], compute_config={"async_wgrad": True})

    def build(cc_mlp, cc_cross):
        m = _base(data)
        m.add(hugectr.DenseLayer(L.MultiCross, ["dense"], ["cross"], num_layers=2, compute_config=cc_cross))
        m.add(
            hugectr.DenseLayer(
                L.MLP,
                ["cross"],
                ["mlp"],
                num_outputs=[6, 1],
                activations=[hugectr.Activation_t.Relu, hugectr.Activation_t.Non],
                compute_config=cc_mlp,
            )
        )
        m.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["mlp", "label"], ["loss"]))
        m.compile()
        return m

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # layers that read it: no warning
        on = build(CC(async_wgrad=True, fuse_wb=True), CC(async_wgrad=True))
    off = build(CC(), CC())
    assert _train(on, 4) == _train(off, 4)  # speed settings: the same numbers
    np.testing.assert_array_equal(device.to_host(on.weights), device.to_host(off.weights))
    p = str(tmp_path / "cc.json")
    on.graph_to_json(p)
    layers = json.load(open(p))["layers"]
    by_type = {d["type"]: d for d in layers}
    assert by_type["MLP"]["compute_config"] == {"async_wgrad": True, "fuse_wb": True}
    assert by_type["MultiCross"]["compute_config"] == {"async_wgrad": True, "fuse_wb": False}
    off.graph_to_json(str(tmp_path / "off.json"))
    assert not any("compute_config" in d for d in json.load(open(tmp_path / "off.json"))["layers"])
    back = _bare(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back.construct_from_json(p, include_dense_network=True)
    assert back.layers[1].cfg.compute_config == CC(True, True)
    assert back.layers[0].cfg.compute_config == CC(async_wgrad=True)
    p2 = str(tmp_path / "again.json")
    back.graph_to_json(p2)
    assert json.load(open(p2)) == json.load(open(p))
    # a bad value in the file names the layer and key
    layers[-2]["compute_config"] = {"async_wgrad": "yes", "fuse_wb": False}
    with open(p, "w") as f:
        json.dump({"layers": layers}, f)
    with pytest.raises(ValueError, match=r"MLP, top 'mlp'.*bad value .* for key 'compute_config'"):
        _bare(data).construct_from_json(p, include_dense_network=True)


def test_compute_config_on_other_layers(data, cpu):
    CC = hugectr.DenseLayerComputeConfig
    with pytest.warns(
        hugectr.IgnoredArgumentWarning,
        match=r"DenseLayer ReLU \['r'\]: compute_config=.*is ignored: "
        r"Layer_t.ReLU does not use it \(HugeCTR reads it only",
    ):
        hugectr.DenseLayer(L.ReLU, ["x"], ["r"], compute_config=CC(async_wgrad=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hugectr.DenseLayer(L.ReLU, ["x"], ["r"], compute_config=CC())  # the default: silent
    m = _base(data)
    m.add(hugectr.DenseLayer(L.InnerProduct, ["dense"], ["fc"], num_output=VEC))
    with pytest.raises(hugectr.ModelError, match="async_wgrad=True needs the two-top"):  # as HugeCTR
        m.add(hugectr.DenseLayer(L.Interaction, ["fc", "sparse_embedding1"], ["i"], compute_config=CC(True)))
    m.add(hugectr.DenseLayer(L.Interaction, ["fc", "sparse_embedding1"], ["i"], compute_config=CC(fuse_wb=True)))
