"""FBGEMM's MANAGED_CACHING on a TBECore: the cache's size, prefetch/flush, and FBGEMM's cache counters.

Contract: cache_slots sizes the cache as FBGEMM does, cache_sets * ASSOC rows, else
ceil(cache_load_factor * caching rows / ASSOC) * ASSOC, lowered to what leaves cache_reserved_memory bytes of
the fast tier free, and split among the caching tables in proportion to their rows. TBECache is the part of
TBECore (array_tbe.py) that drives the cache (numbactr.embedding.tiered.TieredEmbedding) and reads its counters;
every method is a no-op (or zeros) without MANAGED_CACHING tables. Why FBGEMM's sizing rule although the cache
is fully associative: a script's cache_load_factor then buys the same number of device rows as on FBGEMM.
"""

from __future__ import annotations

import os

import numpy as np

from numbactr.runtime import device
from numbactr import log
from numbactr.embedding.engine import OptimizerSpec, state_specs
from numbactr.embedding.tiered import slot_bytes
from numbactr.fbgemm_gpu.tbe_args import _PRECISION, WHO, TBEConfig, _vbe_layout

#: FBGEMM's cache associativity: the cache holds a multiple of ASSOC rows (cache_sets * ASSOC)
ASSOC = 32


def _fast_tier_free_bytes() -> int:
    """Free memory where the cache lives: the GPU's on the gpu device, else the host's available RAM."""
    if device.kind() == "gpu":
        import cupy

        return int(cupy.cuda.runtime.memGetInfo()[0])
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def cache_slots(cfg: TBEConfig, weights_precision, rows, dims, caching, opt: OptimizerSpec) -> list:
    """Cache rows per table, FBGEMM's sizing: cache_sets * 32 rows, else ceil(cache_load_factor x the
    caching tables' rows / 32) sets, fewer when the cache would leave less than cache_reserved_memory
    bytes of the fast tier free; split among the caching tables in proportion to their rows (each
    1..V_t); the other tables are cached whole."""
    total_rows = sum(rows[t] for t in caching)
    per_slot = max(slot_bytes(dims[t], _PRECISION[weights_precision], state_specs(opt)) for t in caching)
    if int(cfg.cache_sets) > 0:
        total = int(cfg.cache_sets) * ASSOC
    else:
        total = max(1, (int(total_rows * float(cfg.cache_load_factor)) + ASSOC - 1) // ASSOC) * ASSOC
        free = _fast_tier_free_bytes() - int(cfg.cache_reserved_memory)
        if free <= 0:
            raise ValueError(f"{WHO}: cache_reserved_memory={cfg.cache_reserved_memory} leaves no memory for the cache")
        if total * per_slot > free:
            total = max(1, (free // per_slot) // ASSOC) * ASSOC
    slots = [int(r) for r in rows]
    for t in caching:
        slots[t] = int(min(rows[t], max(1, total * rows[t] // max(total_rows, 1))))
    return slots


class TBECache:
    """TBECore's cache methods (FBGEMM's names); self.engine is a TieredEmbedding when self.cached."""

    def prefetch(self, indices, offsets, forward_stream=None, batch_size_per_feature_per_rank=None) -> None:
        """Stage the rows of the next forward in the cache (FBGEMM's prefetch; forward_stream has no
        meaning here: with prefetch_pipeline the staging runs on a worker thread). Nothing without
        MANAGED_CACHING tables."""
        if not self.cached:
            return
        xp = device.xp()
        indices, offsets = xp.asarray(indices), xp.asarray(offsets)
        if batch_size_per_feature_per_rank is not None:
            vbe = _vbe_layout(batch_size_per_feature_per_rank, self.feature_dims, int(offsets.shape[0]) - 1)
            offsets = offsets[xp.asarray(vbe.offset_src)]
        self.engine.prefetch(indices, offsets)

    def flush(self) -> None:
        """Write every updated cached row back to host memory (FBGEMM's flush)."""
        if self.cached:
            self.engine.flush()

    def reset_cache_states(self) -> None:
        """Empty the cache (FBGEMM's reset_cache_states, which TorchRec's purge calls); its updated rows are
        written back first, so nothing trained is lost (FBGEMM leaves that to a flush before)."""
        if self.cached:
            self.engine.invalidate(write_back=True)

    def _cache_counts(self) -> dict:
        st = self.engine.stats if self.cached else None
        table = np.array(st.table_misses if st else [0] * len(self.embedding_specs), np.int64)
        miss = np.array(
            [st.batches_with_misses, st.unique_misses, st.unique_rows, st.lookups] if st else [0] * 4, np.int64
        )
        uvm = np.array([st.batches, st.lookups, st.unique_rows, st.unique_misses, 0, 0] if st else [0] * 6, np.int64)
        return dict(miss=miss, table=table, uvm=uvm)

    def _need(self, flag: bool, what: str) -> None:
        if not flag:
            raise AssertionError(f"{what} should be true to access counter values")

    def get_cache_miss_counter(self) -> np.ndarray:
        """(4,) int64: forwards with a miss, unique misses, unique rows asked for, rows asked for (FBGEMM's
        cache_miss_counter; needs record_cache_metrics.record_cache_miss_counter)."""
        self._need(self.record_cache_metrics.record_cache_miss_counter, "record_cache_miss_counter")
        base = self._cache_base if self._cache_base is not None else 0
        return self._cache_counts()["miss"] - base

    def reset_cache_miss_counter(self) -> None:
        self._need(self.record_cache_metrics.record_cache_miss_counter, "record_cache_miss_counter")
        self._cache_base = self._cache_counts()["miss"]

    def get_table_wise_cache_miss(self) -> np.ndarray:
        """(T,) int64 unique misses per table (needs record_cache_metrics.record_tablewise_cache_miss)."""
        self._need(self.record_cache_metrics.record_tablewise_cache_miss, "record_tablewise_cache_miss")
        return self._cache_counts()["table"]

    def get_uvm_cache_stats(self) -> np.ndarray:
        """(6,) int64: N_called, N_requested_indices, N_unique_indices, N_unique_misses, and FBGEMM's
        set-conflict counts N_conflict_unique_misses, N_conflict_misses (always 0: a fully associative
        cache has no set conflicts); needs gather_uvm_cache_stats."""
        self._need(self.gather_uvm_cache_stats, "gather_uvm_cache_stats")
        base = self._uvm_base if self._uvm_base is not None else 0
        return self._cache_counts()["uvm"] - base

    def reset_uvm_cache_stats(self) -> None:
        self._need(self.gather_uvm_cache_stats, "gather_uvm_cache_stats")
        self._uvm_base = self._cache_counts()["uvm"]

    def print_uvm_cache_stats(self) -> None:
        s = self.get_uvm_cache_stats().tolist()
        names = (
            "N_called",
            "N_requested_indices",
            "N_unique_indices",
            "N_unique_misses",
            "N_conflict_unique_misses",
            "N_conflict_misses",
        )
        log.info(" ".join(f"{n}: {v}" for n, v in zip(names, s)))
