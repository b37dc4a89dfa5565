"""A snapshot's sparse weights and optimizer states loaded through numbactr.files.checkpoint into a tiered
SparseEmbedding (embedding_cache): the rows and states land in the backing tier exactly as in the untiered
table, on the cpu device and on the kernels (sim here, the GPU on a GPU run, where the tiered table's
weights and states are host arrays beside the device's)."""

import os

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.files import checkpoint
from numbactr.runtime import device
from numbactr.distributed.comm import world
from numbactr.embedding.tiered import CacheConfig, TierSpec, TieredEmbedding
from tests.test_tiered_sparse_embedding import batches, embedding, train

E, O = hugectr.Embedding_t, hugectr.Optimizer_t


def write_snapshot(e, folder: str, opt_file: str) -> None:
    """HugeCTR's sparse model folder and optimizer-state file of embedding e (no manifest)."""
    _, keys, vecs, slots, blocks = checkpoint._gather_embedding(e, world())
    os.makedirs(folder)
    for name, a, dtype in (("key", keys, "<i8"), ("emb_vector", vecs, "<f4"), ("slot_id", slots, "<u8")):
        if a is not None:
            with open(os.path.join(folder, name), "wb") as f:
                f.write(checkpoint._raw(a, dtype).tobytes())
    with open(opt_file, "wb") as f:
        f.write(checkpoint._raw(np.concatenate(blocks), "<f4").tobytes())


@pytest.mark.parametrize(
    "etype", [E.DistributedSlotSparseEmbeddingHash, E.LocalizedSlotSparseEmbeddingHash], ids=lambda e: e.name
)
@pytest.mark.parametrize("where", ["cpu", "kernels"])
def test_checkpoint_loads_weights_and_optimizer_states_into_a_tiered_table(etype, where, on_device, tmp_path):
    on_device("cpu" if where == "cpu" else "sim" if device._numba_simulated() else "gpu")
    steps = batches(np.random.default_rng(5), etype, n=6)
    source = embedding(etype, optimizer_type=O.Adam)
    train(source, steps[:3], np.random.default_rng(6))
    folder, opt_file = str(tmp_path / "t0_sparse_3.model"), str(tmp_path / "t0_opt_sparse_3.model")
    write_snapshot(source, folder, opt_file)
    plain, cached = (
        embedding(etype, optimizer_type=O.Adam),
        embedding(etype, TierSpec(CacheConfig(capacities=[24])), optimizer_type=O.Adam),
    )
    assert isinstance(cached.engine, TieredEmbedding)
    assert (cached.engine.engine.impl == "kernels") == (where == "kernels")
    for emb in (plain, cached):
        train(emb, steps[:1], np.random.default_rng(8))  # rows and states to be replaced
        model = type("M", (), {"embeddings": [emb], "ranks": 1, "comm": world()})()
        checkpoint.load_sparse_weights(model, [folder])
        checkpoint.load_sparse_optimizer_states(model, [opt_file])
    for emb in (plain, cached):
        np.testing.assert_array_equal(emb.dump()[0], source.dump()[0])
        np.testing.assert_array_equal(emb.dump()[1], source.dump()[1])
        for x, y in zip(emb.dump_states(), source.dump_states()):
            np.testing.assert_array_equal(x, y)
    for a, b in zip(
        train(plain, steps[3:], np.random.default_rng(9)), train(cached, steps[3:], np.random.default_rng(9))
    ):
        np.testing.assert_array_equal(a, b)
    for x, y in zip(plain.dump_states(), cached.dump_states()):
        np.testing.assert_array_equal(x, y)
