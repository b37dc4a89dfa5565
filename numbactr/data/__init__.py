"""numbactr.data: HugeCTR's data formats (Norm, Raw, RawAsync, Parquet), DataSourceParams and DataSource (hugectr.data), file
lists, the reader the model uses (make_reader), the converters (numbactr.data.criteo and numbactr.data.convert:
MovieLens, Avazu, libFM/libSVM, census, Taobao) and the reader benchmark (numbactr.bench.data).

The writers are public API for data sets no converter covers: NormWriter / write_norm_file (Norm),
write_raw_file (Raw), ParquetDatasetWriter (Parquet with its ``_metadata.json`` and file list).
"""

from numbactr.data.batch import Batch
from numbactr.data.errors import DataFormatError
from numbactr.data.norm_write import NormWriter, write_norm_file
from numbactr.data.parquet import ParquetDatasetWriter
from numbactr.data.raw import write_raw_file
from numbactr.data.reader import DataReader, make_reader
from numbactr.data.source import DataSource, DataSourceParams

__all__ = [
    "Batch",
    "DataFormatError",
    "DataReader",
    "DataSource",
    "DataSourceParams",
    "NormWriter",
    "ParquetDatasetWriter",
    "make_reader",
    "write_norm_file",
    "write_raw_file",
]
