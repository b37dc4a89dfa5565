"""`hugectr.*` submodules for scripts that changed only their import line.

A HugeCTR script becomes a numbactr script by one change, ``import hugectr`` -> ``import numbactr as hugectr``.
Many also write ``from hugectr.inference import InferenceParams``, ``from hugectr.tools import DataGenerator``
or ``from hugectr.data import DataSourceParams``: an ``import ... as`` binds a name, not a module path, so
Python would look for a package called ``hugectr`` and fail. Importing numbactr therefore adds a finder that
resolves ``hugectr`` and ``hugectr.X`` to ``numbactr`` and ``numbactr.X`` (the same module objects), unless a
real ``hugectr`` package is importable (then nothing is added) or ``NUMBACTR_HUGECTR_ALIAS=0``.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_PREFIX = "hugectr"


class _Loader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__     # importlib sets module.__spec__ to the alias spec next
        return module

    def exec_module(self, module):
        module.__spec__ = self.own_spec     # already executed under its numbactr name: keep that identity


class HugeCTRAlias(importlib.abc.MetaPathFinder):
    """Finds ``hugectr[.X]`` as the already importable ``numbactr[.X]``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _PREFIX and not fullname.startswith(_PREFIX + "."):
            return None
        real = "numbactr" + fullname[len(_PREFIX):]
        if real not in sys.modules and importlib.util.find_spec(real) is None:
            return None                     # hugectr.X with no numbactr.X: the usual ModuleNotFoundError
        is_pkg = hasattr(sys.modules.get(real) or importlib.import_module(real), "__path__")
        return importlib.machinery.ModuleSpec(fullname, _Loader(real), is_package=is_pkg)


def install() -> bool:
    """Add the finder once; returns whether it is active."""
    if any(isinstance(f, HugeCTRAlias) for f in sys.meta_path):
        return True
    if os.environ.get("NUMBACTR_HUGECTR_ALIAS", "1").strip() == "0":
        return False
    if _PREFIX in sys.modules or importlib.machinery.PathFinder.find_spec(_PREFIX) is not None:
        return False                        # NVIDIA's hugectr is installed: leave it alone
    sys.meta_path.insert(0, HugeCTRAlias())  # before PathFinder, which would find numbactr/X under hugectr
    return True
