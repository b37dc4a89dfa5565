"""The compiled cpu path (kernels/tbe_cpu.py) equals the NumPy reference: every optimizer, pooling,
layout, precision, bounds-check mode and keyed tables; the radix sort is stable for any thread count."""

import numpy as np
import pytest
from hypothesis import given, settings

from numbactr.embedding.engine import (
    BoundsCheck,
    EmbeddingBoundsError,
    Layout,
    Optim,
    Pooling,
    Precision,
    OptimizerSpec,
    TableBatchedEmbedding,
    TableSpec,
)
from numbactr.kernels import tbe_cpu as C
from tests.engine_cases import OPTIMIZER_CASES, Case, assert_same_training, cases, random_steps, run


pytestmark = pytest.mark.usefixtures("cpu")  # conftest.py: the cpu device for every test


@pytest.mark.parametrize(
    "kind,update,wd_mode", OPTIMIZER_CASES, ids=[f"{k.name}-{u.name}-{m.name}" for k, u, m in OPTIMIZER_CASES]
)
def test_every_optimizer_matches_reference(kind, update, wd_mode):
    rng = np.random.default_rng(int(kind) * 7 + int(update))
    tables, fmap = [(6, 5), (4, 8), (7, 5)], [0, 1, 2, 0]
    case = Case(
        tables,
        fmap,
        kind=kind,
        update=update,
        wd_mode=wd_mode,
        pooling=Pooling.MEAN,
        max_norm=0.9,
        clip=True,
        steps=random_steps(rng, tables, fmap, n_steps=3),
    )
    assert_same_training(case, run(case, "ref"), run(case, "cpu"))


@settings(max_examples=25)
@given(case=cases())
def test_random_configurations_match_reference(case):
    assert_same_training(case, run(case, "ref"), run(case, "cpu"))


@pytest.mark.parametrize("mode", [BoundsCheck.WARNING, BoundsCheck.IGNORE, BoundsCheck.NONE])
def test_bounds_modes_repair_like_the_reference(mode):
    rng = np.random.default_rng(5)
    tables, fmap = [(4, 3), (9, 3)], [0, 1]
    case = Case(
        tables, fmap, bounds=mode, kind=Optim.EXACT_ADAGRAD, steps=random_steps(rng, tables, fmap, n_steps=2, bad=True)
    )  # indices up to rows + 1
    if mode == BoundsCheck.WARNING:
        with pytest.warns(RuntimeWarning, match="outside its table"):
            a = run(case, "ref")
        with pytest.warns(RuntimeWarning, match="outside its table"):
            b = run(case, "cpu")
        assert a[0].bounds_warnings == b[0].bounds_warnings > 0
    else:
        a, b = run(case, "ref"), run(case, "cpu")
    assert_same_training(case, a, b)


def test_bad_offsets_and_fatal_on_cpu():
    e = Case([(5, 2)], [0, 0], bounds=BoundsCheck.IGNORE).engine("cpu")
    idx = np.array([1, 2, 3, 4], np.int64)
    out, ctx = e.forward(idx, np.array([0, 3, 2, 9, 4]))  # decreasing, past N: repaired
    np.testing.assert_array_equal(ctx.offsets, [0, 3, 3, 4, 4])
    fatal = Case([(5, 2)], [0, 0], bounds=BoundsCheck.FATAL).engine("cpu")
    with pytest.raises(EmbeddingBoundsError, match=r"offsets\[2\] = 2"):
        fatal.forward(idx, np.array([0, 3, 2, 4, 4]))
    with pytest.raises(EmbeddingBoundsError, match=r"index 7 at position 1 \(feature 0, sample 0\)"):
        fatal.forward(np.array([1, 7, 3, 4], np.int32), np.array([0, 2, 2, 3, 4], np.int32))


def test_int32_inputs_and_sample_major_keyed_tables():
    rng = np.random.default_rng(2)
    keys = rng.integers(0, 2**62, size=12).astype(np.int64)
    for impl in ("ref", "cpu"):
        case = Case(
            [TableSpec(20, 4, keyed=True), (6, 4)],
            [0, 0, 1],
            layout=Layout.SAMPLE_MAJOR,
            pooling=Pooling.MEAN,
            kind=Optim.HUGECTR_ADAM,
        )
        e = case.engine(impl)
        idx = np.concatenate([keys[:4], [1], keys[2:6], [5, 0], keys[7:9]])  # bags b*3 + f
        offs = np.array([0, 2, 4, 5, 7, 9, 11, 12, 13, 13], np.int64)
        out, ctx = e.forward(idx, offs)
        e.backward(ctx, np.ones_like(out))
        if impl == "ref":
            want_rows, want_w = ctx.rows.copy(), [w.copy() for w in e.split_weights()]
        else:
            np.testing.assert_array_equal(ctx.rows, want_rows)
            for w, v in zip(e.split_weights(), want_w):
                np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)
    i32 = Case([(6, 3)], [0, 0]).engine("cpu")
    out32, _ = i32.forward(np.array([1, 2, 5], np.int32), np.array([0, 1, 1, 3, 3], np.int32))
    out64, _ = i32.forward(np.array([1, 2, 5], np.int64), np.array([0, 1, 1, 3, 3], np.int64))
    np.testing.assert_array_equal(out32, out64)


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("top", [1000, 5000, 2**30])  # 1, 2 and 3 passes of up to 11 bits
def test_radix_sort_is_stable_and_thread_count_free(n_threads, top):
    import numba

    rng = np.random.default_rng(0)
    keys = rng.integers(0, top, size=200_000).astype(np.int64)
    keys[:5] = [0, top - 1, top - 1, 0, top // 2]
    vals = np.arange(keys.size, dtype=np.int64)
    keys_in, vals_in = keys.copy(), vals.copy()
    out = [np.full_like(keys, -7) for _ in range(4)]
    old = numba.get_num_threads()
    numba.set_num_threads(n_threads)
    try:
        C.radix_sort(keys, vals, C.radix_bits(top), *out)
    finally:
        numba.set_num_threads(old)
    want = np.argsort(keys, kind="stable")
    np.testing.assert_array_equal(out[1], want)
    np.testing.assert_array_equal(out[0], keys[want])
    # the input is read, never written (the first pass reads it in place of a copy)
    np.testing.assert_array_equal(keys, keys_in)
    np.testing.assert_array_equal(vals, vals_in)


def test_fp16_output_and_weights_on_cpu():
    case = Case(
        [(8, 6)],
        [0, 0],
        weights=Precision.FP16,
        output=Precision.FP16,
        kind=Optim.EXACT_ROWWISE_ADAGRAD,
        steps=random_steps(np.random.default_rng(9), [(8, 6)], [0, 0], n_steps=3),
    )
    a, b = run(case, "ref"), run(case, "cpu")
    assert a[0].weights.dtype == np.float16 and a[1][0].dtype == np.float64
    assert_same_training(case, a, b)


# ---- the compiled hash table ------------------------------------------------------------------------
def test_compiled_hash_table_gives_the_reference_rows():
    from numbactr.embedding.hash_table import HashTable, HashTableFullError

    rng = np.random.default_rng(3)
    ref = HashTable(450, use_kernels=False)
    fast = HashTable(450, use_kernels=False, compiled=True)
    for step in range(6):
        keys = rng.integers(0, 400, size=120).astype(np.uint64) * np.uint64(2**40 + 7)  # big, repeated
        np.testing.assert_array_equal(fast.insert(keys), ref.insert(keys))
        assert fast.size == ref.size
    probe = rng.integers(0, 500, size=200).astype(np.uint64) * np.uint64(2**40 + 7)
    np.testing.assert_array_equal(fast.find(probe), ref.find(probe))
    np.testing.assert_array_equal(fast.keys_by_row(), ref.keys_by_row())
    full = HashTable(5, use_kernels=False, compiled=True)
    full.insert(np.array([1, 2, 3], np.uint64))
    with pytest.raises(HashTableFullError, match="needs 3 more rows"):
        full.insert(np.array([4, 1, 5, 6, 4], np.uint64))
    assert full.size == 3  # rolled back: unchanged
    np.testing.assert_array_equal(full.find(np.array([1, 2, 3, 4, 5, 6], np.uint64)), [0, 1, 2, -1, -1, -1])
    np.testing.assert_array_equal(full.insert(np.array([6, 3], np.uint64)), [3, 2])


@pytest.mark.parametrize("layout", [0, 1])
def test_count_bad_indices_agrees_with_the_repairing_check(layout):
    """The write-free count that lets a clean batch be its own rows finds exactly what check_indices
    repairs: random ragged bags, -1 entries, keyed (unchecked) features, out-of-range on both sides."""
    from numbactr.kernels import tbe_cpu as C

    rng = np.random.default_rng(layout)
    for _ in range(40):
        n_features, batch = int(rng.integers(1, 5)), int(rng.integers(0, 6))
        limits = rng.integers(1, 8, n_features)
        limits[rng.random(n_features) < 0.25] = -1  # keyed: not checked
        lengths = rng.integers(0, 4, n_features * batch)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        indices = rng.integers(-3, 10, int(offsets[-1])).astype(np.int64)
        rows = np.empty_like(indices)
        want = C.check_indices(indices, offsets, limits, batch, layout, 2, rows)
        assert C.count_bad_indices(indices, offsets, limits, batch, layout) == want
        assert C.offsets_valid(offsets, indices.shape[0])
    assert not C.offsets_valid(np.array([0, 2, 1, 3], np.int64), 3)
    assert not C.offsets_valid(np.array([0, 2, 4], np.int64), 3)
    assert not C.offsets_valid(np.array([0, 1, 2], np.int64), 3)


@pytest.mark.parametrize("dims", [(16, 16), (64, 8), (5, 32)])
@pytest.mark.parametrize("pooling", [0, 1])
@pytest.mark.parametrize("half", [False, True])
def test_forward_pooled_equals_the_general_forward(dims, pooling, half):
    """forward_pooled (feature-major, no per-sample weights) gives forward's bits: ragged and empty bags,
    rows -1 (skipped), MEAN of one row stored unscaled, widths with and without a compiled copy."""
    rng = np.random.default_rng(sum(dims) + pooling)
    rows_per = np.array([40, 30], np.int64)
    dims_a = np.array(dims, np.int64)
    lane = 8 if half else 4
    strides = -(-dims_a // lane) * lane
    elem_off = np.concatenate([[0], np.cumsum(rows_per * strides)]).astype(np.int64)
    w = rng.standard_normal(int(elem_off[-1])).astype(np.float32)
    w = w.astype(np.float16).view(np.uint16) if half else w
    ftable = np.array([0, 1, 0], np.int64)
    fcols = np.concatenate([[0], np.cumsum(dims_a[ftable])]).astype(np.int64)
    batch = 70  # > one chunk of 64 samples
    hot = rng.integers(0, 4, ftable.size * batch)
    offsets = np.concatenate([[0], np.cumsum(hot)]).astype(np.int64)
    rows = np.concatenate(
        [rng.integers(-1, rows_per[t], hot[f * batch : (f + 1) * batch].sum()) for f, t in enumerate(ftable)]
    ).astype(np.int64)
    scratch = np.zeros((4, 64), np.float32)
    a = np.full(batch * int(fcols[-1]), np.nan, np.float32)
    b = a.copy()
    C.forward(
        w,
        elem_off,
        strides,
        ftable,
        fcols,
        rows,
        offsets,
        np.zeros(1, np.float32),
        False,
        batch,
        0,
        pooling,
        a,
        scratch,
    )
    C.forward_pooled(w, elem_off, strides, ftable, fcols, rows, offsets, batch, pooling, b, scratch)
    np.testing.assert_array_equal(a, b)
    assert not np.isnan(b).any()


@pytest.mark.parametrize("psw", [False, True])
def test_mean_of_bags_of_at_most_one_row_trains_as_the_reference(psw):
    """A MEAN lookup whose bags hold at most one row (the backward then reads dy itself, without the
    pre-scaled copy) updates the rows as the reference does; empty bags and -1 rows included."""
    rng = np.random.default_rng(11)
    tables, fmap, batch = [(40, 16), (25, 8)], [0, 1, 1], 24
    engines = {
        impl: TableBatchedEmbedding(
            tables,
            fmap,
            pooling=Pooling.MEAN,
            impl=impl,
            bounds_check=BoundsCheck.NONE,
            optimizer=OptimizerSpec(Optim.EXACT_ROWWISE_ADAGRAD, 0.1),
        )
        for impl in ("ref", "cpu")
    }
    for eng in engines.values():
        for t, w in enumerate(eng.split_weights()):
            w[...] = np.random.default_rng(t).uniform(-1, 1, w.shape)
    for _ in range(3):
        hot = rng.integers(0, 2, len(fmap) * batch)
        offsets = np.concatenate([[0], np.cumsum(hot)]).astype(np.int64)
        idx = np.concatenate(
            [rng.integers(-1, tables[t][0], hot[f * batch : (f + 1) * batch].sum()) for f, t in enumerate(fmap)]
        ).astype(np.int64)
        weights = rng.uniform(0.5, 2, idx.size).astype(np.float32) if psw else None
        dy = rng.standard_normal((batch, 32)).astype(np.float32)
        outs = []
        for eng in engines.values():
            out, ctx = eng.forward(idx, offsets, weights)
            eng.backward(ctx, dy)
            outs.append(np.asarray(out, np.float64))
        np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(engines["ref"].split_weights(), engines["cpu"].split_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    for a, b in zip(engines["ref"].split_optimizer_states(), engines["cpu"].split_optimizer_states()):
        for x, y in zip(a, b):
            np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6)
