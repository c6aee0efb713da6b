"""What a paired test can be asked (docs/statistics.md §8, docs/plans.md).

The tests and what each is about (its estimand in words, stated in every result), the
alternatives (difference tests and tests at a margin), which tests run at a margin, the
directions that can be worse, and the intervals for the mean difference.  Every module of
the paired tests (``paired``, ``effects``, ``margins``, ...) and the plans read these.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "ALTERNATIVES", "Alternative", "MARGIN_ALTERNATIVES", "MARGIN_TESTS", "MEAN_CIS", "TESTS", "TEST_DESCRIPTIONS",
    "TestName", "WORSE",
]

#: H1 about A - B: difference tests and tests at a margin (:data:`ALTERNATIVES`, :data:`MARGIN_ALTERNATIVES`).
Alternative = Literal["two-sided", "less", "greater", "equivalence", "noninferiority"]

#: The tests by name (:data:`TESTS` is the full list).
TestName = Literal["wilcoxon", "ttest", "permutation"]

#: The four tests, in the order plans and the docs list them.
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

#: The alternatives of a difference test (A - B against 0).
ALTERNATIVES: tuple[str, ...] = ("two-sided", "less", "greater")

#: Tests at a margin (``paired_test(..., alternative=..., margin=delta)``; docs/statistics.md §8).
MARGIN_ALTERNATIVES: tuple[str, ...] = ("equivalence", "noninferiority")

#: The tests that run at a margin (they are about the mean difference).
MARGIN_TESTS: tuple[str, ...] = ("bootstrap-t", "ttest")

#: Which direction of A - B is worse for A (``paired_test(..., worse=...)``; the estimand table's ``worse``).
WORSE: tuple[str, ...] = ("larger", "smaller")

#: Intervals for the mean difference (``paired_test(..., mean_ci=...)``); the first is the default.
MEAN_CIS: tuple[str, ...] = ("bootstrap-t", "t", "bootstrap")
