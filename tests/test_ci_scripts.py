"""The CI scripts parse, and .ci/gpu (a GPU session's stages, README "A GPU session's checks") names its stages
when asked for none; its stages themselves need a GPU machine."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@pytest.mark.parametrize("script", ["run", "gpu"], ids=["ci_run", "ci_gpu"])  # (an id "gpu" would mark it gpu-only)
def test_ci_script_parses(script):
    subprocess.run(["bash", "-n", str(ROOT / ".ci" / script)], check=True, timeout=60)


def test_gpu_script_lists_its_stages(tmp_path):
    done = subprocess.run(
        ["bash", str(ROOT / ".ci" / "gpu"), "nope"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)},
    )
    assert done.returncode == 2
    for stage in ("wheels", "resolve", "check", "suite", "bench", "profile"):
        assert f"{stage} " in done.stdout


HUGECTR_STYLE = """
import hugectr
from hugectr.tools import DataGeneratorParams          # the other imports of HugeCTR's scripts resolve too
solver = hugectr.CreateSolver(max_eval_batches=300, batchsize_eval=2048, batchsize=16384, lr=0.001,
                              vvgpu=[[0]], repeat_dataset=True)
reader = hugectr.DataReaderParams(data_reader_type=hugectr.DataReaderType_t.Parquet,
                                  source=["/data/train/_file_list.txt"], eval_source="/data/val/_file_list.txt",
                                  check_type=hugectr.Check_t.Non, slot_size_array=[100, 50, 20])
optimizer = hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.Adam)
model = hugectr.Model(solver, reader, optimizer)
model.add(hugectr.Input(label_dim=1, label_name="label", dense_dim=3, dense_name="dense",
                        data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("a", 1, True, 2),
                                                        hugectr.DataReaderSparseParam("b", 2, False, 1)]))
for name, bottom in (("ea", "a"), ("eb", "b")):
    model.add(hugectr.SparseEmbedding(embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
                                      workspace_size_per_gpu_in_mb=1, embedding_vec_size=4, combiner="sum",
                                      sparse_embedding_name=name, bottom_name=bottom, optimizer=optimizer))
model.add(hugectr.DenseLayer(layer_type=hugectr.Layer_t.Reshape, bottom_names=["ea"], top_names=["ra"], leading_dim=8))
model.add(hugectr.DenseLayer(layer_type=hugectr.Layer_t.Reshape, bottom_names=["eb"], top_names=["rb"], leading_dim=4))
model.add(hugectr.DenseLayer(layer_type=hugectr.Layer_t.Concat, bottom_names=["ra", "rb", "dense"], top_names=["c"]))
model.add(hugectr.DenseLayer(layer_type=hugectr.Layer_t.InnerProduct, bottom_names=["c"], top_names=["fc"],
                             num_output=1))
model.add(hugectr.DenseLayer(layer_type=hugectr.Layer_t.BinaryCrossEntropyLoss, bottom_names=["fc", "label"],
                             top_names=["loss"]))
model.compile()
model.fit(max_iter=100000, display=1000, eval_interval=1000)
print("trained", model.step)
"""


def test_hugectr_script_runner_writes_the_data_and_shrinks_the_run(tmp_path):
    """.ci/hugectr_scripts.py on a script shaped like HugeCTR's samples (absolute data paths, a long run)."""
    import sys

    script = tmp_path / "sample.py"
    script.write_text(HUGECTR_STYLE)
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "hugectr_scripts.py"), str(script)],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "trained 60" in done.stdout and "HUGECTR-SCRIPT: OK" in done.stdout
    assert (work / "data" / "train" / "_file_list.txt").exists() and (work / "data" / "val" / "_metadata.json").exists()


FBGEMM_STYLE_TEST = """
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice,
    DenseTableBatchedEmbeddingBagsCodegen, SplitTableBatchedEmbeddingBagsCodegen)


def test_tbe_classes_come_from_numbactr():
    cc = SplitTableBatchedEmbeddingBagsCodegen([(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)])
    out = cc(torch.tensor([1, 2]), torch.tensor([0, 1, 2]))
    assert out.shape == (2, 4)
    assert type(cc).__module__.startswith("numbactr.")
    assert DenseTableBatchedEmbeddingBagsCodegen.__module__.startswith("numbactr.")
"""


def test_fbgemm_tests_runner_swaps_in_numbactrs_tbe(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("fbgemm_gpu")
    (tmp_path / "tbe_test.py").write_text(FBGEMM_STYLE_TEST)
    runner = [sys.executable, str(ROOT / ".ci" / "fbgemm_tests.py"), str(tmp_path), "-q"]
    done = subprocess.run(runner, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
    baseline = subprocess.run(
        runner, capture_output=True, text=True, timeout=600, env={**os.environ, "NUMBACTR_FBGEMM_SWAP": "0"}
    )
    assert baseline.returncode != 0 and "1 failed" in baseline.stdout  # FBGEMM's own class: not numbactr's
