"""Layers of this group register here (see numbactr/layers/__init__.py)."""
LAYERS: dict = {}
