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

Each row says where its formula is (``formula``: the functions that compute it, per replicate
or from the document means).  An estimand's name is spelled here and in the modules those
functions live in, nowhere else in divstats: the figures, plans, noise floor and defaults use
the name constants at the end of this module (``MISMATCH_FRACTION``, ``TAIL_CAPACITY``, ...;
tests/test_divstats_estimands.py scans the sources, resolves every ``formula`` and checks that
each variable the estimators emit is a row).

The speculative-decoding estimands (docs/statistics.md §10) are one per (doc, policy,
γ) rather than per (doc, policy), so they are a table of their own,
:data:`SPECULATIVE_ESTIMANDS`, in the order of ``divstats.speculative``'s variables; its
variables' descriptions and the metrics a plan may test at a ``gamma`` derive from it.

Adding an estimand is one row here, its formula where the row's ``formula`` says
(``traces/replicates``, ``estimation/components``, ...) and its exact value (``truth/exact``).  docs/statistics.md
§3 prints this table (:func:`markdown_table`; tests/test_divstats_estimands.py checks
that the two agree).  This is a base module: every room may import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ACCEPTED_PER_CALL", "AGGREGATIONS", "ESTIMANDS", "EXPOSURE_CONTRIBUTION", "Estimand",
    "FIRST_MISMATCH_CONTRIBUTION", "FULL_VALUES", "LOSS", "MISMATCH_FRACTION", "OCCURRENCE", "SPECULATIVE_ESTIMANDS",
    "TAIL_CAPACITY", "TARGET_CALLS", "TOKENS_PER_CALL", "WINDOW_MISMATCH", "by_name", "formula_text", "markdown_table",
    "names",
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
    formula : tuple of str
        Where its formula is: the functions that compute it, as ``room.module.function`` under
        ``divstats`` (per replicate for a replicate slot; from the document means for a ratio
        or derived estimand, with its per-replicate influence in ``estimation.components``).
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
    formula: tuple[str, ...] = ()

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

# Where the formulas are (``Estimand.formula``).
#: The per-replicate values of each trace kind, one function per kind (docs/statistics.md §4, §5, §7).
_PER_KIND = ("traces.replicates._coupled_chunk", "traces.replicates._residual_chunk",
             "traces.replicates._reference_chunk")
#: The ratio and derived estimands from the document means, and their per-replicate influence.
_DERIVED = ("estimation.estimators.derived_quantities", "estimation.components.replicate_influence")
#: The sharp interval's ends (docs/statistics.md §6): in ``estimate``, per replicate and in ``sharp_interval``.
_BOUNDS = ("estimation.estimators._point_and_se", "estimation.components.replicate_influence",
           "estimation.interval._bounds")
#: The speculative-decoding estimands (docs/statistics.md §10).
_SPECULATIVE = ("estimation.speculative.speculative",)

#: The estimands, in the order of ``divstats.estimate``'s variables.
ESTIMANDS: tuple[Estimand, ...] = (
    _E("occurrence", "P(tau <= T): probability that the branches diverge within the horizon",
       "mean", interval=True, summary=True, replicate=0, bounds="unit", full_value="zero", formula=_PER_KIND),
    _E("rmtd", ("sum_{t=0}^{T-1} S(t) = E[min(tau, T)]: restricted mean time to divergence (docs/statistics.md §3 "
                "definition; its gloss E[min(tau - 1, T)] equals this minus occurrence, see "
                "docs/statistics.md)"),
       "mean", interval=True, summary=True, replicate=2, worse="smaller", bounds="horizon", full_value="horizon",
       formula=_PER_KIND),
    _E("agreeing_tokens", ("rmtd - occurrence = E[min(tau - 1, T)]: expected number of agreeing tokens before "
                           "the divergence (the tokens both models emit identically)"),
       "mean", interval=True, component=False, summary=True, worse="smaller", full_value="horizon",
       formula=("estimation.estimators._point_and_se",)),
    _E("exposure", "E[(T - tau)+]: expected post-divergence steps inside the horizon",
       "mean", interval=True, summary=True, replicate=1, bounds="horizon", full_value="zero", formula=_PER_KIND),
    _E("post_mismatch", "E[R], R = sum_{t > tau} D_t: expected mismatches after the first one",
       "mean", post_dependent=True, replicate=3, bounds="horizon", full_value="zero", formula=_PER_KIND),
    _E("rate", "post_mismatch / exposure (ratio of expectations); NaN when exposure = 0",
       "ratio", post_dependent=True, interval=True, summary=True, bounds="unit", formula=_DERIVED),
    _E("loss", "E[L] = occurrence + exposure * rate: expected number of mismatched tokens",
       "derived", post_dependent=True, bounds="horizon", full_value="zero",
       formula=(*_DERIVED, "estimation.variance.variance_check")),
    _E("mismatch_fraction", "loss / T = first_mismatch_contribution + exposure_contribution",
       "derived", post_dependent=True, interval=True, summary=True, bounds="unit", full_value="zero", formula=_DERIVED),
    _E("first_mismatch_contribution", "occurrence / T",
       "derived", interval=True, summary=True, bounds="unit", full_value="zero", formula=_DERIVED),
    _E("exposure_contribution", "(exposure / T) * rate (0 when exposure = 0, since then R = 0 on every path)",
       "derived", post_dependent=True, interval=True, summary=True, bounds="unit", full_value="zero", formula=_DERIVED),
    _E("window_mismatch", ("E[sum_{tau < t <= tau + W} D_t]: mismatches observed in the W-step window "
                           "after divergence"),
       "mean", replicate=4, bounds="horizon", full_value="zero", formula=_PER_KIND),
    _E("tail_capacity", ("E[(T - tau - K) 1[not both ended at tau + K]; tau <= T], K = min(W, T - tau): "
                         "steps after the window that could still disagree"),
       "mean", replicate=5, bounds="horizon", formula=_PER_KIND),
    _E("loss_lower", "occurrence + window_mismatch: lower end of the sharp interval for loss (docs/statistics.md §6)",
       "derived", interval=True, summary=True, bounds="horizon", full_value="zero", formula=_BOUNDS),
    _E("loss_upper", "occurrence + window_mismatch + tail_capacity: upper end of the sharp interval for loss",
       "derived", interval=True, summary=True, bounds="horizon", full_value="zero", formula=_BOUNDS),
)

#: The speculative-decoding estimands with Q as the draft and P as the target, one per
#: (doc, policy, gamma), in the order of ``divstats.speculative``'s variables (each with
#: ``_se``). Over documents: equal weights, the per-call quantities as ratios of the
#: document means (``divstats.aggregate_speculative``).
SPECULATIVE_ESTIMANDS: tuple[Estimand, ...] = (
    _E("target_calls", "E[C]: target (full-model) calls to produce the run's tokens, N = min(T, first EOS)",
       "mean", interval=True, component=False, bounds="horizon", formula=_SPECULATIVE),
    _E("tokens", "E[N]: tokens the run produces (T when no path ends early)",
       "mean", interval=True, component=False, bounds="horizon", plan=False, formula=_SPECULATIVE),
    _E("accepted", "E[A]: accepted drafts among the run's tokens",
       "mean", interval=True, component=False, worse="smaller", bounds="horizon", plan=False, formula=_SPECULATIVE),
    _E("tokens_per_call", "E[N] / E[C] (ratio of expectations; T / target_calls without EOS)",
       "ratio", interval=True, component=False, worse="smaller", formula=_SPECULATIVE),
    _E("accepted_per_call", "E[A] / E[C]: accepted drafts per target call (ratio of expectations)",
       "ratio", interval=True, component=False, worse="smaller", formula=_SPECULATIVE),
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
        :data:`ESTIMANDS` (§3) or :data:`SPECULATIVE_ESTIMANDS` (§10).

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
             "| worse | range | plan metric | full model | formula |", "|---" * 12 + "|"]
    for e in rows:
        lines.append(f"| `{e.name}` | {AGGREGATIONS[e.aggregate]} | {yes(e.post_dependent)} | {yes(e.interval)} "
                    f"| {yes(e.component)} | {yes(e.summary)} | {'' if e.replicate is None else e.replicate} "
                    f"| {e.worse} | {e.bounds} | {yes(e.plan)} | {FULL_VALUES[e.full_value]} "
                    f"| {formula_text(e)} |")
    return "\n".join(lines)


def formula_text(estimand: Estimand) -> str:
    """Where an estimand's formula is, one module at a time, as the docs print it.

    Parameters
    ----------
    estimand : Estimand
        A row of :data:`ESTIMANDS` or :data:`SPECULATIVE_ESTIMANDS`.

    Returns
    -------
    str
        ``module`` then its functions, modules separated by ``;``.

    Examples
    --------
    >>> formula_text(by_name("rate"))
    '`estimation/estimators`: `derived_quantities`; `estimation/components`: `replicate_influence`'
    """
    modules: dict[str, list[str]] = {}
    for where in estimand.formula:
        module, _, function = where.rpartition(".")
        modules.setdefault(module.replace(".", "/"), []).append(function)
    return "; ".join(f"`{m}`: " + ", ".join(f"`{f}`" for f in fs) for m, fs in modules.items())


# --------------------------------------------------------------------------- names by role

def _spelled(name: str) -> str:
    """``name``, checked against the tables on import: a renamed row fails here, not in a figure."""
    if name not in {e.name for e in ESTIMANDS + SPECULATIVE_ESTIMANDS}:
        raise KeyError(f"{name!r} is not a row of ESTIMANDS or SPECULATIVE_ESTIMANDS")
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
