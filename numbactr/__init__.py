"""numbactr: HugeCTR's Python training API, re-implemented with numba.cuda kernels."""
from . import device as _device  # noqa: F401  (first: may switch numba to its simulator)

__version__ = "0.1.0"
