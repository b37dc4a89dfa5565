"""Leaf validators shared by every configuration object: a ValueError that names the argument and its range,
and the IgnoredArgumentWarning for an argument numbactr accepts but does not act on. Imports nothing of numbactr:
config, optim, inference and the faces all check their arguments the same way."""

from __future__ import annotations

import math
import numbers
import warnings


class IgnoredArgumentWarning(UserWarning):
    """An argument was accepted but has no effect in numbactr (the message names it and says why)."""


def expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def warn_ignored(who: str, arg: str, value, why: str, stacklevel: int) -> None:
    warnings.warn(f"{who}: {arg}={value!r} is ignored: {why}", IgnoredArgumentWarning, stacklevel=stacklevel + 1)


def number(who: str, name: str, v, lo=None, hi=None, lo_open=False, hi_open=False, integer=False):
    """Check that v is a finite real (an int if integer) in the range given; returns it."""
    kind = "an integer" if integer else "a number"
    ok = isinstance(v, numbers.Integral if integer else numbers.Real)
    expect(ok and not isinstance(v, bool), f"{who}: {name} must be {kind}, got {v!r}")
    rng = (
        f"{'(' if lo_open else '['}{'-inf' if lo is None else lo}, "
        f"{'inf' if hi is None else hi}{')' if hi_open or hi is None else ']'}"
    )
    expect(math.isfinite(v), f"{who}: {name} must be finite, got {v!r}")
    expect(lo is None or (v > lo if lo_open else v >= lo), f"{who}: {name} must lie in {rng}, got {v!r}")
    expect(hi is None or (v < hi if hi_open else v <= hi), f"{who}: {name} must lie in {rng}, got {v!r}")
    return v
