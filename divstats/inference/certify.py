"""The certified budget: the most a method can compress and stay within a margin of the reference.

``certify_budget(values, margin)`` takes per-document values of one estimand over a
family's budgets, ordered from the most to the least KV kept, and tests each budget's
**non-inferiority** to the reference (the full model's known value, or the measured
control's per-document values) at the margin, in that fixed order, stopping at the
first budget not shown (docs/statistics.md §11).  The last budget shown is certified.

Why no adjustment: the fixed-sequence procedure tests H_1, H_2, ... each at level α and
stops at the first non-rejection.  A false claim needs a first true null rejected;
every null before it was rejected correctly, so the familywise error is at most the
level of that one test (Maurer, Hothorn & Lehmacher 1995; Westfall & Krishen 2001).
The order must be fixed before the data are seen: here it is the order of KV kept,
which the family's definition fixes.  Its adjusted p-values are the running maximum of
the raw ones, and budget j is shown exactly when max(p_1..p_j) <= α.

Each test is ``divstats.inference.margins.margin_test`` (bootstrap-t by default) with its
refusal discipline: below ``MIN_DOCS_MARGIN`` documents (50, where its size at the
margin holds) it is refused with the number, and the sequence stops there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import xarray as xr

from divstats.errors import DivstatsError
from divstats.estimands import ANSWER_ESTIMANDS, ESTIMANDS
from divstats.estimation.sweeps import family_values
from divstats.inference.margins import margin_test
from divstats.inference.results import PairedTestResult
from divstats.intervals import ConfidenceInterval

#: metrics whose full-model value is the horizon T (the estimand table's ``full_value``)
HORIZON_VALUED = frozenset(e.name for e in ESTIMANDS if e.full_value == "horizon")
#: metrics whose full-model value is 0 whichever side is worse (the answers' ``accuracy_change``)
ZERO_VALUED = frozenset(e.name for e in ESTIMANDS + ANSWER_ESTIMANDS if e.full_value == "zero")

__all__ = ["CertifyResult", "certify_budget", "certify_family"]

#: Accepted spellings of ``worse``: the estimand table's, and the plain-English ones.
_WORSE = {"larger": "larger", "higher": "larger", "smaller": "smaller", "lower": "smaller"}


@dataclass(frozen=True)
class CertifyResult:
    """Result of :func:`certify_budget` (scipy-style named fields; arrays over the budgets, most KV kept first).

    Attributes
    ----------
    budgets : tuple of str
        The budgets' labels (policy ids, or ``"0"``, ``"1"``, ... when none were given).
    kept : numpy.ndarray
        KV kept by each budget (NaN where not given).
    mean : numpy.ndarray
        Each budget's mean value over its documents.
    estimate : numpy.ndarray
        Mean difference from the reference (the tested effect).
    low, high : numpy.ndarray
        Its one-sided (1 − α) bound: ``high`` when larger is worse (``low`` = −inf), ``low``
        when smaller is worse; NaN where the test was refused.
    pvalue : numpy.ndarray
        Each budget's own non-inferiority p-value (NaN: refused).
    pvalue_adjusted : numpy.ndarray
        The fixed-sequence adjusted p-value, max(p_1..p_j): budget j is shown exactly when it is <= α.
    tested : int
        Budgets the sequence tested: up to and including the first not shown (all when all are shown).
        The p-values beyond it are computed but are no part of the claim.
    n_docs : numpy.ndarray
        Documents per budget (pairs with both values).
    certified : str or None
        The last budget shown non-inferior, or None.
    certified_index : int
        Its index (−1 when None).
    reason : str
        Why the sequence stopped where it did (or why nothing is certified).
    margin, alpha : float
        The margin (with the worse side's sign: −δ when smaller is worse) and the level.
    worse : str
        "larger" or "smaller".
    reference : str
        What the budgets were compared with.
    results : tuple of PairedTestResult
        Every budget's test.
    """

    budgets: tuple[str, ...]
    kept: np.ndarray
    mean: np.ndarray
    estimate: np.ndarray
    low: np.ndarray
    high: np.ndarray
    pvalue: np.ndarray
    pvalue_adjusted: np.ndarray
    tested: int
    n_docs: np.ndarray
    certified: str | None
    certified_index: int
    reason: str
    margin: float
    alpha: float
    worse: str
    reference: str
    test: str = "bootstrap-t"
    results: tuple[PairedTestResult, ...] = field(default=(), repr=False)

    @property
    def shown(self) -> np.ndarray:
        """Whether each budget is shown non-inferior by the fixed sequence (adjusted p <= α)."""
        with np.errstate(invalid="ignore"):
            return np.asarray(self.pvalue_adjusted <= self.alpha) & np.isfinite(self.pvalue_adjusted)

    def confidence_interval(self) -> ConfidenceInterval:
        """Every budget's one-sided (1 − α) interval for the mean difference, as arrays (low, high)."""
        return ConfidenceInterval(self.low, self.high)

    @property
    def verdict(self) -> str:
        """The result in words."""
        where = f"at margin {self.margin:g} ({self.worse} is worse), level {self.alpha:g}"
        if self.certified is None:
            return f"no budget certified {where}: {self.reason}"
        kept = self.kept[self.certified_index]
        kept_txt = f" (KV kept {kept:.3g})" if np.isfinite(kept) else ""
        return f"certified down to {self.certified}{kept_txt} {where}"

    def to_dataset(self) -> xr.Dataset:
        """The per-budget numbers as an xarray Dataset over ``budget``, with the decision in attrs."""
        desc = {
            "kept": "fraction of the prompt's KV cache kept",
            "mean": "mean of the estimand over documents",
            "estimate": "mean difference from the reference",
            "low": "one-sided (1 - alpha) bound of the mean difference, lower end",
            "high": "one-sided (1 - alpha) bound of the mean difference, upper end",
            "pvalue": "non-inferiority p-value of this budget alone",
            "pvalue_adjusted": "fixed-sequence adjusted p-value, max of the p-values up to this budget",
            "shown": "shown non-inferior by the fixed sequence",
            "n_docs": "documents with values for this budget and the reference",
        }
        data = {k: ("budget", np.asarray(getattr(self, k)), {"description": v}) for k, v in desc.items()}
        return xr.Dataset(data, coords={"budget": list(self.budgets)}, attrs={
            "certified": "" if self.certified is None else self.certified, "tested": self.tested,
            "reason": self.reason, "margin": self.margin, "alpha": self.alpha, "worse": self.worse,
            "reference": self.reference, "test": self.test, "verdict": self.verdict})


def certify_budget(values: np.ndarray, margin: float, *, alpha: float = 0.05, worse: str = "larger",
                   reference: float | np.ndarray = 0.0, budgets: Sequence[str] | None = None,
                   kept: Sequence[float] | None = None, test: str = "bootstrap-t", n_resamples: int = 9999,
                   seed: int = 0, min_docs: int | None = None) -> CertifyResult:
    """The smallest budget certified non-inferior at a margin, by fixed-sequence tests.

    Parameters
    ----------
    values : array_like
        (document x budget) per-document values of one estimand, budgets ordered from
        the most to the least KV kept (the order is the procedure: fix it in advance).
        NaN: no value (dropped from that budget's pairs).
    margin : float
        δ > 0, or −δ when smaller is worse (rmtd: ``margin=-1``).
    alpha : float
        Level of every test, and the familywise error the procedure controls.
    worse : {"larger", "smaller"} (or "higher", "lower")
        Which direction of value − reference is worse (the estimand table's ``worse``).
    reference : float or array_like
        The full model's known value (0 for mismatch-type estimands, T for rmtd), or the
        measured control's per-document values (length = documents).
    budgets : sequence of str, optional
        Labels of the budgets (policy ids).
    kept : sequence of float, optional
        KV kept by each budget (reported; the order is the columns').
    test : {"bootstrap-t", "ttest"}
        The non-inferiority test (``divstats.inference.margins.margin_test``).
    n_resamples, seed : int
        Bootstrap resamples and their seed (the same seed for every budget).
    min_docs : int, optional
        Refusal threshold override (the calibration measures below it; leave it alone).

    Returns
    -------
    CertifyResult
        Every budget's estimate, bound and p-value, how many were tested, and the
        certified budget (or None with the reason).

    Raises
    ------
    ValueError
        For a values array that is not 2-D, a reference of the wrong length, or bad
        ``worse``, ``margin``, ``alpha``.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> v = np.array([0.0, 0.01, 0.03, 0.2]) + 0.02 * rng.standard_normal((60, 4))
    >>> res = certify_budget(v, 0.05, budgets=["a@0.9", "a@0.7", "a@0.5", "a@0.3"], n_resamples=999)
    >>> res.certified, res.tested
    ('a@0.5', 4)
    >>> res = certify_budget(v[:20], 0.05, n_resamples=999)
    >>> res.certified is None, "n = 20 documents" in res.reason
    (True, True)
    """
    x = np.asarray(values, dtype=float)
    if x.ndim != 2:
        raise ValueError(f"values must be (document x budget), got shape {x.shape}")
    if worse not in _WORSE:
        raise ValueError(f"worse must be one of {sorted(_WORSE)}, got {worse!r}")
    worse = _WORSE[worse]
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    n_docs, k = x.shape
    labels = tuple(str(b) for b in budgets) if budgets is not None else tuple(str(i) for i in range(k))
    if len(labels) != k:
        raise ValueError(f"{len(labels)} budget labels for {k} columns")
    kept_arr = np.full(k, math.nan) if kept is None else np.asarray(kept, dtype=float)
    ref = np.asarray(reference, dtype=float)
    if ref.ndim == 1 and ref.size != n_docs:
        raise ValueError(f"reference has {ref.size} values for {n_docs} documents")
    ref_text = f"{float(ref):g}" if ref.ndim == 0 else "the measured control"
    results = []
    for j in range(k):
        d = x[:, j] - ref
        results.append(margin_test(d[np.isfinite(d)], test, "noninferiority", margin, worse, 1.0 - alpha,
                                   n_resamples=n_resamples, seed=seed, min_docs=min_docs,
                                   hodges_lehmann_effect=False))
    p = np.array([r.pvalue for r in results])
    # fixed-sequence adjusted p: the running max; a refused (NaN) test stops the sequence
    adjusted = np.full(k, math.nan)
    running = 0.0
    for j in range(k):
        if not np.isfinite(p[j]):
            break
        running = max(running, p[j])
        adjusted[j] = running
    with np.errstate(invalid="ignore"):
        shown = np.isfinite(adjusted) & (adjusted <= alpha)
    first_fail = int(np.argmin(shown)) if not shown.all() else k
    tested = min(first_fail + 1, k)
    idx = first_fail - 1
    delta = results[0].margin if k else abs(margin)
    signed = delta if worse == "larger" else -delta
    if first_fail < k:
        r = results[first_fail]
        why = r.reason if r.reason else (f"not shown non-inferior (p = {p[first_fail]:.3g}, bound "
                                         f"{_bound(r, worse):.4g} vs margin {signed:g})")
        reason = f"the sequence stopped at {labels[first_fail]}{' (the first budget)' if idx < 0 else ''}: {why}"
    else:
        reason = "every budget was shown non-inferior"
    means = np.array([np.nanmean(x[:, j]) if np.isfinite(x[:, j]).any() else math.nan for j in range(k)])
    return CertifyResult(
        budgets=labels, kept=kept_arr, mean=means, estimate=np.array([r.mean_difference for r in results]),
        low=np.array([r.ci_low for r in results]), high=np.array([r.ci_high for r in results]),
        pvalue=p, pvalue_adjusted=adjusted, tested=tested, n_docs=np.array([r.n for r in results]),
        certified=labels[idx] if idx >= 0 else None, certified_index=idx, reason=reason, margin=float(signed),
        alpha=float(alpha), worse=worse, reference=ref_text, test=test, results=tuple(results))


def _bound(r: PairedTestResult, worse: str) -> float:
    return r.ci_high if worse == "larger" else r.ci_low


def certify_family(estimates: xr.Dataset, family: str, metric: str, margin: float, *, alpha: float = 0.05,
                   worse: str | None = None, reference: str | float = "full", model: str | None = None,
                   docs: Sequence[str] | None = None, **kwargs) -> CertifyResult:
    """:func:`certify_budget` on a dataset: a family's members and one estimand.

    Parameters
    ----------
    estimates : xarray.Dataset
        ``divstats.estimate(ds)``.
    family : str
        The family (``snapkv``, ``snapkv@*``, ``snapkv@0.9,0.5``; ``divstats.estimation.sweeps.resolve_family``),
        tested from the most to the least KV kept.
    metric : str
        An estimand of ``divstats.ESTIMANDS`` (a variable of ``estimates``).
    margin : float
        As for :func:`certify_budget`.
    alpha : float
        Level.
    worse : {"larger", "smaller"}, optional
        Default: the estimand table's.
    reference : "full" or float
        ``"full"``: the measured control's per-document values where the data hold the
        policy ``full``, else the full model's known value (0 where larger is worse, the
        horizon for rmtd and agreeing_tokens); or a number.
    model : str, optional
        Required when the data have a ``model`` dim (certify each model on its own).
    docs : sequence of str, optional
        Only these documents (a plan's split).
    **kwargs
        ``n_resamples``, ``seed``, ``test``, ``min_docs``.

    Returns
    -------
    CertifyResult
        The fixed-sequence tests over the family's members, most KV kept first.

    Raises
    ------
    DivstatsError
        When ``reference="full"`` and neither the control ``full`` is in the data nor the
        full model's value of ``metric`` is known; also (from
        :func:`divstats.estimation.sweeps.family_values`) when the metric, the model or the
        family is not in the data.

    Examples
    --------
    >>> import divstats
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(60, {"snapkv@0.9": PolicyEffect(0.0), "snapkv@0.5": PolicyEffect(0.3)},
    ...                     horizon=6, replicates=2)
    >>> res = certify_family(divstats.estimate(ds), "snapkv", "occurrence", 0.05, n_resamples=99)
    >>> res.budgets
    ('snapkv@0.9', 'snapkv@0.5')
    """
    row = next((e for e in ESTIMANDS + ANSWER_ESTIMANDS if e.name == metric), None)
    worse = worse or (row.worse if row is not None else "larger")
    values, members, kept, doc_ids = family_values(estimates, family, metric, model=model, docs=docs)
    est = estimates.sel(model=model) if "model" in estimates.dims else estimates
    ref: float | np.ndarray
    if reference == "full":
        if "full" in [str(p) for p in est["policy"].values]:
            ref = np.asarray(est[metric].sel(policy="full", doc=doc_ids).values, dtype=float)
        elif _WORSE.get(worse) == "larger" or metric in ZERO_VALUED:
            ref = 0.0
        elif metric in HORIZON_VALUED and "horizon" in estimates.attrs:
            ref = float(estimates.attrs["horizon"])
        else:
            raise DivstatsError(f"metric {metric!r} has no known full-model value here: pass reference=<value> "
                                f"or collect the control policy 'full'")
    else:
        ref = float(reference)
    return certify_budget(values, margin, alpha=alpha, worse=worse, reference=ref, budgets=members, kept=kept,
                          **kwargs)

