"""numba.cuda kernels with their NumPy references, one module per op.

Installed as ``numbactr.kernels``. Imports nothing from numbactr: each module holds the formula in its
docstring, ``<op>_forward_ref`` / ``<op>_backward_ref`` (NumPy), the ``@cuda.jit`` kernels (grid-stride
loops), launch wrappers, and ``PTX_CHECKS`` (kernel, signature) pairs that tests/test_ptx.py compiles
for a real GPU architecture.
"""

from ._simulator_fix import apply as _apply_simulator_fix

_apply_simulator_fix()   # Numba's simulator: cuda.shared.array under a lock (see _simulator_fix.py)
