"""Shape layers through the tape (sim == cpu), their validation at Model.add(), JSON keys."""

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.runtime import device
from numbactr.autograd import Tape, Tensor
from numbactr.layers import LayerError, RunInfo
from numbactr.layers.shape import LAYERS, ReshapeSelected, Slice
from tests.layer_sim_cpu import assert_sim_matches_cpu

L = hugectr.Layer_t
RNG = np.random.default_rng(0)


def _x(*shape):
    return RNG.normal(size=shape).astype(np.float32)


# ---- sim == cpu through the tape -------------------------------------------------------------
@pytest.mark.parametrize("layer_type", [L.ReduceSum, L.ReduceMean])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_reduce_layers(layer_type, axis):
    x = _x(3, 4, 2)
    _, (y,), (dx,) = assert_sim_matches_cpu(layer_type, [x], ["y"], axis=axis)
    ref = x.mean(axis, keepdims=True) if layer_type == L.ReduceMean else x.sum(axis, keepdims=True)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


def test_slice_layer_overlapping_ranges():
    x = _x(4, 6)
    layer, ys, (dx,) = assert_sim_matches_cpu(L.Slice, [x], ["a", "b", "c"], ranges=[(0, 3), (2, 5), (5, 6)])
    np.testing.assert_array_equal(ys[1], x[:, 2:5])
    # the overlap column 2 receives both tops' gradients
    rng = np.random.default_rng(0)
    dys = [rng.normal(size=y.shape).astype(np.float32) for y in ys]
    np.testing.assert_allclose(dx[:, 2], dys[0][:, 2] + dys[1][:, 0], rtol=1e-6)
    assert layer.json_params() == {"ranges": [[0, 3], [2, 5], [5, 6]]}


def test_select_layer_duplicates_add_and_unselected_get_zero():
    x = _x(2, 5, 3)
    layer, (y,), (dx,) = assert_sim_matches_cpu(L.Select, [x], ["y"], dim=1, index=[4, 1, 4])
    np.testing.assert_array_equal(y, x[:, [4, 1, 4]])
    dy = np.random.default_rng(0).normal(size=y.shape).astype(np.float32)
    np.testing.assert_allclose(dx[:, 4], dy[:, 0] + dy[:, 2], rtol=1e-6)
    assert not dx[:, [0, 2, 3]].any()
    assert layer.json_params() == {"dim": 1, "index": [4, 1, 4]}


def test_gather_layer():
    x = _x(6, 3)
    layer, (y,), (dx,) = assert_sim_matches_cpu(L.Gather, [x], ["y"], indices=[5, 0, 5, 2])
    np.testing.assert_array_equal(y, x[[5, 0, 5, 2]])
    assert layer.out_shapes == [(4, 3)] and not dx[[1, 3, 4]].any()
    assert layer.json_params() == {"indices": [5, 0, 5, 2]}


def test_fused_reshape_concat_layers():
    xs = [_x(2, 4, 3), _x(2, 4, 1)]
    layer, (item, ad), dxs = assert_sim_matches_cpu(L.FusedReshapeConcat, xs, ["item", "ad"])
    assert layer.out_shapes == [(6, 4), (2, 4)]
    np.testing.assert_array_equal(ad, np.concatenate([xs[0][:, 3], xs[1][:, 3]], axis=1))
    layer, (out,), _ = assert_sim_matches_cpu(L.FusedReshapeConcatGeneral, xs, ["out"])
    assert layer.out_shapes == [(8, 4)]
    np.testing.assert_array_equal(out, np.concatenate(xs, axis=2).reshape(8, 4))


def test_sequence_mask_layer_has_no_gradient():
    lf, lt = np.array([[2], [0], [5]], np.float32), np.array([[3], [1], [1]], np.float32)
    layer, (m,), grads = assert_sim_matches_cpu(
        L.SequenceMask, [lf, lt], ["mask"], max_sequence_len_from=4, max_sequence_len_to=3
    )
    assert m.shape == (3, 1, 4, 3) and m[0, 0].sum() == 6 and m[1].sum() == 0 and m[2, 0].sum() == 4
    assert grads == [None, None]
    assert layer.json_params() == {"max_sequence_len_from": 4, "max_sequence_len_to": 3}


def test_one_bottom_sequence_mask_of_hugectr_v23_06():
    lt = np.array([[3], [0], [5]], np.float32)
    layer, (m,), grads = assert_sim_matches_cpu(L.SequenceMask, [lt], ["mask"], max_sequence_len=4)
    assert m.shape == (3, 1, 1, 4) and grads == [None]
    np.testing.assert_array_equal(m[:, 0, 0], [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert layer.json_params() == {"max_sequence_len": 4}
    from numbactr.files import graph_json

    d = graph_json.dense_layer_json(layer.cfg)
    assert d["max_sequence_len"] == 4 and "max_sequence_len_to" not in d
    assert graph_json.dense_layer_from_json(d).max_sequence_len == 4


def test_reshape_selected_gathers_slots_and_zero_fills_the_rest():
    x = _x(2, 4, 3)
    layer, (y,), (dx,) = assert_sim_matches_cpu(
        L.Reshape, [x], ["y"], cls=ReshapeSelected, selected=True, selected_slots=[3, 1]
    )
    assert layer.type_name == "Reshape" and layer.out_shapes == [(2, 6)]
    np.testing.assert_array_equal(y, x[:, [3, 1]].reshape(2, 6))
    assert not dx[:, [0, 2]].any()
    assert layer.json_params() == {"selected": [3, 1]}
    assert L.Reshape not in LAYERS  # core.Reshape dispatches to it


def test_unused_top_of_a_multi_top_layer_adds_nothing():
    # only the first Slice top gets a gradient
    before = device.kind()
    try:
        for kind in ("cpu", "sim") if device._numba_simulated() else ("cpu",):
            device.set_device(kind)
            layer = Slice(hugectr.DenseLayer(L.Slice, ["x"], ["a", "b"], ranges=[(0, 2), (1, 3)]), [(2, 3)])
            x = Tensor(np.ones((2, 3), np.float32), requires_grad=True)
            tape = Tape()
            a, _ = layer.forward(tape, [x], RunInfo(True, 2))
            tape.backward({id(a): (a, np.ones((2, 2), np.float32))})
            np.testing.assert_array_equal(device.to_host(x.grad), [[1, 1, 0], [1, 1, 0]])
    finally:
        device.set_device(before)


# ---- validation at Model.add() ---------------------------------------------------------------
def _model():
    solver = hugectr.CreateSolver(batchsize=8, batchsize_eval=8, i64_input_key=True)
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=["unused.txt"],
        eval_source="unused.txt",
        check_type=hugectr.Check_t.Sum,
    )
    m = hugectr.Model(solver, reader, hugectr.CreateOptimizer())
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=6,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 3)],
        )
    )
    m.add(
        hugectr.SparseEmbedding(hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash, 1, 4, "sum", "emb", "data1")
    )  # emb (8, 3, 4)
    return m


@pytest.mark.parametrize(
    "params,match",
    [
        (dict(ranges=[]), "ranges must not be empty"),
        (dict(ranges=[(0, 1)] * 6), "at most 5 ranges"),
        (dict(ranges=[(3, 2)]), r"range \(3, 2\) is reversed"),
        (dict(ranges=[(-1, 2)]), "negative"),
        (dict(ranges=[(2, 4), (1, 5)]), "out of order or included"),
        (dict(ranges=[(0, 4), (1, 3)]), "out of order or included"),
        (dict(ranges=[(0, 7)]), r"exceeds the width 6 of input 'dense' \(8, 6\)"),
    ],
)
def test_slice_validation(params, match):
    with pytest.raises(hugectr.ModelError, match=match):
        _model().add(hugectr.DenseLayer(L.Slice, ["dense"], ["s"], **params))


def test_slice_top_count_must_match_ranges():
    with pytest.raises(hugectr.ModelError, match="expects 2 top tensor"):
        _model().add(hugectr.DenseLayer(L.Slice, ["dense"], ["s"], ranges=[(0, 2), (2, 4)]))


def test_shape_layer_validation_messages():
    m = _model()
    with pytest.raises(hugectr.ModelError, match=r"axis must be an int in 0..2 .*'emb' \(8, 3, 4\), got 3"):
        m.add(hugectr.DenseLayer(L.ReduceSum, ["emb"], ["r"], axis=3))
    with pytest.raises(hugectr.ModelError, match=r"ReduceMean.*axis must be an int in 0..1"):
        m.add(hugectr.DenseLayer(L.ReduceMean, ["dense"], ["r"], axis=-1))
    with pytest.raises(hugectr.ModelError, match="dim 0 is the batch"):
        m.add(hugectr.DenseLayer(L.Select, ["emb"], ["s"], dim=0, index=[0]))
    with pytest.raises(hugectr.ModelError, match=r"index entry 3 is out of range 0..2 of dim 1 of 'emb'"):
        m.add(hugectr.DenseLayer(L.Select, ["emb"], ["s"], dim=1, index=[0, 3]))
    with pytest.raises(hugectr.ModelError, match="index must not be empty"):
        m.add(hugectr.DenseLayer(L.Select, ["emb"], ["s"], dim=2, index=[]))
    with pytest.raises(hugectr.ModelError, match=r"Gather.*'emb' must be 2-D"):
        m.add(hugectr.DenseLayer(L.Gather, ["emb"], ["g"], indices=[0]))
    with pytest.raises(hugectr.ModelError, match=r"indices entry 8 is out of range 0..7 of the rows of 'dense'"):
        m.add(hugectr.DenseLayer(L.Gather, ["dense"], ["g"], indices=[1, 8]))
    with pytest.raises(hugectr.ModelError, match=r"'dense' must be 3-D \(B, S, w\)"):
        m.add(hugectr.DenseLayer(L.FusedReshapeConcat, ["emb", "dense"], ["i", "a"]))
    with pytest.raises(hugectr.ModelError, match="expects 2 top tensors"):
        m.add(hugectr.DenseLayer(L.FusedReshapeConcat, ["emb"], ["i"]))
    with pytest.raises(hugectr.ModelError, match=r"SequenceMask.*lengths \(B, 1\).*'dense' \(8, 6\)"):
        m.add(hugectr.DenseLayer(L.SequenceMask, ["dense", "label"], ["m"]))
    with pytest.raises(hugectr.ModelError, match="max_sequence_len_to must be a positive int, got 0"):
        m.add(hugectr.DenseLayer(L.SequenceMask, ["label", "label"], ["m"], max_sequence_len_to=0))
    # valid layers add and declare full shapes
    m.add(hugectr.DenseLayer(L.ReduceSum, ["emb"], ["rs"], axis=1))
    m.add(hugectr.DenseLayer(L.Slice, ["dense"], ["s0", "s1"], ranges=[(0, 4), (2, 6)]))
    m.add(hugectr.DenseLayer(L.FusedReshapeConcat, ["emb", "emb"], ["item", "ad"]))
    m.add(
        hugectr.DenseLayer(L.SequenceMask, ["label", "label"], ["mask"], max_sequence_len_from=2, max_sequence_len_to=5)
    )
    assert (m.shapes["rs"], m.shapes["s1"], m.shapes["item"], m.shapes["ad"], m.shapes["mask"]) == (
        (8, 1, 4),
        (8, 4),
        (16, 8),
        (8, 8),
        (8, 1, 2, 5),
    )


def test_reshape_selected_validation():
    def build(shape, **kw):
        cfg = hugectr.DenseLayer(L.Reshape, ["emb"], ["r"], **kw)
        return ReshapeSelected(cfg, [shape])

    with pytest.raises(LayerError, match="only selected=True"):
        build((8, 3, 4), leading_dim=12)
    with pytest.raises(LayerError, match=r"3-D input \(B, S, V\)"):
        build((8, 12), selected=True, selected_slots=[0])
    with pytest.raises(LayerError, match=r"selected_slots entry 3 is out of range 0..2"):
        build((8, 3, 4), selected=True, selected_slots=[3])
    with pytest.raises(LayerError, match="4 entries, more than the 3 slots"):
        build((8, 3, 4), selected=True, selected_slots=[0, 1, 2, 0])
    assert build((8, 3, 4), selected=True, selected_slots=[2, 0]).out_shapes == [(8, 8)]
