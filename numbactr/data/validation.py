"""Value checks the reader's workers run on every decoded chunk, before a batch reaches the model.

A chunk is n consecutive samples of one file (numbactr.data.reader._Chunk): label (n, L), dense (n, D),
per sparse input i a CSR (keys (N_i,), offsets (n*S_i + 1,)), and locate(row, kind, j) -> (record,
byte offset or None, extra description). Every failure raises DataFormatError naming the file, the
record (sample index in the file) and, for Norm and Raw, the byte offset of the bad value.

Checks, in this order:
  * label and dense values are finite (NaN/inf from a damaged file or log(x + 1) of x <= -1 in Raw);
  * no sample holds more keys in a sparse input than the sum of its nnz_per_slot (Norm: HugeCTR's buffers
    hold that many a sample; a single slot may exceed its own nnz_per_slot, as in HugeCTR);
  * label rules (one per label column, derived by the model from its loss layers, see LabelRule):
      "unit"            0 <= y <= 1                 BinaryCrossEntropyLoss
      "unit_or_ignore"  0 <= y <= 1, or y < -0.5    MultiCrossEntropyLoss (y < -0.5 means "no label")
      "class"           y == 0 or y == 1            CrossEntropyLoss (a class index of two classes)
  * no 64-bit key is 2**64-1 (int64 -1): the hash table's empty-slot marker, which no embedding can hold
    (numbactr.embedding.hash_table.EMPTY_KEY; HugeCTR's tables misbehave on it);
  * key ranges (one SlotRanges per sparse input, or None): the key of slot s must lie in
    [lo[s], hi[s]). A one-hot table (LocalizedSlotSparseEmbeddingOneHot, HybridSparseEmbedding: no hash)
    takes per-slot keys in [0, size_s) of slot_size_array and adds the slot offsets itself, as HugeCTR's
    do, so a key outside its slot's range would silently train another slot's rows. Norm and Raw keys are
    compared as stored (the readers use them verbatim); Parquet keys after the reader added its slot
    offset (DataReaderParams.slot_size_array), and the message then also gives the stored value and that
    offset.

Cost: a few vectorized passes over the chunk (each key once: an unsigned subtract and a compare),
run in the worker threads, off the training thread; `numbactr bench data` figures are in the README.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numbactr.data.errors import DataFormatError
from numbactr.kernels.hash_table import EMPTY_KEY

__all__ = ["SlotRanges", "LabelRule", "LABEL_KINDS", "slot_ranges", "validate_chunk"]

LABEL_KINDS = {
    "unit": "must lie in [0, 1]",
    "unit_or_ignore": "must lie in [0, 1] (or be < -0.5 for 'no label')",
    "class": "must be a class index 0 or 1",
}

_ROWS = 4096  # rows per block of the key check: its two temporaries stay small and are reused


@dataclass(frozen=True)
class SlotRanges:
    """Allowed keys of one sparse input: slot s takes keys in [lo[s], hi[s]). lo, hi: (S,) int64 with
    0 <= lo <= hi; what: who needs the ranges (e.g. the embedding), for messages; per_slot=False for a
    single bound over the whole table (lo = 0 and the same hi for every slot)."""

    lo: np.ndarray
    hi: np.ndarray
    what: str = ""
    per_slot: bool = True

    def describe(self, s: int) -> str:
        if not self.per_slot:
            return f"outside the table [0, {int(self.hi[s])})"
        who = f" of {self.what}" if self.what else ""
        return f"outside slot {s}'s range [{int(self.lo[s])}, {int(self.hi[s])}){who}"


@dataclass(frozen=True)
class LabelRule:
    """One label column's constraint: kind in LABEL_KINDS; what: who needs it (the loss layer)."""

    kind: str
    what: str = ""

    def __post_init__(self):
        if self.kind not in LABEL_KINDS:
            raise ValueError(f"LabelRule kind must be one of {sorted(LABEL_KINDS)}, got {self.kind!r}")


def slot_offsets(slot_size_array) -> np.ndarray:
    """(S,) int64 first key of each slot in one key space, the exclusive prefix sum of slot_size_array: key k
    of slot s is k + slot_offsets[s] (the Criteo conversion's keys, the hybrid embedding's categories)."""
    sizes = np.asarray(slot_size_array, np.int64)
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def slot_ranges(bound, slots: int) -> SlotRanges | None:
    """Normalize one input's key bound: None, an int b ([0, b) for every slot), a SlotRanges, or a
    sequence of per-slot (lo, hi) pairs."""
    if bound is None or isinstance(bound, SlotRanges):
        r = bound
    elif isinstance(bound, (int, np.integer)):
        r = SlotRanges(np.zeros(slots, np.int64), np.full(slots, int(bound), np.int64), per_slot=False)
    else:
        pairs = np.asarray(bound, dtype=np.int64).reshape(-1, 2)
        r = SlotRanges(np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1]))
    if r is not None:
        if r.lo.shape != (slots,) or r.hi.shape != (slots,):
            raise ValueError(f"key ranges: need one [lo, hi) per slot ({slots} slots), got {r.lo.shape[0]}")
        if (r.lo < 0).any() or (r.hi < r.lo).any():
            raise ValueError(f"key ranges must satisfy 0 <= lo <= hi, got lo {r.lo.tolist()} hi {r.hi.tolist()}")
    return r


def _check_finite(ch) -> None:
    for kind, arr in (("label", ch.label), ("dense", ch.dense)):
        if arr.size:
            fin = np.isfinite(arr)
            if not fin.all():
                r, j = np.unravel_index(int(np.argmin(fin)), arr.shape)
                rec, off, desc = ch.locate(int(r), kind, int(j))
                raise DataFormatError(ch.fmt, ch.path, off, f"non-finite {kind}[{j}] = {arr[r, j]}{desc}", rec)


def _check_labels(ch, rules) -> None:
    for j, rule in enumerate(rules):
        if rule is None or not ch.n:
            continue
        y = ch.label[:, j]
        if rule.kind == "class":
            bad = (y != 0) & (y != 1)
        else:
            bad = (y < 0) | (y > 1)
            if rule.kind == "unit_or_ignore":
                bad &= y >= -0.5
        if bad.any():
            r = int(np.argmax(bad))
            rec, off, desc = ch.locate(r, "label", j)
            who = f" by {rule.what}" if rule.what else ""
            raise DataFormatError(
                ch.fmt, ch.path, off, f"label[{j}] = {str(y[r])} {LABEL_KINDS[rule.kind]} (required{who}){desc}", rec
            )


def _bad_keys(keys, offs, n, S, lo, size):
    """Position of the first key outside its slot's [lo, lo + size), or -1. keys (N,) uint64/int64,
    offs (n*S + 1,). Unsigned arithmetic: (key - lo) mod 2^64 < size  <=>  lo <= key < lo + size
    (a negative int64 key wraps to a huge value), one subtract and one compare per key."""
    u = keys.view(np.uint64) if keys.dtype == np.int64 else keys
    if keys.shape[0] == n * S and bool((np.diff(offs) == 1).all()):  # one key per bag: an (n, S) matrix
        m = u.reshape(n, S)
        R = min(_ROWS, n)
        diff, bad = np.empty((R, S), np.uint64), np.empty((R, S), bool)  # reused: no page faults
        for a in range(0, n, R):
            k = min(R, n - a)
            np.subtract(m[a : a + k], lo, out=diff[:k])
            np.greater_equal(diff[:k], size, out=bad[:k])
            if bad[:k].any():
                return a * S + int(np.argmax(bad[:k]))  # flat position = row * S + slot
        return -1
    slot = np.repeat(np.tile(np.arange(S), n), np.diff(offs))  # (N,) slot of every key
    bad = (u - lo[slot]) >= size[slot]
    return int(np.argmax(bad)) if bad.any() else -1


def _check_keys(ch, ranges, slot_offsets) -> None:
    for i, ((keys, offs), rg) in enumerate(zip(ch.inputs, ranges)):
        if rg is None or not keys.size:
            continue
        S = rg.lo.shape[0]
        pos = _bad_keys(keys, offs, ch.n, S, rg.lo.astype(np.uint64), (rg.hi - rg.lo).astype(np.uint64))
        if pos < 0:
            continue
        r, s = divmod(int(np.searchsorted(offs, pos, "right") - 1), S)  # bag -> (row, slot)
        rec, off, desc = ch.locate(r, "key", s)
        key = int(keys[pos])
        stored = ""
        if slot_offsets is not None and slot_offsets[i] is not None and int(slot_offsets[i][s]):
            so = int(slot_offsets[i][s])
            stored = f" (stored key {key - so} + slot offset {so} from DataReaderParams.slot_size_array)"
        raise DataFormatError(
            ch.fmt, ch.path, off, f"key {key} of sparse input {i} slot {s}{stored} is {rg.describe(s)}{desc}", rec
        )


def _check_reserved(ch) -> None:
    """DataFormatError for the first 64-bit key equal to EMPTY_KEY (2**64-1, int64 -1), naming the sparse
    input, slot, file and record (32-bit keys cannot hold it)."""
    for i, (keys, offs) in enumerate(ch.inputs):
        if keys.dtype.itemsize != 8 or not keys.size:
            continue
        u = keys.view(np.uint64)
        hit = u == EMPTY_KEY
        if not hit.any():
            continue
        pos = int(np.argmax(hit))
        bag = int(np.searchsorted(offs, pos, "right") - 1)
        S = (offs.shape[0] - 1) // ch.n if ch.n else 1
        r, s = divmod(bag, S)
        rec, off, desc = ch.locate(r, "key", s)
        raise DataFormatError(
            ch.fmt,
            ch.path,
            off,
            f"key {int(keys[pos])} (2**64-1 as unsigned) of sparse input {i} slot {s} is reserved: it marks the "
            f"hash table's empty slots and cannot be an embedding key{desc}",
            rec,
        )


def _check_nnz(ch, max_nnz) -> None:
    """A sample's keys of one sparse input against the most its DataReaderSparseParam holds: HugeCTR's Norm
    reader sizes its buffers by Σ nnz_per_slot per sample and does not bound a slot on its own (a slot may
    hold more than its nnz_per_slot when others hold fewer)."""
    for i, ((keys, offs), most) in enumerate(zip(ch.inputs, max_nnz)):
        if most is None or not ch.n:
            continue
        S = most.shape[0]
        counts = np.diff(offs).reshape(ch.n, S)
        total, cap = counts.sum(axis=1), int(most.sum())
        over = total > cap
        if over.any():
            r = int(np.argmax(over))
            rec, off, desc = ch.locate(r, "key", 0)
            per_slot = ", ".join(str(int(c)) for c in counts[r])
            raise DataFormatError(
                ch.fmt,
                ch.path,
                off,
                f"{int(total[r])} keys in sparse input {i} (per slot: "
                f"{per_slot}), but its DataReaderSparseParam holds at most "
                f"{cap} a sample (the sum of nnz_per_slot "
                f"{[int(m) for m in most]}){desc}",
                rec,
            )


def validate_chunk(ch, key_ranges=None, label_rules=None, slot_offsets=None, max_nnz=None) -> None:
    """Raise DataFormatError for the first bad value of chunk `ch` (see the module docstring).

    key_ranges: per sparse input a SlotRanges or None; label_rules: per label column a LabelRule or
    None; slot_offsets: per sparse input the (S_i,) offsets the Parquet reader added to its keys (for
    messages), or None; max_nnz: per sparse input the (S_i,) most keys a slot may hold (the Input's
    nnz_per_slot), or None.
    """
    _check_finite(ch)
    _check_reserved(ch)
    if max_nnz is not None:
        _check_nnz(ch, max_nnz)
    if label_rules is not None:
        _check_labels(ch, label_rules)
    if key_ranges is not None:
        _check_keys(ch, key_ranges, slot_offsets)
