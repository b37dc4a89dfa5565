"""HugeCTR's HybridSparseEmbedding (spec §5.4): one-hot slots, frequent categories data-parallel, the rest
model-parallel; the same math as LocalizedSlotSparseEmbeddingOneHot, laid out for less communication.

Categories. Each slot s has its own vocabulary [0, size_s) (slot_size_array); a key k of slot s is the
category c = k + Σ_{j<s} size_j, HugeCTR's data_to_unique_categories. Like the OneHot embedding, the hybrid
embedding adds the offsets itself, as HugeCTR's does: a RawAsync file written for NVIDIA's DLRM samples
holds per-slot ids. Row c of the table is category c, and starts exactly as row c of a OneHot table with the
same slot_size_array and seed (U(±sqrt(1/size_s)) from a hash of (seed, row)), so a hybrid model and a
one-hot model fed the same per-slot keys train the same numbers.

Statistics and the split (HugeCTR's hybrid_embedding/model.cu, calibration_data.cu, statistics.cu):
  1. counts: every category's occurrences in the first ``num_iterations_statistics`` (CreateSolver) global
     training batches, read at the start by a reader of its own (the training stream is not consumed;
     HugeCTR reads them at model build). Each rank counts its rows; the counts are summed over ranks.
  2. threshold, by communication type (B the global batch, R ranks, M = B / R, N nodes, I iterations):
        NVLink_SingleNode          t = B * I * sqrt(2 p_dup_max / (M (M - 1)))
            (a category below t is duplicated within one rank's batch less often than p_dup_max)
        IB_NVLink, IB_NVLink_Hier  t = I * N * a2a_bw / ar_bw * efficiency_bandwidth_ratio * N / (N - 1)
            (where an allreduce of the row costs less than sending its samples all-to-all)
     t is infinite where the formula divides by zero (M <= 1; N = 1 for the IB types), as in HugeCTR's
     floating point: then no category is frequent.
  3. frequent = the categories with count >= t, in decreasing count (ties: ascending category); their number
     rounded up to a multiple of R (HugeCTR gives every rank an equal share of the frequent updates), less R
     when that exceeds the categories seen. numbactr caps it at max_num_frequent_categories (the most
     frequent ones) where HugeCTR stops with "Found too many frequent categories" (a difference, logged).
  4. infrequent = every other category of the table, seen or not; the i-th in ascending order lives on
     rank i % R (HugeCTR's category_location).

A step, on R ranks (R = 1 runs the same code with the collectives reduced to copies):
  forward   each rank's occurrences (one per (sample, slot)) are split: a frequent one is read from this
            rank's replica of the frequent rows; an infrequent one goes to its owner and its vector comes back
            (numbactr.embedding.sharded.ShardedTable, pooling NONE: TorchRec's input_dist / output_dist);
  backward  an infrequent occurrence's gradient goes to its owner (the global batch's order); the frequent
            gradients are summed per category on each rank (occurrence order) and allreduced, one dense
            (F, D) buffer as HugeCTR's frequent all-reduce;
  update    every rank applies the summed frequent gradients to its replica (identical on every rank) and the
            owner applies its infrequent gradients, both through the engine's fused SGD (lr / scaler).
Every row thus moves exactly as in the one-hot embedding; only the order of the frequent rows' sums across
ranks differs (float rounding). One key per slot (the input's nnz_per_slot = 1) and SGD only, as HugeCTR.
The routing (which occurrence is frequent, who owns it, the per-category sums) runs on the host with NumPy;
gathers and updates run in the engine on the device (HugeCTR does all of it in kernels: a speed difference).

Storage: every rank allocates the whole (V, D) table, as numbactr's OneHot does; frequent rows are replicas,
an infrequent row is current only on its owner. A snapshot first brings every owner's rows to every rank (one
allgather), then writes exactly what a OneHot embedding writes (slot s's rows from rank s % R, key = row =
category, slot_id): a hybrid snapshot loads into a OneHot model and the reverse. Loading gathers the loaded
rows onto every rank, so a load before the statistics (or on another rank count) needs no split.
(HugeCTR v23.08's HybridSparseEmbedding leaves dump_parameters/load_parameters unimplemented: its snapshots
hold no sparse model. numbactr's are an addition.) Initial rows: the one-hot table's (HugeCTR draws its
hybrid rows per table from curand; same distribution, not the same numbers).
"""

from __future__ import annotations

import math

import numpy as np

from numbactr.runtime import device
from numbactr import log
from numbactr.enums import CommunicationType, Embedding_t, HybridEmbeddingType, Optimizer_t
from numbactr.embedding.engine import Pooling
from numbactr.embedding.sharded import ShardedLookup, ShardedTable, owner_offsets
from numbactr.data.validation import slot_offsets
from numbactr.embedding.sparse_embedding import OneHotEmbedding
from numbactr.config import HybridEmbeddingParam  # noqa: F401 (importable from here as before)

__all__ = [
    "HybridEmbeddingParam",
    "HybridEmbedding",
    "frequency_threshold",
    "hybrid_split",
    "infrequent_owner",
    "slot_offsets",
]


def frequency_threshold(param: HybridEmbeddingParam, batch_size: int, ranks: int, nodes: int, iterations: int) -> float:
    """HugeCTR's count threshold (module docstring, step 2): a category seen at least this often in the
    statistics batches is frequent. ``batch_size`` is the global batch; infinite where HugeCTR divides by 0."""
    if param.communication_type == CommunicationType.NVLink_SingleNode:
        m = batch_size / ranks
        if m * (m - 1) <= 0:
            return math.inf
        return batch_size * iterations * math.sqrt(2.0 * param.p_dup_max / (m * (m - 1)))
    if nodes <= 1:
        return math.inf
    return (
        iterations
        * nodes
        * param.max_all_to_all_bandwidth
        / param.max_all_reduce_bandwidth
        * param.efficiency_bandwidth_ratio
        * nodes
        / (nodes - 1)
    )


def hybrid_split(
    categories: np.ndarray, counts: np.ndarray, threshold: float, ranks: int, max_frequent: int
) -> tuple[np.ndarray, bool]:
    """(frequent categories (F,) int64 by decreasing count, capped): HugeCTR's choice (module docstring,
    step 3) from the distinct ``categories`` (n,) seen and their ``counts`` (n,); the bool says whether
    max_frequent cut the list."""
    categories = np.asarray(categories, np.int64)
    counts = np.asarray(counts, np.int64)
    order = np.lexsort((categories, -counts))  # count descending, then category ascending
    ranked, ranked_counts = categories[order], counts[order]
    f = int(np.count_nonzero(ranked_counts >= threshold))  # counts are sorted: a prefix
    if f > 0:
        f = ((f - 1) // ranks + 1) * ranks  # a multiple of the rank count
    if f > ranked.shape[0]:
        f -= ranks
    capped = f > max_frequent
    return ranked[: min(f, max_frequent)], capped


def infrequent_owner(cats: np.ndarray, frequent_sorted: np.ndarray, ranks: int) -> np.ndarray:
    """(N,) int64 rank owning each infrequent category of ``cats`` (N,): the i-th infrequent category of the
    table in ascending order is on rank i % R (HugeCTR's category_location); ``frequent_sorted`` (F,) the
    frequent categories, ascending."""
    cats = np.asarray(cats, np.int64)
    below = np.searchsorted(frequent_sorted, cats)  # frequent categories smaller than each
    return ((cats - below) % ranks).astype(np.int64)


class HybridLookup:
    """What a hybrid lookup keeps for its backward: which occurrences were frequent (positions ``freq`` and
    their index in the frequent list ``freq_slot``) and which infrequent (``infreq``), and the infrequent
    lookup (a ShardedLookup across ranks, the engine's LookupContext on one)."""

    def __init__(self, n: int, freq, freq_slot, infreq, infreq_lookup, present=None):
        self.n, self.freq, self.freq_slot, self.infreq, self.infreq_lookup = n, freq, freq_slot, infreq, infreq_lookup
        self.present = present  # None, or the bags (of all bags) that had their key: the rest were empty


class HybridEmbedding(OneHotEmbedding):
    """HybridSparseEmbedding (module docstring). Built by embedding.factory.make_embedding; the Model gives it
    ``statistics_source``, a callable returning this rank's first statistics batches, which its first
    forward reads (or call take_statistics yourself)."""

    def __init__(self, cfg, sparse_param, opt, seed: int, comm=None):
        who = f"SparseEmbedding {cfg.sparse_embedding_name!r} (HybridSparseEmbedding)"
        if cfg.embedding_type != Embedding_t.HybridSparseEmbedding:
            raise ValueError("HybridEmbedding is for HybridSparseEmbedding")
        if opt.optimizer_type != Optimizer_t.SGD:
            raise ValueError(
                f"{who}: trains with SGD only, as HugeCTR's hybrid embedding does; got "
                f"optimizer_type {opt.optimizer_type.name} (give the embedding "
                "optimizer=CreateOptimizer(optimizer_type=Optimizer_t.SGD), or use "
                "LocalizedSlotSparseEmbeddingOneHot for other optimizers)"
            )
        nnz = sparse_param.nnz_per_slot
        nnz = list(nnz) if isinstance(nnz, (list, tuple)) else [nnz] * sparse_param.slot_num
        if any(int(k) != 1 for k in nnz):
            raise ValueError(
                f"{who}: takes one-hot input (one key per slot), but its sparse input "
                f"{sparse_param.top_name!r} has nnz_per_slot {sparse_param.nnz_per_slot}; set it to 1"
            )
        if getattr(cfg, "embedding_cache", None) is not None:
            raise ValueError(f"{who}: embedding_cache (a tiered table) is not available for the hybrid embedding")
        param = cfg.hybrid_embedding_param
        if param is None:  # SparseEmbedding's own default in HugeCTR (model_wrapper.hpp), not the class's
            param = HybridEmbeddingParam(
                1, -1, 0.01, 1.3e11, 2.6e11, 1.0, CommunicationType.NVLink_SingleNode, HybridEmbeddingType.Distributed
            )
        if not isinstance(param, HybridEmbeddingParam):
            raise ValueError(f"{who}: hybrid_embedding_param must be a HybridEmbeddingParam, got {param!r}")
        self.param = param
        ocfg = _as_one_hot(cfg)
        super().__init__(ocfg, sparse_param, opt, seed, comm)
        self.cfg = cfg
        self.who = who
        sizes = np.asarray(cfg.slot_size_array, np.int64)
        self.slot_sizes = sizes  # (S,)
        self.slot_offset = slot_offsets(sizes)  # (S,)
        self.statistics_source = None  # () -> [(keys, offsets, valid rows)] of this rank; the Model's
        self.frequent = None  # (F,) int64 frequent categories, by decreasing count (None: no split yet)
        self._frequent_sorted = None  # (F,) ascending, and where each sits in self.frequent
        self._frequent_pos = None
        self.threshold = None
        self._sharded = (
            ShardedTable(self.comm, self.vec, self.slots, Pooling.NONE, self._owner_lookup, key_dtype=np.int64)
            if self.comm.size > 1
            else None
        )

    # ---- the split ------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.frequent is not None

    def categories(self, keys, offsets, bag=None) -> np.ndarray:
        """(N,) int64 host categories of one-hot keys (N,) in CSR bags ``offsets`` (B*S + 1,): key + the offset
        of its slot (bag % S; ``bag`` (N,): each key's bag in the whole batch where the bags are a subset); an
        error names the first bag without exactly one key or the first key outside its slot."""
        keys_h = np.asarray(device.to_host(keys)).astype(np.int64)
        offsets_h = np.asarray(device.to_host(offsets)).astype(np.int64)
        n, bags = keys_h.shape[0], offsets_h.shape[0] - 1
        nnz = np.diff(offsets_h)
        if n != bags or (nnz != 1).any():
            bad = int(np.argmax(nnz != 1)) if (nnz != 1).any() else bags
            raise ValueError(
                f"{self.who}: takes exactly one key per slot, but bag {bad} (sample "
                f"{bad // self.slots}, slot {bad % self.slots}) of this batch has "
                f"{int(nnz[bad]) if bad < bags else n - bags} key(s)"
            )
        bag = np.arange(n, dtype=np.int64) if bag is None else np.asarray(bag, np.int64)
        slot = bag % self.slots
        bad = (keys_h < 0) | (keys_h >= self.slot_sizes[slot])
        if bad.any():
            at = int(np.argmax(bad))
            raise ValueError(
                f"{self.who}: key {int(keys_h[at])} of slot {int(slot[at])} (sample "
                f"{int(bag[at]) // self.slots}) is outside the slot's vocabulary [0, "
                f"{int(self.slot_sizes[slot[at]])}) given by slot_size_array (the hybrid embedding "
                "takes per-slot ids and adds the slot offsets itself)"
            )
        return keys_h + self.slot_offset[slot]

    def take_statistics(self, batches, batch_size: int, iterations: int) -> None:
        """Count the categories of this rank's ``batches`` [(keys, offsets, valid rows)], sum the counts over
        ranks (a collective) and fix the frequent/infrequent split. ``batch_size`` is the global batch and
        ``iterations`` the number of statistics batches asked for (HugeCTR's threshold uses both)."""
        seen = [np.zeros(0, np.int64)]
        for keys, offsets, valid in batches:
            offsets = np.asarray(device.to_host(offsets)).astype(np.int64)[: int(valid) * self.slots + 1]
            keys = np.asarray(device.to_host(keys))[: int(offsets[-1]) if offsets.shape[0] else 0]
            seen.append(self.categories(keys, offsets))
        cats, counts = np.unique(np.concatenate(seen), return_counts=True)
        if self.comm.size > 1:  # every rank's (category, count) pairs, summed
            both = self.comm.allgather_rows(np.stack([cats, counts.astype(np.int64)], axis=1))
            cats, inv = np.unique(both[:, 0], return_inverse=True)
            counts = np.bincount(inv, weights=both[:, 1]).astype(np.int64)
        nodes = int(getattr(self.comm.placement, "nodes", 1) or 1)
        self.threshold = frequency_threshold(self.param, int(batch_size), self.comm.size, nodes, int(iterations))
        freq, capped = hybrid_split(
            cats, counts, self.threshold, self.comm.size, self.param.max_num_frequent_categories
        )
        if capped:
            log.info(
                f"{self.who}: more categories reach the frequency threshold {self.threshold:.6g} than "
                f"max_num_frequent_categories={self.param.max_num_frequent_categories}; the "
                f"{freq.shape[0]} most frequent are frequent (HugeCTR stops with 'Found too many frequent "
                "categories' instead)"
            )
        self._set_frequent(freq)
        seen_n = int(counts.sum())
        share = float(counts[np.isin(cats, freq)].sum()) / seen_n if seen_n else 0.0
        log.info(
            f"{self.who}: {freq.shape[0]} frequent categories of {self.max_rows} (threshold "
            f"{self.threshold:.6g} over {seen_n} statistics samples); {share:.1%} of those samples are frequent"
        )

    def _set_frequent(self, frequent: np.ndarray) -> None:
        self.frequent = np.asarray(frequent, np.int64)
        self._frequent_pos = np.argsort(self.frequent, kind="stable")
        self._frequent_sorted = self.frequent[self._frequent_pos]

    def frequent_index(self, cats: np.ndarray) -> np.ndarray:
        """(N,) int64 index of each category in the frequent list, -1 for an infrequent one."""
        srt = self._frequent_sorted
        if srt.shape[0] == 0:
            return np.full(cats.shape[0], -1, np.int64)
        pos = np.minimum(np.searchsorted(srt, cats), srt.shape[0] - 1)
        return np.where(srt[pos] == cats, self._frequent_pos[pos], -1).astype(np.int64)

    def owner_of(self, cats: np.ndarray) -> np.ndarray:
        """(N,) int64 rank owning each infrequent category (infrequent_owner)."""
        return infrequent_owner(cats, self._frequent_sorted, self.comm.size)

    def _ensure_split(self) -> None:
        if self.ready:
            return
        if self.statistics_source is None:
            raise RuntimeError(
                f"{self.who}: the frequent/infrequent split is not known yet: call "
                "take_statistics(batches, batch_size, iterations) before the first lookup (a "
                "Model does this from its training source)"
            )
        self.statistics_source(self)

    # ---- a step -----------------------------------------------------------------------------------------
    def lookup(self, keys, offsets, training: bool):
        """(out (B, S*D), HybridLookup) of this rank's one-hot batch; a collective across ranks.

        Empty bags (the padding rows of a partial batch, drop_incomplete_batch=False) read zeros and pass no
        gradient; every other bag holds exactly one key."""
        offsets_h = np.asarray(device.to_host(offsets)).astype(np.int64)
        nnz = np.diff(offsets_h)
        if (nnz == 0).any() and not (nnz > 1).any():
            present = np.flatnonzero(nnz == 1)
            out, lookup = self._lookup(keys, np.arange(present.shape[0] + 1, dtype=np.int64), training, bag=present)
            full = device.xp().zeros((nnz.shape[0], self.vec), np.float32)
            full[device.xp().asarray(present)] = out
            lookup.present = present
            return full.reshape(-1, self.slots * self.vec), lookup
        out, lookup = self._lookup(keys, offsets, training)
        return out.reshape(-1, self.slots * self.vec), lookup

    def _lookup(self, keys, offsets, training: bool, bag=None):
        """(out (n, D), HybridLookup) of n one-key bags; bag (n,): their places in the batch (default 0..n-1)."""
        self._ensure_split()
        xp = device.xp()
        cats = self.categories(keys, offsets, bag)
        n = cats.shape[0]
        fi = self.frequent_index(cats)
        freq, infreq = np.flatnonzero(fi >= 0), np.flatnonzero(fi < 0)
        p = self.param
        if (
            p.communication_type == CommunicationType.IB_NVLink_Hier
            and p.max_num_infrequent_samples >= 0
            and infreq.shape[0] > p.max_num_infrequent_samples
        ):
            raise ValueError(
                f"{self.who}: this rank's batch holds {infreq.shape[0]} infrequent samples, more than "
                f"max_num_infrequent_samples={p.max_num_infrequent_samples} (IB_NVLink_Hier's fixed "
                "exchange buffers in HugeCTR); raise it or set it to -1"
            )
        out = xp.empty((n, self.vec), np.float32)
        if freq.shape[0]:
            vecs, _ = self.engine.forward(
                xp.asarray(cats[freq]),
                owner_offsets(freq.shape[0], self.slots),
                training=training,
                pooling=Pooling.NONE,
            )
            out[xp.asarray(freq)] = vecs
        infreq_cats = cats[infreq]
        if self._sharded is not None:
            vecs, ilookup = self._sharded.lookup(
                infreq_cats, np.zeros(1, np.int64), self.owner_of(infreq_cats), training
            )
        else:
            vecs, ilookup = self.engine.forward(
                xp.asarray(infreq_cats),
                owner_offsets(infreq.shape[0], self.slots),
                training=training,
                pooling=Pooling.NONE,
            )
        if infreq.shape[0]:
            out[xp.asarray(infreq)] = vecs
        return out, HybridLookup(n, freq, fi[freq], infreq, ilookup)

    def hold_gradient(self, lookup: HybridLookup, dy) -> None:
        """Route this step's gradients (a collective across ranks): infrequent occurrences' to their owners,
        frequent ones summed per category here and allreduced; update() applies them."""
        g = np.asarray(device.to_host(dy)).reshape(-1, self.vec).astype(np.float32, copy=False)
        if lookup.present is not None:  # the empty bags' rows take no gradient
            g = g[lookup.present]
        # infrequent: to the owner (global batch order), or kept (one rank)
        if isinstance(lookup.infreq_lookup, ShardedLookup):
            owned, owned_grads = self._sharded.gradients(lookup.infreq_lookup, g[lookup.infreq])
        else:
            owned, owned_grads = lookup.infreq_lookup, device.xp().asarray(np.ascontiguousarray(g[lookup.infreq]))
        # frequent: per-category sums in occurrence order, one more column counting the occurrences, allreduced
        F = self.frequent.shape[0]
        summed = np.zeros((F, self.vec + 1), np.float32)
        if lookup.freq.shape[0]:
            np.add.at(summed[:, : self.vec], lookup.freq_slot, g[lookup.freq])
            np.add.at(summed[:, self.vec], lookup.freq_slot, np.float32(1))
        if self.comm.size > 1 and F:
            self.comm.allreduce_sum(summed)
        touched = np.flatnonzero(summed[:, self.vec] > 0)
        self._pending = (self.frequent[touched], np.ascontiguousarray(summed[touched, : self.vec]), owned, owned_grads)

    def update(self, lr: float, scaler: float) -> None:
        """SGD on the touched frequent rows (same on every rank) and on this rank's infrequent rows."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        eng = self.engine
        lr = 0.0 if self.frozen else float(lr)
        if eng.learning_rate != lr or eng.optimizer.scaler != scaler:
            eng.set_hyper_parameters(learning_rate=lr, scaler=float(scaler))
        xp = device.xp()
        fcats, fgrads, owned, owned_grads = pending
        if fcats.shape[0]:
            _, ctx = eng.forward(xp.asarray(fcats), owner_offsets(fcats.shape[0], self.slots), pooling=Pooling.NONE)
            eng.backward(ctx, xp.asarray(fgrads))
        if owned.rows.shape[0]:
            eng.backward(owned, owned_grads)

    # ---- snapshots ------------------------------------------------------------------------------------
    def _sync_table(self) -> None:
        """Every rank's table made whole (a collective): each owner's infrequent rows sent to every rank."""
        if self.comm.size == 1 or not self.ready:
            return
        rows = np.arange(self.max_rows, dtype=np.int64)
        infrequent = rows[self.frequent_index(rows) < 0]
        mine = infrequent[self.owner_of(infrequent) == self.comm.rank]
        w = self.weight.data
        vecs = np.ascontiguousarray(device.to_host(w[device.xp().asarray(mine)]), np.float32)
        all_rows = self.comm.allgather_rows(mine)
        all_vecs = self.comm.allgather_rows(vecs)
        w[device.xp().asarray(all_rows)] = device.xp().asarray(all_vecs)

    def dump(self):
        """OneHot's dump (slot s's rows on rank s % R) after making every rank's table whole (a collective)."""
        self._sync_table()
        return super().dump()

    def load(self, keys: np.ndarray, vectors: np.ndarray, slots: np.ndarray | None = None) -> None:
        """Every rank's share of the file gathered onto every rank (a collective) and written there: each
        frequent row is then the same everywhere and each owner holds its infrequent rows, whatever the split."""
        keys = np.asarray(keys).astype(np.int64)
        vectors = np.asarray(vectors, np.float32).reshape(-1, self.vec)
        if self.comm.size > 1:
            keys, vectors = self.comm.allgather_rows(keys), self.comm.allgather_rows(vectors)
        super().load(keys.astype(np.uint64), vectors, None)


def _as_one_hot(cfg):
    """A copy of a HybridSparseEmbedding config that OneHotEmbedding's constructor accepts (same table)."""
    import copy

    ocfg = copy.copy(cfg)
    ocfg.embedding_type = Embedding_t.LocalizedSlotSparseEmbeddingOneHot
    return ocfg
