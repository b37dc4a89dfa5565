"""`numbactr bench`: a --quick smoke run of every subcommand on cpu (tables, columns, sane figures),
the helpers behind the tables, and the torch baselines' correctness when torch is installed."""

import importlib.util
import re

import numpy as np
import pytest

from numbactr.bench import cli as bench
from numbactr.bench import (
    common as bench_common,
    dlrm as bench_dlrm_mod,
    embedding as bench_embedding_mod,
    hash as bench_hash_mod,
)
from numbactr.runtime import device

HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_FBGEMM = HAVE_TORCH and importlib.util.find_spec("fbgemm_gpu") is not None


def tables_in(text: str) -> list:
    """[(columns, rows)] of every markdown table in text; rows as lists of cell strings."""
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("| impl |") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            cols = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip("|").split("|")])
            out.append((cols, rows))
    return out


def number(cell: str) -> float:
    return float(cell.replace(",", ""))


def check_table(cols, rows, expect_cols, figure_cols):
    assert cols == expect_cols
    assert rows and all(len(r) == len(cols) for r in rows)
    impls = {r[0] for r in rows}
    assert "numbactr" in impls
    if HAVE_TORCH:
        assert "torch-cpu" in impls
    for r in rows:
        for c in figure_cols:
            v = number(r[cols.index(c)])
            assert np.isfinite(v) and v > 0, (c, r)


def run_main(capsys, *argv):
    assert bench.main(list(argv)) == 0
    out = capsys.readouterr().out
    assert "device: cpu" in out and re.search(r"date: \d{4}-\d\d-\d\d", out)
    if not HAVE_TORCH and "--no-torch" not in argv:
        assert "torch not installed" in out
    return out


def test_quick_hash(capsys, on_device):
    on_device("cpu")
    out = run_main(capsys, "hash", "--quick")
    [(cols, rows)] = tables_in(out)
    check_table(cols, rows, bench_common.HASH_COLUMNS, ["ms", "Mkeys/s"])
    ops = {(r[0], r[1], r[2]) for r in rows}
    for dist in ("uniform", "power-law"):
        for op in ("insert-new", "insert-known", "find"):
            assert ("numbactr", dist, op) in ops
    # throughput = batch keys / time
    for r in rows:
        keys, ms, rate = number(r[3]), number(r[6]), number(r[7])
        assert rate == pytest.approx(keys / (ms * 1e3), rel=0.02)
    # uniform 64-bit keys are all distinct; power-law keys repeat
    distinct = {r[1]: (number(r[3]), number(r[4])) for r in rows}
    assert distinct["uniform"][1] == distinct["uniform"][0]
    assert distinct["power-law"][1] < distinct["power-law"][0]


def test_quick_embedding(capsys, on_device):
    on_device("cpu")
    out = run_main(capsys, "embedding", "--quick")
    [(fcols, frows), (bcols, brows)] = tables_in(out)
    check_table(fcols, frows, bench_common.EMBEDDING_FWD_COLUMNS, ["fwd ms", "fwd GB/s"])
    check_table(bcols, brows, bench_common.EMBEDDING_BWD_COLUMNS, ["bwd+upd ms", "bwd+upd GB/s"])
    for r in frows:  # GB/s is FBGEMM's byte count over the time
        b, f, hot, d = (int(number(r[i])) for i in (3, 4, 5, 6))
        assert number(r[9]) == pytest.approx(
            bench_embedding_mod.embedding_bytes(b * f, hot, d) / (number(r[8]) * 1e-3) / 1e9, rel=0.05
        )
    for r in brows:  # backward + update: twice the forward bytes
        b, f, hot, d = (int(number(r[i])) for i in (5, 6, 7, 8))
        nbytes = 2 * bench_embedding_mod.embedding_bytes(b * f, hot, d)
        assert number(r[11]) == pytest.approx(nbytes / (number(r[10]) * 1e-3) / 1e9, rel=0.05)
        assert int(number(r[4])) == bench_embedding_mod.state_bytes_per_row(r[0], r[3], d)
    assert {r[5] for r in frows} == {"1", "4"} and {r[2] for r in frows} == {"sum", "mean"}
    # every implementation forward per shape and pooling; every optimizer except FBGEMM's CPU-less Adam
    impls = {"numbactr"} | ({"torch-cpu"} if HAVE_TORCH else set()) | ({"fbgemm"} if HAVE_FBGEMM else set())
    assert {r[0] for r in frows} == impls and len(frows) == 4 * len(impls)
    got = {(r[0], r[3]) for r in brows}
    want = {(i, o) for i in impls for o in bench_embedding_mod.EMBEDDING_OPTIMIZERS} - {("fbgemm", "adam")}
    assert got == want


def test_quick_dlrm(capsys, on_device):
    on_device("cpu")
    out = run_main(capsys, "dlrm", "--quick")
    [(cols, rows)] = tables_in(out)
    check_table(cols, rows, bench_common.DLRM_COLUMNS, ["step ms", "samples/s"])
    for r in rows:
        assert number(r[7]) == pytest.approx(number(r[2]) / (number(r[6]) * 1e-3), rel=0.02)
    impls = {r[0] for r in rows}
    assert ("torch+numbactr-tbe" in impls) == HAVE_TORCH and ("torch+fbgemm-tbe" in impls) == HAVE_FBGEMM


def test_threads_option(capsys, on_device):
    """--threads runs each count in turn. The embedding benchmark, not dlrm: a second thread count compiles
    every parallel twin a benchmark calls (dlrm's took three minutes of the suite on a cold cache)."""
    on_device("cpu")
    out = run_main(capsys, "embedding", "--quick", "--no-torch", "--min-time", "0", "--threads", "1,2")
    found = tables_in(out)
    assert len(found) == 2
    for cols, rows in found:
        assert cols[:2] == ["impl", "threads"]
        assert {r[0] for r in rows} == {"numbactr"}
        threads = [r[1] for r in rows]
        assert sorted(set(threads)) == ["1", "2"] and threads.count("1") == threads.count("2")
    with pytest.raises(SystemExit):
        bench.main(["dlrm", "--threads", "0,x"])


def test_state_bytes_per_row():
    assert [bench_embedding_mod.state_bytes_per_row("numbactr", o, 16) for o in ("sgd", "rowwise_adagrad", "adam")] == [
        0,
        4,
        128,
    ]
    assert (
        bench_embedding_mod.state_bytes_per_row("torch-cpu", "rowwise_adagrad", 16) == 64
    )  # torch's Adagrad: D values


def test_quick_all_without_torch(capsys, on_device):
    on_device("cpu")
    out = run_main(capsys, "all", "--quick", "--no-torch", "--min-time", "0")
    found = tables_in(out)
    assert [cols for cols, _ in found] == [
        bench_common.HASH_COLUMNS,
        bench_common.EMBEDDING_FWD_COLUMNS,
        bench_common.EMBEDDING_BWD_COLUMNS,
        bench_common.DLRM_COLUMNS,
    ]
    assert all({r[0] for r in rows} == {"numbactr"} for _, rows in found)
    assert "torch baseline skipped (--no-torch)" in out


def test_bad_subcommand_is_rejected(capsys):
    with pytest.raises(SystemExit):
        bench.main(["nope"])


# ---- helpers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,gbs",
    [
        ("NVIDIA H100 80GB HBM3", 3350.0),
        ("NVIDIA H100 PCIe", 2000.0),
        ("NVIDIA H200", 4800.0),
        ("NVIDIA A100-SXM4-80GB", 2039.0),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_known_peak_bandwidth(name, gbs):
    assert bench_common.known_peak_bandwidth(name)[0] == gbs


def test_peak_bandwidth_is_the_measured_copy_with_the_spec_sheet_beside(monkeypatch):
    # issue 14's goals are fractions of the measured bandwidth: the copy comes first, the spec sheet is noted
    monkeypatch.setattr(bench_common, "measure_copy_bandwidth", lambda: 3012.5)
    gbs, src = bench_common.peak_bandwidth("NVIDIA H100 80GB HBM3")
    assert gbs == 3012.5 and "measured" in src and "3350" in src

    def no_gpu():
        raise RuntimeError("no device")

    monkeypatch.setattr(bench_common, "measure_copy_bandwidth", no_gpu)
    assert bench_common.peak_bandwidth("NVIDIA H100 80GB HBM3")[0] == 3350.0  # the spec sheet alone
    gbs, src = bench_common.peak_bandwidth("NVIDIA GeForce RTX 4090")
    assert gbs is None and "no device" in src


def test_profiled_step_runs_only_on_a_gpu_when_asked(monkeypatch):
    from numbactr.bench import mlperf as bench_mlperf

    class Model:
        steps = 0

        def train(self):
            self.steps += 1

    class Env:
        kind = "cpu"

        def sync(self):
            pass

    m = Model()
    monkeypatch.setenv("NUMBACTR_PROFILE_STEP", "1")
    bench_mlperf._profiled_step(m, Env())  # cpu: nothing to profile
    monkeypatch.setenv("NUMBACTR_PROFILE_STEP", "0")
    Env.kind = "gpu"
    bench_mlperf._profiled_step(m, Env())  # not asked for
    assert m.steps == 0


def test_embedding_bytes_is_fbgemms_count():
    # rows read B*L*D*4 + output written B*D*4
    assert bench_embedding_mod.embedding_bytes(8192 * 26, 20, 128) == 8192 * 26 * 20 * 128 * 4 + 8192 * 26 * 128 * 4
    assert bench_embedding_mod.embedding_bytes(10, 1, 16) == 2 * 10 * 16 * 4


def test_table_markdown_and_cells():
    t = bench_common.Table("x", ["impl", "n", "v"], notes=["note"])
    t.add("a", 1234567, 0.012345)
    t.add("b", 5, float("nan"))
    md = t.markdown()
    assert "- note" in md
    assert "| a | 1,234,567 | 0.0123 |" in md and "| b | 5 | - |" in md
    with pytest.raises(ValueError):
        t.add("too", "few")


def test_measure_runs_setup_before_every_call():
    calls = []
    t = bench_common.measure(lambda: calls.append("fn"), setup=lambda: calls.append("setup"), min_time=0)
    assert t >= 0 and calls == ["setup", "fn", "setup", "fn"]


# ---- torch baselines -------------------------------------------------------------------------------
@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_torch_key_index_agrees_with_the_hash_table():
    import torch

    from numbactr.embedding.hash_table import HashTable

    rng = np.random.default_rng(3)
    idx, table = bench_hash_mod.TorchKeyIndex(torch, "cpu"), HashTable(500, use_kernels=False)
    for _ in range(3):  # batches with repeats, some keys known from earlier batches
        keys = rng.integers(0, 400, 300).astype(np.uint64)
        got = idx.insert(torch.from_numpy(keys.view(np.int64))).numpy()
        ref = table.insert(keys)
        # rows are numbered differently (sorted vs first-occurrence order) but must be a bijection
        pairs = set(zip(got.tolist(), ref.tolist()))
        assert len(pairs) == len(set(got.tolist())) == len(set(ref.tolist()))
        assert idx.size == table.size
    probe = np.array([5, 399, 1000, 7], dtype=np.int64)
    found = idx.find(torch.from_numpy(probe)).numpy()
    assert (found >= 0).tolist() == (table.find(probe.astype(np.uint64)) >= 0).tolist()
    assert found[2] == -1


@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_torch_dlrm_interaction_has_hugectrs_layout():
    import torch

    from numbactr.kernels.interaction import interaction_forward_ref

    sizes = [7, 5, 9]
    model = bench_dlrm_mod.torch_dlrm(torch, sizes, dense_dim=4, vec=3)
    rng = np.random.default_rng(0)
    dense = torch.from_numpy(rng.standard_normal((6, 4)).astype(np.float32))
    idx = [torch.from_numpy(rng.integers(0, v, 6)) for v in sizes]
    offs = [torch.arange(6) for _ in sizes]
    seen = {}
    model.top.register_forward_hook(lambda m, inp, out: seen.setdefault("x", inp[0].detach().numpy()))
    model(dense, idx, offs)
    with torch.no_grad():
        x = model.bottom(dense).numpy()  # (B, 3)
        emb = np.stack([e(i, o).numpy() for e, i, o in zip(model.emb, idx, offs)], 1)  # (B, S, 3)
    np.testing.assert_allclose(seen["x"], interaction_forward_ref(x, emb), rtol=1e-5, atol=1e-6)


# ---- the kernel path (gpu code) in the simulator, at tiny sizes -----------------------------------
def test_kernel_path_in_the_simulator(on_device):
    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    on_device("sim")
    env = bench_common.Env(use_torch=False)
    assert env.kernels
    tab = bench_hash_mod.bench_hash(env, n=48, min_time=0)
    assert len(tab.rows) == 6
    fwd, bwd = bench_embedding_mod.bench_embedding(
        env,
        batch=2,
        features=3,
        hots=(2,),
        dims=(4,),
        rows=40,
        poolings=("sum",),
        optimizers=("sgd",),
        threads=(1,),
        min_time=0,
    )
    assert len(fwd.rows) == len(bwd.rows) == 1 and number(fwd.rows[0][9]) > 0 and number(bwd.rows[0][11]) > 0


def test_runs_and_says_so_without_torch(capsys, on_device, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    on_device("cpu")
    out = run_main(capsys, "hash", "--quick", "--min-time", "0")
    assert "torch not installed" in out
    [(_, rows)] = tables_in(out)
    assert {r[0] for r in rows} == {"numbactr"}
