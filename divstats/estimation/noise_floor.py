"""The numerical noise floor: how far the full-cache model drifts from itself (``collect --control``).

The control is the policy ``full`` run as a candidate: Q is P's own model with its full
cache, in the same grouped request, batched, fused and stacked like the real candidates.
Mathematically P = Q and nothing diverges; whatever divergence the control shows is
floating-point noise (bf16 matmuls whose last bits depend on the batch shape, fused or
separate P+Q forwards). A policy's divergence within a few noise-floor units
(:data:`NOISE_FLOOR_FACTOR`) is not distinguishable from numerics.

:func:`noise_floor` uses the existing machinery only: :func:`~divstats.estimation.estimators.estimate`
per document, :func:`~divstats.estimation.estimators.aggregate` and
:func:`~divstats.estimation.estimators.aggregate_intervals` over documents; max TV is the
largest per-step TV between P and Q at a shared history (coupled ``tv``, residual
``shared_tv``), a maximum, with no interval.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xarray as xr

from divstats.estimands import MISMATCH_FRACTION, OCCURRENCE
from divstats.estimation.estimators import aggregate, aggregate_intervals, estimate

__all__ = ["CONTROL_POLICY", "NOISE_FLOOR_FACTOR", "NOISE_FLOOR_METRICS", "NO_CONTROL", "compare_to_floor",
           "control_policy", "floor_level", "floor_warnings", "max_tv", "noise_floor"]

#: The control's policy id: the candidate that is the reference.
CONTROL_POLICY = "full"

#: What a report says when the traces hold no control.
NO_CONTROL = "no control collected (run `kvdiv collect --control` to measure the numerical noise floor)"

#: A policy's effect within this many noise-floor units is flagged: the unit (the control's
#: estimate + 1.96 SE over documents, :func:`floor_level`) is itself an estimate, and batch-shape noise
#: differs between the control's rows and a candidate's, so an effect must clear the
#: floor by a margin, not just exceed it, before it is read as the policy's.
NOISE_FLOOR_FACTOR = 3.0

#: The metrics the noise floor is reported on (estimates' names, and ``max_tv``).
NOISE_FLOOR_METRICS: tuple[str, ...] = (OCCURRENCE, "max_tv", MISMATCH_FRACTION)

#: TV between P's and Q's laws at the same history: coupled ``tv``, residual ``shared_tv``. The
#: branches' ``branch_tv`` compares two different histories (after divergence), which is no
#: P-vs-Q numerics comparison and would put every diverging policy near 1.
_TV_VARS = ("tv", "shared_tv")


def control_policy(ds: xr.Dataset) -> str | None:
    """The traces' control policy: the ``control_policy`` attr (``kvdiv pack``), else ``full`` if present.

    Parameters
    ----------
    ds : xarray.Dataset
        Trace dataset.

    Returns
    -------
    str or None
        The control's policy id; None when the traces hold no control.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(3, {"full": PolicyEffect(0.0), "a": PolicyEffect(0.3)}, horizon=6, replicates=3)
    >>> control_policy(ds), control_policy(ds.sel(policy=["a"]))
    ('full', None)
    """
    policies = {str(p) for p in ds["policy"].values} if "policy" in ds.coords else set()
    named = ds.attrs.get("control_policy")
    if isinstance(named, str) and named in policies:
        return named
    return CONTROL_POLICY if CONTROL_POLICY in policies else None


def max_tv(ds: xr.Dataset) -> xr.DataArray:
    """Per (doc, policy[, model]): the largest TV between P's and Q's next-token laws at a shared history.

    Over replicates and steps of ``tv`` (coupled) or ``shared_tv`` (residual: the survival
    path, up to divergence); NaN where none is observed (reference traces).

    Parameters
    ----------
    ds : xarray.Dataset
        Trace dataset (any kind).

    Returns
    -------
    xarray.DataArray
        ``max_tv`` over (doc, policy[, model]).

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(3, {"full": PolicyEffect(0.0), "a": PolicyEffect(0.3)}, horizon=6, replicates=3)
    >>> float(max_tv(ds).sel(policy="full").max())
    0.0
    """
    parts = [ds[v].max([d for d in ds[v].dims if d not in ("doc", "policy", "model")], skipna=True)
             for v in _TV_VARS if v in ds.data_vars]
    if not parts:
        template = ds["policy"].expand_dims(doc=ds["doc"].values)
        return xr.full_like(template, np.nan, dtype=float).rename("max_tv")
    out = parts[0] if len(parts) == 1 else xr.concat(parts, "part").max("part", skipna=True)
    out = out.drop_vars([c for c in out.coords if c not in out.dims])
    return out.astype(float).compute().rename("max_tv").assign_attrs(
        description="max over replicates and steps of the TV between P's and Q's next-token laws "
                    "at a shared history (tv / shared_tv)")


def noise_floor(ds: xr.Dataset, *, control: str | None = None, window: int | None = None,
                estimates: xr.Dataset | None = None, level: float = 0.95, n_resamples: int = 2000,
                seed: int = 0, policies: Sequence[str] | None = None) -> xr.Dataset:
    """The control's divergence (full vs full) per document and over documents, with intervals.

    Parameters
    ----------
    ds : xarray.Dataset
        Trace dataset (any kind) holding the control policy.
    control : str, optional
        The control's policy id (default :func:`control_policy`).
    window : int, optional
        As :func:`~divstats.estimation.estimators.estimate`.
    estimates : xarray.Dataset, optional
        Per-document estimates already computed for ``ds`` (``estimate(ds, window)``);
        the control's column is taken from them.
    level, n_resamples, seed
        As :func:`~divstats.estimation.estimators.aggregate_intervals`.
    policies : sequence of str, optional
        Also give ``max_tv`` per document for these policies (``policy_max_tv``), for
        comparison (default: every policy).

    Returns
    -------
    xarray.Dataset
        Per document: ``occurrence``, ``mismatch_fraction`` (and ``_se``) and ``max_tv``;
        over documents (equal weights): ``aggregate_<m>``, ``aggregate_<m>_se`` and the
        interval ``aggregate_<m>_low/_high`` for occurrence and mismatch fraction,
        ``aggregate_max_tv`` (the max over documents), ``floor_<m>`` (:func:`floor_level`)
        and ``policy_max_tv`` (doc, policy). attrs: ``control``, ``factor``, ``level``,
        ``interval_method``, ``interval_reason``. Without a control: an empty dataset
        whose ``control`` attr is ``""`` and ``note`` is :data:`NO_CONTROL` (no error).

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(3, {"full": PolicyEffect(0.0), "a": PolicyEffect(0.3)}, horizon=6, replicates=3)
    >>> nf = noise_floor(ds, n_resamples=99)
    >>> nf.attrs["control"], float(nf["aggregate_occurrence"])
    ('full', 0.0)
    >>> noise_floor(ds.sel(policy=["a"])).attrs["note"].startswith("no control")
    True
    """
    control = control if control is not None else control_policy(ds)
    if control is None or control not in {str(p) for p in ds["policy"].values}:
        return xr.Dataset(attrs={"control": "", "note": NO_CONTROL, "factor": NOISE_FLOOR_FACTOR})
    est = estimates if estimates is not None else estimate(ds.sel(policy=[control]), window)
    est = est.sel(policy=[control])
    agg = aggregate(est)
    ci = aggregate_intervals(est, level=level, n_resamples=n_resamples, seed=seed)
    all_tv = max_tv(ds)
    tv = all_tv.sel(policy=control, drop=True)
    # the steps the control was decoded over (documents x replicates x horizon): a floor of exactly 0
    # says "no numerical divergence in this many steps", so the report names the number
    steps = int(ds.sizes.get("doc", 1) * ds.sizes.get("replicate", 1) * int(ds.attrs.get("horizon", 0)))
    out = xr.Dataset(attrs={"control": control, "factor": NOISE_FLOOR_FACTOR, "level": level, "control_steps": steps,
                            "interval_method": str(ci.attrs.get("methods_used", "")),
                            "interval_reason": str(ci.attrs.get("reason", "")), "note": ""})
    for m in (OCCURRENCE, MISMATCH_FRACTION):
        out[m] = est[m].sel(policy=control, drop=True)
        out[m + "_se"] = est[m + "_se"].sel(policy=control, drop=True)
        out["aggregate_" + m] = agg[m].sel(policy=control, drop=True)
        out["aggregate_" + m + "_se"] = agg[m + "_se"].sel(policy=control, drop=True)
        out["aggregate_" + m + "_sd_docs"] = agg[m + "_sd_docs"].sel(policy=control, drop=True)
        out["aggregate_" + m + "_low"] = ci[m + "_low"].sel(policy=control, drop=True)
        out["aggregate_" + m + "_high"] = ci[m + "_high"].sel(policy=control, drop=True)
    out["max_tv"] = tv
    out["aggregate_max_tv"] = tv.max("doc", skipna=True)
    keep = [str(p) for p in (policies if policies is not None else all_tv["policy"].values)]
    out["policy_max_tv"] = all_tv.sel(policy=keep).rename({"policy": "compared_policy"})
    for m in NOISE_FLOOR_METRICS:
        out["floor_" + m] = floor_level(out, m).assign_attrs(
            description=f"one noise-floor unit of {m}: the control's aggregate + 1.96 SE over documents")
    return out.drop_vars([c for c in out.coords if c not in out.dims])


def floor_level(nf: xr.Dataset, metric: str) -> xr.DataArray:
    """One noise-floor unit of ``metric``: the control's aggregate + 1.96 × its standard error over
    documents (SD across documents / √n; the Monte Carlo SE with one document), and for ``max_tv``
    its max.

    The bootstrap interval is not used: on a control that is 0 on most documents it is
    unstable (a hybrid-t interval can span [0, 1]), while the normal upper bound stays
    near the estimate and is 0 exactly when the control never diverged.

    Parameters
    ----------
    nf : xarray.Dataset
        :func:`noise_floor`'s output (with a control).
    metric : str
        One of :data:`NOISE_FLOOR_METRICS`.

    Returns
    -------
    xarray.DataArray
        The floor (a scalar, or over ``model``).

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(3, {"full": PolicyEffect(0.0), "a": PolicyEffect(0.3)}, horizon=6, replicates=3)
    >>> float(floor_level(noise_floor(ds, n_resamples=99), "occurrence"))
    0.0
    """
    point = nf["aggregate_" + metric]
    if metric == "max_tv":
        return point
    n = nf.sizes.get("doc", 1)
    se = nf["aggregate_" + metric + "_sd_docs"] / np.sqrt(n) if n > 1 else nf["aggregate_" + metric + "_se"]
    return point + 1.96 * se.fillna(0.0)


def compare_to_floor(agg: xr.Dataset, nf: xr.Dataset) -> list[dict]:
    """Each non-control policy's divergence beside the noise floor, metric by metric.

    Parameters
    ----------
    agg : xarray.Dataset
        :func:`~divstats.estimation.estimators.aggregate` of the estimates (every policy).
    nf : xarray.Dataset
        :func:`noise_floor` of the same traces.

    Returns
    -------
    list of dict
        One per (policy[, model]): ``policy``, ``model`` (None without a model dim) and,
        per metric of :data:`NOISE_FLOOR_METRICS`, ``<m>`` (the policy's aggregate, max
        over documents for max TV), ``<m>_floor``, ``<m>_units`` (value / floor; inf when
        the floor is 0 and the value is not) and ``<m>_within`` (value <= factor × floor;
        False where the value is NaN, e.g. not identified). ``within`` lists the metrics
        within the floor. Empty without a control.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(3, {"full": PolicyEffect(0.0), "a": PolicyEffect(0.3)}, horizon=6, replicates=3)
    >>> from divstats.estimation.estimators import aggregate, estimate
    >>> rows = compare_to_floor(aggregate(estimate(ds)), noise_floor(ds, n_resamples=99))
    >>> [r["policy"] for r in rows], rows[0]["occurrence_floor"]
    (['a'], 0.0)
    """
    control = nf.attrs.get("control") or None
    if control is None:
        return []
    factor = float(nf.attrs.get("factor", NOISE_FLOOR_FACTOR))
    models = [str(m) for m in agg["model"].values] if "model" in agg.dims else [None]
    rows = []
    for pol in (str(p) for p in agg["policy"].values):
        if pol == control:
            continue
        for model in models:
            msel = {} if model is None else {"model": model}
            row: dict = {"policy": pol, "model": model, "within": []}
            for m in NOISE_FLOOR_METRICS:
                if m == "max_tv":
                    value = float(nf["policy_max_tv"].sel(compared_policy=pol, **msel).max(skipna=True))
                else:
                    value = float(agg[m].sel(policy=pol, **msel))
                floor = float(nf["floor_" + m].sel(**msel)) if "model" in nf["floor_" + m].dims else \
                    float(nf["floor_" + m])
                with np.errstate(divide="ignore", invalid="ignore"):
                    units = value / floor if floor > 0 else (np.inf if value > 0 else np.nan)
                within = bool(np.isfinite(value) and np.isfinite(floor) and value <= factor * floor)
                row.update({m: value, m + "_floor": floor, m + "_units": float(units), m + "_within": within})
                if within:
                    row["within"].append(m)
            rows.append(row)
    return rows


def floor_warnings(rows: Sequence[dict], factor: float = NOISE_FLOOR_FACTOR) -> list[str]:
    """One warning per policy (and model) whose divergence is within ``factor`` noise-floor units.

    Parameters
    ----------
    rows : sequence of dict
        :func:`compare_to_floor`'s rows.
    factor : float
        The factor the rows were compared with (named in the text).

    Returns
    -------
    list of str
        The warnings (the report's notes).

    Examples
    --------
    >>> floor_warnings([{"policy": "b", "model": None, "within": ["occurrence"]}])[0][:40]
    "Noise floor: b's occurrence within 3× th"
    """
    out = []
    for r in rows:
        if r["within"]:
            who = r["policy"] + (f" ({r['model']})" if r.get("model") else "")
            out.append(f"Noise floor: {who}'s {', '.join(r['within'])} within {factor:g}× the control's "
                       "(full vs full) divergence: indistinguishable from numerical noise (dtype, batch shape, "
                       "fused P+Q forwards), not evidence of an eviction effect")
    return out
