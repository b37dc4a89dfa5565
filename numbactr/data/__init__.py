"""numbactr.data: HugeCTR's data formats (Norm, Raw, Parquet), file lists, the reader the model uses
(make_reader), Criteo preprocessing (numbactr.data.criteo) and the reader benchmark (numbactr.data.bench).
"""
from .batch import Batch
from .errors import DataFormatError
from .reader import DataReader, make_reader

__all__ = ["Batch", "DataFormatError", "DataReader", "make_reader"]
