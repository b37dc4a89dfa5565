"""Planted-signal data sets are written once per parameter set and reused: a new parameter, a damaged
or half-written set, or regenerate=True writes it again; the demo reports which happened."""

import os
import re

import numpy as np
import pytest

from numbactr.runtime import device
from numbactr.data.synthetic import MANIFEST, cached_planted_dataset, planted_dataset_key

SMALL = dict(num_train=600, num_eval=200, slot_sizes=[5, 7, 9], dense_dim=2, seed=3, calibration_samples=2000)


def test_reused_until_the_parameters_change(tmp_path):
    a, reused = cached_planted_dataset(tmp_path, **SMALL)
    assert not reused and os.path.basename(a.out_dir) == planted_dataset_key(**SMALL)
    stamp = os.path.getmtime(a.train_files[0])
    b, reused = cached_planted_dataset(tmp_path, **SMALL)
    assert reused and b.out_dir == a.out_dir and os.path.getmtime(b.train_files[0]) == stamp
    for field in ("train_list", "eval_list", "slot_size_array", "bayes_auc", "num_train", "train_ctr"):
        assert getattr(b, field) == getattr(a, field), field
    np.testing.assert_array_equal(b.eval_probs, a.eval_probs)
    np.testing.assert_array_equal(b.eval_labels, a.eval_labels)
    c, reused = cached_planted_dataset(tmp_path, **{**SMALL, "seed": 4})
    assert not reused and c.out_dir != a.out_dir
    d, reused = cached_planted_dataset(tmp_path, regenerate=True, **SMALL)
    assert not reused and d.out_dir == a.out_dir and d.bayes_auc == a.bayes_auc  # same seed, same data


@pytest.mark.parametrize("damage", ["grow", "remove_manifest", "remove_file"])
def test_a_damaged_or_unfinished_set_is_written_again(tmp_path, damage):
    a, _ = cached_planted_dataset(tmp_path, **SMALL)
    if damage == "grow":
        with open(a.eval_files[0], "ab") as f:
            f.write(b"\0")
    elif damage == "remove_manifest":  # a run stopped before the manifest was written
        os.remove(os.path.join(a.out_dir, MANIFEST))
    else:
        os.remove(a.train_files[0])
    b, reused = cached_planted_dataset(tmp_path, **SMALL)
    assert not reused and os.path.exists(os.path.join(b.out_dir, MANIFEST))
    assert os.path.getsize(b.eval_files[0]) == os.path.getsize(a.eval_files[0]) or damage != "grow"


def test_demo_says_where_the_data_is_and_regenerates_on_request(tmp_path, capsys):
    from numbactr import demo

    before = device.kind()
    device.set_device("cpu")
    try:
        argv = [
            "--out",
            str(tmp_path),
            "--train-samples",
            "2048",
            "--eval-samples",
            "512",
            "--rows",
            "600",
            "--batch",
            "256",
            "--iters",
            "1",
        ]
        assert demo.main(argv) == 0
        first = capsys.readouterr().out
        folder = re.search(r"written in [\d.]+s: (\S+) \(\d+ MiB\)", first).group(1)
        assert folder.startswith(str(tmp_path / "data" / "planted-"))
        assert demo.main(argv) == 0
        assert f"reused: {folder}" in capsys.readouterr().out
        assert demo.main(argv + ["--regenerate-data"]) == 0
        assert f"s: {folder}" in capsys.readouterr().out
        assert (tmp_path / "learning_curve.png").exists() and (tmp_path / "learning_curve.csv").exists()
    finally:
        device.set_device(before)


@pytest.mark.parametrize("planted", [False, True])
def test_data_generator_says_whether_labels_carry_a_signal(tmp_path, capsys, planted):
    import numbactr as hugectr

    p = hugectr.tools.DataGeneratorParams(
        format=hugectr.DataReaderType_t.Norm,
        label_dim=1,
        dense_dim=2,
        num_slot=2,
        i64_input_key=True,
        source=str(tmp_path / "file_list.txt"),
        eval_source=str(tmp_path / "file_list_test.txt"),
        slot_size_array=[4, 5],
        num_files=1,
        eval_num_files=1,
        num_samples_per_file=64,
        seed=1,
        planted_signal=planted,
    )
    hugectr.tools.DataGenerator(p).generate()
    out = capsys.readouterr().out
    if planted:
        assert "labels: drawn from a hidden logistic model" in out
    else:
        assert "no model can learn them (AUC 0.5); planted_signal=True" in out
