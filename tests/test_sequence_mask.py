import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numbactr.kernels import sequence_mask as sqm
from tests.kernel_util import dev, f32_arrays, host


def _mask(lf_len, lt_len, lf, lt):
    y = dev(np.full((lf_len.shape[0], 1, lf, lt), np.nan, np.float32))
    sqm.sequence_mask(dev(lf_len), dev(lt_len), y)
    return host(y)


@given(b=st.integers(1, 4), lf=st.integers(1, 6), lt=st.integers(1, 6), data=st.data())
def test_kernel_matches_ref(b, lf, lt, data):
    len_from = data.draw(f32_arrays((b, 1), lo=-1.0, hi=lf + 1.5))  # fractional and negative too
    len_to = data.draw(f32_arrays((b, 1), lo=-1.0, hi=lt + 1.5))
    np.testing.assert_array_equal(_mask(len_from, len_to, lf, lt), sqm.sequence_mask_ref(len_from, len_to, lf, lt))


def test_lengths_are_truncated_like_an_int_cast():
    y = _mask(np.array([[2.9], [0.0]], np.float32), np.array([[1.0], [3.0]], np.float32), 3, 2)
    np.testing.assert_array_equal(y[0, 0], [[1, 0], [1, 0], [0, 0]])
    np.testing.assert_array_equal(y[1, 0], np.zeros((3, 2)))


def test_empty_batch_is_a_no_op():
    z = np.zeros((0, 1), np.float32)
    sqm.sequence_mask(dev(z), dev(z), dev(np.zeros((0, 1, 2, 2), np.float32)))


@pytest.mark.gpu
@given(b=st.integers(1, 300), data=st.data())
def test_sequence_mask_on_gpu(b, data):
    len_from = data.draw(f32_arrays((b, 1), lo=0.0, hi=40.0))
    len_to = data.draw(f32_arrays((b, 1), lo=0.0, hi=40.0))
    np.testing.assert_array_equal(_mask(len_from, len_to, 32, 37), sqm.sequence_mask_ref(len_from, len_to, 32, 37))
