"""A trained HybridSparseEmbedding model at inference (numbactr.inference) and as ONNX (numbactr.onnx_converter):
the hybrid embedding is then the plain one-hot table its snapshot holds, read with its per-slot ids plus the
slot offsets (slot_size_array), as training reads them.

InferenceModel's predictions of the exported batch print as Model.export_predictions wrote them and equal the
model's own evaluation bit for bit; a CSR request gives the same bits; a key outside its slot is a clear error;
the ONNX model run by onnxruntime predicts the exported values (float rounding)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.runtime import device
from numbactr.inference import CreateInferenceSession, InferenceModel, InferenceParams

E, O, L = hugectr.Embedding_t, hugectr.Optimizer_t, hugectr.Layer_t
SIZES = [20, 30, 4]
S, D, B, ITER = len(SIZES), 4, 32, 8


def norm_source(folder):
    """Per-slot ids (slot s in [0, SIZES[s])), skewed so that some categories are frequent."""
    from numbactr.data.norm import write_norm_file

    rng = np.random.default_rng(3)
    n = 256
    ids = np.minimum(rng.geometric(0.3, (n, S)) - 1, np.array(SIZES) - 1).astype(np.int64)
    x = rng.normal(0, 1, (n, 2)).astype(np.float32)
    label = (rng.random(n) < 1 / (1 + np.exp(-(x[:, 0] + 0.3 * ids[:, 0] - 1)))).astype(np.float32)
    path = os.path.join(folder, "data", "part0.data")
    os.makedirs(os.path.dirname(path))
    write_norm_file(path, label, x, ids, key_dtype=np.int64)
    lst = os.path.join(folder, "data", "list.txt")
    with open(lst, "w") as f:
        f.write(f"1\n{path}\n")
    return lst


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    device.set_device("cpu")
    folder = str(tmp_path_factory.mktemp("hybrid_inference"))
    src = norm_source(folder)
    solver = hugectr.CreateSolver(
        batchsize=B,
        batchsize_eval=B,
        max_eval_batches=2,
        lr=0.5,
        vvgpu=[[0]],
        i64_input_key=True,
        seed=7,
        num_iterations_statistics=4,
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm, source=[src], eval_source=src, check_type=hugectr.Check_t.Sum
    )
    m = hugectr.Model(solver, reader, hugectr.CreateOptimizer(optimizer_type=O.SGD))
    m.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=2,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, S)],
        )
    )
    m.add(
        hugectr.SparseEmbedding(
            embedding_type=E.HybridSparseEmbedding,
            workspace_size_per_gpu_in_mb=1,
            embedding_vec_size=D,
            combiner="sum",
            sparse_embedding_name="emb",
            bottom_name="data1",
            slot_size_array=SIZES,
            hybrid_embedding_param=hugectr.HybridEmbeddingParam(
                1000,
                -1,
                1.0,
                1.3e11,
                1.9e11,
                1.0,
                hugectr.CommunicationType.NVLink_SingleNode,
                hugectr.HybridEmbeddingType.Distributed,
            ),
        )
    )
    m.add(hugectr.DenseLayer(L.Reshape, ["emb"], ["flat"], leading_dim=S * D))
    m.add(hugectr.DenseLayer(L.Concat, ["flat", "dense"], ["cat"]))
    m.add(hugectr.DenseLayer(L.InnerProduct, ["cat"], ["fc1"], num_output=4))
    m.add(hugectr.DenseLayer(L.ReLU, ["fc1"], ["r1"]))
    m.add(hugectr.DenseLayer(L.InnerProduct, ["r1"], ["fc2"], num_output=1))
    m.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc2", "label"], ["loss"]))
    m.compile()
    m.fit(max_iter=ITER, display=0, eval_interval=ITER, snapshot=0)
    emb = m.embeddings[0]
    assert emb.ready and 0 < emb.frequent.size < sum(SIZES)  # a real split: frequent and infrequent
    m.export_predictions(os.path.join(folder, "pred"), os.path.join(folder, "label"))
    graph = os.path.join(folder, "graph.json")
    m.graph_to_json(graph)
    prefix = os.path.join(folder, "hyb")
    m.save_params_to_files(prefix, ITER)
    params = InferenceParams(
        model_name="hyb",
        max_batchsize=B,
        hit_rate_threshold=1.0,
        dense_model_file=f"{prefix}_dense_{ITER}.model",
        sparse_model_files=[f"{prefix}0_sparse_{ITER}.model"],
        use_gpu_embedding_cache=True,
        cache_size_percentage=0.5,
        i64_input_key=True,
    )
    with open(os.path.join(folder, "pred")) as f:
        exported = f.read()
    return dict(
        model=m,
        src=src,
        graph=graph,
        params=params,
        exported=exported,
        folder=folder,
        dense=f"{prefix}_dense_{ITER}.model",
        sparse=[f"{prefix}0_sparse_{ITER}.model"],
    )


def as_text(values) -> str:
    return "".join(f"{v:g} " for v in np.asarray(values, np.float32).reshape(-1).tolist())


def last_eval_batch(tr):
    m = tr["model"]
    reader = iter(m._make_reader(m.reader_params.eval_source, m.solver.batchsize_eval, False, eval=True))
    batches = [next(reader) for _ in range(2)]
    return batches[-1]


def test_inference_model_equals_export_predictions(trained):
    model = InferenceModel(trained["graph"], trained["params"])
    preds = model.predict(2, trained["src"], hugectr.DataReaderType_t.Norm, hugectr.Check_t.Sum)
    last = preds[B:]
    assert as_text(last) == trained["exported"]
    assert np.array_equal(last, trained["model"]._last_eval[0])
    model.close()


def test_csr_request_and_bad_keys(trained):
    batch = last_eval_batch(trained)
    keys, off = batch.sparse[0]
    session = CreateInferenceSession(trained["graph"], trained["params"])
    out = session.predict(
        batch.dense.reshape(-1).tolist(), np.asarray(keys, np.int64).tolist(), np.asarray(off, np.int64).tolist()
    )
    assert np.array_equal(np.asarray(out, np.float32).reshape(B, 1), trained["model"]._last_eval[0])
    bad = np.asarray(keys, np.int64).copy()
    bad[S * 3 + 2] = SIZES[2]  # sample 3, slot 2: one past its vocabulary
    with pytest.raises(ValueError, match=r"key 4 of slot 2 \(sample 3\) is outside the slot's vocabulary \[0, 4\)"):
        session.predict(batch.dense.reshape(-1).tolist(), bad.tolist(), np.asarray(off, np.int64).tolist())
    session.close()


def test_onnx_export_predicts_the_exported_values(trained):
    pytest.importorskip("onnxruntime")
    from numbactr.onnx_converter import hugectr2onnx
    from numbactr.onnx_converter.runtime import OnnxPredictor

    path = os.path.join(trained["folder"], "hyb.onnx")
    hugectr2onnx.converter.convert(path, trained["graph"], trained["dense"], True, trained["sparse"])
    got = OnnxPredictor(path, threads=1).predict_batch(last_eval_batch(trained))["label"][:, 0]
    want = np.array(trained["exported"].split(), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, trained["model"]._last_eval[0][:, 0], rtol=1e-5, atol=1e-7)
