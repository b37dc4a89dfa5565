"""Benchmark results as data: the JSON file every ``numbactr bench COMMAND --json PATH`` writes, and its check.

One file holds one run::

    {"schema": 1,
     "command": ["numbactr", "bench", "hash", ...],       # the argv that made it
     "date": "2026-12-07T00:40:00+00:00",                # ISO 8601, UTC
     "machine": {"platform", "python", "cpu", "cores", "gpu", "device"},   # no host name
     "threads": {"numbactr", "numba", "blas", "torch", ...},
     "versions": {"numbactr", "numpy", "numba", and each peer that took part: "torch", "fbgemm_gpu", ...},
     "notes": "what the tables said about the run (one string)",
     "results": [{"name", "implementation", "metric", "value", and the shape as further fields}, ...]}

Each figure is one result: ``value`` is a finite float in the unit ``metric`` names ("ms", "Mkeys/s",
"samples/s"...), ``implementation`` says whose code it timed ("numbactr", "torch-cpu", "fbgemm",
"onnxruntime"...), ``name`` which table of the run it belongs to; the other fields are the parameters
(batch, D, threads, ...). ``validate`` checks a document (the tests run it on the committed files in
``docs/benchmarks/results/``, the Sphinx extension before it draws them); ``from_table`` turns a bench
``Table`` into results; ``write`` writes a document atomically.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import json
import math
import os
import platform
import re
import sys

SCHEMA = 1
#: the fields every result has; every other field of a result is a parameter of its shape
RESULT_FIELDS = ("name", "implementation", "metric", "value")
#: the machine's fields (gpu: null without one)
MACHINE_FIELDS = ("platform", "python", "cpu", "cores", "gpu")
#: the versions a document always gives
CORE_VERSIONS = ("numbactr", "numpy", "numba")
#: peer -> (import name, distributions to ask for the version, first match wins)
PEERS = {
    "torch": ("torch", ("torch",)),
    "fbgemm_gpu": ("fbgemm_gpu", ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly")),
    "onnxruntime": ("onnxruntime", ("onnxruntime", "onnxruntime-gpu")),
    "tensorflow": ("tensorflow", ("tensorflow", "tensorflow-cpu")),
}
#: the bench tables' columns that hold measured figures (every other column is a parameter)
MEASURED = frozenset(
    {
        "ms",
        "Mkeys/s",
        "M-KV/s",
        "fwd ms",
        "fwd GB/s",
        "fwd % peak",
        "bwd ms",
        "bwd+upd ms",
        "bwd+upd GB/s",
        "bwd+upd % peak",
        "step ms",
        "samples/s",
        "eager ms",
        "embedding ms",
        "GEMMs ms",
        "rest ms",
        "host gaps ms",
        "embedding GB/s",
        "hit rate",
        "loads/step",
        "write-backs/step",
        "x native step",
        "x native embedding",
    }
)


def peers_of(implementation: str) -> list:
    """The peers (keys of PEERS) an implementation label names: 'torch-cpu' -> ['torch'],
    'torch+fbgemm-tbe' -> ['torch', 'fbgemm_gpu']; numbactr's own labels name none."""
    low = implementation.lower()
    out = []
    if low.startswith("torch"):
        out.append("torch")
    if "fbgemm" in low and "numbactr" not in low:
        out.append("fbgemm_gpu")
    if "onnxruntime" in low:
        out.append("onnxruntime")
    if "tensorflow" in low:
        out.append("tensorflow")
    return out


# ---- the run's context ---------------------------------------------------------------------------
def machine() -> dict:
    """What ran it, without the host's name: OS and architecture, Python, CPU model and cores, the GPU's
    model (None without one; asking never fails) and numbactr's device kind."""
    from numbactr.bench.common import cpu_model
    from numbactr.runtime import device

    return {
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "gpu": gpu_model(),
        "device": device.kind(),
    }


def gpu_model():
    """The current CUDA device's name through numba.cuda, or None (no GPU, no driver, any failure)."""
    try:
        from numba import cuda

        if not cuda.is_available():
            return None
        name = cuda.get_current_device().name
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 (a machine description never stops a benchmark)
        return None


def thread_counts() -> dict:
    """numbactr's compute threads with numba's and BLAS's setting as numbactr.runtime.threads applied them,
    the OpenMP/numba environment variables, and torch's intra-op threads when torch is loaded."""
    from numbactr.runtime import threads

    plan = threads.current()
    out = {"numbactr": plan.compute, "numba": plan.numba, "blas": plan.blas, "cores": plan.cores}
    try:
        import numba

        out["numba"] = int(numba.get_num_threads())
    except Exception:  # noqa: BLE001 (numba's threading layer may not start: keep the plan's words)
        pass
    for var in ("NUMBACTR_THREADS", "NUMBA_NUM_THREADS", "OMP_NUM_THREADS"):
        if os.environ.get(var):
            out[var] = os.environ[var]
    if "torch" in sys.modules:
        out["torch"] = int(sys.modules["torch"].get_num_threads())
    return out


def _version(dists) -> str | None:
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def versions(peers=()) -> dict:
    """numbactr's, numpy's and numba's versions, and each peer's in ``peers`` (keys of PEERS) when it is
    installed (None when not)."""
    import numba
    import numpy

    import numbactr

    out = {"numbactr": numbactr.__version__, "numpy": numpy.__version__, "numba": numba.__version__}
    for peer in peers:
        module, dists = PEERS[peer]
        out[peer] = _version(dists) or getattr(sys.modules.get(module), "__version__", None)
    return out


# ---- results ---------------------------------------------------------------------------------------
def _number(cell):
    """A measured cell as a float: numbers as they are, '12.3%' or '45.1 (80% of measured)' by their
    leading number; None for an empty cell ('-', None, NaN)."""
    if cell is None or isinstance(cell, bool):
        return None
    if isinstance(cell, str):
        m = re.match(r"\s*([-+]?[\d,]*\.?\d+(?:[eE][-+]?\d+)?)", cell)
        return float(m.group(1).replace(",", "")) if m else None
    value = float(cell)
    return value if math.isfinite(value) else None


def _param(cell):
    if hasattr(cell, "item"):  # numpy scalars
        cell = cell.item()
    return None if cell in ("-", "", None) else cell


def from_table(table, implementation: str | None = None) -> list:
    """One result per measured cell (columns in MEASURED) of a bench ``Table``; its other columns become
    the result's parameters. The 'impl' column gives the implementation (else ``implementation``)."""
    raw = getattr(table, "raw", None) or table.rows
    out = []
    for cells in raw:
        row = dict(zip(table.columns, cells))
        impl = str(row.pop("impl", implementation or "numbactr"))
        params = {k: _param(v) for k, v in row.items() if k not in MEASURED}
        params = {k: v for k, v in params.items() if v is not None}
        for col in table.columns:
            value = _number(row.get(col)) if col in MEASURED else None
            if value is not None:
                out.append({"name": table.title, "implementation": impl, "metric": col, "value": value, **params})
    return out


def document(results: list, *, command=None, notes: str = "", peers=None) -> dict:
    """The JSON document of a run: its results with the machine, threads and versions of now. peers: the
    peers that took part (default: those the results' implementations name)."""
    if peers is None:
        peers = sorted({p for r in results for p in peers_of(r["implementation"])})
    return {
        "schema": SCHEMA,
        "command": list(sys.argv if command is None else command),
        "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
        "machine": machine(),
        "threads": thread_counts(),
        "versions": versions(peers),
        "notes": notes,
        "results": results,
    }


def tables_document(tables: list, command=None) -> dict:
    """document() of the results of bench Tables, their notes (each line once) as the notes."""
    results = [r for t in tables for r in from_table(t)]
    seen = {}
    for t in tables:
        for n in t.notes:
            seen.setdefault(str(n), None)
    return document(results, command=command, notes="\n".join(seen))


def write(path, doc: dict) -> str:
    """Check ``doc`` and write it to ``path`` as indented JSON, atomically (a reader never sees half a
    file); the folder is made if missing."""
    from numbactr.runtime import atomic

    problems = validate(doc)
    if problems:
        raise ValueError(f"{path}: not a valid benchmark result: " + "; ".join(problems))
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic.atomic_write(path, "w", encoding="utf-8") as f:
        f.write(dumps(doc))
    return path


def dumps(doc: dict) -> str:
    """The document as JSON text that reads and diffs line by line: one line per top-level field, one
    per result."""
    lines = []
    for key, value in doc.items():
        if key == "results":
            body = ",\n".join("  " + json.dumps(r, ensure_ascii=False) for r in value)
            lines.append(f' "results": [\n{body}\n ]')
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write_tables(path, tables: list, command=None) -> str:
    """write() the document of bench Tables: what each bench command's --json does."""
    return write(path, tables_document(tables, command))


# ---- the check -------------------------------------------------------------------------------------
def _is_date(text) -> bool:
    if not isinstance(text, str):
        return False
    try:
        datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


def validate(doc) -> list:
    """The problems of a result document (empty when it is valid), each naming the field (and the result's
    index): schema 1, the command, an ISO date, the machine's fields, threads, numbactr's, numpy's and
    numba's versions and every peer's that a result names, and every result's fields with a finite value."""
    if not isinstance(doc, dict):
        return [f"expected a JSON object, got {type(doc).__name__}"]
    problems = []
    if doc.get("schema") != SCHEMA:
        problems.append(f"schema: expected {SCHEMA}, got {doc.get('schema')!r}")
    cmd = doc.get("command")
    if not (isinstance(cmd, list) and cmd and all(isinstance(c, str) for c in cmd)):
        problems.append(f"command: expected a non-empty list of strings (the argv), got {cmd!r}")
    if not _is_date(doc.get("date")):
        problems.append(f"date: expected an ISO 8601 date, got {doc.get('date')!r}")
    mach = doc.get("machine")
    if not isinstance(mach, dict):
        problems.append("machine: missing (an object)")
    else:
        problems += [f"machine: no {k!r}" for k in MACHINE_FIELDS if k not in mach]
    if not isinstance(doc.get("threads"), dict):
        problems.append("threads: missing (an object)")
    vers = doc.get("versions")
    if not isinstance(vers, dict):
        problems.append("versions: missing (an object)")
        vers = {}
    problems += [f"versions: no {k!r}" for k in CORE_VERSIONS if k not in vers]
    if not isinstance(doc.get("notes", ""), str):
        problems.append("notes: expected a string")
    results = doc.get("results")
    if not isinstance(results, list) or not results:
        return problems + ["results: expected a non-empty list"]
    peers = set()
    for i, r in enumerate(results):
        if not isinstance(r, dict):
            problems.append(f"results[{i}]: expected an object")
            continue
        missing = [k for k in RESULT_FIELDS if k not in r]
        if missing:
            problems.append(f"results[{i}]: no {', '.join(missing)}")
            continue
        if not all(isinstance(r[k], str) and r[k] for k in RESULT_FIELDS[:3]):
            problems.append(f"results[{i}]: name, implementation and metric must be non-empty strings")
        v = r["value"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            problems.append(
                f"results[{i}] ({r['name']}, {r['implementation']}, {r['metric']}): value {v!r} is not a finite number"
            )
        peers.update(peers_of(str(r["implementation"])))
    problems += [
        f"versions: no {p!r}, though a result's implementation is {p}'s" for p in sorted(peers) if p not in vers
    ]
    return problems


def load(path) -> dict:
    """A result file read and checked; a ValueError names the file and its problems."""
    with open(path, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON: {e}") from None
    problems = validate(doc)
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems))
    return doc
