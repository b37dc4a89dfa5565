"""The embedding object for a SparseEmbedding config: HugeCTR's Embedding_t picks the class.

Its own module because it sits above every kind it builds (sparse_embedding, hybrid), which import each other
in one direction only (hybrid builds on sparse_embedding's OneHotEmbedding).
"""

from __future__ import annotations

from numbactr.embedding.hybrid import HybridEmbedding
from numbactr.embedding.sparse_embedding import HashEmbedding, OneHotEmbedding
from numbactr.embedding.sparse_evicting import EvictingHashEmbedding
from numbactr.enums import Embedding_t


def make_embedding(cfg, sparse_param, opt, seed: int, comm=None):
    """The embedding object for a SparseEmbedding config."""
    if cfg.embedding_type == Embedding_t.LocalizedSlotSparseEmbeddingOneHot:
        return OneHotEmbedding(cfg, sparse_param, opt, seed, comm)
    if cfg.embedding_type == Embedding_t.HybridSparseEmbedding:
        return HybridEmbedding(cfg, sparse_param, opt, seed, comm)
    if getattr(cfg, "evicting", False):  # numbactr's max_capacity: HierarchicalKV's evicting table
        return EvictingHashEmbedding(cfg, sparse_param, opt, seed, comm)
    return HashEmbedding(cfg, sparse_param, opt, seed, comm)
