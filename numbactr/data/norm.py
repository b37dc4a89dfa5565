"""HugeCTR "Norm" binary data files: writer, decoder and batch reader (spec §2.3, §10.10).

Layout (little-endian). Header `DataSetHeader` = 8 x int64 = 64 bytes:
  error_check (0 none, 1 checksum), number_of_records, label_dim, dense_dim, slot_num (total over all
  sparse inputs), reserved[3] = 0.
Sample payload: float32 label[label_dim], float32 dense[dense_dim], then for every slot k (slots of
sparse input 0 first, then input 1, ...): int32 nnz_k, nnz_k keys (uint32, or int64 with
i64_input_key).
Check_t.Sum frames EVERY record, the header included, as  int32 N | N payload bytes | 1 checksum byte,
checksum = sum of all N payload bytes as signed char with wraparound (the nnz ints are included).
Check_t.Non writes the bare header and bare payloads.

Decoding is vectorized with NumPy: when every record of a file has the same per-slot nnz (one-hot
Criteo data, DataGenerator output) the whole file is viewed as a packed structured array; otherwise the
record starts are found by one cheap pass (the N chain with checksums, a per-slot loop without) and
the fields are gathered slot by slot across all records at once.

HugeCTR: HugeCTR/include/common.hpp (DataSetHeader), src/data_readers/data_reader_worker.cpp,
include/data_readers/check_sum.hpp, include/data_generator.hpp (DataWriter / Checker_Traits).
Deviations: a bad-checksum sample raises NormFormatError unless skip_bad_checksum=True (HugeCTR logs
and skips it); label_dim and dense_dim are checked separately (HugeCTR checks their sum); a header
number_of_records that disagrees with the file length is an error.
"""
from __future__ import annotations

import os
import struct
import warnings
from dataclasses import dataclass

import numpy as np

from numbactr.enums import Check_t, DataReaderType_t
from numbactr.data.batch import Batch
from numbactr.data.errors import DataFormatError

HEADER_BYTES = 64
MAX_NNZ = 1 << 20          # more keys than this in one slot of one sample is treated as corruption
_U8 = np.uint8

__all__ = ["NormFormatError", "NormHeader", "NormWriter", "NormReader", "HEADER_BYTES", "MAX_NNZ",
           "encode_header", "encode_samples", "read_norm_header", "decode_norm_file",
           "read_norm_file", "write_norm_file", "key_dtype_of", "output_key_dtype", "norm_record_offsets",
           "iter_norm_chunks"]


class NormFormatError(DataFormatError):
    """A Norm file does not match its reader configuration or is corrupt; names file and byte offset."""

    def __init__(self, path, offset, message, record=None):
        super().__init__("Norm", path, offset, message, record)


# ---------------------------------------------------------------------------------------------------
# small helpers

def _is_sum(check) -> bool:
    if check is Check_t.Sum:
        return True
    if check is Check_t.Non:
        return False
    raise TypeError(f"check must be Check_t.Sum or Check_t.Non, got {check!r}")


def key_dtype_of(key_dtype) -> np.dtype:
    """On-disk key dtype: uint32 (i64_input_key=False) or int64 (True). Accepts a dtype, its name or
    the bool i64_input_key."""
    if isinstance(key_dtype, (bool, np.bool_)):
        return np.dtype("<i8") if key_dtype else np.dtype("<u4")
    dt = np.dtype(key_dtype)
    if dt == np.uint32:
        return np.dtype("<u4")
    if dt == np.int64:
        return np.dtype("<i8")
    raise TypeError(f"Norm keys are uint32 or int64 (i64_input_key), got {dt}")


def output_key_dtype(key_dtype) -> np.dtype:
    """dtype of Batch keys: uint64 for uint32 files, int64 for int64 files."""
    return np.dtype(np.uint64) if key_dtype_of(key_dtype) == np.uint32 else np.dtype(np.int64)


def _excl_cumsum(a: np.ndarray) -> np.ndarray:
    out = np.zeros(len(a) + 1, dtype=np.int64)
    np.cumsum(a, out=out[1:])
    return out


def _as_2d_f32(x, n_cols: int, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float32)
    if a.ndim == 1 and n_cols == 1:
        a = a.reshape(-1, 1)
    if a.ndim == 1 and a.size == 0:
        a = a.reshape(0, n_cols)
    if a.ndim != 2 or a.shape[1] != n_cols:
        raise ValueError(f"{name} must have shape (n, {n_cols}), got {a.shape}")
    return a


# ---------------------------------------------------------------------------------------------------
# encoding

def encode_header(number_of_records: int, label_dim: int, dense_dim: int, slot_num: int,
                  check=Check_t.Sum) -> bytes:
    """Header record bytes: 64 (Non) or 69 (Sum: int32 64 | header | checksum)."""
    s = _is_sum(check)
    h = struct.pack("<8q", 1 if s else 0, number_of_records, label_dim, dense_dim, slot_num, 0, 0, 0)
    if not s:
        return h
    return struct.pack("<i", len(h)) + h + bytes([sum(h) & 0xFF])


def encode_samples(label: np.ndarray, dense: np.ndarray, nnz: np.ndarray, keys: np.ndarray,
                   check=Check_t.Sum, key_dtype=np.uint32) -> np.ndarray:
    """Bytes (uint8 array) of n sample records.

    label (n, L) float32, dense (n, D) float32, nnz (n, S) key counts, keys (sum(nnz),) in
    sample-major, slot-minor order (the CSR over bags sample*S + slot).
    """
    s = _is_sum(check)
    kd = key_dtype_of(key_dtype)
    ks = kd.itemsize
    n, L = label.shape
    D = dense.shape[1]
    S = nnz.shape[1]
    if n == 0:
        return np.zeros(0, dtype=_U8)
    pre = 4 if s else 0

    if S == 0 or bool(np.all(nnz == nnz[0:1])):
        # Fixed layout: every record has the same byte length R. Fill (n, R) bytes through strided
        # views with the fields' own dtypes (far faster than byte-wise column copies).
        nnz0 = [int(c) for c in nnz[0]] if S else []
        P = 4 * (L + D) + 4 * S + ks * sum(nnz0)
        R = P + (5 if s else 0)
        out = np.empty(n * R, dtype=_U8)

        def view(dt, offset, shape, inner=()):
            return np.ndarray((n,) + shape, dtype=dt, buffer=out, offset=offset, strides=(R,) + inner)

        if s:
            view("<i4", 0, ())[...] = P
        view("<f4", pre, (L + D,), (4,))[...] = np.concatenate([label, dense], axis=1)
        kmat = np.asarray(keys).reshape(n, -1)                # (n, sum(nnz0)) sample-major
        col, kc = pre + 4 * (L + D), 0
        for k in range(S):
            view("<i4", col, ())[...] = nnz0[k]
            view(kd, col + 4, (nnz0[k],), (ks,))[...] = kmat[:, kc:kc + nnz0[k]]
            col += 4 + ks * nnz0[k]
            kc += nnz0[k]
        if s:
            rows = out.reshape(n, R)
            rows[:, R - 1] = rows[:, pre:pre + P].sum(axis=1, dtype=_U8)   # uint8 sum wraps mod 256
        return out

    # Variable layout: scatter every field to its byte position.
    ld_bytes = np.ascontiguousarray(np.concatenate([label, dense], axis=1), dtype="<f4") \
        .view(_U8).reshape(n, 4 * (L + D))
    key_bytes = np.ascontiguousarray(keys, dtype=kd).view(_U8).reshape(-1, ks)   # (M, ks)
    payload = 4 * (L + D) + 4 * S + ks * nnz.sum(axis=1)                  # (n,)
    rec_len = payload + (5 if s else 0)
    starts = _excl_cumsum(rec_len)                                       # (n+1,)
    out = np.zeros(int(starts[-1]), dtype=_U8)
    starts = starts[:-1]
    if s:
        out[starts[:, None] + np.arange(4)] = payload.astype("<i4").view(_U8).reshape(n, 4)
    base = starts + pre
    out[base[:, None] + np.arange(ld_bytes.shape[1])] = ld_bytes
    cum = np.cumsum(nnz, axis=1) - nnz                                   # keys before slot k, (n, S)
    pos = base[:, None] + 4 * (L + D) + 4 * np.arange(S) + ks * cum      # nnz field of (i, k)
    out[pos[..., None] + np.arange(4)] = nnz.astype("<i4").view(_U8).reshape(n, S, 4)
    flat_nnz = nnz.reshape(-1)
    M = key_bytes.shape[0]
    if M:
        within = np.arange(M) - np.repeat(_excl_cumsum(flat_nnz)[:-1], flat_nnz)
        kpos = np.repeat(pos.reshape(-1) + 4, flat_nnz) + ks * within
        out[kpos[:, None] + np.arange(ks)] = key_bytes
    if s:
        chk = starts + 4 + payload
        idx = np.stack([base, chk], axis=1).reshape(-1)
        sums = np.add.reduceat(out, idx, dtype=_U8)[::2]              # uint8 sums wrap mod 256
        out[chk] = np.where(payload == 0, 0, sums)
    return out


def _slots_to_csr(slots, n: int, slot_num: int):
    """Writer input -> (nnz (n, S) int64, keys flat). Each slot entry is (n,) one key per sample,
    (n, k) k keys per sample, or a pair (keys (M,), lengths (n,)) for ragged slots."""
    if isinstance(slots, np.ndarray):
        if slots.ndim != 2 or slots.shape != (n, slot_num):
            raise ValueError(f"a key matrix must be (n, slot_num) = ({n}, {slot_num}) one-hot keys, "
                             f"got {slots.shape}; pass a list of per-slot arrays for multi-hot slots")
        return np.ones((n, slot_num), dtype=np.int64), slots.reshape(-1)   # (n, S) one-hot matrix
    slots = list(slots)
    if len(slots) != slot_num:
        raise ValueError(f"expected {slot_num} slots, got {len(slots)}")
    nnz = np.zeros((n, slot_num), dtype=np.int64)
    pieces = []           # per slot: (n, k) matrix or (values, row offsets)
    fixed = True
    for k, sl in enumerate(slots):
        if isinstance(sl, tuple):
            vals, lens = np.asarray(sl[0]).reshape(-1), np.asarray(sl[1], dtype=np.int64).reshape(-1)
            if vals.size == 0:
                vals = vals.astype(np.int64)        # np.asarray([]) is float64
            if lens.shape[0] != n or (lens < 0).any() or lens.sum() != vals.shape[0]:
                raise ValueError(f"slot {k}: ragged (keys, lengths) needs {n} lengths >= 0 summing "
                                 f"to len(keys)")
            nnz[:, k] = lens
            pieces.append((vals, _excl_cumsum(lens)))
            fixed = False
        else:
            a = np.asarray(sl)
            if a.ndim == 1:
                a = a.reshape(-1, 1)
            if a.ndim != 2 or a.shape[0] != n:
                raise ValueError(f"slot {k}: expected shape (n,) or (n, nnz) with n={n}, got {a.shape}")
            nnz[:, k] = a.shape[1]
            pieces.append(a)
    if fixed:
        keys = np.concatenate(pieces, axis=1).reshape(-1) if pieces else np.zeros(0, np.int64)
        return nnz, keys
    # Ragged: key of (sample i, slot k, j) goes to out_off[i*S+k] + j.
    out_off = _excl_cumsum(nnz.reshape(-1))
    dtype = np.result_type(*[p[0].dtype if isinstance(p, tuple) else p.dtype for p in pieces])
    keys = np.empty(int(out_off[-1]), dtype=dtype)
    for k, p in enumerate(pieces):
        if isinstance(p, tuple):
            vals, off = p
            lens = np.diff(off)
            dst = np.repeat(out_off[:-1].reshape(n, slot_num)[:, k], lens) \
                + (np.arange(vals.shape[0]) - np.repeat(off[:-1], lens))
            keys[dst] = vals
        else:
            w = p.shape[1]
            dst = out_off[:-1].reshape(n, slot_num)[:, k][:, None] + np.arange(w)
            keys[dst.reshape(-1)] = p.reshape(-1)
    return nnz, keys


def _check_key_range(keys: np.ndarray, kd: np.dtype):
    if keys.size == 0:
        return
    if not np.issubdtype(keys.dtype, np.integer):
        raise TypeError(f"keys must be integers, got {keys.dtype}")
    lo, hi = int(keys.min()), int(keys.max())
    info = np.iinfo(kd)
    if lo < info.min or hi > info.max:
        raise ValueError(f"keys [{lo}, {hi}] do not fit the file's key type {kd.name} "
                         f"(use key_dtype=np.int64 / i64_input_key=True for wider keys)")


class NormWriter:
    """Writes one Norm file. number_of_records in the header is patched at close().

    with NormWriter(path, label_dim=1, dense_dim=13, slot_num=26) as w:
        w.write(label (n, 1), dense (n, 13), [slot_0 (n,), ..., slot_25 (n,)])
    """

    def __init__(self, path, label_dim: int, dense_dim: int, slot_num: int, check=Check_t.Sum,
                 key_dtype=np.uint32):
        self.path = os.fspath(path)
        self.label_dim, self.dense_dim, self.slot_num = int(label_dim), int(dense_dim), int(slot_num)
        if min(self.label_dim, self.dense_dim, self.slot_num) < 0 or \
                self.label_dim + self.dense_dim + self.slot_num == 0:
            raise ValueError("label_dim, dense_dim and slot_num must be >= 0, not all 0")
        self.check = check
        self._sum = _is_sum(check)
        self.key_dtype = key_dtype_of(key_dtype)
        self.num_records = 0
        d = os.path.dirname(self.path)
        if d:
            os.makedirs(d, exist_ok=True)
        self._f = open(self.path, "wb")
        self._f.write(self._header())

    def _dense(self, dense, n):
        if dense is None or (self.dense_dim == 0 and np.size(dense) == 0):
            return np.zeros((n, 0), np.float32)
        return _as_2d_f32(dense, self.dense_dim, "dense")

    def _header(self) -> bytes:
        return encode_header(self.num_records, self.label_dim, self.dense_dim, self.slot_num, self.check)

    def write(self, label, dense, slots) -> None:
        """Append n samples. label (n, label_dim), dense (n, dense_dim); slots: slot_num entries, each
        (n,) one key per sample, (n, k) k keys per sample, or (keys (M,), lengths (n,)) ragged; an
        (n, slot_num) integer matrix is accepted for one-hot data."""
        label = _as_2d_f32(label, self.label_dim, "label")
        n = label.shape[0]
        dense = self._dense(dense, n)
        nnz, keys = _slots_to_csr(slots, n, self.slot_num)
        self._write_csr(label, dense, nnz, keys)

    def write_csr(self, label, dense, keys, offsets) -> None:
        """Append n samples given as a CSR over bags sample*slot_num + slot (the Batch layout):
        offsets (n*slot_num + 1,)."""
        label = _as_2d_f32(label, self.label_dim, "label")
        n = label.shape[0]
        dense = self._dense(dense, n)
        offsets = np.asarray(offsets, dtype=np.int64)
        if offsets.shape != (n * self.slot_num + 1,) or offsets[0] != 0 or (np.diff(offsets) < 0).any():
            raise ValueError(f"offsets must be a non-decreasing (n*slot_num+1,) = ({n * self.slot_num + 1},)"
                             f" array starting at 0")
        keys = np.asarray(keys)
        if keys.shape != (int(offsets[-1]),):
            raise ValueError(f"keys must have shape ({int(offsets[-1])},), got {keys.shape}")
        self._write_csr(label, dense, np.diff(offsets).reshape(n, self.slot_num), keys)

    def _write_csr(self, label, dense, nnz, keys):
        if dense.shape[0] != label.shape[0]:
            raise ValueError(f"label has {label.shape[0]} rows but dense has {dense.shape[0]}")
        if self._f is None:
            raise ValueError(f"NormWriter for {self.path!r} is closed")
        if nnz.size and int(nnz.max()) > MAX_NNZ:
            raise ValueError(f"a slot has {int(nnz.max())} keys in one sample (max {MAX_NNZ})")
        _check_key_range(keys, self.key_dtype)
        buf = encode_samples(label, dense, nnz, keys, self.check, self.key_dtype)
        self._f.write(buf.data)
        self.num_records += label.shape[0]

    def close(self) -> None:
        if self._f is None:
            return
        self._f.seek(0)
        self._f.write(self._header())     # patch number_of_records (and the header checksum)
        self._f.close()
        self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def write_norm_file(path, label, dense, slots, check=Check_t.Sum, key_dtype=np.uint32) -> None:
    """One-shot NormWriter: write all samples of one file."""
    label = np.asarray(label, np.float32)
    label = label.reshape(-1, 1) if label.ndim == 1 else label
    dense = np.asarray(dense, np.float32)
    n_slots = slots.shape[1] if isinstance(slots, np.ndarray) and slots.ndim == 2 else len(slots)
    with NormWriter(path, label.shape[1], dense.shape[1] if dense.ndim == 2 else 0, n_slots,
                    check, key_dtype) as w:
        w.write(label, dense, slots)


# ---------------------------------------------------------------------------------------------------
# decoding

@dataclass
class NormHeader:
    error_check: int
    number_of_records: int
    label_dim: int
    dense_dim: int
    slot_num: int
    data_offset: int          # byte offset of the first sample record (64 or 69)


def _parse_header(buf: np.ndarray, path: str, check) -> NormHeader:
    s = _is_sum(check)
    size = len(buf)
    need = HEADER_BYTES + (5 if s else 0)
    if size < 4 and s:
        raise NormFormatError(path, size, f"truncated header: file has {size} bytes, a checksummed "
                                          f"header record needs {need}")
    if s:
        n = int(buf[:4].view("<i4")[0])
        if n != HEADER_BYTES:
            if size >= HEADER_BYTES and int(buf[:8].view("<i8")[0]) == 0:
                raise NormFormatError(path, 0, "header error_check=0 (Check_t.Non file) but the reader's "
                                               "check_type is Check_t.Sum")
            raise NormFormatError(path, 0, f"header record length {n}, expected {HEADER_BYTES} "
                                           f"(not a checksummed Norm file?)")
    if size < need:
        raise NormFormatError(path, size, f"truncated header: file has {size} bytes, the header needs "
                                          f"{need}")
    base = 4 if s else 0
    raw = buf[base:base + HEADER_BYTES]
    f = raw.view("<i8")
    if s:
        got, want = int(buf[base + HEADER_BYTES]), int(raw.sum(dtype=np.uint64) & 0xFF)
        if got != want:
            raise NormFormatError(path, base + HEADER_BYTES, f"bad header checksum {got:#04x} "
                                                              f"(payload sums to {want:#04x})")
    ec = int(f[0])
    if s and ec != 1:
        raise NormFormatError(path, base, f"header error_check={ec} but the reader's check_type is "
                                          f"Check_t.Sum (expects 1)")
    if not s and ec != 0:
        if ec == 1 or int(buf[:4].view("<i4")[0]) == HEADER_BYTES:
            raise NormFormatError(path, 0, "file is checksummed (error_check=1 / Check_t.Sum framing) "
                                           "but the reader's check_type is Check_t.Non")
        raise NormFormatError(path, 0, f"header error_check={ec} but the reader's check_type is "
                                       f"Check_t.Non (expects 0)")
    h = NormHeader(ec, int(f[1]), int(f[2]), int(f[3]), int(f[4]), base + HEADER_BYTES + (1 if s else 0))
    if h.number_of_records < 0:
        raise NormFormatError(path, base + 8, f"negative number_of_records {h.number_of_records}")
    for name, off in (("label_dim", 16), ("dense_dim", 24), ("slot_num", 32)):
        if getattr(h, name) < 0:
            raise NormFormatError(path, base + off, f"negative {name} {getattr(h, name)}")
    return h


def read_norm_header(path, check=Check_t.Sum) -> NormHeader:
    """Read and validate only the header (error_check vs check, truncation, header checksum)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES + 5)
    return _parse_header(np.frombuffer(head, dtype=_U8), path, check)


@dataclass
class _Decoded:
    """All valid records of one file: label (n, L), dense (n, D), nnz (n, S) int64, keys (M,)."""
    label: np.ndarray
    dense: np.ndarray
    nnz: np.ndarray
    keys: np.ndarray
    skipped: int = 0
    first_bad_offset: int = -1
    nnz0: list | None = None      # set when every record has these per-slot nnz (fixed layout)


def _gather_i32(buf, pos):
    return buf[pos[:, None] + np.arange(4)].view("<i4").reshape(-1).astype(np.int64)


def _first_sample_layout(buf, pos, end, L, D, S, ks):
    """Per-slot nnz of the sample whose payload starts at pos, or None if it does not parse."""
    p = pos + 4 * (L + D)
    nnz = np.zeros(S, dtype=np.int64)
    for k in range(S):
        if p + 4 > end:
            return None
        c = int.from_bytes(buf[p:p + 4].tobytes(), "little", signed=True)
        if c < 0 or c > MAX_NNZ:
            return None
        nnz[k] = c
        p += 4 + ks * c
    return nnz if p <= end else None


def _decode_fixed(buf, h, path, s, L, D, S, kd, nnz0, skip_bad):
    """Fast path: all records share the per-slot nnz of record 0. Returns None if they don't."""
    ks = kd.itemsize
    n = h.number_of_records
    P = 4 * (L + D) + 4 * S + ks * int(nnz0.sum())
    R = P + (5 if s else 0)
    if len(buf) - h.data_offset != n * R:
        return None
    base = h.data_offset
    pre = 4 if s else 0
    nnz0 = [int(c) for c in nnz0]

    def view(dt, offset, shape, inner=()):     # (n,) + shape field view, one row per record
        return np.ndarray((n,) + shape, dtype=dt, buffer=buf, offset=base + offset,
                          strides=(R,) + inner)

    ok = np.ones(n, dtype=bool)
    if s:
        ok &= view("<i4", 0, ()) == P
    nnz_at, col = [], pre + 4 * (L + D)
    for k in range(S):
        nnz_at.append(col)
        ok &= view("<i4", col, ()) == nnz0[k]
        col += 4 + ks * nnz0[k]
    if not ok.all():
        return None                                  # some record has another layout: general path
    keep = None
    skipped, first_bad = 0, -1
    if s:
        rows = buf[base:].reshape(n, R)
        sums = rows[:, 4:4 + P].sum(axis=1, dtype=_U8)            # wraps mod 256 like signed char
        bad = sums != rows[:, R - 1]
        if bad.any():
            i = int(np.argmax(bad))
            first_bad = base + i * R
            if not skip_bad:
                raise NormFormatError(path, first_bad, f"bad checksum {int(rows[i, R - 1]):#04x} "
                                                       f"(payload sums to {int(sums[i]):#04x})", i)
            skipped = int(bad.sum())
            keep = ~bad
    ld = view("<f4", pre, (L + D,), (4,))
    label = np.array(ld[:, :L], dtype=np.float32)
    dense = np.array(ld[:, L:], dtype=np.float32)
    out_kd = output_key_dtype(kd)
    keys = np.empty((n, sum(nnz0)), dtype=out_kd)
    kc = 0
    for k in range(S):
        keys[:, kc:kc + nnz0[k]] = view(kd, nnz_at[k] + 4, (nnz0[k],), (ks,))
        kc += nnz0[k]
    if keep is not None:
        label, dense, keys = label[keep], dense[keep], keys[keep]
    nnz = np.broadcast_to(np.array(nnz0, dtype=np.int64), (label.shape[0], S))
    return _Decoded(label, dense, nnz, keys.reshape(-1), skipped, first_bad, nnz0)


def _walk_unframed(buf, h, path, L, D, S, ks):
    """Check_t.Non with varying nnz: find record starts with a per-record, per-slot loop."""
    n = h.number_of_records
    size = len(buf)
    raw = buf.tobytes()                      # int.from_bytes on bytes is the fast scalar path
    starts = np.empty(n + 1, dtype=np.int64)
    pos = h.data_offset
    fixed = 4 * (L + D)
    for i in range(n):
        starts[i] = pos
        if pos == size:
            raise NormFormatError(path, pos, f"file ends after {i} records but the header's "
                                             f"number_of_records is {n}", i)
        p = pos + fixed
        for k in range(S):
            if p + 4 > size:
                raise NormFormatError(path, pos, f"truncated record (slot {k}'s nnz at offset {p} is "
                                                 f"past the end of the {size}-byte file)", i)
            c = int.from_bytes(raw[p:p + 4], "little", signed=True)
            if c < 0 or c > MAX_NNZ or p + 4 + ks * c > size:
                why = "negative" if c < 0 else ("absurd" if c > MAX_NNZ else "beyond the end of file")
                raise NormFormatError(path, p, f"{why} nnz {c} in slot {k}", i)
            p += 4 + ks * c
        if p > size:
            raise NormFormatError(path, pos, f"truncated record (needs {p - pos} bytes, "
                                             f"{size - pos} left)", i)
        pos = p
    if pos != size:
        raise NormFormatError(path, pos, f"{size - pos} trailing bytes after the {n} records the "
                                         f"header's number_of_records declares")
    starts[n] = pos
    return starts[:-1], starts[1:]            # payload [start, end) of every record


def _walk_framed(buf, h, path, skip_bad):
    """Check_t.Sum: follow the int32 N chain, verify every checksum. Returns payload starts/ends of
    the good records, their record numbers, skipped count and first bad offset.

    A damaged length field sends the walk astray, so the chain breaks at a LATER record (or leaves
    trailing bytes); the damaged record itself fails its checksum, whose byte is then read from the
    wrong place. So when the chain breaks, the first walked record with a bad checksum is reported
    (with what following its length led to), not the record where the chain broke."""
    n = h.number_of_records
    size = len(buf)
    raw = buf.tobytes()
    starts = np.empty(n, dtype=np.int64)
    pos = h.data_offset
    i = 0
    try:
        for i in range(n):
            if pos == size:
                raise NormFormatError(path, pos, f"file ends after {i} records but the header's "
                                                 f"number_of_records is {n}", i)
            if pos + 4 > size:
                raise NormFormatError(path, pos, f"truncated record ({size - pos} bytes left, the length "
                                                 f"field needs 4)", i)
            N = int.from_bytes(raw[pos:pos + 4], "little", signed=True)
            if N < 0:
                raise NormFormatError(path, pos, f"negative record length {N}", i)
            if pos + 5 + N > size:
                raise NormFormatError(path, pos, f"truncated record (length {N} + 5 framing bytes, "
                                                 f"{size - pos} left)", i)
            starts[i] = pos
            pos += 5 + N
        else:
            i = n
        if pos != size:
            raise NormFormatError(path, pos, f"{size - pos} trailing bytes after the {n} records the "
                                             f"header's number_of_records declares")
    except NormFormatError as e:
        sums, stored = _record_sums(buf, starts[:i])
        bad = sums != stored
        if bad.any():
            j = int(np.argmax(bad))
            raise NormFormatError(path, int(starts[j]), f"bad checksum {int(stored[j]):#04x} (payload sums to "
                                                        f"{int(sums[j]):#04x}) and the record chain breaks "
                                                        f"after it: its length field "
                                                        f"{int(_gather_i32(buf, starts[j:j + 1])[0])} is likely "
                                                        f"damaged (following it: at byte offset {e.offset}, "
                                                        f"{e.detail})", j) from None
        raise
    recno = np.arange(n)
    if n == 0:
        return starts, starts, recno, 0, -1
    sums, stored = _record_sums(buf, starts)
    pay = starts + 4
    chk = pay + _gather_i32(buf, starts)
    bad = sums != stored
    skipped, first_bad = 0, -1
    if bad.any():
        i = int(np.argmax(bad))
        first_bad = int(starts[i])
        if not skip_bad:
            raise NormFormatError(path, first_bad, f"bad checksum {int(stored[i]):#04x} (payload "
                                                   f"sums to {int(sums[i]):#04x})", i)
        skipped = int(bad.sum())
        keep = ~bad
        pay, chk, recno = pay[keep], chk[keep], recno[keep]
    return pay, chk, recno, skipped, first_bad


def _record_sums(buf, starts):
    """(payload sums mod 256, stored checksum bytes), each (m,) uint8, of the framed records starting
    at `starts` (m,) whose lengths keep them inside buf."""
    if not len(starts):
        return np.zeros(0, _U8), np.zeros(0, _U8)
    lengths = _gather_i32(buf, starts)
    pay = starts + 4
    chk = pay + lengths
    sums = np.add.reduceat(buf, np.stack([pay, chk], axis=1).reshape(-1), dtype=_U8)[::2]   # mod 256
    sums = np.where(lengths == 0, 0, sums).astype(_U8)   # reduceat of an empty range yields 1 item
    return sums, buf[chk]


def _width_hint(ks: int) -> str:
    """The usual cause of a record whose fields do not add up: keys of the other width."""
    return (f"; keys are read as {8 * ks}-bit (CreateSolver(i64_input_key={ks == 8})): a file written with "
            f"{32 if ks == 8 else 64}-bit keys reads this way")


def _decode_general(buf, pay, end, recno, path, L, D, S, kd):
    """Gather the fields of records whose payloads are buf[pay[i]:end[i]], slot by slot."""
    ks = kd.itemsize
    m = len(pay)
    out_kd = output_key_dtype(kd)
    if m == 0:
        return (np.zeros((0, L), np.float32), np.zeros((0, D), np.float32),
                np.zeros((0, S), np.int64), np.zeros(0, out_kd))
    fixed = 4 * (L + D)
    short = pay + fixed > end
    if short.any():
        i = int(np.argmax(short))
        raise NormFormatError(path, int(pay[i]), f"record payload of {int(end[i] - pay[i])} bytes is "
                                                 f"shorter than label+dense ({fixed} bytes)", int(recno[i]))
    ld = buf[pay[:, None] + np.arange(fixed)].view("<f4").reshape(m, L + D)
    nnz = np.zeros((m, S), dtype=np.int64)
    key_at = np.zeros((m, S), dtype=np.int64)        # byte offset of the first key of (record, slot)
    p = pay + fixed
    for k in range(S):
        over = p + 4 > end
        if over.any():
            i = int(np.argmax(over))
            raise NormFormatError(path, int(p[i]), f"record ends inside slot {k}'s nnz field "
                                                   f"(record length disagrees with its contents){_width_hint(ks)}",
                                  int(recno[i]))
        c = _gather_i32(buf, p)
        badc = (c < 0) | (c > MAX_NNZ) | (p + 4 + ks * c > end)
        if badc.any():
            i = int(np.argmax(badc))
            v = int(c[i])
            why = "negative" if v < 0 else ("absurd" if v > MAX_NNZ else "beyond the record's end")
            raise NormFormatError(path, int(p[i]), f"{why} nnz {v} in slot {k}{_width_hint(ks)}", int(recno[i]))
        nnz[:, k] = c
        key_at[:, k] = p + 4
        p = p + 4 + ks * c
    leftover = p != end
    if leftover.any():
        i = int(np.argmax(leftover))
        raise NormFormatError(path, int(pay[i]), f"record length {int(end[i] - pay[i])} disagrees with "
                                                 f"its contents ({int(p[i] - pay[i])} bytes){_width_hint(ks)}",
                              int(recno[i]))
    flat = nnz.reshape(-1)
    M = int(flat.sum())
    if M:
        within = np.arange(M) - np.repeat(_excl_cumsum(flat)[:-1], flat)
        kpos = np.repeat(key_at.reshape(-1), flat) + ks * within
        keys = buf[kpos[:, None] + np.arange(ks)].view(kd).reshape(-1).astype(out_kd)
    else:
        keys = np.zeros(0, out_kd)
    return (np.ascontiguousarray(ld[:, :L]), np.ascontiguousarray(ld[:, L:]), nnz, keys)


def _checked_header(buf, size, path, label_dim, dense_dim, slot_num, check) -> NormHeader:
    """Parse the header from the first bytes `buf` of a `size`-byte file and check it against the
    reader's dimensions."""
    s = _is_sum(check)
    h = _parse_header(buf, path, check)
    base = 4 if s else 0
    if h.label_dim != label_dim:
        raise NormFormatError(path, base + 16, f"header label_dim={h.label_dim} but the reader expects "
                                               f"{label_dim}")
    if h.dense_dim != dense_dim:
        raise NormFormatError(path, base + 24, f"header dense_dim={h.dense_dim} but the reader expects "
                                               f"{dense_dim}")
    if h.slot_num != slot_num:
        raise NormFormatError(path, base + 32, f"header slot_num={h.slot_num} but the reader's sparse "
                                               f"inputs have {slot_num} slots in total")
    L, D, S = label_dim, dense_dim, slot_num
    if L + D + S == 0:
        raise ValueError("label_dim, dense_dim and slot_num are all 0: samples would have no bytes")
    n = h.number_of_records
    min_rec = 4 * (L + D + S) + (5 if s else 0)         # a record with every nnz = 0
    if n * min_rec > size - h.data_offset:
        raise NormFormatError(path, base + 8, f"header number_of_records={n} cannot fit in the "
                                              f"{size - h.data_offset} bytes after the header "
                                              f"(records are >= {min_rec} bytes)")
    return h


def _decode_buffer(buf, path, label_dim, dense_dim, slot_num, check, key_dtype, skip_bad) -> _Decoded:
    s = _is_sum(check)
    kd = key_dtype_of(key_dtype)
    h = _checked_header(buf, len(buf), path, label_dim, dense_dim, slot_num, check)
    L, D, S = label_dim, dense_dim, slot_num
    n = h.number_of_records
    if n == 0 and len(buf) == h.data_offset:
        return _Decoded(np.zeros((0, L), np.float32), np.zeros((0, D), np.float32),
                        np.zeros((0, S), np.int64), np.zeros(0, output_key_dtype(kd)))
    # Fast path: hypothesise that every record has record 0's layout.
    pay0 = h.data_offset + (4 if s else 0)
    end0 = len(buf)
    if s and len(buf) >= h.data_offset + 4:
        end0 = min(end0, pay0 + int.from_bytes(buf[h.data_offset:pay0].tobytes(), "little", signed=True))
    nnz0 = _first_sample_layout(buf, pay0, end0, L, D, S, kd.itemsize) if n else None
    if nnz0 is not None:
        dec = _decode_fixed(buf, h, path, s, L, D, S, kd, nnz0, skip_bad)
        if dec is not None:
            return dec
    if s:
        pay, end, recno, skipped, first_bad = _walk_framed(buf, h, path, skip_bad)
    else:
        pay, end = _walk_unframed(buf, h, path, L, D, S, kd.itemsize)
        recno, skipped, first_bad = np.arange(n), 0, -1
    label, dense, nnz, keys = _decode_general(buf, pay, end, recno, path, L, D, S, kd)
    return _Decoded(label, dense, nnz, keys, skipped, first_bad)


def norm_record_offsets(path, check=Check_t.Sum, label_dim=None, dense_dim=None, slot_num=None,
                        key_dtype=np.uint32, skip_bad_checksum=False):
    """(pay (m,), recno (m,)): byte offset of the payload and the record number of every record
    decode_norm_file returns (row order, skipped bad-checksum records excluded). Walks the file; meant
    for error reports, not the hot path."""
    path = os.fspath(path)
    buf = np.fromfile(path, dtype=_U8)
    h = _parse_header(buf, path, check)
    L = h.label_dim if label_dim is None else label_dim
    D = h.dense_dim if dense_dim is None else dense_dim
    S = h.slot_num if slot_num is None else slot_num
    if _is_sum(check):
        pay, _, recno, _, _ = _walk_framed(buf, h, path, skip_bad_checksum)
        return pay, recno
    pay, _ = _walk_unframed(buf, h, path, L, D, S, key_dtype_of(key_dtype).itemsize)
    return pay, np.arange(len(pay))


def decode_norm_file(path, label_dim, dense_dim, slot_num, check=Check_t.Sum, key_dtype=np.uint32,
                     skip_bad_checksum=False) -> _Decoded:
    """Decode a whole file: object with label (n, L), dense (n, D), nnz (n, S) int64, keys (M,)
    (uint64 for uint32 files, int64 otherwise; sample-major, slot-minor), skipped, first_bad_offset."""
    path = os.fspath(path)
    buf = np.fromfile(path, dtype=_U8)
    return _decode_buffer(buf, path, label_dim, dense_dim, slot_num, check, key_dtype, skip_bad_checksum)


CHUNK_ROWS = 65536          # records per piece when a big file is decoded piecewise


def iter_norm_chunks(path, label_dim, dense_dim, slot_num, check=Check_t.Sum, key_dtype=np.uint32,
                     skip_bad_checksum=False, rows: int = CHUNK_ROWS, whole_below: int = 16 << 20):
    """decode_norm_file in pieces of at most `rows` records (file order), for big fixed-layout files.

    Small files (< whole_below bytes) and files whose records do not all share record 0's layout are
    decoded whole. Pieces keep the reader's memory bounded and allocations small (fresh multi-MB
    allocations page-fault, which costs more than the decoding on some machines)."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    if size < whole_below:
        yield decode_norm_file(path, label_dim, dense_dim, slot_num, check, key_dtype, skip_bad_checksum)
        return
    s = _is_sum(check)
    kd = key_dtype_of(key_dtype)
    with open(path, "rb") as f:
        head = np.frombuffer(f.read(1 << 20), dtype=_U8)
    h = _checked_header(head, size, path, label_dim, dense_dim, slot_num, check)
    L, D, S = label_dim, dense_dim, slot_num
    n = h.number_of_records
    pay0 = h.data_offset + (4 if s else 0)
    end0 = len(head)
    if s and len(head) >= pay0:
        end0 = min(end0, pay0 + int.from_bytes(head[h.data_offset:pay0].tobytes(), "little", signed=True))
    nnz0 = _first_sample_layout(head, pay0, end0, L, D, S, kd.itemsize) if n else None
    R = 4 * (L + D + S) + kd.itemsize * int(nnz0.sum()) + (5 if s else 0) if nnz0 is not None else 0
    if nnz0 is None or size - h.data_offset != n * R:
        yield decode_norm_file(path, label_dim, dense_dim, slot_num, check, key_dtype, skip_bad_checksum)
        return
    done = skipped = 0
    while done < n:
        m = min(int(rows), n - done)
        off = h.data_offset + done * R
        buf = np.fromfile(path, dtype=_U8, count=m * R, offset=off)
        if len(buf) != m * R:
            raise NormFormatError(path, off + len(buf), "file shrank while being read", done)
        try:
            dec = _decode_fixed(buf, NormHeader(h.error_check, m, L, D, S, 0), path, s, L, D, S, kd, nnz0,
                                skip_bad_checksum)
        except NormFormatError as e:                        # block-relative position -> file position
            raise NormFormatError(path, e.offset + off, e.detail,
                                  None if e.record is None else e.record + done) from None
        if dec is None:
            # some record in this block has another layout: decode the whole file the general way and
            # continue after the rows already handed out
            full = decode_norm_file(path, L, D, S, check, key_dtype, skip_bad_checksum)
            k0 = done - skipped
            yield _Decoded(full.label[k0:], full.dense[k0:], full.nnz[k0:],
                           full.keys[int(full.nnz[:k0].sum()):], full.skipped - skipped, full.first_bad_offset)
            return
        if dec.skipped:
            dec.first_bad_offset += off
            skipped += dec.skipped
        yield dec
        done += m


def _split_inputs(dec: _Decoded, slots_per_input):
    """Per sparse input i: (keys_i (M_i,), offsets_i (n*S_i + 1,)) from the file-wide CSR."""
    n, S = dec.nnz.shape
    out = []
    if dec.nnz0 is not None:
        # Fixed layout: keys form an (n, T) matrix, each input is a column range and its offsets
        # follow from arithmetic (no cumsum over n*S bags).
        kmat = dec.keys.reshape(n, -1)
        s0, c0 = 0, 0
        for si in slots_per_input:
            per = np.array(dec.nnz0[s0:s0 + si], dtype=np.int64)
            T = int(per.sum())
            within = _excl_cumsum(per)[:-1]                                  # (S_i,)
            off = np.empty(n * si + 1, dtype=np.int64)
            off[:-1] = (np.arange(n, dtype=np.int64)[:, None] * T + within).reshape(-1)
            off[-1] = n * T
            keys = kmat.reshape(-1) if len(slots_per_input) == 1 else \
                np.ascontiguousarray(kmat[:, c0:c0 + T]).reshape(-1)
            out.append((keys, off))
            s0, c0 = s0 + si, c0 + T
        return out
    if len(slots_per_input) == 1:
        return [(dec.keys, _excl_cumsum(dec.nnz.reshape(-1)))]
    bag_off = _excl_cumsum(dec.nnz.reshape(-1))
    s0 = 0
    for si in slots_per_input:
        # keys of input i in sample r are the contiguous range [bag_off[r*S+s0], bag_off[r*S+s0+si])
        lo = bag_off[np.arange(n) * S + s0]
        cnt = bag_off[np.arange(n) * S + s0 + si] - lo
        starts = np.repeat(lo - _excl_cumsum(cnt)[:-1], cnt) + np.arange(int(cnt.sum()))
        out.append((dec.keys[starts], _excl_cumsum(dec.nnz[:, s0:s0 + si].reshape(-1))))
        s0 += si
    return out


def _warn_skips(path, dec):
    if dec.skipped:
        warnings.warn(f"Norm file {path!r}: skipped {dec.skipped} sample(s) with a bad checksum (first at "
                      f"byte offset {dec.first_bad_offset})", RuntimeWarning, stacklevel=3)


def read_norm_file(path, label_dim, dense_dim, slots_per_input, check=Check_t.Sum, key_dtype=np.uint32,
                   skip_bad_checksum=False) -> Batch:
    """All samples of one file as a single Batch (B = size = number of valid records)."""
    slots_per_input = _slot_list(slots_per_input)
    dec = decode_norm_file(path, label_dim, dense_dim, sum(slots_per_input), check, key_dtype,
                           skip_bad_checksum)
    _warn_skips(os.fspath(path), dec)
    return Batch(dec.label, dec.dense, _split_inputs(dec, slots_per_input), dec.label.shape[0])


def _slot_list(slots_per_input):
    if isinstance(slots_per_input, (int, np.integer)):
        slots_per_input = [int(slots_per_input)]
    out = [int(x) for x in slots_per_input]
    if not out or min(out) < 0:
        raise ValueError(f"slots_per_input must be a non-empty list of slot counts >= 0, got {out}")
    return out


# ---------------------------------------------------------------------------------------------------
# the batch reader

class NormReader:
    """Iterates Batch objects from a Norm file list in HugeCTR's one-worker order.

    Files are read in list order; a batch may span consecutive files. repeat=True wraps around the list
    forever (never a partial batch); repeat=False yields a final partial batch (size < batch_size, padded)
    and stops. Each `iter(reader)` starts again from the first file. With skip_bad_checksum=True a
    sample whose checksum fails is dropped (counted in `reader.skipped`, warned per file) as HugeCTR
    does; by default it raises NormFormatError.

    It is numbactr.data.reader.DataReader with one worker and one rank: the batching code is there.
    """

    def __init__(self, file_list_path, batch_size: int, label_dim: int, dense_dim: int,
                 slots_per_input, check=Check_t.Sum, key_dtype=np.uint32, repeat: bool = True,
                 skip_bad_checksum: bool = False):
        from numbactr.data.reader import DataReader          # reader.py builds on this module: import late
        self.file_list_path = os.fspath(file_list_path)
        self.label_dim, self.dense_dim = int(label_dim), int(dense_dim)
        self.slots_per_input = _slot_list(slots_per_input)
        self.slot_num = sum(self.slots_per_input)
        self.check = check
        _is_sum(check)
        self.key_dtype = key_dtype_of(key_dtype)
        self.skip_bad_checksum = bool(skip_bad_checksum)
        self._reader = DataReader(DataReaderType_t.Norm, self.file_list_path, batch_size, self.label_dim,
                                  self.dense_dim, self.slots_per_input, None,
                                  self.key_dtype == np.dtype(np.int64), repeat, num_workers=1,
                                  check_type=check, skip_bad_checksum=self.skip_bad_checksum)
        self.files, self.batch_size, self.repeat = self._reader.files, self._reader.batch_size, bool(repeat)

    @property
    def skipped(self) -> int:
        return self._reader.skipped

    def read_file(self, path) -> _Decoded:
        dec = decode_norm_file(path, self.label_dim, self.dense_dim, self.slot_num, self.check,
                               self.key_dtype, self.skip_bad_checksum)
        if dec.skipped:
            _warn_skips(path, dec)
        return dec

    def num_records(self) -> int:
        """Sum of the headers' number_of_records over the list (skipped samples included)."""
        return sum(read_norm_header(p, self.check).number_of_records for p in self.files)

    def __iter__(self):
        return iter(self._reader)
