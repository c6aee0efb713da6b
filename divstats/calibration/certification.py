"""Calibration of the certified budget and of the band over budgets, by simulation with known truth.

Populations of per-document values over a family of K budgets (documents shared, so
a document's values are correlated across budgets): value_ij = μ_j + σ (√ρ u_i + √(1−ρ) e_ij)
with σ = 0.1, ρ = 0.5 and u, e standardised *symmetric* (t₅) or *skewed* (Exp(1) − 1,
skewness 2) draws.  The true means μ_j are known, so every rate below is against the
truth (docs/statistics.md §11 has the tables; ``benchmarks/bench_certify.py`` prints them).

* Familywise error of :func:`divstats.inference.certify.certify_budget`: the share of
  studies that certify a budget whose true mean is at (or past) the margin.
* Power against the true crossing: the share that certify exactly the last budget
  inside the margin, and the mean number of budgets certified.
* The band's simultaneous coverage: the share of studies whose band holds every μ_j
  at once (and, for contrast, the pointwise intervals' simultaneous coverage).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import pandas as pd

from divstats.estimation.budget_curves import simultaneous_band
from divstats.inference.margins import margin_test

__all__ = ["SCENARIOS", "band_calibration", "broken_all_budgets", "certified_index", "certify_calibration",
           "scenario_means",
           "sweep_values"]

SD, RHO, MARGIN = 0.1, 0.5, 0.05
#: True means over the budgets (most KV kept first), given K and the margin δ.
SCENARIOS = ("all-at-margin", "two-inside", "crossing")


def scenario_means(scenario: str, k: int, margin: float = MARGIN) -> np.ndarray:
    """μ_j of a scenario: every budget at the margin; the first two at 0 and the rest at the margin;
    or a rising curve 0, δ/4, δ/2, 3δ/4 (inside) then 1.5δ, 2δ, ... (outside): the true last budget
    inside is the fourth.

    Parameters
    ----------
    scenario : str
        One of :data:`SCENARIOS`.
    k : int
        Number of budgets in the family.
    margin : float, optional
        The margin δ.

    Returns
    -------
    numpy.ndarray
        The K true means, most KV kept first.

    Raises
    ------
    ValueError
        If ``scenario`` is not one of :data:`SCENARIOS`.

    Examples
    --------
    >>> scenario_means("two-inside", 4, 0.05).tolist()
    [0.0, 0.0, 0.05, 0.05]
    >>> scenario_means("crossing", 6, 0.04).round(3).tolist()
    [0.0, 0.01, 0.02, 0.03, 0.06, 0.08]
    """
    if scenario == "all-at-margin":
        return np.full(k, margin)
    if scenario == "two-inside":
        return np.array([0.0, 0.0] + [margin] * (k - 2))
    if scenario == "crossing":
        return np.array([margin * min(j, 3) / 4 if j < 4 else margin * (1 + 0.5 * (j - 3)) for j in range(k)])
    raise ValueError(f"unknown scenario {scenario!r}; expected one of {SCENARIOS}")


def _draw(rng: np.random.Generator, shape: tuple[int, ...], population: str) -> np.ndarray:
    if population == "skewed":
        return rng.exponential(1.0, shape) - 1.0
    if population == "symmetric":
        return rng.standard_t(5, shape) / math.sqrt(5 / 3)
    raise ValueError(f"population must be 'symmetric' or 'skewed', got {population!r}")


def sweep_values(rng: np.random.Generator, n: int, means: np.ndarray, population: str) -> np.ndarray:
    """(n x K) per-document values with true column means ``means`` (see the module docstring).

    Parameters
    ----------
    rng : numpy.random.Generator
        Source of the draws.
    n : int
        Number of documents (rows).
    means : numpy.ndarray
        The K true column means.
    population : {"symmetric", "skewed"}
        Standardised t₅ or Exp(1) − 1 draws.

    Returns
    -------
    numpy.ndarray
        An (n, K) array of per-document values.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> sweep_values(rng, 5, np.array([0.0, 0.05]), "symmetric").shape
    (5, 2)
    """
    u = _draw(rng, (n, 1), population)
    e = _draw(rng, (n, len(means)), population)
    return means + SD * (math.sqrt(RHO) * u + math.sqrt(1 - RHO) * e)


def broken_all_budgets(values: np.ndarray, margin: float, *, alpha: float = 0.05, n_resamples: int = 999,
                       seed: int = 0) -> bool:
    """A deliberately wrong procedure, for tests: test every budget on its own at level α, unordered, and
    certify the least-KV budget shown.  Returns whether it certified anything (a false claim when every
    budget is at the margin).

    Parameters
    ----------
    values : numpy.ndarray
        (n, K) per-document values, one column per budget.
    margin : float
        The non-inferiority margin δ.
    alpha : float, optional
        Level of each (uncorrected) test.
    n_resamples : int, optional
        Bootstrap resamples per test.
    seed : int, optional
        Seed of the resampling.

    Returns
    -------
    bool
        Whether any budget was shown inside the margin.

    Examples
    --------
    >>> values = np.zeros((20, 2)) + np.linspace(-0.01, 0.01, 20)[:, None]
    >>> broken_all_budgets(values, 0.05, n_resamples=99)
    True
    """
    return any(margin_test(values[:, j], "bootstrap-t", "noninferiority", margin, "larger", 1 - alpha,
                           n_resamples=n_resamples, seed=seed, min_docs=2, hodges_lehmann_effect=False).pvalue
               <= alpha for j in range(values.shape[1]))


def certified_index(values: np.ndarray, margin: float, *, alpha: float = 0.05, n_resamples: int = 999,
                     seed: int = 0) -> int:
    """``certify_budget(values, margin, ...).certified_index`` (larger worse, reference 0, no refusal), computed
    with every budget's bootstrap-t in one array: the same resamples (one draw of B x n document indices from
    ``numpy.random.default_rng(seed)``, as ``margin_test`` draws them for B <= 2000) and the same p-values, so the
    same decision (tests/test_divstats_certify.py checks that they agree), at a fraction of the cost.

    Parameters
    ----------
    values : numpy.ndarray
        (n, K) per-document values, one column per budget, most KV kept first.
    margin : float
        The non-inferiority margin δ.
    alpha : float, optional
        Familywise level.
    n_resamples : int, optional
        Bootstrap resamples B.
    seed : int, optional
        Seed of the resampling.

    Returns
    -------
    int
        Index of the last budget certified in the fixed-sequence order, or -1 when none is.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> values = sweep_values(rng, 50, np.array([0.0, 0.0, 0.2]), "symmetric")
    >>> certified_index(values, 0.05, n_resamples=199)
    1
    """
    n, _ = values.shape
    root_n = math.sqrt(n)
    mean = values.mean(axis=0)
    se = values.std(axis=0, ddof=1) / root_n
    t = (mean - margin) / se                                   # the "less" side of d - delta
    idx = np.random.default_rng(seed).integers(0, n, (n_resamples, n))
    # resampled means and SDs as matrix products with each resample's document counts (B x n)
    counts = np.bincount((np.arange(n_resamples)[:, None] * n + idx).ravel(),
                         minlength=n_resamples * n).reshape(n_resamples, n).astype(float)
    m_star = counts @ values / n                              # (B, K)
    var_star = np.maximum(counts @ (values ** 2) / n - m_star ** 2, 0.0) * n / (n - 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        ts = (m_star - mean) / (np.sqrt(var_star) / root_n)
    ts = np.nan_to_num(ts, nan=0.0, posinf=math.inf, neginf=-math.inf)
    p = (1 + np.count_nonzero(ts <= t, axis=0)) / (n_resamples + 1)
    shown = np.maximum.accumulate(p) <= alpha
    return int(np.argmin(shown)) - 1 if not shown.all() else len(p) - 1


def certify_calibration(sims: int = 1000, sizes: Sequence[int] = (50, 100),
                        populations: Sequence[str] = ("symmetric", "skewed"),
                        scenarios: Sequence[str] = ("all-at-margin", "two-inside"), *, n_budgets: int = 6,
                        alpha: float = 0.05, margin: float = MARGIN, n_resamples: int = 999, seed: int = 0,
                        power: bool = True) -> pd.DataFrame:
    """Familywise error (and power against the true crossing) of the certification, by simulation.

    Parameters
    ----------
    sims : int, optional
        Simulated studies per cell.
    sizes : sequence of int, optional
        Numbers of documents n.
    populations : sequence of str, optional
        ``"symmetric"`` and/or ``"skewed"``.
    scenarios : sequence of str, optional
        Scenarios from :data:`SCENARIOS`.
    n_budgets : int, optional
        Budgets K in the family.
    alpha : float, optional
        Familywise level.
    margin : float, optional
        The margin δ.
    n_resamples : int, optional
        Bootstrap resamples per study.
    seed : int, optional
        Base seed.
    power : bool, optional
        Also run the ``crossing`` scenario and report power.

    Returns
    -------
    pandas.DataFrame
        One row per (scenario, population, n): ``fwer`` (share certifying a budget whose
        true mean is at or past the margin), its Monte Carlo ``se``, ``bound`` = α + 2 SE
        at α, ``ok``; for the ``crossing`` scenario (added when ``power``) also ``power``
        (certified exactly the true last budget inside), ``mean_certified`` (budgets
        certified, on average) and ``true_last`` (how many are truly inside).

    Examples
    --------
    >>> t = certify_calibration(sims=3, sizes=(10,), populations=("symmetric",), scenarios=("all-at-margin",),
    ...                         n_budgets=3, n_resamples=49, power=False)
    >>> t[["scenario", "n", "sims"]].values.tolist()
    [['all-at-margin', 10, 3]]
    """
    rows = []
    scen = list(scenarios) + (["crossing"] if power and "crossing" not in scenarios else [])
    for scenario in scen:
        mu = scenario_means(scenario, n_budgets, margin)
        inside = int(np.argmax(mu >= margin)) if (mu >= margin).any() else n_budgets   # first null budget
        for population in populations:
            for n in sizes:
                rng = np.random.default_rng([seed, n, SCENARIOS.index(scenario),
                                             ("symmetric", "skewed").index(population)])
                start = time.perf_counter()
                certified = np.empty(sims, dtype=int)
                for s in range(sims):
                    certified[s] = certified_index(sweep_values(rng, n, mu, population), margin, alpha=alpha,
                                                   n_resamples=n_resamples, seed=s)
                fwer = float(np.mean(certified >= inside))
                se_bound = math.sqrt(alpha * (1 - alpha) / sims)
                row = {"scenario": scenario, "population": population, "n": n, "budgets": n_budgets,
                       "sims": sims, "fwer": fwer, "se": math.sqrt(max(fwer * (1 - fwer), 1e-12) / sims),
                       "bound": alpha + 2 * se_bound, "ok": fwer <= alpha + 2 * se_bound,
                       "seconds": round(time.perf_counter() - start, 1)}
                if scenario == "crossing":
                    row.update(power=float(np.mean(certified == inside - 1)),
                               mean_certified=float(np.mean(certified + 1)), true_last=inside)
                rows.append(row)
    return pd.DataFrame(rows)


def band_calibration(sims: int = 1000, sizes: Sequence[int] = (10, 20, 50, 100),
                     populations: Sequence[str] = ("symmetric", "skewed"), *, n_budgets: int = 6,
                     level: float = 0.95, n_resamples: int = 999, seed: int = 0) -> pd.DataFrame:
    """Simultaneous coverage of the max-|t| band (and of the pointwise intervals) over a family's budgets.

    Parameters
    ----------
    sims : int, optional
        Simulated studies per cell.
    sizes : sequence of int, optional
        Numbers of documents n.
    populations : sequence of str, optional
        ``"symmetric"`` and/or ``"skewed"``.
    n_budgets : int, optional
        Budgets K in the family.
    level : float, optional
        Nominal simultaneous coverage 1 − α.
    n_resamples : int, optional
        Bootstrap resamples per study.
    seed : int, optional
        Base seed.

    Returns
    -------
    pandas.DataFrame
        One row per (population, n): ``band`` (every true mean inside the band at once),
        ``pointwise_joint`` (every true mean inside its pointwise interval at once: the
        broken band), ``pointwise_each`` (the worst budget's own coverage), ``critical``
        (the mean critical value), ``bound`` = 1 − α − 2 SE and ``ok``.

    Examples
    --------
    >>> t = band_calibration(sims=3, sizes=(10,), populations=("skewed",), n_budgets=3, n_resamples=49)
    >>> t[["population", "n", "sims"]].values.tolist()
    [['skewed', 10, 3]]
    """
    rows = []
    mu = scenario_means("crossing", n_budgets)
    for population in populations:
        for n in sizes:
            rng = np.random.default_rng([seed, n, 7, ("symmetric", "skewed").index(population)])
            band_in = np.empty(sims, dtype=bool)
            point_in = np.empty((sims, n_budgets), dtype=bool)
            crit = np.empty(sims)
            start = time.perf_counter()
            for s in range(sims):
                b = simultaneous_band(sweep_values(rng, n, mu, population), level, n_resamples=n_resamples, seed=s,
                                      min_docs=2)
                band_in[s] = np.all((b.band_low <= mu) & (mu <= b.band_high))
                point_in[s] = (b.low <= mu) & (mu <= b.high)
                crit[s] = b.critical
            se_bound = math.sqrt(level * (1 - level) / sims)
            cov = float(band_in.mean())
            rows.append({"population": population, "n": n, "budgets": n_budgets, "sims": sims, "band": cov,
                         "pointwise_joint": float(point_in.all(axis=1).mean()),
                         "pointwise_each": float(point_in.mean(axis=0).min()), "critical": float(crit.mean()),
                         "bound": level - 2 * se_bound, "ok": cov >= level - 2 * se_bound,
                         "seconds": round(time.perf_counter() - start, 1)})
    return pd.DataFrame(rows)
