"""Tests at a margin: equivalence (TOST) and non-inferiority of the mean difference.

``paired_test(..., alternative="equivalence" | "noninferiority", margin=delta)`` runs
:func:`margin_test` on the paired differences (docs/statistics.md §8); the thresholds
below which these tests are refused are :func:`margin_not_estimable_reason`'s, and
:func:`margin_verdict` says the outcome in words.
"""

from __future__ import annotations

import math

import numpy as np

from divstats.estimation.bounded import MIN_DOCS_BOUNDED, betting_interval, betting_pvalue, in_range
from divstats.estimation.resample import MIN_DOCS_MARGIN, MIN_DOCS_MARGIN_T, too_few_documents
from divstats.inference.choices import MARGIN_TESTS, TEST_DESCRIPTIONS, WORSE
from divstats.inference.effects import hodges_lehmann, mean_difference_t
from divstats.inference.location_tests import bootstrap_t_test, t_test
from divstats.inference.multiplicity import rejects
from divstats.inference.refusals import not_estimable_reason
from divstats.inference.results import Effect, PairedTestResult

__all__ = ["BETTING_NOTE", "margin_not_estimable_reason", "margin_test", "margin_verdict", "uses_betting"]

#: Added to a test's estimand where the betting test stood in for bootstrap-t (a bounded metric, few documents).
BETTING_NOTE = (f"; below {MIN_DOCS_MARGIN} documents, on a metric of known range, the betting test of a bounded "
                "mean (Waudby-Smith & Ramdas; p = 1 / e-value, valid at every n)")


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

    Besides the test's own conditions (:func:`~divstats.inference.refusals.not_estimable_reason`) it needs
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
        t, p, _ = t_test(e, side)
        _, lo, hi = mean_difference_t(e, level, side)
    else:
        t, p, _, lo, hi = bootstrap_t_test(e, side, n_resamples, seed, level)
    return t, p, (lo if side == "greater" else hi) - shift


def uses_betting(d: np.ndarray, test: str, bounds: tuple[float, float] | None, min_docs: int | None = None) -> bool:
    """Whether a test at a margin is the betting test: bootstrap-t asked for, below its threshold, on
    differences whose range is known and holds them (the betting test keeps its size at every n).

    Examples
    --------
    >>> import numpy as np
    >>> uses_betting(np.zeros(12), "bootstrap-t", (-1.0, 1.0)), uses_betting(np.zeros(12), "bootstrap-t", None)
    (True, False)
    """
    return (test == "bootstrap-t" and bounds is not None and min_docs is None
            and MIN_DOCS_BOUNDED <= d.size < MIN_DOCS_MARGIN and in_range(d, *bounds))


def _betting_sides(d: np.ndarray, shift: float, side: str, bounds: tuple[float, float], seed: int,
                   level: float) -> tuple[float, float, float]:
    """(e-value, p, bound) of the betting test of mean(d) vs ``-shift`` (``side`` = H1) and its (level) bound."""
    lo, hi = bounds
    p = float(betting_pvalue(d, -shift, lo, hi, alternative=side, level=level, seed=seed))
    ci = betting_interval(d, lo, hi, level=level, alternative=side, seed=seed)
    return (1.0 / p if p > 0 else math.inf), p, float(ci.low if side == "greater" else ci.high)


def margin_test(d: np.ndarray, test: str, alternative: str, margin: float, worse: str = "larger",
                confidence_level: float = 0.95, *, n_resamples: int = 9999, seed: int = 0,
                min_docs: int | None = None, hodges_lehmann_effect: bool = True,
                bounds: tuple[float, float] | None = None) -> PairedTestResult:
    """TOST (equivalence) or the one-sided test at the margin (non-inferiority) of the mean of ``d``.

    ``paired_test`` with a margin alternative runs this on ``a - b``; ``min_docs``
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
    bounds : (float, float), optional
        The range the differences are known to lie in (``divstats.estimation.bounded.difference_range``
        of the metric's range).  With it, ``bootstrap-t`` below ``MIN_DOCS_MARGIN`` documents (where it is
        refused) is the betting test of a bounded mean instead (``details["method"] = "betting"``): its
        p-value is 1/e-value, valid at every n (docs/plans.md, "Tests at a margin").

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
    betting = uses_betting(d, test, bounds, min_docs)
    reason = "" if betting else margin_not_estimable_reason(d, test, min_docs)
    details: dict[str, object] = {"effect_kind": "mean_difference", "mean_ci": "betting" if betting else test,
                                  "n_zero": int(np.sum(d == 0)), "alpha": alpha,
                                  "method": "betting" if betting else test}
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
    def one_side(shift: float, side: str) -> tuple[float, float, float]:
        if betting:
            return _betting_sides(d, shift, side, bounds, seed, confidence_level)
        return _margin_sides(d, test, shift, side, n_resamples, seed, confidence_level)

    if alternative == "equivalence" or worse == "smaller":
        t_lo, p_lo, lo = one_side(margin, "greater")
        sides.append((p_lo, t_lo))
        details.update(p_lower=p_lo, t_lower=t_lo)
    if alternative == "equivalence" or worse == "larger":
        t_hi, p_hi, hi = one_side(-margin, "less")
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
        confidence_level=level, exact=test == "ttest", details=details,
        estimand=TEST_DESCRIPTIONS[test] + (BETTING_NOTE if betting else ""), margin=margin,
        worse=worse if alternative == "noninferiority" else "",
        verdict=margin_verdict(alternative, rejects(pvalue, alpha), margin, worse))
