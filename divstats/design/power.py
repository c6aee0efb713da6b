"""Power of a plan's hypotheses at a number of documents and replicates, from a pilot.

Each hypothesis of a plan (docs/plans.md) is a paired test across documents of
per-document differences ``d = A - B``.  A pilot study gives, per hypothesis,
the documents' differences ``d_i`` and their per-replicate Monte Carlo variance
``w_i`` (``divstats.variance_components``).  The model for a new study with N
documents and R replicates per document is

    D = delta + b + e,    b ~ between-document deviations, e ~ N(0, w / R)

where ``delta`` is the pilot's mean difference and the deviations ``b`` are the
pilot's ``d_i - delta`` shrunk by sqrt(sigma_B^2 / Var(d)) so that their variance is
the between-document component sigma_B^2 (their shape, skew and heavy tails
included, is the pilot's).  A document drawn from the pilot's documents brings its
own deviation and its own Monte Carlo variance.  Documents whose difference is
exactly 0 with no Monte Carlo noise (neither policy ever diverges there) stay at 0,
as they would in the study (the signed-rank test drops them).

Power is the probability that the hypothesis' test rejects at its level: the
plan's alpha divided by the family's size for Holm families (Bonferroni: Holm
rejects at least what Bonferroni rejects, so this is a lower bound of Holm's
power).  It is computed by simulating the test on the model (exact signed-rank
null law, t distribution; the sign-flip permutation and bootstrap-t tests as the
t-test; 0 for a one-sided bootstrap-t test on fewer documents than it needs, which
is refused, :func:`refused_reason`) for up to
:data:`SIMULATE_MAX_N` documents, and beyond that from the normal approximation of
the test statistic under the alternative (Lehmann's moments of the signed-rank
statistic, estimated on the model; the noncentral t).

What the pilot says per hypothesis (``d_i``, ``w_i``, the level, the split's share) is
read by :func:`divstats.design.pilot.hypothesis_pilots`; this module is the model and the
power of the test under it.

The pilot is a sample: the reported range is the power at the ends of a
``level`` bootstrap interval (over pilot documents) of the standardised effect
delta / sqrt(sigma_B^2 + w / R).  A pilot of 14 documents gives wide ranges;
that width is the honest answer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr
from scipy import stats

from divstats.design.pilot import HypothesisPilot, counted_replicates, hypothesis_pilots
from divstats.estimation.resample import MIN_DOCS_MARGIN, MIN_DOCS_MARGIN_T, MIN_DOCS_MEAN_BOUND, too_few_documents
from divstats.inference.choices import MARGIN_ALTERNATIVES
from divstats.inference.location_tests import signed_rank_null_cdf
from divstats.plans.format import Hypothesis, Plan

__all__ = ["POWER_COLUMNS", "SIMULATE_MAX_N", "PowerResult", "effect_range", "power", "power_at", "power_range",
           "refused_reason"]

#: Up to this many documents power is simulated; beyond it the normal approximation is used.
SIMULATE_MAX_N = 100
#: Bootstrap resamples of the pilot documents for the range.
N_BOOTSTRAP = 400

POWER_COLUMNS: tuple[str, ...] = (
    "id", "family", "metric", "a", "b", "test", "direction", "alpha_used", "docs", "replicates", "n_docs",
    "effect", "sd_between", "sd_replicate", "power", "power_low", "power_high", "note",
)


# ---------------------------------------------------------------------------
# Power of one test under the model
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _Model:
    """Sampling model of one study's per-document differences at R replicates."""

    shift: float            # delta in the study
    dev: np.ndarray         # shrunk between-document deviations, one per pilot document
    w: np.ndarray           # per-replicate MC variance, one per pilot document
    fixed_zero: np.ndarray  # documents that are exactly 0 whatever happens

    def draw(self, rng: np.random.Generator, shape: tuple[int, ...], R: float) -> np.ndarray:
        idx = rng.integers(0, self.dev.size, size=shape)
        d = self.shift + self.dev[idx] + np.sqrt(self.w[idx] / R) * rng.standard_normal(shape)
        return np.where(self.fixed_zero[idx], 0.0, d)


def _model(hp: HypothesisPilot, theta: float | None, R: float, difference: float | None = None) -> _Model:
    """The model at the pilot's effect (theta None), at standardised effect theta at R, or at a true
    mean ``difference`` (tests at a margin: default 0, the design question "if they are truly the same")."""
    d, w = hp.d, hp.w
    between = hp.between
    total = float(np.var(d, ddof=1))
    shrink = math.sqrt(between / total) if total > 0 else 0.0
    dev = (d - d.mean()) * shrink
    zero = (d == 0) & (w == 0)
    shift = d.mean() if theta is None else theta * math.sqrt(between + w.mean() / R)
    target = difference if difference is not None else (
        0.0 if theta is None and hp.hypothesis.direction in MARGIN_ALTERNATIVES else None)
    if target is not None:
        # the model's mean is shift * P(not fixed at 0) + mean of the others' deviations: solve for target
        live = float(np.mean(~zero)) if zero.size else 1.0
        shift = (target - float(np.mean(np.where(zero, 0.0, dev)))) / live if live > 0 else target
    return _Model(float(shift), dev, w, zero)


def _pvalues_margin(d: np.ndarray, h: Hypothesis) -> np.ndarray:
    """TOST / non-inferiority p-values per row (the t versions; bootstrap-t is powered as t)."""
    delta = float(h.margin or 0.0)
    sides = []
    if h.direction == "equivalence" or h.worse == "smaller":
        sides.append(_pvalues_t(d + delta, "greater"))
    if h.direction == "equivalence" or h.worse == "larger":
        sides.append(_pvalues_t(d - delta, "less"))
    return np.maximum.reduce(sides)


def _pvalues_t(d: np.ndarray, direction: str) -> np.ndarray:
    n = d.shape[-1]
    mean, sd = d.mean(-1), d.std(-1, ddof=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = mean / (sd / math.sqrt(n))
    t = np.where(sd > 0, t, np.where(mean == 0, 0.0, np.sign(mean) * np.inf))
    if direction == "greater":
        return stats.t.sf(t, n - 1)
    if direction == "less":
        return stats.t.cdf(t, n - 1)
    return np.minimum(1.0, 2 * stats.t.sf(np.abs(t), n - 1))


def _pvalues_signed_rank(d: np.ndarray, direction: str) -> np.ndarray:
    """Signed-rank p-values per row: exact null law (zeros dropped per row) like scipy's ``wilcoxon``."""
    nz = d != 0
    n_nz = nz.sum(-1)
    ranks = stats.rankdata(np.where(nz, np.abs(d), np.inf), axis=-1)
    w_plus = np.where(nz & (d > 0), ranks, 0.0).sum(-1)
    p = np.ones(d.shape[0])
    for n in np.unique(n_nz):
        rows = n_nz == n
        if n == 0:
            continue
        if n <= 50:
            cdf = signed_rank_null_cdf(int(n))
            lo = np.floor(w_plus[rows]).astype(int)                 # P(W+ <= w)
            hi = np.ceil(w_plus[rows]).astype(int)                  # P(W+ >= w) = 1 - cdf[w - 1]
            p_less = cdf[np.clip(lo, 0, cdf.size - 1)]
            p_greater = 1.0 - np.where(hi >= 1, cdf[np.clip(hi - 1, 0, cdf.size - 1)], 0.0)
        else:
            mu, sd = n * (n + 1) / 4, math.sqrt(n * (n + 1) * (2 * n + 1) / 24)
            z = (w_plus[rows] - mu) / sd
            p_less, p_greater = stats.norm.cdf(z), stats.norm.sf(z)
        p[rows] = {"less": p_less, "greater": p_greater}.get(direction, np.minimum(1.0, 2 * np.minimum(p_less,
                                                                                                       p_greater)))
    return p


def _simulated_power(model: _Model, n: int, R: float, test: str, direction: str, alpha: float,
                     n_sims: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    d = model.draw(rng, (n_sims, n), R)
    p = _pvalues_signed_rank(d, direction) if test == "wilcoxon" else _pvalues_t(d, direction)
    return float(np.mean(p < alpha))


def _lehmann_power(model: _Model, n: int, R: float, direction: str, alpha: float, seed: int) -> float:
    """Normal approximation of the signed-rank statistic under the alternative (Lehmann's moments)."""
    rng = np.random.default_rng(seed)
    m = 100_000
    d1, d2, d3 = (model.draw(rng, (m,), R) for _ in range(3))
    sign = -1.0 if direction == "less" else 1.0
    d1, d2, d3 = sign * d1, sign * d2, sign * d3
    p1 = np.mean(d1 > 0)
    s12, s13 = d1 + d2 > 0, d1 + d3 > 0
    p2, p3, p4 = np.mean(s12), np.mean((d1 > 0) & s12), np.mean(s12 & s13)
    mean = n * p1 + n * (n - 1) / 2 * p2
    var = (n * p1 * (1 - p1) + n * (n - 1) / 2 * p2 * (1 - p2) + 2 * n * (n - 1) * (p3 - p1 * p2)
           + n * (n - 1) * (n - 2) * (p4 - p2 ** 2))
    mu0, sd0 = n * (n + 1) / 4, math.sqrt(n * (n + 1) * (2 * n + 1) / 24)
    tail = alpha / 2 if direction == "two-sided" else alpha
    crit = mu0 + stats.norm.isf(tail) * sd0
    pw = stats.norm.sf((crit - mean) / math.sqrt(max(var, 1e-300)))
    if direction == "two-sided":  # the other tail
        pw += stats.norm.cdf((n * (n + 1) / 2 - crit - mean) / math.sqrt(max(var, 1e-300)))
    return float(min(pw, 1.0))


def _t_power(model: _Model, n: int, R: float, direction: str, alpha: float, seed: int) -> float:
    """Noncentral t with the model's mean and variance (estimated on draws from the model)."""
    draws = model.draw(np.random.default_rng(seed), (100_000,), R)
    sd = float(draws.std()) or 1e-300
    ncp = float(draws.mean()) / (sd / math.sqrt(n))
    df = n - 1
    if direction == "greater":
        return _nct_sf(stats.t.isf(alpha, df), df, ncp)
    if direction == "less":
        return _nct_sf(stats.t.isf(alpha, df), df, -ncp)
    q = stats.t.isf(alpha / 2, df)
    return min(1.0, _nct_sf(q, df, ncp) + _nct_sf(q, df, -ncp))


def _nct_sf(x: float, df: int, ncp: float) -> float:
    """P(T > x) for a noncentral t; the normal limit where scipy's series gives NaN (large |ncp|).

    Only called with df >= SIMULATE_MAX_N, where t and normal agree to about 1e-2.
    """
    value = float(stats.nct.sf(x, df, ncp))
    return value if math.isfinite(value) else float(stats.norm.sf(x - ncp))


def power_at(hp: HypothesisPilot, n: int, R: float, *, theta: float | None = None, n_sims: int = 2000,
             seed: int = 0, difference: float | None = None) -> float:
    """Power of ``hp``'s test on ``n`` documents with ``R`` replicates each.

    Parameters
    ----------
    hp : HypothesisPilot
        One hypothesis and its pilot (:func:`hypothesis_pilots`).
    n : int
        Documents the test runs on (already the hypothesis' split share).
    R : float
        Replicates per document.
    theta : float, optional
        Replace the pilot's effect by this standardised effect
        delta / sqrt(sigma_B^2 + w / R); None uses the pilot's mean difference.
    n_sims, seed : int
        Simulated studies (for n <= ``SIMULATE_MAX_N``; always for tests at a margin) and their seed.
    difference : float, optional
        The true mean difference A − B in the study (raw units); for tests at a margin
        (equivalence, non-inferiority) it defaults to 0 (the pilot gives the spread).

    Returns
    -------
    float
        The rejection probability at ``hp.alpha``; NaN with fewer than 2 documents
        (in the study or in the pilot); 0 for a one-sided ``bootstrap-t`` test below
        ``divstats.estimation.resample.MIN_DOCS_MEAN_BOUND`` documents, which ``paired_test``
        refuses (:func:`refused_reason`).

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> pilot = simulate_study(6, {"a": PolicyEffect(0.05), "b": PolicyEffect(0.2)}, horizon=6, replicates=4)
    >>> plan = {"plan": {"name": "p", "salt": "s"}, "hypothesis": [{"id": "h", "family": "f",
    ...         "metric": "occurrence", "compare": ["a", "b"], "split": "all"}]}
    >>> hp = hypothesis_pilots(plan, pilot)[0]
    >>> power_at(hp, 40, 4, n_sims=200) >= power_at(hp, 5, 4, n_sims=200)
    True
    """
    h = hp.hypothesis
    if n < 2 or hp.n_pilot < 2:
        return math.nan
    if refused_reason(h, n):
        return 0.0                  # the test is not run, so it never rejects
    model = _model(hp, theta, R, difference)
    if h.direction in MARGIN_ALTERNATIVES:
        d = model.draw(np.random.default_rng(seed), (n_sims, n), R)
        return float(np.mean(_pvalues_margin(d, h) <= hp.alpha))
    if n <= SIMULATE_MAX_N:
        return _simulated_power(model, n, R, h.test, h.direction, hp.alpha, n_sims, seed)
    if h.test == "wilcoxon":
        return _lehmann_power(model, n, R, h.direction, hp.alpha, seed)
    return _t_power(model, n, R, h.direction, hp.alpha, seed)


def refused_reason(h: Hypothesis, n: int) -> str:
    """Why ``paired_test`` refuses ``h``'s test on ``n`` documents whatever the data ("" when it does not).

    A one-sided ``bootstrap-t`` test needs ``divstats.estimation.resample.MIN_DOCS_MEAN_BOUND``
    documents (its size on skewed differences, docs/plans.md).

    Parameters
    ----------
    h : Hypothesis
        The hypothesis (its test and direction).
    n : int
        Documents the test runs on.

    Returns
    -------
    str
        The reason, or "".

    Examples
    --------
    >>> from divstats.plans.format import load_plan
    >>> plan = load_plan({"plan": {"name": "p", "salt": "s"}, "hypothesis": [{"id": "h", "family": "f",
    ...     "metric": "occurrence", "compare": ["a", "b"], "direction": "less", "test": "bootstrap-t"}]})
    >>> refused_reason(plan.hypotheses[0], 20)[:31]
    'not estimable: n = 20 documents'
    """
    if h.direction in MARGIN_ALTERNATIVES:
        need = MIN_DOCS_MARGIN if h.test == "bootstrap-t" else MIN_DOCS_MARGIN_T
        return too_few_documents(n, need, f"{h.test} tests at a margin (equivalence, non-inferiority)")
    if h.test == "bootstrap-t" and h.direction != "two-sided":
        return too_few_documents(n, MIN_DOCS_MEAN_BOUND, "one-sided bootstrap-t tests of a mean difference")
    return ""


def effect_range(hp: HypothesisPilot, R: float, level: float = 0.8, n_boot: int = N_BOOTSTRAP,
                 seed: int = 0) -> tuple[float, float, float]:
    """The standardised effect delta / sqrt(sigma_B^2 + w / R) and its bootstrap interval.

    Parameters
    ----------
    hp : HypothesisPilot
    R : float
        Replicates per document in the planned study.
    level : float
        Coverage of the percentile interval (pilot documents resampled ``n_boot`` times).
    n_boot, seed : int

    Returns
    -------
    tuple of float
        ``(low, point, high)``.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> pilot = simulate_study(6, {"a": PolicyEffect(0.05), "b": PolicyEffect(0.2)}, horizon=6, replicates=4)
    >>> plan = {"plan": {"name": "p", "salt": "s"}, "hypothesis": [{"id": "h", "family": "f",
    ...         "metric": "occurrence", "compare": ["a", "b"], "split": "all"}]}
    >>> low, point, high = effect_range(hypothesis_pilots(plan, pilot)[0], R=4)
    >>> low <= point <= high
    True
    """
    d, w, r = hp.d, hp.w, hp.r
    point = float(d.mean() / math.sqrt(hp.between + w.mean() / R)) if hp.between + w.mean() > 0 else math.nan
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.size, size=(n_boot, d.size))
    db, wb, rb = d[idx], w[idx], r[idx]
    between = np.maximum(db.var(-1, ddof=1) - (wb / rb).mean(-1), 0.0)
    scale = np.sqrt(between + wb.mean(-1) / R)
    with np.errstate(divide="ignore", invalid="ignore"):
        theta = np.where(scale > 0, db.mean(-1) / scale, 0.0)
    lo, hi = np.quantile(theta, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), point, float(hi)


def power_range(hp: HypothesisPilot, n: int, R: float, *, level: float = 0.8, n_sims: int = 2000,
                seed: int = 0, difference: float | None = None) -> tuple[float, float, float]:
    """Power at the pilot's effect and its range over the effect's bootstrap interval.

    Parameters
    ----------
    hp, n, R, n_sims, seed, difference
        As in :func:`power_at`.
    level : float
        Coverage of the effect's interval (:func:`effect_range`).

    Returns
    -------
    tuple of float
        ``(low, point, high)``: the smallest and largest power at the interval's ends
        (and at 0 when the interval straddles it), and the power at the pilot's effect.
        At a stated ``difference`` and for tests at a margin (power at a true difference,
        0 by default) there is no effect range: ``low`` and ``high`` are NaN.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> pilot = simulate_study(6, {"a": PolicyEffect(0.05), "b": PolicyEffect(0.2)}, horizon=6, replicates=4)
    >>> plan = {"plan": {"name": "p", "salt": "s"}, "hypothesis": [{"id": "h", "family": "f",
    ...         "metric": "occurrence", "compare": ["a", "b"], "split": "all"}]}
    >>> low, point, high = power_range(hypothesis_pilots(plan, pilot)[0], 10, 4, n_sims=200)
    >>> low <= point <= high
    True
    """
    point = power_at(hp, n, R, n_sims=n_sims, seed=seed, difference=difference)
    if not np.isfinite(point):
        return math.nan, math.nan, math.nan
    if hp.hypothesis.direction in MARGIN_ALTERNATIVES or difference is not None:
        return math.nan, point, math.nan     # at a stated difference: no effect range (docs/design.md)
    lo, _, hi = effect_range(hp, R, level, seed=seed)
    thetas = [lo, hi] + ([0.0] if lo < 0 < hi else [])
    ends = [power_at(hp, n, R, theta=t, n_sims=n_sims, seed=seed) for t in thetas]
    return min(ends + [point]), point, max(ends + [point])


# ---------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class PowerResult:
    """Outcome of :func:`power`: one row per (hypothesis, docs, replicates)."""

    table: pd.DataFrame
    level: float
    pilot_docs: int
    pilot_replicates: float
    notes: list[str] = field(default_factory=list)

    def to_dataset(self) -> xr.Dataset:
        """The table as an ``xarray.Dataset`` over ``row``, with attrs."""
        t = self.table.reset_index(drop=True)
        ds = xr.Dataset({c: ("row", t[c].to_numpy()) for c in t.columns}, coords={"row": np.arange(len(t))})
        return ds.assign_attrs(level=self.level, pilot_docs=self.pilot_docs,
                               pilot_replicates=self.pilot_replicates, meaning=_MEANING)


_MEANING = ("power: probability that the hypothesis' test rejects at alpha_used (plan alpha / family size for "
            "Holm: a lower bound of Holm's power) with `docs` documents in the study (n_docs of them on the "
            "hypothesis' split) and `replicates` replicates each, under the pilot's variance components and "
            "effect; power_low/high: at the ends of the level bootstrap interval of the standardised effect")


def _typical_replicates(pilot: xr.Dataset) -> int:
    """The median counted R over cells that have any (the default R of a power table)."""
    if "replicate" not in pilot.dims:  # per-document estimates, not traces
        return int(pilot.attrs.get("n_replicates", 1))
    counts = counted_replicates(pilot).values.ravel()
    counts = counts[counts > 0]
    return int(np.median(counts)) if counts.size else int(pilot.attrs.get("n_replicates", 1))


def _as_list(x: int | Iterable[int] | None, default: int) -> list[int]:
    if x is None:
        return [default]
    if isinstance(x, (int, np.integer)):
        return [int(x)]
    return [int(v) for v in x]


def _row(hp: HypothesisPilot, docs: int, R: int, level: float, n_sims: int, seed: int,
         difference: float | None = None) -> dict[str, Any]:
    h = hp.hypothesis
    n = hp.docs_used(docs)
    low, point, high = power_range(hp, n, R, level=level, n_sims=n_sims, seed=seed, difference=difference)
    return {"id": hp.label, "family": h.family, "metric": h.metric, "a": hp.a, "b": hp.b, "test": h.test,
            "direction": h.direction, "alpha_used": hp.alpha, "docs": docs, "replicates": R, "n_docs": n,
            "effect": hp.effect, "sd_between": math.sqrt(hp.between) if hp.n_pilot >= 2 else math.nan,
            "sd_replicate": math.sqrt(hp.replicate_var) if hp.n_pilot else math.nan,
            "power": point, "power_low": low, "power_high": high,
            "note": "; ".join(x for x in (hp.note, refused_reason(h, n), _margin_note(hp, difference)) if x)}


def _margin_note(hp: HypothesisPilot, difference: float | None) -> str:
    """Tests at a margin: at which true difference the power is, and whether the pilot is already past the margin."""
    h = hp.hypothesis
    if h.direction not in MARGIN_ALTERNATIVES:
        return ""
    at = 0.0 if difference is None else difference
    text = f"power at a true difference of {at:g} (margin {h.margin:g})"
    past = (abs(hp.effect) >= h.margin if h.direction == "equivalence" else
            (hp.effect >= h.margin if h.worse == "larger" else hp.effect <= -h.margin))
    return text + (f"; the pilot's mean difference {hp.effect:.3g} is past the margin" if past else "")


def power(plan: Plan | str | Mapping[str, Any], pilot: xr.Dataset, docs: int | Sequence[int] | None = None,
          replicates: int | Sequence[int] | None = None, *, level: float = 0.8,
          aliases: Mapping[str, str] | None = None, window: int | None = None, n_sims: int = 2000,
          seed: int = 0, difference: float | None = None) -> PowerResult:
    """Power of every hypothesis of ``plan`` at ``docs`` documents and ``replicates`` per document.

    Parameters
    ----------
    plan : Plan, path, TOML text or dict
        The plan whose hypotheses are assessed.
    pilot : xarray.Dataset
        Pilot traces (or ``divstats.estimate`` output): the source of each
        hypothesis' effect, between-document and Monte Carlo variance.
    docs, replicates : int or sequence of int, optional
        Study sizes (documents in the whole study; a hypothesis on the confirmatory
        split uses its fraction of them).  Default: the pilot's.  Every combination
        gets a row.
    level : float
        Coverage of the bootstrap interval of the effect behind ``power_low``/``power_high``.
    aliases : mapping, optional
        Planned policy id -> policy id in the pilot.
    window : int, optional
        Window truncation as in ``divstats.estimate``.
    n_sims, seed : int
        Simulated studies per power value (up to ``SIMULATE_MAX_N`` documents) and their seed.
    difference : float, optional
        A stated true mean difference A − B for every hypothesis (raw units).  Tests at
        a margin (equivalence, non-inferiority) are powered at 0 by default: "if the
        candidate is truly as good, how often does the study show it?".

    Returns
    -------
    PowerResult
        ``table`` has the columns of :data:`POWER_COLUMNS`.

    Raises
    ------
    PlanError
        The plan is ill-formed or names a policy the pilot lacks.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> pilot = simulate_study(8, {"a": PolicyEffect(0.05), "b": PolicyEffect(0.15)}, horizon=6, replicates=4)
    >>> plan = {"plan": {"name": "p", "salt": "s"}, "hypothesis": [{"id": "h", "family": "f",
    ...         "metric": "occurrence", "compare": ["a", "b"], "split": "all"}]}
    >>> res = power(plan, pilot, docs=[10, 40], replicates=4, n_sims=200)
    >>> list(res.table["docs"])
    [10, 40]
    """
    pilots = hypothesis_pilots(plan, pilot, aliases=aliases, window=window)
    n_pilot = int(pilot.sizes["doc"])
    r_pilot = _typical_replicates(pilot)
    rows = [_row(hp, n, R, level, n_sims, seed, difference) for hp in pilots
            for n in _as_list(docs, n_pilot) for R in _as_list(replicates, r_pilot)]
    notes = sorted({hp.note for hp in pilots if hp.note})
    table = pd.DataFrame(rows, columns=list(POWER_COLUMNS))
    return PowerResult(table, level, n_pilot, float(r_pilot), notes)
