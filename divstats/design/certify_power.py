"""How many documents certifying a budget needs, from a pilot (``kvdiv power`` for ``[[certify]]``).

For a plan's certification (a policy family, an estimand, a margin; docs/plans.md,
"How much can I compress?"), a study of N documents is simulated by drawing N of the
pilot's documents with replacement — whole rows over the family's budgets, so the
correlation between a document's budgets and the skew of its differences are the
pilot's — and running the certification itself (``divstats.certify_budget``: the
fixed sequence, its bootstrap-t tests and its refusal below 50 documents).  The
power to certify budget j is the share of simulated studies that certify j or a
budget keeping less KV; the documents needed are the fewest on a grid reaching the
target power.  The pilot's mean differences are taken as the truth (a pilot of a few
documents makes this rough: a budget whose pilot difference sits near the margin can
need any number), and each document's Monte Carlo noise stays at the pilot's
replicates.  For a certification on the confirmatory split the documents are the
study's, the split's share of them being tested.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from divstats.errors import DivstatsError, PlanError
from divstats.estimands import OCCURRENCE, value_range
from divstats.estimation.answers import with_answer_values
from divstats.estimation.bounded import difference_range
from divstats.estimation.estimators import estimate
from divstats.estimation.sweeps import family_values
from divstats.inference.certify import certify_budget
from divstats.plans.format import FULL, Certification, Plan, load_plan
from divstats.plans.run import full_model_value

__all__ = ["CERTIFY_POWER_COLUMNS", "DOC_GRID", "certify_power"]

#: Documents tried (the fewest reaching the target power is reported; the tests need 50).
DOC_GRID: tuple[int, ...] = (50, 75, 100, 150, 200, 300, 400, 600, 800, 1000)
CERTIFY_POWER_COLUMNS: tuple[str, ...] = (
    "id", "model", "budget", "kept", "pilot_difference", "margin", "docs", "power", "docs_needed", "note",
)


def _differences_and_range(est: xr.Dataset, c: Certification, model: str | None) -> tuple[
        np.ndarray, tuple[str, ...], np.ndarray, tuple[float, float] | None]:
    """(pilot documents x budgets) differences from the reference, the members, their KV kept and the
    range of a difference (None: the metric's range is unknown), so that a certification below 50
    documents is the betting test, as in the analysis."""
    values, members, kept, docs = family_values(est, c.family, c.metric, model=model)
    one = est.sel(model=model) if model is not None else est
    if c.reference == FULL and FULL in [str(p) for p in one["policy"].values]:
        ref: Any = np.asarray(one[c.metric].sel(policy=FULL, doc=docs).values, dtype=float)[:, None]
    elif c.reference == FULL:
        ref = full_model_value(c.metric, est.attrs.get("horizon"))
    else:
        ref = float(c.reference)
    d = values - ref
    rng = value_range(c.metric, est.attrs.get("horizon"))
    d_range = difference_range(rng, ref if np.ndim(ref) == 0 else None) if rng is not None else None
    return d[np.all(np.isfinite(d), axis=1)], members, kept, d_range


def certify_power(plan: Plan | str | Mapping[str, Any], pilot: xr.Dataset, *, docs: Sequence[int] | None = None,
                  target: float = 0.8, n_sims: int = 200, n_resamples: int = 199, seed: int = 0,
                  window: int | None = None) -> pd.DataFrame:
    """Power to certify each budget of each ``[[certify]]``, and the documents it needs.

    Parameters
    ----------
    plan : Plan, path, TOML text or dict
        A plan with ``[[certify]]`` entries.
    pilot : xarray.Dataset
        Pilot traces, or ``divstats.estimate`` output.
    docs : sequence of int, optional
        Study sizes to report (default :data:`DOC_GRID`).
    target : float
        Power for ``docs_needed``.
    n_sims, n_resamples, seed : int
        Simulated studies per size, bootstrap resamples per test, seed.
    window : int, optional
        As ``divstats.estimate``.

    Returns
    -------
    pandas.DataFrame
        :data:`CERTIFY_POWER_COLUMNS`: one row per (certification, model, budget, docs);
        ``docs_needed`` is the fewest study documents (of ``docs``) with power >= ``target``
        (NaN: none), the same on every row of the budget.

    Raises
    ------
    PlanError
        When a certification's family, metric or model is not in the pilot, or the pilot
        has fewer than two complete documents over the family.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(8, {"snapkv@0.9": PolicyEffect(0.01), "snapkv@0.5": PolicyEffect(0.1),
    ...                         "snapkv@0.3": PolicyEffect(0.2)}, horizon=6, replicates=4)
    >>> plan = {"plan": {"name": "p", "salt": "s"}, "certify": [{"id": "C", "family": "snapkv",
    ...         "metric": "occurrence", "margin": 0.05, "split": "all"}]}
    >>> res = certify_power(plan, ds, docs=[50], n_sims=10, n_resamples=49)
    >>> res[["budget", "docs"]].values.tolist()
    [['snapkv@0.9', 50], ['snapkv@0.5', 50], ['snapkv@0.3', 50]]
    """
    plan = load_plan(plan)
    if not plan.certifications:
        return pd.DataFrame(columns=list(CERTIFY_POWER_COLUMNS))
    # the answer estimands (accuracy_change: certify at an accuracy margin) beside the trace estimands
    est = pilot if OCCURRENCE in pilot.data_vars else with_answer_values(estimate(pilot, window=window), pilot)
    sizes = sorted(set(docs or DOC_GRID))
    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(seed)
    for c in plan.certifications:
        fraction = plan.confirmatory_fraction if c.split == "confirmatory" else (1.0 if c.split == "all" else
                                                                                 1 - plan.confirmatory_fraction)
        models = [str(m) for m in est["model"].values] if "model" in est.dims else [None]
        if c.model is not None:
            models = [m for m in models if m == c.model] or [None]
        for model in models:
            try:
                d, members, kept, d_range = _differences_and_range(est, c, model)
            except DivstatsError as exc:
                raise PlanError(f"certify {c.id!r}: {exc}") from None
            if d.shape[0] < 2:
                raise PlanError(f"certify {c.id!r}: the pilot has {d.shape[0]} complete documents for the family")
            power = np.zeros((len(sizes), len(members)))
            for i, n in enumerate(sizes):
                tested = max(1, int(math.floor(n * fraction)))
                hits = np.zeros(len(members))
                for s in range(n_sims):
                    sample = d[rng.integers(0, d.shape[0], tested)]
                    idx = certify_budget(sample, c.margin, alpha=c.alpha, worse=c.worse, test=c.test,
                                         n_resamples=n_resamples, seed=s, bounds=d_range).certified_index
                    hits[: idx + 1] += 1
                power[i] = hits / n_sims
            for j, budget in enumerate(members):
                reached = [n for n, p in zip(sizes, power[:, j], strict=True) if p >= target]
                needed = float(reached[0]) if reached else math.nan
                diff = float(d[:, j].mean())
                signed = c.margin if c.worse == "larger" else -c.margin
                past = diff >= signed if c.worse == "larger" else diff <= signed
                note = ("the pilot's mean difference is past the margin: not certifiable at any size"
                        if past else "")
                for i, n in enumerate(sizes):
                    rows.append({"id": c.id, "model": model, "budget": budget, "kept": float(kept[j]),
                                 "pilot_difference": diff, "margin": signed, "docs": n, "power": power[i, j],
                                 "docs_needed": needed, "note": note})
    return pd.DataFrame(rows, columns=list(CERTIFY_POWER_COLUMNS))
