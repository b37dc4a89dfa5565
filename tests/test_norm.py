"""Norm format (spec §2.3, §10.10): byte-exact writer, reader round trips, corrupt-file errors, file
lists, throughput."""

import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from numbactr.data.batch import Batch
from numbactr.data.file_list import read_file_list, write_file_list
from numbactr.data.norm import (
    NormFormatError,
    NormReader,
    NormWriter,
    decode_norm_file,
    encode_header,
    encode_samples,
    read_norm_file,
    read_norm_header,
    write_norm_file,
)
from numbactr.enums import Check_t

SUM, NON = Check_t.Sum, Check_t.Non


# ---------------------------------------------------------------------------------------------------
# helpers


def ref_record(payload: bytes, check) -> bytes:
    """HugeCTR's DataWriter framing, written independently with struct."""
    if check is NON:
        return payload
    chk = 0
    for b in payload:  # signed char accumulation with wraparound
        chk = (chk + (b - 256 if b > 127 else b) + 128) % 256 - 128
    return struct.pack("<i", len(payload)) + payload + struct.pack("<b", chk)


def ref_file(check, label, dense, slots, i64, S=None) -> bytes:
    """slots[i][k] = list of keys of sample i, slot k."""
    n = len(label)
    S = len(slots[0]) if S is None else S
    out = ref_record(struct.pack("<8q", 1 if check is SUM else 0, n, len(label[0]), len(dense[0]), S, 0, 0, 0), check)
    kf = "<q" if i64 else "<I"
    for i in range(n):
        p = struct.pack(f"<{len(label[i])}f", *label[i]) + struct.pack(f"<{len(dense[i])}f", *dense[i])
        for keys in slots[i]:
            p += struct.pack("<i", len(keys)) + b"".join(struct.pack(kf, k) for k in keys)
        out += ref_record(p, check)
    return out


def make_data(rng, n, L, D, S, nnz_mode, i64, max_nnz=3):
    label = rng.standard_normal((n, L)).astype(np.float32)
    dense = rng.standard_normal((n, D)).astype(np.float32)
    if nnz_mode == "fixed":
        nnz = np.broadcast_to(rng.integers(0, max_nnz + 1, S), (n, S)).copy()
    else:
        nnz = rng.integers(0, max_nnz + 1, (n, S))
    hi = (1 << 62) if i64 else (1 << 32)
    lo = -(1 << 62) if i64 else 0
    keys = rng.integers(lo, hi, int(nnz.sum()), dtype=np.int64)
    return label, dense, nnz, keys


def write_csr_file(path, label, dense, nnz, keys, check, kd):
    n, S = nnz.shape
    off = np.concatenate([[0], np.cumsum(nnz.reshape(-1))])
    with NormWriter(path, label.shape[1], dense.shape[1], S, check, kd) as w:
        w.write_csr(label, dense, keys, off)


def nested_slots(nnz, keys):
    off = np.concatenate([[0], np.cumsum(nnz.reshape(-1))])
    n, S = nnz.shape
    return [[[int(k) for k in keys[off[i * S + s] : off[i * S + s + 1]]] for s in range(S)] for i in range(n)]


def assert_message(err, path):
    msg = str(err)
    assert repr(str(path)) in msg and "byte offset" in msg, msg


# ---------------------------------------------------------------------------------------------------
# byte-exact writer


@pytest.mark.parametrize("check", [SUM, NON])
@pytest.mark.parametrize("i64", [False, True])
def test_writer_byte_exact_tiny(tmp_path, check, i64):
    label = [[1.0], [0.0], [0.5]]
    dense = [[0.25, -3.0], [7.0, 0.0], [1e-3, 2.5]]
    slots = [[[5], [], [9, 10]], [[0], [4294967295 if not i64 else -7], [1]], [[3], [2], []]]
    path = tmp_path / "tiny.data"
    with NormWriter(path, 1, 2, 3, check, np.int64 if i64 else np.uint32) as w:
        w.write(label[:1], dense[:1], [([5], [1]), ([], [0]), ([9, 10], [2])])
        w.write(label[1:], dense[1:], [([0, 3], [1, 1]), ([4294967295 if not i64 else -7, 2], [1, 1]), ([1], [1, 0])])
    assert path.read_bytes() == ref_file(check, label, dense, slots, i64)


def test_header_record_exact():
    h = struct.pack("<8q", 1, 40960, 1, 13, 26, 0, 0, 0)
    assert encode_header(40960, 1, 13, 26, SUM) == struct.pack("<i", 64) + h + bytes([sum(h) % 256])
    assert encode_header(40960, 1, 13, 26, SUM)[:4] == b"\x40\0\0\0"  # tests skip 4+64+1 bytes
    assert len(encode_header(5, 1, 13, 26, SUM)) == 69
    assert encode_header(5, 1, 2, 3, NON) == struct.pack("<8q", 0, 5, 1, 2, 3, 0, 0, 0)


def test_checksum_wraps_as_signed_char():
    # payload bytes summing to > 255 and containing bytes > 127: checksum is the low byte of the sum
    label = np.array([[np.frombuffer(b"\xff\xff\x7f\x7f", "<f4")[0]]], np.float32)
    buf = encode_samples(
        label, np.zeros((1, 0), np.float32), np.array([[1]]), np.array([0xFFFFFFFF]), SUM, np.uint32
    ).tobytes()
    payload = buf[4:-1]
    assert struct.unpack("<i", buf[:4])[0] == len(payload) == 12
    assert buf[-1] == sum(payload) % 256 == (255 * 2 + 127 * 2 + 1 + 255 * 4) % 256


@given(
    seed=st.integers(0, 2**31),
    n=st.integers(1, 6),
    L=st.integers(1, 3),
    D=st.integers(0, 4),
    S=st.integers(0, 4),
    fixed=st.booleans(),
    i64=st.booleans(),
    s=st.booleans(),
)
def test_encode_matches_struct_reference(seed, n, L, D, S, fixed, i64, s):
    rng = np.random.default_rng(seed)
    label, dense, nnz, keys = make_data(rng, n, L, D, S, "fixed" if fixed else "var", i64)
    check = SUM if s else NON
    kd = np.int64 if i64 else np.uint32
    got = encode_header(n, L, D, S, check) + encode_samples(label, dense, nnz, keys, check, kd).tobytes()
    want = ref_file(check, label.tolist(), dense.tolist(), nested_slots(nnz, keys), i64, S)
    assert got == want


# ---------------------------------------------------------------------------------------------------
# round trips


def read_all(reader):
    """Concatenate the valid rows of every batch (non-repeat reader)."""
    rows = []
    for b in reader:
        assert b.label.shape[0] == reader.batch_size and b.size <= reader.batch_size
        rows.append(b)
    return rows


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    nfiles=st.integers(1, 3),
    sizes=st.lists(st.integers(0, 9), min_size=3, max_size=3),
    L=st.integers(1, 2),
    D=st.integers(0, 3),
    slots=st.lists(st.integers(0, 3), min_size=1, max_size=3),
    fixed=st.booleans(),
    i64=st.booleans(),
    s=st.booleans(),
    batch=st.integers(1, 7),
)
def test_round_trip_reader(tmp_path_factory, seed, nfiles, sizes, L, D, slots, fixed, i64, s, batch):
    tmp = tmp_path_factory.mktemp("rt")
    rng = np.random.default_rng(seed)
    S = sum(slots)
    check = SUM if s else NON
    kd = np.int64 if i64 else np.uint32
    paths, data = [], []
    for f in range(nfiles):
        d = make_data(rng, sizes[f], L, D, S, "fixed" if fixed else "var", i64)
        p = str(tmp / f"f{f}.data")
        write_csr_file(p, *d, check, kd)
        paths.append(p)
        data.append(d)
    lst = str(tmp / "list.txt")
    write_file_list(lst, paths)
    label = np.concatenate([d[0] for d in data])
    dense = np.concatenate([d[1] for d in data])
    nnz = np.concatenate([d[2] for d in data])
    keys = np.concatenate([d[3] for d in data])
    total = label.shape[0]
    bag_off = np.concatenate([[0], np.cumsum(nnz.reshape(-1))])
    out_dtype = np.int64 if i64 else np.uint64

    def expect_batch(b, rows):  # rows: global sample indices of the batch
        assert b.size == len(rows)
        np.testing.assert_array_equal(b.label[: b.size], label[rows])
        np.testing.assert_array_equal(b.dense[: b.size], dense[rows])
        assert not b.label[b.size :].any() and not b.dense[b.size :].any()
        s0 = 0
        for i, si in enumerate(slots):
            k, off = b.sparse[i]
            assert k.dtype == out_dtype and off.dtype == np.int64
            assert off.shape == (batch * si + 1,) and off[0] == 0 and off[-1] == len(k)
            want = [keys[bag_off[r * S + s0 + j] : bag_off[r * S + s0 + j + 1]] for r in rows for j in range(si)]
            got = [k[off[j] : off[j + 1]] for j in range(len(rows) * si)]
            assert len(want) == len(got)
            for w_, g_ in zip(want, got):
                np.testing.assert_array_equal(g_.astype(np.int64), w_)
            assert (np.diff(off[len(rows) * si :]) == 0).all()  # padding bags are empty
            s0 += si

    batches = read_all(NormReader(lst, batch, L, D, slots, check, kd, repeat=False))
    assert len(batches) == -(-total // batch)
    for j, b in enumerate(batches):
        expect_batch(b, list(range(j * batch, min(total, (j + 1) * batch))))

    if total:  # repeat: wraps around the list forever, every batch full
        it = iter(NormReader(lst, batch, L, D, slots, check, kd, repeat=True))
        for j in range(3):
            expect_batch(next(it), [(j * batch + r) % total for r in range(batch)])


def test_round_trip_writer_slot_forms(tmp_path):
    # (n,) one-hot, (n, k) multi-hot and ragged (keys, lengths) slots in one file
    p = tmp_path / "a.data"
    one = np.array([1, 2, 3])
    multi = np.array([[4, 5], [6, 7], [8, 9]])
    ragged = (np.array([10, 11, 12]), np.array([0, 3, 0]))
    with NormWriter(p, 1, 1, 3, SUM, np.uint32) as w:
        w.write(np.zeros(3), np.ones((3, 1)), [one, multi, ragged])
    b = read_norm_file(p, 1, 1, [3])
    assert b.size == 3 and b.batch_size == 3
    assert b.nnz(0).tolist() == [[1, 2, 0], [1, 2, 3], [1, 2, 0]]
    assert b.bag_keys(0, 1, 2).tolist() == [10, 11, 12]
    assert b.sparse[0][0].tolist() == [1, 4, 5, 2, 6, 7, 10, 11, 12, 3, 8, 9]
    assert b.num_slots(0) == 3


def test_writer_rejects_bad_input(tmp_path):
    with NormWriter(tmp_path / "a.data", 1, 2, 2, SUM, np.uint32) as w:
        with pytest.raises(ValueError, match="shape"):
            w.write(np.zeros((2, 1)), np.zeros((2, 3)), [np.zeros(2, int)] * 2)
        with pytest.raises(ValueError, match="fit"):
            w.write(np.zeros((2, 1)), np.zeros((2, 2)), [np.array([1, 1 << 33])] * 2)
        with pytest.raises(ValueError, match="fit"):
            w.write(np.zeros((2, 1)), np.zeros((2, 2)), [np.array([-1, 1])] * 2)
        with pytest.raises(ValueError, match="slots"):
            w.write(np.zeros((2, 1)), np.zeros((2, 2)), [np.zeros(2, int)])
    with pytest.raises(TypeError):
        NormWriter(tmp_path / "b.data", 1, 2, 2, SUM, np.float32)
    with pytest.raises(TypeError):
        NormWriter(tmp_path / "b.data", 1, 2, 2, "Sum")


def test_header_count_patched_at_close(tmp_path):
    p = tmp_path / "a.data"
    w = NormWriter(p, 1, 0, 1, SUM)
    for i in range(4):
        w.write(np.zeros((i, 1)), None, [np.arange(i)])
    w.close()
    w.close()  # idempotent
    assert read_norm_header(p, SUM).number_of_records == 6
    assert decode_norm_file(p, 1, 0, 1, SUM).keys.tolist() == [0, 0, 1, 0, 1, 2]


def test_partial_batch_padding_and_restart(tmp_path):
    p = str(tmp_path / "a.data")
    write_norm_file(p, np.arange(5.0), np.ones((5, 2)), np.arange(10).reshape(5, 2) + 1)
    lst = str(tmp_path / "l.txt")
    write_file_list(lst, [p, p])
    r = NormReader(lst, 4, 1, 2, [1, 1], repeat=False)
    bs = list(r)
    assert [b.size for b in bs] == [4, 4, 2]
    last = bs[-1]
    assert last.label[:, 0].tolist() == [3.0, 4.0, 0.0, 0.0]
    assert last.dense[2:].sum() == 0
    assert last.sparse[0][1].tolist() == [0, 1, 2, 2, 2] and last.sparse[0][0].tolist() == [7, 9]
    assert last.sparse[1][0].tolist() == [8, 10]
    # batch spanning two files
    assert bs[1].label[:, 0].tolist() == [4.0, 0.0, 1.0, 2.0]
    # a fresh iteration starts again from the first file
    assert next(iter(r)).label[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert r.num_records() == 10


def test_repeat_with_only_empty_files_raises(tmp_path):
    p = str(tmp_path / "e.data")
    with NormWriter(p, 1, 1, 1):
        pass
    lst = str(tmp_path / "l.txt")
    write_file_list(lst, [p])
    assert list(NormReader(lst, 4, 1, 1, [1], repeat=False)) == []
    with pytest.raises(ValueError, match="no samples"):
        next(iter(NormReader(lst, 4, 1, 1, [1], repeat=True)))


# ---------------------------------------------------------------------------------------------------
# corrupt files: always NormFormatError naming the file and a byte offset


def _small_file(tmp_path, check, fixed, i64=False, n=5, seed=0):
    rng = np.random.default_rng(seed)
    d = make_data(rng, n, 1, 2, 3, "fixed" if fixed else "var", i64, max_nnz=2)
    if fixed:
        d[2][:] = [1, 2, 1]
        d = (d[0], d[1], d[2], rng.integers(0, 1000, int(d[2].sum())))
    p = tmp_path / f"src_{check.name}_{fixed}.data"
    write_csr_file(p, *d, check, np.int64 if i64 else np.uint32)
    return p, d


@pytest.mark.parametrize("check", [SUM, NON])
@pytest.mark.parametrize("fixed", [True, False])
def test_truncation_at_every_byte_is_an_error(tmp_path, check, fixed):
    src, _ = _small_file(tmp_path, check, fixed)
    raw = src.read_bytes()
    bad = tmp_path / "trunc.data"
    for cut in range(len(raw)):
        bad.write_bytes(raw[:cut])
        with pytest.raises(NormFormatError) as e:
            decode_norm_file(bad, 1, 2, 3, check)
        assert_message(e.value, bad)
        assert 0 <= e.value.offset <= cut
    decode_norm_file(src, 1, 2, 3, check)  # the full file is fine


@pytest.mark.parametrize("fixed", [True, False])
def test_every_single_byte_corruption_is_detected_with_checksum(tmp_path, fixed):
    src, _ = _small_file(tmp_path, SUM, fixed)
    raw = bytearray(src.read_bytes())
    bad = tmp_path / "flip.data"
    rng = np.random.default_rng(1)
    for pos in range(len(raw)):
        b = bytearray(raw)
        b[pos] ^= int(rng.integers(1, 256))
        bad.write_bytes(bytes(b))
        with pytest.raises(NormFormatError) as e:
            decode_norm_file(bad, 1, 2, 3, SUM)
        assert_message(e.value, bad)


@pytest.mark.parametrize("fixed", [True, False])
def test_bad_checksum_skip_option(tmp_path, fixed):
    src, (label, dense, nnz, keys) = _small_file(tmp_path, SUM, fixed)
    raw = bytearray(src.read_bytes())
    # record 2 starts after the header record and two sample records
    rec_len = [4 * 3 + 4 * 3 + 4 * int(nnz[i].sum()) + 5 for i in range(5)]
    start2 = 69 + rec_len[0] + rec_len[1]
    raw[start2 + 4] ^= 0x01  # first payload byte of record 2
    bad = tmp_path / "bad.data"
    bad.write_bytes(bytes(raw))
    with pytest.raises(NormFormatError, match="checksum") as e:
        decode_norm_file(bad, 1, 2, 3, SUM)
    assert e.value.offset == start2 and e.value.record == 2
    lst = str(tmp_path / "l.txt")
    write_file_list(lst, [str(bad)])
    r = NormReader(lst, 3, 1, 2, [3], SUM, skip_bad_checksum=True, repeat=False)
    with pytest.warns(RuntimeWarning, match="skipped 1"):
        bs = list(r)
    assert r.skipped == 1
    assert [b.size for b in bs] == [3, 1]
    got = np.concatenate([b.label[: b.size] for b in bs])
    np.testing.assert_array_equal(got, label[[0, 1, 3, 4]])
    keep = [0, 1, 3, 4]
    off = np.concatenate([[0], np.cumsum(nnz.reshape(-1))])
    want_keys = np.concatenate([keys[off[i * 3] : off[i * 3 + 3]] for i in keep])
    got_keys = np.concatenate([b.sparse[0][0] for b in bs])
    np.testing.assert_array_equal(got_keys.astype(np.int64), want_keys)


def _patch_header(raw: bytes, check, **fields) -> bytes:
    base = 4 if check is SUM else 0
    h = list(struct.unpack("<8q", raw[base : base + 64]))
    names = ["error_check", "number_of_records", "label_dim", "dense_dim", "slot_num"]
    for k, v in fields.items():
        h[names.index(k)] = v
    hb = struct.pack("<8q", *h)
    if check is SUM:
        return struct.pack("<i", 64) + hb + bytes([sum(hb) % 256]) + raw[69:]
    return hb + raw[64:]


@pytest.mark.parametrize("check", [SUM, NON])
@pytest.mark.parametrize(
    "field,value,pattern,offset",
    [
        ("number_of_records", 4, "trailing bytes", None),
        ("number_of_records", 6, "ends after 5 records", None),
        ("number_of_records", -1, "negative number_of_records", 8),
        ("label_dim", 2, "label_dim=2", 16),
        ("dense_dim", 1, "dense_dim=1", 24),
        ("slot_num", 4, "slot_num=4", 32),
    ],
)
def test_header_mismatch_errors(tmp_path, check, field, value, pattern, offset):
    for fixed in (True, False):
        src, _ = _small_file(tmp_path, check, fixed)
        bad = tmp_path / "hdr.data"
        bad.write_bytes(_patch_header(src.read_bytes(), check, **{field: value}))
        with pytest.raises(NormFormatError, match=pattern) as e:
            decode_norm_file(bad, 1, 2, 3, check)
        assert_message(e.value, bad)
        if offset is not None:
            assert e.value.offset == offset + (4 if check is SUM else 0)


def test_check_type_mismatch(tmp_path):
    s, _ = _small_file(tmp_path, SUM, True)
    n, _ = _small_file(tmp_path, NON, True)
    with pytest.raises(NormFormatError, match="Check_t.Non") as e:
        decode_norm_file(s, 1, 2, 3, NON)
    assert_message(e.value, s)
    with pytest.raises(NormFormatError, match="error_check=0") as e:
        decode_norm_file(n, 1, 2, 3, SUM)
    assert_message(e.value, n)
    bad = tmp_path / "x.data"  # checksummed framing but the flag says 0
    bad.write_bytes(_patch_header(s.read_bytes(), SUM, error_check=0))
    with pytest.raises(NormFormatError, match="error_check=0"):
        decode_norm_file(bad, 1, 2, 3, SUM)
    bad.write_bytes(_patch_header(n.read_bytes(), NON, error_check=7))
    with pytest.raises(NormFormatError, match="error_check=7"):
        decode_norm_file(bad, 1, 2, 3, NON)


@pytest.mark.parametrize("value,pattern", [(-1, "negative nnz -1"), ((1 << 20) + 1, "absurd nnz"), (500, "nnz 500")])
def test_bad_nnz_non(tmp_path, value, pattern):
    src, _ = _small_file(tmp_path, NON, True)
    raw = bytearray(src.read_bytes())
    pos = 64 + 12  # record 0, slot 0's nnz
    raw[pos : pos + 4] = struct.pack("<i", value)
    bad = tmp_path / "nnz.data"
    bad.write_bytes(bytes(raw))
    with pytest.raises(NormFormatError, match=pattern) as e:
        decode_norm_file(bad, 1, 2, 3, NON)
    assert e.value.offset == pos and e.value.record == 0
    assert_message(e.value, bad)


def test_bad_nnz_with_valid_checksum(tmp_path):
    # a record whose checksum is right but whose nnz contradicts its length (writer bug, not bit rot)
    payload = (
        struct.pack("<3f", 1, 2, 3)
        + struct.pack("<i", 7)
        + struct.pack("<I", 5)
        + struct.pack("<i", 0)
        + struct.pack("<i", 0)
    )
    raw = encode_header(1, 1, 2, 3, SUM) + ref_record(payload, SUM)
    bad = tmp_path / "n.data"
    bad.write_bytes(raw)
    with pytest.raises(NormFormatError, match="nnz 7") as e:
        decode_norm_file(bad, 1, 2, 3, SUM)
    assert e.value.offset == 69 + 4 + 12
    payload2 = payload[:12] + struct.pack("<i", 1) + payload[16:] + b"\0\0\0\0"
    bad.write_bytes(encode_header(1, 1, 2, 3, SUM) + ref_record(payload2, SUM))
    with pytest.raises(NormFormatError, match="disagrees"):
        decode_norm_file(bad, 1, 2, 3, SUM)


def test_truncated_header_and_bad_header_checksum(tmp_path):
    src, _ = _small_file(tmp_path, SUM, True)
    raw = bytearray(src.read_bytes())
    bad = tmp_path / "h.data"
    bad.write_bytes(bytes(raw[:30]))
    with pytest.raises(NormFormatError, match="truncated header"):
        decode_norm_file(bad, 1, 2, 3, SUM)
    raw[68] ^= 0xFF
    bad.write_bytes(bytes(raw))
    with pytest.raises(NormFormatError, match="bad header checksum") as e:
        decode_norm_file(bad, 1, 2, 3, SUM)
    assert e.value.offset == 68
    with pytest.raises(NormFormatError, match="bad header checksum"):  # never skipped
        decode_norm_file(bad, 1, 2, 3, SUM, skip_bad_checksum=True)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    check=st.sampled_from([SUM, NON]),
    fixed=st.booleans(),
    i64=st.booleans(),
    nflips=st.integers(1, 4),
)
def test_random_corruption_never_crashes(tmp_path_factory, seed, check, fixed, i64, nflips):
    """Random byte damage: either a NormFormatError, or (Non only: no checksum to catch it) data whose
    shapes and CSR stay consistent. Never an IndexError/MemoryError/etc."""
    tmp = tmp_path_factory.mktemp("rc")
    src, _ = _small_file(tmp, check, fixed, i64, n=6, seed=seed % 1000)
    raw = bytearray(src.read_bytes())
    rng = np.random.default_rng(seed)
    for pos in rng.integers(0, len(raw), nflips):
        raw[pos] = int(rng.integers(0, 256))
    if rng.random() < 0.5:
        raw = raw[: int(rng.integers(0, len(raw) + 1))]
    bad = tmp / "bad.data"
    bad.write_bytes(bytes(raw))
    kd = np.int64 if i64 else np.uint32
    try:
        dec = decode_norm_file(bad, 1, 2, 3, check, kd)
    except NormFormatError as e:
        assert_message(e, bad)
        return
    if bytes(raw) != src.read_bytes():
        assert check is NON, "checksummed file with damage decoded without error"
    n = dec.label.shape[0]
    assert dec.dense.shape == (n, 2) and dec.nnz.shape == (n, 3) and dec.keys.shape == (dec.nnz.sum(),)


# ---------------------------------------------------------------------------------------------------
# file lists


def test_file_list_round_trip(tmp_path):
    files = []
    for i in range(3):
        f = tmp_path / f"d{i}.data"
        f.write_bytes(b"")
        files.append(str(f))
    lst = str(tmp_path / "sub" / "list.txt")
    write_file_list(lst, files)
    assert open(lst).read() == "3\n" + "".join(f + "\n" for f in files)
    assert read_file_list(lst) == files


@pytest.mark.parametrize(
    "text,pattern",
    [
        ("0\n", "line 1: file count must be > 0"),
        ("-2\n", "line 1: file count must be > 0"),
        ("abc\nx\n", "line 1: expected the file count"),
        ("", "line 1: empty"),
        ("2\n{f}\n", "line 3: header says 2 files but the list has 1"),
        ("1\n{f}\n{f}\n", "line 3: header says 1 files but the list has 2"),
        ("2\n{f}\n{f}.missing\n", "line 3: data file .* does not exist"),
    ],
)
def test_file_list_errors(tmp_path, text, pattern):
    f = tmp_path / "a.data"
    f.write_bytes(b"")
    lst = tmp_path / "list.txt"
    lst.write_text(text.format(f=f))
    with pytest.raises(ValueError, match=pattern) as e:
        read_file_list(str(lst))
    assert repr(str(lst)) in str(e.value)


def test_file_list_relative_paths_resolve_against_cwd(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.data").write_bytes(b"")
    lst = tmp_path / "d" / "list.txt"
    lst.write_text("1\nd/a.data\n")
    monkeypatch.chdir(tmp_path)
    assert read_file_list(str(lst)) == ["d/a.data"]
    monkeypatch.chdir(tmp_path / "d")
    with pytest.raises(ValueError, match="line 2"):
        read_file_list(str(lst))


def test_reader_missing_list_file(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        NormReader(str(tmp_path / "nope.txt"), 4, 1, 1, [1])


# ---------------------------------------------------------------------------------------------------
# a whole 13 dense + 26 one-hot file and a variable-nnz file decode correctly (speed is measured by
# `numbactr bench data`, not asserted here)


def test_reader_reads_every_sample_of_a_large_file(tmp_path):
    rng = np.random.default_rng(0)
    n = 100_000
    p = str(tmp_path / "c.data")
    write_norm_file(
        p,
        rng.integers(0, 2, (n, 1)),
        rng.random((n, 13), np.float32),
        rng.integers(0, 1 << 31, (n, 26)),
        SUM,
        np.uint32,
    )
    lst = str(tmp_path / "l.txt")
    write_file_list(lst, [p])
    r = NormReader(lst, 2048, 1, 13, [26], SUM, np.uint32, repeat=False)
    assert sum(b.size for b in r) == n


def test_variable_nnz_file_decodes(tmp_path):
    rng = np.random.default_rng(0)
    n = 20_000
    label, dense, nnz, keys = make_data(rng, n, 1, 13, 26, "var", False)
    for check in (SUM, NON):
        p = str(tmp_path / f"v{check.name}.data")
        write_csr_file(p, label, dense, nnz, keys, check, np.uint32)
        dec = decode_norm_file(p, 1, 13, 26, check)
        np.testing.assert_array_equal(dec.keys.astype(np.int64), keys)
        np.testing.assert_array_equal(dec.nnz, nnz)


def test_batch_dataclass():
    b = Batch(
        np.zeros((2, 1), np.float32),
        np.zeros((2, 3), np.float32),
        [(np.array([5, 6, 7], np.uint64), np.array([0, 1, 1, 3, 3]))],
    )
    assert b.size == 2 and b.batch_size == 2 and b.num_slots(0) == 2
    assert b.nnz(0).tolist() == [[1, 0], [2, 0]] and b.bag_keys(0, 1, 0).tolist() == [6, 7]


@pytest.mark.parametrize("check", [SUM, NON])
def test_same_record_length_different_layout(tmp_path, check):
    # every record has 4 keys in total, but split differently over the slots: the file length fits the
    # "all records like record 0" hypothesis, which must still be rejected in favour of the slow path
    nnz = np.array([[1, 2, 1], [2, 1, 1], [1, 1, 2], [0, 4, 0]])
    keys = np.arange(16)
    label, dense = np.zeros((4, 1), np.float32), np.ones((4, 2), np.float32)
    p = tmp_path / "a.data"
    write_csr_file(p, label, dense, nnz, keys, check, np.uint32)
    dec = decode_norm_file(p, 1, 2, 3, check)
    np.testing.assert_array_equal(dec.nnz, nnz)
    np.testing.assert_array_equal(dec.keys, keys)


# ---------------------------------------------------------------------------------------------------
# piecewise decoding of big files (iter_norm_chunks)


def _concat(pieces):
    return (
        np.concatenate([p.label for p in pieces]),
        np.concatenate([p.dense for p in pieces]),
        np.concatenate([p.nnz for p in pieces]),
        np.concatenate([p.keys for p in pieces]),
    )


@pytest.mark.parametrize("check", [SUM, NON])
@pytest.mark.parametrize("mode", ["fixed", "var", "fixed_then_var"])
def test_iter_norm_chunks_equals_whole_decode(tmp_path, check, mode):
    from numbactr.data.norm import iter_norm_chunks

    rng = np.random.default_rng(3)
    label, dense, nnz, keys = make_data(rng, 300, 1, 2, 4, "fixed" if mode != "var" else "var", True)
    if mode == "fixed_then_var":  # same record length, another layout late in the file
        nnz[250] = nnz[250][::-1]
        if (nnz[250] == nnz[0]).all():
            nnz[250, 0], nnz[250, 1] = nnz[250, 0] + 1, max(nnz[250, 1] - 1, 0)
    keys = keys[: int(nnz.sum())] if keys.size >= nnz.sum() else np.resize(keys, int(nnz.sum()))
    p = str(tmp_path / "a.data")
    write_csr_file(p, label, dense, nnz, keys, check, np.int64)
    whole = decode_norm_file(p, 1, 2, 4, check, np.int64)
    pieces = list(iter_norm_chunks(p, 1, 2, 4, check, np.int64, rows=64, whole_below=0))
    if mode == "fixed":
        assert [x.label.shape[0] for x in pieces] == [64, 64, 64, 64, 44]
    got = _concat(pieces)
    for a, b in zip(got, (whole.label, whole.dense, whole.nnz, whole.keys)):
        np.testing.assert_array_equal(a, b)


def test_iter_norm_chunks_errors_and_skips_use_file_positions(tmp_path):
    from numbactr.data.norm import iter_norm_chunks

    rng = np.random.default_rng(0)
    p = str(tmp_path / "a.data")
    write_norm_file(
        p,
        rng.integers(0, 2, (200, 1)),
        rng.random((200, 2), np.float32),
        rng.integers(0, 100, (200, 3)),
        SUM,
        np.uint32,
    )
    R = 5 + 4 * (1 + 2) + 3 * (4 + 4)  # framing + label/dense + 3 x (nnz, key)
    raw = bytearray(open(p, "rb").read())
    raw[69 + 150 * R + 10] ^= 0x55  # damage record 150 (in the third 64-row piece)
    open(p, "wb").write(bytes(raw))
    with pytest.raises(NormFormatError, match="bad checksum") as e:
        list(iter_norm_chunks(p, 1, 2, 3, SUM, np.uint32, rows=64, whole_below=0))
    assert e.value.record == 150 and e.value.offset == 69 + 150 * R
    pieces = list(iter_norm_chunks(p, 1, 2, 3, SUM, np.uint32, True, rows=64, whole_below=0))
    assert sum(x.skipped for x in pieces) == 1 and pieces[2].first_bad_offset == 69 + 150 * R
    assert sum(x.label.shape[0] for x in pieces) == 199
