"""numbactr.distributed.nccl on ONE GPU: the CuPy NCCL calls that the multi-GPU test (tests/test_gpu_select.py,
two GPUs or more) cannot reach on a one-GPU machine.

* gpu mark: a child process (so that MPI starts outside pytest's process) builds ``NcclComm`` over mpi4py's
  COMM_SELF (a one-rank stub without mpi4py) on the gpu device and runs ``allreduce_sum`` (float32, float16,
  float64, int32, int64: one rank's sum is the array itself), ``alltoallv`` to itself (send and receive to self
  in one NCCL group: uint64 keys with high bits set, float32 rows, a zero-row part), both on a non-default
  stream, and both captured into a CUDA graph and replayed after the inputs change. Each part reports on its
  own (one test per part, one child for all).
* cpu: the same NcclComm against a stand-in for ``cupy`` / ``cupy.cuda.nccl`` whose methods have CuPy's
  signatures (cupy_backends/cuda/libs/nccl.pyx: ``NcclCommunicator(ndev, commId, rank)``,
  ``allReduce(sendbuf, recvbuf, count, datatype, op, stream)``, ``send(sendbuf, count, datatype, peer, stream)``,
  ``recv(recvbuf, count, datatype, peer, stream)``, ``groupStart()`` / ``groupEnd()``) and that moves the bytes
  the calls describe: argument order, element counts and data types are checked here without a GPU.
"""

import ctypes
import json
import os
import subprocess
import sys
import traceback
import types

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PARTS = ("init", "allreduce", "alltoallv", "stream", "errors", "graph")
SKIP = 77  # the child's exit code when NCCL is not there to test


# -- on a GPU ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("nccl") / "parts.json"
    env = dict(os.environ, NUMBACTR_DEVICE="gpu", PYTHONPATH=ROOT)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env.setdefault("NCCL_DEBUG", "WARN")
    p = subprocess.run(
        [sys.executable, os.path.abspath(__file__), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    if p.returncode == SKIP:
        pytest.skip(p.stdout.strip().splitlines()[-1])
    parts = json.loads(out.read_text()) if out.exists() else {}  # written after each part: a crash keeps them
    tail = f"rc {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return {k: parts.get(k, f"not reached: the child ended (rc {p.returncode})") for k in PARTS}, tail


@pytest.mark.gpu
@pytest.mark.parametrize("part", PARTS)
def test_nccl_one_gpu(gpu_run, part):
    parts, tail = gpu_run
    assert parts.get(part) == "ok", f"{part}: {parts.get(part)}\n--- child output ---\n{tail}"


class _OneRank:
    """mpi4py's interface as NcclComm uses it, for one rank without MPI."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def bcast(self, obj, root=0):
        return obj


def _child(path: str) -> int:
    """The gpu test's child: every part in turn, each result ('ok' or its traceback) into the JSON at `path`."""
    import numbactr  # noqa: F401  (first, as every numbactr script)
    from numbactr.runtime import device
    from numbactr.distributed import nccl as N

    if not N.importable():
        print("skip: cupy.cuda.nccl does not import or finds no NCCL library", flush=True)
        return SKIP
    assert device.kind() == "gpu", device.describe()
    import cupy as cp
    from cupy.cuda import nccl

    try:
        from mpi4py import MPI

        mpi, how = MPI.COMM_SELF, "mpi4py COMM_SELF"
    except ImportError:
        mpi, how = _OneRank(), "one-rank stub (no mpi4py)"
    print(
        f"NCCL {nccl.get_version()} (built {nccl.get_build_version()}), CuPy {cp.__version__}, {how}, "
        f"{device.describe()}",
        flush=True,
    )
    results = {}
    state = {}

    def part(name):
        def run(fn):
            try:
                fn()
                results[name] = "ok"
            except BaseException:  # noqa: BLE001 (every part reports)
                results[name] = traceback.format_exc()[-3000:]
            print(f"part {name}: {'ok' if results[name] == 'ok' else 'FAILED'}", flush=True)
            _write(path, results)

        return run

    @part("init")
    def _init():
        nc = N.NcclComm(mpi)
        state["nc"] = nc
        assert (nc.rank, nc.size) == (0, 1)
        assert nc.device == cp.cuda.Device().id == device.gpu_index()
        assert (nc._c.rank_id(), nc._c.size(), nc._c.device_id()) == (0, 1, nc.device)

    nc = state.get("nc")
    if nc is None:
        for name in PARTS[1:]:
            results[name] = "skipped: NcclComm could not be built (see init)"
        return _write(path, results)
    rng = np.random.default_rng(7)

    @part("allreduce")
    def _allreduce():
        for dt in (np.float32, np.float16, np.float64, np.int32, np.int64):
            for shape in ((1001,), (37, 5), (1,), (0,)):
                host = (rng.standard_normal(shape) * 100).astype(dt)
                if dt == np.int64:
                    host = host * (1 << 40)  # beyond 32 bits: the count and type are right
                x = cp.asarray(host)
                assert nc.allreduce_sum(x) is x
                cp.cuda.get_current_stream().synchronize()
                np.testing.assert_array_equal(x.get(), host, err_msg=f"{dt} {shape}")

    @part("alltoallv")
    def _alltoallv():
        keys_h = (np.uint64(1) << np.uint64(63)) | rng.integers(0, 2**62, 4099, dtype=np.uint64)
        rows_h = rng.standard_normal((4099, 16)).astype(np.float32)
        for host in (
            keys_h,
            rows_h,
            rows_h[:0],
            keys_h[:0],
            rows_h.astype(np.float16),
            rng.integers(-128, 127, (33, 3), dtype=np.int8),
        ):
            got = nc.alltoallv([cp.asarray(host)], [host.shape[0]])
            assert len(got) == 1 and isinstance(got[0], cp.ndarray)
            assert got[0].shape == host.shape and got[0].dtype == host.dtype
            np.testing.assert_array_equal(got[0].get(), host)
        # a strided part is made contiguous before it travels
        got = nc.alltoallv([cp.asarray(rows_h)[::2]], [(4099 + 1) // 2])
        np.testing.assert_array_equal(got[0].get(), rows_h[::2])

    @part("stream")
    def _stream():
        s = cp.cuda.Stream(non_blocking=True)
        src = cp.asarray(rng.standard_normal(1 << 20).astype(np.float32))
        cp.cuda.get_current_stream().synchronize()
        with s:
            assert cp.cuda.get_current_stream().ptr == s.ptr == nc._stream()
            y = src * 2  # queued on s, before the NCCL calls on s
            nc.allreduce_sum(y)
            got = nc.alltoallv([y], [y.shape[0]])[0]
        s.synchronize()
        np.testing.assert_array_equal(got.get(), src.get() * 2)

    @part("errors")
    def _errors():
        for bad, kind, words in (
            (cp.zeros(4, dtype=cp.bool_), TypeError, "dtype bool"),
            (cp.zeros(4, dtype=cp.complex64), TypeError, "dtype complex64"),
            (cp.zeros((4, 4), dtype=cp.float32)[:, 1], ValueError, "C-contiguous"),
        ):
            try:
                nc.allreduce_sum(bad)
            except kind as e:
                assert words in str(e), e
            else:
                raise AssertionError(f"allreduce_sum accepted {bad.dtype} {bad.strides}")
        for parts, rows in (([cp.zeros(3)], [3, 0]), ([cp.zeros(3), cp.zeros(3)], [3])):
            try:
                nc.alltoallv(parts, rows)
            except ValueError as e:
                assert "for 1 ranks" in str(e), e
            else:
                raise AssertionError("alltoallv accepted the wrong number of parts")

    @part("graph")
    def _graph():
        """allreduce_sum and alltoallv captured on a non-blocking stream (relaxed capture mode, the graph's own
        memory pool, as numbactr.train.cuda_graphs.capture does) and replayed twice after the inputs change."""
        src = cp.arange(1 << 16, dtype=cp.float32)
        keys = cp.asarray((np.uint64(1) << np.uint64(63)) | np.arange(1000, dtype=np.uint64))
        rows = cp.asarray(rng.standard_normal((1000, 8)).astype(np.float32))
        (src * 2).sum()  # the kernels compiled and loaded before the capture
        cp.cuda.get_current_stream().synchronize()
        s = cp.cuda.Stream(non_blocking=True)
        pool = cp.cuda.MemoryPool()
        with cp.cuda.using_allocator(pool.malloc), s:
            s.begin_capture()
            try:
                y = src * 2
                nc.allreduce_sum(y)
                got_keys = nc.alltoallv([keys], [1000])[0]
                got_empty = nc.alltoallv([rows[:0]], [0])[0]  # no NCCL call: nothing captured
                got_rows = nc.alltoallv([rows], [1000])[0]
            finally:
                graph = s.end_capture()
        for step in range(2):
            src[...] = cp.arange(1 << 16, dtype=cp.float32) * (step + 3)
            keys += np.uint64(1)
            rows *= 2
            cp.cuda.get_current_stream().synchronize()
            graph.launch(stream=s)
            s.synchronize()
            np.testing.assert_array_equal(y.get(), src.get() * 2)
            np.testing.assert_array_equal(got_keys.get(), keys.get())
            np.testing.assert_array_equal(got_rows.get(), rows.get())
            assert got_empty.shape == (0, 8)

    nc.close()
    return _write(path, results)


def _write(path, results) -> int:
    with open(path, "w") as fh:
        json.dump(results, fh)
    return 0


# -- on cpu: CuPy's NCCL signatures, moved by a stand-in ---------------------------------------------------------
class _Ptr:
    def __init__(self, ptr):
        self.ptr = ptr


class _Arr(np.ndarray):
    """A host array with CuPy's ``.data.ptr``."""

    @property
    def data(self):
        return _Ptr(self.ctypes.data)


def _fake_cupy(calls):
    """(cupy, cupy.cuda.nccl) stand-ins: NCCL's enum values from cupy_backends/cuda/libs/nccl.pxd, the methods
    with CuPy's argument lists, p2p queued in a group and moved at groupEnd (as NCCL does)."""
    sizes = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8}
    nccl = types.SimpleNamespace(
        NCCL_SUM=0,
        NCCL_INT8=0,
        NCCL_UINT8=1,
        NCCL_INT32=2,
        NCCL_UINT32=3,
        NCCL_INT64=4,
        NCCL_UINT64=5,
        NCCL_FLOAT16=6,
        NCCL_FLOAT32=7,
        NCCL_FLOAT64=8,
        NCCL_BFLOAT16=9,
        available=True,
    )
    group = {"depth": 0, "sends": [], "recvs": []}

    def check(stream, datatype, count, *ptrs):
        assert isinstance(stream, int) and stream == 1234, stream
        assert datatype in sizes, datatype
        assert isinstance(count, int) and count > 0, count
        assert all(isinstance(p, int) and p > 0 for p in ptrs), ptrs

    class NcclCommunicator:
        def __init__(self, ndev, commId, rank):
            assert (ndev, rank) == (1, 0) and commId == b"uid" * 43, (ndev, commId, rank)
            calls.append(("init", ndev, rank))

        def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
            check(stream, datatype, count, sendbuf, recvbuf)
            assert op == nccl.NCCL_SUM
            calls.append(("allReduce", count, datatype))
            ctypes.memmove(recvbuf, sendbuf, count * sizes[datatype])  # one rank: the sum is the input

        def send(self, sendbuf, count, datatype, peer, stream):
            check(stream, datatype, count, sendbuf)
            assert group["depth"] == 1 and peer == 0, (group, peer)
            group["sends"].append((sendbuf, count, datatype))
            calls.append(("send", count, datatype, peer))

        def recv(self, recvbuf, count, datatype, peer, stream):
            check(stream, datatype, count, recvbuf)
            assert group["depth"] == 1 and peer == 0, (group, peer)
            group["recvs"].append((recvbuf, count, datatype))
            calls.append(("recv", count, datatype, peer))

        def destroy(self):
            calls.append(("destroy",))

    def groupStart():
        group["depth"] += 1

    def groupEnd():
        group["depth"] -= 1
        assert len(group["sends"]) == len(group["recvs"]), group
        for (s, n, t), (r, m, u) in zip(group["sends"], group["recvs"]):
            assert (n, t) == (m, u), "send and receive to self disagree on count or type"
            ctypes.memmove(r, s, n * sizes[t])
        group["sends"].clear()
        group["recvs"].clear()

    nccl.NcclCommunicator, nccl.groupStart, nccl.groupEnd = NcclCommunicator, groupStart, groupEnd
    nccl.get_unique_id = lambda: b"uid" * 43
    nccl.get_version = lambda: 22703
    cuda = types.SimpleNamespace(
        nccl=nccl,
        get_current_stream=lambda: types.SimpleNamespace(ptr=1234),
        Device=lambda *a: types.SimpleNamespace(id=0),
    )
    cupy = types.SimpleNamespace(
        cuda=cuda,
        ascontiguousarray=lambda a: np.ascontiguousarray(a).view(_Arr),
        empty=lambda shape, dtype: np.empty(shape, dtype).view(_Arr),
    )
    return cupy, nccl


@pytest.fixture
def fake_nccl(monkeypatch):
    calls = []
    cupy, nccl = _fake_cupy(calls)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cupy.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
    return calls


def test_nccl_calls_follow_cupys_signatures(fake_nccl):
    from numbactr.distributed import nccl as N

    assert N.importable()
    ids = []
    nc = N.NcclComm(_OneRank(), bcast=lambda obj, root: ids.append((obj, root)) or obj)
    assert ids == [(b"uid" * 43, 0)] and fake_nccl == [("init", 1, 0)]
    x = (np.arange(1001, dtype=np.int64) << 40).view(_Arr)
    want = x.copy()
    assert nc.allreduce_sum(x) is x
    np.testing.assert_array_equal(x, want)
    assert fake_nccl[-1] == ("allReduce", 1001, 4)  # count in elements, NCCL_INT64
    nc.allreduce_sum(np.zeros((0,), np.float32).view(_Arr))  # nothing to reduce: no call
    assert fake_nccl[-1] == ("allReduce", 1001, 4)
    keys = ((np.uint64(1) << np.uint64(63)) | np.arange(77, dtype=np.uint64)).view(_Arr)
    got = nc.alltoallv([keys], [77])
    np.testing.assert_array_equal(got[0], keys)
    assert fake_nccl[-2:] == [("send", 77, 5, 0), ("recv", 77, 5, 0)]  # NCCL_UINT64
    rows = np.arange(77 * 16, dtype=np.float32).reshape(77, 16).view(_Arr)
    got = nc.alltoallv([rows], [77])
    assert got[0].shape == (77, 16)
    np.testing.assert_array_equal(got[0], rows)
    assert fake_nccl[-2:] == [("send", 77 * 16, 7, 0), ("recv", 77 * 16, 7, 0)]  # elements, NCCL_FLOAT32
    n = len(fake_nccl)
    got = nc.alltoallv([rows[:0]], [0])  # a zero-row part: no send, no receive
    assert got[0].shape == (0, 16) and len(fake_nccl) == n
    half = rows.astype(np.float16).view(_Arr)
    np.testing.assert_array_equal(nc.alltoallv([half], [77])[0], half)
    assert fake_nccl[-1] == ("recv", 77 * 16, 6, 0)  # NCCL_FLOAT16
    with pytest.raises(TypeError, match="dtype bool"):
        nc.allreduce_sum(np.zeros(3, bool).view(_Arr))
    with pytest.raises(ValueError, match="C-contiguous"):
        nc.allreduce_sum(np.zeros((4, 4), np.float32).view(_Arr)[:, 1])
    nc.close()
    assert fake_nccl[-1] == ("destroy",)
    nc.close()  # once only
    assert fake_nccl.count(("destroy",)) == 1


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
