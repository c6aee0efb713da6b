"""The cheapest study (documents x replicates) that gives a plan the power it needs.

A study of N documents, P policies and R replicates per (document, policy) costs

    N * P * (per_request + per_prompt_token * prompt_tokens + R * steps_per_replicate * per_step)

— one prefill of the prompt per request, then R replicates of ``steps_per_replicate``
decoding steps each (T for coupled traces, T + K for residual traces: the
survival path plus the branch).  :meth:`CostModel.from_traces` takes the
constants from a pilot: the decoding steps from its traces, and seconds per
prompt token and per step fitted (non-negative least squares) to the wall time
per request the collector records (``elapsed_s``).  Without recorded times the
unit is one decoding step and a prefill counts ``prefill_steps`` steps.

:func:`design` finds, for each candidate R, the fewest documents with which each
hypothesis reaches the target power (``divstats.power``), and returns the
cheapest (N, R) for which every reachable hypothesis does.  More replicates buy
less Monte Carlo noise but never remove the between-document spread, so beyond
R ~ sqrt(cost of a document / cost of a replicate x per-replicate variance /
between variance) documents are the cheaper currency.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr
from scipy.optimize import nnls

from divstats.design.pilot import HypothesisPilot, hypothesis_pilots
from divstats.design.power import power_at, power_range
from divstats.estimands import LOSS
from divstats.estimation.components import document_values
from divstats.traces.replicates import replicate_values

__all__ = ["REPLICATE_GRID", "CostModel", "DesignResult", "allocate", "design"]

#: Replicates per document tried by :func:`design`.
REPLICATE_GRID: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class CostModel:
    """What a study costs, in ``unit`` (seconds when fitted to recorded times)."""

    per_step: float = 1.0
    per_prompt_token: float = 0.0
    per_request: float = 2.0
    prompt_tokens: float = 0.0
    steps_per_replicate: float = 1.0
    policies: int = 1
    unit: str = "decoding steps"
    source: str = "assumed"

    def request(self, replicates: float) -> float:
        """Cost of one (document, policy) request with ``replicates`` replicates."""
        return (self.per_request + self.per_prompt_token * self.prompt_tokens
                + replicates * self.steps_per_replicate * self.per_step)

    def cost(self, docs: float, replicates: float) -> float:
        """Cost of a study with ``docs`` documents and ``replicates`` per (document, policy)."""
        return docs * self.policies * self.request(replicates)

    @classmethod
    def from_traces(cls, ds: xr.Dataset, prefill_steps: float = 2.0) -> CostModel:
        """Constants from a pilot's traces (see the module docstring).

        Parameters
        ----------
        ds : xarray.Dataset
            Pilot traces.
        prefill_steps : float
            Cost of one request's prefill in decoding steps, used when the traces
            carry no recorded wall times (two prefills, full and evicted cache,
            counted as one step each by default).

        Returns
        -------
        CostModel
        """
        rep = replicate_values(ds)
        steps = rep.values["cost"]                                      # (rows, replicate)
        per_rep = float(np.nanmean(steps))
        policies = int(ds.sizes.get("policy", 1))
        prompt = float(ds["prompt_tokens"].mean()) if "prompt_tokens" in ds.coords else 0.0
        elapsed = ds.coords.get("elapsed_s")
        if elapsed is None or not np.isfinite(elapsed.values).all() or float(elapsed.min()) <= 0:
            return cls(per_step=1.0, per_prompt_token=0.0, per_request=float(prefill_steps), prompt_tokens=prompt,
                       steps_per_replicate=per_rep, policies=policies, unit="decoding steps",
                       source=f"decoding steps counted in the traces; a prefill counted as {prefill_steps:g} steps")
        rows = dict(zip(rep.layout.dims, rep.layout.shape, strict=True))

        def per_row(coord: xr.DataArray) -> np.ndarray:
            return coord.variable.set_dims(rows).transpose(*rows).values.reshape(-1).astype(float)

        secs = per_row(elapsed)
        tokens = per_row(ds["prompt_tokens"]) if "prompt_tokens" in ds.coords else np.zeros_like(secs)
        total_steps = np.nansum(steps, axis=-1)
        coef, _ = nnls(np.column_stack([np.ones_like(secs), tokens, total_steps]), secs)
        if coef[2] <= 0:  # steps not identified: time proportional to steps
            coef = np.array([0.0, 0.0, secs.sum() / total_steps.sum()])
        return cls(per_step=float(coef[2]), per_prompt_token=float(coef[1]), per_request=float(coef[0]),
                   prompt_tokens=prompt, steps_per_replicate=per_rep, policies=policies, unit="s",
                   source="fitted to the recorded seconds per request (elapsed_s ~ request + prompt tokens + steps)")


@dataclass(frozen=True)
class DesignResult:
    """Outcome of :func:`design`.

    ``table`` has one row per (hypothesis, replicates): the fewest documents reaching
    the power (NaN when not reachable within ``max_docs``) and the study's cost.
    ``docs``/``replicates``/``cost`` are the cheapest design reaching the power on
    every reachable hypothesis; ``unreachable`` lists the others.
    """

    table: pd.DataFrame
    docs: int | None
    replicates: int | None
    cost: float
    target: float
    use: str
    cost_model: CostModel
    unreachable: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if self.docs is None:
            return f"no design within the search reaches power {self.target:g} ({self.use}) on any hypothesis"
        text = (f"cheapest design reaching power {self.target:g} ({self.use}) on every reachable hypothesis: "
                f"{self.docs} documents x {self.replicates} replicates, cost {self.cost:.4g} {self.cost_model.unit}")
        if self.unreachable:
            text += f"; not reachable: {', '.join(self.unreachable)}"
        return text


def _power_value(hp: HypothesisPilot, n: int, R: int, use: str, n_sims: int, seed: int) -> float:
    if use == "point":
        return power_at(hp, n, R, n_sims=n_sims, seed=seed)
    return power_range(hp, n, R, n_sims=n_sims, seed=seed)[0]


def _fewest_docs(hp: HypothesisPilot, R: int, target: float, use: str, max_docs: int, n_sims: int,
                 seed: int) -> int | None:
    """Smallest study size N (documents) whose hypothesis share reaches ``target``; None if > max_docs."""
    ok = lambda N: _power_value(hp, hp.docs_used(N), R, use, n_sims, seed) >= target  # noqa: E731
    lo = max(2, math.ceil(2 / hp.fraction))
    if hp.n_pilot < 2 or not ok(max_docs):
        return None
    hi = lo
    while not ok(hi):          # doubling, then bisection
        lo, hi = hi, min(2 * hi, max_docs)
    if hi == lo:
        return hi
    while hi - lo > max(1, lo // 50):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def design(plan: Any, pilot: xr.Dataset, power: float = 0.8, cost: CostModel | None = None, *,
           replicates: Sequence[int] = REPLICATE_GRID, use: str = "point", hypotheses: Sequence[str] | None = None,
           max_docs: int = 20_000, aliases: Mapping[str, str] | None = None, window: int | None = None,
           n_sims: int = 1000, seed: int = 0) -> DesignResult:
    """The cheapest (documents, replicates) giving every hypothesis of ``plan`` the target power.

    Parameters
    ----------
    plan : Plan, path, shipped plan name, TOML text or dict
        The plan.
    pilot : xarray.Dataset
        Pilot traces (the source of effects and variance components).
    power : float
        Target power of each hypothesis (at its Bonferroni level within Holm families).
    cost : CostModel, optional
        Default: :meth:`CostModel.from_traces` on the pilot.
    replicates : sequence of int
        Replicates per document to consider.
    use : {"point", "low"}
        Reach the target at the pilot's effect, or at the low end of the power range
        (the conservative choice for a small pilot).
    hypotheses : sequence of str, optional
        Ids to plan for (default: all).
    max_docs : int
        Largest study considered.
    aliases, window : optional
        As in :func:`divstats.design.power.power`.
    n_sims, seed : int
        Simulated studies per power evaluation and their seed.

    Returns
    -------
    DesignResult

    Raises
    ------
    ValueError
        ``use`` is neither "point" nor "low".

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> pilot = simulate_study(8, {"a": PolicyEffect(0.05), "b": PolicyEffect(0.15)}, horizon=6, replicates=4)
    >>> plan = {"plan": {"name": "p", "salt": "s"}, "hypothesis": [{"id": "h", "family": "f",
    ...         "metric": "occurrence", "compare": ["a", "b"], "split": "all"}]}
    >>> design(plan, pilot, replicates=(1, 4), n_sims=200).docs is not None
    True
    """
    if use not in ("point", "low"):
        raise ValueError(f"use must be 'point' or 'low', got {use!r}")
    cost = cost or CostModel.from_traces(pilot)
    pilots = [hp for hp in hypothesis_pilots(plan, pilot, aliases=aliases, window=window)
              if hypotheses is None or hp.hypothesis.id in hypotheses or hp.label in hypotheses]
    rows = []
    for hp in pilots:
        for R in replicates:
            N = _fewest_docs(hp, int(R), power, use, max_docs, n_sims, seed)
            rows.append({"id": hp.label, "metric": hp.hypothesis.metric, "a": hp.a, "b": hp.b,
                         "replicates": int(R), "docs": np.nan if N is None else N,
                         "cost": np.nan if N is None else cost.cost(N, R), "note": hp.note})
    table = pd.DataFrame(rows, columns=["id", "metric", "a", "b", "replicates", "docs", "cost", "note"])
    reachable = table.groupby("id")["docs"].apply(lambda s: s.notna().any())
    unreachable = [i for i, ok in reachable.items() if not ok]
    best: tuple[float, int | None, int | None] = (math.inf, None, None)
    for R, group in table[table["id"].isin([i for i, ok in reachable.items() if ok])].groupby("replicates"):
        if group["docs"].isna().any() or group.empty:
            continue
        N = int(group["docs"].max())
        best = min(best, (cost.cost(N, R), N, int(R)), key=lambda b: b[0])
    return DesignResult(table, best[1], best[2], best[0], power, use, cost, unreachable)


# ---------------------------------------------------------------------------
# Allocation of further replicates after a pilot round
# ---------------------------------------------------------------------------

def _per_replicate(pilot: xr.Dataset, metrics: Sequence[str],
                   values: xr.Dataset | None = None) -> tuple[xr.DataArray, xr.DataArray]:
    """(w, R0): per-replicate variance over (metric, doc, policy[, model]) in each metric's units, and R0."""
    vals = (document_values(pilot) if values is None else values).sel(metric=list(metrics))
    return (vals["mc_var"] * vals["replicates"]).fillna(0.0), vals["replicates"].isel(metric=0, drop=True)


def _targets(target_se: float | Mapping[str, float], metrics: Sequence[str]) -> xr.DataArray:
    """Target SE per metric; a mapping must name exactly the metrics."""
    if not isinstance(target_se, Mapping):
        target_se = dict.fromkeys(metrics, target_se)
    if set(target_se) != set(metrics):
        raise ValueError(f"target_se names {sorted(target_se)}, the metrics are {sorted(metrics)}")
    bad = {m: x for m, x in target_se.items() if not float(x) > 0}
    if bad:
        raise ValueError(f"target_se must be > 0, got {bad}")
    return xr.DataArray([float(target_se[m]) for m in metrics], dims="metric", coords={"metric": list(metrics)})


def allocate(pilot: xr.Dataset, metrics: str | Sequence[str] = LOSS, *,
             target_se: float | Mapping[str, float] | None = None, budget: float | None = None,
             cost: CostModel | None = None, by: str = "cell", min_replicates: int = 2, floor: float = 0.1,
             counted: xr.DataArray | None = None, values: xr.Dataset | None = None) -> xr.DataArray:
    """Further replicates per (document, policy) after a pilot round.

    Parameters
    ----------
    pilot : xarray.Dataset
        The traces collected so far (the source of each cell's per-replicate variance).
    metrics : str or sequence of str
        Metrics whose Monte Carlo variance the allocation targets.
    target_se : float or mapping of str to float, optional
        Reach this Monte Carlo SE of every per-document estimate of every metric (a
        mapping gives each metric its own target, in its own units): R = max over
        metrics of w / target_se^2 in total.
    budget : float, optional
        Spend this many further replicates (or cost units, with ``cost``) so as to
        minimise the summed Monte Carlo variance of the metrics, each standardised by
        its mean per-replicate variance: R proportional to sqrt(w / c) (Neyman
        allocation), water-filled above what is already counted.
    cost : CostModel, optional
        Cost per replicate (``steps_per_replicate * per_step``); default 1 per replicate.
    by : {"cell", "policy"}
        ``cell`` uses each (document, policy)'s own variance; ``policy`` the policy's
        mean over documents, so a cell's allocation hardly depends on its own values
        (see the bias note in docs/design.md).
    min_replicates : int
        Every cell gets at least this many further replicates, so that the rounds
        after the pilot estimate every cell on their own.
    floor : float
        A cell's variance is at least ``floor`` times the median (a pilot of few
        replicates can show zero variance by chance).
    counted : xarray.DataArray, optional
        Replicates per cell that already count toward the estimate, and are
        subtracted from the total it needs. Default: the pilot's own, i.e. the pilot
        pooled with what is allocated. An adaptive collection estimates from the
        rounds after the pilot only, and passes their count (0 after the pilot).
    values : xarray.Dataset, optional
        ``divstats.estimation.components.document_values(pilot)`` when the caller
        has it already (``plan_round`` does), so it is not computed twice.

    Returns
    -------
    xarray.DataArray
        Further replicates (int) over (doc, policy[, model]).

    Raises
    ------
    ValueError
        Neither or both of ``target_se`` and ``budget``; a target that is not > 0 or
        names other metrics; an unknown ``by``.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> pilot = simulate_study(3, {"a": PolicyEffect(0.1)}, horizon=5, replicates=4, kind="residual")
    >>> more = allocate(pilot, "loss", budget=30)
    >>> more.dims, int(more.min()) >= 2
    (('doc', 'policy'), True)
    >>> int(allocate(pilot, ["loss", "occurrence"], target_se={"loss": 0.5, "occurrence": 0.1}).min()) >= 2
    True
    """
    if (target_se is None) == (budget is None):
        raise ValueError("give exactly one of target_se and budget")
    if by not in ("cell", "policy"):
        raise ValueError(f"by must be 'cell' or 'policy', got {by!r}")
    metrics = [metrics] if isinstance(metrics, str) else list(metrics)
    w, r0 = _per_replicate(pilot, metrics, values)
    r0 = r0 if counted is None else counted.broadcast_like(r0).fillna(0).astype(float)
    if by == "policy":
        w = w.mean("doc").broadcast_like(w)
    w = np.maximum(w, floor * w.median([d for d in w.dims if d != "metric"]))
    if target_se is not None:  # in each metric's own units
        total = np.ceil((w / _targets(target_se, metrics) ** 2).max("metric"))
    else:  # metrics on different scales count alike: each in units of its mean per-replicate variance
        w = (w / w.mean([d for d in w.dims if d != "metric"])).fillna(0.0).sum("metric")
        c = cost.steps_per_replicate * cost.per_step if cost is not None else 1.0
        total = _neyman(w, r0, float(budget) / c + float(r0.sum()))
    return np.maximum(total - r0, min_replicates).astype(int).rename("replicates")


def _nansum(a: np.ndarray) -> float:
    """xarray's skipna sum (NaN read as 0, then one numpy sum): the same float, without its per-call cost."""
    return float(np.where(np.isnan(a), 0.0, a).sum())


def _neyman(w: xr.DataArray, r0: xr.DataArray, total: float) -> xr.DataArray:
    """R proportional to sqrt(w) with sum R = total, never below r0 (water-filling).

    On the arrays rather than DataArrays: an adaptive simulation calls this once per
    repetition, and xarray's overhead per operation was most of its time.
    """
    wv = w.values
    rv = r0.transpose(*w.dims).values.astype(float)
    fixed = np.zeros(wv.shape, dtype=bool)
    for _ in range(wv.size):
        free = ~fixed
        share = np.where(free, np.sqrt(wv), np.nan)
        left = total - _nansum(np.where(fixed, rv, np.nan))
        alloc = np.where(free, share / _nansum(share) * left, rv)
        under = free & (alloc < rv)
        if not under.any():
            return _largest_remainder(w.copy(data=alloc), total)
        fixed = fixed | under
    return r0.astype(float)


def _largest_remainder(alloc: xr.DataArray, total: float) -> xr.DataArray:
    """Whole replicates summing to floor(total): floors, then one more for the largest remainders."""
    whole = np.floor(alloc)
    short = int(math.floor(total) - float(whole.sum()))
    if short > 0:
        frac = (alloc - whole).values.ravel()
        bump = np.zeros(frac.size)
        bump[np.argsort(-frac, kind="stable")[:short]] = 1.0
        whole = whole + bump.reshape(whole.shape)
    return whole
