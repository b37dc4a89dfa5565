"""numbactr.files.plot: the matplotlib learning curve (two panels, reference lines) and the CSV history."""

import warnings

import numpy as np
import pandas as pd
import pytest
from matplotlib.image import imread

from numbactr.files import plot

HISTORY = {
    "iter": [10, 20, 30, 40],
    "loss": [0.69, 0.55, 0.5, 0.48],
    "lr": [0.01] * 4,
    "eval_iter": [20, 40],
    "auc": [0.70, 0.74],
}


def test_png_and_csv_are_written_with_two_panels(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        png, csv = plot.save_learning_curve(
            tmp_path / "curve.png", HISTORY, reference={"Bayes-optimal AUC": 0.77}, title="t"
        )
    assert png == str(tmp_path / "curve.png") and csv == str(tmp_path / "curve.csv")
    img = imread(png)  # (H, W, 4) floats
    assert img.shape[0] > 400 and img.shape[1] > 600
    assert (img[..., :3] < 0.5).any()  # something drawn on white
    assert not list(tmp_path.glob("*.tmp"))
    fig = plot.learning_curve_figure(HISTORY, {"Bayes-optimal AUC": 0.77})
    loss_ax, auc_ax = fig.axes
    assert loss_ax.get_ylabel() == "training loss" and auc_ax.get_ylabel() == "evaluation AUC"
    np.testing.assert_array_equal(loss_ax.lines[0].get_ydata(), HISTORY["loss"])
    np.testing.assert_array_equal(auc_ax.lines[0].get_xdata(), [20, 40])
    bayes = auc_ax.lines[1]
    assert bayes.get_linestyle() == "--" and list(bayes.get_ydata()) == [0.77, 0.77]
    assert "Bayes-optimal AUC 0.7700" in [t.get_text() for t in auc_ax.get_legend().get_texts()]


def test_csv_has_one_row_per_iteration_and_the_reference(tmp_path):
    path = plot.save_history_csv(tmp_path / "h.csv", HISTORY, {"Bayes-optimal AUC": 0.77})
    text = open(path).read()
    assert text.startswith("# Bayes-optimal AUC: 0.77\n")
    df = pd.read_csv(path, comment="#")
    assert list(df.columns) == ["iteration", "train_loss", "lr", "eval_auc"]
    assert df["iteration"].tolist() == [10, 20, 30, 40]
    assert df["train_loss"].tolist() == HISTORY["loss"]
    assert df["eval_auc"].isna().tolist() == [True, False, True, False]
    assert df["eval_auc"].dropna().tolist() == [0.70, 0.74]


def test_eval_at_an_iteration_without_a_loss_line_gets_its_own_row(tmp_path):
    h = {"iter": [5], "loss": [0.6], "eval_iter": [7], "auc": [0.6]}
    df = pd.read_csv(plot.save_history_csv(tmp_path / "h.csv", h))
    assert df["iteration"].tolist() == [5, 7]
    assert list(df.columns) == ["iteration", "train_loss", "eval_auc"]


def test_empty_history_and_nan_values_still_draw(tmp_path):
    empty = {"iter": [], "loss": [], "eval_iter": [], "auc": []}
    png, csv = plot.save_learning_curve(tmp_path / "e.png", empty)
    assert imread(png).shape[0] > 0
    assert open(csv).read().strip() == "iteration,train_loss,eval_auc"
    h = {"iter": [1, 2], "loss": [float("nan"), 0.5], "eval_iter": [2], "auc": [float("nan")]}
    plot.save_learning_curve(tmp_path / "n.png", h)
    df = pd.read_csv(tmp_path / "n.csv")
    assert np.isnan(df["train_loss"][0]) and df["train_loss"][1] == 0.5


def test_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"history\['eval_iter'\] has 1 entries but history\['auc'\] has 2"):
        plot.save_learning_curve(tmp_path / "x.png", {"eval_iter": [1], "auc": [0.5, 0.6]})
    with pytest.raises(ValueError, match="reference line 'Bayes' is nan"):
        plot.save_learning_curve(tmp_path / "x.png", HISTORY, reference={"Bayes": float("nan")})
