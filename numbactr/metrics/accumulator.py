"""MetricAccumulator: what Model.get_eval_metrics() reports, collected over the eval batches between two
calls; and column_metric, one metric of predictions against labels (shared with ``numbactr predict``)."""

from __future__ import annotations

import numpy as np

from numbactr.enums import MetricsType as M
from numbactr.metrics.grouped import group_auc, group_ids, hit_rate_at_k, ndcg_at_k
from numbactr.metrics.pointwise import average_loss, hugectr_hit_rate, hugectr_ndcg, log_loss, roc_auc

#: the metrics that score groups of rows, one group per user; they need eval_group_size or eval_group_slot
GROUPED = (M.HitRateAtK, M.NDCGAtK, M.GroupAUC)


def metric_name(m, k: int = 10) -> str:
    """The name get_eval_metrics() and ``numbactr predict`` give metric m: HugeCTR's member names, and
    ``HitRate@K`` / ``NDCG@K`` for the ranking metrics with cutoff k."""
    return {M.HitRateAtK: f"HitRate@{k}", M.NDCGAtK: f"NDCG@{k}"}.get(m, m.name)


def column_metric(m, labels: np.ndarray, preds: np.ndarray, groups=None, k: int = 10) -> float:
    """Metric m (any MetricsType but AverageLoss) of preds against labels, both (n, C): a metric defined
    per column (AUC, the grouped ones) is the mean over the C columns (HugeCTR's AUC of label_dim > 1).

    Args:
        m: the MetricsType member.
        labels, preds: (n, C) float arrays.
        groups: for GROUPED metrics, a group size or (n,) group keys (numbactr.metrics.grouped.group_ids).
        k: the cutoff of HitRateAtK / NDCGAtK.
    """
    y, p = np.asarray(labels, np.float64), np.asarray(preds, np.float64)
    if m in GROUPED and groups is None:
        raise ValueError(f"{metric_name(m, k)}: scores groups of rows (users) and no groups were given")
    if m == M.AUC:
        return float(np.mean([roc_auc(y[:, c], p[:, c]) for c in range(p.shape[1])]))
    if m == M.HitRate:
        return hugectr_hit_rate(y, p)
    if m == M.NDCG:
        return hugectr_ndcg(y, p)
    if m == M.SMAPE:
        denom = (p + y) / 2.0
        ok = denom != 0
        return float(np.sum(np.abs(p - y)[ok] / denom[ok]))
    if m == M.LogLoss:
        return log_loss(y, p)
    one = {
        M.HitRateAtK: lambda c: hit_rate_at_k(y[:, c], p[:, c], groups, k),
        M.NDCGAtK: lambda c: ndcg_at_k(y[:, c], p[:, c], groups, k),
        M.GroupAUC: lambda c: group_auc(y[:, c], p[:, c], groups),
    }
    if m not in one:
        raise ValueError(f"column_metric: {m!r} is not a metric of predictions and labels")
    return float(np.mean([one[m](c) for c in range(p.shape[1])]))


class MetricAccumulator:
    """Collects eval predictions/labels/losses (and the rows' group keys) between two get_eval_metrics()
    calls.

    Args:
        metrics_spec: {MetricsType: threshold} as CreateSolver's metrics_spec.
        k: the cutoff K of HitRateAtK / NDCGAtK (CreateSolver's metrics_k).
        group_size: > 0: every group_size consecutive evaluated rows are one group (eval_group_size);
            rows are counted from the last finalize/reset, so an evaluation must start on a group boundary.
        group_slot: the sparse slot whose key is each row's group id (eval_group_slot); add() then takes
            the keys.
    """

    def __init__(self, metrics_spec: dict, k: int = 10, group_size: int = 0, group_slot: int | None = None):
        self.spec = metrics_spec
        self.k, self.group_size, self.group_slot = int(k), int(group_size), group_slot
        self.reset()

    @property
    def wants_group_keys(self) -> bool:
        """True when add() needs each row's group key (a grouped metric grouped by a slot's key)."""
        return self.group_slot is not None and any(m in self.spec for m in GROUPED)

    def reset(self) -> None:
        self.preds, self.labels, self.losses, self.rows, self.groups = [], [], [], [], []

    def add(self, preds: np.ndarray, labels: np.ndarray, loss: float, groups=None) -> None:
        """One eval batch: preds/labels (n, C) of its n valid rows (all ranks'), loss its mean loss over
        those rows (+ the regularizer term), groups the (n,) group keys of those rows when
        wants_group_keys."""
        if self.wants_group_keys:  # checked first: a refused batch leaves nothing behind
            if groups is None or len(groups) != len(preds):
                raise ValueError(
                    f"MetricAccumulator.add: {len(preds)} rows need {len(preds)} group keys "
                    f"(eval_group_slot={self.group_slot}), got {None if groups is None else len(groups)}"
                )
            self.groups.append(np.asarray(groups).reshape(-1))
        self.preds.append(np.asarray(preds, np.float64).reshape(len(preds), -1))
        self.labels.append(np.asarray(labels, np.float64).reshape(len(labels), -1))
        self.losses.append(float(loss))
        self.rows.append(len(preds))

    def finalize(self) -> list[tuple[str, float]]:
        """[(name, value)] in MetricsType order (HugeCTR's AUC, AverageLoss, HitRate, NDCG, SMAPE, then
        numbactr's HitRate@K, NDCG@K, GroupAUC, LogLoss), then reset."""
        p = np.concatenate(self.preds) if self.preds else np.zeros((0, 1))
        y = np.concatenate(self.labels) if self.labels else np.zeros((0, 1))
        losses, rows, keys = self.losses, self.rows, self.groups
        self.reset()  # before anything can raise: the next evaluation starts afresh either way
        groups = None
        if self.group_size > 0:
            groups = self.group_size
        elif self.wants_group_keys:
            groups = np.concatenate(keys) if keys else np.zeros(0, np.int64)
        if groups is not None and any(m in self.spec for m in GROUPED):
            where = f"eval_group_size={self.group_size}" if self.group_size else f"eval_group_slot={self.group_slot}"
            group_ids(len(p), groups, f"the {len(p)} evaluated rows ({where})")  # whole groups, or a clear error
        out = []
        for m in M:
            if m not in self.spec:
                continue
            if m == M.AverageLoss:
                value = average_loss(losses, rows)
            else:
                value = column_metric(m, y, p, groups, self.k)
            out.append((metric_name(m, self.k), value))
        return out
