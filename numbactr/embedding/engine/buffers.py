"""The engine's buffers: zeroed storage on the engine's device, and the deterministic uniform fill.

fill_uniform_rows draws every value from a hash of (seed, linear row, d) (numbactr.kernels.embedding_init), so
a table starts the same on every device and however it is chunked.
"""

from __future__ import annotations

import numpy as np

from numbactr.runtime import device
from numbactr.runtime.hostmem import check_fits, host_zeros
from numbactr.kernels import embedding_init
from numbactr.kernels import tbe_row_ops


def _zeros(n: int, dtype, huge: bool = True):
    """A zeroed buffer for the tables, their states and the step's scratch: device memory on a GPU; on the
    host numbactr.runtime.hostmem.host_zeros (2 MiB-aligned transparent huge pages for big buffers, which
    random row access reads faster; NUMBACTR_HUGE_PAGES=0 declines them)."""
    xp = device.xp()
    if xp is not np or n == 0:
        return xp.zeros(n, dtype)
    return host_zeros(n, dtype, huge)


FILL_CHUNK_ELEMS = 1 << 22  # values per chunk of fill_uniform_rows: its temporaries stay near 200 MB


def fill_uniform_rows(
    view, first_lin: int, seed: int, lo: float, hi: float, row_scale=None, what: str = "an embedding table"
) -> None:
    """view (V, D) = U(lo, hi) from the hash of (seed, first_lin + row, d) (kernels.embedding_init), times
    row_scale[row] ((V,) float32) where given: the same values on every device. It runs in chunks of rows,
    because the hash's NumPy reference holds several 8-byte temporaries per value (a whole table at once
    needed 6x the table's size), and first checks that the host memory it will touch is there (a table
    initialized past the machine's memory is otherwise killed by the kernel without a word)."""
    V, D = view.shape
    xp = np if device.is_host_array(view) else device.xp()  # (a tiered table's rows are host memory)
    if xp is np:
        check_fits(
            V * D * view.dtype.itemsize,
            f"initializing {what} ({V} rows x {D})",
            "shrink the table (slot_size_array, max_vocabulary_size) or keep it in a tiered store "
            "(numbactr.embedding.tiered)",
        )
    step = max(1, FILL_CHUNK_ELEMS // max(D, 1))
    for a in range(0, V, step):
        b = min(V, a + step)
        vals = embedding_init.row_values_ref(np.arange(first_lin + a, first_lin + b, dtype=np.uint64), D, seed, lo, hi)
        if row_scale is not None:
            vals *= row_scale[a:b, None]
        view[a:b] = xp.asarray(vals.astype(view.dtype, copy=False))


def lerp_halves_of(views, coef: float) -> None:
    """TableBatchedEmbedding.lerp_halves on host (V, D) arrays that are no engine's buffer (a tiered table's
    backing tier, numbactr.embedding.tiered): each row's second half moves coef of the way to its first."""
    for view in views:
        tbe_row_ops.lerp_rows_ref(view, coef)
