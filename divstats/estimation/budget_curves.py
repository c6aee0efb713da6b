"""Fidelity against budget: each family's curve, pointwise intervals, a simultaneous band, the crossing.

For one estimand and one policy family (``divstats.estimation.sweeps``), the curve is
the mean over documents of the per-document estimate at each member, against the KV
it keeps (docs/statistics.md §11).  The documents are shared across the budgets, so
uncertainty comes from resampling **documents** (whole rows of the document x budget
table), never points:

* pointwise: the studentized bootstrap (``estimation.resample.bootstrap_t``) per
  budget, equal tails, level ``level``;
* simultaneous over the family's budgets: the studentized max-|t| band,
  mean_j ± c · se_j with c the ``level`` quantile of max_j |t*_j| over the same
  resamples, so that with probability ``level`` every budget's true mean is inside
  at once (measured: docs/statistics.md §11);
* the crossing: where the curve meets a stated level, linearly interpolated in KV
  kept between the two budgets around it, with the interval where the band meets it
  (a descriptive: the band's crossings, not a test).

Refused below :data:`MIN_DOCS_BAND` documents (NaN and the reason), like every interval
over documents.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import xarray as xr

from divstats.estimands import value_range
from divstats.estimation.bounded import bounded_mean_interval, in_range
from divstats.estimation.resample import MIN_DOCS_AGGREGATE, bootstrap_t, too_few_documents
from divstats.estimation.sweeps import family_values, sweep_families

__all__ = ["MIN_DOCS_BAND", "Band", "budget_curves", "crossing", "simultaneous_band"]

#: The band and the pointwise intervals are reported from this many complete documents:
#: the aggregates' threshold; the band's simultaneous coverage on the skewed population
#: at n = 10 is in docs/statistics.md §11.
MIN_DOCS_BAND = MIN_DOCS_AGGREGATE


class Band(NamedTuple):
    """A curve over budgets with its pointwise intervals and simultaneous band (arrays over budgets)."""

    mean: np.ndarray
    se: np.ndarray
    low: np.ndarray
    high: np.ndarray
    band_low: np.ndarray
    band_high: np.ndarray
    critical: float
    n_docs: int
    reason: str


def simultaneous_band(values: np.ndarray, level: float = 0.95, *, n_resamples: int = 1999, seed: int = 0,
                      min_docs: int = MIN_DOCS_BAND) -> Band:
    """Pointwise intervals and the max-|t| simultaneous band of column means, resampling rows (documents).

    Parameters
    ----------
    values : array_like
        (document x budget); documents with a NaN anywhere are left out (complete rows only).
    level : float
        Confidence level, pointwise and simultaneous.
    n_resamples, seed : int
        Bootstrap resamples of the documents and their seed.
    min_docs : int
        Refusal threshold.

    Returns
    -------
    Band

    Examples
    --------
    >>> import numpy as np
    >>> v = np.random.default_rng(0).normal([0.0, 0.1, 0.3], 0.05, (40, 3))
    >>> b = simultaneous_band(v, n_resamples=499)
    >>> bool(np.all(b.band_high - b.band_low >= b.high - b.low)), b.critical > 1.96
    (True, True)
    """
    x = np.asarray(values, dtype=float)
    x = x[np.all(np.isfinite(x), axis=1)]
    n, k = x.shape
    nan = np.full(k, math.nan)
    mean = x.mean(axis=0) if n else nan
    reason = too_few_documents(n, min_docs, "bands over budgets")
    if reason:
        return Band(mean, nan, nan, nan, nan, nan, math.nan, n, reason)
    root_n = math.sqrt(n)
    se = x.std(axis=0, ddof=1) / root_n
    t = bootstrap_t((x.T,), lambda a: a.mean(axis=-1), mean, n_resamples, seed,
                    standard_error=lambda a: a.std(axis=-1, ddof=1) / root_n, batch=max(1, 200_000 // (n * k)))
    t = np.nan_to_num(t, posinf=1e150, neginf=-1e150)      # (k, B); a resample with no spread: an infinite end
    a = (1 - level) / 2
    q_hi, q_lo = np.quantile(t, [1 - a, a], axis=-1)
    critical = float(np.quantile(np.max(np.abs(t), axis=0), level))
    return Band(mean, se, mean - q_hi * se, mean - q_lo * se, mean - critical * se, mean + critical * se,
                critical, n, "")


def crossing(kept: Sequence[float], curve: Sequence[float], level: float, worse: str = "larger") -> float:
    """Where a curve over budgets (most KV kept first) first reaches ``level`` on its worse side.

    Linear interpolation in KV kept between the last budget short of the level and
    the first at or past it.  NaN when the first budget is already past it, or no
    budget reaches it.

    Parameters
    ----------
    kept : sequence of float
        KV kept at each budget, most first.
    curve : sequence of float
        The curve's value at each budget.
    level : float
        The level to meet (e.g. the margin).
    worse : {"larger", "smaller"}, optional
        Which side of ``level`` is worse.

    Returns
    -------
    float
        The KV kept where the curve meets ``level``, or NaN.

    Examples
    --------
    >>> crossing([0.9, 0.7, 0.5], [0.0, 0.02, 0.06], 0.04)
    0.6
    >>> import math; math.isnan(crossing([0.9, 0.5], [0.0, 0.01], 0.04))
    True
    """
    kept, curve = np.asarray(kept, dtype=float), np.asarray(curve, dtype=float)
    past = curve >= level if worse == "larger" else curve <= level
    if not past.any() or past[0] or not np.all(np.isfinite(curve)):
        return math.nan
    j = int(np.argmax(past))
    frac = (level - curve[j - 1]) / (curve[j] - curve[j - 1])
    return float(kept[j - 1] + frac * (kept[j] - kept[j - 1]))


def _crossing_interval(kept: np.ndarray, band: Band, level: float, worse: str) -> tuple[float, float]:
    """(low, high) in KV kept: where the band's two edges meet the level; the family's ends where one does not."""
    early, late = (band.band_high, band.band_low) if worse == "larger" else (band.band_low, band.band_high)
    first = crossing(kept, early, level, worse)      # the pessimistic edge reaches the level first (more KV kept)
    last = crossing(kept, late, level, worse)
    passed = (lambda c: c >= level) if worse == "larger" else (lambda c: c <= level)
    if math.isnan(first) and np.isfinite(early).all() and passed(early[0]):
        first = float(kept[0])                         # already past at the first budget: the end is censored
    if math.isnan(last) and np.isfinite(late).all() and not passed(late).any():
        last = float(kept[-1])                         # never reached within the family: censored at the last
    return last, first


def budget_curves(estimates: xr.Dataset, metric: str, *, families: Sequence[str] | None = None,
                  level: float = 0.95, cross: float | None = None, worse: str = "larger",
                  n_resamples: int = 1999, seed: int = 0) -> xr.Dataset:
    """Each family's curve of ``metric`` against KV kept, with pointwise intervals and a simultaneous band.

    Parameters
    ----------
    estimates : xarray.Dataset
        ``divstats.estimate(ds)`` (per doc and policy[, model]).
    metric : str
        An estimand (a variable of ``estimates``); the curve is its mean over documents
        of the per-document values (for ``rate``: the mean of the documents' rates).
    families : sequence of str, optional
        Default: every family of two or more members (``divstats.sweep_families``).
    level : float
        Level of the pointwise intervals and of the band.
    cross : float, optional
        A level of ``metric`` (e.g. the margin): report where each curve meets it.
    worse : {"larger", "smaller"}
        Which side of ``cross`` is worse.
    n_resamples, seed : int
        Bootstrap resamples of the documents, and their seed.

    Returns
    -------
    xarray.Dataset
        Dims ``family`` x ``budget`` (the member's position, most KV kept first; shorter
        families padded with NaN) [x ``model``]: coords ``policy`` and ``kept``; variables
        ``mean``, ``se``, ``low``, ``high`` (pointwise), ``band_low``, ``band_high``
        (simultaneous), and per family ``critical``, ``n_docs``, ``crossing``,
        ``crossing_low``, ``crossing_high``, ``reason``; each with a ``description``.

    Examples
    --------
    >>> import divstats
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(8, {"snapkv@0.9": PolicyEffect(0.01), "snapkv@0.5": PolicyEffect(0.1),
    ...                         "snapkv@0.3": PolicyEffect(0.2)}, horizon=6, replicates=4)
    >>> bc = budget_curves(divstats.estimate(ds), "occurrence", cross=0.05, n_resamples=99)
    >>> bc["policy"].values.tolist()
    [['snapkv@0.9', 'snapkv@0.5', 'snapkv@0.3']]
    >>> bc["kept"].values.tolist()
    [[0.9, 0.5, 0.3]]
    """
    models = [str(m) for m in estimates["model"].values] if "model" in estimates.dims else [None]
    fams = list(families) if families is not None else list(sweep_families(estimates))
    # a metric of known range keeps its intervals inside it: bootstrap-t's end is infinite where a
    # resample of documents has no spread (0/1 accuracies near a bound), and the range's end is the
    # honest end there; the estimate itself stays inside (a rate above 1 widens the range to it)
    bounds = value_range(metric, estimates.attrs.get("horizon"))
    parts = [_curves_one_model(estimates, metric, fams, m, level, cross, worse, n_resamples, seed, bounds)
             for m in models]
    out = parts[0] if models == [None] else xr.concat(parts, dim=xr.DataArray(models, dims="model", name="model"))
    out.attrs.update(metric=metric, level=level, worse=worse, cross=math.nan if cross is None else cross,
                     n_resamples=n_resamples,
                     description=f"mean {metric} over documents against the KV kept, per policy family")
    return out


_DESCRIPTIONS = {
    "mean": "mean over documents of the per-document estimate",
    "se": "standard error over documents",
    "low": ("pointwise interval, lower end (studentized bootstrap over documents; for a metric of known range "
            "the bounded-means rule, docs/plans.md 'Bounded estimands')"),
    "high": "pointwise interval, upper end",
    "band_low": "band simultaneous over the family's budgets, lower end (max-|t| bootstrap over documents)",
    "band_high": "simultaneous band, upper end",
    "critical": "the band's critical value: the level quantile of max |t*| over the family",
    "n_docs": "documents with values for every member",
    "crossing": "KV kept where the curve meets the crossing level (linear interpolation; descriptive)",
    "crossing_low": "where the band meets the crossing level, lower end (censored at the family's ends)",
    "crossing_high": "where the band meets the crossing level, upper end",
    "reason": "why the intervals are missing, if they are",
}


def _within(band: Band, values: np.ndarray, bounds: tuple[float, float] | None, level: float,
            n_resamples: int, seed: int) -> Band:
    """For a metric of known range: pointwise intervals valid for bounded means (the betting rule,
    :func:`~divstats.estimation.bounded.bounded_mean_interval`) and the band clipped to the range,
    widened to hold the estimate (a rate above 1)."""
    if bounds is None or band.reason:
        return band
    x = np.asarray(values, dtype=float)
    x = x[np.all(np.isfinite(x), axis=1)]
    lo, hi = np.fmin(bounds[0], band.mean), np.fmax(bounds[1], band.mean)
    if in_range(x, *bounds):
        ends = [bounded_mean_interval(x[:, j], *bounds, level=level, n_resamples=n_resamples, seed=seed)
                for j in range(x.shape[1])]
        low = np.array([np.ravel(e.low)[0] for e in ends], dtype=float)
        high = np.array([np.ravel(e.high)[0] for e in ends], dtype=float)
    else:   # per-document values outside the range (a rate above 1): the resampling ends, clipped
        low, high = band.low, band.high
    return band._replace(low=np.clip(low, lo, hi), high=np.clip(high, lo, hi),
                         band_low=np.clip(band.band_low, lo, hi), band_high=np.clip(band.band_high, lo, hi))


def _curves_one_model(estimates: xr.Dataset, metric: str, families: list[str], model: str | None, level: float,
                      cross: float | None, worse: str, n_resamples: int, seed: int,
                      bounds: tuple[float, float] | None = None) -> xr.Dataset:
    rows = []
    for fam in families:
        values, members, kept, _ = family_values(estimates, fam, metric, model=model)
        band = _within(simultaneous_band(values, level, n_resamples=n_resamples, seed=seed), values, bounds,
                       level, n_resamples, seed)
        c = lo = hi = math.nan
        if cross is not None:
            c = crossing(kept, band.mean, cross, worse)
            lo, hi = _crossing_interval(kept, band, cross, worse) if not band.reason else (math.nan, math.nan)
        rows.append((members, kept, band, c, lo, hi))
    width = max((len(r[0]) for r in rows), default=0)

    def pad(a, fill=math.nan):
        return list(a) + [fill] * (width - len(a))
    data = {name: (("family", "budget"), np.array([pad(getattr(r[2], name)) for r in rows], dtype=float))
            for name in ("mean", "se", "low", "high", "band_low", "band_high")}
    data["critical"] = ("family", np.array([r[2].critical for r in rows], dtype=float))
    data["n_docs"] = ("family", np.array([r[2].n_docs for r in rows], dtype=np.int64))
    data["crossing"] = ("family", np.array([r[3] for r in rows], dtype=float))
    data["crossing_low"] = ("family", np.array([r[4] for r in rows], dtype=float))
    data["crossing_high"] = ("family", np.array([r[5] for r in rows], dtype=float))
    data["reason"] = ("family", np.array([r[2].reason for r in rows], dtype=object))
    ds = xr.Dataset(data, coords={
        "family": families, "budget": np.arange(width),
        "policy": (("family", "budget"), np.array([pad(r[0], "") for r in rows], dtype=object)),
        "kept": (("family", "budget"), np.array([pad(r[1]) for r in rows], dtype=float))})
    for name, text in _DESCRIPTIONS.items():
        ds[name].attrs["description"] = text
    ds["kept"].attrs["description"] = "fraction of the prompt's KV cache kept (achieved where recorded, else nominal)"
    ds["policy"].attrs["description"] = "the member's policy id"
    return ds
