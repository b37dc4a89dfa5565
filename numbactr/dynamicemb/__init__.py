"""numbactr.dynamicemb: NVIDIA DynamicEmb's dynamic tables (recsys-examples ``dynamicemb``) on numbactr's engine.

    from numbactr.dynamicemb import (DynamicEmbTableOptions, DynamicEmbScoreStrategy,
        FrequencyAdmissionStrategy, KVCounter, BatchedDynamicEmbeddingTables, incremental_dump)

    opts = DynamicEmbTableOptions(dim=16, max_capacity=1 << 16, score_strategy=DynamicEmbScoreStrategy.STEP,
                                  admit_strategy=FrequencyAdmissionStrategy(2))
    tables = BatchedDynamicEmbeddingTables([opts], ["item"])
    out = tables.forward(keys, offsets); tables.backward(dout)
    dumps, next_threshold = incremental_dump(tables, score_threshold)

DynamicEmb keeps TorchRec's sharded embedding modules and swaps their storage for HierarchicalKV tables
that admit, score and evict keys. numbactr keeps the part users meet when they configure a table
(DynamicEmbTableOptions, the score strategies, frequency admission with a bounded counter, incremental
dumps, get_score / set_score) on one rank, without TorchRec: its modules (BatchedDynamicEmbeddingTables)
take FBGEMM's CSR batches as NumPy (or CuPy) arrays, the engine's optimizer specs, and a backward call.

options.py  DynamicEmbTableOptions, DynamicEmbScoreStrategy, the initializer args, FrequencyAdmissionStrategy,
            KVCounter; how each score strategy maps onto HierarchicalKV's
tables.py   DynamicEmbeddingTable, BatchedDynamicEmbeddingTables, incremental_dump, get_score, set_score
"""

from numbactr.dynamicemb.options import (
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    FrequencyAdmissionStrategy,
    KVCounter,
)
from numbactr.dynamicemb.tables import (
    BatchedDynamicEmbeddingTables,
    DynamicEmbeddingTable,
    DynamicEmbPoolingMode,
    get_score,
    incremental_dump,
    set_score,
)

__all__ = [
    "BatchedDynamicEmbeddingTables",
    "DynamicEmbInitializerArgs",
    "DynamicEmbInitializerMode",
    "DynamicEmbPoolingMode",
    "DynamicEmbScoreStrategy",
    "DynamicEmbTableOptions",
    "DynamicEmbeddingTable",
    "FrequencyAdmissionStrategy",
    "KVCounter",
    "get_score",
    "incremental_dump",
    "set_score",
]
