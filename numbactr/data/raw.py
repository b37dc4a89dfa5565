"""HugeCTR's legacy "Raw" format: writer and decoder (spec §2.4, §10.10).

One binary file, no header, fixed-size little-endian samples (stride = 4 * (L + D + S) bytes):
  label[L], dense[D]   float32 if float_label_dense else int32
  keys[S]              int32, exactly one key per slot (slots of sparse input 0, then input 1, ...)
float_label_dense=False: labels are cast to float, dense values become log(x + 1) computed in float32
(HugeCTR's DLRM-style transform in data_reader_worker_raw.hpp). Keys are used verbatim (no slot
offsets); with i64_input_key they are sign-extended to int64, otherwise reinterpreted as uint32.
The number of samples is not stored: the reader is told num_samples (eval_num_samples for eval) and
uses the first num_samples samples of the file. Batches are consecutive samples; the last one of a pass
is partial (also in repeat mode, unlike Norm), see numbactr.data.reader.

Errors (DataFormatError naming file, record, byte offset): a file shorter than num_samples samples, a
length that is not a whole number of samples, and (checked by the reader) a non-finite label/dense
value, e.g. log(x + 1) of an int dense value x <= -1, a label outside its loss's range and a one-hot
key outside its slot's range. A file longer than num_samples samples warns (DataWarning): its tail is
never read. Raw has no checksum: any other damage to a record (a changed label, dense value or key
that stays in range, or whole samples inserted or removed while the length stays a whole number of
samples) is read as data without an error.
HugeCTR: HugeCTR/include/data_readers/data_reader_worker_raw.hpp, mmap_offset_list.hpp,
tools/raw_script/criteo2raw.cpp (writer side).
"""

from __future__ import annotations

import os
import warnings

import numpy as np

from numbactr.data.errors import DataFormatError, DataWarning

__all__ = ["RawFormatError", "raw_stride", "write_raw_file", "RawFile", "decode_raw_rows"]


class RawFormatError(DataFormatError):
    def __init__(self, path, offset, message, record=None):
        super().__init__("Raw", path, offset, message, record)


def raw_stride(label_dim: int, dense_dim: int, slot_num: int) -> int:
    """Bytes per sample."""
    return 4 * (int(label_dim) + int(dense_dim) + int(slot_num))


def write_raw_file(path, label, dense, keys, float_label_dense: bool = False, append: bool = False) -> int:
    """Write samples to a Raw file; returns the number written.

    label (n, L), dense (n, D): float32 with float_label_dense, else integers stored as int32 (dense are
    the raw counts; the reader applies log(x + 1)). keys (n, S): one int32 key per slot, per-slot keys in
    [0, slot_size_array[k]) for one-hot embeddings (HugeCTR's convention: they add the slot offsets).
    append=True adds the samples to the end of an existing file. Raw stores no sample count: give the
    reader num_samples.
    """
    keys = np.asarray(keys)
    if keys.ndim == 1:
        keys = keys.reshape(-1, 1)
    n = keys.shape[0]
    label = np.asarray(label)
    label = label.reshape(n, -1) if label.size or n == 0 else np.zeros((n, 0))
    dense = np.asarray(dense) if dense is not None else np.zeros((n, 0))
    dense = dense.reshape(n, -1) if dense.size else np.zeros((n, 0))
    if label.shape[0] != n or dense.shape[0] != n:
        raise ValueError(
            f"label, dense and keys must have the same number of rows, got {label.shape[0]}, {dense.shape[0]}, {n}"
        )
    if keys.size and not np.issubdtype(keys.dtype, np.integer):
        raise TypeError(f"keys must be integers, got {keys.dtype}")
    if keys.size and (int(keys.min()) < -(1 << 31) or int(keys.max()) >= (1 << 32)):
        raise ValueError(f"Raw keys are 32-bit; got keys in [{int(keys.min())}, {int(keys.max())}]")
    ld_type = "<f4" if float_label_dense else "<i4"
    if not float_label_dense:
        for name, a in (("label", label), ("dense", dense)):
            if a.size and not np.issubdtype(a.dtype, np.integer):
                if not np.all(a == np.round(a)):
                    raise ValueError(
                        f"float_label_dense=False stores {name} as int32; got non-integer "
                        f"values (pass float_label_dense=True for float data)"
                    )
            if a.size and (a.min() < -(1 << 31) or a.max() >= (1 << 31)):
                raise ValueError(f"{name} values do not fit int32")
    L, D, S = label.shape[1], dense.shape[1], keys.shape[1]
    rec = np.empty((n, L + D + S), dtype="<i4")  # one int32/float32 word per field
    words = rec.view(ld_type)
    words[:, :L] = label
    words[:, L : L + D] = dense
    rec[:, L + D :] = keys.astype(np.int64).astype("<u4").view("<i4") if keys.size else 0
    return write_records(path, rec, append)


def write_records(path, rec: np.ndarray, append: bool) -> int:
    """Write (or append) the fixed-size records rec (n, words) to path, making its folder; returns n."""
    d = os.path.dirname(os.fspath(path))
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "ab" if append else "wb") as f:
        f.write(rec.tobytes())
    return rec.shape[0]


class RawFile:
    """A Raw file mapped read-only; rows(a, b) decodes samples [a, b)."""

    def __init__(
        self,
        path,
        num_samples: int,
        label_dim: int,
        dense_dim: int,
        slot_num: int,
        float_label_dense: bool,
        i64_input_key: bool,
        warn_unread: bool = False,
    ):
        self.path = os.fspath(path)
        self.L, self.D, self.S = int(label_dim), int(dense_dim), int(slot_num)
        self.float_label_dense, self.i64 = bool(float_label_dense), bool(i64_input_key)
        self.stride = raw_stride(self.L, self.D, self.S)
        if self.stride == 0:
            raise ValueError("Raw: label_dim + dense_dim + slot_num must be > 0")
        self.num_samples = int(num_samples)
        if self.num_samples <= 0:
            raise ValueError(
                f"Raw file {self.path!r}: num_samples (eval_num_samples for the eval "
                f"source) must be > 0, got {num_samples}; the Raw format does not store "
                f"the sample count"
            )
        try:
            size = os.path.getsize(self.path)
        except OSError as e:
            raise RawFormatError(self.path, None, f"cannot be read ({e})") from None
        if size % self.stride:
            whole = size // self.stride
            raise RawFormatError(
                self.path,
                whole * self.stride,
                f"file length {size} is not a whole number of {self.stride}-byte "
                f"samples (label_dim {self.L} + dense_dim {self.D} + {self.S} slots, 4 "
                f"bytes each): truncated record, or the reader's dimensions are wrong",
                whole,
            )
        if size < self.num_samples * self.stride:
            have = size // self.stride
            raise RawFormatError(
                self.path,
                size,
                f"num_samples is {self.num_samples} but the file holds only {have} samples of {self.stride} bytes",
                have,
            )
        if warn_unread and size > self.num_samples * self.stride:
            warnings.warn(
                f"Raw file {self.path!r} holds {size // self.stride} samples but num_samples is "
                f"{self.num_samples}: the last {size // self.stride - self.num_samples} are never read",
                DataWarning,
                stacklevel=3,
            )
        self._mm = np.memmap(self.path, dtype="<i4", mode="r", shape=(self.num_samples, self.stride // 4))

    def offset_of(self, record: int, word: int = 0) -> int:
        return record * self.stride + 4 * word

    def rows(self, a: int, b: int):
        """label (m, L) f32, dense (m, D) f32, keys (m, S) (int64 or uint64) for samples [a, b)."""
        return decode_raw_rows(np.asarray(self._mm[a:b]), self.L, self.D, self.float_label_dense, self.i64)

    def close(self):
        self._mm = None


def decode_raw_rows(words: np.ndarray, L: int, D: int, float_label_dense: bool, i64: bool):
    """words (m, L+D+S) int32 -> label (m, L) f32, dense (m, D) f32, keys (m, S)."""
    if float_label_dense:
        ld = words[:, : L + D].view("<f4")
        label = np.array(ld[:, :L], dtype=np.float32)
        dense = np.array(ld[:, L:], dtype=np.float32)
    else:
        label = words[:, :L].astype(np.float32)
        # HugeCTR: log(int + 1.f) in float precision
        with np.errstate(divide="ignore", invalid="ignore"):  # x <= -1: reported by the reader
            dense = np.log(words[:, L : L + D].astype(np.float32) + np.float32(1.0))
    k = words[:, L + D :]
    keys = k.astype(np.int64) if i64 else k.view("<u4").astype(np.uint64)
    return label, dense, keys
