"""numbactr.inference: HugeCTR's inference API (``hugectr.inference``) and its hierarchical parameter server.

    from numbactr.inference import InferenceParams, CreateInferenceSession, InferenceModel, HPS
    # (a HugeCTR script's `from hugectr.inference import ...`; `hugectr.inference.X` works after
    #  `import numbactr as hugectr`)

params.py    InferenceParams, VolatileDatabaseParams, PersistentDatabaseParams, UpdateSourceParams, the enums
             DatabaseType_t / DatabaseOverflowPolicy_t / UpdateSourceType_t / EmbeddingCacheType_t,
             ParameterServerConfig (HugeCTR's HPS JSON too)
backends.py  the database tiers: in-process hash map, Redis (redis client), RocksDB (rocksdict)
hps.py       ParameterServer (tiers filled from the sparse model folders), the embedding cache, HPS
hps_update.py  ParameterServer.update: a training table's incremental dump (rows in, evicted keys out)
session.py   InferenceSession / CreateInferenceSession, InferenceModel
"""

from numbactr.inference.backends import BackendError
from numbactr.inference.hps import HPS, ParameterServer
from numbactr.inference.params import (
    DatabaseOverflowPolicy_t,
    DatabaseType_t,
    EmbeddingCacheType_t,
    InferenceParams,
    ParameterServerConfig,
    PersistentDatabaseParams,
    UpdateSourceParams,
    UpdateSourceType_t,
    VolatileDatabaseParams,
    pybind_members,
)
from numbactr.inference.session import CreateInferenceSession, InferenceModel, InferenceSession

# pybind's export_values(): the enum members are module attributes too (hugectr.inference.Dynamic)
globals().update({m.name: m for m in EmbeddingCacheType_t})
globals().update(pybind_members(EmbeddingCacheType_t))  # and HugeCTR's own names: hugectr.inference.dynamic

__all__ = [
    "BackendError",
    "CreateInferenceSession",
    "DatabaseOverflowPolicy_t",
    "DatabaseType_t",
    "EmbeddingCacheType_t",
    "HPS",
    "InferenceModel",
    "InferenceParams",
    "InferenceSession",
    "ParameterServer",
    "ParameterServerConfig",
    "PersistentDatabaseParams",
    "UpdateSourceParams",
    "UpdateSourceType_t",
    "VolatileDatabaseParams",
]
