"""hugectr.data.DataSourceParams (numbactr.data.source): HugeCTR's arguments and defaults, how a data path
resolves (local, a URI's scheme, the filesystem DataSourceParams names), reading Norm/Raw/RawAsync/Parquet
data through real fsspec filesystems (memory://, file://), and the errors for what is missing."""

import os
import pathlib

import numpy as np
import pytest

import numbactr as hugectr
from numbactr.data import DataSourceParams
from numbactr.data.file_list import write_file_list
from numbactr.data.raw import write_raw_file
from numbactr.data.reader import DataReader
from numbactr.data.source import local_copy, remote_uri
from numbactr.enums import DataReaderType_t as T, FileSystemType_t as F

fsspec = pytest.importorskip("fsspec")


def test_arguments_defaults_and_errors():
    d = hugectr.data.DataSourceParams()
    assert (d.source, d.server, d.port) == (F.Local, "localhost", 9000) and d.is_local()
    h = DataSourceParams(source=hugectr.FileSystemType_t.HDFS, server="10.19.172.76", port=9000)  # the notebook
    assert (h.source, h.server, h.port) == (F.HDFS, "10.19.172.76", 9000)
    h.port = 8020  # read-write attributes, as in pybind
    assert h == DataSourceParams(F.HDFS, "10.19.172.76", 8020) and "HDFS" in repr(h)
    for kw, msg in [
        (dict(source="HDFS"), "source must be a FileSystemType_t"),
        (dict(server=5), "server"),
        (dict(port=70000), "port"),
        (dict(port=True), "port"),
    ]:
        with pytest.raises(ValueError, match=msg):
            DataSourceParams(**kw)
    with pytest.raises(ValueError, match="data_source_params must be a hugectr.data.DataSourceParams"):
        hugectr.DataReaderParams(
            data_reader_type=T.Norm,
            source=["x"],
            eval_source="y",
            check_type=hugectr.Check_t.Sum,
            data_source_params="hdfs://a:1",
        )


def test_path_resolution():
    hdfs = DataSourceParams(F.HDFS, "nn", 9000)
    assert remote_uri("/data/a.bin") is None and remote_uri("rel/a.bin", DataSourceParams()) is None
    assert remote_uri("/data/a.parquet", hdfs) == "hdfs://nn:9000/data/a.parquet"
    assert (
        remote_uri("data/a.parquet", hdfs) == remote_uri("./data//a.parquet", hdfs) == "hdfs://nn:9000/data/a.parquet"
    )
    assert remote_uri("/bucket/k/a.parquet", DataSourceParams(F.S3, "us-east-1", 9000)) == "s3://bucket/k/a.parquet"
    assert remote_uri("/bucket/a.parquet", DataSourceParams(F.GCS, "", 0)) == "gs://bucket/a.parquet"
    assert remote_uri("S3://bucket/a") == "s3://bucket/a" and remote_uri("GS://b/a") == "gs://b/a"
    assert remote_uri("hdfs://other:1/x", DataSourceParams()) == "hdfs://other:1/x"  # the scheme wins
    with pytest.raises(ValueError, match=r"FileSystemType_t.Other\) is not a supported filesystem"):
        remote_uri("/x", DataSourceParams(F.Other, "", 0))


def test_unknown_scheme_missing_file_and_missing_backend():
    with pytest.raises(ValueError, match=r"unknown filesystem scheme 'nosuchfs://'"):
        local_copy("nosuchfs://host/a.bin")
    with pytest.raises(FileNotFoundError, match=r"data file 'memory://numbactr-test/none\.bin' does not exist"):
        local_copy("memory://numbactr-test/none.bin")
    # a protocol fsspec knows whose backend package is not installed here names what is missing
    from fsspec.registry import known_implementations

    missing = [
        p
        for p in ("s3", "gs", "abfs", "oci")
        if p in known_implementations and _import_fails(known_implementations[p]["class"].rsplit(".", 1)[0])
    ]
    if not missing:
        pytest.skip("every remote backend is installed")
    with pytest.raises(ImportError, match=f"the {missing[0]}:// filesystem is not installed"):
        local_copy(f"{missing[0]}://bucket/a.bin")


def _import_fails(module: str) -> bool:
    import importlib

    try:
        importlib.import_module(module)
        return False
    except ImportError:
        return True


def _norm_data(folder, n=40):
    from numbactr.data.norm import write_norm_file

    rng = np.random.default_rng(0)
    label = rng.integers(0, 2, n).astype(np.float32)
    dense = rng.normal(size=(n, 2)).astype(np.float32)
    keys = rng.integers(0, 100, (n, 3))
    paths = []
    for f, idx in enumerate(np.array_split(np.arange(n), 2)):
        p = os.path.join(folder, f"part{f}.data")
        write_norm_file(p, label[idx], dense[idx], keys[idx].astype(np.int64), key_dtype=np.int64)
        paths.append(p)
    return paths


def _batches(reader):
    return [(b.label.copy(), b.dense.copy(), [k.copy() for k, _ in b.sparse]) for b in reader]


def _same(a, b):
    assert len(a) == len(b)
    for (l1, d1, k1), (l2, d2, k2) in zip(a, b):
        np.testing.assert_array_equal(l1, l2)
        np.testing.assert_array_equal(d1, d2)
        for x, y in zip(k1, k2):
            np.testing.assert_array_equal(x, y)


def test_norm_file_list_of_memory_uris_reads_like_the_local_files(tmp_path):
    paths = _norm_data(str(tmp_path))
    fs = fsspec.filesystem("memory")
    uris = []
    for p in paths:
        uri = f"memory://numbactr-norm/{os.path.basename(p)}"
        fs.pipe(uri, pathlib.Path(p).read_bytes())
        uris.append(uri)
    lst_local, lst_remote = str(tmp_path / "local.txt"), str(tmp_path / "remote.txt")
    write_file_list(lst_local, paths)
    write_file_list(lst_remote, uris)
    want = _batches(DataReader(T.Norm, lst_local, 16, 1, 2, [3], None, True, False, num_workers=2))
    got = _batches(DataReader(T.Norm, lst_remote, 16, 1, 2, [3], None, True, False, num_workers=2))
    _same(got, want)
    # the file list itself may be a URI too
    fs.pipe("memory://numbactr-norm/list.txt", pathlib.Path(lst_remote).read_bytes())
    _same(
        _batches(
            DataReader(T.Norm, "memory://numbactr-norm/list.txt", 16, 1, 2, [3], None, True, False, num_workers=2)
        ),
        want,
    )
    with pytest.raises(FileNotFoundError, match="memory://numbactr-norm/gone.data' does not exist"):
        write_file_list(lst_remote, uris + ["memory://numbactr-norm/gone.data"])
        DataReader(T.Norm, lst_remote, 16, 1, 2, [3], None, True, False, num_workers=2)


def test_raw_and_raw_async_through_file_uris_and_a_changed_remote_file(tmp_path):
    p = str(tmp_path / "d.bin")
    rng = np.random.default_rng(1)
    write_raw_file(p, rng.integers(0, 2, (30, 1)), rng.integers(0, 9, (30, 2)), rng.integers(0, 50, (30, 4)))
    want = _batches(DataReader(T.Raw, p, 8, 1, 2, [4], None, False, False, num_workers=1, num_samples=30))
    uri = "file://" + p
    _same(_batches(DataReader(T.Raw, uri, 8, 1, 2, [4], None, False, False, num_workers=1, num_samples=30)), want)
    ap = hugectr.AsyncParam(2, 2, 10, 2, 512, False, multi_hot_reader=False, is_dense_float=False)
    _same(_batches(DataReader(T.RawAsync, uri, 8, 1, 2, [4], None, False, False, async_param=ap)), want)
    fs = fsspec.filesystem("memory")
    fs.pipe("memory://numbactr-raw/d.bin", pathlib.Path(p).read_bytes())
    r = DataReader(T.RawAsync, "memory://numbactr-raw/d.bin", 8, 1, 2, [4], None, False, False, async_param=ap)
    _same(_batches(r), want)
    fs.pipe("memory://numbactr-raw/d.bin", pathlib.Path(p).read_bytes()[: 20 * 28])  # replaced by 20 samples
    r.set_source("memory://numbactr-raw/d.bin")  # fetched again
    assert sum(b.size for b in r) == 20
    same_size = bytearray(pathlib.Path(p).read_bytes()[: 20 * 28])
    same_size[4] ^= 0x01  # dense[0] of sample 0: 1 bit flipped
    fs.pipe("memory://numbactr-raw/d.bin", bytes(same_size))  # same size, new content
    r.set_source("memory://numbactr-raw/d.bin")
    assert next(iter(r)).dense[0, 0] != want[0][1][0, 0]


def test_parquet_on_a_remote_filesystem_with_its_metadata(tmp_path):
    pytest.importorskip("pyarrow")
    from numbactr.data.parquet import ParquetDatasetWriter

    rng = np.random.default_rng(2)
    w = ParquetDatasetWriter(str(tmp_path / "pq"), 1, 2, 3)
    files = [
        w.write_file(
            f"part_{f}.parquet", rng.integers(0, 2, (25, 1)), rng.normal(size=(25, 2)), rng.integers(0, 10, (25, 3))
        )
        for f in range(2)
    ]
    w.close()
    fs = fsspec.filesystem("memory")
    names = sorted(os.listdir(tmp_path / "pq"))
    for name in names:
        fs.pipe(f"memory://numbactr-pq/{name}", pathlib.Path(tmp_path / "pq" / name).read_bytes())
    local_list, remote_list = str(tmp_path / "l.txt"), str(tmp_path / "r.txt")
    write_file_list(local_list, files)
    write_file_list(remote_list, [f"memory://numbactr-pq/{os.path.basename(f)}" for f in files])
    kw = dict(num_workers=1, slot_size_array=[10, 10, 10])
    want = _batches(DataReader(T.Parquet, local_list, 16, 1, 2, [3], None, True, False, **kw))
    _same(_batches(DataReader(T.Parquet, remote_list, 16, 1, 2, [3], None, True, False, **kw)), want)


def test_data_reader_params_accepts_it_and_the_model_reads_hdfs_style_paths_via_memory(cpu, tmp_path):
    """The HDFS notebook's shape: DataSourceParams in DataReaderParams, a local file list naming URIs; here the
    URIs are memory:// (no namenode on a test machine), read by Model.fit like local files."""
    from numbactr.data.file_list import read_file_list
    from tests.model_util import tiny_data, tiny_dlrm

    train, evl = tiny_data(str(tmp_path), n_train=128, n_eval=64, files=2)
    fs = fsspec.filesystem("memory")
    lists = {}
    for name, lst in (("train", train), ("eval", evl)):
        uris = []
        for p in read_file_list(lst):
            uri = f"memory://numbactr-model/{name}/{os.path.basename(p)}"
            fs.pipe(uri, pathlib.Path(p).read_bytes())
            uris.append(uri)
        lists[name] = str(tmp_path / f"{name}_remote.txt")
        write_file_list(lists[name], uris)
    local = tiny_dlrm(train, evl, batch=32)
    local.reader_params.num_workers = 2
    local.fit(max_iter=6, display=1, eval_interval=6, snapshot=0)
    remote = tiny_dlrm(lists["train"], lists["eval"], batch=32)
    remote.reader_params = hugectr.DataReaderParams(
        data_reader_type=T.Norm,
        source=[lists["train"]],
        eval_source=lists["eval"],
        check_type=hugectr.Check_t.Sum,
        num_workers=2,
        data_source_params=hugectr.data.DataSourceParams(
            source=hugectr.FileSystemType_t.HDFS, server="namenode", port=9000
        ),
    )
    remote.fit(max_iter=6, display=1, eval_interval=6, snapshot=0)
    assert remote.history["loss"] == local.history["loss"] and remote.history["auc"] == local.history["auc"]
    # inference reads the same way (InferenceModel.predict(..., data_source_params), as HugeCTR's)
    from numbactr.inference import InferenceModel, InferenceParams

    local.graph_to_json(str(tmp_path / "graph.json"))
    local.save_params_to_files(str(tmp_path / "m"), 6)
    model = InferenceModel(
        str(tmp_path / "graph.json"),
        InferenceParams(
            model_name="m",
            max_batchsize=32,
            hit_rate_threshold=1.0,
            dense_model_file=str(tmp_path / "m_dense_6.model"),
            sparse_model_files=[str(tmp_path / "m0_sparse_6.model")],
            use_gpu_embedding_cache=False,
            cache_size_percentage=0.5,
            i64_input_key=True,
        ),
    )
    want = model.predict(2, evl, T.Norm, hugectr.Check_t.Sum)
    got = model.predict(
        2,
        lists["eval"],
        T.Norm,
        hugectr.Check_t.Sum,
        data_source_params=hugectr.data.DataSourceParams(hugectr.FileSystemType_t.HDFS, "nn", 9000),
    )
    np.testing.assert_array_equal(got, want)


def test_older_data_source_params_forms():
    # v3.5-v3.7: DataSourceParams(use_hdfs, namenode, port), positionally or by keyword
    a = DataSourceParams(True, "nn", 9000)
    b = hugectr.data.DataSourceParams(use_hdfs=True, namenode="nn", port=9000)
    assert a == b == DataSourceParams(F.HDFS, "nn", 9000) and a.use_hdfs and a.namenode == "nn"
    b.use_hdfs, b.namenode = False, "other"
    assert (b.source, b.server) == (F.Local, "other")
    # v3.4: the paths DataSource.move_to_local copies (test/pybind_test/data_source_test.py)
    p = DataSourceParams(
        use_hdfs=True,
        namenode="localhost",
        port=9000,
        hdfs_train_source="/data/train/",
        local_train_filelist="./wdl/file_list.txt",
        hdfs_sparse_model=["/m/0_sparse.model/"],
    )
    assert p.hdfs_train_source == "/data/train/" and p.local_train_filelist == "./wdl/file_list.txt"
    assert p.hdfs_sparse_model == ["/m/0_sparse.model/"] and p.local_sparse_model == [] and p.hdfs_eval_source == ""
    with pytest.raises(TypeError, match="unexpected argument"):
        DataSourceParams(hdfs_train_sources="/x")
    with pytest.raises(ValueError, match="use_hdfs"):
        DataSourceParams(use_hdfs="yes")
    with pytest.raises(ValueError, match="hdfs_sparse_model must be a list"):
        DataSourceParams(hdfs_sparse_model="/m/")


def test_data_source_move_to_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    remote = tmp_path / "remote"
    (remote / "train").mkdir(parents=True)
    (remote / "train" / "sub").mkdir()  # folders inside a source folder are not copied
    for i in range(2):
        (remote / "train" / f"part{i}.parquet").write_bytes(bytes([i]) * 10)
    (remote / "file_list.txt").write_text("2\n")
    (remote / "dense.model").write_bytes(b"d" * 8)
    (remote / "0_sparse.model").mkdir()
    (remote / "0_sparse.model" / "key").write_bytes(b"k" * 8)
    (remote / "0_opt_sparse.model").write_bytes(b"o" * 4)
    url = f"file://{remote}"
    p = hugectr.data.DataSourceParams(
        use_hdfs=True,
        namenode="unused",
        port=9000,
        hdfs_train_source=url + "/train/",
        local_train_source="./wdl/train/",
        hdfs_train_filelist=url + "/file_list.txt",
        local_train_filelist="./wdl/file_list.txt",
        hdfs_dense_model=url + "/dense.model",
        local_dense_model="./model/",
        hdfs_sparse_model=[url + "/0_sparse.model/"],
        local_sparse_model=["./model/0_sparse.model/"],
        hdfs_sparse_opt_states=[url + "/0_opt_sparse.model"],
        local_sparse_opt_states=["./model/0_opt_sparse.model"],
    )
    got = hugectr.data.DataSource(p).move_to_local()
    assert sorted(os.path.relpath(g) for g in got) == sorted(
        [
            "wdl/train/part0.parquet",
            "wdl/train/part1.parquet",
            "wdl/file_list.txt",
            "model/dense.model",
            "model/0_sparse.model/key",
            "model/0_opt_sparse.model",
        ]
    )
    assert (tmp_path / "wdl/train/part1.parquet").read_bytes() == b"\x01" * 10
    assert not (tmp_path / "wdl/train/sub").exists()
    assert (tmp_path / "model/0_sparse.model/key").read_bytes() == b"k" * 8
    # v3.7's form: one file
    out = hugectr.data.DataSource(p).move_to_local(url + "/dense.model", "./one/dense.model")
    assert out == ["./one/dense.model"] and (tmp_path / "one/dense.model").read_bytes() == b"d" * 8
    # a path without a scheme is on the namenode the params name
    assert hugectr.data.DataSource(p)._uri("/data/train/") == "hdfs://unused:9000/data/train"
    # errors: a missing remote file, unequal lists, half a pair
    bad = DataSourceParams(hdfs_dense_model=url + "/nope.model", local_dense_model="./m")
    with pytest.raises(FileNotFoundError, match="nope.model"):
        hugectr.data.DataSource(bad).move_to_local()
    bad = DataSourceParams(hdfs_sparse_model=[url + "/0_sparse.model/"] * 2, local_sparse_model=["./a/"])
    with pytest.raises(ValueError, match="2 HDFS and 1 local sparse models"):
        hugectr.data.DataSource(bad).move_to_local()
    with pytest.raises(ValueError, match="give both paths"):
        hugectr.data.DataSource(p).move_to_local(url + "/dense.model")
    with pytest.raises(IsADirectoryError):
        hugectr.data.DataSource(p).move_to_local(url + "/train", "./x")
