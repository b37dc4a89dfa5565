"""numbactr data movielens: the GroupLens layouts, leave-last-out, the NCF negatives, read back."""

import json

import numpy as np
import pytest

from numbactr.data.convert.movielens import convert_movielens, main, read_ratings
from tests.realdata import MOVIELENS, offsets, read_back, wheel_table

# u.data: user item rating timestamp; a blank line, a repeated (user, item) pair (the later one counts),
# users 7 (one rating: dropped) and 3, 5, 9 with several
UDATA = """3\t10\t4\t100
3\t11\t2\t101
3\t12\t5\t102

5\t10\t1\t50
5\t13\t3\t40
5\t10\t5\t60
9\t14\t4\t7
9\t15\t4\t9
9\t16\t4\t8
7\t10\t4\t1
"""


def ratings_rows(path):
    r, _ = read_ratings(str(path))
    return list(zip(r["user"].tolist(), r["item"].tolist(), r["rating"].tolist(), r["timestamp"].tolist()))


def test_layouts_read_alike(tmp_path):
    (tmp_path / "u.data").write_text(UDATA)
    dat = UDATA.replace("\t", "::")
    (tmp_path / "ratings.dat").write_text(dat)
    (tmp_path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n" + UDATA.replace("\t", ","))
    want = ratings_rows(tmp_path / "u.data")
    assert len(want) == 10 and want[3] == (5, 10, 1.0, 50)
    assert ratings_rows(tmp_path / "ratings.dat") == want
    assert ratings_rows(tmp_path / "ratings.csv") == want


@pytest.mark.parametrize("fmt", ["norm", "raw", "parquet"])
def test_implicit_split_and_negatives(tmp_path, fmt):
    (tmp_path / "u.data").write_text(UDATA)
    r = convert_movielens(
        str(tmp_path / "u.data"), str(tmp_path / "o"), fmt, test_negatives=2, train_negatives=3, verbose=False
    )
    # users 3, 5, 9 -> 0, 1, 2; items 10..16 -> 0..6 (user 7 and its item-10 rating dropped)
    assert r.slot_size_array == [3, 7] and r.eval_group_size == 3 and r.user_slot == 0 and r.item_slot == 1
    assert r.dropped == {
        "duplicate (user, item) pair: kept the latest rating": 1,
        "user with fewer than 2 examples": 1,
    }
    assert r.num_eval == 9 and r.num_train == 5 * 4
    j = json.load(open(tmp_path / "o" / "conversion.json"))
    assert j["extra"]["eval_group_size"] == 3 and j["slot_size_array"] == [3, 7] and j["rows_read"] == 10
    off = offsets([3, 7]) if fmt == "norm" else (offsets([3, 7]) if fmt == "parquet" else np.zeros(2, int))
    lab, dense, keys = read_back(r, "eval")
    assert dense.shape == (9, 0)
    ids = keys.astype(np.int64) - off
    rated = {0: {0, 1, 2}, 1: {0, 3}, 2: {4, 5, 6}}
    held = {0: 2, 1: 0, 2: 5}  # latest timestamp: user 5's item 10 at 60, user 9's item 15 at 9
    for g in range(3):
        rows = ids[3 * g : 3 * g + 3]
        assert list(lab[3 * g : 3 * g + 3]) == [1, 0, 0]
        assert (rows[:, 0] == g).all() and rows[0, 1] == held[g]
        negs = rows[1:, 1]
        assert len(set(negs)) == 2 and not set(negs) & rated[g]
    lab, _, keys = read_back(r, "train")
    ids = keys.astype(np.int64) - off
    pos = sorted(map(tuple, ids[lab == 1].tolist()))
    assert pos == [(0, 0), (0, 1), (1, 3), (2, 4), (2, 6)]
    for u, i in ids[lab == 0].tolist():
        assert i not in rated[u]
    assert (lab == 0).sum() == 15


def test_explicit_and_threshold(tmp_path):
    (tmp_path / "u.data").write_text(UDATA)
    r = convert_movielens(str(tmp_path / "u.data"), str(tmp_path / "e"), "norm", implicit=False, verbose=False)
    lab, _, keys = read_back(r, "eval")
    assert r.eval_group_size == 1 and list(lab) == [5.0, 5.0, 4.0]  # the held-out ratings
    assert r.num_train == 5
    r = convert_movielens(
        str(tmp_path / "u.data"), str(tmp_path / "t"), "norm", threshold=4, test_negatives=1, verbose=False
    )
    # positives: user 3 items 10, 12; user 5 item 10; user 9 all three -> user 5 drops (one positive)
    assert r.num_users == 2 and r.dropped["rating below the threshold 4 (not a positive; still never a negative)"] == 2


def test_seeded_and_deterministic(tmp_path):
    (tmp_path / "u.data").write_text(UDATA)
    a = [convert_movielens(str(tmp_path / "u.data"), str(tmp_path / d), "raw", seed=s, test_negatives=2,
                           verbose=False) for d, s in (("a", 1), ("b", 1), ("c", 2))]  # fmt: skip
    data = [open(x.train_source, "rb").read() + open(x.eval_source, "rb").read() for x in a]
    assert data[0] == data[1] and data[0] != data[2]


@pytest.mark.parametrize(
    "text,pattern",
    [
        ("1\t2\t3\t4\n1\t2\t3\n", r"u.data', line 2: 3 '\\t'-separated fields, expected 4"),
        (
            "1\t2\t3\t4\n\n1\tcaf\xe9\t3\t4\n",
            r"u.data', line 3: byte b'\\xe9' at column 6 is not utf-8 text \(invalid continuation byte\)$",
        ),
        ("1\t2\t3\t4\n1\t2\tx\t4\n", r"u.data', line 2: rating 'x' is not a finite number"),
        ("1\t2\t3\t4\n1\t2.5\t3\t4\n", r"u.data', line 2: item '2.5' is not an integer"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path, text, pattern):
    (tmp_path / "u.data").write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=pattern):
        convert_movielens(str(tmp_path / "u.data"), str(tmp_path / "o"), verbose=False)


def test_cli(tmp_path, capsys):
    (tmp_path / "ratings.dat").write_text(UDATA.replace("\t", "::"))
    assert main([str(tmp_path / "ratings.dat"), str(tmp_path / "o"), "--implicit", "--test-negatives", "2"]) == 0
    assert "slot_size_array: [3, 7]" in capsys.readouterr().out
    assert json.load(open(tmp_path / "o" / "slot_size_array.json")) == [3, 7]
    assert main([str(tmp_path / "nope.dat"), str(tmp_path / "o2")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_movielens_100k_from_the_wheel(tmp_path):
    df = wheel_table(MOVIELENS)
    assert len(df) == 100_000
    path = tmp_path / "u.data"  # the original layout, then the text converter
    df[["user_id", "movie_id", "rating", "timestamp"]].to_csv(path, sep="\t", header=False, index=False)
    r = convert_movielens(str(path), str(tmp_path / "o"), "norm", verbose=False)
    assert r.num_users == 943 and r.num_items == 1682 and r.dropped == {}
    assert r.num_eval == 943 * 100 and r.num_train == (100_000 - 943) * 5
    lab, _, keys = read_back(r, "eval", batch=4000)
    ids = keys.astype(np.int64) - offsets(r.slot_size_array)
    assert (lab.reshape(943, 100)[:, 0] == 1).all() and lab.sum() == 943
    assert (ids[:, 0].reshape(943, 100) == np.arange(943)[:, None]).all()
    users = np.unique(df.user_id)
    items = np.unique(df.movie_id)
    rated = set(zip(np.searchsorted(users, df.user_id).tolist(), np.searchsorted(items, df.movie_id).tolist()))
    negs = ids.reshape(943, 100, 2)[:, 1:].reshape(-1, 2)
    assert not any((u, i) in rated for u, i in negs.tolist())
    t = convert_movielens(df, str(tmp_path / "df"), "norm", verbose=False)  # the table itself: the same data
    assert (
        open(t.eval_source.replace("_file_list.txt", "part_0.data"), "rb").read()
        == open(r.eval_source.replace("_file_list.txt", "part_0.data"), "rb").read()
    )
