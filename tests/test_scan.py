import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from numbactr.kernels import scan
from tests.kernel_util import dev, host


def run_scan(x: np.ndarray, tpb: int, fill: int = -7) -> np.ndarray:
    out = dev(np.full(x.shape[0] + 1, fill, dtype=np.int64))  # garbage: every entry must be written
    scan.exclusive_scan(dev(x), out, threads=tpb)
    return host(out)


@given(
    x=hnp.arrays(np.int64, st.integers(0, 300), elements=st.integers(-(10**6), 10**6)), tpb=st.sampled_from([32, 64])
)
def test_scan_kernel_matches_ref(x, tpb):
    np.testing.assert_array_equal(run_scan(x, tpb), scan.exclusive_scan_ref(x))


@pytest.mark.parametrize("tpb", [1, 2, 32, 64, 128])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 63, 64, 65, 127, 128, 129, 257])
def test_scan_sizes_around_tile_edges(n, tpb):
    x = np.arange(1, n + 1, dtype=np.int64) * 3 - 5  # mixed signs, distinct values
    np.testing.assert_array_equal(run_scan(x, tpb), scan.exclusive_scan_ref(x))


def test_scan_reference_definition():
    x = np.array([3, 0, 2, 5], dtype=np.int64)
    np.testing.assert_array_equal(scan.exclusive_scan_ref(x), [0, 3, 3, 5, 10])
    np.testing.assert_array_equal(scan.exclusive_scan_ref(np.zeros(0, np.int64)), [0])


def test_scan_of_empty_input_writes_zero():
    assert run_scan(np.zeros(0, np.int64), 32).tolist() == [0]


def test_scan_large_values_do_not_lose_precision():
    # int64 sums above 2**53 must stay exact (a float path would round them)
    x = np.full(70, 2**56 + 1, dtype=np.int64)
    np.testing.assert_array_equal(run_scan(x, 32), scan.exclusive_scan_ref(x))


def test_scan_over_several_blocks():
    # with a partials scratch the scan runs reduce / scan totals / scan over several blocks
    x = np.arange(300, dtype=np.int64) - 150
    out = dev(np.full(301, -1, dtype=np.int64))
    scan.exclusive_scan(dev(x), out, threads=32, partials=dev(np.zeros(scan.scan_partials_size(300, 32), np.int64)))
    np.testing.assert_array_equal(host(out), scan.exclusive_scan_ref(x))


def test_scan_rejects_bad_arguments():
    x = np.zeros(5, np.int64)
    with pytest.raises(ValueError, match="n \\+ 1"):
        scan.exclusive_scan(x, np.zeros(5, np.int64))
    with pytest.raises(TypeError, match="int64"):
        scan.exclusive_scan(x.astype(np.int32), np.zeros(6, np.int64))
    with pytest.raises(ValueError, match="power of two"):
        scan.make_scan_kernel(48, scan.SUM, False)
    with pytest.raises(ValueError, match="power of two"):
        scan.make_scan_kernel(2048, scan.SUM, False)


@pytest.mark.gpu
@pytest.mark.parametrize("tpb", [256, 1024])
def test_scan_on_gpu_large(tpb):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, size=1_000_003).astype(np.int64)
    np.testing.assert_array_equal(run_scan(x, tpb), scan.exclusive_scan_ref(x))
