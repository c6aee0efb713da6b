"""Calibration studies for the inference layer: simulated studies with known truth.

Two kinds of experiment, shared by the tests (small, seconds) and
``benchmarks/bench_calibration.py`` (larger, printing a table):

* :func:`paired_calibration` — type-I error and power of the paired tests, and
  coverage of their effect-size intervals, on per-document differences drawn
  from a symmetric heavy-tailed or a skewed law with a known mean;
  :func:`mean_interval_coverage` — the mean difference's intervals alone, below
  their refusal threshold too;
* :func:`decomposition_coverage` — coverage of the intervals over documents
  (hybrid-t, bootstrap-t, jackknife-t, BCa, percentile) for the gap decomposition and
  its shares, documents drawn from a symmetric or a skewed population whose aggregate
  gap and parts are known (computed from a very large draw);
* :func:`aggregate_coverage` — the same for one policy's aggregate estimates
  (document means, and the rate, a ratio of means).

The simulated trace studies they draw on (:func:`divstats.truth.studies.simulate_study`)
live in ``truth/``, since production code uses them; nothing outside this room
imports it (tests/test_divstats_layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from divstats.estimation.bounded import betting_interval
from divstats.estimation.estimators import INTERVAL_QUANTITIES, aggregate_statistic
from divstats.estimation.resample import MIN_DOCS_AGGREGATE, MIN_DOCS_INTERVAL, document_interval
from divstats.inference.decompose import PARTS, parts_and_shares, split_gap
from divstats.inference.effects import mean_difference_interval
from divstats.inference.margins import margin_test
from divstats.inference.multiplicity import rejects
from divstats.inference.paired import paired_test

__all__ = [
    "POPULATIONS", "AggregateCoverage", "DecompositionCoverage", "MeanIntervalCoverage", "PairedCalibration",
    "aggregate_coverage", "decomposition_coverage", "mean_interval_coverage",
    "document_population", "draw_differences", "policy_documents", "pseudo_median",
    "paired_calibration", "MarginCalibration", "margin_calibration", "BOUNDED_LAWS", "BoundedCoverage",
    "bounded_coverage",
]

# ---------------------------------------------------------------------------
# Paired tests: size, power, interval coverage
# ---------------------------------------------------------------------------

#: Populations of per-document differences: ``symmetric`` = shift + 0.1 t5 (mean, median
#: and pseudo-median all equal the shift); ``skewed`` = shift + 0.1 (Exp(1) − 1) (mean =
#: shift; skewness 2, so the median and pseudo-median lie below it).
POPULATIONS: tuple[str, ...] = ("symmetric", "skewed")
#: Pseudo-median of Exp(1) − 1: half the median of Gamma(2, 1), minus 1.
_EXP_PSEUDO_MEDIAN = 0.5 * 1.6783469900166608 - 1.0


def draw_differences(population: str, n: int, shift: float, rng: np.random.Generator) -> np.ndarray:
    """Per-document differences from one of :data:`POPULATIONS` (mean = ``shift``).

    Parameters
    ----------
    population : {"symmetric", "skewed"}
        The law.
    n : int
        Documents.
    shift : float
        The mean.
    rng : numpy.random.Generator
        Randomness.

    Returns
    -------
    numpy.ndarray
        ``n`` differences.

    Raises
    ------
    ValueError
        For an unknown population.

    Examples
    --------
    >>> import numpy as np
    >>> draw_differences("skewed", 4, 0.0, np.random.default_rng(0)).shape
    (4,)
    """
    if population == "symmetric":
        return shift + 0.1 * rng.standard_t(5, n)
    if population == "skewed":
        return shift + 0.1 * (rng.exponential(1.0, n) - 1.0)
    raise ValueError(f"unknown population {population!r}; expected one of {POPULATIONS}")


def pseudo_median(population: str, shift: float) -> float:
    """The Hodges–Lehmann location of a population of :func:`draw_differences`.

    Parameters
    ----------
    population : {"symmetric", "skewed"}
        The law.
    shift : float
        Its mean.

    Returns
    -------
    float
        The pseudo-median.

    Examples
    --------
    >>> round(pseudo_median("skewed", 0.0), 4)
    -0.0161
    """
    return shift + (0.1 * _EXP_PSEUDO_MEDIAN if population == "skewed" else 0.0)


@dataclass(frozen=True)
class PairedCalibration:
    """Outcome of :func:`paired_calibration`: rejection rate and interval coverages at one setting."""

    test: str
    alternative: str
    n_docs: int
    n_sims: int
    shift: float
    rejection_rate: float
    effect_coverage: float
    mean_ci_coverage: float
    hl_ci_coverage: float
    population: str = "symmetric"
    not_estimable: float = 0.0
    ci_refused: float = 0.0      # fraction of studies whose test interval was refused (too few documents)
    #: bootstrap-t only (``unrefused=True``): rejection rate of the same test without its
    #: refusal below divstats.estimation.resample.MIN_DOCS_MEAN_BOUND (its dual bound excludes 0)
    rejection_unrefused: float = float("nan")


def paired_calibration(test: str = "wilcoxon", *, n_docs: int = 20, n_sims: int = 400, shift: float = 0.0,
                       alpha: float = 0.05, alternative: str = "two-sided", seed: int = 0,
                       n_resamples: int = 999, mean_ci: str = "bootstrap-t",
                       population: str = "symmetric", unrefused: bool = False) -> PairedCalibration:
    """Rejection rate and interval coverage for per-document differences from ``population``.

    The mean difference is ``shift`` in both populations, so ``rejection_rate`` at
    shift 0 is the size *for the mean*; the mean intervals are checked against the
    shift and the Hodges–Lehmann interval against the population's pseudo-median.
    The test's own interval is checked against its own estimand.  Coverages are over
    the studies where the interval was reported (``ci_refused``: the fraction where
    the test's interval was refused for too few documents).

    Parameters
    ----------
    test : str
        The paired test (``divstats.inference.choices.TESTS``).
    n_docs, n_sims : int
        Documents per simulated study and studies.
    shift : float
        The true mean of the differences (0: the null for the mean).
    alpha : float
        Level of the test; intervals are at 1 − alpha.
    alternative : str
        H1 about A − B.
    seed : int
        Seed of the simulation.
    n_resamples : int
        Resamples of each test.
    mean_ci : {"bootstrap-t", "t", "bootstrap"}
        Interval for the mean difference.
    population : {"symmetric", "skewed"}
        Law of the differences (:func:`draw_differences`).
    unrefused : bool
        For ``bootstrap-t``: also measure the rejection rate without the refusal of
        one-sided tests below ``divstats.estimation.resample.MIN_DOCS_MEAN_BOUND`` (the test
        rejects exactly when its dual interval, computed without threshold by
        ``divstats.inference.effects.mean_difference_interval``, excludes 0), i.e. the
        behaviour before that refusal.

    Returns
    -------
    PairedCalibration
        Rejection rate, the three coverages and the not-estimable fraction.

    Raises
    ------
    ValueError
        For ``unrefused`` with a test other than ``bootstrap-t``.

    Examples
    --------
    >>> r = paired_calibration("ttest", n_docs=10, n_sims=20, population="skewed")
    >>> 0 <= r.rejection_rate <= 1
    True
    """
    if unrefused and test != "bootstrap-t":
        raise ValueError(f"unrefused is measured for bootstrap-t only, not {test!r}")
    rng = np.random.default_rng(seed)
    rej = cov = cov_m = cov_hl = bad = shown = shown_m = rej_u = 0
    hl_truth = pseudo_median(population, shift)
    own = hl_truth if test == "wilcoxon" else shift
    for i in range(n_sims):
        a = rng.normal(0.5, 0.2, n_docs)  # the per-document level cancels in the pair
        d = draw_differences(population, n_docs, shift, rng)
        res = paired_test(a + d, a, test, alternative, confidence_level=1 - alpha,
                          n_resamples=n_resamples, seed=i, mean_ci=mean_ci)
        if unrefused:   # the same resamples as paired_test's (same seed), without the threshold
            _, lo, hi = mean_difference_interval((a + d) - a, "bootstrap-t", 1 - alpha, alternative,
                                                 n_resamples=n_resamples, seed=i)
            rej_u += bool(lo > 0.0 or hi < 0.0)
        bad += bool(res.reason)
        rej += rejects(res.pvalue, alpha)
        reported = not (np.isnan(res.ci_low) or np.isnan(res.ci_high))
        shown += reported
        cov += reported and res.ci_low <= own <= res.ci_high
        reported_m = not (np.isnan(res.mean_ci_low) or np.isnan(res.mean_ci_high))
        shown_m += reported_m
        cov_m += reported_m and res.mean_ci_low <= shift <= res.mean_ci_high
        cov_hl += res.hl_ci_low <= hl_truth <= res.hl_ci_high
    rate = lambda k, m: float(k / m) if m else float("nan")  # noqa: E731
    return PairedCalibration(test, alternative, n_docs, n_sims, shift, float(rej / n_sims),
                             rate(cov, shown), rate(cov_m, shown_m), float(cov_hl / n_sims),
                             population, float(bad / n_sims), float(1 - shown / n_sims),
                             float(rej_u / n_sims) if unrefused else float("nan"))


@dataclass(frozen=True)
class MarginCalibration:
    """Outcome of :func:`margin_calibration`: rejection rate of a test at a margin at one true difference."""

    test: str
    alternative: str
    n_docs: int
    n_sims: int
    margin: float
    shift: float
    population: str
    worse: str
    rejection_rate: float       # over all studies, without the refusal threshold
    coverage: float             # the test's interval (1 - 2 alpha for equivalence) covers the shift
    not_estimable: float        # fraction of studies the test could not run (zero spread), threshold aside

    @property
    def se(self) -> float:
        """Binomial standard error of :attr:`rejection_rate`."""
        r = self.rejection_rate
        return float(np.sqrt(max(r * (1 - r), 1e-12) / self.n_sims))


def margin_calibration(test: str = "bootstrap-t", alternative: str = "equivalence", *, n_docs: int = 50,
                       margin: float = 0.05, population: str = "skewed", shift: float | None = None,
                       worse: str = "larger", n_sims: int = 400, alpha: float = 0.05, n_resamples: int = 999,
                       seed: int = 0) -> MarginCalibration:
    """Size at the margin or power of an equivalence / non-inferiority test, by simulation.

    Differences are drawn from ``population`` (:func:`draw_differences`, SD 0.1 for
    ``skewed``, 0.129 for ``symmetric``) with mean ``shift``; the test runs without its
    refusal threshold (``min_docs=2``), so the table shows what it would do below it.
    ``shift = ±margin`` (the boundary of H0, the worst case) gives the size;
    ``shift = 0`` the power.  The default shift is the boundary: ``+margin`` for
    equivalence and for non-inferiority with ``worse="larger"``, ``-margin`` otherwise.

    Parameters
    ----------
    test : {"bootstrap-t", "ttest"}
        The test.
    alternative : {"equivalence", "noninferiority"}
        The test at a margin.
    n_docs, n_sims : int
        Documents per study and studies.
    margin : float
        delta.
    population : {"symmetric", "skewed"}
        Law of the differences.
    shift : float, optional
        True mean difference.
    worse : {"larger", "smaller"}
        Non-inferiority direction.
    alpha : float
        Level.
    n_resamples : int
        Bootstrap resamples.
    seed : int
        Seed of the simulation.

    Returns
    -------
    MarginCalibration
        The rejection rate (``.se`` its binomial SE) and the interval's coverage.

    Examples
    --------
    >>> r = margin_calibration("ttest", n_docs=10, n_sims=20)
    >>> 0 <= r.rejection_rate <= 1
    True
    """
    if shift is None:
        shift = -margin if (alternative == "noninferiority" and worse == "smaller") else margin
    rng = np.random.default_rng(seed)
    rej = cov = bad = 0
    for i in range(n_sims):
        d = draw_differences(population, n_docs, shift, rng)
        res = margin_test(d, test, alternative, margin, worse, 1 - alpha, n_resamples=n_resamples, seed=i,
                          min_docs=2, hodges_lehmann_effect=False)
        bad += bool(res.reason)
        rej += rejects(res.pvalue, alpha)
        cov += bool(res.ci_low <= shift <= res.ci_high)
    return MarginCalibration(test, alternative, n_docs, n_sims, float(margin), float(shift), population, worse,
                             float(rej / n_sims), float(cov / n_sims), float(bad / n_sims))


@dataclass(frozen=True)
class MeanIntervalCoverage:
    """Outcome of :func:`mean_interval_coverage`."""

    method: str
    alternative: str
    n_docs: int
    n_sims: int
    population: str
    coverage: float
    infinite: float        # fraction of studies whose bound(s) were infinite
    undefined: float       # fraction with NaN bounds (no spread in the differences)


def mean_interval_coverage(method: str = "bootstrap-t", *, n_docs: int = 10, n_sims: int = 400,
                           alternative: str = "two-sided", level: float = 0.95, population: str = "skewed",
                           seed: int = 0, n_resamples: int = 999) -> MeanIntervalCoverage:
    """Coverage of a mean-difference interval (``inference.effects.mean_difference_interval``) of the true mean.

    Measured without the refusal threshold of ``paired_test``, so that the
    threshold can be read off; the truth is the population's mean (0).

    Parameters
    ----------
    method : {"bootstrap-t", "t", "bootstrap"}
        ``divstats.inference.choices.MEAN_CIS``.
    n_docs, n_sims : int
        Documents per simulated study and studies.
    alternative : {"two-sided", "less", "greater"}
        Two-sided interval or one-sided bound ("less": an upper bound).
    level : float
        Confidence level.
    population : {"symmetric", "skewed"}
        Law of the differences (:func:`draw_differences`).
    seed, n_resamples : int
        Seed of the simulation and bootstrap resamples.

    Returns
    -------
    MeanIntervalCoverage
        Coverage, and the fractions of infinite and undefined intervals.

    Examples
    --------
    >>> c = mean_interval_coverage("t", n_docs=5, n_sims=50)
    >>> 0.0 <= c.coverage <= 1.0
    True
    """
    rng = np.random.default_rng(seed)
    hit = inf = nan = 0
    for i in range(n_sims):
        d = draw_differences(population, n_docs, 0.0, rng)
        _, lo, hi = mean_difference_interval(d, method, level, alternative, n_resamples=n_resamples, seed=i)
        nan += bool(np.isnan(lo) or np.isnan(hi))
        inf += bool(np.isinf(lo) and np.isinf(hi)) if alternative == "two-sided" else \
            bool(np.isinf(lo if alternative == "greater" else hi))
        hit += bool(lo <= 0.0 <= hi)
    return MeanIntervalCoverage(method, alternative, n_docs, n_sims, population, hit / n_sims, inf / n_sims,
                                nan / n_sims)


# ---------------------------------------------------------------------------
# Intervals over documents: the gap decomposition and its shares
# ---------------------------------------------------------------------------

def document_population(n: int, rng: np.random.Generator, horizon: int,
                        population: str = "skewed") -> tuple[np.ndarray, ...]:
    """Per-document (o_A, o_B, e_A, e_B, post_A, post_B), A and B correlated through the document.

    ``skewed``: occurrence levels log-normal (most documents rarely diverge, a few
    often), rates Beta(1, 6); ``symmetric``: levels Beta(3, 3), rates Beta(4, 4) / 2.

    Parameters
    ----------
    n : int
        Documents.
    rng : numpy.random.Generator
        Randomness.
    horizon : int
        T.
    population : {"symmetric", "skewed"}
        The population.

    Returns
    -------
    tuple of numpy.ndarray
        (o_A, o_B, e_A, e_B, post_A, post_B).

    Raises
    ------
    ValueError
        For an unknown population.

    Examples
    --------
    >>> import numpy as np
    >>> len(document_population(5, np.random.default_rng(0), 10))
    6
    """
    if population == "skewed":
        base = np.clip(np.exp(rng.normal(-1.8, 0.9, n)), 0, 0.75)
        r = rng.beta(1.0, 6.0, n)
    elif population == "symmetric":
        base = rng.beta(3.0, 3.0, n) * 0.7
        r = rng.beta(4.0, 4.0, n) / 2
    else:
        raise ValueError(f"unknown population {population!r}; expected one of {POPULATIONS}")
    o_a = np.clip(base + rng.normal(0, 0.03, n), 0, 1)
    o_b = np.clip(base * 1.3 + rng.normal(0, 0.03, n), 0, 1)
    frac = rng.uniform(0.3, 0.7, n)                  # how early divergence happens
    e_a = o_a * horizon * frac
    e_b = o_b * horizon * np.clip(frac + 0.1, 0, 1)
    return o_a, o_b, e_a, e_b, e_a * r, e_b * np.clip(r * 1.2, 0, 1)


@dataclass(frozen=True)
class DecompositionCoverage:
    """Outcome of :func:`decomposition_coverage`: coverage per part and the true values."""

    n_docs: int
    n_sims: int
    level: float
    method: str
    coverage: dict[str, float]
    truth: dict[str, float]
    population: str = "skewed"
    refused: float = 0.0          # fraction of studies with no interval (too few documents)
    shares_refused: float = 0.0   # fraction with the shares refused (gap interval covers 0, or no interval)


#: The decomposition's parts and shares, in ``parts_and_shares`` order (``divstats.inference.decompose.PARTS``).
_QUANTITIES = (*PARTS, *(f"share_{p}" for p in PARTS[1:]))


def decomposition_coverage(*, n_docs: int = 30, n_sims: int = 100, level: float = 0.95,
                           method: str = "auto", n_resamples: int = 999, horizon: int = 32,
                           seed: int = 0, population: str = "skewed", min_docs: int | None = None,
                           ) -> DecompositionCoverage:
    """Coverage of the document intervals for gap, Δfirst, Δexposure, Δrate and the shares.

    Coverage is over the studies where the interval was reported (``min_docs``
    overrides the refusal threshold, so coverage below it can be measured); the
    shares' coverage is over the studies where the gap's interval excluded 0.

    Parameters
    ----------
    n_docs, n_sims : int
        Documents per simulated study and studies.
    level : float
        Confidence level.
    method : str
        ``divstats.estimation.resample.METHODS``.
    n_resamples : int
        Resamples per interval (bootstrap methods).
    horizon : int
        T of the simulated population.
    seed : int
        Seed of the simulation.
    population : {"symmetric", "skewed"}
        :func:`document_population`.
    min_docs : int, optional
        Refusal threshold (default ``divstats.estimation.resample.MIN_DOCS_INTERVAL``).

    Returns
    -------
    DecompositionCoverage
        Coverage and truth per quantity, and the refused fractions.

    Examples
    --------
    >>> c = decomposition_coverage(n_docs=12, n_sims=5, n_resamples=99)
    >>> sorted(c.coverage)[:2]
    ['exposure', 'first']
    """
    rng = np.random.default_rng(seed)
    big = document_population(2_000_000, np.random.default_rng(seed + 1), horizon, population)
    t = split_gap(*big, horizon, "shapley")[:4]
    truth = np.concatenate([t, t[1:] / t[0]])
    hits, seen = np.zeros(7), np.zeros(7)
    refused = shares_refused = 0
    for i in range(n_sims):
        sample = document_population(n_docs, rng, horizon, population)
        ci = document_interval(sample, parts_and_shares(horizon, "shapley"), level=level, method=method,
                               n_resamples=n_resamples, seed=seed + i,
                               min_docs=MIN_DOCS_INTERVAL if min_docs is None else min_docs)
        if ci.reason:
            refused += 1
            continue
        ok = np.ones(7, dtype=bool)
        if ci.low[0] <= 0.0 <= ci.high[0]:
            ok[4:] = False
            shares_refused += 1
        hits += ok & (ci.low <= truth) & (truth <= ci.high)
        seen += ok
    with np.errstate(invalid="ignore", divide="ignore"):
        cov = hits / seen
    return DecompositionCoverage(n_docs, n_sims, level, method,
                                 {k: float(c) for k, c in zip(_QUANTITIES, cov, strict=True)},
                                 {k: float(v) for k, v in zip(_QUANTITIES, truth, strict=True)},
                                 population, refused / n_sims, (shares_refused + refused) / n_sims)


@dataclass(frozen=True)
class AggregateCoverage:
    """Outcome of :func:`aggregate_coverage`: coverage per aggregate quantity and the true values."""

    n_docs: int
    n_sims: int
    level: float
    method: str
    coverage: dict[str, float]
    truth: dict[str, float]
    population: str = "skewed"
    refused: float = 0.0          # fraction of studies with no interval (too few documents)


def policy_documents(n: int, rng: np.random.Generator, horizon: int,
                     population: str = "skewed") -> tuple[np.ndarray, ...]:
    """One policy's per-document arrays in ``divstats.estimation.estimators.MEAN_OVER_DOCS`` order.

    Occurrence, exposure and post_mismatch are policy A of :func:`document_population`;
    rmtd = T − exposure, agreeing_tokens = rmtd − occurrence, window_mismatch =
    post_mismatch and tail_capacity = 0 (an observation window W = T).

    Parameters
    ----------
    n : int
        Documents.
    rng : numpy.random.Generator
        Randomness.
    horizon : int
        T.
    population : {"symmetric", "skewed"}
        The population.

    Returns
    -------
    tuple of numpy.ndarray
        (occurrence, rmtd, agreeing_tokens, exposure, post_mismatch, window_mismatch, tail_capacity).

    Examples
    --------
    >>> import numpy as np
    >>> len(policy_documents(5, np.random.default_rng(0), 10))
    7
    """
    o, _, e, _, post, _ = document_population(n, rng, horizon, population)
    rmtd = horizon - e
    return o, rmtd, rmtd - o, e, post, post, np.zeros(n)


def aggregate_coverage(*, n_docs: int = 30, n_sims: int = 100, level: float = 0.95, method: str = "auto",
                       n_resamples: int = 999, horizon: int = 32, seed: int = 0, population: str = "skewed",
                       min_docs: int | None = None) -> AggregateCoverage:
    """Coverage of the report's aggregate intervals (``divstats.aggregate_intervals``) by quantity.

    The truth is the aggregate statistic on two million documents of the
    population (:func:`policy_documents`).

    Parameters
    ----------
    n_docs, n_sims : int
        Documents per simulated study and studies.
    level : float
        Confidence level.
    method : str
        ``divstats.estimation.resample.METHODS``.
    n_resamples : int
        Resamples per interval (bootstrap methods).
    horizon : int
        T of the simulated population.
    seed : int
        Seed of the simulation.
    population : {"symmetric", "skewed"}
        :func:`document_population`.
    min_docs : int, optional
        Refusal threshold (default ``divstats.estimation.resample.MIN_DOCS_AGGREGATE``), so
        that coverage below it can be measured.

    Returns
    -------
    AggregateCoverage
        Coverage and truth per quantity of ``divstats.estimation.estimators.INTERVAL_QUANTITIES``.

    Examples
    --------
    >>> c = aggregate_coverage(n_docs=12, n_sims=5, n_resamples=99)
    >>> 0.0 <= c.coverage["rate"] <= 1.0
    True
    """
    statistic = aggregate_statistic(horizon)
    truth = statistic(*policy_documents(2_000_000, np.random.default_rng(seed + 1), horizon, population))
    rng = np.random.default_rng(seed)
    hits = np.zeros(len(INTERVAL_QUANTITIES))
    refused = 0
    for i in range(n_sims):
        ci = document_interval(policy_documents(n_docs, rng, horizon, population), statistic, level=level,
                               method=method, n_resamples=n_resamples, seed=seed + i,
                               min_docs=MIN_DOCS_AGGREGATE if min_docs is None else min_docs)
        if ci.reason:
            refused += 1
            continue
        # a quantity constant over documents (tail_capacity = 0) is covered by its point interval
        hits += (ci.low <= truth + 1e-12) & (truth - 1e-12 <= ci.high)
    seen = max(n_sims - refused, 1)
    return AggregateCoverage(n_docs, n_sims, level, method,
                             {k: float(h / seen) for k, h in zip(INTERVAL_QUANTITIES, hits, strict=True)},
                             {k: float(v) for k, v in zip(INTERVAL_QUANTITIES, truth, strict=True)},
                             population, refused / n_sims)


# ---------------------------------------------------------------------------
# Bounded means: the betting interval against the resampling intervals
# ---------------------------------------------------------------------------

def _near_bound_skewed(n: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    # the law: three quarters of the documents at 0.998, a quarter Beta(8, 2)
    return np.where(rng.random(n) < 0.75, 0.998, rng.beta(8, 2, n))


def _near_zero_skewed(n: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    # a mild policy's occurrence: most documents never diverge, a few a little
    return np.where(rng.random(n) < 0.8, 0.0, rng.beta(1, 3, n))


#: Laws of per-document values on [0, 1] for :func:`bounded_coverage`: name -> (draw(shape, rng), true mean).
BOUNDED_LAWS: dict[str, tuple] = {
    "interior-symmetric": (lambda n, rng: rng.beta(4, 4, n), 0.5),
    "interior-skewed": (lambda n, rng: rng.beta(2, 6, n), 0.25),
    "near-bound-symmetric": (lambda n, rng: 0.96 + 0.04 * rng.beta(2, 2, n), 0.98),
    "near-bound-skewed": (_near_bound_skewed, 0.75 * 0.998 + 0.25 * 0.8),
    "near-zero-skewed": (_near_zero_skewed, 0.2 * 0.25),
}


@dataclass(frozen=True)
class BoundedCoverage:
    """Outcome of :func:`bounded_coverage`: per method, coverage, median width and whole-range count."""

    law: str
    n_docs: int
    n_sims: int
    level: float
    coverage: dict[str, float]
    median_width: dict[str, float]
    whole_range: dict[str, int]
    betting_chosen: float          # fraction of studies where the betting interval was the narrower


def bounded_coverage(law: str = "near-bound-skewed", *, n_docs: int = 10, n_sims: int = 200, level: float = 0.95,
                     n_resamples: int = 2000, seed: int = 0) -> BoundedCoverage:
    """Coverage and width of a [0, 1] mean's intervals: betting, ``auto`` (resampling) and the narrower.

    ``betting`` is the betting interval, ``auto`` the resampling interval over documents as before
    (hybrid-t below 100 documents, clipped to [0, 1]; measured below its refusal threshold too),
    ``narrower`` the narrower of the two in each study.  :func:`divstats.estimation.bounded.bounded_mean_interval`
    (what the report uses for a bounded estimand) is ``betting`` below its switch and ``narrower`` from
    there on; the switch was read off this table.  The truth is the law's mean (:data:`BOUNDED_LAWS`).

    Parameters
    ----------
    law : str
        A key of :data:`BOUNDED_LAWS`.
    n_docs, n_sims : int
        Documents per simulated study and studies.
    level : float
        Confidence level.
    n_resamples : int
        Resamples of the resampling interval.
    seed : int
        Seed of the simulation.

    Returns
    -------
    BoundedCoverage

    Examples
    --------
    >>> c = bounded_coverage(n_docs=10, n_sims=4, n_resamples=99)
    >>> sorted(c.coverage)
    ['auto', 'betting', 'narrower']
    """
    draw, truth = BOUNDED_LAWS[law]
    rng = np.random.default_rng(seed)
    x = draw((n_sims, n_docs), rng)
    bet = betting_interval(x, level=level, seed=seed)          # vectorised over the studies
    lows = {"betting": bet.low, "auto": np.empty(n_sims)}
    highs = {"betting": bet.high, "auto": np.empty(n_sims)}
    for i in range(n_sims):
        ci = document_interval((x[i],), lambda a: a.mean(axis=-1)[None], level=level, n_resamples=n_resamples,
                               seed=seed + i, min_docs=2)
        lows["auto"][i], highs["auto"][i] = np.clip(ci.low[0], 0, 1), np.clip(ci.high[0], 0, 1)
    # the narrower of the two (bounded_mean_interval's rule from its switch on; betting alone below it)
    take_bet = (highs["auto"] - lows["auto"]) >= (highs["betting"] - lows["betting"])
    mean = x.mean(axis=-1)
    lows["narrower"] = np.where(take_bet, lows["betting"], np.minimum(lows["auto"], mean))
    highs["narrower"] = np.where(take_bet, highs["betting"], np.maximum(highs["auto"], mean))
    cov, width, whole = {}, {}, {}
    for m in ("betting", "auto", "narrower"):
        cov[m] = float(np.mean((lows[m] <= truth) & (truth <= highs[m])))
        width[m] = float(np.median(highs[m] - lows[m]))
        whole[m] = int(np.sum((lows[m] <= 0) & (highs[m] >= 1)))
    return BoundedCoverage(law, n_docs, n_sims, level, cov, width, whole, float(take_bet.mean()))
