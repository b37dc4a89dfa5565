"""Checks shared by the configuration objects: slot sizes and yes/no flags."""

from __future__ import annotations

import numbers

from numbactr.validate import expect as _expect


def _sizes(who: str, values) -> list:
    """slot_size_array: whole numbers >= 0 (a float such as 2.7 is refused, not truncated)."""
    _expect(not isinstance(values, (str, bytes)), f"{who}: slot_size_array must be a list of sizes, got {values!r}")
    out = []
    for s, v in enumerate(values):
        whole = isinstance(v, numbers.Integral) or (isinstance(v, numbers.Real) and float(v).is_integer())
        _expect(
            whole and not isinstance(v, bool) and v >= 0,
            f"{who}: slot_size_array[{s}] must be a whole number >= 0, got {v!r}",
        )
        out.append(int(v))
    return out


def _flag(who: str, name: str, v) -> bool:
    """A yes/no argument: True/False (numpy's too, or the integers 0/1); a string such as "False" is refused
    (it would read as true)."""
    import numpy as np

    _expect(
        isinstance(v, (bool, np.bool_)) or (isinstance(v, numbers.Integral) and v in (0, 1)),
        f"{who}: {name} must be True or False, got {v!r}",
    )
    return bool(v)
