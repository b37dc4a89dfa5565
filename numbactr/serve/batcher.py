"""Dynamic batching: the requests of one model, queued, run together as one session call.

What Triton does (``dynamic_batching`` in config.pbtxt): a request waits in the model's queue; the
scheduler forms a batch of as many queued requests as fit ``max_batch_size``, and sends it at once when it
reaches a ``preferred_batch_size`` (or the maximum), otherwise after the oldest request has waited
``max_queue_delay_microseconds``. Without ``dynamic_batching`` each request runs alone.

What numbactr does: the same rule on asyncio. Sizes are samples (the HugeCTR backend's batch is the
samples of DES, numbactr.serve.infer), so a batch holds whole requests whose samples sum to at most
max_batch_size; a request that does not fit waits for the next batch. A batch is formed once an instance
of its model is free (numbactr.serve.instances: instance_group; one instance by default), so while the
instances are busy the next batch fills. One compute thread runs the batches of every model's instance 0
(compute_executor): an InferenceSession is not thread-safe, numba's workqueue threading layer (numbactr.runtime.threads) takes
calls from one thread at a time, and numbactr's compiled cpu ops and the GPU kernels use the cores
themselves. That thread runs with the calling thread's numba thread count (numba's setting is per
thread; another count would compile and run the other twin of numbactr's parallel kernels). Each
batch's queue time (oldest request), compute time and size go to the metrics callback.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numba

from numbactr.serve import infer

__all__ = ["Batcher", "compute_executor"]


def compute_executor() -> ThreadPoolExecutor:
    """The one compute thread (module docstring), with this thread's numba thread count."""
    return ThreadPoolExecutor(1, "serve-compute", numba.set_num_threads, (numba.get_num_threads(),))


class _Item:
    __slots__ = ("job", "future", "queued")

    def __init__(self, job, future):
        self.job, self.future, self.queued = job, future, time.perf_counter()


class Batcher:
    """The queue of one model. submit(job) -> (the version that ran it, its predictions). A job runs on the
    version it was checked against (infer.Job.model): a batch holds jobs of one version, so a request
    checked just before a new version was swapped in (numbactr.serve.reload) still runs, on the old one."""

    def __init__(self, executor: ThreadPoolExecutor, observe=None, on_instance=None):
        self.executor = executor
        self.observe = observe  # observe(model, samples, queue_s, compute_s) after each batch
        self.on_instance = on_instance  # on_instance(model, instance index) after each batch
        self.running = set()  # the batches being run (instances.py: several at once)
        self.queue: asyncio.Queue | None = None
        self.held: _Item | None = None  # a request that did not fit the last batch
        self.task = None

    def start(self) -> None:
        self.queue = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def submit(self, job: infer.Job):
        """(the model version that ran it, its predictions (n * P,)) of a checked request, once its batch ran."""
        if self.task is None:
            self.start()
        item = _Item(job, asyncio.get_running_loop().create_future())
        await self.queue.put(item)
        return await item.future

    async def close(self) -> None:
        for task in [self.task, *self.running]:
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass

    async def _next(self, timeout: float | None):
        if self.held is not None:
            item, self.held = self.held, None
            return item
        if timeout is None:
            return await self.queue.get()
        if timeout <= 0:
            return self.queue.get_nowait() if not self.queue.empty() else None
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None

    async def _gather(self, first: _Item) -> list:
        """The batch that starts with `first` (module docstring's rule)."""
        batch, total = [first], first.job.n
        cfg = first.job.model.config
        if not cfg.dynamic_batching:
            return batch
        deadline = first.queued + cfg.max_queue_delay_microseconds * 1e-6
        preferred = set(cfg.preferred_batch_size)
        while total < cfg.max_batch_size and total not in preferred:
            item = await self._next(deadline - time.perf_counter())
            if item is None:
                break
            if total + item.job.n > cfg.max_batch_size or item.job.model is not first.job.model:
                self.held = item
                break
            batch.append(item)
            total += item.job.n
        return batch

    @staticmethod
    def _free(model) -> asyncio.Queue:
        """The model version's free instances: None (the compute thread) and its workers (instances.py)."""
        free = getattr(model, "free_instances", None)
        if free is None:
            free = model.free_instances = asyncio.Queue()
            for runner in [None] + list(model.workers):
                free.put_nowait(runner)
        return free

    async def _loop(self) -> None:
        while True:
            first = await self._next(None)
            free = self._free(first.job.model)
            runner = await free.get()  # a free instance first: the batch fills while it waits
            batch = await self._gather(first)
            task = asyncio.get_running_loop().create_task(self._run(batch, runner, free))
            self.running.add(task)
            task.add_done_callback(self.running.discard)

    async def _run(self, batch: list, runner, free: asyncio.Queue) -> None:
        loop = asyncio.get_running_loop()
        model = batch[0].job.model
        start = time.perf_counter()
        jobs = [i.job for i in batch]
        try:
            if runner is None:
                results = await loop.run_in_executor(self.executor, infer.run, jobs)
            else:
                results = await loop.run_in_executor(runner.thread, runner.run, jobs)
        except Exception as e:  # noqa: BLE001 (every waiting request gets the error, the loop goes on)
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(e)
            return
        finally:
            free.put_nowait(runner)
        done = time.perf_counter()
        for item, preds in zip(batch, results):
            if not item.future.done():  # a client that went away has cancelled its future
                item.future.set_result((model, preds))
        if self.observe is not None:
            self.observe(model, sum(i.job.n for i in batch), start - batch[0].queued, done - start)
        if self.on_instance is not None:
            self.on_instance(model, 0 if runner is None else runner.index)
