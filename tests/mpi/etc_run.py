"""The embedding training cache on R ranks (tests/test_etc.py::test_etc_under_mpiexec_equals_one_rank).

    mpiexec -n R python tests/mpi/etc_run.py DATA_DIR OUT_DIR

Trains tests/test_etc.py's model over DATA_DIR's three file lists with their keyset files (a Cached PS: on
several ranks it runs as Staged), saves with save_params_to_files (the table into OUT_DIR/sparse), then
builds a second model on that sparse model. Rank 0 writes OUT_DIR/result.npz: dense weights, the saved
table, the table the second model loaded (gathered), and this rank count's incremental-model key counts.
"""

import os
import sys
import warnings

os.environ.setdefault("NUMBACTR_DEVICE", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402

import numbactr as hugectr  # noqa: E402
from numbactr.distributed.comm import world  # noqa: E402
from tests.test_etc import _model  # noqa: E402

data, out = sys.argv[1], sys.argv[2]
comm = world()
parts = [(os.path.join(data, f"file_list.{p}.txt"), os.path.join(data, f"file_list.{p}.keyset")) for p in range(3)]
evl = os.path.join(data, "file_list.3.txt")
sparse = os.path.join(out, "sparse")
with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    etc = hugectr.CreateETC(
        [hugectr.TrainPSType_t.Cached],
        [sparse],
        local_paths=[out],
        hmem_cache_configs=[hugectr.CreateHMemCache(2, 0.5, 0)],
    )
    m = _model([p[0] for p in parts], [p[1] for p in parts], evl, etc)
cached_warned = any("ps_types[0]" in str(w.message) for w in rec)
m.fit(num_epochs=1, display=100, eval_interval=100)
inc = m.get_incremental_model()
m.save_params_to_files(os.path.join(out, "model"), 9)
m2 = _model([parts[0][0]], [parts[0][1]], evl, hugectr.CreateETC([hugectr.TrainPSType_t.Staged], [sparse]), seed=5)
keys, vecs = m2.embeddings[0].dump()
keys, vecs = comm.gather_rows(keys.astype(np.int64)), comm.gather_rows(np.asarray(vecs))
n_inc = comm.gather_rows(np.array([inc[0][0].size], np.int64))
if comm.rank == 0:
    order = np.argsort(keys)
    saved_k = np.fromfile(os.path.join(sparse, "key"), "<i8")
    saved_v = np.fromfile(os.path.join(sparse, "emb_vector"), "<f4").reshape(saved_k.size, -1)
    so = np.argsort(saved_k)
    np.savez(
        os.path.join(out, "result.npz"),
        weights=np.asarray(m.weights),
        saved_keys=saved_k[so],
        saved_vecs=saved_v[so],
        loaded_keys=keys[order],
        loaded_vecs=vecs[order],
        n_inc=n_inc,
        cached_warned=np.array([cached_warned]),
    )
