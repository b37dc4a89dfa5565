"""HugeCTR's HPS plugin for PyTorch (``hps_torch``) on numbactr's hierarchical parameter server (imports torch).

    import hps_torch                          ->  import numbactr.hps_torch as hps_torch
                                                  (or, after ``import numbactr``, ``import hps_torch`` as it is)
    layer = hps_torch.LookupLayer(ps_config_file, model_name, table_id, emb_vec_size)
    vectors = layer(keys)                     # keys (...) int32/int64 -> (..., emb_vec_size) float32

A lookup-only module (the inference side of a model trained elsewhere): each key's vector from the model's
table through numbactr.inference.HPS, that is the embedding cache, then the volatile and persistent
databases the HPS JSON configures, and default_value_for_each_table for a key none of them has. As in
HugeCTR's plugin, the parameter server of one JSON file is started once per process and shared by every
layer built on that file. The output is float32 on the keys' device and carries no gradient.

Checked at construction (ValueError / KeyError naming what is wrong): the JSON (numbactr.inference's HPS
JSON reader), the model name, the table index and emb_vec_size against the table's
embedding_vecsize_per_table. At each call: integer keys, each valid for the model's key width
(supportlonglong), at most maxnum_catfeature_query_per_table_per_sample x max_batch_size of them.
"""

from __future__ import annotations

import os
import threading

try:
    import torch
except ImportError as e:
    raise ImportError("numbactr.hps_torch is HPS's PyTorch plugin and needs torch: pip install torch") from e

from numbactr.inference.hps import HPS

__all__ = ["LookupLayer"]

_SERVERS: dict = {}  # abspath of an HPS JSON -> its HPS (one per process)
_LOCK = threading.Lock()


def _server(ps_config_file: str) -> HPS:
    path = os.path.abspath(os.fspath(ps_config_file))
    with _LOCK:
        hps = _SERVERS.get(path)
        if hps is None:
            hps = _SERVERS[path] = HPS(hps_json_config_file=path)
        return hps


class LookupLayer(torch.nn.Module):
    """HPS lookups as a torch module (``torch.nn.Embedding``'s forward for a served table).

    Args (HugeCTR's):
        ps_config_file: the HPS JSON.
        model_name: a model of that JSON ("model").
        table_id: the index of its table (its sparse_files / embedding_table_names order).
        emb_vec_size: the table's vector width (must equal its embedding_vecsize_per_table entry).
    """

    def __init__(self, ps_config_file: str, model_name: str, table_id: int, emb_vec_size: int):
        super().__init__()
        self.ps_config_file = ps_config_file
        self.model_name = model_name
        self.table_id = table_id
        self.emb_vec_size = emb_vec_size
        hps = _server(ps_config_file)
        model = hps.config.models.get(model_name)
        if model is None:
            raise KeyError(
                f"hps_torch.LookupLayer: model {model_name!r} is not in {ps_config_file!r}; its models: "
                f"{sorted(hps.config.models)}"
            )
        dims = hps.ps.cache(model_name).dims
        if not isinstance(table_id, int) or not 0 <= table_id < len(dims):
            raise ValueError(
                f"hps_torch.LookupLayer: model {model_name!r} has tables 0..{len(dims) - 1}, not table_id={table_id!r}"
            )
        if int(emb_vec_size) != int(dims[table_id]):
            raise ValueError(
                f"hps_torch.LookupLayer: emb_vec_size={emb_vec_size}, but table {table_id} of model "
                f"{model_name!r} has vectors of {int(dims[table_id])} (embedding_vecsize_per_table)"
            )
        self._hps = hps

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        """(..., emb_vec_size) float32 vectors of int32 / int64 keys of any shape."""
        if not isinstance(keys, torch.Tensor):
            raise TypeError(f"hps_torch.LookupLayer: keys must be a torch.Tensor, got {type(keys).__name__}")
        if keys.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"hps_torch.LookupLayer: keys must be int32 or int64, got {keys.dtype}")
        flat = keys.detach().reshape(-1).cpu().numpy()
        vectors = self._hps.lookup(flat, self.model_name, self.table_id)
        out = torch.from_numpy(vectors).reshape(*keys.shape, self.emb_vec_size)
        return out.to(keys.device)

    def extra_repr(self) -> str:
        return (
            f"ps_config_file={self.ps_config_file!r}, model_name={self.model_name!r}, "
            f"table_id={self.table_id}, emb_vec_size={self.emb_vec_size}"
        )
