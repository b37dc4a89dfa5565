"""HugeCTR's Norm files, reading: header parsing and vectorized decoding (layout: numbactr.data.norm).

    dec = decode_norm_file(path, label_dim, dense_dim, slot_num, check, key_dtype)   # whole file
    for dec in iter_norm_chunks(path, ...): ...                                      # bounded pieces
    batch = read_norm_file(path, label_dim, dense_dim, slots_per_input)              # one Batch

A decoded file: label (n, L), dense (n, D), nnz (n, S), keys (M,) sample-major, slot-minor (uint64 for
uint32 files, int64 otherwise). When every record has the same per-slot nnz the whole file is viewed as
a packed structured array; otherwise the record starts are found by one pass (the N chain with
checksums, a per-slot loop without) and the fields are gathered slot by slot across all records at once.
Why a module of its own: the batch reader (numbactr.data.reader) decodes through it, and
numbactr.data.norm's NormReader builds on that reader.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import numpy as np

from numbactr.enums import Check_t
from numbactr.data.batch import Batch
from numbactr.data.errors import DataFormatError
from numbactr.data.norm_write import HEADER_BYTES, MAX_NNZ, _U8, _excl_cumsum, _is_sum, key_dtype_of, output_key_dtype

__all__ = [
    "NormFormatError",
    "NormHeader",
    "read_norm_header",
    "decode_norm_file",
    "read_norm_file",
    "norm_record_offsets",
    "iter_norm_chunks",
]


class NormFormatError(DataFormatError):
    """A Norm file does not match its reader configuration or is corrupt; names file and byte offset."""

    def __init__(self, path, offset, message, record=None):
        super().__init__("Norm", path, offset, message, record)


# ---------------------------------------------------------------------------------------------------
# decoding


@dataclass
class NormHeader:
    error_check: int
    number_of_records: int
    label_dim: int
    dense_dim: int
    slot_num: int
    data_offset: int  # byte offset of the first sample record (64 or 69)


def _parse_header(buf: np.ndarray, path: str, check) -> NormHeader:
    s = _is_sum(check)
    size = len(buf)
    need = HEADER_BYTES + (5 if s else 0)
    if size < 4 and s:
        raise NormFormatError(
            path, size, f"truncated header: file has {size} bytes, a checksummed header record needs {need}"
        )
    if s:
        n = int(buf[:4].view("<i4")[0])
        if n != HEADER_BYTES:
            if size >= HEADER_BYTES and int(buf[:8].view("<i8")[0]) == 0:
                raise NormFormatError(
                    path, 0, "header error_check=0 (Check_t.Non file) but the reader's check_type is Check_t.Sum"
                )
            raise NormFormatError(
                path, 0, f"header record length {n}, expected {HEADER_BYTES} (not a checksummed Norm file?)"
            )
    if size < need:
        raise NormFormatError(path, size, f"truncated header: file has {size} bytes, the header needs {need}")
    base = 4 if s else 0
    raw = buf[base : base + HEADER_BYTES]
    f = raw.view("<i8")
    if s:
        got, want = int(buf[base + HEADER_BYTES]), int(raw.sum(dtype=np.uint64) & 0xFF)
        if got != want:
            raise NormFormatError(
                path, base + HEADER_BYTES, f"bad header checksum {got:#04x} (payload sums to {want:#04x})"
            )
    ec = int(f[0])
    if s and ec != 1:
        raise NormFormatError(
            path, base, f"header error_check={ec} but the reader's check_type is Check_t.Sum (expects 1)"
        )
    if not s and ec != 0:
        if ec == 1 or int(buf[:4].view("<i4")[0]) == HEADER_BYTES:
            raise NormFormatError(
                path,
                0,
                "file is checksummed (error_check=1 / Check_t.Sum framing) but the reader's check_type is Check_t.Non",
            )
        raise NormFormatError(
            path, 0, f"header error_check={ec} but the reader's check_type is Check_t.Non (expects 0)"
        )
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
    nnz0: list | None = None  # set when every record has these per-slot nnz (fixed layout)


def _gather_i32(buf, pos):
    return buf[pos[:, None] + np.arange(4)].view("<i4").reshape(-1).astype(np.int64)


def _first_sample_layout(buf, pos, end, L, D, S, ks):
    """Per-slot nnz of the sample whose payload starts at pos, or None if it does not parse."""
    p = pos + 4 * (L + D)
    nnz = np.zeros(S, dtype=np.int64)
    for k in range(S):
        if p + 4 > end:
            return None
        c = int.from_bytes(buf[p : p + 4].tobytes(), "little", signed=True)
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

    def view(dt, offset, shape, inner=()):  # (n,) + shape field view, one row per record
        return np.ndarray((n,) + shape, dtype=dt, buffer=buf, offset=base + offset, strides=(R,) + inner)

    ok = np.ones(n, dtype=bool)
    if s:
        ok &= view("<i4", 0, ()) == P
    nnz_at, col = [], pre + 4 * (L + D)
    for k in range(S):
        nnz_at.append(col)
        ok &= view("<i4", col, ()) == nnz0[k]
        col += 4 + ks * nnz0[k]
    if not ok.all():
        return None  # some record has another layout: general path
    keep = None
    skipped, first_bad = 0, -1
    if s:
        rows = buf[base:].reshape(n, R)
        sums = rows[:, 4 : 4 + P].sum(axis=1, dtype=_U8)  # wraps mod 256 like signed char
        bad = sums != rows[:, R - 1]
        if bad.any():
            i = int(np.argmax(bad))
            first_bad = base + i * R
            if not skip_bad:
                raise NormFormatError(
                    path, first_bad, f"bad checksum {int(rows[i, R - 1]):#04x} (payload sums to {int(sums[i]):#04x})", i
                )
            skipped = int(bad.sum())
            keep = ~bad
    ld = view("<f4", pre, (L + D,), (4,))
    label = np.array(ld[:, :L], dtype=np.float32)
    dense = np.array(ld[:, L:], dtype=np.float32)
    out_kd = output_key_dtype(kd)
    keys = np.empty((n, sum(nnz0)), dtype=out_kd)
    kc = 0
    for k in range(S):
        keys[:, kc : kc + nnz0[k]] = view(kd, nnz_at[k] + 4, (nnz0[k],), (ks,))
        kc += nnz0[k]
    if keep is not None:
        label, dense, keys = label[keep], dense[keep], keys[keep]
    nnz = np.broadcast_to(np.array(nnz0, dtype=np.int64), (label.shape[0], S))
    return _Decoded(label, dense, nnz, keys.reshape(-1), skipped, first_bad, nnz0)


def _walk_unframed(buf, h, path, L, D, S, ks):
    """Check_t.Non with varying nnz: find record starts with a per-record, per-slot loop."""
    n = h.number_of_records
    size = len(buf)
    raw = buf.tobytes()  # int.from_bytes on bytes is the fast scalar path
    starts = np.empty(n + 1, dtype=np.int64)
    pos = h.data_offset
    fixed = 4 * (L + D)
    for i in range(n):
        starts[i] = pos
        if pos == size:
            raise NormFormatError(
                path, pos, f"file ends after {i} records but the header's number_of_records is {n}", i
            )
        p = pos + fixed
        for k in range(S):
            if p + 4 > size:
                raise NormFormatError(
                    path,
                    pos,
                    f"truncated record (slot {k}'s nnz at offset {p} is past the end of the {size}-byte file)",
                    i,
                )
            c = int.from_bytes(raw[p : p + 4], "little", signed=True)
            if c < 0 or c > MAX_NNZ or p + 4 + ks * c > size:
                why = "negative" if c < 0 else ("absurd" if c > MAX_NNZ else "beyond the end of file")
                raise NormFormatError(path, p, f"{why} nnz {c} in slot {k}", i)
            p += 4 + ks * c
        if p > size:
            raise NormFormatError(path, pos, f"truncated record (needs {p - pos} bytes, {size - pos} left)", i)
        pos = p
    if pos != size:
        raise NormFormatError(
            path, pos, f"{size - pos} trailing bytes after the {n} records the header's number_of_records declares"
        )
    starts[n] = pos
    return starts[:-1], starts[1:]  # payload [start, end) of every record


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
                raise NormFormatError(
                    path, pos, f"file ends after {i} records but the header's number_of_records is {n}", i
                )
            if pos + 4 > size:
                raise NormFormatError(
                    path, pos, f"truncated record ({size - pos} bytes left, the length field needs 4)", i
                )
            N = int.from_bytes(raw[pos : pos + 4], "little", signed=True)
            if N < 0:
                raise NormFormatError(path, pos, f"negative record length {N}", i)
            if pos + 5 + N > size:
                raise NormFormatError(
                    path, pos, f"truncated record (length {N} + 5 framing bytes, {size - pos} left)", i
                )
            starts[i] = pos
            pos += 5 + N
        else:
            i = n
        if pos != size:
            raise NormFormatError(
                path, pos, f"{size - pos} trailing bytes after the {n} records the header's number_of_records declares"
            )
    except NormFormatError as e:
        sums, stored = _record_sums(buf, starts[:i])
        bad = sums != stored
        if bad.any():
            j = int(np.argmax(bad))
            raise NormFormatError(
                path,
                int(starts[j]),
                f"bad checksum {int(stored[j]):#04x} (payload sums to "
                f"{int(sums[j]):#04x}) and the record chain breaks "
                f"after it: its length field "
                f"{int(_gather_i32(buf, starts[j : j + 1])[0])} is likely "
                f"damaged (following it: at byte offset {e.offset}, "
                f"{e.detail})",
                j,
            ) from None
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
            raise NormFormatError(
                path, first_bad, f"bad checksum {int(stored[i]):#04x} (payload sums to {int(sums[i]):#04x})", i
            )
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
    sums = np.add.reduceat(buf, np.stack([pay, chk], axis=1).reshape(-1), dtype=_U8)[::2]  # mod 256
    sums = np.where(lengths == 0, 0, sums).astype(_U8)  # reduceat of an empty range yields 1 item
    return sums, buf[chk]


def _width_hint(ks: int) -> str:
    """The usual cause of a record whose fields do not add up: keys of the other width."""
    return (
        f"; keys are read as {8 * ks}-bit (CreateSolver(i64_input_key={ks == 8})): a file written with "
        f"{32 if ks == 8 else 64}-bit keys reads this way"
    )


def _decode_general(buf, pay, end, recno, path, L, D, S, kd):
    """Gather the fields of records whose payloads are buf[pay[i]:end[i]], slot by slot."""
    ks = kd.itemsize
    m = len(pay)
    out_kd = output_key_dtype(kd)
    if m == 0:
        return (
            np.zeros((0, L), np.float32),
            np.zeros((0, D), np.float32),
            np.zeros((0, S), np.int64),
            np.zeros(0, out_kd),
        )
    fixed = 4 * (L + D)
    short = pay + fixed > end
    if short.any():
        i = int(np.argmax(short))
        raise NormFormatError(
            path,
            int(pay[i]),
            f"record payload of {int(end[i] - pay[i])} bytes is shorter than label+dense ({fixed} bytes)",
            int(recno[i]),
        )
    ld = buf[pay[:, None] + np.arange(fixed)].view("<f4").reshape(m, L + D)
    nnz = np.zeros((m, S), dtype=np.int64)
    key_at = np.zeros((m, S), dtype=np.int64)  # byte offset of the first key of (record, slot)
    p = pay + fixed
    for k in range(S):
        over = p + 4 > end
        if over.any():
            i = int(np.argmax(over))
            raise NormFormatError(
                path,
                int(p[i]),
                f"record ends inside slot {k}'s nnz field (record length disagrees with its contents){_width_hint(ks)}",
                int(recno[i]),
            )
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
        raise NormFormatError(
            path,
            int(pay[i]),
            f"record length {int(end[i] - pay[i])} disagrees with "
            f"its contents ({int(p[i] - pay[i])} bytes){_width_hint(ks)}",
            int(recno[i]),
        )
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
        raise NormFormatError(path, base + 16, f"header label_dim={h.label_dim} but the reader expects {label_dim}")
    if h.dense_dim != dense_dim:
        raise NormFormatError(path, base + 24, f"header dense_dim={h.dense_dim} but the reader expects {dense_dim}")
    if h.slot_num != slot_num:
        raise NormFormatError(
            path,
            base + 32,
            f"header slot_num={h.slot_num} but the reader's sparse inputs have {slot_num} slots in total",
        )
    L, D, S = label_dim, dense_dim, slot_num
    if L + D + S == 0:
        raise ValueError("label_dim, dense_dim and slot_num are all 0: samples would have no bytes")
    n = h.number_of_records
    min_rec = 4 * (L + D + S) + (5 if s else 0)  # a record with every nnz = 0
    if n * min_rec > size - h.data_offset:
        raise NormFormatError(
            path,
            base + 8,
            f"header number_of_records={n} cannot fit in the "
            f"{size - h.data_offset} bytes after the header "
            f"(records are >= {min_rec} bytes)",
        )
    return h


def _decode_buffer(buf, path, label_dim, dense_dim, slot_num, check, key_dtype, skip_bad) -> _Decoded:
    s = _is_sum(check)
    kd = key_dtype_of(key_dtype)
    h = _checked_header(buf, len(buf), path, label_dim, dense_dim, slot_num, check)
    L, D, S = label_dim, dense_dim, slot_num
    n = h.number_of_records
    if n == 0 and len(buf) == h.data_offset:
        return _Decoded(
            np.zeros((0, L), np.float32),
            np.zeros((0, D), np.float32),
            np.zeros((0, S), np.int64),
            np.zeros(0, output_key_dtype(kd)),
        )
    # Fast path: hypothesise that every record has record 0's layout.
    pay0 = h.data_offset + (4 if s else 0)
    end0 = len(buf)
    if s and len(buf) >= h.data_offset + 4:
        end0 = min(end0, pay0 + int.from_bytes(buf[h.data_offset : pay0].tobytes(), "little", signed=True))
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


def norm_record_offsets(
    path, check=Check_t.Sum, label_dim=None, dense_dim=None, slot_num=None, key_dtype=np.uint32, skip_bad_checksum=False
):
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


def decode_norm_file(
    path, label_dim, dense_dim, slot_num, check=Check_t.Sum, key_dtype=np.uint32, skip_bad_checksum=False
) -> _Decoded:
    """Decode a whole file: object with label (n, L), dense (n, D), nnz (n, S) int64, keys (M,)
    (uint64 for uint32 files, int64 otherwise; sample-major, slot-minor), skipped, first_bad_offset."""
    path = os.fspath(path)
    buf = np.fromfile(path, dtype=_U8)
    return _decode_buffer(buf, path, label_dim, dense_dim, slot_num, check, key_dtype, skip_bad_checksum)


CHUNK_ROWS = 65536  # records per piece when a big file is decoded piecewise


def iter_norm_chunks(
    path,
    label_dim,
    dense_dim,
    slot_num,
    check=Check_t.Sum,
    key_dtype=np.uint32,
    skip_bad_checksum=False,
    rows: int = CHUNK_ROWS,
    whole_below: int = 16 << 20,
):
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
        end0 = min(end0, pay0 + int.from_bytes(head[h.data_offset : pay0].tobytes(), "little", signed=True))
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
            dec = _decode_fixed(
                buf, NormHeader(h.error_check, m, L, D, S, 0), path, s, L, D, S, kd, nnz0, skip_bad_checksum
            )
        except NormFormatError as e:  # block-relative position -> file position
            raise NormFormatError(
                path, e.offset + off, e.detail, None if e.record is None else e.record + done
            ) from None
        if dec is None:
            # some record in this block has another layout: decode the whole file the general way and
            # continue after the rows already handed out
            full = decode_norm_file(path, L, D, S, check, key_dtype, skip_bad_checksum)
            k0 = done - skipped
            yield _Decoded(
                full.label[k0:],
                full.dense[k0:],
                full.nnz[k0:],
                full.keys[int(full.nnz[:k0].sum()) :],
                full.skipped - skipped,
                full.first_bad_offset,
            )
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
            per = np.array(dec.nnz0[s0 : s0 + si], dtype=np.int64)
            T = int(per.sum())
            within = _excl_cumsum(per)[:-1]  # (S_i,)
            off = np.empty(n * si + 1, dtype=np.int64)
            off[:-1] = (np.arange(n, dtype=np.int64)[:, None] * T + within).reshape(-1)
            off[-1] = n * T
            keys = (
                kmat.reshape(-1)
                if len(slots_per_input) == 1
                else np.ascontiguousarray(kmat[:, c0 : c0 + T]).reshape(-1)
            )
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
        out.append((dec.keys[starts], _excl_cumsum(dec.nnz[:, s0 : s0 + si].reshape(-1))))
        s0 += si
    return out


def _warn_skips(path, dec):
    if dec.skipped:
        warnings.warn(
            f"Norm file {path!r}: skipped {dec.skipped} sample(s) with a bad checksum (first at "
            f"byte offset {dec.first_bad_offset})",
            RuntimeWarning,
            stacklevel=3,
        )


def read_norm_file(
    path, label_dim, dense_dim, slots_per_input, check=Check_t.Sum, key_dtype=np.uint32, skip_bad_checksum=False
) -> Batch:
    """All samples of one file as a single Batch (B = size = number of valid records)."""
    slots_per_input = _slot_list(slots_per_input)
    dec = decode_norm_file(path, label_dim, dense_dim, sum(slots_per_input), check, key_dtype, skip_bad_checksum)
    _warn_skips(os.fspath(path), dec)
    return Batch(dec.label, dec.dense, _split_inputs(dec, slots_per_input), dec.label.shape[0])


def _slot_list(slots_per_input):
    if isinstance(slots_per_input, (int, np.integer)):
        slots_per_input = [int(slots_per_input)]
    out = [int(x) for x in slots_per_input]
    if not out or min(out) < 0:
        raise ValueError(f"slots_per_input must be a non-empty list of slot counts >= 0, got {out}")
    return out
