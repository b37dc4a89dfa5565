"""HugeCTR's Python API as its pybind definitions state it (v23.08 include/pybind/*_wrapper.hpp): positional
orders, keyword names of the overloads, TrainingCallback, enums registered on the module."""

from __future__ import annotations

import pytest

import numbactr as hugectr
from numbactr.model import ModelError

from .model_util import tiny_data, tiny_dlrm


# API surface and input checks, nothing device-specific: on the cpu device (the session's simulator would run
# every training step's kernels as Python threads, ~30 s a test)
pytestmark = pytest.mark.usefixtures("cpu")

T, C = hugectr.DataReaderType_t, hugectr.Check_t


def test_data_reader_params_positional_order_is_hugectrs():
    p = hugectr.DataReaderParams(T.Norm, ["train.txt"], ["keyset"], "eval.txt", C.Sum, 0, 0, 0, False, False, 3)
    assert (p.source, p.keyset, p.eval_source, p.check_type, p.num_workers) == (
        ["train.txt"],
        ["keyset"],
        "eval.txt",
        C.Sum,
        3,
    )
    short = hugectr.DataReaderParams(T.Norm, "train.txt", "eval.txt", C.Sum)  # the four-argument form
    assert (short.eval_source, short.check_type, short.keyset) == ("eval.txt", C.Sum, "")
    assert short == hugectr.DataReaderParams(
        data_reader_type=T.Norm, source="train.txt", eval_source="eval.txt", check_type=C.Sum
    )
    with pytest.raises(TypeError, match=r"missing required argument\(s\) \['eval_source', 'check_type'\]"):
        hugectr.DataReaderParams(T.Norm, "train.txt")
    with pytest.raises(TypeError, match="multiple values for argument 'source'"):
        hugectr.DataReaderParams(T.Norm, "a", "", "e", C.Sum, source="b")


def test_create_solver_input_and_dense_layer_take_hugectrs_positional_forms():
    s = hugectr.CreateSolver("m", 42, hugectr.LrPolicy_t.fixed, 0.5)
    assert (s.model_name, s.seed, s.lr) == ("m", 42, 0.5)
    sp = [hugectr.DataReaderSparseParam("data1", 1, True, 3)]
    inp = hugectr.Input([1, 1], ["a", "b"], [0.3, 0.7], 3, "dense", sp)  # the label_weights overload
    assert (inp.label_weights, inp.dense_dim, inp.dense_name, inp.sparse) == ([0.3, 0.7], 3, "dense", sp)
    inp = hugectr.Input(1, "label", 3, "dense", sp)
    assert (inp.label_dims, inp.dense_dim) == ([1], 3)
    bn = hugectr.DenseLayer(hugectr.Layer_t.BatchNorm, ["a"], ["b"], 0.9, 1e-3)
    assert (bn.factor, bn.eps) == (0.9, 1e-3)
    with pytest.raises(ValueError, match="factor given twice"):
        hugectr.DenseLayer(hugectr.Layer_t.BatchNorm, ["a"], ["b"], 0.9, factor=0.8)


def test_dense_layer_positional_order_is_hugectrs():
    """model_wrapper.hpp's order (spec §6.0): batchsize, SeqLength, vector_size, ... A GRU written
    positionally to its 16th argument gets each value in its own field."""
    from numbactr import config

    want = (
        "factor eps gamma_init_type beta_init_type dropout_rate elu_alpha num_output weight_init_type "
        "bias_init_type num_layers leading_dim time_step batchsize SeqLength vector_size selected"
    ).split()
    assert config._DENSE_ORDER[: len(want)] == want
    I = hugectr.Initializer_t.Default
    g = hugectr.DenseLayer(hugectr.Layer_t.GRU, ["x"], ["y"], 1.0, 1e-5, I, I, 0.5, 1.0, 64, I, I, 0, 0, 0, 16, 10, 8)
    assert (g.num_output, g.batchsize, g.SeqLength, g.vector_size) == (64, 16, 10, 8)


def test_module_level_enums():
    assert hugectr.Error_t.EndOfFile.name == "EndOfFile" and hugectr.EndOfFile is hugectr.Error_t.EndOfFile
    assert hugectr.Hierarchical is hugectr.CommunicationStrategy.Hierarchical
    assert hugectr.EmbeddingTrainingCache.__name__ == "EmbeddingTrainingCache"


class Recorder(hugectr.TrainingCallback):
    def __init__(self, stop_at=None):
        super().__init__()
        self.calls, self.stop_at = [], stop_at

    def on_training_start(self):
        self.calls.append(("start",))

    def on_training_end(self, current_iter):
        self.calls.append(("end", current_iter))

    def on_eval_start(self, current_iter):
        self.calls.append(("eval_start", current_iter))
        return False

    def on_eval_end(self, current_iter, eval_results):
        self.calls.append(("eval_end", current_iter, sorted(eval_results)))
        return self.stop_at is not None and current_iter >= self.stop_at


def _model(tmp_path, callbacks):
    train, evl = tiny_data(str(tmp_path), n_train=256, n_eval=128, files=1)
    solver = hugectr.CreateSolver(
        batchsize=64,
        batchsize_eval=64,
        max_eval_batches=2,
        lr=0.01,
        vvgpu=[[0]],
        i64_input_key=True,
        training_callbacks=callbacks,
        metrics_spec={hugectr.MetricsType.AUC: 1.0},
    )
    m = hugectr.Model(solver, hugectr.DataReaderParams(T.Norm, [train], evl, C.Sum), hugectr.CreateOptimizer())
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 3)],
        )
    )
    m.add(
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
            workspace_size_per_gpu_in_mb=1,
            embedding_vec_size=4,
            sparse_embedding_name="emb",
            bottom_name="data1",
        )
    )
    m.add(hugectr.DenseLayer(hugectr.Layer_t.Reshape, ["emb"], ["flat"], leading_dim=12))
    m.add(hugectr.DenseLayer(hugectr.Layer_t.Concat, ["flat", "dense"], ["cat"]))
    m.add(hugectr.DenseLayer(hugectr.Layer_t.InnerProduct, ["cat"], ["fc"], num_output=1))
    m.add(hugectr.DenseLayer(hugectr.Layer_t.BinaryCrossEntropyLoss, ["fc", "label"], ["loss"]))
    m.compile()
    return m


def test_fit_calls_training_callbacks_as_hugectr(tmp_path):
    a, b = Recorder(), Recorder()
    m = _model(tmp_path, [a, b])
    m.fit(max_iter=6, display=100, eval_interval=3)
    expect = [
        ("start",),
        ("eval_start", 2),
        ("eval_end", 2, ["AUC"]),
        ("eval_start", 5),
        ("eval_end", 5, ["AUC"]),
        ("end", 5),
    ]
    assert a.calls == expect and b.calls == expect


class Keeper(Recorder):
    def on_eval_end(self, current_iter, eval_results):
        self.calls.append(("eval_end", current_iter, dict(eval_results)))
        return False


def test_callbacks_see_the_evaluation_the_log_and_the_target_see(tmp_path):
    """The metrics are read once per evaluation (a read resets them): the callbacks, the log, the history and
    the AUC target all get the same values, and the values a run without callbacks gets."""
    keep = Keeper()
    with_cb = _model(tmp_path / "a", [keep])
    with_cb.fit(max_iter=6, display=100, eval_interval=3)
    plain = _model(tmp_path / "a", [])
    plain.fit(max_iter=6, display=100, eval_interval=3)
    seen = [c[2]["AUC"] for c in keep.calls if c[0] == "eval_end"]
    assert len(seen) == 2 and all(0.0 < v < 1.0 for v in seen), keep.calls
    assert with_cb.history["auc"] == seen == plain.history["auc"]


def test_a_callback_stops_training_early(tmp_path):
    stop, other = Recorder(stop_at=3), Recorder()
    m = _model(tmp_path / "b", [stop, other])
    m.fit(max_iter=20, display=100, eval_interval=2)
    assert stop.calls[-2:] == [("eval_end", 3, ["AUC"]), ("end", 3)]
    assert other.calls[-1] == ("end", 3)  # every callback hears the end
    assert m.step == 4


def test_training_callbacks_must_be_training_callbacks_and_define_their_methods(tmp_path):
    with pytest.raises(ValueError, match=r"training_callbacks\[0\] must be a hugectr.TrainingCallback"):
        hugectr.CreateSolver(training_callbacks=[object()])

    class Half(hugectr.TrainingCallback):
        def on_training_start(self):
            pass

    m = _model(tmp_path, [Half()])
    with pytest.raises(NotImplementedError, match="Half.on_eval_start: a TrainingCallback must define it"):
        m.fit(max_iter=4, display=100, eval_interval=2)


def test_overload_keyword_names(tmp_path):
    train, evl = tiny_data(str(tmp_path), n_train=128, n_eval=64, files=1)
    m = tiny_dlrm(train, evl)
    m.fit(max_iter=2, display=100, eval_interval=100)
    m.save_params_to_files(str(tmp_path / "snap"), 2)
    m.load_sparse_weights(sparse_embedding_files_map={"emb": str(tmp_path / "snap0_sparse_2.model")})
    m.load_sparse_optimizer_states(sparse_opt_states_files_map={"emb": str(tmp_path / "snap0_opt_sparse_2.model")})
    with pytest.raises(ValueError, match="no embedding named|unknown|not an embedding"):
        m.load_sparse_weights(sparse_embedding_files_map={"nope": str(tmp_path / "snap0_sparse_2.model")})
    with pytest.raises(TypeError, match="give one of sparse_embedding_files or sparse_embedding_files_map"):
        m.load_sparse_weights()
    with pytest.raises(ModelError, match="dump_incremental_model_2kafka: numbactr cannot send to Kafka"):
        m.dump_incremental_model_2kafka()


def test_model_add_takes_hugectrs_keyword_names(tmp_path):
    train, evl = tiny_data(str(tmp_path), n_train=128, n_eval=64, files=1)
    solver = hugectr.CreateSolver(batchsize=64, batchsize_eval=64, vvgpu=[[0]], i64_input_key=True)
    reader = hugectr.DataReaderParams(T.Norm, [train], evl, C.Sum)
    m = hugectr.Model(solver, reader, hugectr.CreateOptimizer())
    m.add(
        input=hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 3)],
        )
    )
    m.add(
        sparse_embedding=hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
            workspace_size_per_gpu_in_mb=1,
            embedding_vec_size=4,
            sparse_embedding_name="emb",
            bottom_name="data1",
        )
    )
    m.add(dense_layer=hugectr.DenseLayer(hugectr.Layer_t.Reshape, ["emb"], ["flat"], leading_dim=12))
    with pytest.raises(ModelError, match="Model.add takes one"):
        m.add(
            hugectr.DenseLayer(hugectr.Layer_t.Concat, ["flat", "dense"], ["c"]),
            dense_layer=hugectr.DenseLayer(hugectr.Layer_t.Concat, ["flat", "dense"], ["c"]),
        )
    assert "flat" in m.shapes
