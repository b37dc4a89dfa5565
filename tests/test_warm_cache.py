"""numbactr.tools.warm_cache compiles the cpu device's engine, hash table, interaction and dense-op signatures."""

import numpy as np
import pytest

from numbactr.runtime import device
from numbactr.kernels import bce, bias, hash_table_cpu, interaction, layer_norm, optimizers_cpu, relu, softmax, tbe_cpu
from numbactr.tools import warm_cache


def test_warm_cache_compiles_the_engine_in_both_weight_types():
    """One thread, as the suite runs (the session's background warm-up compiled the same, so this loads them;
    the parallel twins' compile, ~2 min on a fresh clone, is left to the test below, on a cheap step)."""
    before = device.kind()
    assert warm_cache.main(["--quiet", "--threads", "1"]) == 0
    assert device.kind() == before  # the device is restored
    weight_types = {str(sig[0].dtype) for sig in tbe_cpu.forward.signatures}
    assert {"float32", "uint16"} <= weight_types  # FP32 and FP16 (stored as uint16 bits) tables
    assert {str(sig[0].dtype) for sig in tbe_cpu.fused_update.signatures} >= {"float32", "uint16"}
    # int32 indices are checked into int64 rows; a clean int64 batch is only counted (it is its own rows)
    assert "int32" in {str(sig[0].dtype) for sig in tbe_cpu.check_indices.signatures}
    assert "int64" in {str(sig[0].dtype) for sig in tbe_cpu.count_bad_indices.signatures}
    assert hash_table_cpu.hash_find_cpu.signatures and hash_table_cpu.hash_insert_cpu.signatures
    for fn in (hash_table_cpu.direct_rows, hash_table_cpu.direct_note, hash_table_cpu.direct_find_cpu):
        assert fn.signatures, fn.__name__  # the direct index of small keys
    assert hash_table_cpu.serve_cached_cpu.signatures
    assert interaction._forward_cpu.signatures and interaction._backward_cpu.signatures
    # one-thread runs call the serial twin of a parallel function (kernels.parallel_cpu.pjit)
    assert tbe_cpu.forward.serial.signatures
    # the demo DLRM's training steps: its dense ops' compiled CPU code
    for fn in (
        relu._relu_forward_cpu,
        relu._relu_backward_cpu,
        bias._bias_add_cpu,
        bias._bias_grad_cpu,
        bce._bce_cpu,
        optimizers_cpu._dense_update,
        layer_norm._layer_norm_forward_cpu,  # attention models' LayerNorm and softmax rows
        layer_norm._layer_norm_backward_cpu,
        softmax._shift_cpu,
        softmax._masked_shift_cpu,
        softmax._normalize_cpu,
        softmax._backward_cpu,
    ):
        assert fn.signatures, fn.__name__


def test_warm_cache_runs_each_step_for_one_thread_and_numbas_count(monkeypatch):
    """By default every step runs at 1 thread (the serial twins) and at numba's thread count (the parallel
    ones), --threads picks the counts, a count numba cannot run is refused, and the thread count is
    restored. The steps are replaced by one that compiles a small twin and records what it ran with."""
    import numba

    from numbactr.kernels.parallel_cpu import pjit

    @pjit(cache=False)
    def double(x, out):
        for i in numba.prange(x.shape[0]):
            out[i] = 2 * x[i]

    ran = []

    def step():
        x = np.arange(4, dtype=np.float32)
        out = np.empty_like(x)
        double(x, out)
        assert (out == 2 * x).all()
        ran.append((numba.get_num_threads(), len(double.serial.signatures), len(double.parallel.signatures)))

    monkeypatch.setattr(warm_cache, "STEPS", (("double", step),))
    before = numba.get_num_threads()
    most = numba.config.NUMBA_NUM_THREADS
    assert warm_cache.main(["--quiet"]) == 0
    assert [n for n, _, _ in ran] == sorted({1, most})
    assert ran[0][1:] == (1, 0)  # one thread: the serial twin compiled
    if most > 1:
        assert ran[-1][2] == 1  # then the parallel twin
    assert numba.get_num_threads() == before
    ran.clear()
    assert warm_cache.main(["--quiet", "--threads", "1", "--threads", "1"]) == 0
    assert [n for n, _, _ in ran] == [1]
    with pytest.raises(SystemExit):
        warm_cache.main(["--quiet", "--threads", str(most + 1)])
