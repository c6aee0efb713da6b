"""Paired comparisons across documents (docs/statistics.md §8).

The document is the unit of inference: each document contributes one paired
difference ``d = a - b`` (policy A minus policy B, or late minus early window).
Per-document Monte Carlo error is part of the between-document spread, so the
tests below are valid without modelling it separately.

Four tests, one- or two-sided (``alternative`` refers to ``A - B``); each tests
one estimand (:data:`~divstats.inference.choices.TEST_DESCRIPTIONS`), stated in every result:

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

Multiplicity: :func:`~divstats.inference.multiplicity.holm` applies statsmodels' Holm
step-down within one family.  One rejection rule everywhere
(:func:`~divstats.inference.multiplicity.rejects`): reject when the (adjusted) p-value is <= alpha.

This module is the dispatcher, :func:`paired_test`; the parts live by job in
``divstats.inference``: ``choices`` (the tests, alternatives, mean-difference intervals),
``results`` (``PairedTestResult``, ``Effect``), ``location_tests`` (the four tests and their
null laws), ``effects`` (Hodges–Lehmann and the mean difference with their intervals),
``refusals`` (when a test is not estimable), ``margins`` (equivalence and
non-inferiority) and ``multiplicity`` (``holm``, ``rejects``).
"""

from __future__ import annotations

import math

import numpy as np

from divstats.estimation.bounded import betting_interval, betting_pvalue
from divstats.estimation.resample import MIN_DOCS_MEAN_BOUND, MIN_DOCS_MEAN_DIFFERENCE, too_few_documents
from divstats.inference.choices import (
    ALTERNATIVES,
    MARGIN_ALTERNATIVES,
    MEAN_CIS,
    TEST_DESCRIPTIONS,
    TESTS,
    Alternative,
    TestName,
)
from divstats.inference.effects import hodges_lehmann, mean_difference_interval
from divstats.inference.location_tests import bootstrap_t_test, sign_flip_test, signed_rank_test, t_test
from divstats.inference.margins import BETTING_NOTE, margin_test, uses_betting
from divstats.inference.refusals import not_estimable_reason
from divstats.inference.results import Effect, PairedTestResult

__all__ = ["paired_pvalue", "paired_test"]


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


def paired_test(a: np.ndarray, b: np.ndarray | float, test: TestName = "wilcoxon",
                alternative: Alternative = "two-sided", *, confidence_level: float = 0.95,
                n_resamples: int = 9999, seed: int = 0, mean_ci: str = "bootstrap-t",
                margin: float | None = None, worse: str = "larger",
                bounds: tuple[float, float] | None = None) -> PairedTestResult:
    """Test the paired difference ``a - b`` across documents.

    ``alternative`` is about A − B: ``less`` means H1: A < B. Pairs with a missing
    value (NaN) on either side are dropped; ``n`` is the number used.  Data the
    test cannot handle give a result with NaN p-value and interval and the reason
    in ``reason`` (see :func:`~divstats.inference.refusals.not_estimable_reason`); ``estimand`` says what the
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
    ``MIN_DOCS_MARGIN_T`` (t) documents (:func:`~divstats.inference.margins.margin_not_estimable_reason`), and the
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
        (``reason``; :func:`~divstats.inference.refusals.not_estimable_reason`).
    margin : float, optional
        The margin delta (> 0) of an equivalence or non-inferiority test (required
        there; a negative value is accepted for non-inferiority with ``worse="smaller"``,
        meaning the same bound −|delta|).
    worse : {"larger", "smaller"}
        Non-inferiority: the direction of A − B that is worse for A (the estimand
        table's ``worse``; "larger" for mismatch-type metrics, "smaller" for rmtd).
    bounds : (float, float), optional
        The range of A − B when the metric's range is known
        (``divstats.estimation.bounded.difference_range``): a one-sided ``bootstrap-t`` test or a
        test at a margin below 50 documents (where bootstrap-t is refused) is then the betting test
        of a bounded mean (:func:`~divstats.inference.margins.margin_test`), valid at every n.

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
                           seed=seed, bounds=bounds)
    reason = not_estimable_reason(d, test, alternative)
    if reason and alternative in ("less", "greater") and uses_betting(d, test, bounds):
        return _betting_one_sided(d, alternative, bounds, confidence_level, seed)
    if reason:
        return _not_estimable(test, alternative, d, reason, confidence_level)
    statistic, pvalue, exact, bt_lo, bt_hi = _location_test(d, test, alternative, n_resamples, seed,
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


def paired_pvalue(a: np.ndarray, b: np.ndarray | float, test: TestName = "wilcoxon",
                  alternative: Alternative = "two-sided", *, n_resamples: int = 9999, seed: int = 0) -> float:
    """The p-value :func:`paired_test` reports, without its effect sizes and intervals.

    The same pairs, refusals and test as ``paired_test`` (so the two agree exactly), for
    callers that run many tests and need only the decision: the effect intervals
    (Hodges–Lehmann inversion, bootstrap) cost most of ``paired_test``'s time at
    large n.  Margin alternatives are not served (use ``paired_test``).

    Parameters
    ----------
    a, b, test, alternative, n_resamples, seed
        As for :func:`paired_test`.

    Returns
    -------
    float
        The p-value; NaN where ``paired_test`` finds the data not estimable.

    Raises
    ------
    ValueError
        As ``paired_test``, and for a margin alternative.

    Examples
    --------
    >>> import numpy as np
    >>> a = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]); b = a + np.array([0.1, 0.12, 0.09, 0.11, 0.1, 0.13])
    >>> paired_pvalue(a, b, "ttest", "less") == paired_test(a, b, "ttest", "less").pvalue
    True
    """
    _check_args(test, alternative, "bootstrap-t")
    if alternative in MARGIN_ALTERNATIVES:
        raise ValueError("paired_pvalue does not serve tests at a margin; use paired_test")
    d = _clean_pairs(a, b)
    if not_estimable_reason(d, test, alternative):
        return math.nan
    return float(_location_test(d, test, alternative, n_resamples, seed, 0.95)[1])


def _location_test(d: np.ndarray, test: str, alternative: str, n_resamples: int, seed: int,
                   confidence_level: float) -> tuple[float, float, bool, float, float]:
    """(statistic, p-value, exact, and the bootstrap-t test's dual interval: NaN for the others)."""
    if test == "wilcoxon":
        return (*signed_rank_test(d, alternative), math.nan, math.nan)
    if test == "ttest":
        return (*t_test(d, alternative), math.nan, math.nan)
    if test == "permutation":
        return (*sign_flip_test(d, alternative, n_resamples, seed), math.nan, math.nan)
    return bootstrap_t_test(d, alternative, n_resamples, seed, confidence_level)


def _betting_one_sided(d: np.ndarray, alternative: str, bounds: tuple[float, float], confidence_level: float,
                       seed: int) -> PairedTestResult:
    """The one-sided bootstrap-t test below its threshold, on a metric of known range: the betting test.

    p = 1 / e-value against mean 0 (size <= alpha at every n), the bound the one-sided betting bound."""
    lo_r, hi_r = bounds
    p = float(betting_pvalue(d, 0.0, lo_r, hi_r, alternative=alternative, level=confidence_level, seed=seed))
    ci = betting_interval(d, lo_r, hi_r, level=confidence_level, alternative=alternative, seed=seed)
    lo, hi = (ci.low, math.inf) if alternative == "greater" else (-math.inf, ci.high)
    mean = float(d.mean())
    hl, hl_lo, hl_hi = hodges_lehmann(d, confidence_level, alternative)
    effect = Effect(mean, float(lo), float(hi))
    return PairedTestResult(
        test="bootstrap-t", alternative=alternative, n=int(d.size), statistic=(1.0 / p if p > 0 else math.inf),
        pvalue=p, test_effect=effect, mean_effect=effect, hl_effect=Effect(float(hl), float(hl_lo), float(hl_hi)),
        confidence_level=confidence_level, exact=False,
        details={"effect_kind": "mean_difference", "mean_ci": "betting", "method": "betting",
                 "n_zero": int(np.sum(d == 0))},
        estimand=TEST_DESCRIPTIONS["bootstrap-t"] + BETTING_NOTE)


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
