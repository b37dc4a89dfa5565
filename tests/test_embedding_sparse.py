"""HugeCTR's SparseEmbedding on the engine: lookups, the fused update a step applies, what a step must not
change, slots and state moves for snapshots, the simulator's kernels against the cpu path, and sharded
(mpiexec -n 2, 3) == one rank bit for bit."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.runtime import device
from numbactr.autograd import Tape
from numbactr.embedding.factory import make_embedding
from numbactr.kernels.embedding_init import row_values_ref
from tests.mpi_util import MPIEXEC, needs_mpi

E, O, U = hugectr.Embedding_t, hugectr.Optimizer_t, hugectr.Update_t
S, D = 3, 4
# two samples x three slots, sample-major bags (b*S + s): [5, 5] [] [7] | [9] [5, 11, 7] [8]
KEYS = np.array([5, 5, 7, 9, 5, 11, 7, 8], np.int64)
OFFSETS = np.array([0, 2, 2, 3, 4, 7, 8], np.int64)


pytestmark = pytest.mark.usefixtures("cpu")  # conftest.py: the cpu device for every test


def embedding(etype=E.DistributedSlotSparseEmbeddingHash, combiner="sum", sizes=(), seed=3, **opt):
    opt.setdefault("optimizer_type", O.SGD)
    cfg = hugectr.SparseEmbedding(etype, 1, D, combiner, "e", "data", slot_size_array=list(sizes))
    return make_embedding(
        cfg, hugectr.DataReaderSparseParam("data", 3, False, S), hugectr.CreateOptimizer(**opt), seed=seed
    )


def train_step(emb, keys, offsets, dy, lr=0.1, scaler=1.0):
    """forward -> backward -> update, as Model.train runs them; returns the pooled output (B, S, D)."""
    tape = Tape()
    out = emb.forward(tape, keys, offsets, dy.shape[0], True)
    tape.backward({id(out): (out, dy)})
    emb.update(lr, scaler)
    return device.to_host(out.data)


def vectors(emb) -> dict:
    keys, vecs = emb.dump()
    return {int(k): v.copy() for k, v in zip(keys, vecs)}


def bags(keys, offsets):
    return [keys[offsets[j] : offsets[j + 1]] for j in range(len(offsets) - 1)]


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_lookup_pools_every_slot_and_evaluation_counts_missing_keys(combiner):
    emb = embedding(combiner=combiner)
    out = emb.forward(None, KEYS, OFFSETS, 2, True)  # training inserts (no tape: no update)
    assert emb.table.size == 5 and list(emb.dump()[0]) == [5, 7, 9, 11, 8]  # rows in first-seen order
    vec = vectors(emb)
    np.testing.assert_array_equal(vec[11], row_values_ref(np.array([11], np.uint64), D, 3, -0.05, 0.05)[0])

    def pooled(keys, offsets):
        rows = []
        for bag in bags(keys, offsets):
            total = sum((vec.get(int(k), np.zeros(D, np.float32)) for k in bag), np.zeros(D, np.float32))
            rows.append(total / max(len(bag), 1) if combiner == "mean" else total)
        return np.stack(rows).reshape(-1, S, D)

    np.testing.assert_allclose(out.data, pooled(KEYS, OFFSETS), rtol=1e-6, atol=1e-8)
    unseen = np.array([5, 40, 41, 7], np.int64)  # 40, 41 were never inserted
    ev = emb.forward(None, unseen, np.array([0, 2, 3, 3, 4, 4, 4]), 2, False)
    np.testing.assert_allclose(ev.data, pooled(unseen, np.array([0, 2, 3, 3, 4, 4, 4])), rtol=1e-6, atol=1e-8)
    assert emb.table.size == 5  # evaluation never inserts
    if combiner == "mean":  # [5, 40]: 40 adds 0 but counts
        np.testing.assert_allclose(ev.data[0, 0], vec[5] / 2, rtol=1e-6)


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_update_is_sgd_on_each_rows_summed_gradient(combiner):
    emb = embedding(combiner=combiner)
    emb.forward(None, KEYS, OFFSETS, 2, True)
    before = vectors(emb)
    dy = np.random.default_rng(0).normal(size=(2, S, D)).astype(np.float32)
    train_step(emb, KEYS, OFFSETS, dy, lr=0.5, scaler=4.0)
    grad = {k: np.zeros(D) for k in before}
    for j, bag in enumerate(bags(KEYS, OFFSETS)):
        for k in bag:
            grad[int(k)] += dy.reshape(-1, D)[j] / (len(bag) if combiner == "mean" else 1)
    after = vectors(emb)
    for k in before:  # HugeCTR's SGD: w -= lr * g / scaler
        np.testing.assert_allclose(after[k], before[k] - 0.5 * grad[k] / 4.0, rtol=1e-5, atol=1e-7)


def test_update_needs_this_steps_backward():
    """update() applies the gradient of the step's own backward only: none without one, and a training
    forward drops a gradient a stopped step left behind (Model.train stops before the update on a
    non-finite loss)."""
    emb = embedding()
    dy = np.ones((2, S, D), np.float32)
    tape = Tape()
    out = emb.forward(tape, KEYS, OFFSETS, 2, True)
    tape.backward({id(out): (out, dy)})  # ... and the step stops here
    before = vectors(emb)
    emb.forward(Tape(), KEYS, OFFSETS, 2, True)  # the next step, whose backward never runs
    emb.update(0.1, 1.0)
    emb.update(0.1, 1.0)
    for k, v in vectors(emb).items():
        np.testing.assert_array_equal(v, before[k])


@pytest.mark.parametrize("update", [U.Local, U.Global])
def test_frozen_keeps_the_weights_while_adams_states_move(update):
    emb = embedding(optimizer_type=O.Adam, update_type=update)
    dy = np.random.default_rng(1).normal(size=(2, S, D)).astype(np.float32)
    train_step(emb, KEYS, OFFSETS, dy)
    weights, states = vectors(emb), [s.copy() for s in emb.dump_states()]
    emb.frozen = True  # Model.freeze_embedding: HugeCTR's lr = 0
    train_step(emb, KEYS, OFFSETS, dy)
    for k, v in vectors(emb).items():
        np.testing.assert_array_equal(v, weights[k])
    for new, old in zip(emb.dump_states(), states):
        assert not np.array_equal(new[:5], old[:5])
    emb.frozen = False
    train_step(emb, KEYS, OFFSETS, dy)
    assert not np.array_equal(vectors(emb)[5], weights[5])


def test_global_moves_every_row_in_use_and_no_row_beyond():
    emb = embedding(optimizer_type=O.Adam, update_type=U.Global)
    dy = np.ones((2, S, D), np.float32)
    train_step(emb, KEYS, OFFSETS, dy)
    after_first = vectors(emb)
    train_step(emb, np.array([9], np.int64), np.array([0, 1, 1, 1, 1, 1, 1]), dy)  # only key 9 is hot
    for k, v in vectors(emb).items():
        assert not np.array_equal(v, after_first[k]), k  # cold rows drift on their moments
    np.testing.assert_array_equal(device.to_host(emb.weight.data)[emb.table.size :], 0)


def test_localized_records_the_slot_of_each_keys_first_occurrence():
    emb = embedding(E.LocalizedSlotSparseEmbeddingHash)
    emb.forward(None, KEYS, OFFSETS, 2, True)  # 5: slot 0, 7: slot 2, 9: 0, 11: 1, 8: 2
    np.testing.assert_array_equal(emb.dump_slots(), [0, 2, 0, 1, 2])
    emb.forward(None, np.array([5, 30], np.int64), np.array([0, 0, 0, 2, 2, 2, 2]), 2, True)
    np.testing.assert_array_equal(emb.dump_slots(), [0, 2, 0, 1, 2, 2])  # 5 keeps slot 0; 30 is new in slot 2
    assert embedding().dump_slots() is None  # a Distributed table records none


def test_a_load_moves_the_optimizer_states_with_their_keys():
    emb = embedding(optimizer_type=O.Adam, update_type=U.LazyGlobal)
    rng = np.random.default_rng(2)
    train_step(emb, KEYS, OFFSETS, rng.normal(size=(2, S, D)).astype(np.float32))
    train_step(
        emb,
        np.array([5, 9], np.int64),
        np.array([0, 1, 1, 1, 2, 2, 2]),  # 5, 9: previous step 2
        rng.normal(size=(2, S, D)).astype(np.float32),
    )
    keys, vecs = emb.dump()
    m, v = (s[: keys.size].copy() for s in emb.dump_states())
    prev = device.to_host(emb.engine.split_optimizer_states()[0][2])[: keys.size].copy()
    new_keys = np.concatenate([keys[::-1], [77]]).astype(np.uint64)  # reversed, plus a key new here
    emb.load(new_keys, np.concatenate([vecs[::-1], np.ones((1, D), np.float32)]))
    got_keys, got_vecs = emb.dump()
    np.testing.assert_array_equal(got_keys, new_keys)
    np.testing.assert_array_equal(got_vecs[:-1], vecs[::-1])
    m2, v2 = emb.dump_states()
    prev2 = device.to_host(emb.engine.split_optimizer_states()[0][2])
    np.testing.assert_array_equal(m2[: keys.size], m[::-1])
    np.testing.assert_array_equal(v2[: keys.size], v[::-1])
    np.testing.assert_array_equal(prev2[: keys.size], prev[::-1])
    assert (m2[keys.size :] == 0).all() and (v2[keys.size :] == 0).all() and (prev2[keys.size :] == 1).all()


def test_one_hot_takes_per_slot_keys_and_bad_keys_are_named():
    """HugeCTR's one-hot embedding adds the slot offsets itself (do_unique_key_flag, spec §5.4): per-slot key
    k of slot s reads row k + Σ_{j<s} size_j; a key outside [0, size_s) would read another slot's row and is
    refused, naming the key, slot and sample."""
    sizes = (4, 5, 6)
    emb = embedding(E.LocalizedSlotSparseEmbeddingOneHot, sizes=sizes)
    w = device.to_host(emb.weight.data)
    assert emb.table is None and w.shape == (15, D)
    bound = np.repeat(np.sqrt(1.0 / np.array(sizes)), sizes)[:, None]  # U(+-sqrt(1/size_s))
    unit = row_values_ref(np.arange(15, dtype=np.uint64), D, 3, -1.0, 1.0)  # U(-1, 1) from (seed, row)
    assert (np.abs(w) <= bound).all()
    np.testing.assert_allclose(w, unit * bound, rtol=1e-6)
    keys = np.array([1, 0, 0, 3, 2, 5], np.int64)  # (2 samples, 3 slots), per-slot ids
    rows = np.array([1, 4, 9, 3, 6, 14])  # + offsets (0, 4, 9)
    out = emb.forward(None, keys, np.arange(7), 2, True)
    np.testing.assert_array_equal(out.data.reshape(-1, D), w[rows])
    # multi-key bags: each key takes its bag's slot (bag b is slot b % 3)
    out = emb.forward(None, np.array([1, 3, 0, 5, 2]), np.array([0, 2, 3, 4, 4, 4, 5]), 2, False)
    got = device.to_host(out.data).reshape(2, 3, D)
    np.testing.assert_allclose(got[0], np.stack([w[1] + w[3], w[4], w[14]]), rtol=1e-6)
    np.testing.assert_array_equal(got[1], np.stack([np.zeros(D), np.zeros(D), w[11]]))
    with pytest.raises(
        ValueError, match=r"key 6 of slot 2 \(sample 0, position 2 of this batch\) is outside the slot's"
    ):
        emb.forward(None, np.array([1, 0, 6, 3, 2, 5]), np.arange(7), 2, True)
    with pytest.raises(
        ValueError, match=r"key 4 of slot 0 \(sample 1, position 3 of this batch\) is outside .*\[0, 4\)"
    ):
        emb.forward(None, np.array([1, 0, 0, 4, 2, 5]), np.arange(7), 2, True)  # would be slot 1's row 4


def test_one_hot_device_keys_of_a_deferred_step_are_offset_on_the_device(monkeypatch):
    """A GPU step's keys are not read on the host: table_rows offsets them on the device (the slots from the
    bag_of_key kernel) and turns a key outside its slot into row -1, which the engine's deferred FATAL bounds
    check records. Run on the simulator with the keys treated as device arrays without a host mirror."""
    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    device.set_device("sim")
    emb = embedding(E.LocalizedSlotSparseEmbeddingOneHot, sizes=(4, 5, 6))
    assert emb._deferred()
    monkeypatch.setattr(device, "is_host_array", lambda a: False)
    monkeypatch.setattr(device, "host_mirror", lambda a: None)
    offsets = np.array([0, 2, 3, 4, 4, 4, 5])  # sample 0: slot 0 two keys; sample 1: slot 2 one key
    rows = emb.table_rows(np.array([1, 3, 0, 5, 2]), offsets)
    np.testing.assert_array_equal(rows, [1, 3, 4, 14, 11])
    rows = emb.table_rows(np.array([1, 4, 0, 6, -1]), offsets)  # 4 in slot 0, 6 and -1 in slot 2: outside
    np.testing.assert_array_equal(rows, [1, -1, 4, -1, -1])


@pytest.mark.parametrize("etype", [E.DistributedSlotSparseEmbeddingHash, E.LocalizedSlotSparseEmbeddingHash])
def test_simulator_kernels_equal_the_cpu_path(etype):
    """The engine's numba.cuda kernels (sim) and its compiled cpu code give one SparseEmbedding step alike (on
    sim with the deferred checks of a GPU step: rows, initial values and a Localized table's key slots are
    made on the device)."""
    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    dy = np.random.default_rng(3).normal(size=(2, S, D)).astype(np.float32)
    got = {}
    for kind in ("cpu", "sim"):
        device.set_device(kind)
        emb = embedding(etype, combiner="mean", optimizer_type=O.Adam, update_type=U.Global)
        assert emb.engine.defer_checks == (kind == "sim")
        outs = [train_step(emb, KEYS, OFFSETS, dy) for _ in range(2)]
        ev = device.to_host(emb.forward(None, np.array([5, 40, 7, 9]), np.array([0, 2, 2, 3, 3, 4, 4]), 2, False).data)
        slots = emb.dump_slots()
        got[kind] = outs + [ev, *emb.dump(), *emb.dump_states()] + ([] if slots is None else [slots])
    assert len(got["sim"]) == len(got["cpu"])
    for a, b in zip(got["sim"], got["cpu"]):
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=1e-5, atol=1e-7)


# ---- sharded == one rank, bit for bit ------------------------------------------------------------------
HERE = pathlib.Path(__file__).parent


@pytest.mark.mpi
@needs_mpi
def test_sharded_equals_one_rank_bit_for_bit(tmp_path):
    """Distributed (mean, Adam Global; sum, Adam LazyGlobal), Localized (mean, MomentumSGD Global) and
    OneHot (sum, Nesterov) on 1, 2 and 3 ranks: every step's pooled output, the evaluation output with
    unseen keys, and every key's vector, states and slot are identical (tests/mpi/embedding_sharded_run.py)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBACTR_DEVICE"] = "cpu"
    results = {}
    for ranks in (1, 2, 3):
        out = tmp_path / f"r{ranks}.npz"
        r = subprocess.run(
            [MPIEXEC, "-n", str(ranks), sys.executable, str(HERE / "mpi" / "embedding_sharded_run.py"), str(out)],
            capture_output=True,
            text=True,
            env=env,
            timeout=240,
            stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 0, f"mpiexec -n {ranks} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        results[ranks] = dict(np.load(out))
    one = results[1]
    assert {k.split(":")[0] for k in one} == {
        "dist_adam_global_mean",
        "dist_adam_lazy_sum",
        "local_momentum_global_mean",
        "onehot_nesterov_sum",
    }
    assert one["local_momentum_global_mean:slots"].size == one["local_momentum_global_mean:keys"].size > 0
    for ranks in (2, 3):
        assert results[ranks].keys() == one.keys()
        for name, want in one.items():
            np.testing.assert_array_equal(results[ranks][name], want, err_msg=f"{ranks} ranks: {name}")
