"""Learning curves: a matplotlib chart and the history as CSV next to it.

    png, csv = save_learning_curve("runs/demo/learning_curve.png", model.history,
                                   reference={"Bayes-optimal AUC": 0.7715}, title="DLRM, planted data")

The chart has two panels on a shared iteration axis: the training loss (top) and the evaluation AUC
(bottom), each on its own scale, with reference AUCs as dashed horizontal lines. The CSV (same name,
.csv) holds one row per iteration at which anything was recorded:

    iteration,train_loss,lr,eval_auc
    39,0.5123,0.002,
    97,0.4911,0.002,0.7283

Empty cells mark values not recorded at that iteration (pandas reads them as NaN); reference lines are
written as ``# name: value`` comment lines at the top (``pd.read_csv(path, comment="#")``). matplotlib
runs headless (the Agg canvas, no pyplot, no display needed); both files are written to a temporary
name and renamed (numbactr.runtime.atomic), so a viewer polling them during training never sees half a
file.
"""

from __future__ import annotations

import csv
import math
import os

from numbactr.runtime import atomic

#: model.history key -> (CSV column, chart panel, label); the panels are "loss" and "auc"
SERIES = {
    "loss": ("train_loss", "loss", "train loss"),
    "lr": ("lr", None, "learning rate"),
    "auc": ("eval_auc", "auc", "eval AUC"),
}
#: the iteration key of each history series
ITER_KEY = {"loss": "iter", "lr": "iter", "auc": "eval_iter"}


def _series(history: dict) -> dict:
    """{history key: (iterations, values)} of the series present in history, lengths checked."""
    out = {}
    for key in SERIES:
        if key not in history:
            continue
        its, vals = list(history[ITER_KEY[key]]), list(history[key])
        if len(its) != len(vals):
            raise ValueError(
                f"learning curve: history[{ITER_KEY[key]!r}] has {len(its)} entries but "
                f"history[{key!r}] has {len(vals)}"
            )
        out[key] = ([int(i) for i in its], [float(v) for v in vals])
    return out


def save_history_csv(path, history: dict, reference: dict | None = None) -> str:
    """Write the history (model.history layout) as the CSV described in the module docstring."""
    path = os.fspath(path)
    series = _series(history)
    iters = sorted({i for its, _ in series.values() for i in its})
    table = {key: dict(zip(*series[key])) for key in series}

    with atomic.atomic_write(path, "w", newline="") as f:
        for name, value in (reference or {}).items():
            f.write(f"# {name}: {float(value):.6g}\n")
        w = csv.writer(f)
        w.writerow(["iteration"] + [SERIES[k][0] for k in series])
        for it in iters:
            w.writerow([it] + [_fmt(table[k].get(it)) for k in series])
    return path


def _fmt(v) -> str:
    return "" if v is None else f"{v:.6g}"


def learning_curve_figure(history: dict, reference: dict | None = None, title: str = ""):
    """A matplotlib Figure: train loss (top) and eval AUC with reference lines (bottom)."""
    from matplotlib.figure import Figure

    series = _series(history)
    fig = Figure(figsize=(8, 6.5), dpi=110, layout="constrained")
    ax_loss, ax_auc = fig.subplots(2, 1, sharex=True, height_ratios=(1, 1))
    for ax, panel, ylabel in ((ax_loss, "loss", "training loss"), (ax_auc, "auc", "evaluation AUC")):
        drawn = False
        for key, (_, p, label) in SERIES.items():
            if p != panel or key not in series or not series[key][0]:
                continue
            its, vals = series[key]
            style = dict(marker="o", markersize=4) if panel == "auc" else dict(linewidth=1.2)
            ax.plot(its, vals, label=label, **style)
            drawn = True
        if panel == "auc":
            for k, (name, value) in enumerate((reference or {}).items()):
                ax.axhline(
                    float(value), linestyle="--", color=f"C{k + 3}", linewidth=1.2, label=f"{name} {float(value):.4f}"
                )
                drawn = True
        if not drawn:
            ax.text(
                0.5, 0.5, "nothing recorded", transform=ax.transAxes, ha="center", va="center", color="0.4", fontsize=11
            )
        ax.set_ylabel(ylabel, fontsize=12)
        ax.grid(True, color="0.9")
        ax.tick_params(labelsize=10)
        if drawn:
            ax.legend(fontsize=10, loc="best")
    ax_auc.set_xlabel("iteration", fontsize=12)
    if title:
        fig.suptitle(title, fontsize=14)
    return fig


def save_learning_curve(path, history: dict, reference: dict | None = None, title: str = "") -> tuple[str, str]:
    """Write the chart to `path` (PNG) and the history to the same name with .csv; returns both paths.

    history: model.history ({"iter", "loss", "lr", "eval_iter", "auc"}: lists; missing keys are
    skipped). reference: {label: AUC} drawn as dashed lines (e.g. the Bayes-optimal AUC).
    Non-finite values are kept in the CSV and left out of the chart by matplotlib.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path = os.fspath(path)
    for name, value in (reference or {}).items():
        if not math.isfinite(float(value)):
            raise ValueError(f"learning curve: reference line {name!r} is {value}")
    fig = learning_curve_figure(history, reference, title)
    FigureCanvasAgg(fig)
    with atomic.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    csv_path = save_history_csv(os.path.splitext(path)[0] + ".csv", history, reference)
    return path, csv_path
