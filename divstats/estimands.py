"""The estimand table: one row per scalar estimand of docs/statistics.md §3.

Every list of estimand names in divstats is derived from :data:`ESTIMANDS`
(the row order is the order of ``divstats.estimate``'s variables):

* ``divstats.traces.replicates.VALUES``: rows with a ``replicate`` slot, by slot (then ``cost``);
* ``divstats.estimation.estimators.DESCRIPTIONS`` / ``SCALARS``: every row;
* ``MEAN_OVER_DOCS``: ``aggregate == "mean"``; the ``"ratio"`` and ``"derived"`` rows are
  computed from those (``aggregate`` and ``aggregate_intervals``);
* the post-divergence quantities marked not identified when W < T − 1: ``post_dependent``;
* ``INTERVAL_QUANTITIES`` (``aggregate_intervals``): ``interval``;
* ``divstats.estimation.components.METRICS``: ``component``;
* ``divstats.report.tables.SUMMARY_QUANTITIES``: ``summary``;
* ``divstats.plans.run.FULL_MODEL_VALUES`` (what a plan compares with the full model): ``full_value``.

An estimand's name is spelled here and where its formula is, nowhere else in divstats: the
figures, plans, noise floor and defaults use the name constants at the end of this module
(``MISMATCH_FRACTION``, ``TAIL_CAPACITY``, ...; tests/test_divstats_estimands.py scans the sources).

The speculative-decoding estimands (docs/statistics.md §10) are one per (doc, policy,
γ) rather than per (doc, policy), so they are a table of their own,
:data:`SPECULATIVE_ESTIMANDS`, in the order of ``divstats.speculative``'s variables; its
variables' descriptions and the metrics a plan may test at a ``gamma`` derive from it.

Adding an estimand is one row here, its per-replicate formula (``traces/replicates``,
``estimation/components``) and its exact value (``truth/exact``).  docs/statistics.md
§3 prints this table (:func:`markdown_table`; tests/test_divstats_estimands.py checks
that the two agree).  This is a base module: every room may import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ACCEPTED_PER_CALL", "ACCURACY", "ACCURACY_CHANGE", "AGGREGATIONS", "ANSWER_ESTIMANDS", "ESTIMANDS",
    "EXPOSURE_CONTRIBUTION", "Estimand",
    "FIRST_MISMATCH_CONTRIBUTION", "FULL_VALUES", "LOSS", "MISMATCH_FRACTION", "OCCURRENCE", "SPECULATIVE_ESTIMANDS",
    "TAIL_CAPACITY", "TARGET_CALLS", "TOKENS_PER_CALL", "WINDOW_MISMATCH", "by_name", "markdown_table", "names",
]

#: How an estimand combines over documents (equal document weights, docs/statistics.md §3).
AGGREGATIONS: dict[str, str] = {
    "mean": "mean over documents",
    "ratio": "ratio of document means",
    "derived": "derived from the aggregated parts",
}

#: The full model's own value of an estimand (compared with itself it never diverges), as
#: ``markdown_table`` prints it: 0, the horizon T, or none (undefined, e.g. a rate without exposure).
FULL_VALUES: dict[str, str] = {"zero": "0", "horizon": "T", "none": ""}


@dataclass(frozen=True)
class Estimand:
    """One scalar estimand and how every part of divstats treats it.

    Attributes
    ----------
    name : str
        The variable name (``divstats.estimate``'s output, plan metrics).
    description : str
        What it is (the variable's ``attrs["description"]``).
    aggregate : {"mean", "ratio", "derived"}
        How it combines over documents (:data:`AGGREGATIONS`).
    post_dependent : bool
        Needs the post-divergence tail (W >= T - 1); not identified otherwise.
    interval : bool
        ``aggregate_intervals`` gives it an interval over documents.
    component : bool
        A variance-component metric (``variance_components``, ``design``, ``allocate``).
    summary : bool
        In the report's summary table.
    replicate : int or None
        Its slot among the per-replicate values each trace kind computes
        (``divstats.traces.replicates.VALUES``); None when computed from others.
    worse : {"larger", "smaller"}
        Which direction is worse for the candidate policy.
    bounds : {"unit", "horizon", "none"}
        Its range, [0, 1], [0, T] or unbounded (intervals are clipped to it).
    plan : bool
        A plan may test it (a quantity that does not depend on the policy may not).
    full_value : {"zero", "horizon", "none"}
        The full model's own value (:data:`FULL_VALUES`): what a plan compares a policy with
        when the data hold no measured ``full`` control (``divstats.plans.run.FULL_MODEL_VALUES``).
    """

    name: str
    description: str
    aggregate: Literal["mean", "ratio", "derived"]
    post_dependent: bool = False
    interval: bool = False
    component: bool = True
    summary: bool = False
    replicate: int | None = None
    worse: Literal["larger", "smaller"] = "larger"
    bounds: Literal["unit", "horizon", "none"] = "none"
    plan: bool = True
    full_value: Literal["zero", "horizon", "none"] = "none"

    def __post_init__(self) -> None:
        if self.aggregate not in AGGREGATIONS:
            raise ValueError(f"{self.name}: aggregate must be one of {tuple(AGGREGATIONS)}")
        if self.worse not in ("larger", "smaller"):
            raise ValueError(f"{self.name}: worse must be 'larger' or 'smaller'")
        if self.bounds not in ("unit", "horizon", "none"):
            raise ValueError(f"{self.name}: bounds must be 'unit', 'horizon' or 'none'")
        if self.full_value not in FULL_VALUES:
            raise ValueError(f"{self.name}: full_value must be one of {tuple(FULL_VALUES)}")
        if self.summary and not self.interval:
            raise ValueError(f"{self.name}: the summary table shows an interval, so summary needs interval")


_E = Estimand

#: The estimands, in the order of ``divstats.estimate``'s variables.
ESTIMANDS: tuple[Estimand, ...] = (
    _E("occurrence", "P(tau <= T): probability that the branches diverge within the horizon",
       "mean", interval=True, summary=True, replicate=0, bounds="unit", full_value="zero"),
    _E("rmtd", ("sum_{t=0}^{T-1} S(t) = E[min(tau, T)]: restricted mean time to divergence (docs/statistics.md §3 "
                "definition; its gloss E[min(tau - 1, T)] equals this minus occurrence, see "
                "docs/statistics.md)"),
       "mean", interval=True, summary=True, replicate=2, worse="smaller", bounds="horizon", full_value="horizon"),
    _E("agreeing_tokens", ("rmtd - occurrence = E[min(tau - 1, T)]: expected number of agreeing tokens before "
                           "the divergence (the tokens both models emit identically)"),
       "mean", interval=True, component=False, summary=True, worse="smaller", full_value="horizon"),
    _E("exposure", "E[(T - tau)+]: expected post-divergence steps inside the horizon",
       "mean", interval=True, summary=True, replicate=1, bounds="horizon", full_value="zero"),
    _E("post_mismatch", "E[R], R = sum_{t > tau} D_t: expected mismatches after the first one",
       "mean", post_dependent=True, replicate=3, bounds="horizon", full_value="zero"),
    _E("rate", "post_mismatch / exposure (ratio of expectations); NaN when exposure = 0",
       "ratio", post_dependent=True, interval=True, summary=True, bounds="unit"),
    _E("loss", "E[L] = occurrence + exposure * rate: expected number of mismatched tokens",
       "derived", post_dependent=True, bounds="horizon", full_value="zero"),
    _E("mismatch_fraction", "loss / T = first_mismatch_contribution + exposure_contribution",
       "derived", post_dependent=True, interval=True, summary=True, bounds="unit", full_value="zero"),
    _E("first_mismatch_contribution", "occurrence / T",
       "derived", interval=True, summary=True, bounds="unit", full_value="zero"),
    _E("exposure_contribution", "(exposure / T) * rate (0 when exposure = 0, since then R = 0 on every path)",
       "derived", post_dependent=True, interval=True, summary=True, bounds="unit", full_value="zero"),
    _E("window_mismatch", ("E[sum_{tau < t <= tau + W} D_t]: mismatches observed in the W-step window "
                           "after divergence"),
       "mean", replicate=4, bounds="horizon", full_value="zero"),
    _E("tail_capacity", ("E[(T - tau - K) 1[not both ended at tau + K]; tau <= T], K = min(W, T - tau): "
                         "steps after the window that could still disagree"),
       "mean", replicate=5, bounds="horizon"),
    _E("loss_lower", "occurrence + window_mismatch: lower end of the sharp interval for loss (docs/statistics.md §6)",
       "derived", interval=True, summary=True, bounds="horizon", full_value="zero"),
    _E("loss_upper", "occurrence + window_mismatch + tail_capacity: upper end of the sharp interval for loss",
       "derived", interval=True, summary=True, bounds="horizon", full_value="zero"),
)

#: The speculative-decoding estimands with Q as the draft and P as the target, one per
#: (doc, policy, gamma), in the order of ``divstats.speculative``'s variables (each with
#: ``_se``). Over documents: equal weights, the per-call quantities as ratios of the
#: document means (``divstats.aggregate_speculative``).
SPECULATIVE_ESTIMANDS: tuple[Estimand, ...] = (
    _E("target_calls", "E[C]: target (full-model) calls to produce the run's tokens, N = min(T, first EOS)",
       "mean", interval=True, component=False, bounds="horizon"),
    _E("tokens", "E[N]: tokens the run produces (T when no path ends early)",
       "mean", interval=True, component=False, bounds="horizon", plan=False),
    _E("accepted", "E[A]: accepted drafts among the run's tokens",
       "mean", interval=True, component=False, worse="smaller", bounds="horizon", plan=False),
    _E("tokens_per_call", "E[N] / E[C] (ratio of expectations; T / target_calls without EOS)",
       "ratio", interval=True, component=False, worse="smaller"),
    _E("accepted_per_call", "E[A] / E[C]: accepted drafts per target call (ratio of expectations)",
       "ratio", interval=True, component=False, worse="smaller"),
)

#: The answer estimands (docs/statistics.md §12): per (doc, policy) from the answer scores
#: ``x_score`` (P's) and ``y_score`` (Q's) that traces with task outcomes carry, replicates
#: averaged within the document (``divstats.estimation.answers.answer_values``).  A table of
#: their own, as the speculative one is: they are no function of the token traces, so they
#: have no per-replicate slot in ``traces/replicates`` nor an exact value in ``truth/exact``.
#: Plans test them (``metric = "accuracy_change"``, ``compare = [policy, "full"]``) and
#: ``certify_budget`` certifies a budget on them at an accuracy margin.
ANSWER_ESTIMANDS: tuple[Estimand, ...] = (
    _E("accuracy", "E[score of Q's answer]: the policy's task accuracy (mean score in [0, 1])",
       "mean", interval=True, component=False, worse="smaller", bounds="unit"),
    _E("accuracy_change", ("E[score of Q's answer - score of P's answer] on the coupled pairs: the change in "
                           "task accuracy the policy makes (Q - P, in [-1, 1]; 0 for the full model)"),
       "mean", interval=True, component=False, worse="smaller", full_value="zero"),
)


def names(**where: object) -> tuple[str, ...]:
    """Names of the estimands whose fields equal ``where``, in table order.

    Parameters
    ----------
    **where
        Field name -> required value.

    Returns
    -------
    tuple of str

    Examples
    --------
    >>> names(aggregate="ratio")
    ('rate',)
    """
    return tuple(e.name for e in ESTIMANDS if all(getattr(e, k) == v for k, v in where.items()))


def by_name(name: str) -> Estimand:
    """The row of estimand ``name``.

    Parameters
    ----------
    name : str
        An estimand name.

    Returns
    -------
    Estimand

    Raises
    ------
    KeyError
        For a name not in :data:`ESTIMANDS`.

    Examples
    --------
    >>> by_name("rmtd").worse
    'smaller'
    """
    for e in ESTIMANDS:
        if e.name == name:
            return e
    raise KeyError(f"unknown estimand {name!r}; expected one of {names()}")


def markdown_table(rows: tuple[Estimand, ...] = ESTIMANDS) -> str:
    """The table as docs/statistics.md prints it (one line per estimand).

    Parameters
    ----------
    rows : tuple of Estimand, optional
        :data:`ESTIMANDS` (§3), :data:`SPECULATIVE_ESTIMANDS` (§10) or :data:`ANSWER_ESTIMANDS` (§12).

    Returns
    -------
    str
        A Markdown table.

    Examples
    --------
    >>> markdown_table().splitlines()[0].split(" | ")[:3]
    ['| name', 'over documents', 'needs post-divergence']
    """
    def yes(flag: bool) -> str:
        return "yes" if flag else ""

    lines = ["| name | over documents | needs post-divergence | interval | component | summary | replicate value "
             "| worse | range | plan metric | full model |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in rows:
        lines.append(f"| `{e.name}` | {AGGREGATIONS[e.aggregate]} | {yes(e.post_dependent)} | {yes(e.interval)} "
                    f"| {yes(e.component)} | {yes(e.summary)} | {'' if e.replicate is None else e.replicate} "
                    f"| {e.worse} | {e.bounds} | {yes(e.plan)} | {FULL_VALUES[e.full_value]} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- names by role

def _spelled(name: str) -> str:
    """``name``, checked against the tables on import: a renamed row fails here, not in a figure."""
    if name not in {e.name for e in ESTIMANDS + SPECULATIVE_ESTIMANDS + ANSWER_ESTIMANDS}:
        raise KeyError(f"{name!r} is not a row of ESTIMANDS, SPECULATIVE_ESTIMANDS or ANSWER_ESTIMANDS")
    return name


# The estimands other modules name for a role of their own (the figures' parts of the mismatch
# fraction, the noise floor's metrics, defaults, the speculative table's columns).  An estimand's
# name is spelled in this module and where its formula is, nowhere else in divstats
# (tests/test_divstats_estimands.py scans the sources).
OCCURRENCE = _spelled("occurrence")
LOSS = _spelled("loss")
MISMATCH_FRACTION = _spelled("mismatch_fraction")
FIRST_MISMATCH_CONTRIBUTION = _spelled("first_mismatch_contribution")
EXPOSURE_CONTRIBUTION = _spelled("exposure_contribution")
WINDOW_MISMATCH = _spelled("window_mismatch")
TAIL_CAPACITY = _spelled("tail_capacity")
TARGET_CALLS = _spelled("target_calls")
TOKENS_PER_CALL = _spelled("tokens_per_call")
ACCEPTED_PER_CALL = _spelled("accepted_per_call")
ACCURACY = _spelled("accuracy")
ACCURACY_CHANGE = _spelled("accuracy_change")
