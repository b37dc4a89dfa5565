"""`hugectr.*` submodules for scripts that changed only their import line.

A HugeCTR script becomes a numbactr script by one change, ``import hugectr`` -> ``import numbactr as hugectr``.
Many also write ``from hugectr.inference import InferenceParams``, ``from hugectr.tools import DataGenerator``
or ``from hugectr.data import DataSourceParams``: an ``import ... as`` binds a name, not a module path, so
Python would look for a package called ``hugectr`` and fail. Importing numbactr therefore adds a finder that
resolves ``hugectr`` and ``hugectr.X`` to ``numbactr`` and ``numbactr.X`` (the same module objects),
HugeCTR's separately installed ONNX converter ``hugectr2onnx`` to ``numbactr.onnx_converter.hugectr2onnx``
and its HPS plugin for PyTorch ``hps_torch`` to ``numbactr.hps_torch``, each unless a real package of that
name is importable, or ``NUMBACTR_HUGECTR_ALIAS=0``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_ALIASES = {
    "hugectr": "numbactr",
    "hugectr2onnx": "numbactr.onnx_converter.hugectr2onnx",
    "hps_torch": "numbactr.hps_torch",
}


class _Loader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__  # importlib sets module.__spec__ to the alias spec next
        return module

    def exec_module(self, module):
        module.__spec__ = self.own_spec  # already executed under its numbactr name: keep that identity


class HugeCTRAlias(importlib.abc.MetaPathFinder):
    """Finds ``hugectr[.X]`` as the already importable ``numbactr[.X]`` (and ``hugectr2onnx[.X]``)."""

    def __init__(self, names):
        self.names = dict(names)  # alias top-level name -> numbactr module

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.split(".", 1)[0]
        if top not in self.names:
            return None
        real = self.names[top] + fullname[len(top) :]
        if real not in sys.modules and importlib.util.find_spec(real) is None:
            return None  # hugectr.X with no numbactr.X: the usual ModuleNotFoundError
        is_pkg = hasattr(sys.modules.get(real) or importlib.import_module(real), "__path__")
        return importlib.machinery.ModuleSpec(fullname, _Loader(real), is_package=is_pkg)


def install() -> bool:
    """Add the finder once; returns whether it is active."""
    if any(isinstance(f, HugeCTRAlias) for f in sys.meta_path):
        return True
    if os.environ.get("NUMBACTR_HUGECTR_ALIAS", "1").strip() == "0":
        return False
    # a name whose real package is installed (NVIDIA's hugectr, its hugectr2onnx) is left alone
    names = {
        a: r
        for a, r in _ALIASES.items()
        if a not in sys.modules and importlib.machinery.PathFinder.find_spec(a) is None
    }
    if not names:
        return False
    sys.meta_path.insert(0, HugeCTRAlias(names))  # before PathFinder, which would find numbactr/X under hugectr
    return True
