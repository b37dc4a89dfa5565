"""EmbeddingCollection's plan: where each table lives (shard) and which tables share an engine.

``shard(shard_matrix, shard_strategy)``: shard_matrix[g] names the tables GPU g holds; shard_strategy
[("mp" | "dp", [table names]), ...] says how. "mp" (model parallel): the table's keys are split over the
ranks holding it, key % n -> the (key % n)-th of them (one rank: it holds every key), and the lookups go
through numbactr.embedding.sharded.ShardedTable. "dp" (data parallel): every rank holds the whole table
(HugeCTR requires it on every rank); the ranks' keys are gathered and each rank looks up and updates the
global batch (the effect of HugeCTR's allreduced gradients). On one rank shard() may be left out (every table
on rank 0). A script written for G GPUs on R ranks (R divides G) places GPU g's tables on rank g * R // G.
group_plan: tables share an engine when they have the same strategy, ranks, optimizer settings, static or
dynamic kind, and mode (pooled: sum/average lookups only, not model parallel over ranks; else one width).
Why keep static and dynamic apart: a hash table in an engine takes the engine's index fast path away from its
static tables, and a growing table rebuilds its whole engine.
"""

from __future__ import annotations

from numbactr.validate import warn_ignored
from numbactr.embedding.collection_config import CollectionError


def placement(cfg, comm, name: str, by_name: dict) -> dict:
    """{table name: (strategy "mp"|"dp", sorted ranks holding it)} from shard(), checked."""
    R = comm.size
    who = f"{name} shard()"
    if cfg.shard_matrix is None:
        if R > 1:
            raise CollectionError(
                f"{name}: on {R} ranks the EmbeddingCollectionConfig needs "
                "shard(shard_matrix, shard_strategy) to place its tables"
            )
        return {n: ("mp", [0]) for n in by_name}
    G = len(cfg.shard_matrix)
    if G != R:
        # a script written for G GPUs (HugeCTR drives several GPUs from one process) on R ranks, one GPU
        # each: GPU g's tables go to rank g * R // G (the GPUs of one node to one rank); where a table lives
        # changes no result (model-parallel tables equal one rank's, data-parallel ones are everywhere)
        if G < R or G % R:
            raise CollectionError(
                f"{who}: shard_matrix has {G} rows, one per GPU; this job has {R} rank(s), one "
                f"GPU each (give one row per rank, or a multiple of the rank count)"
            )
        warn_ignored(
            who,
            "shard_matrix rows",
            G,
            f"numbactr runs one GPU per rank: this job has {R} rank(s), so "
            f"the tables of GPUs {G // R} at a time are placed together on one rank",
            stacklevel=4,
        )
    strategy = {}
    for kind, names in cfg.shard_strategy:
        if kind not in ("mp", "dp"):
            raise CollectionError(f"{who}: shard_strategy kind {kind!r} is not 'mp' or 'dp'")
        for n in names:
            if n not in by_name:
                raise CollectionError(
                    f"{who}: shard_strategy names table {n!r}, which no lookup uses; tables: {sorted(by_name)}"
                )
            if n in strategy:
                raise CollectionError(f"{who}: table {n!r} appears twice in shard_strategy")
            strategy[n] = kind
    missing = sorted(set(by_name) - set(strategy))
    if missing:
        raise CollectionError(f"{who}: tables {missing} are in no shard_strategy group ('mp' or 'dp')")
    ranks = {n: [] for n in by_name}
    for g, row in enumerate(cfg.shard_matrix):
        r = g * R // G
        for n in row:
            if n not in by_name:
                raise CollectionError(
                    f"{who}: shard_matrix row {g} names table {n!r}, which no lookup uses; tables: {sorted(by_name)}"
                )
            if r not in ranks[n]:
                ranks[n].append(r)
    out = {}
    for n in by_name:
        if not ranks[n]:
            raise CollectionError(f"{who}: table {n!r} is on no rank (no shard_matrix row names it)")
        if strategy[n] == "dp" and len(ranks[n]) != R:
            raise CollectionError(
                f"{who}: data-parallel table {n!r} must be on every rank; shard_matrix puts "
                f"it on ranks {ranks[n]} of {R}"
            )
        out[n] = (strategy[n], ranks[n])
    return out


def group_plan(tables: list, lookups: list, comm) -> list:
    """[(pooled, [_Table])]: the tables in as few engines (_Group) as one forward and one fused backward can
    serve: tables on the same ranks with the same strategy and optimizer settings share one, static ones apart
    from dynamic
    ones (a hash table in an engine takes the engine's index fast path away from its static tables, and
    a growing table rebuilds its whole engine), pooled groups (sum/average lookups only) apart from
    occurrence groups (a concat lookup, or model parallel over ranks), the latter by width (pooling NONE
    returns one width)."""
    groups: dict = {}
    for t in tables:
        sharded = comm.size > 1 and t.strategy == "mp"
        pooled = not sharded and all(lookups[i]["combiner"] != "concat" for i in t.lookups)
        # an evicting table (max_capacity) has an engine of its own: its index maps keys to slots first
        kind = ("evicting", t.name) if t.cfg.evicting else t.cfg.dynamic
        key = (t.strategy, tuple(t.ranks), t.opt_key, kind, pooled, None if pooled else t.dim)
        groups.setdefault(key, (pooled, []))[1].append(t)
    return list(groups.values())
