"""numbactr.hps_torch, HugeCTR's HPS plugin for PyTorch: LookupLayer on HugeCTR's own unit-test setup (sparse
model files written key by key, the plugin's HPS JSON) returns each key's vector for keys of any shape, a
key no table holds gets the default value, one JSON's parameter server is shared by its layers, `import
hps_torch` works after `import numbactr`, and bad arguments are clear errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from numbactr import hps_torch  # noqa: E402

VOCAB, D, QUERY, MAX_BATCH = 1000, 16, 10, 32

# the plugin's JSON asks for the "static" cache, which numbactr's dynamic cache replaces (it says so once)
pytestmark = pytest.mark.filterwarnings("ignore:.*embedding_cache_type=EmbeddingCacheType_t.Static is ignored")


def write_table(folder, keys, vectors) -> None:
    """A HugeCTR sparse model folder: key (int64) and emb_vector (float32) files."""
    os.makedirs(folder, exist_ok=True)
    np.asarray(keys, np.int64).tofile(os.path.join(folder, "key"))
    np.asarray(vectors, np.float32).tofile(os.path.join(folder, "emb_vector"))


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """Two tables (keys 0..VOCAB-1 and VOCAB..2*VOCAB-1, the second 8 wide) and the plugin's HPS JSON."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    tables = [rng.random((VOCAB, D), dtype=np.float32), rng.random((VOCAB, 8), dtype=np.float32)]
    for i, t in enumerate(tables):
        write_table(f"embeddings/table{i}", np.arange(i * VOCAB, (i + 1) * VOCAB), t)
    config = {
        "supportlonglong": True,
        "fuse_embedding_table": False,
        "models": [
            {
                "model": "2_table",
                "sparse_files": ["embeddings/table0", "embeddings/table1"],
                "num_of_worker_buffer_in_pool": 2,
                "embedding_table_names": ["table0", "table1"],
                "embedding_vecsize_per_table": [D, 8],
                "maxnum_catfeature_query_per_table_per_sample": [QUERY, QUERY],
                "default_value_for_each_table": [0.5, 0.0],
                "deployed_device_list": [0],
                "max_batch_size": MAX_BATCH,
                "cache_refresh_percentage_per_iteration": 1.0,
                "hit_rate_threshold": 1.0,
                "gpucacheper": 1.0,
                "gpucache": True,
                "embedding_cache_type": "static",
                "use_context_stream": True,
            }
        ],
    }
    path = tmp_path / "2_table.json"
    path.write_text(json.dumps(config, indent=4))
    return str(path), tables


def test_lookup_layer_returns_each_keys_vector_in_the_keys_shape(setup):
    path, tables = setup
    layer = hps_torch.LookupLayer(path, "2_table", 0, D)
    keys = torch.randint(0, VOCAB, (MAX_BATCH, QUERY), generator=torch.Generator().manual_seed(1))
    for dtype in (torch.int64, torch.int32):
        out = layer(keys.to(dtype))
        assert out.shape == (MAX_BATCH, QUERY, D) and out.dtype == torch.float32 and not out.requires_grad
        np.testing.assert_array_equal(out.numpy(), tables[0][keys.numpy()])
    second = hps_torch.LookupLayer(path, "2_table", 1, 8)
    k1 = torch.tensor([[VOCAB + 3, VOCAB + 7], [2 * VOCAB - 1, VOCAB]])
    np.testing.assert_array_equal(second(k1).numpy(), tables[1][k1.numpy() - VOCAB])
    assert second._hps is layer._hps  # one parameter server per JSON and process
    # a key no table holds: default_value_for_each_table
    out = layer(torch.tensor([5, 10**9]))
    np.testing.assert_array_equal(out[0].numpy(), tables[0][5])
    np.testing.assert_array_equal(out[1].numpy(), np.full(D, 0.5, np.float32))
    assert layer(torch.zeros((0, 3), dtype=torch.int64)).shape == (0, 3, D)


def test_bad_arguments_are_clear_errors(setup):
    path, _ = setup
    with pytest.raises(KeyError, match="model 'nope' is not in"):
        hps_torch.LookupLayer(path, "nope", 0, D)
    with pytest.raises(ValueError, match="tables 0..1, not table_id=2"):
        hps_torch.LookupLayer(path, "2_table", 2, D)
    with pytest.raises(ValueError, match="emb_vec_size=128, but table 0 .* has vectors of 16"):
        hps_torch.LookupLayer(path, "2_table", 0, 128)
    layer = hps_torch.LookupLayer(path, "2_table", 0, D)
    with pytest.raises(TypeError, match="int32 or int64"):
        layer(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="at most maxnum_catfeature_query_per_table_per_sample"):
        layer(torch.zeros(QUERY * MAX_BATCH + 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="key -1 at position 1 is reserved"):
        layer(torch.tensor([3, -1]))
    with pytest.raises(ValueError, match="cannot be read"):
        hps_torch.LookupLayer(str(os.path.dirname(path)) + "/missing.json", "2_table", 0, D)


def test_import_hps_torch_after_numbactr(setup):
    """HugeCTR's plugin scripts say `import hps_torch`: after `import numbactr` that is numbactr's."""
    path, tables = setup
    code = (
        "import numbactr, torch, numpy as np\n"
        "import hps_torch\n"
        f"layer = hps_torch.LookupLayer({path!r}, '2_table', 0, {D})\n"
        "print(hps_torch.__name__, float(layer(torch.tensor([[4]])).sum()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBACTR_DEVICE"] = "cpu"
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, cwd=os.path.dirname(path)
    )
    assert r.returncode == 0, r.stderr[-3000:]
    name, total = r.stdout.strip().splitlines()[-1].split()
    assert name == "numbactr.hps_torch"
    assert abs(float(total) - float(tables[0][4].sum())) < 1e-4
