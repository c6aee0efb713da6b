"""Gap decomposition between two policies (docs/statistics.md §3).

For policies A and B on the same documents and horizon T, the aggregate mismatch
fractions satisfy M = o/T + e·ρ/T with o, e the document means of occurrence and
exposure and ρ = Σ post_mismatch / Σ exposure. The gap M_A − M_B splits exactly into

    Δfirst    = (o_A − o_B)/T
    Δexposure = (e_A − e_B)·(ρ_A + ρ_B)/(2T)      (Shapley, the default)
    Δrate     = (ρ_A − ρ_B)·(e_A + e_B)/(2T)

and the two ordered (one-at-a-time) splits:

    exposure-first:  Δexposure = (e_A − e_B)·ρ_B/T,  Δrate = (ρ_A − ρ_B)·e_A/T
    rate-first:      Δrate = (ρ_A − ρ_B)·e_B/T,      Δexposure = (e_A − e_B)·ρ_A/T

A policy whose aggregate exposure is 0 has an undefined rate (0/0). Its exposure ×
rate term is 0 whatever the rate, so for attribution we borrow the other policy's
rate (0 when both are undefined): no rate difference is invented, and the parts
still sum to the gap exactly. The result records when this happened.

Uncertainty: intervals over documents (A and B always on the same documents) from
:func:`divstats.estimation.resample.document_interval` — hybrid-t below 100 documents and
jackknife-t from there on by default; bootstrap-t, BCa or percentile on request —
for the gap, its parts and the shares part / gap. The gap's and the parts'
intervals are refused below ``resample.MIN_DOCS_PARTS`` documents and the shares'
below ``resample.MIN_DOCS_SHARES`` (NaN, with the reason; the thresholds come from
the coverage table in docs/plans.md), and the shares are refused whenever the
gap's interval covers 0: a share of a gap that may be 0 or of either sign means
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import xarray as xr

from divstats.estimation.estimators import estimate
from divstats.estimation.resample import MIN_DOCS_PARTS, MIN_DOCS_SHARES, document_interval, too_few_documents
from divstats.intervals import ConfidenceInterval

__all__ = [
    "ATTRIBUTIONS", "PARTS", "DecompositionInterval", "DecompositionResult", "Parts", "as_estimates",
    "PartIntervals", "decompose", "decomposition_interval", "estimates_horizon", "parts_and_shares", "split_gap"
]

ATTRIBUTIONS: tuple[str, ...] = ("shapley", "exposure-first", "rate-first")
PARTS: tuple[str, ...] = ("gap", "first", "exposure", "rate")
_NEEDED = ("occurrence", "exposure", "post_mismatch")


class Parts(NamedTuple):
    """The gap and its three parts (floats, or DataArrays over ``model``)."""

    gap: Any
    first: Any
    exposure: Any
    rate: Any


@dataclass(frozen=True)
class DecompositionInterval:
    """Confidence intervals over documents for the gap, its parts and their shares.

    ``share_low``/``share_high`` hold the intervals of part / gap (``gap`` is 1);
    they are NaN, with ``share_reason`` saying why, where the gap's interval covers
    0 or there are too few documents for shares. ``reason`` is set when the
    intervals of the gap and its parts are not reported (too few documents; the
    thresholds are ``resample.MIN_DOCS_PARTS`` and ``MIN_DOCS_SHARES``).
    """

    low: Parts
    high: Parts
    confidence_level: float
    method: str
    n_resamples: int
    share_low: Parts | None = None
    share_high: Parts | None = None
    reason: str = ""
    share_reason: str = ""

    @property
    def interval(self) -> ConfidenceInterval:
        """The intervals of the gap and its parts, ``ConfidenceInterval(low, high)`` of :class:`Parts`."""
        return ConfidenceInterval(self.low, self.high)

    @property
    def share_interval(self) -> ConfidenceInterval | None:
        """The intervals of the shares part / gap (None when not computed)."""
        return None if self.share_low is None else ConfidenceInterval(self.share_low, self.share_high)

    def to_dataset(self) -> xr.Dataset:
        """The bounds as ``<part>_low`` / ``<part>_high`` and ``share_<part>_low`` / ``_high``
        variables (scalars or over ``model``; shares NaN where refused)."""
        data = {}
        for name in PARTS:
            data[f"{name}_low"] = _as_da(getattr(self.low, name))
            data[f"{name}_high"] = _as_da(getattr(self.high, name))
        if self.share_low is not None:
            for name in PARTS[1:]:
                data[f"share_{name}_low"] = _as_da(getattr(self.share_low, name))
                data[f"share_{name}_high"] = _as_da(getattr(self.share_high, name))
        return xr.Dataset(data, attrs={"confidence_level": self.confidence_level, "method": self.method,
                                       "n_resamples": self.n_resamples, "reason": self.reason,
                                       "share_reason": self.share_reason})

    def to_frame(self):
        """One row per quantity (and model), columns ``low``/``high`` (shares as ``share_<part>``)."""
        rows = []
        pairs = [(name, getattr(self.low, name), getattr(self.high, name)) for name in PARTS]
        if self.share_low is not None:
            pairs += [(f"share_{name}", getattr(self.share_low, name), getattr(self.share_high, name))
                      for name in PARTS[1:]]
        for name, lo, hi in pairs:
            if isinstance(lo, xr.DataArray):
                for m in lo["model"].values:
                    rows.append({"model": str(m), "quantity": name,
                                 "low": float(lo.sel(model=m)), "high": float(hi.sel(model=m))})
            else:
                rows.append({"quantity": name, "low": float(lo), "high": float(hi)})
        return pd.DataFrame(rows)


# ---------------------------------------------------------------------------
# Core arithmetic (vectorised over any leading axes; documents on the last axis)
# ---------------------------------------------------------------------------

def split_gap(o_a, o_b, e_a, e_b, p_a, p_b, horizon: float, attribution: str) -> np.ndarray:
    """Aggregate two policies' per-document parts and split the gap.

    Parameters
    ----------
    o_a, o_b, e_a, e_b, p_a, p_b : numpy.ndarray
        Per-document occurrence, exposure and post_mismatch of A and B, documents
        on the last axis (any leading axes, e.g. bootstrap resamples).
    horizon : float
        T.
    attribution : str
        One of :data:`ATTRIBUTIONS`.

    Returns
    -------
    numpy.ndarray
        Stacked on axis 0 as (gap, first, exposure, rate, M_A, M_B, rho_A, rho_B),
        the document axis reduced.

    Raises
    ------
    ValueError
        For an unknown attribution.

    Examples
    --------
    >>> import numpy as np
    >>> one = np.ones(3)
    >>> out = split_gap(one * 0.5, one * 0.25, one * 4, one * 2, one, one * 0.5, 10, "shapley")
    >>> bool(np.isclose(out[0], out[1] + out[2] + out[3]))
    True
    """
    oa, ob = o_a.mean(-1), o_b.mean(-1)
    ea, eb = e_a.mean(-1), e_b.mean(-1)
    pa, pb = p_a.mean(-1), p_b.mean(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        ra = np.where(ea > 0, pa / np.where(ea > 0, ea, 1.0), np.nan)
        rb = np.where(eb > 0, pb / np.where(eb > 0, eb, 1.0), np.nan)
    # Undefined rate (no exposure): borrow the other policy's rate, or 0 (see module doc).
    ra_att = np.where(np.isnan(ra), np.where(np.isnan(rb), 0.0, rb), ra)
    rb_att = np.where(np.isnan(rb), ra_att, rb)
    t = float(horizon)
    first = (oa - ob) / t
    if attribution == "shapley":
        exp_part = (ea - eb) * (ra_att + rb_att) / (2 * t)
        rate_part = (ra_att - rb_att) * (ea + eb) / (2 * t)
    elif attribution == "exposure-first":
        exp_part = (ea - eb) * rb_att / t
        rate_part = (ra_att - rb_att) * ea / t
    elif attribution == "rate-first":
        rate_part = (ra_att - rb_att) * eb / t
        exp_part = (ea - eb) * ra_att / t
    else:
        raise ValueError(f"unknown attribution {attribution!r}; expected one of {ATTRIBUTIONS}")
    m_a = (oa + pa) / t
    m_b = (ob + pb) / t
    return np.stack([m_a - m_b, first, exp_part, rate_part, m_a, m_b, ra, rb])


# ---------------------------------------------------------------------------
# Input handling
# ---------------------------------------------------------------------------

def _is_estimate(ds: xr.Dataset) -> bool:
    return all(v in ds.data_vars for v in _NEEDED) and "replicate" not in ds.dims


def as_estimates(ds: xr.Dataset, window: int | None = None) -> xr.Dataset:
    """Per-document estimates from a trace dataset, or ``ds`` itself if it already is one.

    Parameters
    ----------
    ds : xarray.Dataset
        Traces or per-document estimates.
    window : int, optional
        Observation window for ``divstats.estimate``.

    Returns
    -------
    xarray.Dataset
        Per-document estimates.

    Raises
    ------
    ValueError
        For a dataset that is neither.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.3)}, horizon=5, replicates=4)
    >>> est = as_estimates(ds)
    >>> as_estimates(est) is est
    True
    """
    if _is_estimate(ds):
        return ds
    if "replicate" not in ds.dims:
        raise ValueError("expected a trace dataset (with a replicate dim) or an estimate "
                         f"dataset with {', '.join(_NEEDED)}; got variables {sorted(ds.data_vars)}")
    return estimate(ds, window=window)


def estimates_horizon(est: xr.Dataset) -> int:
    """T of per-document estimates: the attrs, else loss / mismatch_fraction.

    (:func:`divstats.traces.replicates.horizon_of` reads T from a trace dataset.)

    Parameters
    ----------
    est : xarray.Dataset
        Per-document estimates.

    Returns
    -------
    int
        T.

    Raises
    ------
    ValueError
        When neither the attribute nor loss / mismatch_fraction give it.

    Examples
    --------
    >>> import xarray as xr
    >>> estimates_horizon(xr.Dataset(attrs={"horizon": 8}))
    8
    """
    if "horizon" in est.attrs:
        return int(est.attrs["horizon"])
    if "loss" in est and "mismatch_fraction" in est:
        ratio = (est["loss"] / est["mismatch_fraction"]).values
        ratio = ratio[np.isfinite(ratio)]
        if ratio.size:
            return int(round(float(np.median(ratio))))
    raise ValueError("cannot determine the horizon T: no 'horizon' attr on the dataset")


def _per_doc(est: xr.Dataset, policy: str, model: Any | None) -> tuple[np.ndarray, ...]:
    if policy not in est["policy"].values:
        raise ValueError(f"policy {policy!r} is not in the data; available: "
                         f"{[str(p) for p in est['policy'].values]}")
    sub = est.sel(policy=policy)
    if model is not None:
        sub = sub.sel(model=model)
    return tuple(np.asarray(sub[v].transpose("doc").values, dtype=float) for v in _NEEDED)


def _paired_docs(est: xr.Dataset, a: str, b: str, model: Any | None) -> tuple[np.ndarray, ...]:
    o_a, e_a, p_a = _per_doc(est, a, model)
    o_b, e_b, p_b = _per_doc(est, b, model)
    arrays = (o_a, o_b, e_a, e_b, p_a, p_b)
    if np.isnan(p_a[np.isfinite(e_a) & (e_a > 0)]).any() or np.isnan(p_b[np.isfinite(e_b) & (e_b > 0)]).any():
        raise ValueError(
            "post_mismatch is not identified (branches observed for W < T - 1 steps); the gap "
            "cannot be decomposed. Use the sharp interval (divstats.sharp_interval) instead.")
    # A document must be present for both policies (NaN occurrence = no data).
    keep = np.all([np.isfinite(x) for x in (o_a, o_b, e_a, e_b)], axis=0)
    return tuple(np.nan_to_num(x[keep]) for x in arrays)


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class DecompositionResult:
    """Gap ``M_A − M_B`` and its exact split (scipy-style named fields).

    ``gap``, ``first``, ``exposure``, ``rate`` and ``shares`` are floats, or
    DataArrays over ``model`` when the data hold several models. ``ordered`` maps
    each ordered attribution name to its :class:`Parts` (the Shapley split is the
    average of the two).
    """

    a: str
    b: str
    attribution: str
    horizon: int
    n_docs: Any
    gap: Any
    first: Any
    exposure: Any
    rate: Any
    shares: Parts
    mismatch_a: Any
    mismatch_b: Any
    rate_a: Any
    rate_b: Any
    ordered: dict[str, Parts]
    undefined_rate: bool
    _data: dict[Any, tuple[np.ndarray, ...]] = field(repr=False, default_factory=dict)

    @property
    def parts(self) -> Parts:
        return Parts(self.gap, self.first, self.exposure, self.rate)

    def confidence_interval(self, level: float = 0.95, *, method: str = "auto",
                            n_resamples: int = 1999, seed: int = 0) -> DecompositionInterval:
        """Intervals over documents (the same documents for A and B) for the gap, parts and shares.

        ``method`` is ``"auto"`` (hybrid-t below 100 documents, jackknife-t from 100),
        ``"hybrid-t"``, ``"bootstrap-t"``, ``"jackknife-t"``, ``"BCa"`` or ``"percentile"``
        (:func:`divstats.estimation.resample.document_interval`); see docs/plans.md for the
        coverage each reaches by number of documents.
        """
        results = {key: decomposition_interval(arrays, self.horizon, self.attribution, level, method,
                                               n_resamples, seed)
                   for key, arrays in self._data.items()}
        keys = list(self._data)
        pick = lambda what: _assemble([getattr(results[k], what) for k in keys], keys)  # noqa: E731
        reasons = [f"{'' if k is None else f'model {k}: '}{results[k].reason}" for k in keys if results[k].reason]
        share_reasons = [f"{'' if k is None else f'model {k}: '}{results[k].share_reason}" for k in keys
                         if results[k].share_reason]
        return DecompositionInterval(low=pick("low"), high=pick("high"), confidence_level=level,
                                     method=method, n_resamples=n_resamples,
                                     share_low=pick("share_low"), share_high=pick("share_high"),
                                     reason="; ".join(reasons), share_reason="; ".join(share_reasons))

    def to_dataset(self) -> xr.Dataset:
        """The point estimates as an xarray Dataset (attrs name A, B, attribution)."""
        data = {}
        for name in PARTS:
            data[name] = _as_da(getattr(self, name))
            data[f"share_{name}"] = _as_da(getattr(self.shares, name))
        for name, parts in self.ordered.items():
            for part in ("first", "exposure", "rate"):
                data[f"{part}_{name.replace('-', '_')}"] = _as_da(getattr(parts, part))
        data["mismatch_a"] = _as_da(self.mismatch_a)
        data["mismatch_b"] = _as_da(self.mismatch_b)
        data["rate_a"] = _as_da(self.rate_a)
        data["rate_b"] = _as_da(self.rate_b)
        data["n_docs"] = _as_da(self.n_docs)
        return xr.Dataset(data, attrs={"a": self.a, "b": self.b, "attribution": self.attribution,
                                       "horizon": self.horizon,
                                       "undefined_rate": int(self.undefined_rate)})


def _as_da(x: Any) -> xr.DataArray:
    """A float or DataArray as a DataArray."""
    return x if isinstance(x, xr.DataArray) else xr.DataArray(x)


def _assemble(values: list[np.ndarray], keys: list[Any]) -> Parts:
    """Parts from per-model vectors (gap, first, exposure, rate, ...)."""
    if keys == [None]:
        return Parts(*(float(values[0][i]) for i in range(4)))
    stacked = np.stack(values)  # (model, quantity)
    return Parts(*(xr.DataArray(stacked[:, i], dims="model", coords={"model": keys}) for i in range(4)))


@dataclass(frozen=True)
class PartIntervals:
    """One model's intervals: vectors over (gap, first, exposure, rate)."""

    low: np.ndarray
    high: np.ndarray
    share_low: np.ndarray
    share_high: np.ndarray
    reason: str
    share_reason: str


def parts_and_shares(horizon: int, attribution: str):
    """Statistic for document_interval: (gap, first, exposure, rate, shares of the three parts).

    Parameters
    ----------
    horizon : int
        T.
    attribution : str
        One of :data:`ATTRIBUTIONS`.

    Returns
    -------
    callable
        ``statistic(o_A, o_B, e_A, e_B, post_A, post_B)`` → 7 values (documents on the last axis).

    Examples
    --------
    >>> import numpy as np
    >>> f = parts_and_shares(10, "shapley")
    >>> v = f(*(np.array([x]) for x in (0.5, 0.3, 4.0, 2.0, 1.0, 0.4)))
    >>> bool(np.isclose(v[1:4].sum(), v[0])), bool(np.isclose(v[4:].sum(), 1.0))
    (True, True)
    """
    def statistic(*xs):
        v = split_gap(*xs, horizon, attribution)
        with np.errstate(invalid="ignore", divide="ignore"):
            shares = v[1:4] / np.where(v[0] != 0, v[0], np.nan)
        return np.concatenate([v[:4], shares])
    return statistic


def decomposition_interval(arrays: tuple[np.ndarray, ...], horizon: int, attribution: str = "shapley",
                           level: float = 0.95, method: str = "auto", n_resamples: int = 1999,
                           seed: int = 0) -> PartIntervals:
    """Intervals for the gap, its parts and the shares from per-document arrays (one model).

    ``arrays`` is ``(o_A, o_B, e_A, e_B, post_A, post_B)`` over the same documents.
    The gap's and the parts' intervals are refused (NaN, ``reason``) below
    ``resample.MIN_DOCS_PARTS`` documents; the shares (NaN, ``share_reason``) below
    ``resample.MIN_DOCS_SHARES`` documents and when the gap's interval covers 0.

    Parameters
    ----------
    arrays : tuple of numpy.ndarray
        Per-document values, as :func:`split_gap` takes them.
    horizon : int
        T.
    attribution : str
        One of :data:`ATTRIBUTIONS`.
    level : float
        Confidence level.
    method : str
        ``divstats.estimation.resample.METHODS``.
    n_resamples, seed : int
        For the bootstrap methods.

    Returns
    -------
    PartIntervals
        Bounds of (gap, first, exposure, rate) and of the shares, with the reasons.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> o = rng.uniform(0.2, 0.8, (2, 24)); e = o * 5; p = e * 0.3
    >>> ci = decomposition_interval((o[0], o[1] * 1.5, e[0], e[1], p[0], p[1]), 10, n_resamples=199)
    >>> bool(ci.low[0] <= ci.high[0]), ci.reason
    (True, '')
    """
    n = arrays[0].shape[-1]
    ci = document_interval(arrays, parts_and_shares(horizon, attribution), level=level, method=method,
                           n_resamples=n_resamples, seed=seed, min_docs=min(MIN_DOCS_PARTS, MIN_DOCS_SHARES))
    low, high = ci.low[:4].copy(), ci.high[:4].copy()
    s_low, s_high = np.concatenate([[1.0], ci.low[4:]]), np.concatenate([[1.0], ci.high[4:]])
    reason = too_few_documents(n, MIN_DOCS_PARTS, "intervals for the gap and its parts")
    share_reason = too_few_documents(n, MIN_DOCS_SHARES, "intervals for shares")
    # the gap's interval gates the shares even with too few documents to report it
    if not share_reason and low[0] <= 0.0 <= high[0]:
        share_reason = (f"shares not reported: the gap's {level:.0%} interval [{low[0]:.4g}, {high[0]:.4g}] "
                        "covers 0")
    if share_reason:
        s_low[1:], s_high[1:] = np.nan, np.nan
    if reason:
        low[:], high[:] = np.nan, np.nan
    return PartIntervals(low, high, s_low, s_high, reason, share_reason)


def _models(est: xr.Dataset) -> list[Any]:
    return [m for m in est["model"].values] if "model" in est.dims else [None]


def decompose(ds: xr.Dataset, a: str, b: str, attribution: str = "shapley", *,
              window: int | None = None) -> DecompositionResult:
    """Split the mismatch-fraction gap between policies ``a`` and ``b`` (docs/statistics.md §3).

    ``ds`` is a trace dataset (estimated with ``divstats.estimate``) or an estimate
    dataset. With a ``model`` dim, each model is decomposed separately and the
    fields are DataArrays over ``model``. Documents missing for either policy are
    dropped; ``n_docs`` is the number used.

    Parameters
    ----------
    ds : xarray.Dataset
        Traces or per-document estimates.
    a, b : str
        The two policies; the gap is M_A − M_B.
    attribution : {"shapley", "exposure-first", "rate-first"}
        How the exposure × rate term is split.
    window : int, optional
        Observation window when ``ds`` holds traces.

    Returns
    -------
    DecompositionResult
        The gap, its parts and shares; ``confidence_interval()`` bootstraps them.

    Raises
    ------
    ValueError
        For an unknown attribution or policy, no common documents, or a
        post-divergence part that is not identified.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.3)}, horizon=5, replicates=4)
    >>> d = decompose(ds, "b", "a")
    >>> bool(abs(d.gap - (d.first + d.exposure + d.rate)) < 1e-12)
    True
    """
    if attribution not in ATTRIBUTIONS:
        raise ValueError(f"unknown attribution {attribution!r}; expected one of {ATTRIBUTIONS}")
    est = as_estimates(ds, window)
    horizon = estimates_horizon(est)
    models = _models(est)
    data = {m: _paired_docs(est, a, b, m) for m in models}
    for m, arrays in data.items():
        if arrays[0].size == 0:
            where = f" for model {m!r}" if m is not None else ""
            raise ValueError(f"no document has estimates for both {a!r} and {b!r}{where}")
    main = [split_gap(*data[m], horizon, attribution) for m in models]
    ordered_raw = {name: [split_gap(*data[m], horizon, name) for m in models]
                   for name in ("exposure-first", "rate-first")}
    pick = _picker(models)
    gap, first, exp_part, rate_part = (pick(main, i) for i in range(4))
    shares = Parts(*(_share(pick(main, i), gap) for i in range(4)))
    undefined = any(np.isnan(v[6]) or np.isnan(v[7]) for v in main)
    return DecompositionResult(
        a=a, b=b, attribution=attribution, horizon=horizon,
        n_docs=pick([np.array([data[m][0].size] * 8) for m in models], 0),
        gap=gap, first=first, exposure=exp_part, rate=rate_part, shares=shares,
        mismatch_a=pick(main, 4), mismatch_b=pick(main, 5), rate_a=pick(main, 6),
        rate_b=pick(main, 7),
        ordered={name: Parts(*(pick(vals, i) for i in range(4))) for name, vals in ordered_raw.items()},
        undefined_rate=bool(undefined), _data=data,
    )


def _share(part: Any, gap: Any) -> Any:
    """part / gap, NaN where the gap is exactly 0 (shares are undefined there)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        if isinstance(gap, xr.DataArray):
            return (part / gap).where(gap != 0)
        return float(part) / gap if gap != 0 else float("nan")


def _picker(models: Sequence[Any]):
    """Select quantity ``i`` from per-model result vectors: float, or DataArray over model."""
    def pick(values: list[np.ndarray], i: int) -> Any:
        if list(models) == [None]:
            v = values[0][i]
            return int(v) if np.issubdtype(np.asarray(v).dtype, np.integer) else float(v)
        return xr.DataArray(np.array([v[i] for v in values]), dims="model", coords={"model": list(models)})
    return pick
