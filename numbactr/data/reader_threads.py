"""The data reader's threads: W worker threads, each running ahead into its own bounded queue, and the
round-robin consumer that hands their batches out in HugeCTR's order (numbactr.data.reader: the order,
the prefetch depth, when threads stop).

    p = _Pass(generators, depth, stop)   # starts one thread per generator (each yields Batch objects)
    for batch in p: ...                  # worker 0, 1, ..., W-1, 0, ...; finished workers are skipped
    p.pause(); p.close()                 # join the threads (pause keeps each worker's place)

A worker's exception travels through its queue as a _Failure and is re-raised by the consumer at its place
in the sample order. Why every pass is tracked until collected: no reader thread may still run while the
interpreter shuts down (a daemon thread inside pyarrow then aborts the process), so _close_all_passes
joins them at exit.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from types import SimpleNamespace

from numbactr.data.batch import Batch

_EOF = object()


class _Failure:
    def __init__(self, exc):
        self.exc = exc


def _put(q, item, stop, halt) -> bool:
    """Queue item; False if the pass stops or pauses first."""
    while not (stop.is_set() or halt.is_set()):
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            pass
    return False


def _next_item(gen):
    """gen's next batch, _EOF at its end, or the _Failure that the consumer re-raises in sample order."""
    try:
        return next(gen)
    except StopIteration:
        return _EOF
    except BaseException as e:  # noqa: BLE001
        return _Failure(e)


class _Worker:
    """One worker: its generator and queue, its thread while it runs, and the item it made but could not
    queue before a pause (queued first when it resumes). It holds nothing of the pass, so dropping the
    pass object closes it."""

    def __init__(self, gen, depth: int):
        self.gen, self.q = gen, queue.Queue(maxsize=depth)
        self.held = None
        self.thread: threading.Thread | None = None
        self.finished = False  # its _EOF or _Failure is queued


def _worker_main(wk: _Worker, stop, halt) -> None:
    try:
        while not wk.finished:
            if wk.held is None:
                wk.held = _next_item(wk.gen)
            if not _put(wk.q, wk.held, stop, halt):
                return  # stopped, or paused with wk.held kept for the next run
            wk.finished = wk.held is _EOF or isinstance(wk.held, _Failure)
            wk.held = None
    finally:
        if wk.finished or stop.is_set():
            wk.gen.close()


class _Pass:
    """One pass over the data: W workers, consumed round-robin.

    Its threads are joined when the pass ends, is closed or dropped, and at interpreter exit
    (_close_all_passes); pause() joins them too but keeps the pass's place, and the next batch restarts
    them."""

    def __init__(self, gens, depth, stop):
        self.stop, self.halt = stop, threading.Event()
        self.workers = [_Worker(g, depth) for g in gens]
        self.queues = [wk.q for wk in self.workers]
        self.eof = [False] * len(gens)
        self.counter = 0
        self.done = False
        self.paused = True
        self.memory = SimpleNamespace(arena=None)  # the workers' (DataReader.__iter__ shares its own)
        _PASSES.add(self)
        self._start()

    def _start(self) -> None:
        for wk in self.workers:  # a pause that timed out: its thread still owns the generator
            if wk.thread is not None:
                wk.thread.join()
        self.halt.clear()
        for w, wk in enumerate(self.workers):
            if not wk.finished:
                wk.thread = threading.Thread(
                    target=_worker_main, args=(wk, self.stop, self.halt), daemon=True, name=f"numbactr-reader-{w}"
                )
                wk.thread.start()
        self.paused = False

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if self.done:
            raise StopIteration
        if self.paused:
            self._start()
        W = len(self.workers)
        while True:
            if all(self.eof):
                self.close()
                raise StopIteration
            w = self.counter
            if self.eof[w]:
                self.counter = (w + 1) % W
                continue
            item = self._get(w)
            if item is _EOF:
                self.eof[w] = True
                self.counter = (w + 1) % W
                continue
            if isinstance(item, _Failure):
                self.close()
                raise item.exc
            self.counter = (w + 1) % W
            return item

    def _get(self, w):
        q, t = self.queues[w], self.workers[w].thread
        while True:
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                if self.stop.is_set():
                    return _Failure(RuntimeError("the data reader was closed"))
                if not t.is_alive() and q.empty():
                    return _Failure(RuntimeError(f"data reader worker {w} exited without a result"))

    def pause(self, timeout: float = 10.0) -> None:
        """Stop and join the workers, keeping the queued batches and each worker's place in its files; the
        next batch restarts them (Model.fit does this at its end)."""
        if not (self.done or self.paused):
            self.halt.set()
            self._join(timeout)
            self.paused = True

    def close(self, timeout: float = 10.0) -> None:
        """End the pass: stop the workers, free the queued batches, join the threads (each finishes at most
        the chunk it is decoding) and close the generators."""
        self.done = True
        self.stop.set()
        for q in self.queues:  # free buffered batches, unblock puts
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
        self._join(timeout)
        for wk in self.workers:  # a paused worker's generator (a running thread closes its own)
            if wk.thread is None or not wk.thread.is_alive():
                wk.gen.close()

    def _join(self, timeout: float) -> None:
        for wk in self.workers:
            if wk.thread is not None and wk.thread is not threading.current_thread():
                wk.thread.join(timeout)

    def __del__(self):
        if not self.done:
            self.close()


_PASSES: weakref.WeakSet = weakref.WeakSet()  # passes not yet collected


@atexit.register
def _close_all_passes() -> None:
    """No reader thread may still run when the interpreter shuts down: a daemon thread inside pyarrow then
    aborts the process ("terminate called without an active exception", or "PyGILState_Release: thread
    state must be current")."""
    for p in list(_PASSES):
        p.close()
