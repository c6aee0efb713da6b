"""Confidence intervals over documents: hybrid-t, bootstrap-t, jackknife-t, BCa and percentile.

Every interval that treats the document as the unit (the gap decomposition and its
shares, the aggregate estimates in the report) goes through
:func:`document_interval`, so one rule decides how they are built and when they
are refused.  The statistic is any smooth function of per-document arrays
(documents on the last axis): a document mean, a ratio of means, a difference of
such, or a share of a gap.

Methods (docs/plans.md, "Calibration", gives the measured coverage by n); the
default ``auto`` is hybrid-t below :data:`AUTO_JACKKNIFE_DOCS` documents and
jackknife-t from there on:

* ``bootstrap-t``: the studentized bootstrap, t* = (θ* − θ̂) / SE*_jack
  with the jackknife SE recomputed in every resample; interval
  θ̂ − q_{1−α/2}(t*) SE_jack … θ̂ − q_{α/2}(t*) SE_jack.  Second-order accurate, but
  with 10–20 skewed documents its tails are still short for ratios (worst part
  0.87, worst share 0.83 at n = 10 on the skewed population).
* ``jackknife-t``: θ̂ ± t_{n−1, 1−α/2} · SE_jack with the jackknife SE
  sqrt((n−1)/n · Σ_i (θ_(i) − θ̄)²); for a document mean this is the t interval.
* ``hybrid-t``: each end the furthest of the bootstrap-t's, the jackknife-t's and
  that of Hall's (1992) skewness-corrected t (the t_{n−1} interval after the
  monotone transformation that removes the skewness of the studentized statistic,
  the skewness estimated from the jackknife influence values), all with the same
  SE_jack.  The bootstrap-t and Hall's correction move the end that skewness
  stretches, the t_{n−1} quantile keeps the other end from collapsing when the
  resamples have too little spread.  The best-covering of these at 10–50 skewed
  documents.
* ``BCa`` and ``percentile``: ``scipy.stats.bootstrap`` over documents (paired:
  one resampled set of documents for every array).  Both undercover with few
  documents (0.78–0.88 at n = 10 on the skewed population).

Each kind of interval is refused (NaN ends, the reason stated) below its own
number of documents, read off the coverage table: :data:`MIN_DOCS_AGGREGATE`,
:data:`MIN_DOCS_PARTS`, :data:`MIN_DOCS_SHARES` and, for paired differences,
:data:`MIN_DOCS_MEAN_DIFFERENCE` (two-sided) and :data:`MIN_DOCS_MEAN_BOUND`
(one-sided).  :func:`too_few_documents` words the refusal.

Why this module is in ``estimation/`` and not ``inference/``: the aggregate
estimates' intervals (``divstats.estimation.estimators.aggregate_intervals``) are
built here, and estimation may import only ``traces/``.  Moving
``aggregate_intervals`` to inference would split the estimators' module; instead
the resampling primitives sit one room lower, where the estimators and the
inference room (``divstats.inference.effects``, ``location_tests``, ``decompose``) may both import
them.  They depend on numpy and scipy only.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import stats

from divstats.intervals import ConfidenceInterval

__all__ = [
    "AUTO_JACKKNIFE_DOCS", "COVERAGE_TARGET", "METHODS", "MIN_DOCS_AGGREGATE", "MIN_DOCS_INTERVAL",
    "MIN_DOCS_MARGIN", "MIN_DOCS_MARGIN_T",
    "MIN_DOCS_MEAN_BOUND", "MIN_DOCS_MEAN_DIFFERENCE", "MIN_DOCS_PARTS", "MIN_DOCS_SHARES", "DocumentInterval",
    "bootstrap_t", "document_interval", "too_few_documents",
]

METHODS: tuple[str, ...] = ("auto", "hybrid-t", "bootstrap-t", "jackknife-t", "BCa", "percentile")
#: ``auto`` uses hybrid-t below this many documents and jackknife-t from here on
#: (hybrid-t costs resamples x documents^2; jackknife-t covered 0.93-0.96 at n = 100
#: and 200 on the skewed population, but aggregates only 0.92 at n = 50).
AUTO_JACKKNIFE_DOCS = 100

# Refusal thresholds: the fewest documents from which the default method covered at
# least COVERAGE_TARGET (nominal 0.95) on the skewed calibration population at every
# measured n; read off the coverage tables in docs/plans.md ("Calibration",
# benchmarks/bench_calibration.py).  Below them the interval is NaN with the reason.
#: Coverage a reported interval must reach on the skewed population.
COVERAGE_TARGET = 0.92
#: Aggregate estimates (document means and the rate, a ratio of means), hybrid-t:
#: worst quantity 0.916 at n = 5, 0.927 at n = 10 on the skewed population
#: (4000 studies at n = 10: 0.930).
MIN_DOCS_AGGREGATE = 10
#: The decomposition's gap and parts, hybrid-t: gap 0.913 at n = 5; at n = 10 gap
#: 0.922 and worst part 0.918 (1000 studies), each >= 0.921 in 4000 studies, on the
#: skewed population (bootstrap-t alone: worst part 0.872 at n = 10).
MIN_DOCS_PARTS = 10
#: The shares part / gap, hybrid-t (reported where the gap's interval excludes 0):
#: worst share 0.945 at n = 10 (4000 studies: 0.951); at n = 5 the gap's interval
#: covered 0 in 82% of the studies, so shares were rarely reported (not trusted there).
MIN_DOCS_SHARES = 10
#: Paired mean differences, two-sided (the bootstrap-t interval of docs/plans.md,
#: "Tests and effect sizes"): 0.946 at n = 5 (another run: 0.925), 0.920 at n = 10
#: (six runs, 4300 studies: 0.913-0.938, pooled 0.930) on skewed differences; at
#: n = 3 the interval is infinite in 96% of the studies, so nothing is lost by refusing it.
MIN_DOCS_MEAN_DIFFERENCE = 5
#: Paired mean differences, one-sided: the bound (the side right skew shortens) AND its
#: dual, the one-sided ``bootstrap-t`` test, refused together.  The bound covered 0.906
#: at n = 10 and 0.940 at n = 20, but the test's size for the mean on skewed differences
#: (alpha = 0.05, the weak side) was 0.073, 0.069, 0.071, 0.072, 0.052 at n = 5, 10, 20,
#: 30, 50 (1000 studies each; alpha + 2 SE = 0.064; other runs: 0.078-0.081 at 10,
#: 0.066 at 20, 0.059-0.068 at 30, 0.052-0.061 at 50); no construction measured (hybrid-t,
#: Hall's skewness-corrected t, double bootstrap) held below 50 (docs/plans.md,
#: "One-sided tests of a mean").
MIN_DOCS_MEAN_BOUND = 50
#: Tests at a margin (equivalence by TOST, non-inferiority), bootstrap-t.  At a true
#: difference on the margin (the worst case) the test that decides is a one-sided
#: bootstrap-t test of d - delta, the same law as the one-sided test of a mean at 0, so
#: the threshold is MIN_DOCS_MEAN_BOUND's.  Measured at the margin (docs/plans.md, "Tests
#: at a margin", 600 studies per cell, alpha + 2 SE = 0.068), skewed differences, weak
#: side: 0.075 at n = 10, 0.057 at 20, 0.050 at 30, 0.060 at 50 (symmetric <= 0.062); the
#: one-sided test's 1000-study runs (0.066-0.081 at 10-30, 0.052-0.061 at 50) decide.
MIN_DOCS_MARGIN = MIN_DOCS_MEAN_BOUND
#: The t versions (``ttest`` at a margin): size at the margin on skewed differences 0.131,
#: 0.113, 0.106, 0.094, 0.075, 0.067, 0.066 at n = 10, 20, 30, 50, 100, 200, 400 (2000
#: studies per cell, alpha + 2 SE = 0.060): not shown to hold at any n measured, so t at a
#: margin is refused below 1000 documents (beyond the largest n measured; use bootstrap-t).
MIN_DOCS_MARGIN_T = 1000
#: Default threshold of :func:`document_interval` (the smallest of the kinds above).
MIN_DOCS_INTERVAL = min(MIN_DOCS_AGGREGATE, MIN_DOCS_PARTS, MIN_DOCS_SHARES)


@dataclass(frozen=True)
class DocumentInterval:
    """Interval(s) over documents for a vector-valued statistic (like scipy's ``BootstrapResult``).

    ``point`` and the ends of ``confidence_interval`` (a
    :class:`~divstats.intervals.ConfidenceInterval`; ``low``/``high`` read them) have the
    statistic's shape; ``reason`` is non-empty when the interval was refused (then
    the ends are NaN).
    """

    point: np.ndarray
    confidence_interval: ConfidenceInterval
    method: str
    level: float
    n_docs: int
    reason: str = ""

    @property
    def low(self) -> np.ndarray:
        return self.confidence_interval.low

    @property
    def high(self) -> np.ndarray:
        return self.confidence_interval.high


def too_few_documents(n_docs: int, min_docs: int = MIN_DOCS_INTERVAL, what: str = "intervals over documents") -> str:
    """The refusal reason for ``n_docs`` documents ("" when there are enough).

    Parameters
    ----------
    n_docs : int
        Documents with data.
    min_docs : int
        The threshold (one of the ``MIN_DOCS_*`` constants).
    what : str
        The kind of interval, as the reason names it ("intervals for shares").

    Returns
    -------
    str
        The reason, or "".

    Examples
    --------
    >>> too_few_documents(12)
    ''
    >>> too_few_documents(7, MIN_DOCS_SHARES, "intervals for shares")
    'not estimable: n = 7 documents, intervals for shares need ≥ 10 (coverage table in docs/plans.md)'
    """
    if n_docs >= min_docs:
        return ""
    return f"not estimable: n = {n_docs} documents, {what} need ≥ {min_docs} (coverage table in docs/plans.md)"


def _leave_one_out(arrays: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray]) -> np.ndarray:
    """The statistic without each document in turn, shape (k, *lead, n) for arrays of shape (*lead, n)."""
    n = arrays[0].shape[-1]
    idx = np.nonzero(~np.eye(n, dtype=bool))[1].reshape(n, n - 1)   # row i: every document but i
    # (*lead, n, n-1) -> statistic over the last axis -> (k, *lead, n)
    return np.asarray(statistic(*(a[..., idx] for a in arrays)), dtype=float)


def _jackknife_se(arrays: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray]) -> np.ndarray:
    """Jackknife SE of the statistic, shape (k, *lead) for arrays of shape (*lead, n)."""
    n = arrays[0].shape[-1]
    loo = _leave_one_out(arrays, statistic)
    with np.errstate(invalid="ignore"):
        return np.sqrt((n - 1) / n * ((loo - loo.mean(axis=-1, keepdims=True)) ** 2).sum(axis=-1))


def _skewness_corrected_t(arrays: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray],
                          point: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """Hall's (1992) skewness-removing transformation of t, with jackknife influence values.

    g(T) = T + a T^2 + a^2 T^3 / 3 + b with a = γ/(3√n), b = γ/(6√n) and γ the skewness
    of the influence values ψ_i = (n − 1)(θ̄ − θ_(i)) (for a mean, x_i − x̄); g is
    monotone, so the interval is θ̂ − SE g⁻¹(q) … θ̂ − SE g⁻¹(−q) with q = t_{n−1, 1−α/2}.
    """
    n = arrays[0].shape[-1]
    loo = _leave_one_out(arrays, statistic).reshape(point.size, n)
    psi = (n - 1) * (loo.mean(axis=-1, keepdims=True) - loo)
    with np.errstate(invalid="ignore", divide="ignore"):
        m2 = (psi ** 2).mean(axis=-1)
        gamma = np.nan_to_num((psi ** 3).mean(axis=-1) / m2 ** 1.5)
        se = np.sqrt((psi ** 2).sum(axis=-1) / (n * (n - 1)))
    a, b = gamma / (3 * math.sqrt(n)), gamma / (6 * math.sqrt(n))
    small = np.abs(a) < 1e-12
    safe_a = np.where(small, 1.0, a)

    def g_inv(x: float) -> np.ndarray:
        return np.where(small, x - b, (np.cbrt(1 + 3 * safe_a * (x - b)) - 1) / safe_a)

    q = stats.t.ppf(0.5 + level / 2, n - 1)
    flat = point.reshape(-1)
    return (flat - g_inv(q) * se).reshape(point.shape), (flat - g_inv(-q) * se).reshape(point.shape)


def _jackknife_t(arrays: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray],
                 point: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    n = arrays[0].shape[-1]
    se = _jackknife_se(arrays, statistic).reshape(point.shape)
    q = stats.t.ppf(0.5 + level / 2, n - 1)
    return point - q * se, point + q * se


def bootstrap_t(arrays: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray], point: np.ndarray,
                n_resamples: int, seed: int, *,
                standard_error: Callable[..., np.ndarray] | None = None,
                batch: int | None = None) -> np.ndarray:
    """The studentized bootstrap: t* = (θ* − θ̂) / SE* over resamples of the documents.

    The one bootstrap-t of divstats: the intervals over documents
    (:func:`document_interval`, ``bootstrap-t`` and ``hybrid-t``) take quantiles of
    t*, the paired ``bootstrap-t`` test (``divstats.inference.location_tests``) its p-value
    and dual interval from the order statistics of t*.

    Parameters
    ----------
    arrays : tuple of numpy.ndarray
        Per-document values, documents on the last axis.
    statistic : callable
        As for :func:`document_interval`: ``statistic(*arrays)`` → (k, *lead).
    point : numpy.ndarray
        θ̂, the statistic on the documents (k values).
    n_resamples, seed : int
        Resamples (documents drawn with replacement, the same documents for every
        array) and the seed of ``numpy.random.default_rng``.
    standard_error : callable, optional
        SE* of the statistic from the resampled arrays, (k, B); default the jackknife
        SE recomputed in every resample.
    batch : int, optional
        Resamples drawn at a time (default: enough to keep the jackknife's
        (batch, n, n − 1) temporaries near 400,000 values).  The draws are made batch
        by batch, so a caller keeps its batch to keep its resamples.

    Returns
    -------
    numpy.ndarray
        t*, shape (k, n_resamples).  A resample with no spread gives ±inf, or 0 when
        it is centred (no shift): it is kept, so the number of resamples never shrinks.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.arange(12.0)
    >>> bootstrap_t((x,), lambda a: a.mean(-1)[None], np.array([x.mean()]), 99, 0).shape
    (1, 99)
    """
    n = arrays[0].shape[-1]
    se_of = standard_error or (lambda *xs: _jackknife_se(xs, statistic))
    rng = np.random.default_rng(seed)
    ts = []
    batch = batch or max(1, 400_000 // (n * n))   # keeps the (batch, n, n - 1) temporaries small
    for start in range(0, n_resamples, batch):
        idx = rng.integers(0, n, (min(batch, n_resamples - start), n))
        xs = tuple(a[..., idx] for a in arrays)                 # (B, n)
        theta = np.asarray(statistic(*xs), dtype=float)         # (k, B)
        se_b = se_of(*xs)                                       # (k, B)
        with np.errstate(invalid="ignore", divide="ignore"):
            ts.append((theta - point.reshape(-1, 1)) / se_b)
    return np.nan_to_num(np.concatenate(ts, axis=-1), nan=0.0, posinf=math.inf, neginf=-math.inf)


def _studentized_quantiles(arrays: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray],
                           point: np.ndarray, level: float, n_resamples: int,
                           seed: int, standard_error: Callable[..., np.ndarray] | None = None,
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(SE_jack, q_{1-a/2}(t*), q_{a/2}(t*)) with t* from :func:`bootstrap_t`."""
    se = _jackknife_se(arrays, statistic).reshape(point.shape)
    t = bootstrap_t(arrays, statistic, point, n_resamples, seed, standard_error=standard_error)
    # a resample with no spread: t* = 0 with no shift, else beyond every finite t* (an infinite end)
    t = np.nan_to_num(t, posinf=1e150, neginf=-1e150)
    a = (1 - level) / 2
    hi_q, lo_q = np.quantile(t, [1 - a, a], axis=-1)
    return se, hi_q.reshape(point.shape), lo_q.reshape(point.shape)


def _bootstrap_t(arrays: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray],
                 point: np.ndarray, level: float, n_resamples: int, seed: int,
                 hybrid: bool = False, standard_error: Callable[..., np.ndarray] | None = None,
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Studentized bootstrap; ``hybrid``: each end no nearer than the jackknife-t's and Hall's."""
    se, hi_q, lo_q = _studentized_quantiles(arrays, statistic, point, level, n_resamples, seed, standard_error)
    if not hybrid:
        return point - hi_q * se, point - lo_q * se
    q = stats.t.ppf(0.5 + level / 2, arrays[0].shape[-1] - 1)
    low, high = point - np.maximum(hi_q, q) * se, point - np.minimum(lo_q, -q) * se
    h_low, h_high = _skewness_corrected_t(arrays, statistic, point, level)
    return np.fmin(low, h_low), np.fmax(high, h_high)     # fmin/fmax: a NaN end of one method is ignored


def _scipy_bootstrap(arrays: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray],
                     point: np.ndarray, level: float, method: str, n_resamples: int,
                     seed: int) -> tuple[np.ndarray, np.ndarray]:
    def stat(*xs, axis=-1):
        return statistic(*(np.moveaxis(x, axis, -1) for x in xs))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # degenerate (constant) parts give NaN; handled below
        res = stats.bootstrap(arrays, stat, paired=True, vectorized=True, n_resamples=n_resamples,
                              confidence_level=level, method=method, rng=seed)
    low = np.asarray(res.confidence_interval.low, dtype=float).reshape(point.shape)
    high = np.asarray(res.confidence_interval.high, dtype=float).reshape(point.shape)
    # A part constant across resamples (e.g. both rates undefined) has a degenerate
    # interval; its interval is the point itself.
    deg = ~np.isfinite(low) | ~np.isfinite(high)
    return np.where(deg, point, low), np.where(deg, point, high)


def document_interval(arrays: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray], *,
                      level: float = 0.95, method: str = "auto", n_resamples: int = 1999,
                      seed: int = 0, min_docs: int = MIN_DOCS_INTERVAL,
                      what: str = "intervals over documents",
                      standard_error: Callable[..., np.ndarray] | None = None) -> DocumentInterval:
    """Two-sided interval over documents for ``statistic(*arrays)``.

    Parameters
    ----------
    arrays : tuple of numpy.ndarray
        Per-document values, documents on the last axis, all of the same length
        (a document missing anywhere must already be dropped).
    statistic : callable
        ``statistic(*arrays)`` returns a vector; it must accept extra leading axes
        on every array (resamples) and reduce the last one.
    level : float
        Confidence level.
    method : {"auto", "hybrid-t", "bootstrap-t", "jackknife-t", "BCa", "percentile"}
        See the module docstring.
    n_resamples, seed : int
        For the bootstrap methods.
    min_docs : int
        Refuse (NaN ends, ``reason`` set) below this many documents (one of the
        ``MIN_DOCS_*`` constants).
    what : str
        The kind of interval, as the refusal reason names it.
    standard_error : callable, optional
        The bootstrap methods' SE* of the statistic from resampled arrays (``bootstrap_t``'s);
        default the jackknife SE, which costs documents² per resample.  For a document mean it is
        sd / √n exactly, in documents per resample (``divstats.estimation.bounded``).

    Returns
    -------
    DocumentInterval

    Raises
    ------
    ValueError
        For an unknown method or arrays of different lengths.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.arange(12.0)
    >>> ci = document_interval((x,), lambda a: a.mean(-1)[None])
    >>> bool(ci.low[0] < 5.5 < ci.high[0]), ci.method
    (True, 'hybrid-t')
    """
    if method not in METHODS:
        raise ValueError(f"unknown interval method {method!r}; expected one of {METHODS}")
    n = arrays[0].shape[-1]
    if any(a.shape[-1] != n for a in arrays):
        raise ValueError("every per-document array must have the same number of documents")
    point = np.asarray(statistic(*arrays), dtype=float) if n else np.array([math.nan])
    reason = too_few_documents(n, min_docs, what)
    if reason:
        nan = np.full(point.shape, math.nan)
        return DocumentInterval(point, ConfidenceInterval(nan, nan.copy()), method, level, n, reason)
    if method == "auto":
        method = "hybrid-t" if n < AUTO_JACKKNIFE_DOCS else "jackknife-t"
    if method == "jackknife-t":
        low, high = _jackknife_t(arrays, statistic, point, level)
    elif method in ("bootstrap-t", "hybrid-t"):
        low, high = _bootstrap_t(arrays, statistic, point, level, n_resamples, seed, method == "hybrid-t",
                                 standard_error)
    else:
        low, high = _scipy_bootstrap(arrays, statistic, point, level, method, n_resamples, seed)
    return DocumentInterval(point, ConfidenceInterval(low, high), method, level, n)
