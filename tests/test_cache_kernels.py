"""Property tests of the embedding cache (kernels/cache.py, numbactr.embedding.cache): the reference
placement against a brute-force model of LRU / LFU victim choice; the numba.cuda kernels (simulator)
against the reference step by step, with pins, dirty rows, duplicate rows in a batch and batches larger
than a table's free slots (an error that changes nothing); the row copy kernels against NumPy."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numbactr.runtime import device
from numbactr.embedding.cache import CacheCapacityError, EmbeddingCache
from numbactr.kernels import cache as K
from tests.kernel_util import dev, host

STATE = ("slot_row", "row_slot", "stamp", "freq", "pins", "dirty")


@st.composite
def cache_states(draw):
    """(caps, rows, state dict with row_freq, batch rows, policy): a consistent random cache and a batch."""
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    n_tables = draw(st.integers(1, 3))
    rows = [draw(st.integers(1, 12)) for _ in range(n_tables)]
    caps = [draw(st.integers(1, 6)) for _ in range(n_tables)]
    row_off = np.concatenate([[0], np.cumsum(rows)])
    slot_off = np.concatenate([[0], np.cumsum(caps)])
    C, R = int(slot_off[-1]), int(row_off[-1])
    s = dict(
        slot_row=np.full(C, -1, np.int64),
        row_slot=np.full(R, -1, np.int64),
        stamp=rng.integers(0, 4, C).astype(np.int64),
        freq=rng.integers(0, 4, C).astype(np.int64),
        pin=(rng.random(C) < 0.15).astype(np.int32),
        dirty=(rng.random(C) < 0.5).astype(np.int8),
        row_freq=rng.integers(0, 4, R).astype(np.int64),
    )
    for t in range(n_tables):
        held = rng.choice(rows[t], size=int(rng.integers(0, min(rows[t], caps[t]) + 1)), replace=False)
        slots = rng.choice(caps[t], size=held.size, replace=False)
        s["slot_row"][slot_off[t] + slots] = row_off[t] + held
        s["row_slot"][row_off[t] + held] = slot_off[t] + slots
    s["pin"][s["slot_row"] < 0] = 0  # only held rows are pinned
    n = draw(st.integers(0, 14))
    batch = rng.integers(-1, R, size=n).astype(np.int64)  # duplicates are frequent
    return np.array(caps), np.array(rows), s, batch, draw(st.sampled_from([K.LRU, K.LFU]))


def brute_force_victims(s, caps, rows, batch, policy):
    """Per table, the misses (ascending) paired with the unblocked slots sorted by (priority tuple, slot)."""
    slot_off = np.concatenate([[0], np.cumsum(caps)])
    row_off = np.concatenate([[0], np.cumsum(rows)])
    u = sorted(set(int(r) for r in batch if r >= 0))
    used = {int(s["row_slot"][r]) for r in u if s["row_slot"][r] >= 0}
    victims = []
    for t in range(len(caps)):
        misses = [r for r in u if row_off[t] <= r < row_off[t + 1] and s["row_slot"][r] < 0]
        cands = []
        for c in range(slot_off[t], slot_off[t + 1]):
            if c in used or s["pin"][c] > 0:
                continue
            if s["slot_row"][c] < 0:
                key = (-1,)
            elif policy == K.LFU:
                key = (int(s["freq"][c]), int(s["stamp"][c]))
            else:
                key = (int(s["stamp"][c]),)
            cands.append((key, c))
        if len(misses) > len(cands):
            return None
        victims += [c for _, c in sorted(cands)[: len(misses)]]
    return np.array(victims, np.int64)


@settings(max_examples=60)
@given(cache_states())
def test_reference_placement_matches_brute_force_lru_lfu(case):
    caps, rows, s, batch, policy = case
    slot_off = np.concatenate([[0], np.cumsum(caps)])
    row_off = np.concatenate([[0], np.cumsum(rows)])
    want = brute_force_victims(s, caps, rows, batch, policy)
    if want is None:
        with pytest.raises(CacheCapacityError):
            K.place_ref(s, batch, slot_off, row_off, policy, clock=9)
        return
    got = K.place_ref(s, batch, slot_off, row_off, policy, clock=9)
    np.testing.assert_array_equal(got["victims"], want)
    new = got["state"]
    # every row of the batch is cached now, in a slot of its own table; the maps agree
    for r in batch[batch >= 0]:
        slot = new["row_slot"][r]
        t = np.searchsorted(row_off, r, side="right") - 1
        assert slot_off[t] <= slot < slot_off[t + 1] and new["slot_row"][slot] == r
        assert new["stamp"][slot] == 9
    held = np.flatnonzero(new["slot_row"] >= 0)
    np.testing.assert_array_equal(new["row_slot"][new["slot_row"][held]], held)
    assert (new["row_slot"] >= 0).sum() == held.size
    # hits keep their slot; pinned slots keep their row; evicted rows and their dirt are reported
    for r in batch[batch >= 0]:
        if s["row_slot"][r] >= 0:
            assert new["row_slot"][r] == s["row_slot"][r]
    pinned = s["pin"] > 0
    np.testing.assert_array_equal(new["slot_row"][pinned], s["slot_row"][pinned])
    np.testing.assert_array_equal(got["evicted"], s["slot_row"][want])
    np.testing.assert_array_equal(got["evicted_dirty"], s["dirty"][want])
    # duplicates: a row's LFU count grows by its occurrences (from the backing tier's count if it was loaded)
    for r in np.unique(batch[batch >= 0]):
        before = s["freq"][s["row_slot"][r]] if s["row_slot"][r] >= 0 else s["row_freq"][r]
        assert new["freq"][new["row_slot"][r]] == before + (batch == r).sum()
    # an evicted row's count went back to the backing tier
    for v, old in zip(want, got["evicted"]):
        if old >= 0:
            assert new["row_freq"][old] == s["freq"][v]


@settings(max_examples=60)
@given(cache_states(), st.booleans())
def test_host_cache_placement_matches_brute_force(case, filling):
    """EmbeddingCache's host path, including its shortcut for a cache with enough empty slots
    (_empty_victims), picks the brute-force victims; `filling` empties most slots so the shortcut runs."""
    caps, rows, s, batch, policy = case
    if filling:
        s = {k: v.copy() for k, v in s.items()}
        gone = np.flatnonzero((s["slot_row"] >= 0) & (np.arange(s["slot_row"].size) % 3 != 0))
        s["row_slot"][s["slot_row"][gone]] = -1
        s["slot_row"][gone] = -1
    want = brute_force_victims(s, caps, rows, batch, policy)
    c = _cache(caps, rows, s, policy, False)
    if want is None:
        with pytest.raises(CacheCapacityError):
            c.place(batch)
        return
    np.testing.assert_array_equal(c.place(batch).victims, want)


def _cache(caps, rows, s, policy, use_kernels):
    c = EmbeddingCache(caps, rows, "lfu" if policy == K.LFU else "lru", use_kernels=use_kernels)
    for name, key in zip(STATE, ("slot_row", "row_slot", "stamp", "freq", "pin", "dirty")):
        getattr(c, name)[...] = dev(s[key]) if use_kernels else s[key]
    return c


def _snapshot(c):
    return {name: np.array(host(getattr(c, name)) if c.use_kernels else getattr(c, name)) for name in STATE}


@pytest.mark.skipif(not device.uses_kernels(), reason="needs the sim or gpu device")
@settings(max_examples=25)
@given(cache_states(), st.integers(1, 3))
def test_cache_kernels_equal_reference_over_batches(case, n_batches):
    caps, rows, s, batch, policy = case
    caches = [_cache(caps, rows, s, policy, use) for use in (False, True)]
    rng = np.random.default_rng(len(batch))
    for k in range(n_batches):
        plans = []
        for c in caches:
            try:
                plans.append(c.place(dev(batch) if c.use_kernels else batch))
            except CacheCapacityError as e:
                plans.append(str(e))
        if isinstance(plans[0], str) or isinstance(plans[1], str):
            assert plans[0] == plans[1]  # both refuse, with the same message
            a, b = (_snapshot(c) for c in caches)
            for name in STATE:
                np.testing.assert_array_equal(a[name], b[name])
            return
        freq = rng.integers(0, 5, plans[0].misses.shape[0])
        for c, p in zip(caches, plans):
            c.finish(p, freq)
        a, b = plans
        for f in ("misses", "victims", "evicted", "evicted_dirty", "evicted_freq", "miss_start"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
        np.testing.assert_array_equal(a.slots, host(b.slots))
        np.testing.assert_array_equal(a.unique_slots, host(b.unique_slots))
        # a training step: pin the batch, release it dirty
        caches[0].pin(a.unique_slots)
        caches[1].pin(b.unique_slots)
        caches[0].unpin(a.unique_slots, dirty=True)
        caches[1].unpin(b.unique_slots, dirty=True)
        sa, sb = (_snapshot(c) for c in caches)
        for name in STATE:
            np.testing.assert_array_equal(sa[name], sb[name], err_msg=name)
        assert caches[0].stats == caches[1].stats
        batch = rng.integers(-1, int(np.sum(rows)), size=batch.size).astype(np.int64)


def test_over_capacity_batch_leaves_the_cache_unchanged():
    for use in [False, True] if device.uses_kernels() else [False]:
        c = EmbeddingCache([3], [10], "lru", use_kernels=use)
        p = c.place(dev(np.array([1, 2])) if use else np.array([1, 2]))
        c.finish(p)
        c.pin(p.unique_slots)
        before = _snapshot(c)
        with pytest.raises(CacheCapacityError, match="needs 2 rows loaded but only 1 of its 3"):
            c.place(dev(np.array([5, 6, 1])) if use else np.array([5, 6, 1]))
        after = _snapshot(c)
        for name in STATE:
            np.testing.assert_array_equal(before[name], after[name])
        assert c.stats.batches == 1 and c.clock == 1


def test_lru_and_lfu_pick_different_victims():
    # slot 0 holds row 0, used in batches 1 and 2 (count 2); slot 1 holds row 1, used in batch 3 only:
    # LRU evicts row 0 (older), LFU evicts row 1 (rarer)
    for policy, evicted in (("lru", 0), ("lfu", 1)):
        c = EmbeddingCache([2], [5], policy, use_kernels=False)
        for rows in ([0], [0], [1]):
            c.finish(c.place(np.array(rows)))
        plan = c.place(np.array([4]))
        assert plan.evicted.tolist() == [evicted]


@pytest.mark.skipif(not device.uses_kernels(), reason="needs the sim or gpu device")
@given(st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**31))
def test_row_copy_kernels_equal_numpy(n_rows, width, seed):
    rng = np.random.default_rng(seed)
    stride = width + int(rng.integers(0, 3))
    block = rng.normal(size=(n_rows + 3, stride)).astype(np.float32)
    idx = rng.choice(n_rows + 3, size=n_rows, replace=False).astype(np.int64)
    out = dev(np.zeros((n_rows, width), np.float32))
    K.gather_rows(dev(block), dev(idx), out)
    np.testing.assert_array_equal(host(out), block[idx, :width])
    dst = dev(block.copy())
    src = rng.normal(size=(n_rows, width)).astype(np.float32)
    K.scatter_rows(dst, dev(idx), dev(src))
    want = block.copy()
    want[idx, :width] = src
    np.testing.assert_array_equal(host(dst), want)
