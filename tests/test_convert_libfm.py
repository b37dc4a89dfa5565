"""numbactr data libfm / libsvm: given and inferred fields, multi-hot slots, zero values, read back."""

import numpy as np
import pytest

from numbactr.data.convert.libfm import convert_libfm, main
from numbactr.data.convert.libsvm import convert_libsvm
from tests.realdata import offsets, read_back

# Frappe's files: libSVM-style lines, label -1/1, one feature per field in field order
FRAPPE = "-1 451:1 4149:1 5041:1\n1 452:1 4150:1 5041:1\n\n1 451:1 4149:1 5042:1\n-1 9:1 4150:1 5041:1\n"
# libFM: field 1 is multi-hot in line 1, field 2 missing in line 2, a zero value, a non-unit value
LIBFM = "0 0:3:1 1:7:1 1:8:1 2:5:1\n1 0:4:1 1:7:1\n1 0:3:1 2:1:0.5 1:9:0\n0 0:3:1 1:8:1 2:5:1\n"


@pytest.mark.parametrize("fmt", ["norm", "raw", "parquet"])
def test_libsvm_fields_by_position(tmp_path, fmt):
    (tmp_path / "f.libfm").write_text(FRAPPE)
    r = convert_libsvm(str(tmp_path / "f.libfm"), str(tmp_path / "o"), fmt, eval_fraction=0.25, verbose=False)
    assert r.slot_size_array == [4, 3, 3] and r.max_nnz_per_slot == [1, 1, 1] and (r.num_train, r.num_eval) == (3, 1)
    lab, _, keys = read_back(r, "train")
    ids = keys.astype(np.int64) - (offsets(r.slot_size_array) if fmt != "raw" else 0)
    assert list(lab) == [0, 1, 1]
    assert ids.tolist() == [[2, 1, 1], [3, 2, 1], [2, 1, 2]]  # field 0: 9, 451, 452 -> 1, 2, 3


def test_libsvm_boundaries_and_single(tmp_path):
    (tmp_path / "f.libfm").write_text(FRAPPE)
    r = convert_libsvm(str(tmp_path / "f.libfm"), str(tmp_path / "b"), "norm", fields=[0, 4149, 5041],
                       eval_fraction=0, verbose=False)  # fmt: skip
    assert r.slot_size_array == [4, 3, 3]
    r = convert_libsvm(str(tmp_path / "f.libfm"), str(tmp_path / "s"), "parquet", fields="single",
                       eval_fraction=0, verbose=False)  # fmt: skip
    assert r.slot_num == 1 and r.max_nnz_per_slot == [3] and r.slot_size_array == [8]
    _, _, csrs = read_back(r, "train")
    k, off = csrs[0]
    assert list(np.diff(off[:5])) == [3, 3, 3, 3]
    with pytest.raises(ValueError, match="line 1: feature 451 lies before the first field boundary"):
        convert_libsvm(str(tmp_path / "f.libfm"), str(tmp_path / "x"), fields=[500, 600], verbose=False)


def test_libfm_multi_hot_and_missing(tmp_path):
    (tmp_path / "a.libfm").write_text(LIBFM)
    r = convert_libfm(str(tmp_path / "a.libfm"), str(tmp_path / "o"), "norm", eval_fraction=0.25, verbose=False)
    assert r.slot_size_array == [3, 3, 3] and r.max_nnz_per_slot == [1, 2, 1]
    assert r.dropped == {"features with value 0 (absent)": 1} and r.extra["non_unit_values_kept_as_keys"] == 1
    _, _, csrs = read_back(r, "train")
    keys, off = csrs[0]
    rows = [keys[off[3 * i] : off[3 * i + 3]].tolist() for i in range(3)]
    # offsets [0, 3, 6]; field 0: 3, 4 -> 1, 2; field 1: 7, 8 -> 1, 2; field 2: 1, 5 -> 1, 2; missing -> id 0
    assert rows == [[1, 4, 5, 8], [2, 4, 6], [1, 7]]
    assert np.diff(off).tolist()[:9] == [1, 2, 1, 1, 1, 1, 1, 0, 1]
    with pytest.raises(ValueError, match="field 1 has up to 2 features per sample; Raw holds one key per slot"):
        convert_libfm(str(tmp_path / "a.libfm"), str(tmp_path / "r"), "raw", verbose=False)


@pytest.mark.parametrize(
    "text,pattern",
    [
        ("1 0:1:1\n2 0:1:1\n", r"a.libfm', line 2: label '2' is not -1, 0 or 1"),
        ("1 0:1:1\n\n1 0:1\n", r"a.libfm', line 3: '0:1' is not field:feature:value"),
        ("1 0:1:1\n1 0:x:1\n", r"a.libfm', line 2: '0:x:1' is not field:feature:value"),
        ("1 0:1:1\n1 0:\xe9:1\n", r"a.libfm', line 2: byte b'\\xe9' at column 5 is not utf-8"),
    ],
)
def test_bad_lines(tmp_path, text, pattern):
    (tmp_path / "a.libfm").write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=pattern):
        convert_libfm(str(tmp_path / "a.libfm"), str(tmp_path / "o"), verbose=False)


def test_regression_and_cli(tmp_path, capsys):
    (tmp_path / "a.libfm").write_text("2.5 0:1:1\n-0.5 0:2:1\n")
    r = convert_libfm(str(tmp_path / "a.libfm"), str(tmp_path / "o"), "norm", regression=True, eval_fraction=0,
                      verbose=False)  # fmt: skip
    assert list(read_back(r)[0]) == [2.5, -0.5]
    (tmp_path / "f.txt").write_text(FRAPPE)
    args = [str(tmp_path / "f.txt"), str(tmp_path / "c"), "--eval-input", str(tmp_path / "f.txt")]
    assert main(args, kind="libsvm") == 0
    assert main(args) == 1  # Frappe's lines are libSVM, not libFM
    assert "line 1: '451:1' is not field:feature:value" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "f.txt"), str(tmp_path / "c2"), "--fields", "0,x"], kind="libsvm")
    assert "--fields: expected position, single or integers" in capsys.readouterr().err
