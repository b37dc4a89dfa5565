"""Strict simulator arrays: the sim device's arrays made to say when the host reads them implicitly.

On a GPU, ``bool(a)``, ``int(a)``, ``float(a)``, ``a.item()``, ``a.tolist()`` and iterating of a CuPy array copy
it to the host and wait for the device: a host synchronization, which a training step must not hold (issue
14: the step reads nothing back; a CUDA graph cannot even be captured around one). On the simulator the
arrays are NumPy's and those reads cost nothing, so numbactr.kernels.launch's count of host reads (which
sees ``device.to_host`` and the simulator's copies) cannot see them.

Inside ``strict()`` the sim device's array module (``device.xp()``) is a NumPy whose functions return
``DeviceArray``, an ndarray subclass that NumPy keeps through slicing, ufuncs and reductions (a reduction
gives a 0-d DeviceArray, as CuPy gives a 0-d device array) and that records each implicit host read:
``reads()`` lists them with the line of numbactr's code that made them. Indexing one element gives a 0-d
DeviceArray too (CuPy's behaviour), so ``int(offsets[-1])`` is seen. Reads made by simulated kernels are
not recorded (a kernel runs on the device).

Not seen: arrays a caller made with ``numpy`` itself rather than ``device.xp()`` (they are host arrays to the
code that made them), and ``np.asarray(device_array)`` (CuPy raises on it; NumPy cannot be told).
Used by tests/test_step_counts.py."""

from __future__ import annotations

import contextlib
import sys

import numpy as np

_state = {"active": False, "reads": []}


def _in_kernel() -> bool:
    kernel = sys.modules.get("numba.cuda.simulator.kernel")
    return kernel is not None and kernel._kernel_context is not None


def _where() -> str:
    """The innermost frame of numbactr's own code (not this module) that made the read."""
    f = sys._getframe(2)
    while f is not None:
        module = f.f_globals.get("__name__", "")
        if module.startswith("numbactr.") and module != __name__:
            return f"{module}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "?"


def _note(what: str) -> None:
    if _state["active"] and not _in_kernel():
        _state["reads"].append((what, _where()))


class DeviceArray(np.ndarray):
    """A sim device array that records implicit host reads while strict() is active (module docstring)."""

    def __bool__(self):
        _note("bool")
        return super().__bool__()

    def __int__(self):
        _note("int")
        return super().__int__()

    def __float__(self):
        _note("float")
        return super().__float__()

    def __index__(self):
        _note("index")
        return super().__index__()

    def item(self, *args):
        _note("item")
        return super().item(*args)

    def tolist(self):
        _note("tolist")
        return super().tolist()

    def __iter__(self):
        if not _state["active"] or _in_kernel():
            return super().__iter__()
        return (self[i] for i in range(len(self)))

    def __getitem__(self, key):
        r = super().__getitem__(key)
        if _state["active"] and not isinstance(r, np.ndarray) and not _in_kernel():
            r = np.asarray(r).view(DeviceArray)  # one element: a 0-d device array, as in CuPy
        return r


def _device(x):
    if type(x) is np.ndarray:
        return x.view(DeviceArray)
    if type(x) is tuple:
        return tuple(_device(v) for v in x)
    return x


class StrictNumpy:
    """numpy as the sim device's array module inside strict(): its functions' arrays are DeviceArrays. Code
    that tells NumPy from CuPy by ``xp.__name__`` or ``xp is numpy`` sees neither (the device branches of
    ``is numpy`` tests run), and where the two libraries differ in results it gives CuPy's: ``argsort`` is
    stable (CuPy's always is)."""

    __name__ = "numbactr.runtime.sim_strict"

    @staticmethod
    def argsort(a, axis=-1, kind=None, order=None):
        return _device(np.argsort(a, axis=axis, kind="stable" if kind is None else kind, order=order))

    def __getattr__(self, name):
        obj = getattr(np, name)
        if callable(obj) and not isinstance(obj, (type, np.ufunc)):

            def fn(*args, _obj=obj, **kwargs):
                return _device(_obj(*args, **kwargs))

            fn.__name__ = name
            self.__dict__[name] = fn
            return fn
        return obj


XP = StrictNumpy()


def active() -> bool:
    return _state["active"]


@contextlib.contextmanager
def strict():
    """Inside: sim arrays made by device.xp() record implicit host reads (``reads()``)."""
    before = _state["active"]
    _state["active"] = True
    try:
        yield
    finally:
        _state["active"] = before


def reads(clear: bool = True) -> list:
    """The implicit host reads recorded so far: (what, where) pairs."""
    got = list(_state["reads"])
    if clear:
        _state["reads"].clear()
    return got
