"""`numbactr bench`: a --quick smoke run of every subcommand on cpu (tables, columns, sane figures),
the helpers behind the tables, and the torch baselines' correctness when torch is installed."""
import importlib.util
import re

import numpy as np
import pytest

from numbactr import bench, device

HAVE_TORCH = importlib.util.find_spec("torch") is not None


@pytest.fixture
def on_device():
    before = device.kind()
    yield device.set_device
    device.set_device(before)


def tables_in(text: str) -> list:
    """[(columns, rows)] of every markdown table in text; rows as lists of cell strings."""
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("| impl |") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            cols = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            for row in lines[i + 2:]:
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
    check_table(cols, rows, bench.HASH_COLUMNS, ["ms", "Mkeys/s"])
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
    [(cols, rows)] = tables_in(out)
    check_table(cols, rows, bench.EMBEDDING_COLUMNS, ["fwd ms", "fwd GB/s", "bwd+upd ms", "bwd+upd GB/s"])
    for r in rows:      # GB/s is FBGEMM's byte count over the time
        b, t, hot, d = (int(number(r[i])) for i in (1, 2, 3, 4))
        nbytes = bench.embedding_bytes(b * t, hot, d)
        assert number(r[7]) == pytest.approx(nbytes / (number(r[6]) * 1e-3) / 1e9, rel=0.05)
        assert number(r[9]) == pytest.approx(2 * nbytes / (number(r[8]) * 1e-3) / 1e9, rel=0.05)
    assert {r[3] for r in rows} == {"1", "4"}


def test_quick_dlrm(capsys, on_device):
    on_device("cpu")
    out = run_main(capsys, "dlrm", "--quick")
    [(cols, rows)] = tables_in(out)
    check_table(cols, rows, bench.DLRM_COLUMNS, ["step ms", "samples/s"])
    for r in rows:
        assert number(r[6]) == pytest.approx(number(r[1]) / (number(r[5]) * 1e-3), rel=0.02)


def test_quick_all_without_torch(capsys, on_device):
    on_device("cpu")
    out = run_main(capsys, "all", "--quick", "--no-torch", "--min-time", "0")
    found = tables_in(out)
    assert [cols for cols, _ in found] == [bench.HASH_COLUMNS, bench.EMBEDDING_COLUMNS, bench.DLRM_COLUMNS]
    assert all({r[0] for r in rows} == {"numbactr"} for _, rows in found)
    assert "torch baseline skipped (--no-torch)" in out


def test_bad_subcommand_is_rejected(capsys):
    with pytest.raises(SystemExit):
        bench.main(["nope"])


# ---- helpers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,gbs", [("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA H100 PCIe", 2000.0),
                                      ("NVIDIA H200", 4800.0), ("NVIDIA A100-SXM4-80GB", 2039.0),
                                      ("NVIDIA GeForce RTX 4090", None)])
def test_known_peak_bandwidth(name, gbs):
    assert bench.known_peak_bandwidth(name)[0] == gbs


def test_embedding_bytes_is_fbgemms_count():
    # rows read B*L*D*4 + output written B*D*4
    assert bench.embedding_bytes(8192 * 26, 20, 128) == 8192 * 26 * 20 * 128 * 4 + 8192 * 26 * 128 * 4
    assert bench.embedding_bytes(10, 1, 16) == 2 * 10 * 16 * 4


def test_table_markdown_and_cells():
    t = bench.Table("x", ["impl", "n", "v"], notes=["note"])
    t.add("a", 1234567, 0.012345)
    t.add("b", 5, float("nan"))
    md = t.markdown()
    assert "- note" in md
    assert "| a | 1,234,567 | 0.0123 |" in md and "| b | 5 | - |" in md
    with pytest.raises(ValueError):
        t.add("too", "few")


def test_measure_runs_setup_before_every_call():
    calls = []
    t = bench.measure(lambda: calls.append("fn"), setup=lambda: calls.append("setup"), min_time=0)
    assert t >= 0 and calls == ["setup", "fn", "setup", "fn"]


# ---- torch baselines -------------------------------------------------------------------------------
@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_torch_key_index_agrees_with_the_hash_table():
    import torch

    from numbactr.embedding.hash_table import HashTable
    rng = np.random.default_rng(3)
    idx, table = bench.TorchKeyIndex(torch, "cpu"), HashTable(500, use_kernels=False)
    for _ in range(3):                   # batches with repeats, some keys known from earlier batches
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
    model = bench.torch_dlrm(torch, sizes, dense_dim=4, vec=3)
    rng = np.random.default_rng(0)
    dense = torch.from_numpy(rng.standard_normal((6, 4)).astype(np.float32))
    idx = [torch.from_numpy(rng.integers(0, v, 6)) for v in sizes]
    offs = [torch.arange(6) for _ in sizes]
    seen = {}
    model.top.register_forward_hook(lambda m, inp, out: seen.setdefault("x", inp[0].detach().numpy()))
    model(dense, idx, offs)
    with torch.no_grad():
        x = model.bottom(dense).numpy()                                     # (B, 3)
        emb = np.stack([e(i, o).numpy() for e, i, o in zip(model.emb, idx, offs)], 1)   # (B, S, 3)
    np.testing.assert_allclose(seen["x"], interaction_forward_ref(x, emb), rtol=1e-5, atol=1e-6)


# ---- the kernel path (gpu code) in the simulator, at tiny sizes -----------------------------------
def test_kernel_path_in_the_simulator(on_device):
    if not device._numba_simulated():
        pytest.skip("needs the simulator")
    on_device("sim")
    env = bench.Env(use_torch=False)
    assert env.kernels
    tab = bench.bench_hash(env, n=48, min_time=0)
    assert len(tab.rows) == 6
    tab = bench.bench_embedding(env, batch=2, tables=3, hots=(2,), dims=(4,), rows=40, min_time=0)
    assert len(tab.rows) == 1 and number(tab.rows[0][7]) > 0


def test_runs_and_says_so_without_torch(capsys, on_device, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "torch", None)          # `import torch` now raises ImportError
    on_device("cpu")
    out = run_main(capsys, "hash", "--quick", "--min-time", "0")
    assert "torch not installed" in out
    [(_, rows)] = tables_in(out)
    assert {r[0] for r in rows} == {"numbactr"}
