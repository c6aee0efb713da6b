"""Plans: format validation, the hash split, paired tests, Holm, run-time refusals.

These tests build per-document estimate datasets by hand, so they exercise the plan
machinery independently of the estimators (the end-to-end test on simulated traces
is in test_divstats_plans_e2e.py).
"""

from __future__ import annotations

import hashlib
import itertools
import json

import numpy as np
import pytest
import xarray as xr
from scipy import stats

from divstats.inference.effects import hodges_lehmann
from divstats.inference.location_tests import signed_rank_null_cdf
from divstats.inference.multiplicity import holm
from divstats.inference.paired import paired_test
from divstats.plans.format import PlanError, load_plan, parse_aliases, shipped_plan
from divstats.plans.run import TABLE_COLUMNS, run_plan
from divstats.plans.split import assign_split, split_table, split_uniform

PAPER = shipped_plan("paper")  # package data, as a wheel install has it
POLICIES = ["snapkv@0.5", "snapkv#512", "recent@0.5", "snapkv@0.9"]


def minimal_plan(**hyp_overrides) -> dict:
    hyp = {"id": "H1", "family": "f", "metric": "occurrence", "compare": ["snapkv@0.5", "recent@0.5"],
           "direction": "less", "test": "wilcoxon", "correction": "holm", "split": "all"}
    hyp.update(hyp_overrides)
    return {"plan": {"name": "t", "alpha": 0.05, "salt": "s", "confirmatory_fraction": 0.5},
            "windows": {"early": [1, 4], "late": [8, 12]}, "hypothesis": [hyp]}


def fake_data(n_docs=40, effect=0.0, tv_slope=0.0, seed=0, split=None, models=None):
    """Estimate + branch_tv datasets over (doc, policy[, model]) with a planted effect.

    snapkv@0.5 gets occurrence lowered by ``effect`` and rmtd raised by 10·effect;
    branch_tv rises with age at ``tv_slope`` per step.
    """
    rng = np.random.default_rng(seed)
    docs = [f"doc{i}" for i in range(n_docs)]
    base = rng.uniform(0.3, 0.8, (n_docs, 1))
    shift = np.array([-effect, 0.0, 0.0, 0.0])
    occ = base + shift + rng.normal(0, 0.05, (n_docs, 4))
    rmtd = 20 - 10 * (base + shift) + rng.normal(0, 0.5, (n_docs, 4))
    ages = np.arange(24)
    bt = 0.2 + tv_slope * ages + rng.normal(0, 0.05, (n_docs, 4, 24))
    coords = {"doc": docs, "policy": POLICIES, "split": ("doc", split or [""] * n_docs)}
    est = xr.Dataset({"occurrence": (("doc", "policy"), occ), "rmtd": (("doc", "policy"), rmtd)},
                     coords=coords, attrs={"horizon": 24})
    branch = xr.Dataset({"branch_tv": (("doc", "policy", "age"), bt)}, coords={**coords, "age": ages})
    if models:
        est = xr.concat([est] * len(models), dim=xr.DataArray(models, dims="model", name="model"))
        branch = xr.concat([branch] * len(models), dim=xr.DataArray(models, dims="model", name="model"))
    return est, branch


# ---------------------------------------------------------------------------
# Loading and refusal
# ---------------------------------------------------------------------------

def test_paper_plan_loads_and_hashes_file_bytes():
    plan = load_plan(PAPER)
    assert plan.sha256 == hashlib.sha256(PAPER.read_bytes()).hexdigest()
    assert plan.windows == {"early": (1, 8), "late": (16, 32)}
    fams = plan.families()
    assert [h.id for h in fams["snapkv-retention"]] == [
        "F1-occ-budget", "F1-occ-recent", "F1-rmtd-budget", "F1-rmtd-recent"]
    assert {h.compare for h in fams["snapkv-retention"]} == {
        ("snapkv@0.5", "snapkv#512"), ("snapkv@0.5", "recent@0.5")}
    assert {(h.metric, h.direction) for h in fams["snapkv-retention"]} == {
        ("occurrence", "less"), ("rmtd", "greater")}
    (tv,) = fams["branch-drift"]
    assert (tv.policy, tv.compare, tv.direction) == ("snapkv@0.9", ("late", "early"), "greater")
    assert all(h.correction == "holm" and h.split == "confirmatory" for h in plan.hypotheses)


def test_dict_plan_hash_is_canonical_json():
    raw = minimal_plan()
    canon = json.dumps(raw, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert load_plan(raw).sha256 == hashlib.sha256(canon).hexdigest()
    # Key order does not matter for a dict; it is the same plan.
    reordered = {k: raw[k] for k in reversed(list(raw))}
    assert load_plan(reordered).sha256 == load_plan(raw).sha256


@pytest.mark.parametrize("mutate, message", [
    (lambda p: p.pop("plan"), "missing [plan] table"),
    (lambda p: p["plan"].pop("salt"), "'salt' must be a non-empty string"),
    (lambda p: p["plan"].update(alpha=1.5), "'alpha' must be a number in (0, 1)"),
    (lambda p: p["plan"].update(confirmatory_fraction=0), "'confirmatory_fraction' must be in (0, 1]"),
    (lambda p: p["plan"].update(alfa=0.1), "unknown key 'alfa'"),
    (lambda p: p["windows"].update(late=[12, 8]), "needs 0 <= first_age <= last_age"),
    (lambda p: p["windows"].update(late=[1]), "must be [first_age, last_age]"),
    (lambda p: p.update(hypothesis=[]), "no [[hypothesis]] entries"),
    (lambda p: p["hypothesis"][0].update(direction="smaller"), "'direction' must be one of"),
    (lambda p: p["hypothesis"][0].update(test="mannwhitney"), "'test' must be one of"),
    (lambda p: p["hypothesis"][0].update(correction="bonferroni"), "'correction' must be one of"),
    (lambda p: p["hypothesis"][0].update(split="train"), "'split' must be one of"),
    (lambda p: p["hypothesis"][0].update(compare=["snapkv@0.5"]), "'compare' must be two strings"),
    (lambda p: p["hypothesis"][0].update(compare=["a", "a"]), "names 'a' twice"),
    (lambda p: p["hypothesis"][0].update(directon="less"), "unknown key 'directon'"),
    (lambda p: p["hypothesis"][0].pop("metric"), "'metric' must be a non-empty string"),
    (lambda p: p["hypothesis"][0].update(metric="branch_tv"), "needs 'window'"),
    (lambda p: p["hypothesis"][0].update(metric="branch_tv", window="middle"), "window 'middle' is not defined"),
    (lambda p: p["hypothesis"][0].update(metric="branch_tv", policy="snapkv@0.9", compare=["late", "mid"]),
     "window 'mid' is not defined"),
    (lambda p: p["hypothesis"][0].update(policy="snapkv@0.9", compare=["late", "early"]),
     "comparing windows needs a windowed metric"),
    (lambda p: p["hypothesis"].append(dict(p["hypothesis"][0])), "duplicate id 'H1'"),
    (lambda p: p["hypothesis"].append({**p["hypothesis"][0], "id": "H2", "alpha": 0.01}),
     "different alpha values"),
])
def test_ill_formed_plans_are_refused_naming_the_problem(mutate, message):
    raw = minimal_plan()
    mutate(raw)
    with pytest.raises(PlanError) as err:
        load_plan(raw)
    assert message in str(err.value)


def test_invalid_toml_and_missing_file_are_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[plan\nname = 1\n")
    with pytest.raises(PlanError, match="not valid TOML"):
        load_plan(bad)
    with pytest.raises(PlanError, match="does not exist"):
        load_plan(tmp_path / "nope.toml")


# ---------------------------------------------------------------------------
# The split
# ---------------------------------------------------------------------------

def test_split_assignment_is_stable():
    ids = ["doc0", "doc1", "doc2", "doc3", "doc4", "doc5", "pydoc:json.loads", "wiki/Paris"]
    # Fixed expectations: changing the hash rule would silently move documents between splits.
    assert assign_split(ids, "kvdiv-paper-v1", 0.5) == [
        "confirmatory", "confirmatory", "exploratory", "exploratory", "exploratory",
        "confirmatory", "confirmatory", "exploratory"]
    assert split_uniform("doc0", "kvdiv-paper-v1") == pytest.approx(0.4688800476550458, abs=0, rel=1e-15)
    digest = hashlib.sha256(b"kvdiv-paper-v1:doc0").digest()
    assert split_uniform("doc0", "kvdiv-paper-v1") == int.from_bytes(digest[:8], "big") / 2 ** 64
    # Order- and population-independent; the salt matters; the fraction is honoured.
    assert assign_split(ids[::-1], "kvdiv-paper-v1", 0.5) == assign_split(ids, "kvdiv-paper-v1", 0.5)[::-1]
    many = [f"d{i}" for i in range(4000)]
    frac = np.mean([s == "confirmatory" for s in assign_split(many, "x", 0.3)])
    assert abs(frac - 0.3) < 0.03
    assert assign_split(many, "x", 0.5) != assign_split(many, "y", 0.5)


def test_split_disagreement_is_reported():
    plan = load_plan(PAPER)
    table = split_table(["doc0", "doc2", "doc4"], plan, ["confirmatory", "confirmatory", ""])
    assert table["agrees"].tolist() == [True, False, True]
    est, branch = fake_data(n_docs=6, split=["exploratory"] * 6)
    res = run_plan(est, minimal_plan(), estimates=est, branch=branch)
    assert res.split_note is not None and "disagrees" in res.split_note
    assert any("disagrees" in n for n in res.notes)


# ---------------------------------------------------------------------------
# Running plans
# ---------------------------------------------------------------------------

def test_run_plan_table_columns_and_planted_effect():
    # 120 documents: about 60 confirmatory, above the 50 that one-sided bootstrap-t tests need
    est, branch = fake_data(n_docs=120, effect=0.1, tv_slope=0.01, seed=1)
    res = run_plan(est, PAPER, estimates=est, branch=branch)
    assert list(res.table.columns[: len(TABLE_COLUMNS)]) == list(TABLE_COLUMNS)
    assert res.plan_sha256 == hashlib.sha256(PAPER.read_bytes()).hexdigest()
    assert res.table["reject"].all()
    assert res.table["confirmatory"].all()
    n_conf = sum(s == "confirmatory" for s in assign_split(est["doc"].values, "kvdiv-paper-v1", 0.5))
    assert (res.table["n_docs"] == n_conf).all()
    occ = res.table.set_index("id").loc["F1-occ-budget"]
    assert occ["effect"] < 0 and occ["ci_high"] < 0 and occ["ci_low"] == -np.inf
    # Windows beyond the data's ages are clipped, and that is said.
    assert any("extends past the largest age" in n for n in res.notes)


def test_holm_within_family_matches_manual_step_down():
    # 120 documents: about 60 confirmatory, above the 50 that one-sided bootstrap-t tests need
    est, branch = fake_data(n_docs=120, effect=0.02, seed=3)
    res = run_plan(est, PAPER, estimates=est, branch=branch)
    fam = res.table[res.table["family"] == "snapkv-retention"]
    p = fam["p_value"].to_numpy()
    order = np.argsort(p)
    manual = np.maximum.accumulate(np.minimum(1, (len(p) - np.arange(len(p))) * p[order]))
    expected = np.empty_like(manual)
    expected[order] = manual
    np.testing.assert_allclose(fam["p_adjusted"].to_numpy(), expected)
    assert (fam["reject"] == (fam["p_adjusted"] < 0.05)).all()
    # A one-member family is unadjusted.
    tv = res.table[res.table["family"] == "branch-drift"].iloc[0]
    assert tv["p_adjusted"] == tv["p_value"]


def test_each_model_gets_its_own_row_in_the_family():
    est, branch = fake_data(n_docs=40, effect=0.1, tv_slope=0.01, models=["m1", "m2"])
    res = run_plan(est, PAPER, estimates=est, branch=branch)
    tv = res.table[res.table["family"] == "branch-drift"]
    assert tv["id"].tolist() == ["F2-tv-late-early[m1]", "F2-tv-late-early[m2]"]
    assert tv["model"].tolist() == ["m1", "m2"]
    assert len(res.table) == 10


def test_null_plan_rarely_rejects():
    rejections = 0
    for seed in range(20):
        est, branch = fake_data(n_docs=30, effect=0.0, seed=100 + seed)
        res = run_plan(est, minimal_plan(direction="two-sided"), estimates=est, branch=branch)
        rejections += int(res.table["reject"].iloc[0])
    assert rejections <= 4  # P(Binom(20, 0.05) >= 5) < 0.003


def test_run_time_refusals():
    est, branch = fake_data(n_docs=10)
    with pytest.raises(PlanError, match=r"policy 'snapkv#512' is not in the data"):
        run_plan(est.drop_sel(policy="snapkv#512"), PAPER, estimates=est.drop_sel(policy="snapkv#512"),
                 branch=branch)
    with pytest.raises(PlanError, match="unknown metric 'occurence'"):
        run_plan(est, minimal_plan(metric="occurence"), estimates=est, branch=branch)
    raw = minimal_plan(split="exploratory")
    raw["plan"]["confirmatory_fraction"] = 1.0
    with pytest.raises(PlanError, match="'exploratory' split has no documents"):
        run_plan(est, raw, estimates=est, branch=branch)
    with pytest.raises(PlanError, match="which the plan does not use"):
        run_plan(est, minimal_plan(), estimates=est, branch=branch, aliases={"h2o@0.5": "x"})



def test_unidentified_hypothesis_is_reported_not_fatal():
    est, branch = fake_data(n_docs=10)
    raw = minimal_plan(metric="branch_tv", window="late")
    raw["windows"]["late"] = [40, 50]
    raw["hypothesis"].append({**raw["hypothesis"][0], "id": "H2", "metric": "occurrence", "window": None})
    del raw["hypothesis"][1]["window"]
    res = run_plan(est, raw, estimates=est, branch=branch)
    t = res.table.set_index("id")
    assert np.isnan(t.loc["H1", "p_value"]) and not t.loc["H1", "reject"] and t.loc["H1", "n_docs"] == 0
    assert "starts beyond the largest age" in t.loc["H1", "note"]
    assert any("starts beyond the largest age" in n for n in res.notes)
    # The other hypothesis of the family is still tested and Holm ignores the missing p-value.
    assert np.isfinite(t.loc["H2", "p_value"]) and t.loc["H2", "p_adjusted"] == t.loc["H2", "p_value"]


def test_post_hoc_alias_is_a_deviation_and_exploratory():
    est, branch = fake_data(n_docs=40, effect=0.1)
    est = est.assign_coords(policy=["snapkv@0.5", "snapkv#128", "recent@0.5", "snapkv@0.9"])
    branch = branch.assign_coords(policy=est["policy"].values)
    res = run_plan(est, PAPER, estimates=est, branch=branch, aliases=parse_aliases(["snapkv#512=snapkv#128"]))
    t = res.table.set_index("id")
    assert t.loc["F1-occ-budget", "b"] == "snapkv#128"
    assert not t.loc["F1-occ-budget", "confirmatory"] and t.loc["F1-occ-budget", "label"] == "exploratory"
    assert "snapkv#512 -> snapkv#128" in t.loc["F1-occ-budget", "deviation"]
    assert t.loc["F1-occ-recent", "confirmatory"]
    assert res.deviations == ["snapkv#512 -> snapkv#128 (substituted at run time; not in the plan)"]
    # The same substitution written into the plan is prespecified: no deviation.
    raw = minimal_plan(compare=["snapkv@0.5", "snapkv#512"], split="confirmatory")
    raw["aliases"] = {"snapkv#512": "snapkv#128"}
    res2 = run_plan(est, raw, estimates=est, branch=branch)
    assert res2.table["confirmatory"].all() and res2.deviations == []
    with pytest.raises(PlanError, match="PLANNED=ACTUAL"):
        parse_aliases(["snapkv#512"])


def test_results_table_round_trips_through_netcdf(tmp_path):
    est, branch = fake_data(n_docs=20, effect=0.1)
    res = run_plan(est, PAPER, estimates=est, branch=branch)
    path = tmp_path / "t.nc"
    res.to_dataset().to_netcdf(path, engine="h5netcdf")
    back = xr.load_dataset(path, engine="h5netcdf")
    assert back.attrs["plan_sha256"] == res.plan_sha256
    assert back["plan_id"].values.tolist() == res.table["id"].tolist()
    np.testing.assert_array_equal(back["plan_reject"].values, res.table["reject"].to_numpy())
    np.testing.assert_allclose(back["plan_p_adjusted"].values, res.table["p_adjusted"].to_numpy())


# ---------------------------------------------------------------------------
# Paired tests
# ---------------------------------------------------------------------------

def test_signed_rank_null_matches_enumeration():
    n = 8
    sums = [sum(k + 1 for k in range(n) if mask >> k & 1) for mask in range(2 ** n)]
    counts = np.bincount(sums) / 2 ** n
    np.testing.assert_allclose(signed_rank_null_cdf(n), np.cumsum(counts))


def test_hodges_lehmann_interval_uses_tabled_ranks():
    # n = 10, 95% two-sided: critical value 8, so the interval is [A_(9), A_(47)] of 55 Walsh averages.
    d = np.array([1.5, -0.2, 3.1, 0.7, 2.2, -1.0, 0.4, 1.9, 2.8, 0.1])
    i, j = np.triu_indices(10)
    walsh = np.sort((d[i] + d[j]) / 2)
    est, lo, hi = hodges_lehmann(d, 0.95)
    assert est == np.median(walsh)
    # The ends are those Walsh averages; at A_(9) = 0.1 = d_10 the test of d - 0.1 drops a zero
    # and rejects, so that end is open (reported as the next float).
    assert (lo, hi) == (pytest.approx(walsh[8], abs=1e-15), walsh[46])


def test_paired_tests_agree_with_scipy_and_enumeration():
    rng = np.random.default_rng(5)
    a, b = rng.normal(0.4, 1, 12), rng.normal(0, 1, 12)
    d = a - b
    w = paired_test(a, b, "wilcoxon", "greater")
    assert w.pvalue == pytest.approx(stats.wilcoxon(d, alternative="greater").pvalue)
    t = paired_test(a, b, "ttest", "two-sided", mean_ci="t")   # the default interval is bootstrap-t
    ref = stats.ttest_rel(a, b)
    assert t.pvalue == pytest.approx(ref.pvalue)
    assert (t.ci_low, t.ci_high) == pytest.approx(tuple(ref.confidence_interval(0.95)))
    p = paired_test(a, b, "permutation", "greater")
    assert p.exact
    flips = np.array(list(itertools.product([-1, 1], repeat=12)))
    null = (flips * np.abs(d)).mean(axis=1)
    assert p.pvalue == pytest.approx(np.mean(null >= d.mean() - 1e-12))


def test_nan_pairs_are_dropped_and_ties_handled():
    a = np.array([1.0, 2.0, np.nan, 4.0, 5.0, 6.0])
    b = np.array([0.0, 1.0, 1.0, np.nan, 3.0, 4.0])
    assert paired_test(a, b).n == 4
    z = paired_test(np.ones(10), np.ones(10), "wilcoxon")
    assert z.pvalue == 1.0 and z.effect == 0.0


def test_holm_keeps_nan():
    reject, adj = holm(np.array([0.01, np.nan, 0.04]), 0.05)
    assert np.isnan(adj[1]) and not reject[1]
    np.testing.assert_allclose(adj[[0, 2]], [0.02, 0.04])
