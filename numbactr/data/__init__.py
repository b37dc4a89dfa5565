"""numbactr.data: HugeCTR's data formats (Norm, Raw, RawAsync, Parquet), DataSourceParams and DataSource (hugectr.data), file
lists, the reader the model uses (make_reader), Criteo preprocessing (numbactr.data.criteo) and the reader
benchmark (numbactr.bench.data).
"""

from numbactr.data.batch import Batch
from numbactr.data.errors import DataFormatError
from numbactr.data.reader import DataReader, make_reader
from numbactr.data.source import DataSource, DataSourceParams

__all__ = ["Batch", "DataFormatError", "DataReader", "DataSource", "DataSourceParams", "make_reader"]
