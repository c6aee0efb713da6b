"""Tests at a margin: equivalence (TOST) and non-inferiority in divstats.paired_test (docs/statistics.md §8)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from divstats.calibration.coverage import margin_calibration
from divstats.estimation.resample import MIN_DOCS_MARGIN, MIN_DOCS_MARGIN_T
from divstats.inference.margins import margin_test, margin_verdict
from divstats.inference.paired import paired_test


def _diffs(n: int, mean: float, sd: float = 0.05, seed: int = 0) -> np.ndarray:
    return mean + sd * np.random.default_rng(seed).standard_normal(n)


@pytest.mark.parametrize("mean", [0.0, 0.02, -0.03, 0.05])
def test_tost_t_matches_a_hand_computation(mean):
    d = _diffs(60, mean)
    delta, alpha = 0.05, 0.05
    res = margin_test(d, "ttest", "equivalence", delta, confidence_level=1 - alpha, min_docs=2)
    p_lo = stats.ttest_1samp(d, -delta, alternative="greater").pvalue
    p_hi = stats.ttest_1samp(d, delta, alternative="less").pvalue
    assert res.pvalue == pytest.approx(max(p_lo, p_hi), rel=1e-12)
    se = d.std(ddof=1) / math.sqrt(d.size)
    q = stats.t.ppf(1 - alpha, d.size - 1)
    ci = res.confidence_interval()
    assert (ci.low, ci.high) == pytest.approx((d.mean() - q * se, d.mean() + q * se), rel=1e-12)
    assert res.confidence_level == pytest.approx(0.90)
    assert res.margin == delta and res.alternative == "equivalence"
    inside = -delta < ci.low and ci.high < delta
    assert (res.pvalue <= alpha) == inside
    assert res.verdict == ("equivalent within ±0.05" if inside else "not shown equivalent at this size")


@pytest.mark.parametrize("test", ["ttest", "bootstrap-t"])
def test_tost_rejects_exactly_when_the_interval_is_inside_the_margins(test):
    seen = set()
    for seed in range(12):
        d = _diffs(60, (seed % 4 - 1.5) * 0.03, seed=seed)
        res = margin_test((d + 1.0) - np.full(d.size, 1.0), test, "equivalence", 0.05, n_resamples=999,
                          seed=seed, min_docs=2)
        inside = -0.05 < res.ci_low and res.ci_high < 0.05
        assert (res.pvalue <= 0.05) == inside
        assert res.details["p_lower"] <= res.pvalue and res.details["p_upper"] <= res.pvalue
        seen.add(inside)
    assert seen == {True, False}   # both outcomes exercised


def test_bootstrap_t_tost_is_its_two_one_sided_tests():
    d = _diffs(55, 0.01, seed=3)
    res = paired_test(d, 0.0, "bootstrap-t", "equivalence", margin=0.04, n_resamples=999, seed=7)
    lower = paired_test(d + 0.04, 0.0, "bootstrap-t", "greater", n_resamples=999, seed=7)
    upper = paired_test(d - 0.04, 0.0, "bootstrap-t", "less", n_resamples=999, seed=7)
    assert res.pvalue == max(lower.pvalue, upper.pvalue)
    assert res.ci_low == pytest.approx(lower.ci_low - 0.04) and res.ci_high == pytest.approx(upper.ci_high + 0.04)


def test_noninferiority_direction_follows_worse():
    d = _diffs(60, 0.01, seed=1)
    larger = margin_test(d, "ttest", "noninferiority", 0.05, "larger", min_docs=2)
    assert larger.pvalue == pytest.approx(stats.ttest_1samp(d, 0.05, alternative="less").pvalue, rel=1e-12)
    assert larger.ci_low == -math.inf and larger.ci_high < 0.05 and larger.verdict == "non-inferior at margin 0.05"
    smaller = margin_test(-d, "ttest", "noninferiority", -0.05, "smaller", min_docs=2)
    assert smaller.pvalue == pytest.approx(stats.ttest_1samp(-d, -0.05, alternative="greater").pvalue, rel=1e-12)
    assert smaller.ci_high == math.inf and smaller.verdict == "non-inferior at margin -0.05"
    # the same margin written as a magnitude
    assert margin_test(-d, "ttest", "noninferiority", 0.05, "smaller", min_docs=2).pvalue == smaller.pvalue
    # a policy clearly worse is not shown non-inferior
    worse = margin_test(d + 0.06, "ttest", "noninferiority", 0.05, min_docs=2)
    assert worse.pvalue > 0.05 and worse.verdict == "not shown non-inferior at margin 0.05 at this size"


def test_scalar_b_is_a_known_reference_value():
    d = _diffs(60, 0.3, seed=2)
    assert paired_test(d, 0.25, "bootstrap-t", "equivalence", margin=0.1, n_resamples=499).pvalue == pytest.approx(
        paired_test(d, np.full(60, 0.25), "bootstrap-t", "equivalence", margin=0.1, n_resamples=499).pvalue)


@pytest.mark.parametrize(("test", "need"), [("bootstrap-t", MIN_DOCS_MARGIN), ("ttest", MIN_DOCS_MARGIN_T)])
def test_refused_below_the_threshold_with_a_reason(test, need):
    d = _diffs(need - 1, 0.0)
    res = paired_test(d, 0.0, test, "equivalence", margin=0.05)
    assert math.isnan(res.pvalue) and math.isnan(res.ci_low) and f"need ≥ {need}" in res.reason
    assert res.verdict.startswith("not estimable")
    ok = paired_test(_diffs(need, 0.0), 0.0, test, "equivalence", margin=0.05, n_resamples=999)
    assert not ok.reason and np.isfinite(ok.pvalue)
    constant = paired_test(np.full(need, 0.01), 0.0, test, "noninferiority", margin=0.05)
    assert math.isnan(constant.pvalue) and "spread is 0" in constant.reason


def test_bad_arguments_raise():
    d = _diffs(60, 0.0)
    with pytest.raises(ValueError, match="test must be one of"):
        paired_test(d, 0.0, "wilcoxon", "equivalence", margin=0.05)
    with pytest.raises(ValueError, match="margin"):
        paired_test(d, 0.0, "ttest", "equivalence")
    with pytest.raises(ValueError, match="margin must be > 0"):
        paired_test(d, 0.0, "ttest", "equivalence", margin=-0.05)
    with pytest.raises(ValueError, match="margin must be > 0"):
        paired_test(d, 0.0, "ttest", "noninferiority", margin=-0.05, worse="larger")
    with pytest.raises(ValueError, match="worse"):
        paired_test(d, 0.0, "ttest", "noninferiority", margin=0.05, worse="higher")


def test_verdict_words():
    assert margin_verdict("equivalence", False, 0.05) == "not shown equivalent at this size"
    assert margin_verdict("noninferiority", True, 1.0, "smaller") == "non-inferior at margin -1"
    assert margin_verdict("equivalence", False, 0.05, estimable=False).startswith("not estimable")


def test_t_size_at_the_margin_within_a_binomial_bound():
    # normal differences: the t TOST is exact, size at the margin = alpha (here <= its 0.999 binomial quantile);
    # a TOST at 2 alpha (0.10) or an interval at 1 - alpha would fail it.
    n_sims, rej = 1000, 0
    rng = np.random.default_rng(11)
    for _ in range(n_sims):
        d = 0.05 + 0.1 * rng.standard_normal(60)
        rej += margin_test(d, "ttest", "equivalence", 0.05, min_docs=2).pvalue <= 0.05
    assert 25 <= rej <= stats.binom.ppf(0.999, n_sims, 0.05)


def test_bootstrap_t_size_at_the_margin_and_power_at_zero_on_skewed_differences():
    # at the threshold, on the skewed population: size at the margin within alpha + 3 SE, power at 0 well above alpha
    size = margin_calibration("bootstrap-t", "noninferiority", n_docs=MIN_DOCS_MARGIN, margin=0.05,
                              population="skewed", n_sims=300, n_resamples=499, seed=5)
    assert size.shift == 0.05 and size.rejection_rate <= stats.binom.ppf(0.999, 300, 0.05) / 300
    power = margin_calibration("bootstrap-t", "equivalence", n_docs=MIN_DOCS_MARGIN, margin=0.05,
                               population="skewed", shift=0.0, n_sims=100, n_resamples=499, seed=6)
    assert power.rejection_rate >= 0.6 and power.coverage >= 0.8


# ---------------------------------------------------------------------------
# Plans: direction = "equivalence" / "noninferiority", margin, worse, compare = [A, "full"]
# ---------------------------------------------------------------------------

def _plan(*hyps):
    return {"plan": {"name": "m", "salt": "s"}, "hypothesis": list(hyps)}


def test_plan_validation_names_every_problem_at_once():
    from divstats.errors import PlanError
    from divstats.plans.format import load_plan
    bad = _plan(
        {"id": "no-margin", "family": "f", "metric": "occurrence", "compare": ["a", "full"],
         "direction": "equivalence", "test": "bootstrap-t"},
        {"id": "rank", "family": "f", "metric": "occurrence", "compare": ["a", "b"],
         "direction": "noninferiority", "margin": 0.05, "test": "wilcoxon"},
        {"id": "full-first", "family": "f", "metric": "occurrence", "compare": ["full", "a"],
         "direction": "equivalence", "margin": 0.05, "test": "ttest"},
        {"id": "stray", "family": "f", "metric": "occurrence", "compare": ["a", "b"], "margin": 0.05},
        {"id": "sign", "family": "f", "metric": "mismatch_fraction", "compare": ["a", "full"],
         "direction": "noninferiority", "margin": -0.05, "test": "ttest", "worse": "sideways"})
    with pytest.raises(PlanError) as exc:
        load_plan(bad)
    msg = str(exc.value)
    for needle in ("'no-margin'", "needs a finite non-zero 'margin'", "'rank'", "'test' must be one of",
                   "'full-first'", "side B", "'stray'", "'margin' applies only", "'sign'",
                   "'worse' must be one of", "'margin' must be > 0"):
        assert needle in msg, needle


def test_plan_worse_defaults_from_the_estimand_table():
    from divstats.plans.format import load_plan
    plan = load_plan(_plan(
        {"id": "r", "family": "f", "metric": "rmtd", "compare": ["a", "full"], "direction": "noninferiority",
         "margin": -1, "test": "bootstrap-t"},
        {"id": "m", "family": "f", "metric": "mismatch_fraction", "compare": ["a", "full"],
         "direction": "noninferiority", "margin": 0.05, "test": "bootstrap-t"}))
    assert [(h.worse, h.margin) for h in plan.hypotheses] == [("smaller", 1.0), ("larger", 0.05)]


def test_deployment_plan_ships_and_validates():
    from divstats.plans.format import load_plan, shipped_plans
    assert "deployment" in shipped_plans()
    plan = load_plan("deployment")
    assert {h.direction for h in plan.hypotheses} == {"noninferiority", "equivalence"}
    assert all(h.compare[1] == "full" for h in plan.hypotheses if h.direction == "noninferiority")
    assert {h.metric: h.worse for h in plan.hypotheses if h.direction == "noninferiority"} == {
        "mismatch_fraction": "larger", "rmtd": "smaller"}


def test_run_plan_against_the_full_model_known_value():
    from divstats.estimation.estimators import estimate
    from divstats.plans.run import run_plan
    from divstats.truth.studies import PolicyEffect, simulate_study
    ds = simulate_study(MIN_DOCS_MARGIN, {"good": PolicyEffect(0.15), "bad": PolicyEffect(0.9)},
                        horizon=6, replicates=2, seed=1)
    hyp = dict(family="ni", metric="occurrence", direction="noninferiority", margin=0.4, test="bootstrap-t",
               split="all")
    res = run_plan(ds, _plan({"id": "good", "compare": ["good", "full"], **hyp},
                             {"id": "bad", "compare": ["bad", "full"], **hyp},
                             {"id": "eq", "family": "eq", "metric": "occurrence", "compare": ["good", "bad"],
                              "direction": "equivalence", "margin": 0.05, "test": "bootstrap-t", "split": "all"}),
                   n_resamples=499).table.set_index("id")
    occ = estimate(ds)["occurrence"].sel(policy="good").values
    direct = paired_test(occ, 0.0, "bootstrap-t", "noninferiority", margin=0.4, n_resamples=499)
    assert res.loc["good", "p_value"] == pytest.approx(direct.pvalue) and res.loc["good", "mean_b"] == 0.0
    assert res.loc["good", "verdict"] == "non-inferior at margin 0.4"
    assert res.loc["bad", "verdict"] == "not shown non-inferior at margin 0.4 at this size"
    assert res.loc["eq", "verdict"] == "not shown equivalent at this size"
    assert res.loc["good", "margin"] == 0.4 and res.loc["good", "worse"] == "larger"


def test_run_plan_refuses_below_the_threshold_with_the_reason():
    from divstats.plans.run import run_plan
    from divstats.truth.studies import PolicyEffect, simulate_study
    ds = simulate_study(12, {"p": PolicyEffect(0.05)}, horizon=6, replicates=2, seed=2)
    row = run_plan(ds, _plan({"id": "r", "family": "f", "metric": "rmtd", "compare": ["p", "full"],
                              "direction": "noninferiority", "margin": -1, "test": "bootstrap-t",
                              "split": "all"}), n_resamples=99).table.iloc[0]
    assert math.isnan(row["p_value"]) and "need ≥ 50" in row["note"] and row["verdict"].startswith("not estimable")
    assert row["mean_b"] == 6.0      # the full model's rmtd is the horizon


def test_report_gives_verdicts_and_the_margin_figure():
    from divstats.report.analysis import compute
    from divstats.report.figures import margin_figure
    from divstats.report.render import make_figures, render_markdown
    from divstats.report.tables import plan_rows
    from divstats.truth.studies import PolicyEffect, simulate_study
    ds = simulate_study(12, {"p": PolicyEffect(0.05), "q": PolicyEffect(0.06)}, horizon=6, replicates=2, seed=3)
    plan = _plan({"id": "NI", "family": "f", "metric": "mismatch_fraction", "compare": ["p", "full"],
                  "direction": "noninferiority", "margin": 0.05, "test": "bootstrap-t", "split": "all"},
                 {"id": "EQ", "family": "g", "metric": "mismatch_fraction", "compare": ["p", "q"],
                  "direction": "equivalence", "margin": 0.05, "test": "ttest", "split": "all"},
                 {"id": "D", "family": "h", "metric": "occurrence", "compare": ["p", "q"], "test": "ttest",
                  "split": "all"})
    an = compute(ds, plan, n_resamples=99, progress=False)
    rows = {r["id"]: r for r in plan_rows(an.plan_result)}
    assert rows["NI"]["H1"] == "A − B < 0.05" and rows["EQ"]["H1"] == "|A − B| < 0.05"
    assert rows["NI"]["verdict"].startswith("not estimable") and rows["D"]["verdict"] == ""
    assert "margins" in make_figures(an)
    md = render_markdown(an)
    assert "## Verdicts at a margin" in md and "- EQ (mismatch_fraction, p − q): not estimable" in md
    # an estimable row draws its interval
    t = an.plan_result.table[an.plan_result.table["id"] == "EQ"].assign(
        ci_low=-0.01, ci_high=0.02, mean_difference=0.005, verdict="equivalent within ±0.05")
    assert len(margin_figure(t).axes[0].lines) >= 3


# ---------------------------------------------------------------------------
# Design: power of tests at a margin from a pilot
# ---------------------------------------------------------------------------

def test_power_of_margin_tests_at_zero_and_at_a_stated_difference():
    from divstats.design.pilot import hypothesis_pilots
    from divstats.design.power import power, power_at, refused_reason
    from divstats.truth.studies import PolicyEffect, simulate_study
    pilot = simulate_study(12, {"a": PolicyEffect(0.05), "b": PolicyEffect(0.06)}, horizon=6, replicates=4, seed=4)
    plan = _plan({"id": "eq", "family": "f", "metric": "occurrence", "compare": ["a", "b"],
                  "direction": "equivalence", "margin": 0.1, "test": "bootstrap-t", "split": "all"},
                 {"id": "ni", "family": "g", "metric": "occurrence", "compare": ["a", "full"],
                  "direction": "noninferiority", "margin": 0.1, "test": "ttest", "split": "all"})
    eq, ni = hypothesis_pilots(plan, pilot)
    assert ni.b == "full" and ni.effect == pytest.approx(float(np.mean(ni.d)))   # B = 0 for occurrence
    assert refused_reason(eq.hypothesis, MIN_DOCS_MARGIN - 1) and not refused_reason(eq.hypothesis, MIN_DOCS_MARGIN)
    assert power_at(eq, MIN_DOCS_MARGIN - 1, 4, n_sims=200) == 0.0
    p0, p200 = (power_at(eq, n, 4, n_sims=400) for n in (MIN_DOCS_MARGIN, 200))
    assert 0 <= p0 <= p200 and p200 > 0.5
    # at the margin the power is the size (about alpha), below power at 0
    at_margin = power_at(eq, 200, 4, n_sims=2000, difference=0.1)
    assert at_margin <= stats.binom.ppf(0.999, 2000, 0.05) / 2000 and at_margin < p200
    table = power(plan, pilot, docs=[200], replicates=4, n_sims=200).table
    assert table["power_low"].isna().all() and "true difference of 0" in table.loc[0, "note"]
