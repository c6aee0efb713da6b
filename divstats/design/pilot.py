"""What a pilot says about each hypothesis of a plan: per-document differences and their noise.

A power calculation (:mod:`divstats.design.power`), a design (:mod:`divstats.design.allocation`)
and the power calibration all start from the same reading of a pilot: for each hypothesis of a
plan (docs/plans.md), the pilot documents' differences ``d_i = A - B`` of its metric, their
per-replicate Monte Carlo variances ``w_i`` (``divstats.variance_components``) and the replicates
``r_i`` behind them, with the level the test runs at and the share of a study's documents it
uses.  :func:`hypothesis_pilots` makes one :class:`HypothesisPilot` per hypothesis (and per model);
a hypothesis the pilot cannot serve gets one with no documents and a note saying why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from divstats.errors import PlanError
from divstats.estimation.components import document_values, paired_document_values
from divstats.estimation.curves import branch_tv_window
from divstats.estimation.speculative import SPECULATIVE_METRICS, speculative
from divstats.plans.format import FULL, WINDOW_METRICS, Hypothesis, Plan, load_plan
from divstats.plans.run import full_model_value
from divstats.traces.arrays import layout, present_replicates

__all__ = ["HypothesisPilot", "counted_replicates", "hypothesis_pilots"]


@dataclass(frozen=True)
class HypothesisPilot:
    """What the pilot says about one hypothesis: per-document differences and MC variances.

    ``d`` are the pilot's per-document differences A - B, ``w`` their per-replicate
    Monte Carlo variances (R_i times the squared SE) and ``r`` the pilot's replicates
    per document.  ``alpha`` is the level the test is run at (after Bonferroni for
    Holm families) and ``fraction`` the share of a study's documents the hypothesis
    uses (its split).
    """

    hypothesis: Hypothesis
    label: str
    a: str
    b: str
    d: np.ndarray
    w: np.ndarray
    r: np.ndarray
    alpha: float
    fraction: float
    note: str = ""

    @property
    def n_pilot(self) -> int:
        return int(self.d.size)

    @property
    def effect(self) -> float:
        return float(np.mean(self.d)) if self.d.size else math.nan

    @property
    def between(self) -> float:
        """sigma_B^2: variance of the differences minus their Monte Carlo part (>= 0)."""
        return _between(self.d, self.w, self.r)

    @property
    def replicate_var(self) -> float:
        return float(np.mean(self.w)) if self.w.size else math.nan

    def docs_used(self, docs: int) -> int:
        """Documents of a study with ``docs`` documents that this hypothesis tests on."""
        return int(round(docs * self.fraction))


def _between(d: np.ndarray, w: np.ndarray, r: np.ndarray) -> float:
    if d.size < 2:
        return math.nan
    return max(float(np.var(d, ddof=1) - np.mean(w / r)), 0.0)


# ---------------------------------------------------------------------------
# The pilot, per hypothesis
# ---------------------------------------------------------------------------

def _window_values(pilot: xr.Dataset, window: tuple[int, int], W: int | None) -> xr.Dataset:
    """Per-document branch_tv window mean and its squared SE (ages first..last, inclusive)."""
    T = int(pilot.attrs["horizon"])
    first, last = window
    observed = min(T - 1, W if W is not None else int(pilot.attrs.get("window", T)))
    stop = min(last, observed) + 1
    if first >= stop:
        raise PlanError(f"window [{first}, {last}] lies beyond the observed ages (<= {observed})")
    res = branch_tv_window(pilot, first, stop, window=W)
    return xr.Dataset({"value": res["branch_tv_window"], "mc_var": res["branch_tv_window_se"] ** 2,
                       "replicates": counted_replicates(pilot).broadcast_like(res["branch_tv_window"])})


def _speculative_values(pilot: xr.Dataset, metric: str, gamma: int) -> xr.Dataset:
    """Per-document speculative-decoding metric at one γ and its squared SE (docs/statistics.md §10)."""
    if pilot.attrs.get("kind") != "reference":
        raise PlanError(f"metric {metric!r} needs reference traces (log p and log q of P's tokens); the pilot's "
                        f"are {pilot.attrs.get('kind')!r}")
    res = speculative(pilot, gamma=gamma).squeeze("gamma", drop=True)
    return xr.Dataset({"value": res[metric], "mc_var": res[metric + "_se"] ** 2,
                       "replicates": counted_replicates(pilot).broadcast_like(res[metric])})


def counted_replicates(pilot: xr.Dataset) -> xr.DataArray:
    """Replicates that count in each cell's estimates (over the pilot's lead dims).

    Not the ``replicate`` dimension's size: padding (absent replicates) and an adaptive
    collection's pilot round do not count (:func:`divstats.traces.arrays.present_replicates`),
    and R converts a squared standard error into the per-replicate variance.

    Parameters
    ----------
    pilot : xarray.Dataset
        A trace dataset.

    Returns
    -------
    xarray.DataArray
        Integer counts over the lead dims (``doc``, ``policy``, ...).

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(2, {"a": PolicyEffect(0.1)}, horizon=4, replicates=3)
    >>> counted_replicates(ds).values.tolist()
    [[3], [3]]
    """
    lay = layout(pilot)
    return lay.wrap(present_replicates(pilot, lay).sum(axis=-1))


def _family_sizes(plan: Plan, n_models: int) -> dict[str, int]:
    return {fam: len(members) * n_models for fam, members in plan.families().items()}


def _fraction(plan: Plan, h: Hypothesis) -> float:
    return {"confirmatory": plan.confirmatory_fraction, "exploratory": 1 - plan.confirmatory_fraction,
            "all": 1.0}[h.split]


def _pair_arrays(vals: xr.Dataset, model: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    sel = vals.sel(model=model) if model is not None else vals
    d, v, r = (np.asarray(sel[k].values, dtype=float).ravel() for k in ("value", "mc_var", "replicates"))
    ok = np.isfinite(d) & np.isfinite(v) & np.isfinite(r)
    return d[ok], np.maximum(v[ok], 0.0) * r[ok], r[ok]


def _hypothesis_values(h: Hypothesis, plan: Plan, pilot: xr.Dataset, vals: xr.Dataset | None,
                       resolve, window: int | None) -> tuple[xr.Dataset, str, str, str]:
    """(per-document difference dataset, a, b, note) for one hypothesis."""
    if h.compares_windows:
        pol = resolve(h.policy)
        late, early = (_window_values(pilot, plan.windows[w], window).sel(policy=pol, drop=True)
                       for w in h.compare)
        diff = xr.Dataset({"value": late["value"] - early["value"],
                           "mc_var": late["mc_var"] + early["mc_var"], "replicates": late["replicates"]})
        note = "Monte Carlo covariance between the two windows of one branch taken as 0"
        return diff, f"{pol}:{h.compare[0]}", f"{pol}:{h.compare[1]}", note
    a, b = resolve(h.compare[0]), resolve(h.compare[1])
    if h.metric in WINDOW_METRICS:
        win = _window_values(pilot, plan.windows[h.window], window)
        pa, pb = win.sel(policy=a, drop=True), win.sel(policy=b, drop=True)
        diff = xr.Dataset({"value": pa["value"] - pb["value"], "mc_var": pa["mc_var"] + pb["mc_var"],
                           "replicates": (pa["replicates"] + pb["replicates"]) / 2})
        return diff, a, b, "Monte Carlo covariance between policies taken as 0"
    if h.metric in SPECULATIVE_METRICS:
        if b == FULL:
            raise PlanError(f"hypothesis {h.id!r}: {h.metric} has no known value for the full model")
        spec = _speculative_values(pilot, h.metric, int(h.gamma))
        pa, pb = spec.sel(policy=a, drop=True), spec.sel(policy=b, drop=True)
        diff = xr.Dataset({"value": pa["value"] - pb["value"], "mc_var": pa["mc_var"] + pb["mc_var"],
                           "replicates": (pa["replicates"] + pb["replicates"]) / 2})
        # the policies score the same P-samples (reference traces), so this covariance is
        # positive and the sum overstates the difference's Monte Carlo variance: conservative
        return diff, a, b, "Monte Carlo covariance between policies taken as 0 (conservative: shared P-samples)"
    if vals is None or h.metric not in vals["metric"].values:
        raise PlanError(f"hypothesis {h.id!r}: metric {h.metric!r} has no variance components")
    if b == FULL and FULL not in [str(p) for p in pilot["policy"].values]:
        # B is the full model's known value: no variance of its own
        va = vals.sel(policy=a, metric=h.metric, drop=True)
        full = full_model_value(h.metric, pilot.attrs.get("horizon"))
        diff = xr.Dataset({"value": va["value"] - full, "mc_var": va["mc_var"], "replicates": va["replicates"]})
        return diff, a, b, f"B = the full model's known {h.metric} ({full:g})"
    return paired_document_values(vals, a, b).sel(metric=h.metric, drop=True), a, b, ""


def hypothesis_pilots(plan: Plan | str | Mapping[str, Any], pilot: xr.Dataset, *,
                      aliases: Mapping[str, str] | None = None,
                      window: int | None = None) -> list[HypothesisPilot]:
    """Per-document differences and Monte Carlo variances for every hypothesis of a plan.

    Parameters
    ----------
    plan : Plan, path, TOML text or dict
        The plan (``divstats.load_plan``).
    pilot : xarray.Dataset
        Pilot traces (any kind), or ``divstats.estimate`` output (windowed metrics
        then cannot be served).
    aliases : mapping, optional
        Planned policy id -> policy id in the pilot.
    window : int, optional
        Window truncation as in ``divstats.estimate``.

    Returns
    -------
    list of HypothesisPilot
        One per hypothesis (and per model when the pilot has several); all pilot
        documents are used, whatever their split (the pilot stands for the population
        of documents; the study's documents are new).

    Raises
    ------
    PlanError
        A policy the plan names is not in the pilot.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> pilot = simulate_study(6, {"a": PolicyEffect(0.05), "b": PolicyEffect(0.2)}, horizon=6, replicates=4)
    >>> plan = {"plan": {"name": "p", "salt": "s"}, "hypothesis": [{"id": "h", "family": "f",
    ...         "metric": "occurrence", "compare": ["a", "b"], "split": "all"}]}
    >>> [(hp.label, hp.n_pilot) for hp in hypothesis_pilots(plan, pilot)]
    [('h', 6)]
    """
    plan = plan if isinstance(plan, Plan) else load_plan(plan)
    mapping = {**plan.aliases, **dict(aliases or {})}
    policies = [str(p) for p in pilot["policy"].values]
    is_traces = not any(str(v).endswith("_se") for v in pilot.data_vars)

    def resolve(pid: str) -> str:
        out = mapping.get(pid, pid)
        if out == FULL and FULL not in policies:
            return out              # the full model's known value (no measured control in the pilot)
        if out not in policies:
            raise PlanError(f"policy {out!r} (planned {pid!r}) is not in the pilot; available: {policies}")
        return out

    vals = document_values(pilot, window) if any(h.metric not in WINDOW_METRICS + tuple(SPECULATIVE_METRICS)
                                                  for h in plan.hypotheses) else None
    models = [m for m in pilot["model"].values] if "model" in pilot.dims else [None]
    sizes = _family_sizes(plan, len(models))
    out: list[HypothesisPilot] = []
    for h in plan.hypotheses:
        alpha = h.alpha / sizes[h.family] if h.correction == "holm" else h.alpha
        note = ""
        try:
            if (h.metric in WINDOW_METRICS or h.metric in SPECULATIVE_METRICS) and not is_traces:
                raise PlanError(f"hypothesis {h.id!r}: {h.metric} needs traces, not estimates")
            diff, a, b, note = _hypothesis_values(h, plan, pilot, vals, resolve, window)
        except PlanError as exc:
            if "not in the pilot" in str(exc):
                raise
            diff, note = None, str(exc)
            a, b = ((f"{h.policy}:{h.compare[0]}", f"{h.policy}:{h.compare[1]}") if h.compares_windows
                    else h.compare)
        for m in models:
            if h.model is not None and m is not None and str(m) != h.model:
                continue
            label = f"{h.id}[{m}]" if m is not None and len(models) > 1 else h.id
            d, w, r = _pair_arrays(diff, m) if diff is not None else (np.array([]),) * 3
            row_note = note if d.size >= 2 else (note or f"{h.metric}: fewer than 2 pilot documents with a value")
            out.append(HypothesisPilot(h, label, a, b, d, w, r, alpha, _fraction(plan, h), row_note))
    return out
