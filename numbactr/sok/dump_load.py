"""SOK's sok.dump / sok.load: SOK tables (and their optimizer states) in SOK's weight files.

SOK (its TensorFlow API, sparse_operation_kit/dump_load.py) writes one folder with, per table, these files:

    <name>-key                   the keys,        a 296-byte head, then n keys
    <name>-weight                the rows,        a 296-byte head, then n x D values
    <name>-<Optimizer>-<slot>    optimizer state, a 296-byte head, then n x D values (one file per slot)

<name> is the variable's name with every punctuation character made '_'. The head: the table name padded
with spaces to 256 bytes (SOK leaves it blank), the file kind (4 bytes, big-endian: 0 key, 1 weight, 2
optimizer state), the slot name padded to 32 bytes, and the data type (4 bytes, big-endian: 0 int32, 1 int64,
2 uint32, 3 uint64, 4 float16, 5 float32, 6 float64). Keys are int64 (a distributed sok.Variable's global
rows, a DynamicVariable's keys in ascending order per rank) or uint64 (a localized Variable's rows); values
float32. <Optimizer> and <slot> are TensorFlow's: SGD (no slot), Adam (m, v), Adagrad (accumulator).

Here sok_vars are numbactr.sok modules (Variable, DynamicVariable, and the layers too) and optimizer is the
OptimizerWrapper (or sok.SGD / sok.Adam) that trains them. Under R ranks every rank calls dump / load with
the same arguments: dump gathers the rows on rank 0, which writes the folder (each file written under a
temporary name, then renamed); load reads the whole folder on every rank and keeps the keys it owns, so a
folder dumped by any number of ranks loads on any other. A DynamicVariable then holds exactly the file's
keys; a Variable needs a row for each of its rows. Everything is checked before any table changes
(missing or short files, heads, widths, duplicate keys, optimizer kinds); a table's step count (Adam's t)
is not in SOK's files and is kept.

Reading a folder that real SOK dumped: SOK names the files after the TensorFlow variable's name, which
ends in ":0" (sok.DynamicVariable(name="emb") is "emb:0", its files "emb_0-key", ...; an unnamed one is
"sok_dynamic_Variable_<i>:0" / "sok_static_Variable_<i>:0", files "sok_dynamic_Variable_<i>_0-..."). Here
a module's name is used as given, so give the table the name SOK's files carry: name="emb_0" (or
"emb:0", which file_name() turns into the same "emb_0") finds "emb_0-key" and "emb_0-weight".

incremental_model_dump(sok_vars, time_threshold): SOK's export of the keys a HierarchicalKV table
(DynamicVariable(var_type="hybrid")) inserted or updated at or after a time, gathered from every rank.
"""

from __future__ import annotations

import datetime as _datetime
import os
import string

import numpy as np

from numbactr.files import snapshot
from numbactr.runtime import atomic
from numbactr.embedding.engine import Optim

HEAD_BYTES = 296
NAME_BYTES, SLOT_BYTES = 256, 32
KEY_FILE, WEIGHT_FILE, STATE_FILE = 0, 1, 2
DTYPES = {0: np.int32, 1: np.int64, 2: np.uint32, 3: np.uint64, 4: np.float16, 5: np.float32, 6: np.float64}
DTYPE_INDEX = {np.dtype(v): k for k, v in DTYPES.items()}
#: the engine optimizer kinds SOK's files name, and each engine state's TensorFlow slot name
OPTIMIZER_NAMES = {Optim.EXACT_SGD: "SGD", Optim.HUGECTR_ADAM: "Adam", Optim.HUGECTR_ADAGRAD: "Adagrad"}
SLOT_NAMES = {"m": "m", "v": "v", "accum": "accumulator"}

__all__ = ["dump", "load", "file_name", "incremental_model_dump"]


def file_name(name: str) -> str:
    """SOK's file prefix of a variable: its name with every punctuation character made '_'."""
    return "".join("_" if c in string.punctuation else c for c in name)


def head(kind: int, slot: str, dtype) -> bytes:
    """A SOK weight file's 296-byte head."""
    return (
        b" " * NAME_BYTES
        + kind.to_bytes(4, "big")
        + slot.rjust(SLOT_BYTES).encode()
        + DTYPE_INDEX[np.dtype(dtype)].to_bytes(4, "big")
    )


def read_file(path: str, kind: int, slot: str = ""):
    """(values 1-D array) of a SOK weight file, its head checked: ValueError naming the file and what is
    wrong."""
    if not os.path.isfile(path):
        raise ValueError(f"sok.load: {path} does not exist")
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < HEAD_BYTES:
        raise ValueError(f"sok.load: {path} has {len(raw)} bytes, less than SOK's {HEAD_BYTES}-byte head")
    got_kind = int.from_bytes(raw[NAME_BYTES : NAME_BYTES + 4], "big")
    got_slot = raw[NAME_BYTES + 4 : NAME_BYTES + 4 + SLOT_BYTES].decode("utf-8", "replace").strip()
    index = int.from_bytes(raw[HEAD_BYTES - 4 : HEAD_BYTES], "big")
    kinds = {KEY_FILE: "key", WEIGHT_FILE: "weight", STATE_FILE: "optimizer state"}
    if got_kind != kind:
        raise ValueError(
            f"sok.load: {path} is a {kinds.get(got_kind, f'kind {got_kind}')} file, expected a {kinds[kind]} file"
        )
    if slot and got_slot != slot:
        raise ValueError(f"sok.load: {path} holds slot {got_slot!r}, expected {slot!r}")
    if index not in DTYPES:
        raise ValueError(f"sok.load: {path} names data type {index}, not one of SOK's {sorted(DTYPES)}")
    dtype = np.dtype(DTYPES[index])
    body = len(raw) - HEAD_BYTES
    if body % dtype.itemsize:
        raise ValueError(f"sok.load: {path} holds {body} bytes after its head, not whole {dtype} values")
    return np.frombuffer(raw, dtype, offset=HEAD_BYTES).copy()


def _vars(sok_vars, who: str) -> list:
    items = list(sok_vars) if isinstance(sok_vars, (list, tuple)) else [sok_vars]
    for v in items:
        if getattr(v, "table", None) is None or not hasattr(v.table, "state"):
            raise TypeError(f"{who}: {v!r} is not a numbactr.sok variable or layer")
    names = [file_name(v.name) for v in items]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"{who}: several tables would share the files {sorted(dup)}; give them distinct names")
    return items


def _trained(optimizer, v, who: str):
    """(SOK optimizer name, [(engine state, TensorFlow slot)]) of the optimizer training v, or None."""
    if optimizer is None:
        return None
    tables = getattr(optimizer, "_tables", None)
    if tables is None:
        raise TypeError(
            f"{who}: optimizer must be a numbactr.sok OptimizerWrapper (or sok.SGD / sok.Adam), got "
            f"{type(optimizer).__name__}"
        )
    if not any(t is v.table for t, _ in tables):
        raise ValueError(
            f"{who}: the optimizer does not train {v.name!r}; dump or load its optimizer state with "
            "the optimizer that trains it (SOK: all the variables have states, or none)"
        )
    kind = Optim(v.table.engine.optimizer.kind)
    if kind not in OPTIMIZER_NAMES:
        raise NotImplementedError(f"{who}: {kind.name} has no SOK file name")
    states = [n for n, _, _ in v.table.engine._state_specs()]
    missing = [n for n in states if n not in SLOT_NAMES]
    if missing:
        raise NotImplementedError(f"{who}: {v.name!r}'s optimizer keeps {missing}, which SOK's files have no slot for")
    return OPTIMIZER_NAMES[kind], [(n, SLOT_NAMES[n]) for n in states]


def dump(path, dump_vars, optimizer=None) -> None:
    """SOK's sok.dump(path, dump_vars, optimizer=None): the tables (and, given the OptimizerWrapper that trains
    them, its states) into folder ``path`` in SOK's files (module docstring). Every rank calls it."""
    who = "sok.dump"
    items = _vars(dump_vars, who)
    plans = [_trained(optimizer, v, who) for v in items]
    comm = items[0].table.comm if items else None
    files, errors = {}, []  # file name -> bytes (rank 0)
    for v, plan in zip(items, plans):
        keys, values = v.table.state()
        st = v.table.optimizer_state() if plan else None
        if v.table.keyed:
            order = np.argsort(keys, kind="stable")  # SOK: each rank's keys ascending
            keys, values = keys[order], values[order]
            states = [st["states"][n][order] for n, _ in plan[1]] if plan else []
            key_dtype = np.int64
        else:
            states = [st["states"][n] for n, _ in plan[1]] if plan else []
            key_dtype = np.int64 if v.table.target < 0 else np.uint64
        keys = comm.gather_rows(np.ascontiguousarray(keys.astype(key_dtype)))
        values = comm.gather_rows(np.ascontiguousarray(values))
        states = [comm.gather_rows(np.ascontiguousarray(s, np.float32)) for s in states]
        if comm.rank == 0:
            if keys.size == 0 and v.table.keyed:  # raised in write(), so that every rank hears of it
                errors.append(f"{v.name!r} holds no key yet (SOK refuses to dump an empty dynamic table)")
            base = file_name(v.name)
            files[f"{base}-key"] = head(KEY_FILE, "", key_dtype) + keys.tobytes()
            files[f"{base}-weight"] = head(WEIGHT_FILE, "", np.float32) + values.astype(np.float32).tobytes()
            for (_, slot), s in zip(plan[1] if plan else [], states):
                files[f"{base}-{plan[0]}-{slot}"] = head(STATE_FILE, slot, np.float32) + s.tobytes()

    def write():
        if errors:
            raise ValueError(f"{who}: {errors[0]}")
        os.makedirs(path, exist_ok=True)
        for name, data in files.items():
            with atomic.atomic_write(os.path.join(path, name)) as f:
                f.write(data)

    if comm is not None:
        snapshot.on_rank0(comm, write, f"{who}: rank 0 could not write {path}")


def load(path, load_vars, optimizer=None) -> None:
    """SOK's sok.load(path, load_vars, optimizer=None): the tables (and, given the OptimizerWrapper that
    trains them, its states) from folder ``path`` in SOK's files (module docstring). Every rank calls it."""
    who = "sok.load"
    items = _vars(load_vars, who)
    todo = []
    for v in items:  # read and check everything first
        plan = _trained(optimizer, v, who)
        base = os.path.join(os.fspath(path), file_name(v.name))
        keys = read_file(f"{base}-key", KEY_FILE)
        values = read_file(f"{base}-weight", WEIGHT_FILE)
        dim = v.table.dim
        if keys.dtype.kind not in "iu":
            raise ValueError(f"{who}: {base}-key holds {keys.dtype} keys, not integers")
        if values.size != keys.size * dim:
            raise ValueError(
                f"{who}: {base}-weight holds {values.size} values for {keys.size} keys; {v.name!r} has vectors of {dim}"
            )
        keys = keys.astype(np.int64)
        states = {}
        for name, slot in plan[1] if plan else []:
            s = read_file(f"{base}-{plan[0]}-{slot}", STATE_FILE, slot)
            if s.size != keys.size * dim:
                raise ValueError(f"{who}: {base}-{plan[0]}-{slot} holds {s.size} values for {keys.size} keys x {dim}")
            states[name] = s.reshape(keys.size, dim)
        mine = v.table.owners(keys) == v.table.comm.rank
        keys, values = keys[mine], values.reshape(keys.size, dim)[mine].astype(np.float32)
        states = {n: s[mine].astype(np.float32) for n, s in states.items()}
        v.table.check_state(keys, f"{base}-key")
        todo.append((v, keys, values, states, plan))
    for v, keys, values, states, plan in todo:
        v.table.load_state(keys, values)
        if plan:
            v.table.load_optimizer_state(
                {
                    "optimizer": Optim(v.table.engine.optimizer.kind).name,
                    "step": v.table.engine.step,
                    "keys": keys,
                    "states": states,
                }
            )


def incremental_model_dump(sok_vars, time_threshold, sess=None):
    """SOK's sok.incremental_model_dump(sok_vars, time_threshold, sess=None): per DynamicVariable of
    var_type 'hybrid' (SOK's HierarchicalKV backend, which keeps a time per key), the keys inserted or
    updated (looked up in training, assigned, loaded, or updated by an optimizer step) at or after its
    time threshold, and their vectors, from every rank (a collective: every rank calls it with the same
    arguments and gets the same arrays).

    Args:
        sok_vars: one DynamicVariable or a list of them, all var_type='hybrid'.
        time_threshold: a datetime.datetime (aware, e.g. UTC, or naive local time), or a list of them: one
            for all variables or one per variable.
        sess: TensorFlow 1's session; must be None here.
    Returns: (keys, values): lists of numpy arrays, per variable keys (n,) int64 and values (n, D) float32.
    """
    if sess is not None:
        raise TypeError("sok.incremental_model_dump: sess is TensorFlow 1's session; numbactr has none (give None)")
    items = list(sok_vars) if isinstance(sok_vars, (list, tuple)) else [sok_vars]
    times = list(time_threshold) if isinstance(time_threshold, (list, tuple)) else [time_threshold]
    if len(times) not in (1, len(items)):
        raise ValueError(
            f"sok.incremental_model_dump: {len(times)} time thresholds for {len(items)} variables; give "
            "one for all of them or one per variable"
        )
    for i, v in enumerate(items):
        table = getattr(v, "table", None)
        if table is None or not table.keyed or not hasattr(v, "backend_type"):
            raise TypeError(
                f"sok.incremental_model_dump: variable {i} ({type(v).__name__}) is not a "
                "sok.DynamicVariable (SOK supports DynamicVariable with the 'hybrid' backend only)"
            )
        if not table.keeps_times:
            raise ValueError(
                f"sok.incremental_model_dump: variable {i} ({v.name!r}) has var_type "
                f"{v.backend_type!r}; SOK supports var_type='hybrid' (HierarchicalKV) only, whose "
                "tables keep a time per key"
            )
    for i, t in enumerate(times):
        if not isinstance(t, _datetime.datetime):
            raise TypeError(
                f"sok.incremental_model_dump: time threshold {i} must be a datetime.datetime, got {type(t).__name__}"
            )
    keys_out, values_out = [], []
    for i, v in enumerate(items):
        threshold = times[0] if len(times) == 1 else times[i]
        keys, values = v.table.updated_since(int(round(threshold.timestamp() * 1e9)))
        comm = v.table.comm
        keys_out.append(comm.allgather_rows(np.ascontiguousarray(keys, np.int64)))
        values_out.append(comm.allgather_rows(np.ascontiguousarray(values, np.float32)))
    return keys_out, values_out
