"""numbactr.data: HugeCTR's data formats (Norm, Raw, RawAsync, Parquet), DataSourceParams (hugectr.data), file
lists, the reader the model uses (make_reader), Criteo preprocessing (numbactr.data.criteo) and the reader
benchmark (numbactr.data.bench).
"""
from .batch import Batch
from .errors import DataFormatError
from .reader import DataReader, make_reader
from .source import DataSourceParams

__all__ = ["Batch", "DataFormatError", "DataReader", "DataSourceParams", "make_reader"]
