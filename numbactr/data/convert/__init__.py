"""Converters from the public recommender data sets to HugeCTR's formats (``numbactr data NAME IN OUT``).

One module per data set, each with a ``convert_<name>`` function and the ``main`` of its command:
movielens (NCF), avazu, libfm and libsvm (Frappe and the BARS files), census (UCI adult, Wide & Deep),
taobao (DIN/BST behaviour sequences); numbactr.data.criteo converts Criteo. They share
numbactr.data.convert.common: the output layout (``OUT/train``, ``OUT/eval``, ``OUT/slot_size_array.json``,
``OUT/conversion.json``), the key convention per format and the ConversionResult every converter returns.
"""

from numbactr.data.convert.avazu import convert_avazu
from numbactr.data.convert.census import convert_census
from numbactr.data.convert.common import ConversionResult
from numbactr.data.convert.libfm import convert_libfm
from numbactr.data.convert.libsvm import convert_libsvm
from numbactr.data.convert.movielens import convert_movielens
from numbactr.data.convert.taobao import convert_taobao

__all__ = [
    "ConversionResult",
    "convert_avazu",
    "convert_census",
    "convert_libfm",
    "convert_libsvm",
    "convert_movielens",
    "convert_taobao",
]
