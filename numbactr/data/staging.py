"""Training batches moved to the device one step ahead, through pinned double buffers (a GPU step's input).

Without staging, a GPU step copies its batch from pageable host memory at the moment it needs it: the copy
runs on the compute stream and the host waits for it. ``DeviceStager`` instead, inside step k:

1. hands out batch k, staged during step k-1 (the compute stream waits for its copy event: a device-side
   wait, the host goes on);
2. reads batch k+1 from the reader and copies it into the *other* slot's pinned host buffers (one host
   memcpy; the host first waits until that slot's previous upload left the pinned buffers), then queues the
   upload to the slot's device buffers on a second, non-blocking stream, after an event that marks the end
   of step k-1 on the compute stream (the last user of that slot);
3. returns, and step k's kernels are queued behind batch k's copy only, overlapping batch k+1's upload.

The host memcpy of step 2 is skipped when the reader's workers already wrote the batch into pinned memory:
the stager gives the reader's pass its ``PinnedArena`` (``pass.memory.arena``), the workers assemble every batch
after that in the arena's blocks (numbactr.data.reader._assemble), and the upload reads those blocks directly.
A batch's blocks go back to the arena once its upload event has completed, so the arena holds about as many
batches as are in flight (the reader's queues and the two staged ones); an array that is not in the batch's
blocks (the float16 dense that Model makes under mixed precision) takes the copy path. ``host_copies`` and
``direct_uploads`` count the two paths.

Offsets of one-hot inputs (one key per bag, the usual Criteo/MLPerf slot) are not uploaded: the device keeps
one ``arange(B*S + 1)`` per shape. Batches are handed out as ``Batch`` objects whose arrays are views of the
slot's device buffers, valid until the step after next (the model reads them within its step).

On the simulator the same slots are plain NumPy buffers and the copies ``np.copyto`` (there are no streams):
the order, the reader's semantics and the contents are what the tests there check; the streams and events
are the GPU's. Model.train uses a stager when every embedding is a SparseEmbedding on the kernels
(numbactr.train.step.stager_for_step); NUMBACTR_STAGE_INPUTS=0 turns it off. On several ranks the
sharded embeddings read each batch's keys on the host to route them to their owners: the stager then keeps
the batch's host arrays as read-only mirrors of its device arrays (host_mirrors), which
numbactr.runtime.device.to_host returns without a device read.
"""

from __future__ import annotations

import collections
import os
import threading

import numpy as np

from numbactr.runtime import device
from numbactr.data.batch import Batch

_END = object()  # the reader's end (an epoch-mode source): handed out as None, once


def staging_enabled() -> bool:
    flag = os.environ.get("NUMBACTR_STAGE_INPUTS", "1")
    if flag not in ("0", "1"):
        raise ValueError(f"NUMBACTR_STAGE_INPUTS must be 0 or 1, got {flag!r}")
    return flag == "1" and device.uses_kernels()


class PinnedArena:
    """Host blocks that reader workers assemble batches in (numbactr.data.reader._assemble): page-locked on a
    GPU, so an upload from them is a DMA with no host copy; plain NumPy memory on the simulator. Blocks come in
    power-of-two sizes (at least MIN_BLOCK bytes); ``release(memory, event)`` returns a batch's blocks once the
    event (the upload that read them) has completed. Thread-safe: workers take blocks, the training thread
    releases them. Blocks that are never released are ordinary garbage (their batch was dropped)."""

    MIN_BLOCK = 4096

    def __init__(self, gpu: bool):
        self.gpu = gpu
        self.device_id = None
        if gpu:
            import cupy

            self.device_id = cupy.cuda.runtime.getDevice()  # the rank's GPU, for allocations in worker threads
        self._bound = threading.local()  # .id: the GPU this thread was bound to (bind_thread)
        self._lock = threading.Lock()
        self._free: dict[int, list] = collections.defaultdict(list)
        self._waiting: collections.deque = collections.deque()  # (event or None, [blocks]) in upload order
        self.blocks = 0  # blocks made (statistics)
        self.reused = 0  # blocks handed out again

    def batch_memory(self) -> "BatchMemory":
        return BatchMemory(self)

    def bind_thread(self) -> None:
        """Make the rank's GPU this thread's current device, once per thread and never undone. A reader worker
        is a new thread, whose current device is GPU 0: its first CUDA call (an event query, a pinned
        allocation) would create a context on GPU 0 for every rank, and a ``with Device(id)`` block would set
        GPU 0 back (creating that context) on leaving."""
        if self.gpu and getattr(self._bound, "id", None) != self.device_id:
            import cupy

            cupy.cuda.runtime.setDevice(self.device_id)
            self._bound.id = self.device_id

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 block of at least nbytes (its own power-of-two size)."""
        size = max(self.MIN_BLOCK, 1 << (max(int(nbytes), 1) - 1).bit_length())
        self.bind_thread()
        with self._lock:
            self._reclaim()
            free = self._free.get(size)
            if free:
                self.reused += 1
                return free.pop()
            self.blocks += 1
        return self._new(size)

    def _new(self, size: int) -> np.ndarray:
        if not self.gpu:
            return np.empty(size, np.uint8)
        import cupy

        mem = cupy.cuda.alloc_pinned_memory(size)  # on the rank's GPU: take() bound this thread to it
        return np.frombuffer(mem, np.uint8, size)

    def release(self, memory: "BatchMemory", event=None) -> None:
        """Give memory's blocks back once `event` (a cupy Event; None: now) has completed."""
        blocks, memory.blocks = memory.blocks, []
        if blocks:
            with self._lock:
                self._waiting.append((event, blocks))

    def _reclaim(self) -> None:
        while self._waiting:
            event, blocks = self._waiting[0]
            if event is not None and not event.done:  # uploads complete in order (one stream)
                return
            self._waiting.popleft()
            for b in blocks:
                self._free[b.shape[0]].append(b)


class BatchMemory:
    """The arena blocks of one batch: ``empty(shape, dtype)`` hands out arrays in new blocks,
    ``owns(a)`` says whether an array lies in one of them."""

    def __init__(self, arena: PinnedArena):
        self.arena = arena
        self.blocks: list = []
        self._spans: list = []  # (address, bytes) of each block

    def empty(self, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64))
        block = self.arena.take(n * dtype.itemsize)
        self.blocks.append(block)
        self._spans.append((block.__array_interface__["data"][0], block.shape[0]))
        return block[: n * dtype.itemsize].view(dtype).reshape(shape)

    def owns(self, a: np.ndarray) -> bool:
        p = a.__array_interface__["data"][0]
        return any(s <= p and p + a.nbytes <= s + n for s, n in self._spans)


class _Slot:
    """One buffer set: pinned host arrays (the copy path) and device arrays per (name, dtype), grown as
    needed, plus the event of its last upload."""

    def __init__(self, gpu: bool):
        self.gpu = gpu
        self.host: dict = {}
        self.dev: dict = {}
        self.uploaded = None  # cupy Event of the last upload (gpu)

    def device_buffer(self, name: str, dtype, n: int):
        """The device (n,) flat view for `name`."""
        dtype = np.dtype(dtype)
        key = (name, dtype.str)
        d = self.dev.get(key)
        if d is None or d.shape[0] < n:
            d = self.dev[key] = device.xp().empty(max(n, 1 if d is None else int(d.shape[0] * 1.25)), dtype)
        return d[:n]

    def host_buffer(self, name: str, dtype, n: int):
        """The pinned host (n,) flat view for `name` (the copy path)."""
        dtype = np.dtype(dtype)
        key = (name, dtype.str)
        h = self.host.get(key)
        if h is None or h.shape[0] < n:
            h = self.host[key] = self._pinned(max(n, 1 if h is None else int(h.shape[0] * 1.25)), dtype)
        return h[:n]

    def _pinned(self, n: int, dtype):
        if not self.gpu:
            return np.empty(n, dtype)
        import cupy

        mem = cupy.cuda.alloc_pinned_memory(max(n * dtype.itemsize, 1))
        return np.frombuffer(mem, dtype, n)


class DeviceStager:
    """See the module docstring. ``next(reader, fetch)``: the next batch of `reader` on the device (None at
    the end of an epoch-mode source), with the one after it already uploading.

    host_mirrors (several ranks: the sharded embeddings route each key to its owner on the host): the batch
    handed out keeps its host arrays, registered with numbactr.runtime.device.add_host_mirrors, so that
    device.to_host of its device arrays reads nothing back; they stay valid (a reader's arena blocks are
    released, a slot's pinned buffers restaged) only once the next batch is handed out."""

    def __init__(self, host_mirrors: bool = False):
        self.host_mirrors = bool(host_mirrors)
        self._out = None  # (mirror pairs, arena memory) of the batch handed out last
        self.kind = device.kind()
        self.gpu = self.kind == "gpu"
        self.slots = [_Slot(self.gpu), _Slot(self.gpu)]
        self.turn = 0  # the slot the next staged batch goes to
        self.pending = None  # (reader, staged batch or _END)
        self._offsets: dict = {}  # (B*S + 1) -> device arange, one-hot inputs' offsets
        self._offsets_host: dict = {}  # the same on the host, to recognise them
        self.stream = None
        if self.gpu:
            import cupy

            self.stream = cupy.cuda.Stream(non_blocking=True)
        self.uploads = self.device_offsets = 0  # counts, for tests and benchmarks
        self.host_copies = self.direct_uploads = 0  # arrays copied into pinned buffers / uploaded as they came
        self.arena = PinnedArena(self.gpu)

    def next(self, reader, fetch):
        memory = getattr(reader, "memory", None)  # a reader pass: its workers write into the arena
        if memory is not None and getattr(memory, "arena", None) is None:
            memory.arena = self.arena
        if self.pending is not None and self.pending[0] is reader:
            staged = self.pending[1]
        else:  # the first step, or the source changed: stage now
            staged = self._stage(fetch(reader))
        self.pending = None
        self._retire()
        if staged is not _END:
            self._ready(staged)
            if self.host_mirrors:
                self._out = (staged[2], staged[3])
                device.add_host_mirrors(staged[2])
        # the next batch starts uploading now, behind what the compute stream has queued so far
        self.pending = (reader, self._stage(fetch(reader)))
        return None if staged is _END else staged[0]

    def drop(self) -> None:
        """Forget a staged batch (its reader is being replaced)."""
        self.pending = None

    def close(self) -> None:
        """Done with this stager (the model makes another): the last batch's host mirrors are removed."""
        self.pending = None
        self._retire()

    def _retire(self) -> None:
        """The batch handed out last is done with (its step has run on the host): its host mirrors go and
        its arena blocks return."""
        if self._out is None:
            return
        pairs, (mem, event) = self._out
        self._out = None
        device.remove_host_mirrors(pairs)
        if mem is not None:
            self.arena.release(mem, event)

    # ---- internals ----------------------------------------------------------------------------------
    def _stage(self, batch):
        if batch is None:
            return _END
        slot = self.slots[self.turn]
        self.turn ^= 1
        after = None
        if self.gpu:
            import cupy

            if slot.uploaded is not None:
                slot.uploaded.synchronize()  # the pinned buffers' previous upload has left them
            after = cupy.cuda.Event(disable_timing=True)
            after.record(cupy.cuda.Stream.null)  # the compute queued so far: the slot's last user included
            self.stream.wait_event(after)
        mem = batch.memory if getattr(batch.memory, "arena", None) is self.arena else None
        pairs = []  # (device array, host array), for host_mirrors
        label = self._upload(slot, "label", batch.label, mem, pairs)
        dense = self._upload(slot, "dense", batch.dense, mem, pairs)
        sparse = []
        for i, (keys, offsets) in enumerate(batch.sparse):
            k = self._upload(slot, f"keys{i}", keys, mem, pairs)
            n_bags = offsets.shape[0] - 1
            if keys.shape[0] == n_bags and offsets[0] == 0 and np.array_equal(offsets, self._host_arange(n_bags + 1)):
                o = self._arange(n_bags + 1)
                pairs.append((o, self._host_arange(n_bags + 1)))
                self.device_offsets += 1
            else:
                o = self._upload(slot, f"offsets{i}", offsets, mem, pairs)
            sparse.append((k, o))
        event = None
        if self.gpu:
            import cupy

            event = cupy.cuda.Event(disable_timing=True)
            event.record(self.stream)
            slot.uploaded = event
        if mem is not None and not self.host_mirrors:
            self.arena.release(mem, event)  # the blocks return once the upload has read them
        self.uploads += 1
        return (
            Batch(label=label, dense=dense, sparse=sparse, size=batch.size, global_size=batch.global_size),
            event,
            pairs if self.host_mirrors else [],
            (mem if self.host_mirrors else None, event),
        )

    def _upload(self, slot: _Slot, name: str, a, mem=None, pairs=None):
        a = np.ascontiguousarray(a)
        dev = slot.device_buffer(name, a.dtype, a.size)
        if mem is not None and mem.owns(a):  # a worker wrote it into pinned memory: upload it as it is
            host = a.reshape(-1)
            self.direct_uploads += 1
        else:
            host = slot.host_buffer(name, a.dtype, a.size)
            np.copyto(host, a.reshape(-1))
            self.host_copies += 1
        if self.gpu:
            dev.set(host, stream=self.stream)
        else:
            np.copyto(dev, host)
        dev = dev.reshape(a.shape)
        if pairs is not None:
            pairs.append((dev, host.reshape(a.shape)))
        return dev

    def _host_arange(self, n: int):
        h = self._offsets_host.get(n)
        if h is None:
            h = self._offsets_host[n] = np.arange(n, dtype=np.int64)
        return h

    def _arange(self, n: int):
        o = self._offsets.get(n)
        if o is None:
            o = self._offsets[n] = device.xp().arange(n, dtype=np.int64)
        return o

    def _ready(self, staged) -> None:
        """The compute stream waits for the batch's upload (a device-side wait)."""
        event = staged[1]
        if event is not None:
            import cupy

            cupy.cuda.Stream.null.wait_event(event)
