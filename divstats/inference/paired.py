"""Paired comparisons across documents (docs/statistics.md §8).

The document is the unit of inference: each document contributes one paired
difference ``d = a - b`` (policy A minus policy B, or late minus early window).
Per-document Monte Carlo error is part of the between-document spread, so the
tests below are valid without modelling it separately.

Four tests, one- or two-sided (``alternative`` refers to ``A - B``); each tests
one estimand (:data:`TEST_DESCRIPTIONS`), stated in every result:

- ``wilcoxon``: Wilcoxon signed-rank (the function's default); estimand: the
  pseudo-median of the differences (its null is a law symmetric about 0); effect =
  Hodges–Lehmann estimate (median of Walsh averages) with the interval obtained by
  inverting this very test (same zero and tie handling), so "the interval excludes
  0" holds exactly when the test rejects.
- ``ttest``: paired t; effect = mean difference with its interval (below).
- ``permutation``: sign-flip permutation of the mean difference, exact
  (all 2^n flips) when n is small and seeded Monte Carlo otherwise; effect =
  mean difference with its interval (below).
- ``bootstrap-t``: studentized (percentile-t) bootstrap test of the mean
  difference, with its dual interval; second-order accurate, so its size for the
  mean holds better than t's on skewed differences (docs/plans.md, calibration).

Degenerate data (one document for a permutation or bootstrap test, zero spread
for the t and bootstrap-t tests) are *not estimable*: NaN p-value and interval with
the reason in ``reason``; nothing raises and nothing claims certainty.  So is a
one-sided ``bootstrap-t`` test below ``divstats.estimation.resample.MIN_DOCS_MEAN_BOUND``
documents: on skewed differences with mean 0 its size was 0.066-0.081 at 5-30
documents (alpha = 0.05; 0.052 at 50) and no construction measured held there
(docs/plans.md, "One-sided tests of a mean"); it is refused together with its dual
bound, and the two-sided test (size 0.047-0.066 there from 5 documents) stays available.

The mean difference's interval is the studentized bootstrap (bootstrap-t) interval
by default — the dual of the ``bootstrap-t`` test — because it is the one that covers
on skewed differences (two-sided 0.93-0.95 at n = 5 and 0.92-0.94 at n = 10,
one-sided 0.94 at n = 20, where the t interval covers 0.87-0.89, 0.87 and 0.90;
docs/plans.md, Calibration); ``mean_ci="t"`` gives the t interval and
``mean_ci="bootstrap"`` a BCa bootstrap (0.85 at n = 10), on request and with
their own coverage (no threshold beyond BCa's 10 documents).  Below
``divstats.estimation.resample.MIN_DOCS_MEAN_DIFFERENCE`` documents (two-sided) or
``MIN_DOCS_MEAN_BOUND`` (one-sided bounds) no mean-difference interval is reported
(NaN, with the reason in ``ci_reason``); the p-value still is, except for the
one-sided ``bootstrap-t`` test, refused with its bound (above). The Hodges–Lehmann
interval needs no threshold: it covered the pseudo-median at ≥ 0.92 at every n
measured, and is infinite where too few documents can reject.

Every result carries both effect sizes (mean difference and Hodges–Lehmann) with
intervals, so a table can show either. Intervals are the duals of the test: a
one-sided test gets a one-sided confidence bound (the open side is ±inf), so
"the interval excludes 0" and "the test rejects" agree.

Multiplicity: :func:`holm` applies statsmodels' Holm step-down within one family.
One rejection rule everywhere (:func:`rejects`): reject when the (adjusted)
p-value is <= alpha.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
from scipy import stats

from divstats.estimation.resample import (
    MIN_DOCS_INTERVAL,
    MIN_DOCS_MARGIN,
    MIN_DOCS_MARGIN_T,
    MIN_DOCS_MEAN_BOUND,
    MIN_DOCS_MEAN_DIFFERENCE,
    bootstrap_t,
    too_few_documents,
)
from divstats.intervals import ConfidenceInterval

__all__ = [
    "ALTERNATIVES", "MARGIN_ALTERNATIVES", "MARGIN_TESTS", "WORSE", "margin_verdict",
    "EXACT_PERMUTATION_MAX_N", "EXACT_SIGNED_RANK_MAX_N", "TESTS", "Alternative",
    "TEST_DESCRIPTIONS", "MEAN_CIS", "MIN_DOCS_BY_TEST", "Effect", "PairedTestResult", "TestName",
    "hodges_lehmann", "holm",
    "mean_difference_bootstrap", "mean_difference_interval", "mean_difference_t", "not_estimable_reason",
    "margin_not_estimable_reason", "margin_test", "paired_test", "rejects",
    "signed_rank_null_cdf", "signed_rank_test"
]

Alternative = Literal["two-sided", "less", "greater", "equivalence", "noninferiority"]
TestName = Literal["wilcoxon", "ttest", "permutation"]

TESTS: tuple[str, ...] = ("wilcoxon", "ttest", "permutation", "bootstrap-t")
#: What each test is about, its estimand in words (a result's ``estimand``; stated in plan results and the
#: report).  Not the estimand table (``divstats.estimands.ESTIMANDS``): these describe tests, not metrics.
TEST_DESCRIPTIONS: dict[str, str] = {
    "wilcoxon": "pseudo-median of the paired differences (Hodges-Lehmann location; the null is a law "
                "symmetric about 0)",
    "ttest": "mean paired difference",
    "permutation": "mean paired difference (the sign-flip null is a law symmetric about 0)",
    "bootstrap-t": "mean paired difference",
}
#: Relative spread below which the differences count as constant (t undefined).
ZERO_SPREAD = 1e-12
ALTERNATIVES: tuple[str, ...] = ("two-sided", "less", "greater")
#: Tests at a margin (``paired_test(..., alternative=..., margin=delta)``; docs/statistics.md §8).
MARGIN_ALTERNATIVES: tuple[str, ...] = ("equivalence", "noninferiority")
#: The tests that run at a margin (they are about the mean difference).
MARGIN_TESTS: tuple[str, ...] = ("bootstrap-t", "ttest")
#: Which direction of A - B is worse for A (``paired_test(..., worse=...)``; the estimand table's ``worse``).
WORSE: tuple[str, ...] = ("larger", "smaller")
#: Intervals for the mean difference (``paired_test(..., mean_ci=...)``); the first is the default.
MEAN_CIS: tuple[str, ...] = ("bootstrap-t", "t", "bootstrap")

#: Largest n for which the sign-flip test enumerates all 2^n flips.
EXACT_PERMUTATION_MAX_N = 16
#: Largest n for which the signed-rank null law is computed exactly (for the HL interval).
EXACT_SIGNED_RANK_MAX_N = 200


class Effect(NamedTuple):
    """An effect size and its interval: (estimate, low, high), unpacked as before.

    ``interval`` (or :meth:`confidence_interval`) is the
    :class:`~divstats.intervals.ConfidenceInterval` (low, high); a one-sided bound has
    an infinite open end, a refused interval NaN ends.
    """

    estimate: float
    low: float
    high: float

    @property
    def interval(self) -> ConfidenceInterval:
        return ConfidenceInterval(self.low, self.high)

    def confidence_interval(self) -> ConfidenceInterval:
        """The interval, as scipy's results give it."""
        return self.interval


@dataclass(frozen=True)
class PairedTestResult:
    """Result of :func:`paired_test` (scipy-style named fields).

    Three effect sizes, each an :class:`Effect` (``.estimate``, ``.interval``):
    ``test_effect`` is the test's own (Hodges–Lehmann for ``wilcoxon``, mean
    difference otherwise; :meth:`confidence_interval` returns its interval),
    ``mean_effect`` the mean difference and ``hl_effect`` the Hodges–Lehmann
    estimate.  The flat names (``effect``, ``ci_low``, ``ci_high``,
    ``mean_difference``, ``mean_ci_low``, ..., ``hl_ci_high``) read them.
    ``reason`` is set when the test is not estimable (NaN p-value); ``ci_reason``
    when the mean difference's interval is refused (too few documents) while the
    p-value stands.
    """

    test: str
    alternative: str
    n: int
    statistic: float
    pvalue: float
    test_effect: Effect
    mean_effect: Effect
    hl_effect: Effect
    confidence_level: float
    exact: bool
    details: dict[str, object] = field(default_factory=dict)
    reason: str = ""       # non-empty: not estimable (NaN p-value), and why
    estimand: str = ""
    ci_reason: str = ""    # non-empty: the mean difference's interval is refused, and why
    margin: float = math.nan   # tests at a margin: delta (> 0); NaN for difference tests
    worse: str = ""            # non-inferiority: which direction of A - B is worse ("larger"/"smaller")
    verdict: str = ""          # tests at a margin: the unadjusted verdict in words (:func:`margin_verdict`)

    def confidence_interval(self) -> ConfidenceInterval:
        """The interval of the test's own effect size (:attr:`test_effect`), at ``confidence_level``.

        For ``alternative="equivalence"`` it is the (1 − 2α) interval of the mean
        difference (``confidence_level`` = 1 − 2α), inside (−margin, margin) exactly
        when equivalence is declared; for ``"noninferiority"`` the one-sided (1 − α) bound.
        """
        return self.test_effect.interval

    effect = property(lambda self: self.test_effect.estimate, doc="The test's own effect size.")
    ci_low = property(lambda self: self.test_effect.low)
    ci_high = property(lambda self: self.test_effect.high)
    mean_difference = property(lambda self: self.mean_effect.estimate)
    mean_ci_low = property(lambda self: self.mean_effect.low)
    mean_ci_high = property(lambda self: self.mean_effect.high)
    hodges_lehmann = property(lambda self: self.hl_effect.estimate)
    hl_ci_low = property(lambda self: self.hl_effect.low)
    hl_ci_high = property(lambda self: self.hl_effect.high)


def _clean_pairs(a: np.ndarray, b: np.ndarray | float) -> np.ndarray:
    a = np.asarray(a, dtype=float).ravel()
    b = np.asarray(b, dtype=float)
    # a scalar b is a known reference value (the full model's: 0 for mismatch-type metrics)
    b = np.full(a.shape, float(b)) if b.ndim == 0 else b.ravel()
    if a.shape != b.shape:
        raise ValueError(f"paired samples differ in length: {a.size} vs {b.size}")
    d = a - b
    # A document with a missing value on either side has no paired difference.
    return d[np.isfinite(d)]


# ---------------------------------------------------------------------------
# Effect sizes
# ---------------------------------------------------------------------------

def _walsh_averages(d: np.ndarray) -> np.ndarray:
    i, j = np.triu_indices(d.size)
    return np.sort((d[i] + d[j]) / 2.0)


def signed_rank_null_cdf(n: int) -> np.ndarray:
    """Exact null CDF of the signed-rank statistic W+ for n untied, non-zero pairs.

    Returns ``cdf`` with ``cdf[w] = P(W+ <= w)`` for w = 0..n(n+1)/2, from the
    subset-sum recursion (counts of subsets of {1..n} summing to w) in floats
    normalised as we go so that large n does not overflow.

    Parameters
    ----------
    n : int
        Number of pairs.

    Returns
    -------
    numpy.ndarray
        ``cdf`` of length n(n+1)/2 + 1.

    Examples
    --------
    >>> signed_rank_null_cdf(2).tolist()
    [0.25, 0.5, 0.75, 1.0]
    """
    m = n * (n + 1) // 2
    pmf = np.zeros(m + 1)
    pmf[0] = 1.0
    for k in range(1, n + 1):
        shifted = np.zeros_like(pmf)
        shifted[k:] = pmf[:-k]
        pmf = 0.5 * (pmf + shifted)
    return np.cumsum(pmf)


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


def _zero_spread(d: np.ndarray) -> bool:
    """All differences equal up to rounding (0.1 and 0.1 + 1e-17 included)."""
    return d.size > 0 and float(np.ptp(d)) <= ZERO_SPREAD * max(float(np.max(np.abs(d))), 1e-300)


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
    :func:`paired_test` runs it (zero differences dropped, ties at average ranks,
    scipy's exact / permutation / normal p-value), does not reject at level
    1 - confidence_level}; an end where the test rejects is open and reported as
    the next float.  So the interval excludes 0 exactly when the test rejects.
    The tabled ranks (:func:`signed_rank_null_cdf`) give the starting point of the
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
    if _zero_spread(d):
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


def _studentized_resamples(d: np.ndarray, n_resamples: int, seed: int) -> np.ndarray:
    """t* = (mean* - mean) / se* over bootstrap resamples of the documents (:func:`bootstrap_t`).

    se* is the plain SD / sqrt(n) of each resample, drawn 2000 at a time.  A resample
    with zero spread has t* = +-inf (or 0 when centred): it is kept, so the number of
    resamples never silently shrinks.
    """
    root_n = math.sqrt(d.size)
    return bootstrap_t((d,), lambda x: x.mean(axis=-1)[None], np.array([d.mean()]), n_resamples, seed,
                       standard_error=lambda x: (x.std(axis=-1, ddof=1) / root_n)[None], batch=2000)[0]


def _bootstrap_t_test(d: np.ndarray, alternative: str, n_resamples: int, seed: int,
                 confidence_level: float) -> tuple[float, float, bool, float, float]:
    """(t, p, exact, low, high): percentile-t test of mean = 0 and its dual interval.

    p = (1 + #{t* at least as extreme as t}) / (B + 1) (two-sided: |t*| >= |t|);
    the interval is {theta : the same test of d - theta does not reject}, which is
    mean - s se .. mean + s se with s the matching order statistic of t*.
    """
    n = d.size
    mean, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(n))
    t = mean / se
    ts = _studentized_resamples(d, n_resamples, seed)
    B = ts.size
    if alternative == "two-sided":
        p = (1 + np.count_nonzero(np.abs(ts) >= abs(t))) / (B + 1)
    elif alternative == "greater":
        p = (1 + np.count_nonzero(ts >= t)) / (B + 1)
    else:
        p = (1 + np.count_nonzero(ts <= t)) / (B + 1)
    # reject iff #{more extreme} <= K; accept iff the statistic is within the (K+1)-th most extreme t*
    K = math.floor((1.0 - confidence_level) * (B + 1) + 1e-9) - 1
    if K < 0:
        return t, float(p), False, -math.inf, math.inf
    if alternative == "two-sided":
        s = np.sort(np.abs(ts))[::-1][K]
        lo, hi = mean - s * se, mean + s * se
    elif alternative == "greater":
        lo, hi = mean - np.sort(ts)[::-1][K] * se, math.inf
    else:
        lo, hi = -math.inf, mean - np.sort(ts)[K] * se
    return t, float(min(p, 1.0)), False, float(lo), float(hi)


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


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------

def _signed_rank_null(doubled_ranks: np.ndarray) -> np.ndarray:
    """Exact null pmf of 2 W+ given the (doubled, so integer) ranks: every sign equally likely."""
    pmf = np.zeros(int(doubled_ranks.sum()) + 1)
    pmf[0] = 1.0
    for r in doubled_ranks:
        shifted = np.zeros_like(pmf)
        shifted[r:] = pmf[:pmf.size - r]
        pmf = 0.5 * (pmf + shifted)
    return pmf


def signed_rank_test(d: np.ndarray, alternative: str) -> tuple[float, float, bool]:
    """Wilcoxon signed-rank test of ``d`` (statistic, p-value, exact).

    Zero differences are dropped (Wilcoxon's rule); ties get average ranks. The
    p-value is exact — the law of W+ under independent random signs given these
    ranks — for up to :data:`EXACT_SIGNED_RANK_MAX_N` non-zero differences (scipy's
    exact test without ties, its exact permutation test with ties), and the
    tie-corrected normal approximation with continuity correction beyond.
    The statistic is scipy's: min(W+, W-) for two-sided tests, W+ otherwise.

    Parameters
    ----------
    d : numpy.ndarray
        Paired differences (NaN-free).
    alternative : {"two-sided", "less", "greater"}
        H1 about the location of ``d``.

    Returns
    -------
    (float, float, bool)
        Statistic, p-value, and whether the p-value is exact.

    Examples
    --------
    >>> import numpy as np
    >>> stat, p, exact = signed_rank_test(np.array([0.5, 1.0, 1.0, 0.0, 2.0]), "greater")
    >>> round(p, 4), exact
    (0.0625, True)
    """
    nz = d[d != 0]
    n = nz.size
    if n == 0:
        # Every document agrees exactly: no evidence either way.
        return 0.0, 1.0, True
    ranks = stats.rankdata(np.abs(nz))
    w_plus = float(ranks[nz > 0].sum())
    statistic = min(w_plus, n * (n + 1) / 2 - w_plus) if alternative == "two-sided" else w_plus
    if n <= EXACT_SIGNED_RANK_MAX_N:
        pmf = _signed_rank_null(np.rint(2 * ranks).astype(np.int64))
        w2 = int(round(2 * w_plus))
        less, greater = float(pmf[:w2 + 1].sum()), float(pmf[w2:].sum())
    else:
        _, counts = np.unique(np.abs(nz), return_counts=True)
        mean = n * (n + 1) / 4.0
        sd = math.sqrt(n * (n + 1) * (2 * n + 1) / 24.0 - float((counts ** 3 - counts).sum()) / 48.0)
        less = float(stats.norm.cdf((w_plus - mean + 0.5) / sd))
        greater = float(stats.norm.sf((w_plus - mean - 0.5) / sd))
    p = {"less": less, "greater": greater, "two-sided": min(1.0, 2.0 * min(less, greater))}[alternative]
    return float(statistic), min(p, 1.0), n <= EXACT_SIGNED_RANK_MAX_N


def _permutation(d: np.ndarray, alternative: str, n_resamples: int, seed: int) -> tuple[float, float, bool]:
    if np.all(d == 0):
        return 0.0, 1.0, True
    exact = d.size <= EXACT_PERMUTATION_MAX_N
    # 'samples' permutations of (d, 0) swap within each pair, i.e. flip the sign of d.
    n_res = max(n_resamples, 2 ** d.size) if exact else n_resamples
    res = stats.permutation_test(
        (d, np.zeros_like(d)), lambda x, y, axis: np.mean(x - y, axis=axis),
        permutation_type="samples", vectorized=True, n_resamples=n_res,
        alternative=alternative, rng=seed)
    return float(res.statistic), float(res.pvalue), exact


def _ttest(d: np.ndarray, alternative: str) -> tuple[float, float, bool]:
    res = stats.ttest_1samp(d, 0.0, alternative=alternative)
    return float(res.statistic), float(res.pvalue), True


#: Fewest documents each test needs; below it the result is not estimable (and a
#: one-sided ``bootstrap-t`` test needs ``divstats.estimation.resample.MIN_DOCS_MEAN_BOUND``).
MIN_DOCS_BY_TEST: dict[str, int] = {"wilcoxon": 1, "ttest": 2, "permutation": 2, "bootstrap-t": 3}


def not_estimable_reason(d: np.ndarray, test: str, alternative: str = "two-sided") -> str:
    """Why ``test`` cannot be run on the differences ``d`` ("" when it can).

    Parameters
    ----------
    d : numpy.ndarray
        Paired differences (NaN-free).
    test : str
        One of :data:`TESTS`.
    alternative : {"two-sided", "less", "greater"}
        Side of the test: a one-sided ``bootstrap-t`` test needs
        ``divstats.estimation.resample.MIN_DOCS_MEAN_BOUND`` documents.

    Returns
    -------
    str
        The reason, or "" when the test is defined on ``d``.

    Examples
    --------
    >>> import numpy as np
    >>> not_estimable_reason(np.array([0.1, 0.1]), "ttest")[:15]
    'not estimable: '
    >>> not_estimable_reason(np.arange(12.0), "bootstrap-t", "less")[:41]
    'not estimable: n = 12 documents, one-side'
    """
    if d.size < MIN_DOCS_BY_TEST[test]:
        return (f"not estimable: {test} needs at least {MIN_DOCS_BY_TEST[test]} documents with both values, "
                f"got {d.size}")
    if test in ("ttest", "bootstrap-t") and _zero_spread(d):
        return (f"not estimable: all {d.size} differences are equal ({d[0]:.6g}), so the spread is 0 "
                f"and {test} is undefined")
    if test == "bootstrap-t" and alternative != "two-sided":
        # too liberal below the threshold on skewed differences (docs/plans.md, "One-sided tests of a mean")
        reason = too_few_documents(d.size, MIN_DOCS_MEAN_BOUND, "one-sided bootstrap-t tests of a mean difference")
        if reason:
            return f"{reason}; a two-sided test holds its size from {MIN_DOCS_MEAN_DIFFERENCE} documents"
    return ""


def _not_estimable(test: str, alternative: str, d: np.ndarray, reason: str,
                   confidence_level: float) -> PairedTestResult:
    nan = math.nan
    mean = float(d.mean()) if d.size else nan
    return PairedTestResult(
        test=test, alternative=alternative, n=int(d.size), statistic=nan, pvalue=nan,
        test_effect=Effect(nan, nan, nan), mean_effect=Effect(mean, nan, nan), hl_effect=Effect(nan, nan, nan),
        confidence_level=confidence_level,
        exact=False, details={"effect_kind": _effect_kind(test), "n_zero": int(np.sum(d == 0))},
        reason=reason, estimand=TEST_DESCRIPTIONS[test])


def _effect_kind(test: str) -> str:
    return "hodges_lehmann" if test == "wilcoxon" else "mean_difference"


def _check_args(test: str, alternative: str, mean_ci: str) -> None:
    if test not in TESTS:
        raise ValueError(f"unknown test {test!r}; expected one of {TESTS}")
    if alternative not in ALTERNATIVES + MARGIN_ALTERNATIVES:
        raise ValueError(f"unknown alternative {alternative!r}; expected one of {ALTERNATIVES + MARGIN_ALTERNATIVES}")
    if mean_ci not in MEAN_CIS:
        raise ValueError(f"mean_ci must be one of {MEAN_CIS}, got {mean_ci!r}")


def _check_margin(test: str, alternative: str, margin: float | None, worse: str) -> float:
    """The margin's magnitude delta (> 0), checking the arguments of a test at a margin."""
    if test not in MARGIN_TESTS:
        raise ValueError(f"alternative {alternative!r} tests the mean difference: test must be one of "
                         f"{MARGIN_TESTS}, got {test!r}")
    if worse not in WORSE:
        raise ValueError(f"worse must be one of {WORSE}, got {worse!r}")
    if margin is None or not np.isfinite(margin) or margin == 0:
        raise ValueError(f"alternative {alternative!r} needs a finite non-zero margin, got {margin!r}")
    if margin < 0 and not (alternative == "noninferiority" and worse == "smaller"):
        raise ValueError(f"margin must be > 0 (a negative margin is the signed form of a non-inferiority "
                         f"margin when worse='smaller'), got {margin!r}")
    return abs(float(margin))


def margin_not_estimable_reason(d: np.ndarray, test: str, min_docs: int | None = None) -> str:
    """Why a test at a margin cannot be run on ``d`` ("" when it can).

    Besides the test's own conditions (:func:`not_estimable_reason`) it needs
    ``divstats.estimation.resample.MIN_DOCS_MARGIN`` documents for ``bootstrap-t`` and
    ``MIN_DOCS_MARGIN_T`` for ``ttest``: below them its size at the margin exceeded
    alpha + 2 SE on skewed differences (docs/plans.md, "Tests at a margin").

    Parameters
    ----------
    d : numpy.ndarray
        Paired differences (NaN-free).
    test : {"bootstrap-t", "ttest"}
        The test.
    min_docs : int, optional
        Override of the threshold (lower it only to measure the size, as the calibration does).

    Returns
    -------
    str
        The reason, or "".

    Examples
    --------
    >>> import numpy as np
    >>> margin_not_estimable_reason(np.arange(12.0), "bootstrap-t")[:44]
    'not estimable: n = 12 documents, bootstrap-t'
    """
    reason = not_estimable_reason(d, test)
    if reason:
        return reason
    need = min_docs if min_docs is not None else (MIN_DOCS_MARGIN if test == "bootstrap-t" else MIN_DOCS_MARGIN_T)
    return too_few_documents(d.size, need, f"{test} tests at a margin (equivalence, non-inferiority)")


def margin_verdict(alternative: str, reject: bool, margin: float, worse: str = "larger",
                   estimable: bool = True) -> str:
    """The verdict of a test at a margin, in words.

    Parameters
    ----------
    alternative : {"equivalence", "noninferiority"}
        The test.
    reject : bool
        Whether its (adjusted) p-value is <= alpha.
    margin : float
        Its margin delta (> 0).
    worse : {"larger", "smaller"}
        Non-inferiority: which direction is worse (the margin is written with that sign).
    estimable : bool
        False: the test was refused.

    Returns
    -------
    str
        E.g. "equivalent within ±0.05", "non-inferior at margin 0.05",
        "not shown equivalent at this size".

    Examples
    --------
    >>> margin_verdict("equivalence", True, 0.05)
    'equivalent within ±0.05'
    >>> margin_verdict("noninferiority", False, 1, "smaller")
    'not shown non-inferior at margin -1 at this size'
    """
    if alternative == "equivalence":
        words, where = "equivalent", f"within ±{margin:g}"
    else:
        words, where = "non-inferior", f"at margin {margin if worse == 'larger' else -margin:g}"
    if not estimable:
        return f"not estimable ({words} {where} not tested)"
    if reject:
        return f"{words} {where}"
    if alternative == "equivalence":
        return f"not shown {words} at this size"
    return f"not shown {words} {where} at this size"


def _margin_sides(d: np.ndarray, test: str, shift: float, side: str, n_resamples: int, seed: int,
                  level: float) -> tuple[float, float, float]:
    """(t, p, bound) of the one-sided test of mean(d) vs ``-shift`` (``side`` = H1) and its dual (1 - alpha) bound."""
    e = d + shift
    if test == "ttest":
        t, p, _ = _ttest(e, side)
        _, lo, hi = mean_difference_t(e, level, side)
    else:
        t, p, _, lo, hi = _bootstrap_t_test(e, side, n_resamples, seed, level)
    return t, p, (lo if side == "greater" else hi) - shift


def margin_test(d: np.ndarray, test: str, alternative: str, margin: float, worse: str = "larger",
                confidence_level: float = 0.95, *, n_resamples: int = 9999, seed: int = 0,
                min_docs: int | None = None, hodges_lehmann_effect: bool = True) -> PairedTestResult:
    """TOST (equivalence) or the one-sided test at the margin (non-inferiority) of the mean of ``d``.

    :func:`paired_test` with a margin alternative runs this on ``a - b``; ``min_docs``
    overrides the refusal threshold (the calibration measures below it).

    Parameters
    ----------
    d : numpy.ndarray
        Paired differences (NaN-free).
    test : {"bootstrap-t", "ttest"}
        The test.
    alternative : {"equivalence", "noninferiority"}
        The null: |mean| >= margin, or A worse by at least margin.
    margin : float
        delta (> 0; a negative value only for non-inferiority with worse="smaller").
    worse : {"larger", "smaller"}
        Non-inferiority: the direction of A − B that is worse for A.
    confidence_level : float
        1 − alpha.
    n_resamples : int
        Bootstrap resamples.
    seed : int
        Seed of the resampling (both one-sided tests use the same resamples).
    min_docs : int, optional
        Refusal threshold override.
    hodges_lehmann_effect : bool
        Also compute the Hodges–Lehmann effect (False: NaN; the calibration skips it).

    Returns
    -------
    PairedTestResult
        With ``margin``, ``worse``, ``verdict`` and, in ``details``, both one-sided p-values.

    Examples
    --------
    >>> import numpy as np
    >>> margin_test(np.full(3, 0.1) + [0, 0.01, -0.01], "ttest", "equivalence", 0.05, min_docs=2).verdict
    'not shown equivalent at this size'
    """
    margin = _check_margin(test, alternative, margin, worse)
    d = np.asarray(d, dtype=float)
    d = d[np.isfinite(d)]
    alpha = 1.0 - confidence_level
    level = round(1.0 - 2.0 * alpha, 12) if alternative == "equivalence" else confidence_level
    reason = margin_not_estimable_reason(d, test, min_docs)
    details: dict[str, object] = {"effect_kind": "mean_difference", "mean_ci": test, "n_zero": int(np.sum(d == 0)),
                                  "alpha": alpha}
    mean, nan = (float(d.mean()) if d.size else math.nan), math.nan
    if reason:
        return PairedTestResult(
            test=test, alternative=alternative, n=int(d.size), statistic=nan, pvalue=nan,
            test_effect=Effect(mean, nan, nan), mean_effect=Effect(mean, nan, nan), hl_effect=Effect(nan, nan, nan),
            confidence_level=level, exact=False, details=details, reason=reason, estimand=TEST_DESCRIPTIONS[test],
            margin=margin, worse=worse if alternative == "noninferiority" else "",
            verdict=margin_verdict(alternative, False, margin, worse, estimable=False))
    lo, hi = -math.inf, math.inf
    sides = []
    # H0 mean <= -delta (rejected: "greater" on d + delta); H0 mean >= delta ("less" on d - delta)
    if alternative == "equivalence" or worse == "smaller":
        t_lo, p_lo, lo = _margin_sides(d, test, margin, "greater", n_resamples, seed, confidence_level)
        sides.append((p_lo, t_lo))
        details.update(p_lower=p_lo, t_lower=t_lo)
    if alternative == "equivalence" or worse == "larger":
        t_hi, p_hi, hi = _margin_sides(d, test, -margin, "less", n_resamples, seed, confidence_level)
        sides.append((p_hi, t_hi))
        details.update(p_upper=p_hi, t_upper=t_hi)
    pvalue, statistic = max(sides)       # TOST: the larger of the two one-sided p-values
    hl = (hodges_lehmann(d, level, "two-sided" if alternative == "equivalence" else
                         ("less" if worse == "larger" else "greater"))
          if hodges_lehmann_effect else (math.nan, math.nan, math.nan))
    effect = Effect(mean, float(lo), float(hi))
    return PairedTestResult(
        test=test, alternative=alternative, n=int(d.size), statistic=float(statistic), pvalue=float(pvalue),
        test_effect=effect, mean_effect=effect, hl_effect=Effect(*(float(x) for x in hl)),
        confidence_level=level, exact=test == "ttest", details=details, estimand=TEST_DESCRIPTIONS[test],
        margin=margin, worse=worse if alternative == "noninferiority" else "",
        verdict=margin_verdict(alternative, rejects(pvalue, alpha), margin, worse))


def paired_test(a: np.ndarray, b: np.ndarray | float, test: TestName = "wilcoxon",
                alternative: Alternative = "two-sided", *, confidence_level: float = 0.95,
                n_resamples: int = 9999, seed: int = 0, mean_ci: str = "bootstrap-t",
                margin: float | None = None, worse: str = "larger") -> PairedTestResult:
    """Test the paired difference ``a - b`` across documents.

    ``alternative`` is about A − B: ``less`` means H1: A < B. Pairs with a missing
    value (NaN) on either side are dropped; ``n`` is the number used.  Data the
    test cannot handle give a result with NaN p-value and interval and the reason
    in ``reason`` (see :func:`not_estimable_reason`); ``estimand`` says what the
    test is about.

    Tests at a margin delta (docs/statistics.md §8), for ``ttest`` and ``bootstrap-t``
    (the mean difference): ``alternative="equivalence"`` tests H0: |mean(A − B)| >= delta
    by two one-sided tests (TOST) at level alpha = 1 − ``confidence_level``; p is the
    larger of the two one-sided p-values, and equivalence is declared (p <= alpha)
    exactly when the (1 − 2 alpha) interval (``confidence_interval()``, whose
    ``confidence_level`` the result states) lies inside (−delta, delta).
    ``"noninferiority"`` tests H0: A is worse than B by at least delta, in the
    direction ``worse`` (``"larger"``: H0 mean(A − B) >= delta; ``"smaller"``:
    H0 mean(A − B) <= −delta), with its one-sided (1 − alpha) bound.  Both are refused
    (NaN p-value, ``reason``) below ``MIN_DOCS_MARGIN`` (bootstrap-t) or
    ``MIN_DOCS_MARGIN_T`` (t) documents (:func:`margin_not_estimable_reason`), and the
    result carries ``margin``, ``worse`` and ``verdict``.

    Parameters
    ----------
    a : numpy.ndarray
        Per-document values of side A.
    b : numpy.ndarray or float
        Per-document values of side B (same length), or one known value (e.g. the
        full model's: 0 for mismatch-type metrics).
    test : {"wilcoxon", "ttest", "permutation", "bootstrap-t"}
        The test (docs/plans.md).
    alternative : {"two-sided", "less", "greater", "equivalence", "noninferiority"}
        H1 about A − B (the last two: tests at ``margin``).
    confidence_level : float
        Level of the effect-size intervals (one-sided bounds for one-sided H1); for
        tests at a margin, 1 − alpha (the equivalence interval is at 1 − 2 alpha).
    n_resamples : int
        Monte Carlo permutations (beyond exact enumeration) and bootstrap resamples.
    seed : int
        Seed of every resampling.
    mean_ci : {"bootstrap-t", "t", "bootstrap"}
        Interval for the mean difference (and the effect interval of ``ttest`` and
        ``permutation``): studentized bootstrap (default), t, or BCa bootstrap.
        Refused below ``divstats.estimation.resample.MIN_DOCS_MEAN_DIFFERENCE`` documents, or
        ``MIN_DOCS_MEAN_BOUND`` for a one-sided bound (``ci_reason``);
        ``bootstrap-t`` tests always use their own (dual) interval, and a one-sided
        ``bootstrap-t`` test is itself refused below ``MIN_DOCS_MEAN_BOUND``
        (``reason``; :func:`not_estimable_reason`).
    margin : float, optional
        The margin delta (> 0) of an equivalence or non-inferiority test (required
        there; a negative value is accepted for non-inferiority with ``worse="smaller"``,
        meaning the same bound −|delta|).
    worse : {"larger", "smaller"}
        Non-inferiority: the direction of A − B that is worse for A (the estimand
        table's ``worse``; "larger" for mismatch-type metrics, "smaller" for rmtd).

    Returns
    -------
    PairedTestResult
        Statistic, p-value, the test's effect size with its interval, both effect
        sizes with their intervals, and ``n``.

    Raises
    ------
    ValueError
        For unequal lengths or an unknown test, alternative or ``mean_ci``.

    Examples
    --------
    >>> import numpy as np
    >>> a = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]); b = a + np.array([0.1, 0.12, 0.09, 0.11, 0.1, 0.13])
    >>> res = paired_test(a, b, "ttest", "less")
    >>> res.n, res.pvalue < 0.05
    (6, True)
    >>> rng = np.random.default_rng(0)
    >>> eq = paired_test(0.01 + 0.02 * rng.standard_normal(60), 0.0, "bootstrap-t", "equivalence", margin=0.05,
    ...                  n_resamples=999)
    >>> eq.verdict, eq.confidence_level
    ('equivalent within ±0.05', 0.9)
    """
    _check_args(test, alternative, mean_ci)
    d = _clean_pairs(a, b)
    if alternative in MARGIN_ALTERNATIVES:
        return margin_test(d, test, alternative, margin, worse, confidence_level, n_resamples=n_resamples,
                           seed=seed)
    reason = not_estimable_reason(d, test, alternative)
    if reason:
        return _not_estimable(test, alternative, d, reason, confidence_level)
    if test == "wilcoxon":
        statistic, pvalue, exact = signed_rank_test(d, alternative)
    elif test == "ttest":
        statistic, pvalue, exact = _ttest(d, alternative)
    elif test == "permutation":
        statistic, pvalue, exact = _permutation(d, alternative, n_resamples, seed)
    else:
        statistic, pvalue, exact, bt_lo, bt_hi = _bootstrap_t_test(d, alternative, n_resamples, seed,
                                                              confidence_level)
    hl, hl_lo, hl_hi = hodges_lehmann(d, confidence_level, alternative)
    if test == "bootstrap-t":
        mean_ci = "bootstrap-t"
        mean, m_lo, m_hi = float(d.mean()), bt_lo, bt_hi
    else:
        mean, m_lo, m_hi = mean_difference_interval(d, mean_ci, confidence_level, alternative,
                                                    n_resamples=n_resamples, seed=seed)
    ci_reason = (too_few_documents(d.size, MIN_DOCS_MEAN_DIFFERENCE, "intervals for a mean difference")
                 if alternative == "two-sided" else
                 too_few_documents(d.size, MIN_DOCS_MEAN_BOUND, "one-sided bounds for a mean difference"))
    if ci_reason:
        m_lo, m_hi = math.nan, math.nan
    effect, lo, hi = (hl, hl_lo, hl_hi) if test == "wilcoxon" else (mean, m_lo, m_hi)
    return PairedTestResult(
        test=test, alternative=alternative, n=int(d.size), statistic=statistic, pvalue=pvalue,
        test_effect=Effect(float(effect), float(lo), float(hi)),
        mean_effect=Effect(float(mean), float(m_lo), float(m_hi)),
        hl_effect=Effect(float(hl), float(hl_lo), float(hl_hi)),
        confidence_level=confidence_level, exact=exact,
        details={"effect_kind": _effect_kind(test), "mean_ci": mean_ci, "n_zero": int(np.sum(d == 0))},
        estimand=TEST_DESCRIPTIONS[test], ci_reason=ci_reason,
    )


def mean_difference_interval(d: np.ndarray, mean_ci: str = "bootstrap-t", confidence_level: float = 0.95,
                             alternative: Alternative = "two-sided", *, n_resamples: int = 9999,
                             seed: int = 0) -> Effect:
    """Mean of paired differences with its interval by one of :data:`MEAN_CIS`, without a threshold.

    :func:`paired_test` reports this interval only from
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
    if d.size < 2 or _zero_spread(d):
        return Effect(mean, math.nan, math.nan)      # t* undefined; a zero-width interval would claim certainty
    return Effect(mean, *_bootstrap_t_test(d, alternative, n_resamples, seed, confidence_level)[3:])


def rejects(pvalue, alpha: float):
    """The one rejection rule: reject when the (adjusted) p-value is <= alpha; NaN never rejects.

    Parameters
    ----------
    pvalue : float or numpy.ndarray
        (Adjusted) p-values; NaN means not estimable.
    alpha : float
        The level.

    Returns
    -------
    bool or numpy.ndarray
        The decision(s).

    Examples
    --------
    >>> rejects(0.05, 0.05), rejects(float("nan"), 0.05)
    (True, False)
    """
    p = np.asarray(pvalue, dtype=float)
    out = np.nan_to_num(p, nan=np.inf) <= alpha
    return bool(out) if out.ndim == 0 else out


def holm(pvalues: np.ndarray, alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Holm step-down within one family: ``(reject, p_adjusted)``; NaN p-values stay NaN.

    ``p_adjusted`` is statsmodels' Holm adjustment; ``reject`` is :func:`rejects`
    (p_adjusted <= alpha), the same rule as an unadjusted test.
    Parameters
    ----------
    pvalues : numpy.ndarray
        The family's p-values (NaN: not evaluated).
    alpha : float
        The family's level.

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        Boolean rejections and adjusted p-values.

    Examples
    --------
    >>> import numpy as np
    >>> reject, adj = holm(np.array([0.01, 0.04, np.nan]))
    >>> reject.tolist(), [round(float(x), 2) for x in adj]
    ([True, True, False], [0.02, 0.04, nan])
    """
    from statsmodels.stats.multitest import multipletests  # lazy: statsmodels is heavy and only holm needs it

    p = np.asarray(pvalues, dtype=float)
    adjusted = np.full(p.shape, np.nan)
    ok = np.isfinite(p)
    if ok.any():
        adjusted[ok] = multipletests(p[ok], alpha=alpha, method="holm")[1]
    return rejects(adjusted, alpha), adjusted
