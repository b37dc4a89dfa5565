"""The KServe v2 inference protocol's request and response bodies, with Triton's binary-data extension.

A request body is JSON::

    {"id": "...", "parameters": {"binary_data_output": true},
     "inputs": [{"name": "DES", "datatype": "FP32", "shape": [1, 26], "data": [...]}, ...],
     "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": true}}]}

Triton's binary extension (what tritonclient sends by default): the header ``Inference-Header-Content-Length:
L`` says that the JSON is the body's first L bytes; an input with ``"parameters": {"binary_data_size": n}``
has no "data" and its n bytes (little-endian, row-major) follow the JSON, in input order. A response
carries an output in binary the same way when the request asked (``binary_data`` on the output, or
``binary_data_output`` on the request): its JSON gives ``binary_data_size`` and the bytes follow.

What numbactr does: the same bodies, parsed strictly. Every violation is a RequestError (HTTP 400 with
``{"error": ...}``) naming the tensor and what is wrong: malformed JSON, a missing or unknown field, a
datatype the protocol does not have, a shape whose element count disagrees with the data, a binary size
that is not shape x element size, a body shorter than its header and binary sizes say (truncated), or
bytes left over. Request bodies compressed with gzip or deflate (``Content-Encoding``) are inflated first.
Checks that need the model (which inputs, their datatypes and lengths) are numbactr.serve.infer's.
"""

from __future__ import annotations

import json
import math
import zlib

import numpy as np

__all__ = ["RequestError", "Tensor", "InferRequest", "parse_request", "encode_response", "NUMPY"]

#: KServe v2 datatypes numbactr reads and writes -> numpy (little-endian)
NUMPY = {
    "BOOL": np.dtype(bool),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
HEADER = "inference-header-content-length"


class RequestError(ValueError):
    """A request the server cannot answer; ``status`` is the HTTP code (400 unless said otherwise)."""

    def __init__(self, msg: str, status: int = 400):
        super().__init__(msg)
        self.status = status


class Tensor:
    """An input tensor: name, datatype, shape and its data (a flat numpy array of that datatype)."""

    def __init__(self, name: str, datatype: str, shape: list, data: np.ndarray):
        self.name, self.datatype, self.shape, self.data = name, datatype, shape, data


class InferRequest:
    """A parsed request: id, inputs by name (in request order), requested outputs {name: binary?} (empty:
    every output) and whether outputs not named go binary."""

    def __init__(self, rid, inputs: dict, outputs: dict, binary_output: bool):
        self.id, self.inputs, self.outputs, self.binary_output = rid, inputs, outputs, binary_output


def _fields(obj, where: str, known: set, required: set) -> dict:
    if not isinstance(obj, dict):
        raise RequestError(f"{where} must be a JSON object, got {type(obj).__name__}")
    extra = sorted(set(obj) - known)
    if extra:
        raise RequestError(f"{where}: unknown field(s) {extra} (KServe v2 knows {sorted(known)})")
    missing = sorted(required - set(obj))
    if missing:
        raise RequestError(f"{where}: missing field(s) {missing}")
    return obj


def _parameters(obj: dict, where: str) -> dict:
    p = obj.get("parameters", {})
    if not isinstance(p, dict):
        raise RequestError(f"{where}: 'parameters' must be a JSON object")
    return p


def _shape(value, where: str) -> list:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise RequestError(f"{where}: 'shape' must be a list of integers >= 0, got {value!r}")
    return value


def _flatten(data, where: str) -> list:
    """JSON data as a flat list (KServe allows nested lists in row-major order)."""
    if not isinstance(data, list):
        raise RequestError(f"{where}: 'data' must be a JSON list")
    out, stack = [], [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


def _json_data(values: list, dtype: np.dtype, datatype: str, where: str) -> np.ndarray:
    """Typed array of JSON values; a value of the wrong kind (a string, a float for an integer type, an
    integer out of range) is a RequestError naming its index."""
    integer = dtype.kind in "iu"
    for i, v in enumerate(values):
        ok = (
            isinstance(v, bool)
            if datatype == "BOOL"
            else (
                isinstance(v, int) and not isinstance(v, bool)
                if integer
                else isinstance(v, (int, float)) and not isinstance(v, bool)
            )
        )
        if not ok:
            raise RequestError(f"{where}: data[{i}] = {v!r} is not a {datatype} value")
        if integer and not np.iinfo(dtype).min <= v <= np.iinfo(dtype).max:
            raise RequestError(f"{where}: data[{i}] = {v} is out of {datatype}'s range")
    return np.asarray(values, dtype=dtype)


def _inflate(body: bytes, encoding: str | None) -> bytes:
    if not encoding or encoding == "identity":
        return body
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}.get(encoding.lower())
    if wbits is None:
        raise RequestError(f"Content-Encoding {encoding!r} is not supported (gzip, deflate)", 415)
    try:
        return zlib.decompress(body, wbits)
    except zlib.error as e:
        raise RequestError(f"Content-Encoding {encoding}: the body does not inflate ({e})") from None


def parse_request(body: bytes, header_length: str | None, encoding: str | None = None) -> InferRequest:
    """An InferRequest of an HTTP body (module docstring); header_length: the Inference-Header-Content-Length
    header or None (the whole body is JSON)."""
    body = _inflate(body, encoding)
    if header_length is None:
        n_json = len(body)
    else:
        try:
            n_json = int(header_length)
        except ValueError:
            raise RequestError(f"Inference-Header-Content-Length {header_length!r} is not an integer") from None
        if not 0 <= n_json <= len(body):
            raise RequestError(
                f"Inference-Header-Content-Length {n_json} but the body has {len(body)} bytes (truncated request?)"
            )
    try:
        doc = json.loads(body[:n_json].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    _fields(doc, "request", {"id", "parameters", "inputs", "outputs"}, {"inputs"})
    params = _parameters(doc, "request")
    rid = doc.get("id")
    if rid is not None and not isinstance(rid, str):
        raise RequestError("request: 'id' must be a string")
    if not isinstance(doc["inputs"], list):
        raise RequestError("request: 'inputs' must be a list")
    binary = memoryview(body)[n_json:]
    pos, inputs = 0, {}
    for k, item in enumerate(doc["inputs"]):
        where = f"inputs[{k}]"
        _fields(item, where, {"name", "shape", "datatype", "parameters", "data"}, {"name", "shape", "datatype"})
        name = item["name"]
        if not isinstance(name, str):
            raise RequestError(f"{where}: 'name' must be a string")
        where = f"input {name!r}"
        if name in inputs:
            raise RequestError(f"{where} is given twice")
        datatype, shape = item["datatype"], _shape(item["shape"], where)
        if datatype not in NUMPY:
            raise RequestError(f"{where}: datatype {datatype!r} is not one of {sorted(NUMPY)}")
        dtype, count = NUMPY[datatype], math.prod(shape)
        size = _parameters(item, where).get("binary_data_size")
        if size is not None:
            if "data" in item:
                raise RequestError(f"{where}: both 'data' and binary_data_size are given")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise RequestError(f"{where}: binary_data_size must be an integer >= 0, got {size!r}")
            if size != count * dtype.itemsize:
                raise RequestError(
                    f"{where}: binary_data_size {size} bytes, but shape {shape} of {datatype} takes "
                    f"{count * dtype.itemsize}"
                )
            if pos + size > len(binary):
                raise RequestError(
                    f"{where}: its {size} binary bytes end at byte {pos + size} after the JSON, but the body "
                    f"has {len(binary)} there (truncated request)"
                )
            data = np.frombuffer(binary[pos : pos + size], dtype=dtype)
            pos += size
        else:
            if "data" not in item:
                raise RequestError(f"{where}: no 'data' and no binary_data_size parameter")
            data = _json_data(_flatten(item["data"], where), dtype, datatype, where)
            if data.size != count:
                raise RequestError(f"{where}: 'data' has {data.size} elements; shape {shape} needs {count}")
        inputs[name] = Tensor(name, datatype, shape, data)
    if pos != len(binary):
        raise RequestError(f"the body has {len(binary) - pos} bytes after the JSON and the inputs' binary data")
    outputs = {}
    for k, item in enumerate(doc.get("outputs") or []):
        _fields(item, f"outputs[{k}]", {"name", "parameters"}, {"name"})
        p = _parameters(item, f"outputs[{k}]")
        outputs[item["name"]] = bool(p.get("binary_data", params.get("binary_data_output", False)))
    return InferRequest(rid, inputs, outputs, bool(params.get("binary_data_output", False)))


def encode_response(model: str, version: str, rid, outputs: dict, binary: dict) -> tuple[bytes, dict]:
    """(body, extra headers) of a response: outputs {name: (datatype, shape, array)}; binary {name: bool}
    whether each goes as binary data after the JSON (Inference-Header-Content-Length then says where the
    JSON ends)."""
    doc = {"model_name": model, "model_version": version, "outputs": []}
    if rid is not None:
        doc["id"] = rid
    tail = []
    for name, (datatype, shape, array) in outputs.items():
        out = {"name": name, "datatype": datatype, "shape": list(shape)}
        a = np.ascontiguousarray(array, dtype=NUMPY[datatype])
        if binary.get(name):
            raw = a.tobytes()
            out["parameters"] = {"binary_data_size": len(raw)}
            tail.append(raw)
        else:
            out["data"] = a.reshape(-1).tolist()
        doc["outputs"].append(out)
    head = json.dumps(doc, separators=(",", ":")).encode()
    if not tail:
        return head, {}
    return head + b"".join(tail), {"Inference-Header-Content-Length": str(len(head))}
