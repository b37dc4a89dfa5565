"""config.pbtxt as numbactr serve reads it (numbactr.serve.pbtxt, numbactr.serve.repository): HugeCTR's own
Triton configuration parses, and every mistake is an error naming the file and line; the KServe v2 body
parser (numbactr.serve.protocol) refuses malformed bodies with what is wrong."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from numbactr.cli import main as cli
from numbactr.serve.pbtxt import PbtxtError, parse
from numbactr.serve.protocol import RequestError, encode_response, parse_request
from numbactr.serve.repository import RepositoryError, read_config

# HugeCTR's DCN example for its Triton backend (hugectr_backend/samples/dcn/config.pbtxt), as users have it
HUGECTR_DCN = """name: "dcn"
backend: "hugectr"
max_batch_size:64,
input [
   {
    name: "DES"
    data_type: TYPE_FP32
    dims: [ -1 ]
  },
  {
    name: "CATCOLUMN"
    data_type: TYPE_INT64
    dims: [ -1 ]
  },
  {
    name: "ROWINDEX"
    data_type: TYPE_INT32
    dims: [ -1 ]
  }
]
output [
  {
    name: "OUTPUT0"
    data_type: TYPE_FP32
    dims: [ -1 ]
  }
]
instance_group [
  {
    count: 1
    kind : KIND_GPU
    gpus:[0]
  }
]
dynamic_batching {
  preferred_batch_size: [ 16, 32 ]
  max_queue_delay_microseconds: 100   # Triton's default is 0
}
parameters [
  { key: "config" value: { string_value: "/model/dcn/1/dcn.json" } },
  { key: "gpucache" value: { string_value: "true" } },
  { key: "hit_rate_threshold" value: { string_value: "0.8" } },
  { key: "gpucacheper" value: { string_value: "0.5" } },
  { key: "label_dim" value: { string_value: "1" } },
  { key: "slots" value: { string_value: "26" } },
  { key: "cat_feature_num" value: { string_value: "26" } },
  { key: "des_feature_num" value: { string_value: "13" } },
  { key: "max_nnz" value: { string_value: "2" } },
  { key: "embedding_vector_size" value: { string_value: "128" } },
  { key: "embeddingkey_long_type" value: { string_value: "true" } }
]
"""


def _write(tmp_path, text):
    path = tmp_path / "config.pbtxt"
    path.write_text(text)
    return str(path)


def test_hugectrs_dcn_config_parses(tmp_path):
    cfg = read_config(_write(tmp_path, HUGECTR_DCN), "dcn")
    assert cfg.max_batch_size == 64 and cfg.dynamic_batching
    assert cfg.preferred_batch_size == [16, 32] and cfg.max_queue_delay_microseconds == 100
    assert [t.datatype for t in cfg.inputs.values()] == ["FP32", "INT64", "INT32"]
    assert cfg.parameters["slots"] == 26 and cfg.parameters["gpucache"] is True
    assert cfg.parameters["gpucacheper"] == 0.5 and cfg.parameters["config"] == "/model/dcn/1/dcn.json"
    assert cfg.as_json()["parameters"]["embeddingkey_long_type"] == {"string_value": "true"}
    assert cfg.instances == 1  # instance_group count 1
    two = read_config(_write(tmp_path, HUGECTR_DCN.replace("count: 1", "count: 2")), "dcn")
    assert two.instances == 2 and two.as_json()["instance_group"][0]["count"] == 2


def test_text_format_grammar():
    tree = parse('a: "x" "y"  # comment\nb { c: [1, 2.5, -3] d: E_NUM } b < c: 0x10 >; e: true,')
    assert tree["a"][0].value == "xy" and tree["a"][0].line == 1
    assert [v.value for v in tree["b"][0].value["c"]] == [1, 2.5, -3]
    assert tree["b"][1].value["c"][0].value == 16 and tree["e"][0].value == "true"
    for text, where in (('a: "open', "1"), ("a {\n b: 1\n", "2"), ("a: ?", "1"), ("\n\na b", "3")):
        with pytest.raises(PbtxtError, match=rf"<config.pbtxt>:{where}:"):
            parse(text)


@pytest.mark.parametrize(
    "old, new, line, words",
    [
        ('backend: "hugectr"', 'backend: "onnxruntime"', 2, "numbactr serves backend"),
        ('name: "dcn"', 'name: "other"', 1, "differs from the model's folder name"),
        ("max_batch_size:64,", "max_batch_size: 0", 3, "must be >= 1"),
        ("max_batch_size:64,", 'max_batch_size: "64"', 3, "must be an integer"),
        ("    data_type: TYPE_INT64", "    data_type: TYPE_FP32", 12, "CATCOLUMN"),
        ('    name: "ROWINDEX"', '    name: "ROWS"', 16, "input 'ROWS'"),
        (
            '    dims: [ -1 ]\n  },\n  {\n    name: "CATCOLUMN"',
            '    dims: [ 13 ]\n  },\n  {\n    name: "CATCOLUMN"',
            8,
            "dims [13]",
        ),  # fmt: skip
        ("instance_group [", "instance_groups [", 29, "unknown field 'instance_groups'"),
        ("kind : KIND_GPU", "kind : KIND_TPU", 31, "instance_group kind KIND_TPU is not one of"),
        ("count: 1", "count: 0", 30, "instance_group count must be >= 1"),
        ("count: 1", "cores: 1", 30, "unknown field 'cores'"),
        (
            '{ key: "slots" value: { string_value: "26" } }',
            '{ key: "slots" value: { string_value: "x" } }',
            45,
            "'slots': 'x' is not int",
        ),  # fmt: skip
        (
            '{ key: "slots" value: { string_value: "26" } }',
            '{ key: "slot" value: { string_value: "26" } }',
            45,
            "unknown parameter 'slot'",
        ),  # fmt: skip
        ("preferred_batch_size: [ 16, 32 ]", "preferred_batch_size: [ 16, 128 ]", 36, "[1, max_batch_size 64]"),
        ('string_value: "true" } }\n]', 'string_value: "false" } }\n]', 1, "disagrees with CATCOLUMN"),
    ],
)
def test_config_mistakes_name_file_and_line(tmp_path, old, new, line, words):
    assert old in HUGECTR_DCN
    path = _write(tmp_path, HUGECTR_DCN.replace(old, new, 1))
    with pytest.raises(RepositoryError) as e:
        read_config(path, "dcn")
    assert str(e.value).startswith(f"{path}:{line}:") and words in str(e.value), str(e.value)


def test_serve_stops_with_the_reason_when_a_model_cannot_load(tmp_path, capsys):
    pytest.importorskip("uvicorn")  # serve imports it before it reads the repository
    (tmp_path / "dcn").mkdir()
    (tmp_path / "dcn" / "config.pbtxt").write_text(HUGECTR_DCN.replace("TYPE_INT32", "TYPE_INT16"))
    assert cli(["serve", "--model-repository", str(tmp_path), "--http-port", "1"]) == 1
    err = capsys.readouterr().err
    assert "config.pbtxt:17:" in err and "data_type TYPE_INT16 is not TYPE_INT32" in err
    (tmp_path / "dcn" / "config.pbtxt").write_text(HUGECTR_DCN)
    assert cli(["serve", "--model-repository", str(tmp_path), "--http-port", "1"]) == 1
    assert "no version folder" in capsys.readouterr().err
    assert cli(["serve", "--model-repository", str(tmp_path), "--backend-config=onnx,x=1"]) == 1
    assert "hugectr,ps=PATH" in capsys.readouterr().err


def _body(**fields):
    return json.dumps({"inputs": [{"name": "DES", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}], **fields})


def test_request_bodies():
    req = parse_request(_body(outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": True}}]).encode(), None)
    assert req.inputs["DES"].data.tolist() == [1.0, 2.0] and req.outputs == {"OUTPUT0": True}
    # binary tensors after the JSON, and a gzip body
    head = json.dumps(
        {"inputs": [{"name": "K", "datatype": "INT64", "shape": [1, 3], "parameters": {"binary_data_size": 24}}]}
    ).encode()
    body = head + np.arange(3, dtype=np.int64).tobytes()
    req = parse_request(gzip.compress(body), str(len(head)), "gzip")
    assert req.inputs["K"].data.tolist() == [0, 1, 2]
    bad = [
        (body[:-1], str(len(head)), "truncated"),
        (body + b"x", str(len(head)), "1 bytes after"),
        (body, "nine", "not an integer"),
        (_body(id=3).encode(), None, "'id' must be a string"),
        (_body(inputs2=[]).encode(), None, "unknown field(s) ['inputs2']"),
        (_body().replace('"FP32"', '"FP33"').encode(), None, "datatype 'FP33'"),
        (_body().replace("[1.0, 2.0]", '[1.0, "a"]').encode(), None, "data[1] = 'a' is not a FP32 value"),
        (_body().replace('"FP32"', '"INT32"').encode(), None, "data[0] = 1.0 is not a INT32 value"),
        (_body().replace('"FP32"', '"UINT32"').replace("1.0, 2.0", "1, -2").encode(), None, "out of UINT32's range"),
    ]
    for b, n, words in bad:
        with pytest.raises(RequestError) as e:
            parse_request(b, n)
        assert words in str(e.value), (words, str(e.value))


def test_binary_response_layout():
    body, headers = encode_response(
        "m", "1", "r", {"OUTPUT0": ("FP32", [1, 2], np.float32([0.5, 0.25]))}, {"OUTPUT0": True}
    )
    n = int(headers["Inference-Header-Content-Length"])
    doc = json.loads(body[:n])
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == 8 and doc["id"] == "r"
    assert np.frombuffer(body[n:], np.float32).tolist() == [0.5, 0.25]
