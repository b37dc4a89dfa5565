"""HugeCTR's Norm files, writing: the header and sample encoding and NormWriter (layout: numbactr.data.norm).

    with NormWriter(path, label_dim=1, dense_dim=13, slot_num=26) as w:
        w.write(label (n, 1), dense (n, 13), [slot_0 (n,), ..., slot_25 (n,)])
    write_norm_file(path, label, dense, slots)            # the same in one call

Encoding is vectorized: when every sample has the same per-slot nnz the records are filled through
strided views of one (n, R) byte array; otherwise every field is scattered to its byte position. Why
here and not beside the decoder: the writer and the small format helpers sit below the decoder and the
reader, which use key_dtype_of and the header layout but never write.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from numbactr.enums import Check_t

HEADER_BYTES = 64
MAX_NNZ = 1 << 20  # more keys than this in one slot of one sample is treated as corruption
_U8 = np.uint8

__all__ = [
    "NormWriter",
    "write_norm_file",
    "encode_header",
    "encode_samples",
    "key_dtype_of",
    "output_key_dtype",
    "HEADER_BYTES",
    "MAX_NNZ",
]


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


def encode_header(number_of_records: int, label_dim: int, dense_dim: int, slot_num: int, check=Check_t.Sum) -> bytes:
    """Header record bytes: 64 (Non) or 69 (Sum: int32 64 | header | checksum)."""
    s = _is_sum(check)
    h = struct.pack("<8q", 1 if s else 0, number_of_records, label_dim, dense_dim, slot_num, 0, 0, 0)
    if not s:
        return h
    return struct.pack("<i", len(h)) + h + bytes([sum(h) & 0xFF])


def encode_samples(
    label: np.ndarray, dense: np.ndarray, nnz: np.ndarray, keys: np.ndarray, check=Check_t.Sum, key_dtype=np.uint32
) -> np.ndarray:
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
        kmat = np.asarray(keys).reshape(n, -1)  # (n, sum(nnz0)) sample-major
        col, kc = pre + 4 * (L + D), 0
        for k in range(S):
            view("<i4", col, ())[...] = nnz0[k]
            view(kd, col + 4, (nnz0[k],), (ks,))[...] = kmat[:, kc : kc + nnz0[k]]
            col += 4 + ks * nnz0[k]
            kc += nnz0[k]
        if s:
            rows = out.reshape(n, R)
            rows[:, R - 1] = rows[:, pre : pre + P].sum(axis=1, dtype=_U8)  # uint8 sum wraps mod 256
        return out

    # Variable layout: scatter every field to its byte position.
    ld_bytes = (
        np.ascontiguousarray(np.concatenate([label, dense], axis=1), dtype="<f4").view(_U8).reshape(n, 4 * (L + D))
    )
    key_bytes = np.ascontiguousarray(keys, dtype=kd).view(_U8).reshape(-1, ks)  # (M, ks)
    payload = 4 * (L + D) + 4 * S + ks * nnz.sum(axis=1)  # (n,)
    rec_len = payload + (5 if s else 0)
    starts = _excl_cumsum(rec_len)  # (n+1,)
    out = np.zeros(int(starts[-1]), dtype=_U8)
    starts = starts[:-1]
    if s:
        out[starts[:, None] + np.arange(4)] = payload.astype("<i4").view(_U8).reshape(n, 4)
    base = starts + pre
    out[base[:, None] + np.arange(ld_bytes.shape[1])] = ld_bytes
    cum = np.cumsum(nnz, axis=1) - nnz  # keys before slot k, (n, S)
    pos = base[:, None] + 4 * (L + D) + 4 * np.arange(S) + ks * cum  # nnz field of (i, k)
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
        sums = np.add.reduceat(out, idx, dtype=_U8)[::2]  # uint8 sums wrap mod 256
        out[chk] = np.where(payload == 0, 0, sums)
    return out


def _slots_to_csr(slots, n: int, slot_num: int):
    """Writer input -> (nnz (n, S) int64, keys flat). Each slot entry is (n,) one key per sample,
    (n, k) k keys per sample, or a pair (keys (M,), lengths (n,)) for ragged slots."""
    if isinstance(slots, np.ndarray):
        if slots.ndim != 2 or slots.shape != (n, slot_num):
            raise ValueError(
                f"a key matrix must be (n, slot_num) = ({n}, {slot_num}) one-hot keys, "
                f"got {slots.shape}; pass a list of per-slot arrays for multi-hot slots"
            )
        return np.ones((n, slot_num), dtype=np.int64), slots.reshape(-1)  # (n, S) one-hot matrix
    slots = list(slots)
    if len(slots) != slot_num:
        raise ValueError(f"expected {slot_num} slots, got {len(slots)}")
    nnz = np.zeros((n, slot_num), dtype=np.int64)
    pieces = []  # per slot: (n, k) matrix or (values, row offsets)
    fixed = True
    for k, sl in enumerate(slots):
        if isinstance(sl, tuple):
            vals, lens = np.asarray(sl[0]).reshape(-1), np.asarray(sl[1], dtype=np.int64).reshape(-1)
            if vals.size == 0:
                vals = vals.astype(np.int64)  # np.asarray([]) is float64
            if lens.shape[0] != n or (lens < 0).any() or lens.sum() != vals.shape[0]:
                raise ValueError(f"slot {k}: ragged (keys, lengths) needs {n} lengths >= 0 summing to len(keys)")
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
            dst = np.repeat(out_off[:-1].reshape(n, slot_num)[:, k], lens) + (
                np.arange(vals.shape[0]) - np.repeat(off[:-1], lens)
            )
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
        raise ValueError(
            f"keys [{lo}, {hi}] do not fit the file's key type {kd.name} "
            f"(use key_dtype=np.int64 / i64_input_key=True for wider keys)"
        )


class NormWriter:
    """Writes one Norm file. number_of_records in the header is patched at close().

    with NormWriter(path, label_dim=1, dense_dim=13, slot_num=26) as w:
        w.write(label (n, 1), dense (n, 13), [slot_0 (n,), ..., slot_25 (n,)])
    """

    def __init__(self, path, label_dim: int, dense_dim: int, slot_num: int, check=Check_t.Sum, key_dtype=np.uint32):
        self.path = os.fspath(path)
        self.label_dim, self.dense_dim, self.slot_num = int(label_dim), int(dense_dim), int(slot_num)
        if (
            min(self.label_dim, self.dense_dim, self.slot_num) < 0
            or self.label_dim + self.dense_dim + self.slot_num == 0
        ):
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
            raise ValueError(
                f"offsets must be a non-decreasing (n*slot_num+1,) = ({n * self.slot_num + 1},) array starting at 0"
            )
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
        self._f.write(self._header())  # patch number_of_records (and the header checksum)
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
    """One-shot NormWriter: write all samples of one file.

    label (n,) or (n, L), dense (n, D) float; slots as NormWriter.write takes them. Keys are written
    verbatim: for HugeCTR's hash embeddings they must already be unique across slots (add the slot
    offsets, as numbactr.data.convert does). key_dtype: np.uint32 (i64_input_key=False) or np.int64.
    """
    label = np.asarray(label, np.float32)
    label = label.reshape(-1, 1) if label.ndim == 1 else label
    dense = np.asarray(dense, np.float32)
    n_slots = slots.shape[1] if isinstance(slots, np.ndarray) and slots.ndim == 2 else len(slots)
    with NormWriter(path, label.shape[1], dense.shape[1] if dense.ndim == 2 else 0, n_slots, check, key_dtype) as w:
        w.write(label, dense, slots)
