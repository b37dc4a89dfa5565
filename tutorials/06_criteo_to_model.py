# %% [markdown]
# # Tutorial 06: from a Criteo click log (TSV) to a trained model, through Parquet.
#
# Run:
# ```bash
# python tutorials/06_criteo_to_model.py            # about 10 s on a laptop CPU
# ```
#
# What you will see:
#   1. the raw log: one click record per line, label + 13 integer counts + 26 hashed categories;
#   2. preprocessing exactly as HugeCTR's pandas tool does it (numbactr.data.criteo, also available as
#      `numbactr data criteo IN.tsv OUT/`): missing values filled, rare categories pooled, categories
#      label-encoded per slot, counts log-transformed; written as Parquet with `_metadata.json` and
#      `_file_list.txt`, and the slot_size_array the model needs;
#   3. what the Parquet reader hands the model: one Batch (labels, dense features, CSR keys with the
#      slot_size_array offsets applied);
#   4. a small model built with the HugeCTR API (`import numbactr as hugectr`), trained for a few epochs
#      on the Parquet data, and its AUC on the held-out lines.
# The input is datasets/criteo/tiny_criteo.tsv (600 synthetic lines in Criteo's format, made by
# datasets/criteo/make_fixture.py). Point CRITEO_TSV at a real day file to run the same steps on it.
# The model runs on the CPU device unless NUMBACTR_DEVICE=gpu is set (tiny data: kernels would not pay).

# %%
import os
import shutil
import tempfile

if os.environ.get("NUMBACTR_DEVICE") != "gpu":
    os.environ["NUMBACTR_DEVICE"] = "cpu"          # must be set before numbactr is imported

import numpy as np                                  # noqa: E402

import numbactr as hugectr                          # noqa: E402
from numbactr.data import make_reader               # noqa: E402
from numbactr.data.criteo import preprocess_criteo  # noqa: E402

# the repository root: from this file when run as a script, from the working directory (tutorials/)
# when the tutorial is opened as a notebook (a notebook has no __file__)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)) if "__file__" in globals() else os.getcwd())
TSV = os.environ.get("CRITEO_TSV", os.path.join(ROOT, "datasets", "criteo", "tiny_criteo.tsv"))
np.set_printoptions(precision=3, suppress=True, linewidth=110)


def title(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 70 - len(text)))


# %%
title("1. the raw click log")
with open(TSV) as f:
    first = f.readline().rstrip("\n").split("\t")
print(f"{TSV}: {sum(1 for _ in open(TSV))} lines, {len(first)} tab-separated fields per line")
print("label:", first[0])
print("I1..I13 (counts, empty = missing):", first[1:14])
print("C1..C4 of 26 (hashed categories):", first[14:18])

# %%
title("2. preprocessing to Parquet")
out = tempfile.mkdtemp(prefix="numbactr_tutorial06_")
# Two streaming passes over the file: count categories, then encode and write. Categories seen fewer
# than min_count times share id 0 of their slot (HugeCTR's threshold is 6 for full Criteo days; the
# 600-line fixture uses 3). The last 25% of the lines become the evaluation set.
data = preprocess_criteo(TSV, out, fmt="parquet", min_count=3, eval_fraction=0.25, chunk_size=256)
print("train file list:", data.train_list)
print(open(data.train_list).read().strip())
meta = open(os.path.join(os.path.dirname(data.train_list), "_metadata.json")).read()
print("_metadata.json (start):", " ".join(meta.split())[:160], "...")
slot_size_array = data.slot_size_array
print(f"slot_size_array ({sum(slot_size_array)} embedding rows in all):", slot_size_array)

# %%
title("3. what the Parquet reader hands the model")
# The model builds this reader itself from DataReaderParams; we build one by hand to look inside.
# slot_size_array turns the per-slot category ids into globally unique keys: slot k's ids are shifted
# by sum(slot_size_array[:k]).
BATCH = 64
reader_params = hugectr.DataReaderParams(data_reader_type=hugectr.DataReaderType_t.Parquet,
                                         source=[data.train_list], eval_source=data.eval_list,
                                         check_type=hugectr.Check_t.Non, slot_size_array=slot_size_array,
                                         num_workers=1)
reader = make_reader(reader_params, data.train_list, BATCH, label_dim=1, dense_dim=13,
                     slots_per_input=[26], nnz_per_slot=[[1] * 26], i64_input_key=True, repeat=False)
batch = next(iter(reader))
keys, offsets = batch.sparse[0]
print(f"label {batch.label.shape}, dense {batch.dense.shape}, keys {keys.shape} {keys.dtype}, "
      f"offsets {offsets.shape} (one key per (sample, slot) bag)")
print("sample 0 dense (log(x+1) of the counts):", batch.dense[0])
print("sample 0 keys, slots 0..5:", keys[:6], "= ids + offsets", np.cumsum([0] + slot_size_array[:5]))
assert (keys.reshape(BATCH, 26) < np.cumsum(slot_size_array)).all()
n_batches = sum(1 for _ in reader)                  # a fresh pass: iter() restarts at the first file
print(f"one epoch = {n_batches} batches of {BATCH} for {data.num_train} training samples "
      f"(the last one partial)")
reader.close()

# %%
title("4. a model trained on the Parquet data")
solver = hugectr.CreateSolver(batchsize=BATCH, batchsize_eval=BATCH, max_eval_batches=100, lr=0.01,
                              vvgpu=[[0]], repeat_dataset=False, i64_input_key=True, seed=6,
                              metrics_spec={hugectr.MetricsType.AUC: 1.0})
optimizer = hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.Adam, update_type=hugectr.Update_t.Global)
model = hugectr.Model(solver, reader_params, optimizer)
model.add(hugectr.Input(label_dim=1, label_name="label", dense_dim=13, dense_name="dense",
                        data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 26)]))
model.add(hugectr.SparseEmbedding(embedding_type=hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash,
                                  workspace_size_per_gpu_in_mb=1, embedding_vec_size=4, combiner="sum",
                                  sparse_embedding_name="sparse_embedding1", bottom_name="data1",
                                  optimizer=optimizer))
L = hugectr.Layer_t
model.add(hugectr.DenseLayer(L.Reshape, ["sparse_embedding1"], ["reshape1"], leading_dim=26 * 4))
model.add(hugectr.DenseLayer(L.Concat, ["reshape1", "dense"], ["concat1"]))
model.add(hugectr.DenseLayer(L.InnerProduct, ["concat1"], ["fc1"], num_output=32))
model.add(hugectr.DenseLayer(L.ReLU, ["fc1"], ["relu1"]))
model.add(hugectr.DenseLayer(L.InnerProduct, ["relu1"], ["fc2"], num_output=1))
model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc2", "label"], ["loss"]))
model.compile()
model.summary()
auc_before = dict(model.eval_whole_source())["AUC"]
# Epoch mode (repeat_dataset=False): each epoch reads the train file list once, the last batch partial.
model.fit(num_epochs=6, display=8, eval_interval=0)
auc_after = dict(model.eval_whole_source())["AUC"]
print(f"eval AUC before training {auc_before:.3f}, after 6 epochs {auc_after:.3f} "
      f"({data.num_eval} held-out lines)")
assert np.isfinite(model.get_current_loss())
shutil.rmtree(out)

print("\ntutorial 06 OK")
