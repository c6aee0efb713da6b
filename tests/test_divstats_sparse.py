"""divstats where data are sparse and n is small (issue 13).

Every statistical claim here is checked against exact enumeration (``divstats.exact``)
or against simulation with a known truth, never against earlier output.
"""

from __future__ import annotations

import numpy as np
import pytest
from divstats_cases import split_replicates

import divstats as dv
from divstats.estimation.curves import MIN_SE_COUNT

V, T = 3, 7


def _hashed(seed: int, conc: float):
    """A kernel with full history dependence: a Dirichlet law keyed by the whole history."""
    cache: dict[tuple[int, ...], np.ndarray] = {}

    def k(h):
        if h not in cache:
            cache[h] = np.random.default_rng([seed, len(h), *h]).dirichlet(np.full(V, conc))
        return cache[h]
    return k


_BASE, _NOISE = _hashed(11, 0.5), _hashed(12, 0.5)


def _mixed(weight: float):
    """Q = (1 - weight) P + weight noise: a history-dependent pair whose late ages are sparse."""
    return lambda h: (1.0 - weight) * _BASE(h) + weight * _NOISE(h)


def _sampling(kind: str, weight: float, groups: int = 400, per_group: int = 20, seed: int = 1):
    """branch_tv on `groups` independent datasets of `per_group` replicates, and the exact truth."""
    q = _mixed(weight)
    ds = dv.simulate(_BASE, q, V, T, groups * per_group, kind=kind, seed=seed)
    bt = dv.branch_tv(split_replicates(ds, groups))
    get = lambda name: bt[name].values.reshape(groups, T)  # noqa: E731
    return get("branch_tv"), get("branch_tv_se"), get("branch_tv_count"), dv.exact(_BASE, q, V, T).branch_tv


# --------------------------------------------------------------------------- item 1

def _constant_tv_residual(replicates: int = 5, horizon: int = 12, seed: int = 3):
    P, Q = np.array([0.5, 0.3, 0.2]), np.array([0.4, 0.3, 0.3])    # TV 0.1 at every step
    return dv.simulate(lambda h: P, lambda h: Q, 3, horizon, replicates, kind="residual", seed=seed)


def test_residual_branch_tv_is_nan_where_no_branch_reached() -> None:
    bt = dv.branch_tv(_constant_tv_residual()).isel(doc=0, policy=0)
    count, r = bt["branch_tv_count"].values, bt["branch_tv"].values
    assert count[-1] == 0                                   # no branch reaches age 11
    assert np.isnan(r[count == 0]).all()                    # not 0 +- 0
    assert np.isnan(bt["branch_tv_se"].values[count < MIN_SE_COUNT]).all()
    np.testing.assert_allclose(r[count > 0], 0.1, atol=1e-12)   # history-free: TV 0.1 exactly
    assert (bt["branch_tv_denominator"].values > 0).all()   # P(tau + k <= T) is still estimated
    win = dv.branch_tv_window(_constant_tv_residual(), 8, 12).isel(doc=0, policy=0)
    assert float(win["branch_tv_window"]) == pytest.approx(0.1)  # age 11 is not averaged in as 0
    assert int(win["branch_tv_window_ages"]) == 3


def test_residual_branch_tv_lies_in_unit_interval() -> None:
    # Large TVs: the old numerator-from-the-branch / denominator-from-the-law ratio exceeded 1.
    r, _, _, _ = _sampling("residual", 0.9, groups=300, per_group=5, seed=4)
    assert np.nanmax(r) <= 1.0
    assert np.nanmin(r) >= 0.0


def test_residual_branch_tv_unbiased_against_exact() -> None:
    r, _, count, truth = _sampling("residual", 0.3)
    for k in range(T):
        ok = count[:, k] > 0
        v = r[ok, k]
        assert abs(v.mean() - truth[k]) <= 3.5 * v.std(ddof=1) / np.sqrt(v.size) + 1e-12, k


# --------------------------------------------------------------------------- item 2

@pytest.mark.parametrize("kind", ["coupled", "residual"])
def test_branch_tv_se_covers_where_reported(kind: str) -> None:
    r, se, count, truth = _sampling(kind, 0.3)
    reported = np.isfinite(se)
    assert not reported[count < MIN_SE_COUNT].any()         # "not available" below the stated count
    assert reported[count >= MIN_SE_COUNT].mean() > 0.99    # (and where all values seen are equal)
    hit = np.abs(r - truth) <= 1.96 * se
    pooled = hit[reported].mean()
    assert pooled >= 0.93, pooled
    for k in range(T):
        if reported[:, k].sum() >= 100:
            assert hit[reported[:, k], k].mean() >= 0.90, (k, hit[reported[:, k], k].mean())


# --------------------------------------------------------------------------- item 4

def test_permutation_with_one_document_is_not_estimable() -> None:
    res = dv.paired_test(np.array([0.3]), np.array([0.1]), "permutation", "greater")
    assert np.isnan(res.pvalue) and np.isnan(res.ci_low) and np.isnan(res.ci_high)
    assert res.n == 1 and "not estimable" in res.reason


@pytest.mark.parametrize("a", [[0.1, 0.1], [0.1, 0.1 + 1e-17], [0.2, 0.2, 0.2, 0.2], [0.0, 0.0, 0.0]])
@pytest.mark.parametrize("test", ["ttest", "bootstrap-t"])
def test_zero_spread_is_not_estimable(a, test) -> None:
    res = dv.paired_test(np.array(a), np.zeros(len(a)), test, "two-sided")
    assert np.isnan(res.pvalue), res.pvalue                 # never p = 0 (or 1.4e-49)
    assert np.isnan(res.mean_ci_low) and np.isnan(res.mean_ci_high)  # never a zero-width interval
    assert "not estimable" in res.reason


def test_constant_differences_have_no_zero_width_mean_interval() -> None:
    res = dv.paired_test(np.full(6, 0.3), np.zeros(6), "wilcoxon", "two-sided")
    assert not res.reason                                   # the rank test is defined
    assert not res.mean_ci_low == res.mean_ci_high          # NaN, not [0.3, 0.3]


# --------------------------------------------------------------------------- item 5

@pytest.mark.parametrize("alternative", ["two-sided", "greater", "less"])
def test_hl_interval_excludes_zero_iff_wilcoxon_rejects(alternative) -> None:
    rng = np.random.default_rng(17)
    for _ in range(300):
        n = int(rng.integers(3, 40))
        d = np.round(rng.normal(0.25, 1.0, n), 1)           # zeros and ties on purpose
        res = dv.paired_test(d, np.zeros(n), "wilcoxon", alternative)
        rejected = res.pvalue <= 0.05
        excluded = not (res.ci_low <= 0.0 <= res.ci_high)
        assert rejected == excluded, (d.tolist(), res.pvalue, res.ci_low, res.ci_high)
        assert res.ci_low <= res.effect <= res.ci_high


def test_hl_interval_is_the_inverted_test_at_its_ends() -> None:
    from divstats.inference.location_tests import signed_rank_test

    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(5, 25))
        d = np.round(rng.normal(0.2, 1.0, n), 1)
        res = dv.paired_test(d, np.zeros(n), "wilcoxon", "two-sided")
        for end, inward in ((res.ci_low, +1), (res.ci_high, -1)):
            assert signed_rank_test(d - (end + inward * 1e-9), "two-sided")[1] > 0.05     # just inside: accepted
        # the test rejects just beyond the nearest Walsh average outside each end
        i, j = np.triu_indices(n)
        walsh = np.unique((d[i] + d[j]) / 2)
        below, above = walsh[walsh < res.ci_low], walsh[walsh > res.ci_high]
        if below.size:
            assert signed_rank_test(d - (below[-1] - 1e-9), "two-sided")[1] <= 0.05
        if above.size:
            assert signed_rank_test(d - (above[0] + 1e-9), "two-sided")[1] <= 0.05


def test_wilcoxon_matches_scipy_with_ties_and_zeros() -> None:
    from scipy import stats

    from divstats.inference.location_tests import signed_rank_test

    rng = np.random.default_rng(8)
    for _ in range(12):                  # scipy's permutation path is slow (~0.5 s a call)
        n = int(rng.integers(4, 11))
        d = np.round(rng.normal(0.3, 1.0, n), 1)
        nz = d[d != 0]
        if nz.size == 0:
            continue
        for alt in ("two-sided", "greater", "less"):
            assert signed_rank_test(d, alt)[1] == pytest.approx(stats.wilcoxon(nz, alternative=alt).pvalue, abs=1e-12)


# --------------------------------------------------------------------------- item 7

def test_one_rejection_rule_at_the_boundary() -> None:
    from divstats.inference.multiplicity import holm, rejects

    reject, adjusted = holm(np.array([0.025, 0.025]), 0.05)
    np.testing.assert_allclose(adjusted, [0.05, 0.05])
    assert reject.all()                                     # Holm: p_adjusted <= alpha
    assert rejects(0.05, 0.05) and not rejects(0.0500001, 0.05) and not rejects(np.nan, 0.05)


# --------------------------------------------------------------------------- item 9

def test_agreeing_tokens_reported_beside_rmtd() -> None:
    q = _mixed(0.3)
    ds = dv.simulate(_BASE, q, V, T, 400, kind="coupled", seed=2)
    est = dv.estimate(ds).isel(doc=0, policy=0)
    x, y = ds["x_token"].values[0, 0], ds["y_token"].values[0, 0]
    agree = np.where((x != y).any(-1), (x != y).argmax(-1), T)      # tokens before the first mismatch
    assert float(est["agreeing_tokens"]) == pytest.approx(agree.mean())
    assert float(est["agreeing_tokens"]) == pytest.approx(float(est["rmtd"] - est["occurrence"]))
    ex = dv.exact(_BASE, q, V, T)
    assert ex.agreeing_tokens == pytest.approx(ex.rmtd - ex.occurrence)
    assert abs(float(est["agreeing_tokens"]) - ex.agreeing_tokens) <= 4 * float(est["agreeing_tokens_se"])
    agg = dv.aggregate(dv.estimate(ds))
    assert "agreeing_tokens" in agg and "agreeing_tokens_se" in agg


# --------------------------------------------------------------------------- items 3 and 8

def _estimates(o_a, o_b, e_a, e_b, p_a, p_b, horizon: int = 32):
    import xarray as xr

    docs = [f"d{i}" for i in range(len(o_a))]
    stack = lambda a, b: xr.DataArray(np.stack([a, b], 1), dims=("doc", "policy"),  # noqa: E731
                                      coords={"doc": docs, "policy": ["A", "B"]})
    return xr.Dataset({"occurrence": stack(o_a, o_b), "exposure": stack(e_a, e_b),
                       "post_mismatch": stack(p_a, p_b)}, attrs={"horizon": horizon})


def test_decomposition_shares_have_intervals_and_refuse_when_gap_covers_zero() -> None:
    from divstats.calibration.coverage import document_population

    pop = document_population(40, np.random.default_rng(0), 32, "skewed")
    res = dv.decompose(_estimates(*pop), "A", "B")
    ci = res.confidence_interval()
    assert ci.method == "auto" and not ci.reason and not ci.share_reason
    assert not (ci.low.gap <= 0 <= ci.high.gap)
    for part in ("first", "exposure", "rate"):
        assert getattr(ci.share_low, part) <= getattr(res.shares, part) <= getattr(ci.share_high, part)
    # A and B identical up to noise: the gap's interval covers 0, so no share is reported.
    o_a, o_b, e_a, e_b, p_a, p_b = pop
    rng = np.random.default_rng(1)
    same = _estimates(o_a, o_a + rng.normal(0, 1e-3, 40), e_a, e_a, p_a, p_a + rng.normal(0, 1e-3, 40))
    ci0 = dv.decompose(same, "A", "B").confidence_interval()
    assert ci0.low.gap <= 0 <= ci0.high.gap
    assert np.isnan(ci0.share_low.exposure) and "covers 0" in ci0.share_reason


def test_decomposition_interval_refused_with_few_documents() -> None:
    from divstats.calibration.coverage import document_population
    from divstats.estimation.resample import MIN_DOCS_PARTS

    pop = document_population(2, np.random.default_rng(0), 32, "skewed")
    ci = dv.decompose(_estimates(*pop), "A", "B").confidence_interval(method="BCa", n_resamples=199)
    assert np.isnan(ci.low.gap) and np.isnan(ci.high.gap)      # no finite interval from 2 documents
    assert f"need ≥ {MIN_DOCS_PARTS}" in ci.reason


@pytest.mark.parametrize("population", ["symmetric", "skewed"])
def test_default_document_interval_covers_from_min_docs(population) -> None:
    from divstats.calibration.coverage import decomposition_coverage
    from divstats.estimation.resample import MIN_DOCS_PARTS

    cov = decomposition_coverage(n_docs=MIN_DOCS_PARTS, n_sims=300, seed=5, population=population)
    assert cov.refused == 0.0
    for name in ("gap", "first", "exposure", "rate"):
        # nominal 0.95 (measured >= 0.93 at n = 20, hybrid-t); binomial SD with 300 studies is 0.013
        assert cov.coverage[name] >= 0.90, (name, cov.coverage)


# --------------------------------------------------------------------------- plans: items 1, 6, 7

def _window_plan(test: str = "ttest") -> dict:
    return {"plan": {"name": "sparse", "alpha": 0.05, "salt": "s", "confirmatory_fraction": 0.5},
            "windows": {"early": [0, 3], "late": [10, 11]},
            "hypothesis": [{"id": "tv", "family": "f", "metric": "branch_tv", "policy": "p",
                            "compare": ["late", "early"], "direction": "greater", "test": test,
                            "split": "all"}]}


@pytest.mark.parametrize("kind", ["coupled", "residual"])
def test_plan_drops_documents_whose_window_no_branch_reached(kind) -> None:
    from divstats.plans.run import run_plan
    from divstats.truth.studies import PolicyEffect, simulate_study

    ds = simulate_study(16, {"p": PolicyEffect(0.05, growth=0.2)}, horizon=12, replicates=5, kind=kind, seed=3)
    reached = (dv.branch_tv(ds)["branch_tv_count"].sel(policy="p", age=[10, 11]).sum("age") > 0).values
    assert 0 < reached.sum() < reached.size                 # some documents never reach ages 10-11
    res = run_plan(ds, _window_plan())
    row = res.table.iloc[0]
    assert row["n_docs"] == reached.sum()                   # residual used to enter them with late = 0
    assert row["n_dropped"] == reached.size - reached.sum()
    assert any(f"{reached.size - reached.sum()} of {reached.size} documents dropped" in n for n in res.notes)


def test_plan_rows_state_their_estimand_and_survive_degenerate_tests(monkeypatch) -> None:
    from divstats.plans.run import run_plan
    from divstats.truth.studies import PolicyEffect, simulate_study

    ds = simulate_study(3, {"p": PolicyEffect(0.3, growth=0.2)}, horizon=12, replicates=8, kind="coupled", seed=1)
    plan = _window_plan("permutation")
    plan["hypothesis"][0]["split"] = "confirmatory"
    plan["plan"]["confirmatory_fraction"] = 0.34          # with salt "s": only doc1 is confirmatory
    res = run_plan(ds, plan)                                # must not raise inside scipy
    row = res.table.iloc[0]
    assert row["estimand"].startswith("mean paired difference")
    assert row["n_docs"] == 1
    assert np.isnan(row["p_value"]) and not row["reject"] and "not estimable" in row["note"]


def test_plan_rejection_rule_is_the_same_with_and_without_holm(monkeypatch) -> None:
    from divstats.inference.paired import paired_test as real
    from divstats.plans.run import run_plan
    from divstats.truth.studies import PolicyEffect, simulate_study

    pvalues = iter([0.025, 0.025, 0.05])

    def fake(*args, **kwargs):
        import dataclasses

        return dataclasses.replace(real(*args, **kwargs), pvalue=next(pvalues))

    monkeypatch.setattr("divstats.plans.run.paired_test", fake)
    ds = simulate_study(12, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.2)}, horizon=6, replicates=4)
    hyp = {"metric": "occurrence", "compare": ["a", "b"], "split": "all", "test": "ttest"}
    plan = {"plan": {"name": "rule", "alpha": 0.05, "salt": "s"}, "windows": {},
            "hypothesis": [{**hyp, "id": "h1", "family": "holm"}, {**hyp, "id": "h2", "family": "holm"},
                           {**hyp, "id": "h3", "family": "raw", "correction": "none"}]}
    t = run_plan(ds, plan).table.set_index("id")
    np.testing.assert_allclose(t["p_adjusted"], [0.05, 0.05, 0.05])
    assert t["reject"].all()                                # p_adjusted = alpha rejects in both families


def test_paper_plan_tests_the_mean_with_a_test_whose_size_holds_better() -> None:
    from pathlib import Path

    from divstats.calibration.coverage import paired_calibration
    from divstats.plans.format import load_plan

    plan = load_plan(Path(dv.__file__).parent / "shipped_plans" / "paper.toml")
    assert {h.test for h in plan.hypotheses} == {"bootstrap-t"}
    # Skewed differences with mean 0: the Wilcoxon test (pseudo-median) rejects far too often
    # for a claim about the mean; the bootstrap-t test stays near alpha.
    w = paired_calibration("wilcoxon", n_docs=30, n_sims=300, population="skewed", seed=2)
    b = paired_calibration("bootstrap-t", n_docs=30, n_sims=300, population="skewed", seed=2, n_resamples=499)
    assert w.rejection_rate > 0.10, w
    assert b.rejection_rate < 0.09, b


# --------------------------------------------------------------------------- item 10

def test_aggregate_intervals_drop_missing_documents_explicitly() -> None:
    from divstats.truth.studies import PolicyEffect, simulate_study

    ds = simulate_study(14, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.3)}, horizon=6, replicates=6, seed=4)
    est = dv.estimate(ds)
    holed = est.copy(deep=True)
    for name in holed.data_vars:                               # doc0..doc2 missing for policy b
        if "doc" in holed[name].dims and "policy" in holed[name].dims:
            holed[name].loc[{"doc": ["doc0", "doc1", "doc2"], "policy": "b"}] = np.nan
    ci = dv.aggregate_intervals(holed, n_resamples=499)
    assert int(ci["n_dropped"].sel(policy="b")) == 3 and int(ci["n_docs"].sel(policy="b")) == 11
    assert int(ci["n_dropped"].sel(policy="a")) == 0
    # b's interval is exactly the one over its 11 documents with data (not NaN-skipping resamples)
    alone = dv.aggregate_intervals(est.sel(doc=[f"doc{i}" for i in range(3, 14)]), n_resamples=499)
    for q in ("occurrence", "rate"):
        assert float(ci[f"{q}_low"].sel(policy="b")) == pytest.approx(float(alone[f"{q}_low"].sel(policy="b")))
    # fewer documents than resample.MIN_DOCS_INTERVAL: refused, not a finite interval
    few = dv.aggregate_intervals(est.isel(doc=slice(0, 3)), n_resamples=199)
    assert np.isnan(few["occurrence_low"]).all()


def test_bootstrap_mean_interval_refused_with_few_documents() -> None:
    res = dv.paired_test(np.array([0.3, 0.5]), np.array([0.1, 0.2]), "ttest", mean_ci="bootstrap")
    assert np.isnan(res.mean_ci_low) and np.isnan(res.mean_ci_high)   # no finite interval from 2 documents


def test_report_shows_counts_beside_per_age_branch_tv_all_within_unit_interval() -> None:
    import re

    from divstats.report.analysis import compute
    from divstats.report.render import render_html
    from divstats.report.tables import branch_tv_rows
    from divstats.truth.studies import PolicyEffect, simulate_study

    ds = simulate_study(12, {"a": PolicyEffect(0.1, growth=0.3), "b": PolicyEffect(0.3, growth=0.3)},
                        horizon=10, replicates=4, kind="residual", seed=2)
    an = compute(ds, n_resamples=199, progress=False)
    rows = branch_tv_rows(an.branch_tv)
    cells = [c for r in rows for k, c in r.items() if k.startswith("age")]
    assert len(cells) == 2 * 10
    for c in cells:
        if c != "—":
            value, count, docs = re.fullmatch(r"(\S+) \((\d+); (\d+) docs\)", c).groups()
            assert 0.0 <= float(value) <= 1.0 and int(count) > 0 and int(docs) > 0
    assert "—" in cells or all(c != "—" for c in cells)
    page = render_html(an, {})
    assert "replicates whose branch reached the age" in page and cells[0] in page
    per_doc = an.branch_tv["branch_tv"].values
    assert np.nanmax(per_doc) <= 1.0 and np.nanmin(per_doc) >= 0.0
