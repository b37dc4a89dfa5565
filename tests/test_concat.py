import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numbactr.kernels import concat
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, f32_arrays, host


@st.composite
def pieces(draw, ndim=2, axis=1):
    """1..4 float32 arrays that agree on every dim but `axis`; sizes on `axis` may be 0."""
    shape = list(draw(st.tuples(*[st.integers(0 if d == 0 else 1, 4) for d in range(ndim)])))
    count = draw(st.integers(1, 4))
    xs = []
    for _ in range(count):
        shape[axis] = draw(st.integers(0, 5))
        xs.append(draw(f32_arrays(tuple(shape))))
    return xs


def _run_both_ways(xs, axis):
    ref = concat.concat_forward_ref(xs, axis)
    out = dev(np.full(ref.shape, np.nan, np.float32))
    concat.concat_forward([dev(x) for x in xs], out, axis)
    np.testing.assert_array_equal(host(out), ref)

    dy = (np.arange(ref.size, dtype=np.float32) - 7).reshape(ref.shape)
    dxs = [dev(np.full(x.shape, np.nan, np.float32)) for x in xs]
    concat.concat_backward(dev(dy), dxs, axis)
    for got, want in zip(dxs, concat.concat_backward_ref(dy, [x.shape[axis] for x in xs], axis)):
        np.testing.assert_array_equal(host(got), want)


@given(xs=pieces(ndim=2, axis=1))
def test_concat_2d_matches_ref(xs):
    _run_both_ways(xs, 1)


@given(xs=pieces(ndim=3, axis=1))
def test_concat_3d_axis1_matches_ref(xs):
    _run_both_ways(xs, 1)


@given(xs=pieces(ndim=3, axis=2))
def test_concat_3d_axis2_matches_ref(xs):
    _run_both_ways(xs, 2)


@given(x=f32_arrays((5, 7)), blocks=st.integers(1, 3), tpb=st.sampled_from([1, 3, 32]), c0=st.integers(0, 4))
def test_copy_kernels_any_grid(x, blocks, tpb, c0):
    out = np.full((5, 11), np.nan, np.float32)
    want = out.copy()
    want[:, c0 : c0 + 7] = x
    d_out = dev(out)
    concat.concat_copy_in_kernel[blocks, tpb](dev(x), d_out, c0)
    np.testing.assert_array_equal(host(d_out), want)
    back = dev(np.zeros((5, 7), np.float32))
    concat.concat_copy_out_kernel[blocks, tpb](d_out, back, c0)
    np.testing.assert_array_equal(host(back), x)


def test_concat_rejects_mismatched_shapes():
    a, b = np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError):
        concat.concat_forward([a, b], np.zeros((2, 8), np.float32))  # wrong total width
    with pytest.raises(ValueError):
        concat.concat_forward([a, np.zeros((3, 4), np.float32)], np.zeros((2, 7), np.float32))
    with pytest.raises(ValueError):
        concat.concat_backward(np.zeros((2, 7), np.float32), [a, b], axis=0)


def test_concat_reference_gradient():
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(3, k, 2)) for k in (2, 1, 3)]
    dy = rng.normal(size=(3, 6, 2))
    grads = concat.concat_backward_ref(dy, [2, 1, 3], axis=1)
    for i in range(len(xs)):

        def f(xi, i=i):
            return concat.concat_forward_ref(xs[:i] + [xi] + xs[i + 1 :], axis=1)

        assert_grad_close(grads[i], f, xs[i], dy)


@pytest.mark.gpu
@given(
    b=st.integers(0, 4096), widths=st.lists(st.integers(0, 600), min_size=1, max_size=5), seed=st.integers(0, 2**32 - 1)
)
def test_concat_on_gpu(b, widths, seed):
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(b, k)).astype(np.float32) for k in widths]
    _run_both_ways(xs, 1)
