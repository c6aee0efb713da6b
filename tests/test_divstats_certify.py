"""The certified budget: fixed-sequence non-inferiority over a family (divstats.inference.certify)."""

from __future__ import annotations

import numpy as np
import pytest

import divstats
from divstats.calibration.certification import (
    broken_all_budgets,
    certified_index,
    certify_calibration,
    sweep_values,
)
from divstats.inference.certify import certify_budget


def test_sequence_stops_at_first_failure_and_adjusts() -> None:
    rng = np.random.default_rng(1)
    # budget 2 is far outside the margin, budget 3 inside again: the sequence must stop at 2
    v = np.array([0.0, 0.0, 0.3, 0.0]) + 0.03 * rng.standard_normal((60, 4))
    res = certify_budget(v, 0.05, budgets=["a@0.9", "a@0.7", "a@0.5", "a@0.3"], kept=[0.9, 0.7, 0.5, 0.3],
                         n_resamples=499)
    assert res.certified == "a@0.7" and res.certified_index == 1 and res.tested == 3
    assert res.pvalue[3] < 0.05 and not res.shown[3]          # shown alone, but after the stop
    assert np.all(np.diff(res.pvalue_adjusted) >= 0)
    assert "stopped at a@0.5" in res.reason and "KV kept 0.7" in res.verdict
    low, high = res.confidence_interval()
    assert np.all(np.isinf(low)) and np.all(high[:2] < 0.05) and high[2] > 0.05
    ds = res.to_dataset()
    assert ds.attrs["certified"] == "a@0.7" and list(ds["shown"].values) == [True, True, False, False]


def test_smaller_is_worse_and_control_reference() -> None:
    rng = np.random.default_rng(2)
    control = 20 + rng.standard_normal(60)
    v = control[:, None] - np.array([0.0, 0.2, 3.0]) + 0.2 * rng.standard_normal((60, 3))
    res = certify_budget(v, -1, worse="lower", reference=control, n_resamples=499)
    assert res.certified == "1" and res.worse == "smaller" and res.margin == -1
    assert res.reference == "the measured control"
    with pytest.raises(ValueError, match="reference has"):
        certify_budget(v, -1, worse="smaller", reference=control[:5])


def test_refused_below_the_document_count() -> None:
    v = np.zeros((30, 3)) + np.linspace(0, 0.01, 30)[:, None]
    res = certify_budget(v, 0.05, n_resamples=199)
    assert res.certified is None and res.tested == 1
    assert "n = 30 documents" in res.reason and "need ≥ 50" in res.reason
    assert np.isnan(res.pvalue).all()


def _estimates(n: int = 60, seed: int = 3):
    """An estimates-shaped dataset over (model, doc, policy): occurrence rising as snapkv keeps less."""
    import xarray as xr

    rng = np.random.default_rng(seed)
    pols = ["full", "snapkv@0.9", "snapkv@0.5", "snapkv@0.3", "recent@0.5", "recent@0.9"]
    mu = np.array([0.0, 0.005, 0.02, 0.3, 0.2, 0.01])
    occ = np.clip(mu + 0.03 * rng.standard_normal((2, n, len(pols))), 0, 1)
    occ[:, :, 0] = 0.0
    return xr.Dataset({"occurrence": (("model", "doc", "policy"), occ),
                       "rmtd": (("model", "doc", "policy"), 8 - 8 * occ)},
                      coords={"model": ["m1", "m2"], "doc": [f"d{i}" for i in range(n)], "policy": pols,
                              "retention": ("policy", [1.0, 0.9, 0.5, 0.3, 0.5, 0.9]),
                              "budget": ("policy", [-1] * 6)}, attrs={"horizon": 8})


def test_family_on_a_dataset_per_model() -> None:
    est = _estimates()
    with pytest.raises(divstats.DivstatsError, match="name one"):
        divstats.certify_family(est, "snapkv", "occurrence", 0.05)
    res = divstats.certify_family(est, "snapkv", "occurrence", 0.05, model="m1", n_resamples=299)
    assert res.budgets == ("snapkv@0.9", "snapkv@0.5", "snapkv@0.3") and res.reference == "the measured control"
    assert res.certified == "snapkv@0.5" and list(res.kept) == [0.9, 0.5, 0.3]
    res = divstats.certify_family(est.drop_sel(policy="full"), "snapkv@*", "rmtd", -1, model="m2", n_resamples=299)
    assert res.reference == "8" and res.worse == "smaller" and res.certified == "snapkv@0.5"
    with pytest.raises(divstats.DivstatsError, match="families are"):
        divstats.certify_family(est, "nope", "occurrence", 0.2, model="m1")


def test_curves_with_band_per_model() -> None:
    est = _estimates()
    cur = divstats.budget_curves(est, "occurrence", cross=0.1, n_resamples=299)
    assert cur["mean"].dims == ("model", "family", "budget") and list(cur["family"].values) == ["snapkv@*", "recent@*"]
    one = cur.sel(model="m1", family="snapkv@*")
    assert list(one["policy"].values) == ["snapkv@0.9", "snapkv@0.5", "snapkv@0.3"]
    assert np.all(one["band_low"] <= one["low"]) and np.all(one["band_high"] >= one["high"])
    # the crossing of 0.1 lies between 0.5 (mean ~0.02) and 0.3 (~0.3), inside its band interval
    c = float(one["crossing"])
    assert 0.3 < c < 0.5 and float(one["crossing_low"]) <= c <= float(one["crossing_high"])
    assert cur["band_low"].attrs["description"] and np.isnan(cur.sel(model="m1", family="recent@*")["mean"][2])


def test_familywise_error_small_and_broken_procedure_caught() -> None:
    # all budgets exactly at the margin: any certification is a false claim
    table = certify_calibration(sims=150, sizes=(50,), populations=("skewed",), scenarios=("all-at-margin",),
                                n_budgets=6, n_resamples=199, seed=5, power=False)
    fwer = table["fwer"].iloc[0]
    assert fwer < 0.11                                      # alpha 0.05, SE ~0.018 at 150 studies
    rng = np.random.default_rng(5)
    broken = np.mean([broken_all_budgets(sweep_values(rng, 50, np.full(6, 0.05), "skewed"), 0.05, n_resamples=199)
                      for _ in range(150)])
    assert broken > 0.12                                    # testing every budget without order inflates it


def _cert_plan(**over):
    c = {"id": "C1", "family": "snapkv", "metric": "occurrence", "margin": 0.05, "split": "all", **over}
    return {"plan": {"name": "t", "salt": "s"}, "certify": [c]}


def test_plan_certify_validation() -> None:
    plan = divstats.load_plan(_cert_plan())
    assert plan.hypotheses == () and plan.certifications[0].worse == "larger"
    assert divstats.load_plan(_cert_plan(metric="rmtd", margin=-1)).certifications[0].margin == 1
    for over, match in [({"metric": "nope"}, "estimand"), ({"margin": 0}, "non-zero"),
                        ({"family": "snapkv@0.9,2"}, "outside"), ({"family": "snapkv@0.5"}, "one member"),
                        ({"test": "wilcoxon"}, "must be one of"), ({"reference": "x"}, "reference"),
                        ({"fmaily": 1}, "unknown key")]:
        with pytest.raises(divstats.PlanError, match=match):
            divstats.load_plan(_cert_plan(**over))


def test_run_plan_certifies_per_model() -> None:
    import xarray as xr

    est = _estimates()
    # run_plan needs traces only for what it computes; hand it the estimates to reuse
    ds = xr.Dataset(coords={"doc": est["doc"].values, "policy": est["policy"].values, "model": est["model"].values},
                    attrs={"horizon": 8, "kind": "coupled"})
    res = divstats.run_plan(ds, _cert_plan(), estimates=est, n_resamples=199)
    assert list(res.certify["model"]) == ["m1", "m2"] and set(res.certify["certified"]) == {"snapkv@0.5"}
    assert res.certified[("C1", "m1")].reference == "the measured control" and res.table.empty
    with pytest.raises(divstats.PlanError, match="families are"):
        divstats.run_plan(ds, _cert_plan(family="h2o"), estimates=est, n_resamples=99)


def test_fast_calibration_path_agrees_with_certify_budget() -> None:
    rng = np.random.default_rng(11)
    for s, mu in enumerate([np.full(5, 0.05), np.array([0.0, 0.0, 0.02, 0.05, 0.1]), np.zeros(5)]):
        v = sweep_values(rng, 50, mu, "skewed")
        assert certified_index(v, 0.05, n_resamples=299, seed=s) == \
            certify_budget(v, 0.05, n_resamples=299, seed=s).certified_index


def test_certify_power_from_a_pilot() -> None:
    from divstats.design.certify_power import certify_power

    est = _estimates(n=40)
    table = certify_power(_cert_plan(model="m1"), est, docs=[30, 50, 200], n_sims=30, n_resamples=99)
    assert set(table["budget"]) == {"snapkv@0.9", "snapkv@0.5", "snapkv@0.3"}
    p = table.set_index(["budget", "docs"])["power"]
    assert p[("snapkv@0.9", 30)] == 0.0                     # refused below 50 documents
    assert p[("snapkv@0.9", 200)] > 0.9 and p[("snapkv@0.3", 200)] == 0.0
    needed = table.set_index("budget")["docs_needed"]
    assert needed["snapkv@0.9"].iloc[0] in (50, 200) and np.isnan(needed["snapkv@0.3"].iloc[0])
    assert "past the margin" in table.set_index("budget")["note"]["snapkv@0.3"].iloc[0]


def test_kvdiv_power_prints_certify(tmp_path) -> None:
    from click.testing import CliRunner

    from divstats.cli.power import power_command
    from protocols import save_traces

    eff = {"snapkv@0.9": 0.01, "snapkv@0.5": 0.05, "snapkv@0.3": 0.4}
    ds = divstats.simulate_study(12, {p: divstats.PolicyEffect(e) for p, e in eff.items()}, horizon=5, replicates=4)
    save_traces(ds, tmp_path / "t.nc")
    plan = tmp_path / "p.toml"
    plan.write_text('[plan]\nname = "c"\nsalt = "s"\n\n[[certify]]\nid = "C"\nfamily = "snapkv@0.9,0.5,0.3"\n'
                    'metric = "occurrence"\nmargin = 0.2\nsplit = "all"\n')
    res = CliRunner().invoke(power_command, [str(tmp_path / "t.nc"), "--plan", str(plan), "--docs", "50",
                                             "--sims", "100"])
    assert res.exit_code == 0, res.output
    assert "certify C: power to certify each budget" in res.output and "hypothesis metric" not in res.output


def test_report_section_renders(tmp_path) -> None:
    from divstats.report.analysis import compute
    from divstats.report.render import figure_png, make_figures, render_html, render_markdown

    eff = {"snapkv@0.9": 0.01, "snapkv@0.5": 0.05, "snapkv@0.3": 0.3, "recent@0.9": 0.05, "recent@0.5": 0.3}
    ds = divstats.simulate_study(12, {p: divstats.PolicyEffect(e) for p, e in eff.items()}, horizon=4, replicates=4)
    plan = {"plan": {"name": "sweep", "salt": "s"}, "certify": [
        {"id": "C", "family": "snapkv", "metric": "occurrence", "margin": 0.1, "split": "all"}]}
    an = compute(ds, plan, n_resamples=99, progress=False)
    assert list(an.compression["family"].values) == ["snapkv@*", "recent@*"]
    row = an.plan_result.certify.iloc[0]
    # occurrence has a known range: below 50 documents each test is the betting test, which cannot
    # show snapkv@0.9 within 0.1 from 12 documents (a bound near 0.26), and says so
    assert row["certified"] == "" and "not shown non-inferior" in row["reason"]
    figs = make_figures(an)
    html = render_html(an, {k: figure_png(v) for k, v in figs.items()})
    assert "How much can I compress?" in html and "compression" in figs and "no budget certified" in html
    assert "## How much can I compress?" in render_markdown(an)
    # without a plan: the curves, no margin
    an = compute(ds, n_resamples=99, progress=False)
    assert an.compression.attrs["metric"] == "mismatch_fraction" and "nothing certified" in render_markdown(an)


def test_results_nc_carries_the_section(tmp_path) -> None:
    from divstats.report.analysis import compute
    from divstats.report.results import results_dataset, save_results

    eff = {"snapkv@0.9": 0.01, "snapkv@0.5": 0.05, "recent@0.9": 0.05, "recent@0.5": 0.3}
    ds = divstats.simulate_study(10, {p: divstats.PolicyEffect(e) for p, e in eff.items()}, horizon=4, replicates=3)
    plan = {"plan": {"name": "sweep", "salt": "s"}, "certify": [
        {"id": "C", "family": "snapkv", "metric": "occurrence", "margin": 0.1, "split": "all"}]}
    res = results_dataset(compute(ds, plan, n_resamples=99, progress=False))
    assert res["compression_mean"].dims == ("compression_family", "compression_budget")
    assert list(res["certify_id"].values) == ["C"] and "policy" in res.dims
    save_results(res, tmp_path / "results.nc")


def test_curves_of_a_bounded_metric_stay_in_its_range_near_a_bound() -> None:
    """Accuracies near 0 (0/1 scores, few right): bootstrap-t's end is infinite where a resample has no
    spread; the curve's intervals are the bounded-means rule's instead, inside [0, 1] and around the mean."""
    from divstats.truth.answers import with_answer_scores
    from divstats.truth.studies import PolicyEffect, simulate_study

    tr = simulate_study(30, {"snapkv@0.5": PolicyEffect(0.5), "snapkv@0.3": PolicyEffect(0.6)}, horizon=6,
                        replicates=1, seed=3)
    tr = with_answer_scores(tr, {"snapkv@0.5": (0.9, 0.0), "snapkv@0.3": (0.95, 0.0)}, x_accuracy=0.6, seed=3)
    # the demo's pass keys: 0/1 scores, Q right on 3 of 30 documents (a resample without them has no spread)
    y = np.zeros(tr["y_score"].shape)
    y[[2, 11, 23]] = 1.0
    tr["y_score"] = tr["y_score"].copy(data=y)
    cur = divstats.budget_curves(divstats.answer_values(tr), "accuracy", worse="smaller", n_resamples=299)
    one = cur.isel(family=0)
    mean, low, high = (one[v].values for v in ("mean", "low", "high"))
    assert np.all(mean < 0.3)
    for v in ("low", "high", "band_low", "band_high"):
        assert np.all((one[v].values >= 0.0) & (one[v].values <= 1.0)), v
    assert np.all((low <= mean) & (mean <= high))
    assert np.all(high < 0.7)       # the betting interval, not bootstrap-t's whole side
