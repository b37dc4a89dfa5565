"""HugeCTR's SparseEmbedding with numbactr's embedding_cache (a TierSpec): the table in a backing tier behind
a cache of 24 rows trains exactly like the untiered embedding (Distributed, Localized, OneHot; SGD, Adam
Global and LazyGlobal, MomentumSGD Global), its snapshots (keys, vectors, slots, optimizer states) are the
same, a load moves states with their keys through the cache, and bad options are clear errors."""

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.runtime import device
from numbactr.autograd import Tape
from numbactr.embedding.factory import make_embedding
from numbactr.embedding.tiered import CacheConfig, TierSpec, TieredEmbedding

E, O, U = hugectr.Embedding_t, hugectr.Optimizer_t, hugectr.Update_t
S, D, B = 3, 4, 4
SIZES = (40, 30, 50)


pytestmark = pytest.mark.usefixtures("cpu")  # conftest.py: the cpu device for every test


def embedding(etype, tier=None, **opt):
    cfg = hugectr.SparseEmbedding(
        etype,
        1,
        D,
        "mean",
        "e",
        "data",
        optimizer=None,
        embedding_cache=tier,
        slot_size_array=list(SIZES) if etype != E.DistributedSlotSparseEmbeddingHash else [],
    )
    return make_embedding(
        cfg, hugectr.DataReaderSparseParam("data", 3, False, S), hugectr.CreateOptimizer(**opt), seed=3
    )


def batches(rng, etype, n=8):
    out = []
    for _ in range(n):
        lens = rng.integers(0, 3, size=B * S)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        slot = np.repeat(np.arange(B * S) % S, lens)
        keys = (
            rng.integers(0, 12, size=slot.size)  # per-slot keys: the one-hot embedding adds the offsets
            if etype == E.LocalizedSlotSparseEmbeddingOneHot
            else rng.integers(0, 60, size=slot.size) * 1000 + slot
        )
        out.append((keys.astype(np.int64), offsets))
    return out


def train(emb, steps, rng):
    outs = []
    for k, (keys, offsets) in enumerate(steps):
        tape = Tape()
        out = emb.forward(tape, keys, offsets, B, training=k != 3)
        outs.append(np.array(device.to_host(out.data)))
        if k != 3:
            tape.backward({id(out): (out, rng.normal(size=out.data.shape).astype(np.float32))})
            emb.update(0.1, 1.0)
    return outs


CASES = [(O.SGD, U.Local), (O.Adam, U.Global), (O.Adam, U.LazyGlobal), (O.MomentumSGD, U.Global)]


@pytest.mark.parametrize(
    "etype",
    [E.DistributedSlotSparseEmbeddingHash, E.LocalizedSlotSparseEmbeddingHash, E.LocalizedSlotSparseEmbeddingOneHot],
    ids=lambda e: e.name,
)
@pytest.mark.parametrize("opt,update", CASES, ids=[f"{o.name}-{u.name}" for o, u in CASES])
def test_tiered_sparse_embedding_trains_like_the_untiered_one(etype, opt, update, tmp_path):
    steps = batches(np.random.default_rng(1), etype)
    kw = dict(optimizer_type=opt, update_type=update)
    plain = embedding(etype, **kw)
    tier = TierSpec(CacheConfig("lru", capacities=[24]), backing="memmap", path=str(tmp_path / "t"))
    cached = embedding(etype, tier, **kw)
    assert isinstance(cached.engine, TieredEmbedding)
    for a, b in zip(train(plain, steps, np.random.default_rng(2)), train(cached, steps, np.random.default_rng(2))):
        np.testing.assert_array_equal(a, b)
    assert cached.engine.stats.evictions > 0
    (ka, va), (kb, vb) = plain.dump(), cached.dump()
    np.testing.assert_array_equal(ka, kb)
    np.testing.assert_array_equal(va, vb)
    for x, y in zip(plain.dump_states(), cached.dump_states()):
        np.testing.assert_array_equal(x, y)
    sa, sb = plain.dump_slots(), cached.dump_slots()
    assert (sa is None) == (sb is None) and (sa is None or np.array_equal(sa, sb))


def test_a_load_through_the_cache_moves_states_with_their_keys():
    etype = E.LocalizedSlotSparseEmbeddingHash
    steps = batches(np.random.default_rng(5), etype)
    source = embedding(etype, optimizer_type=O.Adam)
    train(source, steps[:4], np.random.default_rng(6))
    keys, vecs = source.dump()
    order = np.random.default_rng(7).permutation(keys.size)  # a snapshot in another row order
    plain, cached = (
        embedding(etype, optimizer_type=O.Adam),
        embedding(etype, TierSpec(CacheConfig(capacities=[24])), optimizer_type=O.Adam),
    )
    for emb in (plain, cached):
        train(emb, steps[:2], np.random.default_rng(8))
        emb.load(keys[order], vecs[order], source.dump_slots()[order].astype(np.int64))
    for a, b in zip(
        train(plain, steps[4:], np.random.default_rng(9)), train(cached, steps[4:], np.random.default_rng(9))
    ):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(plain.dump()[1], cached.dump()[1])
    for x, y in zip(plain.dump_states(), cached.dump_states()):
        np.testing.assert_array_equal(x, y)


def test_embedding_cache_option_errors():
    with pytest.raises(ValueError, match="TierSpec"):
        hugectr.SparseEmbedding(
            E.DistributedSlotSparseEmbeddingHash, 1, D, "sum", "e", "data", embedding_cache=CacheConfig()
        )
    with pytest.raises(ValueError, match="'host' or 'memmap'"):
        hugectr.SparseEmbedding(
            E.DistributedSlotSparseEmbeddingHash, 1, D, "sum", "e", "data", embedding_cache=TierSpec(backing="lmdb")
        )
