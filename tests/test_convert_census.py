"""numbactr data census: UCI adult layouts ('?' missing, adult.test's header and dotted labels), read back."""

import numpy as np
import pytest

from numbactr.data.convert.census import BUCKETS, CATEGORICAL, NUMERIC, convert_census, main
from tests.realdata import ADULT, offsets, read_back, wheel_table

DATA = """39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, Male, 2174, 0, 40, United-States, <=50K
50, Self-emp-not-inc, 83311, Bachelors, 13, Married-civ-spouse, Exec-managerial, Husband, White, Male, 0, 0, 13, United-States, <=50K
38, ?, 215646, HS-grad, 9, Divorced, ?, Not-in-family, White, Male, 0, 0, 40, ?, >50K
38, ?, 215646, HS-grad, 9, Divorced, ?, Not-in-family, White, Male, 0, 0, 40, ?, >50K

"""  # noqa: E501
TEST = """|1x3 Cross validator
25, Private, 226802, 11th, 7, Never-married, Machine-op-inspct, Own-child, Black, Male, 0, 0, 40, United-States, <=50K.
17, State-gov, 103497, Bachelors, 10, Never-married, Adm-clerical, Own-child, White, Female, 0, 0, 30, Peru, >50K.
"""  # noqa: E501


@pytest.fixture
def adult(tmp_path):
    (tmp_path / "adult.data").write_text(DATA)
    (tmp_path / "adult.test").write_text(TEST)
    return tmp_path


@pytest.mark.parametrize("fmt", ["norm", "raw", "parquet"])
def test_uci_folder_round_trip(adult, fmt):
    r = convert_census(str(adult), str(adult / "o"), fmt, verbose=False)
    assert r.num_train == 4 and r.num_eval == 2 and r.extra["duplicate_training_rows_kept"] == 1
    assert r.slot_num == 15 and r.dense_dim == 5 and r.dense_names == NUMERIC
    k = r.slot_names.index
    assert r.slot_size_array[k("workclass")] == 3 + 1  # '?', Self-emp-not-inc, State-gov + unseen
    assert r.slot_size_array[k("age-bucket")] == len(BUCKETS["age"]) + 1
    off = offsets(r.slot_size_array) if fmt != "raw" else 0
    lab, dense, keys = read_back(r, "train")
    ids = keys.astype(np.int64) - off
    assert list(lab) == [0, 0, 1, 1]
    assert ids[0, k("workclass")] == 3 and ids[2, k("workclass")] == 1  # sorted: '?' < Self-emp... < State-gov
    assert ids[0, k("age-bucket")] == 4  # 39 is in [35, 40): 4 boundaries are <= 39
    assert ids[0, k("capital-gain-bucket")] == 2  # 2174 in [2000, 5000)
    np.testing.assert_allclose(dense.mean(axis=0)[[0, 4]], 0, atol=1e-6)  # standardized on train
    lab, dense, keys = read_back(r, "eval")
    ids = keys.astype(np.int64) - off
    assert list(lab) == [0, 1]  # '<=50K.' and '>50K.'
    assert ids[1, k("native-country")] == 0 and ids[0, k("workclass")] == 0  # Peru, Private: unseen in train
    assert ids[1, k("workclass")] == 3


def test_single_file_and_fraction(adult):
    r = convert_census(str(adult / "adult.data"), str(adult / "o"), "norm", eval_fraction=0.25, verbose=False)
    assert (r.num_train, r.num_eval) == (3, 1) and "last 0.25" in r.split


@pytest.mark.parametrize(
    "line,pattern",
    [
        ("39, X, 1, B, 13, N, A, N, W, M, 0, 0, 40, US, 50K", r"adult.data', line 2: income '50K' is not >50K"),
        ("39, X, 1, B, 13, N, A, N, W, M, 0, 0, 40, US", r"adult.data', line 2: 14 ','-separated fields, expected 15"),
        ("3x, X, 1, B, 13, N, A, N, W, M, 0, 0, 40, US, >50K", r"adult.data', line 2: age '3x' is not an integer"),
        ("39, Caf\xe9, 1, B, 13, N, A, N, W, M, 0, 0, 40, US, >50K", r"adult.data', line 2: byte b'\\xe9' at column 8"),
    ],
)
def test_bad_records(tmp_path, line, pattern):
    first = DATA.splitlines()[0]
    (tmp_path / "adult.data").write_bytes((first + "\n" + line + "\n").encode("latin-1"))
    with pytest.raises(ValueError, match=pattern):
        convert_census(str(tmp_path / "adult.data"), str(tmp_path / "o"), verbose=False)


def test_latin1_with_encoding(tmp_path):
    text = DATA.replace("Peru", "Per\xfa") + TEST.splitlines()[1].replace("Black", "Bl\xe4ck") + "\n"
    (tmp_path / "adult.data").write_bytes(text.encode("latin-1"))
    r = convert_census(str(tmp_path / "adult.data"), str(tmp_path / "o"), encoding="latin-1", verbose=False)
    assert r.num_train + r.num_eval == 5


def test_cli(adult, capsys):
    assert main([str(adult), str(adult / "o"), "--format", "raw"]) == 0
    assert main([str(adult / "missing"), str(adult / "o2")]) == 1
    assert "cannot be read" in capsys.readouterr().err


def test_adult_from_the_wheel(tmp_path):
    df = wheel_table(ADULT)
    assert len(df) == 48_842
    path = tmp_path / "adult.data"  # the UCI layout, then the text converter
    with open(path, "w") as f:
        for row in df.itertuples(index=False):
            f.write(", ".join(map(str, row)) + "\n")
    r = convert_census(str(path), str(tmp_path / "o"), "parquet", eval_fraction=0.2, verbose=False)
    assert (r.num_train, r.num_eval) == (39_074, 9_768)
    lab, dense, keys = read_back(r, "train", batch=4096)
    np.testing.assert_array_equal(lab, (df.income[:39_074] == ">50K").to_numpy(np.float32))
    assert keys.shape == (39_074, 15) and dense.shape == (39_074, 5)
    k = r.slot_names.index("workclass")
    assert r.slot_size_array[k] == df.workclass[:39_074].nunique() + 1  # '?' included
    t = convert_census(df, str(tmp_path / "df"), "parquet", eval_fraction=0.2, verbose=False)
    assert t.slot_size_array == r.slot_size_array and t.extra["dense_mean"] == r.extra["dense_mean"]
    assert set(CATEGORICAL) <= set(r.slot_names)
