"""A table model-parallel over the ranks of a job: TorchRec's input_dist -> lookup -> output_dist.

Every rank holds the rows it owns in its own engine (numbactr.embedding.engine.TableBatchedEmbedding) and
brings a batch of its own samples: keys (N,) in CSR bags offsets (F*B + 1,). The caller decides who owns
each key occurrence (``owner`` (N,) ranks: key % R, slot % R, one rank for a whole table, ...) and how an
owner looks up what it receives (``owner_lookup``: its engine with pooling NONE, keys mapped to its local
rows). HugeCTR's SparseEmbedding (numbactr.embedding.sparse_embedding) and SOK's layers (numbactr.sok)
both run their sharded lookups here.

    table = ShardedTable(comm, dim, features, pooling, owner_lookup)
    out, lookup = table.lookup(keys, offsets, owner, training)     # every rank takes part
    owned, grads = table.gradients(lookup, dy)                     # every rank takes part
    engine.backward(owned, grads)                                  # the owner's fused update, when wanted

Forward (shapes: N occurrences on this rank, M received by it as an owner, D width):
  1. input_dist  every occurrence goes to its owner: keys grouped by owner (stably, so in batch order), one
                 alltoallv; an optional int64 payload per occurrence travels beside its key (a Localized
                 SparseEmbedding sends each key's slot, which the owner records for new keys);
  2. lookup      owner_lookup(keys (M,), offsets, training, payload) on the owner: one vector per received
                 occurrence, (M, D) (a missing key's vector is zeros), and the LookupContext its update needs;
  3. output_dist the vectors go back to their senders (a second alltoallv), which put them back in batch
                 order and pool them into their own bags (SUM or MEAN, per-sample weights if given) on a
                 second engine holding them as its rows (row k = occurrence k): the one-rank lookup's own
                 pooling arithmetic, a missing key's zero vector adding nothing but counting in MEAN's length.
                 With pooling NONE the (N, D) vectors are the output.
Backward walks the same wires in reverse: the sender's pooling engine (optimizer NONE) turns dY of each bag
into one gradient per occurrence (dY / L for MEAN, times the per-sample weight), and each goes to its
owner, which receives rank 0's occurrences first, then rank 1's, ..., each in batch order: the global
batch's order, so every row sums its gradients in the one-rank run's order (sharded == one rank, bit for
bit, when each rank's dY is the one-rank dY's rows). Embedding gradients are never allreduced.

Row counts: a receiver must know how many rows each rank sends it. The output_dist and the backward's
exchange are the reverse of the input_dist, so their counts are known; the input_dist's are exchanged first
(one MPI alltoall of R integers), except under a fixed exchange plan: when the caller (numbactr.model, once
per step, all ranks together) names the step's ``fixed_key``, a key that fixes every rank's owners (a
slot-owned table whose bags hold one key each: the owners then follow from the bag count alone), the first
lookup with that key exchanges the counts and keeps them with the grouping (order, cuts, their device copies,
the payload's), and later lookups with it reuse all of it: no count exchange and no host-to-device copy, so
the lookup enqueues device work only (what a CUDA graph of a step on several ranks captures).

The gathered exchange of a key-owned table (DistributedSlot: owner key % R), HugeCTR's own wires for it and
fixed in size whatever the keys, so that a CUDA graph can hold it: when every rank has the same number N of
key occurrences (one-hot bags, or multi-hot ones of a fixed length: each rank pools its own bags), the
caller names the step's key ``("gathered", N)`` (``step_key``) and
  1. allgather     every rank gets the global batch's keys (R*N,), rank 0's first (the global batch order);
  2. lookup        the owner side looks all of them up, skipping (zeros, no insert, no update) the keys
                   ``owner_of_keys`` gives another rank: an element-wise test on the device;
  3. reduce-scatter the (R*N, D) vectors are summed over ranks and each rank keeps its own N rows: each
                   element is one owner's value plus zeros, so exactly the value (no rounding);
and the backward allgathers the per-occurrence gradients, (R*N, D) in global batch order, for the owner's
update (its rows sum their gradients in the one-rank order, as the alltoall's do). It moves about R times the
alltoall's bytes; numbactr.model uses it only where the step may be a CUDA graph.

Two paths, the same wires (``exchange_on_device``): when every rank has a GPU of its own and NCCL is usable
(``Comm.transport()`` is 'nccl' on the gpu device) keys, payloads, vectors and gradients stay device arrays
and travel by NCCL (Comm.alltoallv with CuPy arrays; only the owners (N,), a host array the caller made,
and the per-rank row counts are host data); otherwise (cpu, sim, ranks sharing a GPU, NUMBACTR_COMM=mpi)
they are staged through host memory and MPI as NumPy arrays. The device path uses the array library only
(gathers, a scatter, concatenations), so with NumPy arrays it computes what it computes on a GPU:
tests/test_sharded_exchange.py runs it under mpiexec on the cpu device against the one-rank run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numbactr.runtime import device
from numbactr.embedding.engine import (
    BoundsCheck,
    Layout,
    LookupContext,
    Optim,
    OptimizerSpec,
    Pooling,
    TableBatchedEmbedding,
)

__all__ = ["ShardedTable", "ShardedLookup", "owner_offsets", "exchange_on_device"]


@dataclass
class ShardedLookup:
    """What a sharded lookup keeps for its backward: the owner-side lookup of the occurrences this rank
    received, how this rank's N occurrences were sent (order (N,) grouped by owner, cuts (R-1,)) and the
    sender's pooling of the vectors that came back (None for pooling NONE). A gathered lookup (module
    docstring) has no order or cuts: its owner side looked up the whole global batch."""

    owned: LookupContext
    order: np.ndarray | None
    cuts: np.ndarray | None
    pooled: LookupContext | None
    order_on_device: object = None  # order as a device array when the exchange runs on the device
    recv: tuple | None = None  # rows each rank sent this one in the input_dist (the backward's counts)
    gathered: bool = False  # the gathered exchange (allgather / reduce-scatter)


@dataclass
class ExchangePlan:
    """A lookup's grouping by owner and input_dist receive counts, kept under a fixed key (module
    docstring): owner (N,) host, order (N,) and cuts (R-1,) host, their device copy, the rows each rank
    sends here, and the payload sent in order (device), once one was sent."""

    owner: np.ndarray
    order: np.ndarray
    cuts: np.ndarray
    order_on_device: object
    recv: tuple
    payload: object = None
    payload_host: np.ndarray | None = None


def exchange_on_device(comm) -> bool:
    """Do a sharded table's exchanges pass device arrays to ``comm`` (NCCL between GPUs)? Only on the gpu
    device with several ranks whose ``transport()`` is NCCL (every rank has its own GPU, cupy.cuda.nccl
    imports); else the host path. transport() is a collective decided once per job, so every rank takes the
    same path; it is not called at all off the gpu device."""
    return comm.size > 1 and device.kind() == "gpu" and comm.transport()[0] == "nccl"


def _split(a, cuts) -> list:
    """a cut into consecutive row blocks at the host integers ``cuts`` (any array library)."""
    edges = [0, *(int(c) for c in cuts), a.shape[0]]
    return [a[edges[i] : edges[i + 1]] for i in range(len(edges) - 1)]


def _group(owner: np.ndarray, ranks: int):
    """(order (N,), cuts (R-1,)): occurrences grouped by owner, in batch order within each group (a stable
    sort by owner, one pass per rank: ~3x faster than argsort for millions of occurrences)."""
    order = np.concatenate([np.flatnonzero(owner == r) for r in range(ranks)])
    return order, np.cumsum(np.bincount(owner, minlength=ranks))[:-1]


def _sent(cuts, n: int) -> list:
    """Rows sent to each rank by an input_dist cut at ``cuts`` (of n occurrences)."""
    edges = [0, *(int(c) for c in cuts), int(n)]
    return [edges[i + 1] - edges[i] for i in range(len(edges) - 1)]


def owner_offsets(m: int, features: int):
    """(F + 1,) int64 CSR offsets putting m occurrences in the first bag: an owner's pooling-NONE lookup of
    what it received (one vector per occurrence whatever the bags), on this device."""
    bags = np.full(features + 1, m, np.int64)
    bags[0] = 0
    return device.xp().asarray(bags)


class ShardedTable:
    """The wires of a model-parallel table (module docstring); the rows stay in the caller's engine.

    Args:
        comm: numbactr.distributed.comm.Comm of the job (every rank builds its ShardedTable in the same order).
        dim: D, the width of the table's rows.
        features: F, the features (slots) of the caller's bags: offsets have F*B + 1 entries.
        pooling: Pooling of the output (SUM, MEAN, or NONE for one row per occurrence).
        owner_lookup: (keys (M,) device array, offsets (F + 1,), training, payload (M,) int64 device array or
            None) -> (vectors (M, D), LookupContext) on the owner.
        key_dtype: dtype of the keys on the wire (uint64 for hash keys, int64 for rows).
        layout: the CSR bag order of the caller's offsets (HugeCTR's SAMPLE_MAJOR: bag b*F + f).
    """

    def __init__(
        self,
        comm,
        dim: int,
        features: int,
        pooling,
        owner_lookup,
        *,
        key_dtype=np.uint64,
        layout=Layout.SAMPLE_MAJOR,
        defer_checks: bool = False,
        owner_of_keys=None,
    ):
        self.comm, self.dim, self.features = comm, int(dim), int(features)
        #: keys (M,) (any array library) -> (M,) int64 owning ranks, for a key-owned table: its gathered
        #: exchange computes the owners on the device (module docstring); None for other tables
        self.owner_of_keys = owner_of_keys
        self.pooling, self.layout = Pooling(pooling), Layout(layout)
        self.owner_lookup = owner_lookup
        self.key_dtype = key_dtype
        # the poolers' bounds checks of this rank's bags recorded on the device and raised by check_deferred
        # (the caller's check points: a GPU step reads nothing back), as the owner's engine does its own
        self.defer_checks = bool(defer_checks)
        self._poolers = {}  # pooling -> the engine pooling the vectors that came back (grown as needed)
        #: the next lookup's fixed exchange key (module docstring), set by the caller for one lookup on every
        #: rank at once, None for an exchange of the counts
        self.fixed_key = None
        self.plans: dict = {}  # fixed key -> ExchangePlan
        self.plan_hits = 0  # lookups that reused a plan (statistics, tests)
        self._bags: dict = {}  # m -> owner_offsets(m, F) on the device (made once per m)

    GATHERED = "gathered"

    def step_key(self, parts) -> tuple | None:
        """A step's fixed exchange key from every rank's part (rank order; HashEmbedding.exchange_key_part:
        an occurrence count N, or -1), None when some part is unknown: a
        slot-owned table's ``("one key per bag", N_0, ..., N_R-1)`` (its owners follow from the counts: the
        input_dist's plan, made by the first lookup with it) or a key-owned table's ``("gathered", N)`` (the
        gathered exchange; every rank's N alike)."""
        parts = [int(p) for p in parts]
        if not parts or min(parts) < 0:
            return None
        if self.owner_of_keys is not None:
            return (self.GATHERED, parts[0]) if len(set(parts)) == 1 else None
        return ("one key per bag", *parts)

    def ready(self, key) -> bool:
        """Does a lookup with this fixed key enqueue device work and fixed-size transfers only (what a CUDA
        graph needs)? A gathered key always; a plan's key once its plan is made."""
        return key is not None and (key[0] == self.GATHERED or key in self.plans)

    def gathers(self) -> bool:
        """Will the next lookup take the gathered exchange (its fixed key says so)?"""
        return self.fixed_key is not None and self.fixed_key[0] == self.GATHERED

    def check_deferred(self) -> None:
        """Raise what the poolers' lookups recorded on the device since the last call (defer_checks)."""
        for eng in self._poolers.values():
            eng.check_deferred()

    def lookup(self, keys, offsets, owner, training: bool, payload=None, per_sample_weights=None, pooling=None):
        """(out, ShardedLookup): out (B, F*D) pooled, or (N, D) for pooling NONE, of this rank's keys (N,) in
        CSR bags ``offsets`` (F*B + 1,); owner (N,) int64 the rank owning each occurrence; payload (N,) int64
        sent beside each key (every rank sends one or none); per_sample_weights (N,) float for the sender's
        pooling; pooling overrides the table's for this lookup."""
        xp, comm = device.xp(), self.comm
        pooling = self.pooling if pooling is None else Pooling(pooling)
        key, self.fixed_key = self.fixed_key, None  # (for this lookup only)
        if key is not None and key[0] == self.GATHERED:
            return self._lookup_gathered(keys, offsets, training, per_sample_weights, pooling, key[1])
        owner = np.asarray(owner, np.int64)
        plan = self._plan(key, owner, payload)
        if exchange_on_device(comm):
            return self._lookup_on_device(
                keys, offsets, owner, training, payload, per_sample_weights, pooling, key, plan
            )
        keys_h, offsets_h = device.to_host(keys), device.to_host(offsets).astype(np.int64)
        n = keys_h.shape[0]
        if owner.shape[0] != n:
            raise ValueError(f"ShardedTable.lookup: {owner.shape[0]} owners for {n} keys")
        order, cuts = (plan.order, plan.cuts) if plan is not None else _group(owner, comm.size)
        # 1. input_dist: keys (+ payload) to their owners
        send = keys_h[order].astype(self.key_dtype)
        if payload is not None:
            send = np.stack([send, np.asarray(payload)[order].astype(self.key_dtype)], axis=1)  # (N, 2)
        parts = comm.alltoallv(np.split(send, cuts), None if plan is None else plan.recv)
        recv = tuple(int(p.shape[0]) for p in parts)
        if plan is None and key is not None:
            self._keep(key, ExchangePlan(owner.copy(), order, cuts, None, recv))
        got = np.concatenate(parts)
        got_keys, got_payload = (
            (got[:, 0], xp.asarray(got[:, 1].astype(np.int64))) if payload is not None else (got, None)
        )
        # 2. lookup on the owner, pooling NONE: (M, D)
        vecs, owned = self.owner_lookup(
            xp.asarray(got_keys), self._owner_offsets(got_keys.shape[0]), training, got_payload
        )
        # 3. output_dist: each vector back to its sender (who sent it: the counts are known), which pools
        back = comm.alltoallv(np.split(device.to_host(vecs), np.cumsum(recv)[:-1]), _sent(cuts, n))
        mine = np.empty((n, self.dim), np.float32)
        mine[order] = np.concatenate(back)
        if pooling == Pooling.NONE:
            return xp.asarray(mine), ShardedLookup(owned, order, cuts, None, recv=recv)
        out, pooled = self._pool(xp.asarray(mine), xp.asarray(offsets_h), per_sample_weights, pooling, offsets_h)
        return out, ShardedLookup(owned, order, cuts, pooled, recv=recv)

    def _plan(self, key, owner: np.ndarray, payload) -> ExchangePlan | None:
        """The fixed exchange plan of ``key`` (None: no key, or its first lookup, which makes it). A key
        promises the owners (and the payload) its first lookup had: checked here on the host, since a plan
        used with other owners would send rows where no rank expects them."""
        if key is None:
            return None
        plan = self.plans.get(key)
        if plan is None:
            return None
        if not np.array_equal(plan.owner, owner) or (
            payload is not None
            and plan.payload_host is not None
            and not np.array_equal(plan.payload_host, np.asarray(payload))
        ):
            raise RuntimeError(
                f"ShardedTable: the exchange plan {key!r} was made for other owners than this "
                "lookup's (a fixed key must fix every rank's owners; numbactr.model's keys do)"
            )
        self.plan_hits += 1
        return plan

    #: plans kept at once (a job sees a few keys: full batches, and the partial last batch of each epoch)
    MAX_PLANS = 16

    def _keep(self, key, plan: ExchangePlan) -> ExchangePlan:
        if len(self.plans) >= self.MAX_PLANS:
            self.plans.clear()
        self.plans[key] = plan
        return plan

    def _owner_offsets(self, m: int):
        """owner_offsets(m, F) on the device, made once per m (no host-to-device copy in a later step)."""
        bags = self._bags.get(m)
        if bags is None:
            if len(self._bags) > 8:
                self._bags.clear()
            bags = self._bags[m] = owner_offsets(m, self.features)
        return bags

    def gradients(self, lookup: ShardedLookup, dy):
        """(owned LookupContext, grads (M, D)): every rank sends each of its occurrences' gradient to the
        occurrence's owner and gets back those of the occurrences it owns, for its engine's backward.
        dy: dLoss/dout of this rank's lookup, (B, F*D) pooled or (N, D) for pooling NONE."""
        if lookup.pooled is None:
            per_key = dy  # (N, D)
        else:  # row k of the pooling engine = occurrence k's gradient
            per_key = self._poolers[lookup.pooled.pooling].backward(lookup.pooled, dy).sparse.values
        if lookup.gathered:  # every rank's gradients, in global batch order, to every owner
            xp = device.xp()
            return lookup.owned, self.comm.allgather(xp.ascontiguousarray(xp.asarray(per_key, dtype=np.float32)))
        # the gradients take the input_dist's way: each rank receives as many rows as it did then
        if lookup.order_on_device is not None:  # the device path (exchange_on_device)
            xp = device.xp()
            parts = self.comm.alltoallv(_split(xp.asarray(per_key)[lookup.order_on_device], lookup.cuts), lookup.recv)
            return lookup.owned, xp.concatenate(parts)
        parts = self.comm.alltoallv(np.split(device.to_host(per_key)[lookup.order], lookup.cuts), lookup.recv)
        return lookup.owned, device.xp().asarray(np.concatenate(parts))

    def _lookup_on_device(
        self, keys, offsets, owner, training: bool, payload, per_sample_weights, pooling, key=None, plan=None
    ):
        """lookup() with every exchanged array a device array (exchange_on_device): the host path's steps
        and arithmetic, nothing read back to the host. owner (N,) is a host array (the caller's); the
        grouping by owner is computed on the host from it and copied to the device, once per step, or once
        for all under a fixed plan (which also keeps the payload's device copy and the receive counts)."""
        xp, comm = device.xp(), self.comm
        keys = xp.asarray(keys)
        n = keys.shape[0]
        if owner.shape[0] != n:
            raise ValueError(f"ShardedTable.lookup: {owner.shape[0]} owners for {n} keys")
        if plan is not None:
            order, cuts, order_d = plan.order, plan.cuts, plan.order_on_device
        else:
            order, cuts = _group(owner, comm.size)
            order_d = xp.asarray(order)
        # 1. input_dist
        send = xp.ascontiguousarray(keys[order_d].astype(self.key_dtype))
        if payload is not None:
            if plan is not None and plan.payload is not None:
                sent = plan.payload
            else:
                sent = xp.asarray(payload)[order_d].astype(self.key_dtype)
            send = xp.ascontiguousarray(xp.stack([send, sent], axis=1))  # (N, 2)
        parts = comm.alltoallv(_split(send, cuts), None if plan is None else plan.recv)
        recv = tuple(int(p.shape[0]) for p in parts)
        if key is not None:
            if plan is None:
                plan = self._keep(key, ExchangePlan(owner.copy(), order, cuts, order_d, recv))
            if payload is not None and plan.payload is None:
                plan.payload, plan.payload_host = sent, np.array(payload, copy=True)
        got = xp.concatenate(parts)
        got_keys, got_payload = (
            (xp.ascontiguousarray(got[:, 0]), got[:, 1].astype(np.int64)) if payload is not None else (got, None)
        )
        # 2. lookup on the owner, pooling NONE: (M, D)
        vecs, owned = self.owner_lookup(got_keys, self._owner_offsets(got_keys.shape[0]), training, got_payload)
        # 3. output_dist (the counts are what this rank sent)
        back = comm.alltoallv(_split(xp.ascontiguousarray(vecs), np.cumsum(recv)[:-1]), _sent(cuts, n))
        mine = xp.empty((n, self.dim), np.float32)
        mine[order_d] = xp.concatenate(back)
        if pooling == Pooling.NONE:
            return mine, ShardedLookup(owned, order, cuts, None, order_d, recv)
        host_offsets = offsets if device.is_host_array(offsets) else device.host_mirror(offsets)
        out, pooled = self._pool(mine, xp.asarray(offsets).astype(np.int64), per_sample_weights, pooling, host_offsets)
        return out, ShardedLookup(owned, order, cuts, pooled, order_d, recv)

    def _lookup_gathered(self, keys, offsets, training: bool, per_sample_weights, pooling, n: int):
        """lookup() by the gathered exchange (module docstring): fixed sizes, owners computed on the device,
        the same code for device arrays (NCCL) and host ones (MPI)."""
        xp, comm = device.xp(), self.comm
        if self.owner_of_keys is None:
            raise RuntimeError("ShardedTable: a gathered exchange needs owner_of_keys (a key-owned table)")
        keys = xp.asarray(keys)
        if keys.shape[0] != n:
            raise RuntimeError(
                f"ShardedTable: the gathered exchange was keyed for {n} occurrences per rank, "
                f"this lookup has {keys.shape[0]}"
            )
        every = comm.allgather(xp.ascontiguousarray(keys.astype(self.key_dtype)))  # (R*N,) global order
        skip = self.owner_of_keys(every) != comm.rank  # another rank's keys
        vecs, owned = self.owner_lookup(every, self._owner_offsets(every.shape[0]), training, None, skip=skip)
        mine = comm.reduce_scatter_sum(xp.ascontiguousarray(vecs.astype(np.float32, copy=False)))  # (N, D)
        if pooling == Pooling.NONE:
            return mine, ShardedLookup(owned, None, None, None, gathered=True)
        host_offsets = offsets if device.is_host_array(offsets) else device.host_mirror(offsets)
        out, pooled = self._pool(mine, xp.asarray(offsets).astype(np.int64), per_sample_weights, pooling, host_offsets)
        return out, ShardedLookup(owned, None, None, pooled, gathered=True)

    def _pool(self, vectors, offsets, per_sample_weights, pooling, host_offsets=None):
        """(pooled (B, F*D), LookupContext) of this rank's occurrence vectors (N, D) in its bags, by an engine
        holding them as its rows (grown as batches need): the one-rank lookup's own pooling. Its optimizer
        NONE makes its backward return each occurrence's gradient. host_offsets: the offsets on the host
        when the caller has them (a NumPy array, or a staged batch's host mirror), which spare the backward
        its read of the touched row count."""
        n = vectors.shape[0]
        eng = self._poolers.get(pooling)
        if eng is None or eng.rows[0] < n:
            if eng is not None and self.defer_checks:
                eng.check_deferred()  # what the old pooler recorded is not lost with it
            eng = self._poolers[pooling] = TableBatchedEmbedding(
                [(max(n, 1) * 3 // 2 + 1, self.dim)],
                [0] * self.features,
                pooling=pooling,
                layout=self.layout,
                optimizer=OptimizerSpec(Optim.NONE),
                bounds_check=BoundsCheck.FATAL,
            )
            eng.defer_checks = self.defer_checks and eng.impl == "kernels"
        eng.split_weights()[0][:n] = vectors
        out, ctx = eng.forward(device.xp().arange(n, dtype=np.int64), offsets, per_sample_weights, training=False)
        host = host_offsets if host_offsets is not None else offsets if device.is_host_array(offsets) else None
        if host is not None and host.shape[0] > 0 and host[0] == 0 and host[-1] == n and (np.diff(host) >= 0).all():
            # every occurrence k is in a bag and is row k: the backward's touched rows are 0..n-1, n of them,
            # which it then need not read back from the device (engine.LookupContext.extra "touched_rows")
            ctx.extra["touched_rows"] = n
        return out, ctx
