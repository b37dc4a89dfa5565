"""Drop-in check: HugeCTR's own generate-then-train scripts (tools/data_generator/*.py, spec §8), shrunk,
run with `import numbactr as hugectr` and nothing else changed but sizes and paths."""

import os

import pytest

import numbactr as hugectr
from numbactr.runtime import device


@pytest.fixture
def cpu(monkeypatch, tmp_path):
    before = device.kind()
    device.set_device("cpu")
    monkeypatch.chdir(tmp_path)
    yield
    device.set_device(before)


def test_dcn_norm_generate_train(cpu):
    # --- tools/data_generator/dcn_norm_generate_train.py, sizes reduced ---
    data_generator_params = hugectr.tools.DataGeneratorParams(
        format=hugectr.DataReaderType_t.Norm,
        label_dim=1,
        dense_dim=13,
        num_slot=26,
        i64_input_key=False,
        source="./dcn_norm/file_list.txt",
        eval_source="./dcn_norm/file_list_test.txt",
        slot_size_array=[
            39884,
            39043,
            17289,
            7420,
            20263,
            3,
            7120,
            1543,
            39884,
            39043,
            17289,
            7420,
            20263,
            3,
            7120,
            1543,
            63,
            63,
            39884,
            39043,
            17289,
            7420,
            20263,
            3,
            7120,
            1543,
        ],
        nnz_array=[1] * 26,
        check_type=hugectr.Check_t.Sum,
        dist_type=hugectr.Distribution_t.PowerLaw,
        power_law_type=hugectr.PowerLaw_t.Short,
        num_files=4,
        eval_num_files=2,
        num_samples_per_file=512,
    )
    data_generator = hugectr.tools.DataGenerator(data_generator_params)
    data_generator.generate()
    solver = hugectr.CreateSolver(
        max_eval_batches=2, batchsize_eval=256, batchsize=256, lr=0.001, vvgpu=[[0]], repeat_dataset=True
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Norm,
        source=["./dcn_norm/file_list.txt"],
        eval_source="./dcn_norm/file_list_test.txt",
        check_type=hugectr.Check_t.Sum,
    )
    optimizer = hugectr.CreateOptimizer(
        optimizer_type=hugectr.Optimizer_t.Adam,
        update_type=hugectr.Update_t.Global,
        beta1=0.9,
        beta2=0.999,
        epsilon=0.0001,
    )
    model = hugectr.Model(solver, reader, optimizer)
    model.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=13,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 26)],
        )
    )
    model.add(
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
            workspace_size_per_gpu_in_mb=25,
            embedding_vec_size=16,
            combiner="sum",
            sparse_embedding_name="sparse_embedding1",
            bottom_name="data1",
            optimizer=optimizer,
        )
    )
    model.add(
        hugectr.DenseLayer(
            layer_type=hugectr.Layer_t.Reshape,
            bottom_names=["sparse_embedding1"],
            top_names=["reshape1"],
            leading_dim=416,
        )
    )
    model.add(
        hugectr.DenseLayer(layer_type=hugectr.Layer_t.Concat, bottom_names=["reshape1", "dense"], top_names=["concat1"])
    )
    model.add(
        hugectr.DenseLayer(
            layer_type=hugectr.Layer_t.Slice,
            bottom_names=["concat1"],
            top_names=["slice11", "slice12"],
            ranges=[(0, 429), (0, 429)],
        )
    )
    model.add(
        hugectr.DenseLayer(
            layer_type=hugectr.Layer_t.MultiCross, bottom_names=["slice11"], top_names=["multicross1"], num_layers=6
        )
    )
    model.add(
        hugectr.DenseLayer(
            layer_type=hugectr.Layer_t.InnerProduct, bottom_names=["slice12"], top_names=["fc1"], num_output=64
        )
    )
    model.add(hugectr.DenseLayer(layer_type=hugectr.Layer_t.ReLU, bottom_names=["fc1"], top_names=["relu1"]))
    model.add(
        hugectr.DenseLayer(
            layer_type=hugectr.Layer_t.Dropout, bottom_names=["relu1"], top_names=["dropout1"], dropout_rate=0.5
        )
    )
    model.add(
        hugectr.DenseLayer(
            layer_type=hugectr.Layer_t.Concat, bottom_names=["dropout1", "multicross1"], top_names=["concat2"]
        )
    )
    model.add(
        hugectr.DenseLayer(
            layer_type=hugectr.Layer_t.InnerProduct, bottom_names=["concat2"], top_names=["fc2"], num_output=1
        )
    )
    model.add(
        hugectr.DenseLayer(
            layer_type=hugectr.Layer_t.BinaryCrossEntropyLoss, bottom_names=["fc2", "label"], top_names=["loss"]
        )
    )
    model.compile()
    model.summary()
    model.graph_to_json(graph_config_file="dcn.json")
    model.fit(max_iter=12, display=4, eval_interval=6, snapshot=10, snapshot_prefix="dcn")
    assert os.path.exists("dcn.json") and os.path.exists("dcn_dense_10.model")
    assert os.path.isdir("dcn0_sparse_10.model")
    assert len(model.history["auc"]) == 2


def test_dlrm_raw_generate_train(cpu):
    # --- tools/data_generator/dlrm_raw_generate_train.py, sizes reduced ---
    slot_sizes = [203, 18, 16, 4, 3, 90, 18, 105, 3, 96, 14, 10, 2, 20, 6, 16, 5, 11, 6, 15, 12, 7, 8, 8, 9, 10]
    data_generator_params = hugectr.tools.DataGeneratorParams(
        format=hugectr.DataReaderType_t.Raw,
        label_dim=1,
        dense_dim=13,
        num_slot=26,
        i64_input_key=False,
        source="./dlrm_raw/train_data.bin",
        eval_source="./dlrm_raw/validation_data.bin",
        slot_size_array=slot_sizes,
        nnz_array=[1] * 26,
        check_type=hugectr.Check_t.Non,
        dist_type=hugectr.Distribution_t.PowerLaw,
        power_law_type=hugectr.PowerLaw_t.Short,
        num_samples=2048,
        eval_num_samples=512,
    )
    hugectr.tools.DataGenerator(data_generator_params).generate()
    solver = hugectr.CreateSolver(
        max_eval_batches=2,
        batchsize_eval=256,
        batchsize=256,
        lr=0.5,
        warmup_steps=4,
        vvgpu=[[0]],
        repeat_dataset=True,
        i64_input_key=False,
        metrics_spec={hugectr.MetricsType.AUC: 0.8025},
    )
    reader = hugectr.DataReaderParams(
        data_reader_type=hugectr.DataReaderType_t.Raw,
        source=["./dlrm_raw/train_data.bin"],
        eval_source="./dlrm_raw/validation_data.bin",
        check_type=hugectr.Check_t.Non,
        num_samples=2048,
        eval_num_samples=512,
    )
    optimizer = hugectr.CreateOptimizer(
        optimizer_type=hugectr.Optimizer_t.SGD, update_type=hugectr.Update_t.Local, atomic_update=True
    )
    model = hugectr.Model(solver, reader, optimizer)
    model.add(
        hugectr.Input(
            label_dim=1,
            label_name="label",
            dense_dim=13,
            dense_name="dense",
            data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 26)],
        )
    )
    model.add(
        hugectr.SparseEmbedding(
            embedding_type=hugectr.Embedding_t.LocalizedSlotSparseEmbeddingOneHot,
            slot_size_array=slot_sizes,
            workspace_size_per_gpu_in_mb=1,
            embedding_vec_size=16,
            combiner="sum",
            sparse_embedding_name="sparse_embedding1",
            bottom_name="data1",
            optimizer=optimizer,
        )
    )
    L = hugectr.Layer_t
    model.add(hugectr.DenseLayer(layer_type=L.InnerProduct, bottom_names=["dense"], top_names=["fc1"], num_output=32))
    model.add(hugectr.DenseLayer(layer_type=L.ReLU, bottom_names=["fc1"], top_names=["relu1"]))
    model.add(hugectr.DenseLayer(layer_type=L.InnerProduct, bottom_names=["relu1"], top_names=["fc2"], num_output=16))
    model.add(hugectr.DenseLayer(layer_type=L.ReLU, bottom_names=["fc2"], top_names=["relu2"]))
    model.add(
        hugectr.DenseLayer(
            layer_type=L.Interaction, bottom_names=["relu2", "sparse_embedding1"], top_names=["interaction1"]
        )
    )
    model.add(
        hugectr.DenseLayer(layer_type=L.InnerProduct, bottom_names=["interaction1"], top_names=["fc3"], num_output=32)
    )
    model.add(hugectr.DenseLayer(layer_type=L.ReLU, bottom_names=["fc3"], top_names=["relu3"]))
    model.add(hugectr.DenseLayer(layer_type=L.InnerProduct, bottom_names=["relu3"], top_names=["fc4"], num_output=1))
    model.add(
        hugectr.DenseLayer(layer_type=L.BinaryCrossEntropyLoss, bottom_names=["fc4", "label"], top_names=["loss"])
    )
    model.compile()
    model.summary()
    model.fit(max_iter=8, display=4, eval_interval=8, snapshot=0)
    assert len(model.history["loss"]) == 2
