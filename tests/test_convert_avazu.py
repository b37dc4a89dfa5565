"""numbactr data avazu: Kaggle's CSV layout, hour -> hour of day and weekday, rare values, read back."""

import numpy as np
import pytest

from numbactr.data.convert.avazu import convert_avazu, main
from tests.realdata import offsets, read_back

HEADER = (
    "id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,app_domain,app_category,device_id,"
    "device_ip,device_model,device_type,device_conn_type,C14,C15,C16,C17,C18,C19,C20,C21"
)
ROW = "1000009418151094273,{c},{h},1005,0,{s},f3845767,28905ebd,ecad2386,7801e8d9,07d7df22,a99f214a,ddd2926e,44956a24,1,2,15706,320,50,1722,0,35,-1,79"  # noqa: E501


def write(path, rows, header=True):
    lines = ([HEADER] if header else []) + [ROW.format(c=c, h=h, s=s) for c, h, s in rows]
    path.write_text("\n".join(lines) + "\n")


ROWS = [(0, 14102100, "1fbe01fe"), (1, 14102100, "1fbe01fe"), (0, 14102123, "85f751fd"), (1, 14102201, "1fbe01fe")]


@pytest.mark.parametrize("fmt", ["norm", "raw", "parquet"])
def test_round_trip(tmp_path, fmt):
    write(tmp_path / "train.csv", ROWS)
    r = convert_avazu(str(tmp_path / "train.csv"), str(tmp_path / "o"), fmt, eval_fraction=0.25, verbose=False)
    assert (r.num_train, r.num_eval, r.slot_num) == (3, 1, 23)
    k = r.slot_names.index
    # min_count 2: site_id 85f751fd (once) -> 0; hour of day 0 (3 times), 23 (once) -> rare
    assert r.slot_size_array[k("site_id")] == 2 and r.slot_size_array[k("hour_of_day")] == 2
    assert r.slot_size_array[k("weekday")] == 2  # Tuesday 3 times, Wednesday once (rare)
    lab, _, keys = read_back(r, "train")
    ids = keys.astype(np.int64) - (offsets(r.slot_size_array) if fmt != "raw" else 0)
    assert list(lab) == [0, 1, 0]
    assert list(ids[:, k("site_id")]) == [1, 1, 0] and list(ids[:, k("hour_of_day")]) == [1, 1, 0]
    lab, _, keys = read_back(r, "eval")
    ids = keys.astype(np.int64) - (offsets(r.slot_size_array) if fmt != "raw" else 0)
    assert list(lab) == [1] and ids[0, k("weekday")] == 0


def test_eval_input(tmp_path):
    write(tmp_path / "a.csv", ROWS)
    write(tmp_path / "b.csv", ROWS[:2])
    r = convert_avazu(str(tmp_path / "a.csv"), str(tmp_path / "o"), "norm", eval_source=str(tmp_path / "b.csv"),
                      min_count=1, verbose=False)  # fmt: skip
    assert (r.num_train, r.num_eval, r.rows_read) == (4, 2, 6)
    k = r.slot_names.index
    _, _, keys = read_back(r, "train")
    ids = keys.astype(np.int64) - offsets(r.slot_size_array)
    # 2014-10-21 is a Tuesday (weekday 1), 2014-10-22 a Wednesday (2): values 1, 2 -> ids 1, 2
    assert list(ids[:, k("weekday")]) == [1, 1, 1, 2] and list(ids[:, k("hour_of_day")]) == [1, 1, 3, 2]


@pytest.mark.parametrize(
    "rows,pattern",
    [
        ([(2, 14102100, "a")], r"train.csv', line 3: click must be 0 or 1, got 2"),
        ([(0, 141021, "a")], r"train.csv', line 3: hour '141021' is not YYMMDDHH"),
        ([(0, 14102100, "a,b")], r"train.csv', line 3: 25 ','-separated fields, expected 24"),
    ],
)
def test_bad_lines(tmp_path, rows, pattern):
    write(tmp_path / "train.csv", ROWS[:1] + rows)
    with pytest.raises(ValueError, match=pattern):
        convert_avazu(str(tmp_path / "train.csv"), str(tmp_path / "o"), verbose=False)


def test_no_labels_or_header(tmp_path, capsys):
    (tmp_path / "test.csv").write_text(HEADER.replace("click,", "") + "\n")
    with pytest.raises(ValueError, match=r"line 1: .* has no 'click' column"):
        convert_avazu(str(tmp_path / "test.csv"), str(tmp_path / "o"), verbose=False)
    write(tmp_path / "train.csv", ROWS)
    assert main([str(tmp_path / "train.csv"), str(tmp_path / "o"), "--min-count", "1", "--quiet"]) == 0
    assert main([str(tmp_path / "test.csv"), str(tmp_path / "o")]) == 1
    assert "no 'click' column" in capsys.readouterr().err
