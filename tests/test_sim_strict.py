"""numbactr.runtime.sim_strict: on the simulator, device arrays that record the implicit host reads a GPU would pay for
(each a synchronization on a CuPy array), which tests/test_step_counts.py counts in every step; here, that
the detector sees what it must and nothing else."""

import numpy as np
import pytest

from numbactr.runtime import device, sim_strict
from numbactr.embedding.engine import BoundsCheck, Optim, OptimizerSpec, Pooling, TableBatchedEmbedding

pytestmark = pytest.mark.skipif(not device._numba_simulated(), reason="needs the simulator")


def test_implicit_reads_are_recorded_with_their_place(on_device):
    on_device("sim")
    sim_strict.reads()
    with sim_strict.strict():
        xp = device.xp()
        a = xp.arange(5, dtype=np.int64)
        assert isinstance(a, sim_strict.DeviceArray) and not device.is_host_array(a)
        assert isinstance((a * 2)[1:], sim_strict.DeviceArray)  # kept through ufuncs and slices
        assert isinstance(a.sum(), sim_strict.DeviceArray)  # a reduction: a 0-d device array
        assert sim_strict.reads() == []
        bool((a > 3).any())
        int(a[-1])  # one element: a 0-d device array
        float(a.max())
        a.tolist()
        a[0].item()
        list(a)
        [1, 2][a[0]]
        got = sim_strict.reads()
        assert [w for w, _ in got] == ["bool", "int", "float", "tolist", "item"] + ["index"]
        assert {where for _, where in got} == {"?"}  # numbactr's own lines only: none here
        host = np.arange(3)
        assert device.is_host_array(host)
        bool(host.any())  # host arrays are free
        assert sim_strict.reads() == []
    int(a[-1])  # outside strict(): not recorded
    assert sim_strict.reads() == [] and device.xp() is np


def test_a_step_read_is_caught_and_kernels_are_not(on_device, monkeypatch):
    """The engine's lookup of uint64 indices once checked them with bool(...) on the device arrays (a GPU
    step's synchronization): strict() sees that and names the line; the lookup's own kernels (their element
    reads run in the simulator) record nothing."""
    on_device("sim")
    sim_strict.reads()
    with sim_strict.strict():
        xp = device.xp()
        e = TableBatchedEmbedding(
            [(5, 4), (3, 4)],
            [0, 1],
            bounds_check=BoundsCheck.FATAL,
            impl="kernels",
            optimizer=OptimizerSpec(Optim.EXACT_SGD, learning_rate=0.1),
            pooling=Pooling.SUM,
        )
        e.defer_checks = True
        idx = xp.asarray(np.array([1, 3, 4, 2, 0, 2], np.uint64))
        off = xp.asarray(np.array([0, 2, 3, 4, 6]))
        out, ctx = e.forward(idx, off)
        e.backward(ctx, xp.ones((2, 8), np.float32))
        assert sim_strict.reads() == []
        top = np.uint64(2**63 - 1)

        def checking(indices, on_device=False):  # the old conversion
            if bool((indices > top).any()):
                raise ValueError("too large")
            return indices.astype(np.int64)

        monkeypatch.setattr(TableBatchedEmbedding, "_as_int64", staticmethod(checking))
        e.forward(idx, off)
        got = sim_strict.reads()
        assert len(got) == 1 and got[0][0] == "bool" and got[0][1].startswith("numbactr.embedding.engine.core:")
