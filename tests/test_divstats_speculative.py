"""Speculative decoding with Q as the draft (docs/statistics.md §10): the exact enumerator against
closed forms, the simulated algorithm and the estimator from reference traces against the
enumerator (|z| < 4.5), the estimator's variance against the plain simulation's, EOS and
-inf log-probabilities, refusals, and the aggregation over documents."""

from __future__ import annotations

import math

import numpy as np
import pytest
from divstats_cases import CASES

import divstats as dv
from divstats.estimation.speculative import expected_calls
from protocols import reference_dataset

Z_MAX = 4.5
N_REP = 3000
#: (case name, gamma): history dependence, EOS, near point masses, TV = 1 steps.
PAIRS = [("markov3", 1), ("markov3", 4), ("markov3_eos", 2), ("near_point_mass", 3),
         ("tv_one", 2), ("hashed4_eos", 1), ("hashed4_eos", 4)]
CASE = {c.name: c for c in CASES}


def iid(vec):
    v = np.asarray(vec, dtype=float)
    return lambda h: v


def test_closed_forms() -> None:
    """Q = P accepts every draft: ceil(T / (γ + 1)) calls; disjoint supports accept none: T calls;
    one position accepts its draft with probability α = Σ min(p, q) = 1 − TV."""
    p = iid([0.5, 0.3, 0.2])
    for T, g in ((7, 2), (8, 3), (1, 4)):
        r = dv.exact_target_calls(p, p, 3, T, g)
        assert r.target_calls == pytest.approx(math.ceil(T / (g + 1)))
        assert r.tokens == pytest.approx(T)
    r = dv.exact_target_calls(iid([1.0, 0.0]), iid([0.0, 1.0]), 2, 5, 3)
    assert (r.target_calls, r.accepted, r.tokens_per_call) == (pytest.approx(5.0), 0.0, pytest.approx(1.0))
    q = iid([0.4, 0.4, 0.2])
    assert dv.exact_target_calls(p, q, 3, 1, 3).accepted == pytest.approx(1 - 0.1)   # α = 1 - TV


def test_history_free_calls_closed_form() -> None:
    """History-free kernels with acceptance α, T = 2, γ = 1: a second call is needed unless
    the first draft is accepted (then the bonus fills position 2): E[C] = 2 − α."""
    p, q = iid([0.5, 0.3, 0.2]), iid([0.4, 0.4, 0.2])
    alpha = 0.9
    r = dv.exact_target_calls(p, q, 3, 2, 1)
    assert r.target_calls == pytest.approx(2 - alpha)
    assert r.accepted == pytest.approx(alpha + (1 - alpha) * alpha)   # position 2 is drafted after a rejection
    # γ = 2, T = 3: a call opens at 1; at 2 when position 1 is rejected; at 3 when position 2
    # is rejected, whichever call drafted it (A1 ¬A2, or ¬A1 and the new call's first draft
    # rejected): E[C] = 1 + (1 − α) + (1 − α)
    r = dv.exact_target_calls(p, q, 3, 3, 2)
    assert r.target_calls == pytest.approx(3 - 2 * alpha)


def test_recursion_by_hand() -> None:
    a = np.array([[1.0, 1.0, 1.0, 0.0, 0.5]])
    c, acc = expected_calls(a, np.array([5]), 2)
    # call 1: positions 1, 2 accepted, 3 bonus; call 2: position 4 rejected; call 3 opens at 5
    assert c.tolist() == [3.0] and acc.tolist() == [2.5]
    c, _ = expected_calls(a, np.array([3]), 2)      # the path ended at 3: one call
    assert c.tolist() == [1.0]


@pytest.mark.parametrize(("name", "gamma"), PAIRS, ids=[f"{n}-g{g}" for n, g in PAIRS])
def test_estimator_and_algorithm_against_exact(name: str, gamma: int) -> None:
    case = CASE[name]
    ex = dv.exact_target_calls(case.p, case.q, case.vocab_size, case.horizon, gamma, eos=case.eos)
    ds = dv.simulate(case.p, case.q, case.vocab_size, case.horizon, N_REP, kind="reference", seed=11, eos=case.eos)
    spec = dv.speculative(ds, gamma=gamma).squeeze()
    runs = dv.simulate_speculative(case.p, case.q, case.vocab_size, case.horizon, gamma, N_REP, seed=12,
                                   eos=case.eos)
    for var, sim in (("target_calls", runs.calls), ("tokens", runs.tokens), ("accepted", runs.accepted)):
        truth = getattr(ex, var)
        est, se = float(spec[var]), float(spec[var + "_se"])
        if se == 0:
            assert est == pytest.approx(truth, abs=1e-9), var
        else:
            assert abs(est - truth) / se < Z_MAX, (var, est, truth, se)
        sim_se = sim.std(ddof=1) / math.sqrt(N_REP)
        if sim_se == 0:
            assert sim.mean() == pytest.approx(truth, abs=1e-9), var
        else:
            assert abs(sim.mean() - truth) / sim_se < Z_MAX, (var, sim.mean(), truth, sim_se)
    ratio = float(spec["tokens_per_call"])
    assert abs(ratio - ex.tokens_per_call) / float(spec["tokens_per_call_se"]) < Z_MAX


def test_estimator_variance_below_the_algorithm_runs() -> None:
    """E[C | path] is a conditional expectation of C: its variance is at most C's (Rao-Blackwell);
    on this pair it is a fraction of it."""
    case = CASE["markov3"]
    ds = dv.simulate(case.p, case.q, case.vocab_size, 8, N_REP, kind="reference", seed=3)
    se = float(dv.speculative(ds, gamma=3)["target_calls_se"].squeeze())
    runs = dv.simulate_speculative(case.p, case.q, case.vocab_size, 8, 3, N_REP, seed=4)
    sim_se = runs.calls.std(ddof=1) / math.sqrt(N_REP)
    assert (se / sim_se) ** 2 < 0.8


def test_every_gamma_from_one_trace_and_the_speedup() -> None:
    case = CASE["markov3"]
    ds = dv.simulate(case.p, case.q, case.vocab_size, 6, 400, kind="reference", seed=5)
    spec = dv.speculative(ds, gamma=(4, 1, 2), cost_ratio=0.05)
    assert spec["gamma"].values.tolist() == [1, 2, 4]
    assert spec["target_calls"].dims == ("doc", "policy", "gamma")
    calls = spec["target_calls"].squeeze().values
    assert (np.diff(calls) <= 1e-12).all()       # more drafts never need more calls along the same paths
    speedup = spec["speedup"].squeeze().values
    np.testing.assert_allclose(speedup, 6 / (calls * (1 + np.array([1, 2, 4]) * 0.05)))
    assert int(spec["best_gamma"].squeeze()) == [1, 2, 4][int(np.argmax(speedup))]
    assert "speedup" not in dv.speculative(ds, gamma=2)


def _ref(logp, logq, tokens=None, eos=None):
    logp, logq = np.asarray(logp, float), np.asarray(logq, float)
    tokens = np.zeros(logp.shape, int) if tokens is None else tokens
    return reference_dataset(tokens, logp, logq, vocab_size=4, eos_token_id=eos)


def test_minus_infinity_and_eos() -> None:
    # log p a rounding above 0 (float32 log 1) is a probability of 1, not an error
    # (γ = 2: position 1 accepted with a_1; position 2 is drafted either way, a_2 = 1)
    ok = dv.speculative(_ref([[4e-6, -0.1]], [[-0.1, -0.1]]), gamma=2).squeeze()
    assert float(ok["accepted"]) == pytest.approx(np.exp(-0.1 - 4e-6) + 1.0)
    # log q = -inf: that draft is always rejected, its position ends a call
    ds = _ref([[-0.1, -0.1, -0.1]], [[-0.1, -np.inf, -0.1]])
    spec = dv.speculative(ds, gamma=4).squeeze()
    assert float(spec["target_calls"]) == 2.0 and float(spec["accepted"]) == 2.0
    # a path that ends at EOS (token 3 at step 2): the rest is not produced, whatever it holds
    ds = _ref([[-0.1, -0.1, 0.0, 0.0]], [[-0.1, -0.1, 0.0, 0.0]], tokens=np.array([[1, 3, 3, 3]]), eos=3)
    spec = dv.speculative(ds, gamma=1).squeeze()
    assert float(spec["tokens"]) == 2.0 and float(spec["target_calls"]) == 1.0


def test_refusals_name_the_problem() -> None:
    coupled = dv.simulate(iid([0.5, 0.5]), iid([0.4, 0.6]), 2, 3, 2)
    with pytest.raises(dv.DivstatsError, match="reference traces"):
        dv.speculative(coupled)
    ds = _ref([[-0.1, -np.inf]], [[-0.1, -0.1]])
    with pytest.raises(dv.DivstatsError, match=r"x_logp .* replicate=0, step=2"):
        dv.speculative(ds)
    with pytest.raises(dv.DivstatsError, match=r"x_logq .*NaN"):
        dv.speculative(_ref([[-0.1, -0.2]], [[np.nan, -0.1]]))
    good = _ref([[-0.1, -0.2]], [[-0.3, -0.1]])
    for bad in (0, (2, 2), (), 1.5, True):
        with pytest.raises(dv.DivstatsError, match="gamma"):
            dv.speculative(good, gamma=bad)
    for bad in ("measured", -0.1, float("nan")):
        with pytest.raises(dv.DivstatsError, match="cost_ratio"):
            dv.speculative(good, cost_ratio=bad)
    with pytest.raises(ValueError, match="gamma"):
        dv.exact_target_calls(iid([0.5, 0.5]), iid([0.5, 0.5]), 2, 3, 0)


def _study(n_docs: int):
    cases = [CASE["markov3"], CASE["near_point_mass"]]
    parts = []
    for d in range(n_docs):
        pol = []
        for k, c in enumerate(cases):
            pol.append(dv.simulate(c.p, c.q, 3, 4, 60, kind="reference", seed=100 * d + k,
                                   doc=f"d{d}", policy=f"pol{k}"))
        parts.append(pol)
    import protocols
    return protocols.combine([protocols.combine(p, dim="policy") for p in parts], dim="doc")


def test_aggregate_over_documents() -> None:
    spec = dv.speculative(_study(12), gamma=(1, 3), cost_ratio=0.1)
    agg = dv.aggregate_speculative(spec, n_resamples=200)
    assert agg["tokens_per_call"].dims == ("policy", "gamma")
    assert agg.attrs["reason"] == ""
    for name in ("target_calls", "tokens_per_call", "accepted_per_call", "speedup"):
        assert bool((agg[f"{name}_low"] <= agg[name]).all() & (agg[name] <= agg[f"{name}_high"]).all()), name
    np.testing.assert_allclose(agg["target_calls"], spec["target_calls"].mean("doc"))
    np.testing.assert_allclose(agg["tokens_per_call"], spec["tokens"].mean("doc") / spec["target_calls"].mean("doc"))
    assert agg["best_gamma"].dims == ("policy",)
    few = dv.aggregate_speculative(dv.speculative(_study(3), gamma=2), n_resamples=50)
    assert few.attrs["reason"].startswith("not estimable") and bool(few["tokens_per_call_low"].isnull().all())
    assert "speedup" not in few


def test_report_section_only_with_reference_traces(tmp_path) -> None:
    from click.testing import CliRunner

    from divstats.cli.analyze import analyze as analyze_cmd
    from divstats.report.analysis import compute
    from divstats.report.render import make_figures, render_html, render_markdown
    from protocols import save_traces

    ds = _study(12)
    an = dv.analyze(ds, None, tmp_path / "ref", n_resamples=99, progress=False, cost_ratio=0.05)
    assert an.speculative is not None and an.speculative["best_gamma"].dims == ("policy",)
    html = (tmp_path / "ref" / "report.html").read_text(encoding="utf-8")
    md = (tmp_path / "ref" / "summary.md").read_text(encoding="utf-8")
    assert "<h2>Speculative decoding" in html and 'alt="tokens per call against gamma"' in html
    assert "## Speculative decoding" in md and "cost ratio c = 0.05" in md and "★" in md
    import xarray as xr
    with xr.open_dataset(tmp_path / "ref" / "results.nc", engine="h5netcdf") as res:
        assert res["speculative_tokens_per_call"].dims == ("policy", "gamma")
    # The two analyses below check what the pages say, not the writing (checked above and by the CLI run
    # below): rendered in memory, the same strings write_report puts in summary.md and report.html,
    # without two more sets of figures and results.nc files.
    no_c = compute(ds, None, n_resamples=99, progress=False)
    assert "speedup" not in no_c.speculative
    assert "--cost-ratio" in render_markdown(no_c)
    coupled = dv.simulate(iid([0.5, 0.5]), iid([0.4, 0.6]), 2, 4, 5)
    an = compute(coupled, None, n_resamples=99, progress=False)
    assert an.speculative is None
    assert "Speculative decoding" not in render_html(an, {k: b"" for k in make_figures(an)})
    path = save_traces(ds, tmp_path / "ref.nc")
    result = CliRunner().invoke(analyze_cmd, [str(path), "--out", str(tmp_path / "cli"), "--cost-ratio", "0.1",
                                              "--n-resamples", "99", "-q"])
    assert result.exit_code == 0, result.output
    assert "cost ratio c = 0.1" in (tmp_path / "cli" / "summary.md").read_text(encoding="utf-8")


SPEC_PLAN = {"plan": {"name": "spec", "salt": "s1"}, "hypothesis": [
    {"id": "H1", "family": "spec", "metric": "tokens_per_call", "gamma": 4, "compare": ["pol0", "pol1"],
     "split": "all", "test": "ttest"},
    {"id": "H2", "family": "spec", "metric": "target_calls", "gamma": 2, "compare": ["pol0", "pol1"],
     "split": "all", "test": "ttest"}]}


def test_plans_test_the_speculative_metrics_per_document() -> None:
    ds = _study(12)
    res = dv.run_plan(ds, SPEC_PLAN, n_resamples=199)
    spec = {g: dv.speculative(ds, gamma=g) for g in (2, 4)}
    want = {"H1": (spec[4]["tokens_per_call"].sel(policy="pol0") - spec[4]["tokens_per_call"].sel(policy="pol1")),
            "H2": (spec[2]["target_calls"].sel(policy="pol0") - spec[2]["target_calls"].sel(policy="pol1"))}
    for row in res.table.itertuples(index=False):
        assert row.n_docs == 12
        assert row.effect == pytest.approx(float(want[row.id].mean()), rel=1e-9)   # the t-test's mean difference
    assert dv.load_plan(SPEC_PLAN).hypotheses[0].worse == "smaller"     # fewer tokens per call is worse
    bad = {**SPEC_PLAN, "hypothesis": [{**SPEC_PLAN["hypothesis"][0], "gamma": 0}]}
    with pytest.raises(dv.PlanError, match="needs 'gamma'"):
        dv.load_plan(bad)
    other = {**SPEC_PLAN, "hypothesis": [{**SPEC_PLAN["hypothesis"][0], "metric": "occurrence"}]}
    with pytest.raises(dv.PlanError, match="'gamma' applies only"):
        dv.load_plan(other)
    coupled = dv.simulate_study(3, {"pol0": dv.PolicyEffect(0.1), "pol1": dv.PolicyEffect(0.2)}, horizon=4,
                                replicates=3)
    with pytest.raises(dv.PlanError, match="needs reference traces"):
        dv.run_plan(coupled, SPEC_PLAN, n_resamples=99)


def test_power_of_a_speculative_hypothesis() -> None:
    ds = _study(12)
    res = dv.power(SPEC_PLAN, ds, docs=[4, 12], replicates=[60], n_sims=200)
    h1 = res.table[res.table["id"] == "H1"]
    assert len(h1) == 2 and h1["note"].str.contains("conservative").all()
    assert (h1["power"].diff().dropna() >= -0.05).all()      # more documents, no less power


def test_intervals_over_documents_stay_inside_what_each_quantity_can_be() -> None:
    # ten documents, two of them with far fewer tokens per call: hybrid-t's ends at this
    # size can leave [1, γ + 1]; they are clipped to it (and calls to [1, T], accepted to [0, γ])
    rng = np.random.default_rng(4)
    T, R, n = 10, 4, 10
    logp = np.full((n, 1, R, T), -0.3)
    logq = logp + np.where(np.arange(n)[:, None, None, None] < 2, -3.0, -0.05) * rng.random((n, 1, R, T))
    ds = reference_dataset(np.full((n, 1, R, T), 3), logp, logq, vocab_size=8)
    agg = dv.aggregate_speculative(dv.speculative(ds, gamma=(1, 3, 6), cost_ratio=0.2), n_resamples=400)
    g = agg["gamma"]
    assert agg.attrs["reason"] == "" and int(agg["n_docs"].min()) == n
    for name, lo, hi in (("tokens_per_call", 1, g + 1), ("accepted_per_call", 0, g), ("target_calls", 1, T),
                         ("speedup", 1 / (1 + 0.2 * g), (g + 1) / (1 + 0.2 * g))):
        assert (agg[f"{name}_low"] >= lo - 1e-12).all() and (agg[f"{name}_high"] <= hi + 1e-12).all(), name
        assert (agg[f"{name}_low"] <= agg[name]).all() and (agg[name] <= agg[f"{name}_high"]).all(), name
