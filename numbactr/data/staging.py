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

Offsets of one-hot inputs (one key per bag, the usual Criteo/MLPerf slot) are not uploaded: the device keeps
one ``arange(B*S + 1)`` per shape. Batches are handed out as ``Batch`` objects whose arrays are views of the
slot's device buffers, valid until the step after next (the model reads them within its step).

On the simulator the same slots are plain NumPy buffers and the copies ``np.copyto`` (there are no streams):
the order, the reader's semantics and the contents are what the tests there check; the streams and events
are the GPU's. Model.train uses a stager on one rank when every embedding is a SparseEmbedding on the
kernels (numbactr.model.Model._stager_for_step); NUMBACTR_STAGE_INPUTS=0 turns it off.
"""
from __future__ import annotations

import os

import numpy as np

from .. import device
from .batch import Batch

_END = object()          # the reader's end (an epoch-mode source): handed out as None, once


def staging_enabled() -> bool:
    flag = os.environ.get("NUMBACTR_STAGE_INPUTS", "1")
    if flag not in ("0", "1"):
        raise ValueError(f"NUMBACTR_STAGE_INPUTS must be 0 or 1, got {flag!r}")
    return flag == "1" and device.uses_kernels()


class _Slot:
    """One buffer set: pinned host arrays and device arrays per (name, dtype), grown as needed, plus the
    event of its last upload."""

    def __init__(self, gpu: bool):
        self.gpu = gpu
        self.host: dict = {}
        self.dev: dict = {}
        self.uploaded = None            # cupy Event of the last upload (gpu)

    def buffers(self, name: str, dtype, n: int):
        """(pinned host (n,), device (n,)) flat views for `name`."""
        dtype = np.dtype(dtype)
        key = (name, dtype.str)
        h = self.host.get(key)
        if h is None or h.shape[0] < n:
            size = max(n, 1 if h is None else int(h.shape[0] * 1.25))
            h = self._pinned(size, dtype)
            self.host[key] = h
            self.dev[key] = device.xp().empty(size, dtype)
        return h[:n], self.dev[key][:n]

    def _pinned(self, n: int, dtype):
        if not self.gpu:
            return np.empty(n, dtype)
        import cupy
        mem = cupy.cuda.alloc_pinned_memory(max(n * dtype.itemsize, 1))
        return np.frombuffer(mem, dtype, n)


class DeviceStager:
    """See the module docstring. ``next(reader, fetch)``: the next batch of `reader` on the device (None at
    the end of an epoch-mode source), with the one after it already uploading."""

    def __init__(self):
        self.kind = device.kind()
        self.gpu = self.kind == "gpu"
        self.slots = [_Slot(self.gpu), _Slot(self.gpu)]
        self.turn = 0                   # the slot the next staged batch goes to
        self.pending = None             # (reader, staged batch or _END)
        self._offsets: dict = {}        # (B*S + 1) -> device arange, one-hot inputs' offsets
        self._offsets_host: dict = {}   # the same on the host, to recognise them
        self.stream = None
        if self.gpu:
            import cupy
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self.uploads = self.device_offsets = 0       # counts, for tests and benchmarks

    def next(self, reader, fetch):
        if self.pending is not None and self.pending[0] is reader:
            staged = self.pending[1]
        else:                            # the first step, or the source changed: stage now
            staged = self._stage(fetch(reader))
        self.pending = None
        if staged is not _END:
            self._ready(staged)
        # the next batch starts uploading now, behind what the compute stream has queued so far
        self.pending = (reader, self._stage(fetch(reader)))
        return None if staged is _END else staged[0]

    def drop(self) -> None:
        """Forget a staged batch (its reader is being replaced)."""
        self.pending = None

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
                slot.uploaded.synchronize()     # the pinned buffers' previous upload has left them
            after = cupy.cuda.Event(disable_timing=True)
            after.record(cupy.cuda.Stream.null)   # the compute queued so far: the slot's last user included
            self.stream.wait_event(after)
        label = self._upload(slot, "label", batch.label)
        dense = self._upload(slot, "dense", batch.dense)
        sparse = []
        for i, (keys, offsets) in enumerate(batch.sparse):
            k = self._upload(slot, f"keys{i}", keys)
            n_bags = offsets.shape[0] - 1
            if keys.shape[0] == n_bags and offsets[0] == 0 and np.array_equal(offsets, self._host_arange(n_bags + 1)):
                o = self._arange(n_bags + 1)
                self.device_offsets += 1
            else:
                o = self._upload(slot, f"offsets{i}", offsets)
            sparse.append((k, o))
        event = None
        if self.gpu:
            import cupy
            event = cupy.cuda.Event(disable_timing=True)
            event.record(self.stream)
            slot.uploaded = event
        self.uploads += 1
        return (Batch(label=label, dense=dense, sparse=sparse, size=batch.size, global_size=batch.global_size),
                event)

    def _upload(self, slot: _Slot, name: str, a):
        a = np.ascontiguousarray(a)
        host, dev = slot.buffers(name, a.dtype, a.size)
        np.copyto(host, a.reshape(-1))
        if self.gpu:
            dev.set(host, stream=self.stream)
        else:
            np.copyto(dev, host)
        return dev.reshape(a.shape)

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
        _, event = staged
        if event is not None:
            import cupy
            cupy.cuda.Stream.null.wait_event(event)
