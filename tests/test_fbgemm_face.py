"""FBGEMM's TBE face (numbactr/fbgemm_gpu): enums, argument mapping, FBGEMM's semantics the face owns
(layouts, variable batch, iteration counting, gradient clipping on dLoss/dout, which optimizer takes
max_norm and weight decay), clear errors, and the array face (NumPy, explicit backward) against the engine
used directly. The torch face and the DLRM: test_fbgemm_face_torch.py; against fbgemm_gpu itself:
test_fbgemm_face_diff.py."""

import importlib
import sys
import warnings

import numpy as np
import pytest

from numbactr.runtime import device
from numbactr.config import IgnoredArgumentWarning
from numbactr.embedding.engine import EmbeddingBoundsError, Optim, OptimizerSpec, Pooling, TableBatchedEmbedding
from numbactr.fbgemm_gpu import split_table_batched_embeddings_ops_common as common
from numbactr.fbgemm_gpu.array_tbe import ArrayTBE
from numbactr.fbgemm_gpu.split_embedding_configs import EmbOptimType, OptimType, SparseType
from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    BoundsCheckMode,
    CacheAlgorithm,
    ComputeDevice,
    EmbeddingLocation,
    PoolingMode,
    WeightDecayMode,
)
from numbactr.fbgemm_gpu.optimizer_config import CowClipDefinition, UserEnabledConfigDefinition

HOST = (EmbeddingLocation.HOST, ComputeDevice.CPU)


pytestmark = pytest.mark.usefixtures("cpu")  # conftest.py: the cpu device for every test


def tbe(specs, **kw):
    return ArrayTBE([(r, d, *HOST) for r, d in specs], **kw)


def batch(rng, rows_of_feature, b, max_len=3):
    """(indices, offsets) of b random bags per feature, feature-major; some bags empty."""
    lens = rng.integers(0, max_len + 1, len(rows_of_feature) * b)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    feat = np.repeat(np.arange(lens.size) // b, lens)
    indices = (rng.random(offsets[-1]) * np.asarray(rows_of_feature)[feat]).astype(np.int64)
    return indices, offsets


def fill(face, seed=0):
    rng = np.random.default_rng(seed)
    for w in face.split_embedding_weights():
        w[...] = rng.uniform(-1, 1, w.shape)


# ---- enums --------------------------------------------------------------------------------------------
def test_enum_names_and_values_are_fbgemms():
    assert {m.name: m.value for m in EmbeddingLocation} == dict(DEVICE=0, MANAGED=1, MANAGED_CACHING=2, HOST=3, MTIA=4)
    assert {m.name: m.value for m in ComputeDevice} == dict(CPU=0, CUDA=1, MTIA=2)
    assert {m.name: m.value for m in PoolingMode} == dict(SUM=0, MEAN=1, NONE=2)
    assert {m.name: m.value for m in BoundsCheckMode} == dict(
        FATAL=0, WARNING=1, IGNORE=2, NONE=3, V2_IGNORE=4, V2_WARNING=5, V2_FATAL=6
    )
    assert {m.name: m.value for m in CacheAlgorithm} == dict(LRU=0, LFU=1)
    assert {m.name: m.value for m in WeightDecayMode} == dict(
        NONE=0, L2=1, DECOUPLE=2, COUNTER=3, COWCLIP=4, DECOUPLE_GLOBAL=5
    )
    assert OptimType is EmbOptimType
    assert EmbOptimType.EXACT_ROWWISE_ADAGRAD.value == "exact_row_wise_adagrad"
    assert str(EmbOptimType.PARTIAL_ROWWISE_ADAM) == "partial_row_wise_adam"
    assert [SparseType.FP32.as_int(), SparseType.FP16.as_int(), SparseType.BF16.as_int()] == [0, 1, 5]
    assert SparseType.from_int(1) is SparseType.FP16 and SparseType.FP16.bit_rate() == 16
    assert SparseType.from_dtype(np.float16) is SparseType.FP16
    assert PoolingMode.from_str("mean") is PoolingMode.MEAN and not PoolingMode.NONE.do_pooling()
    with pytest.raises(ValueError):
        SparseType.from_int(7)


def test_enums_match_fbgemm_when_installed():
    pytest.importorskip("fbgemm_gpu")
    from fbgemm_gpu import split_embedding_configs as fc
    from fbgemm_gpu import split_table_batched_embeddings_ops_common as fcommon
    from fbgemm_gpu import split_table_batched_embeddings_ops_training as ftrain

    pairs = [
        (common.EmbeddingLocation, fcommon.EmbeddingLocation),
        (common.PoolingMode, fcommon.PoolingMode),
        (common.BoundsCheckMode, fcommon.BoundsCheckMode),
        (common.CacheAlgorithm, fcommon.CacheAlgorithm),
        (common.ComputeDevice, ftrain.ComputeDevice),
        (common.WeightDecayMode, ftrain.WeightDecayMode),
        (EmbOptimType, fc.EmbOptimType),
        (SparseType, fc.SparseType),
    ]
    for ours, theirs in pairs:
        assert {m.name: m.value for m in ours} == {m.name: m.value for m in theirs}, ours
    assert [SparseType(v.value).as_int() for v in fc.SparseType] == [v.as_int() for v in fc.SparseType]


def test_module_paths_export_fbgemms_names():
    from numbactr.fbgemm_gpu import split_table_batched_embeddings_ops as old
    from numbactr.fbgemm_gpu import split_table_batched_embeddings_ops_training as train

    for name in (
        "SplitTableBatchedEmbeddingBagsCodegen",
        "EmbeddingLocation",
        "ComputeDevice",
        "PoolingMode",
        "OptimType",
        "SparseType",
        "BoundsCheckMode",
        "CacheAlgorithm",
        "WeightDecayMode",
    ):
        assert hasattr(train, name) and hasattr(old, name), name
    assert train.get_available_compute_device() == ComputeDevice.CPU


# ---- layout and the array face ------------------------------------------------------------------------
def test_fbgemm_documented_two_table_example_layout():
    # FBGEMM's forward() docstring: tables (3, 8) and (5, 4), batch 3, two features
    face = ArrayTBE(
        [(3, 8, EmbeddingLocation.DEVICE, ComputeDevice.CUDA), (5, 4, EmbeddingLocation.MANAGED, ComputeDevice.CUDA)]
    )
    face.init_embedding_weights_uniform(-1, 1)
    w0, w1 = (np.array(w) for w in face.split_embedding_weights())
    assert w0.shape == (3, 8) and w1.shape == (5, 4) and np.abs(w0).max() <= 1 and w0.std() > 0.3
    indices = np.array([0, 1, 2, 0, 1, 2, 0, 3, 1, 4, 2, 0, 0])
    offsets = np.array([0, 2, 5, 7, 9, 12, 13])
    out = face(indices, offsets)
    assert out.shape == (3, 12) and out.dtype == np.float32
    want = np.concatenate(
        [
            np.stack([w0[[0, 1]].sum(0), w0[[2, 0, 1]].sum(0), w0[[2, 0]].sum(0)]),
            np.stack([w1[[3, 1]].sum(0), w1[[4, 2, 0]].sum(0), w1[[0]].sum(0)]),
        ],
        axis=1,
    )
    np.testing.assert_allclose(out, want, rtol=1e-6)


@pytest.mark.parametrize(
    "opt,engine_kind",
    [
        (EmbOptimType.EXACT_ADAGRAD, Optim.EXACT_ADAGRAD),
        (EmbOptimType.ADAM, Optim.ADAM),
        (EmbOptimType.PARTIAL_ROWWISE_LAMB, Optim.PARTIAL_ROWWISE_LAMB),
    ],
)
def test_array_face_steps_equal_the_engine(opt, engine_kind):
    specs, ftm = [(11, 8), (6, 4)], [0, 1, 0]
    face = tbe(specs, feature_table_map=ftm, optimizer=opt, learning_rate=0.05, pooling_mode=PoolingMode.MEAN)
    eng = TableBatchedEmbedding(specs, ftm, pooling=Pooling.MEAN, optimizer=OptimizerSpec(engine_kind, 0.05))
    fill(face)
    for w, v in zip(eng.split_weights(), face.split_embedding_weights()):
        w[...] = v
    rng = np.random.default_rng(1)
    for _ in range(3):
        idx, off = batch(rng, [11, 6, 11], 4)
        out = face(idx, off)
        want, ctx = eng.forward(idx, off)
        np.testing.assert_array_equal(out, want)
        dy = rng.standard_normal(out.shape).astype(np.float32)
        face.backward(dy)
        eng.backward(ctx, dy)
    for a, b in zip(face.split_embedding_weights(), eng.split_weights()):
        np.testing.assert_array_equal(a, b)
    for sa, sb in zip(face.split_optimizer_states(), eng.split_optimizer_states()):
        for a, b in zip(sa, sb):
            np.testing.assert_array_equal(a, b)


def test_adam_counts_iterations_at_forward_as_fbgemm():
    # two forwards, then their backwards: FBGEMM's updates use t = 1 and t = 2 (the forwards' iter)
    specs = [(5, 4)]
    face = tbe(specs, optimizer=EmbOptimType.ADAM, learning_rate=0.1)
    fill(face)
    eng = TableBatchedEmbedding(specs, optimizer=OptimizerSpec(Optim.ADAM, 0.1))
    eng.split_weights()[0][...] = face.split_embedding_weights()[0]
    idx, off = np.array([1, 2, 1]), np.array([0, 2, 3])
    _, first = face.forward(idx, off, return_lookup=True)
    _, second = face.forward(idx, off, return_lookup=True)
    assert (first.iteration, second.iteration, int(face.iter[0]), face.step) == (1, 2, 2, 2)
    dy = np.ones((2, 4), np.float32)
    face.backward(dy, second)
    face.backward(2 * dy, first)
    _, ctx = eng.forward(idx, off)
    eng.step = 1  # t = 2 first, then t = 1
    eng.backward(ctx, dy)
    eng.step = 0
    eng.backward(ctx, 2 * dy)
    np.testing.assert_array_equal(face.split_embedding_weights()[0], eng.split_weights()[0])
    face.set_optimizer_step(10)
    _, third = face.forward(idx, off, return_lookup=True)
    assert third.iteration == 11
    sgd = tbe(specs)  # EXACT_SGD: FBGEMM's iter stays 0
    sgd(idx, off)
    assert int(sgd.iter[0]) == 0 and sgd.step == 1


def test_gradient_clipping_clamps_dloss_dout_not_row_sums():
    # row 1 occurs twice in one bag: FBGEMM clamps each dout element to 0.5, then sums (1.0 per element);
    # clipping the row's summed gradient (1.6) would give 0.5
    face = tbe([(4, 4)], learning_rate=1.0, gradient_clipping=True, max_gradient=0.5)
    before = np.array(face.split_embedding_weights()[0])
    face(np.array([1, 1]), np.array([0, 2]))
    face.backward(np.full((1, 4), 0.8, np.float32))
    np.testing.assert_allclose(before[1] - face.split_embedding_weights()[0][1], 1.0)


def test_max_norm_only_for_rowwise_adagrad_and_weight_decay_only_where_fbgemm_reads_it():
    idx, off = np.array([0, 1]), np.array([0, 1, 2])
    dy = np.ones((2, 4), np.float32)

    def run(**kw):
        face = tbe([(3, 4)], learning_rate=0.1, **kw)
        fill(face)
        face(idx, off)
        face.backward(dy)
        return np.array(face.split_embedding_weights()[0])

    np.testing.assert_array_equal(run(optimizer=EmbOptimType.ADAM, max_norm=0.01), run(optimizer=EmbOptimType.ADAM))
    np.testing.assert_array_equal(run(weight_decay=0.5), run())  # EXACT_SGD ignores it
    np.testing.assert_array_equal(
        run(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, weight_decay=0.5),
        run(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD),
    )  # mode NONE
    assert not np.array_equal(run(optimizer=EmbOptimType.ADAM, weight_decay=0.5), run(optimizer=EmbOptimType.ADAM))
    capped = run(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, max_norm=0.1)
    assert np.linalg.norm(capped[:2], axis=1).max() <= 0.1 + 1e-6
    decayed = run(
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, weight_decay=0.5, weight_decay_mode=WeightDecayMode.DECOUPLE
    )
    assert np.abs(decayed[2]).max() == np.abs(run(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)[2]).max()


def test_split_optimizer_states_in_fbgemms_order_and_shapes():
    specs = [(5, 4), (3, 8)]
    shapes = {
        EmbOptimType.EXACT_SGD: [],
        EmbOptimType.EXACT_ADAGRAD: [[(5, 4)], [(3, 8)]],
        EmbOptimType.EXACT_ROWWISE_ADAGRAD: [[(5,)], [(3,)]],
        EmbOptimType.ADAM: [[(5, 4), (5, 4)], [(3, 8), (3, 8)]],
        EmbOptimType.PARTIAL_ROWWISE_ADAM: [[(5, 4), (5,)], [(3, 8), (3,)]],
        EmbOptimType.LAMB: [[(5, 4), (5, 4)], [(3, 8), (3, 8)]],
    }
    for opt, want in shapes.items():
        face = tbe(specs, optimizer=opt)
        assert [[s.shape for s in t] for t in face.split_optimizer_states()] == want, opt
    assert [list(d) for d in tbe(specs, optimizer=EmbOptimType.ADAM).get_optimizer_state()] == [
        ["exp_avg", "exp_avg_sq"]
    ] * 2
    assert tbe(specs).get_optimizer_state() == []


def test_hyper_parameters_and_learning_rate():
    face = tbe([(5, 4)], optimizer=EmbOptimType.ADAM, learning_rate=0.1)
    face.set_learning_rate(0.25)
    face.update_hyper_parameters({"eps": 1e-3, "beta1": 0.5, "beta2": 0.75, "weight_decay": 0.1, "lower_bound": 0.0})
    opt = face.engine.optimizer
    assert (face.get_learning_rate(), opt.eps, opt.beta1, opt.beta2, opt.weight_decay) == (0.25, 1e-3, 0.5, 0.75, 0.1)
    face.update_hyper_parameters({"lr": 0.5})
    assert face.get_learning_rate() == 0.5
    with pytest.raises(NotImplementedError, match="momentum"):
        face.update_hyper_parameters({"momentum": 0.1})
    none = tbe([(5, 4)], optimizer=EmbOptimType.NONE)
    for call in (
        lambda: none.set_learning_rate(0.1),
        lambda: none.split_optimizer_states(),
        lambda: none.set_optimizer_step(3),
        lambda: none.update_hyper_parameters({"lr": 1.0}),
    ):
        with pytest.raises(NotImplementedError):
            call()


def test_optimizer_none_returns_the_sparse_row_gradient():
    face = tbe([(5, 4), (3, 4)], optimizer=EmbOptimType.NONE)
    fill(face)
    before = [np.array(w) for w in face.split_embedding_weights()]
    with pytest.raises(ValueError, match="total_unique_indices"):
        face(np.array([1, 1, 2]), np.array([0, 2, 3]))
    face(np.array([1, 1, 2]), np.array([0, 2, 3]), total_unique_indices=2)
    grads = face.backward(np.arange(8, dtype=np.float32).reshape(1, 8))
    for w, b in zip(face.split_embedding_weights(), before):
        np.testing.assert_array_equal(w, b)  # no update
    (r0, g0), (r1, g1) = grads.sparse.per_table()
    assert r0.tolist() == [1] and r1.tolist() == [2]
    np.testing.assert_array_equal(g0, [[0, 2, 4, 6]])
    np.testing.assert_array_equal(g1, [[4, 5, 6, 7]])


def test_variable_batch_sizes_use_fbgemms_vbe_layout():
    # 2 features (D 4 and 8), 2 ranks: B[f][r] = [[1, 2], [2, 1]]; offsets feature-major, then rank
    specs = [(10, 4), (10, 8)]
    face = tbe(specs, learning_rate=1.0)
    fill(face)
    w0, w1 = (np.array(w) for w in face.split_embedding_weights())
    idx = np.array([1, 2, 3, 4, 5, 6, 7])
    off = np.array([0, 1, 2, 4, 5, 6, 7])  # f0: [1] | [2] [3 4]; f1: [5] [6] | [7]
    out = face(idx, off, batch_size_per_feature_per_rank=[[1, 2], [2, 1]])
    # rank-major output: r0 (f0 b0, f1 b0 b1), r1 (f0 b0 b1, f1 b0)
    want = np.concatenate([w0[1], w1[5], w1[6], w0[2], w0[3] + w0[4], w1[7]])
    assert out.shape == (36,)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    dy = np.arange(36, dtype=np.float32)
    face.backward(dy)
    new0, new1 = face.split_embedding_weights()
    np.testing.assert_allclose(w0[1] - new0[1], dy[0:4], rtol=1e-6)
    np.testing.assert_allclose(w0[3] - new0[3], dy[24:28], rtol=1e-6)
    np.testing.assert_allclose(w0[4] - new0[4], dy[24:28], rtol=1e-6)
    np.testing.assert_allclose(w1[7] - new1[7], dy[28:36], rtol=1e-5)
    with pytest.raises(ValueError, match="sums to 5 bags"):
        face(idx, off, batch_size_per_feature_per_rank=[[1, 2], [1, 1]])
    face(idx, off, batch_size_per_feature_per_rank=[[1, 2], [2, 1]])
    with pytest.raises(ValueError, match="shape"):
        face.backward(np.zeros((3, 12), np.float32))


def test_bounds_check_modes():
    idx, off = np.array([0, 9]), np.array([0, 1, 2])
    with pytest.raises(EmbeddingBoundsError):
        tbe([(3, 4)], bounds_check_mode=BoundsCheckMode.FATAL)(idx, off)
    with pytest.raises(EmbeddingBoundsError):
        tbe([(3, 4)], bounds_check_mode=BoundsCheckMode.V2_FATAL)(idx, off)
    face = tbe([(3, 4)])
    fill(face)
    with pytest.warns(RuntimeWarning, match="index 9"):
        out = face(idx, off)
    np.testing.assert_array_equal(out[1], face.split_embedding_weights()[0][0])  # set to row 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tbe([(3, 4)], bounds_check_mode=BoundsCheckMode.IGNORE)(idx, off)


def test_fbgemm_bounds_check_environment_override(monkeypatch):
    monkeypatch.setenv("FBGEMM_TBE_BOUNDS_CHECK_MODE", "0")
    face = tbe([(3, 4)])
    assert face.bounds_check_mode_int == BoundsCheckMode.FATAL
    with pytest.raises(EmbeddingBoundsError):
        face(np.array([5]), np.array([0, 1]))


def test_managed_caching_runs_cached_with_the_same_results():
    # the cache itself: tests/test_fbgemm_face_cache.py
    face = ArrayTBE([(4, 4, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA)], cache_load_factor=0.5)
    plain = ArrayTBE([(4, 4, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)])
    for f in (face, plain):
        fill(f)
        f(np.array([1, 3]), np.array([0, 2]))
        f.backward(np.ones((1, 4), np.float32))
    assert face.cached and face.engine.capacities == [4]  # one set of 32 rows holds the table
    np.testing.assert_array_equal(face.split_embedding_weights()[0], plain.split_embedding_weights()[0])
    with pytest.raises(NotImplementedError, match="cache_precision"):
        ArrayTBE([(4, 4, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA)], cache_precision=SparseType.FP16)
    with pytest.warns(IgnoredArgumentWarning, match="use_experimental_tbe"):
        tbe([(4, 4)], use_experimental_tbe=True)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(optimizer=EmbOptimType.SHAMPOO), NotImplementedError, "SHAMPOO"),
        (dict(optimizer=EmbOptimType.ENSEMBLE_ROWWISE_ADAGRAD), NotImplementedError, "ENSEMBLE_ROWWISE_ADAGRAD"),
        (dict(optimizer=EmbOptimType.SGD), ValueError, "deprecated"),
        (dict(optimizer="adagrad_w"), ValueError, "EmbOptimType"),
        (dict(weights_precision=SparseType.INT4), NotImplementedError, "INT4"),
        (dict(weights_precision=SparseType.INT8, optimizer=EmbOptimType.NONE), NotImplementedError, "forward only"),
        (dict(output_dtype=SparseType.INT8), NotImplementedError, "output_dtype=INT8"),
        (dict(learning_rate=float("nan")), ValueError, "finite"),
        (dict(optimizer=EmbOptimType.ADAM, beta2=float("inf")), ValueError, "finite"),
        (dict(output_dtype=SparseType.BF16), NotImplementedError, "BF16"),
        (
            dict(
                optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                weight_decay_mode=WeightDecayMode.COUNTER,
                counter_based_regularization=object(),
            ),
            TypeError,
            "CounterBasedRegularizationDefinition",
        ),
        (
            dict(
                optimizer=EmbOptimType.EXACT_ADAGRAD,
                weight_decay_mode=WeightDecayMode.COWCLIP,
                cowclip_regularization=CowClipDefinition(),
            ),
            ValueError,
            "EXACT_ROWWISE_ADAGRAD",
        ),
        (
            dict(
                optimizer=EmbOptimType.EXACT_SGD,
                extra_optimizer_config=UserEnabledConfigDefinition(use_rowwise_bias_correction=True),
            ),
            AssertionError,
            "only supported for OptimType.ADAM",
        ),
        (dict(weight_decay_mode=WeightDecayMode.COUNTER), ValueError, "counter_based_regularization"),
        (dict(weight_decay_mode=WeightDecayMode.DECOUPLE_GLOBAL), ValueError, "DECOUPLE_GLOBAL"),
        (dict(preallocated_host_buffers={"momentum1": np.zeros(32, np.float32)}), AssertionError, "not consumed"),
        (dict(preallocated_host_buffers={"weights": np.zeros(31, np.float32)}), ValueError, "size mismatch"),
        (dict(enable_raw_embedding_streaming=True), NotImplementedError, "raw_embedding"),
        (dict(optimizer_state_dtypes={"momentum1": SparseType.FP16}), NotImplementedError, "optimizer_state_dtypes"),
        (dict(embedding_table_index_type="int16"), ValueError, "int32 or int64"),
        (dict(feature_table_map=[0, 0]), ValueError, "table"),
        (dict(feature_table_map=[0, 5]), ValueError, "feature_table_map"),
        (dict(no_such_argument=1), TypeError, "no_such_argument"),
    ],
)
def test_bad_arguments_get_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        tbe([(5, 4), (3, 4)], **kwargs)


def test_a_non_finite_learning_rate_is_refused_and_changes_nothing():
    m = tbe([(5, 4)], learning_rate=0.5)
    with pytest.raises(ValueError, match="finite"):
        m.set_learning_rate(float("nan"))
    assert m.get_learning_rate() == 0.5


@pytest.mark.parametrize(
    "specs,match",
    [
        ([(5, 4, EmbeddingLocation.DEVICE, ComputeDevice.CPU)], "HOST"),
        ([(5, 4, EmbeddingLocation.HOST, ComputeDevice.CUDA)], "HOST"),
        ([(5, 4, *HOST), (5, 4, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)], "Heterogenous"),
        ([(5, 4, EmbeddingLocation.MTIA, ComputeDevice.MTIA)], "MTIA"),
        ([(5, -1, *HOST)], "dim"),
        ([(5,)], "expected"),
        ([], "empty"),
    ],
)
def test_bad_embedding_specs(specs, match):
    with pytest.raises((ValueError, NotImplementedError), match=match):
        ArrayTBE(specs)


def test_mixed_dims_need_pooling_and_backward_needs_a_forward():
    with pytest.raises(ValueError, match="mixed dimension"):
        tbe([(5, 4), (3, 8)], pooling_mode=PoolingMode.NONE)
    face = tbe([(5, 4), (3, 4)], pooling_mode=PoolingMode.NONE)
    out = face(np.array([1, 2, 0]), np.array([0, 2, 3]))
    assert out.shape == (3, 4)
    face.backward(np.ones((3, 4), np.float32))
    with pytest.raises(RuntimeError, match="no training forward"):
        face.backward(np.ones((3, 4), np.float32))
    face.eval()
    face(np.array([1, 2, 0]), np.array([0, 2, 3]))
    with pytest.raises(RuntimeError, match="no training forward"):
        face.backward(np.ones((3, 4), np.float32))


def test_fp16_weights_and_output():
    face = tbe([(6, 8)], weights_precision=SparseType.FP16, output_dtype=SparseType.FP16)
    fill(face)
    assert face.split_embedding_weights()[0].dtype == np.float16
    out = face(np.array([1, 2]), np.array([0, 2]))
    assert out.dtype == np.float16 and face.output_dtype == SparseType.FP16.as_int()


def test_without_torch_the_training_module_exports_the_array_face(monkeypatch):
    import numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_training as train

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    try:
        reloaded = importlib.reload(train)
        assert reloaded.SplitTableBatchedEmbeddingBagsCodegen is ArrayTBE
        face = reloaded.SplitTableBatchedEmbeddingBagsCodegen([(4, 4, *HOST)])
        assert face(np.array([1]), np.array([0, 1])).shape == (1, 4)
    finally:
        monkeypatch.undo()
        importlib.reload(train)


def test_sim_device_runs_the_same_face():
    """The face is device-agnostic: on the sim device (the engine's kernel path in the simulator), tiny
    shapes give the cpu device's result."""
    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    results = []
    for kind in ("cpu", "sim"):
        device.set_device(kind)
        face = tbe(
            [(5, 4), (3, 4)],
            optimizer=EmbOptimType.PARTIAL_ROWWISE_ADAM,
            learning_rate=0.1,
            pooling_mode=PoolingMode.MEAN,
        )
        fill(face)
        out = face(np.array([1, 4, 2, 0]), np.array([0, 2, 2, 3, 4]))
        face.backward(np.linspace(-1, 1, out.size, dtype=np.float32).reshape(out.shape))
        results.append((device.to_host(out), [device.to_host(w) for w in face.split_embedding_weights()]))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-6)
    for a, b in zip(results[1][1], results[0][1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_preallocated_host_buffers_are_the_tables_storage():
    specs = [(5, 4, EmbeddingLocation.HOST, ComputeDevice.CPU), (3, 8, EmbeddingLocation.HOST, ComputeDevice.CPU)]
    w = np.arange(5 * 4 + 3 * 8, dtype=np.float32)  # contents kept: FBGEMM's rule
    m = np.zeros(5 + 3, np.float32)
    face = ArrayTBE(
        specs,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.1,
        preallocated_host_buffers={"weights": w, "momentum1": m},
    )
    np.testing.assert_array_equal(face.split_embedding_weights()[1], w[20:].reshape(3, 8))
    out = face(np.array([1, 2]), np.array([0, 1, 2]))
    np.testing.assert_array_equal(out, np.concatenate([w[4:8], w[20 + 16 : 20 + 24]])[None])
    before = w.copy()
    face.backward(np.ones((1, 12), np.float32))
    changed = np.flatnonzero(w != before)
    assert set(changed) == set(range(4, 8)) | set(range(36, 44))  # row 1 of table 0, row 2 of table 1
    assert m[1] > 0 and m[5 + 2] > 0 and np.count_nonzero(m) == 2
    with pytest.raises(NotImplementedError, match="multiple of 4"):
        ArrayTBE(
            [(5, 6, EmbeddingLocation.HOST, ComputeDevice.CPU)],
            preallocated_host_buffers={"weights": np.zeros(30, np.float32)},
        )
    with pytest.raises(AssertionError, match="dtype"):
        ArrayTBE(specs, preallocated_host_buffers={"weights": np.zeros(44, np.float64)})
