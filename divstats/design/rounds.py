"""Round planning of an adaptive collection: the next round's replicates from the data so far.

After a pilot (round 0) each (document, policy) pair's per-replicate Monte Carlo
variance w of the target metrics is estimated from every replicate collected
(``divstats.estimation.components.document_values``), and each pair is asked the
further replicates it needs (``divstats.design.allocation.allocate``):

- ``target_se``: enough that w / R reaches the target SE on every metric, counting
  only the replicates of rounds >= 1 (the ``round`` coordinate; round 0 chose the
  allocation and is left out of every estimate, docs/design.md);
- ``budget``: B further replicates (or cost units, ``CostModel.from_traces`` on the
  data) spread by Neyman allocation, in one round after the pilot.

Every round gives every pair it asks at least ``min_replicates`` (round 1: every
pair), so the rounds after the pilot estimate every pair on their own.  The
application (``kvdiv.adaptive``) collects, packs and calls :func:`plan_round`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import xarray as xr

from divstats.design.allocation import CostModel, allocate
from divstats.errors import NotIdentified
from divstats.estimation.components import document_values
from divstats.traces.arrays import layout, present_replicates

__all__ = ["RoundPlan", "counted_replicates", "plan_round"]


@dataclass(frozen=True)
class RoundPlan:
    """What :func:`plan_round` decided after the data so far.

    Attributes
    ----------
    further : xarray.DataArray
        Replicates to ask of each (doc, policy) in the next round (0: none).
    counted : xarray.DataArray
        Replicates per pair that count toward the estimate so far (rounds >= 1).
    se : xarray.DataArray
        The Monte Carlo SE per (metric, doc, policy) from the variance of all the data
        so far, at ``counted`` replicates (before round 1: at the pilot's R).
    reason : str
        Why no further round, when ``further`` is all 0.
    short : int
        (pair, metric) SEs above the target when the last allowed round is done (0 otherwise).
    """

    further: xr.DataArray
    counted: xr.DataArray
    se: xr.DataArray
    reason: str = ""
    short: int = 0

    @property
    def pilot_only(self) -> bool:
        return not int(self.counted.sum())

    @property
    def replicates(self) -> int:
        return int(self.further.sum())

    @property
    def pairs(self) -> int:
        return int((self.further > 0).sum())

    def allocation(self) -> dict[str, dict[str, int]]:
        """doc -> policy -> replicates (the collector's ``allocation``)."""
        f = self.further.transpose("doc", "policy")
        return {str(d): {str(p): int(r) for p, r in zip(f["policy"].values, row, strict=True)}
                for d, row in zip(f["doc"].values, f.values, strict=True)}

    def summary(self, metrics: Sequence[str], target_se: Mapping[str, float] | None = None) -> str:
        """SE per metric (median and max over pairs) against the target."""
        parts = ["pilot (not counted in the estimate)"] if self.pilot_only else []
        for m in metrics:
            se = self.se.sel(metric=m)
            if not bool(se.notnull().any()):
                continue
            text = f"{m} SE median {float(se.median()):.3g}, max {float(se.max()):.3g}"
            if target_se is not None:
                text += f" (target {target_se[m]:g}, {int((se > target_se[m]).sum())} pairs above)"
            parts.append(text)
        return ", ".join(parts)


def counted_replicates(data: xr.Dataset) -> xr.DataArray:
    """Replicates per (doc, policy) that count toward the estimate: rounds >= 1 (0 before round 1).

    Parameters
    ----------
    data : xarray.Dataset
        Packed traces, with the ``round`` coordinate once a round after the pilot exists.

    Returns
    -------
    xarray.DataArray
        ``counted`` over (doc, policy[, model]).

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> pilot = simulate_study(2, {"a": PolicyEffect(0.1)}, horizon=4, replicates=3)
    >>> int(counted_replicates(pilot).sum())
    0
    """
    lay = layout(data)
    if "round" not in data.coords:
        return lay.wrap(np.zeros(lay.rows, dtype=int)).rename("counted")
    return lay.wrap(present_replicates(data, lay).sum(-1)).rename("counted")


def plan_round(data: xr.Dataset, metrics: Sequence[str], round_index: int, *,
               target_se: Mapping[str, float] | None = None, budget: float | None = None,
               budget_unit: str = "replicates", by: str = "cell", max_rounds: int = 1,
               min_replicates: int = 2) -> RoundPlan:
    """The next round's replicates per (document, policy), from everything collected so far.

    Parameters
    ----------
    data : xarray.Dataset
        The packed traces of rounds 0..round_index-1 (with the ``round`` coordinate
        once a later round exists).
    metrics : sequence of str
        Metrics of ``divstats.ESTIMANDS`` (``component``) the allocation targets.
    round_index : int
        The round to plan (>= 1).
    target_se : mapping of str to float, optional
        metric -> the Monte Carlo SE to reach on every per-document estimate.
    budget : float, optional
        Further replicates, or cost units with ``budget_unit="cost"``; spent in one round.
    budget_unit : {"replicates", "cost"}
    by : {"cell", "policy"}
        Allocate from each (document, policy)'s own variance, or the policy's mean.
    max_rounds : int
        Rounds after the pilot, at most (``target_se``).
    min_replicates : int
        Each pair a round asks gets at least this many (round 1 asks every pair).

    Returns
    -------
    RoundPlan
        ``further`` all 0 (with a ``reason``) when the collection should stop.

    Raises
    ------
    NotIdentified
        The traces give no Monte Carlo variance of a metric (post-divergence metrics need W >= T - 1).

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> pilot = simulate_study(3, {"a": PolicyEffect(0.1)}, horizon=5, replicates=4, kind="residual")
    >>> nxt = plan_round(pilot, ("loss",), 1, budget=40)
    >>> nxt.pairs, nxt.replicates >= 40
    (3, True)
    """
    everything = data.drop_vars("round", errors="ignore")   # the variance: from every replicate collected
    counted = counted_replicates(data)
    all_values = document_values(everything)
    vals = all_values.sel(metric=list(metrics))
    w = vals["mc_var"] * vals["replicates"]
    unknown = [m for m in metrics if not bool(w.sel(metric=m).notnull().any())]
    if unknown:
        raise NotIdentified(f"the traces give no Monte Carlo variance of {', '.join(unknown)} (post-divergence "
                            "metrics need W >= T - 1)")
    at = counted.where(counted > 0) if int(counted.sum()) else vals["replicates"]
    se = np.sqrt(w / at).rename("se")
    if round_index > (1 if budget is not None else max_rounds):
        if budget is not None:
            return RoundPlan(xr.zeros_like(counted), counted, se, "the budget is spent")
        short = sum(int((se.sel(metric=m) > x).sum()) for m, x in target_se.items())
        return RoundPlan(xr.zeros_like(counted), counted, se, f"the last of {max_rounds} rounds is done", short)
    cost = CostModel.from_traces(data) if budget is not None and budget_unit == "cost" else None
    further = allocate(everything, list(metrics), target_se=target_se, budget=budget, cost=cost,
                       by=by, counted=counted, min_replicates=min_replicates if round_index == 1 else 0,
                       values=all_values)
    further = further.transpose(*counted.dims)
    if round_index > 1:  # a pair asked again gets at least the minimum, so its round estimates it on its own
        further = xr.where(further > 0, np.maximum(further, min_replicates), 0)
    reason = "" if int(further.sum()) else "the target SE is met on every pair"
    return RoundPlan(further.astype(int), counted, se, reason)
