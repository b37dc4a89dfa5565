"""Metrics over all evaluated rows at once: ROC-AUC, AverageLoss and HugeCTR's HitRate / NDCG as HugeCTR
computes them (spec §4.4), and the log loss public benchmarks report."""

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


#: the clipping of log_loss: sklearn's old default ``eps`` and FuxiCTR's, so that a prediction of exactly
#: 0 or 1 costs -log(1e-7) ~ 16.1 instead of infinity
LOG_LOSS_EPS = 1e-7


def log_loss(labels, preds, eps: float = LOG_LOSS_EPS) -> float:
    """Binary cross entropy of probabilities: -mean(y log p + (1 - y) log(1 - p)) over every element, with p
    clipped to [eps, 1 - eps] (as sklearn.metrics.log_loss(eps=1e-7) and FuxiCTR's logloss). Labels may be
    fractional (soft targets). nan when there is no row.

    Args:
        labels: (n,) or (n, C) labels in [0, 1].
        preds: predicted probabilities of the same shape.
        eps: the clipping bound, 0 <= eps < 0.5.
    """
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    p = np.asarray(preds, dtype=np.float64).reshape(-1)
    if y.shape != p.shape:
        raise ValueError(f"log_loss: {y.size} labels vs {p.size} predictions")
    if not 0.0 <= eps < 0.5:
        raise ValueError(f"log_loss: eps must be in [0, 0.5), got {eps}")
    if np.isnan(p).any():
        raise ValueError(f"log_loss: the predictions contain NaN (row {int(np.flatnonzero(np.isnan(p))[0])})")
    if y.size == 0:
        return float("nan")
    p = np.clip(p, eps, 1.0 - eps)
    with np.errstate(divide="ignore", invalid="ignore"):  # eps=0: log(0) where the label makes it count 0
        terms = np.where(y > 0, y * np.log(p), 0.0) + np.where(y < 1, (1.0 - y) * np.log1p(-p), 0.0)
    return float(-terms.mean())


def hugectr_hit_rate(labels, preds) -> float:
    """HugeCTR's MetricsType.HitRate (src/metrics.cu): among the predictions above 0.8, the share whose
    label is 1 (a precision at a fixed threshold, not the HitRate@K of ranking papers). 0 when none is
    above 0.8."""
    y, p = np.asarray(labels, np.float64), np.asarray(preds, np.float64)
    checked = p > 0.8
    return float((y[checked] == 1.0).sum() / max(checked.sum(), 1))


def hugectr_ndcg(labels, preds) -> float:
    """HugeCTR's MetricsType.NDCG: one ranking of every evaluated row by prediction (no groups, no cutoff),
    DCG over the ideal DCG with the labels as gains. 0 when no label is positive."""
    y = np.asarray(labels, np.float64).reshape(-1)
    p = np.asarray(preds, np.float64).reshape(-1)
    disc = 1.0 / np.log2(np.arange(2, y.size + 2))
    dcg = float(np.sum(y[np.argsort(-p, kind="mergesort")] * disc))
    ideal = float(np.sum(np.sort(y)[::-1] * disc))
    return dcg / ideal if ideal > 0 else 0.0
