"""`numbactr bench hstu --quick`: numbactr's HSTU attention forward and backward timed (beside PyTorch padded
dense when torch is installed), one row per implementation and length, the same figures in the --json file;
the bench's PyTorch attention agrees with numbactr's face (it times the same math)."""

import importlib.util

import numpy as np
import pytest

from numbactr.bench import cli as bench
from numbactr.bench import hstu as bench_hstu
from numbactr.bench import results
from numbactr.bench.common import Env

pytestmark = pytest.mark.usefixtures("cpu")
HAS_TORCH = importlib.util.find_spec("torch") is not None


def _rows(text):
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return header, [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[1:]]


def test_bench_hstu_quick_table_and_json(tmp_path, capsys):
    out = tmp_path / "hstu.json"
    assert bench.main(["hstu", "--quick", "--min-time", "0", "--no-torch", "--json", str(out)]) == 0
    header, rows = _rows(capsys.readouterr().out)
    assert header == bench_hstu.COLUMNS
    assert [(r["impl"], r["threads"], r["L"], r["tokens"]) for r in rows] == [("numbactr", "1", "12", "18")]
    assert all(float(r["fwd ms"]) > 0 and float(r["bwd ms"]) > 0 for r in rows)
    doc = results.load(out)  # validated
    assert {(r["metric"], r["implementation"]) for r in doc["results"]} == {
        ("fwd ms", "numbactr"),
        ("bwd ms", "numbactr"),
    }


def test_sequence_lengths_run_from_l_to_half_l():
    assert bench_hstu.seq_lengths(512, 4) == [512, 427, 342, 256]
    assert bench_hstu.seq_lengths(50, 1) == [50]
    with pytest.raises(ValueError, match="lengths >= 2"):
        bench_hstu.bench_hstu(Env(use_torch=False), lengths=(1,))


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_bench_torch_attention_is_the_same_math():
    env = Env(use_torch=True)
    lengths, heads, dim = [7, 4], 2, 8
    fwd, bwd = bench_hstu._numbactr_fns(env, lengths, heads, dim, np.random.default_rng(3))
    tfwd, tbwd = bench_hstu._torch_fns(env, lengths, heads, dim, np.random.default_rng(3))
    np.testing.assert_allclose(tfwd().detach().numpy(), fwd(), rtol=1e-4, atol=1e-6)
    for got, want in zip(tbwd(), bwd()[:3]):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6)
