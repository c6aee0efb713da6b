"""The betting interval for bounded means (divstats.estimation.bounded), against exact properties:
coverage by simulation on laws at and near the bounds, Clopper–Pearson's scale on 0/1 data, the
Markov bound on the e-value, monotonicity in the level and the data, invariance to document order."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from divstats.estimation.bounded import (
    MIN_DOCS_BOUNDED,
    betting_evalue,
    betting_interval,
    betting_pvalue,
    bounded_mean_interval,
    in_range,
)


def _covers(ci, mu):
    return (ci.low <= mu) & (mu <= ci.high)


@pytest.mark.parametrize(("draw", "mu"), [
    (lambda rng, s: np.where(rng.random(s) < 0.75, 0.998, rng.beta(8, 2, s)), 0.75 * 0.998 + 0.25 * 0.8),
    (lambda rng, s: (rng.random(s) < 0.9).astype(float), 0.9),            # 0/1 documents at a bound
    (lambda rng, s: np.where(rng.random(s) < 0.8, 0.0, rng.random(s)), 0.1),
    (lambda rng, s: rng.beta(2, 6, s), 0.25),
])
@pytest.mark.parametrize("n", [5, 10, 30])
def test_coverage_by_simulation(draw, mu, n):
    # valid at every n for every law on [0, 1]: 400 studies, coverage >= 0.95 - 2 SE (0.928)
    x = draw(np.random.default_rng(n), (400, n))
    ci = betting_interval(x, n_permutations=8)
    assert _covers(ci, mu).mean() >= 0.928
    assert np.all((ci.low >= 0) & (ci.high <= 1) & (ci.low <= x.mean(-1)) & (x.mean(-1) <= ci.high))


def test_near_bound_not_the_whole_range_and_narrower_than_a_third():
    # the case: the demo's ten snapkv@0.3 occurrences, where hybrid-t gave [0, 1]
    x = np.array([0.999, 0.998, 1.0, 0.999, 0.841, 0.998, 0.999, 1.0, 0.998, 0.999])
    ci = betting_interval(x)
    assert ci.high == 1.0 and 0.6 < ci.low < x.mean()
    assert ci.high - ci.low < 0.4


def test_zero_one_data_on_clopper_pearsons_scale():
    # no interval valid for every law on [0, 1] can beat Clopper-Pearson on 0/1 data by much; the
    # betting interval lies within a small factor of it and contains it at the all-ones extreme
    for n in (10, 30, 100):
        x = np.ones(n)
        cp = stats.binomtest(n, n).proportion_ci(0.95, method="exact")
        ci = betting_interval(x)
        assert ci.low <= cp.low + 1e-12 and ci.high == 1.0
        assert (1 - ci.low) < 1.6 * (1 - cp.low)
    x = np.r_[np.ones(15), np.zeros(15)]
    cp = stats.binomtest(15, 30).proportion_ci(0.95, method="exact")
    ci = betting_interval(x)
    assert ci.low < 0.5 < ci.high and (ci.high - ci.low) < 1.5 * (cp.high - cp.low)


def test_evalue_is_an_evalue_and_pvalue_keeps_its_size():
    # under the null E[e-value] <= 1 (the product of fair bets), so P(p <= alpha) <= alpha
    rng = np.random.default_rng(3)
    x = rng.beta(0.5, 0.5, (3000, 8))
    e = betting_evalue(x, 0.5, n_permutations=4)
    assert e.mean() <= 1.05
    for alt in ("less", "greater"):
        p = betting_pvalue(x, 0.5, alternative=alt, n_permutations=4)
        assert (p <= 0.05).mean() <= 0.05 + 2 * np.sqrt(0.05 * 0.95 / 3000)


def test_pvalue_and_interval_agree():
    x = np.random.default_rng(4).beta(2, 5, 25)
    ci = betting_interval(x)
    assert betting_pvalue(x, ci.low - 1e-3) <= 0.05 + 1e-9
    assert betting_pvalue(x, ci.low + 1e-3) > 0.05
    lower = betting_interval(x, alternative="greater")
    assert lower.high == 1.0 and lower.low > ci.low     # one side: a tighter bound
    assert betting_pvalue(x, lower.low - 1e-3, alternative="greater") <= 0.05 + 1e-9


def test_monotone_in_level_and_data_and_range():
    x = np.random.default_rng(5).beta(3, 3, 20)
    wide, narrow = betting_interval(x, level=0.99), betting_interval(x, level=0.8)
    assert wide.low < narrow.low < narrow.high < wide.high
    shifted = betting_interval(np.minimum(x + 0.05, 1.0))
    assert shifted.low > betting_interval(x).low
    # affine in the range: values on [0, T] give T times the [0, 1] interval
    scaled = betting_interval(7 * x, 0.0, 7.0)
    assert np.allclose(np.array(scaled), 7 * np.array(betting_interval(x)))
    # a difference of [0, 1] quantities on [-1, 1]
    d = 2 * x - 1
    assert np.allclose(np.array(betting_interval(d, -1.0, 1.0)), 2 * np.array(betting_interval(x)) - 1)


def test_order_of_documents_barely_matters_and_seed_reproduces():
    x = np.random.default_rng(6).beta(2, 2, 15)
    a, b = betting_interval(x), betting_interval(x[::-1])
    assert abs(a.low - b.low) < 0.03 and abs(a.high - b.high) < 0.03
    assert betting_interval(x) == a


def test_refusals_and_errors():
    with pytest.raises(ValueError, match="outside the range"):
        betting_interval(np.array([0.5, 1.2]))
    with pytest.raises(ValueError, match="outside the range"):
        bounded_mean_interval(np.array([0.5, 1.2] * 6), 0.0, 1.0)
    ci = bounded_mean_interval(np.ones(MIN_DOCS_BOUNDED - 1), 0.0, 1.0)
    assert ci.reason.startswith("not estimable") and np.isnan(ci.low[0])
    assert bounded_mean_interval(np.ones(MIN_DOCS_BOUNDED), 0.0, 1.0).low[0] > 0.3
    assert in_range(np.array([0.0, 1.0 + 1e-12]), 0, 1) and not in_range(np.array([1.01]), 0, 1)


def test_rule_takes_betting_near_the_bound_and_resampling_inside():
    near = np.array([0.999, 0.998, 1.0, 0.999, 0.841, 0.998, 0.999, 1.0, 0.998, 0.999] * 2)
    assert bounded_mean_interval(near, 0.0, 1.0, n_resamples=499).method == "betting"
    inner = np.random.default_rng(7).beta(4, 4, 30)
    ci = bounded_mean_interval(inner, 0.0, 1.0, n_resamples=499)
    assert ci.method == "hybrid-t" and ci.low[0] < inner.mean() < ci.high[0]
