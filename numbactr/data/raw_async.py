"""HugeCTR's asynchronous Raw reader (DataReaderType_t.RawAsync) and its AsyncParam (spec §2.1, §2.4).

One binary file, no header, fixed-size little-endian samples (one 32-bit word = int32 or float32):

  AsyncParam(multi_hot_reader=False)  "one-hot", HugeCTR's AsyncReader (async_reader_adapter.cpp):
      label[L] int32, dense[D] int32, keys[S] int32 (one per slot)
      = the Raw layout with float_label_dense=False; keys are 32-bit even with i64_input_key.
  AsyncParam(multi_hot_reader=True)   "multi-hot", HugeCTR's MultiHot::AsyncDataReader:
      label[L] int32, dense[D] float32 (is_dense_float) or int32, then for each slot k exactly
      nnz_per_slot[k] keys (static hotness: the Input's DataReaderSparseParam), each uint32 or, with
      i64_input_key, int64 (two words).
Decoding (split_label_dense_sparse.cu, multi_hot/split_batch.cu): labels are the int32 cast to float
(also in the multi-hot layout, whatever the docs say), int32 dense values become log(x + 1) in float32,
float dense values are used as stored, 32-bit keys are read unsigned and 64-bit keys signed. So a
one-hot file decodes exactly as the Raw reader decodes it (numbactr.data.raw.decode_raw_rows).

Sample count: the file's length decides (HugeCTR's AsyncReader ignores num_samples); a length that is
not a whole number of samples is an error naming the file and the byte offset of the broken sample. A
num_samples that disagrees with the file warns (DataWarning) and is not used.

Order (AsyncReaderImpl / BatchLocations): the file is cut into batches of B consecutive samples, the last
one partial. shuffle=False reads them in file order, exactly like the Raw reader (same batches, same
partial last batch, every pass). shuffle=True (training source only; HugeCTR never shuffles the eval
reader) permutes the BATCHES once, with a generator seeded by the solver's seed, identical on every rank:
the samples inside a batch stay consecutive and in file order, the partial batch moves with the
permutation, and every pass (every epoch, every wrap in repeat mode) uses the same permutation. HugeCTR
draws that permutation with std::shuffle(mt19937(seed)); numbactr's comes from
numpy.random.default_rng(seed), so it is a different (equally fixed) permutation. In repeat mode numbactr
repeats the batch order pass after pass; HugeCTR's threads each loop over their own batch list, which gives
the same stream when the batch count is a multiple of num_threads and a slightly different interleaving
otherwise.

Threads (num_threads, num_batches_per_thread): batch i of the order goes to thread i % num_threads
(HugeCTR's round-robin distribution); each thread reads its batches ahead into num_batches_per_thread
buffers, and the batches are handed out round-robin over the threads, i.e. in the order above. Only
this rank's rows of each global batch are read (rows [r*B/R, (r+1)*B/R), as the Raw reader splits them).

I/O: each thread reads its rows of a batch with one os.preadv into a buffer it reuses (the call releases
the GIL, so threads overlap), after posix_fadvise(SEQUENTIAL) on the file. HugeCTR submits libaio
requests on an O_DIRECT file; numbactr does the O_DIRECT part when asked (direct_io below, or the
environment variable NUMBACTR_DIRECT_IO=1): offsets and lengths are widened to io_alignment (at least
4096 bytes) and read into page-aligned buffers. Buffered reads are the default: they were faster
than O_DIRECT wherever measured (`numbactr bench data` compares raw_async and raw_async_direct). A filesystem that refuses
O_DIRECT (tmpfs, some network filesystems: EINVAL) falls back to buffered reads with a log line.
max_num_requests_per_thread and io_depth size HugeCTR's libaio queues; numbactr has no such queue (one
request per batch and thread) and only checks them as HugeCTR does. aligned_type=Alignment_t.Auto pads
HugeCTR's dense tensor with zero columns to a multiple of 8 (for fp16 tensor cores); numbactr keeps the
dense width D: the padding columns are zero, so they add nothing to any output, but in HugeCTR they widen
the first layer that reads the dense input (more weights, and a fan-in-dependent initialiser such as Xavier
then draws with a slightly different scale).

Rules HugeCTR enforces (add_input.cpp), checked by check_async_input with a clear error: exactly one
sparse input; the one-hot reader needs is_dense_float=False and max_num_requests_per_thread >
2 * num_batches_per_thread. HugeCTR's one-hot reader also refuses epoch mode (repeat_dataset=False);
numbactr reads epochs with it too (ValueError only under hugectr_exact()).
HugeCTR: HugeCTR/include/common.hpp (AsyncParam), include/pybind/common_wrapper.hpp,
src/pybind/add_input.cpp, src/data_readers/async_reader/*, src/data_readers/multi_hot/* (v23.08).
"""

from __future__ import annotations

import mmap
import os
import warnings

import numpy as np

from numbactr import hugectr_exact
from numbactr import log
from numbactr.enums import Alignment_t
from numbactr.data.errors import DataFormatError, DataWarning
from numbactr.data.raw import decode_raw_rows, write_records

__all__ = [
    "AsyncParam",
    "RawAsyncFormatError",
    "RawAsyncFile",
    "raw_async_stride",
    "write_raw_async_file",
    "check_async_input",
    "batch_order",
    "DIRECT_IO_ENV",
]

DIRECT_IO_ENV = "NUMBACTR_DIRECT_IO"
_PAGE = mmap.PAGESIZE


class RawAsyncFormatError(DataFormatError):
    def __init__(self, path, offset, message, record=None):
        super().__init__("RawAsync", path, offset, message, record)


def _int_arg(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ValueError(f"AsyncParam: {name} must be an integer >= {lo}, got {v!r}")
    return int(v)


def _bool_arg(name: str, v) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise ValueError(f"AsyncParam: {name} must be True or False, got {v!r}")
    return bool(v)


class AsyncParam:
    """``hugectr.AsyncParam``: HugeCTR's arguments, order and defaults (shuffle has no default).

    Args:
        num_threads: reading threads (>= 1).
        num_batches_per_thread: batches each thread reads ahead (>= 1).
        max_num_requests_per_thread: HugeCTR's libaio requests per thread (one-hot reader only).
        io_depth: HugeCTR's libaio queue depth (one-hot reader only).
        io_alignment: byte alignment of direct I/O (0 or a power of two; numbactr uses at least 4096).
        shuffle: permute the training batches once (see the module docstring). Required.
        aligned_type: Alignment_t.Non or Alignment_t.Auto (dense padding, see the module docstring).
        multi_hot_reader: True: the multi-hot layout; False: the one-hot (Raw) layout.
        is_dense_float: dense values stored as float32 (else int32, read as log(x + 1)).
    """

    def __init__(
        self,
        num_threads,
        num_batches_per_thread,
        max_num_requests_per_thread=0,
        io_depth=0,
        io_alignment=0,
        shuffle=None,
        aligned_type=Alignment_t.Non,
        multi_hot_reader=True,
        is_dense_float=True,
    ):
        if shuffle is None:
            raise TypeError("AsyncParam: shuffle is required (HugeCTR gives it no default)")
        self.num_threads = _int_arg("num_threads", num_threads, 1)
        self.num_batches_per_thread = _int_arg("num_batches_per_thread", num_batches_per_thread, 1)
        self.max_num_requests_per_thread = _int_arg("max_num_requests_per_thread", max_num_requests_per_thread, 0)
        self.io_depth = _int_arg("io_depth", io_depth, 0)
        self.io_alignment = _int_arg("io_alignment", io_alignment, 0)
        if self.io_alignment & (self.io_alignment - 1):
            raise ValueError(
                f"AsyncParam: io_alignment must be 0 or a power of two (a sector size such as 512 "
                f"or 4096), got {io_alignment}"
            )
        self.shuffle = _bool_arg("shuffle", shuffle)
        if not isinstance(aligned_type, Alignment_t):
            raise ValueError(
                f"AsyncParam: aligned_type must be Alignment_t.Auto or Alignment_t.Non, got {aligned_type!r}"
            )
        self.aligned_type = aligned_type
        self.multi_hot_reader = _bool_arg("multi_hot_reader", multi_hot_reader)
        self.is_dense_float = _bool_arg("is_dense_float", is_dense_float)

    def __repr__(self):
        return (
            f"AsyncParam(num_threads={self.num_threads}, num_batches_per_thread={self.num_batches_per_thread}, "
            f"max_num_requests_per_thread={self.max_num_requests_per_thread}, io_depth={self.io_depth}, "
            f"io_alignment={self.io_alignment}, shuffle={self.shuffle}, aligned_type={self.aligned_type!r}, "
            f"multi_hot_reader={self.multi_hot_reader}, is_dense_float={self.is_dense_float})"
        )

    def __eq__(self, other):
        return isinstance(other, AsyncParam) and vars(self) == vars(other)


def check_async_input(ap: AsyncParam, slots_per_input, nnz_per_slot, repeat: bool) -> list[int]:
    """HugeCTR's RawAsync rules for the model's Input (add_input.cpp); returns the keys per slot.

    slots_per_input: [S_i] per sparse input; nnz_per_slot: [[nnz per slot] per input] or None (1 each).
    The multi-hot reader takes several sparse inputs (one per table, as HugeCTR's DLRM-DCNv2 scripts have):
    a sample's keys are every input's slots in order. The one-hot reader takes exactly one.
    """
    S = int(sum(slots_per_input))
    if not ap.multi_hot_reader and len(slots_per_input) != 1:
        raise ValueError(
            f"RawAsync with AsyncParam(multi_hot_reader=False) reads exactly one sparse input "
            f"(HugeCTR: 'Only one sparse input is supported'), the Input has {len(slots_per_input)}"
        )
    if not ap.multi_hot_reader:
        if ap.is_dense_float:
            raise ValueError(
                "RawAsync with AsyncParam(multi_hot_reader=False) reads int32 dense values only: "
                "set is_dense_float=False (HugeCTR: 'One-hot RawAsync Reader only supports int32 "
                "dense type')"
            )
        if ap.max_num_requests_per_thread <= 2 * ap.num_batches_per_thread:
            raise ValueError(
                f"AsyncParam: max_num_requests_per_thread ({ap.max_num_requests_per_thread}) must "
                f"exceed 2 * num_batches_per_thread ({2 * ap.num_batches_per_thread}) for the "
                f"one-hot reader (HugeCTR: 'Too many batches for each thread!')"
            )
        if not repeat and hugectr_exact.hugectr_exact():
            raise ValueError(
                "Epoch mode cannot be used with the one-hot RawAsync reader (HugeCTR); set repeat_dataset=True"
            )
        return [1] * S
    nnz = [1] * S if nnz_per_slot is None else [int(v) for per_input in nnz_per_slot for v in per_input]
    if len(nnz) != S or min(nnz, default=1) < 1:
        raise ValueError(
            f"RawAsync multi-hot: nnz_per_slot must give a hotness >= 1 for each of the {S} "
            f"slots (the static hotness of every sample), got {nnz}"
        )
    return nnz


def raw_async_stride(label_dim: int, dense_dim: int, nnz_per_slot, wide_keys: bool) -> int:
    """Bytes per sample: 4 * (L + D) + (8 if wide_keys else 4) * sum(nnz_per_slot)."""
    return 4 * (int(label_dim) + int(dense_dim)) + (8 if wide_keys else 4) * int(sum(nnz_per_slot))


def write_raw_async_file(
    path, label, dense, keys, is_dense_float: bool, wide_keys: bool = False, append: bool = False
) -> int:
    """Write samples in the multi-hot RawAsync layout; returns the number written.

    label (n, L) integers (int32), dense (n, D) float32 if is_dense_float else integer counts (int32),
    keys (n, K) with K = sum(nnz_per_slot), slot-major within a sample (uint32, or int64 with wide_keys).
    With one key per slot, int32 dense and 32-bit keys this is also the one-hot (Raw) layout.
    """
    keys = np.asarray(keys)
    keys = keys.reshape(-1, 1) if keys.ndim == 1 else keys
    n = keys.shape[0]
    label = np.asarray(label).reshape(n, -1)
    dense = np.zeros((n, 0)) if dense is None else np.asarray(dense).reshape(n, -1)
    for name, a in (("label", label),) + (() if is_dense_float else (("dense", dense),)):
        if a.size and (not np.all(a == np.round(a)) or a.min() < -(1 << 31) or a.max() >= (1 << 31)):
            raise ValueError(f"RawAsync stores {name} as int32; got values that are not int32 integers")
    if keys.size and not np.issubdtype(keys.dtype, np.integer):
        raise TypeError(f"keys must be integers, got {keys.dtype}")
    lo, hi = (-(1 << 63), 1 << 63) if wide_keys else (-(1 << 31), 1 << 32)
    if keys.size and (int(keys.min()) < lo or int(keys.max()) >= hi):
        raise ValueError(
            f"RawAsync keys must lie in [{lo}, {hi}) (wide_keys={wide_keys}); got "
            f"[{int(keys.min())}, {int(keys.max())}]"
        )
    L, D = label.shape[1], dense.shape[1]
    kw = keys.shape[1] * (2 if wide_keys else 1)
    rec = np.empty((n, L + D + kw), dtype="<i4")
    rec[:, :L] = label
    if is_dense_float:
        rec[:, L : L + D].view("<f4")[:] = dense
    else:
        rec[:, L : L + D] = dense
    rec[:, L + D :] = keys.astype(np.int64).astype("<i8" if wide_keys else "<u4").view("<i4").reshape(n, kw)
    return write_records(path, rec, append)


def batch_order(num_batches: int, shuffle: bool, seed: int) -> np.ndarray | None:
    """The batch permutation (None: file order): one draw from default_rng(seed), the same on every rank."""
    if not shuffle or num_batches <= 1:
        return None
    return np.random.default_rng(int(seed)).permutation(num_batches)


class RawAsyncFile:
    """A RawAsync file opened for positional reads; rows(a, b) decodes samples [a, b).

    Args:
        path: the file (local).
        label_dim, dense_dim: L, D.
        nnz_per_slot: keys per slot (all 1 for the one-hot layout).
        is_dense_float: dense stored as float32 (else int32 -> log(x + 1)).
        i64_input_key: the model's key type (int64 keys out, else uint64).
        wide_keys: keys stored as int64 (the multi-hot layout with i64_input_key); else 32-bit.
        io_alignment: direct-I/O alignment (0: 4096).
        direct_io: True: O_DIRECT (falls back to buffered reads where refused); False: buffered; None:
            the NUMBACTR_DIRECT_IO environment variable decides (default buffered).
        num_samples: the count the script gave (0: none); a mismatch with the file warns.
        checked_samples: the sample count found when the reader was set up (its batches are cut from it): the
            size checks are skipped, and a file cut short since then fails at the first read past its end.
    """

    fmt = "RawAsync"

    def __init__(
        self,
        path,
        label_dim,
        dense_dim,
        nnz_per_slot,
        is_dense_float,
        i64_input_key,
        wide_keys,
        io_alignment=0,
        direct_io=None,
        num_samples=0,
        checked_samples=None,
    ):
        self.fd = -1
        self.path = os.fspath(path)
        self.L, self.D = int(label_dim), int(dense_dim)
        self.nnz = [int(v) for v in nnz_per_slot]
        self.is_dense_float, self.i64, self.wide = bool(is_dense_float), bool(i64_input_key), bool(wide_keys)
        self.key_words = 2 if self.wide else 1
        self.stride = raw_async_stride(self.L, self.D, self.nnz, self.wide)
        self.words = self.stride // 4
        try:
            size = os.path.getsize(self.path)
        except OSError as e:
            raise RawAsyncFormatError(self.path, None, f"cannot be read ({e})") from None
        self.size = size
        if checked_samples is not None:
            self.num_samples = int(checked_samples)
        elif size % self.stride or size == 0:
            whole = size // self.stride
            raise RawAsyncFormatError(
                self.path,
                whole * self.stride,
                f"file length {size} is not a whole, non-zero number of {self.stride}-byte "
                f"samples (label_dim {self.L} + dense_dim {self.D} words of 4 bytes, "
                f"{sum(self.nnz)} keys of {4 * self.key_words} bytes): truncated sample, or "
                f"the reader's dimensions are wrong",
                whole,
            )
        else:
            self.num_samples = size // self.stride
        if num_samples and int(num_samples) != self.num_samples:
            warnings.warn(
                f"RawAsync file {self.path!r} holds {self.num_samples} samples but num_samples is "
                f"{num_samples}: RawAsync reads the whole file (as HugeCTR does)",
                DataWarning,
                stacklevel=3,
            )
        if direct_io is None:
            direct_io = os.environ.get(DIRECT_IO_ENV, "0") not in ("", "0")
        self.align = max(int(io_alignment), 4096)
        self.direct = False
        if direct_io and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
                self.direct = True
            except OSError as e:
                log.info_once(
                    ("raw_async no O_DIRECT", self.path),
                    f"RawAsync: O_DIRECT refused for {self.path!r} ({e.strerror}); reading through the page cache",
                )
        if self.fd < 0:
            self.fd = os.open(self.path, os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self._buf = None

    def key_word(self, j: int) -> int:
        """Word index (within a sample) of slot j's first key."""
        return self.L + self.D + self.key_words * int(sum(self.nnz[:j]))

    def offset_of(self, record: int, word: int = 0) -> int:
        return record * self.stride + 4 * word

    def _buffer(self, nbytes: int) -> memoryview:
        """A reusable page-aligned buffer of at least nbytes (anonymous mmap: aligned for O_DIRECT)."""
        if self._buf is None or len(self._buf) < nbytes:
            self._buf = mmap.mmap(-1, max(nbytes, _PAGE))
        return memoryview(self._buf)

    def _read(self, start: int, nbytes: int) -> np.ndarray:
        """File bytes [start, start + nbytes) as a view into the reusable buffer (valid until the next read)."""
        a0, end = start, start + nbytes
        if self.direct:
            a0 = start - start % self.align
            end = -(-end // self.align) * self.align
        buf = self._buffer(end - a0)
        got, need = 0, start + nbytes - a0
        while got < need:
            try:
                n = os.preadv(self.fd, [buf[got : end - a0]], a0 + got)
            except OSError as e:
                if not (self.direct and got == 0):
                    raise RawAsyncFormatError(self.path, a0 + got, f"read failed ({e.strerror})") from None
                self._fall_back(e)  # O_DIRECT refused at the first read (e.g. EINVAL)
                return self._read(start, nbytes)
            if n == 0:
                raise RawAsyncFormatError(
                    self.path,
                    a0 + got,
                    f"file ends at byte {a0 + got} while reading samples "
                    f"up to byte {start + nbytes} (it was {self.size} bytes when opened: "
                    f"truncated while being read)",
                    (a0 + got) // self.stride,
                )
            got += n
        return np.frombuffer(buf, dtype="<i4", count=nbytes // 4, offset=start - a0)

    def _fall_back(self, err: OSError) -> None:
        log.info_once(
            ("raw_async no O_DIRECT", self.path),
            f"RawAsync: direct reads of {self.path!r} refused ({err.strerror}); reading through the page cache",
        )
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_RDONLY)
        self.direct = False

    def rows(self, a: int, b: int):
        """Samples [a, b): label (m, L) f32, dense (m, D) f32, keys (m, sum(nnz)) (fresh arrays): int64 with
        i64_input_key (64-bit keys as stored, 32-bit ones sign-extended as HugeCTR does), else uint64."""
        m, L, D = b - a, self.L, self.D
        words = self._read(a * self.stride, m * self.stride).reshape(m, self.words)
        if self.is_dense_float:
            label = words[:, :L].astype(np.float32)
            dense = np.array(words[:, L : L + D].view("<f4"), dtype=np.float32)
        elif not self.wide:  # the Raw layout (int label/dense, 32-bit keys)
            return decode_raw_rows(words, L, D, False, self.i64)
        else:
            label, dense, _ = decode_raw_rows(words[:, : L + D], L, D, False, self.i64)
        k = words[:, L + D :]
        if self.wide:
            keys = np.ascontiguousarray(k).view("<i8").astype(np.int64)
        else:
            keys = k.astype(np.int64) if self.i64 else k.view("<u4").astype(np.uint64)
        return label, dense, keys

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._buf = None

    def __del__(self):
        self.close()
