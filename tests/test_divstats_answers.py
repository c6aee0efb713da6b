"""Task answers under the coupling (docs/statistics.md §12): compare_answers against independent
computations (numpy, scipy, statsmodels), the interval's coverage by simulation, the dataset form
``kvdiv analyze`` writes, the report section, the per-token table and plans on answer scores."""

from __future__ import annotations

import math

import numpy as np
import pytest
import xarray as xr
from scipy import stats
from statsmodels.stats.contingency_tables import mcnemar

import divstats
from divstats.estimands import ANSWER_ESTIMANDS, markdown_table
from divstats.inference.answers import (
    MIN_DOCS_ANSWERS,
    answer_interval,
    change_by_divergence,
    compare_answers,
    compare_answers_dataset,
    coupling_saving,
)
from divstats.inference.paired import paired_test
from divstats.truth.answers import simulate_answer_scores, true_difference, with_answer_scores
from divstats.truth.studies import PolicyEffect, simulate_study


def _t_interval(v: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    half = stats.t.ppf(0.5 + level / 2, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size)
    return v.mean() - half, v.mean() + half


# --------------------------------------------------------------------------- compare_answers

def test_one_replicate_matches_statsmodels_mcnemar_and_counts() -> None:
    rng = np.random.default_rng(3)
    x = (rng.random(40) < 0.7).astype(float)
    y = np.where(rng.random(40) < 0.3, 1 - x, x)
    res = compare_answers(x, y)
    # the 2x2 table by hand: rows P right/wrong, columns Q right/wrong
    table = [[int(np.sum((x == 1) & (y == 1))), int(np.sum((x == 1) & (y == 0)))],
             [int(np.sum((x == 0) & (y == 1))), int(np.sum((x == 0) & (y == 0)))]]
    assert res.test == "mcnemar-exact"
    assert res.pvalue == pytest.approx(mcnemar(table, exact=True).pvalue, rel=1e-12)
    assert (res.lost, res.gained) == (table[0][1], table[1][0])
    assert res.x_accuracy.estimate == pytest.approx(x.mean()) and res.y_accuracy.estimate == pytest.approx(y.mean())
    assert res.difference.estimate == pytest.approx((y - x).mean())
    lo, hi = _t_interval(y - x)
    assert (res.difference.low, res.difference.high) == pytest.approx((max(lo, -1), min(hi, 1)))
    lo, hi = _t_interval(x)
    assert (res.x_accuracy.low, res.x_accuracy.high) == pytest.approx((max(lo, 0), min(hi, 1)))
    assert res.confidence_interval() == res.difference.interval


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_sign_flip_over_documents_is_mcnemar_with_one_replicate(seed: int) -> None:
    """The R > 1 test generalises McNemar's: on one replicate of 0/1 scores the two agree."""
    rng = np.random.default_rng(seed)
    x = (rng.random(14) < 0.6).astype(float)
    y = np.where(rng.random(14) < 0.4, 1 - x, x)
    table = [[np.sum((x == 1) & (y == 1)), np.sum((x == 1) & (y == 0))],
             [np.sum((x == 0) & (y == 1)), np.sum((x == 0) & (y == 0))]]
    p_flip = paired_test(y - x, 0.0, "permutation").pvalue      # exact: 14 documents enumerate 2^14 flips
    assert p_flip == pytest.approx(mcnemar(table, exact=True).pvalue, rel=1e-9)


def test_several_replicates_average_within_document_then_test_over_documents() -> None:
    x, y = simulate_answer_scores(30, 4, x_accuracy=0.6, lost=0.3, gained=0.05, rng=5)
    y[0, 3] = np.nan                              # an unscored answer drops that pair only
    res = compare_answers(x, y, n_resamples=999)
    ok = np.isfinite(y)
    xd = np.array([x[i][ok[i]].mean() for i in range(30)])
    yd = np.array([y[i][ok[i]].mean() for i in range(30)])
    assert res.test.startswith("sign-flip")
    assert res.pvalue == pytest.approx(paired_test(yd - xd, 0.0, "permutation", n_resamples=999).pvalue)
    assert res.difference.estimate == pytest.approx((yd - xd).mean())
    assert res.n_pairs == int(ok.sum()) and res.replicates == 4 and res.n_docs == 30
    assert res.lost == int(np.sum((x == 1) & (y == 0))) and res.gained == int(np.sum((x == 0) & (y == 1)))


def test_graded_scores_count_right_from_one_half_and_use_the_document_test() -> None:
    x = np.array([0.9, 0.6, 0.2, 0.5, 0.1] * 3)
    y = np.array([0.4, 0.7, 0.6, 0.49, 0.1] * 3)
    res = compare_answers(x, y)
    assert not res.binary and res.test.startswith("sign-flip")
    assert (res.lost, res.gained) == (6, 3)


def test_too_few_documents_are_refused_with_the_number() -> None:
    res = compare_answers(np.ones(MIN_DOCS_ANSWERS - 2), np.zeros(MIN_DOCS_ANSWERS - 2))
    assert math.isnan(res.difference.low) and f"n = {MIN_DOCS_ANSWERS - 2} documents" in res.reason
    assert res.lost == MIN_DOCS_ANSWERS - 2 and np.isfinite(res.pvalue)


def test_bad_scores_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        compare_answers(np.array([0.0, 2.0]), np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="one shape"):
        compare_answers(np.zeros((3, 2)), np.zeros((3, 1)))


def test_margin_tests_run_through_the_margin_machinery() -> None:
    x, y = simulate_answer_scores(80, 1, x_accuracy=0.8, lost=0.01, gained=0.01, rng=2)
    res = compare_answers(x, y, margin=0.1, n_resamples=999)
    xd, yd = x[:, 0], y[:, 0]
    ref = paired_test(yd, xd, "bootstrap-t", "noninferiority", margin=0.1, worse="smaller", n_resamples=999)
    assert res.noninferiority.pvalue == ref.pvalue and res.noninferiority.verdict == ref.verdict
    assert res.equivalence.alternative == "equivalence"


def test_paired_interval_covers_at_50_documents() -> None:
    """Fast version of benchmarks/bench_answers_coverage.py: 400 studies at n = 50, R = 1."""
    rng = np.random.default_rng(11)
    truth = true_difference(0.6, 0.3, 0.05)
    hits = 0
    for _ in range(400):
        x, y = simulate_answer_scores(50, 1, x_accuracy=0.6, lost=0.3, gained=0.05, rng=rng)
        _, lo, hi, _ = answer_interval((y - x)[:, 0], -1.0, 1.0)
        hits += lo <= truth <= hi
    assert 0.92 <= hits / 400 <= 0.98      # binomial SE at 0.95 with 400 studies: 0.011


# --------------------------------------------------------------------------- the coupling's saving

def test_coupling_saving_predicts_independent_runs() -> None:
    """The independent side is a prediction from the coupled data: check it against real independent draws."""
    n, r = 6000, 4
    x, y = simulate_answer_scores(n, r, x_accuracy=0.55, lost=0.4, gained=0.05, rng=7)
    s = coupling_saving(x, y)
    # independent runs: a second, independent draw of each side with the same per-document laws
    rng = np.random.default_rng(8)
    p = rng.beta(0.55 * 2, 0.45 * 2, size=n)
    xi = (rng.random((n, r)) < p[:, None]).astype(float)
    q = p * 0.6 + (1 - p) * 0.05                    # Q's per-document accuracy under the same model
    yi = (rng.random((n, r)) < q[:, None]).astype(float)
    emp_docs = float(np.var((yi - xi).mean(axis=1), ddof=1))
    emp_within = float(np.mean(np.var(yi - xi, axis=1, ddof=1)))
    assert s.docs_independent == pytest.approx(emp_docs, rel=0.08)
    assert s.within_independent == pytest.approx(emp_within, rel=0.05)
    assert s.within_coupled < s.within_independent and s.ratio < 1
    assert s.docs_needed_coupled == math.ceil(stats.norm.ppf(0.975) ** 2 * s.docs_coupled / 0.05 ** 2)


def test_coupling_saving_needs_two_replicates() -> None:
    s = coupling_saving(np.ones((20, 1)), np.zeros((20, 1)))
    assert "2 or more replicates" in s.reason and math.isnan(s.docs_needed_independent)


# --------------------------------------------------------------------------- dataset forms

@pytest.fixture(scope="module")
def traces() -> xr.Dataset:
    ds = simulate_study(24, {"full": PolicyEffect(0.0), "snapkv@0.5": PolicyEffect(0.3),
                             "snapkv@0.3": PolicyEffect(0.5), "recent@0.5": PolicyEffect(0.2)},
                        horizon=8, replicates=2)
    return with_answer_scores(ds, {"snapkv@0.5": (0.6, 0.0), "snapkv@0.3": (0.8, 0.0), "recent@0.5": (0.3, 0.05)})


def test_dataset_form_is_compare_answers_per_policy(traces: xr.Dataset) -> None:
    res = compare_answers_dataset(traces, n_resamples=999)
    for pol in ["snapkv@0.5", "recent@0.5"]:
        one = compare_answers(traces["x_score"].sel(policy=pol).values, traces["y_score"].sel(policy=pol).values,
                              n_resamples=999)
        row = res.sel(policy=pol)
        assert float(row["answer_difference"]) == pytest.approx(one.difference.estimate)
        assert float(row["answer_difference_low"]) == pytest.approx(one.difference.low)
        assert float(row["answer_mcnemar_p"]) == pytest.approx(one.pvalue)
        assert int(row["answer_lost"]) == one.lost and int(row["answer_gained"]) == one.gained
    assert all(res[v].attrs["description"] for v in res.data_vars)


def test_analyze_writes_the_answer_variables_only_with_scores(traces: xr.Dataset, tmp_path) -> None:
    from divstats.report.analysis import compute
    from divstats.report.render import render_html
    from divstats.report.results import results_dataset

    an = compute(traces, n_resamples=99, progress=False)
    res = results_dataset(an)
    names = ["answer_x_accuracy", "answer_y_accuracy", "answer_difference", "answer_difference_low",
             "answer_difference_high", "answer_mcnemar_p", "answer_lost", "answer_gained"]
    for n in names:
        assert res[n].dims == ("policy",) and res[n].attrs["description"], n
    assert res["accuracy_change"].dims == ("doc", "policy")
    page = render_html(an, {})
    assert "Does it change the answer?" in page and "diverged before the answer" in page
    plain = compute(traces.drop_vars(["x_score", "y_score"]), n_resamples=99, progress=False)
    assert not any(str(v).startswith("answer_") for v in results_dataset(plain).data_vars)
    assert "Does it change the answer?" not in render_html(plain, {})


def test_change_by_divergence_against_a_loop(traces: xr.Dataset) -> None:
    ch = change_by_divergence(traces)
    pol = "snapkv@0.5"
    one = traces.sel(policy=pol)
    counts = {"before": [0, 0], "inside": [0, 0], "none": [0, 0]}
    for d in range(one.sizes["doc"]):
        for r in range(one.sizes["replicate"]):
            x, y = one["x_token"].values[d, r], one["y_token"].values[d, r]
            tau = next((t + 1 for t in range(x.size) if x[t] != y[t]), None)
            start = int(one["x_answer_start"].values[d, r])
            where = "none" if tau is None else ("before" if tau - 1 < start else "inside")
            counts[where][0] += 1
            counts[where][1] += one["x_score"].values[d, r] != one["y_score"].values[d, r]
    for where, (n, changed) in counts.items():
        assert int(ch["answer_change_pairs"].sel(policy=pol, divergence=where)) == n
        if n:
            assert float(ch["answer_score_changed"].sel(policy=pol, divergence=where)) == pytest.approx(changed / n)
    assert float(ch["answer_score_changed"].sel(divergence="none").max()) == 0.0


def test_accuracy_by_depth_against_a_loop(traces: xr.Dataset) -> None:
    dep = divstats.accuracy_by_depth(traces, bins=4)
    depth = traces["needle_depth"].values
    y = traces["y_score"].sel(policy="recent@0.5").mean("replicate").values
    first = y[depth < 0.25].mean()
    assert float(dep["answer_depth_y_accuracy"].sel(policy="recent@0.5").isel(depth=0)) == pytest.approx(first)


def test_answers_text_table_lists_every_policy(traces: xr.Dataset) -> None:
    from divstats.report.answer_tables import answers_text_table

    text = answers_text_table(compare_answers_dataset(traces, n_resamples=99))
    lines = text.splitlines()
    assert lines[0].startswith("policy") and len(lines) == 1 + traces.sizes["policy"]
    assert "snapkv@0.3" in text and "pts" in text


# --------------------------------------------------------------------------- the estimand table and plans

def test_answer_estimands_are_printed_in_the_docs() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "statistics.md").read_text(encoding="utf-8")
    start = "<!-- estimand-table: divstats.estimands.markdown_table(ANSWER_ESTIMANDS) -->"
    assert start in text
    assert text.split(start, 1)[1].split("<!-- /estimand-table -->", 1)[0].strip() == markdown_table(ANSWER_ESTIMANDS)
    assert {e.name: e.bounds for e in ANSWER_ESTIMANDS}["accuracy"] == "unit"


def test_a_plan_tests_accuracy_change_against_the_full_model(traces: xr.Dataset) -> None:
    plan = {"plan": {"name": "answers", "salt": "s"},
            "hypothesis": [{"id": "H1", "family": "answers", "metric": "accuracy_change",
                            "compare": ["snapkv@0.3", "full"], "direction": "less", "test": "ttest",
                            "split": "all"}]}
    res = divstats.run_plan(traces, plan, n_resamples=99)
    row = res.table.iloc[0]
    d = (traces["y_score"] - traces["x_score"]).sel(policy="snapkv@0.3").mean("replicate").values
    full = (traces["y_score"] - traces["x_score"]).sel(policy="full").mean("replicate").values
    assert row["p_value"] == pytest.approx(stats.ttest_rel(d, full, alternative="less").pvalue)
