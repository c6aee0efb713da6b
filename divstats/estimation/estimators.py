"""Per-document estimates of every docs/statistics.md §3 estimand, and their aggregation.

``estimate`` reduces the replicates of a trace dataset (any kind) to one value
and one Monte Carlo standard error per (doc, policy[, model]); ``aggregate``
combines documents with equal weights.  Derived quantities are computed from
their parts, so on every reported number

    loss = occurrence + exposure * rate
    mismatch_fraction = first_mismatch_contribution + exposure_contribution

hold to rounding.  When exposure = 0 the rate is NaN (0/0) but the post-divergence
count R is 0 on every path (R <= (T - tau)+), so the exposure contribution is
defined as 0 and loss = occurrence.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from divstats.estimands import ESTIMANDS, RATE, by_name, names, value_range
from divstats.estimation.bounded import (
    BETTING_ONLY_BELOW,
    MIN_DOCS_BOUNDED,
    betting_interval,
    choose_bounded,
    in_range,
    resampled_interval,
)
from divstats.estimation.resample import MIN_DOCS_AGGREGATE, document_interval
from divstats.intervals import ConfidenceInterval
from divstats.traces.arrays import cov_of_means, mean_se, ratio_se
from divstats.traces.chunked import load, map_docs
from divstats.traces.replicates import REPLICATE_ESTIMANDS, Replicates, replicate_values
from protocols import Kind
from protocols.chunks import is_lazy

__all__ = [
    "DESCRIPTIONS", "ESTIMATORS", "INTERVAL_QUANTITIES", "MEAN_OVER_DOCS", "NOT_IDENTIFIED_POST",
    "NOT_IDENTIFIED_REF", "SCALARS", "aggregate", "aggregate_intervals", "aggregate_statistic", "derived_quantities",
    "estimate"
]

#: What each reported quantity is (stored in the variable's ``attrs``; ``divstats.estimands``).
DESCRIPTIONS: dict[str, str] = {e.name: e.description for e in ESTIMANDS}

SCALARS = tuple(DESCRIPTIONS)

ESTIMATORS = {
    "coupled": "crude replicate means over complete coupled trajectories (docs/statistics.md §4)",
    "residual": "residual-branch conditional Monte Carlo, per-replicate formulas of docs/statistics.md §5",
    "reference": "importance weights prod min(1, q/p) along P-samples (docs/statistics.md §7); post-divergence part "
                 "bounded with W = 0 (§6)",
}

NOT_IDENTIFIED_POST = ("the post-divergence tail beyond the observed window W = {W} < T - 1 = {Tm1} is not "
                       "identified; use loss_lower/loss_upper (docs/statistics.md §6)")
NOT_IDENTIFIED_REF = ("reference traces observe nothing after divergence (W = 0); use loss_lower/loss_upper "
                      "(docs/statistics.md §6-7)")

_POST_DEPENDENT = names(post_dependent=True)


def derived_quantities(occ: np.ndarray, exposure: np.ndarray, post: np.ndarray, T: int) -> dict[str, np.ndarray]:
    """The rate and the identity-bound quantities, computed from their parts.

    Parameters
    ----------
    occ, exposure, post : numpy.ndarray
        Means of occurrence, exposure and post_mismatch (same shape).
    T : int
        The horizon.

    Returns
    -------
    dict of str to numpy.ndarray
        ``rate`` (NaN where exposure = 0), ``loss``, ``first_mismatch_contribution``,
        ``exposure_contribution`` and ``mismatch_fraction``; loss = occ + exposure * rate
        and mismatch_fraction = first + exposure contributions hold to rounding.

    Examples
    --------
    >>> import numpy as np
    >>> d = derived_quantities(np.array([0.5]), np.array([4.0]), np.array([1.0]), 10)
    >>> float(d["rate"][0]), round(float(d["mismatch_fraction"][0]), 12)
    (0.25, 0.15)
    """
    pos = exposure > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = np.where(pos, post / np.where(pos, exposure, 1.0), np.nan)
        contrib = np.where(pos, exposure * rate, np.where(np.isnan(post), np.nan, 0.0))
    first = occ / T
    exp_contrib = contrib / T
    return {
        "rate": rate,
        "loss": occ + contrib,
        "first_mismatch_contribution": first,
        "exposure_contribution": exp_contrib,
        "mismatch_fraction": first + exp_contrib,
    }


def _point_and_se(rep: Replicates) -> dict[str, np.ndarray]:
    v, T = rep.values, rep.horizon
    out: dict[str, np.ndarray] = {}
    for name in REPLICATE_ESTIMANDS:
        out[name], out[name + "_se"] = mean_se(v[name])
    # min(tau, T) - 1[tau <= T] = min(tau - 1, T) per replicate: the agreeing tokens
    out["agreeing_tokens"], out["agreeing_tokens_se"] = mean_se(v["rmtd"] - v["occurrence"])
    out.update(derived_quantities(out["occurrence"], out["exposure"], out["post_mismatch"], T))
    _, out["rate_se"] = ratio_se(v["post_mismatch"], v["exposure"])
    out["rate_se"] = np.where(np.isnan(out["rate"]), np.nan, out["rate_se"])
    _, out["loss_se"] = mean_se(v["occurrence"] + v["post_mismatch"])
    out["mismatch_fraction_se"] = out["loss_se"] / T
    out["first_mismatch_contribution_se"] = out["occurrence_se"] / T
    # exposure * rate is the post_mismatch mean itself, so its SE is post_mismatch's
    out["exposure_contribution_se"] = np.where(out["exposure"] > 0, out["post_mismatch_se"] / T,
                                               np.where(np.isnan(out["post_mismatch"]), np.nan, 0.0))
    lower = v["occurrence"] + v["window_mismatch"]
    out["loss_lower"] = out["occurrence"] + out["window_mismatch"]
    out["loss_upper"] = out["loss_lower"] + out["tail_capacity"]
    _, out["loss_lower_se"] = mean_se(lower)
    _, out["loss_upper_se"] = mean_se(lower + v["tail_capacity"])
    out["post_mismatch_exposure_cov"] = cov_of_means(v["post_mismatch"], v["exposure"])
    return out


def _reason(rep: Replicates) -> str | None:
    if rep.identified:
        return None
    if rep.kind == Kind.REFERENCE:
        return NOT_IDENTIFIED_REF
    return NOT_IDENTIFIED_POST.format(W=rep.window, Tm1=rep.horizon - 1)


def _attrs_for(name: str, rep: Replicates) -> dict[str, str]:
    base = name[:-3] if name.endswith("_se") else name
    attrs = {"description": DESCRIPTIONS.get(base, "")}
    if name.endswith("_se"):
        attrs = {"description": f"Monte Carlo standard error of {base} (replicate SD / sqrt(n)"
                                + ("; delta method with cov(R, exposure))" if base == "rate" else ")")}
    if name == "post_mismatch_exposure_cov":
        attrs = {"description": "Monte Carlo covariance of the post_mismatch and exposure estimates "
                                "(used by aggregate for the rate's SE)"}
    reason = _reason(rep)
    if reason and base in _POST_DEPENDENT:
        attrs["not_identified"] = reason
    if base == "rate" and not name.endswith("_se"):
        attrs["when_exposure_zero"] = "NaN (0/0); exposure_contribution is then 0"
    return attrs


def _dataset(rep: Replicates, arrays: dict[str, np.ndarray], attrs: dict) -> xr.Dataset:
    return rep.layout.dataset(arrays, {k: _attrs_for(k, rep) for k in arrays}, attrs)


def _global_attrs(ds: xr.Dataset, rep: Replicates) -> dict:
    return {
        "kind": rep.kind, "estimator": ESTIMATORS[rep.kind], "horizon": rep.horizon,
        "window": rep.window, "n_replicates": int(rep.counts.max(initial=0)),
        "n_replicates_min": int(rep.counts.min()) if rep.counts.size else 0,
        "post_identified": int(rep.identified), "eos_token_id": rep.eos,
        "se_meaning": "Monte Carlo standard error over replicates, conditional on the document",
        "source_producer": str(ds.attrs.get("producer", "")),
    }


def estimate(ds: xr.Dataset, window: int | None = None) -> xr.Dataset:
    """Per-(doc, policy[, model]) estimates of every estimand with Monte Carlo SEs.

    ``window`` truncates the observation window after the fact (coupled traces
    then behave like W-observed residual traces; residual traces can only be
    truncated to W <= their own window).  When W < T - 1 the post-divergence
    quantities are NaN with the reason in ``attrs["not_identified"]`` and only the
    interval (``loss_lower``, ``loss_upper``) is reported for the loss.
    A dask-backed ``ds`` is processed one document chunk at a time (``divstats.traces.chunked``).

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset of any kind.
    window : int, optional
        Truncate the observation window W after divergence.

    Returns
    -------
    xarray.Dataset
        Every name in :data:`SCALARS` and its ``_se``, plus ``post_mismatch_exposure_cov``,
        over (doc, policy[, model]); attrs describe the estimator.

    Raises
    ------
    ValueError
        For an unknown trace kind or a window beyond what the data observe.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.3)}, horizon=5, replicates=4)
    >>> est = estimate(ds)
    >>> bool(abs(est["loss"] - est["occurrence"] - est["exposure"] * est["rate"]).max() < 1e-9)
    True
    """
    if is_lazy(ds):
        return map_docs(estimate, ds, window=window)
    rep = replicate_values(ds, window)
    arrays = _point_and_se(rep)
    order = [n for s in SCALARS for n in (s, s + "_se")] + ["post_mismatch_exposure_cov"]
    return _dataset(rep, {k: arrays[k] for k in order}, _global_attrs(ds, rep))


# --------------------------------------------------------------------------- aggregate

#: Quantities ``aggregate`` averages over documents; the rest are derived from them.
MEAN_OVER_DOCS: tuple[str, ...] = names(aggregate="mean")


def _combine_se(se: xr.DataArray, dim: str) -> xr.DataArray:
    """MC SE of an equal-weight mean of independent per-doc estimates."""
    n = se.sizes[dim]
    return np.sqrt((se ** 2).sum(dim, skipna=False)) / n


def aggregate(estimates: xr.Dataset, dim: str = "doc") -> xr.Dataset:
    """Combine per-document estimates with equal document weights (docs/statistics.md §3).

    occurrence, rmtd, agreeing_tokens, exposure, post_mismatch, window_mismatch and
    tail_capacity are document means; rate = sum post_mismatch / sum exposure; loss, fractions
    and contributions are derived from those parts so the identity holds exactly.

    Two kinds of uncertainty are reported:

    * ``<name>_se``: Monte Carlo SE of the aggregate given these documents,
      sqrt(sum_d se_d^2) / n_docs (documents are simulated independently); the
      rate's uses the delta method with the per-doc cov(post_mismatch, exposure).
    * ``<name>_sd_docs``: SD of the per-document estimates across documents
      (between-document spread, which includes MC noise); ``<name>_sd_docs /
      sqrt(n_docs)`` is the naive SE for a population of documents.  Document-level
      inference (bootstrap, paired tests) belongs to the plans layer.

    Parameters
    ----------
    estimates : xarray.Dataset
        :func:`estimate`'s output.
    dim : str
        The document dim.

    Returns
    -------
    xarray.Dataset
        Every name in :data:`SCALARS` with ``_se`` and ``_sd_docs``, ``dim`` reduced.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.3)}, horizon=5, replicates=4)
    >>> agg = aggregate(estimate(ds))
    >>> agg["occurrence"].dims
    ('policy',)
    """
    estimates = load(estimates)  # per-document estimates are small; a dask-backed one is computed
    T = int(estimates.attrs["horizon"])
    n_docs = estimates.sizes[dim]
    out: dict[str, xr.DataArray] = {}
    for name in MEAN_OVER_DOCS:
        out[name] = estimates[name].mean(dim, skipna=False)
        out[name + "_se"] = _combine_se(estimates[name + "_se"], dim)
    derived = derived_quantities(out["occurrence"].values, out["exposure"].values, out["post_mismatch"].values, T)
    like = out["occurrence"]
    for name, values in derived.items():
        out[name] = like.copy(data=values)
    e, p = out["exposure"], out["post_mismatch"]
    var_p, var_e = out["post_mismatch_se"] ** 2, out["exposure_se"] ** 2
    cov = estimates["post_mismatch_exposure_cov"].sum(dim, skipna=False) / n_docs ** 2
    rate = out["rate"]
    out["rate_se"] = np.sqrt(np.maximum(var_p - 2 * rate * cov + rate ** 2 * var_e, 0.0)) / e.where(e > 0)
    out["loss_se"] = _combine_se(estimates["loss_se"], dim)
    out["mismatch_fraction_se"] = out["loss_se"] / T
    out["first_mismatch_contribution_se"] = out["occurrence_se"] / T
    out["exposure_contribution_se"] = (out["post_mismatch_se"] / T).where(e > 0, 0.0).where(p.notnull())
    out["loss_lower"] = out["occurrence"] + out["window_mismatch"]
    out["loss_upper"] = out["loss_lower"] + out["tail_capacity"]
    out["loss_lower_se"] = _combine_se(estimates["loss_lower_se"], dim)
    out["loss_upper_se"] = _combine_se(estimates["loss_upper_se"], dim)
    ordered: dict[str, xr.DataArray] = {}
    for name in SCALARS:
        ordered[name] = out[name].assign_attrs(estimates[name].attrs)
        ordered[name + "_se"] = out[name + "_se"].assign_attrs(
            description=f"Monte Carlo SE of the document-mean {name} given these documents")
        sd = estimates[name].std(dim, ddof=1) if n_docs > 1 else xr.full_like(out[name], np.nan)
        ordered[name + "_sd_docs"] = sd.assign_attrs(
            description=f"SD of per-document {name} across documents (between-document spread)")
    ordered["rate"].attrs["aggregate"] = "sum_d post_mismatch_d / sum_d exposure_d (exposure-weighted)"
    attrs = dict(estimates.attrs)
    attrs.update(n_docs=n_docs, weights="equal document weights",
                 se_meaning="_se: Monte Carlo SE given the documents; _sd_docs: between-document SD")
    res = xr.Dataset(ordered, attrs=attrs)
    return res.drop_vars([c for c in res.coords if dim in res[c].dims], errors="ignore")


# --------------------------------------------------------------------------- document bootstrap

#: Quantities :func:`aggregate_intervals` gives intervals for (the report's estimates table).
INTERVAL_QUANTITIES: tuple[str, ...] = names(interval=True)


def aggregate_statistic(T: int):
    """Statistic for document_interval: INTERVAL_QUANTITIES from per-document MEAN_OVER_DOCS arrays.

    Parameters
    ----------
    T : int
        The horizon.

    Returns
    -------
    callable
        ``statistic(*arrays)`` over the :data:`MEAN_OVER_DOCS` arrays (documents on
        the last axis) → the :data:`INTERVAL_QUANTITIES`, stacked on axis 0.

    Examples
    --------
    >>> import numpy as np
    >>> f = aggregate_statistic(10)
    >>> v = f(*(np.array([x]) for x in (0.5, 6.0, 5.5, 4.0, 1.0, 1.0, 0.0)))
    >>> float(v[INTERVAL_QUANTITIES.index("rate")])
    0.25
    """
    def statistic(*xs):
        m = dict(zip(MEAN_OVER_DOCS, (x.mean(axis=-1) for x in xs), strict=True))
        with np.errstate(invalid="ignore", divide="ignore"):
            parts = derived_quantities(m["occurrence"], m["exposure"], m["post_mismatch"], T)
        lower = m["occurrence"] + m["window_mismatch"]
        values = {**m, **parts, "loss_lower": lower, "loss_upper": lower + m["tail_capacity"]}
        return np.stack([np.asarray(values[q], dtype=float) for q in INTERVAL_QUANTITIES])
    return statistic


#: Why the rate and its interval are on an unclipped scale (results.nc's ``rate_low``/``_high`` attrs, the report).
RATE_SCALE = ("unclipped: the rate's estimate is a ratio of Monte Carlo estimates, and residual traces' "
              "conditional weighting can put it above 1 although the true rate is at most 1; the interval "
              "is on the same scale, clipped to [0, max(1, estimate)] so that it holds the estimate")

#: The interval quantities that are document means of per-document values in a known range (every
#: ``bounds`` row but the ratios): their intervals follow ``bounded.bounded_mean_interval``'s rule.
BOUNDED_MEANS: tuple[str, ...] = tuple(q for q in INTERVAL_QUANTITIES
                                       if by_name(q).bounds != "none" and by_name(q).aggregate != "ratio")


def _column_interval(arrays: list[np.ndarray], T: int, level: float, method: str, n_resamples: int,
                     seed: int) -> tuple[np.ndarray, np.ndarray, int, int, list[str], str]:
    """One (policy[, model]) column: drop documents without data, then the document interval.

    Returns the ends, documents used and dropped, each quantity's method and the refusal reason
    of the quantities that got no interval ("" if none)."""
    present = np.isfinite(arrays[0]) & np.isfinite(arrays[MEAN_OVER_DOCS.index("exposure")])
    kept = tuple(np.where(np.isnan(a[present]), np.nan, a[present]) for a in arrays)
    statistic = aggregate_statistic(T)
    ci = document_interval(kept, statistic, level=level, method=method,
                           n_resamples=n_resamples, seed=seed, min_docs=MIN_DOCS_AGGREGATE,
                           what="intervals for aggregate estimates")
    lo_b, hi_b = _interval_ranges(T)
    point = ci.point
    # hybrid-t ends are additive and can leave the quantity's range (an occurrence above 1); the truth
    # lies in the range, so clipping to it changes no coverage.  The range is widened to hold the
    # estimate itself: the rate's estimate can exceed 1 (below), and an estimate is never outside its
    # own interval.
    with np.errstate(invalid="ignore"):
        low = np.clip(ci.low, np.fmin(lo_b, point), np.fmax(hi_b, point))
        high = np.clip(ci.high, np.fmin(lo_b, point), np.fmax(hi_b, point))
    how = [ci.reason or ci.method] * len(INTERVAL_QUANTITIES)
    n = int(present.sum())
    if method == "auto" and n >= MIN_DOCS_BOUNDED:
        low, high = _bounded_ends(kept, statistic, point, ci, low, high, how, level, n_resamples, seed, T)
    reasons = {w for w in how if w.startswith("not estimable")}
    return low, high, n, int((~present).sum()), how, "; ".join(sorted(reasons))


def _bounded_ends(kept: tuple[np.ndarray, ...], statistic, point: np.ndarray, ci, low: np.ndarray,
                  high: np.ndarray, how: list[str], level: float, n_resamples: int, seed: int,
                  T: int) -> tuple[np.ndarray, np.ndarray]:
    """The :data:`BOUNDED_MEANS` rows of one column by ``bounded_mean_interval``'s rule (``how`` updated).

    A quantity takes it when its per-document values all lie in its range and average to its
    estimate (Monte Carlo weighting can put a document's value outside: then the resampling
    interval stays)."""
    per_doc = statistic(*(a[:, None] for a in kept))          # (k, n): each document's own value
    lo_b, hi_b = _interval_ranges(T)
    rows = [i for i, q in enumerate(INTERVAL_QUANTITIES) if q in BOUNDED_MEANS
            and np.all(np.isfinite(per_doc[i])) and in_range(per_doc[i], lo_b[i], hi_b[i])
            and np.isclose(per_doc[i].mean(), point[i], rtol=1e-9, atol=1e-12)]
    if not rows:
        return low, high
    width = hi_b[rows] - lo_b[rows]
    unit = (per_doc[rows] - lo_b[rows, None]) / width[:, None]
    bet = betting_interval(unit, level=level, seed=seed)
    bet = ConfidenceInterval(lo_b[rows] + width * bet.low, lo_b[rows] + width * bet.high)
    resampled = None
    if unit.shape[-1] >= BETTING_ONLY_BELOW:
        r = resampled_interval(per_doc[rows], level=level, n_resamples=n_resamples, seed=seed)
        resampled = ConfidenceInterval(r.low, r.high)
    b_low, b_high, chosen = choose_bounded(point[rows], bet, resampled, "hybrid-t", lo_b[rows], hi_b[rows])
    low, high = low.copy(), high.copy()
    low[rows], high[rows] = b_low, b_high
    for i, m in zip(rows, chosen, strict=True):
        how[i] = m
    return low, high


def _interval_ranges(T: int) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) range of each of INTERVAL_QUANTITIES: probabilities and fractions in [0, 1],
    counts of steps in [0, T]; agreeing_tokens is left unbounded."""
    upper = {e.name: value_range(e.name, T)[1] for e in ESTIMANDS if e.bounds != "none"}
    lower = np.array([-np.inf if q not in upper else 0.0 for q in INTERVAL_QUANTITIES])
    return lower, np.array([float(upper.get(q, np.inf)) for q in INTERVAL_QUANTITIES])


def aggregate_intervals(estimates: xr.Dataset, *, level: float = 0.95, n_resamples: int = 2000,
                        seed: int = 0, method: str = "auto") -> xr.Dataset:
    """Intervals over documents for the aggregate quantities (:func:`divstats.estimation.resample.document_interval`).

    Each quantity is recomputed from document means exactly as :func:`aggregate`
    does (rate = sum post / sum exposure, the derived quantities from their parts).
    Documents without data for a policy (NaN occurrence or exposure, e.g. missing
    after a combine) are dropped from that policy's interval explicitly and
    counted in ``n_dropped`` — never resampled as NaN and silently skipped.
    Below ``resample.MIN_DOCS_AGGREGATE`` documents the interval is refused (NaN; the
    reason is in the attrs' ``reason``).

    Parameters
    ----------
    estimates : xarray.Dataset
        Per-document estimates from :func:`estimate` (a ``doc`` dim, ``horizon`` attr).
    level : float
        Confidence level.
    n_resamples : int
        Bootstrap resamples.
    seed : int
        Seed of the resampling.
    method : str
        ``divstats.estimation.resample.METHODS``; ``auto`` is hybrid-t below 100 documents,
        jackknife-t from 100.

    Returns
    -------
    xarray.Dataset
        ``<name>_low`` / ``<name>_high`` over (policy[, model]) for every name in
        :data:`INTERVAL_QUANTITIES`, ``n_docs`` and ``n_dropped``; attrs record
        level, resamples, seed and method.

    Examples
    --------
    >>> import divstats
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(12, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.2)}, horizon=6, replicates=4)
    >>> ci = aggregate_intervals(divstats.estimate(ds), n_resamples=200)
    >>> bool((ci["occurrence_low"] <= ci["occurrence_high"]).all())
    True
    """
    T = int(estimates.attrs["horizon"])
    template = estimates["occurrence"].isel(doc=0, drop=True)
    template = template.drop_vars([c for c in template.coords if not template[c].dims])
    cols = {name: np.asarray(estimates[name].transpose(*template.dims, "doc").values, dtype=float)
            .reshape(-1, estimates.sizes["doc"]) for name in MEAN_OVER_DOCS}
    n_cols = cols["occurrence"].shape[0]
    low = np.full((len(INTERVAL_QUANTITIES), n_cols), np.nan)
    high = low.copy()
    used, dropped, how, refused = np.zeros(n_cols, int), np.zeros(n_cols, int), set(), set()
    method_of = np.empty((len(INTERVAL_QUANTITIES), n_cols), dtype=object)
    for j in range(n_cols):
        lo, hi, used[j], dropped[j], methods, reason = _column_interval(
            [cols[k][j] for k in MEAN_OVER_DOCS], T, level, method, n_resamples, seed)
        low[:, j], high[:, j] = lo, hi
        method_of[:, j] = methods
        how |= {m for m in methods if not m.startswith("not estimable")}
        if reason:
            refused.add(reason)
    shape = template.shape
    out = {}
    for i, name in enumerate(INTERVAL_QUANTITIES):
        used_here = sorted({m for m in method_of[i] if not str(m).startswith("not estimable")})
        attrs = {"method": ", ".join(used_here)} if used_here else {}
        if name == RATE:
            attrs["scale"] = RATE_SCALE
        out[f"{name}_low"] = template.copy(data=low[i].reshape(shape)).assign_attrs(attrs)
        out[f"{name}_high"] = template.copy(data=high[i].reshape(shape)).assign_attrs(attrs)
    out["n_docs"] = template.copy(data=used.reshape(shape)).assign_attrs(
        description="documents with data for this policy (used by the interval)")
    out["n_dropped"] = template.copy(data=dropped.reshape(shape)).assign_attrs(
        description="documents without data for this policy (dropped from its interval, not resampled as NaN)")
    return xr.Dataset(out, attrs={"level": level, "n_resamples": n_resamples, "seed": seed,
                                  "method": f"{method} over documents (divstats.estimation.resample); the bounded "
                                            "means by divstats.estimation.bounded.bounded_mean_interval's rule",
                                  "methods_used": ", ".join(sorted(how)),
                                  "bounded_min_docs": MIN_DOCS_BOUNDED,
                                  "min_docs": MIN_DOCS_AGGREGATE, "reason": "; ".join(sorted(refused))})
