"""``compute``: every estimator, the plan and the decompositions on one trace dataset.

This is the computation behind ``kvdiv analyze`` (no files written): it calls the
public API (``divstats.estimate``, ``aggregate``, ``aggregate_intervals``,
``survival``, ``branch_tv``, ``interval_by_window``, ``variance_check``,
``run_plan``, ``decompose``) with the same options and keeps every result in one
:class:`Analysis`. On dask-backed traces the per-document estimators share one
pass over the data (``divstats.traces.chunked.map_docs_many``): each document chunk is
read once, not once per estimator. Without a plan the analysis is descriptive: there are no plan
rows and every comparison is exploratory.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from divstats.errors import PlanError
from divstats.estimands import MISMATCH_FRACTION, OCCURRENCE, by_name
from divstats.estimation.answers import with_answer_values
from divstats.estimation.budget_curves import budget_curves
from divstats.estimation.curves import branch_tv, logit_curves, survival
from divstats.estimation.estimators import aggregate, aggregate_intervals, estimate
from divstats.estimation.interval import interval_by_window
from divstats.estimation.noise_floor import compare_to_floor, control_policy, floor_warnings, noise_floor
from divstats.estimation.speculative import aggregate_speculative, speculative
from divstats.estimation.sweeps import sweep_families
from divstats.estimation.variance import variance_check
from divstats.inference.choices import MARGIN_ALTERNATIVES
from divstats.inference.decompose import DecompositionInterval, DecompositionResult, decompose
from divstats.plans.format import Plan, PlanSource, load_plan
from divstats.plans.run import PlanResult, full_model_value, run_plan
from divstats.report.answers import AnswerAnalysis, compute_answers
from divstats.traces.chunked import map_docs_many
from protocols import Kind, logit_vars
from protocols.chunks import is_lazy

__all__ = ["Analysis", "compute", "decomposition_pairs", "default_interval_windows"]

#: What the progress bar counts, in order.
STEPS: tuple[str, ...] = ("estimate", "survival", "branch TV", "interval by W", "variance check", "plan",
                          "decomposition")


@dataclass(frozen=True)
class Analysis:
    """Everything ``analyze`` computed, built once by :func:`compute` and never changed.

    ``plan`` and ``plan_result`` are None for a descriptive analysis (no plan). What
    ``results.nc`` holds is computed from it by
    :func:`divstats.report.results.results_dataset` (which imports this module, not
    the other way round). ``paths`` is empty from :func:`compute`; the writers in
    ``divstats.report.write`` return the paths they wrote, and
    :func:`divstats.report.write.analyze` returns a copy of the analysis naming them.
    """

    traces: xr.Dataset
    plan: Plan | None
    estimates: xr.Dataset
    aggregate: xr.Dataset
    aggregate_ci: xr.Dataset
    survival: xr.Dataset
    branch_tv: xr.Dataset | None
    interval: xr.Dataset | None
    variance: xr.Dataset | None
    plan_result: PlanResult | None
    decompositions: list[tuple[DecompositionResult, DecompositionInterval]]
    notes: list[str]
    options: dict[str, Any]
    paths: Mapping[str, Path] = field(default_factory=dict)
    #: :func:`divstats.estimation.noise_floor.noise_floor` (its ``note`` says when no control was collected).
    noise_floor: xr.Dataset | None = None
    #: :func:`divstats.estimation.speculative.aggregate_speculative` over (policy, gamma); reference traces only.
    speculative: xr.Dataset | None = None
    #: :func:`divstats.estimation.curves.logit_curves` of traces that carry logit traces (else None).
    logit_curves: xr.Dataset | None = None
    #: "How much can I compress?": :func:`divstats.estimation.budget_curves.budget_curves` of every policy
    #: family with two or more members (None when there is none); the certifications are ``plan_result.certify``.
    compression: xr.Dataset | None = None
    #: "Does it change the answer?": :func:`divstats.report.answers.compute_answers` (None when the traces
    #: carry neither answer scores nor logit traces).
    answers: AnswerAnalysis | None = None


def default_interval_windows(ds: xr.Dataset) -> list[int]:
    """A grid of at most 9 observation windows W for the sharp-interval curve.

    Parameters
    ----------
    ds : xarray.Dataset
        Traces (``kind``, ``horizon`` and, for residual traces, ``window`` attrs).

    Returns
    -------
    list of int
        ``[0]`` for reference traces, else evenly spaced W from 0 to the largest
        observed window (T - 1 for coupled traces).

    Examples
    --------
    >>> import xarray as xr
    >>> default_interval_windows(xr.Dataset(attrs={"kind": "coupled", "horizon": 5}))
    [0, 1, 2, 3, 4]
    """
    T = int(ds.attrs["horizon"])
    kind = ds.attrs.get("kind")
    if kind == Kind.REFERENCE:
        return [0]
    top = T - 1 if kind == Kind.COUPLED else min(int(ds.attrs.get("window", T)), T - 1)
    grid = np.unique(np.round(np.linspace(0, top, min(top + 1, 9))).astype(int))
    return [int(w) for w in grid]


def decomposition_pairs(plan_result: PlanResult | None, policies: Sequence[str]) -> list[tuple[str, str]]:
    """Policy pairs to decompose: those the plan compares (after aliases), else all vs the first.

    Parameters
    ----------
    plan_result : PlanResult or None
        The plan's result (None: no plan).
    policies : sequence of str
        Policies in the data, in order.

    Returns
    -------
    list of (str, str)
        (A, B) pairs, in plan order, without repeats.

    Examples
    --------
    >>> decomposition_pairs(None, ["a", "b", "c"])
    [('b', 'a'), ('c', 'a')]
    """
    pairs: list[tuple[str, str]] = []
    if plan_result is not None:
        t = plan_result.table
        for a, b, pol in zip(t["a"], t["b"], t["policy"], strict=True):
            if not pol and a in policies and b in policies and (a, b) not in pairs:
                pairs.append((a, b))
    if not pairs and len(policies) > 1:
        pairs = [(p, policies[0]) for p in policies[1:]]
    return pairs


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm  # lazy: the progress bar (and its notebook probe) only when compute runs

    return tqdm(total=total, file=sys.stderr, disable=not enabled, desc="analyze", unit="step",
                leave=False)


def _optional_curves(traces: xr.Dataset, window: int | None, notes: list[str]) -> tuple[Any, Any]:
    """(branch TV, variance check), each None where the trace kind does not allow it."""
    kind = traces.attrs.get("kind")
    bt = vc = None
    if kind == Kind.REFERENCE:
        notes.append("Reference traces observe nothing after divergence: no branch-aligned TV.")
    else:
        bt = branch_tv(traces, window=window)
    if kind == Kind.RESIDUAL:
        try:
            vc = variance_check(traces)
        except ValueError as exc:
            notes.append(f"Variance check skipped: {exc}")
    return bt, vc


def _one_pass(traces: xr.Dataset, window: int | None, windows: list[int], notes: list[str],
              ) -> tuple[Any, ...]:
    """(estimates, survival, branch TV, interval by W, variance check) of dask-backed traces, one read.

    Each document chunk is read once for all five (``map_docs_many``) instead of once
    per estimator. A variance check the data do not allow fails its chunk task, so
    the pass is run again without it and the reason noted, as in memory.
    """
    kind = traces.attrs.get("kind")
    fns: dict[str, tuple[Any, dict[str, Any]]] = {
        "est": (estimate, {"window": window}), "surv": (survival, {}),
        "ivw": (interval_by_window, {"windows": windows})}
    if kind == Kind.REFERENCE:
        notes.append("Reference traces observe nothing after divergence: no branch-aligned TV.")
    else:
        fns["bt"] = (branch_tv, {"window": window})
    if kind == Kind.RESIDUAL:
        try:
            out = map_docs_many({**fns, "vc": (variance_check, {})}, traces)
        except ValueError as exc:
            out = map_docs_many(fns, traces)
            notes.append(f"Variance check skipped: {exc}")
    else:
        out = map_docs_many(fns, traces)
    return out["est"], out["surv"], out.get("bt"), out["ivw"], out.get("vc")


def _per_document(traces: xr.Dataset, window: int | None, windows: list[int], notes: list[str], bar,
                  ) -> tuple[Any, ...]:
    """(estimates, survival, branch TV, interval by W, variance check): the per-document estimators."""
    if is_lazy(traces):
        out = _one_pass(traces, window, windows, notes)
        bar.update(4)
        return out
    est = estimate(traces, window=window)
    bar.update()
    surv = survival(traces)
    bar.update()
    bt, vc = _optional_curves(traces, window, notes)
    bar.update()
    ivw = interval_by_window(traces, windows)
    bar.update()
    return est, surv, bt, ivw, vc


def _decompositions(est: xr.Dataset, pairs: Sequence[tuple[str, str]], level: float, n_resamples: int,
                    seed: int, notes: list[str]) -> list[tuple[DecompositionResult, DecompositionInterval]]:
    decs = []
    for a, b in pairs:
        try:
            res = decompose(est, a, b)
        except ValueError as exc:
            notes.append(f"Decomposition {a} vs {b} not computed: {exc}")
            continue
        decs.append((res, res.confidence_interval(level, n_resamples=n_resamples, seed=seed)))
    return decs


def _refuse_control_hypotheses(plan: Plan | None, aliases: Mapping[str, str] | None, control: str | None) -> None:
    """The control (full vs full) is the noise floor, never a hypothesis's policy (planned or aliased),
    except as the reference side B of a test at a margin: "A is non-inferior to (or equivalent with)
    the full model" is then tested against the full model as measured, floor included."""
    if plan is None or control is None:
        return

    def named(h: Any) -> set[str]:
        sides = [h.policy] if h.compares_windows else list(h.compare)
        if h.direction in MARGIN_ALTERNATIVES and not h.compares_windows:
            sides = sides[:1]   # B may be the control
        return {(aliases or {}).get(p, p) for p in sides}

    bad = [h.id for h in plan.hypotheses if control in named(h)]
    if bad:
        raise PlanError(f"hypotheses {', '.join(bad)} name {control!r}, the numerical control: it measures the noise "
                        "floor (the report's noise-floor section) and can only be side B of a test at a margin; "
                        "compare candidates")


def compute(traces: xr.Dataset, plan: PlanSource | None = None, *, window: int | None = None,
            policy_aliases: Mapping[str, str] | None = None, seed: int = 0, n_resamples: int = 9999,
            level: float = 0.95, interval_windows: Sequence[int] | None = None,
            progress: bool = True, cost_ratio: float | None = None) -> Analysis:
    """Run every estimator, the plan and the decompositions on ``traces`` (no files written).

    Parameters
    ----------
    traces : xarray.Dataset
        A trace dataset (docs/contract.md).
    plan : Plan, str, pathlib.Path, mapping or None
        Anything :func:`divstats.plans.format.load_plan` accepts (``"paper"``: the shipped
        plan). None: a descriptive analysis, every comparison exploratory.
    window : int, optional
        Truncate the observation window after divergence.
    policy_aliases : mapping of str to str, optional
        Planned policy → data policy (a recorded deviation; see docs/plans.md).
    seed, n_resamples : int
        Control every bootstrap and Monte Carlo permutation test.
    level : float
        Confidence level of the descriptive intervals (plan rows use 1 - alpha).
    interval_windows : sequence of int, optional
        Observation windows of the sharp-interval curve (default: :func:`default_interval_windows`).
    progress : bool
        Show a progress bar on stderr.
    cost_ratio : float, optional
        One draft step / one target step, for the speedup of the speculative-decoding
        section (reference traces only; docs/statistics.md §10).

    Returns
    -------
    Analysis
        Every result (``divstats.report.results.results_dataset`` turns it into the
        Dataset that ``results.nc`` holds).

    Raises
    ------
    PlanError
        For an ill-formed plan, or one that names what the data lack.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.2)}, horizon=6, replicates=3)
    >>> an = compute(ds, n_resamples=99, progress=False)
    >>> an.plan is None, [(r.a, r.b) for r, _ in an.decompositions]
    (True, [('b', 'a')])
    """
    plan = None if plan is None else load_plan(plan)
    if plan is None and policy_aliases:
        raise ValueError("policy aliases substitute planned policies; without a plan there is nothing to alias")
    _refuse_control_hypotheses(plan, policy_aliases, control_policy(traces))
    notes: list[str] = []
    bar = _progress(len(STEPS), progress)
    windows = list(interval_windows) if interval_windows is not None else default_interval_windows(traces)
    est, surv, bt, ivw, vc = _per_document(traces, window, windows, notes, bar)
    est = with_answer_values(est, traces)      # accuracy, accuracy_change beside the estimands (plans test them)
    # KL and entropies beside TV, when the traces carry logit traces (descriptive: no estimand uses them)
    lc = logit_curves(traces, window=window) if logit_vars(traces) and traces.attrs.get("kind") != Kind.REFERENCE \
        else None
    agg = aggregate(est)
    agg_ci = aggregate_intervals(est, level=level, n_resamples=n_resamples, seed=seed)
    bar.update()
    pres = None
    if plan is not None:
        pres = run_plan(traces, plan, aliases=policy_aliases, window=window, estimates=est, branch=bt,
                        n_resamples=n_resamples, seed=seed)
    bar.update()
    control = control_policy(traces)
    # the control is shown (estimates, the noise-floor section) but is no comparison of its own
    pairs = decomposition_pairs(pres, [str(p) for p in traces["policy"].values if str(p) != control])
    decs = _decompositions(est, pairs, level, n_resamples, seed, notes)
    bar.update()
    bar.close()
    floor = noise_floor(traces, control=control, window=window, estimates=est, level=level,
                        n_resamples=n_resamples, seed=seed)
    notes += floor_warnings(compare_to_floor(agg, floor))
    spec = _speculative(traces, cost_ratio, level, n_resamples, seed, notes)
    comp = _compression(est, pres, level, n_resamples, seed, notes)
    answers = compute_answers(traces, est, level=level, n_resamples=n_resamples, seed=seed)
    if answers is not None:
        notes += answers.notes
    options = {"window": -1 if window is None else int(window), "seed": int(seed),
               "n_resamples": int(n_resamples), "level": float(level),
               "policy_aliases": json.dumps(dict(policy_aliases or {}), sort_keys=True),
               "interval_windows": json.dumps(windows),
               **({"cost_ratio": float(cost_ratio)} if cost_ratio is not None else {})}
    return Analysis(traces=traces, plan=plan, estimates=est, aggregate=agg, aggregate_ci=agg_ci, survival=surv,
                    branch_tv=bt, interval=ivw, variance=vc, plan_result=pres, decompositions=decs,
                    notes=notes + (pres.notes if pres is not None else []), options=options, noise_floor=floor,
                    speculative=spec, logit_curves=lc, compression=comp, answers=answers)


def _compression(est: xr.Dataset, pres: PlanResult | None, level: float, n_resamples: int, seed: int,
                 notes: list[str]) -> xr.Dataset | None:
    """The curves of "How much can I compress?": the first [[certify]]'s metric and margin, else mismatch fraction.

    ``attrs``: ``metric``, ``worse``, ``margin`` (signed; NaN without a certification) and
    ``reference_level`` (the full model's value, or the control's mean), so that the
    figure draws the margin where the certification puts it (reference + margin).
    """
    if not sweep_families(est):
        return None
    cert = pres.plan.certifications[0] if pres is not None and pres.plan.certifications else None
    metric = cert.metric if cert is not None else next(
        (m for m in (MISMATCH_FRACTION, OCCURRENCE) if m in est and bool(np.isfinite(est[m]).any())), OCCURRENCE)
    worse = cert.worse if cert is not None else by_name(metric).worse
    margin = math.nan if cert is None else (cert.margin if worse == "larger" else -cert.margin)
    ref = math.nan
    if cert is not None:
        if cert.reference != "full":
            ref = float(cert.reference)
        elif "full" in [str(p) for p in est["policy"].values]:
            ref = float(est[metric].sel(policy="full").mean())
        else:
            ref = full_model_value(metric, est.attrs.get("horizon"))
    curves = budget_curves(est, metric, level=level, cross=None if cert is None else ref + margin, worse=worse,
                           n_resamples=min(n_resamples, 1999), seed=seed)
    curves.attrs.update(margin=margin, reference_level=ref, certify_id="" if cert is None else cert.id)
    for fam, why in zip(curves["family"].values, np.ravel(curves["reason"].values), strict=False):
        if why:
            notes.append(f"How much can I compress? ({fam}): {why}")
    return curves


def _speculative(traces: xr.Dataset, cost_ratio: float | None, level: float, n_resamples: int, seed: int,
                 notes: list[str]) -> xr.Dataset | None:
    """The speculative-decoding section's numbers: reference traces only (the others carry no log q of P's tokens)."""
    if traces.attrs.get("kind") != Kind.REFERENCE:
        if cost_ratio is not None:
            notes.append("cost ratio ignored: the speculative-decoding section needs reference traces")
        return None
    agg = aggregate_speculative(speculative(traces, cost_ratio=cost_ratio), level=level,
                                n_resamples=n_resamples, seed=seed)
    if agg.attrs.get("reason"):
        notes.append(f"speculative decoding: intervals over documents {agg.attrs['reason']}")
    return agg
