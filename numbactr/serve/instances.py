"""instance_group: several instances of a model, each a process with its own InferenceSession.

What Triton does: ``instance_group [{ count: N, kind: KIND_CPU }]`` makes N execution instances of the
model; the scheduler hands each formed batch to an instance that is free, so N batches run at once.

What numbactr does: instance 0 is the server's compute thread with the model's own session
(numbactr.serve.batcher); instances 1..N-1 are Worker processes (multiprocessing, spawn) that load the
same version folder (numbactr.serve.repository.load_model: checks and warm-up included) into sessions of
their own, so N batches run at once on N interpreters, with no lock between them. The batcher takes a
free instance for each batch it forms; a batch goes to a worker as one joined request (infer.join) over
a pipe, and its predictions come back to be split (infer.split). Each worker is driven from one thread
of its own, so a refresh (numbactr.serve.refresh) sent on that thread lands between two of its batches.

Each instance holds a whole copy of the model: its dense weights and, without a ``--backend-config``
HPS JSON, its in-process tables. With one, the instances share the JSON's database tiers: Redis is
shared by every process, but RocksDB opens its folder for one process only, so a RocksDB tier allows one
instance. A worker that dies fails the batch it had (500) and the ones after it. Without
instance_group a model has one instance (numbactr's choice, not Triton's per-core default for CPU models:
each instance is a whole copy of the model and a process that takes seconds to start); a group without
a count has one.
"""

from __future__ import annotations

import multiprocessing
import weakref
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from numbactr.inference import BackendError
from numbactr.serve import infer
from numbactr.serve.refresh import apply as apply_refresh
from numbactr.serve.repository import RepositoryError, SharedHPS, load_model

__all__ = ["Worker", "load_instances", "start_workers"]

#: seconds a worker may take to load its model (a cold numba cache compiles)
START_TIMEOUT = 600.0


class Worker:
    """Instance `index` of a model version: a process and the thread that talks to it."""

    def __init__(self, index: int, repo: str, name: str, version: int, ps_path: str | None):
        ctx = multiprocessing.get_context("spawn")
        self.index = index
        self.conn, child = ctx.Pipe()
        args = (child, repo, name, version, ps_path, numba.get_num_threads())
        self.proc = ctx.Process(target=_main, args=args, name=f"numbactr-serve-{name}-{index}", daemon=True)
        self.proc.start()
        child.close()
        self.thread = ThreadPoolExecutor(1, f"serve-instance-{index}")

    def ready(self) -> None:
        """Wait until the worker has loaded its model; ValueError with its reason when it could not."""
        if not self.conn.poll(START_TIMEOUT):
            raise ValueError(f"instance {self.index} did not load its model within {START_TIMEOUT:.0f} s")
        self._answer()

    def _answer(self):
        try:
            status, out = self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"instance {self.index} (process {self.proc.pid}) died") from None
        if status == "ok":
            return out
        if status == "backend":
            raise BackendError(out)
        raise ValueError(f"instance {self.index}: {out}")

    def call(self, kind: str, payload):
        """Run kind ("run": a joined request; "refresh": checked updates) in the worker (on self.thread)."""
        try:
            self.conn.send((kind, payload))
        except (BrokenPipeError, OSError):
            raise RuntimeError(f"instance {self.index} (process {self.proc.pid}) died") from None
        return self._answer()

    def run(self, jobs: list) -> list:
        return infer.split(jobs, self.call("run", infer.join(jobs)))


def _close(workers: list) -> None:
    for w in workers:
        try:
            w.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
    for w in workers:
        w.proc.join(10)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(10)
        w.conn.close()
        w.thread.shutdown(wait=False)


def load_instances(repo: str, name: str, version: int | None = None, hps=None):
    """repository.load_model, and the model's worker instances 1..N-1 (config.instances = N) started and
    loaded; they stop when the model is closed or collected. RepositoryError (the worker's reason, config.pbtxt
    named) when one cannot load."""
    model = load_model(repo, name, version, hps)
    if model.config.instances > 1:
        try:
            start_workers(model, repo, hps.path if hps is not None else None)
        except (ValueError, RuntimeError) as e:
            model.close()
            raise RepositoryError(f"{model.config.path}: instance_group: {e}") from None
    return model


def start_workers(model, repo: str, ps_path: str | None) -> None:
    """Give a LoadedModel its worker instances (load_instances)."""
    n = model.config.instances
    workers = [Worker(i, repo, model.name, model.version, ps_path) for i in range(1, n)]
    model.workers = workers
    model.stop_workers = weakref.finalize(model, _close, workers)
    try:
        for w in workers:
            w.ready()
    except BaseException:
        model.stop_workers()
        raise


def _main(conn, repo: str, name: str, version: int, ps_path: str | None, threads: int) -> None:
    """A worker process: load the version, then answer (kind, payload) messages until None or EOF."""
    numba.set_num_threads(threads)
    hps = SharedHPS(ps_path) if ps_path else None
    try:
        model = load_model(repo, name, version, hps)
    except Exception as e:  # noqa: BLE001 (the reason goes back to the server)
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the server is gone (kill -9 included)
            break
        if msg is None:
            break
        kind, payload = msg
        try:
            if kind == "run":
                out = np.asarray(model.session.predict(*payload), np.float32)
            else:
                out = apply_refresh(model.session, payload)
            conn.send(("ok", out))
        except BackendError as e:
            conn.send(("backend", str(e)))
        except Exception as e:  # noqa: BLE001 (the batch's requests get it; the worker goes on)
            conn.send(("error", f"{type(e).__name__}: {e}"))
    model.close()
    if hps is not None:
        hps.close()
