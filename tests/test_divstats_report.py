"""Figures, the report and the analyze/split commands."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
import xarray as xr
from click.testing import CliRunner
from matplotlib.figure import Figure

import divstats
from divstats.cli.analyze import analyze, split
from divstats.inference.decompose import decompose
from divstats.plans.format import shipped_plan
from divstats.plans.run import run_plan
from divstats.plans.split import assign_split
from divstats.report import figures as F
from divstats.report.analysis import compute
from divstats.report.render import make_figures
from divstats.report.results import load_results, results_dataset
from divstats.report.tables import fmt
from divstats.truth.studies import PolicyEffect, simulate_study

PAPER = shipped_plan("paper")  # package data, as a wheel install has it
POLICIES = {"snapkv@0.5": PolicyEffect(0.04), "snapkv#128": PolicyEffect(0.12),
            "recent@0.5": PolicyEffect(0.12), "snapkv@0.9": PolicyEffect(0.03, growth=1.0)}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """Residual traces run to a horizon long enough for the paper plan's late window."""
    from protocols import save_traces

    ds = simulate_study(10, POLICIES, horizon=36, replicates=6, kind="residual", seed=8)
    # A wrong split label on one document, to be reported.
    split = np.array([""] * ds.sizes["doc"], dtype=object)
    truth = assign_split([str(d) for d in ds["doc"].values], "kvdiv-paper-v1", 0.5)
    split[0] = "exploratory" if truth[0] == "confirmatory" else "confirmatory"
    ds = ds.assign_coords(split=("doc", split))
    path = tmp_path_factory.mktemp("traces") / "traces.nc"
    save_traces(ds, path)
    return ds, path


@pytest.fixture(scope="module")
def analysis(traces):
    ds, _ = traces
    return compute(ds, PAPER, policy_aliases={"snapkv#512": "snapkv#128"}, n_resamples=499, progress=False)


def test_every_figure_is_a_figure(analysis):
    figs = make_figures(analysis)
    # snapkv@0.5 and snapkv@0.9 are a family: the "How much can I compress?" curve
    assert set(figs) == {"survival", "decomposition", "gap", "branch_tv", "interval", "variance", "compression"}
    assert all(isinstance(f, Figure) for f in figs.values())
    assert all(f.axes for f in figs.values())
    # Window shading of the plan's early/late windows is drawn on the branch-TV figure.
    texts = [t.get_text() for t in figs["branch_tv"].axes[0].texts]
    assert any("early" in t for t in texts) and any("late" in t for t in texts)


def test_figures_split_panels_by_model():
    ds = simulate_study(3, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.2)}, horizon=6, replicates=5,
                        models=["m1", "m2"], seed=1)
    assert len(F.survival_figure(divstats.survival(ds)).axes) == 2
    assert len(F.branch_tv_figure(divstats.branch_tv(ds), {"early": (1, 2)}).axes) == 2
    agg = divstats.aggregate(divstats.estimate(ds))
    assert len(F.decomposition_figure(agg).axes) == 2
    assert len(F.interval_figure(divstats.interval_by_window(ds, [0, 2, 4]), agg).axes) == 2


def test_numbers_are_reproducible_from_the_public_api(traces, analysis):
    ds, _ = traces
    res = results_dataset(analysis)
    est = divstats.estimate(ds)
    agg = divstats.aggregate(est)
    np.testing.assert_allclose(res["aggregate_mismatch_fraction"].values, agg["mismatch_fraction"].values)
    np.testing.assert_allclose(res["occurrence"].values, est["occurrence"].values)
    np.testing.assert_allclose(res["survival"].values, divstats.survival(ds)["survival"].values)
    pr = run_plan(ds, PAPER, aliases={"snapkv#512": "snapkv#128"}, n_resamples=499)
    np.testing.assert_allclose(res["plan_p_value"].values, pr.table["p_value"].to_numpy())
    np.testing.assert_allclose(res["plan_p_adjusted"].values, pr.table["p_adjusted"].to_numpy())
    dec = decompose(est, "snapkv@0.5", "snapkv#128")
    ci = dec.confidence_interval(0.95, n_resamples=499, seed=0)
    row = res.sel(comparison="snapkv@0.5 vs snapkv#128")
    assert float(row["decomposition_gap"]) == pytest.approx(dec.gap)
    assert float(row["decomposition_first_low"]) == pytest.approx(ci.low.first)
    assert res.attrs["plan_sha256"] == hashlib.sha256(PAPER.read_bytes()).hexdigest()
    assert "plan_split" in res and set(res["plan_split"].values) <= {"confirmatory", "exploratory"}


def test_cli_analyze_writes_the_three_files(traces, tmp_path):
    _, path = traces
    out = tmp_path / "out"
    result = CliRunner().invoke(analyze, [str(path), "--plan", str(PAPER), "--out", str(out), "--quiet",
                                          "--n-resamples", "199", "--policy-alias", "snapkv#512=snapkv#128"])
    assert result.exit_code == 0, result.output
    digest = hashlib.sha256(PAPER.read_bytes()).hexdigest()
    html = (out / "report.html").read_text()
    assert digest in html
    assert "data:image/png;base64," in html and "src=\"http" not in html
    assert "confirmatory" in html and "exploratory" in html and "p (Holm)" in html
    assert "snapkv#512 -&gt; snapkv#128" in html            # the deviation is reported
    assert "disagrees with the plan" in html                 # the split-label disagreement too
    md = (out / "summary.md").read_text()
    assert digest in md and "F1-occ-recent" in md
    res = load_results(out / "results.nc")
    assert res.attrs["plan_sha256"] == digest
    assert res["plan_id"].values.tolist() == ["F1-occ-budget", "F1-occ-recent", "F1-rmtd-budget",
                                             "F1-rmtd-recent", "F2-tv-late-early"]
    assert res["plan_confirmatory"].values.tolist() == [False, True, False, True, True]
    assert json.loads(res.attrs["deviations"]) == ["snapkv#512 -> snapkv#128 (substituted at run time; "
                                                   "not in the plan)"]
    again = load_results(out / "results.nc")
    xr.testing.assert_identical(res, again)


def test_results_round_trip_exactly(analysis, tmp_path):
    from divstats.report.results import save_results

    results = results_dataset(analysis)
    path = save_results(results, tmp_path / "r.nc")
    back = load_results(path)
    for name, var in results.data_vars.items():
        if var.dtype == object:
            assert back[name].values.tolist() == var.values.tolist(), name
        else:
            xr.testing.assert_equal(back[name].reset_coords(drop=True), var.reset_coords(drop=True))
    assert back.attrs == {k: v for k, v in results.attrs.items()}


def test_cli_refuses_unknown_policy_with_a_message(traces, tmp_path):
    _, path = traces
    result = CliRunner().invoke(analyze, [str(path), "--plan", str(PAPER), "--out", str(tmp_path), "-q"])
    assert result.exit_code != 0
    assert "policy 'snapkv#512' is not in the data" in result.output
    assert "--policy-alias" in result.output


def test_cli_split_on_documents_jsonl(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"id": i, "text": "x", **({"split": s} if s else {})})
                              for i, s in [("doc0", ""), ("doc2", "confirmatory"), ("doc5", "")]) + "\n")
    result = CliRunner().invoke(split, [str(docs), "--plan", str(PAPER), "--format", "jsonl"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["doc"], r["split"], r["agrees"]) for r in rows] == [
        ("doc0", "confirmatory", True), ("doc2", "exploratory", False), ("doc5", "confirmatory", True)]
    assert "2 confirmatory, 1 exploratory" in result.stderr
    strict = CliRunner().invoke(split, [str(docs), "--plan", str(PAPER), "--strict"])
    assert strict.exit_code == 1


def test_cli_split_on_traces_reports_the_disagreeing_label(traces):
    _, path = traces
    result = CliRunner().invoke(split, [str(path), "--plan", str(PAPER)])
    assert result.exit_code == 0, result.output
    assert result.stdout.count("<- disagrees") == 1
    assert "1 of 10 documents carry a dataset split label that disagrees" in result.stderr


def test_analysis_modules_never_import_model_stacks():
    code = ("import sys, divstats.cli.analyze, divstats.report.write, divstats.plans.format, "
            "divstats.inference.decompose, divstats.report.figures, divstats.report.analysis, "
            "divstats.report.results, divstats.report.render, divstats.report.tables, divstats.plans.run;"
            "bad = [m for m in ('torch', 'transformers', 'httpx', 'gen_service') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_number_formatting():
    assert fmt(float("nan")) == "—" and fmt(float("inf")) == "∞" and fmt(-float("inf")) == "−∞"
    assert fmt(-0.25) == "−0.25" and fmt(3) == "3" and fmt(1.23456e-7) == "1.235e-07"


def test_the_reproduce_snippet_uses_only_public_names():
    import ast
    import re

    import divstats
    from divstats.report.analysis import compute
    from divstats.report.render import reproduce_snippet
    from divstats.truth.studies import PolicyEffect, simulate_study

    ds = simulate_study(4, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.2)}, horizon=6, replicates=3)
    snippet = reproduce_snippet(compute(ds, n_resamples=99, progress=False))
    imports = [n for n in ast.walk(ast.parse(snippet)) if isinstance(n, ast.ImportFrom)]
    assert imports and all(n.module == "divstats" for n in imports), snippet
    assert {a.name for n in imports for a in n.names} <= set(divstats.__all__)
    assert set(re.findall(r"divstats\.(\w+)", snippet)) <= set(divstats.__all__), snippet


def test_without_attrs_is_drop_attrs(analysis):
    # results.nc is built with without_attrs (xarray's drop_attrs costs a merge per variable):
    # the same objects, variables in the same order, so the file is the same
    from divstats.traces.arrays import without_attrs

    objs = [x for x in (analysis.estimates, analysis.aggregate, analysis.interval, analysis.compression)
            if x is not None]
    objs += [analysis.estimates[v] for v in analysis.estimates.data_vars]
    assert len(objs) > 10 and all(o.attrs or any(c.attrs for c in o.coords.values()) for o in objs[:3])
    for obj in objs:
        ours, theirs = without_attrs(obj), obj.drop_attrs()
        assert ours.identical(theirs)
        assert list(ours.coords) == list(theirs.coords)
        assert not any(v.attrs for v in ([ours.variable] if isinstance(ours, xr.DataArray) else [])
                       + list(ours.coords.values()))
    assert analysis.estimates.attrs   # the original keeps its attrs


def test_the_header_gives_each_models_replicates_and_vocabulary():
    """Combined models keep their own vocabularies, and a model studied at a smaller R holds
    absent replicates: the report's header says each model's, not the padded width."""
    from collector.rounds import pad_replicates
    from divstats.report.tables import data_summary
    from protocols import combine
    from protocols.examples import example_dataset

    a = example_dataset("residual", replicates=4, vocab_size=6, model="m1", seed=1)
    b = pad_replicates(example_dataset("residual", replicates=2, vocab_size=9, model="m2", seed=2), 4)
    head = data_summary(combine([a, b], "model"))
    assert head["replicates per (doc, policy)"] == "4 (m1), 2 (m2)"
    assert head["vocabulary"] == "6 (m1), 9 (m2)"
    same = data_summary(combine([a, a.assign_attrs(model="m3")], "model"))
    assert same["replicates per (doc, policy)"] == "4" and same["vocabulary"] == "6"
    assert data_summary(a)["replicates per (doc, policy)"] == "4"
