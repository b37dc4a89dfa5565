"""Hypothesis property tests of the engine's kernels against their references in the simulator: random
tables, features, ragged and empty bags, duplicate rows within and across features, -1 rows, per-sample
weights, every pooling, layout, precision and optimizer; and the multi-block scans the segment step uses."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from numbactr.runtime import device
from numbactr.kernels import scan
from tests.engine_cases import assert_same_training, cases, run
from tests.kernel_util import dev, host

pytestmark = pytest.mark.skipif(not device.uses_kernels(), reason="needs the sim or gpu device")


@settings(max_examples=12)
@given(case=cases())
def test_random_engine_configurations_match_reference(case):
    assert_same_training(case, run(case, "ref"), run(case, "kernels"))


@given(
    x=hnp.arrays(np.int64, st.integers(0, 200), elements=st.integers(-(10**6), 10**6)), tpb=st.sampled_from([1, 2, 8])
)
def test_multiblock_scans_match_references(x, tpb):
    partials = dev(np.full(scan.scan_partials_size(x.shape[0] + 1, tpb), -99, np.int64))
    out = dev(np.full(x.shape[0] + 1, -7, np.int64))
    scan.exclusive_scan(dev(x), out, threads=tpb, partials=partials)
    np.testing.assert_array_equal(host(out), scan.exclusive_scan_ref(x))
    if x.shape[0]:
        inplace = dev(x)
        scan.inclusive_max_scan(inplace, inplace, partials, threads=tpb)
        np.testing.assert_array_equal(host(inplace), scan.inclusive_max_ref(x))
