import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from numbactr.kernels import embedding_init as ei
from tests.kernel_util import dev, host


@given(
    keys=hnp.arrays(np.uint64, st.integers(1, 40), elements=st.integers(0, 2**64 - 2)),
    width=st.integers(1, 6),
    first_new=st.integers(0, 30),
    seed=st.integers(0, 2**32),
)
def test_kernel_matches_reference(keys, width, first_new, seed):
    rows = np.arange(keys.size, dtype=np.int64)
    pool = np.full((keys.size, width), 7.0, np.float32)
    want = ei.init_new_rows_ref(pool, rows, keys, first_new, seed, -0.05, 0.05)
    got = dev(pool)
    ei.init_new_rows(got, dev(rows), dev(keys), first_new, seed, -0.05, 0.05)
    np.testing.assert_allclose(host(got), want, rtol=1e-6, atol=1e-8)
    assert (host(got)[:first_new] == 7.0).all()  # old rows untouched


@given(
    keys=hnp.arrays(np.uint64, st.integers(1, 30), elements=st.integers(0, 2**64 - 2)),
    dim=st.integers(1, 6),
    pad=st.integers(0, 3),
    base=st.integers(0, 5),
    seed=st.integers(0, 2**32),
    data=st.data(),
)
def test_flagged_kernel_matches_reference_on_a_padded_flat_table(keys, dim, pad, base, seed, data):
    """init_flagged_rows (the deferred insert's new rows): each flagged occurrence with a row gets
    row_values_ref of its key in the first `dim` elements of that row; padding, unflagged rows, rows -1 and
    the elements before the table are untouched."""
    n = keys.size
    rows = np.array(data.draw(st.lists(st.integers(-1, n - 1), min_size=n, max_size=n)), np.int64)
    flags = np.array(data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)), np.int64)
    rows[flags == 1] = np.arange(n)[flags == 1] % n  # a flagged row is written by its occurrence only
    rows[(flags == 1) & (np.arange(n) % 5 == 4)] = -1  # ... or is -1 (a rolled-back key)
    stride = dim + pad
    w = np.full(base + n * stride, 7.0, np.float32)
    want = w.copy()
    for k in np.flatnonzero((flags == 1) & (rows >= 0)):
        r = rows[k]
        want[base + r * stride : base + r * stride + dim] = ei.row_values_ref(keys[k : k + 1], dim, seed, -0.05, 0.05)[
            0
        ]
    got = dev(w)
    ei.init_flagged_rows(got, base, stride, dim, dev(rows), dev(keys), dev(flags), seed, -0.05, 0.05)
    np.testing.assert_allclose(host(got), want, rtol=1e-6, atol=1e-8)


def test_values_depend_only_on_seed_key_and_d_and_look_uniform():
    keys = np.arange(200_000, dtype=np.uint64)
    v = ei.row_values_ref(keys, 4, seed=3, lo=-0.05, hi=0.05)
    assert v.min() >= -0.05 and v.max() < 0.05
    assert abs(v.mean()) < 1e-3 and abs(v.std() - 0.1 / np.sqrt(12)) < 1e-3
    np.testing.assert_array_equal(ei.row_values_ref(keys[::-1], 4, 3, -0.05, 0.05), v[::-1])
    assert not np.array_equal(ei.row_values_ref(keys[:10], 4, 4, -0.05, 0.05), v[:10])  # seed matters
    assert abs(np.corrcoef(v[:, 0], v[:, 1])[0, 1]) < 0.01
