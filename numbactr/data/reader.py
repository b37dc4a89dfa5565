"""The data reader the model uses: Norm, Raw and Parquet behind one factory, with HugeCTR's sample order,
background prefetch workers and the per-rank split of the global batch (spec §2.1-§2.5).

    reader = make_reader(params, source, batch_size, label_dim, dense_dim, slots_per_input,
                         nnz_per_slot, i64_input_key, repeat, rank=0, ranks=1, eval=False)
    for batch in reader: ...          # each iter() is a fresh pass from the first file
    reader.set_source(path)           # epoch mode: the next pass reads another file list
    reader.close()                    # stops and joins the workers (see Threads below)

Sample order (HugeCTR's DataReader + DataCollector):
* W worker threads. Norm / Parquet: worker w reads files w, w+W, w+2W, ... of the file list (with
  repeat the sequence continues modulo the file count, forever) and builds whole GLOBAL batches of
  consecutive samples from its own stream (a batch may span two of its files). Raw: worker w takes
  batches w, w+W, ... of the single file, each `batch_size` consecutive samples (so the order is the
  file order). RawAsync: the same with W = AsyncParam.num_threads, over the batches in file order or, with
  AsyncParam.shuffle (training only), in one fixed permutation (numbactr.data.raw_async).
* The batches are collected round-robin: worker 0, 1, ..., W-1, 0, ... In epoch mode (repeat=False)
  each worker ends with a partial batch at its end of data (Raw: the file's last partial batch); the
  round-robin then skips finished workers, and the pass ends when all are finished. In repeat mode Norm
  and Parquet never emit a partial batch (a worker wraps to its next file); Raw emits the file's last
  partial batch every pass, as HugeCTR's MmapOffsetList does.
* Workers: Norm and Raw use num_workers (RawAsync: num_threads, each num_batches_per_thread ahead); Norm
  needs at least one file per worker (HugeCTR throws, so do we). Parquet uses min(num_workers, #files,
  local devices) workers (one per local GPU: 1 here; read_file_sequentially=True skips the #files bound
  as in HugeCTR). num_workers=None (the script set none): numbactr.runtime.threads.reader_workers(), sized next
  to the compute threads, one per file at most.
* drop_incomplete_batch is the model's business: the reader hands out every partial batch.

Data paths go through numbactr.data.source: a path with a scheme (hdfs://, s3://, gs://, memory://, ...) or
one on the remote filesystem DataReaderParams.data_source_params names is fetched through fsspec.

Ranks: the global batch B is split contiguously; rank r of R gets rows [r*B/R, (r+1)*B/R) as a Batch of
B/R rows. Every rank reads the whole batch's files (as every HugeCTR node does) and keeps its rows.
A partial global batch of s valid rows gives rank r max(0, min(B/R, s - r*B/R)) valid rows: the first
ranks are full, later ones partly filled or empty (size 0, all padding: zero label/dense, empty bags).
Batch.global_size = s on every rank, so all ranks agree on "end of data" and "incomplete batch".

Prefetch: each worker runs ahead into a bounded queue (depth max(1, 4 // W) batches, so about W + 4
batches are buffered in all); decoding, validation and batch assembly happen in the workers, so the
training step only takes a ready Batch. NumPy and pyarrow release the GIL for the heavy work. A pass's
``memory.arena``, when a device stager sets it (numbactr.data.staging.PinnedArena), makes the workers
assemble each batch straight into pinned host blocks that the stager uploads from.

Threads (numbactr.data.reader_threads): a pass's worker threads are stopped and joined when the pass
ends, is closed, replaced (iter() again, set_source) or dropped, and at interpreter exit, so none runs
while Python shuts down (a daemon thread inside pyarrow then aborts the process: "terminate called
without an active exception").
pass.pause() joins them but keeps the queued batches and each worker's place; the next batch restarts
them (Model.fit pauses its readers at its end).

Bad data raises DataFormatError (file, record, byte offset) in the consumer at the point in the sample
order where it occurs; the reader then stops its workers. Checked in the workers for every format
(numbactr.data.validation): non-finite label/dense values, label_rules (the labels' ranges the model's
loss layers need) and key_bound (each slot's key range of a one-hot table).
Norm's bad-checksum records raise unless skip_bad_checksum=True, which skips them as HugeCTR does and
counts them in `reader.skipped` (with a RuntimeWarning per file).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from numbactr import hugectr_exact
from numbactr import log
from numbactr.enums import Check_t, DataReaderType_t
from numbactr.data.batch import Batch
from numbactr.data.file_list import read_file_list
from numbactr.data.norm_decode import _split_inputs, iter_norm_chunks, norm_record_offsets
from numbactr.data.norm_write import key_dtype_of, output_key_dtype
from numbactr.data.parquet import ParquetFile, metadata_path_for, read_parquet_metadata, slot_offsets_of
from numbactr.data.raw import RawFile
from numbactr.data.raw_async import AsyncParam, RawAsyncFile, batch_order, check_async_input
from numbactr.data.reader_threads import _Pass
from numbactr.data.source import is_remote, local_copy, source_names
from numbactr.data.validation import SlotRanges, slot_ranges, validate_chunk

__all__ = ["make_reader", "DataReader"]

_ARANGE = np.arange(1, dtype=np.int64)


def _arange(n: int) -> np.ndarray:
    """Read-only view of 0..n-1 (int64) from one shared, grown-on-demand array: one-hot CSR offsets are
    the same for every chunk, and fresh multi-MB arrays are costly (page faults)."""
    global _ARANGE
    a = _ARANGE
    if a.shape[0] < n:
        a = np.arange(max(n, 2 * a.shape[0]), dtype=np.int64)
        a.flags.writeable = False
        _ARANGE = a
    return a[:n]


def _excl_cumsum(a) -> np.ndarray:
    out = np.zeros(len(a) + 1, dtype=np.int64)
    np.cumsum(a, out=out[1:])
    return out


# ---------------------------------------------------------------------------------------------------
# decoded pieces of data


@dataclass
class _Chunk:
    """n consecutive samples of one file: label (n, L), dense (n, D), inputs [(keys, offsets (n*S_i+1,))].
    locate(row, kind, j) -> (record, byte offset, description) for error messages."""

    fmt: str
    path: str
    label: np.ndarray
    dense: np.ndarray
    inputs: list
    n: int
    locate: object
    row: int = 0  # cursor: next unread row


def _slots_to_inputs(slots, m, slots_per_input, slot_offsets, out_dtype, fail):
    """Parquet row group slots [(values, offsets or None)] -> per input (keys, offsets (m*S_i+1,))."""
    out, s0 = [], 0
    for S in slots_per_input:
        group = slots[s0 : s0 + S]
        offs_k = slot_offsets[s0 : s0 + S]
        if all(o is None for _, o in group):  # all one-hot: an (m, S) key matrix
            keys = np.empty((m, S), dtype=out_dtype)
            for k, (vals, _) in enumerate(group):
                keys[:, k] = vals  # (non-negative: checked by the file)
            if S and offs_k.any():
                keys += offs_k.astype(out_dtype)  # (S,) broadcast over rows
                if out_dtype == np.uint64 and m and int(keys.max()) > 0xFFFFFFFF:
                    r, k = np.unravel_index(int(np.argmax(keys > 0xFFFFFFFF)), keys.shape)
                    fail(
                        s0 + int(k),
                        int(r),
                        f"key {int(keys[r, k])} (after the slot offset {int(offs_k[k])}) "
                        f"does not fit 32 bits (i64_input_key=False)",
                    )
            out.append((keys.reshape(-1), _arange(m * S + 1)))
        else:
            lens = np.ones((m, S), dtype=np.int64)
            for k, (_, o) in enumerate(group):
                if o is not None:
                    lens[:, k] = np.diff(o)
            bag_off = _excl_cumsum(lens.reshape(-1))
            starts = bag_off[:-1].reshape(m, S)
            keys = np.empty(int(bag_off[-1]), dtype=out_dtype)
            for k, ((vals, o), off) in enumerate(zip(group, offs_k)):
                v = _offset_keys(vals, o, off, out_dtype, fail, s0 + k)
                if o is None:
                    keys[starts[:, k]] = v
                else:
                    lk = lens[:, k]
                    dst = np.repeat(starts[:, k], lk) + (np.arange(v.shape[0]) - np.repeat(o[:-1], lk))
                    keys[dst] = v
            out.append((keys, bag_off))
        s0 += S
    return out


def _offset_keys(vals, row_offsets, off, out_dtype, fail, slot):
    """Keys of one slot (+ its offset) in the output dtype; row_offsets (m+1,) for list columns."""
    v = vals.astype(out_dtype, copy=False) if vals.dtype.kind == out_dtype.kind else vals.astype(out_dtype)
    if off:
        v = v + out_dtype.type(off)
        if out_dtype == np.uint64 and v.size and int(v.max()) > 0xFFFFFFFF:
            pos = int(np.argmax(v > 0xFFFFFFFF))
            row = pos if row_offsets is None else int(np.searchsorted(row_offsets, pos, "right") - 1)
            fail(
                slot, row, f"key {int(v[pos])} (after the slot offset {off}) does not fit 32 bits (i64_input_key=False)"
            )
    return v


# ---------------------------------------------------------------------------------------------------
# per-format chunk sources


class _Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.skipped = 0


def _norm_chunks(cfg, path, stop):
    L = cfg.label_dim
    row0 = 0
    skipped, first_bad = 0, -1
    for dec in iter_norm_chunks(
        path, cfg.label_dim, cfg.dense_dim, cfg.slot_num, cfg.check_type, cfg.key_dtype, cfg.skip_bad_checksum
    ):
        if dec.skipped:
            with cfg.stats.lock:
                cfg.stats.skipped += dec.skipped
            first_bad = dec.first_bad_offset if first_bad < 0 else first_bad
            skipped += dec.skipped

        def locate(row, kind, j, row0=row0):
            pay, recno = norm_record_offsets(
                path, cfg.check_type, cfg.label_dim, cfg.dense_dim, cfg.slot_num, cfg.key_dtype, cfg.skip_bad_checksum
            )
            r = row0 + row
            if kind == "label":
                return int(recno[r]), int(pay[r]) + 4 * j, ""
            if kind == "dense":
                return int(recno[r]), int(pay[r]) + 4 * (L + j), ""
            return int(recno[r]), int(pay[r]), f" (record payload at the byte offset; slot {j})"

        n = dec.label.shape[0]
        if dec.nnz0 is not None and all(c == 1 for c in dec.nnz0):  # one-hot: keys are an (n, S) matrix
            kmat, inputs, s0 = dec.keys.reshape(n, -1), [], 0
            for S in cfg.slots_per_input:
                keys = (
                    kmat.reshape(-1) if S == kmat.shape[1] else np.ascontiguousarray(kmat[:, s0 : s0 + S]).reshape(-1)
                )
                inputs.append((keys, _arange(n * S + 1)))
                s0 += S
        else:
            inputs = _split_inputs(dec, cfg.slots_per_input)
        yield _Chunk("Norm", path, dec.label, dec.dense, inputs, n, locate)
        row0 += n
        if stop.is_set():
            return
    if skipped:
        warnings.warn(
            f"Norm file {path!r}: skipped {skipped} sample(s) with a bad checksum (first at byte offset {first_bad})",
            RuntimeWarning,
            stacklevel=2,
        )


def _parquet_chunks(cfg, path, stop):
    pf = ParquetFile(path, cfg.metas[path], cfg.label_dim, cfg.dense_dim, cfg.slot_num, cfg.flat_nnz, cfg.i64)
    names = [nm for g, nm, _, _ in pf.cols]
    n_lab, n_den = cfg.label_dim, cfg.dense_dim
    rg = -1
    for row_start, label, dense, slots in pf.chunks(stop):
        rg += 1
        m = label.shape[0]

        def locate(row, kind, j, rg=rg, row_start=row_start):
            name = names[j] if kind == "label" else names[n_lab + j] if kind == "dense" else names[n_lab + n_den + j]
            return row_start + row, None, f" (row group {rg}, column {name!r})"

        def fail(slot, row, msg, rg=rg, row_start=row_start):
            pf._fail(rg, row_start, row, names[n_lab + n_den + slot], msg)

        inputs = _slots_to_inputs(slots, m, cfg.slots_per_input, cfg.slot_offsets, cfg.out_key_dtype, fail)
        yield _Chunk("Parquet", path, label, dense, inputs, m, locate)


# ---------------------------------------------------------------------------------------------------
# batch assembly


def _assemble(pieces, have, B, lo, hi, cfg) -> Batch:
    """Rows [lo, hi) of a global batch made of `pieces` [(chunk, a, b)] covering global rows [0, have).

    When a device stager has given the reader its pinned arena (cfg.memory.arena, numbactr.data.staging),
    every array is written into the arena's blocks here, in the worker thread, so the training thread
    uploads them to the device without a host copy of its own."""
    arena = getattr(getattr(cfg, "memory", None), "arena", None)
    mem = arena.batch_memory() if arena is not None else None
    Bl = hi - lo
    size = max(0, min(Bl, have - lo))
    if mem is None:
        label = np.zeros((Bl, cfg.label_dim), np.float32)
        dense = np.zeros((Bl, cfg.dense_dim), np.float32)
    else:  # reused blocks: the padding rows are zeroed below
        label = mem.empty((Bl, cfg.label_dim), np.float32)
        dense = mem.empty((Bl, cfg.dense_dim), np.float32)
    mine = []  # (chunk, a, b) restricted to [lo, hi)
    g = 0
    for c, a, b in pieces:
        s, e = max(g, lo), min(g + b - a, hi)
        if s < e:
            mine.append((c, a + s - g, a + e - g))
        g += b - a
    r = 0
    for c, a, b in mine:
        label[r : r + b - a] = c.label[a:b]
        dense[r : r + b - a] = c.dense[a:b]
        r += b - a
    if mem is not None:
        label[r:] = 0
        dense[r:] = 0
    sparse = []
    for i, S in enumerate(cfg.slots_per_input):
        key_parts, off_parts = [], []
        base = 0
        for c, a, b in mine:
            keys, off = c.inputs[i]
            k0, k1 = int(off[a * S]), int(off[b * S])
            key_parts.append(keys[k0:k1])
            off_parts.append(off[a * S : b * S] - (k0 - base))
            base += k1 - k0
        off_parts.append(np.full((Bl - size) * S + 1, base, dtype=np.int64))  # padding: empty bags
        if mem is not None:
            keys = mem.empty((base,), cfg.out_key_dtype)
            if key_parts:
                np.concatenate(key_parts, out=keys)
            offsets = mem.empty((Bl * S + 1,), np.int64)
            np.concatenate(off_parts, out=offsets)
            sparse.append((keys, offsets))
            continue
        keys = (
            key_parts[0]
            if len(key_parts) == 1
            else (np.concatenate(key_parts) if key_parts else np.zeros(0, cfg.out_key_dtype))
        )
        sparse.append((np.ascontiguousarray(keys), np.concatenate(off_parts)))
    return Batch(label, dense, sparse, size, have, memory=mem)


def _file_worker(cfg, files, w, W, chunk_fn, stop):
    """Batches of worker w (generator run in the worker thread)."""
    N = len(files)
    B, lo, hi = cfg.batch_size, cfg.lo, cfg.hi

    def chunks():
        k, since_data = 0, 0
        while True:
            idx = w + k * W
            if idx >= N:
                if not cfg.repeat:
                    return
                idx %= N
            k += 1
            got = False
            for ch in chunk_fn(cfg, files[idx], stop):
                validate_chunk(ch, cfg.key_ranges, cfg.label_rules, cfg.input_slot_offsets, cfg.max_nnz)
                if ch.n:
                    got = True
                    yield ch
                if stop.is_set():
                    return
            since_data = 0 if got else since_data + 1
            if since_data > N:  # a whole cycle without one sample
                raise ValueError(
                    f"source {cfg.source!r}: worker {w} found no samples in any of its files, cannot repeat"
                )

    stream = chunks()
    cur = None
    while not stop.is_set():
        pieces, have = [], 0
        while have < B:
            if cur is None or cur.row == cur.n:
                cur = next(stream, None)
                if cur is None:
                    break
            take = min(B - have, cur.n - cur.row)
            pieces.append((cur, cur.row, cur.row + take))
            cur.row += take
            have += take
        if have == 0:
            return
        yield _assemble(pieces, have, B, lo, hi, cfg)
        if have < B:
            return


def _raw_worker(cfg, open_file, w, W, stop, order=None):
    """Batches w, w+W, ... (modulo the batch count with repeat) of a Raw or RawAsync file, this rank's rows.

    open_file() -> RawFile or RawAsyncFile (opened in the worker thread); order: a permutation of the batch
    indices (RawAsync shuffle) or None for file order.
    """
    rf = open_file()
    num_samples = rf.num_samples
    B, lo, hi = cfg.batch_size, cfg.lo, cfg.hi
    nb = -(-num_samples // B)
    nnz = getattr(rf, "nnz", None)  # RawAsync: static keys per slot
    key_word = getattr(rf, "key_word", lambda j: cfg.label_dim + cfg.dense_dim + j)
    L = cfg.label_dim
    k = 0
    try:
        while not stop.is_set():
            b = w + k * W
            if b >= nb:
                if not cfg.repeat:
                    return
                b %= nb
            k += 1
            if order is not None:
                b = int(order[b])
            a, e = b * B, min(num_samples, (b + 1) * B)
            ra, re = a + lo, max(a + lo, min(a + hi, e))  # this rank's rows of the file
            label, dense, keys = rf.rows(ra, re)
            m = re - ra

            def locate(row, kind, j, ra=ra):
                word = j if kind == "label" else L + j if kind == "dense" else key_word(j)
                return ra + row, rf.offset_of(ra + row, word), ""

            inputs, s0, c0 = [], 0, 0  # keys (m, sum(nnz)): every input's slots in order
            for S in cfg.slots_per_input:
                if nnz is None or all(v == 1 for v in nnz):
                    inputs.append((np.ascontiguousarray(keys[:, s0 : s0 + S]).reshape(-1), _arange(m * S + 1)))
                    c0 += S
                else:  # multi-hot: this input's columns, slot-major
                    nz = np.asarray(nnz[s0 : s0 + S], np.int64)
                    c1 = c0 + int(nz.sum())
                    inputs.append((np.ascontiguousarray(keys[:, c0:c1]).reshape(-1), _excl_cumsum(np.tile(nz, m))))
                    c0 = c1
                s0 += S
            ch = _Chunk(getattr(rf, "fmt", "Raw"), rf.path, label, dense, inputs, m, locate)
            validate_chunk(ch, cfg.key_ranges, cfg.label_rules, cfg.input_slot_offsets)
            # the chunk holds exactly this rank's valid rows: assemble them as rows [0, m) of B/R
            b = _assemble([(ch, 0, m)], m, hi - lo, 0, hi - lo, cfg)
            b.global_size = e - a
            yield b
    finally:
        rf.close()


def _open_async(cfg, path, num_samples, checked_samples=None):
    """The RawAsync file of a reader's settings (cfg: the reader or its snapshot)."""
    ap = cfg.async_param
    return RawAsyncFile(
        path,
        cfg.label_dim,
        cfg.dense_dim,
        cfg.async_nnz,
        ap.multi_hot_reader and ap.is_dense_float,
        cfg.i64,
        ap.multi_hot_reader and cfg.i64,
        ap.io_alignment,
        cfg.direct_io,
        num_samples=num_samples,
        checked_samples=checked_samples,
    )


# ---------------------------------------------------------------------------------------------------
# the reader


class DataReader:
    """Iterable of Batch objects (this rank's rows); see the module docstring. Construct via make_reader."""

    def __init__(
        self,
        fmt,
        source,
        batch_size,
        label_dim,
        dense_dim,
        slots_per_input,
        nnz_per_slot,
        i64_input_key,
        repeat,
        rank=0,
        ranks=1,
        *,
        num_workers=None,
        check_type=Check_t.Sum,
        skip_bad_checksum=False,
        slot_size_array=(),
        num_samples=0,
        float_label_dense=False,
        read_file_sequentially=False,
        key_bound=None,
        label_rules=None,
        local_devices=1,
        queue_depth=4,
        async_param=None,
        data_source_params=None,
        seed=0,
        shuffle=True,
        direct_io=None,
    ):
        if not isinstance(fmt, DataReaderType_t):
            raise NotImplementedError(
                f"data reader type {fmt!r} is not supported by numbactr (DataReaderType_t."
                f"Norm, Raw, Parquet and RawAsync are)"
            )
        self.fmt = fmt
        B, R, r = int(batch_size), int(ranks), int(rank)
        if B <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if R <= 0 or not 0 <= r < R:
            raise ValueError(f"rank {rank} of {ranks} ranks is invalid")
        if B % R:
            raise ValueError(f"global batch size {B} must be divisible by the number of ranks {R}")
        self.batch_size, self.rank, self.ranks = B, r, R
        self.lo, self.hi = r * B // R, (r + 1) * B // R
        self.local_batch_size = self.hi - self.lo
        self.label_dim, self.dense_dim = int(label_dim), int(dense_dim)
        self.slots_per_input = [int(s) for s in slots_per_input]
        if not self.slots_per_input or min(self.slots_per_input) < 0:
            raise ValueError(f"slots_per_input must be a non-empty list of slot counts >= 0, got {slots_per_input}")
        self.slot_num = sum(self.slots_per_input)
        # nnz_per_slot: the most keys one slot of one sample may hold (Parquet checks it); None: unchecked
        self.nnz_per_slot = self.flat_nnz = None
        if nnz_per_slot is not None:
            nnz = [list(x) for x in nnz_per_slot]
            if [len(x) for x in nnz] != self.slots_per_input:
                raise ValueError(f"nnz_per_slot must give one entry per slot of every input, got {nnz_per_slot}")
            self.nnz_per_slot = nnz
            self.flat_nnz = [int(v) for x in nnz for v in x]
        self.i64 = bool(i64_input_key)
        self.repeat = bool(repeat)
        # num_workers=None: the user did not choose; numbactr.runtime.threads sizes the workers next to the compute
        # threads (HugeCTR's default 12 under hugectr_exact.hugectr_exact()), and fewer files is no warning
        self.num_workers_chosen = num_workers is not None
        if num_workers is None:
            from numbactr.runtime import threads

            num_workers = 12 if hugectr_exact.hugectr_exact() else threads.reader_workers()
        self.num_workers_requested = int(num_workers)
        if self.num_workers_requested <= 0:
            raise ValueError(f"num_workers must be > 0, got {num_workers}")
        self.check_type = check_type
        self.skip_bad_checksum = bool(skip_bad_checksum)
        self.key_dtype = key_dtype_of(self.i64)
        self.out_key_dtype = output_key_dtype(self.i64)
        self.slot_size_array = [int(v) for v in (slot_size_array or [])]
        self.num_samples = int(num_samples)
        self.float_label_dense = bool(float_label_dense)
        self.read_file_sequentially = bool(read_file_sequentially)
        self.local_devices = max(1, int(local_devices))
        self.queue_depth = max(1, int(queue_depth))
        bounds = key_bound if isinstance(key_bound, (list, tuple)) else [key_bound] * len(self.slots_per_input)
        if len(bounds) != len(self.slots_per_input):
            raise ValueError("key_bound: give one bound (or None) per sparse input")
        ranges = [slot_ranges(b, S) for b, S in zip(bounds, self.slots_per_input)]
        self.key_ranges = ranges if any(r is not None for r in ranges) else None
        self.label_rules = list(label_rules) if label_rules is not None else None
        if self.label_rules is not None and len(self.label_rules) != self.label_dim:
            raise ValueError(f"label_rules: give one rule (or None) per label column ({self.label_dim})")
        self.slot_offsets = (
            slot_offsets_of(self.slot_size_array, self.slot_num) if fmt == DataReaderType_t.Parquet else None
        )
        self.input_slot_offsets = (
            None if self.slot_offsets is None else np.split(self.slot_offsets, np.cumsum(self.slots_per_input)[:-1])
        )
        if self.input_slot_offsets is not None and self.slot_size_array:
            # Parquet keys are offset by slot: a stored key past its slot's size would land in the next
            # slot's ids (and rows). Inputs without a tighter bound get [offset_s, offset_s + size_s); a size
            # of 0 bounds nothing.
            sizes = np.split(np.asarray(self.slot_size_array, np.int64), np.cumsum(self.slots_per_input)[:-1])
            ranges = self.key_ranges or [None] * len(self.slots_per_input)
            for i, (lo, size) in enumerate(zip(self.input_slot_offsets, sizes)):
                if ranges[i] is None and size.size:
                    hi = np.where(size > 0, lo + size, np.iinfo(np.int64).max)
                    ranges[i] = SlotRanges(lo.copy(), hi, "DataReaderParams.slot_size_array")
            self.key_ranges = ranges if any(r is not None for r in ranges) else None
        # Norm files state each slot's key count: a sample with more keys in a sparse input than the sum of
        # its nnz_per_slot is an error, as HugeCTR's buffers hold no more (Parquet's reader checks while
        # decoding; Raw and RawAsync have fixed counts)
        self.max_nnz = None
        if fmt == DataReaderType_t.Norm and self.nnz_per_slot is not None:
            self.max_nnz = [np.asarray(x, np.int64) for x in self.nnz_per_slot]
        self.data_source_params = data_source_params
        self.async_param = async_param
        self.order = None
        if fmt == DataReaderType_t.RawAsync:
            if async_param is None:  # DataReaderParams' default (HugeCTR's model_wrapper.hpp)
                async_param = AsyncParam(16, 4, 512000, 4, 512, False, multi_hot_reader=False, is_dense_float=False)
            self.async_param = async_param
            self.async_nnz = check_async_input(async_param, self.slots_per_input, self.nnz_per_slot, self.repeat)
            self.shuffle = bool(shuffle) and async_param.shuffle
            self.direct_io = direct_io  # None: NUMBACTR_DIRECT_IO decides (numbactr.data.raw_async)
            self.seed = int(seed)
            self.queue_depth = async_param.num_threads * async_param.num_batches_per_thread
        self.stats = _Stats()
        self._pass = None
        self.set_source(source)

    # -- configuration -----------------------------------------------------------------------------
    @property
    def skipped(self) -> int:
        """Norm samples skipped for a bad checksum (skip_bad_checksum=True), over all passes."""
        return self.stats.skipped

    def set_source(self, source) -> None:
        """Read another source from the next pass on (HugeCTR's set_source; stops a running pass).

        source: a file list (Norm, Parquet) or data file (Raw, RawAsync), or a list of file lists, which are
        read in order as one data set: the files of the first list, then those of the second, ... (one
        list of all their files; DataReaderParams(source=[list1, list2]) trains on both). HugeCTR reads
        source[0] alone outside its embedding training cache; numbactr reads every list rather than drop
        the others. Raw and RawAsync read one data file of num_samples samples: several are refused."""
        self.close()
        sources = source_names(source)
        self.source = sources[0] if len(sources) == 1 else sources
        dsp = self.data_source_params
        if self.fmt in (DataReaderType_t.Raw, DataReaderType_t.RawAsync) and len(sources) > 1:
            raise ValueError(
                f"DataReaderParams: source lists {len(sources)} files {sources}, but the {self.fmt.name} reader "
                "reads one data file (of num_samples samples); concatenate the files into one, or give one"
            )
        if self.fmt == DataReaderType_t.Raw:
            self.files = [local_copy(sources[0], dsp)]
            RawFile(
                self.files[0],
                self.num_samples,
                self.label_dim,
                self.dense_dim,
                self.slot_num,
                self.float_label_dense,
                self.i64,
                warn_unread=True,
            ).close()  # size checks up front
            self.num_workers = self.num_workers_requested
            return
        if self.fmt == DataReaderType_t.RawAsync:
            self.files = [local_copy(sources[0], dsp)]
            rf = _open_async(self, self.files[0], self.num_samples)  # size checks up front
            self.async_samples = rf.num_samples
            nb = -(-rf.num_samples // self.batch_size)
            rf.close()
            self.order = batch_order(nb, self.shuffle, self.seed)
            self.num_workers = min(self.async_param.num_threads, nb)  # a thread without batches idles
            return
        self.files, self.metas = [], {}
        for list_name in sources:
            list_path = local_copy(list_name)  # a list given as a URI is fetched
            listed = read_file_list(list_path, check_exists=False)
            if not any(is_remote(f, dsp) for f in listed):
                listed = read_file_list(list_path)  # local files: checked, with line numbers
            files = [local_copy(f, dsp) for f in listed]
            if self.fmt == DataReaderType_t.Parquet:
                if is_remote(listed[0], dsp):
                    local_copy(metadata_path_for(listed[0]), dsp)  # beside files[0] in the cache
                meta = self._parquet_metadata(files[0])  # each list's own _metadata.json
                self.metas.update((f, meta) for f in files)
            self.files += files
        N = len(self.files)
        what = f"file list {self.source!r}" if len(sources) == 1 else f"file lists {sources}"
        if self.fmt == DataReaderType_t.Norm:
            self.num_workers = self.num_workers_requested
            if N < self.num_workers_requested:
                msg = (
                    f"{what} has {N} file(s) but num_workers is "
                    f"{self.num_workers_requested}: HugeCTR's Norm reader gives every worker its own files "
                    f"and needs #files >= num_workers"
                )
                if hugectr_exact.hugectr_exact():
                    raise ValueError(msg + f"; set DataReaderParams(num_workers=...) to at most {N}")
                # HugeCTR refuses; numbactr runs with one worker per file (same order as num_workers=N)
                if self.num_workers_chosen:
                    warnings.warn(msg + f"; using {N} worker(s)", stacklevel=3)
                else:
                    log.info_once(
                        ("reader workers", str(self.source)), f"reader: {N} worker(s) for the {N} file(s) of {what}"
                    )
                self.num_workers = N
        else:
            self.meta = self.metas[self.files[0]]
            W = self.num_workers_requested if self.read_file_sequentially else min(self.num_workers_requested, N)
            self.num_workers = min(W, self.local_devices)

    def _parquet_metadata(self, first_file: str):
        """The _metadata.json beside a list's first file, checked against the model's Input."""
        m = read_parquet_metadata(metadata_path_for(first_file))
        if (len(m.labels), len(m.conts), len(m.cats)) != (self.label_dim, self.dense_dim, self.slot_num):
            raise ValueError(
                f"Parquet metadata {m.path!r} lists {len(m.labels)} labels, {len(m.conts)} "
                f"conts and {len(m.cats)} cats, but the model's Input has label_dim "
                f"{self.label_dim}, dense_dim {self.dense_dim} and {self.slot_num} slots"
            )
        return m

    # -- iteration ---------------------------------------------------------------------------------
    def __iter__(self) -> _Pass:
        """A fresh pass from the first file, with its workers already prefetching."""
        self.close()
        W = self.num_workers
        stop = threading.Event()
        # the workers get a snapshot of the settings, never the reader itself: a reader (and its pass)
        # that nobody references any more is collected, and dropping the pass stops the workers
        cfg = SimpleNamespace(**{k: v for k, v in vars(self).items() if k != "_pass"})
        # shared by the workers and the pass: a device stager puts its pinned arena here (even while the
        # workers run) and the batches assembled after that are written into its blocks
        cfg.memory = SimpleNamespace(arena=None)
        path = self.files[0]
        if self.fmt == DataReaderType_t.Raw:

            def open_raw():
                return RawFile(
                    path, cfg.num_samples, cfg.label_dim, cfg.dense_dim, cfg.slot_num, cfg.float_label_dense, cfg.i64
                )

            gens = [_raw_worker(cfg, open_raw, w, W, stop) for w in range(W)]
        elif self.fmt == DataReaderType_t.RawAsync:
            gens = [
                _raw_worker(cfg, lambda: _open_async(cfg, path, 0, cfg.async_samples), w, W, stop, self.order)
                for w in range(W)
            ]
        else:
            fn = _norm_chunks if self.fmt == DataReaderType_t.Norm else _parquet_chunks
            gens = [_file_worker(cfg, self.files, w, W, fn, stop) for w in range(W)]
        self._pass = _Pass(gens, max(1, self.queue_depth // W), stop)
        self._pass.memory = cfg.memory
        return self._pass

    def close(self) -> None:
        """Stop and join the running pass's workers (each finishes at most the chunk it is decoding)."""
        p, self._pass = getattr(self, "_pass", None), None
        if p is not None:
            p.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return (
            f"DataReader({self.fmt.name}, source={self.source!r}, batch_size={self.batch_size}, "
            f"rank={self.rank}/{self.ranks}, workers={self.num_workers}, repeat={self.repeat})"
        )


def make_reader(
    params,
    source: str,
    batch_size: int,
    label_dim: int,
    dense_dim: int,
    slots_per_input,
    nnz_per_slot,
    i64_input_key: bool,
    repeat: bool,
    rank: int = 0,
    ranks: int = 1,
    eval: bool = False,
    *,
    key_bound=None,
    label_rules=None,  # noqa: A002
    skip_bad_checksum: bool = False,
    local_devices: int = 1,
    queue_depth: int = 4,
    seed: int = 0,
) -> DataReader:
    """The reader for one source (train: params.source, every file list of it in order; eval:
    params.eval_source); ``source`` is a path or a list of paths (DataReader.set_source).

    params: DataReaderParams (data_reader_type, check_type, num_workers, slot_size_array (Parquet key
    offsets), num_samples / eval_num_samples and float_label_dense (Raw), read_file_sequentially).
    batch_size: the GLOBAL batch size; the reader yields this rank's B/ranks rows.
    slots_per_input: [slot_num of each sparse input]; nnz_per_slot: [[max keys per slot] per input].
    eval=True picks params.eval_num_samples for Raw. key_bound: per sparse input None (unchecked), an
    int b (keys in [0, b)) or a numbactr.data.validation.SlotRanges (slot s's keys in [lo[s], hi[s]);
    the model passes each one-hot table's slot_size_array ranges); a single int or None applies to every
    input. label_rules: None or one numbactr.data.validation.LabelRule (or None) per label column.
    local_devices: devices of this process (Parquet uses at most one worker per device).
    RawAsync: params.async_param (None: DataReaderParams' default AsyncParam); its shuffle applies to the
    training source only, with the permutation drawn from seed (the solver's: the same on every rank).
    params.data_source_params: where data paths without a scheme live (numbactr.data.source).
    """
    return DataReader(
        params.data_reader_type,
        source,
        batch_size,
        label_dim,
        dense_dim,
        slots_per_input,
        nnz_per_slot,
        i64_input_key,
        repeat,
        rank,
        ranks,
        num_workers=params.num_workers,
        check_type=params.check_type,
        skip_bad_checksum=skip_bad_checksum,
        slot_size_array=params.slot_size_array,
        num_samples=params.eval_num_samples if eval else params.num_samples,
        float_label_dense=params.float_label_dense,
        read_file_sequentially=params.read_file_sequentially,
        key_bound=key_bound,
        label_rules=label_rules,
        local_devices=local_devices,
        queue_depth=queue_depth,
        async_param=params.async_param,
        data_source_params=params.data_source_params,
        seed=seed,
        shuffle=not eval,
    )
