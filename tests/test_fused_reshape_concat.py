import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numbactr.kernels import fused_reshape_concat as frc
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host


@st.composite
def inputs(draw, min_slots=2, max_side=4):
    b = draw(st.integers(1, max_side))
    s = draw(st.integers(min_slots, max_side))
    widths = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    return [draw(f32_arrays((b, s, w))) for w in widths]


@given(xs=inputs())
def test_fused_reshape_concat_kernels_match_ref(xs):
    item_ref, ad_ref = frc.fused_reshape_concat_forward_ref(xs)
    item, ad = dev(np.full(item_ref.shape, np.nan, np.float32)), dev(np.full(ad_ref.shape, np.nan, np.float32))
    frc.fused_reshape_concat_forward([dev(x) for x in xs], item, ad)
    np.testing.assert_array_equal(host(item), item_ref)
    np.testing.assert_array_equal(host(ad), ad_ref)
    rng = np.random.default_rng(0)
    d_item = rng.normal(size=item_ref.shape).astype(np.float32)
    d_ad = rng.normal(size=ad_ref.shape).astype(np.float32)
    dxs = [dev(np.full(x.shape, np.nan, np.float32)) for x in xs]
    frc.fused_reshape_concat_backward(dev(d_item), dev(d_ad), dxs)
    widths = [x.shape[2] for x in xs]
    for dx, ref in zip(dxs, frc.fused_reshape_concat_backward_ref(d_item, d_ad, widths, xs[0].shape[1])):
        np.testing.assert_array_equal(host(dx), ref)


@given(xs=inputs(min_slots=1))
def test_general_kernels_match_ref(xs):
    ref = frc.fused_reshape_concat_general_forward_ref(xs)
    out = dev(np.full(ref.shape, np.nan, np.float32))
    frc.fused_reshape_concat_general_forward([dev(x) for x in xs], out)
    np.testing.assert_array_equal(host(out), ref)
    dxs = [dev(np.full(x.shape, np.nan, np.float32)) for x in xs]
    frc.fused_reshape_concat_general_backward(dev(ref), dxs)  # backward of the forward = inputs
    for dx, x in zip(dxs, xs):
        np.testing.assert_array_equal(host(dx), x)


def test_last_slot_goes_to_ad_in_order():
    x = np.arange(2 * 3 * 1, dtype=np.float32).reshape(2, 3, 1)  # values = b*3 + s
    item, ad = dev(np.zeros((4, 1), np.float32)), dev(np.zeros((2, 1), np.float32))
    frc.fused_reshape_concat_forward([dev(x)], item, ad)
    np.testing.assert_array_equal(host(item).ravel(), [0, 1, 3, 4])
    np.testing.assert_array_equal(host(ad).ravel(), [2, 5])


def test_empty_batch_is_a_no_op():
    x = np.zeros((0, 3, 2), np.float32)
    frc.fused_reshape_concat_forward([dev(x)], dev(np.zeros((0, 2), np.float32)), dev(np.zeros((0, 2), np.float32)))


def test_reference_gradients():
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(2, 3, w)) for w in (2, 1)]
    d_item, d_ad = rng.normal(size=(4, 3)), rng.normal(size=(2, 3))
    dxs = frc.fused_reshape_concat_backward_ref(d_item, d_ad, [2, 1], 3)
    flat_dy = np.concatenate([d_item.ravel(), d_ad.ravel()])
    for i in range(2):

        def f(z, i=i):
            item, ad = frc.fused_reshape_concat_forward_ref([z if j == i else xs[j] for j in range(2)])
            return np.concatenate([item.ravel(), ad.ravel()])

        assert_grad_close(dxs[i], f, xs[i], flat_dy)
    d_out = rng.normal(size=(6, 3))
    gxs = frc.fused_reshape_concat_general_backward_ref(d_out, [2, 1], 3)
    for i in range(2):
        assert_grad_close(
            gxs[i],
            lambda z, i=i: frc.fused_reshape_concat_general_forward_ref([z if j == i else xs[j] for j in range(2)]),
            xs[i],
            d_out,
        )


@pytest.mark.gpu
@given(xs=inputs(max_side=60))
def test_fused_reshape_concat_on_gpu(xs):
    item_ref, ad_ref = frc.fused_reshape_concat_forward_ref(xs)
    item, ad = dev(np.zeros(item_ref.shape, np.float32)), dev(np.zeros(ad_ref.shape, np.float32))
    frc.fused_reshape_concat_forward([dev(x) for x in xs], item, ad)
    np.testing.assert_array_equal(host(item), item_ref)
    np.testing.assert_array_equal(host(ad), ad_ref)
