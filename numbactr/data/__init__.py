"""numbactr.data: HugeCTR's data formats (Norm, Raw, RawAsync, Parquet), DataSourceParams and DataSource (hugectr.data), file
lists, the reader the model uses (make_reader), Criteo preprocessing (numbactr.data.criteo) and the reader
benchmark (numbactr.data.bench).
"""
from .batch import Batch
from .errors import DataFormatError
from .reader import DataReader, make_reader
from .source import DataSource, DataSourceParams

__all__ = ["Batch", "DataFormatError", "DataReader", "DataSource", "DataSourceParams", "make_reader"]
