"""A volatile database tier that goes down (a Redis restart) while the server answers: the tiers still up
answer, or the requests get 503, and the tier is used again once it is back.

What HugeCTR does: its HPS logs a failed Redis query and treats the keys as missing (the persistent tier,
then the default vector answer them), whether or not a lower tier holds every key, so a Redis outage can
turn into default embeddings, i.e. wrong predictions, without an error reaching the client.

What numbactr does: ``guard(ps)`` (called for every parameter server a model is served through,
numbactr.serve.repository) wraps the parameter server's volatile tier in a GuardedTier:

* With a persistent tier (filled at start with every key: numbactr.inference.hps), a volatile tier that
  fails is skipped: its lookups find nothing and the persistent tier answers every key with the same row,
  so the answers stay exact; the copy of persistent rows up into the volatile tier
  (``cache_missed_embeddings``) is dropped while it is down (a cache fill, nothing is lost).
* Without one, the volatile tier is the rows' only home: a request that needs it fails with BackendError,
  which the HTTP route answers with 503 and the error (numbactr.serve.app), rather than default rows.
  When it answers again it must still hold the rows it held when guarded (a Redis restarted without
  persistence comes back empty): otherwise it stays unavailable, with a ``hps_tier_lost_rows`` log line,
  until the model is loaded again (``POST /v2/repository/models/{m}/load`` fills a new parameter server's
  tiers; one shared through ``--backend-config`` needs a server restart).
* A refresh (numbactr.serve.refresh) needs every tier: while one is down it fails (503) before it writes.

After the first failure the tier is not called again on the compute thread (a Redis client retries a
refused connection for seconds, which every batch would wait for); a background thread pings it every
PROBE_SECONDS and puts it back when it answers. The client's own retries are shortened for the same
reason (fast_fail). ``hps_tier_down`` and ``hps_tier_up`` log lines (JSON, stderr) say when and why, and
how many lookups the lower tier answered meanwhile.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np

from numbactr.inference import BackendError
from numbactr.inference.params import make_tag_name

__all__ = ["GuardedTier", "guard"]

#: how often a tier that failed is pinged
PROBE_SECONDS = 0.25


def _log(event: str, **fields) -> None:
    line = {"ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "event": event, **fields}
    print(json.dumps(line, separators=(",", ":")), file=sys.stderr, flush=True)


def fast_fail(db) -> None:
    """A Redis client that gives up on a refused connection at once (two quick retries) instead of its
    default of ten with exponential back-off (seconds)."""
    client = getattr(db, "client", None)
    if client is None or not hasattr(client, "set_retry"):
        return
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    client.set_retry(Retry(ExponentialBackoff(cap=0.02, base=0.005), 2))


class GuardedTier:
    """The volatile tier `db` (module docstring); fallback: a persistent tier holds every key."""

    def __init__(self, db, fallback: bool, alive=lambda: True):
        self.db, self.fallback, self.alive = db, fallback, alive  # alive(): the parameter server is open
        self.down_since: float | None = None
        self.error = ""
        self.skipped = 0  # lookups the lower tier answered alone while this one was down
        self.strict = False  # set by a refresh: a write that fails is an error
        self.lost = ""  # why a tier without a persistent one behind it came back unusable
        self.rows: dict = {}  # tag -> rows held when guarded (checked on recovery without fallback)
        self._lock = threading.Lock()

    def __getattr__(self, name):  # size, close, name, params: the tier's own
        return getattr(self.db, name)

    @property
    def address(self) -> str:
        return str(getattr(getattr(self.db, "params", None), "address", "?"))

    def _failed(self, e: Exception) -> None:
        with self._lock:
            if self.down_since is not None:
                return
            self.down_since, self.error = time.monotonic(), str(e)
        _log(
            "hps_tier_down",
            tier=f"volatile_db ({getattr(self.db, 'name', type(self.db).__name__)})",
            address=self.address,
            error=str(e),
            answers="from the persistent tier" if self.fallback else "503 until it is back",
        )
        threading.Thread(target=self._probe, name="serve-tier-probe", daemon=True).start()

    def _probe(self) -> None:
        while self.alive():
            time.sleep(PROBE_SECONDS)
            try:
                self.db.client.ping()
                short = {t: (n, self.db.size(t)) for t, n in self.rows.items()}
            except Exception:  # noqa: BLE001 (any failure: still down)
                continue
            short = {t: v for t, v in short.items() if v[1] < v[0]}
            if short:
                self.lost = (
                    "it came back without its rows ("
                    + ", ".join(f"{t}: {b} of {a}" for t, (a, b) in short.items())
                    + "); load the model again to fill it (one served through --backend-config: restart the server)"
                )
                _log("hps_tier_lost_rows", address=self.address, error=self.lost)
                return
            with self._lock:
                down, self.down_since = time.monotonic() - self.down_since, None
                skipped, self.skipped = self.skipped, 0
            _log("hps_tier_up", address=self.address, down_s=round(down, 3), lookups_answered_below=skipped)
            return

    def recount(self) -> None:
        """Take the rows held again (after a refresh added or evicted some)."""
        self.rows = {t: self.db.size(t) for t in self.rows}

    def _unavailable(self) -> BackendError:
        why = self.lost or self.error
        return BackendError(f"the volatile database tier at {self.address!r} is down: {why}")

    def fetch(self, tag: str, keys: np.ndarray, width: int):
        if self.down_since is None:
            try:
                return self.db.fetch(tag, keys, width)
            except BackendError as e:
                self._failed(e)
        if not self.fallback:
            raise self._unavailable()
        self.skipped += 1
        return np.zeros((keys.shape[0], width), np.float32), np.zeros(keys.shape[0], bool)

    def insert(self, tag: str, keys: np.ndarray, values: np.ndarray) -> None:
        if self.down_since is None:
            try:
                return self.db.insert(tag, keys, values)
            except BackendError as e:
                self._failed(e)
        if self.strict or not self.fallback:
            raise self._unavailable()

    def erase(self, tag: str, keys: np.ndarray) -> None:
        if self.down_since is None:
            try:
                return self.db.erase(tag, keys)
            except BackendError as e:
                self._failed(e)
        raise self._unavailable()


def guard(ps) -> None:
    """Wrap ps's volatile tier (once; a shared parameter server is guarded by its first model)."""
    if ps.volatile is None or isinstance(ps.volatile, GuardedTier) or not hasattr(ps.volatile, "client"):
        return  # only a tier behind a network connection (Redis) can go down under the server
    fast_fail(ps.volatile)
    fin = getattr(ps, "_finalizer", None)
    alive = (lambda: fin.alive) if fin is not None else (lambda: True)
    tier = GuardedTier(ps.volatile, ps.persistent is not None and _holds_all(ps), alive)
    if not tier.fallback:
        tags = [make_tag_name(name, t) for name, m in ps.config.models.items() for t in m.names]
        tier.rows = {tag: tier.db.size(tag) for tag in tags}
    ps.volatile = tier


def _holds_all(ps) -> bool:
    """Whether the persistent tier was filled with every key at start (numbactr.inference.hps)."""
    return bool(ps.config.persistent_db.initialize_after_startup)
