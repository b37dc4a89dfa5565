# %% [markdown]
# # Tutorial 09: one inference request, from its keys through the parameter server's three tiers to a prediction.
#
# Run:
# ```bash
# python tutorials/09_one_request_through_the_hps.py
# ```
#
# HugeCTR serves a trained model with its hierarchical parameter server (HPS): the embedding vectors live in
# a persistent database (RocksDB, on disk: tables larger than memory), the warmer ones also in a volatile
# database (a hash map in this process, or Redis shared by several processes), and the hottest in an
# embedding cache on the device (RAM on the cpu device). A request's keys look in the cache first; the
# misses fall through to the volatile tier, then the persistent one, and what they find fills the tiers
# above on the way back. A key no tier holds gets default_value_for_each_table. Then the vectors are pooled
# per slot and the dense network (its loss replaced by the sigmoid) makes the prediction.
#
# We train a tiny DLRM with the HugeCTR API, save it in HugeCTR's files, start an InferenceSession whose
# volatile tier holds only half the table, and follow one request: which keys each tier answered, what the
# cache holds afterwards, and that the prediction is exactly what the trained model's evaluation gives.
# (For Redis: VolatileDatabaseParams(type=DatabaseType_t.RedisCluster, address="127.0.0.1:6379") with a
# running redis-server; the numbers are the same.)

# %%
import os
import tempfile

import numpy as np

import numbactr as hugectr
from numbactr.inference import (CreateInferenceSession, DatabaseType_t, InferenceParams, PersistentDatabaseParams,
                                VolatileDatabaseParams)

hugectr.device.set_device("cpu")
work = tempfile.mkdtemp(prefix="tutorial09-")
rng = np.random.default_rng(0)

# %% [markdown]
# ## A model to serve
# 3 one-hot slots of 6 keys each (keys 0..17), 2 dense features, trained 16 steps, one evaluation batch,
# whose predictions `export_predictions` writes as HugeCTR does.

# %%
from numbactr.data.file_list import write_file_list          # noqa: E402
from numbactr.data.norm import write_norm_file               # noqa: E402

lists = []
for name, n in (("train", 512), ("eval", 64)):
    keys = rng.integers(0, 6, (n, 3)) + np.arange(3) * 6
    x = rng.normal(0, 1, (n, 2)).astype(np.float32)
    y = (rng.random(n) < 1 / (1 + np.exp(-(keys % 6 - 2.5).sum(1) / 2 - x[:, 0]))).astype(np.float32)
    path = os.path.join(work, f"{name}.data")
    write_norm_file(path, y, x, keys.astype(np.int64), key_dtype=np.int64)
    lists.append(os.path.join(work, f"{name}_list.txt"))
    write_file_list(lists[-1], [path])

solver = hugectr.CreateSolver(batchsize=64, batchsize_eval=64, max_eval_batches=1, lr=0.05, vvgpu=[[0]],
                              i64_input_key=True)
reader = hugectr.DataReaderParams(data_reader_type=hugectr.DataReaderType_t.Norm, source=[lists[0]],
                                  eval_source=lists[1], check_type=hugectr.Check_t.Sum)
model = hugectr.Model(solver, reader, hugectr.CreateOptimizer())
L = hugectr.Layer_t
model.add(hugectr.Input(label_dim=1, label_name="label", dense_dim=2, dense_name="dense",
                        data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 3)]))
model.add(hugectr.SparseEmbedding(hugectr.Embedding_t.DistributedSlotSparseEmbeddingHash, 1, 4, "sum", "emb", "data1"))
model.add(hugectr.DenseLayer(L.InnerProduct, ["dense"], ["fc1"], num_output=4))
model.add(hugectr.DenseLayer(L.ReLU, ["fc1"], ["relu1"]))
model.add(hugectr.DenseLayer(L.Interaction, ["relu1", "emb"], ["inter"]))
model.add(hugectr.DenseLayer(L.InnerProduct, ["inter"], ["fc2"], num_output=1))
model.add(hugectr.DenseLayer(L.BinaryCrossEntropyLoss, ["fc2", "label"], ["loss"]))
model.compile()
model.fit(max_iter=16, display=0, eval_interval=16, snapshot=0)
model.export_predictions(os.path.join(work, "pred"), os.path.join(work, "label"))
model.graph_to_json(os.path.join(work, "dlrm.json"))
model.save_params_to_files(os.path.join(work, "dlrm"), 16)
exported = np.loadtxt(os.path.join(work, "pred"))
print(f"trained; the last evaluation batch's first predictions: {exported[:3]}")

# %% [markdown]
# ## The parameter server
# Volatile tier: the in-process hash map, filled at start with the first half of the table's keys
# (initial_cache_rate 0.5), and told to keep what the persistent tier finds (cache_missed_embeddings).
# Persistent tier: RocksDB in `work/rocksdb`, filled with the whole table. Cache: 64 slots (HugeCTR's
# smallest), empty at start; hit_rate_threshold 1.0 makes every answer exact.

# %%
params = InferenceParams(
    model_name="dlrm", max_batchsize=64, hit_rate_threshold=1.0,
    dense_model_file=os.path.join(work, "dlrm_dense_16.model"),
    sparse_model_files=[os.path.join(work, "dlrm0_sparse_16.model")],
    use_gpu_embedding_cache=True, cache_size_percentage=0.5, i64_input_key=True,
    volatile_db=VolatileDatabaseParams(type=DatabaseType_t.ParallelHashMap, initial_cache_rate=0.5,
                                       cache_missed_embeddings=True),
    persistent_db=PersistentDatabaseParams(backend=DatabaseType_t.RocksDB, path=os.path.join(work, "rocksdb")))
session = CreateInferenceSession(os.path.join(work, "dlrm.json"), params)
ps, cache = session.ps, session.cache
tag = "hps_et.dlrm.emb"                      # HugeCTR's table name in the databases: hps_et.<model>.<table>
print(f"volatile tier holds {ps.volatile.size(tag)} keys, persistent tier {ps.persistent.size(tag)}, "
      f"cache {cache.capacities[0]} slots, empty")

# %% [markdown]
# ## One request
# Three samples in HugeCTR's CSR form: the dense features, the keys of every slot, the row pointers
# (sample b's slot s is bag b*3 + s). The third sample's last key (999) was never trained.

# %%
dense = [0.5, -1.0, 1.5, 0.2, -0.3, 0.8]
keys = [0, 7, 14, 5, 9, 16, 2, 11, 999]
row_ptrs = list(range(10))
uniq = np.unique(keys).astype(np.uint64)
tiers_before = {name: (s.queried, s.found) for name, s in ps.stats.items()}
out = session.predict(dense, keys, row_ptrs)
for name, s in ps.stats.items():
    q0, f0 = tiers_before[name]
    print(f"{name:>10} tier: asked for {s.queried - q0} keys, had {s.found - f0}")
print(f"cache: {cache.hits[0]} of {cache.queried[0]} distinct keys were cached; predictions {np.round(out, 6)}")
assert ps.stats["volatile"].queried == 9 and ps.stats["persistent"].queried == 9 - ps.stats["volatile"].found
assert ps.stats["persistent"].found == 8 - ps.stats["volatile"].found        # all but the unknown key 999

# %% [markdown]
# The keys the volatile tier missed came from RocksDB and were copied up into the hash map; the key 999
# is nowhere, so its vector is the default (0): it adds nothing to its slot's sum, exactly what the
# trained model's evaluation does with a key it never saw. Every key found is now in the cache, so the
# same request again is answered by the cache alone:

# %%
print(f"volatile tier now holds {ps.volatile.size(tag)} keys")
before = (ps.stats["volatile"].queried, cache.hits[0])
again = session.predict(dense, keys, row_ptrs)
print(f"second request: {cache.hits[0] - before[1]} cache hits, volatile tier asked for "
      f"{ps.stats['volatile'].queried - before[0]} key(s) (the unknown one); same predictions: {again == out}")
assert again == out and cache.hits[0] - before[1] == 8

# %% [markdown]
# ## The same numbers as training
# The evaluation batch through the session (CSR requests built from the eval file) gives exactly the
# predictions the trained model exported: the tiers change where a vector comes from, never its value.

# %%
from numbactr.data import make_reader                      # noqa: E402

batch = next(iter(make_reader(reader, lists[1], 64, 1, 2, [3], [[1, 1, 1]], True, False)))
k, off = batch.sparse[0]
served = np.asarray(session.predict(batch.dense.reshape(-1), np.asarray(k, np.int64), off), np.float32)
printed = "".join(f"{v:g} " for v in served.tolist())
assert printed == open(os.path.join(work, "pred")).read()
print("the session's predictions print exactly as export_predictions wrote them")
session.close()
print("tutorial 09 OK")
