"""When a paired test is refused (docs/statistics.md §8): too few documents or zero spread.

Degenerate data (one document for a permutation or bootstrap test, zero spread for the t
and bootstrap-t tests) are *not estimable*: the result has a NaN p-value and interval with
the reason in ``reason``; nothing raises and nothing claims certainty.  So is a one-sided
``bootstrap-t`` test below ``divstats.estimation.resample.MIN_DOCS_MEAN_BOUND`` documents
(docs/plans.md, "One-sided tests of a mean").  Tests at a margin have their own thresholds
(``divstats.inference.margins.margin_not_estimable_reason``).
"""

from __future__ import annotations

import numpy as np

from divstats.estimation.resample import MIN_DOCS_MEAN_BOUND, MIN_DOCS_MEAN_DIFFERENCE, too_few_documents

__all__ = ["MIN_DOCS_BY_TEST", "ZERO_SPREAD", "not_estimable_reason", "zero_spread"]

#: Relative spread below which the differences count as constant (t undefined).
ZERO_SPREAD = 1e-12


def zero_spread(d: np.ndarray) -> bool:
    """All differences equal up to rounding (0.1 and 0.1 + 1e-17 included): t is undefined there.

    Parameters
    ----------
    d : numpy.ndarray
        Paired differences (NaN-free).

    Returns
    -------
    bool
        True when the spread is at most :data:`ZERO_SPREAD` relative to the largest |d|.

    Examples
    --------
    >>> import numpy as np
    >>> zero_spread(np.array([0.1, 0.1 + 1e-17])), zero_spread(np.array([0.1, 0.2]))
    (True, False)
    """
    return d.size > 0 and float(np.ptp(d)) <= ZERO_SPREAD * max(float(np.max(np.abs(d))), 1e-300)

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
        One of :data:`~divstats.inference.choices.TESTS`.
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
    if test in ("ttest", "bootstrap-t") and zero_spread(d):
        return (f"not estimable: all {d.size} differences are equal ({d[0]:.6g}), so the spread is 0 "
                f"and {test} is undefined")
    if test == "bootstrap-t" and alternative != "two-sided":
        # too liberal below the threshold on skewed differences (docs/plans.md, "One-sided tests of a mean")
        reason = too_few_documents(d.size, MIN_DOCS_MEAN_BOUND, "one-sided bootstrap-t tests of a mean difference")
        if reason:
            return f"{reason}; a two-sided test holds its size from {MIN_DOCS_MEAN_DIFFERENCE} documents"
    return ""
