"""HSTU's relative attention bias (position + log-time buckets): the reference against the original's
pad / repeat / reshape construction and hand-worked buckets, its backward against central differences, and
the kernels against the reference."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numbactr.kernels import hstu_rab as hr
from tests.gradcheck import assert_grad_close
from tests.kernel_util import dev, host


def _original_position_bias(pos_w, n):
    """The research module's position part, transcribed: pad pos_w by n zeros, repeat n times, drop the
    last n, view as (1, n, 3n - 2) and keep the columns r .. -r, r = (2n - 1) // 2."""
    t = np.tile(np.concatenate([pos_w[: 2 * n - 1], np.zeros(n)]), n)[:-n].reshape(1, n, 3 * n - 2)
    r = (2 * n - 1) // 2
    return t[:, :, r:-r] if r else t


def test_buckets_by_hand():
    # ln(|dt|) / 0.301, floored, clamped: 1 s and below -> 0; 2 s -> 2 (ln 2 = 0.693); 60 s -> 13; 1 day -> 37
    got = hr.time_bucket_ref([0, 1, -1, 2, 60, 86400, 10**12], 40)
    np.testing.assert_array_equal(got, [0, 0, 0, 2, 13, 37, 40])


@pytest.mark.parametrize("n", [1, 2, 5])
def test_position_part_is_the_original_construction(n):
    rng = np.random.default_rng(n)
    pos_w = rng.normal(size=2 * n - 1)
    ts = np.zeros((1, n), np.int64)  # all buckets 0: ts_w[0] only
    rab = hr.rab_forward_ref(ts, pos_w, np.array([0.0, 5.0]))
    np.testing.assert_allclose(rab, _original_position_bias(pos_w, n))


def test_time_part_compares_the_next_item():
    ts = np.array([[100, 102, 160, 160]], np.int64)
    rab = hr.rab_forward_ref(ts, np.zeros(7), np.arange(50.0))
    # row i uses ts[i + 1] (the last row ts[3]): row 0 vs j = 0: dt 2 -> bucket 2; row 1 vs j = 0: 60 -> 13;
    # row 2 vs j = 1: 58 -> 13 (ln 58 / 0.301 = 13.5); row 2 vs j = 2: 0 (the next item has the same time)
    np.testing.assert_array_equal(
        [rab[0, 0, 0], rab[0, 1, 0], rab[0, 2, 1], rab[0, 2, 2], rab[0, 3, 3]], [2, 13, 13, 0, 0]
    )


def test_backward_matches_central_differences():
    rng = np.random.default_rng(0)
    ts = np.cumsum(rng.integers(0, 500, (2, 4)), axis=1)
    pos_w, ts_w = rng.normal(size=7), rng.normal(size=9)
    drab = rng.normal(size=(2, 4, 4))
    dpos, dts = hr.rab_backward_ref(ts, drab, pos_w, ts_w)
    assert_grad_close(dpos, lambda z: hr.rab_forward_ref(ts, z, ts_w), pos_w, drab)
    assert_grad_close(dts, lambda z: hr.rab_forward_ref(ts, pos_w, z), ts_w, drab)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"pos_w must be \(2N - 1,\)"):
        hr.rab_forward_ref(np.zeros((1, 3), np.int64), np.zeros(4), np.zeros(3))
    with pytest.raises(ValueError, match="timestamps must be"):
        hr.rab_forward_ref(np.zeros((1, 3)), np.zeros(5), np.zeros(3))


@settings(max_examples=10)
@given(b=st.integers(1, 2), n=st.integers(1, 5), nb=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_kernels_match_reference(b, n, nb, seed):
    rng = np.random.default_rng(seed)
    ts = np.cumsum(rng.integers(0, 3000, (b, n)), axis=1).astype(np.int64)
    pos_w = rng.normal(size=2 * n - 1).astype(np.float32)
    ts_w = rng.normal(size=nb + 1).astype(np.float32)
    rab = dev(np.full((b, n, n), np.nan, np.float32))
    hr.rab_forward(dev(ts), dev(pos_w), dev(ts_w), rab, threads=16)
    np.testing.assert_allclose(host(rab), hr.rab_forward_ref(ts, pos_w, ts_w), rtol=1e-6)
    drab = rng.normal(size=(b, n, n)).astype(np.float32)
    dpos, dts = dev(np.zeros_like(pos_w)), dev(np.zeros_like(ts_w))
    hr.rab_backward(dev(ts), dev(drab), dpos, dts, threads=16)
    want = hr.rab_backward_ref(ts, drab.astype(np.float64), pos_w, ts_w)
    np.testing.assert_allclose(host(dpos), want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(host(dts), want[1], rtol=1e-5, atol=1e-6)
