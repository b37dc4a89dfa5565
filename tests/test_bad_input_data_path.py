"""Bad input on the data path (issue 40, item 5): several training file lists, a snapshot prefix in a missing
folder, a Norm key equal to the hash table's empty marker, a Criteo file that is not ASCII."""

from __future__ import annotations

import os

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.data.criteo import preprocess_criteo
from numbactr.data.errors import DataFormatError
from numbactr.data.file_list import write_file_list
from numbactr.data.norm import write_norm_file
from numbactr.data.reader import DataReader
from numbactr.enums import Check_t, DataReaderType_t as T
from numbactr.train.graph import ModelError
from tests.model_util import tiny_data, tiny_dlrm


def _norm_list(folder, first_label, n, files=2):
    """A file list of `files` Norm files, labels first_label, first_label + 1, ... in file order."""
    paths = []
    for f, idx in enumerate(np.array_split(np.arange(n), files)):
        p = os.path.join(folder, f"part{f}.data")
        os.makedirs(folder, exist_ok=True)
        label = (first_label + idx).astype(np.float32).reshape(-1, 1)
        keys = np.zeros((idx.size, 2), np.int64)
        write_norm_file(p, label, np.zeros((idx.size, 1), np.float32), keys, key_dtype=np.int64)
        paths.append(p)
    lst = os.path.join(folder, "_file_list.txt")
    write_file_list(lst, paths)
    return lst


# ---- a. several file lists -----------------------------------------------------------------------------
def _labels(reader):
    return np.concatenate([b.label[: b.size, 0] for b in reader])


def test_reader_reads_every_file_list_in_order(tmp_path):
    one = _norm_list(str(tmp_path / "a"), 0, 10)
    two = _norm_list(str(tmp_path / "b"), 100, 7, files=1)
    r = DataReader(T.Norm, [one, two], 4, 1, 1, [2], None, True, False, num_workers=1, check_type=Check_t.Sum)
    np.testing.assert_array_equal(_labels(r), np.r_[np.arange(10), 100 + np.arange(7)])
    assert r.source == [one, two] and len(r.files) == 3
    r = DataReader(T.Norm, one, 4, 1, 1, [2], None, True, False, num_workers=1, check_type=Check_t.Sum)
    assert r.source == one  # one list, as before


def test_parquet_lists_in_two_folders_each_with_its_metadata(tmp_path):
    """Two Parquet lists from two folders, each _metadata.json beside its own files: both read, in order."""
    pytest.importorskip("pyarrow")
    from numbactr.data.reader import make_reader
    from numbactr.tools.data_generator import DataGenerator, DataGeneratorParams

    lists = []
    for name, rows, seed in (("a", 60, 1), ("b", 40, 2)):
        p = DataGeneratorParams(
            T.Parquet,
            1,
            2,
            2,
            True,
            str(tmp_path / name / "_file_list.txt"),
            str(tmp_path / name / "_eval.txt"),
            [5, 7],
            num_files=1,
            eval_num_files=1,
            num_samples_per_file=rows,
            seed=seed,
        )
        DataGenerator(p).generate()
        lists.append(p.source)
    prm = hugectr.DataReaderParams(T.Parquet, lists, lists[0], Check_t.Non, slot_size_array=[5, 7])
    got = _labels(make_reader(prm, lists, 16, 1, 2, [2], [[1, 1]], True, False))
    each = [_labels(make_reader(prm, lst, 16, 1, 2, [2], [[1, 1]], True, False)) for lst in lists]
    assert [e.size for e in each] == [60, 40]
    np.testing.assert_array_equal(got, np.concatenate(each))


def test_model_trains_on_every_source_list(tmp_path, cpu):
    """DataReaderParams(source=[list1, list2]) trains on both (it read list1 only, with a warning)."""
    a_tr, ev = tiny_data(str(tmp_path / "a"), n_train=64, n_eval=32, files=1)
    b_tr, _ = tiny_data(str(tmp_path / "b"), n_train=96, n_eval=32, files=1, seed=1)
    m = tiny_dlrm([a_tr, b_tr], ev, batch=32, repeat=False)
    steps = 0
    while m.train():
        steps += 1
    assert steps == (64 + 96) // 32
    m.set_source([b_tr, a_tr], ev)  # Model.set_source takes several lists too
    assert m.reader_params.source == [b_tr, a_tr]
    steps = 0
    while m.train():
        steps += 1
    assert steps == (64 + 96) // 32


def test_raw_refuses_several_sources_and_eval_source_lists(tmp_path):
    from numbactr.data.raw import write_raw_file

    p = str(tmp_path / "d.bin")
    write_raw_file(p, np.zeros((4, 1), np.int64), np.zeros((4, 1), np.int64), np.zeros((4, 2), np.int64))
    with pytest.raises(ValueError, match=r"source lists 2 files .* reader reads one data file .*concatenate"):
        DataReader(T.Raw, [p, p], 2, 1, 1, [2], None, False, False, num_samples=4)
    with pytest.raises(ValueError, match=r"eval_source must be one non-empty file-list path .* write one file list"):
        hugectr.DataReaderParams(T.Norm, [p], [p, p], Check_t.Sum)


# ---- b. snapshot prefix ---------------------------------------------------------------------------------
def test_fit_checks_the_snapshot_folder_before_the_first_step(tmp_path, cpu):
    m = tiny_dlrm(*tiny_data(str(tmp_path), n_train=64, n_eval=32, files=1), batch=32)
    prefix = str(tmp_path / "missing" / "dlrm")
    with pytest.raises(ModelError, match=r"snapshot_prefix .*missing/dlrm.*its folder .*missing' does not exist"):
        m.fit(max_iter=20, display=0, eval_interval=100, snapshot=10, snapshot_prefix=prefix)
    assert m.step == 0  # nothing trained
    (tmp_path / "afile").write_text("")
    with pytest.raises(ModelError, match=r"afile' is not a folder"):
        m.fit(max_iter=20, display=0, eval_interval=100, snapshot=10, snapshot_prefix=str(tmp_path / "afile" / "x"))
    m.fit(max_iter=4, display=0, eval_interval=100, snapshot=10, snapshot_prefix=prefix)  # no snapshot: no check
    m.fit(max_iter=12, display=0, eval_interval=100, snapshot=10, snapshot_prefix=str(tmp_path / "snap"))
    assert os.path.exists(str(tmp_path / "snap_10.manifest.json"))


# ---- c. the hash table's empty key in a Norm file -------------------------------------------------------
def test_norm_key_minus_one_names_the_file_and_record(tmp_path):
    keys = np.arange(12, dtype=np.int64).reshape(6, 2)
    keys[4, 1] = -1
    p = str(tmp_path / "k.data")
    write_norm_file(p, np.zeros((6, 1), np.float32), np.zeros((6, 1), np.float32), keys, key_dtype=np.int64)
    write_file_list(str(tmp_path / "l.txt"), [p])
    r = DataReader(T.Norm, str(tmp_path / "l.txt"), 6, 1, 1, [2], None, True, False, num_workers=1)
    with pytest.raises(
        DataFormatError, match=r"k\.data', byte offset \d+, record 4: key -1 .* slot 1 is reserved"
    ) as e:
        _labels(r)
    assert e.value.path == p and e.value.record == 4


# ---- d. Criteo bytes that are not ASCII -----------------------------------------------------------------
def test_criteo_names_the_line_of_a_non_ascii_byte(tmp_path):
    good = "\t".join(["1"] + ["3"] * 13 + ["68fd1e64"] * 26) + "\n"
    bad = "\t".join(["0"] + ["3"] * 13 + ["68fd1e64"] * 25 + ["6\xe9ab"]) + "\n"
    p = tmp_path / "day_0"
    p.write_bytes((good * 4 + bad + good).encode("latin-1"))
    with pytest.raises(ValueError, match=r"day_0', line 5: byte 0xe9 at byte offset \d+ \(column C26\) is not ASCII"):
        preprocess_criteo(str(p), str(tmp_path / "out"))
