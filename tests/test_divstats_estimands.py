"""The estimand table (divstats.estimands): every list of estimand names is derived from it,
in today's order, and docs/statistics.md prints it."""

from __future__ import annotations

from pathlib import Path

import pytest

import divstats
import protocols
from divstats.calibration import coverage
from divstats.estimands import ESTIMANDS, SPECULATIVE_ESTIMANDS, Estimand, by_name, markdown_table, names
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
                                               ("markdown_table(SPECULATIVE_ESTIMANDS)", SPECULATIVE_ESTIMANDS)])
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
