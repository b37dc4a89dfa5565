"""HugeCTR "Norm" binary data files: writer, decoder and batch reader (spec §2.3, §10.10).

The writer is numbactr.data.norm_write, the decoder numbactr.data.norm_decode (the batch reader,
numbactr.data.reader, decodes through it); this module holds NormReader, a one-worker DataReader, and
re-exports both, so every Norm name imports from here.

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

import numpy as np

from numbactr.enums import Check_t, DataReaderType_t
from numbactr.data.norm_decode import (
    CHUNK_ROWS as CHUNK_ROWS,
    NormFormatError,
    NormHeader,
    _Decoded,
    _is_sum,  # noqa: F401
    _slot_list,
    _split_inputs as _split_inputs,
    _warn_skips,
    decode_norm_file,
    iter_norm_chunks,
    norm_record_offsets,
    read_norm_file,
    read_norm_header,
)
from numbactr.data.norm_write import (
    HEADER_BYTES,
    MAX_NNZ,
    NormWriter,
    encode_header,
    encode_samples,  # noqa: F401
    key_dtype_of,
    output_key_dtype,
    write_norm_file,
)
from numbactr.data.reader import DataReader

__all__ = [
    "NormFormatError",
    "NormHeader",
    "NormWriter",
    "NormReader",
    "HEADER_BYTES",
    "MAX_NNZ",
    "encode_header",
    "encode_samples",
    "read_norm_header",
    "decode_norm_file",
    "read_norm_file",
    "write_norm_file",
    "key_dtype_of",
    "output_key_dtype",
    "norm_record_offsets",
    "iter_norm_chunks",
]


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

    def __init__(
        self,
        file_list_path,
        batch_size: int,
        label_dim: int,
        dense_dim: int,
        slots_per_input,
        check=Check_t.Sum,
        key_dtype=np.uint32,
        repeat: bool = True,
        skip_bad_checksum: bool = False,
    ):
        self.file_list_path = os.fspath(file_list_path)
        self.label_dim, self.dense_dim = int(label_dim), int(dense_dim)
        self.slots_per_input = _slot_list(slots_per_input)
        self.slot_num = sum(self.slots_per_input)
        self.check = check
        _is_sum(check)
        self.key_dtype = key_dtype_of(key_dtype)
        self.skip_bad_checksum = bool(skip_bad_checksum)
        self._reader = DataReader(
            DataReaderType_t.Norm,
            self.file_list_path,
            batch_size,
            self.label_dim,
            self.dense_dim,
            self.slots_per_input,
            None,
            self.key_dtype == np.dtype(np.int64),
            repeat,
            num_workers=1,
            check_type=check,
            skip_bad_checksum=self.skip_bad_checksum,
        )
        self.files, self.batch_size, self.repeat = self._reader.files, self._reader.batch_size, bool(repeat)

    @property
    def skipped(self) -> int:
        return self._reader.skipped

    def read_file(self, path) -> _Decoded:
        dec = decode_norm_file(
            path, self.label_dim, self.dense_dim, self.slot_num, self.check, self.key_dtype, self.skip_bad_checksum
        )
        if dec.skipped:
            _warn_skips(path, dec)
        return dec

    def num_records(self) -> int:
        """Sum of the headers' number_of_records over the list (skipped samples included)."""
        return sum(read_norm_header(p, self.check).number_of_records for p in self.files)

    def __iter__(self):
        return iter(self._reader)
