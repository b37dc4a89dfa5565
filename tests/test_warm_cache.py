"""numbactr.tools.warm_cache compiles the cpu device's engine, hash table and interaction signatures."""
from numbactr import device
from numbactr.kernels import hash_table_cpu, interaction, tbe_cpu
from numbactr.tools import warm_cache


def test_warm_cache_compiles_the_engine_in_both_weight_types():
    before = device.kind()
    assert warm_cache.main(["--quiet"]) == 0
    assert device.kind() == before                      # the device is restored
    weight_types = {str(sig[0].dtype) for sig in tbe_cpu.forward.signatures}
    assert {"float32", "uint16"} <= weight_types         # FP32 and FP16 (stored as uint16 bits) tables
    assert {str(sig[0].dtype) for sig in tbe_cpu.fused_update.signatures} >= {"float32", "uint16"}
    # int32 indices are checked into int64 rows; a clean int64 batch is only counted (it is its own rows)
    assert "int32" in {str(sig[0].dtype) for sig in tbe_cpu.check_indices.signatures}
    assert "int64" in {str(sig[0].dtype) for sig in tbe_cpu.count_bad_indices.signatures}
    assert hash_table_cpu.hash_find_cpu.signatures and hash_table_cpu.hash_insert_cpu.signatures
    assert hash_table_cpu.serve_cached_cpu.signatures
    assert interaction._forward_cpu.signatures and interaction._backward_cpu.signatures
    # both twins of a parallel function: one-thread runs call the serial one (kernels.parallel_cpu.pjit)
    import numba
    assert tbe_cpu.forward.serial.signatures
    if numba.config.NUMBA_NUM_THREADS > 1:
        assert tbe_cpu.forward.parallel.signatures
