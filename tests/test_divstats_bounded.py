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


@pytest.mark.parametrize("n", [10, 30])
def test_margin_test_by_betting_keeps_its_size_at_the_margin(n):
    # differences of two [0, 1] quantities, true mean exactly on the margin (the worst case): the
    # non-inferiority test's rejection rate stays <= alpha + 2 SE (it is <= alpha by Markov)
    from divstats.inference.margins import margin_test
    rng = np.random.default_rng(n)
    delta, sims = 0.05, 300
    a = np.where(rng.random((sims, n)) < 0.5, rng.beta(2, 8, (sims, n)), 0.0)      # skewed, mean 0.1
    b = np.clip(a - 0.05 + 0.02 * rng.standard_normal((sims, n)), 0, 1)
    d = a - b
    d = d - d.mean() + delta            # centred on the margin over the whole simulation
    d = np.clip(d, -1, 1)
    rejected = [margin_test(row, "bootstrap-t", "noninferiority", delta, bounds=(-1.0, 1.0)).pvalue <= 0.05
                for row in d]
    assert np.mean(rejected) <= 0.05 + 2 * np.sqrt(0.05 * 0.95 / sims)


def test_margin_test_by_betting_can_show_non_inferiority_and_agrees_with_its_bound():
    from divstats.inference.margins import margin_test
    d = np.zeros(40)                                    # a policy that never diverged, vs the full model's 0
    res = margin_test(d, "bootstrap-t", "noninferiority", 0.1, bounds=(0.0, 1.0))
    assert res.details["method"] == "betting" and res.verdict == "non-inferior at margin 0.1"
    assert res.confidence_interval().high < 0.1 and res.pvalue <= 0.05
    far = margin_test(np.full(40, 0.3), "bootstrap-t", "noninferiority", 0.1, bounds=(0.0, 1.0))
    assert far.pvalue > 0.05 and far.confidence_interval().high > 0.1
    eq = margin_test(np.zeros(40), "bootstrap-t", "equivalence", 0.2, bounds=(-1.0, 1.0))
    assert eq.verdict == "equivalent within ±0.2" and -0.2 < eq.confidence_interval().low


def test_certify_budget_uses_betting_below_fifty_documents():
    from divstats.inference.certify import certify_budget
    v = np.zeros((40, 3))
    v[:, 2] = 0.4
    res = certify_budget(v, 0.1, budgets=["a@0.9", "a@0.5", "a@0.1"], bounds=(0.0, 1.0), n_resamples=99)
    assert res.certified == "a@0.5" and res.tested == 3
    v[:, :2] += np.linspace(0, 0.01, 40)[:, None]     # bootstrap-t needs a spread
    refused = certify_budget(v, 0.1, budgets=["a@0.9", "a@0.5", "a@0.1"], n_resamples=99)
    assert refused.certified is None and "n = 40 documents" in refused.reason


# ---------------------------------------------------------------------------------------------
# every estimate inside its own interval (results.nc, the report and the summary read these)
# ---------------------------------------------------------------------------------------------

def _estimate_outside(agg, ci):
    from divstats.estimation.estimators import INTERVAL_QUANTITIES
    bad = []
    for q in INTERVAL_QUANTITIES:
        est, lo, hi = (np.asarray(x, dtype=float) for x in (agg[q], ci[q + "_low"], ci[q + "_high"]))
        shown = np.isfinite(est) & np.isfinite(lo) & np.isfinite(hi)
        tol = 1e-9 * np.maximum(1.0, np.abs(est))
        if np.any(shown & ((est < lo - tol) | (est > hi + tol))):
            bad.append(q)
    return bad


@pytest.mark.parametrize("kind", ["coupled", "residual"])
def test_every_estimate_lies_in_its_interval_over_simulated_studies(kind):
    import divstats
    from divstats.truth.studies import PolicyEffect, simulate_study
    policies = {"mild": PolicyEffect(0.02), "mid": PolicyEffect(0.4), "harsh": PolicyEffect(3.0)}
    for n, seed in ((6, 0), (12, 1), (25, 2)):
        ds = simulate_study(n, policies, horizon=6, replicates=2, kind=kind, seed=seed, vocab_size=3)
        est = divstats.estimate(ds)
        agg, ci = divstats.aggregate(est), divstats.aggregate_intervals(est, n_resamples=199)
        assert not _estimate_outside(agg, ci), (n, seed)
        # ratios above 1: residual traces' Monte Carlo weighting can put per-document rates above 1;
        # here post_mismatch is scaled so that the aggregate rate exceeds 1 too
        big = est.copy()
        big["post_mismatch"] = est["post_mismatch"] * 2.5
        agg, ci = divstats.aggregate(big), divstats.aggregate_intervals(big, n_resamples=199)
        if n >= 10:
            assert float(agg["rate"].max()) > 1
        assert not _estimate_outside(agg, ci), (n, seed, "scaled")
        assert "unclipped" in ci["rate_low"].attrs["scale"]


def test_speculative_target_calls_get_the_bounded_interval():
    from divstats.estimation.speculative import aggregate_speculative, speculative
    from divstats.truth.studies import PolicyEffect, simulate_study
    for n, how in ((6, "betting"), (25, None)):
        ds = simulate_study(n, {"a": PolicyEffect(0.3)}, horizon=8, replicates=10, kind="reference", seed=1)
        agg = aggregate_speculative(speculative(ds, gamma=(2, 4)))
        est, lo, hi = (agg[f"target_calls{s}"].values for s in ("", "_low", "_high"))
        assert np.all((1 <= lo) & (lo <= est) & (est <= hi) & (hi <= 8))
        assert how is None or agg.attrs["target_calls_method"] == how
        assert np.isnan(agg["tokens_per_call_low"].values).all() == (n < 10)    # the ratios: refused below 10


def test_one_sided_paired_test_below_fifty_is_the_betting_test_and_keeps_its_size():
    from divstats.inference.paired import paired_test
    rng = np.random.default_rng(11)
    sims, n = 300, 12
    # skewed differences of [0, 1] quantities with mean exactly 0 (the null's boundary)
    a = np.where(rng.random((sims, n)) < 0.3, rng.beta(2, 3, (sims, n)), 0.0)
    d = a - a.mean()
    d = np.clip(d, -1, 1)
    p = np.array([paired_test(row, 0.0, "bootstrap-t", "greater", bounds=(-1.0, 1.0)).pvalue for row in d])
    assert np.mean(p <= 0.05) <= 0.05 + 2 * np.sqrt(0.05 * 0.95 / sims)
    res = paired_test(np.full(30, 0.4) + np.linspace(0, 0.1, 30), 0.0, "bootstrap-t", "greater", bounds=(-1.0, 1.0))
    assert res.details["method"] == "betting" and res.pvalue <= 0.05 and res.confidence_interval().low > 0
    assert res.confidence_interval().high == np.inf
    refused = paired_test(np.linspace(0.3, 0.5, 30), 0.0, "bootstrap-t", "greater")      # no range: refused
    assert np.isnan(refused.pvalue) and "need ≥ 50" in refused.reason
