"""run_plan end to end on simulated traces; calibration of the paired tests (small, seconds)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import divstats
from divstats.calibration.coverage import paired_calibration
from divstats.plans.format import PlanError
from divstats.plans.run import run_plan, window_mean
from divstats.truth.studies import PolicyEffect, simulate_study

PLANTED = {"snapkv@0.5": PolicyEffect(0.03), "snapkv#512": PolicyEffect(0.09),
           "recent@0.5": PolicyEffect(0.09), "snapkv@0.9": PolicyEffect(0.02, growth=1.0)}


def plan(hypotheses, windows=None, fraction=0.5):
    return {"plan": {"name": "e2e", "alpha": 0.05, "salt": "e2e", "confirmatory_fraction": fraction},
            "windows": windows or {"early": [2, 4], "late": [8, 11]}, "hypothesis": hypotheses}


@pytest.fixture(scope="module")
def planted():
    return simulate_study(36, PLANTED, horizon=14, replicates=16, seed=21)


def test_planted_effects_are_detected(planted):
    hyps = [{"id": f"{m}-{b}", "family": "retention", "metric": m, "compare": ["snapkv@0.5", b],
             "direction": d} for (m, d), b in itertools.product(
                 [("occurrence", "less"), ("rmtd", "greater")], ["snapkv#512", "recent@0.5"])]
    hyps.append({"id": "drift", "family": "drift", "metric": "branch_tv", "policy": "snapkv@0.9",
                 "compare": ["late", "early"], "direction": "greater"})
    res = run_plan(planted, plan(hyps), n_resamples=999)
    t = res.table.set_index("id")
    assert t["reject"].all(), t[["p_value", "p_adjusted"]]
    assert (t.loc[[h["id"] for h in hyps[:4]], "n_docs"] > 10).all()
    assert t.loc["occurrence-snapkv#512", "effect"] < 0 < t.loc["rmtd-recent@0.5", "effect"]
    # The window metric is the per-document average of divstats.branch_tv over the inclusive ages.
    w = divstats.branch_tv_window(planted, 8, 12).sel(policy="snapkv@0.9")["branch_tv_window"]
    mine = window_mean(divstats.branch_tv(planted), 8, 11).sel(policy="snapkv@0.9")
    np.testing.assert_allclose(mine.values, w.values, rtol=1e-12)


def test_null_comparisons_do_not_reject():
    same = {p: PolicyEffect(0.06) for p in ("a", "b", "c", "d")}
    ds = simulate_study(30, same, horizon=10, replicates=12, seed=5)
    hyps = [{"id": f"{m}:{x}-{y}", "family": m, "metric": m, "compare": [x, y], "split": "all",
             "test": test}
            for (m, test) in (("occurrence", "wilcoxon"), ("mismatch_fraction", "permutation"))
            for x, y in itertools.combinations(same, 2)]
    res = run_plan(ds, plan(hyps), n_resamples=999)
    # Holm keeps the family-wise error at 5% per family; two families of six true nulls.
    assert res.table["reject"].sum() <= 1
    assert (res.table["n_docs"] == 30).all()


def test_unidentified_hypotheses_are_reported_with_the_reason():
    ds = simulate_study(4, {"a": PolicyEffect(0.2), "b": PolicyEffect(0.3)}, horizon=12, replicates=6,
                        kind="residual", window=5, seed=2)
    hyps = [{"id": "w", "family": "f", "metric": "branch_tv", "policy": "a", "compare": ["late", "early"],
             "split": "all"},
            {"id": "m", "family": "g", "metric": "mismatch_fraction", "compare": ["a", "b"], "split": "all"},
            {"id": "o", "family": "g", "metric": "occurrence", "compare": ["a", "b"], "split": "all"}]
    t = run_plan(ds, plan(hyps)).table.set_index("id")
    assert "observed only to age W = 5; not identified" in t.loc["w", "note"]
    assert "no document has a finite 'mismatch_fraction'" in t.loc["m", "note"]
    assert t.loc[["w", "m"], "p_value"].isna().all() and np.isfinite(t.loc["o", "p_value"])
    ref = simulate_study(3, {"a": PolicyEffect(0.2), "b": PolicyEffect(0.3)}, horizon=12, replicates=4,
                         kind="reference", seed=2)
    t = run_plan(ref, plan(hyps[:1])).table
    assert "branch_tv is not identified" in t["note"].iloc[0]
    with pytest.raises(PlanError, match="unknown metric"):
        run_plan(ref, plan([{**hyps[2], "metric": "occurence"}]))


@pytest.mark.parametrize("test", ["wilcoxon", "ttest", "permutation"])
def test_type_one_error_power_and_coverage(test):
    null = paired_calibration(test, n_docs=20, n_sims=300, shift=0.0, seed=1)
    # 300 simulations at alpha = 0.05: SE 0.0126, so [0.015, 0.095] is a ±3.5 SE band.
    assert 0.015 <= null.rejection_rate <= 0.095, null
    assert null.effect_coverage >= 0.9 and null.hl_ci_coverage >= 0.9, null
    alt = paired_calibration(test, n_docs=20, n_sims=150, shift=0.1, seed=2)
    assert alt.rejection_rate >= 0.9, alt
    assert alt.effect_coverage >= 0.88, alt
