"""divstats.power: the table, its monotonicity and range, and predicted vs observed power."""

from __future__ import annotations

import numpy as np
import pytest

import divstats
from divstats.calibration.power import PowerDesign, power_calibration
from divstats.design.pilot import hypothesis_pilots
from divstats.design.power import power, power_at
from divstats.errors import PlanError
from divstats.truth.studies import PolicyEffect, simulate_study

EFFECTS = {"a": PolicyEffect(0.05), "b": PolicyEffect(0.07), "c": PolicyEffect(0.02, growth=1.0)}


def plan(hypotheses, fraction=0.5):
    return {"plan": {"name": "pw", "alpha": 0.05, "salt": "pw", "confirmatory_fraction": fraction},
            "windows": {"early": [1, 2], "late": [4, 6]}, "hypothesis": hypotheses}


HYPS = [{"id": "occ", "family": "f", "metric": "occurrence", "compare": ["a", "b"], "direction": "less"},
        {"id": "rmtd", "family": "f", "metric": "rmtd", "compare": ["a", "b"], "direction": "greater",
         "test": "ttest"},
        {"id": "drift", "family": "g", "metric": "branch_tv", "policy": "c", "compare": ["late", "early"],
         "direction": "greater", "split": "all"}]


@pytest.fixture(scope="module")
def pilot():
    return simulate_study(12, EFFECTS, horizon=8, replicates=6, kind="residual", seed=4)


def test_table_has_a_row_per_hypothesis_and_design(pilot):
    res = power(plan(HYPS), pilot, docs=[12, 48], replicates=[2, 6], n_sims=400)
    t = res.table
    assert len(t) == 3 * 4 and set(t["id"]) == {"occ", "rmtd", "drift"}
    # Holm family of two: Bonferroni level; the single-member family keeps alpha
    assert np.allclose(t.loc[t["family"] == "f", "alpha_used"], 0.025)
    assert np.allclose(t.loc[t["family"] == "g", "alpha_used"], 0.05)
    # confirmatory hypotheses use half the documents, split = all uses all
    assert list(t.loc[t["id"] == "occ", "n_docs"]) == [6, 6, 24, 24]
    assert list(t.loc[t["id"] == "drift", "n_docs"]) == [12, 12, 48, 48]
    ok = t["power"].notna()
    assert ok.all(), t
    assert (t["power_low"] <= t["power"] + 1e-12).all() and (t["power"] <= t["power_high"] + 1e-12).all()
    ds = res.to_dataset()
    assert ds.attrs["level"] == 0.8 and "power" in ds


def test_power_grows_with_documents_and_replicates(pilot):
    hp = hypothesis_pilots(plan(HYPS), pilot)[0]
    by_n = [power_at(hp, n, 4, n_sims=1500, seed=1) for n in (4, 8, 16, 32)]
    assert np.all(np.diff(by_n) >= -0.02) and by_n[-1] > by_n[0] + 0.2
    # the t-test's power falls with the variance, so it grows with R up to the R = infinity limit
    # (the signed-rank test's need not: less noise can expose a skewed between-document law)
    hp_t = hypothesis_pilots(plan(HYPS), pilot)[1]
    by_r = [power_at(hp_t, 8, r, n_sims=3000, seed=1) for r in (1, 4, 64, 10 ** 9)]
    assert np.all(np.diff(by_r) >= -0.02) and by_r[-1] > by_r[0]


def test_zero_effect_has_power_alpha():
    same = simulate_study(16, {"a": PolicyEffect(0.06), "b": PolicyEffect(0.06)}, horizon=8, replicates=6,
                          kind="residual", seed=9)
    hp = hypothesis_pilots(plan([{**HYPS[0], "split": "all", "direction": "two-sided"}]), same)[0]
    assert power_at(hp, 20, 4, theta=0.0, n_sims=4000, seed=2) == pytest.approx(0.05, abs=0.015)
    # the noncentral-t approximation beyond SIMULATE_MAX_N at a zero mean difference
    hp_t = hypothesis_pilots(plan([{**HYPS[1], "split": "all", "direction": "two-sided"}]), same)[0]
    assert power_at(hp_t, 400, 4, theta=0.0, seed=2) == pytest.approx(0.05, abs=0.002)


def test_estimates_pilot_serves_scalar_metrics_only(pilot):
    est = divstats.estimate(pilot)
    t = power(plan(HYPS), est, docs=24, n_sims=200).table.set_index("id")
    assert np.isfinite(t.loc["occ", "power"]) and np.isnan(t.loc["drift", "power"])
    assert "needs traces" in t.loc["drift", "note"]


def test_unknown_policy_is_refused(pilot):
    with pytest.raises(PlanError, match="not in the pilot"):
        power(plan([{**HYPS[0], "compare": ["a", "zzz"]}]), pilot)


#: 15 designs on residual traces: all tests, both sides, simulated (n <= 100) and normal-approximation paths.
DESIGNS = {
    (0.05, 0.058): [PowerDesign("wilcoxon", "less", 6, 1), PowerDesign("wilcoxon", "less", 8, 4),
                    PowerDesign("wilcoxon", "less", 12, 1), PowerDesign("wilcoxon", "two-sided", 10, 2),
                    PowerDesign("ttest", "less", 6, 2), PowerDesign("ttest", "two-sided", 10, 1),
                    PowerDesign("permutation", "less", 8, 2), PowerDesign("wilcoxon", "less", 16, 16)],
    (0.05, 0.052): [PowerDesign("wilcoxon", "less", 120, 1), PowerDesign("wilcoxon", "two-sided", 200, 2),
                    PowerDesign("ttest", "less", 150, 1), PowerDesign("wilcoxon", "less", 60, 8),
                    # bootstrap-t (the paper plan's test): predicted as the t-test; one-sided refused below 50
                    PowerDesign("bootstrap-t", "less", 100, 2), PowerDesign("bootstrap-t", "two-sided", 60, 2),
                    PowerDesign("bootstrap-t", "less", 40, 8)],
}


#: Studies per design (observed) and simulations per prediction. The observed side (one
#: ``paired_pvalue``, paired_test's p-value, per study) and the two simulated pools cost
#: ~all of the test's time; at 500 the SE of one design's
#: difference is at most sqrt(.25/500 + .25/4000) = 0.024, so the per-design bound below
#: stays ~3 SE as 0.05 was at 1,000 studies (0.018); the pooled checks add what halving
#: the studies took: a bias shared by the designs is seen from ~0.02 (3 SE of the mean of 15).
CALIBRATION_STUDIES, CALIBRATION_SIMS = 500, 4000


def calibration_problems(table) -> list[str]:
    """What is wrong with a ``power_calibration`` table at the sizes above (empty: nothing)."""
    from scipy import stats

    p = table["predicted"].clip(0.01, 0.99)
    se = np.sqrt(p * (1 - p) * (1 / CALIBRATION_STUDIES + 1 / CALIBRATION_SIMS))
    z = table["difference"] / se
    problems = []
    if (table["difference"].abs() > 0.07).any():
        problems.append(f"a design off by more than 0.07 (~3 SE):\n{table}")
    if abs(z.mean()) > 3 / np.sqrt(len(z)):
        problems.append(f"a shared bias: mean z {z.mean():.2f} over {len(z)} designs")
    if (z**2).sum() > stats.chi2.ppf(0.999, len(z)):
        problems.append(f"too spread: sum z^2 {(z**2).sum():.1f} > chi2({len(z)}) 0.999 quantile")
    return problems


@pytest.mark.slow
def test_predicted_power_matches_simulated_studies():
    import pandas as pd

    table = pd.concat([power_calibration(designs, effects, n_studies=CALIBRATION_STUDIES,
                                         n_sims=CALIBRATION_SIMS, seed=3)
                       for effects, designs in DESIGNS.items()])
    assert len(table) >= 12
    # the designs span the interesting range, so agreement is not trivial (all 0 or all 1)
    assert table["observed"].between(0.15, 0.95).sum() >= 10
    assert not calibration_problems(table), calibration_problems(table)


def test_pilot_replicates_are_the_counted_ones() -> None:
    # An adaptive collection's pilot round (round 0) and padding do not count: the
    # power table's default R and the per-replicate variance use the counted R.
    import numpy as np

    from divstats.design.pilot import counted_replicates
    from divstats.design.power import power
    from divstats.truth.studies import PolicyEffect, simulate_study

    ds = simulate_study(6, {"a": PolicyEffect(0.05), "b": PolicyEffect(0.15)}, horizon=6, replicates=6,
                        kind="residual", seed=3)
    adaptive = ds.assign_coords(round=("replicate", np.array([0, 0, 1, 1, 1, 1])))
    assert (counted_replicates(ds) == 6).all() and (counted_replicates(adaptive) == 4).all()
    plan = {"plan": {"name": "p", "salt": "s"}, "hypothesis": [
        {"id": "h", "family": "f", "metric": "occurrence", "compare": ["a", "b"], "split": "all"}]}
    assert power(plan, adaptive, docs=[10], n_sims=50).pilot_replicates == 4


def test_power_table_columns_stay_aligned() -> None:
    # a long "test direction" cell ("bootstrap-t greater") must not shift the columns after it
    import pandas as pd

    from divstats.cli.power import format_power_table

    row = dict(id="h", metric="rmtd", a="x", b="y", alpha_used=0.05, docs=10, replicates=8, n_docs=10,
               effect=0.1, sd_between=0.2, sd_replicate=0.3, power=0.5, power_low=0.4, power_high=0.6)
    table = pd.DataFrame([{**row, "test": "bootstrap-t", "direction": "greater"},
                          {**row, "test": "ttest", "direction": "less"}])
    head, _, *lines = format_power_table(table)
    assert len({line.index("0.0500") for line in lines}) == 1
    assert head.index("alpha") + len("alpha") == lines[0].index("0.0500") + len("0.0500")


def test_cli_prints_each_rows_refusal_once() -> None:
    import pandas as pd

    from divstats.cli.power import row_notes

    table = pd.DataFrame({"id": ["a", "a", "b", "c"],
                          "note": ["refused at 7", "", "refused at 7; window beyond W", None]})
    assert row_notes(table, ["window beyond W"]) == ["note (a, b): refused at 7"]


@pytest.mark.parametrize("direction", ["two-sided", "greater", "less"])
def test_large_studies_have_power_not_nan(direction: str) -> None:
    # scipy's noncentral t returns NaN at large noncentrality (here ~100); power is then ~1 or ~0
    import math

    from divstats.design.pilot import hypothesis_pilots
    from divstats.design.power import power_at
    from divstats.truth.studies import PolicyEffect, simulate_study

    pilot = simulate_study(8, {"a": PolicyEffect(0.05), "b": PolicyEffect(0.3)}, horizon=6, replicates=4, seed=1)
    plan = {"plan": {"name": "p", "salt": "s"}, "hypothesis": [
        {"id": "h", "family": "f", "metric": "occurrence", "compare": ["b", "a"], "split": "all",
         "direction": direction, "test": "ttest"}]}
    hp = hypothesis_pilots(plan, pilot)[0]
    value = power_at(hp, 20_000, 4)
    assert math.isfinite(value) and value == (0.0 if direction == "less" else 1.0)
