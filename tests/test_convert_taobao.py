"""numbactr data taobao: UserBehavior.csv -> DIN histories in HugeCTR's layout, read back."""

import numpy as np
import pytest

from numbactr.data.convert.taobao import convert_taobao, main
from tests.realdata import offsets, read_back

# user 1: four clicks (a buy in between is not a click); user 2: three clicks, one line twice; user 3: one
UB = """1,2268318,2520377,pv,1511544070
1,2333346,2520771,pv,1511561733
1,2576651,149192,pv,1511572885
1,3830808,4181361,pv,1511593493
1,4365585,2520377,buy,1511596146
2,1,5,pv,10
2,3,6,pv,12
2,2,5,pv,11
2,3,6,pv,12

3,9,9,pv,1
"""
# items sorted: 1 2 3 9 2268318 2333346 2576651 3830808 -> 1..8; categories 5 6 9 149192 2520377 2520771 4181361
CAT = {1: 1, 2: 1, 3: 2, 4: 3, 5: 5, 6: 6, 7: 4, 8: 7}


@pytest.mark.parametrize("fmt", ["norm", "raw", "parquet"])
def test_histories(tmp_path, fmt):
    (tmp_path / "ub.csv").write_text(UB)
    r = convert_taobao(str(tmp_path / "ub.csv"), str(tmp_path / "o"), fmt, max_len=2, shuffle=False, verbose=False)
    assert r.dropped == {"duplicate line": 1, "behavior not in ['pv']": 1, "user with fewer than 3 behaviours": 1}
    assert r.slot_names == ["user", "item_0", "item_1", "item_target", "category_0", "category_1", "category_target"]
    if fmt == "raw":
        assert r.slot_size_array == [2, 9, 9, 9, 8, 8, 8]
        off = 0
    else:
        assert r.slot_size_array == [2, 0, 0, 9, 0, 0, 8]  # HugeCTR's din_parquet.py: shared key spaces
        off = offsets(r.slot_size_array)
    for split, want in (
        ("eval", [[0, 6, 7, 8], [1, 1, 2, 3]]),  # last click, history = the two before (oldest first)
        ("train", [[0, 5, 6, 7], [1, 1, 0, 2]]),  # the click before; user 2's history padded with 0
    ):
        lab, _, keys = read_back(r, split)
        ids = keys.astype(np.int64) - off
        assert list(lab) == [1, 0, 1, 0]
        assert ids[::2, :4].tolist() == want
        assert (ids[1::2, :3] == ids[::2, :3]).all()  # the negative keeps the history
        clicked = {0: {5, 6, 7, 8}, 1: {1, 2, 3}}
        for row in ids[1::2]:
            assert row[3] not in clicked[row[0]] and 1 <= row[3] <= 8
        for row in ids:
            assert [CAT.get(int(i), 0) for i in row[1:4]] == row[4:7].tolist()


def test_all_targets_and_shuffle(tmp_path):
    (tmp_path / "ub.csv").write_text(UB)
    r = convert_taobao(str(tmp_path / "ub.csv"), str(tmp_path / "o"), "raw", max_len=3, train_targets="all",
                       seed=3, verbose=False)  # fmt: skip
    assert r.num_train == 2 * (2 + 1) and r.num_eval == 4 and r.eval_group_size == 2
    lab, _, ids = read_back(r, "train")
    pos = sorted(map(tuple, ids[lab == 1][:, :4].tolist()))
    assert pos == [(0, 5, 0, 0), (0, 5, 6, 0), (1, 1, 0, 0)]
    assert [i["slots"] for i in r.extra["inputs"]] == [1, 4, 4]


@pytest.mark.parametrize(
    "line,pattern",
    [
        ("1,2,3,click,4", r"ub.csv', line 2: behavior 'click' is not one of"),
        ("1,2,3,pv", r"ub.csv', line 2: 4 ','-separated fields, expected 5"),
        ("1,2,x,pv,4", r"ub.csv', line 2: category 'x' is not an integer"),
        ("1,2,\xe9,pv,4", r"ub.csv', line 2: byte b'\\xe9' at column 5 is not utf-8"),
    ],
)
def test_bad_lines(tmp_path, line, pattern):
    (tmp_path / "ub.csv").write_bytes(("1,2,3,pv,4\n" + line + "\n").encode("latin-1"))
    with pytest.raises(ValueError, match=pattern):
        convert_taobao(str(tmp_path / "ub.csv"), str(tmp_path / "o"), verbose=False)


def test_cli(tmp_path, capsys):
    (tmp_path / "ub.csv").write_text(UB)
    assert main([str(tmp_path / "ub.csv"), str(tmp_path / "o"), "--max-len", "4", "--behaviors", "pv,buy"]) == 0
    assert "slot_size_array: [2, 0, 0, 0, 0, 10, 0, 0, 0, 0, 8]" in capsys.readouterr().out
    assert main([str(tmp_path / "ub.csv"), str(tmp_path / "o"), "--behaviors", "click"]) == 1
