"""A Model's snapshot files: the save of everything (dense, sparse, the collections' tables) as one
commit, and what every load does before it replaces anything. The layouts are numbactr.files.checkpoint's
and numbactr.embedding.collection's.

Why before_load: a load replaces counters and arrays, so the skips counted on the device are accounted
for first (the loaded step counters are then the host's), and the captured CUDA graphs, which point at
the old arrays, are dropped.
"""

from __future__ import annotations

from numbactr.files import checkpoint
from numbactr.train import graph, overflow, step
from numbactr.train import training_cache


def save_params(model, prefix: str, iteration) -> None:
    """Model.save_params_to_files: the dense files and every table, committed as one unit."""
    graph.require_compiled(model, "save_params_to_files")
    model.check_deferred()
    iteration = checkpoint._iteration(iteration)  # checked before any file is written
    if model.etc is not None:  # ETC: the tables go to their sparse model folders, the rest under prefix
        training_cache.save_sparse_models(model, model.etc)
        checkpoint.save(model, prefix, iteration, with_sparse=False)
        return
    checkpoint.save(model, prefix, iteration)
    if model.collections:  # the tables: their own atomic dump beside the dense files
        model.embedding_dump(f"{prefix}_embedding_collection_{iteration}")


def before_load(model) -> None:
    """What every load does first (module docstring)."""
    overflow.sync_skips(model)
    step.drop_graphs(model, "a load")


def one_of(who: str, **given):
    """The one argument given of two names for it (HugeCTR's overloads: a list, or a dict by another name)."""
    set_ = [(k, v) for k, v in given.items() if v is not None]
    if len(set_) != 1:
        raise TypeError(f"Model.{who}: give one of {' or '.join(given)}, got {[k for k, _ in set_] or 'none'}")
    return set_[0][1]
