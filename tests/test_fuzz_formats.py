"""Byte-mutation fuzz of the data and graph formats (issue 8, item 8): random bit flips, multi-byte
changes, truncations and insertions of Norm, Raw, Parquet (+ _metadata.json) and graph JSON files.

Each mutation must give a clear error naming the file, or exactly the original values. Where a format
has no integrity check, the test states what it cannot detect and checks that nothing else slips by:
  * Norm Check_t.Non: a changed label/dense/key value of one record reads as data (no checksum);
  * Raw: the same, plus whole samples inserted when the file stays a whole number of samples (the tail
    past num_samples is then unread, which warns);
  * graph JSON: a mutation that leaves valid JSON with another valid value (dense_dim 2 -> 3) builds
    that other model; the model then equals what the mutated file says, never a silent default.
Seeded loops: deterministic and a few seconds per format.
"""

import json
import pathlib
import warnings

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.config import DataReaderParams
from numbactr.data import DataFormatError, make_reader
from numbactr.data.errors import DataWarning
from numbactr.data.file_list import write_file_list
from numbactr.data.norm import write_norm_file
from numbactr.data.parquet import ParquetDatasetWriter
from numbactr.data.raw import write_raw_file
from numbactr.enums import Check_t, DataReaderType_t as T
from tests.model_util import tiny_data, tiny_dlrm

KINDS = ("flip", "bytes", "truncate", "insert")


def mutations(raw: bytes, seed: int, per_kind: int):
    """(kind, mutated bytes) pairs, deterministic for a seed; never the unchanged input."""
    rng = np.random.default_rng(seed)
    for kind in KINDS:
        done = 0
        while done < per_kind:
            b = bytearray(raw)
            if kind == "flip":  # one bit
                b[int(rng.integers(len(b)))] ^= 1 << int(rng.integers(8))
            elif kind == "bytes":  # 2-4 bytes anywhere set to random values
                for pos in rng.integers(0, len(b), int(rng.integers(2, 5))):
                    b[int(pos)] = int(rng.integers(0, 256))
            elif kind == "truncate":
                b = b[: int(rng.integers(len(b)))]
            else:  # 1-8 random bytes inserted anywhere
                pos = int(rng.integers(len(b) + 1))
                b[pos:pos] = rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8).tobytes()
            if bytes(b) != raw:
                done += 1
                yield kind, bytes(b)


def read_all(prm, src, B, L, D, slots, nnz=None, i64=True):
    """(label, dense, [(keys, offsets) per input]) of the valid rows of every batch, concatenated."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataWarning)  # a mutation must not hide behind a warning
        batches = list(make_reader(prm, src, B, L, D, slots, nnz, i64, False))
    label = np.concatenate([b.label[: b.size] for b in batches])
    dense = np.concatenate([b.dense[: b.size] for b in batches])
    bags = [[] for _ in slots]
    for b in batches:
        for i, S in enumerate(slots):
            k, o = b.sparse[i]
            bags[i] += [k[o[j] : o[j + 1]].astype(np.int64).tolist() for j in range(b.size * S)]
    return label, dense, bags


def assert_names_file(e: Exception, path: str):
    assert repr(path) in str(e) or (isinstance(e, DataFormatError) and e.path == path), str(e)


# ---------------------------------------------------------------------------------------------------
# Norm


@pytest.mark.parametrize("check", [Check_t.Sum, Check_t.Non])
@pytest.mark.parametrize("fixed", [True, False])
def test_norm_mutations(tmp_path, check, fixed):
    rng = np.random.default_rng(7)
    n = 6
    lens = np.ones(n, int) if fixed else rng.integers(0, 3, n)
    slots = [(rng.integers(0, 100, int(lens.sum())), lens), rng.integers(0, 9, n)]
    path = str(tmp_path / "a.data")
    write_norm_file(path, rng.integers(0, 2, (n, 1)), rng.random((n, 2)), slots, check)
    lst = str(tmp_path / "list.txt")
    write_file_list(lst, [path])
    prm = DataReaderParams(T.Norm, lst, lst, check, num_workers=1)
    raw = pathlib.Path(path).read_bytes()
    ref = read_all(prm, lst, 4, 1, 2, [2], None, False)
    silent = 0
    for kind, data in mutations(raw, seed=int(fixed) + 2 * (check is Check_t.Sum), per_kind=40):
        pathlib.Path(path).write_bytes(data)
        try:
            got = read_all(prm, lst, 4, 1, 2, [2], None, False)
        except DataFormatError as e:
            assert_names_file(e, path)
            continue
        if (
            got[0].shape == ref[0].shape
            and all(np.array_equal(a, b) for a, b in zip(got[:2], ref[:2]))
            and got[2] == ref[2]
        ):
            continue  # identical values
        # only Check_t.Non, only a changed value: the same records, the same key counts
        assert check is Check_t.Non and kind in ("flip", "bytes"), (kind, "checksummed Norm read damaged data")
        assert got[0].shape == ref[0].shape and [len(x) for x in got[2][0]] == [len(x) for x in ref[2][0]]
        silent += 1
    if check is Check_t.Sum:
        assert silent == 0


# ---------------------------------------------------------------------------------------------------
# Raw


@pytest.mark.parametrize("fld", [False, True])
def test_raw_mutations(tmp_path, fld):
    rng = np.random.default_rng(11)
    n, L, D, S = 9, 1, 2, 3
    dense = rng.random((n, D)).astype(np.float32) if fld else rng.integers(0, 50, (n, D))
    path = str(tmp_path / "r.bin")
    write_raw_file(path, rng.integers(0, 2, (n, L)), dense, rng.integers(0, 100, (n, S)), fld)
    prm = DataReaderParams(T.Raw, path, path, Check_t.Non, num_samples=n, float_label_dense=fld, num_workers=1)
    raw = pathlib.Path(path).read_bytes()
    stride = 4 * (L + D + S)

    def from_bytes(data):  # what the bytes say, decoded independently of the reader
        w = np.frombuffer(data[: n * stride], "<i4").reshape(n, L + D + S)
        if fld:
            label, dense = w[:, :L].view("<f4"), w[:, L : L + D].view("<f4")
        else:
            label, dense = w[:, :L].astype(np.float32), np.log(w[:, L : L + D].astype(np.float32) + np.float32(1))
        return label, dense, w[:, L + D :].view("<u4").astype(np.int64)

    for kind, data in mutations(raw, seed=int(fld), per_kind=40):
        pathlib.Path(path).write_bytes(data)
        try:
            label, dense, bags = read_all(prm, path, 4, L, D, [S], None, False)
        except DataFormatError as e:
            assert_names_file(e, path)
            continue
        # no checksum: what was read is exactly what the bytes say, finite, and never a truncation
        assert kind in ("flip", "bytes") and len(data) == len(raw)
        want = from_bytes(data)
        np.testing.assert_array_equal(label, want[0])
        np.testing.assert_array_equal(dense, want[1])
        np.testing.assert_array_equal(np.array(bags[0]).reshape(n, S), want[2])
        assert np.isfinite(dense).all() and np.isfinite(label).all()
    # a whole sample inserted: still a whole number of samples, so the data shifts; the unread tail warns
    data = raw[: stride * 2] + bytes(range(stride)) + raw[stride * 2 :]
    pathlib.Path(path).write_bytes(data)
    with pytest.warns(DataWarning, match=f"holds {n + 1} samples but num_samples is {n}: the last 1"):
        batches = list(make_reader(prm, path, 4, L, D, [S], None, False, False))
    assert sum(b.size for b in batches) == n


# ---------------------------------------------------------------------------------------------------
# Parquet


@pytest.mark.parametrize("compression", ["none", "snappy"])
@pytest.mark.parametrize("target", ["a.parquet", "_metadata.json"])
def test_parquet_mutations(tmp_path, compression, target):
    """Page checksums, footer cross-checks and the metadata checks: every mutation is an error naming
    the file, or the values read are the original ones (damage in unused bytes such as statistics)."""
    rng = np.random.default_rng(5)
    n = 12
    w = ParquetDatasetWriter(str(tmp_path), 1, 2, 2, multi_hot={1}, compression=compression)
    lens = rng.integers(0, 3, n)
    w.write_file(
        "a.parquet",
        rng.integers(0, 2, n),
        rng.random((n, 2)),
        [rng.integers(0, 9, n), (rng.integers(0, 9, int(lens.sum())), lens)],
    )
    lst = w.close()
    prm = DataReaderParams(T.Parquet, lst, lst, Check_t.Non, slot_size_array=[9, 9])
    path = str(tmp_path / target)
    raw = pathlib.Path(path).read_bytes()
    ref = read_all(prm, lst, 5, 1, 2, [2], [[1, 2]])
    errors = 0
    for kind, data in mutations(raw, seed=len(target) + len(compression), per_kind=40):
        pathlib.Path(path).write_bytes(data)
        try:
            got = read_all(prm, lst, 5, 1, 2, [2], [[1, 2]])
        except DataFormatError as e:
            assert_names_file(e, path)
            errors += 1
            continue
        except ValueError as e:  # _metadata.json problems
            assert target == "_metadata.json" and "_metadata.json" in str(e), str(e)
            errors += 1
            continue
        assert all(np.array_equal(a, b) for a, b in zip(got[:2], ref[:2])) and got[2] == ref[2], (
            f"{kind} mutation of {target} changed the values read without an error"
        )
    assert errors > 100


# ---------------------------------------------------------------------------------------------------
# graph JSON


def _comparable(graph: dict) -> dict:
    """A graph with the informational max_vocabulary_size_global removed (the writer recomputes it)."""
    g = json.loads(json.dumps(graph))
    for layer in g.get("layers", []):
        if isinstance(layer, dict):
            (layer.get("sparse_embedding_hparam") or {}).pop("max_vocabulary_size_global", None)
    return g


def test_graph_json_mutations(tmp_path):
    tr, ev = tiny_data(str(tmp_path), n_train=64, n_eval=64)
    m = tiny_dlrm(tr, ev, batch=32)
    path = str(tmp_path / "g.json")
    m.graph_to_json(path)
    raw = pathlib.Path(path).read_bytes()
    original = json.loads(raw)
    bad, out = str(tmp_path / "bad.json"), str(tmp_path / "out.json")
    built = 0
    # besides the random mutations (whether one of them builds depends on the file's layout), one edit
    # that surely does: a valid value changed, so the rebuild branch below always runs
    valid = ("value", raw.replace(b'"num_output": 8', b'"num_output": 9', 1))
    for kind, data in [*mutations(raw, seed=3, per_kind=40), valid]:
        pathlib.Path(bad).write_bytes(data)
        m2 = hugectr.Model(m.solver, m.reader_params, hugectr.CreateOptimizer())
        with warnings.catch_warnings(record=True):  # recorded, not raised
            warnings.simplefilter("always", hugectr.IgnoredArgumentWarning)
            try:
                m2.construct_from_json(bad, include_dense_network=True)
                m2.compile()
            except hugectr.ModelError as e:  # a graph the file describes but that is wrong
                assert "Model.compile" in str(e) or repr(bad) in str(e), str(e)
                continue
            except ValueError as e:  # never a bare KeyError/TypeError/...
                assert_names_file(e, bad)
                continue
        built += 1
        m2.graph_to_json(out)
        rebuilt = _comparable(json.loads(pathlib.Path(out).read_text()))
        if rebuilt == _comparable(original):
            continue  # whitespace, an unread key (which warned)
        # valid JSON with another valid value: the model is exactly what the mutated file says
        assert rebuilt == _comparable(json.loads(data)), f"{kind}: the model is neither the original nor the file"
    assert built >= 1
