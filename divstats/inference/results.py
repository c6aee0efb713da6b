"""What a paired test returns: :class:`PairedTestResult` (scipy-style named fields) and its
:class:`Effect` records (an effect size and its interval).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from divstats.intervals import ConfidenceInterval

__all__ = ["Effect", "PairedTestResult"]


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
    """Result of :func:`~divstats.inference.paired.paired_test` (scipy-style named fields).

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
    verdict: str = ""          # tests at a margin: the unadjusted verdict in words (``margins.margin_verdict``)

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
