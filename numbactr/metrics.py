"""Evaluation metrics as HugeCTR computes them (spec §4.4)."""

from __future__ import annotations

import numpy as np


def roc_auc(labels, scores) -> float:
    """Exact ROC-AUC: sort by score, tied scores merged, trapezoidal rule; fractional labels act as
    weights (positive weight y, negative weight 1-y), as HugeCTR's metrics.cu. Equals
    sklearn.roc_auc_score for 0/1 labels. Returns nan when one class is absent."""
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ValueError(f"roc_auc: {y.size} labels vs {s.size} scores")
    if np.isnan(s).any():
        raise ValueError("roc_auc: scores contain NaN")
    order = np.argsort(-s, kind="mergesort")
    s, y = s[order], y[order]
    # last index of each run of equal scores: tied predictions form one ROC step
    ends = np.r_[np.nonzero(np.diff(s))[0], s.size - 1] if s.size else np.array([], dtype=np.int64)
    tp = np.cumsum(y)[ends]
    fp = np.cumsum(1.0 - y)[ends]
    if s.size == 0 or tp[-1] <= 0 or fp[-1] <= 0:
        return float("nan")
    tp = np.r_[0.0, tp] / tp[-1]
    fp = np.r_[0.0, fp] / fp[-1]
    return float(np.sum((fp[1:] - fp[:-1]) * (tp[1:] + tp[:-1]) / 2.0))


def average_loss(losses, rows) -> float:
    """The AverageLoss metric over eval batches with mean losses `losses` over `rows` valid rows each.

    Default: sum(rows_b * loss_b) / sum(rows_b), the mean loss of the evaluated samples (each batch's
    loss is the mean over its valid rows plus the regularizer term, which is the same for every batch,
    so it is added once). HugeCTR (src/metrics.cu, AverageLoss::finalize_metric) returns the plain mean
    of the per-batch losses, which over-weights a partial last batch; numbactr.hugectr_exact.hugectr_exact()
    gives that. nan when there is no batch.
    """
    from numbactr import hugectr_exact

    losses = np.asarray(losses, np.float64)
    rows = np.asarray(rows, np.float64)
    if losses.size == 0:
        return float("nan")
    if hugectr_exact.hugectr_exact():
        return float(losses.mean())
    if rows.sum() <= 0:
        return float("nan")
    return float(np.dot(losses, rows) / rows.sum())


class MetricAccumulator:
    """Collects eval predictions/labels/losses between two get_eval_metrics() calls."""

    def __init__(self, metrics_spec: dict):
        self.spec = metrics_spec
        self.reset()

    def reset(self) -> None:
        self.preds, self.labels, self.losses, self.rows = [], [], [], []

    def add(self, preds: np.ndarray, labels: np.ndarray, loss: float) -> None:
        """One eval batch: preds/labels (n, C) of its n valid rows (all ranks'), loss its mean loss over
        those rows (+ the regularizer term)."""
        self.preds.append(np.asarray(preds, np.float64).reshape(len(preds), -1))
        self.labels.append(np.asarray(labels, np.float64).reshape(len(labels), -1))
        self.losses.append(float(loss))
        self.rows.append(len(preds))

    def finalize(self) -> list[tuple[str, float]]:
        """[(name, value)] in MetricsType order (AUC, AverageLoss, HitRate, NDCG, SMAPE), then reset."""
        from numbactr.enums import MetricsType as M

        out = []
        p = np.concatenate(self.preds) if self.preds else np.zeros((0, 1))
        y = np.concatenate(self.labels) if self.labels else np.zeros((0, 1))
        for m in M:
            if m not in self.spec:
                continue
            if m == M.AUC:
                aucs = [roc_auc(y[:, c], p[:, c]) for c in range(p.shape[1])]
                out.append(("AUC", float(np.mean(aucs))))
            elif m == M.AverageLoss:
                out.append(("AverageLoss", average_loss(self.losses, self.rows)))
            elif m == M.HitRate:
                checked = p > 0.8
                out.append(("HitRate", float((y[checked] == 1.0).sum() / max(checked.sum(), 1))))
            elif m == M.NDCG:
                out.append(("NDCG", _ndcg(y.reshape(-1), p.reshape(-1))))
            elif m == M.SMAPE:
                denom = (p + y) / 2.0
                ok = denom != 0
                out.append(("SMAPE", float(np.sum(np.abs(p - y)[ok] / denom[ok]))))
        self.reset()
        return out


def _ndcg(y: np.ndarray, p: np.ndarray) -> float:
    disc = 1.0 / np.log2(np.arange(2, y.size + 2))
    dcg = float(np.sum(y[np.argsort(-p, kind="mergesort")] * disc))
    ideal = float(np.sum(np.sort(y)[::-1] * disc))
    return dcg / ideal if ideal > 0 else 0.0
