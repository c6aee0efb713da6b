"""Speculative decoding with the evicted model as draft, from reference traces (docs/statistics.md §10).

Along a path sampled from P with log p and log q of each token, let
a_t = min(1, q_t(x_t)/p_t(x_t)).  Given the path, whether position t came from an
accepted draft is Bernoulli(a_t), independently across positions, and the rest of
the path does not depend on it; so E[target calls | path] follows exactly from a
forward recursion over the drafts accepted so far in the running call (0..γ),
for every γ from the same trace.  :func:`speculative` gives the per-document
estimates, :func:`aggregate_speculative` the equal-weight mean over documents
with intervals over documents.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import numpy as np
import xarray as xr

from divstats.errors import DivstatsError
from divstats.estimands import SPECULATIVE_ESTIMANDS
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
from divstats.traces.arrays import core_array, kind_of, layout, mean_se, present_replicates, ratio_se
from divstats.traces.replicates import eos_rows, horizon_of
from protocols import Kind
from protocols.validate import LOGP_ATOL

__all__ = ["DEFAULT_GAMMAS", "SPECULATIVE_METRICS", "SPECULATIVE_VARS", "aggregate_speculative", "expected_calls",
           "speculative"]

#: The draft lengths :func:`speculative` evaluates unless told otherwise.
DEFAULT_GAMMAS: tuple[int, ...] = (1, 2, 3, 4, 6, 8)

#: Variables of :func:`speculative` (each with ``_se``) and what they are (the estimand table).
SPECULATIVE_VARS: dict[str, str] = {e.name: e.description for e in SPECULATIVE_ESTIMANDS}
#: The per-document quantities a plan may test (with ``gamma``), and which direction of A − B is worse.
SPECULATIVE_METRICS: dict[str, str] = {e.name: e.worse for e in SPECULATIVE_ESTIMANDS if e.plan}
_SPEEDUP = ("speedup: T / (target_calls (1 + gamma c)), c = one draft step / one target step "
            "(tokens_per_call / (1 + gamma c) with EOS)")


def _gammas(gamma: int | Iterable[int]) -> tuple[int, ...]:
    values = tuple(gamma) if isinstance(gamma, Iterable) and not isinstance(gamma, str) else (gamma,)
    if not values:
        raise DivstatsError("gamma: give at least one draft length")
    for g in values:
        if isinstance(g, bool) or not isinstance(g, numbers.Integral) or g < 1:
            raise DivstatsError(f"gamma: every draft length must be an integer >= 1, got {g!r}")
    if len(set(values)) != len(values):
        raise DivstatsError(f"gamma: draft lengths repeat in {values}")
    return tuple(sorted(int(g) for g in values))


def _cost_ratio(cost_ratio: float | None) -> float | None:
    if cost_ratio is None:
        return None
    if isinstance(cost_ratio, bool) or not isinstance(cost_ratio, numbers.Real):
        # Reference traces carry no per-step timings of the draft and the target apart
        # (only the request's elapsed_s, both models and the prefill together).
        raise DivstatsError(f"cost_ratio must be a number (one draft step / one target step), got {cost_ratio!r}; "
                            "traces carry no per-step timings of the two models to measure it from")
    c = float(cost_ratio)
    if not np.isfinite(c) or c < 0:
        raise DivstatsError(f"cost_ratio must be finite and >= 0, got {cost_ratio!r}")
    return c


def expected_calls(accept: np.ndarray, length: np.ndarray, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """E[target calls | path] and E[accepted drafts | path] by the forward recursion over j = 0..γ.

    State j at position t: t is the running call's (j+1)-th position.  Below γ it is a
    drafted position, accepted with probability a_t (j → j+1) or rejected (its token is
    the resample, the call ends: → 0); at j = γ it is the bonus token (→ 0).  A call
    opens at every position in state 0, so E[C | path] = Σ_{t≤N} P(state_t = 0).

    Parameters
    ----------
    accept : numpy.ndarray
        a_t in [0, 1], steps on the last axis.
    length : numpy.ndarray
        N per path (leading shape of ``accept``): positions after N are not produced.
    gamma : int
        γ.

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        E[C | path] and E[A | path], the leading shape of ``accept``.

    Examples
    --------
    >>> import numpy as np
    >>> c, a = expected_calls(np.array([[1.0, 1.0, 1.0, 0.0]]), np.array([4]), 2)
    >>> c.tolist(), a.tolist()   # calls open at 1 and 4: accepted, accepted, bonus; then a new call
    ([2.0], [2.0])
    """
    lead, T = accept.shape[:-1], accept.shape[-1]
    a_steps = np.ascontiguousarray(np.moveaxis(accept.reshape(-1, T), -1, 0), dtype=np.float64)   # (T, paths)
    alive = np.arange(T)[:, None] < np.asarray(length).reshape(1, -1)
    n = a_steps.shape[1]
    # The states live in a ring of γ + 1 rows, state j in row (off + j) mod (γ + 1): moving the
    # offset back by one turns every state j into j + 1 for free, so one in-place product by a_t
    # makes every transition j -> j + 1, and only the row that held state γ is rewritten, as the
    # new state 0.
    ring = np.zeros((gamma + 1, n))
    ring[0] = 1.0
    off = 0
    calls = np.zeros(n)
    acc = np.zeros(n)
    last = np.empty(n)
    for t in range(T):
        a, live = a_steps[t], alive[t]
        top = (off + gamma) % (gamma + 1)       # the row of state γ (the bonus position)
        np.copyto(last, ring[top])
        calls += np.where(live, ring[off], 0.0)
        acc += np.where(live, a * (1.0 - last), 0.0)   # mass at drafted slots times a_t
        ring *= a
        ring[top] = (1.0 - last) * (1.0 - a) + last     # rejected or bonus: a new call opens at t + 1
        off = top
    calls, acc = calls.reshape(lead), acc.reshape(lead)
    return calls, acc


def _locate(ds: xr.Dataset, lay, idx: tuple[int, ...]) -> str:
    row, rep, step = idx
    where = np.unravel_index(row, lay.shape)
    parts = [f"{d}={ds[d].values[i]!s}" if d in ds.coords else f"{d}={i}"
             for d, i in zip(lay.dims, where, strict=True)]
    return ", ".join([*parts, f"replicate={rep}", f"step={int(ds['step'].values[step])}"])


def _replicate_values(ds: xr.Dataset, gammas: tuple[int, ...]):
    """(calls, accepted) per (rows, replicate, gamma), tokens per (rows, replicate), and the layout."""
    lay = layout(ds)
    core = ("replicate", "step")
    x = core_array(ds, "x_token", lay, core)
    lp = core_array(ds, "x_logp", lay, core).astype(np.float64)
    lq = core_array(ds, "x_logq", lay, core).astype(np.float64)
    T = horizon_of(ds)
    eos = eos_rows(ds, lay)
    is_eos = (x[..., None] == eos[:, None, None, :]).any(axis=-1) & (x >= 0)
    length = np.where(is_eos.any(axis=-1), is_eos.argmax(axis=-1) + 1, T)
    present = present_replicates(ds, lay)
    produced = (np.arange(T) < length[..., None]) & present[..., None]
    for name, arr, bad, what in (
            ("x_logp", lp, ~np.isfinite(lp) | (lp > LOGP_ATOL),
             "not a finite log-probability <= 0 (a token sampled from P has positive probability under P)"),
            ("x_logq", lq, np.isnan(lq) | (lq > LOGP_ATOL), "NaN or > 0 (-inf is allowed: Q gives the token no mass)")):
        hit = bad & produced
        if hit.any():
            first = tuple(int(i[0]) for i in np.nonzero(hit))
            raise DivstatsError(f"{name} is {what} at {_locate(ds, lay, first)}: {arr[first]!r}")
    with np.errstate(invalid="ignore", over="ignore"):
        # exp(-inf) = 0 where Q gives no mass; outside the produced positions the value is unused.
        accept = np.where(produced, np.exp(np.minimum(0.0, lq - lp)), 0.0)
    calls = np.empty(length.shape + (len(gammas),))
    acc = np.empty_like(calls)
    for k, g in enumerate(gammas):
        calls[..., k], acc[..., k] = expected_calls(accept, length, g)
    tokens = length.astype(np.float64)
    calls[~present], acc[~present] = np.nan, np.nan
    tokens[~present] = np.nan
    return calls, acc, tokens, lay


def speculative(ds: xr.Dataset, gamma: int | Iterable[int] = DEFAULT_GAMMAS,
                cost_ratio: float | None = None) -> xr.Dataset:
    """Per-document estimates of speculative decoding with Q as the draft and P as the target.

    Parameters
    ----------
    ds : xarray.Dataset
        A ``reference`` trace dataset (P-samples with ``x_logp`` and ``x_logq``).
    gamma : int or sequence of int
        Draft lengths γ to evaluate, all from the same traces.
    cost_ratio : float, optional
        c = the cost of one draft step / one target step.  With it, ``speedup``
        and ``best_gamma`` are added.  Only a number is accepted: the traces record
        no per-step timings of the two models apart.

    Returns
    -------
    xarray.Dataset
        Over (doc, policy, gamma) (and any other leading dim of ``ds``):
        ``target_calls``, ``tokens``, ``accepted``, ``tokens_per_call``,
        ``accepted_per_call``, each with ``_se`` (Monte Carlo SE over replicates;
        delta method for the ratios) and, with a cost ratio, ``speedup``,
        ``speedup_se`` and ``best_gamma`` (over doc, policy).

    Raises
    ------
    DivstatsError
        Traces that are not of the reference kind, a bad γ or cost ratio, or
        log-probabilities that cannot be a P-sample's (NaN, log p = -inf, > 0),
        located by coordinate.

    Examples
    --------
    >>> import numpy as np
    >>> from divstats.truth.simulate import simulate
    >>> p = lambda h: np.array([0.6, 0.4])
    >>> q = lambda h: np.array([0.5, 0.5])
    >>> ds = simulate(p, q, 2, horizon=8, replicates=50, kind="reference", seed=1)
    >>> spec = speculative(ds, gamma=(1, 4), cost_ratio=0.1)
    >>> dict(spec["tokens_per_call"].sizes)
    {'doc': 1, 'policy': 1, 'gamma': 2}
    """
    kind = kind_of(ds)
    if kind != Kind.REFERENCE:
        raise DivstatsError(f"speculative needs reference traces (P-samples with log p and log q), got {kind!r} "
                            "traces (docs/statistics.md §10)")
    gammas = _gammas(gamma)
    c = _cost_ratio(cost_ratio)
    calls, acc, tokens, lay = _replicate_values(ds, gammas)
    # the replicate axis last for the moment helpers: (rows, gamma, replicate)
    calls_r, acc_r = np.moveaxis(calls, 1, -1), np.moveaxis(acc, 1, -1)
    tok_r = np.broadcast_to(tokens[:, None, :], calls_r.shape)
    values = {}
    values["target_calls"] = mean_se(calls_r)
    values["tokens"] = mean_se(tok_r)
    values["accepted"] = mean_se(acc_r)
    values["tokens_per_call"] = ratio_se(tok_r, calls_r)
    values["accepted_per_call"] = ratio_se(acc_r, calls_r)
    extra = {"gamma": np.asarray(gammas, dtype=np.int32)}
    out: dict[str, xr.DataArray] = {}
    for name, (m, se) in values.items():
        out[name] = lay.wrap(m, ("gamma",), extra, {"description": SPECULATIVE_VARS[name]})
        out[name + "_se"] = lay.wrap(se, ("gamma",), extra, {"description": f"Monte Carlo SE of {name}"})
    attrs = {"horizon": horizon_of(ds), "kind": kind, "estimator": "forward recursion over drafts accepted "
             "(docs/statistics.md §10)", "cost_ratio": np.nan if c is None else c}
    spec = xr.Dataset(out, attrs=attrs)
    return _with_speedup(spec, c) if c is not None else spec


def _with_speedup(spec: xr.Dataset, c: float) -> xr.Dataset:
    scale = 1.0 + spec["gamma"] * c
    spec["speedup"] = (spec["tokens_per_call"] / scale).assign_attrs(description=_SPEEDUP)
    spec["speedup_se"] = (spec["tokens_per_call_se"] / scale).assign_attrs(description="Monte Carlo SE of speedup")
    spec["best_gamma"] = _best_gamma(spec["speedup"])
    return spec


def _best_gamma(speedup: xr.DataArray) -> xr.DataArray:
    filled = speedup.fillna(-np.inf)
    best = speedup["gamma"].values[filled.argmax("gamma").values]
    best = np.where(speedup.notnull().any("gamma").values, best, -1)
    return xr.DataArray(best.astype(np.int32), dims=tuple(d for d in speedup.dims if d != "gamma"),
                        coords={k: v for k, v in speedup.coords.items() if "gamma" not in v.dims and k != "gamma"},
                        attrs={"description": "the gamma of the largest speedup (-1: none estimable)"})


def _statistic(scale: float):
    """Per-document (calls, tokens, accepted) means -> the aggregate rows, equal document weights."""
    def statistic(calls: np.ndarray, tokens: np.ndarray, accepted: np.ndarray) -> np.ndarray:
        mc, mt, ma = calls.mean(-1), tokens.mean(-1), accepted.mean(-1)
        tpc = mt / mc
        return np.stack([mc, tpc, ma / mc, tpc / scale])   # the rows on axis 0, as document_interval wants
    return statistic


_AGG = ("target_calls", "tokens_per_call", "accepted_per_call", "speedup")


def _ranges(gamma: float, horizon: float, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """The possible values of :data:`_AGG`'s quantities at one γ: calls in [1, T], tokens per
    call in [1, γ + 1], accepted drafts per call in [0, γ], speedup tokens per call / scale."""
    return (np.array([1.0, 1.0, 0.0, 1.0 / scale]),
            np.array([max(horizon, 1.0), gamma + 1.0, gamma, (gamma + 1.0) / scale]))


def _bounded_calls(calls: np.ndarray, point: float, horizon: float, level: float, n_resamples: int,
                   seed: int) -> tuple[float, float, str]:
    """target_calls' interval by ``bounded_mean_interval``'s rule (its values lie in [0, T])."""
    bet = betting_interval(calls[None], 0.0, horizon, level=level, seed=seed)
    res = None
    if calls.size >= BETTING_ONLY_BELOW:
        r = resampled_interval(calls[None], level=level, n_resamples=n_resamples, seed=seed)
        res = ConfidenceInterval(r.low, r.high)
    lo, hi, how = choose_bounded(np.array([point]), ConfidenceInterval(bet.low, bet.high), res, "hybrid-t",
                                 0.0, horizon)
    return float(lo[0]), float(hi[0]), how[0]


def aggregate_speculative(spec: xr.Dataset, *, level: float = 0.95, n_resamples: int = 2000, seed: int = 0,
                          method: str = "auto", dim: str = "doc") -> xr.Dataset:
    """Combine :func:`speculative`'s per-document estimates with equal document weights.

    target_calls is the mean over documents; tokens_per_call and accepted_per_call
    are ratios of document means (sum of tokens / sum of calls, as ``rate`` in
    ``divstats.aggregate``); speedup is tokens_per_call / (1 + γ c).  ``_se`` is
    the Monte Carlo SE given the documents; ``_low``/``_high`` the interval over
    documents of ``divstats.estimation.resample.document_interval`` (refused, NaN,
    below ``MIN_DOCS_AGGREGATE`` documents, the reason in attrs ``reason``).

    Parameters
    ----------
    spec : xarray.Dataset
        :func:`speculative`'s output.
    level : float
        Confidence level.
    n_resamples, seed : int
        For the bootstrap.
    method : str
        ``divstats.estimation.resample.METHODS``.
    dim : str
        The document dim.

    Returns
    -------
    xarray.Dataset
        Over (policy, gamma): the rows above with ``_se``, ``_low``, ``_high``
        (speedup only with a cost ratio), ``n_docs``, and ``best_gamma`` per policy.

    Examples
    --------
    >>> import numpy as np
    >>> from divstats.truth.simulate import simulate
    >>> p = lambda h: np.array([0.6, 0.4])
    >>> q = lambda h: np.array([0.5, 0.5])
    >>> ds = simulate(p, q, 2, horizon=8, replicates=20, kind="reference", seed=1)
    >>> agg = aggregate_speculative(speculative(ds, gamma=(2, 4)))
    >>> agg["tokens_per_call"].dims, agg.attrs["reason"][:13]
    (('policy', 'gamma'), 'not estimable')
    """
    c = float(spec.attrs.get("cost_ratio", np.nan))
    has_speedup = np.isfinite(c)
    calls = spec["target_calls"].transpose(..., "gamma", dim)
    template = calls.isel({dim: 0}, drop=True)
    template = template.drop_vars([k for k in template.coords if k not in template.dims and
                                   any(d == dim for d in spec[k].dims)], errors="ignore")
    arrays = [np.asarray(spec[n].transpose(*calls.dims).values, dtype=float).reshape(-1, spec.sizes[dim])
              for n in ("target_calls", "tokens", "accepted")]
    gam = np.broadcast_to(template["gamma"].values, template.shape).reshape(-1)
    scale = 1.0 + gam * (c if has_speedup else 0.0)
    cols = arrays[0].shape[0]
    point = np.full((len(_AGG), cols), np.nan)
    low, high = point.copy(), point.copy()
    used = np.zeros(cols, int)
    methods = [""] * cols
    reasons: set[str] = set()
    for j in range(cols):
        ok = np.isfinite(arrays[0][j]) & np.isfinite(arrays[1][j]) & np.isfinite(arrays[2][j])
        used[j] = int(ok.sum())
        if not used[j]:
            continue
        ci = document_interval(tuple(a[j][ok] for a in arrays), _statistic(float(scale[j])), level=level,
                               method=method, n_resamples=n_resamples, seed=seed, min_docs=MIN_DOCS_AGGREGATE)
        # each end clipped to what the quantity can be (as the estimand table's ranges clip
        # the other estimands): a call emits 1..γ+1 tokens and accepts 0..γ drafts, so at
        # least one call is made and at most T; at ten documents hybrid-t's ends can
        # otherwise leave that range
        lo_b, hi_b = _ranges(float(gam[j]), float(spec.attrs.get("horizon", np.inf)), float(scale[j]))
        point[:, j] = ci.point
        low[:, j], high[:, j] = np.clip(ci.low, lo_b, hi_b), np.clip(ci.high, lo_b, hi_b)
        calls_j = arrays[0][j][ok]
        if method == "auto" and used[j] >= MIN_DOCS_BOUNDED and in_range(calls_j, 0.0, hi_b[0]):
            # target_calls is a document mean of counts in [0, T]: the bounded rule, as for the
            # estimand table's bounded estimands (divstats.estimation.bounded)
            low[0, j], high[0, j], methods[j] = _bounded_calls(calls_j, ci.point[0], hi_b[0], level,
                                                               n_resamples, seed)
            low[0, j] = min(max(low[0, j], lo_b[0]), ci.point[0])     # at least one call
        if ci.reason:
            reasons.add(ci.reason)
    n_docs = spec.sizes[dim]
    se_calls = np.sqrt((spec["target_calls_se"] ** 2).sum(dim, skipna=False)) / n_docs
    mc = spec["target_calls"].mean(dim, skipna=False)
    mt = spec["tokens"].mean(dim, skipna=False)
    # delta method for the ratio of document means, from each document's ratio SE
    se_ratio = {n: np.sqrt(((spec[n + "_se"] * spec["target_calls"]) ** 2).sum(dim, skipna=False)) / (n_docs * mc)
                for n in ("tokens_per_call", "accepted_per_call")}
    out: dict[str, xr.DataArray] = {}
    for i, name in enumerate(_AGG):
        if name == "speedup" and not has_speedup:
            continue
        desc = _SPEEDUP if name == "speedup" else SPECULATIVE_VARS[name]
        out[name] = template.copy(data=point[i].reshape(template.shape)).assign_attrs(
            description=f"{desc}; equal document weights")
        if name == "target_calls":
            se = se_calls
        elif name == "speedup":
            se = se_ratio["tokens_per_call"] / (1.0 + spec["gamma"] * c)
        else:
            se = se_ratio[name]
        out[name + "_se"] = se.transpose(*template.dims).assign_attrs(
            description=f"Monte Carlo SE of the document-mean {name} given these documents")
        out[name + "_low"] = template.copy(data=low[i].reshape(template.shape))
        out[name + "_high"] = template.copy(data=high[i].reshape(template.shape))
    out["tokens"] = mt.transpose(*template.dims).assign_attrs(description=SPECULATIVE_VARS["tokens"])
    out["n_docs"] = template.copy(data=used.reshape(template.shape)).assign_attrs(
        description="documents with data (used by the interval)")
    agg = xr.Dataset(out, attrs={**spec.attrs, "level": level, "n_resamples": n_resamples, "seed": seed,
                                 "method": f"{method} over documents (divstats.estimation.resample)",
                                 "min_docs": MIN_DOCS_AGGREGATE, "reason": "; ".join(sorted(reasons)),
                                 "target_calls_method": ", ".join(sorted(set(methods) - {""})),
                                 "weights": "equal document weights"})
    if has_speedup:
        agg["best_gamma"] = _best_gamma(agg["speedup"])
    return agg
