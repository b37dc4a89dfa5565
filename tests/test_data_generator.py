"""tools.DataGenerator (spec §2.6), the planted-signal dataset and roc_auc."""

import itertools
import os

import numpy as np
import pytest
from hypothesis import given, strategies as st

from numbactr.data.file_list import read_file_list
from numbactr.data.norm import NormReader, read_norm_file, read_norm_header
from numbactr.data.synthetic import criteo_like_slot_sizes, expected_auc, make_planted_dataset, power_law_keys, roc_auc
from numbactr.enums import Check_t, DataReaderType_t, Distribution_t, PowerLaw_t
from numbactr.tools import DataGenerator, DataGeneratorParams
from numbactr.config import DataReaderParams
from numbactr.data import make_reader


# ---------------------------------------------------------------------------------------------------
# roc_auc


def brute_auc(y, s):
    pos = [a for a, l in zip(s, y) if l == 1]
    neg = [a for a, l in zip(s, y) if l == 0]
    tot = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p, q in itertools.product(pos, neg))
    return tot / (len(pos) * len(neg))


@given(
    y=st.lists(st.integers(0, 1), min_size=2, max_size=60),
    s=st.lists(st.integers(0, 5), min_size=60, max_size=60),
    as_float=st.booleans(),
)
def test_roc_auc_equals_pairwise_with_ties(y, s, as_float):
    if len(set(y)) < 2:
        y = [0, 1] + y
    s = s[: len(y)]
    scores = np.array(s, dtype=np.float32 if as_float else np.int64) / 3
    labels = np.array(y, dtype=np.float32 if as_float else np.int64)
    assert roc_auc(labels, scores) == pytest.approx(brute_auc(y, list(scores)), abs=1e-12)


def test_roc_auc_known_values_and_errors():
    assert roc_auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) == 0.75  # sklearn's doc example
    assert roc_auc([0, 1], [0.5, 0.5]) == 0.5
    assert roc_auc([True, False], [1.0, 0.0]) == 1.0
    assert np.isnan(roc_auc([1, 1], [0.1, 0.2]))  # one class: undefined
    assert roc_auc([0.0, 0.5, 1.0], [0.1, 0.2, 0.3]) == pytest.approx(17 / 18)  # fractional labels weigh
    with pytest.raises(ValueError, match="NaN"):
        roc_auc([0, 1], [np.nan, 0.2])
    with pytest.raises(ValueError, match="labels"):
        roc_auc([0, 1, 1], [0.1, 0.2])


def test_expected_auc_matches_monte_carlo():
    rng = np.random.default_rng(0)
    p = 1 / (1 + np.exp(-(rng.standard_normal(4000) * 1.5 - 1)))
    draws = [roc_auc(rng.random(p.shape) < p, p) for _ in range(30)]
    assert expected_auc(p) == pytest.approx(np.mean(draws), abs=0.005)


# ---------------------------------------------------------------------------------------------------
# key samplers and cardinalities


def test_criteo_like_slot_sizes():
    a = criteo_like_slot_sizes(26, 100_000)
    assert a == criteo_like_slot_sizes(26, 100_000)  # deterministic
    assert len(a) == 26 and sum(a) == 100_000 and min(a) >= 2
    s = sorted(a, reverse=True)
    assert sum(s[:5]) > 0.8 * sum(a)  # a few large ...
    assert sum(v < 1000 for v in a) >= 13  # ... many small
    b = criteo_like_slot_sizes(7, 5000)
    assert len(b) == 7 and sum(b) == 5000
    with pytest.raises(ValueError):
        criteo_like_slot_sizes(26, 40)


def test_power_law_keys_range_and_skew():
    rng = np.random.default_rng(0)
    k = power_law_keys(rng, 200_000, 1000, 1.2)
    assert k.min() >= 0 and k.max() <= 999
    c = np.bincount(k, minlength=1000)
    # HugeCTR rounds y in [1, size]: key 0 only gets y in [1, 1.5), so key 1 is the most frequent
    assert c[1] > c[0] > c[3] > c[10] and c[:10].sum() > 0.3 * k.size
    with pytest.raises(ValueError):
        power_law_keys(rng, 10, 100, 1.0)


# ---------------------------------------------------------------------------------------------------
# planted dataset


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    out = tmp_path_factory.mktemp("planted")
    return make_planted_dataset(out, 200_000, 20_000, seed=3, files=(3, 2)), None


def test_planted_dataset_signal(planted):
    ds, _ = planted
    assert 0.75 <= ds.bayes_auc <= 0.80
    assert 0.2 <= ds.train_ctr <= 0.3 and 0.2 <= ds.eval_ctr <= 0.3
    assert roc_auc(ds.eval_labels, ds.eval_probs) == ds.bayes_auc
    # the logit really depends on slot keys, dense features and crosses
    assert (np.abs(ds.model.weights) > 0).all() and len(ds.model.pairs) == 3


def test_planted_dataset_files(planted):
    ds, _ = planted
    assert read_file_list(ds.train_list) == ds.train_files and len(ds.train_files) == 3
    assert read_file_list(ds.eval_list) == ds.eval_files and len(ds.eval_files) == 2
    assert ds.train_list.endswith(os.path.join("train", "_file_list.txt"))
    assert ds.eval_list.endswith(os.path.join("eval", "_file_list.txt"))
    assert sum(read_norm_header(f).number_of_records for f in ds.train_files) == 200_000
    sizes = np.array(ds.slot_size_array)
    assert sizes.sum() == 100_000 and len(sizes) == 26
    lo = ds.slot_offsets
    r = NormReader(ds.eval_list, 4096, 1, 13, [26], Check_t.Sum, np.int64, repeat=False)
    labels, keys = [], []
    for b in r:
        labels.append(b.label[: b.size, 0])
        keys.append(
            b.sparse[0][0].reshape(-1, 26)[: b.size]
            if b.size == 4096
            else b.sparse[0][0][: b.size * 26].reshape(-1, 26)
        )
        assert (b.nnz(0)[: b.size] == 1).all()
        assert np.isfinite(b.dense).all() and (b.dense >= 0).all()
    labels, keys = np.concatenate(labels), np.concatenate(keys)
    np.testing.assert_array_equal(labels, ds.eval_labels)
    assert set(np.unique(labels)) <= {0.0, 1.0}
    assert (keys >= lo).all() and (keys < lo + sizes).all()  # globally offset per slot
    # power law: within the biggest slot the most frequent key carries lots of mass
    big = int(np.argmax(sizes))
    c = np.bincount(keys[:, big] - lo[big])
    assert c.max() > 0.05 * keys.shape[0]
    # the stored probabilities are those of the model on the stored features
    b = read_norm_file(ds.eval_files[0], 1, 13, [26], Check_t.Sum, np.int64)
    local = b.sparse[0][0].reshape(-1, 26).astype(np.int64) - lo
    np.testing.assert_allclose(ds.model.probs(b.dense, list(local.T)), ds.eval_probs[: b.size], rtol=1e-5)


def test_planted_dataset_deterministic(tmp_path):
    a = make_planted_dataset(
        tmp_path / "a",
        3000,
        1000,
        slot_sizes=[50, 7, 300],
        dense_dim=3,
        seed=5,
        files=1,
        calibration_samples=5000,
        check=Check_t.Non,
        key_dtype=np.uint32,
    )
    b = make_planted_dataset(
        tmp_path / "b",
        3000,
        1000,
        slot_sizes=[50, 7, 300],
        dense_dim=3,
        seed=5,
        files=1,
        calibration_samples=5000,
        check=Check_t.Non,
        key_dtype=np.uint32,
    )
    for fa, fb in zip(a.train_files + a.eval_files, b.train_files + b.eval_files):
        assert open(fa, "rb").read() == open(fb, "rb").read()
    keys = read_norm_file(a.train_files[0], 1, 3, [3], Check_t.Non, np.uint32).sparse[0][0].reshape(-1, 3)
    assert keys[:, 0].max() < 50 and 50 <= keys[:, 1].min() and keys[:, 1].max() < 57
    assert 57 <= keys[:, 2].min() and keys[:, 2].max() < 357


# ---------------------------------------------------------------------------------------------------
# DataGenerator


def _params(tmp_path, **kw):
    args = dict(
        format=DataReaderType_t.Norm,
        label_dim=1,
        dense_dim=4,
        num_slot=3,
        i64_input_key=False,
        source=str(tmp_path / "data" / "file_list.txt"),
        eval_source=str(tmp_path / "data" / "file_list_test.txt"),
        slot_size_array=[10, 200, 5],
        num_files=2,
        eval_num_files=1,
        num_samples_per_file=500,
        seed=0,
    )
    args.update(kw)
    return DataGeneratorParams(**args)


def test_params_defaults_and_attributes(tmp_path):
    p = DataGeneratorParams(DataReaderType_t.Norm, 1, 13, 2, False, "a/b.txt", "a/c.txt", [4, 5])
    assert p.nnz_array == [1, 1] and p.check_type == Check_t.Sum
    assert p.dist_type == Distribution_t.PowerLaw and p.power_law_type == PowerLaw_t.Specific
    assert p.alpha == pytest.approx(1.2) and p.num_files == 128 and p.eval_num_files == 32
    assert p.num_samples_per_file == 40960 and p.num_samples == 5242880
    assert p.eval_num_samples == 1310720 and p.float_label_dense is False and p.num_threads == 1
    assert p.planted_signal is False and p.seed is None
    p.num_files = 3
    p.alpha = 2.0
    assert p.num_files == 3 and p.alpha == 2.0
    with pytest.raises(ValueError, match="slot_size_array"):
        DataGeneratorParams(DataReaderType_t.Norm, 1, 13, 2, False, "a", "b", [4])
    with pytest.raises(ValueError, match="nnz_array"):
        DataGeneratorParams(DataReaderType_t.Norm, 1, 13, 2, False, "a", "b", [4, 5], [1])
    with pytest.raises(ValueError, match="alpha"):
        DataGeneratorParams(DataReaderType_t.Norm, 1, 13, 2, False, "a", "b", [4, 5], alpha=1.0)
    with pytest.raises(ValueError, match="num_threads"):
        DataGeneratorParams(DataReaderType_t.Norm, 1, 13, 2, False, "a", "b", [4, 5], num_threads=0)


@pytest.mark.parametrize("check,i64", [(Check_t.Sum, False), (Check_t.Non, True)])
def test_generate_norm(tmp_path, check, i64):
    p = _params(tmp_path, check_type=check, i64_input_key=i64, nnz_array=[2, 1, 3])
    DataGenerator(p).generate()
    d = tmp_path / "data"
    assert read_file_list(p.source) == [f"{d}/train/gen_0.data", f"{d}/train/gen_1.data"]
    assert read_file_list(p.eval_source) == [f"{d}/val/gen_0.data"]
    kd = np.int64 if i64 else np.uint32
    lo = np.array([0, 10, 210])
    hi = lo + [10, 200, 5]
    for f in read_file_list(p.source) + read_file_list(p.eval_source):
        h = read_norm_header(f, check)
        assert (h.number_of_records, h.label_dim, h.dense_dim, h.slot_num) == (500, 1, 4, 3)
        b = read_norm_file(f, 1, 4, [3], check, kd)
        assert b.sparse[0][0].dtype == (np.int64 if i64 else np.uint64)
        assert (b.nnz(0) == [2, 1, 3]).all()
        assert (0 <= b.label).all() and (b.label < 1).all() and len(np.unique(b.label)) > 400
        assert (0 <= b.dense).all() and (b.dense < 1).all()
        keys = b.sparse[0][0].astype(np.int64).reshape(500, 6)
        slot = np.array([0, 0, 1, 2, 2, 2])
        assert (keys >= lo[slot]).all() and (keys < hi[slot]).all()
    # a reader over two inputs splits the slots
    r = NormReader(p.source, 300, 1, 4, [2, 1], check, kd, repeat=False)
    assert [b.size for b in r] == [300, 300, 300, 100]


def test_generate_distributions(tmp_path):
    def keys_of(dist, plt=PowerLaw_t.Specific, alpha=1.2, sub="x"):
        p = _params(
            tmp_path / sub,
            slot_size_array=[1000],
            num_slot=1,
            nnz_array=[4],
            dist_type=dist,
            power_law_type=plt,
            alpha=alpha,
            num_samples_per_file=5000,
            num_files=1,
        )
        DataGenerator(p).generate()
        return read_norm_file(read_file_list(p.source)[0], 1, 4, [1]).sparse[0][0].astype(np.int64)

    u = np.bincount(keys_of(Distribution_t.Uniform, sub="u"), minlength=1000)
    assert u.max() < 60 and (u > 0).sum() > 990
    pw = np.bincount(keys_of(Distribution_t.PowerLaw, sub="p"), minlength=1000)
    assert pw[0] > 0.1 * pw.sum() and pw[0] > pw[5] > pw[100]
    # named power-law types override alpha (Long 0.9 < Medium 1.1 < Short 1.3: shorter tail)
    heads = [
        np.mean(keys_of(Distribution_t.PowerLaw, t, alpha=3.0, sub=t.name) < 10)
        for t in (PowerLaw_t.Long, PowerLaw_t.Medium, PowerLaw_t.Short)
    ]
    assert heads[0] < heads[1] < heads[2] < 0.9


def test_generate_skips_existing_list_and_is_seeded(tmp_path, capsys):
    p = _params(tmp_path)
    DataGenerator(p).generate()
    f0 = read_file_list(p.source)[0]
    first = open(f0, "rb").read()
    os.remove(f0)
    DataGenerator(p).generate()  # list exists -> nothing regenerated
    assert not os.path.exists(f0) and "exist" in capsys.readouterr().out
    q = _params(tmp_path / "again")
    DataGenerator(q).generate()
    assert open(read_file_list(q.source)[0], "rb").read() == first  # same seed, same bytes


def test_generate_planted_signal(tmp_path):
    p = _params(tmp_path, planted_signal=True, num_samples_per_file=4000, slot_size_array=[20, 300, 8], label_dim=2)
    DataGenerator(p).generate()
    r = NormReader(p.source, 8000, 2, 4, [3], repeat=False)
    b = next(iter(r))
    assert b.size == 8000
    assert set(np.unique(b.label[:, 0])) == {0.0, 1.0} and (b.label[:, 1] == 0).all()
    assert 0.15 < b.label[:, 0].mean() < 0.35


@pytest.mark.parametrize("fld", [False, True])
def test_generate_raw(tmp_path, fld):
    p = _params(
        tmp_path,
        format=DataReaderType_t.Raw,
        source=str(tmp_path / "raw" / "train.bin"),
        eval_source=str(tmp_path / "raw" / "eval.bin"),
        num_samples=1001,
        eval_num_samples=77,
        float_label_dense=fld,
        slot_size_array=[10, 200, 5],
    )
    DataGenerator(p).generate()
    assert os.path.getsize(p.source) == 1001 * 4 * (1 + 4 + 3)
    assert os.path.getsize(p.eval_source) == 77 * 4 * (1 + 4 + 3)
    words = np.fromfile(p.source, "<i4").reshape(1001, 8)
    ld = words[:, :5].view("<f4") if fld else words[:, :5]
    assert (ld[:, 0] == np.arange(1001) % 2).all()  # label i % 2
    assert (ld[:, 1:] == np.arange(4)).all()  # dense column j = j
    keys = words[:, 5:]
    # per-slot keys in [0, size_k), as HugeCTR's generator writes them (the one-hot embeddings add the offsets)
    assert (keys >= 0).all() and (keys < [10, 200, 5]).all()
    assert (keys[:, 1] >= 10).any()  # not squeezed into the smallest slot's range
    prm = DataReaderParams(
        DataReaderType_t.Raw,
        p.source,
        p.eval_source,
        Check_t.Non,
        num_samples=1001,
        eval_num_samples=77,
        float_label_dense=fld,
        num_workers=2,
    )
    b = next(iter(make_reader(prm, p.eval_source, 100, 1, 4, [3], None, False, False, eval=True)))
    assert b.size == 77
    want = np.arange(4, dtype=np.float32) if fld else np.log(np.arange(4, dtype=np.float32) + np.float32(1))
    np.testing.assert_array_equal(b.dense[:77], np.broadcast_to(want, (77, 4)))
    with pytest.raises(ValueError, match="one key per slot"):
        DataGenerator(_params(tmp_path, format=DataReaderType_t.Raw, nnz_array=[1, 2, 1])).generate()


def test_generate_raw_planted(tmp_path):
    p = _params(
        tmp_path,
        format=DataReaderType_t.Raw,
        source=str(tmp_path / "t.bin"),
        eval_source=str(tmp_path / "e.bin"),
        num_samples=6000,
        eval_num_samples=10,
        planted_signal=True,
    )
    DataGenerator(p).generate()
    lab = np.fromfile(p.source, "<i4").reshape(6000, 8)[:, 0]
    assert set(np.unique(lab)) == {0, 1} and 0.15 < lab.mean() < 0.35


@pytest.mark.parametrize("i64", [False, True])
def test_generate_parquet(tmp_path, i64):
    import json

    import pyarrow.parquet as pq

    p = _params(
        tmp_path,
        format=DataReaderType_t.Parquet,
        nnz_array=[1, 3, 1],
        i64_input_key=i64,
        source=str(tmp_path / "pq" / "_file_list.txt"),
        eval_source=str(tmp_path / "pq" / "_file_list_eval.txt"),
    )
    DataGenerator(p).generate()
    d = tmp_path / "pq"
    assert read_file_list(p.source) == [f"{d}/train/gen_0.parquet", f"{d}/train/gen_1.parquet"]
    assert read_file_list(p.eval_source) == [f"{d}/val/gen_0.parquet"]
    meta = json.load(open(d / "train" / "_metadata.json"))
    assert [c["col_name"] for c in meta["labels"] + meta["conts"] + meta["cats"]] == [
        "label0",
        "C1",
        "C2",
        "C3",
        "C4",
        "C5",
        "C6",
        "C7",
    ]
    assert [c["index"] for c in meta["cats"]] == [5, 6, 7]
    t = pq.read_table(read_file_list(p.source)[0])
    assert t.num_rows == 500 and t.column_names[0] == "label0"
    lens = np.array([len(v) for v in t.column("C6").to_pylist()])
    assert lens.min() == 1 and lens.max() == 3  # 1 + rand() % nnz
    c5 = t.column("C5").to_numpy()
    assert c5.dtype == np.int64 and c5.min() >= 0 and c5.max() < 10  # local keys, not offset
    prm = DataReaderParams(DataReaderType_t.Parquet, p.source, p.eval_source, Check_t.Non, slot_size_array=[10, 200, 5])
    got = list(make_reader(prm, p.source, 256, 1, 4, [3], [[1, 3, 1]], i64, False))
    assert sum(b.size for b in got) == 1000
    b = got[0]
    assert (0 <= b.label).all() and (b.label < 1).all() and (0 <= b.dense).all() and (b.dense < 1).all()
    nnz = b.nnz(0)
    assert (nnz[:, 0] == 1).all() and (nnz[:, 2] == 1).all() and set(np.unique(nnz[:, 1])) == {1, 2, 3}
    keys, off = b.sparse[0]
    first = keys[off[:-1:3]]  # slot 0 of every sample
    assert first.max() < 10 and keys[off[2::3][:256]].min() >= 210  # slot 2 offset by 10 + 200


def test_generate_parquet_planted(tmp_path):
    p = _params(
        tmp_path,
        format=DataReaderType_t.Parquet,
        planted_signal=True,
        num_samples_per_file=3000,
        source=str(tmp_path / "pq" / "_file_list.txt"),
        eval_source=str(tmp_path / "pq" / "_e.txt"),
    )
    DataGenerator(p).generate()
    prm = DataReaderParams(DataReaderType_t.Parquet, p.source, p.eval_source, Check_t.Non, slot_size_array=[10, 200, 5])
    lab = np.concatenate([b.label[: b.size, 0] for b in make_reader(prm, p.source, 1000, 1, 4, [3], None, True, False)])
    assert set(np.unique(lab)) == {0.0, 1.0} and 0.15 < lab.mean() < 0.35


def test_tools_exports():
    import numbactr.tools as tools

    assert tools.DataGenerator is DataGenerator and tools.DataGeneratorParams is DataGeneratorParams
