"""The one switch between numbactr's corrected math and HugeCTR's exact behaviour.

numbactr computes correct gradients by default. Where HugeCTR's backward or update is wrong or unstable
(spec §10: Scale's gradient keeps only the first copy, ElementwiseMultiply divides Y by X and returns 0
where Y == 0, Softmax skips the max subtraction, AdaGrad's accumulator starts from a byte memset), the
HugeCTR behaviour is available for result comparisons:

    NUMBACTR_HUGECTR_EXACT=1 python train.py         # or
    numbactr.hugectr_exact.set_hugectr_exact(True)

Every place that differs reads ``hugectr_exact()`` and documents both behaviours; the README's
"Differences from HugeCTR" lists them.
"""

from __future__ import annotations

import os

_exact = os.environ.get("NUMBACTR_HUGECTR_EXACT", "").strip().lower() in ("1", "true", "yes", "on")


def hugectr_exact() -> bool:
    """True when HugeCTR's exact (quirky) behaviour is requested."""
    return _exact


def set_hugectr_exact(on: bool) -> None:
    global _exact
    _exact = bool(on)
