"""HugeCTR-style log lines, ``[HCTR][HH:MM:SS.mmm][INFO][RK0][main]: message``, and progress.

    log.info("...")                    rank 0 only, stdout
    log.info_once("key", "...")        the same, once per process and key (defaults numbactr picked)
    log.warn("...")                    every rank, stderr
    with log.progress(total=n, desc="write train", unit="sample") as bar:
        bar.update(k)

``progress`` draws a tqdm bar on a terminal (stderr is a TTY; it appears only for tasks that take longer
than a second). When output goes to a file, a pipe or CI, it writes a log line every
NUMBACTR_PROGRESS_INTERVAL seconds (default 10) and a closing line if it wrote any, so short tasks stay
silent. NUMBACTR_PROGRESS=0 turns both off; only rank 0 reports.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

_rank = 0
_said: set = set()


def set_rank(rank: int) -> None:
    global _rank
    _rank = int(rank)


def _stamp(level: str) -> str:
    now = datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]
    return f"[HCTR][{now}][{level}][RK{_rank}][main]: "


def info(msg: str) -> None:
    if _rank != 0:  # one voice per job, like HugeCTR's rank-0 logging
        return
    print(_stamp("INFO") + msg, flush=True)


def info_once(key, msg: str) -> None:
    """info(msg) the first time `key` is seen in this process (a default numbactr chose for the user is
    said once, not per reader or per epoch)."""
    if key in _said:
        return
    _said.add(key)
    info(msg)


def warn(msg: str) -> None:
    print(_stamp("WARNING") + msg, file=sys.stderr, flush=True)


# ---- progress -------------------------------------------------------------------------------------
class _LogProgress:
    """The non-terminal progress report: a log line every `interval` seconds, a closing line if any."""

    def __init__(self, total, desc: str, unit: str, interval: float):
        self.total, self.desc, self.unit, self.interval = total, desc, unit, interval
        self.n, self.t0 = 0, time.monotonic()
        self.last, self.lines = self.t0, 0

    def _line(self, end: str = "") -> None:
        el = time.monotonic() - self.t0
        of = f"/{self.total:,}" if self.total else ""
        pct = f" ({100.0 * self.n / self.total:.0f}%)" if self.total else ""
        rate = f", {self.n / el:,.0f} {self.unit}/s" if el > 0 else ""
        info(f"{self.desc}: {self.n:,}{of} {self.unit}{pct} in {el:.1f}s{rate}{end}")
        self.lines += 1

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self._line()

    def close(self) -> None:
        if self.lines:
            self._line(", done")
            self.lines = 0


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class _Progress:
    """Context manager around the chosen reporter; `update(n)` and `close()` pass through."""

    def __init__(self, impl):
        self.impl = impl

    def update(self, n: int = 1) -> None:
        self.impl.update(n)

    def close(self) -> None:
        self.impl.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def progress(total: int | None = None, desc: str = "", unit: str = "it") -> _Progress:
    """A progress reporter for a long loop: a tqdm bar on a terminal, periodic log lines otherwise."""
    mode = os.environ.get("NUMBACTR_PROGRESS", "").strip().lower()
    if _rank != 0 or mode in ("0", "off", "no", "false"):
        return _Progress(_NoProgress())
    if sys.stderr.isatty():
        from tqdm import tqdm

        # delay: no bar at all for tasks that end within a second; unit_scale: 266k/850k samples (without a
        # total tqdm would write a count as "13.0batch", so counts stay plain)
        return _Progress(
            tqdm(
                total=total,
                desc=desc,
                unit=unit,
                unit_scale=total is not None,
                delay=1.0,
                dynamic_ncols=True,
                file=sys.stderr,
            )
        )
    try:
        interval = float(os.environ.get("NUMBACTR_PROGRESS_INTERVAL", "10"))
    except ValueError:
        raise ValueError(
            f"NUMBACTR_PROGRESS_INTERVAL={os.environ['NUMBACTR_PROGRESS_INTERVAL']!r}: "
            f"expected seconds between progress lines"
        ) from None
    return _Progress(_LogProgress(total, desc, unit, interval))
