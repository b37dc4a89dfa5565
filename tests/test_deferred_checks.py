"""Checks a GPU training step does not read back (TableBatchedEmbedding.defer_checks): on the kernels (sim
here, gpu alike) a SparseEmbedding's bounds check, hash-table overflow and reserved keys are recorded on the
device and raised at the model's check points (evaluation, snapshots, the end of fit, every
NONFINITE_CHECK_EVERY steps, Model.check_deferred) with the cpu device's message; the occurrences at fault are
looked up as nothing in the meantime, so nothing else is corrupted. (A SparseEmbedding's keys outside their
slot_size_array ranges are stopped by the data reader before any lookup, tests/test_validation_data.py; the
engine's own deferred bounds check is tested directly below.)"""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numbactr as hugectr  # noqa: F401  (first: picks the device, as a script's import does)
from numbactr.runtime import device
from numbactr.embedding.engine import (
    BoundsCheck,
    EmbeddingBoundsError,
    Layout,
    Optim,
    OptimizerSpec,
    Pooling,
    TableBatchedEmbedding,
)
from numbactr.kernels import tbe as K
from numbactr.embedding.hash_table import HashTableFullError
from numbactr.kernels import launch
from tests.model_util import tiny_data, tiny_dlrm

pytestmark = pytest.mark.skipif(not device._numba_simulated(), reason="needs the simulator")


def _first_error(model, check):
    """(error type, message) of the first error: train() on cpu, train() then check() on sim."""
    with pytest.raises((HashTableFullError, EmbeddingBoundsError)) as info:
        model.train()
        check(model)
    return type(info.value), str(info.value)


def test_hash_table_full_is_raised_at_the_check_point_with_the_cpu_message(tmp_path, on_device):
    tr, ev = tiny_data(str(tmp_path), n_train=64, n_eval=64, keys_per_slot=40)
    got = {}
    for dev in ("cpu", "sim"):
        on_device(dev)
        m = tiny_dlrm(tr, ev, batch=64)
        emb = m.embeddings[0]
        # 1 MB holds 21845 rows: shrink the table to 20 so that the first batch does not fit
        emb.table._max_rows = 20
        if dev == "sim":
            assert emb.engine.defer_checks
            launch.reset_counts()
            assert m.train()  # nothing raised, nothing read in the step
            assert launch.reset_counts()["host_reads"] == 0
            assert emb.table.size == 0  # the batch was rolled back on the device
        got[dev] = _first_error(m, lambda model: model.check_deferred())
    assert got["sim"] == got["cpu"]
    assert "the keys seen so far need" in got["sim"][1]


def test_fit_raises_what_its_steps_deferred(tmp_path, on_device):
    tr, ev = tiny_data(str(tmp_path), n_train=64, n_eval=64, keys_per_slot=40)
    on_device("sim")
    m = tiny_dlrm(tr, ev, batch=32)
    m.embeddings[0].table._max_rows = 10
    with pytest.raises(HashTableFullError, match="the keys seen so far need"):
        m.fit(max_iter=2, display=0, eval_interval=0, snapshot=0)


@pytest.mark.parametrize("mode", [BoundsCheck.FATAL, BoundsCheck.WARNING])
def test_engine_deferred_bounds_check(on_device, mode):
    """The engine's record over two lookups: the first offender's details and the summed count; FATAL's bad
    occurrences read nothing (the lookup equals one where they are -1), WARNING's read row 0 (FBGEMM)."""
    on_device("sim")

    def engine():
        e = TableBatchedEmbedding(
            [(5, 4), (3, 4)],
            [0, 1],
            bounds_check=mode,
            impl="kernels",
            optimizer=OptimizerSpec(Optim.EXACT_SGD, learning_rate=0.1),
            pooling=Pooling.SUM,
        )
        e.init_uniform(-1, 1, seed=3)
        return e

    e, plain = engine(), engine()
    e.defer_checks = True
    offsets = np.array([0, 2, 3, 4, 6])  # 2 features x 2 samples, feature-major
    bad = np.array([1, 9, 4, 2, 7, 0])  # 9 (feature 0, sample 0), 7 (feature 1, sample 1)
    launch.reset_counts()
    out, _ = e.forward(bad, offsets)
    out2, _ = e.forward(np.array([1, 4, 4, 2, 0, 8]), offsets)
    assert launch.reset_counts()["host_reads"] == 0
    fill = -1 if mode == BoundsCheck.FATAL else 0
    want, _ = plain.forward(np.where(bad == 9, fill, np.where(bad == 7, fill, bad)), offsets)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    if mode == BoundsCheck.FATAL:
        with pytest.raises(
            EmbeddingBoundsError,
            match=r"index 9 at position 1 \(feature 0, sample 0\) is outside "
            r"its table of 5 rows \(2 more in this batch\)",
        ):
            e.check_deferred()
    else:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            e.check_deferred()
        assert len(w) == 1 and "index 9 at position 1" in str(w[0].message)
        assert e.bounds_warnings == 3
    e.check_deferred()  # cleared: nothing more


def test_engine_deferred_uint64_indices_read_nothing(on_device):
    """uint64 indices of unkeyed tables (a one-hot SparseEmbedding fed 32-bit keys, which readers widen to
    uint64): with a deferred check the step converts them on the device, no host read; one above 2**63 - 1
    is recorded as out of range and raised at the check point, never wrapped to a negative row or to -1."""
    on_device("sim")
    e = TableBatchedEmbedding(
        [(5, 4), (3, 4)],
        [0, 1],
        bounds_check=BoundsCheck.FATAL,
        impl="kernels",
        optimizer=OptimizerSpec(Optim.EXACT_SGD, learning_rate=0.1),
        pooling=Pooling.SUM,
    )
    e.init_uniform(-1, 1, seed=3)
    e.defer_checks = True
    offsets = np.array([0, 2, 3, 4, 6])
    good = np.array([1, 3, 4, 2, 0, 2])
    want, _ = e.forward(good.astype(np.int64), offsets)
    seen = []
    real = device.to_host
    try:  # every host read of the step would pass here on sim
        device.to_host = lambda a: seen.append(a) or real(a)
        launch.reset_counts()
        got, _ = e.forward(good.astype(np.uint64), offsets)
        huge = good.astype(np.uint64)
        huge[4] = np.uint64(2**64 - 1)  # would view as -1: "missing", silently
        e.forward(huge, offsets)
        assert launch.reset_counts()["host_reads"] == 0 and not seen
    finally:
        device.to_host = real
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(
        EmbeddingBoundsError,
        match=r"index 9223372036854775807 at position 4 \(feature 1, "
        r"sample 1\) is outside its table of 3 rows",
    ):
        e.check_deferred()
    e.defer_checks = False  # eager: the host check names the cause
    with pytest.raises(ValueError, match="must fit int64"):
        e.forward(huge, offsets)


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_deferred_bounds_record_matches_the_reference(data):
    """record_bounds_kernel against check_indices_ref over two random batches: the count of bad indices summed
    over both and the first offender (the first bad batch's) make the FATAL message."""
    device.set_device("sim")  # (conftest's autouse fixture switches back)
    tables, fmap, batch = [(5, 4), (3, 4)], [0, 1], 2
    limits = np.array([5, 3])
    e = TableBatchedEmbedding(tables, fmap, bounds_check=BoundsCheck.FATAL, impl="kernels")
    e.defer_checks = True
    first, total = None, 0
    for _ in range(2):
        lens = data.draw(st.lists(st.integers(0, 3), min_size=4, max_size=4))
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        idx = np.array(
            data.draw(st.lists(st.integers(-1, 7), min_size=int(offsets[-1]), max_size=int(offsets[-1]))), np.int64
        )
        _, bad, at = K.check_indices_ref(idx, offsets, limits, batch, int(Layout.FEATURE_MAJOR), BoundsCheck.NONE)
        total += bad
        first = first or at
        e.forward(idx, offsets)
    if first is None:
        e.check_deferred()
        return
    with pytest.raises(EmbeddingBoundsError) as info:
        e.check_deferred()
    assert str(info.value).startswith(K.bounds_message(first, total, BoundsCheck.FATAL)), (str(info.value), first)
