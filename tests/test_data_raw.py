"""The Raw format (spec §2.4): byte layout, HugeCTR's log(x+1) for int dense, key widths, batches of
consecutive samples with a partial last one, num_samples, errors, and random byte damage."""

import contextlib
import os
import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from numbactr.data import DataFormatError
from numbactr.data.errors import DataWarning
from numbactr.data.raw import RawFile, RawFormatError, raw_stride, write_raw_file
from numbactr.data.reader import DataReader
from numbactr.enums import DataReaderType_t as T


def reader(path, n, B, L=1, D=2, slots=(3,), fld=False, i64=False, repeat=False, W=1, **kw):
    return DataReader(
        T.Raw, path, B, L, D, list(slots), None, i64, repeat, num_workers=W, num_samples=n, float_label_dense=fld, **kw
    )


def test_byte_layout_int_and_float(tmp_path):
    p = str(tmp_path / "a.bin")
    write_raw_file(p, [[1], [0]], [[5, 0], [7, 9]], [[10, 11, 12], [-1, 2**31 - 1, 0]], float_label_dense=False)
    want = struct.pack("<6i", 1, 5, 0, 10, 11, 12) + struct.pack("<6i", 0, 7, 9, -1, 2**31 - 1, 0)
    assert open(p, "rb").read() == want
    q = str(tmp_path / "b.bin")
    write_raw_file(q, [[0.5]], [[1.25, -2.0]], [[3, 4, 5]], float_label_dense=True)
    assert open(q, "rb").read() == struct.pack("<3f3i", 0.5, 1.25, -2.0, 3, 4, 5)
    assert raw_stride(1, 2, 3) == 24
    with pytest.raises(ValueError, match="non-integer"):
        write_raw_file(q, [[0.5]], [[1.0, 2.0]], [[1, 2, 3]], float_label_dense=False)
    with pytest.raises(ValueError, match="32-bit"):
        write_raw_file(q, [[0]], [[1, 2]], [[1 << 33, 2, 3]])


def test_int_dense_gets_log1p_in_float32_and_keys_widen(tmp_path):
    p = str(tmp_path / "a.bin")
    dense = np.array([[0, 1], [1000, 2**31 - 2]])
    write_raw_file(p, [[1], [0]], dense, [[7, -2, 3], [0, 1, 2]])
    b = next(iter(reader(p, 2, 2)))
    np.testing.assert_array_equal(b.dense, np.log(dense.astype(np.float32) + np.float32(1)))
    assert b.dense.dtype == np.float32 and b.label.tolist() == [[1.0], [0.0]]
    keys = b.sparse[0][0]
    assert keys.dtype == np.uint64 and keys[1] == 2**32 - 2  # uint32 reinterpretation
    b = next(iter(reader(p, 2, 2, i64=True)))
    assert b.sparse[0][0].dtype == np.int64 and b.sparse[0][0][1] == -2  # sign extension
    f = str(tmp_path / "f.bin")
    write_raw_file(f, [[0.25]], [[-3.5, 2.0]], [[1, 2, 3]], float_label_dense=True)
    b = next(iter(reader(f, 1, 1, fld=True)))
    assert b.dense.tolist() == [[-3.5, 2.0]] and b.label.tolist() == [[0.25]]  # used as is


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 30),
    B=st.integers(1, 8),
    W=st.integers(1, 3),
    used=st.integers(0, 5),
    slots=st.sampled_from([(3,), (1, 2), (2, 0, 1)]),
)
def test_batches_are_consecutive_with_a_partial_last_one(tmp_path_factory, n, B, W, used, slots):
    d = tmp_path_factory.mktemp("raw")
    p = str(d / "r.bin")
    total = n + used  # the file may hold more than num_samples
    ids = np.arange(total)
    S = sum(slots)
    keys = ids[:, None] * 10 + np.arange(S)
    write_raw_file(p, ids.reshape(-1, 1), np.stack([ids, ids], 1), keys)
    with (
        pytest.warns(DataWarning, match=f"holds {total} samples but num_samples is {n}")
        if used
        else contextlib.nullcontext()
    ):
        got = list(reader(p, n, B, slots=slots, W=W))
    assert len(got) == -(-n // B)
    seen = []
    for b in got:
        seen += b.label[: b.size, 0].astype(int).tolist()
        assert b.batch_size == B and (b.label[b.size :] == 0).all()
        s0 = 0
        for i, Si in enumerate(slots):
            k, off = b.sparse[i]
            rows = np.array(b.label[: b.size, 0], dtype=np.int64)
            np.testing.assert_array_equal(k, (rows[:, None] * 10 + np.arange(s0, s0 + Si)).reshape(-1))
            assert off.tolist() == list(range(b.size * Si + 1)) + [b.size * Si] * ((B - b.size) * Si)
            s0 += Si
    assert seen == list(range(n))


def test_repeat_mode_emits_the_partial_batch_every_pass(tmp_path):
    p = str(tmp_path / "r.bin")
    write_raw_file(p, np.arange(5).reshape(-1, 1), np.zeros((5, 1), int), np.zeros((5, 1), int))
    r = reader(p, 5, 2, D=1, slots=(1,), repeat=True, W=2)
    it = iter(r)
    sizes = [next(it).size for _ in range(7)]
    r.close()
    assert sizes == [2, 2, 1, 2, 2, 1, 2]  # as HugeCTR's MmapOffsetList, unlike Norm


def test_rank_split(tmp_path):
    p = str(tmp_path / "r.bin")
    write_raw_file(p, np.arange(7).reshape(-1, 1), np.zeros((7, 1)), np.arange(7).reshape(-1, 1))
    parts = [list(reader(p, 7, 4, D=1, slots=(1,), rank=r, ranks=2)) for r in range(2)]
    assert [[b.label[: b.size, 0].tolist() for b in part] for part in parts] == [[[0, 1], [4, 5]], [[2, 3], [6]]]
    assert [b.size for b in parts[1]] == [2, 1] and parts[1][1].sparse[0][1].tolist() == [0, 1, 1]
    assert [b.global_size for b in parts[0]] == [b.global_size for b in parts[1]] == [4, 3]
    parts = [list(reader(p, 7, 8, D=1, slots=(1,), rank=r, ranks=4)) for r in range(4)]
    assert [(b.size, b.global_size) for part in parts for b in part] == [(2, 7), (2, 7), (2, 7), (1, 7)]
    with pytest.warns(DataWarning, match="the last 2 are never read"):
        parts = [list(reader(p, 5, 8, D=1, slots=(1,), rank=r, ranks=4)) for r in range(4)]
    assert [(b.size, b.global_size) for part in parts for b in part] == [(2, 5), (2, 5), (1, 5), (0, 5)]
    assert parts[3][0].sparse[0][1].tolist() == [0, 0, 0] and parts[3][0].sparse[0][0].size == 0


def test_errors(tmp_path):
    p = str(tmp_path / "r.bin")
    write_raw_file(p, np.zeros((4, 1), int), np.zeros((4, 2), int), np.zeros((4, 3), int))
    with pytest.raises(RawFormatError, match=r"num_samples is 5 but the file holds only 4 samples") as e:
        reader(p, 5, 2)
    assert e.value.offset == 96 and e.value.record == 4
    with pytest.raises(ValueError, match="num_samples"):
        reader(p, 0, 2)
    with pytest.raises(RawFormatError, match="not a whole number of 20-byte samples") as e:
        reader(p, 4, 2, slots=(2,))  # wrong dimensions: 24-byte samples on disk
    with open(p, "ab") as f:
        f.write(b"\x00\x01")  # a truncated record
    with pytest.raises(RawFormatError, match="truncated record") as e:
        reader(p, 4, 2)
    assert e.value.offset == 96
    with pytest.raises(RawFormatError, match="cannot be read"):
        reader(str(tmp_path / "none.bin"), 4, 2)


def test_dense_below_minus_one_is_an_error(tmp_path):
    p = str(tmp_path / "r.bin")
    write_raw_file(p, np.zeros((3, 1)), [[0, 0], [4, -1], [0, 0]], np.zeros((3, 3), int))
    with pytest.raises(DataFormatError, match=r"byte offset 32, record 1: non-finite dense\[1\] = -inf"):
        list(reader(p, 3, 2))


def test_key_bound(tmp_path):
    p = str(tmp_path / "r.bin")
    write_raw_file(p, np.zeros((3, 1)), np.zeros((3, 2)), [[0, 1, 2], [3, 4, 5], [6, 7, 99]])
    assert sum(b.size for b in reader(p, 3, 2, key_bound=100)) == 3
    with pytest.raises(DataFormatError, match=r"byte offset 68, record 2: key 99 of sparse input 0 slot 2"):
        list(reader(p, 3, 2, key_bound=99))
    with pytest.raises(DataFormatError, match="key 4294967295"):  # -1 as uint32
        write_raw_file(p, np.zeros((1, 1)), np.zeros((1, 2)), [[0, -1, 2]])
        list(reader(p, 1, 1, key_bound=10))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), nflips=st.integers(1, 6), fld=st.booleans(), cut=st.booleans())
def test_random_damage_never_crashes_and_batches_equal_the_bytes(tmp_path_factory, seed, nflips, fld, cut):
    """Raw has no checksum: damage inside a record changes that record's values. The reader must either
    raise DataFormatError or hand out exactly what the (damaged) bytes say, never anything else."""
    rng = np.random.default_rng(seed)
    d = tmp_path_factory.mktemp("rd")
    p = str(d / "r.bin")
    n = 9
    dense = rng.integers(0, 50, (n, 2)) if not fld else rng.random((n, 2)).astype(np.float32)
    write_raw_file(p, rng.integers(0, 2, (n, 1)), dense, rng.integers(0, 100, (n, 3)), fld)
    raw = bytearray(open(p, "rb").read())
    for pos in rng.integers(0, len(raw), nflips):
        raw[pos] = int(rng.integers(0, 256))
    if cut:
        raw = raw[: int(rng.integers(0, len(raw)))]
    open(p, "wb").write(bytes(raw))
    m = len(raw) // 24
    try:
        got = list(reader(p, n, 4, fld=fld, key_bound=100))
    except DataFormatError as e:
        assert e.path == p and repr(p) in str(e)
        return
    assert m == n and len(raw) == 24 * n  # truncation is always caught
    words = np.frombuffer(bytes(raw), "<i4").reshape(n, 6)
    lab = np.concatenate([b.label[: b.size] for b in got])
    den = np.concatenate([b.dense[: b.size] for b in got])
    keys = np.concatenate([b.sparse[0][0][: 3 * b.size] for b in got]).reshape(n, 3)
    if fld:
        np.testing.assert_array_equal(lab, words[:, :1].view("<f4"))
        np.testing.assert_array_equal(den, words[:, 1:3].view("<f4"))
    else:
        np.testing.assert_array_equal(lab, words[:, :1].astype(np.float32))
        np.testing.assert_array_equal(den, np.log(words[:, 1:3].astype(np.float32) + np.float32(1)))
    assert np.isfinite(den).all() and np.isfinite(lab).all()
    np.testing.assert_array_equal(keys, words[:, 3:].view("<u4"))
    assert keys.max() < 100


def test_rawfile_rows(tmp_path):
    p = str(tmp_path / "r.bin")
    write_raw_file(p, np.arange(3).reshape(-1, 1), np.zeros((3, 2)), np.arange(9).reshape(3, 3))
    rf = RawFile(p, 3, 1, 2, 3, False, True)
    label, dense, keys = rf.rows(1, 3)
    assert label[:, 0].tolist() == [1, 2] and keys.tolist() == [[3, 4, 5], [6, 7, 8]]
    assert rf.offset_of(2, 3) == 2 * 24 + 12
    rf.close()
    assert os.path.getsize(p) == 72
