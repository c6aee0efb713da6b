"""The report's "Does it change the answer?" section: what it computes (display: ``answer_tables``).

:func:`compute_answers` gathers what the section shows from traces that carry answer
scores (``x_score``, ``y_score``) or logit traces: the per-policy answers table
(:func:`divstats.compare_answers_dataset`), accuracy against budget per policy family with
the certified budget at an accuracy margin (``certify_family`` on ``accuracy_change``), how
often the answer changes by where P and Q diverged, the needle-depth map, what the coupling
saved, and the per-token numbers beside them (:func:`divstats.estimation.token_summary.token_summary`).
:mod:`divstats.report.answer_tables` turns it into display rows, figures and the plain-text
table of the demo's headline.  docs/report.md describes the section; docs/statistics.md §12
the statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xarray as xr

from divstats.errors import DivstatsError
from divstats.estimands import ACCURACY, ACCURACY_CHANGE
from divstats.estimation.answers import has_answers
from divstats.estimation.budget_curves import budget_curves
from divstats.estimation.sweeps import sweep_families
from divstats.estimation.token_summary import token_summary
from divstats.inference.answers import accuracy_by_depth, change_by_divergence, compare_answers_dataset
from divstats.inference.certify import CertifyResult, certify_family
from divstats.traces.arrays import without_attrs

if TYPE_CHECKING:
    pass

__all__ = ["DEFAULT_ACCURACY_MARGIN", "AnswerAnalysis", "answers_results", "compute_answers", "keep_descriptions"]

#: The accuracy margin of the section's certification and equivalence wording (5 points).
DEFAULT_ACCURACY_MARGIN = 0.05


@dataclass(frozen=True)
class AnswerAnalysis:
    """What the "Does it change the answer?" section shows (every part may be empty)."""

    table: xr.Dataset
    change: xr.Dataset
    depth: xr.Dataset
    curves: xr.Dataset | None
    certify: tuple[tuple[str, Any, CertifyResult], ...]
    tokens: xr.Dataset
    margin: float
    notes: list[str] = field(default_factory=list)

    @property
    def has_answers(self) -> bool:
        return bool(self.table.data_vars)


def compute_answers(traces: xr.Dataset, est: xr.Dataset, *, level: float = 0.95, n_resamples: int = 9999,
                    seed: int = 0, margin: float = DEFAULT_ACCURACY_MARGIN) -> AnswerAnalysis | None:
    """Everything the section shows; None when the traces carry neither answer scores nor logit traces.

    Parameters
    ----------
    traces : xarray.Dataset
        The traces.
    est : xarray.Dataset
        Their estimates with the answer estimands (:func:`with_answer_values`).
    level : float
        Confidence level of the intervals.
    n_resamples, seed : int
        Resampling.
    margin : float
        Accuracy margin δ (> 0) of the certification: a budget is certified when Q − P > −δ
        is shown by the fixed sequence.

    Returns
    -------
    AnswerAnalysis or None

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> from divstats.truth.answers import with_answer_scores
    >>> tr = with_answer_scores(simulate_study(12, {"a@0.5": PolicyEffect(0.3)}, horizon=6, replicates=2),
    ...                         {"a@0.5": (0.5, 0.0)})
    >>> import divstats
    >>> aa = compute_answers(tr, divstats.answer_values(tr), n_resamples=99)
    >>> aa.has_answers, list(aa.table["policy"].values)
    (True, ['a@0.5'])
    """
    tokens = token_summary(traces, level=level)
    if not has_answers(traces):
        if not tokens.data_vars:
            return None
        return AnswerAnalysis(xr.Dataset(), xr.Dataset(), xr.Dataset(), None, (), tokens, margin)
    alpha = 1.0 - level
    table = compare_answers_dataset(traces, alpha=alpha, n_resamples=n_resamples, seed=seed)
    notes = []
    if table.attrs.get("reason"):
        notes.append(f"Answers: intervals {table.attrs['reason']}")
    change = change_by_divergence(traces) if traces.attrs.get("kind") == "coupled" else xr.Dataset()
    depth = accuracy_by_depth(traces)
    curves, certs = None, []
    fams = sweep_families(est)
    if fams:
        curves = budget_curves(est, ACCURACY, level=level, worse="smaller", n_resamples=min(n_resamples, 1999),
                               seed=seed)
        ref = est[ACCURACY].sel(policy="full").mean() if "full" in [str(p) for p in est["policy"].values] else None
        # the line the certification draws: P's accuracy (or the control's) minus the margin
        p_acc = float(table["answer_x_accuracy"].mean()) if ref is None else float(ref)
        curves.attrs.update(margin=-margin, reference_level=p_acc, certify_id="answers")
        models = [str(m) for m in est["model"].values] if "model" in est.dims else [None]
        for fam in fams:
            for m in models:
                try:
                    res = certify_family(est, fam, ACCURACY_CHANGE, -margin, alpha=alpha, worse="smaller",
                                         model=m, n_resamples=min(n_resamples, 1999), seed=seed)
                except DivstatsError as exc:
                    notes.append(f"Answers: certification of {fam}: {exc}")
                    continue
                certs.append((fam, m, res))
    return AnswerAnalysis(table, change, depth, curves, tuple(certs), tokens, margin, notes)


def answers_results(aa: AnswerAnalysis | None) -> list[xr.Dataset]:
    """The section's numbers for results.nc (each variable with its ``description``).

    The per-policy table keeps its names (``answer_x_accuracy``, ... over ``policy``); the
    divergence split is over ``answer_divergence``, the depth map over ``answer_depth``, the
    per-token table's ``token_*`` over ``policy``, accuracy against budget ``answer_budget_*``.

    Parameters
    ----------
    aa : AnswerAnalysis or None
        :func:`compute_answers` output.

    Returns
    -------
    list of xarray.Dataset
        The parts to merge into results.nc (empty for None).

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> from divstats.truth.answers import with_answer_scores
    >>> tr = with_answer_scores(simulate_study(12, {"a@0.5": PolicyEffect(0.3)}, horizon=6, replicates=2),
    ...                         {"a@0.5": (0.5, 0.0)})
    >>> import divstats
    >>> parts = answers_results(compute_answers(tr, divstats.answer_values(tr), n_resamples=99))
    >>> "answer_difference" in parts[0], "answer_divergence" in parts[1].dims
    (True, True)
    """
    if aa is None:
        return []
    parts = []
    if aa.has_answers:
        parts.append(aa.table.drop_attrs(deep=False))
    if aa.change.data_vars:
        parts.append(aa.change.rename(divergence="answer_divergence"))
    if aa.depth.data_vars:
        parts.append(aa.depth.rename(depth="answer_depth", depth_low="answer_depth_low",
                                     depth_high="answer_depth_high"))
    if aa.tokens.data_vars:
        parts.append(aa.tokens.drop_attrs(deep=False))
    if aa.curves is not None:
        c = without_attrs(aa.curves)
        names = {n: f"answer_budget_{n}" for n in [*c.data_vars, "family", "budget", "policy", "kept"]
                 if n in c.variables}
        parts.append(c.rename(names))
    return parts


def keep_descriptions(out: xr.Dataset, parts: Sequence[xr.Dataset]) -> None:
    """Put each part's variables' ``description`` attrs on ``out`` (a merge that drops attrs lost them).

    Parameters
    ----------
    out : xarray.Dataset
        The merged dataset (changed in place).
    parts : sequence of xarray.Dataset
        The parts whose variables carry the descriptions.

    Returns
    -------
    None

    Examples
    --------
    >>> import xarray as xr
    >>> part = xr.Dataset({"a": ("x", [1.0], {"description": "what a is"})})
    >>> out = xr.merge([part], combine_attrs="drop").drop_attrs()
    >>> keep_descriptions(out, [part]); out["a"].attrs["description"]
    'what a is'
    """
    for part in parts:
        for name, var in part.data_vars.items():
            if name in out and var.attrs.get("description"):
                out[name].attrs["description"] = var.attrs["description"]


