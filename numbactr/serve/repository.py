"""A Triton model repository of HugeCTR models, read as Triton's HugeCTR backend reads it.

Layout (Triton's)::

    <repo>/<model>/config.pbtxt           backend "hugectr", inputs, outputs, batching, parameters
    <repo>/<model>/<version>/             a number: the network JSON, <prefix>_dense_<iter>.model,
                                          <prefix><t>_sparse_<iter>.model/ (one folder per table)

What Triton does: it loads every model of the repository at start (a model that fails to load stops the
server, ``--exit-on-error`` true by default), serves the highest version (version_policy latest 1), and
hands each batch to the backend named by ``backend``. The HugeCTR backend reads its ``parameters``:
``config`` (the network JSON), ``gpucache``, ``gpucacheper``, ``hit_rate_threshold``, ``label_dim``,
``slots``, ``cat_feature_num``, ``des_feature_num``, ``max_nnz``, ``embedding_vector_size``,
``embeddingkey_long_type``; the dense and sparse files come from the parameter server's JSON
(``--backend-config=hugectr,ps=ps.json``).

What numbactr does: the same layout and names. config.pbtxt is read by numbactr.serve.pbtxt and checked
here (unknown fields, wrong types, inputs other than ``DES`` FP32 / ``CATCOLUMN`` INT64 or UINT32 /
``ROWINDEX`` INT32 and output ``OUTPUT0`` FP32 are errors naming file and line); the version folder is
loaded into a numbactr InferenceSession, and the parameters are checked against the network JSON
(des_feature_num = the dense width, slots = the slots of all tables, label_dim = the predictions per
sample, embeddingkey_long_type = the CATCOLUMN type). With a ps.json its model entry gives the dense and
sparse files and the database tiers, and one ParameterServer serves every model it names (HugeCTR's HPS);
without one, the version folder's files are used and each model gets its own parameter server. At start
each model serves its highest version that loads (load_newest_good): a damaged newer version (a crash
while one was being copied in, say) is reported, not fatal; a config.pbtxt error or no loadable version
stops the server, as in Triton.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field

import numpy as np

from numbactr.inference import InferenceParams, InferenceSession, ParameterServer, ParameterServerConfig
from numbactr.serve.pbtxt import Ident, PbtxtError, Value, parse_file
from numbactr.serve.tiers import guard

__all__ = [
    "ModelConfig",
    "LoadedModel",
    "RepositoryError",
    "read_config",
    "versions",
    "load_model",
    "load_newest_good",
    "folder_stamp",
    "SharedHPS",
]

#: Triton's TYPE_* names -> KServe v2 datatypes
DATATYPES = {"TYPE_FP32": "FP32", "TYPE_INT64": "INT64", "TYPE_UINT32": "UINT32", "TYPE_INT32": "INT32"}
#: the HugeCTR backend's tensors and the datatypes each may have
INPUTS = {"DES": ("FP32",), "CATCOLUMN": ("INT64", "UINT32"), "ROWINDEX": ("INT32",)}
OUTPUTS = {"OUTPUT0": ("FP32",)}
#: HugeCTR backend parameters: name -> (type, required)
PARAMETERS = {
    "config": (str, True),
    "gpucache": (bool, False),
    "gpucacheper": (float, False),
    "hit_rate_threshold": (float, False),
    "label_dim": (int, True),
    "slots": (int, True),
    "cat_feature_num": (int, True),
    "des_feature_num": (int, True),
    "max_nnz": (int, True),
    "embedding_vector_size": (int, True),
    "embeddingkey_long_type": (bool, True),
}
#: config.pbtxt fields Triton knows that change nothing here (policies and options of Triton's own)
IGNORED_FIELDS = {"version_policy", "platform", "default_model_filename", "model_warmup"}
#: instance_group kinds: each instance is a process with its own session on numbactr's device
KINDS = {"KIND_CPU", "KIND_GPU", "KIND_AUTO"}


class RepositoryError(ValueError):
    """A model that cannot be served: the message names the file (and line) and what is wrong."""


@dataclass
class TensorConfig:
    name: str
    datatype: str  # KServe's: FP32, INT64, ...
    dims: list


@dataclass
class ModelConfig:
    """config.pbtxt of one model, checked (module docstring)."""

    name: str
    path: str
    max_batch_size: int
    inputs: dict  # name -> TensorConfig
    outputs: dict
    parameters: dict  # HugeCTR's, typed
    dynamic_batching: bool = False
    preferred_batch_size: list = field(default_factory=list)
    max_queue_delay_microseconds: int = 0
    instances: int = 1  # instance_group's counts summed (numbactr.serve.instances)

    def as_json(self) -> dict:
        """The config as Triton's ``GET /v2/models/{m}/config`` shows it (its JSON names)."""
        tensor = lambda t: {"name": t.name, "data_type": "TYPE_" + t.datatype, "dims": t.dims}  # noqa: E731
        out = {
            "name": self.name,
            "backend": "hugectr",
            "max_batch_size": self.max_batch_size,
            "input": [tensor(t) for t in self.inputs.values()],
            "output": [tensor(t) for t in self.outputs.values()],
            "parameters": {k: {"string_value": _as_text(v)} for k, v in self.parameters.items()},
        }
        out["instance_group"] = [{"count": self.instances, "kind": "KIND_CPU"}]
        if self.dynamic_batching:
            out["dynamic_batching"] = {
                "preferred_batch_size": self.preferred_batch_size,
                "max_queue_delay_microseconds": self.max_queue_delay_microseconds,
            }
        return out


def _as_text(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


class _Msg:
    """A parsed message with the checks config.pbtxt needs: each error names path:line."""

    def __init__(self, fields: dict, path: str, line: int, where: str):
        self.fields, self.path, self.line, self.where = fields, path, line, where

    def err(self, line: int, msg: str) -> RepositoryError:
        return RepositoryError(f"{self.path}:{line}: {msg}")

    def known(self, names) -> None:
        for name, values in self.fields.items():
            if name not in names:
                raise self.err(values[0].line, f"unknown field {name!r} in {self.where} (known: {sorted(names)})")

    def line_of(self, name: str) -> int:
        """The line of the field's first value (the message's own line when it is absent)."""
        values = self.many(name)
        return values[0].line if values else self.line

    def many(self, name: str) -> list:
        return self.fields.get(name, [])

    def one(self, name: str, kind, default=None, required: bool = False):
        values = self.many(name)
        if not values:
            if required:
                raise self.err(self.line, f"{self.where} has no {name!r}")
            return default
        if len(values) > 1:
            raise self.err(values[1].line, f"{name!r} is given twice in {self.where}")
        v = values[0]
        ok = isinstance(v.value, kind) and not (kind is int and isinstance(v.value, bool))
        if kind is str and isinstance(v.value, Ident):
            ok = False  # a bare word where a quoted string belongs
        if not ok:
            raise self.err(v.line, f"{name!r} in {self.where} must be {_KIND[kind]}, got {v.value!r}")
        return v.value

    def sub(self, v: Value, where: str) -> "_Msg":
        if not isinstance(v.value, dict):
            raise self.err(v.line, f"{where} must be a message {{...}}, got {v.value!r}")
        return _Msg(v.value, self.path, v.line, where)


_KIND = {str: "a quoted string", int: "an integer", Ident: "a name (e.g. TYPE_FP32)", dict: "a message"}


def _tensor(msg: _Msg, allowed: dict, role: str) -> TensorConfig:
    msg.known({"name", "data_type", "dims", "format", "reshape", "optional", "label_filename"})
    name = msg.one("name", str, required=True)
    if name not in allowed:
        raise msg.err(msg.line_of("name"), f"{role} {name!r}: the HugeCTR backend's {role}s are {sorted(allowed)}")
    dt = msg.one("data_type", Ident, required=True)
    if DATATYPES.get(dt) not in allowed[name]:
        want = " or ".join("TYPE_" + t for t in allowed[name])
        raise msg.err(msg.line_of("data_type"), f"{role} {name!r}: data_type {dt} is not {want}")
    dims = [v.value for v in msg.many("dims")]
    if dims != [-1]:
        raise msg.err(
            msg.line_of("dims"), f"{role} {name!r}: dims {dims} must be [ -1 ] (a flat, variable-length tensor)"
        )
    return TensorConfig(name, DATATYPES[dt], dims)


def _param(msg: _Msg, raw: str, kind, name: str, line: int):
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return raw.lower() in ("true", "1")
        value = kind(raw)
    except ValueError:
        raise msg.err(line, f"parameter {name!r}: {raw!r} is not {kind.__name__}") from None
    if kind is int and value < 1:
        raise msg.err(line, f"parameter {name!r}: {value} must be >= 1")
    return value


def read_config(path: str, model: str) -> ModelConfig:
    """config.pbtxt of model (its folder's name) as a ModelConfig; RepositoryError names path:line."""
    try:
        top = _Msg(parse_file(path), path, 1, "the model config")
    except PbtxtError as e:
        raise RepositoryError(str(e)) from None
    top.known(
        {"name", "backend", "max_batch_size", "input", "output", "dynamic_batching", "parameters", "instance_group"}
        | IGNORED_FIELDS
    )
    name = top.one("name", str, model)
    if name != model:
        raise top.err(top.many("name")[0].line, f"name {name!r} differs from the model's folder name {model!r}")
    backend = top.one("backend", str, required=True)
    if backend != "hugectr":
        raise top.err(top.many("backend")[0].line, f'backend {backend!r}: numbactr serves backend "hugectr"')
    mbs = top.one("max_batch_size", int, required=True)
    if mbs < 1:
        raise top.err(top.many("max_batch_size")[0].line, f"max_batch_size {mbs} must be >= 1")
    tensors = {}
    for role, allowed, key in (("input", INPUTS, "input"), ("output", OUTPUTS, "output")):
        got = {}
        for v in top.many(key):
            t = _tensor(top.sub(v, role), allowed, role)
            if t.name in got:
                raise top.err(v.line, f"{role} {t.name!r} is declared twice")
            got[t.name] = t
        missing = sorted(set(allowed) - set(got))
        if missing:
            raise top.err(1, f"no {role} {missing} (the HugeCTR backend's {role}s are {sorted(allowed)})")
        tensors[role] = got
    params = {}
    for v in top.many("parameters"):
        p = top.sub(v, "a parameters entry")
        p.known({"key", "value"})
        key = p.one("key", str, required=True)
        val = p.sub(p.many("value")[0], f"parameter {key!r}'s value") if p.many("value") else None
        if val is None:
            raise p.err(p.line, f"parameter {key!r} has no value")
        val.known({"string_value"})
        if key not in PARAMETERS:
            raise p.err(p.line, f"unknown parameter {key!r} (the HugeCTR backend's: {sorted(PARAMETERS)})")
        if key in params:
            raise p.err(p.line, f"parameter {key!r} is given twice")
        params[key] = _param(p, val.one("string_value", str, required=True), PARAMETERS[key][0], key, p.line)
    missing = [k for k, (_, req) in PARAMETERS.items() if req and k not in params]
    if missing:
        raise top.err(1, f"parameters {missing} are missing (the HugeCTR backend needs them)")
    long_keys = tensors["input"]["CATCOLUMN"].datatype == "INT64"
    if params["embeddingkey_long_type"] != long_keys:
        raise top.err(
            1,
            f"parameter embeddingkey_long_type {_as_text(params['embeddingkey_long_type'])} disagrees with "
            f"CATCOLUMN's data_type TYPE_{tensors['input']['CATCOLUMN'].datatype} "
            "(true: TYPE_INT64, false: TYPE_UINT32)",
        )
    cfg = ModelConfig(name, path, mbs, tensors["input"], tensors["output"], params)
    groups = [top.sub(v, "an instance_group entry") for v in top.many("instance_group")]
    for g in groups:
        g.known({"name", "count", "kind", "gpus"})
        kind = g.one("kind", Ident, Ident("KIND_AUTO"))
        if kind not in KINDS:
            raise g.err(g.line_of("kind"), f"instance_group kind {kind} is not one of {sorted(KINDS)}")
        if g.one("count", int, 1) < 1:
            raise g.err(g.line_of("count"), "instance_group count must be >= 1")
    if groups:
        cfg.instances = sum(g.one("count", int, 1) for g in groups)
    for v in top.many("dynamic_batching"):
        db = top.sub(v, "dynamic_batching")
        db.known({"preferred_batch_size", "max_queue_delay_microseconds", "preserve_ordering"})
        cfg.dynamic_batching = True
        cfg.preferred_batch_size = sorted(x.value for x in db.many("preferred_batch_size"))
        for x in db.many("preferred_batch_size"):
            if not isinstance(x.value, int) or not 1 <= x.value <= mbs:
                raise db.err(
                    x.line, f"preferred_batch_size {x.value!r} must be an integer in [1, max_batch_size {mbs}]"
                )
        cfg.max_queue_delay_microseconds = db.one("max_queue_delay_microseconds", int, 0)
        if cfg.max_queue_delay_microseconds < 0:
            raise db.err(db.line, "max_queue_delay_microseconds must be >= 0")
    return cfg


def versions(model_dir: str) -> list:
    """The model's version numbers (its numbered sub-folders), ascending."""
    return sorted(
        int(d) for d in os.listdir(model_dir) if re.fullmatch(r"\d+", d) and os.path.isdir(os.path.join(model_dir, d))
    )


@dataclass
class LoadedModel:
    """One version of a model, ready: its config, session, and what a request must look like."""

    config: ModelConfig
    version: int
    session: InferenceSession
    slots: list  # S_t per table
    max_keys: list  # most keys a sample may give table t
    dense_dim: int
    width: int  # predictions per sample (P)
    workers: list = field(default_factory=list)  # instances 1..N-1 (numbactr.serve.instances)
    stop_workers: object = None

    @property
    def name(self) -> str:
        return self.config.name

    def close(self) -> None:
        if self.stop_workers is not None:
            self.stop_workers()
        self.session.close()


class SharedHPS:
    """``--backend-config=hugectr,ps=PATH``: HugeCTR's HPS JSON, one ParameterServer for its models (made
    when a model first needs it). Relative file names in it are taken from the JSON's folder."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.config = ParameterServerConfig.from_json(self.path)
        base = os.path.dirname(self.path)
        for m in self.config.models.values():
            p = m.params
            if p.dense_model_file:
                p.dense_model_file = os.path.join(base, p.dense_model_file)
            p.sparse_model_files = [os.path.join(base, f) for f in p.sparse_model_files]
        self._ps = None

    def params(self, model: str) -> InferenceParams:
        if model not in self.config.models:
            raise RepositoryError(
                f"HPS JSON {self.path!r} has no model {model!r} (models: {sorted(self.config.models)})"
            )
        return self.config.models[model].params

    def server(self) -> ParameterServer:
        if self._ps is None:
            self._ps = ParameterServer(self.config)
        return self._ps

    def close(self) -> None:
        if self._ps is not None:
            self._ps.close()


def folder_stamp(folder: str) -> tuple:
    """(files, newest modification time) under folder: it changes while a version is being copied."""
    count, newest = 0, 0.0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                newest = max(newest, os.stat(os.path.join(root, f)).st_mtime)
            except OSError:
                continue
            count += 1
    return count, newest


def load_newest_good(repo: str, name: str, hps: SharedHPS | None = None, load=None) -> tuple:
    """(the highest version of model `name` that loads, [(version, folder stamp, reason)] of the higher
    ones that did not): a restart after a damaged version was copied in serves the last good one, as
    numbactr.serve.reload kept it serving. A config.pbtxt error, or no version loading, raises. load:
    load_model or its like (numbactr.serve.instances.load_instances)."""
    load = load or load_model
    found = versions(os.path.join(repo, name)) if os.path.isdir(os.path.join(repo, name)) else []
    failed = []
    for version in reversed(found):
        try:
            return load(repo, name, version, hps), failed
        except RepositoryError as e:
            read_config(
                os.path.join(repo, name, "config.pbtxt"), name
            )  # a config error is the model's, not the version's
            failed.append((version, folder_stamp(os.path.join(repo, name, str(version))), str(e)))
    if not failed:
        return load(repo, name, None, hps), failed  # its error: no version folder
    raise RepositoryError("; ".join(f"version {v}: {why}" for v, _, why in failed))


def _model_files(vdir: str) -> tuple:
    """(dense file, [sparse folder per table]) in a version folder, by HugeCTR's snapshot names."""
    dense = [
        p
        for p in glob.glob(os.path.join(vdir, "*_dense_*.model"))
        if not p.endswith("_opt_dense") and "_opt_dense_" not in p
    ]
    if len(dense) != 1:
        raise RepositoryError(
            f"{vdir}: {len(dense)} dense model files (<prefix>_dense_<iter>.model) where one is needed: "
            f"{sorted(map(os.path.basename, dense))}"
        )
    tables = {}
    for p in glob.glob(os.path.join(vdir, "*_sparse_*.model")):
        m = re.fullmatch(r"(.*?)(\d+)_sparse_\d+\.model", os.path.basename(p))
        if m and not m.group(1).endswith("_opt") and os.path.isdir(p):
            if int(m.group(2)) in tables:
                raise RepositoryError(
                    f"{vdir}: two sparse folders for table {m.group(2)}: {tables[int(m.group(2))]}, {p}"
                )
            tables[int(m.group(2))] = p
    if sorted(tables) != list(range(len(tables))):
        raise RepositoryError(f"{vdir}: sparse model folders for tables {sorted(tables)}; tables 0.. are needed")
    return dense[0], [tables[t] for t in range(len(tables))]


def _network_json(cfg: ModelConfig, vdir: str) -> str:
    """The ``config`` parameter: relative to the version folder; an absolute path that does not exist here
    (a Docker mount such as /model/dcn/1/dcn.json) falls back to its file name in the version folder."""
    given = cfg.parameters["config"]
    path = given if os.path.isabs(given) else os.path.join(vdir, given)
    if not os.path.isfile(path) and os.path.isabs(given):
        path = os.path.join(vdir, os.path.basename(given))
    if not os.path.isfile(path):
        raise RepositoryError(f"{cfg.path}: parameter config {given!r}: no such network JSON (looked at {path})")
    return path


def load_model(repo: str, name: str, version: int | None = None, hps: SharedHPS | None = None) -> LoadedModel:
    """Read and check model `name` of the repository and load its version (default: the highest) into an
    InferenceSession; RepositoryError (file, line, what) when it cannot be served. Its instance_group's
    other instances are started by numbactr.serve.instances.load_instances."""
    mdir = os.path.join(repo, name)
    cfg = read_config(os.path.join(mdir, "config.pbtxt"), name)
    found = versions(mdir)
    if not found:
        raise RepositoryError(f"{mdir}: no version folder (a numbered sub-folder holding the model files)")
    version = found[-1] if version is None else version
    vdir = os.path.join(mdir, str(version))
    graph = _network_json(cfg, vdir)
    p = cfg.parameters
    try:
        if hps is not None:
            params = hps.params(name)
            if cfg.max_batch_size > params.max_batchsize:
                raise RepositoryError(
                    f"{cfg.path}: max_batch_size {cfg.max_batch_size} exceeds the HPS JSON's max_batch_size "
                    f"{params.max_batchsize} for model {name!r}"
                )
            session = InferenceSession(graph, params, hps.server())
        else:
            dense, sparse = _model_files(vdir)
            params = InferenceParams(
                model_name=name,
                max_batchsize=cfg.max_batch_size,
                hit_rate_threshold=p.get("hit_rate_threshold", 0.9),
                dense_model_file=dense,
                sparse_model_files=sparse,
                use_gpu_embedding_cache=p.get("gpucache", True),
                cache_size_percentage=p.get("gpucacheper", 0.5),
                i64_input_key=p["embeddingkey_long_type"],
            )
            session = InferenceSession(graph, params)
    except RepositoryError:
        raise
    except (ValueError, TypeError, KeyError, OSError) as e:
        raise RepositoryError(f"{vdir}: cannot load version {version} of model {name!r}: {e}") from None
    guard(session.ps)  # a Redis tier that goes down while serving (numbactr.serve.tiers)
    try:
        model = _checked(cfg, version, session)
    except RepositoryError:
        session.close()
        raise
    return model


def _checked(cfg: ModelConfig, version: int, session: InferenceSession) -> LoadedModel:
    """The LoadedModel, once config.pbtxt's parameters agree with the network JSON."""
    g, p = session.graph, cfg.parameters
    slots = [g.sparse_param(e).slot_num for e in g.embeddings]
    max_keys = [g.sparse_param(e).max_feature_num for e in g.embeddings]
    width = session._width()
    if session.params.i64_input_key != p["embeddingkey_long_type"]:
        raise RepositoryError(
            f"{cfg.path}: embeddingkey_long_type {_as_text(p['embeddingkey_long_type'])} but the parameter "
            f"server's keys are {'64' if session.params.i64_input_key else '32'}-bit (HPS JSON supportlonglong)"
        )
    for key, want, what in (
        ("des_feature_num", g.input.dense_dim, "the network's dense_dim"),
        ("slots", sum(slots), f"the slots of its tables {slots}"),
        ("label_dim", width, "its predictions per sample"),
        ("embedding_vector_size", max(e.embedding_vec_size for e in g.embeddings), "its widest embedding"),
    ):
        if p[key] != want:
            raise RepositoryError(f"{cfg.path}: parameter {key} is {p[key]} but the network JSON gives {want} ({what})")
    model = LoadedModel(cfg, version, session, slots, max_keys, g.input.dense_dim, width)
    _warm_up(model)
    return model


def _warm_up(model: LoadedModel) -> None:
    """One sample through the session before the model is ready (Triton's model_warmup): numba compiles
    the kernels a request runs on first use, which must not be a client's wait. The sample has key 0 in
    every slot (a one-hot slot's first id; a key no tier holds gets the default vector)."""
    key_dtype = np.int64 if model.session.params.i64_input_key else np.uint32
    keys = np.zeros(sum(model.slots), key_dtype)
    rows = np.concatenate([np.arange(s + 1, dtype=np.int64) for s in model.slots])
    try:
        model.session.predict(np.zeros(model.dense_dim, np.float32), keys, rows)
    except (ValueError, TypeError, KeyError, OSError) as e:
        raise RepositoryError(f"{model.config.path}: version {model.version} fails its warm-up request: {e}") from None
