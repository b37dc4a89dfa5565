"""``numbactr bench dlrm --model mlperf`` on cpu (tiny batch and tables, one or two timed steps): the MLPerf
widths are built, both optimizers run, the breakdown (embedding, GEMMs, rest, host gaps) adds up to the
eager step, the GEMMs leave the bias/ReLU kernels to the rest, the embedding's bytes count Global Adam's
all-rows pass, the graphs column never passes eager steps off as replayed graphs, the gated GPU method's
arithmetic and fallback hold (a stand-in gate on cpu), and the phase timers leave the model as they found
it. No timed assertion: figures are checked for being there, finite, non-negative and consistent."""

import importlib.util
import math
import os
import subprocess
import sys
import types

import pytest

from numbactr.bench import cli as bench
from numbactr.bench import common as bench_common, mlperf as bench_mlperf
from numbactr.kernels import bias as bias_kernels
from numbactr.kernels import fused_bias_act
from numbactr.layers import dense
from numbactr import ops

PARTS = ("embedding", "gemm", "rest", "host_gap")


def _check_sums(rec, host_gap_measured=True):
    for k in ("embedding", "gemm", "rest", "eager", "step"):
        assert math.isfinite(rec[k]) and rec[k] >= 0, (k, rec)
    assert rec["embedding"] > 0 and rec["gemm"] > 0
    if host_gap_measured:
        assert math.isfinite(rec["host_gap"]) and rec["host_gap"] >= 0
        assert sum(rec[k] for k in PARTS) == pytest.approx(rec["eager"], rel=1e-9, abs=1e-12)
    else:
        assert rec["host_gap"] is None
        assert rec["embedding"] + rec["gemm"] + rec["rest"] == pytest.approx(rec["eager"], rel=1e-9, abs=1e-12)


def test_mlperf_table_on_cpu(cpu, monkeypatch):
    monkeypatch.delenv("NUMBACTR_CUDA_GRAPHS", raising=False)
    env = bench_common.Env(use_torch=importlib.util.find_spec("torch") is not None)
    tab = bench_mlperf.bench_mlperf(
        env,
        batch=32,
        rows=300,
        dims=(16,),
        optimizers=("sgd", "adam"),
        batches=1,
        min_time=0.0,
        breakdown_steps=1,
        threads=(1, 2),
    )
    assert tab.columns == bench_mlperf.COLUMNS
    for name in ("graphs", "eager ms", "embedding ms", "GEMMs ms", "rest ms", "host gaps ms", "embedding GB/s"):
        assert name in tab.columns
    col = {c: i for i, c in enumerate(tab.columns)}
    ours = [r for r in tab.rows if r[0] == "numbactr"]
    # each optimizer at each thread count, numbactr's and torch's threads set alike
    assert [(r[1], r[2]) for r in ours] == [("1", "sgd"), ("2", "sgd"), ("1", "adam"), ("2", "adam")]
    assert [(r["threads"], r["optimizer"]) for r in tab.records] == [(1, "sgd"), (2, "sgd"), (1, "adam"), (2, "adam")]
    for r, rec in zip(ours, tab.records):
        assert r[3:6] == ["16", "32", "300"]
        assert r[col["graphs"]] == "off" and rec["replayed"] is False
        for c in ("step ms", "eager ms", "embedding ms", "GEMMs ms", "rest ms", "host gaps ms", "embedding GB/s"):
            assert float(r[col[c]].split()[0].replace(",", "")) >= 0, c
        # cpu: the breakdown is of the timed steps themselves, host gaps 0 by definition, parts add up
        _check_sums(rec)
        assert rec["host_gap"] == 0.0 and rec["method"] == "host clock" and rec["busy"] is None
        assert rec["step"] == rec["eager_step"]  # no graphs: the clean steps were the eager ones
        # bytes: FBGEMM's touched-row count, plus Adam's all-rows pass (SGD has none)
        touched = 3 * 2 * 32 * 26 * 16 * 4
        assert rec["embedding_bytes"] == touched + rec["global_pass_bytes"]
        assert (rec["global_pass_bytes"] > 0) == (rec["optimizer"] == "adam")
        assert math.isfinite(rec["embedding_gbs"]) and rec["embedding_gbs"] > 0
    if env.torch is not None:
        assert [r[0] for r in tab.rows] == ["numbactr", "torch-cpu"] * 4
        assert [r[1] for r in tab.rows] == ["1", "1", "2", "2"] * 2
    md = tab.markdown()
    assert "512-256-D" in md and "1024-1024-512-256-1" in md and "host gaps 0 by definition on cpu" in md
    # the timers are gone: the classes and kernel modules hold their own functions again
    assert dense.FcBiasAct.__dict__["forward"].__func__.__qualname__ == "FcBiasAct.forward"
    assert ops.Linear.__dict__["backward"].__func__.__qualname__ == "Linear.backward"
    assert bias_kernels.bias_add_cpu.__qualname__ == "bias_add_cpu"
    assert fused_bias_act.bias_act_backward.__qualname__ == "bias_act_backward"


def test_mlperf_graphs_asked_for_but_not_replayed(cpu, monkeypatch):
    """NUMBACTR_CUDA_GRAPHS=1 where no step can be a graph (cpu): the row says so and its figures are the
    eager steps' (a failed capture on a GPU reads the same way, with StepGraphs.disabled as the reason)."""
    monkeypatch.setenv("NUMBACTR_CUDA_GRAPHS", "1")
    env = bench_common.Env(use_torch=False)
    tab = bench_mlperf.bench_mlperf(
        env, batch=16, rows=200, dims=(16,), optimizers=("sgd",), batches=1, min_time=0.0, breakdown_steps=1
    )
    (rec,) = tab.records
    assert rec["graphs"] == "not replayed: not on a GPU" and not rec["replayed"] and rec["replays"] == 0
    assert tab.rows[0][tab.columns.index("graphs")] == "not replayed: not on a GPU"
    assert rec["step"] == rec["eager_step"]
    _check_sums(rec)
    assert os.environ["NUMBACTR_CUDA_GRAPHS"] == "1"  # the eager steps' switch is put back


def test_graph_status():
    g = types.SimpleNamespace(captures=2, replays=9, disabled=None)
    assert bench_mlperf.graph_status(False, None, 5, 0) == ("off", False)
    assert bench_mlperf.graph_status(True, g, 5, 5) == ("replayed (5/5 steps, 2 captures)", True)
    cell, ok = bench_mlperf.graph_status(True, g, 5, 3, [None, "a partial batch", None])
    assert not ok and cell.startswith("partly replayed (3/5 steps") and "a partial batch" in cell
    failed = types.SimpleNamespace(captures=0, replays=0, disabled="capture failed (RuntimeError: x)")
    assert bench_mlperf.graph_status(True, failed, 5, 0, ["capture failed (RuntimeError: x)"]) == (
        "not replayed: capture failed (RuntimeError: x)",
        False,
    )
    assert bench_mlperf.graph_status(True, None, 4, 0, ["not on a GPU"] * 4) == ("not replayed: not on a GPU", False)
    assert bench_mlperf.graph_status(True, None, 4, 0)[0] == "not replayed: no step was captured"


@pytest.fixture
def tiny_model(cpu, tmp_path):
    import numbactr as hugectr
    from tests.model_util import tiny_data

    tr, ev = tiny_data(str(tmp_path), n_train=16, n_eval=16, slots=26, dense=13, keys_per_slot=2, files=1)

    def make(optimizer="sgd"):
        return bench_mlperf.build_mlperf_dlrm(
            hugectr, tr, ev, batch=8, dim=16, optimizer=optimizer, workspace_mb=1, bottom=(8,), top=(8, 1)
        )

    return make


class _VirtualClock:
    """A clock that moves only when told: a phase's time is what ran inside it, exactly."""

    def __init__(self):
        self.now = 0.0

    def mark(self):
        return self.now

    @staticmethod
    def seconds(a, b):
        return b - a


def test_gemms_leave_bias_kernels_to_the_rest(tiny_model, monkeypatch):
    """Time passes only inside the bias kernels (1 s a call): the GEMMs phase gets none of it; before, the
    dense phase held the bias kernels."""
    model = tiny_model()
    model.train()
    clock = _VirtualClock()
    calls = {"n": 0}

    def ticking(fn):
        def run(*a, **k):
            calls["n"] += 1
            clock.now += 1.0
            return fn(*a, **k)

        return run

    for name in ("bias_add_cpu", "bias_grad_cpu"):
        monkeypatch.setattr(bias_kernels, name, ticking(getattr(bias_kernels, name)))
    # the planned step fuses an InnerProduct and the ReLU after it (FcBiasAct): its bias runs in these
    for name in ("bias_act_forward_cpu", "bias_act_backward_cpu"):
        monkeypatch.setattr(fused_bias_act, name, ticking(getattr(fused_bias_act, name)))
    timer = bench_mlperf.PhaseTimer(model, clock)
    with timer:
        model.train()
    s = timer.seconds()
    assert calls["n"] == 2 * 4  # forward and backward of each of the 4 InnerProducts' bias (fused or not)
    assert s["gemm"] == 0.0 and s["other"] == calls["n"] and s["embedding"] == 0.0
    gemm = [i for i in timer.intervals if i[0] == "gemm"]
    assert len(gemm) == 8 and all(len(children) == 1 for _, _, _, children in gemm)
    assert bias_kernels.bias_add_cpu.__name__ == "run"  # the test's own wrapper is back in place


class _StandInGate:
    """StreamGate's interface on cpu: held() around each gated step, timed_out() after it."""

    def __init__(self, timed_out=False):
        self.held_steps, self._timed_out = 0, timed_out

    def held(self):
        import contextlib

        self.held_steps += 1
        return contextlib.nullcontext()

    def timed_out(self):
        return self._timed_out


def test_gated_breakdown_adds_up(tiny_model):
    """The GPU method's arithmetic, run on cpu with a stand-in gate and the host clock as 'events': rest =
    busy - embedding - GEMMs, host gaps = eager step - busy, the four add up to the eager step."""
    model = tiny_model("adam")
    model.train()
    env = types.SimpleNamespace(kind="gpu", sync=lambda: None)
    gate = _StandInGate()
    slow = bench_mlperf.breakdown(model, env, 2, eager_step=100.0, gate=gate, clock=bench_mlperf.WallClock())
    assert gate.held_steps == 2 and slow["method"] == "gated events" and slow["why"] == ""
    assert slow["embedding"] + slow["gemm"] + slow["rest"] == pytest.approx(slow["busy"], rel=1e-9)
    assert slow["host_gap"] == pytest.approx(100.0 - slow["busy"]) and slow["eager"] == 100.0
    assert sum(slow[k] for k in PARTS) == pytest.approx(100.0, rel=1e-9)
    fast = bench_mlperf.breakdown(model, env, 1, eager_step=0.0, gate=_StandInGate(), clock=bench_mlperf.WallClock())
    assert fast["host_gap"] == 0.0 and fast["eager"] == fast["busy"] > 0  # never a negative gap
    assert sum(fast[k] for k in PARTS) == pytest.approx(fast["eager"], rel=1e-9)


def test_gated_breakdown_falls_back_when_the_gate_times_out(tiny_model):
    """A step that made the host wait for the device (the gate timed out) is not measured as device time:
    after GATE_FAILURES such steps, host-clock phases and host gaps unmeasured (None, '-' in the table)."""
    model = tiny_model()
    model.train()
    env = types.SimpleNamespace(kind="gpu", sync=lambda: None)
    gate = _StandInGate(timed_out=True)
    r = bench_mlperf.breakdown(model, env, 2, eager_step=1.0, gate=gate, clock=bench_mlperf.WallClock())
    assert gate.held_steps == bench_mlperf.GATE_FAILURES
    assert r["method"] == "host clock" and "timed out" in r["why"] and r["busy"] is None
    _check_sums(dict(r, step=1.0), host_gap_measured=False)


def test_embedding_bytes_count_global_adam(tiny_model):
    sgd, adam = tiny_model("sgd"), tiny_model("adam")
    for m in (sgd, adam):
        m.train()
    assert bench_mlperf.global_pass_bytes(sgd.embeddings[0].engine) == 0
    eng = adam.embeddings[0].engine
    live = sum(eng.live_rows(t) * int(eng.dims[t]) for t in range(len(eng.tables)))
    assert live > 0
    # every element in use: weight, Adam's m and v (float32 each), read and written
    assert bench_mlperf.global_pass_bytes(eng) == 2 * live * (4 + 4 + 4)
    assert bench_mlperf.embedding_step_bytes(8, 16) == 3 * (8 * 26 * 16 * 4) * 2
    assert bench_mlperf.embedding_step_bytes(8, 16, 1000) == 3 * (8 * 26 * 16 * 4) * 2 + 1000


def test_gate_kernel_compiles_for_sm90():
    """The gate a GPU breakdown queues (an atomic poll with nanosleep) compiles for sm_90 without a GPU."""
    code = (
        "from numba import cuda\nfrom numbactr.bench.mlperf import _gate_kernel\n"
        "ptx, _ = cuda.compile_ptx(_gate_kernel, 'void(int64[::1], int64, int64[::1])', cc=(9, 0))\n"
        "assert 'atom.global.add.u64' in ptx and 'nanosleep' in ptx, ptx\nprint('ok')"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if out.returncode and ("NVVM" in out.stderr or "libnvvm" in out.stderr.lower()):
        pytest.skip("NVVM not installed (pip install 'numba-cuda[cu12]')")
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_mlperf_model_widths(cpu, tmp_path):
    import numbactr as hugectr
    from tests.model_util import tiny_data

    tr, ev = tiny_data(str(tmp_path), n_train=16, n_eval=16, slots=26, dense=13, keys_per_slot=2, files=1)
    m = bench_mlperf.build_mlperf_dlrm(hugectr, tr, ev, batch=8, dim=16, optimizer="adam", workspace_mb=1)
    widths = [m.shapes[f"fc{i}"][-1] for i in range(1, 9)]
    assert widths == [512, 256, 16, 1024, 1024, 512, 256, 1]
    assert m.shapes["interaction1"][-1] == 16 + 27 * 26 // 2 + 1
    with pytest.raises(ValueError, match="sgd or adam"):
        bench_mlperf.build_mlperf_dlrm(hugectr, tr, ev, batch=8, optimizer="lamb")


def test_mlperf_command_line(cpu, capsys, monkeypatch):
    monkeypatch.delenv("NUMBACTR_CUDA_GRAPHS", raising=False)
    assert (
        bench.main(
            [
                "dlrm",
                "--model",
                "mlperf",
                "--no-torch",
                "--batch",
                "16",
                "--rows",
                "200",
                "--dim",
                "16",
                "--optimizer",
                "sgd",
                "--min-time",
                "0",
                "--quick",
                "--threads",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "MLPerf DLRM training step (cpu)" in out and "| numbactr | 2 | sgd | 16 | 16 | 200 | off |" in out
    assert "| GEMMs ms | rest ms | host gaps ms |" in out
    for bad, words in (
        (["hash", "--tf32"], "only apply"),
        (["hash", "--model", "mlperf"], "`bench dlrm` only"),
        (["dlrm", "--model", "mlperf", "--optimizer", "lamb"], "sgd and/or adam"),
        (["dlrm", "--model", "mlperf", "--dim", "x"], "embedding widths"),
    ):
        with pytest.raises(SystemExit):
            bench.main(bad)
        assert words in capsys.readouterr().err
