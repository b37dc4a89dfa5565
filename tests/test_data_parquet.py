"""Parquet datasets (spec §2.5, §10.9): _metadata.json next to the first file, columns by index sorted
ascending, list columns for multi-hot, slot_size_array offsets, validation, and random byte damage."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings, strategies as st

from numbactr.config import DataReaderParams
from numbactr.data import DataFormatError, make_reader
from numbactr.data.file_list import write_file_list
from numbactr.data.parquet import ParquetDatasetWriter, read_parquet_metadata, slot_offsets_of
from numbactr.enums import Check_t, DataReaderType_t as T


def params(lst, sizes=(), **kw):
    return DataReaderParams(T.Parquet, lst, lst, Check_t.Non, slot_size_array=list(sizes), **kw)


def read_all(lst, B, L, D, slots, nnz=None, sizes=(), i64=True, **kw):
    r = make_reader(params(lst, sizes), lst, B, L, D, slots, nnz, i64, False, **kw)
    return list(r)


def test_writer_layout_and_metadata(tmp_path):
    w = ParquetDatasetWriter(str(tmp_path), 1, 2, 3, multi_hot={1})
    p = w.write_file("a.parquet", [1, 0], [[0.5, 1.5], [2.5, 3.5]], [[4, 5], ([6, 7, 8], [2, 1]), [9, 10]])
    lst = w.close()
    assert open(lst).read() == f"1\n{p}\n"
    t = pq.read_table(p)
    assert t.column_names == ["label0", "C1", "C2", "C3", "C4", "C5"]
    assert pa.types.is_list(t.schema.field("C4").type) and t.schema.field("C4").type.value_type == pa.int64()
    assert t.schema.field("C3").type == pa.int64()
    assert t.column("C4").to_pylist() == [[6, 7], [8]] and t.column("label0").type == pa.float32()
    j = json.load(open(tmp_path / "_metadata.json"))
    assert j["file_stats"] == [{"file_name": "a.parquet", "num_rows": 2}]
    assert j["labels"] == [{"col_name": "label0", "index": 0}]
    assert [c["index"] for c in j["conts"]] == [1, 2] and [c["col_name"] for c in j["cats"]] == ["C3", "C4", "C5"]


def test_round_trip_multi_hot_offsets_and_inputs(tmp_path):
    rng = np.random.default_rng(0)
    n = 50
    w = ParquetDatasetWriter(str(tmp_path), 2, 3, 4, multi_hot={2})
    label, dense = rng.random((n, 2)), rng.random((n, 3))
    lens = rng.integers(0, 4, n)  # 0..3 keys, empty bags included
    vals = rng.integers(0, 7, int(lens.sum()))
    one = [rng.integers(0, 5, n) for _ in range(3)]
    w.write_file(
        "a.parquet",
        label[:30],
        dense[:30],
        [one[0][:30], one[1][:30], (vals[: lens[:30].sum()], lens[:30]), one[2][:30]],
    )
    w.write_file(
        "b.parquet",
        label[30:],
        dense[30:],
        [one[0][30:], one[1][30:], (vals[lens[:30].sum() :], lens[30:]), one[2][30:]],
    )
    lst = w.close()
    sizes = [5, 0, 7, 5]  # slot 1 shares slot 0's key space (a zero size)
    off = slot_offsets_of(sizes, 4)
    assert off.tolist() == [0, 5, 5, 12]
    got = read_all(lst, 16, 2, 3, [2, 2], [[1, 1], [3, 1]], sizes)
    assert [b.size for b in got] == [16, 16, 16, 2]
    lab = np.concatenate([b.label[: b.size] for b in got])
    np.testing.assert_allclose(lab, label.astype(np.float32))
    np.testing.assert_allclose(np.concatenate([b.dense[: b.size] for b in got]), dense.astype(np.float32))
    k0 = np.concatenate([b.sparse[0][0] for b in got]).reshape(-1, 2)
    np.testing.assert_array_equal(k0, np.stack([one[0], one[1] + 5], 1))
    # input 1: slot 2 is the list column, slot 3 one-hot
    bags = []
    for b in got:
        k, o = b.sparse[1]
        bags += [k[o[j] : o[j + 1]].tolist() for j in range(2 * b.size)]
    vs = np.split(vals, np.cumsum(lens)[:-1])
    want = []
    for i in range(n):
        want += [(vs[i] + 5).tolist(), [int(one[2][i]) + 12]]
    assert bags == want


def test_columns_are_taken_by_index_sorted_ascending(tmp_path):
    # file columns in an odd order; metadata JSON lists groups in yet another order
    t = pa.table(
        {
            "c_b": pa.array([20, 21], pa.int64()),
            "y": pa.array([1.0, 0.0], pa.float32()),
            "d2": pa.array([2.0, 3.0], pa.float32()),
            "c_a": pa.array([10, 11], pa.int64()),
            "d1": pa.array([7.0, 8.0], pa.float64()),
        }
    )
    p = str(tmp_path / "x.parquet")
    pq.write_table(t, p)
    meta = {
        "file_stats": [{"file_name": "/somewhere/else/x.parquet", "num_rows": 2}],  # matched by basename
        "cats": [{"col_name": "c_a", "index": 3}, {"col_name": "c_b", "index": 0}],
        "conts": [{"col_name": "d1", "index": 4}, {"col_name": "d2", "index": 2}],
        "labels": [{"col_name": "y", "index": 1}],
    }
    json.dump(meta, open(tmp_path / "_metadata.json", "w"))
    lst = str(tmp_path / "_file_list.txt")
    write_file_list(lst, [p])
    m = read_parquet_metadata(str(tmp_path / "_metadata.json"))
    assert [c for c, _ in m.cats] == ["c_b", "c_a"]
    b = read_all(lst, 2, 1, 2, [2])[0]
    assert b.dense.tolist() == [[2.0, 7.0], [3.0, 8.0]]  # d2 (index 2) before d1 (index 4)
    assert b.sparse[0][0].tolist() == [20, 10, 21, 11]  # c_b (index 0) is slot 0


@pytest.fixture
def good(tmp_path):
    w = ParquetDatasetWriter(str(tmp_path), 1, 1, 2, multi_hot={1})
    w.write_file("g.parquet", [0, 1, 1], [0.5, 1.5, 2.5], [[1, 2, 3], ([4, 5, 6], [1, 2, 0])])
    return tmp_path, w.close()


def rewrite(path, **cols):
    t = pq.read_table(path)
    for name, arr in cols.items():
        t = t.set_column(t.column_names.index(name), name, arr)
    pq.write_table(t, path)


def expect(lst, pattern, L=1, D=1, slots=(2,), nnz=None, i64=True, exc=DataFormatError, **kw):
    with pytest.raises(exc, match=pattern) as e:
        read_all(lst, 2, L, D, list(slots), nnz, i64=i64, **kw)
    return e.value


def test_metadata_disagreeing_with_files(good):
    d, lst = good
    meta = json.load(open(d / "_metadata.json"))
    meta["file_stats"][0]["num_rows"] = 4
    json.dump(meta, open(d / "_metadata.json", "w"))
    e = expect(lst, r"says num_rows=4 but the file has 3 rows")
    assert e.path.endswith("g.parquet")
    meta["file_stats"][0] = {"file_name": "other.parquet", "num_rows": 3}
    json.dump(meta, open(d / "_metadata.json", "w"))
    expect(lst, r"'g.parquet' is not listed in the file_stats")
    meta["file_stats"][0] = {"file_name": "g.parquet", "num_rows": 3}
    meta["cats"][1]["index"] = 7
    json.dump(meta, open(d / "_metadata.json", "w"))
    expect(lst, r"missing column: .* lists cat 'C3' at index 7 but the file has only 4 columns")
    meta["cats"][1] = {"col_name": "C9", "index": 3}
    json.dump(meta, open(d / "_metadata.json", "w"))
    expect(lst, r"says column 3 is cat 'C9' but the file's column 3 is 'C3'")
    meta["cats"][1] = {"col_name": "C3", "index": 3}
    json.dump(meta, open(d / "_metadata.json", "w"))
    expect(
        lst,
        r"lists 1 labels, 1 conts and 2 cats, but the model's Input has label_dim 1, dense_dim 2",
        D=2,
        exc=ValueError,
    )
    meta["cats"][1]["index"] = 1
    json.dump(meta, open(d / "_metadata.json", "w"))
    expect(lst, r"column index 1 is used twice", exc=ValueError)
    open(d / "_metadata.json", "w").write("{not json")
    expect(lst, r"invalid JSON at byte offset 1", exc=ValueError)
    os.remove(d / "_metadata.json")
    expect(lst, r"_metadata.json' cannot be read .* next to the first file", exc=ValueError)


def test_bad_values(good):
    d, lst = good
    p = str(d / "g.parquet")
    orig = pq.read_table(p)
    assert sum(b.size for b in read_all(lst, 2, 1, 1, [2])) == 3
    rewrite(p, C1=pa.array([0.5, None, 2.5], pa.float32()))
    e = expect(lst, r"row group 0, column 'C1': null value")
    assert e.record == 1 and e.offset is None and "record 1: row group 0, column 'C1'" in str(e)
    pq.write_table(orig, p)
    rewrite(p, C3=pa.array([[4], [5, None], []], pa.list_(pa.int64())))
    assert expect(lst, r"column 'C3': null key inside a list").record == 1
    pq.write_table(orig, p)
    rewrite(p, C2=pa.array([1, -2, 3], pa.int64()))
    assert expect(lst, r"column 'C2': negative key -2").record == 1
    pq.write_table(orig, p)
    rewrite(p, C2=pa.array([1, 2, 1 << 33], pa.int64()))
    expect(lst, r"key 8589934592 does not fit 32 bits", i64=False)
    assert sum(b.size for b in read_all(lst, 2, 1, 1, [2])) == 3  # fine with 64-bit keys
    pq.write_table(orig, p)
    t = pq.read_table(p).drop_columns(["C3"])  # one-hot only: the matrix path
    pq.write_table(t, p)
    meta = json.load(open(d / "_metadata.json"))
    meta["cats"] = meta["cats"][:1] + [{"col_name": "C3x", "index": 3}]
    pq.write_table(t.append_column("C3x", pa.array([0, 1, 2], pa.int64())), p)
    json.dump(meta, open(d / "_metadata.json", "w"))
    e = expect(
        lst,
        r"record 0: row group 0, column 'C3x': key 4294967296 \(after the slot offset 4294967296\) "
        r"does not fit 32 bits",
        i64=False,
        sizes=[2**32, 5],
    )
    assert e.record == 0
    k = read_all(lst, 3, 1, 1, [2], sizes=[2**32, 5])[0].sparse[0][0]
    assert k.tolist() == [1, 2**32, 2, 2**32 + 1, 3, 2**32 + 2]
    json.dump(
        json.load(open(d / "_metadata.json"))
        | {"cats": [{"col_name": "C2", "index": 2}, {"col_name": "C3", "index": 3}]},
        open(d / "_metadata.json", "w"),
    )
    pq.write_table(orig, p)
    assert expect(lst, r"2 keys in one row but nnz_per_slot of slot 1 is 1", nnz=[[1, 1]]).record == 1
    rewrite(p, C1=pa.array([0.5, float("inf"), 2.5], pa.float32()))
    assert expect(lst, r"non-finite dense\[0\] = inf.*column 'C1'").record == 1
    pq.write_table(orig, p)
    rewrite(p, C1=pa.array(["a", "b", "c"]))
    expect(lst, r"cont column 'C1' \(index 1\) has type string; expected a numeric column")
    pq.write_table(orig, p)
    rewrite(p, C2=pa.array([1.0, 2.0, 3.0]))
    expect(lst, r"cat column 'C2' \(index 2\) has type double; expected an integer")
    pq.write_table(orig, p)
    expect(lst, r"key 6 .* outside the table \[0, 6\)", key_bound=6)


def test_file_list_errors(good):
    d, lst = good
    open(lst, "w").write("2\n" + str(d / "g.parquet") + "\n")
    with pytest.raises(ValueError, match=r"line 3: header says 2 files but the list has 1"):
        read_all(lst, 2, 1, 1, [2])
    open(lst, "w").write("1\n" + str(d / "nope.parquet") + "\n")
    with pytest.raises(ValueError, match=r"line 2: data file .*nope.parquet.* does not exist"):
        read_all(lst, 2, 1, 1, [2])
    (d / "g.parquet").write_bytes(b"PAR1 this is not parquet")
    open(lst, "w").write("1\n" + str(d / "g.parquet") + "\n")
    expect(lst, r"not a readable Parquet file")


def test_slot_size_array_length_must_match(good):
    d, lst = good
    with pytest.raises(ValueError, match="slot_size_array has 3 entries but the sparse inputs have 2"):
        read_all(lst, 2, 1, 1, [2], sizes=[1, 2, 3])


def test_row_groups_and_slices(tmp_path):
    n = 70
    w = ParquetDatasetWriter(str(tmp_path), 1, 1, 1, row_group_size=16)
    w.write_file("a.parquet", np.arange(n), np.zeros(n), [np.arange(n)])
    lst = w.close()
    assert pq.ParquetFile(str(tmp_path / "a.parquet")).metadata.num_row_groups == 5
    got = read_all(lst, 32, 1, 1, [1])
    assert np.concatenate([b.label[: b.size, 0] for b in got]).tolist() == list(range(n))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31), nflips=st.integers(1, 8), cut=st.booleans(), target=st.sampled_from(["data", "meta"])
)
def test_random_damage_never_crashes_or_lies(tmp_path_factory, seed, nflips, cut, target):
    """Damaged Parquet or _metadata.json bytes: either a DataFormatError / ValueError naming the file,
    or batches equal to what pyarrow itself decodes from the damaged file (Parquet has no per-value
    redundancy without page checksums, so equal-to-the-bytes is the best any reader can promise)."""
    rng = np.random.default_rng(seed)
    d = tmp_path_factory.mktemp("pd")
    n = 12
    w = ParquetDatasetWriter(str(d), 1, 2, 2, multi_hot={1}, compression="none")
    lens = rng.integers(0, 3, n)
    w.write_file(
        "a.parquet",
        rng.integers(0, 2, n),
        rng.random((n, 2)),
        [rng.integers(0, 9, n), (rng.integers(0, 9, int(lens.sum())), lens)],
    )
    lst = w.close()
    path = str(d / ("a.parquet" if target == "data" else "_metadata.json"))
    raw = bytearray(open(path, "rb").read())
    for pos in rng.integers(0, len(raw), nflips):
        raw[pos] = int(rng.integers(0, 256))
    if cut:
        raw = raw[: int(rng.integers(0, len(raw)))]
    open(path, "wb").write(bytes(raw))
    try:
        got = read_all(lst, 5, 1, 2, [2], [[1, 2]], sizes=[9, 9], key_bound=18)
    except DataFormatError as e:
        assert os.path.basename(e.path) in str(e)
        return
    except ValueError as e:  # metadata-level problems
        assert "_metadata.json" in str(e) or "Parquet metadata" in str(e)
        return
    ref = pq.read_table(str(d / "a.parquet"))  # what the damaged bytes say
    lab = np.concatenate([b.label[: b.size, 0] for b in got])
    den = np.concatenate([b.dense[: b.size] for b in got])
    np.testing.assert_array_equal(lab, np.asarray(ref.column(0).to_numpy(zero_copy_only=False), np.float32))
    np.testing.assert_array_equal(den[:, 0], np.asarray(ref.column(1).to_numpy(zero_copy_only=False), np.float32))
    bags = []
    for b in got:
        k, o = b.sparse[0]
        bags += [k[o[j] : o[j + 1]].tolist() for j in range(2 * b.size)]
    want = []
    for a, lst_ in zip(ref.column(3).to_pylist(), ref.column(4).to_pylist()):
        want += [[a], [v + 9 for v in lst_]]
    assert bags == want
    assert np.isfinite(den).all()
