"""Smoke test of ``numbactr bench dlrm --model mlperf`` on cpu (tiny batch and tables, one timed step):
the MLPerf widths are built, both optimizers run, the breakdown is measured and the phase timers leave
the model as they found it."""
import importlib.util

import pytest

from numbactr import bench, bench_mlperf
from numbactr.layers import dense
from numbactr import ops


def test_mlperf_table_on_cpu(cpu, capsys):
    env = bench.Env(use_torch=importlib.util.find_spec("torch") is not None)
    tab = bench_mlperf.bench_mlperf(env, batch=32, rows=300, dims=(16,), optimizers=("sgd", "adam"), batches=1,
                                    min_time=0.0, breakdown_steps=1, threads=(1, 2))
    ours = [r for r in tab.rows if r[0] == "numbactr"]
    # each optimizer at each thread count, numbactr's and torch's threads set alike
    assert [(r[1], r[2]) for r in ours] == [("1", "sgd"), ("2", "sgd"), ("1", "adam"), ("2", "adam")]
    for r in ours:
        step, emb, dense_ms = (float(r[i].replace(",", "")) for i in (6, 8, 9))
        assert step > 0 and emb > 0 and dense_ms > 0
        assert r[3:6] == ["16", "32", "300"]
    if env.torch is not None:
        assert [r[0] for r in tab.rows] == ["numbactr", "torch-cpu"] * 4
        assert [r[1] for r in tab.rows] == ["1", "1", "2", "2"] * 2
    assert "512-256-D" in tab.markdown() and "1024-1024-512-256-1" in tab.markdown()
    # the timers are gone: the classes hold their own functions again
    assert dense.FcBiasAct.__dict__["forward"].__func__.__qualname__ == "FcBiasAct.forward"
    assert ops.Linear.__dict__["backward"].__func__.__qualname__ == "Linear.backward"


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


def test_mlperf_command_line(cpu, capsys):
    assert bench.main(["dlrm", "--model", "mlperf", "--no-torch", "--batch", "16", "--rows", "200", "--dim", "16",
                       "--optimizer", "sgd", "--min-time", "0", "--quick", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "MLPerf DLRM training step (cpu)" in out and "| numbactr | 2 | sgd | 16 | 16 | 200 |" in out
    for bad, words in ((["hash", "--tf32"], "only apply"), (["hash", "--model", "mlperf"], "`bench dlrm` only"),
                       (["dlrm", "--model", "mlperf", "--optimizer", "lamb"], "sgd and/or adam"),
                       (["dlrm", "--model", "mlperf", "--dim", "x"], "embedding widths")):
        with pytest.raises(SystemExit):
            bench.main(bad)
        assert words in capsys.readouterr().err
