"""Model updates into a running parameter server: new rows in, evicted keys out (``ParameterServer.update``).

A training table that evicts (numbactr.embedding.sparse_evicting, collection_evicting, SOK's hybrid tables)
hands out incremental dumps: the keys inserted or trained since the last dump with their rows, and the keys
it evicted. HugeCTR's HPS takes new rows from its update source (a Kafka stream numbactr does not have) but
never hears of a key leaving, so an evicted key would keep its last row in every tier and in the embedding
cache: a stale row that inference keeps serving. Here one call applies a dump::

    ps.update(model_name, table, keys, values, evicted)      # e.g. (..., *emb.incremental_dump())

  keys (n,) with values (n, D): inserted into every database tier (volatile, then persistent) and, where a
      key is in the embedding cache, written over its cached vector (the next request reads the new row;
      keys not cached are fetched from the tiers when asked, as always).
  evicted (e,): erased from every database tier, and their cache slots emptied (no write-back: inference
      never writes), so the next request for such a key misses everywhere and gets the table's default,
      exactly as a key the model never had.
"""

from __future__ import annotations

import numpy as np

from numbactr.runtime import device
from numbactr.inference.params import make_tag_name

__all__ = ["apply_update"]


def _keys(keys, what: str) -> np.ndarray:
    k = np.asarray(device.to_host(keys) if keys is not None else np.zeros(0, np.uint64))
    if k.dtype.kind not in "iu" or k.ndim != 1:
        raise ValueError(f"HPS update: {what} must be a 1-D integer array, got {k.dtype} {k.shape}")
    return k.astype(np.uint64)


def apply_update(ps, model_name: str, table, keys, values, evicted=None) -> None:
    """Apply one table's update (module docstring). table: its index in the model or its name."""
    m = ps.config.models.get(model_name)
    if m is None:
        raise KeyError(f"HPS update: no model named {model_name!r}; models: {sorted(ps.config.models)}")
    t = m.names.index(table) if isinstance(table, str) and table in m.names else table
    if not isinstance(t, (int, np.integer)) or not 0 <= int(t) < len(m.names):
        raise ValueError(f"HPS update: model {model_name!r} has no table {table!r} (tables: {list(m.names)})")
    t, width = int(t), int(m.vec_sizes[t])
    keys, evicted = _keys(keys, "keys"), _keys(evicted, "evicted")
    values = np.ascontiguousarray(np.asarray(device.to_host(values), np.float32))
    if values.shape != (keys.shape[0], width):
        raise ValueError(
            f"HPS update: model {model_name!r} table {m.names[t]!r}: values must be ({keys.shape[0]}, {width}) "
            f"for {keys.shape[0]} keys, got {values.shape}"
        )
    both = np.intersect1d(keys, evicted)
    if both.size:
        raise ValueError(f"HPS update: key {int(both[0])} is both updated and evicted")
    tag = make_tag_name(model_name, m.names[t])
    for db in (ps.volatile, ps.persistent):
        if db is None:
            continue
        if keys.size:
            db.insert(tag, keys, values)
        if evicted.size:
            db.erase(tag, evicted)
    cache = ps.cache(model_name)
    if cache.enabled:
        _update_cache(cache, t, keys, values, evicted)


def _update_cache(cache, t: int, keys, values, evicted) -> None:
    """The embedding cache of table t: cached keys take their new rows, evicted keys leave."""
    ec, xp = cache.cache, cache.xp
    row0, slot0 = int(ec.row_offsets[t]), int(ec.slot_offsets[t])
    if keys.size:
        lin = cache.index[t].find(xp.asarray(keys))
        slot = xp.where(lin >= 0, ec.row_slot[xp.maximum(lin, 0) + row0], -1)
        held = np.flatnonzero(device.to_host(slot) >= 0)
        if held.size:
            src = np.zeros((held.size, cache.strides[t]), np.float32)
            src[:, : cache.dims[t]] = values[held]
            cache._rows_to(cache.buffers[t], device.to_host(slot)[held] - slot0, src)
    if evicted.size:
        lin = cache.index[t].find(xp.asarray(evicted))
        ec.forget(lin[lin >= 0] + row0)
