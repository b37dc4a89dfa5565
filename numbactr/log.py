"""HugeCTR-style log lines: ``[HCTR][HH:MM:SS.mmm][INFO][RK0][main]: message``."""
from __future__ import annotations

import datetime
import sys

_rank = 0


def set_rank(rank: int) -> None:
    global _rank
    _rank = int(rank)


def info(msg: str) -> None:
    if _rank != 0:                      # one voice per job, like HugeCTR's rank-0 logging
        return
    now = datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]
    print(f"[HCTR][{now}][INFO][RK{_rank}][main]: {msg}", flush=True)


def warn(msg: str) -> None:
    now = datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]
    print(f"[HCTR][{now}][WARNING][RK{_rank}][main]: {msg}", file=sys.stderr, flush=True)
