"""The one interval type (divstats.ConfidenceInterval) and the one bootstrap-t (resample.bootstrap_t)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import divstats
from divstats.estimation import resample
from divstats.estimation.estimators import aggregate_statistic
from divstats.inference.choices import TESTS
from divstats.inference.effects import mean_difference_t
from divstats.inference.location_tests import studentized_resamples
from divstats.inference.results import Effect
from divstats.intervals import ConfidenceInterval
from divstats.truth.studies import PolicyEffect, simulate_study


def test_confidence_interval_is_scipys_shape():
    from scipy import stats

    scipy_ci = stats.ttest_rel(np.arange(5.0), np.array([1.0, 0.0, 4.0, 2.0, 3.0])).confidence_interval()
    ci = divstats.ConfidenceInterval(1.0, 2.0)
    assert ConfidenceInterval is divstats.ConfidenceInterval and isinstance(ci, tuple)
    assert ci._fields == scipy_ci._fields == ("low", "high") and tuple(ci) == (1.0, 2.0)


def test_every_confidence_interval_is_one():
    rng = np.random.default_rng(1)
    a, b = rng.exponential(size=20), rng.exponential(size=20)
    for test in TESTS:
        res = divstats.paired_test(a, b, test, n_resamples=499)
        ci = res.confidence_interval()
        assert isinstance(ci, ConfidenceInterval) and ci == (res.ci_low, res.ci_high)
        assert res.test_effect == ((res.hodges_lehmann, res.hl_ci_low, res.hl_ci_high) if test == "wilcoxon"
                                   else (res.mean_difference, res.mean_ci_low, res.mean_ci_high))
        for eff in (res.test_effect, res.mean_effect, res.hl_effect):
            assert isinstance(eff.interval, ConfidenceInterval) and eff.confidence_interval() == eff.interval
    m = mean_difference_t(a - b)
    assert isinstance(m, Effect) and m.interval == (m[1], m[2])
    x = rng.exponential(size=(7, 15))
    di = resample.document_interval(tuple(x), aggregate_statistic(12), n_resamples=99)
    assert isinstance(di.confidence_interval, ConfidenceInterval)
    assert di.low is di.confidence_interval.low and di.high is di.confidence_interval.high
    ds = simulate_study(12, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.3)}, horizon=6, replicates=4)
    dec = divstats.decompose(ds, "a", "b").confidence_interval(n_resamples=99)
    assert isinstance(dec.interval, ConfidenceInterval) and dec.interval.low is dec.low
    assert isinstance(dec.share_interval, ConfidenceInterval)


def _old_paired_resamples(d, n_resamples, seed):
    """inference/paired.py's (now location_tests') studentized resamples before there was one bootstrap-t (verbatim)."""
    rng = np.random.default_rng(seed)
    n, mean = d.size, d.mean()
    out = np.empty(n_resamples)
    for start in range(0, n_resamples, 2000):
        x = d[rng.integers(0, n, (min(2000, n_resamples - start), n))]
        m = x.mean(axis=1)
        se = x.std(axis=1, ddof=1) / math.sqrt(n)
        with np.errstate(divide="ignore", invalid="ignore"):
            t = (m - mean) / se
        out[start:start + t.size] = np.nan_to_num(t, nan=0.0, posinf=math.inf, neginf=-math.inf)
    return out


def _old_interval_resamples(arrays, statistic, point, n_resamples, seed):
    """estimation/resample.py's t* before (verbatim, without the quantiles)."""
    n = arrays[0].shape[-1]
    rng = np.random.default_rng(seed)
    ts = []
    batch = max(1, 400_000 // (n * n))
    for start in range(0, n_resamples, batch):
        idx = rng.integers(0, n, (min(batch, n_resamples - start), n))
        xs = tuple(a[..., idx] for a in arrays)
        theta = np.asarray(statistic(*xs), dtype=float)
        se_b = resample._jackknife_se(xs, statistic)
        with np.errstate(invalid="ignore", divide="ignore"):
            ts.append((theta - point.reshape(-1, 1)) / se_b)
    return np.nan_to_num(np.concatenate(ts, axis=-1), nan=0.0, posinf=1e150, neginf=-1e150)


@pytest.mark.parametrize("n", [2, 5, 13, 40])
def test_the_one_bootstrap_t_draws_what_both_old_ones_drew(n):
    rng = np.random.default_rng(n)
    d = np.round(rng.exponential(size=n), 1)   # ties: some resamples have no spread
    np.testing.assert_array_equal(studentized_resamples(d, 4321, 7), _old_paired_resamples(d, 4321, 7))
    arrays = tuple(rng.exponential(size=(7, n)))
    stat = aggregate_statistic(12)
    point = np.asarray(stat(*arrays), dtype=float)
    new = np.nan_to_num(resample.bootstrap_t(arrays, stat, point, 777, 3), posinf=1e150, neginf=-1e150)
    np.testing.assert_array_equal(new, _old_interval_resamples(arrays, stat, point, 777, 3))
