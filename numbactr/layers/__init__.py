"""Dense layers: one class per Layer_t, shape inference at construction, forward builds tape entries.

A layer gets its DenseLayer config and the FULL shapes of its bottoms (dim 0 = per-rank batch B),
checks them, and declares ``out_shapes`` and ``param_shapes``. The model hands it parameter Tensors
(views into one flat weight buffer, in HugeCTR's file order) before training.

Each module of this package defines ``LAYERS = {Layer_t.X: class}``; the registry merges them.
"""

from __future__ import annotations

import importlib

from numbactr.layers.base import Layer, LayerError, RunInfo

_MODULES = ("core", "elementwise", "shape", "attention", "normalization", "dense", "recurrent", "losses")

REGISTRY: dict = {}
for _name in _MODULES:
    REGISTRY.update(importlib.import_module(f"{__name__}.{_name}").LAYERS)


def build(cfg, in_shapes) -> Layer:
    from numbactr.enums import Layer_t

    if cfg.layer_type == Layer_t.Reshape and cfg.selected:
        from numbactr.layers.shape import ReshapeSelected  # slot selection: a gather, not a view

        return ReshapeSelected(cfg, in_shapes)
    cls = REGISTRY.get(cfg.layer_type)
    if cls is None:
        have = ", ".join(sorted(t.name for t in REGISTRY))
        raise LayerError(
            f"Layer_t.{cfg.layer_type.name} (top {cfg.top_names}) is not implemented in numbactr; available: {have}"
        )
    return cls(cfg, in_shapes)


__all__ = ["Layer", "LayerError", "RunInfo", "REGISTRY", "build"]
