"""Curves over time: the survival function S(t) and branch-aligned TV by age (docs/statistics.md §3, §5, §7).

``branch_tv[k] = E[delta_{tau+k} | tau + k <= T]`` is a ratio of expectations, so
every kind is estimated as mean(numerator) / mean(denominator) over replicates
with a delta-method SE:

* coupled: numerator tv_{tau+k} 1[tau + k <= T], denominator 1[tau + k <= T];
* residual: numerator w delta_{t*+k} 1[t* + k <= T], denominator w 1[t* + k <= T]
  with w = 1 - S_T (docs/statistics.md §4-5): the self-normalised ratio, whose
  numerator and denominator come from the same sampled branch, so it lies in
  [0, 1] and is NaN (count 0) where no branch reached the age;
* reference: not identified (the TV after divergence is never observed).

``branch_tv_denominator`` estimates P(tau + k <= T): the mean indicator for
coupled traces, the mean of sum_{t <= T-k} pi_t over the whole law of tau for
residual traces.  The Monte Carlo SE carries a small-count correction and is
NaN below :data:`MIN_SE_COUNT` replicates (see :func:`small_count_se`).
"""

from __future__ import annotations

import numpy as np
import xarray as xr
from scipy import stats

from divstats.errors import DivstatsError
from divstats.traces.arrays import (
    core_array,
    kind_of,
    layout,
    mean_se,
    nanmean,
    present_replicates,
    ratio_se,
    row_chunks,
)
from divstats.traces.chunked import map_docs
from divstats.traces.replicates import (
    effective_window,
    first_divergence,
    horizon_of,
    reference_survival,
    survival_terms,
)
from protocols import Kind, logit_vars
from protocols.chunks import is_lazy

__all__ = ["LOGIT_CURVES", "MIN_SE_COUNT", "branch_tv", "branch_tv_window", "logit_curves", "small_count_se",
           "survival"]


def _n_replicates(ds: xr.Dataset, lay) -> int:
    """Most replicates present in any row (padding after a combine does not count)."""
    return int(present_replicates(ds, lay).sum(-1).max(initial=0))


def _survival_rows(ds: xr.Dataset, lay, T: int) -> np.ndarray:
    """Per-replicate S_t, t = 0..T, as (rows, n, T + 1)."""
    kind = kind_of(ds)
    n = lay.n_replicates
    out = np.empty((lay.rows, n, T + 1))
    out[..., 0] = 1.0
    core = ("replicate", "step")
    if kind == Kind.COUPLED:
        x, y = (core_array(ds, v, lay, core) for v in ("x_token", "y_token"))
        for sl in row_chunks(lay.rows, n * T):
            _, tau = first_divergence(x[sl], y[sl], T)
            out[sl, :, 1:] = tau[..., None] > np.arange(1, T + 1)
    elif kind == Kind.RESIDUAL:
        stv = core_array(ds, "shared_tv", lay, core)
        for sl in row_chunks(lay.rows, n * T):
            out[sl, :, 1:] = survival_terms(stv[sl])[0]
    else:
        lp, lq = (core_array(ds, v, lay, core) for v in ("x_logp", "x_logq"))
        for sl in row_chunks(lay.rows, n * T):
            out[sl, :, 1:] = reference_survival(lp[sl], lq[sl])
    out[~present_replicates(ds, lay)] = np.nan
    return out


def survival(ds: xr.Dataset) -> xr.Dataset:
    """S(t) = P(tau > t) for t = 0..T with Monte Carlo SEs, over (doc, policy[, model], step).

    coupled: the empirical survival of tau (docs/statistics.md §4); residual: the mean of
    S_t = prod_{s<=t} (1 - delta_s) on the survival paths (§5); reference: the mean
    of prod_{s<=t} min(1, q_s/p_s) along P-samples (§7).  ``step`` runs 0..T.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset of any kind.

    Returns
    -------
    xarray.Dataset
        ``survival`` and ``survival_se`` over (doc, policy[, model], step).

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(2, {"a": PolicyEffect(0.2)}, horizon=5, replicates=4)
    >>> s = survival(ds)
    >>> s["survival"].dims, float(s["survival"].isel(step=0).min())
    (('doc', 'policy', 'step'), 1.0)
    """
    if is_lazy(ds):
        return map_docs(survival, ds)
    lay, T = layout(ds), horizon_of(ds)
    s = _survival_rows(ds, lay, T)
    m, se = mean_se(np.moveaxis(s, 1, -1))
    step = {"step": np.arange(T + 1)}
    return xr.Dataset(
        {"survival": lay.wrap(m, ("step",), step, {"description": "S(t) = P(tau > t), S(0) = 1"}),
         "survival_se": lay.wrap(se, ("step",), step, {"description": "Monte Carlo SE of S(t)"})},
        attrs={"kind": kind_of(ds), "horizon": T, "n_replicates": _n_replicates(ds, lay)},
    )


# --------------------------------------------------------------------------- branch TV

#: Fewest replicates reaching an age for which ``branch_tv_se`` is reported; below it
#: the SE is NaN ("not available"): with so few values no SE covered in simulation
#: (tests/test_divstats_sparse.py, docs/statistics.md §4).
MIN_SE_COUNT = 5


def small_count_se(se: np.ndarray, count: np.ndarray, min_count: int | None = None) -> np.ndarray:
    """Delta-method SE of a ratio at an age reached by ``count`` replicates, made honest.

    Given the replicates that reach the age, the ratio is a (weighted) mean of
    ``count`` values, and the delta-method SE is their SD with divisor ``count``
    where the unbiased divisor is ``count - 1``; with few values estimate +- 1.96 SE
    then undercovers.  The SE is multiplied by sqrt(c / (c - 1)) and by
    t_{0.975, c-1} / z_{0.975}, so that +- 1.96 SE is the Student-t interval on
    c - 1 degrees of freedom, and is NaN where c < ``min_count`` (default
    :data:`MIN_SE_COUNT`) or where the SE is 0 (all values seen at the age equal).

    Parameters
    ----------
    se : numpy.ndarray
        Delta-method SEs.
    count : numpy.ndarray
        Replicates reaching each age (same shape).
    min_count : int, optional
        Fewest replicates for a reported SE.

    Returns
    -------
    numpy.ndarray
        The corrected SEs, NaN below ``min_count``.

    Examples
    --------
    >>> import numpy as np
    >>> small_count_se(np.array([0.1, 0.1]), np.array([3, 20])).round(3).tolist()
    [nan, 0.11]
    """
    c = np.asarray(count, dtype=float)
    # A zero SE (every value seen at the age equal) would claim certainty that rare
    # paths with other values cannot exist: not available either.
    ok = (c >= max(MIN_SE_COUNT if min_count is None else min_count, 2)) & (np.nan_to_num(se) > 1e-12)
    cs = np.where(ok, c, 2.0)
    factor = np.sqrt(cs / (cs - 1.0)) * stats.t.ppf(0.975, cs - 1.0) / stats.norm.ppf(0.975)
    return np.where(ok, se * factor, np.nan)


def _coupled_branch(tv: np.ndarray, x: np.ndarray, y: np.ndarray, T: int, W: int):
    """(numerator, denominator, observed, law denominator) per replicate and age, coupled traces."""
    _, tau = first_divergence(x, y, T)
    ages = np.arange(T)
    idx = tau[..., None] - 1 + ages                      # 0-based step of tau + k
    valid = (idx <= T - 1) & (ages <= W)
    vals = np.take_along_axis(tv.astype(np.float64), np.clip(idx, 0, T - 1), axis=-1)
    den = valid.astype(np.float64)
    return np.where(valid, vals, 0.0), den, valid, den


def _residual_branch(stv: np.ndarray, tstar: np.ndarray, btv: np.ndarray, T: int, W: int):
    """(numerator, denominator, observed, law denominator) per replicate and age, residual traces.

    Numerator and denominator both come from the sampled branch (weight
    w = 1 - S_T where the branch reaches age k, else 0); the law denominator
    sum_{t <= T-k} pi_t uses the whole law of tau and is reported separately.
    """
    s, pi = survival_terms(stv)
    occ = np.where(tstar > 0, 1.0 - s[..., -1], 0.0)
    ages = np.arange(btv.shape[-1])
    K = np.where(tstar > 0, np.minimum(W, T - tstar), -1)
    observed = ages <= K[..., None]
    num = np.where(observed, occ[..., None] * np.nan_to_num(btv.astype(np.float64)), 0.0)
    den = np.where(observed, occ[..., None], 0.0)
    cum_pi = np.cumsum(pi, axis=-1)
    # law denominator at age k: sum_{t <= T-k} pi_t = cum_pi[T - k - 1]
    return num, den, observed, cum_pi[..., T - 1 - ages]


def _branch_rows(ds: xr.Dataset, window: int | None, reducer):
    """Apply ``reducer(num, den, observed, law_den)`` chunk by chunk; returns stacked results."""
    kind, T = kind_of(ds), horizon_of(ds)
    if kind == Kind.REFERENCE:
        raise _NotIdentified("reference traces never observe the branches after divergence")
    W = effective_window(ds, window)
    lay = layout(ds)
    n = lay.n_replicates
    if kind == Kind.COUPLED:
        arrays = [core_array(ds, v, lay, ("replicate", "step")) for v in ("tv", "x_token", "y_token")]
        fn = lambda a, b, c: _coupled_branch(a, b, c, T, W)  # noqa: E731
    else:
        arrays = [core_array(ds, "shared_tv", lay, ("replicate", "step")),
                  core_array(ds, "branch_step", lay, ("replicate",)),
                  core_array(ds, "branch_tv", lay, ("replicate", "age"))]
        fn = lambda a, b, c: _residual_branch(a, b, c, T, W)  # noqa: E731
    present = present_replicates(ds, lay)

    def masked(sl):
        num, den, observed, law = fn(*(a[sl] for a in arrays))
        absent = ~present[sl][..., None]
        nan = lambda v: np.where(absent, np.nan, v)  # noqa: E731
        return nan(num), nan(den), observed & ~absent, nan(law)

    parts = [reducer(*masked(sl)) for sl in row_chunks(lay.rows, 3 * n * T)]
    return lay, T, W, [np.concatenate(p, axis=0) for p in zip(*parts, strict=True)]


class _NotIdentified(DivstatsError, ValueError):
    """Branch TV cannot be estimated from these traces (caught in branch_tv: NaN with the reason)."""


def _per_age(num: np.ndarray, den: np.ndarray, observed: np.ndarray, law: np.ndarray):
    a = lambda v: np.moveaxis(v, 1, -1)  # noqa: E731  (rows, age, n)
    r, se = ratio_se(a(num), a(den))
    count = a(observed).sum(axis=-1)
    return r, small_count_se(se, count), nanmean(a(law)), count


def branch_tv(ds: xr.Dataset, window: int | None = None) -> xr.Dataset:
    """Branch-aligned TV by age k = 0..T-1 over (doc, policy[, model], age).

    Variables: ``branch_tv`` (ratio estimate, in [0, 1]), ``branch_tv_se`` (delta
    method with the small-count correction of :func:`small_count_se`; NaN when
    fewer than :data:`MIN_SE_COUNT` replicates reach the age),
    ``branch_tv_denominator`` (estimate of P(tau + k <= T)) and ``branch_tv_count``
    (replicates whose branch was observed at that age; report it beside every
    value).  Ages beyond the observed window W, and ages no replicate reached
    (count 0), are NaN.

    Parameters
    ----------
    ds : xarray.Dataset
        Coupled or residual traces (reference traces give NaN with the reason in
        ``attrs["not_identified"]``).
    window : int, optional
        Truncate the observation window W after divergence.

    Returns
    -------
    xarray.Dataset
        ``branch_tv``, ``branch_tv_se``, ``branch_tv_denominator``, ``branch_tv_count``
        over (doc, policy[, model], age).

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(2, {"a": PolicyEffect(0.2)}, horizon=5, replicates=4)
    >>> branch_tv(ds)["branch_tv"].sizes["age"]
    5
    """
    if is_lazy(ds):
        return map_docs(branch_tv, ds, window=window)
    T = horizon_of(ds)
    age = {"age": np.arange(T)}
    try:
        lay, T, W, (r, se, den, count) = _branch_rows(ds, window, _per_age)
    except _NotIdentified as exc:
        lay = layout(ds)
        nan = np.full((lay.rows, T), np.nan)
        attrs = {"not_identified": str(exc)}
        return xr.Dataset({name: lay.wrap(nan, ("age",), age, attrs) for name in
                           ("branch_tv", "branch_tv_se", "branch_tv_denominator", "branch_tv_count")},
                          attrs={"kind": kind_of(ds), "horizon": T})
    beyond = np.arange(T) > W
    r, se = np.where(beyond, np.nan, r), np.where(beyond, np.nan, se)
    attrs_r = {"description": "E[delta_{tau+k} | tau + k <= T]: TV between the branches' laws k steps "
                              "after divergence"}
    if beyond.any():
        attrs_r["not_identified"] = f"ages k > W = {W} are not observed"
    return xr.Dataset({
        "branch_tv": lay.wrap(r, ("age",), age, attrs_r),
        "branch_tv_se": lay.wrap(se, ("age",), age, {
            "description": "delta-method Monte Carlo SE x sqrt(c/(c-1)) t_{c-1}/z (c = branch_tv_count)",
            "not_available": f"NaN where fewer than {MIN_SE_COUNT} replicates reach the age, or where "
                             "every value seen at the age is equal (a zero SE would claim certainty)"}),
        "branch_tv_denominator": lay.wrap(den, ("age",), age,
                                          {"description": "estimate of P(tau + k <= T)"}),
        "branch_tv_count": lay.wrap(count, ("age",), age,
                                    {"description": "replicates with the branch observed at age k"}),
    }, attrs={"kind": kind_of(ds), "horizon": T, "window": W, "n_replicates": _n_replicates(ds, lay)})


def branch_tv_window(ds: xr.Dataset, start: int, stop: int, window: int | None = None) -> xr.Dataset:
    """Per-document average of branch_tv over ages ``start <= k < stop`` (like ``range``).

    The average is the unweighted mean of the per-age ratio estimates over ages
    whose denominator estimate is positive (ages where no branch can reach are
    skipped; ``branch_tv_window_ages`` says how many were used).  Its SE is the
    delta method on the replicate influence values
    (1/m) sum_k (num_ik - r_k den_ik) / mean(den_k), so the correlation between
    ages of one replicate is accounted for.  Ages beyond the observed window make
    the average NaN (not identified) rather than silently shorter.

    Parameters
    ----------
    ds : xarray.Dataset
        Coupled or residual traces.
    start, stop : int
        Ages ``start <= k < stop``.
    window : int, optional
        Truncate the observation window W after divergence.

    Returns
    -------
    xarray.Dataset
        ``branch_tv_window``, its ``_se`` and ``branch_tv_window_ages`` over (doc, policy[, model]).

    Raises
    ------
    ValueError
        Unless 0 <= start < stop <= T.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(2, {"a": PolicyEffect(0.2)}, horizon=5, replicates=4)
    >>> sorted(branch_tv_window(ds, 1, 3).data_vars)[0]
    'branch_tv_window'
    """
    if is_lazy(ds):
        return map_docs(branch_tv_window, ds, start=start, stop=stop, window=window)
    T = horizon_of(ds)
    if not 0 <= start < stop <= T:
        raise ValueError(f"need 0 <= start < stop <= T = {T}, got start={start}, stop={stop}")

    def reducer(num, den, observed, law):
        num, den = num[..., start:stop], den[..., start:stop]          # (rows, n, m)
        mn, md = nanmean(np.moveaxis(num, 1, -1)), nanmean(np.moveaxis(den, 1, -1))  # (rows, m)
        ok = md > 0
        safe = np.where(ok, md, 1.0)
        r = np.where(ok, mn / safe, 0.0)
        m = ok.sum(axis=-1)
        m_safe = np.maximum(m, 1)
        avg = np.where(m > 0, r.sum(axis=-1) / m_safe, np.nan)
        # absent replicates have NaN num/den, hence NaN influence: mean_se skips them
        infl = (np.where(ok, 1.0 / safe, 0.0)[:, None, :] * (num - r[:, None, :] * den)).sum(-1)
        _, se = mean_se(infl / m_safe[:, None])
        return avg, np.where(m > 0, se, np.nan), m

    attrs = {"description": f"mean of branch_tv over ages {start} <= k < {stop}", "start": start,
             "stop": stop}
    try:
        lay, T, W, (avg, se, m) = _branch_rows(ds, window, reducer)
    except _NotIdentified as exc:
        lay = layout(ds)
        nan = np.full(lay.rows, np.nan)
        attrs["not_identified"] = str(exc)
        return xr.Dataset({"branch_tv_window": lay.wrap(nan, attrs=attrs),
                           "branch_tv_window_se": lay.wrap(nan, attrs=attrs),
                           "branch_tv_window_ages": lay.wrap(np.zeros(lay.rows, int))})
    if stop - 1 > W:
        attrs["not_identified"] = f"ages up to {stop - 1} requested but only ages <= W = {W} are observed"
        avg, se = np.full_like(avg, np.nan), np.full_like(se, np.nan)
    return xr.Dataset({
        "branch_tv_window": lay.wrap(avg, attrs=attrs),
        "branch_tv_window_se": lay.wrap(se, attrs={"description": "delta-method Monte Carlo SE"}),
        "branch_tv_window_ages": lay.wrap(m, attrs={"description": "ages with a positive denominator"}),
    }, attrs={"kind": kind_of(ds), "horizon": T, "window": W, "n_replicates": _n_replicates(ds, lay)})


# --------------------------------------------------------------------------- logit traces

#: The per-step summaries of the logit traces (docs/contract.md, "Logit traces") that get curves.
LOGIT_CURVES = ("kl_pq", "kl_qp", "entropy_p", "entropy_q")


def _mean_with_inf(values: np.ndarray, weights: np.ndarray, observed: np.ndarray):
    """The weighted mean over the last axis, +inf where an observed value with weight is +inf
    (a KL under truncated sampling: P has mass Q lacks), with its ratio SE and count."""
    inf = (observed & np.isinf(values) & (weights > 0)).any(-1)
    finite = np.where(np.isinf(values) | np.isnan(values), 0.0, values)
    num = np.where(observed, weights * finite, np.where(np.isnan(weights), np.nan, 0.0))
    r, se = ratio_se(num, np.where(observed, weights, np.where(np.isnan(weights), np.nan, 0.0)))
    count = observed.sum(-1)
    return np.where(inf, np.inf, r), np.where(inf, np.nan, small_count_se(se, count)), count


def logit_curves(ds: xr.Dataset, window: int | None = None) -> xr.Dataset:
    """KL(P‖Q), KL(Q‖P) and the two entropies by step and by age since divergence.

    By step: the mean over replicates of each step's value on the path the traces record
    (coupled: the coupled histories; residual: the survival path while it runs). By age: the
    value k steps after divergence, aligned as :func:`branch_tv` aligns TV (coupled: at
    the first mismatch τ; residual: on the sampled branch, weighted by 1 − S_T, so the
    ratio estimates E[KL at τ + k | τ + k ≤ T]). A mean is +inf where a replicate it
    averages is (docs/statistics.md, "KL beside TV").

    Parameters
    ----------
    ds : xarray.Dataset
        Coupled or residual traces with logit traces (``top_logprobs`` > 0).
    window : int, optional
        Truncate the observation window W after divergence.

    Returns
    -------
    xarray.Dataset
        ``logit_<name>_by_step`` (+ ``_se``) over (doc, policy[, model], step) and
        ``logit_<name>_by_age`` (+ ``_se``, ``_count``) over (doc, policy[, model], age), for
        each name of :data:`LOGIT_CURVES`; empty when the traces carry no logit traces.

    Raises
    ------
    DivstatsError
        Reference traces (they observe nothing after divergence) with logit traces.

    Examples
    --------
    >>> from protocols.examples import example_dataset
    >>> lc = logit_curves(example_dataset("residual", top_logprobs=2, horizon=5))
    >>> lc["logit_kl_pq_by_age"].dims, float(lc["logit_entropy_p_by_step"].min()) >= 0
    (('doc', 'policy', 'age'), True)
    """
    if not logit_vars(ds):
        return xr.Dataset()
    if is_lazy(ds):
        return map_docs(logit_curves, ds, window=window)
    kind, T = kind_of(ds), horizon_of(ds)
    if kind not in (Kind.COUPLED, Kind.RESIDUAL):
        raise _NotIdentified("logit curves by age need coupled or residual traces")
    W, lay = effective_window(ds, window), layout(ds)
    core = ("replicate", "step")
    present = present_replicates(ds, lay)
    step_prefix = "" if kind == Kind.COUPLED else "shared_"
    out: dict[str, xr.DataArray] = {}
    steps, ages = {"step": np.arange(1, T + 1)}, {"age": np.arange(T)}
    absent = ~present[..., None]                       # padding after a combine: not a replicate at all
    if kind == Kind.COUPLED:
        x, y = (core_array(ds, n, lay, core) for n in ("x_token", "y_token"))
        tau = first_divergence(x, y, T)[1]
    else:
        stv = core_array(ds, "shared_tv", lay, core)
        tstar = core_array(ds, "branch_step", lay, ("replicate",))
    for name in LOGIT_CURVES:
        v = core_array(ds, step_prefix + name, lay, core).astype(np.float64)      # (rows, n, T)
        seen = ~np.isnan(v)
        m, se, _ = _mean_with_inf(*(np.moveaxis(a, 1, -1) for a in
                                    (v, np.where(absent, np.nan, 1.0) * np.ones(v.shape), seen)))
        out[f"logit_{name}_by_step"] = lay.wrap(m, ("step",), steps, {
            "description": f"{name} at step t, mean over the replicates observed there (+inf where one is)"})
        out[f"logit_{name}_by_step_se"] = lay.wrap(se, ("step",), steps, {"description": "Monte Carlo SE"})
        if kind == Kind.COUPLED:
            # the value at tau + k, where tau is observed and tau + k <= T (branch_tv's alignment)
            vals = np.take_along_axis(v, np.clip(tau[..., None] - 1 + np.arange(T), 0, T - 1), axis=-1)
            _, weights, observed, _ = _coupled_branch(np.zeros_like(v), x, y, T, W)
        else:
            vals = core_array(ds, "branch_" + name, lay, ("replicate", "age")).astype(np.float64)
            _, weights, observed, _ = _residual_branch(stv, tstar, np.zeros_like(vals), T, W)
        weights = np.where(absent, np.nan, weights)
        m, se, count = _mean_with_inf(*(np.moveaxis(a, 1, -1) for a in (vals, weights, observed & ~absent)))
        beyond = np.arange(T) > W
        m, se = np.where(beyond, np.nan, m), np.where(beyond, np.nan, se)
        out[f"logit_{name}_by_age"] = lay.wrap(m, ("age",), ages, {
            "description": f"{name} k steps after divergence, aligned and weighted as branch_tv"})
        out[f"logit_{name}_by_age_se"] = lay.wrap(se, ("age",), ages, {
            "description": "delta-method SE, small-count corrected as branch_tv_se"})
        out[f"logit_{name}_by_age_count"] = lay.wrap(count, ("age",), ages, {
            "description": "replicates observed at age k"})
    return xr.Dataset(out, attrs={"kind": kind, "horizon": T, "window": W})
