"""Embedding-bag ops: the pooled lookup of CSR bags, and the tape entry of a SparseEmbedding lookup.

Contract: ``embedding_bag_forward(table, rows, offsets, combiner)`` -> (nbags, D) pooled rows, through
numbactr.ops.dispatch.pick (numba.cuda kernel of numbactr.kernels.embedding_bag on gpu/sim, its NumPy
reference on cpu). ``LookupFn`` puts an embedding's lookup on the autograd tape.

Formula: out[b] = Σ_{k in bag b} table[rows[k]] (combiner sum), divided by the bag's size (mean);
rows == -1 (a key missing in eval) add nothing but count for the mean.

Why LookupFn hands dY to the embedding instead of returning a gradient: the embedding's rows live in its
own (sparse, sharded, cached) storage; its update() applies dY there, the dense tape sees no gradient.
"""

from __future__ import annotations

import numpy as np

from numbactr.autograd import Context, Function
from numbactr.kernels import embedding_bag
from numbactr.ops.dispatch import pick
from numbactr.runtime.device import xp as _xp


def _forward_kernel(table, rows, offsets, combiner):
    out = _xp().empty((offsets.shape[0] - 1, table.shape[1]), np.float32)
    embedding_bag.embedding_bag_forward(table, rows, offsets, combiner, out)
    return out


def embedding_bag_forward(table, rows, offsets, combiner: int):
    """(nbags, D) pooled rows; rows == -1 (missing in eval) add nothing but count for the mean."""
    return pick(kernel=_forward_kernel, ref=embedding_bag.embedding_bag_forward_ref)(table, rows, offsets, combiner)


class LookupFn(Function):
    """A SparseEmbedding lookup on the tape: forward pools (B, S, D); backward hands dY to the embedding,
    whose update() applies it (the pool gets no dense gradient)."""

    @staticmethod
    def forward(ctx: Context, pool, emb=None, keys=None, offsets=None, training=True, shape=()):
        ctx.emb = emb
        out, ctx.lookup = emb.lookup(keys, offsets, training)
        return out.reshape(shape)

    @staticmethod
    def backward(ctx: Context, dy):
        ctx.emb.hold_gradient(ctx.lookup, dy)


class CollectionLookupFn(Function):
    """An EmbeddingCollection's lookups on the tape: forward returns every top (``coll.lookup``); backward hands
    their dLoss/dtop to the collection (``coll.hold_gradients``), whose update applies them (no dense gradient)."""

    @staticmethod
    def forward(ctx: Context, anchor, coll=None, inputs=None, training=True):
        ctx.coll = coll
        return tuple(coll.lookup(inputs, training))

    @staticmethod
    def backward(ctx: Context, *dys):
        ctx.coll.hold_gradients(dys)
        return None
