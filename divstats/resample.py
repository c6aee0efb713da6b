"""Confidence intervals over documents: jackknife-t, BCa and percentile bootstrap.

Every interval that treats the document as the unit (the gap decomposition and its
shares, the aggregate estimates in the report) goes through
:func:`document_interval`, so one rule decides how they are built and when they
are refused.  The statistic is any smooth function of per-document arrays
(documents on the last axis): a document mean, a ratio of means, a difference of
such, or a share of a gap.

Methods (docs/plans.md, "Calibration", gives the measured coverage by n); the
default ``auto`` is bootstrap-t below :data:`AUTO_JACKKNIFE_DOCS` documents and
jackknife-t from there on:

* ``bootstrap-t``: the studentized bootstrap, t* = (θ* − θ̂) / SE*_jack
  with the jackknife SE recomputed in every resample; interval
  θ̂ − q_{1−α/2}(t*) SE_jack … θ̂ − q_{α/2}(t*) SE_jack.  Second-order accurate, so
  it copes with skewed documents best (gap 0.93 at n = 10 on the skewed population).
* ``jackknife-t``: θ̂ ± t_{n−1, 1−α/2} · SE_jack with the jackknife SE
  sqrt((n−1)/n · Σ_i (θ_(i) − θ̄)²); for a document mean this is the t interval.
* ``BCa`` and ``percentile``: ``scipy.stats.bootstrap`` over documents (paired:
  one resampled set of documents for every array).  Both undercover with few
  documents (0.81–0.90 at n = 10 on the skewed population).

Below :data:`MIN_DOCS` documents no method covered (≤ 0.91 at n = 5 on the skewed
population), so the interval is refused: NaN ends and the reason.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import stats

__all__ = ["AUTO_JACKKNIFE_DOCS", "METHODS", "MIN_DOCS", "DocumentInterval", "document_interval", "too_few_documents"]

METHODS: tuple[str, ...] = ("auto", "bootstrap-t", "jackknife-t", "BCa", "percentile")
#: ``auto`` uses bootstrap-t below this many documents and jackknife-t from here on
#: (bootstrap-t costs resamples x documents^2; at 50 documents the two cover alike).
AUTO_JACKKNIFE_DOCS = 50
#: Fewest documents for which an interval over documents is reported.
MIN_DOCS = 10


@dataclass(frozen=True)
class DocumentInterval:
    """Interval(s) over documents for a vector-valued statistic.

    ``low``/``high``/``point`` have the statistic's shape; ``reason`` is non-empty
    when the interval was refused (then ``low``/``high`` are NaN).
    """

    point: np.ndarray
    low: np.ndarray
    high: np.ndarray
    method: str
    level: float
    n_docs: int
    reason: str = ""


def too_few_documents(n_docs: int, min_docs: int = MIN_DOCS) -> str:
    """The refusal reason for ``n_docs`` documents ("" when there are enough).

    Parameters
    ----------
    n_docs : int
        Documents with data.
    min_docs : int
        The threshold.

    Returns
    -------
    str
        The reason, or "".

    Examples
    --------
    >>> too_few_documents(12)
    ''
    """
    if n_docs >= min_docs:
        return ""
    return (f"interval not reported: {n_docs} documents, fewer than {min_docs}; with so few documents "
            "no interval over documents covered at its nominal level (docs/plans.md, Calibration)")


def _jackknife_se(arrays: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray]) -> np.ndarray:
    """Jackknife SE of the statistic, shape (k, *lead) for arrays of shape (*lead, n)."""
    n = arrays[0].shape[-1]
    idx = np.nonzero(~np.eye(n, dtype=bool))[1].reshape(n, n - 1)   # row i: every document but i
    # (*lead, n, n-1) -> statistic over the last axis -> (k, *lead, n)
    loo = np.asarray(statistic(*(a[..., idx] for a in arrays)), dtype=float)
    with np.errstate(invalid="ignore"):
        return np.sqrt((n - 1) / n * ((loo - loo.mean(axis=-1, keepdims=True)) ** 2).sum(axis=-1))


def _jackknife_t(arrays: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray],
                 point: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    n = arrays[0].shape[-1]
    se = _jackknife_se(arrays, statistic).reshape(point.shape)
    q = stats.t.ppf(0.5 + level / 2, n - 1)
    return point - q * se, point + q * se


def _bootstrap_t(arrays: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray],
                 point: np.ndarray, level: float, n_resamples: int,
                 seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Studentized bootstrap: t* = (theta* - theta) / SE_jack*, SE_jack* from each resample."""
    n = arrays[0].shape[-1]
    se = _jackknife_se(arrays, statistic).reshape(point.shape)
    rng = np.random.default_rng(seed)
    ts = []
    batch = max(1, 400_000 // (n * n))          # keeps the (batch, n, n - 1) temporaries small
    for start in range(0, n_resamples, batch):
        idx = rng.integers(0, n, (min(batch, n_resamples - start), n))
        xs = tuple(a[..., idx] for a in arrays)                 # (B, n)
        theta = np.asarray(statistic(*xs), dtype=float)         # (k, B)
        se_b = _jackknife_se(xs, statistic)                     # (k, B)
        with np.errstate(invalid="ignore", divide="ignore"):
            ts.append((theta - point.reshape(-1, 1)) / se_b)
    t = np.concatenate(ts, axis=-1)
    # a resample with no spread: t* = 0 with no shift, else beyond every finite t* (an infinite end)
    t = np.nan_to_num(t, nan=0.0, posinf=1e150, neginf=-1e150)
    a = (1 - level) / 2
    lo_q, hi_q = np.quantile(t, [1 - a, a], axis=-1)
    return point - lo_q.reshape(point.shape) * se, point - hi_q.reshape(point.shape) * se


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
                      seed: int = 0, min_docs: int = MIN_DOCS) -> DocumentInterval:
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
    method : {"auto", "bootstrap-t", "jackknife-t", "BCa", "percentile"}
        See the module docstring.
    n_resamples, seed : int
        For the bootstrap methods.
    min_docs : int
        Refuse (NaN ends, ``reason`` set) below this many documents.

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
    (True, 'bootstrap-t')
    """
    if method not in METHODS:
        raise ValueError(f"unknown interval method {method!r}; expected one of {METHODS}")
    n = arrays[0].shape[-1]
    if any(a.shape[-1] != n for a in arrays):
        raise ValueError("every per-document array must have the same number of documents")
    point = np.asarray(statistic(*arrays), dtype=float) if n else np.array([math.nan])
    reason = too_few_documents(n, min_docs)
    if reason:
        nan = np.full(point.shape, math.nan)
        return DocumentInterval(point, nan, nan.copy(), method, level, n, reason)
    if method == "auto":
        method = "bootstrap-t" if n < AUTO_JACKKNIFE_DOCS else "jackknife-t"
    if method == "jackknife-t":
        low, high = _jackknife_t(arrays, statistic, point, level)
    elif method == "bootstrap-t":
        low, high = _bootstrap_t(arrays, statistic, point, level, n_resamples, seed)
    else:
        low, high = _scipy_bootstrap(arrays, statistic, point, level, method, n_resamples, seed)
    return DocumentInterval(point, low, high, method, level, n)
