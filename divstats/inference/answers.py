"""Does compression change the answer? Paired statistics of task outcomes under the coupling (docs/statistics.md §12).

Under the coupling P (full cache) and Q (the policy) answer the same document with shared
randomness, so every (document, replicate) gives a *pair* of scores ``(x, y)`` in [0, 1]:
P's and Q's.  :func:`compare_answers` takes them for one policy as (document x replicate)
arrays; :func:`compare_answers_dataset` runs it for every policy of a trace dataset (what
``kvdiv analyze`` writes into results.nc as ``answer_*``).

What is computed, and over what:

* **Accuracies** (P's and Q's) and the **paired difference** Q − P: replicates are
  averaged within each document first, then the documents (equal weights) give the
  estimate and its interval over documents (the document is the unit, as everywhere in
  divstats).  The interval is :func:`answer_interval`, the one call site of the interval
  for these bounded means ([0, 1] for accuracies, [−1, 1] for the difference).
* **The test of no difference.**  With one replicate per document and 0/1 scores the
  pairs are independent across documents and the test is McNemar's exact test
  (``statsmodels.stats.contingency_tables.mcnemar(exact=True)``) on the documents' 2x2
  table of (P right?, Q right?).  With several replicates the pairs of one document share
  the document and are not independent, so the pairs are *not* pooled into one 2x2 table:
  the test is the exact sign-flip permutation test over documents of the per-document mean
  difference (``paired_test(..., "permutation")``).  With one replicate and 0/1 scores the
  sign-flip test conditional on the discordant documents *is* exact McNemar (the tests
  agree), so the second generalises the first; graded scores (token F1) get the second too.
* **The flips**: ``lost`` = pairs where P is right and Q wrong, ``gained`` the reverse,
  counted over every scored (document, replicate) pair; "right" is a score >= 0.5 (for
  0/1 scores: score 1).
* At an accuracy **margin** δ: non-inferiority (H0: Q − P <= −δ) and equivalence (TOST)
  through ``divstats.inference.margins`` (bootstrap-t, refused below its 50 documents).
* **What the coupling saved** (:func:`coupling_saving`): the variance of the paired
  difference, within documents and across documents, against what independent runs of P
  and Q would have had, and the documents each needs for a ±m interval.

This module imports statsmodels lazily (only the exact McNemar test needs it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import xarray as xr
from scipy import stats

from divstats.estimation.answers import score_arrays
from divstats.estimation.resample import MIN_DOCS_AGGREGATE, document_interval
from divstats.inference.paired import paired_test
from divstats.inference.results import Effect, PairedTestResult
from divstats.intervals import ConfidenceInterval

__all__ = ["AnswersResult", "CouplingSaving", "MIN_DOCS_ANSWERS", "RIGHT", "accuracy_by_depth", "answer_interval",
           "change_by_divergence", "compare_answers", "compare_answers_dataset", "coupling_saving"]

#: A score at or above this counts as a right answer for the flips (0/1 scores: 1 is right).
RIGHT = 0.5
#: Fewest documents for an interval of an accuracy or of the paired difference (below: NaN
#: with the reason); the coverage table is docs/statistics.md §12 (benchmarks/bench_answers_coverage.py).
MIN_DOCS_ANSWERS = MIN_DOCS_AGGREGATE
#: Test names, as results state them.
MCNEMAR = "mcnemar-exact"
SIGN_FLIP = "sign-flip permutation over documents"


def answer_interval(values: np.ndarray, low: float, high: float, level: float = 0.95) -> tuple[float, float, float,
                                                                                                    str]:
    """Mean over documents of per-document values bounded in [low, high], with its interval.

    The one call site of the interval of an accuracy ([0, 1]) or a paired difference of
    accuracies ([−1, 1]): the t interval over documents (``document_interval``'s
    ``jackknife-t``, which for a mean is the t interval) clipped to the range, refused below
    :data:`MIN_DOCS_ANSWERS` documents.  (The hybrid-t of the other aggregates is not used:
    on per-document values piled at a bound its bootstrap resamples have no spread and its
    ends run off to infinity.)

    Parameters
    ----------
    values : numpy.ndarray
        One value per document (NaN: no value, dropped).
    low, high : float
        The range of a value.
    level : float
        Confidence level.

    Returns
    -------
    (float, float, float, str)
        Estimate, low, high and the refusal reason ("" when the interval is given).

    Examples
    --------
    >>> import numpy as np
    >>> est, lo, hi, why = answer_interval(np.r_[np.ones(15), np.zeros(5)], 0.0, 1.0)
    >>> round(est, 2), bool(0.5 < lo < est < hi < 1.0), why
    (0.75, True, '')
    """
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return math.nan, math.nan, math.nan, "no document has a value"
    res = document_interval((v,), lambda a: a.mean(-1)[None], level=level, method="jackknife-t",
                            min_docs=MIN_DOCS_ANSWERS, what="answer intervals")
    lo, hi = float(res.low[0]), float(res.high[0])
    if not res.reason:
        lo, hi = max(lo, low), min(hi, high)
    return float(v.mean()), lo, hi, res.reason


@dataclass(frozen=True)
class CouplingSaving:
    """What the coupling saved: the paired difference's variance, coupled against independent runs.

    Independent runs of P and Q (different seeds per side) have the same per-document laws
    of P's and of Q's scores and no within-document covariance between them; the coupling
    keeps those laws and adds the covariance c_d.  So, per replicate,
    Var(Y − X | d) = Var(X | d) + Var(Y | d) − 2 c_d coupled against Var(X | d) + Var(Y | d)
    independent, and across documents the variance of the per-document mean difference
    D_d over R_d replicates is larger by 2 E[c_d / R_d] without the coupling.  The documents
    a ±m interval needs are z² Var(D) / m² (normal approximation).  Needs two replicates per
    document (c_d is not identified from one; under greedy decoding there is no sampling
    noise and nothing to save).

    Attributes
    ----------
    within_coupled, within_independent : float
        Mean over documents of the within-document variance of one pair's difference.
    docs_coupled, docs_independent : float
        Variance across documents of the per-document mean difference, at the data's R.
    covariance : float
        Mean over documents of the within-document covariance of P's and Q's scores.
    docs_needed_coupled, docs_needed_independent : float
        Documents for a ±``margin`` interval at ``level`` (ceil of z² Var / m²).
    margin, level : float
        The interval's half-width m and level.
    n_docs, replicates : int
        Documents with two or more pairs, and their median number of pairs.
    reason : str
        Non-empty when not estimable (then the independent side is NaN).
    """

    within_coupled: float
    within_independent: float
    docs_coupled: float
    docs_independent: float
    covariance: float
    docs_needed_coupled: float
    docs_needed_independent: float
    margin: float
    level: float
    n_docs: int
    replicates: int
    reason: str = ""

    @property
    def ratio(self) -> float:
        """Documents needed coupled / independent (< 1: the coupling saves documents)."""
        return self.docs_needed_coupled / self.docs_needed_independent if self.docs_needed_independent else math.nan


def coupling_saving(x_scores: np.ndarray, y_scores: np.ndarray, *, margin: float = 0.05,
                    level: float = 0.95) -> CouplingSaving:
    """The paired difference's variance coupled against independent runs, and documents for ±margin.

    Parameters
    ----------
    x_scores, y_scores : array_like
        (document x replicate) scores of P and Q (NaN: not scored; a pair needs both).
    margin : float
        Half-width m of the interval the documents are counted for.
    level : float
        Its confidence level.

    Returns
    -------
    CouplingSaving

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(1)
    >>> x = (rng.random((200, 4)) < 0.6).astype(float)
    >>> y = np.where(rng.random((200, 4)) < 0.8, x, 1 - x)     # Q mostly copies P: positive covariance
    >>> s = coupling_saving(x, y)
    >>> bool(s.within_coupled < s.within_independent), bool(s.ratio < 1)
    (True, True)
    """
    x, y = _pairs(x_scores, y_scores)
    z = stats.norm.ppf(0.5 + level / 2)
    d = y - x
    n_pairs = np.isfinite(d).sum(axis=1)
    docs_d = np.nanmean(np.where(n_pairs[:, None] > 0, d, 0.0), axis=1)[n_pairs > 0]
    docs_coupled = float(np.var(docs_d, ddof=1)) if docs_d.size >= 2 else math.nan

    def need(v: float) -> float:
        return float(math.ceil(z * z * v / margin**2)) if np.isfinite(v) else math.nan

    multi = n_pairs >= 2
    nan = math.nan
    if multi.sum() < 2:
        why = ("not estimable: the within-document covariance of P's and Q's scores needs 2 or more replicates "
               f"in 2 or more documents ({int(multi.sum())} have them)")
        return CouplingSaving(nan, nan, docs_coupled, nan, nan, need(docs_coupled), nan, margin, level,
                              int(multi.sum()), int(np.median(n_pairs)) if n_pairs.size else 0, why)
    xm, ym, r = x[multi], y[multi], n_pairs[multi]
    ok = np.isfinite(xm - ym)
    xm, ym = np.where(ok, xm, np.nan), np.where(ok, ym, np.nan)
    vx, vy = np.nanvar(xm, axis=1, ddof=1), np.nanvar(ym, axis=1, ddof=1)
    cov = np.nansum((xm - np.nanmean(xm, axis=1)[:, None]) * (ym - np.nanmean(ym, axis=1)[:, None]), axis=1) / (r - 1)
    within_c, within_i = float(np.mean(vx + vy - 2 * cov)), float(np.mean(vx + vy))
    # with R_d pairs the coupling removes 2 c_d / R_d from the variance of document d's mean difference
    docs_i = docs_coupled + 2.0 * float(np.mean(cov / r))
    return CouplingSaving(within_c, within_i, docs_coupled, docs_i, float(np.mean(cov)), need(docs_coupled),
                          need(docs_i), margin, level, int(multi.sum()), int(np.median(r)))


@dataclass(frozen=True)
class AnswersResult:
    """Result of :func:`compare_answers` (scipy-style named fields).

    Attributes
    ----------
    x_accuracy, y_accuracy : Effect
        P's and Q's accuracy (mean over documents of the per-document mean score) with its
        interval over documents.
    difference : Effect
        Q − P with its interval over documents (:meth:`confidence_interval`).
    pvalue : float
        The test of no difference: ``test`` says which (exact McNemar with one replicate and
        0/1 scores, else the sign-flip permutation test over documents).
    test : str
    lost, gained : int
        Pairs where P is right and Q wrong, and the reverse ("right": score >= :data:`RIGHT`).
    table : numpy.ndarray
        The 2x2 counts over pairs [[both right, lost], [gained, both wrong]].
    binary : bool
        Every score is 0 or 1.
    n_docs, n_pairs, replicates : int
        Documents with a scored pair, scored pairs, and the most pairs in one document.
    confidence_level : float
    reason : str
        Why the intervals are refused ("" when given).
    noninferiority, equivalence : PairedTestResult or None
        At ``margin``: H0 Q − P <= −margin, and TOST of |Q − P| >= margin (bootstrap-t).
    coupling : CouplingSaving
        What the coupling saved.
    """

    x_accuracy: Effect
    y_accuracy: Effect
    difference: Effect
    pvalue: float
    test: str
    lost: int
    gained: int
    table: np.ndarray
    binary: bool
    n_docs: int
    n_pairs: int
    replicates: int
    confidence_level: float
    reason: str = ""
    noninferiority: PairedTestResult | None = None
    equivalence: PairedTestResult | None = None
    coupling: CouplingSaving | None = field(default=None, repr=False)

    def confidence_interval(self) -> ConfidenceInterval:
        """The paired difference's interval (Q − P), as scipy's results give it."""
        return self.difference.interval


def _pairs(x_scores: np.ndarray, y_scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(document x replicate) float arrays, checked; a cell missing on either side is NaN on both."""
    x, y = (np.asarray(a, dtype=float) for a in (x_scores, y_scores))
    if x.ndim == 1:
        x, y = x[:, None], y[:, None] if y.ndim == 1 else y
    if x.shape != y.shape or x.ndim != 2:
        raise ValueError(f"x_scores and y_scores must be (document x replicate) arrays of one shape, got "
                         f"{x.shape} and {y.shape}")
    for name, a in (("x_scores", x), ("y_scores", y)):
        if np.any((a < 0) | (a > 1)):
            raise ValueError(f"{name}: scores must lie in [0, 1] (NaN = not scored)")
    both = np.isfinite(x) & np.isfinite(y)
    return np.where(both, x, np.nan), np.where(both, y, np.nan)


def compare_answers(x_scores: np.ndarray, y_scores: np.ndarray, *, alpha: float = 0.05,
                    margin: float | None = None, coupling_margin: float = 0.05, n_resamples: int = 9999,
                    seed: int = 0) -> AnswersResult:
    """P's and Q's answers on the same documents: accuracies, the paired difference, the test, the flips.

    Parameters
    ----------
    x_scores, y_scores : array_like
        (document x replicate) scores in [0, 1] of P's (full cache) and Q's (the policy's)
        answers; a 1-D array is one replicate per document.  NaN: not scored (a pair needs
        both scores; documents without a pair are dropped).
    alpha : float
        1 − the confidence level of the intervals; the level of the margin tests.
    margin : float, optional
        An accuracy margin δ > 0: also test non-inferiority (Q − P > −δ) and equivalence
        (|Q − P| < δ) of the mean difference over documents.
    coupling_margin : float
        Half-width of the interval for which :attr:`AnswersResult.coupling` counts documents.
    n_resamples, seed : int
        Monte Carlo permutations (beyond the exact enumeration's size) and bootstrap resamples.

    Returns
    -------
    AnswersResult

    Raises
    ------
    ValueError
        Arrays of different shapes, or scores outside [0, 1].

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([1, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1.0])
    >>> y = np.array([0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1.0])
    >>> res = compare_answers(x, y)
    >>> res.lost, res.gained, res.test, round(res.pvalue, 4)
    (5, 1, 'mcnemar-exact', 0.2188)
    >>> round(res.difference.estimate, 3)
    -0.333
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    x, y = _pairs(x_scores, y_scores)
    n_pairs_doc = np.isfinite(x).sum(axis=1)
    keep = n_pairs_doc > 0
    x, y, n_pairs_doc = x[keep], y[keep], n_pairs_doc[keep]
    level = 1.0 - alpha
    with np.errstate(invalid="ignore"):
        xd, yd = np.nanmean(x, axis=1) if x.size else x[:, 0], np.nanmean(y, axis=1) if y.size else y[:, 0]
    dd = yd - xd
    xa, ya, diff = (answer_interval(v, lo, hi, level) for v, lo, hi in ((xd, 0, 1), (yd, 0, 1), (dd, -1, 1)))
    seen = np.isfinite(x)
    xr_, yr_ = x[seen] >= RIGHT, y[seen] >= RIGHT
    table = np.array([[np.sum(xr_ & yr_), np.sum(xr_ & ~yr_)], [np.sum(~xr_ & yr_), np.sum(~xr_ & ~yr_)]])
    binary = bool(np.all((x[seen] == 0) | (x[seen] == 1)) and np.all((y[seen] == 0) | (y[seen] == 1)))
    replicates = int(n_pairs_doc.max()) if n_pairs_doc.size else 0
    pvalue, test = _no_difference_test(table, dd, binary, replicates, n_resamples, seed)
    ni = eq = None
    if margin is not None:
        ni = paired_test(yd, xd, "bootstrap-t", "noninferiority", margin=margin, worse="smaller",
                         confidence_level=level, n_resamples=n_resamples, seed=seed)
        eq = paired_test(yd, xd, "bootstrap-t", "equivalence", margin=margin, confidence_level=level,
                         n_resamples=n_resamples, seed=seed)
    return AnswersResult(
        x_accuracy=Effect(*xa[:3]), y_accuracy=Effect(*ya[:3]), difference=Effect(*diff[:3]), pvalue=pvalue,
        test=test, lost=int(table[0, 1]), gained=int(table[1, 0]), table=table, binary=binary,
        n_docs=int(keep.sum()), n_pairs=int(seen.sum()), replicates=replicates, confidence_level=level,
        reason=diff[3], noninferiority=ni, equivalence=eq,
        coupling=coupling_saving(x, y, margin=coupling_margin, level=level))


def _no_difference_test(table: np.ndarray, dd: np.ndarray, binary: bool, replicates: int, n_resamples: int,
                        seed: int) -> tuple[float, str]:
    """(p, test): exact McNemar on one replicate of 0/1 scores, else the sign-flip test over documents."""
    if dd.size == 0:
        return math.nan, ""
    if binary and replicates == 1:
        from statsmodels.stats.contingency_tables import mcnemar  # lazy: statsmodels is slow to import

        return float(mcnemar(table, exact=True).pvalue), MCNEMAR
    if not np.any(dd != 0):
        return 1.0, SIGN_FLIP      # every document's difference is 0: nothing to flip
    return float(paired_test(dd, 0.0, "permutation", n_resamples=n_resamples, seed=seed).pvalue), SIGN_FLIP


# --------------------------------------------------------------------------- dataset forms

#: results.nc's answer variables (over policy) and what each is.
ANSWER_VARS: dict[str, str] = {
    "answer_x_accuracy": "P's (full cache) task accuracy: mean over documents of the mean score over replicates",
    "answer_x_accuracy_low": "lower end of the interval over documents of answer_x_accuracy",
    "answer_x_accuracy_high": "upper end of the interval over documents of answer_x_accuracy",
    "answer_y_accuracy": "Q's (the policy's) task accuracy: mean over documents of the mean score over replicates",
    "answer_y_accuracy_low": "lower end of the interval over documents of answer_y_accuracy",
    "answer_y_accuracy_high": "upper end of the interval over documents of answer_y_accuracy",
    "answer_difference": "paired difference of accuracies Q - P (replicates averaged within document first)",
    "answer_difference_low": "lower end of the interval over documents of answer_difference",
    "answer_difference_high": "upper end of the interval over documents of answer_difference",
    "answer_mcnemar_p": ("p-value of no difference: McNemar's exact test with one replicate and 0/1 scores, else the "
                         "sign-flip permutation test over documents (answer_test says which)"),
    "answer_test": "the test behind answer_mcnemar_p",
    "answer_lost": "scored (document, replicate) pairs where P is right and Q wrong (right: score >= 0.5)",
    "answer_gained": "scored (document, replicate) pairs where Q is right and P wrong",
    "answer_pairs": "scored (document, replicate) pairs",
    "answer_n_docs": "documents with a scored pair",
    "answer_var_within_coupled": "mean within-document variance of one pair's difference Y - X, coupled",
    "answer_var_within_independent": "the same had P and Q run independently: Var(X) + Var(Y) within documents",
    "answer_var_docs_coupled": "variance across documents of the per-document mean difference, coupled",
    "answer_var_docs_independent": "the same had P and Q run independently (adds 2 E[cov(X, Y | doc) / R])",
    "answer_docs_needed_coupled": "documents for a +-margin interval of the difference, coupled (margin in attrs)",
    "answer_docs_needed_independent": "documents for a +-margin interval of the difference, independent runs",
}


def compare_answers_dataset(ds: xr.Dataset, *, alpha: float = 0.05, coupling_margin: float = 0.05,
                            n_resamples: int = 9999, seed: int = 0) -> xr.Dataset:
    """:func:`compare_answers` for every policy (and model) of traces with answer scores.

    Parameters
    ----------
    ds : xarray.Dataset
        Traces with ``x_score`` and ``y_score`` over (doc, policy[, model], replicate).
    alpha, coupling_margin, n_resamples, seed
        As for :func:`compare_answers`.

    Returns
    -------
    xarray.Dataset
        :data:`ANSWER_VARS` over ``policy`` (and ``model``), each with a ``description``
        attr; attrs ``level``, ``coupling_margin`` and ``reason`` (refused intervals).

    Raises
    ------
    DivstatsError
        Traces without scores, or scores outside [0, 1].

    Examples
    --------
    >>> import numpy as np, xarray as xr
    >>> rng = np.random.default_rng(0)
    >>> x = xr.DataArray((rng.random((30, 2, 1)) < 0.7).astype(float), dims=("doc", "policy", "replicate"),
    ...                  coords={"policy": ["a", "b"]})
    >>> res = compare_answers_dataset(xr.Dataset({"x_score": x, "y_score": x * 0 + 1}))
    >>> res["answer_gained"].values.tolist() == (30 - x.sum(("doc", "replicate"))).values.tolist()
    True
    """
    x, y = score_arrays(ds)
    extra = [d for d in x.dims if d not in ("doc", "replicate")]
    xs, ys = (a.transpose(*extra, "doc", "replicate") for a in (x, y))
    shape = tuple(xs.sizes[d] for d in extra)
    out = {k: np.full(shape, math.nan) for k in ANSWER_VARS if k != "answer_test"}
    tests = np.full(shape, "", dtype=object)
    reasons = []
    for idx in np.ndindex(*shape):
        res = compare_answers(xs.values[idx], ys.values[idx], alpha=alpha, coupling_margin=coupling_margin,
                              n_resamples=n_resamples, seed=seed)
        c = res.coupling
        row = {"answer_x_accuracy": res.x_accuracy, "answer_y_accuracy": res.y_accuracy,
               "answer_difference": res.difference}
        for name, eff in row.items():
            out[name][idx], out[name + "_low"][idx], out[name + "_high"][idx] = eff
        out["answer_mcnemar_p"][idx], tests[idx] = res.pvalue, res.test
        out["answer_lost"][idx], out["answer_gained"][idx] = res.lost, res.gained
        out["answer_pairs"][idx], out["answer_n_docs"][idx] = res.n_pairs, res.n_docs
        for k in ("within_coupled", "within_independent", "docs_coupled", "docs_independent"):
            out[f"answer_var_{k}"][idx] = getattr(c, k)
        out["answer_docs_needed_coupled"][idx] = c.docs_needed_coupled
        out["answer_docs_needed_independent"][idx] = c.docs_needed_independent
        if res.reason:
            reasons.append(res.reason)
    coords = {d: xs[d].values for d in extra if d in xs.coords}
    data = {k: (extra, v, {"description": ANSWER_VARS[k]}) for k, v in out.items()}
    data["answer_test"] = (extra, tests.astype(str), {"description": ANSWER_VARS["answer_test"]})
    order = {k: data[k] for k in ANSWER_VARS}
    return xr.Dataset(order, coords=coords, attrs={"level": 1.0 - alpha, "coupling_margin": coupling_margin,
                                                   "reason": reasons[0] if reasons else ""})


def change_by_divergence(ds: xr.Dataset) -> xr.Dataset:
    """How often the answer changes when P and Q diverged before the answer, inside it, or not at all.

    Coupled traces with scores: per (document, replicate) pair, τ is the first step where
    P's and Q's tokens differ (``x_token != y_token``; none within the trace: "none").  With
    ``x_answer_start`` (the 0-based index of the token where P's answer starts; −1 unknown)
    a divergence at step τ (token τ − 1) is "before" the answer when τ − 1 < start, else
    "inside"; where the start is unknown it is "diverged" (start unknown).  The answer
    *changed* when the answer texts differ (``x_text``, ``y_text``), and separately when the
    scores differ.

    Parameters
    ----------
    ds : xarray.Dataset
        Coupled traces with ``x_token``, ``y_token``, ``x_score`` and ``y_score``.

    Returns
    -------
    xarray.Dataset
        Over (policy[, model], divergence) with divergence in ("before", "inside", "diverged",
        "none"): ``answer_change_pairs``, ``answer_score_changed`` (fraction of those pairs
        whose scores differ) and ``answer_text_changed`` (texts differ; NaN without texts).
        Empty when the traces hold no tokens.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> from divstats.truth.answers import with_answer_scores
    >>> tr = with_answer_scores(simulate_study(12, {"a@0.5": PolicyEffect(0.3)}, horizon=6, replicates=2),
    ...                         {"a@0.5": (0.5, 0.0)})
    >>> ch = change_by_divergence(tr)
    >>> ch["divergence"].values.tolist(), int(ch["answer_change_pairs"].sum())
    (['before', 'inside', 'diverged', 'none'], 24)
    """
    if not all(v in ds.data_vars for v in ("x_token", "y_token")):
        return xr.Dataset()
    x, y = score_arrays(ds)
    xt, yt = ds["x_token"], ds["y_token"]
    T = int(xt.sizes["step"])
    differ = (xt != yt) & (xt >= 0) & (yt >= 0)
    tau = xr.where(differ.any("step"), differ.argmax("step") + 1, T + 1)
    if "x_answer_start" in ds.data_vars:
        start = ds["x_answer_start"].astype(np.int64)
    else:
        start = xr.full_like(tau, -1)
    cat = xr.where(tau > T, 3, xr.where(start < 0, 2, xr.where(tau - 1 < start, 0, 1)))
    names = ["before", "inside", "diverged", "none"]
    scored = x.notnull() & y.notnull()
    score_changed = (x != y) & scored
    text_changed = None
    if "x_text" in ds.data_vars and "y_text" in ds.data_vars:
        text_changed = (ds["x_text"] != ds["y_text"]) & scored
    keep = [d for d in x.dims if d not in ("doc", "replicate")]
    pairs, s_rate, t_rate = [], [], []
    for k in range(4):
        in_k = scored & (cat == k)
        n = in_k.sum(("doc", "replicate"))
        pairs.append(n)
        s_rate.append((score_changed & in_k).sum(("doc", "replicate")) / n.where(n > 0))
        t_rate.append((text_changed & in_k).sum(("doc", "replicate")) / n.where(n > 0) if text_changed is not None
                      else xr.full_like(n, np.nan, dtype=float))
    div = xr.DataArray(names, dims="divergence")

    def cat_(parts: list[xr.DataArray]) -> xr.DataArray:
        return xr.concat(parts, dim="divergence").assign_coords(divergence=div).transpose(*keep, "divergence")

    return xr.Dataset({
        "answer_change_pairs": cat_(pairs).assign_attrs(description="scored pairs by where P and Q first diverged"),
        "answer_score_changed": cat_(s_rate).assign_attrs(description="fraction of those pairs whose scores differ"),
        "answer_text_changed": cat_(t_rate).assign_attrs(
            description="fraction of those pairs whose answer texts differ (NaN: no texts)"),
    })


def accuracy_by_depth(ds: xr.Dataset, bins: int = 5) -> xr.Dataset:
    """Needle tasks: P's and Q's accuracy by needle depth (equal-width bins of [0, 1]) and policy.

    Parameters
    ----------
    ds : xarray.Dataset
        Traces with scores and ``needle_depth`` (doc,) in [0, 1] (NaN: no needle).
    bins : int
        Number of equal-width depth bins.

    Returns
    -------
    xarray.Dataset
        Over (depth[, policy, model]): ``answer_depth_x_accuracy``, ``answer_depth_y_accuracy``
        (means over the bin's documents of the per-document mean score) and
        ``answer_depth_docs``; coords ``depth`` (bin centre), ``depth_low``, ``depth_high``.
        Empty without needle depths.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> from divstats.truth.answers import with_answer_scores
    >>> tr = with_answer_scores(simulate_study(12, {"a@0.5": PolicyEffect(0.3)}, horizon=6, replicates=2),
    ...                         {"a@0.5": (0.5, 0.0)})
    >>> accuracy_by_depth(tr, bins=4)["answer_depth_docs"].values.ravel().tolist()
    [3, 3, 3, 3]
    """
    if "needle_depth" not in ds.variables or not bool(np.isfinite(ds["needle_depth"].values).any()):
        return xr.Dataset()
    x, y = score_arrays(ds)
    depth = np.asarray(ds["needle_depth"].values, dtype=float)
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(depth, edges[1:-1]), 0, bins - 1)
    which = np.where(np.isfinite(depth), which, -1)
    xd, yd = x.mean("replicate", skipna=True), y.mean("replicate", skipna=True)
    cols = {"answer_depth_x_accuracy": [], "answer_depth_y_accuracy": [], "answer_depth_docs": []}
    for b in range(bins):
        sel = xr.DataArray(which == b, dims="doc")
        cols["answer_depth_x_accuracy"].append(xd.where(sel).mean("doc", skipna=True))
        cols["answer_depth_y_accuracy"].append(yd.where(sel).mean("doc", skipna=True))
        cols["answer_depth_docs"].append((yd.notnull() & sel).sum("doc"))
    centre = (edges[:-1] + edges[1:]) / 2
    desc = {"answer_depth_x_accuracy": "P's accuracy over the documents whose needle lies in this depth bin",
            "answer_depth_y_accuracy": "Q's accuracy over the documents whose needle lies in this depth bin",
            "answer_depth_docs": "documents with a scored answer in this depth bin"}
    out = {k: xr.concat(v, dim="depth").assign_attrs(description=desc[k]) for k, v in cols.items()}
    return xr.Dataset(out).assign_coords(depth=centre, depth_low=("depth", edges[:-1]),
                                         depth_high=("depth", edges[1:]))

