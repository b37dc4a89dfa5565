"""kernels/dropout.py: the hash mask is bit-identical in kernel and reference, has the right keep
rate, changes with seed/step/layer, and the backward applies the same mask."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from numbactr.kernels import dropout
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host

SHAPES = hnp.array_shapes(min_dims=1, max_dims=3, max_side=12)
RATES = st.floats(0.05, 0.95)
U64 = st.integers(0, 2**64 - 1)


@given(x=f32_arrays(SHAPES), rate=RATES, seed=U64, step=st.integers(0, 2**40), layer=st.integers(0, 2**32))
def test_dropout_kernel_is_bit_identical_to_ref(x, rate, seed, step, layer):
    y = dev(np.full_like(x, np.nan))
    dropout.dropout_apply(dev(x), y, rate, seed, step, layer)
    np.testing.assert_array_equal(host(y), dropout.dropout_forward_ref(x, rate, seed, step, layer))


def test_keep_rate_and_scaling():
    for rate in (0.1, 0.5, 0.9):
        keep = dropout.dropout_mask_ref(200_000, rate, seed=7, step=3, layer_id=11)
        assert abs(keep.mean() - (1 - rate)) < 4e-3, (rate, keep.mean())
    x = np.ones(1000, np.float32)
    y = dropout.dropout_forward_ref(x, 0.2, 1, 2, 3)
    assert set(np.unique(y)) <= {0.0, np.float32(1 / 0.8)}
    y_dev = dev(np.zeros_like(x))
    dropout.dropout_apply(dev(x), y_dev, 0.2, 1, 2, 3)
    np.testing.assert_array_equal(host(y_dev), y)


def test_mask_depends_on_every_key_word_and_looks_independent():
    n = 4096
    base = dropout.dropout_mask_ref(n, 0.5, 1, 2, 3)
    for other in (
        dropout.dropout_mask_ref(n, 0.5, 2, 2, 3),
        dropout.dropout_mask_ref(n, 0.5, 1, 3, 3),
        dropout.dropout_mask_ref(n, 0.5, 1, 2, 4),
    ):
        agree = (other == base).mean()
        assert 0.45 < agree < 0.55, agree  # unrelated masks agree about half the time
    np.testing.assert_array_equal(dropout.dropout_mask_ref(n, 0.5, 1, 2, 3), base)  # deterministic
    # neighbouring elements are not correlated
    assert abs(np.corrcoef(base[:-1], base[1:])[0, 1]) < 0.06


def test_backward_uses_the_forward_mask():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 7)).astype(np.float32)
    dy = rng.normal(size=(6, 7)).astype(np.float32)
    y = dropout.dropout_forward_ref(x, 0.3, 5, 6, 7)
    dx = dev(np.zeros_like(dy))
    dropout.dropout_apply(dev(dy), dx, 0.3, 5, 6, 7)
    np.testing.assert_array_equal(host(dx) == 0, y == 0)
    np.testing.assert_array_equal(host(dx), dropout.dropout_backward_ref(dy, 0.3, 5, 6, 7))


def test_rate_outside_open_interval_is_rejected():
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match=r"in \(0, 1\)"):
            dropout.dropout_threshold(bad)


def test_empty_input_is_a_no_op():
    e = np.zeros((0, 4), np.float32)
    dropout.dropout_apply(e, e, 0.5, 0, 0, 0)


def test_dropout_reference_gradient():
    rng = np.random.default_rng(2)
    x, dy = rng.normal(size=(4, 5)), rng.normal(size=(4, 5))
    assert_grad_close(
        dropout.dropout_backward_ref(dy, 0.4, 9, 1, 2), lambda v: dropout.dropout_forward_ref(v, 0.4, 9, 1, 2), x, dy
    )


@pytest.mark.gpu
@given(rate=RATES, seed=U64, step=st.integers(0, 10**6))
def test_dropout_on_gpu_matches_ref(rate, seed, step):
    x = np.random.default_rng(step).normal(size=(2048, 129)).astype(np.float32)
    y = dev(np.zeros_like(x))
    dropout.dropout_apply(dev(x), y, rate, seed, step, 12345)
    np.testing.assert_array_equal(host(y), dropout.dropout_forward_ref(x, rate, seed, step, 12345))
