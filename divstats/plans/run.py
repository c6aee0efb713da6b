"""Running a prespecified plan on traces: per-document metrics, paired tests, Holm.

:func:`run_plan` evaluates a :class:`~divstats.plans.format.Plan` on a trace dataset and
returns one row per hypothesis (and per model when the data hold several), with
Holm-adjusted p-values within each family. The plan format and its validation
are :mod:`divstats.plans.format`; ``docs/plans.md`` documents both.

Labelling rule: a row is *confirmatory* only if its hypothesis is planned on the
confirmatory split and was run exactly as written. Rows on other splits, and rows
whose policies were substituted after the fact (``aliases=`` / ``--policy-alias``),
are exploratory; substitutions are listed as deviations.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from divstats.errors import DivstatsError, NotIdentified, PlanError
from divstats.estimands import ANSWER_ESTIMANDS, ESTIMANDS
from divstats.estimation.answers import with_answer_values
from divstats.estimation.curves import branch_tv
from divstats.estimation.estimators import estimate
from divstats.estimation.speculative import SPECULATIVE_METRICS, speculative
from divstats.inference.certify import CertifyResult, certify_family
from divstats.inference.choices import MARGIN_ALTERNATIVES, TEST_DESCRIPTIONS
from divstats.inference.margins import margin_verdict
from divstats.inference.multiplicity import holm, rejects
from divstats.inference.paired import paired_test
from divstats.plans.format import (
    FULL,
    WINDOW_METRICS,
    Certification,
    Hypothesis,
    Plan,
    PlanSource,
    load_plan,
    split_disagreement_note,
    split_table,
)
from protocols import Kind

__all__ = ["CERTIFY_COLUMNS", "EXTRA_COLUMNS", "FULL_MODEL_VALUES", "TABLE_COLUMNS", "PlanResult", "full_model_value",
           "run_plan", "window_mean"]

TABLE_COLUMNS: tuple[str, ...] = (
    "id", "family", "metric", "n_docs", "statistic", "p_value", "p_adjusted", "reject",
    "effect", "ci_low", "ci_high", "confirmatory",
)
EXTRA_COLUMNS: tuple[str, ...] = (
    "label", "model", "a", "b", "policy", "window", "direction", "test", "correction", "split",
    "alpha", "effect_kind", "mean_a", "mean_b", "mean_difference", "mean_ci_low", "mean_ci_high",
    "hodges_lehmann", "hl_ci_low", "hl_ci_high", "estimand", "n_dropped", "deviation", "note",
    "margin", "worse", "verdict",
)
#: The full model's own value of each metric, compared with itself (it never diverges): 0 for
#: the mismatch-type metrics, the horizon T for rmtd and agreeing_tokens (E[min(tau, T)] with tau > T);
#: the estimand table's ``full_value``, and 0 for the window metric ``branch_tv``.
#: Used for ``compare = [A, "full"]`` when the data hold no measured ``full`` control policy.
#: The columns of :attr:`PlanResult.certify`.
CERTIFY_COLUMNS: tuple[str, ...] = (
    "id", "family", "metric", "model", "split", "n_docs", "margin", "worse", "alpha", "reference", "budgets",
    "tested", "certified", "certified_kept", "reason", "verdict", "confirmatory",
)

FULL_MODEL_VALUES: dict[str, str | float] = {
    **{e.name: 0.0 if e.full_value == "zero" else "horizon" for e in ESTIMANDS + ANSWER_ESTIMANDS
       if e.full_value != "none"},
    "branch_tv": 0.0,
}


def full_model_value(metric: str, horizon: int | None) -> float:
    """The full model's known value of ``metric`` (:data:`FULL_MODEL_VALUES`).

    Parameters
    ----------
    metric : str
        The metric.
    horizon : int or None
        The traces' horizon T.

    Returns
    -------
    float
        The value.

    Raises
    ------
    PlanError
        For a metric with no known full-model value (e.g. rate, undefined without divergence).

    Examples
    --------
    >>> full_model_value("mismatch_fraction", 10), full_model_value("rmtd", 10)
    (0.0, 10.0)
    """
    value = FULL_MODEL_VALUES.get(metric)
    if value is None or (value == "horizon" and horizon is None):
        raise PlanError(f"metric {metric!r} has no known value for the full model; collect a {FULL!r} control "
                        "policy to compare with")
    return float(horizon) if value == "horizon" else float(value)



@dataclass
class PlanResult:
    """Outcome of :func:`run_plan`: the results table and everything needed to audit it."""

    plan: Plan
    table: pd.DataFrame
    split: pd.DataFrame
    deviations: list[str]
    notes: list[str]
    #: One row per [[certify]] (and model): :data:`CERTIFY_COLUMNS`.
    certify: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=list(CERTIFY_COLUMNS)))
    #: (certify id, model or None) -> its :class:`~divstats.inference.certify.CertifyResult`.
    certified: dict[tuple[str, str | None], CertifyResult] = field(default_factory=dict)

    @property
    def plan_sha256(self) -> str:
        return self.plan.sha256

    @property
    def split_note(self) -> str | None:
        return split_disagreement_note(self.split)

    def to_dataset(self) -> xr.Dataset:
        """The table as an xarray Dataset over ``hypothesis`` (for results.nc)."""
        t = self.table.reset_index(drop=True)
        data = {}
        for col in t.columns:
            values = t[col].to_numpy()
            if t[col].dtype == object:
                values = np.array(["" if v is None else str(v) for v in values], dtype=object)
            data[f"plan_{col}"] = ("hypothesis", values)
        return xr.Dataset(data, coords={"hypothesis": np.arange(len(t))},
                          attrs={"plan_name": self.plan.name, "plan_sha256": self.plan.sha256,
                                 "deviations": json.dumps(self.deviations),
                                 "notes": json.dumps(self.notes)})


class _Data:
    """Lazily computed per-document quantities the plan needs (computed once each)."""

    def __init__(self, ds: xr.Dataset, window: int | None, estimates: xr.Dataset | None,
                 branch: xr.Dataset | None) -> None:
        self.ds, self.window = ds, window
        self._est, self._branch = estimates, branch
        self.notes: list[str] = []
        self._speculative: dict[int, xr.Dataset] = {}

    def speculative(self, gamma: int) -> xr.Dataset:
        if gamma not in self._speculative:
            self._speculative[gamma] = speculative(self.ds, gamma=gamma).squeeze("gamma", drop=True)
        return self._speculative[gamma]

    @property
    def est(self) -> xr.Dataset:
        if self._est is None:
            # the answer estimands (accuracy, accuracy_change) beside the trace estimands, when scored
            self._est = with_answer_values(estimate(self.ds, window=self.window), self.ds)
        return self._est

    @property
    def branch(self) -> xr.Dataset:
        if self._branch is None:
            self._branch = branch_tv(self.ds, window=self.window)
        return self._branch


def window_mean(branch: xr.Dataset, first: int, last: int) -> xr.DataArray:
    """Per-document average of ``branch_tv`` over ages first..last (both inclusive).

    The unweighted mean of the per-age estimates over ages that some branch can
    reach (NaN ages skipped), i.e. ``divstats.branch_tv_window(ds, first, last + 1)``
    when the window lies inside the horizon.

    Parameters
    ----------
    branch : xarray.Dataset
        ``divstats.branch_tv(ds)``.
    first, last : int
        The window's ages, both inclusive (a plan's ``[windows]`` entry).

    Returns
    -------
    xarray.DataArray
        Over the dims of ``branch`` except ``age``.

    Examples
    --------
    >>> import divstats
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(2, {"a": PolicyEffect(0.3)}, horizon=6, replicates=4)
    >>> window_mean(divstats.branch_tv(ds), 1, 2).dims
    ('doc', 'policy')
    """
    ages = branch["age"]
    sel = branch["branch_tv"].where((ages >= first) & (ages <= last), drop=True)
    return sel.mean("age", skipna=True)


def _resolve(policy: str, plan_aliases: Mapping[str, str], aliases: Mapping[str, str]) -> tuple[str, str | None]:
    """Data policy id for a planned id, and the deviation text when substituted post hoc."""
    target = plan_aliases.get(policy, policy)
    if policy in aliases or target in aliases:
        final = aliases.get(policy, aliases.get(target))
        return final, f"{policy} -> {final} (substituted at run time; not in the plan)"
    return target, None


def _check_policy(pid: str, planned: str, data: _Data, hid: str) -> None:
    available = [str(p) for p in data.ds["policy"].values]
    if pid not in available:
        via = f" (planned as {planned!r})" if pid != planned else ""
        raise PlanError(f"hypothesis {hid!r}: policy {pid!r}{via} is not in the data; available: {available}. "
                        "Use --policy-alias PLANNED=ACTUAL to substitute (recorded as a deviation).")


def _metric(data: _Data, h: Hypothesis, plan: Plan, policy: str, which: str | None) -> xr.DataArray:
    """Per-document values of the hypothesis metric for one policy (over doc[, model])."""
    if h.metric in WINDOW_METRICS:
        reason = data.branch["branch_tv"].attrs.get("not_identified")
        if data.branch.attrs.get("kind") == Kind.REFERENCE or (reason and data.branch["branch_tv"].isnull().all()):
            raise NotIdentified(f"hypothesis {h.id!r}: branch_tv is not identified for these traces ({reason})")
        first, last = plan.windows[which]
        ages = data.branch["age"].values
        if ages.size == 0 or first > ages.max():
            raise NotIdentified(f"hypothesis {h.id!r}: window {which!r} = [{first}, {last}] starts beyond the "
                                f"largest age in the data ({int(ages.max()) if ages.size else 'none'}); "
                                "not identified")
        observed = data.branch.attrs.get("window")
        if observed is not None and last > int(observed) and int(observed) < ages.max():
            raise NotIdentified(f"hypothesis {h.id!r}: window {which!r} = [{first}, {last}] needs ages up to "
                                f"{min(last, int(ages.max()))}, but branches are observed only to age W = "
                                f"{observed}; not identified")
        if last > ages.max():
            note = (f"window {which!r} = [{first}, {last}] extends past the largest age in the data "
                    f"({int(ages.max())}); it was averaged over ages {first}..{int(ages.max())}.")
            if note not in data.notes:
                data.notes.append(note)
        return window_mean(data.branch.sel(policy=policy), first, last)
    if h.metric in SPECULATIVE_METRICS:
        if data.ds.attrs.get("kind") != Kind.REFERENCE:
            raise PlanError(f"hypothesis {h.id!r}: metric {h.metric!r} needs reference traces (log p and log q of "
                            f"P's tokens, docs/statistics.md §10); these are {data.ds.attrs.get('kind')!r}")
        return data.speculative(int(h.gamma))[h.metric].sel(policy=policy)
    if h.metric not in data.est.data_vars:
        raise PlanError(f"hypothesis {h.id!r}: unknown metric {h.metric!r}; estimate provides "
                        f"{sorted(str(v) for v in data.est.data_vars)} and windowed {list(WINDOW_METRICS)}")
    return data.est[h.metric].sel(policy=policy)


def _docs_for(split: str, table: pd.DataFrame) -> list[str]:
    if split == "all":
        return table["doc"].tolist()
    return table.loc[table["split"] == split, "doc"].tolist()


def run_plan(ds: xr.Dataset, plan: PlanSource, *,
             aliases: Mapping[str, str] | None = None, window: int | None = None,
             estimates: xr.Dataset | None = None, branch: xr.Dataset | None = None,
             n_resamples: int = 9999, seed: int = 0) -> PlanResult:
    """Run every hypothesis of ``plan`` on the trace dataset ``ds``.

    Parameters
    ----------
    ds : xarray.Dataset
        Traces (``doc``, ``policy``[, ``model``] dims; an optional ``split`` coord
        over ``doc`` is compared with the plan's split and reported when it disagrees).
    plan : Plan, str, pathlib.Path or mapping
        Anything :func:`divstats.plans.format.load_plan` accepts (e.g. ``"paper"``).
    aliases : mapping of str to str, optional
        Planned policy id → id in the data: a post-hoc deviation, recorded; the
        affected rows are labelled exploratory.
    window : int, optional
        Truncate the observation window after divergence (as ``divstats.estimate``).
    estimates, branch : xarray.Dataset, optional
        ``divstats.estimate(ds)`` / ``divstats.branch_tv(ds)`` to reuse.
    n_resamples : int
        Resamples of the bootstrap and Monte Carlo permutation tests.
    seed : int
        Seed of every resampling.

    Returns
    -------
    PlanResult
        The table (columns :data:`TABLE_COLUMNS` + :data:`EXTRA_COLUMNS`), the split,
        deviations and notes.

    Raises
    ------
    PlanError
        For a policy, metric, model, alias or split the data cannot serve. A
        hypothesis the data cannot identify is not an error: its row holds NaN
        and the reason.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> effects = {p: PolicyEffect(0.1) for p in ("snapkv@0.5", "snapkv#512", "recent@0.5", "snapkv@0.9")}
    >>> ds = simulate_study(6, effects, horizon=6, replicates=3)
    >>> plan = {"plan": {"name": "t", "salt": "s"}, "hypothesis": [
    ...     {"id": "H1", "family": "f", "metric": "occurrence", "compare": ["snapkv@0.5", "recent@0.5"],
    ...      "split": "all"}]}
    >>> run_plan(ds, plan, n_resamples=99).table["id"].tolist()
    ['H1']
    """
    plan = load_plan(plan)
    aliases = dict(aliases or {})
    data = _Data(ds, window, estimates, branch)
    docs = [str(d) for d in ds["doc"].values]
    ds_split = ds["split"].values if "split" in ds.coords else None
    split = split_table(docs, plan, ds_split)
    notes: list[str] = []
    if (note := split_disagreement_note(split)) is not None:
        notes.append(note)
    unused = sorted(set(aliases) - plan.policies() - set(plan.aliases.values()))
    if unused:
        raise PlanError(f"--policy-alias names {unused}, which the plan does not use; planned policies: "
                        f"{sorted(plan.policies())}")
    rows: list[dict[str, Any]] = []
    deviations: list[str] = []
    for h in plan.hypotheses:
        rows.extend(_run_hypothesis(h, plan, data, split, aliases, deviations, n_resamples, seed))
    certified: dict[tuple[str, str | None], CertifyResult] = {}
    cert_rows = [row for c in plan.certifications
                 for row in _run_certification(c, data, split, certified, n_resamples, seed)]
    notes.extend(data.notes)
    table = _correct(pd.DataFrame(rows, columns=None if rows else list(TABLE_COLUMNS + EXTRA_COLUMNS)), plan)
    table.attrs.update({"plan_name": plan.name, "plan_sha256": plan.sha256})
    return PlanResult(plan=plan, table=table, split=split, deviations=sorted(set(deviations)), notes=notes,
                      certify=pd.DataFrame(cert_rows, columns=list(CERTIFY_COLUMNS)), certified=certified)


def _run_certification(c: Certification, data: _Data, split: pd.DataFrame,
                       out: dict[tuple[str, str | None], CertifyResult], n_resamples: int,
                       seed: int) -> list[dict[str, Any]]:
    """One [[certify]]: :func:`divstats.certify_family` per model on the certification's split."""
    docs = _docs_for(c.split, split)
    if not docs:
        raise PlanError(f"certify {c.id!r}: the {c.split!r} split has no documents in the data")
    if c.metric not in data.est:
        raise PlanError(f"certify {c.id!r}: metric {c.metric!r} is not a variable of divstats.estimate(ds)")
    reference: str | float = c.reference
    if reference == FULL and FULL not in [str(p) for p in data.ds["policy"].values]:
        reference = full_model_value(c.metric, data.ds.attrs.get("horizon"))
    rows = []
    for m in _models_for(data, c):
        model = None if m is None else str(m)
        try:
            res = certify_family(data.est, c.family, c.metric, c.margin, alpha=c.alpha, worse=c.worse,
                                 reference=reference, model=model, docs=docs, test=c.test,
                                 n_resamples=n_resamples, seed=seed)
        except DivstatsError as exc:
            raise PlanError(f"certify {c.id!r}: {exc}") from None
        out[(c.id, model)] = res
        if res.certified is None:
            data.notes.append(f"certify {c.id!r}{'' if m is None else f' (model {m})'}: {res.reason}")
        kept = res.kept[res.certified_index] if res.certified is not None else float("nan")
        rows.append({"id": c.id, "family": c.family, "metric": c.metric, "model": model, "split": c.split,
                     "n_docs": int(res.n_docs.min()) if res.n_docs.size else 0, "margin": res.margin,
                     "worse": res.worse, "alpha": c.alpha, "reference": res.reference,
                     "budgets": ",".join(res.budgets), "tested": res.tested,
                     "certified": res.certified or "", "certified_kept": float(kept), "reason": res.reason,
                     "verdict": res.verdict, "confirmatory": c.split == "confirmatory"})
    return rows


def _models_for(data: _Data, h: Hypothesis | Certification) -> list[Any]:
    if "model" not in data.ds.dims:
        if h.model is not None and h.model != str(data.ds.attrs.get("model", "")):
            raise PlanError(f"hypothesis {h.id!r}: model {h.model!r} is not in the data "
                            f"(model: {data.ds.attrs.get('model', '')!r})")
        return [None]
    models = [m for m in data.ds["model"].values]
    if h.model is not None:
        if h.model not in [str(m) for m in models]:
            raise PlanError(f"hypothesis {h.id!r}: model {h.model!r} is not in the data; available: "
                            f"{[str(m) for m in models]}")
        return [m for m in models if str(m) == h.model]
    return models


def _run_hypothesis(h: Hypothesis, plan: Plan, data: _Data, split: pd.DataFrame,
                    aliases: Mapping[str, str], deviations: list[str], n_resamples: int,
                    seed: int) -> list[dict[str, Any]]:
    docs = _docs_for(h.split, split)
    if not docs:
        raise PlanError(f"hypothesis {h.id!r}: the {h.split!r} split has no documents in the data "
                        f"({len(split)} documents; confirmatory_fraction={plan.confirmatory_fraction})")
    devs: list[str] = []
    if h.compares_windows:
        pol, dev = _resolve(h.policy, plan.aliases, aliases)
        _check_policy(pol, h.policy, data, h.id)
        devs += [dev] if dev else []
        sides, labels = (pol, pol), (h.compare[0], h.compare[1], pol)
        windows = h.compare
    else:
        pa, dev_a = _resolve(h.compare[0], plan.aliases, aliases)
        pb, dev_b = _resolve(h.compare[1], plan.aliases, aliases)
        for pid, planned in ((pa, h.compare[0]), (pb, h.compare[1])):
            if not _known_full(pid, data):
                _check_policy(pid, planned, data, h.id)
        devs += [d for d in (dev_a, dev_b) if d]
        sides, labels = (pa, pb), (pa, pb, "")
        windows = (h.window, h.window)
    deviations.extend(devs)
    models = _models_for(data, h)
    try:
        va = _metric(data, h, plan, sides[0], windows[0])
        vb = (xr.full_like(va, full_model_value(h.metric, data.ds.attrs.get("horizon")), dtype=float)
              if _known_full(sides[1], data) else _metric(data, h, plan, sides[1], windows[1]))
    except NotIdentified as exc:
        data.notes.append(str(exc))
        return [_row(h, m, data, labels, devs, None, np.array([]), np.array([]), str(exc)) for m in models]
    rows = []
    for m in models:
        sa = va.sel(model=m) if m is not None else va
        sb = vb.sel(model=m) if m is not None else vb
        xa = sa.sel(doc=docs).values.astype(float)
        xb = sb.sel(doc=docs).values.astype(float)
        dropped = _dropped_note(h, m, xa, xb)
        if dropped:
            data.notes.append(dropped)
        if not (np.isfinite(xa) & np.isfinite(xb)).any():
            why = data.est[h.metric].attrs.get("not_identified", "") if h.metric in data.est else ""
            note = (f"hypothesis {h.id!r}{'' if m is None else f' (model {m})'}: no document has a finite "
                    f"{h.metric!r} for both sides" + (f" ({why})" if why else "") + "; not identified")
            data.notes.append(note)
            rows.append(_row(h, m, data, labels, devs, None, xa, xb, note))
            continue
        margin = {"margin": h.margin, "worse": h.worse} if h.direction in MARGIN_ALTERNATIVES else {}
        res = paired_test(xa, xb, h.test, h.direction, confidence_level=1 - h.alpha,
                          n_resamples=n_resamples, seed=seed, **margin)
        # a refused mean-difference interval (too few documents) is said where the test is not
        why = res.reason or res.ci_reason
        note = "; ".join(x for x in (dropped, f"{h.id}: {why}" if why else "") if x)
        if why:
            data.notes.append(f"hypothesis {h.id!r}{'' if m is None else f' (model {m})'}: {why}")
        rows.append(_row(h, m, data, labels, devs, res, xa, xb, note))
    return rows


def _known_full(pid: str, data: _Data) -> bool:
    """``full`` as side B with no measured control in the data: its known value is used."""
    return pid == FULL and FULL not in [str(p) for p in data.ds["policy"].values]


def _dropped_note(h: Hypothesis, m: Any, xa: np.ndarray, xb: np.ndarray) -> str:
    """Say how many documents of the split had no value on one side (and were dropped from the pair)."""
    missing = ~(np.isfinite(xa) & np.isfinite(xb))
    if not missing.any():
        return ""
    why = ("no branch reached the window (branch_tv NaN, count 0)" if h.metric in WINDOW_METRICS
           else f"{h.metric!r} missing or not identified")
    return (f"hypothesis {h.id!r}{'' if m is None else f' (model {m})'}: {int(missing.sum())} of "
            f"{missing.size} documents dropped from the pair: {why}")


def _row(h: Hypothesis, m: Any, data: _Data, labels: tuple[str, str, str], devs: list[str],
         res: Any, xa: np.ndarray, xb: np.ndarray, note: str) -> dict[str, Any]:
    """One table row; ``res`` None means not evaluated (NaN results, reason in ``note``)."""
    both = np.isfinite(xa) & np.isfinite(xb)
    nan = float("nan")
    get = (lambda name: getattr(res, name)) if res is not None else (lambda name: nan)  # noqa: E731
    multi = m is not None and data.ds.sizes.get("model", 1) > 1
    return {
        "id": f"{h.id}[{m}]" if multi else h.id,
        "family": h.family, "metric": h.metric, "n_docs": res.n if res is not None else 0,
        "statistic": get("statistic"), "p_value": get("pvalue"), "p_adjusted": nan, "reject": False,
        "effect": get("effect"), "ci_low": get("ci_low"), "ci_high": get("ci_high"),
        "confirmatory": h.split == "confirmatory" and not devs,
        "label": "", "model": "" if m is None else str(m), "a": labels[0], "b": labels[1],
        "policy": labels[2], "window": h.window or "", "direction": h.direction, "test": h.test,
        "correction": h.correction, "split": h.split, "alpha": h.alpha,
        "effect_kind": "hodges_lehmann" if h.test == "wilcoxon" else "mean_difference",
        "mean_a": float(np.mean(xa[both])) if both.any() else nan,
        "mean_b": float(np.mean(xb[both])) if both.any() else nan,
        "mean_difference": get("mean_difference"), "mean_ci_low": get("mean_ci_low"),
        "mean_ci_high": get("mean_ci_high"), "hodges_lehmann": get("hodges_lehmann"),
        "hl_ci_low": get("hl_ci_low"), "hl_ci_high": get("hl_ci_high"), "estimand": TEST_DESCRIPTIONS[h.test],
        "n_dropped": int((~both).sum()), "deviation": "; ".join(devs),
        "note": note,
        "margin": h.margin if h.margin is not None else nan,
        "worse": h.worse if h.direction == "noninferiority" else "", "verdict": "",
    }


def _correct(table: pd.DataFrame, plan: Plan) -> pd.DataFrame:
    """Holm within each family (over all its rows, models included); 'none' leaves p as is."""
    table = table.copy()
    for _, idx in table.groupby("family", sort=False).groups.items():
        fam = table.loc[idx]
        alpha = float(fam["alpha"].iloc[0])
        if fam["correction"].iloc[0] == "holm":
            reject, adjusted = holm(fam["p_value"].to_numpy(), alpha)
        else:
            adjusted = fam["p_value"].to_numpy(dtype=float)
            reject = rejects(adjusted, alpha)       # the same rule as Holm's: p <= alpha
        table.loc[idx, "p_adjusted"] = adjusted
        table.loc[idx, "reject"] = reject
    table["reject"] = table["reject"].astype(bool)
    table["confirmatory"] = table["confirmatory"].astype(bool)
    table["label"] = np.where(table["confirmatory"], "confirmatory", "exploratory")
    # tests at a margin: the verdict in words, from the (adjusted) decision
    for i in table.index[table["direction"].isin(MARGIN_ALTERNATIVES)]:
        r = table.loc[i]
        table.loc[i, "verdict"] = margin_verdict(r["direction"], bool(r["reject"]), float(r["margin"]),
                                                 r["worse"] or "larger", bool(np.isfinite(r["p_value"])))
    return table[list(TABLE_COLUMNS) + list(EXTRA_COLUMNS)]

