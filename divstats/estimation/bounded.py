"""Intervals and tests for the mean of a bounded quantity, valid at every n: betting (docs/statistics.md §7).

Most of what kvdiv estimates lives in a known range (the estimand table's ``bounds``:
[0, 1] for occurrence and the fractions, [0, T] for counts of steps; a paired
difference of two such quantities in [−(hi − lo), hi − lo]).  For a mean of values
known to lie in [lo, hi] the betting confidence interval of Waudby-Smith & Ramdas
("Estimating means of bounded random variables by betting", JRSS-B 2024, §4: the
hedged capital process with the predictable plug-in bets, fixed-n form) is valid in
finite samples for every law on the range — no asymptotics, no resampling — and,
unlike the t and bootstrap intervals, does not collapse or explode when the documents
pile up at one end.

The construction, for values rescaled to x_i ∈ [0, 1] and a candidate mean m:

    K⁺_n(m) = Π_i (1 + λ⁺_i (x_i − m)),   K⁻_n(m) = Π_i (1 − λ⁻_i (x_i − m)),
    λ_i = sqrt(2 log(2/α) / (n σ̂²_{i−1})),  λ⁺_i = min(λ_i, c/m),  λ⁻_i = min(λ_i, c/(1 − m)),
    σ̂²_i = (1/4 + Σ_{j≤i} (x_j − μ̂_j)²) / (i + 1),  μ̂_j = (1/2 + Σ_{k≤j} x_k) / (j + 1),

with c = :data:`TRUNCATION`.  Under mean m both products have expectation ≤ 1 (the bets
are predictable), so the hedged capital K = ½K⁺ + ½K⁻ is an e-value and m is rejected
when K ≥ 1/α (Markov).  The documents have no order, so the capital is averaged over
:data:`N_PERMUTATIONS` seeded orders of the documents (an average of e-values is an
e-value): the interval does not depend on the order the documents were stored in.  The
interval is the set of m not rejected; its ends are found by bisection (K⁺ falls and K⁻
rises with m), to 1e-9 of the range.  A one-sided bound bets on one side only (K⁺ for a
lower bound, with log(1/α) in λ).

Why betting, and not an empirical-Bernstein bound or a library:

* Waudby-Smith & Ramdas show the betting interval is never wider than the empirical-Bernstein
  interval asymptotically and markedly narrower at small n; at 10 documents near a bound
  (the near-bound law of docs/measurements.md) it is about 0.35 wide where the empirical-Bernstein
  interval of Maurer & Pontil is wider than the range (tests/test_divstats_bounded.py).
* ``confseq`` (the authors' package) builds C++ extensions with Boost at install time (no wheel
  for Python 3.11), and ``expectation`` computes confidence sequences (valid at every time,
  wider than the fixed-n interval); the fixed-n betting interval is a few lines of numpy, so it
  is written here and checked against exact properties instead: coverage by simulation on
  laws at the bound, reduction to Clopper–Pearson's scale on 0/1 data, monotonicity.
"""

from __future__ import annotations

import math

import numpy as np

from divstats.estimation.resample import MIN_DOCS_AGGREGATE, DocumentInterval, document_interval, too_few_documents
from divstats.intervals import ConfidenceInterval

__all__ = ["MIN_DOCS_BOUNDED", "N_PERMUTATIONS", "TRUNCATION", "betting_evalue", "betting_interval",
           "betting_pvalue", "bounded_mean_interval", "in_range"]

#: Orders of the documents the capital is averaged over (seeded, so an interval is reproducible).
N_PERMUTATIONS = 32
#: c of the bets' truncation λ⁺ ≤ c/m, λ⁻ ≤ c/(1 − m): below 1, so one document at the far end of
#: the range does not take the capital to 0.  WSR use 1/2 or 3/4; at 10 documents near a bound
#: (the near-bound-skewed law) the median width was 0.50, 0.41, 0.37, 0.35 for c = 0.5, 0.75,
#: 0.9, 0.99, but 0.99 widened 50 0/1 documents at 0.95 from 0.17 to 0.23 (600 studies each).
TRUNCATION = 0.9
_ALTERNATIVES = ("two-sided", "less", "greater")
_BISECTIONS = 32


def _orders(n: int, seed: int, n_permutations: int) -> np.ndarray:
    """(P, n) document orders: the stored order first, then seeded permutations."""
    rng = np.random.default_rng(seed)
    perms = [np.arange(n)] + [rng.permutation(n) for _ in range(max(n_permutations, 1) - 1)]
    return np.stack(perms)


def _plugin_bets(x: np.ndarray, log_term: float) -> np.ndarray:
    """λ_i before truncation, same shape as x (..., P, n): predictable, from x_1..x_{i−1}."""
    n = x.shape[-1]
    t = np.arange(1, n + 1)
    mu = (0.5 + np.cumsum(x, axis=-1)) / (t + 1)
    var = (0.25 + np.cumsum((x - mu) ** 2, axis=-1)) / (t + 1)
    prev = np.concatenate([np.full(x.shape[:-1] + (1,), 0.25), var[..., :-1]], axis=-1)
    return np.sqrt(2 * log_term / (n * prev))


def _log_capital(x: np.ndarray, lam: np.ndarray, m: np.ndarray, sign: int) -> np.ndarray:
    """log K^±(m) averaged over orders: x, lam (..., P, n), m (...,) -> (...,)."""
    mm = m[..., None, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        cap = np.minimum(lam, TRUNCATION / (mm if sign > 0 else 1 - mm))
        log_k = np.log1p(sign * cap * (x - mm)).sum(axis=-1)          # (..., P)
    top = np.max(log_k, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    return (top[..., 0] + np.log(np.mean(np.exp(log_k - top), axis=-1)))


def _prepare(values: np.ndarray, low: float, high: float, seed: int, n_permutations: int):
    x = np.asarray(values, dtype=float)
    if not (np.isfinite(low) and np.isfinite(high) and high > low):
        raise ValueError(f"the range [{low}, {high}] must be finite with low < high")
    width = high - low
    u = (x - low) / width
    if np.any(u < -1e-12) or np.any(u > 1 + 1e-12):
        raise ValueError(f"values outside the range [{low}, {high}]: the betting interval needs the range to hold")
    u = np.clip(u, 0.0, 1.0)
    n = u.shape[-1]
    return u[..., _orders(n, seed, n_permutations)], width, n           # (..., P, n)


def betting_evalue(values: np.ndarray, mean: float | np.ndarray, low: float = 0.0, high: float = 1.0, *,
                   alternative: str = "two-sided", level: float = 0.95, seed: int = 0,
                   n_permutations: int = N_PERMUTATIONS) -> np.ndarray:
    """The betting e-value against "the mean is ``mean``" (hedged for two-sided, one side otherwise).

    Parameters
    ----------
    values : numpy.ndarray
        Per-document values in [low, high], documents on the last axis.
    mean : float or numpy.ndarray
        The null mean (broadcast against the leading axes).
    low, high : float
        The range the values are known to lie in.
    alternative : {"two-sided", "less", "greater"}
        "less": evidence that the mean is below ``mean`` (bets on K⁻); "greater": above (K⁺).
    level : float
        Tunes the bets (λ uses log(2/α) two-sided, log(1/α) one-sided, α = 1 − level).
    seed, n_permutations : int
        The document orders averaged over.

    Returns
    -------
    numpy.ndarray
        The e-value, one per leading index; under the null its expectation is ≤ 1.

    Examples
    --------
    >>> import numpy as np
    >>> e = betting_evalue(np.full(30, 0.9), 0.5, alternative="greater")
    >>> bool(e > 20)
    True
    """
    if alternative not in _ALTERNATIVES:
        raise ValueError(f"alternative must be one of {_ALTERNATIVES}, got {alternative!r}")
    u, width, _ = _prepare(values, low, high, seed, n_permutations)
    alpha = 1 - level
    lam = _plugin_bets(u, math.log((2 if alternative == "two-sided" else 1) / alpha))
    m = np.broadcast_to((np.asarray(mean, dtype=float) - low) / width, u.shape[:-2]).astype(float)
    m = np.clip(m, 0.0, 1.0)
    if alternative == "greater":
        return np.exp(_log_capital(u, lam, m, +1))
    if alternative == "less":
        return np.exp(_log_capital(u, lam, m, -1))
    return 0.5 * np.exp(_log_capital(u, lam, m, +1)) + 0.5 * np.exp(_log_capital(u, lam, m, -1))


def betting_pvalue(values: np.ndarray, mean: float | np.ndarray, low: float = 0.0, high: float = 1.0, *,
                   alternative: str = "two-sided", level: float = 0.95, seed: int = 0,
                   n_permutations: int = N_PERMUTATIONS) -> np.ndarray:
    """min(1, 1/E) for :func:`betting_evalue`'s E: a valid p-value at every n (Markov's inequality).

    It is at most α exactly when ``mean`` lies outside :func:`betting_interval` at the matching
    level and side, so the test and the interval agree.  Parameters as for :func:`betting_evalue`.

    Returns
    -------
    numpy.ndarray

    Examples
    --------
    >>> import numpy as np
    >>> float(betting_pvalue(np.full(30, 0.9), 0.5, alternative="greater")) < 0.05
    True
    """
    e = betting_evalue(values, mean, low, high, alternative=alternative, level=level, seed=seed,
                       n_permutations=n_permutations)
    with np.errstate(divide="ignore"):
        return np.minimum(1.0, 1.0 / e)


def _bisect(u: np.ndarray, lam: np.ndarray, log_thr: float, sides: tuple[int, ...], weights: tuple[float, ...],
            inside: np.ndarray, outside: np.ndarray) -> np.ndarray:
    """The end between ``inside`` (not rejected) and ``outside`` (rejected): the rejected side's last point."""
    def rejected(m: np.ndarray) -> np.ndarray:
        logs = [math.log(w) + _log_capital(u, lam, m, s) for s, w in zip(sides, weights, strict=True)]
        return np.logaddexp.reduce(np.stack(logs), axis=0) >= log_thr

    a, b = inside.copy(), outside.copy()
    for _ in range(_BISECTIONS):
        mid = 0.5 * (a + b)
        rej = rejected(mid)
        b = np.where(rej, mid, b)
        a = np.where(rej, a, mid)
    # where even the range's end is not rejected, the end is the range's
    return np.where(rejected(outside), b, outside)


def betting_interval(values: np.ndarray, low: float = 0.0, high: float = 1.0, *, level: float = 0.95,
                     alternative: str = "two-sided", seed: int = 0,
                     n_permutations: int = N_PERMUTATIONS) -> ConfidenceInterval:
    """Waudby-Smith & Ramdas' betting interval for the mean of values known to lie in [low, high].

    Valid for every law on [low, high] at every number of documents (finite-sample, not
    asymptotic), and never outside the range.  The interval always holds the sample mean.

    Parameters
    ----------
    values : numpy.ndarray
        Per-document values, documents on the last axis; leading axes are independent
        samples (one interval each).  Every value must lie in [low, high].
    low, high : float
        The range (the estimand table's ``bounds``; [−1, 1] for a paired difference of two
        [0, 1] quantities).
    level : float
        Confidence level.
    alternative : {"two-sided", "less", "greater"}
        "less": the one-sided upper bound (low end = ``low``); "greater": the lower bound.
    seed, n_permutations : int
        The orders of the documents the capital is averaged over.

    Returns
    -------
    ConfidenceInterval
        ``low``/``high`` with the leading axes' shape (floats for 1-d input).

    Raises
    ------
    ValueError
        For values outside the range, an empty sample, or an unknown alternative.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([0.999, 0.998, 1.0, 0.999, 0.84, 0.998, 0.999, 1.0, 0.998, 0.999])
    >>> ci = betting_interval(x)
    >>> 0.6 < ci.low < 0.75 and ci.high == 1.0
    True
    """
    if alternative not in _ALTERNATIVES:
        raise ValueError(f"alternative must be one of {_ALTERNATIVES}, got {alternative!r}")
    x = np.asarray(values, dtype=float)
    if x.shape[-1] == 0:
        raise ValueError("betting_interval needs at least one document")
    u, width, _ = _prepare(x, low, high, seed, n_permutations)
    alpha = 1 - level
    two = alternative == "two-sided"
    lam = _plugin_bets(u, math.log((2 if two else 1) / alpha))
    centre = np.clip((x.mean(axis=-1) - low) / width, 0.0, 1.0)
    zero, one = np.zeros_like(centre), np.ones_like(centre)
    log_thr = math.log(1 / alpha)
    lo, hi = zero, one
    if alternative in ("two-sided", "greater"):
        sides, weights = ((+1, -1), (0.5, 0.5)) if two else ((+1,), (1.0,))
        lo = _bisect(u, lam, log_thr, sides, weights, centre, zero)
    if alternative in ("two-sided", "less"):
        sides, weights = ((+1, -1), (0.5, 0.5)) if two else ((-1,), (1.0,))
        hi = _bisect(u, lam, log_thr, sides, weights, centre, one)
    lo, hi = np.minimum(lo, centre), np.maximum(hi, centre)
    low_end, high_end = low + width * lo, low + width * hi
    if low_end.ndim == 0:
        return ConfidenceInterval(float(low_end), float(high_end))
    return ConfidenceInterval(low_end, high_end)


#: Fewest documents for a bounded mean's interval: valid at any n, but with fewer than 5 documents it is
#: wider than half the range even when they all agree (five documents at 1: [0.43, 1]; docs/measurements.md).
MIN_DOCS_BOUNDED = 5


def in_range(values: np.ndarray, low: float, high: float) -> bool:
    """Whether every finite value lies in [low, high] (up to rounding), so that a bounded method applies."""
    x = np.asarray(values, dtype=float)
    span = 1e-9 * max(1.0, abs(high - low))
    return bool(np.all((x >= low - span) & (x <= high + span)))


def bounded_mean_interval(values: np.ndarray, low: float, high: float, *, level: float = 0.95,
                          n_resamples: int = 2000, seed: int = 0, min_docs: int = MIN_DOCS_BOUNDED,
                          what: str = "intervals for bounded means") -> DocumentInterval:
    """The interval over documents for the mean of per-document values known to lie in [low, high].

    The rule (docs/plans.md, "Bounded estimands"; measured in docs/measurements.md):

    * below ``min_docs`` documents: refused (NaN ends, the reason stated);
    * below ``resample.MIN_DOCS_AGGREGATE`` (where the resampling intervals are refused):
      :func:`betting_interval`;
    * from there on: the narrower of :func:`betting_interval` and the ``auto`` resampling interval
      (hybrid-t, clipped to the range).  Near a bound the resampling intervals are the whole range
      or undercover, the betting one is neither; in the interior the resampling one is narrower
      and covers.

    Parameters
    ----------
    values : numpy.ndarray
        One value per document (1-d, no NaN), each in [low, high].
    low, high : float
        The range (the estimand table's ``bounds``; [−(hi − lo), hi − lo] for paired differences).
    level : float
        Confidence level (two-sided).
    n_resamples, seed : int
        For the resampling interval and the betting interval's document orders.
    min_docs : int
        Refuse below this many documents.
    what : str
        The kind of interval, as the refusal reason names it.

    Returns
    -------
    DocumentInterval
        ``point`` the mean (shape (1,)), ``method`` "betting" or the resampling method used.

    Raises
    ------
    ValueError
        For values outside [low, high] or a non-1-d array.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([0.999, 0.998, 1.0, 0.999, 0.84, 0.998, 0.999, 1.0, 0.998, 0.999])
    >>> ci = bounded_mean_interval(x, 0.0, 1.0)
    >>> ci.method, bool(0.6 < ci.low[0] < 0.75), float(ci.high[0])
    ('betting', True, 1.0)
    """
    x = np.asarray(values, dtype=float)
    if x.ndim != 1:
        raise ValueError("bounded_mean_interval takes one value per document (a 1-d array)")
    if not in_range(x, low, high):
        raise ValueError(f"values outside the range [{low}, {high}]: a bounded mean's interval needs the range")
    n = x.size
    point = np.array([x.mean()]) if n else np.array([math.nan])
    reason = too_few_documents(n, min_docs, what)
    if reason:
        nan = np.full(1, math.nan)
        return DocumentInterval(point, ConfidenceInterval(nan, nan.copy()), "betting", level, n, reason)
    bet = betting_interval(x, low, high, level=level, seed=seed)
    b_low, b_high = np.array([bet.low]), np.array([bet.high])
    if n < MIN_DOCS_AGGREGATE:
        return DocumentInterval(point, ConfidenceInterval(b_low, b_high), "betting", level, n)
    res = document_interval((x,), _mean, level=level, n_resamples=n_resamples, seed=seed, min_docs=1)
    r_low = np.minimum(np.clip(res.low, low, high), point)
    r_high = np.maximum(np.clip(res.high, low, high), point)
    if (r_high - r_low)[0] < (b_high - b_low)[0]:
        return DocumentInterval(point, ConfidenceInterval(r_low, r_high), res.method, level, n)
    return DocumentInterval(point, ConfidenceInterval(b_low, b_high), "betting", level, n)


def _mean(x: np.ndarray) -> np.ndarray:
    return x.mean(axis=-1)[None]
