"""The four tests of the location of paired differences and their null laws.

Each returns ``(statistic, p-value, exact)`` for H1 ``alternative`` about the location of
``d``: the Wilcoxon signed-rank test (:func:`signed_rank_test`, exact null law up to
:data:`EXACT_SIGNED_RANK_MAX_N` non-zero differences), the paired t test (:func:`t_test`),
the sign-flip permutation test of the mean (:func:`sign_flip_test`, all 2^n flips up to
:data:`EXACT_PERMUTATION_MAX_N` documents) and the studentized bootstrap test of the mean
(:func:`bootstrap_t_test`, which also returns its dual interval).  ``paired_test``
(``divstats.inference.paired``) dispatches to them; the effect sizes' intervals
(``divstats.inference.effects``) invert them.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import stats

from divstats.estimation.resample import bootstrap_t

__all__ = [
    "EXACT_PERMUTATION_MAX_N", "EXACT_SIGNED_RANK_MAX_N", "bootstrap_t_test", "sign_flip_test",
    "signed_rank_null_cdf", "signed_rank_test", "studentized_resamples", "t_test",
]

#: Largest n for which the sign-flip test enumerates all 2^n flips.
EXACT_PERMUTATION_MAX_N = 16

#: Largest n for which the signed-rank null law is computed exactly (for the HL interval).
EXACT_SIGNED_RANK_MAX_N = 200


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
        ``cdf`` of length n(n+1)/2 + 1, read-only: it is computed once per n (the
        Hodges-Lehmann interval and the power calculations ask for the same n again and again).

    Examples
    --------
    >>> signed_rank_null_cdf(2).tolist()
    [0.25, 0.5, 0.75, 1.0]
    """
    return _null_cdf(int(n))


@functools.lru_cache(maxsize=256)
def _null_cdf(n: int) -> np.ndarray:
    m = n * (n + 1) // 2
    pmf = np.zeros(m + 1)
    pmf[0] = 1.0
    for k in range(1, n + 1):
        shifted = np.zeros_like(pmf)
        shifted[k:] = pmf[:-k]
        pmf = 0.5 * (pmf + shifted)
    cdf = np.cumsum(pmf)
    cdf.flags.writeable = False
    return cdf


def _average_ranks(a: np.ndarray) -> np.ndarray:
    """``scipy.stats.rankdata(a)`` (ties share their average rank) of a finite 1-d array.

    Without scipy's argument handling, which was half of a signed-rank test's time on
    the few documents of a study (the Hodges-Lehmann interval runs that test several
    times per comparison). Ranks are integers or halves, exact in floats: the same values.
    """
    order = np.argsort(a, kind="stable")
    s = a[order]
    new = np.empty(s.size, dtype=bool)
    new[:1] = True
    np.not_equal(s[1:], s[:-1], out=new[1:])
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], s.size)
    ranks = np.empty(s.size)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)   # positions start..end-1
    return ranks


def _signed_rank_null(doubled_ranks: np.ndarray) -> np.ndarray:
    """Exact null pmf of 2 W+ given the (doubled, so integer) ranks: every sign equally likely."""
    # Counts of sign patterns, in place and over the support reached so far (the sum of the
    # ranks seen), halved once at the end: halving is exact in binary floating point, so this
    # equals halving at every step bit for bit, at a fraction of the time for large n.
    pmf = np.zeros(int(doubled_ranks.sum()) + 1)
    pmf[0] = 1.0
    top = 0
    for r in doubled_ranks.tolist():
        # numpy buffers the overlapping operands, so the right side is the old counts
        pmf[r:top + r + 1] += pmf[:top + 1]
        top += r
    return np.ldexp(pmf, -doubled_ranks.size)


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
    ranks = _average_ranks(np.abs(nz))
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


def sign_flip_test(d: np.ndarray, alternative: str, n_resamples: int, seed: int) -> tuple[float, float, bool]:
    """Sign-flip permutation test of mean(d) = 0 (statistic, p-value, exact).

    Every sign pattern is equally likely under a null law symmetric about 0; all 2^n
    flips are enumerated up to :data:`EXACT_PERMUTATION_MAX_N` documents, seeded
    Monte Carlo flips beyond.

    Parameters
    ----------
    d : numpy.ndarray
        Paired differences (NaN-free).
    alternative : {"two-sided", "less", "greater"}
        H1 about the mean of ``d``.
    n_resamples : int
        Monte Carlo flips beyond exact enumeration.
    seed : int
        Seed of the flips.

    Returns
    -------
    (float, float, bool)
        Mean difference, p-value, and whether the p-value is exact.

    Examples
    --------
    >>> import numpy as np
    >>> sign_flip_test(np.array([1.0, 2.0, 3.0]), "greater", 999, 0)
    (2.0, 0.125, True)
    """
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


def t_test(d: np.ndarray, alternative: str) -> tuple[float, float, bool]:
    """The paired t test of mean(d) = 0, scipy's ``ttest_1samp`` (statistic, p-value, exact).

    Parameters
    ----------
    d : numpy.ndarray
        Paired differences (NaN-free, non-zero spread).
    alternative : {"two-sided", "less", "greater"}
        H1 about the mean of ``d``.

    Returns
    -------
    (float, float, bool)
        t, p-value, and True (the t law is exact for normal differences).

    Examples
    --------
    >>> import numpy as np
    >>> t, p, exact = t_test(np.array([1.0, 2.0, 3.0]), "greater")
    >>> round(t, 3), round(p, 3)
    (3.464, 0.037)
    """
    res = stats.ttest_1samp(d, 0.0, alternative=alternative)
    return float(res.statistic), float(res.pvalue), True


def studentized_resamples(d: np.ndarray, n_resamples: int, seed: int) -> np.ndarray:
    """t* = (mean* - mean) / se* over bootstrap resamples of the documents (:func:`bootstrap_t`).

    se* is the plain SD / sqrt(n) of each resample, drawn 2000 at a time.  A resample
    with zero spread has t* = +-inf (or 0 when centred): it is kept, so the number of
    resamples never silently shrinks.

    Parameters
    ----------
    d : numpy.ndarray
        Paired differences (NaN-free).
    n_resamples : int
        Bootstrap resamples B.
    seed : int
        Seed of the resampling.

    Returns
    -------
    numpy.ndarray
        The B values of t*.

    Examples
    --------
    >>> import numpy as np
    >>> studentized_resamples(np.arange(5.0), 100, 0).shape
    (100,)
    """
    root_n = math.sqrt(d.size)
    return bootstrap_t((d,), lambda x: x.mean(axis=-1)[None], np.array([d.mean()]), n_resamples, seed,
                       standard_error=lambda x: (x.std(axis=-1, ddof=1) / root_n)[None], batch=2000)[0]


def bootstrap_t_test(d: np.ndarray, alternative: str, n_resamples: int, seed: int,
                     confidence_level: float) -> tuple[float, float, bool, float, float]:
    """(t, p, exact, low, high): percentile-t test of mean = 0 and its dual interval.

    p = (1 + #{t* at least as extreme as t}) / (B + 1) (two-sided: |t*| >= |t|);
    the interval is {theta : the same test of d - theta does not reject}, which is
    mean - s se .. mean + s se with s the matching order statistic of t*.

    Parameters
    ----------
    d : numpy.ndarray
        Paired differences (NaN-free, at least 2, non-zero spread).
    alternative : {"two-sided", "less", "greater"}
        H1 about the mean of ``d`` (a one-sided test gets a one-sided bound).
    n_resamples : int
        Bootstrap resamples.
    seed : int
        Seed of the resampling.
    confidence_level : float
        Level of the dual interval.

    Returns
    -------
    (float, float, bool, float, float)
        t, p-value, False (not exact), and the interval's ends.

    Examples
    --------
    >>> import numpy as np
    >>> t, p, exact, lo, hi = bootstrap_t_test(np.arange(1.0, 11.0), "two-sided", 999, 0, 0.95)
    >>> bool(lo < 5.5 < hi), p < 0.05
    (True, True)
    """
    n = d.size
    mean, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(n))
    t = mean / se
    ts = studentized_resamples(d, n_resamples, seed)
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
