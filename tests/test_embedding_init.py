import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from numbactr.kernels import embedding_init as ei
from tests.kernel_util import dev, host


@given(keys=hnp.arrays(np.uint64, st.integers(1, 40), elements=st.integers(0, 2**64 - 2)),
       width=st.integers(1, 6), first_new=st.integers(0, 30), seed=st.integers(0, 2**32))
def test_kernel_matches_reference(keys, width, first_new, seed):
    rows = np.arange(keys.size, dtype=np.int64)
    pool = np.full((keys.size, width), 7.0, np.float32)
    want = ei.init_new_rows_ref(pool, rows, keys, first_new, seed, -0.05, 0.05)
    got = dev(pool)
    ei.init_new_rows(got, dev(rows), dev(keys), first_new, seed, -0.05, 0.05)
    np.testing.assert_allclose(host(got), want, rtol=1e-6, atol=1e-8)
    assert (host(got)[:first_new] == 7.0).all()                 # old rows untouched


def test_values_depend_only_on_seed_key_and_d_and_look_uniform():
    keys = np.arange(200_000, dtype=np.uint64)
    v = ei.row_values_ref(keys, 4, seed=3, lo=-0.05, hi=0.05)
    assert v.min() >= -0.05 and v.max() < 0.05
    assert abs(v.mean()) < 1e-3 and abs(v.std() - 0.1 / np.sqrt(12)) < 1e-3
    np.testing.assert_array_equal(ei.row_values_ref(keys[::-1], 4, 3, -0.05, 0.05), v[::-1])
    assert not np.array_equal(ei.row_values_ref(keys[:10], 4, 4, -0.05, 0.05), v[:10])   # seed matters
    assert abs(np.corrcoef(v[:, 0], v[:, 1])[0, 1]) < 0.01
