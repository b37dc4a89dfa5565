"""Evaluation metrics, pure NumPy.

* numbactr.metrics.pointwise: over all rows at once: ROC-AUC, AverageLoss, HugeCTR's HitRate and NDCG
  (spec §4.4), log loss;
* numbactr.metrics.grouped: over groups of rows (users): HitRate@K and NDCG@K of a ranking with sampled
  negatives (the NCF protocol), group AUC (DIN, BARS/FuxiCTR);
* numbactr.metrics.accumulator: MetricAccumulator, what Model.get_eval_metrics() reports.
"""

from numbactr.metrics.accumulator import GROUPED, MetricAccumulator, column_metric, metric_name
from numbactr.metrics.grouped import group_auc, group_ids, hit_rate_at_k, ndcg_at_k, row_group_keys
from numbactr.metrics.pointwise import LOG_LOSS_EPS, average_loss, hugectr_hit_rate, hugectr_ndcg, log_loss, roc_auc

__all__ = [
    "GROUPED",
    "LOG_LOSS_EPS",
    "MetricAccumulator",
    "average_loss",
    "column_metric",
    "group_auc",
    "group_ids",
    "hit_rate_at_k",
    "hugectr_hit_rate",
    "hugectr_ndcg",
    "log_loss",
    "metric_name",
    "ndcg_at_k",
    "roc_auc",
    "row_group_keys",
]
