"""How the compiled CPU versions of the dense ops (numba.njit) split their work.

Shared by the compiled sections of kernels/interaction.py, relu.py, bias.py, fused_bias_act.py and by
kernels/optimizers_cpu.py:
  * work is cut into chunks of a fixed size (never by the thread count), and a reduction adds one partial
    per chunk in chunk order: 1 or N threads give the same bits;
  * an op smaller than PARALLEL_MIN elements runs its chunks in the calling thread: waking numba's workers
    costs more than the work (a 4096 x 128 bias add took 0.03 ms alone and 0.2 ms as a 2-thread region on
    the busy 2-core sandbox);
  * loops walk 0-based views (x[lo:hi], y[m]): an index that may be negative makes numba test it for
    wraparound on every access, which keeps LLVM from vectorizing (measured 3-9x slower);
  * every parallel function is a ``pjit`` twin: compiled with parallel=True and, beside it, without; a call
    from Python runs the serial twin when numba runs one thread. Even with one thread a prange loop is a
    parallel region, and under the workqueue layer (numbactr.runtime.threads picks it: its workers sleep) a region
    costs a worker's wake-up: 92 us per region on this sandbox (omp: 1 us), against 0.2 us for the same
    loop compiled serially; the engine's backward opens seven of them. Chunks do not depend on the thread
    count, so both twins give the same bits;
  * the serial twin sees its array arguments *borrowed* (``borrow``: the same array without its
    reference-count handle). Numba counts references of every array variable a loop body copies (an inlined
    helper's parameters are copies): an atomic add and subtract each, through a call, per array per
    iteration, which a parallel region's body never pays (its arrays arrive borrowed). The engine's fused
    update (106k one-hot rows, 1 thread): compiled serially 18.7 ms, of which NRT_incref / NRT_decref were
    half the samples; borrowed 6.3 ms. The arguments outlive the call, and a twin returns no array (checked
    when it compiles), so no borrowed array escapes.
"""
from __future__ import annotations

import functools
import inspect
import types

import numba
from numba import float32, njit
from numba import types as nt
from numba.core import cgutils, errors
from numba.extending import intrinsic, overload
from numba.np.ufunc import parallel as _numba_parallel

FLAT_CHUNK = 1 << 14      # elements per chunk of a flat elementwise op
ROW_CHUNK = 256           # rows per chunk of a row-wise op
PARALLEL_MIN = 1 << 20    # elements (or multiply-adds) below which an op runs in the calling thread


@njit(cache=True)
def sum_partials(part, out):
    """out (N,) = the rows of part (chunks, N) added in order."""
    for k in range(out.shape[0]):
        out[k] = float32(0.0)
    for c in range(part.shape[0]):
        p = part[c]
        for k in range(out.shape[0]):
            out[k] += p[k]


@intrinsic
def _borrow_array(typingctx, arr):
    """The array arr without its meminfo (numba's reference-count handle): reference counting it is a
    null test. Valid while the array it came from is alive."""
    if not isinstance(arr, nt.Array):
        return None

    def codegen(context, builder, signature, args):
        src = context.make_array(signature.args[0])(context, builder, args[0])
        out = context.make_array(signature.return_type)(context, builder)
        for field in ("parent", "nitems", "itemsize", "data", "shape", "strides"):
            setattr(out, field, getattr(src, field))
        out.meminfo = cgutils.get_null_value(out.meminfo.type)
        return out._getvalue()
    return arr(arr), codegen


def borrow(x):
    """x with its arrays borrowed (an array, or a tuple of arrays; anything else unchanged). Compiled
    code only (an overload)."""
    raise TypeError("borrow is for compiled code")


@overload(borrow, jit_options=dict(cache=True))
def _borrow(x):
    if isinstance(x, nt.Array):
        return lambda x: _borrow_array(x)
    if isinstance(x, nt.BaseTuple) and any(isinstance(t, nt.Array) for t in x.types):
        if not all(isinstance(t, nt.Array) for t in x.types) or len(x.types) > 4:
            raise errors.TypingError("borrow: a tuple of at most 4 arrays")
        return [lambda x: (_borrow_array(x[0]),),
                lambda x: (_borrow_array(x[0]), _borrow_array(x[1])),
                lambda x: (_borrow_array(x[0]), _borrow_array(x[1]), _borrow_array(x[2])),
                lambda x: (_borrow_array(x[0]), _borrow_array(x[1]), _borrow_array(x[2]),
                           _borrow_array(x[3]))][len(x.types) - 1]
    return lambda x: x


def _holds_array(ty) -> bool:
    if isinstance(ty, nt.Array):
        return True
    return isinstance(ty, nt.BaseTuple) and any(_holds_array(t) for t in ty.types)


def no_array(x):
    """x itself; refuses, when compiling, a value holding an array (a borrowed one must not escape)."""
    return x


@overload(no_array, jit_options=dict(cache=True))
def _no_array(x):
    if _holds_array(x):
        raise errors.TypingError("a parallel_cpu.pjit function must not return an array: its serial twin "
                                 "borrows its arguments")
    return lambda x: x


def _borrowing_twin(fn, opts: dict):
    """fn compiled serially (prange as range) as <name>_serial_body, called by <name>_serial, which passes
    it every argument borrowed. Both are copies of real functions of fn's module and file (Numba's disk
    cache keys them by name; its index does not tell the parallel flag apart)."""
    body = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial_body", fn.__defaults__,
                              fn.__closure__)
    body.__qualname__ = fn.__qualname__ + "_serial_body"
    body.__module__ = fn.__module__
    params = inspect.signature(fn).parameters
    plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    odd = [p for p in params.values() if p.kind not in plain]
    if odd:
        raise TypeError(f"parallel_cpu.pjit {fn.__qualname__}: only plain parameters, not {odd[0]}")
    name = fn.__name__ + "_serial"
    src = (f"def {name}({', '.join(params)}):\n"
           f"    return _no_array(_body({', '.join(f'_borrow({p})' for p in params)}))\n")
    space = {"__name__": fn.__module__, "_body": njit(**opts)(body), "_borrow": borrow, "_no_array": no_array}
    exec(compile(src, fn.__code__.co_filename, "exec"), space)
    caller = space[name]
    caller.__defaults__ = fn.__defaults__         # the parallel twin's defaults, so both take the same calls
    caller.__qualname__ = fn.__qualname__ + "_serial"
    caller.__module__, caller.__doc__ = fn.__module__, fn.__doc__
    return njit(**opts)(caller)


def _num_threads() -> int:
    """numba.get_num_threads() without its per-call lock once numba's threading layer is up: the same value
    (the calling thread's setting) for a tenth of the cost, which a one-sample inference request pays in
    every compiled op it calls."""
    if _numba_parallel._is_initialized:
        n = _numba_parallel._get_num_threads()
        if n > 0:
            return n
    return numba.get_num_threads()


class ParallelTwin:
    """A function compiled twice, ``parallel`` (njit(parallel=True)) and ``serial`` (njit, prange as range,
    its arguments borrowed: see the module's docstring), each compiled on first use; calling it from Python
    runs the serial twin when numba runs one thread in the calling thread (numba.get_num_threads()), else
    the parallel one. The serial twin is a copy of the function under the name <name>_serial, so the two
    keep separate entries in Numba's on-disk cache (its index does not tell the parallel flag apart)."""

    def __init__(self, fn, opts: dict):
        self.py_func = fn
        self.parallel = njit(parallel=True, **opts)(fn)
        self.serial = _borrowing_twin(fn, opts)
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        return (self.serial if _num_threads() == 1 else self.parallel)(*args)

    @property
    def signatures(self) -> list:
        """The signatures compiled so far, in either twin."""
        return list(self.serial.signatures) + list(self.parallel.signatures)


def pjit(**opts):
    """Decorator: a ParallelTwin of the function with njit options opts (cache=True, fastmath...; not
    parallel, which the twin sets)."""
    opts.pop("parallel", None)
    return lambda fn: ParallelTwin(fn, opts)


#: no kernels here (compiled CPU code only)
PTX_CHECKS = []
