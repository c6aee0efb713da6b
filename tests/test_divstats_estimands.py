"""The estimand table (divstats.estimands): every list of estimand names is derived from it,
in today's order, and docs/statistics.md prints it."""

from __future__ import annotations

from pathlib import Path

import pytest

import divstats
import protocols
from divstats.calibration import coverage
from divstats.estimands import (
    ANSWER_ESTIMANDS,
    ESTIMANDS,
    SPECULATIVE_ESTIMANDS,
    Estimand,
    by_name,
    markdown_table,
    names,
)
from divstats.estimation import components, estimators
from divstats.report import tables
from divstats.traces import replicates

ROOT = Path(__file__).resolve().parents[1]

#: The lists as they were written out before the table (order matters: variable order, array layouts).
LITERAL = {
    "VALUES": ("occurrence", "exposure", "rmtd", "post_mismatch", "window_mismatch", "tail_capacity", "cost"),
    "SCALARS": ("occurrence", "rmtd", "agreeing_tokens", "exposure", "post_mismatch", "rate", "loss",
                "mismatch_fraction", "first_mismatch_contribution", "exposure_contribution", "window_mismatch",
                "tail_capacity", "loss_lower", "loss_upper"),
    "_POST_DEPENDENT": ("post_mismatch", "rate", "loss", "mismatch_fraction", "exposure_contribution"),
    "MEAN_OVER_DOCS": ("occurrence", "rmtd", "agreeing_tokens", "exposure", "post_mismatch", "window_mismatch",
                       "tail_capacity"),
    "INTERVAL_QUANTITIES": ("occurrence", "rmtd", "agreeing_tokens", "exposure", "rate", "mismatch_fraction",
                            "first_mismatch_contribution", "exposure_contribution", "loss_lower", "loss_upper"),
    "METRICS": ("occurrence", "rmtd", "exposure", "post_mismatch", "rate", "loss", "mismatch_fraction",
                "first_mismatch_contribution", "exposure_contribution", "window_mismatch", "tail_capacity",
                "loss_lower", "loss_upper"),
    "SUMMARY_QUANTITIES": ("occurrence", "rmtd", "agreeing_tokens", "exposure", "rate", "mismatch_fraction",
                           "first_mismatch_contribution", "exposure_contribution", "loss_lower", "loss_upper"),
    "_QUANTITIES": ("gap", "first", "exposure", "rate", "share_first", "share_exposure", "share_rate"),
}

DERIVED = {
    "VALUES": replicates.VALUES,
    "SCALARS": estimators.SCALARS,
    "_POST_DEPENDENT": estimators._POST_DEPENDENT,
    "MEAN_OVER_DOCS": estimators.MEAN_OVER_DOCS,
    "INTERVAL_QUANTITIES": estimators.INTERVAL_QUANTITIES,
    "METRICS": components.METRICS,
    "SUMMARY_QUANTITIES": tables.SUMMARY_QUANTITIES,
    "_QUANTITIES": coverage._QUANTITIES,
}


@pytest.mark.parametrize("name", sorted(LITERAL))
def test_each_derived_list_equals_the_old_literal_list(name):
    assert tuple(DERIVED[name]) == LITERAL[name]


def test_descriptions_come_from_the_table():
    assert estimators.DESCRIPTIONS == {e.name: e.description for e in ESTIMANDS}
    assert tuple(estimators.DESCRIPTIONS) == LITERAL["SCALARS"]


def test_the_table_is_public_and_consistent():
    assert divstats.ESTIMANDS is ESTIMANDS and divstats.Estimand is Estimand
    assert len({e.name for e in ESTIMANDS}) == len(ESTIMANDS)
    slots = sorted(e.replicate for e in ESTIMANDS if e.replicate is not None)
    assert slots == list(range(len(slots)))
    assert names(aggregate="ratio") == ("rate",)
    assert by_name("rmtd").worse == "smaller" and by_name("loss").worse == "larger"
    with pytest.raises(KeyError):
        by_name("occurence")
    with pytest.raises(ValueError, match="summary needs interval"):
        Estimand("x", "", "mean", summary=True)


def test_estimate_reports_every_estimand_in_table_order():
    from divstats.truth.studies import PolicyEffect, simulate_study

    est = divstats.estimate(simulate_study(2, {"a": PolicyEffect(0.2)}, horizon=4, replicates=3))
    assert [v for v in est.data_vars if not v.endswith(("_se", "_cov"))] == [e.name for e in ESTIMANDS]
    assert all(est[e.name].attrs["description"] == e.description for e in ESTIMANDS)


@pytest.mark.parametrize(("marker", "rows"), [("markdown_table()", ESTIMANDS),
                                               ("markdown_table(SPECULATIVE_ESTIMANDS)", SPECULATIVE_ESTIMANDS),
                                               ("markdown_table(ANSWER_ESTIMANDS)", ANSWER_ESTIMANDS)])
def test_docs_print_the_code_table(marker: str, rows: tuple) -> None:
    text = (ROOT / "docs" / "statistics.md").read_text(encoding="utf-8")
    start, end = f"<!-- estimand-table: divstats.estimands.{marker} -->", "<!-- /estimand-table -->"
    assert start in text, f"docs/statistics.md lacks the marker {start}"
    printed = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert printed == markdown_table(rows), ("docs/statistics.md's estimand table differs from the code; paste "
                                             f"divstats.estimands.{marker}")


def test_speculative_variables_and_plan_metrics_come_from_their_table() -> None:
    import numpy as np

    from divstats.estimation.speculative import SPECULATIVE_METRICS

    ds = protocols.reference_dataset(np.zeros((2, 4), int), np.full((2, 4), -0.5), np.full((2, 4), -0.7),
                                     vocab_size=8)
    spec = divstats.speculative(ds, gamma=(2,))
    assert [v for v in spec.data_vars if not v.endswith("_se")] == [e.name for e in SPECULATIVE_ESTIMANDS]
    assert all(spec[e.name].attrs["description"] == e.description for e in SPECULATIVE_ESTIMANDS)
    assert SPECULATIVE_METRICS == {"target_calls": "larger", "tokens_per_call": "smaller",
                                   "accepted_per_call": "smaller"}


def test_interval_ranges_come_from_the_table():
    import numpy as np

    lower, upper = estimators._interval_ranges(7)
    old_upper = {"occurrence": 1.0, "rate": 1.0, "mismatch_fraction": 1.0, "first_mismatch_contribution": 1.0,
                 "exposure_contribution": 1.0, "rmtd": 7, "exposure": 7, "loss_lower": 7, "loss_upper": 7}
    q = estimators.INTERVAL_QUANTITIES
    np.testing.assert_array_equal(lower, [0.0 if n in old_upper else -np.inf for n in q])
    np.testing.assert_array_equal(upper, [float(old_upper.get(n, np.inf)) for n in q])


# --------------------------------------------------------------------------- where a name is spelled

#: The modules that may spell an estimand's name (a string literal equal to it): the table and
#: the modules where formulas are.  Everywhere else derives the name from the table (a row's flag,
#: or a constant of divstats.estimands such as TAIL_CAPACITY).
SPELLED_IN: dict[str, str] = {
    "estimands.py": "the table itself",
    "traces/replicates.py": "the per-replicate formulas, one function per trace kind",
    "estimation/estimators.py": "the ratio and derived estimands' formulas (estimate, aggregate)",
    "estimation/components.py": "each estimand's per-replicate influence",
    "estimation/interval.py": "the sharp interval's ends, loss_lower and loss_upper",
    "estimation/variance.py": "loss per replicate, in the variance-dominance check",
    "estimation/speculative.py": "the speculative-decoding estimands' formulas",
    "inference/decompose.py": "the gap decomposition: its parts are named after the estimands they vary",
    "estimation/answers.py": "the answer estimands' formulas (accuracy, accuracy_change)",
}
#: The old FULL_MODEL_VALUES, before it was derived from the table.
OLD_FULL_MODEL_VALUES = {
    **{m: 0.0 for m in ("occurrence", "exposure", "post_mismatch", "loss", "mismatch_fraction",
                        "first_mismatch_contribution", "exposure_contribution", "window_mismatch",
                        "loss_lower", "loss_upper", "branch_tv")},
    "rmtd": "horizon", "agreeing_tokens": "horizon",
    "accuracy_change": 0.0,     # the answers' table (docs/statistics.md §12): the full model's own change is 0
}


def spelled_names(package: Path, estimand_names: set[str]) -> list[str]:
    """``file:line name`` for each string literal equal to an estimand's name outside SPELLED_IN (docstrings aside)."""
    import ast

    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel in SPELLED_IN:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        found += [f"{package.name}/{rel}:{node.lineno} {node.value}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and node.value in estimand_names and id(node) not in docstrings]
    return found


ALL_NAMES = {e.name for e in ESTIMANDS + SPECULATIVE_ESTIMANDS + ANSWER_ESTIMANDS}


def test_an_estimand_name_is_spelled_only_in_the_table_and_where_its_formula_is() -> None:
    found = spelled_names(ROOT / "divstats", ALL_NAMES)
    assert not found, "derive these from divstats.estimands (a flag, or a name constant):\n" + "\n".join(found)
    assert all((ROOT / "divstats" / rel).is_file() for rel in SPELLED_IN)


def test_the_spelling_check_catches_a_planted_name(tmp_path: Path) -> None:
    pkg = tmp_path / "divstats"
    (pkg / "report").mkdir(parents=True)
    (pkg / "estimation").mkdir()
    (pkg / "report" / "figures.py").write_text('"""Plots the tail_capacity."""\n\ndef f(sub):\n'
                                               '    """tail_capacity"""\n    return sub["tail_capacity"]\n')
    (pkg / "estimation" / "interval.py").write_text('X = "tail_capacity"\n')
    assert spelled_names(pkg, ALL_NAMES) == ["divstats/report/figures.py:5 tail_capacity"]


def test_full_model_values_come_from_the_table() -> None:
    from divstats.plans.run import FULL_MODEL_VALUES

    assert FULL_MODEL_VALUES == OLD_FULL_MODEL_VALUES


def test_the_name_constants_are_rows() -> None:
    from divstats import estimands

    constants = {k: v for k, v in vars(estimands).items() if k.isupper() and isinstance(v, str)}
    assert constants and set(constants.values()) <= ALL_NAMES
    assert all(k == v.upper() for k, v in constants.items())
