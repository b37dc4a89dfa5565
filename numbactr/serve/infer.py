"""A request's tensors checked against the model, and a batch of requests run as one session call.

What the HugeCTR backend takes (its Triton client examples): one request row per tensor, shape [1, N]::

    DES        FP32            (1, n * des_feature_num)          the dense features, sample-major
    CATCOLUMN  INT64 | UINT32  (1, K)                            every table's keys, table after table
    ROWINDEX   INT32           (1, sum_t (n * S_t + 1))          each table's CSR row offsets from 0,
                                                                 bag b * S_t + s = sample b's slot s
    OUTPUT0    FP32            (1, n * label_dim)                the predictions, sample-major

The number of samples n is DES's length / des_feature_num, as the backend counts it. check() refuses
(RequestError, HTTP 400, naming the tensor, sample or table) every request the session would refuse or
mis-read: a missing or unknown input, a wrong datatype or shape, n over max_batch_size, a ROWINDEX
length other than the slots say, offsets that do not start at 0 or decrease, a key count other than
the offsets say, more keys than the network's nnz_per_slot allows, a non-finite dense value, a key the
parameter server reserves (-1) or that does not fit 32-bit keys, a key outside its one-hot slot's
vocabulary. So a bad request never reaches a batch that others share.

run() concatenates checked requests of one model version (dense rows stacked, each table's keys and
offsets joined) into one InferenceSession.predict call and splits the predictions back per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numbactr.inference.hps import check_keys
from numbactr.inference.session import ONE_HOT, one_hot_categories
from numbactr.serve.protocol import InferRequest, RequestError
from numbactr.serve.repository import LoadedModel

__all__ = ["Job", "check", "run"]


@dataclass
class Job:
    """A checked request: the model version it was checked against (it runs on that one), n samples,
    dense (n, des), per table (keys (K_t,), offsets (n * S_t + 1,))."""

    model: LoadedModel
    n: int
    dense: np.ndarray
    tables: list


def _input(model: LoadedModel, req: InferRequest, name: str) -> np.ndarray:
    t = req.inputs[name]
    want = model.config.inputs[name].datatype
    if t.datatype != want:
        raise RequestError(f"input {name!r}: datatype {t.datatype}, but model {model.name!r} takes {want}")
    if len(t.shape) != 2 or t.shape[0] != 1:
        raise RequestError(
            f"input {name!r}: shape {t.shape}; the HugeCTR backend takes one row per request, shape [1, N] "
            "(the samples are counted from DES's length)"
        )
    return t.data


def check(model: LoadedModel, req: InferRequest) -> Job:
    """The Job of a request, or RequestError naming what is wrong (module docstring)."""
    names = set(model.config.inputs)
    missing, extra = sorted(names - set(req.inputs)), sorted(set(req.inputs) - names)
    if missing or extra:
        parts = ([f"missing input(s) {missing}"] if missing else []) + ([f"unknown input(s) {extra}"] if extra else [])
        raise RequestError(f"{'; '.join(parts)}: model {model.name!r} takes {sorted(names)}")
    for name in req.outputs:
        if name not in model.config.outputs:
            raise RequestError(f"unknown output {name!r}: model {model.name!r} gives {sorted(model.config.outputs)}")
    des, keys, rows = (_input(model, req, k) for k in ("DES", "CATCOLUMN", "ROWINDEX"))
    d = model.dense_dim
    n, rem = divmod(des.size, d)
    if rem or n == 0:
        raise RequestError(f"input 'DES': {des.size} values are not a whole number (>= 1) of samples of {d} features")
    if n > model.config.max_batch_size:
        raise RequestError(f"{n} samples exceed max_batch_size {model.config.max_batch_size} of model {model.name!r}")
    finite = np.isfinite(des)
    if not finite.all():
        i = int(np.argmin(finite))
        raise RequestError(f"input 'DES': value {des[i]} of sample {i // d}, feature {i % d} is not finite")
    need = sum(n * s + 1 for s in model.slots)
    if rows.size != need:
        raise RequestError(
            f"input 'ROWINDEX': {rows.size} offsets; {n} samples over tables of {model.slots} slots need "
            f"{need} (n * slots + 1 per table)"
        )
    rows = rows.astype(np.int64)
    tables, r0, k0 = [], 0, 0
    for t, (s, most) in enumerate(zip(model.slots, model.max_keys)):
        off = rows[r0 : r0 + n * s + 1]
        bad = np.flatnonzero(np.diff(off) < 0)
        if off[0] != 0 or bad.size:
            j = 0 if off[0] != 0 else int(bad[0]) + 1
            raise RequestError(
                f"input 'ROWINDEX': table {t}'s offsets must start at 0 and never decrease; its entry {j} "
                f"(ROWINDEX[{r0 + j}]) is {int(off[j])}"
            )
        end = int(off[-1])
        if end > n * most:
            raise RequestError(
                f"input 'ROWINDEX': table {t} gets {end} keys; {n} samples take at most {n * most} "
                f"({most} per sample, the network's nnz_per_slot)"
            )
        if k0 + end > keys.size:
            raise RequestError(
                f"input 'CATCOLUMN': {keys.size} keys, but ROWINDEX's tables 0..{t} account for {k0 + end}"
            )
        tables.append((keys[k0 : k0 + end], off))
        r0, k0 = r0 + n * s + 1, k0 + end
    if k0 != keys.size:
        raise RequestError(f"input 'CATCOLUMN': {keys.size} keys, but ROWINDEX accounts for {k0}")
    try:  # what the session refuses (-1, a key over 32 bits for 32-bit keys) must not fail a shared batch
        check_keys(keys, model.session.params.i64_input_key, "input 'CATCOLUMN'")
    except ValueError as err:
        raise RequestError(str(err)) from None
    g = model.session.graph
    for t, (e, (k, off)) in enumerate(zip(g.embeddings, tables)):
        if e.embedding_type in ONE_HOT:
            try:
                one_hot_categories(e, k, off, model.slots[t])
            except ValueError as err:
                raise RequestError(f"input 'CATCOLUMN': {err}") from None
    return Job(model, n, des.reshape(n, d), tables)


def run(jobs: list) -> list:
    """Predictions (n_j * P,) float32 per job, from one session call over all of them (jobs of one model
    version)."""
    return split(jobs, jobs[0].model.session.predict(*join(jobs)))


def join(jobs: list) -> tuple:
    """The jobs as one request of the session: (dense (N*d,), keys, row offsets), tables one after another."""
    model = jobs[0].model
    dense = np.concatenate([j.dense for j in jobs]).reshape(-1)
    keys, rows = [], []
    for t in range(len(model.slots)):
        shift = 0
        for i, j in enumerate(jobs):
            k, off = j.tables[t]
            keys.append(k)
            rows.append(off[(0 if i == 0 else 1) :] + shift)
            shift += int(off[-1])
    key_dtype = np.int64 if model.session.params.i64_input_key else np.uint32
    flat_keys = np.concatenate(keys).astype(key_dtype, copy=False) if keys else np.zeros(0, key_dtype)
    return dense, flat_keys, np.concatenate(rows)


def split(jobs: list, out) -> list:
    """The predictions of a joined request, one part per job."""
    out = np.asarray(out, np.float32)
    cuts = np.cumsum([j.n * jobs[0].model.width for j in jobs])[:-1]
    return np.split(out, cuts)
