"""Validation of data with the file and record named (issue 8, item 5): one-hot keys inside their own
slot's range of slot_size_array (Norm, Raw, Parquet, and through the model), label ranges derived from
the loss layers, Parquet page checksums, Norm record-length damage reported at the damaged record, and
Criteo field counts with file line numbers."""

import os
import pathlib
import struct
import sys

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.config import DataReaderParams
from numbactr.data import DataFormatError, make_reader
from numbactr.data.criteo import preprocess_criteo
from numbactr.data.file_list import write_file_list
from numbactr.data.norm import NormFormatError, decode_norm_file, write_norm_file
from numbactr.data.parquet import ParquetDatasetWriter
from numbactr.data.raw import write_raw_file
from numbactr.data.validation import LabelRule, SlotRanges
from numbactr.enums import Check_t, DataReaderType_t as T
from tests.model_util import tiny_dlrm

SIZES = [4, 5, 6]  # slot_size_array of the one-hot table below
LO = np.cumsum([0] + SIZES[:-1])  # slot s owns global keys [LO[s], LO[s] + SIZES[s])
RANGES = SlotRanges(LO, LO + np.array(SIZES), "test table")
N = 8


def _local_keys(rng):
    return np.stack([rng.integers(0, s, N) for s in SIZES], axis=1)  # (N, 3) per-slot keys


def _write(fmt, d, local, label=None, dense=None):
    """One file of N samples in `fmt` with per-slot keys `local`; returns (params, source)."""
    label = np.zeros((N, 1)) if label is None else label
    dense = np.ones((N, 2)) if dense is None else dense
    glob = local + LO  # Norm and Raw store globally offset keys
    if fmt == "norm":
        p = os.path.join(d, "a.data")
        write_norm_file(p, label, dense, glob.astype(np.int64), Check_t.Sum, np.int64)
        lst = os.path.join(d, "list.txt")
        write_file_list(lst, [p])
        return DataReaderParams(T.Norm, lst, lst, Check_t.Sum, num_workers=1), lst
    if fmt == "raw":
        p = os.path.join(d, "a.raw")
        write_raw_file(p, label, dense, glob, float_label_dense=True)
        return DataReaderParams(T.Raw, p, p, Check_t.Non, num_samples=N, float_label_dense=True, num_workers=1), p
    w = ParquetDatasetWriter(d, label.shape[1], 2, 3)  # Parquet stores per-slot keys; the reader offsets
    w.write_file("a.parquet", label, dense, list(local.T))
    lst = w.close()
    return DataReaderParams(T.Parquet, lst, lst, Check_t.Non, slot_size_array=SIZES), lst


def _read(prm, src, label_dim=1, **kw):
    return list(make_reader(prm, src, 4, label_dim, 2, [3], [[1, 1, 1]], True, False, **kw))


@pytest.mark.parametrize("fmt", ["norm", "raw", "parquet"])
@pytest.mark.parametrize("slot,bad_local", [(1, 7), (2, -9), (0, 4)])
def test_one_hot_key_outside_its_slot_is_rejected(tmp_path, fmt, slot, bad_local):
    """A key of slot s that lands in another slot's rows (still under the total) is an error naming the
    file, the record and the slot; good data reads with the same keys."""
    rng = np.random.default_rng(0)
    local = _local_keys(rng)
    prm, src = _write(fmt, str(tmp_path / "good"), local)
    got = np.concatenate([b.sparse[0][0] for b in _read(prm, src, key_bound=[RANGES])])
    np.testing.assert_array_equal(got.reshape(N, 3).astype(np.int64), local + LO)
    local[5, slot] = bad_local  # global key LO[slot] + bad_local: another slot's row
    prm, src = _write(fmt, str(tmp_path / "bad"), local)
    if fmt == "parquet" and bad_local < 0:  # Parquet stores per-slot keys: negative is caught first
        with pytest.raises(DataFormatError, match=rf"record 5: row group 0, column 'C{3 + slot}': negative key"):
            _read(prm, src, key_bound=[RANGES])
        return
    with pytest.raises(DataFormatError) as e:
        _read(prm, src, key_bound=[RANGES])
    err = e.value
    key = int(LO[slot] + bad_local)
    assert err.record == 5 and os.path.basename(err.path) in str(err)
    assert f"key {key} of sparse input 0 slot {slot}" in str(err)
    assert f"outside slot {slot}'s range [{LO[slot]}, {LO[slot] + SIZES[slot]}) of test table" in str(err)
    if fmt == "raw":
        assert err.offset == 5 * 4 * 6 + 4 * (3 + slot)  # record 5, word label+dense+slot
    if fmt == "parquet":
        assert f"stored key {bad_local} + slot offset {LO[slot]}" in str(err) or slot == 0
        assert f"row group 0, column 'C{3 + slot}'" in str(err)


def test_key_ranges_on_multi_hot_csr(tmp_path):
    """Ragged slots: the range check finds the slot of every key of the CSR."""
    n = 6
    lens = np.array([1, 0, 2, 1, 3, 1])
    vals = np.array([0, 3, 4, 1, 2, 0, 4, 3])  # slot 1 (size 5): all inside [0, 5)
    w = ParquetDatasetWriter(str(tmp_path), 1, 1, 2, multi_hot={1})
    w.write_file("a.parquet", np.zeros(n), np.zeros(n), [np.arange(n) % 4, (vals, lens)])
    lst = w.close()
    prm = DataReaderParams(T.Parquet, lst, lst, Check_t.Non, slot_size_array=[4, 5])
    rng_ = SlotRanges(np.array([0, 4]), np.array([4, 9]))
    assert sum(b.size for b in make_reader(prm, lst, 4, 1, 1, [2], [[1, 3]], True, False, key_bound=[rng_])) == n
    bad = SlotRanges(np.array([0, 4]), np.array([4, 8]))  # slot 1 now only [4, 8): key 4 + 4 is out
    with pytest.raises(DataFormatError, match=r"record 2: .*key 8 of sparse input 0 slot 1 \(stored key 4"):
        list(make_reader(prm, lst, 4, 1, 1, [2], [[1, 3]], True, False, key_bound=[bad]))


@pytest.mark.parametrize("fmt", ["norm", "raw", "parquet"])
@pytest.mark.parametrize(
    "kind,good,bad",
    [
        ("unit", [0.0, 1.0, 0.25], [1.5, -0.25]),
        ("unit_or_ignore", [0.0, 1.0, -1.0, -7.0], [-0.5, -0.25, 2.0]),
        ("class", [0.0, 1.0], [0.5, 2.0, -1.0]),
    ],
)
def test_label_rules(tmp_path, fmt, kind, good, bad):
    rng = np.random.default_rng(1)
    local = _local_keys(rng)
    rule = [LabelRule(kind, "the test loss")]
    label = np.resize(np.array(good), N).reshape(N, 1)
    prm, src = _write(fmt, str(tmp_path / "good"), local, label=label)
    got = np.concatenate([b.label[: b.size] for b in _read(prm, src, label_rules=rule)])
    np.testing.assert_array_equal(got, label.astype(np.float32))
    for i, v in enumerate(bad):
        label[6, 0] = v
        prm, src = _write(fmt, str(tmp_path / f"bad{i}"), local, label=label)
        with pytest.raises(DataFormatError, match=r"record 6.*label\[0\] = .* by the test loss") as e:
            _read(prm, src, label_rules=rule)
        if fmt == "raw":
            assert e.value.offset == 6 * 24


def _rewrite_norm(lst, label=None, keys=None, record=3):
    """Rewrite the first file of a tiny_data list with one label or key changed at `record`."""
    path = pathlib.Path(lst).read_text().split()[1]
    dec = decode_norm_file(path, 1, 2, 3, Check_t.Sum, np.int64)
    lab, k = dec.label.copy(), dec.keys.reshape(-1, 3).copy()
    if label is not None:
        lab[record, 0] = label
    if keys is not None:
        k[record] = keys
    write_norm_file(path, lab, dec.dense, k, Check_t.Sum, np.int64)
    return path


def test_model_checks_one_hot_slots_and_bce_labels(tmp_path):
    """The model derives the key ranges from the one-hot table's slot_size_array and the label range
    from BinaryCrossEntropyLoss, and train() stops at the bad record with the file named."""
    from tests.model_util import one_hot_lists, tiny_data

    tr, ev = tiny_data(str(tmp_path), n_train=128, n_eval=64)
    one_hot = hugectr.Embedding_t.LocalizedSlotSparseEmbeddingOneHot
    m = tiny_dlrm(tr, ev, batch=32, embedding=one_hot)
    assert m.train()  # per-slot keys in [0, 6): fine
    path = _rewrite_norm(one_hot_lists(one_hot, tr)[0], keys=[0, 7, 2])  # slot 1 holds 7: slot 2's row 1
    m = tiny_dlrm(tr, ev, batch=32, embedding=one_hot)
    with pytest.raises(
        DataFormatError,
        match=r"record 3: key 7 of sparse input 0 slot 1 is outside slot 1's "
        r"range \[0, 6\) of LocalizedSlotSparseEmbeddingOneHot 'emb'",
    ) as e:
        m.train()
    assert e.value.path == path
    _rewrite_norm(tr, keys=[0, 7, 12], label=2.0)
    m = tiny_dlrm(tr, ev, batch=32)
    with pytest.raises(
        DataFormatError,
        match=r"record 3: label\[0\] = 2.0 must lie in \[0, 1\] \(required by "
        r"BinaryCrossEntropyLoss 'loss'\)",
    ):
        m.train()


def test_model_multi_cross_entropy_allows_ignored_labels(tmp_path):
    rng = np.random.default_rng(2)
    n = 32
    label = rng.integers(0, 2, (n, 2)).astype(np.float32)
    label[::3, 1] = -1.0  # "no label"
    p = str(tmp_path / "a.data")
    write_norm_file(p, label, rng.random((n, 3)), rng.integers(0, 4, (n, 2)).astype(np.int64), Check_t.Sum, np.int64)
    lst = str(tmp_path / "l.txt")
    write_file_list(lst, [p])

    def model():
        s = hugectr.CreateSolver(batchsize=16, batchsize_eval=16, i64_input_key=True)
        r = hugectr.DataReaderParams(data_reader_type=T.Norm, source=[lst], eval_source=lst, check_type=Check_t.Sum)
        m = hugectr.Model(s, r, hugectr.CreateOptimizer(optimizer_type=hugectr.Optimizer_t.SGD))
        m.add(
            hugectr.Input(
                label_dim=2,
                label_name="label",
                dense_dim=3,
                dense_name="dense",
                data_reader_sparse_param_array=[hugectr.DataReaderSparseParam("data1", 1, True, 2)],
            )
        )
        m.add(hugectr.DenseLayer(hugectr.Layer_t.InnerProduct, ["dense"], ["out"], num_output=2))
        m.add(
            hugectr.DenseLayer(
                hugectr.Layer_t.MultiCrossEntropyLoss, ["out", "label"], ["loss"], target_weight_vec=[1.0, 1.0]
            )
        )
        m.compile()
        return m

    assert model().train()
    label[20, 1] = -0.3  # neither a label nor "missing"
    write_norm_file(p, label, rng.random((n, 3)), rng.integers(0, 4, (n, 2)).astype(np.int64), Check_t.Sum, np.int64)
    with pytest.raises(
        DataFormatError,
        match=r"record 20: label\[1\] = -0.3 must lie in \[0, 1\] \(or be < -0.5 "
        r"for 'no label'\) \(required by MultiCrossEntropyLoss 'loss'\)",
    ):
        model().train()


# ---------------------------------------------------------------------------------------------------
# Parquet page checksums


def test_parquet_page_checksum_names_file_row_group_and_column(tmp_path):
    import pyarrow.parquet as pq

    n = 64
    w = ParquetDatasetWriter(str(tmp_path), 1, 2, 2, compression="none", row_group_size=32)
    vals = np.arange(n, dtype=np.float32)
    w.write_file("a.parquet", np.zeros(n), np.stack([vals, vals + 1000], 1), [np.arange(n) % 3, np.arange(n) % 5])
    lst = w.close()
    path = str(tmp_path / "a.parquet")
    md = pq.ParquetFile(path).metadata
    col = md.row_group(1).column(2)  # row group 1, column C2 (the second cont)
    assert col.path_in_schema == "C2"
    raw = bytearray(pathlib.Path(path).read_bytes())
    start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
    body = raw.index(np.float32(1000 + 40).tobytes(), start, start + col.total_compressed_size)
    raw[body + 1] ^= 0x10  # a mantissa bit of the value 1040
    pathlib.Path(path).write_bytes(bytes(raw))
    prm = DataReaderParams(T.Parquet, lst, lst, Check_t.Non, slot_size_array=[3, 5])
    with pytest.raises(DataFormatError, match=r"row group 1, column 'C2': page checksum mismatch") as e:
        list(make_reader(prm, lst, 16, 1, 2, [2], None, True, False))
    assert e.value.path == path and "a.parquet" in str(e.value)
    unverified = pq.read_table(path).column("C2").to_numpy()  # pyarrow without verification: silent change
    assert not np.array_equal(unverified, vals + 1000)


def test_parquet_footer_row_counts_must_agree(tmp_path):
    """A damaged footer row-group row count (pyarrow would silently read fewer rows) is an error."""
    import pyarrow.parquet as pq

    n = 12
    w = ParquetDatasetWriter(str(tmp_path), 1, 1, 1, compression="none")
    w.write_file("a.parquet", np.zeros(n), np.zeros(n), [np.arange(n)])
    lst = w.close()
    path = str(tmp_path / "a.parquet")
    raw = bytearray(pathlib.Path(path).read_bytes())
    flen = struct.unpack("<i", raw[-8:-4])[0]
    footer = bytes(raw[-8 - flen : -8])
    # thrift compact: RowGroup.num_rows (field 3, i64) follows total_byte_size; find the zigzag 12 = 0x18
    # right after the column chunks by trying every 0x18 byte and keeping the one that changes it
    for i in [k for k, b in enumerate(footer) if b == 0x18]:
        b = bytearray(raw)
        b[len(raw) - 8 - flen + i] = 0x10  # zigzag 8
        pathlib.Path(path).write_bytes(bytes(b))
        try:
            rg_rows = pq.ParquetFile(path).metadata.row_group(0).num_rows
        except Exception:  # noqa: BLE001 (another field: the footer no longer parses)
            continue
        if rg_rows == 8:
            break
    else:
        pytest.fail("no row-group num_rows byte found")
    prm = DataReaderParams(T.Parquet, lst, lst, Check_t.Non)
    with pytest.raises(DataFormatError, match=r"row groups hold 8 rows \[8\] but its num_rows is 12"):
        list(make_reader(prm, lst, 4, 1, 1, [1], None, True, False))


# ---------------------------------------------------------------------------------------------------
# Norm: a damaged record length is reported at the damaged record


def _framed_starts(raw: bytes, n: int):
    pos, starts = 69, []
    for _ in range(n):
        starts.append(pos)
        pos += 5 + struct.unpack_from("<i", raw, pos)[0]
    return starts


@pytest.mark.parametrize("fixed", [True, False])
def test_norm_damaged_length_is_reported_at_its_record(tmp_path, fixed):
    rng = np.random.default_rng(3)
    n = 6
    lens = np.ones(n, int) if fixed else rng.integers(0, 3, n)
    slots = [(rng.integers(0, 100, int(lens.sum())), lens), rng.integers(0, 9, n)]
    src = tmp_path / "a.data"
    write_norm_file(src, np.zeros((n, 1)), rng.random((n, 2)), slots, Check_t.Sum)
    raw = src.read_bytes()
    starts = _framed_starts(raw, n)
    bad = tmp_path / "b.data"
    for rec in range(n):
        for delta in (-5, -1, 1, 4, 9, 1000, -(1 << 20)):
            b = bytearray(raw)
            length = struct.unpack_from("<i", b, starts[rec])[0]
            struct.pack_into("<i", b, starts[rec], length + delta)
            bad.write_bytes(bytes(b))
            with pytest.raises(NormFormatError) as e:
                decode_norm_file(bad, 1, 2, 2, Check_t.Sum)
            assert (e.value.record, e.value.offset) == (rec, starts[rec]), (rec, delta, str(e.value))
            with pytest.raises(NormFormatError) as e:  # skipping cannot step over it
                decode_norm_file(bad, 1, 2, 2, Check_t.Sum, skip_bad_checksum=True)
            assert e.value.record == rec


# ---------------------------------------------------------------------------------------------------
# Criteo field counts


@pytest.fixture
def criteo_lines():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "datasets" / "criteo"))
    try:
        import make_fixture  # the generator of the committed Criteo fixture
    finally:
        sys.path.pop(0)
    return make_fixture.make_lines(40, 7)


@pytest.mark.parametrize(
    "fields,lenient,pattern",
    [
        (39, False, r"line 10: 39 tab-separated fields, expected 40 .*--pad-short-lines"),
        (41, False, r"line 10: 41 tab-separated fields, expected 40"),
        (41, True, r"line 10: 41 tab-separated fields, expected 40"),  # long lines are never padded
        (1, False, r"line 10: 1 tab-separated fields"),
    ],
)
def test_criteo_field_count_names_the_file_line(tmp_path, criteo_lines, fields, lenient, pattern):
    lines = criteo_lines[:5] + ["", "\r"] + criteo_lines[5:6] + [""]  # blank lines count: the bad one is line 10
    cut = criteo_lines[6].split("\t")
    bad = "\t".join((cut + ["0"] * 2)[:fields]) if fields > 1 else "1"
    f = tmp_path / "bad.tsv"
    f.write_text("\n".join(lines + [bad] + criteo_lines[7:]) + "\n")
    with pytest.raises(ValueError, match=pattern) as e:
        preprocess_criteo(str(f), str(tmp_path / "out"), verbose=False, chunk_size=4, lenient=lenient)
    assert "bad.tsv" in str(e.value)


def test_criteo_lenient_pads_short_lines_and_skips_blank_ones(tmp_path, criteo_lines):
    short = "\t".join(criteo_lines[3].split("\t")[:20])  # label, I1..I13, C1..C6
    padded = short + "\t" * 20
    f, g = tmp_path / "short.tsv", tmp_path / "padded.tsv"
    f.write_text("\n".join(criteo_lines[:3] + ["", short] + criteo_lines[4:]))  # no final newline
    g.write_text("\n".join(criteo_lines[:3] + [padded] + criteo_lines[4:]) + "\n")
    with pytest.raises(ValueError, match="line 5: 20 tab-separated fields"):
        preprocess_criteo(str(f), str(tmp_path / "o0"), verbose=False)
    a = preprocess_criteo(str(f), str(tmp_path / "o1"), "norm", min_count=1, verbose=False, chunk_size=3, lenient=True)
    b = preprocess_criteo(str(g), str(tmp_path / "o2"), "norm", min_count=1, verbose=False, chunk_size=3)
    assert (a.num_train, a.num_eval, a.slot_size_array) == (b.num_train, b.num_eval, b.slot_size_array)
    assert a.num_train + a.num_eval == len(criteo_lines)
    for split in ("train", "eval"):
        pa = pathlib.Path(a.out_dir, split, "_file_list.txt").read_text().split()[1:]
        pb = pathlib.Path(b.out_dir, split, "_file_list.txt").read_text().split()[1:]
        assert [pathlib.Path(x).read_bytes() for x in pa] == [pathlib.Path(x).read_bytes() for x in pb]


def test_key_ranges_csr_with_as_many_keys_as_bags(tmp_path):
    """n*S keys in a ragged CSR (bag lengths 0 and 2) is not one key per bag: keys keep their own slots."""
    n = 4
    lens = np.array([2, 0, 1, 1])  # slot 1: 4 keys in 4 rows, but row 0 holds two
    w = ParquetDatasetWriter(str(tmp_path), 1, 1, 2, multi_hot={0, 1})
    w.write_file(
        "a.parquet",
        np.zeros(n),
        np.zeros(n),
        [(np.array([0, 1, 2, 3]), np.array([0, 2, 1, 1])), (np.array([0, 1, 2, 3]), lens)],
    )
    lst = w.close()
    prm = DataReaderParams(T.Parquet, lst, lst, Check_t.Non, slot_size_array=[4, 4])
    ok = SlotRanges(np.array([0, 4]), np.array([4, 8]))
    got = list(make_reader(prm, lst, 4, 1, 1, [2], [[2, 2]], True, False, key_bound=[ok]))
    assert got[0].sparse[0][0].tolist() == [4, 5, 0, 1, 2, 6, 3, 7]  # rows 0..3, slots 0, 1
    tight = SlotRanges(np.array([0, 4]), np.array([4, 6]))  # slot 1 keys 4, 5 only: 6 is out
    with pytest.raises(DataFormatError, match=r"record 2: .*key 6 of sparse input 0 slot 1"):
        list(make_reader(prm, lst, 4, 1, 1, [2], [[2, 2]], True, False, key_bound=[tight]))
