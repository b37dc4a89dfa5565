"""The one exception type every data reader raises for bad input.

A DataFormatError names the file, the record (0-based sample index within that file) and a byte offset
into the file where the problem sits, so a user can `xxd -s OFFSET file` to look at it. Parquet errors
name the row group, row and column instead of a byte offset (values are encoded; see
numbactr.data.parquet).
"""

from __future__ import annotations

__all__ = ["DataFormatError", "DataWarning"]


class DataFormatError(ValueError):
    """Bad or inconsistent input data. Attributes: fmt ("Norm", "Raw", "Parquet"), path, offset (byte
    offset or None), record (sample index in the file, or None)."""

    def __init__(self, fmt: str, path, offset, message: str, record=None):
        self.fmt, self.path, self.offset, self.record = fmt, path, offset, record
        self.detail = message
        where = f"{fmt} file {path!r}"
        if offset is not None:
            where += f", byte offset {offset}"
        if record is not None:
            where += f", record {record}"
        super().__init__(f"{where}: {message}")


class DataWarning(UserWarning):
    """Input data that is readable but partly unused, e.g. a Raw file holding more samples than
    num_samples (the reader reads only the first num_samples, as HugeCTR does)."""
