"""HitRate@K, NDCG@K, group AUC and log loss (numbactr.metrics) against brute-force definitions, He et al.'s
NCF evaluate.py convention, and sklearn's roc_auc_score per group (numbactr.metrics.roc_auc without
sklearn); and MetricAccumulator's grouping over eval batches."""

from __future__ import annotations

import heapq
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from numbactr.enums import MetricsType as M
from numbactr.metrics import (
    MetricAccumulator,
    column_metric,
    group_auc,
    group_ids,
    hit_rate_at_k,
    log_loss,
    ndcg_at_k,
    roc_auc,
    row_group_keys,
)

try:
    from sklearn.metrics import roc_auc_score as reference_auc
except ImportError:  # the project's own exact AUC, itself tested against the pairwise definition
    reference_auc = roc_auc


def _by_group(keys):
    out: dict = {}
    for i, k in enumerate(keys):
        out.setdefault(k, []).append(i)
    return list(out.values())


def brute_positions(y, s):
    """0-based positions the positives of one group take when ties rank them last: for each score v, the
    positives scoring v come after every row scoring more and every negative scoring v."""
    pos = []
    for v in sorted(set(s), reverse=True):
        above = sum(1 for x in s if x > v)
        tied_neg = sum(1 for x, t in zip(s, y) if x == v and t == 0)
        pos += [above + tied_neg + j for j in range(sum(1 for x, t in zip(s, y) if x == v and t == 1))]
    return pos


def brute_hr_ndcg(y, s, keys, k):
    hits, ndcgs = [], []
    for rows in _by_group(keys):
        yy, ss = [y[i] for i in rows], [s[i] for i in rows]
        if sum(yy) == 0:
            continue
        pos = brute_positions(yy, ss)
        hits.append(float(any(p < k for p in pos)))
        ideal = sum(1 / math.log2(j + 2) for j in range(min(k, len(pos))))
        ndcgs.append(sum(1 / math.log2(p + 2) for p in pos if p < k) / ideal)
    return (np.mean(hits), np.mean(ndcgs)) if hits else (math.nan, math.nan)


def brute_gauc(y, s, keys):
    num = den = 0.0
    for rows in _by_group(keys):
        P = [s[i] for i in rows if y[i] == 1]
        N = [s[i] for i in rows if y[i] == 0]
        if not P or not N:
            continue
        wins = sum((p > n) + 0.5 * (p == n) for p in P for n in N)
        num += len(rows) * wins / (len(P) * len(N))
        den += len(rows)
    return num / den if den else math.nan


# scores on a coarse grid so that ties are common
scores = st.integers(0, 6).map(lambda i: i / 6.0)


@st.composite
def grouped_data(draw, max_groups=6, max_size=8):
    sizes = draw(st.lists(st.integers(1, max_size), min_size=1, max_size=max_groups))
    keys = [g for g, n in enumerate(sizes) for _ in range(n)]
    perm = draw(st.permutations(range(len(keys))))  # a group's rows need not be consecutive
    keys = [keys[i] * 7 + 3 for i in perm]  # any key values
    n = len(keys)
    y = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    s = draw(st.lists(scores, min_size=n, max_size=n))
    return np.array(y, np.float64), np.array(s), np.array(keys, np.int64)


@settings(max_examples=150, deadline=None)
@given(grouped_data(), st.integers(1, 9))
def test_hr_ndcg_match_the_brute_force_definition(data, k):
    y, s, keys = data
    hr, nd = brute_hr_ndcg(y.tolist(), s.tolist(), keys.tolist(), k)
    np.testing.assert_allclose(hit_rate_at_k(y, s, keys, k), hr, rtol=1e-12)
    np.testing.assert_allclose(ndcg_at_k(y, s, keys, k), nd, rtol=1e-12)


def he_et_al(pos_score, neg_scores, k):
    """He et al.'s evaluate.py (neural_collaborative_filtering) under Python 3: the positive item appended
    after its negatives, ranked by heapq.nlargest over an item -> score dict."""
    items = list(range(len(neg_scores))) + ["gt"]
    score = dict(zip(items, list(neg_scores) + [pos_score]))
    ranklist = heapq.nlargest(k, score, key=score.get)
    hr = int("gt" in ranklist)
    ndcg = math.log(2) / math.log(ranklist.index("gt") + 2) if hr else 0.0
    return hr, ndcg


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5), st.integers(1, 12), st.integers(1, 14), st.data())
def test_ncf_layout_matches_he_et_al_evaluate(users, negatives, k, data):
    """Every N + 1 consecutive rows: the held-out positive, then its N sampled negatives."""
    s = np.array(data.draw(st.lists(scores, min_size=users * (negatives + 1), max_size=users * (negatives + 1))))
    y = np.tile(np.r_[1.0, np.zeros(negatives)], users)
    ref = [he_et_al(b[0], b[1:], k) for b in s.reshape(users, negatives + 1)]
    assert hit_rate_at_k(y, s, negatives + 1, k) == pytest.approx(np.mean([r[0] for r in ref]), rel=1e-12)
    assert ndcg_at_k(y, s, negatives + 1, k) == pytest.approx(np.mean([r[1] for r in ref]), rel=1e-12)
    # the positive's rank counts every negative scoring at least as much (ties pessimistic)
    blocks = s.reshape(users, negatives + 1)
    rank = (blocks[:, 1:] >= blocks[:, :1]).sum(1)
    assert hit_rate_at_k(y, s, negatives + 1, k) == pytest.approx(np.mean(rank < k))


@settings(max_examples=150, deadline=None)
@given(grouped_data())
def test_group_auc_matches_pairs_and_the_reference_auc_per_group(data):
    y, s, keys = data
    got = group_auc(y, s, keys)
    np.testing.assert_allclose(got, brute_gauc(y.tolist(), s.tolist(), keys.tolist()), rtol=1e-12)
    num = den = 0.0
    for rows in _by_group(keys.tolist()):
        if 0 < y[rows].sum() < len(rows):
            num += len(rows) * reference_auc(y[rows], s[rows])
            den += len(rows)
    np.testing.assert_allclose(got, num / den if den else math.nan, rtol=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=30))
def test_group_auc_of_one_group_with_fractional_labels_is_roc_auc(rows):
    y, s = np.array(rows).T
    want = roc_auc(y, s)
    got = group_auc(y, s, np.zeros(len(y), np.int64))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 1.0, 0.25]), st.floats(0, 1)), min_size=1, max_size=40))
def test_log_loss_is_clipped_binary_cross_entropy(rows):
    y, p = np.array(rows).T
    want = 0.0
    for t, q in zip(y, p):
        q = min(max(q, 1e-7), 1 - 1e-7)
        want -= t * math.log(q) + (1 - t) * math.log(1 - q)
    assert log_loss(y, p) == pytest.approx(want / len(y), rel=1e-9, abs=1e-12)


def test_known_values_and_conventions():
    # two users: the positive ties with a negative (rank 1), the positive is behind 1 and tied with 1 (rank 2)
    y = np.array([1, 0, 0, 0, 0, 1, 0, 0.0])
    s = np.array([0.5, 0.5, 0.1, 0.2, 0.9, 0.3, 0.3, 0.1])
    assert hit_rate_at_k(y, s, 4, 1) == 0.0 and hit_rate_at_k(y, s, 4, 2) == 0.5
    assert ndcg_at_k(y, s, 4, 3) == pytest.approx((1 / math.log2(3) + 1 / math.log2(4)) / 2)
    assert group_auc(y, s, 4) == pytest.approx((4 * 5 / 6 + 4 * 0.5) / 8)
    # constant scores never hit (ties rank the positive last)
    assert hit_rate_at_k(y, np.zeros(8), 4, 3) == 0.0
    # a group without a positive is skipped by HR/NDCG; a one-class group by gAUC
    y2 = np.r_[y, 0, 0]
    s2 = np.r_[s, 0.4, 0.6]
    keys = np.array([1, 1, 1, 1, 2, 2, 2, 2, 3, 3])
    assert hit_rate_at_k(y2, s2, keys, 2) == 0.5 and group_auc(y2, s2, keys) == group_auc(y, s, 4)
    assert math.isnan(group_auc(np.ones(4), s[:4], 2)) and math.isnan(ndcg_at_k(np.zeros(4), s[:4], 2))
    assert log_loss([1, 0], [1.0, 0.0]) == pytest.approx(-math.log(1 - 1e-7))
    assert math.isnan(log_loss([], []))


def test_bad_input_is_named():
    y, s = np.array([1, 0, 0, 1, 0.0]), np.arange(5.0)
    with pytest.raises(ValueError, match=r"5 rows are not whole groups of 2 consecutive rows \(2 groups and 1"):
        hit_rate_at_k(y, s, 2)
    with pytest.raises(ValueError, match="5 rows need 5 group keys"):
        group_auc(y, s, np.zeros(4))
    with pytest.raises(ValueError, match="labels must be 0 or 1.*0.5 at row 2"):
        ndcg_at_k(np.array([1, 0, 0.5, 0, 0]), s, 5)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        hit_rate_at_k(y, s, 5, 0)
    with pytest.raises(ValueError, match=r"NaN \(row 1\)"):
        group_auc(y, np.array([0, np.nan, 1, 2, 3.0]), 5)
    with pytest.raises(ValueError, match="group size must be > 0"):
        group_ids(5, 0)
    with pytest.raises(ValueError, match="no groups were given"):
        column_metric(M.GroupAUC, y[:, None], s[:, None])


def test_row_group_keys_reads_one_slot_over_several_inputs():
    # input 0: 1 slot; input 1: 2 slots (global slots 1 and 2); 3 samples
    in0 = (np.array([10, 11, 12]), np.array([0, 1, 2, 3]))
    in1 = (np.array([5, 70, 6, 71, 7, 72]), np.array([0, 1, 2, 3, 4, 5, 6]))
    np.testing.assert_array_equal(row_group_keys([in0, in1], [1, 2], 2, 3, "t"), [70, 71, 72])
    np.testing.assert_array_equal(row_group_keys([in0, in1], [1, 2], 0, 2, "t"), [10, 11])
    with pytest.raises(ValueError, match=r"t: slot 3 does not exist; the data has 3 sparse slots \(0..2\)"):
        row_group_keys([in0, in1], [1, 2], 3, 3, "t")
    multi = (np.array([1, 2, 3]), np.array([0, 2, 3]))
    with pytest.raises(ValueError, match="sample 0 of the batch holds 2 keys in the group slot"):
        row_group_keys([multi], [1], 0, 2, "t")


def test_accumulator_groups_rows_over_batches():
    rng = np.random.default_rng(0)
    y = np.tile(np.r_[1.0, np.zeros(4)], 6)[:, None]
    p = rng.random((30, 1))
    spec = {M.AUC: 1.0, M.HitRateAtK: 1.0, M.NDCGAtK: 1.0, M.GroupAUC: 1.0, M.LogLoss: 1.0}
    acc = MetricAccumulator(spec, k=2, group_size=5)
    assert not acc.wants_group_keys
    for a, b in ((0, 10), (10, 25), (25, 30)):  # batches need not hold whole groups
        acc.add(p[a:b], y[a:b], 0.0)
    got = dict(acc.finalize())
    assert list(got) == ["AUC", "HitRate@2", "NDCG@2", "GroupAUC", "LogLoss"]
    assert got["HitRate@2"] == hit_rate_at_k(y, p, 5, 2) and got["NDCG@2"] == ndcg_at_k(y, p, 5, 2)
    assert got["GroupAUC"] == group_auc(y, p, 5) and got["LogLoss"] == log_loss(y, p)
    assert got["AUC"] == roc_auc(y, p)
    # grouped by keys: rows of a user anywhere in the eval
    keys = np.repeat(np.arange(6), 5)[::-1]
    acc = MetricAccumulator(spec, k=2, group_slot=3)
    assert acc.wants_group_keys
    acc.add(p[:12], y[:12], 0.0, keys[:12])
    with pytest.raises(ValueError, match=r"18 rows need 18 group keys \(eval_group_slot=3\), got None"):
        acc.add(p[12:], y[12:], 0.0)
    acc.add(p[12:], y[12:], 0.0, keys[12:])
    assert dict(acc.finalize())["GroupAUC"] == group_auc(y, p, keys)


def test_accumulator_refuses_a_partial_group_and_starts_afresh():
    acc = MetricAccumulator({M.HitRateAtK: 1.0}, k=3, group_size=4)
    acc.add(np.zeros((6, 1)), np.zeros((6, 1)), 0.0)
    with pytest.raises(ValueError, match=r"the 6 evaluated rows \(eval_group_size=4\): 6 rows are not whole groups"):
        acc.finalize()
    assert acc.preds == []  # reset even so
    acc.add(np.arange(4.0)[:, None], np.array([[0], [0], [0], [1.0]]), 0.0)
    assert acc.finalize() == [("HitRate@3", 1.0)]
