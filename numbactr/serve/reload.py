"""Live updates: a new version folder is loaded beside the serving one and swapped in; no request is dropped.

What Triton does: with ``--model-control-mode=poll`` it rescans the repository every
``--repository-poll-secs``; a model whose versions changed is loaded again while the serving version keeps
answering, and replaces it once ready. A version that fails to load leaves the serving one in place; the
failure is logged and shown in the repository index. With ``--model-control-mode=explicit``,
``POST /v2/repository/models/{m}/load`` loads a model (again) on demand.

What numbactr does: the same, per model. Reloader.check(name) loads the highest version folder when it
differs from the serving one (or always, when asked through the load route): config.pbtxt read again,
the files into a new InferenceSession, its warm-up request run (numbactr.serve.repository). The load runs
on the compute thread (numbactr.serve.batcher: the session's kernels are called from one thread), so
batches wait for it instead of failing. Then the slot serves the new version; requests already checked
against the old one run on it (infer.Job.model), and the old session is closed by its finalizer when the
last of them is done. A failed load sets the slot's reason (``last_load_error`` on ``/v2/models/{m}`` and
in the repository index) and writes a ``model_load_failed`` log line; the same folder is not tried again
until a file in it changes (a copy still in progress then finishes and loads). The HPS JSON's models
(``--backend-config``) share one parameter server whose files the JSON names: their versions are loaded
against it as well.

Reloader.refresh(slot, body) is the other live update: new embedding rows for the version being served,
from a snapshot's sparse files or an incremental dump (numbactr.serve.refresh), applied on the compute
thread between two batches; logged as ``embeddings_refreshed`` or ``embeddings_refresh_failed``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from numbactr.inference import BackendError
from numbactr.serve import refresh as refreshing
from numbactr.serve.protocol import RequestError
from numbactr.serve.instances import load_instances
from numbactr.serve.repository import RepositoryError, folder_stamp, versions

__all__ = ["Reloader"]


class Reloader:
    """Watches the repository for a Server (numbactr.serve.app)."""

    def __init__(self, server, repo: str, hps=None):
        self.server, self.repo, self.hps = server, repo, hps
        self.new_failed: dict = {}  # a model not served yet: name -> (stamp, reason) of its failed load

    def _log(self, event: str, **fields) -> None:
        line = {"ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "event": event, **fields}
        print(json.dumps(line, separators=(",", ":")), file=self.server.log_stream or sys.stderr, flush=True)

    async def check(self, name: str, force: bool = False) -> str | None:
        """Load model `name`'s highest version if it is not the one served (always with force); None when
        it serves that version after this, else the reason it does not."""
        slot = self.server.slots.get(name)
        try:
            newest = versions(os.path.join(self.repo, name))[-1:]
        except OSError as e:
            newest, err = [], str(e)
        else:
            err = f"{os.path.join(self.repo, name)}: no version folder"
        if not newest:
            return err if slot is None else None  # a served model whose folders vanished keeps serving
        version = newest[0]
        stamp = (version, folder_stamp(os.path.join(self.repo, name, str(version))))
        if not force:
            if slot is None and self.new_failed.get(name, (None,))[0] == stamp:
                return self.new_failed[name][1]
            if slot is not None and (version == slot.model.version or slot.failed == stamp):
                return slot.reason if slot.failed == stamp else None
        loop = asyncio.get_running_loop()
        try:
            model = await loop.run_in_executor(self.server.executor, load_instances, self.repo, name, version, self.hps)
        except (RepositoryError, ValueError, OSError) as e:
            reason = f"version {version}: {e}"
            if slot is not None:
                slot.reason, slot.failed = reason, stamp
            else:
                self.new_failed[name] = (stamp, reason)
            self._log("model_load_failed", model=name, version=version, error=str(e))
            return reason
        old = None if slot is None else slot.model.version
        if slot is None:
            self.new_failed.pop(name, None)
            self.server.add(model)
        else:
            slot.model, slot.reason, slot.failed = model, None, None
        self._log("model_loaded", model=name, version=version, replaced=old)
        return None

    async def refresh(self, slot, body: bytes) -> dict:
        """Apply a refresh request to the slot's serving version (module docstring): {"model", "version",
        "tables": {table: {"updated", "evicted"}}}; RequestError (400: a bad request, nothing changed;
        503: a database tier failed while it was applied) after logging why."""
        model = slot.model
        session = model.session
        tables = session.ps.config.models[session.params.model_name]
        loop = asyncio.get_running_loop()
        try:
            updates = await loop.run_in_executor(
                None, refreshing.read_request, body, self.repo, model.name, list(tables.names), list(tables.vec_sizes)
            )
            done = await loop.run_in_executor(self.server.executor, refreshing.apply, session, updates)
            for w in model.workers:  # every instance (numbactr.serve.instances), each between two of its batches
                await loop.run_in_executor(w.thread, w.call, "refresh", updates)
        except RequestError as e:
            self._log("embeddings_refresh_failed", model=model.name, version=model.version, error=str(e))
            raise
        except BackendError as e:
            self._log("embeddings_refresh_failed", model=model.name, version=model.version, error=str(e))
            raise RequestError(f"refresh of model {model.name!r} failed part way: {e}", 503) from None
        self._log("embeddings_refreshed", model=model.name, version=model.version, tables=done)
        return {"model": model.name, "version": str(model.version), "tables": done}

    async def poll(self, seconds: float) -> None:
        """check() every model with a config.pbtxt every `seconds` (``--model-control-mode=poll``)."""
        while True:
            await asyncio.sleep(seconds)
            try:
                names = sorted(
                    d for d in os.listdir(self.repo) if os.path.isfile(os.path.join(self.repo, d, "config.pbtxt"))
                )
            except OSError:
                continue
            for name in names:
                await self.check(name)
