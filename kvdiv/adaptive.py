"""Adaptive collection: a pilot, then rounds of further replicates where they pay.

``kvdiv collect --target-se X`` (or ``--budget B``) collects the run as usual, R
replicates per (document, policy): that is round 0, the *pilot*. Then, round after
round, it packs what it has, estimates each pair's per-replicate Monte Carlo variance
w of the target metrics and asks each pair the further replicates it needs
(``divstats.plan_round``, docs/design.md):

- ``target_se``: enough that w / R reaches the target SE on every metric, counting
  only the replicates of rounds >= 1; after each round the variance is re-estimated
  from everything collected and the run stops once no pair needs more, or after
  ``max_rounds`` rounds;
- ``budget``: B further replicates (or cost units, ``divstats.plan_round``'s cost model)
  spread by Neyman allocation (R proportional to sqrt(w / c)) to minimise the summed
  variance of the metrics, in one round after the pilot.

Every round gives every pair it asks at least ``min_replicates`` (round 1: every
pair), so that the rounds after the pilot estimate every pair on their own. The
estimate is theirs alone: round 0 chose the allocation, and pooled with it the
estimate is biased (docs/design.md); ``kvdiv pack`` marks round 0 with the ``round``
coordinate and ``divstats`` leaves it out of every estimate. With one allocated
round (``budget``, or a target met after round 1) the estimate is exactly
unbiased; further rounds, allocated from the data of round 1, leave a small bias,
measured by simulation (``divstats.calibration.adaptive``) in docs/design.md and
``tests/test_adaptive.py``.

The collector does the collecting (``collector.collect`` with ``round_index`` and
``allocation``); this module, the application layer, decides the rounds, because
the decision needs ``divstats``, which the collector may not import. The journal
records each round's allocation (``rounds/<k>/allocation.json``) and the manifest the
settings (``adaptive``: target or budget, metrics, plan, rounds so far), so a rerun of
the same command resumes the right round and never mixes rounds.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xarray as xr

from collector.collect import CollectConfig, collect
from collector.errors import ConfigError, ManifestMismatch
from collector.journal import Journal
from collector.result import CollectResult
from divstats import RoundPlan
from protocols import Kind

__all__ = ["AdaptiveResult", "AdaptiveSpec", "RoundPlan", "collect_adaptive", "next_round", "parse_target",
           "plan_metrics"]

BUDGET_UNITS = ("replicates", "cost")


def _targetable() -> tuple[str, ...]:
    """The metrics an allocation can target: the variance-component estimands of ``divstats.ESTIMANDS``."""
    from divstats import ESTIMANDS

    return tuple(e.name for e in ESTIMANDS if e.component)


@dataclass(frozen=True)
class AdaptiveSpec:
    """What an adaptive collection aims for; recorded in the manifest and compared on resume.

    Attributes
    ----------
    metrics : tuple of str
        Variance-component metrics of ``divstats.ESTIMANDS`` the allocation targets.
    target_se : dict, optional
        metric -> the Monte Carlo SE to reach on every per-document estimate.
    budget : float, optional
        Further replicates (``budget_unit="replicates"``) or cost units (``"cost"``:
        the cost model fitted to the pilot's traces) to spend.
    budget_unit : {"replicates", "cost"}
    by : {"cell", "policy"}
        Allocate from each (document, policy)'s own variance, or the policy's mean.
    max_rounds : int
        Rounds after the pilot, at most (``target_se``; a budget is spent in one).
        One round keeps the estimate exactly unbiased; each further round is
        allocated from data the estimate uses, which leaves a small bias
        (docs/design.md). May be raised when a run is resumed.
    min_replicates : int
        Each pair a round asks gets at least this many (round 1 asks every pair).
    plan : str, optional
        The plan the metrics came from (name and sha256), for the record.

    Raises
    ------
    ConfigError
        Neither or both of ``target_se`` and ``budget``, a target or budget that is not
        > 0, an unknown metric, unit or ``by``, or ``max_rounds`` < 1.

    Examples
    --------
    >>> AdaptiveSpec(("occurrence",), target_se={"occurrence": 0.05}).describe()
    'target SE occurrence=0.05, by cell, at most 1 round after the pilot'
    """

    metrics: tuple[str, ...]
    target_se: dict[str, float] | None = None
    budget: float | None = None
    budget_unit: str = "replicates"
    by: str = "cell"
    max_rounds: int = 1
    min_replicates: int = 2
    plan: str | None = None

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ConfigError("; ".join(problems))

    def _problems(self) -> list[str]:
        METRICS = _targetable()

        problems = []
        if (self.target_se is None) == (self.budget is None):
            problems.append("give one of --target-se and --budget, not both" if self.target_se is not None
                            else "an adaptive collection needs --target-se or --budget")
        unknown = [m for m in self.metrics if m not in METRICS]
        if unknown or not self.metrics:
            problems.append(f"metrics {unknown or '(none)'} cannot be targeted; known: {', '.join(METRICS)}")
        if self.target_se is not None:
            bad = {m: x for m, x in self.target_se.items() if not (math.isfinite(x) and x > 0)}
            if bad:
                problems.append(f"--target-se must be > 0, got {bad}")
            if set(self.target_se) != set(self.metrics):
                problems.append(f"--target-se names {sorted(self.target_se)}, the metrics are {list(self.metrics)}")
        if self.budget is not None and not (math.isfinite(self.budget) and self.budget > 0):
            problems.append(f"--budget must be > 0, got {self.budget}")
        if self.budget_unit not in BUDGET_UNITS:
            problems.append(f"--budget-unit must be one of {BUDGET_UNITS}, not {self.budget_unit!r}")
        if self.by not in ("cell", "policy"):
            problems.append(f"--allocate-by must be 'cell' or 'policy', not {self.by!r}")
        if self.max_rounds < 1 or self.min_replicates < 1:
            problems.append("--max-rounds and the minimum replicates per pair must be >= 1")
        return problems

    @property
    def rounds_allowed(self) -> int:
        return 1 if self.budget is not None else self.max_rounds

    def round_settings(self) -> dict[str, Any]:
        """The allocation's settings as ``divstats.plan_round`` (and ``simulate_adaptive``) take them."""
        return {"target_se": self.target_se, "budget": self.budget, "budget_unit": self.budget_unit, "by": self.by,
                "max_rounds": self.max_rounds, "min_replicates": self.min_replicates}

    def record(self) -> dict[str, Any]:
        """The JSON the manifest keeps (``adaptive.spec``)."""
        return json_safe(dataclasses.asdict(self))

    def describe(self) -> str:
        if self.target_se is not None:
            goal = "target SE " + ", ".join(f"{m}={x:g}" for m, x in self.target_se.items())
        else:
            goal = f"budget {self.budget:g} {self.budget_unit}"
        rounds = "1 round" if self.rounds_allowed == 1 else f"{self.rounds_allowed} rounds"
        return f"{goal}, by {self.by}, at most {rounds} after the pilot"


def json_safe(obj: Any) -> Any:
    """Tuples as lists, numpy scalars as Python numbers: as the manifest stores them."""
    import json

    return json.loads(json.dumps(obj, default=lambda x: x.item() if hasattr(x, "item") else str(x)))


def parse_target(text: str, metrics: Sequence[str]) -> dict[str, float]:
    """``--target-se``: one number for a single metric, or ``metric=X,...`` for each metric.

    Parameters
    ----------
    text : str
        ``"0.05"`` or ``"occurrence=0.05,rmtd=0.5"``.
    metrics : sequence of str
        The metrics targeted (from ``--metrics`` or the plan).

    Returns
    -------
    dict
        metric -> target SE.

    Raises
    ------
    ConfigError
        A value that is not a number, a bare number with several metrics (their units
        differ), or metrics other than ``metrics``.

    Examples
    --------
    >>> parse_target("0.05", ["occurrence"]), parse_target("rmtd=0.5,occurrence=0.05", ["occurrence", "rmtd"])
    ({'occurrence': 0.05}, {'rmtd': 0.5, 'occurrence': 0.05})
    """
    metrics = list(metrics)
    try:
        if "=" not in text:
            if len(metrics) != 1:
                raise ConfigError(f"--target-se {text} is ambiguous for the metrics {', '.join(metrics)} (their "
                                  "units differ): give one per metric, e.g. --target-se "
                                  + ",".join(f"{m}=X" for m in metrics) + ", or choose one with --metrics")
            return {metrics[0]: float(text)}
        pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
        target = {k.strip(): float(v) for k, v in pairs}
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"--target-se {text!r}: not a number or metric=number list ({exc})") from None
    if set(target) != set(metrics):
        raise ConfigError(f"--target-se names {sorted(target)}, the metrics targeted are {metrics}")
    return target


def plan_metrics(plan_source: Any) -> tuple[tuple[str, ...], list[str], str]:
    """The metrics of a plan's hypotheses that an allocation can target.

    Parameters
    ----------
    plan_source : Plan, path, shipped plan name, TOML text or dict
        As ``divstats.load_plan`` takes it.

    Returns
    -------
    (tuple of str, list of str, str)
        The targetable metrics (in the plan's order), notes on the hypotheses left
        out (windowed branch-TV metrics are not per-document estimates the
        allocation knows), and "name sha256=..." for the record.

    Raises
    ------
    ConfigError
        The plan cannot be read, or none of its metrics can be targeted.

    Examples
    --------
    >>> plan_metrics("paper")[0]
    ('occurrence', 'rmtd')
    """
    from divstats import DivstatsError, load_plan

    METRICS = _targetable()
    try:
        plan = load_plan(plan_source)
    except (DivstatsError, ValueError, OSError) as exc:
        raise ConfigError(f"--plan {plan_source}: {exc}") from None
    metrics: list[str] = []
    skipped: list[str] = []
    for h in plan.hypotheses:
        if h.metric in METRICS:
            metrics += [h.metric] if h.metric not in metrics else []
        else:
            skipped.append(f"{h.id} ({h.metric})")
    if not metrics:
        raise ConfigError(f"plan {plan.name}: none of its metrics can be targeted ({', '.join(skipped)}); "
                          f"give --metrics from {', '.join(METRICS)}")
    return tuple(metrics), skipped, f"{plan.name} sha256={plan.sha256}"


def next_round(data: xr.Dataset, spec: AdaptiveSpec, round_index: int) -> RoundPlan:
    """``kvdiv collect``'s next round: ``divstats.plan_round`` with a spec's settings, its stop worded for the command.

    The statistics are ``divstats.plan_round``'s (the one function of that name); this
    passes it the spec's settings (:meth:`AdaptiveSpec.round_settings`), turns a metric
    without a Monte Carlo variance into the command's error, and words the reason to stop
    at ``--max-rounds`` with the flag to raise.

    Parameters
    ----------
    data : xarray.Dataset
        The packed traces of rounds 0..round_index-1 (with the ``round`` coordinate
        once a later round exists).
    spec : AdaptiveSpec
        The target or budget.
    round_index : int
        The round to plan (>= 1).

    Returns
    -------
    RoundPlan
        ``further`` all 0 (with a ``reason``) when the collection should stop.

    Raises
    ------
    ConfigError
        The traces give no Monte Carlo variance of a targeted metric.

    Examples
    --------
    >>> from divstats import PolicyEffect, simulate_study
    >>> pilot = simulate_study(3, {"a": PolicyEffect(0.1)}, horizon=5, replicates=4, kind="residual")
    >>> nxt = next_round(pilot, AdaptiveSpec(("loss",), budget=40), 1)
    >>> nxt.pairs, nxt.replicates >= 40
    (3, True)
    """
    import divstats

    try:
        plan = divstats.plan_round(data, spec.metrics, round_index, **spec.round_settings())
    except divstats.NotIdentified as exc:
        raise ConfigError(f"{exc}; target other --metrics (the pilot is kept)") from None
    if round_index > spec.rounds_allowed and spec.budget is None:
        why = f"--max-rounds {spec.max_rounds} reached" + (
            f" with {plan.short} (pair, metric) SEs above the target; rerun with --max-rounds {spec.max_rounds + 1} "
            "to add a round (later rounds leave a small bias: docs/design.md)" if plan.short else "")
        plan = dataclasses.replace(plan, reason=why)
    return plan


@dataclass
class AdaptiveResult:
    """What :func:`collect_adaptive` did.

    Attributes
    ----------
    results : dict
        round -> the collector's :class:`collector.result.CollectResult`.
    plans : dict
        round -> the :class:`RoundPlan` that allocated it (and the final one, with
        the reason to stop, under the next round's index).
    stopped : str
        Why the collection stopped.
    """

    results: dict[int, CollectResult] = field(default_factory=dict)
    plans: dict[int, RoundPlan] = field(default_factory=dict)
    stopped: str = ""

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results.values())


def _check_spec(journal: Journal, spec: AdaptiveSpec) -> None:
    """A resume must aim for what the run aimed for; only ``max_rounds`` may change (more rounds)."""
    manifest = journal.read_manifest()
    old = (manifest or {}).get("adaptive", {}).get("spec")
    diffs = [f"{k}: manifest has {old.get(k)!r}, this run asks for {v!r}" for k, v in spec.record().items()
             if old is not None and k != "max_rounds" and old.get(k) != v]
    if diffs:
        raise ManifestMismatch(f"{journal.dir} is an adaptive collection with other settings:\n  "
                               + "\n  ".join(diffs) + "\nResume with the original settings, or collect into a "
                               "new --out directory.")


def _record(journal: Journal, spec: AdaptiveSpec, plans: Mapping[int, RoundPlan], stopped: str) -> None:
    """The manifest's ``adaptive`` entry: the settings, each round's allocation in brief, why it stopped."""
    manifest = journal.read_manifest() or {}
    rounds = {r["round"]: r for r in (manifest.get("adaptive") or {}).get("rounds", [])}  # earlier invocations
    rounds.update({k: {"round": k, "pairs": p.pairs, "replicates": p.replicates,
                       "se_before": {m: _quantiles(p.se.sel(metric=m)) for m in spec.metrics}}
                   for k, p in plans.items() if p.replicates})
    manifest["adaptive"] = json_safe({"spec": spec.record(), "rounds": [rounds[k] for k in sorted(rounds)],
                                      "stopped": stopped})
    journal.write_manifest(manifest)


def _quantiles(se: xr.DataArray) -> dict[str, float | None]:
    if not bool(se.notnull().any()):
        return {"median": None, "max": None}
    return {"median": float(se.median()), "max": float(se.max())}


def _say(message: str) -> None:
    print(message, file=sys.stderr)


def collect_adaptive(cfg: CollectConfig, spec: AdaptiveSpec, *, say: Callable[[str], None] = _say,
                     stop_reason: Callable[[], str | None] | None = None) -> AdaptiveResult:
    """Collect a pilot (``cfg`` as given: round 0), then rounds of further replicates (module docstring).

    Parameters
    ----------
    cfg : CollectConfig
        The run; its ``replicates`` are the pilot's R. Rerunning with the same
        ``cfg`` and ``spec`` resumes it, in the right round.
    spec : AdaptiveSpec
        Target or budget, metrics, rounds.
    say : callable
        Progress lines (one per round).
    stop_reason : callable, optional
        As in :func:`collector.collect.collect`.

    Returns
    -------
    AdaptiveResult
        Per-round collector results and allocations; ``ok`` when every round
        collected completely. An incomplete round stops the run (a rerun resumes it).

    Raises
    ------
    ConfigError
        Coupled traces (an adaptive collection pads the rounds' replicate blocks,
        which only residual traces allow), or a round index in ``cfg``.
    ManifestMismatch
        A resume with other settings (each difference named).

    Examples
    --------
    >>> spec = AdaptiveSpec(("occurrence",), target_se={"occurrence": 0.05})
    >>> collect_adaptive(CollectConfig.flat(servers=["http://127.0.0.1:8080"], docs_file="docs.jsonl",
    ...                                     policies=["snapkv@0.5"], out="runs/x", seed=1), spec)  # doctest: +SKIP
    """
    from collector.pack import pack_run

    if cfg.kind != Kind.RESIDUAL:
        raise ConfigError("an adaptive collection (--target-se/--budget) needs --kind residual: its rounds give "
                          "pairs different replicate counts, and only residual traces may hold absent replicates")
    if cfg.round.index:
        raise ConfigError("collect_adaptive takes the pilot's config (round_index 0); it runs the later rounds")
    journal = Journal(cfg.out)
    if journal.manifest_path.exists():
        _check_spec(journal, spec)
    out = AdaptiveResult()
    say(f"round 0 (pilot): R={cfg.replicates} per pair; then {spec.describe()}")
    out.results[0] = collect(cfg, stop_reason)
    k = 1
    while out.results[k - 1].ok:
        existing = journal.for_round(k).read_allocation()
        if existing is not None:  # a resumed round keeps the allocation it was started with
            allocation = existing["replicates"]
            say(f"round {k}: resuming ({sum(map(sum, (row.values() for row in allocation.values())))} "
                "replicates allocated)")
        else:
            plan = next_round(pack_run(cfg.out, progress=False), spec, k)   # rounds 0..k-1, all complete
            out.plans[k] = plan
            if not plan.replicates:
                out.stopped = plan.reason
                say(f"after round {k - 1}: {plan.summary(spec.metrics, spec.target_se)}; stop: {plan.reason}")
                break
            allocation = plan.allocation()
            journal.for_round(k).write_allocation(allocation, {**spec.record(), "round": k,
                                                               "counted_before": int(plan.counted.sum())})
            _record(journal, spec, out.plans, "")
            say(f"after round {k - 1}: {plan.summary(spec.metrics, spec.target_se)}; round {k}: "
                f"{plan.replicates} replicates for {plan.pairs} pairs")
        out.results[k] = collect(cfg.for_round(k, allocation), stop_reason)
        k += 1
    last = out.results[max(out.results)]
    if not out.ok and last.refused and not last.retry_helps:   # designed refusals: a rerun cannot collect them
        out.stopped = (f"round {max(out.results)} is incomplete: the server refuses {', '.join(sorted(last.refused))} "
                       "on its model by design; collect without them (--policies)")
    elif not out.ok:
        out.stopped = f"round {max(out.results)} is incomplete; rerun the same command to resume it"
    _record(journal, spec, out.plans, out.stopped)
    return out
