"""Effect sizes of paired differences and their intervals (docs/statistics.md §8).

The Hodges–Lehmann estimate (median of Walsh averages) with the interval that inverts the
Wilcoxon test (:func:`hodges_lehmann`), and the mean difference with a t
(:func:`mean_difference_t`), BCa bootstrap (:func:`mean_difference_bootstrap`) or
studentized bootstrap interval (:func:`mean_difference_interval`, the dual of the
``bootstrap-t`` test and the default).  The thresholds below which ``paired_test`` does
not report them live in ``divstats.estimation.resample``.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
from scipy import stats

from divstats.estimation.resample import MIN_DOCS_INTERVAL, too_few_documents
from divstats.inference.choices import MEAN_CIS, Alternative
from divstats.inference.location_tests import (
    EXACT_SIGNED_RANK_MAX_N,
    bootstrap_t_test,
    signed_rank_null_cdf,
    signed_rank_test,
)
from divstats.inference.multiplicity import rejects
from divstats.inference.refusals import zero_spread
from divstats.inference.results import Effect

__all__ = ["hodges_lehmann", "mean_difference_bootstrap", "mean_difference_interval", "mean_difference_t"]


def _walsh_averages(d: np.ndarray) -> np.ndarray:
    i, j = np.triu_indices(d.size)
    return np.sort((d[i] + d[j]) / 2.0)


def _hl_rank(n: int, tail: float) -> int:
    """Largest k with P(W+ <= k - 1) <= tail; 0 when no finite bound exists.

    The interval endpoints are the k-th smallest and k-th largest Walsh averages:
    theta lies outside [A_(k), A_(M+1-k)] exactly when the signed-rank test of
    d - theta rejects at level ``tail`` in that direction.
    """
    if n == 0:
        return 0
    if n <= EXACT_SIGNED_RANK_MAX_N:
        cdf = signed_rank_null_cdf(n)
        ok = np.nonzero(cdf <= tail)[0]
        return int(ok[-1]) + 1 if ok.size else 0
    # Normal approximation with continuity correction for large n.
    m = n * (n + 1) / 4.0
    s = math.sqrt(n * (n + 1) * (2 * n + 1) / 24.0)
    k = math.floor(m - stats.norm.ppf(1 - tail) * s - 0.5) + 1
    return max(k, 0)


class _Inversion:
    """The Wilcoxon test of ``d - theta`` on the grid where its p-value can change.

    The p-value of the signed-rank test of d - theta is constant between
    consecutive distinct Walsh averages (ranks and signs change only there);
    at a Walsh average itself a zero or a tie appears, which the test handles its
    own way.  The grid holds every distinct Walsh average (odd positions), the
    midpoints between them (even positions) and a point beyond each end.
    """

    def __init__(self, d: np.ndarray, alternative: str, alpha: float) -> None:
        self.d, self.alternative, self.alpha = d, alternative, alpha
        self.all_walsh = _walsh_averages(d)
        c = np.unique(self.all_walsh)
        span = float(c[-1] - c[0]) + 1.0
        self.walsh = c
        self.pts = np.empty(2 * c.size + 1)
        self.pts[1::2] = c
        self.pts[2:-1:2] = (c[:-1] + c[1:]) / 2.0
        self.pts[0], self.pts[-1] = c[0] - span, c[-1] + span
        self._memo: dict[int, bool] = {}

    def accepts(self, i: int) -> bool:
        if i not in self._memo:
            p = signed_rank_test(self.d - self.pts[i], self.alternative)[1]
            self._memo[i] = not rejects(p, self.alpha)
        return self._memo[i]

    def _start(self, rank: int) -> int:
        """Grid position of the Walsh average of the given 0-based rank (ties share a position)."""
        return 2 * int(np.searchsorted(self.walsh, self.all_walsh[rank])) + 1

    def lower(self, k: int) -> float:
        """Smallest accepted theta, searching from the tabled guess A_(k)."""
        last = self.pts.size - 1
        i = self._start(k - 1) if k >= 1 else 0
        if self.accepts(i):
            while i > 0 and self.accepts(i - 1):
                i -= 1
        else:
            while i < last and not self.accepts(i):
                i += 1
        if i == 0:
            return -math.inf
        # odd i: a Walsh average the test accepts (closed end); even i: the set starts
        # just after the rejected Walsh average below it (open end, reported as the next float).
        return float(self.pts[i]) if i % 2 else float(np.nextafter(self.pts[i - 1], math.inf))

    def upper(self, k: int) -> float:
        last = self.pts.size - 1
        j = self._start(self.all_walsh.size - k) if k >= 1 else last
        if self.accepts(j):
            while j < last and self.accepts(j + 1):
                j += 1
        else:
            while j > 0 and not self.accepts(j):
                j -= 1
        if j == last:
            return math.inf
        return float(self.pts[j]) if j % 2 else float(np.nextafter(self.pts[j + 1], -math.inf))


def hodges_lehmann(d: np.ndarray, confidence_level: float = 0.95,
                   alternative: Alternative = "two-sided") -> Effect:
    """Hodges–Lehmann location of paired differences with the interval that inverts the Wilcoxon test.

    The interval is {theta : the signed-rank test of d - theta, exactly as
    ``paired_test`` runs it (zero differences dropped, ties at average ranks,
    scipy's exact / permutation / normal p-value), does not reject at level
    1 - confidence_level}; an end where the test rejects is open and reported as
    the next float.  So the interval excludes 0 exactly when the test rejects.
    The tabled ranks (:func:`~divstats.inference.location_tests.signed_rank_null_cdf`) give the starting point of the
    search.  Returns ``(estimate, low, high)``; one-sided alternatives give a
    one-sided bound.

    Parameters
    ----------
    d : numpy.ndarray
        Paired differences (NaN-free).
    confidence_level : float
        Level of the interval.
    alternative : {"two-sided", "less", "greater"}
        Side of the bound.

    Returns
    -------
    Effect
        (estimate, low, high); ``.interval`` is the ConfidenceInterval.

    Examples
    --------
    >>> import numpy as np
    >>> hodges_lehmann(np.array([1.0, 2.0, 3.0]))[0]
    2.0
    """
    d = np.asarray(d, dtype=float)
    d = d[np.isfinite(d)]
    if d.size == 0:
        return Effect(math.nan, math.nan, math.nan)
    est = float(np.median(_walsh_averages(d)))
    alpha = 1.0 - confidence_level
    inv = _Inversion(d, alternative, alpha)
    k = _hl_rank(d.size, alpha / 2 if alternative == "two-sided" else alpha)
    lo = inv.lower(k) if alternative != "less" else -math.inf
    hi = inv.upper(k) if alternative != "greater" else math.inf
    # The acceptance set can have holes with zeros and ties; the test at 0 decides 0.
    if rejects(signed_rank_test(d, alternative)[1], alpha):
        if lo <= 0.0 <= hi:
            lo, hi = (float(np.nextafter(0.0, math.inf)), hi) if est > 0 else (lo, float(np.nextafter(0.0, -math.inf)))
    else:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    return Effect(est, lo, hi)


def mean_difference_t(d: np.ndarray, confidence_level: float = 0.95,
                      alternative: Alternative = "two-sided") -> Effect:
    """Mean of paired differences with its t interval (one-sided bound if asked).

    With one document the interval is (-inf, inf); with zero spread it is NaN
    (not estimable: a zero-width interval would claim certainty).

    Parameters
    ----------
    d : numpy.ndarray
        Paired differences (NaN-free).
    confidence_level : float
        Level of the interval.
    alternative : {"two-sided", "less", "greater"}
        Side of the bound.

    Returns
    -------
    Effect
        (mean, low, high); ``.interval`` is the ConfidenceInterval.

    Examples
    --------
    >>> import numpy as np
    >>> m, lo, hi = mean_difference_t(np.array([1.0, 2.0, 3.0]), alternative="greater")
    >>> m, hi
    (2.0, inf)
    """
    d = np.asarray(d, dtype=float)
    d = d[np.isfinite(d)]
    if d.size == 0:
        return Effect(math.nan, math.nan, math.nan)
    mean = float(d.mean())
    if d.size < 2:
        return Effect(mean, -math.inf, math.inf)
    if zero_spread(d):
        return Effect(mean, math.nan, math.nan)
    se = float(d.std(ddof=1) / math.sqrt(d.size))
    alpha = 1.0 - confidence_level
    if alternative == "two-sided":
        q = stats.t.ppf(1 - alpha / 2, d.size - 1)
        return Effect(mean, mean - q * se, mean + q * se)
    q = stats.t.ppf(1 - alpha, d.size - 1)
    if alternative == "less":
        return Effect(mean, -math.inf, mean + q * se)
    return Effect(mean, mean - q * se, math.inf)


def mean_difference_bootstrap(d: np.ndarray, confidence_level: float = 0.95,
                              alternative: Alternative = "two-sided", *, n_resamples: int = 9999,
                              seed: int = 0, min_docs: int = MIN_DOCS_INTERVAL) -> Effect:
    """Mean of paired differences with a BCa bootstrap interval over documents.

    Refused (NaN bounds) below ``min_docs`` documents: BCa over few documents
    covered 0.64–0.83 at n = 3–5 (docs/plans.md, Calibration).

    Parameters
    ----------
    d : numpy.ndarray
        Paired differences (NaN-free).
    confidence_level : float
        Level of the interval.
    alternative : {"two-sided", "less", "greater"}
        Side of the bound.
    n_resamples : int
        Bootstrap resamples.
    seed : int
        Seed of the resampling.
    min_docs : int
        Refusal threshold (``divstats.estimation.resample.MIN_DOCS_INTERVAL``, 10; lower it only to
        measure coverage).

    Returns
    -------
    Effect
        (mean, low, high); ``.interval`` is the ConfidenceInterval.

    Examples
    --------
    >>> import numpy as np
    >>> m, lo, hi = mean_difference_bootstrap(np.arange(10.0), n_resamples=999)
    >>> lo < m < hi
    True
    """
    d = np.asarray(d, dtype=float)
    d = d[np.isfinite(d)]
    if d.size == 0:
        return Effect(math.nan, math.nan, math.nan)
    mean = float(d.mean())
    if too_few_documents(d.size, min_docs):
        return Effect(mean, math.nan, math.nan)
    if np.ptp(d) == 0:
        return Effect(mean, *mean_difference_t(d, confidence_level, alternative)[1:])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # degenerate resamples: fall back below
        res = stats.bootstrap((d,), np.mean, n_resamples=n_resamples, vectorized=True,
                              confidence_level=confidence_level, alternative=alternative,
                              method="BCa", rng=seed)
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if alternative == "two-sided" and not (np.isfinite(lo) and np.isfinite(hi)):
        return Effect(mean, *mean_difference_t(d, confidence_level, alternative)[1:])
    return Effect(mean, lo, hi)


def mean_difference_interval(d: np.ndarray, mean_ci: str = "bootstrap-t", confidence_level: float = 0.95,
                             alternative: Alternative = "two-sided", *, n_resamples: int = 9999,
                             seed: int = 0) -> Effect:
    """Mean of paired differences with its interval by one of ``MEAN_CIS``, without a threshold.

    ``MEAN_CIS`` is :data:`divstats.inference.choices.MEAN_CIS`.

    :func:`~divstats.inference.paired.paired_test` reports this interval only from
    ``divstats.estimation.resample.MIN_DOCS_MEAN_DIFFERENCE`` documents; the calibration
    measures it below that too.  ``bootstrap-t`` is the dual interval of the
    ``bootstrap-t`` test (NaN bounds when the spread is 0 or n < 2).

    Parameters
    ----------
    d : numpy.ndarray
        Paired differences (NaN-free).
    mean_ci : {"bootstrap-t", "t", "bootstrap"}
        Studentized bootstrap, t, or BCa bootstrap.
    confidence_level : float
        Level of the interval.
    alternative : {"two-sided", "less", "greater"}
        Side of the bound.
    n_resamples : int
        Bootstrap resamples.
    seed : int
        Seed of the resampling.

    Returns
    -------
    Effect
        (mean, low, high); ``.interval`` is the ConfidenceInterval.

    Raises
    ------
    ValueError
        For an unknown ``mean_ci``.

    Examples
    --------
    >>> import numpy as np
    >>> m, lo, hi = mean_difference_interval(np.arange(10.0), n_resamples=999)
    >>> bool(lo < m < hi)
    True
    """
    if mean_ci not in MEAN_CIS:
        raise ValueError(f"mean_ci must be one of {MEAN_CIS}, got {mean_ci!r}")
    d = np.asarray(d, dtype=float)
    d = d[np.isfinite(d)]
    if mean_ci == "t":
        return mean_difference_t(d, confidence_level, alternative)
    if mean_ci == "bootstrap":
        return mean_difference_bootstrap(d, confidence_level, alternative, n_resamples=n_resamples, seed=seed,
                                         min_docs=2)
    mean = float(d.mean()) if d.size else math.nan
    if d.size < 2 or zero_spread(d):
        return Effect(mean, math.nan, math.nan)      # t* undefined; a zero-width interval would claim certainty
    return Effect(mean, *bootstrap_t_test(d, alternative, n_resamples, seed, confidence_level)[3:])
