"""The mixed-precision gate's one-thread kernels against the host values they stand in for
(kernels.optimizers.adam_gate_kernel: step_values("adam"); kernels.tbe.gate_scalars_kernel: kernel_scalars
and kernel_ints), for the device's t = the host's t less the skips the host has not read."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import config

from numbactr.kernels import optimizers as OPT
from numbactr.kernels import tbe as K
from numbactr.kernels import tbe_math as M

pytestmark = pytest.mark.skipif(not config.ENABLE_CUDASIM, reason="runs the kernels on the simulator")

HP = dict(
    learning_rate=0.0, eps=1e-8, beta1=0.9, beta2=0.999, weight_decay=0.0, momentum=0.0, max_norm=0.0, scaler=1024.0
)


@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(1, 10**6),
    unread=st.integers(0, 64),
    seen=st.integers(0, 10**4),
    go=st.booleans(),
    lr=st.floats(1e-5, 1.0),
    b1=st.sampled_from([0.9, 0.5, 1.0]),
    b2=st.sampled_from([0.999, 0.98]),
)
def test_gate_scalars_equal_the_host_values(t, unread, seen, go, lr, b1, b2):
    hp = dict(HP, learning_rate=lr, beta1=b1, beta2=b2)
    host_t = t + unread  # the host counted the unread skipped steps too
    ks = K.kernel_scalars(hp, host_t)
    ki = K.kernel_ints(int(M.Optim.HUGECTR_ADAM), 0, 0, host_t, False, 0, 0, 4)
    skips = np.array([seen + unread], np.int64)
    tv = np.array([host_t, seen], np.int64)
    fv = np.array([lr, b1, b2], np.float64)
    before = ks.copy(), ki.copy()
    K.gate_scalars(ks, ki, np.array([int(go)], np.int64), skips, tv, fv)
    if not go:  # only the gate: the kernels skip the step
        np.testing.assert_array_equal(ks, before[0])
        want = before[1].copy()
        want[M.KI_GO] = 0
        np.testing.assert_array_equal(ki, want)
        return
    np.testing.assert_array_equal(ks, K.kernel_scalars(hp, t))
    np.testing.assert_array_equal(ki, K.kernel_ints(int(M.Optim.HUGECTR_ADAM), 0, 0, t, False, 0, 0, 4))


@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(1, 10**6),
    unread=st.integers(0, 64),
    seen=st.integers(0, 10**4),
    go=st.booleans(),
    lr=st.floats(1e-5, 1.0),
)
def test_adam_gate_equals_the_host_values(t, unread, seen, go, lr):
    hp = OPT.step_values("adam", lr, 0.9, 0.999, t + unread)
    OPT.adam_gate(
        hp,
        np.array([int(go)], np.int64),
        np.array([seen + unread], np.int64),
        np.array([t + unread, seen], np.int64),
        np.array([lr, 0.9, 0.999], np.float64),
    )
    if go:
        np.testing.assert_array_equal(hp, OPT.step_values("adam", lr, 0.9, 0.999, t))
    else:
        assert hp[-1] == 0.0
